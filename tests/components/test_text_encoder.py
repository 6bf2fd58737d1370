"""TextEncoder against the released Diffusers text-encoder steps (t2va, fl2va, ref2va), layer-50 pre-norm read-out,
the presentation, the torchvision-free video preprocessing and the conditioning cache key."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import diffusers_oracle as oracle
from h3lab.components.references import AudioRef, ImageRef, Keyframe, VideoRef
from h3lab.components.text_encoder import PilVideoProcessor, TextEncoder, cache_key, sample_video_frames
from h3lab.components.text_encoder import video_smart_resize
from h3lab.errors import CheckpointError, ValidationError


def _comps(te: TextEncoder):
    return oracle.components(text_encoder=te.model, tokenizer=te.tokenizer, processor=te.processor)


def _image(rng, h=64, w=96) -> np.ndarray:
    return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def test_t2va_matches_released_step(text_encoder):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep

    prompt = "A red fox trots through fresh snow at dawn. Audio: soft footsteps, light wind."
    enc = text_encoder.encode(prompt)
    state = oracle.run_block(MiniMaxH3TextEncoderStep(), _comps(text_encoder), prompt=prompt)
    assert enc.embeds.shape == (1, len(enc.token_ids), 16) and enc.embeds.dtype == text_encoder.dtype
    assert torch.equal(enc.embeds, state.get("prompt_embeds"))
    assert torch.equal(enc.tags, state.get("text_token_tags")) and bool((enc.tags == 1).all())
    # No chat template, no special tokens: the ids are exactly the prompt's.
    assert list(enc.token_ids) == text_encoder.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_reads_decoder_layer_50_before_the_final_norm(text_encoder):
    prompt = "layer fifty"
    seen = {}
    layers = text_encoder.model.model.language_model.layers
    assert len(layers) == 51
    handle = layers[49].register_forward_hook(lambda m, a, out: seen.setdefault("out", out))  # the 50th layer
    try:
        enc = text_encoder.encode(prompt)
    finally:
        handle.remove()
    out = seen["out"][0] if isinstance(seen["out"], tuple) else seen["out"]
    assert torch.equal(enc.embeds, out)
    ids = torch.tensor([list(enc.token_ids)])
    final = text_encoder.model.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert not torch.allclose(enc.embeds.float(), final.last_hidden_state.float())  # post-norm output is not it


@pytest.mark.parametrize("roles", [("first",), ("last",), ("first", "last")])
def test_fl2va_matches_released_step(text_encoder, rng, roles):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3FL2VATextEncoderStep

    images = [_image(rng) for _ in roles]
    anchors = [Keyframe(im, role) for im, role in zip(images, roles)]
    enc = text_encoder.encode("the fox jumps", anchors=anchors)
    state = oracle.run_block(
        MiniMaxH3FL2VATextEncoderStep(), _comps(text_encoder), prompt="the fox jumps",
        keyframes=[Image.fromarray(im) for im in images],
    )
    assert torch.equal(enc.embeds, state.get("prompt_embeds"))
    assert torch.equal(enc.tags, state.get("text_token_tags"))
    text = text_encoder.tokenizer.decode(list(enc.token_ids))
    assert text.startswith("<Picture 1>: <|vision_start|><|image_pad|>")
    assert text.endswith("<|vision_end|>the fox jumps")
    assert text.count("<|vision_start|>") == len(roles) == text.count("<Picture ")
    # Vision-block rows (start, pads, end) are tagged video (0); labels and the prompt text (1).
    ids = torch.tensor(enc.token_ids)
    vision = torch.isin(ids, torch.tensor([text_encoder._special[k] for k in text_encoder._special]))
    assert torch.equal(enc.tags == 0, vision)


def test_ref2va_matches_released_step(text_encoder, rng):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    im1, im2 = _image(rng), _image(rng, 96, 64)
    video, silent = rng.integers(0, 256, (30, 64, 64, 3), np.uint8), rng.integers(0, 256, (13, 64, 96, 3), np.uint8)
    sound = (rng.standard_normal((2, 64000)) * 0.1).astype(np.float32)
    ours = [ImageRef(im1), AudioRef(sound), VideoRef(video, audio=sound), VideoRef(silent), ImageRef(im2)]
    theirs = [
        MiniMaxH3ImageReference(image=Image.fromarray(im1)),
        MiniMaxH3AudioReference(audio=torch.from_numpy(sound)),
        MiniMaxH3VideoReference(frames=video, fps=24.0, audio=torch.from_numpy(sound)),
        MiniMaxH3VideoReference(frames=silent, fps=24.0),
        MiniMaxH3ImageReference(image=Image.fromarray(im2)),
    ]
    enc = text_encoder.encode("use all of them", references=ours)
    # Without torchvision both sides run the processor's PilVideoProcessor for the two video references.
    assert isinstance(text_encoder.processor.video_processor, PilVideoProcessor)
    state = oracle.run_block(
        MiniMaxH3Ref2VATextEncoderStep(), _comps(text_encoder), prompt="use all of them", normalized_references=theirs
    )
    assert torch.equal(enc.embeds, state.get("prompt_embeds"))
    assert torch.equal(enc.tags, state.get("text_token_tags"))
    text = text_encoder.tokenizer.decode(list(enc.token_ids))
    labels = [s for s in text.replace("<|", "[").split("<")[1:]]
    assert [lab.split(">")[0] for lab in labels] == [
        "Picture 1", "Audio 1", "Audio 2", "Video 1", "0.2 seconds", "1.0 seconds", "Video 2", "0.2 seconds",
        "Picture 2",
    ]


def test_video_frame_sampling_matches_released(rng):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep

    for n, fps in [(48, 24.0), (13, 24.0), (30, 24.0), (100, 25.0), (77, 29.97), (124, 24.0)]:
        frames = np.arange(n, dtype=np.uint8)[:, None, None, None] * np.ones((1, 2, 2, 3), np.uint8)
        their_frames, their_times = MiniMaxH3Ref2VATextEncoderStep._sample_video_condition_frames(frames, fps, 2.0, 2)
        indices, times = sample_video_frames(n, fps, 2.0, 2)
        assert [int(f[0, 0, 0]) for f in their_frames] == indices and times == their_times
    assert [f"<{t:.1f} seconds>" for t in sample_video_frames(48)[1]] == ["<0.2 seconds>", "<1.2 seconds>"]
    with pytest.raises(ValidationError, match="reference video of 12 frames at 24 fps: .* at least 13 frames"):
        sample_video_frames(12)


def test_pil_video_processor_geometry_and_layout_match_transformers(text_encoder, rng):
    raw = oracle.transformers_video_module()  # transformers' own functions, loaded without torchvision
    for t, h, w in [(2, 64, 96), (4, 30, 200), (3, 500, 700), (6, 1080, 1920), (2, 20, 24)]:
        for lo, hi in [(32 * 32 * 2, 32 * 32 * 64), (128 * 32 * 32, 32 * 32 * 768)]:
            assert video_smart_resize(t, h, w, 2, 32, lo, hi) == raw.smart_resize(t, h, w, 2, 32, lo, hi)
    vp = text_encoder.processor.video_processor
    for t in (3, 4):
        video = rng.standard_normal((t, 3, 64, 96)).astype(np.float32)
        flat, grid = vp._patchify(video)
        theirs, gt, gh, gw = raw.Qwen3VLVideoProcessor.patchify(None, torch.from_numpy(video)[None], 16, 2, 2)
        assert torch.equal(torch.from_numpy(flat), theirs[0]) and grid == (gt, gh, gw)


def test_pil_video_processor_agrees_with_the_image_path(text_encoder, rng):
    """Two copies of one frame make exactly the image processor's patches for that frame when the video pixel
    budget is twice the image one (the video rule budgets t*h*w with t = 2): same resolved size, same PIL resize,
    same rescale/normalise, and the temporal copies are Qwen's image broadcast."""
    ip = text_encoder.processor.image_processor
    size = {"shortest_edge": 2 * ip.size["shortest_edge"], "longest_edge": 2 * ip.size["longest_edge"]}
    vp = PilVideoProcessor(ip, **{**vars(ip), "size": size})
    frame = _image(rng, 100, 140)  # not a multiple of 32: both sides resize
    image = ip(images=[Image.fromarray(frame)], return_tensors="pt")
    video = vp(videos=[np.stack([frame, frame])])
    assert torch.equal(video["video_grid_thw"], image["image_grid_thw"])
    assert torch.equal(video["pixel_values_videos"], image["pixel_values"].float())


def test_processor_configs_are_the_snapshots(component_snapshot, text_encoder):
    import json

    folder = component_snapshot / "processor"
    nested = folder / "processor_config.json"
    if nested.is_file() and "image_processor" in json.loads(nested.read_text()):
        saved = json.loads(nested.read_text())
        image_cfg, video_cfg = saved["image_processor"], saved["video_processor"]
    else:
        image_cfg = json.loads((folder / "preprocessor_config.json").read_text())
        video_cfg = json.loads((folder / "video_preprocessor_config.json").read_text())
    assert dict(text_encoder.processor.image_processor.size) == image_cfg["size"]
    assert text_encoder.processor.video_processor.size == video_cfg["size"]


def test_layer_and_input_errors(text_encoder, rng):
    with pytest.raises(CheckpointError, match=r"51 decoder layers: MiniMax-H3 reads hidden_states\[51\]"):
        TextEncoder(text_encoder.model, text_encoder.tokenizer, text_encoder.processor, layer=51)
    with pytest.raises(ValidationError, match="prompt of type list: must be a single string"):
        text_encoder.encode(["a", "b"])
    with pytest.raises(ValidationError, match="cannot be mixed"):
        text_encoder.encode("x", anchors=[Keyframe(_image(rng), "first")], references=[ImageRef(_image(rng))])


def test_dtype_argument_and_processor_backends(component_snapshot):
    from transformers.utils import is_torchvision_available

    from h3lab.components.text_encoder import load_processor

    te = TextEncoder.from_pretrained(component_snapshot, dtype=torch.float32)  # backend "auto"
    assert te.encode("fp32 please").embeds.dtype == torch.float32
    # "auto" is transformers' own processor where torchvision exists, the PIL assembly elsewhere.
    assert isinstance(te.processor.video_processor, PilVideoProcessor) != is_torchvision_available()
    with pytest.raises(ValidationError, match="processor backend 'torchvision': must be 'auto' or 'pil'"):
        load_processor(component_snapshot / "processor", backend="torchvision")
    with pytest.raises(CheckpointError, match="has no text_encoder/ folder"):
        TextEncoder.from_pretrained(component_snapshot / "processor")


def test_cache_key_covers_prompt_and_media(rng):
    im, im2 = _image(rng), _image(rng)
    wave = rng.standard_normal((2, 70000)).astype(np.float32)
    frames = rng.integers(0, 256, (20, 32, 32, 3), np.uint8)
    base = cache_key("fox", [Keyframe(im, "first")])
    assert base == cache_key("fox", [Keyframe(im.copy(), "first")]) and len(base) == 64
    changed = im.copy()
    changed[3, 5, 1] ^= 1
    keys = {
        base,
        cache_key("fox ", [Keyframe(im, "first")]),
        cache_key("fox", [Keyframe(changed, "first")]),
        cache_key("fox", [Keyframe(im, "last")]),
        cache_key("fox", [Keyframe(im, "first")], salt="other checkpoint"),
        cache_key("fox", references=[ImageRef(im), ImageRef(im2)]),
        cache_key("fox", references=[ImageRef(im2), ImageRef(im)]),
        cache_key("fox", references=[ImageRef(im), AudioRef(wave)]),
        cache_key("fox", references=[ImageRef(im), AudioRef(wave[:, :-1])]),
        cache_key("fox", references=[VideoRef(frames)]),
        cache_key("fox", references=[VideoRef(frames, audio=wave)]),
        cache_key("fox", references=[VideoRef(frames, fps=25.0)]),
        cache_key("fox", references=[VideoRef(frames[:, :, :16].copy())]),
        cache_key("fox"),
    }
    assert len(keys) == 14
