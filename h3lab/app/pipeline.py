"""The released MiniMax-H3 pipeline as plain functions: read a request's media, encode text and conditions, build the
layout, draw the noise in the released order, build the `RunSpec`, decode.

Contract
- No state of their own: components come in as objects (or a `load(name)` callable), caches as objects with
  `hit(key)` / `put(key, value)`. `h3lab.app.session.Session` calls them in order, holds the caches and the lock, books the
  timings and releases components between phases.
- `read_media(settings, pipeline_config) -> Media`: every input file of a request decoded and checked (kinds,
  streams, reference rules, audio durations) and normalised (`components.references`), nothing encoded.
- `encode_text(settings, media, cache, load) -> (TextEntry, cached)`: layer-50 embeddings and row tags of the prompt
  and the presented media, cached by the text encoder's `cache_key`.
- `encode_conditions(media, cache, load) -> (CondSet, cached)`: VAE latents of every anchor / reference in packed
  order, cached per item by content hash (`COND_SALT`); `cached` is None without conditioning.
- `build_layout(settings, media, text, cond, patch) -> PackedLayout`.
- `draw_inputs(settings, layout, schedule, text, cond, config, device) -> DenoiseInputs`: the noise on one CPU
  generator seeded with the request seed in the released order -- one draw per visual condition (augmentation), the
  video noise as a latent tensor, the audio noise in row layout -- then the sealed inputs on `device`.
- `build_spec(settings, model, layout, schedule, inputs, adapters=(), execution=None) -> RunSpec`: mode,
  variant, fingerprint, layout, ablation factors by name (checked here), reuse, the speed presets
  (`presets.preset_for`), adapters, and from the execution plan (`components.execution.ExecutionPlan`) where the
  DiT's blocks live (`RunSpec.residency`) and the device mesh's topology (`RunSpec.placement`).
- `final_latents(settings, inputs, video, audio, patch)`: the target rows after the loop as (C, T, h, w) video
  latents and (2A, C) audio rows, float32 CPU. `decode_video(vae, latents, settings)` -> uint8 frames at the output
  size (`upscale_frames` from the render canvas); `preview_frame(vae, latents)` -> the middle frame of the smallest
  decodable middle window.
- `settings_meta(settings)`: what a trajectory manifest records about the request beyond its run spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..schema.generation_settings import AUDIO_SAMPLE_RATE, FPS, REFERENCE_KINDS, GenerationSettings

COND_SALT = "h3lab-condition-latents"


@dataclass
class Media:
    """A request's conditioning media, decoded and normalised (numpy, CPU)."""

    keyframes: list  # [components.references.Keyframe] on the canvas, packed order
    references: list  # [ImageRef | VideoRef | AudioRef], normalised, request order


@dataclass
class TextEntry:
    embeds: torch.Tensor  # (1, L, text_dim) on the session device
    tags: torch.Tensor  # (L,) int64 CPU
    summary: str


@dataclass
class CondEntry:
    """One encoded keyframe or reference."""

    video: torch.Tensor | None  # (C, T, h, w) float32 CPU, normalised (keyframe, image or video reference)
    audio: torch.Tensor | None  # (2A, C) float32 CPU clean soundtrack rows (audio-bearing reference)
    summary: str


@dataclass
class CondSet:
    """The conditioning latents of one request, in packed order."""

    video: list  # [(C, T, h, w)]
    audio: list  # [(2A, C)]


# ------------------------------------------------------------------------------------------------ media
def read_media(s: GenerationSettings, pipeline_config: dict[str, int]) -> Media:
    """Every input file of a request decoded, checked and normalised (see the module docstring)."""
    from ..components import conditioning, media
    from ..components import references as refmod

    width, height = s.canvas
    keyframes = []
    if s.anchors:
        first = media.read_image(s.first) if s.first is not None else None
        last = media.read_image(s.last) if s.last is not None else None
        keyframes = conditioning.prepare_keyframes(first, last, height, width)
    refs = []
    for r in s.references:
        flag = "--" + REFERENCE_KINDS[r.kind]
        if r.kind == "image":
            refs.append(refmod.ImageRef(media.read_image(r.path), source=r.path))
            continue
        if r.kind == "audio":
            media.check_audio_file(r.path, flag)
            refs.append(refmod.AudioRef(media.read_audio(r.path), AUDIO_SAMPLE_RATE, source=r.path))
            continue
        # Kind and completeness first, each error naming the file that is wrong: an image given as a video, a
        # truncated file, a missing soundtrack, a replacement audio file without sound.
        info = media.check_video(r.path, flag, needs_audio=r.kind == "video")
        if r.kind == "video-audio":
            media.check_audio_file(r.audio_path, f"{flag} audio")
        # Decode only what the 24 fps resampling and the truncation to num_frames can use.
        bound = math.ceil(s.num_frames * info.video.fps / FPS) + 2
        frames, fps = media.read_video(r.path, max_frames=bound)
        audio = media.read_audio(r.audio_path) if r.audio_path is not None else None
        refs.append(refmod.VideoRef(frames, fps, audio, AUDIO_SAMPLE_RATE, source=r.path,
                                    audio_source=r.audio or ""))
    if refs:
        cfg = pipeline_config
        refs = refmod.normalize_references(
            refs,
            s.num_frames,
            image_short_edge=cfg["reference_image_short_edge"],
            canvas_short_edge=cfg["canvas_short_edge"],
            canvas_max_pixels=cfg["canvas_max_pixels"],
        )
    return Media(keyframes, refs)


# ------------------------------------------------------------------------------------------------ encoders
def encode_text(s: GenerationSettings, media: Media, cache, load: Callable[[str], Any]) -> tuple[TextEntry, bool]:
    """Prompt (+ presented keyframes / references) -> layer-50 embeddings and row tags, cached by content."""
    from ..components.text_encoder import cache_key

    key = cache_key(s.prompt, media.keyframes, media.references)
    hit = cache.hit(key)
    if hit is not None:
        return hit, True
    enc = load("text_encoder").encode(s.prompt, media.keyframes, media.references)
    summary = f"{len(enc.token_ids)} rows: {s.prompt[:40]!r}" + (
        f" + {len(media.keyframes)} anchors" if media.keyframes else ""
    ) + (f" + {len(media.references)} refs" if media.references else "")
    entry = TextEntry(enc.embeds.detach(), enc.tags.cpu(), summary)
    cache.put(key, entry)
    return entry, False


def encode_conditions(media: Media, cache, load: Callable[[str], Any]) -> tuple[CondSet, bool | None]:
    """VAE encodes of anchors / references, cached per item by content (the normalised media bytes, so the
    canvas and the truncation are part of the key): adding a reference encodes only the new one. Returns
    (latents in packed order, cached) with cached None when the request has no conditioning, True when every
    item came from the cache."""
    from ..components import conditioning
    from ..components.text_encoder import cache_key

    items = [("keyframe", k) for k in media.keyframes] + [("reference", r) for r in media.references]
    if not items:
        return CondSet([], []), None
    video, audio, all_cached = [], [], True
    for kind, item in items:
        key = (
            cache_key("", [item], (), salt=COND_SALT) if kind == "keyframe"
            else cache_key("", (), [item], salt=COND_SALT)
        )
        entry = cache.hit(key)
        if entry is None:
            all_cached = False
            if kind == "keyframe":
                v = conditioning.encode_keyframes(load("vae"), [item])[0]
                entry = CondEntry(v, None, f"{item.anchor} keyframe -> {tuple(v.shape)}")
            else:
                vae = load("vae") if item.kind != "audio" else None
                audio_vae = load("audio_vae") if item.has_audio else None
                lat = conditioning.encode_references(vae, audio_vae, [item])
                v = lat.video[0] if lat.video else None
                a = lat.audio[0] if lat.audio else None
                shapes = " + ".join(str(tuple(x.shape)) for x in (v, a) if x is not None)
                entry = CondEntry(v, a, f"{item.kind} reference {item.source} -> {shapes}")
            cache.put(key, entry)
        if entry.video is not None:
            video.append(entry.video)
        if entry.audio is not None:
            audio.append(entry.audio)
    return CondSet(video, audio), all_cached


# ------------------------------------------------------------------------------------------------ the run
def build_layout(s: GenerationSettings, media: Media, text: TextEntry, cond: CondSet, patch):
    from ..run import layout as L

    refs = []
    video_iter, audio_iter = iter(cond.video), iter(cond.audio)
    for ref in media.references:
        if ref.kind == "image":
            lat = next(video_iter)
            refs.append(L.Reference.image(lat.shape[2], lat.shape[3]))
        elif ref.kind == "video":
            lat = next(video_iter)
            sound = next(audio_iter).shape[0] // 2 if ref.has_audio else 0
            refs.append(L.Reference.video(lat.shape[1], lat.shape[2], lat.shape[3], sound))
        else:
            refs.append(L.Reference.audio(next(audio_iter).shape[0] // 2))
    return L.build_layout(
        s.task,
        text.tags,
        s.num_latent_frames,
        s.latent_height,
        s.latent_width,
        s.num_audio_latents,
        anchors=tuple(k.anchor for k in media.keyframes),
        references=refs,
        patch_size=patch,
    )


def draw_inputs(s: GenerationSettings, layout, schedule, text: TextEntry, cond: CondSet, cfg, device):
    """The request's noise in the released order and its sealed `DenoiseInputs` on `device`."""
    from ..components import conditioning
    from ..components.video_vae import patchify
    from ..run import DenoiseInputs
    from ..run.sampler import draw_noise

    patch = tuple(cfg.patch_size)
    # Draw order on the one CPU generator: conditions, target video latents, target audio rows.
    generator = torch.Generator().manual_seed(s.seed)
    noised = conditioning.augment_conditions(cond.video, generator)
    video_noise = draw_noise((1, cfg.in_channels, s.num_latent_frames, s.latent_height, s.latent_width), generator)
    audio_noise = draw_noise((2 * s.num_audio_latents, cfg.audio_in_channels), generator)
    video_rows = torch.cat([patchify(c, patch) for c in noised] + [patchify(video_noise[0], patch)])
    audio_rows = torch.cat([a.to(torch.float32) for a in cond.audio] + [audio_noise])
    return DenoiseInputs.from_layout(
        layout, schedule, text=text.embeds.to(device), video=video_rows, audio=audio_rows,
        seeds={"request": s.seed, "condition_encode": 42},
    ).to(device)


def build_spec(s: GenerationSettings, model, layout, schedule, inputs, adapters=(), execution=None):
    """The request's `RunSpec`: its sealed inputs, schedule and layout, its mode, the transformer partition and
    its fingerprint, the ablation factors by name (`h3lab.research.ablation` applies them inside the loop, the same way
    each time the spec runs), the reuse interval and the LoRA adapters (`Session.load_lora` entries, applied by the
    spec's `adapters` field), and the execution plan's placement and residency (`components.execution.ExecutionPlan
    .spec_fields()`, the run record; None: one process, resident). Factor names are checked here (known factors, H1
    alone, no two that change one thing)."""
    from ..hashing import model_fingerprint
    from ..presets import preset_for
    from ..run import RunSpec
    from ..schema import SETTINGS

    fields = dict(mode=s.mode, variant=variant_for(s.task), fingerprint=model_fingerprint(model), layout=layout,
                  factors=tuple(s.ablations), reuse=s.reuse, preset=preset_for(s, model, layout),
                  adapters=list(adapters), **(execution.spec_fields() if execution is not None else {}))
    declared = SETTINGS.spec_fields(s)  # what settings declared in h3lab.schema add to the run (`Setting.spec`)
    taken = sorted(set(declared) & set(fields))
    if taken:
        raise ValueError(f"a declared setting sets RunSpec {taken[0]!r}, which build_spec sets itself")
    return RunSpec(inputs, schedule, **fields, **declared)


def variant_for(task: str) -> str:
    """The DiT partition a task runs on: `transformer_ref` for ref2va, `transformer` for t2va / fl2va."""
    return "transformer_ref" if task == "ref2va" else "transformer"


def final_latents(s: GenerationSettings, inputs, video: torch.Tensor, audio: torch.Tensor, patch):
    """The target rows after the loop: video latents (C, T, h, w) and audio rows (2A, C), float32 CPU."""
    from ..components.video_vae import unpatchify

    final_video = video[0, inputs.num_condition_video_rows:].float().cpu()
    latents = unpatchify(final_video, s.num_latent_frames, s.latent_height, s.latent_width, patch)
    audio_rows = audio[0, inputs.num_condition_audio_rows:].float().cpu()
    return latents, audio_rows


# ------------------------------------------------------------------------------------------------ decode
def decode_video(vae, latents: torch.Tensor, s: GenerationSettings) -> np.ndarray:
    """Video latents -> uint8 (F, H, W, 3) at the output size (upscaled from the render canvas when one is set)."""
    frames = vae.decode(latents)
    if frames.shape[0] != s.num_frames:
        raise RuntimeError(f"video VAE decoded {frames.shape[0]} frames for {s.num_frames} requested")
    if s.render_width is not None:
        frames = upscale_frames(frames, s.width, s.height)
    return frames


def upscale_frames(frames: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 (F, h, w, 3) -> uint8 (F, height, width, 3), bicubic (torch, align_corners=False), clamped, rounded."""
    if frames.shape[1:3] == (height, width):
        return frames
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).to(torch.float32)
    y = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", align_corners=False)
    return y.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def preview_frame(vae, latents: torch.Tensor) -> np.ndarray:
    """The preview of a latent clip (C, T, h, w): the smallest window of middle latent frames the video VAE can
    decode (`VideoVAE.min_decode_frames`, 3 as released: its temporal chunking yields nothing for fewer),
    decoded, and the middle pixel frame of that window: uint8 (H, W, 3) at the render canvas. It is the
    cheapest honest decode of the clip's middle; it is close to, not identical with, the middle frame of a full
    decode (the decoder's temporal windows see less context)."""
    n = min(max(2, vae.min_decode_frames), latents.shape[1])
    start = max(0, min(latents.shape[1] // 2 - n // 2, latents.shape[1] - n))
    frames = vae.decode(latents[:, start : start + n])
    return frames[frames.shape[0] // 2]


def settings_meta(s: GenerationSettings) -> dict[str, Any]:
    """What a trajectory manifest records about the request beyond its run spec (which holds the mode, the reuse
    interval and the ablation factors): geometry, seed, media kinds. No file paths: they differ between machines."""
    return {
        "task": s.task, "seed": s.seed, "width": s.width, "height": s.height, "canvas": list(s.canvas),
        "num_frames": s.num_frames, "steps": s.steps, "references": [r.kind for r in s.references],
        "anchors": [name for name, _ in s.anchors],
    }
