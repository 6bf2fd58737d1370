"""h3lab.run.layout against Diffusers' layout builders (t2va/fl2va `build_packed_sequence`, ref2va
`build_ref2va_packed_sequence`) and timestep block, bit for bit; the row-identity table; legal and illegal
permutations, checked on the tiny Diffusers transformer too; hashing, JSON round trip and validation errors."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3Ref2VAPrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.references import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from diffusers.modular_pipelines.modular_pipeline import PipelineState

from h3lab.run import layout as layout_module
from h3lab.errors import H3Error
from h3lab.run.layout import (
    CONDITION_VIDEO_T,
    PERMUTABLE,
    LayoutError,
    PackedLayout,
    Reference,
    build_layout,
)
from h3lab.run.sampler import CONDITION_T, DualSchedule

PATCH = (1, 2, 2)
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
ANCHOR_SETS = [(), ("first",), ("last",), ("first", "last")]
# (latent frames, latent height, latent width, audio latents per channel): square, non-square with odd patch grids
# (3x5, 5x3), the released 16:9 768p at 124 frames (37 x 48 x 84, 207), frame counts around the ulp divergence of
# the two span sums (16, 23) and the longest video (102 latent frames at 345 frames).
GEOMETRIES = [(1, 2, 2, 1), (2, 4, 4, 3), (7, 6, 10, 12), (16, 10, 6, 27), (23, 8, 12, 40), (37, 48, 84, 207),
              (102, 4, 6, 575)]


def _tags(pattern: str, length: int, generator: torch.Generator) -> torch.Tensor:
    """Text tag patterns: all text; random text/vision rows; text with one vision block in the middle."""
    if pattern == "text":
        return torch.full((length,), TEXT_TAG)
    if pattern == "random":
        return torch.randint(0, 2, (length,), generator=generator)
    tags = torch.full((length,), TEXT_TAG)
    tags[length // 3 : 2 * length // 3] = VIDEO_TAG
    return tags


def _mine(layout: PackedLayout):
    return (layout.position_ids, layout.token_tags, layout.video_indices, layout.audio_indices,
            layout.text_indices, layout.num_condition_video_rows, layout.num_condition_audio_rows)


def _assert_same(ref, mine, what):
    assert len(ref) == len(mine) == 7
    for name, a, b in zip(("position_ids", "token_tags", "video", "audio", "text", "ncv", "nca"), ref, mine):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), (what, name)
        else:
            assert a == b, (what, name, a, b)


def test_span_sums_really_differ():
    # The "last" anchor (numpy pairwise) and the ref2va video span (sequential) sum the same series in different
    # orders; the sweeps below include frame counts where the two differ, so mixing them up would fail.
    spans = layout_module._frame_spans(16)
    assert float(np.asarray(spans).sum()) != layout_module._video_span(16)


@pytest.mark.parametrize("anchors", ANCHOR_SETS, ids=["t2va", "first", "last", "first+last"])
def test_t2va_fl2va_bit_equal_to_diffusers(anchors):
    g = torch.Generator().manual_seed(11)
    task = "fl2va" if anchors else "t2va"
    for geometry in GEOMETRIES:
        for pattern, length in (("text", 1), ("random", 7), ("vision", 40), ("random", 300)):
            tags = _tags(pattern, length, g)
            ref = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                tags, *geometry, PATCH, 2, AUDIO_TAG, VIDEO_TAG, anchors
            )
            layout = build_layout(task, tags, *geometry, anchors=anchors)
            _assert_same(ref, _mine(layout), (task, anchors, geometry, pattern, length))


def _diffusers_refs(refs: list[Reference]):
    """The Diffusers reference objects and encoded-latent stand-ins the ref2va builder reads its geometry from."""
    objects, video_latents, audio_rows = [], [], []
    pixels = np.zeros((2, 2, 3), dtype=np.uint8)
    for r in refs:
        if r.kind == "image":
            objects.append(MiniMaxH3ImageReference(image=pixels))
            video_latents.append(torch.empty(1, 1, 1, r.latent_height, r.latent_width))
        elif r.kind == "audio":
            objects.append(MiniMaxH3AudioReference(audio=torch.zeros(2, 4)))
            audio_rows.append(torch.empty(2 * r.audio_latents, 1))
        else:
            soundtrack = torch.zeros(2, 4) if r.has_audio else None
            objects.append(MiniMaxH3VideoReference(frames=pixels[None], audio=soundtrack))
            video_latents.append(torch.empty(1, 1, r.latent_frames, r.latent_height, r.latent_width))
            if r.has_audio:
                audio_rows.append(torch.empty(2 * r.audio_latents, 1))
    return objects, video_latents, audio_rows


REFERENCE_MIXES = [
    [Reference.image(4, 4)],
    [Reference.image(6, 10), Reference.audio(30)],
    [Reference.audio(3), Reference.image(10, 6)],
    [Reference.video(7, 4, 4)],
    [Reference.video(7, 4, 6, soundtrack_latents=12)],  # soundtrack shorter than the video span (5/3*25)
    [Reference.video(16, 6, 4, soundtrack_latents=100)],  # soundtrack longer: the clock advances by A
    [Reference.video(37, 8, 14, soundtrack_latents=41)],  # long video: the sequential span sum
    [Reference.audio(9), Reference.image(4, 8), Reference.video(23, 4, 4, soundtrack_latents=5),
     Reference.image(2, 2), Reference.audio(1), Reference.video(2, 2, 6)],
    [Reference.image(128, 228)],  # a 16:9 image reference at the 2048 short edge: 7,296 rows
]


@pytest.mark.parametrize("refs", REFERENCE_MIXES, ids=[f"mix{i}" for i in range(len(REFERENCE_MIXES))])
def test_ref2va_bit_equal_to_diffusers(refs):
    g = torch.Generator().manual_seed(12)
    objects, video_latents, audio_rows = _diffusers_refs(refs)
    for geometry in ((2, 4, 4, 3), (7, 6, 10, 12), (37, 48, 84, 207)):
        for pattern, length in (("text", 3), ("vision", 25)):
            tags = _tags(pattern, length, g)
            ref = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
                tags, objects, video_latents, audio_rows, *geometry, PATCH, 2, AUDIO_TAG, VIDEO_TAG
            )
            layout = build_layout("ref2va", tags, *geometry, references=refs)
            _assert_same(ref, _mine(layout), (refs, geometry, pattern))


def _small_layouts():
    g = torch.Generator().manual_seed(13)
    tags = _tags("vision", 9, g)
    return [
        build_layout("t2va", tags, 7, 6, 10, 12),
        build_layout("fl2va", tags, 7, 6, 10, 12, anchors=("first", "last")),
        build_layout("fl2va", tags, 3, 4, 4, 5, anchors="last"),
        build_layout("ref2va", tags, 7, 6, 10, 12, references=REFERENCE_MIXES[7]),
    ]


def test_row_timesteps_bit_equal_to_diffusers():
    values = [0.0, 0.25, 0.8, 0.998, 0.999, 0.9995, 1.0]  # around the max(t, 0.999) of the conditioning rows
    for layout in _small_layouts():
        for video_t in values:
            for audio_t in values:
                ref = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                    layout.video_indices, layout.audio_indices, layout.num_condition_video_rows,
                    layout.num_condition_audio_rows, layout.num_text_tokens, video_t, audio_t,
                    max(video_t, 0.999), 1.0,
                )
                mine = layout.row_timesteps(torch.tensor(video_t), audio_t)
                for a, b in zip(ref, mine):
                    assert a.dtype == b.dtype and torch.equal(a, b), (layout, video_t, audio_t)
    assert CONDITION_VIDEO_T == CONDITION_T == 0.999


def test_timestep_plan_matches_the_set_timesteps_block():
    """The whole per-step plan, from Diffusers' block on its two real schedulers, vs layout + DualSchedule."""
    dual = DualSchedule.build(12)
    for layout in _small_layouts():
        components = types.SimpleNamespace(
            _execution_device=torch.device("cpu"),
            scheduler=MiniMaxH3Scheduler(shift=12.0),
            audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
            keyframe_noise_aug=0.999,
        )
        state = PipelineState()
        for key, value in dict(
            num_inference_steps=12,
            video_indices=layout.video_indices,
            audio_indices=layout.audio_indices,
            text_indices=layout.text_indices,
            num_condition_video_rows=layout.num_condition_video_rows,
            num_condition_audio_rows=layout.num_condition_audio_rows,
        ).items():
            state.set(key, value)
        MiniMaxH3SetTimestepsStep()(components, state)
        ref_plan = state.get("row_timestep_plan")
        plan = layout.timestep_plan(dual.video.timesteps, dual.audio.timesteps)
        assert len(plan) == len(ref_plan) == 11
        for (ua, ia), (ub, ib) in zip(ref_plan, plan):
            assert torch.equal(ua, ub) and torch.equal(ia, ib)


def test_row_table_contents():
    g = torch.Generator().manual_seed(14)
    tags = _tags("vision", 6, g)
    layout = build_layout("fl2va", tags, 3, 4, 6, 5, anchors=("first", "last"))
    table = layout.row_table(video_t=0.3, audio_t=0.45)
    json.dumps(table)  # machine-readable as is
    assert [e["row"] for e in table] == list(range(layout.sequence_length)) == [e["canonical_row"] for e in table]
    by_block = {}
    for e in table:
        by_block.setdefault(e["block"], []).append(e)
    assert list(by_block) == ["text", "anchor0:first", "anchor1:last", "target:audio", "target:video"]
    assert [len(v) for v in by_block.values()] == [6, 6, 6, 10, 18]
    unique, indices = layout.row_timesteps(0.3, 0.45)
    for e in table:
        assert e["tag"] == int(layout.token_tags[e["row"]])
        assert [e["t"], e["h"], e["w"]] == layout.position_ids[e["row"]].tolist()
        assert e["timestep_index"] == int(indices[e["row"]])
        stream_indices = getattr(layout, f"{e['stream']}_indices")
        assert int(stream_indices[e["source"]]) == e["row"]
        expected_t = {"video_t": 0.3, "audio_t": 0.45, "cond_video_t": 0.999, "ref_audio_t": 1.0}[e["time_kind"]]
        assert float(unique[e["timestep_index"]]) == float(torch.tensor(expected_t, dtype=torch.float32))
    text, anchors = by_block["text"], by_block["anchor0:first"]
    audio, video = by_block["target:audio"], by_block["target:video"]
    assert {e["role"] for e in text} == {"text"} and [e["tag"] for e in text] == tags.tolist()
    assert all(e["selection"] is None and e["time_kind"] == "video_t" for e in text)
    anchor_kinds = {(e["role"], e["stream"], e["tag"], e["time_kind"]) for e in anchors}
    assert anchor_kinds == {("cond", "video", 0, "cond_video_t")}
    assert [e["selection"] for e in anchors + by_block["anchor1:last"] + video] == list(range(30))
    assert [(e["channel"], e["latent"]) for e in audio] == [(c, a) for c in range(2) for a in range(5)]
    assert [e["selection"] for e in audio] == list(range(10))
    assert [(e["frame"], e["y"], e["x"]) for e in video] == [(f, y, x) for f in range(3) for y in range(2)
                                                              for x in range(3)]
    # Positions the row table reports follow the documented rules: frame times 5/3 * (1, 4, 4) cumulated.
    assert [video[i]["t"] for i in (0, 6, 12)] == [6.0, 6.0 + 5 / 3, 6.0 + 5 / 3 + 20 / 3]
    assert by_block["anchor1:last"][0]["t"] == 6.0 + (5 / 3 + 20 / 3 + 20 / 3) - 5 / 3
    assert {e["w"] for e in audio if e["channel"] == 0} == {video[0]["w"]}
    assert {e["w"] for e in audio if e["channel"] == 1} == {video[2]["w"]}
    assert all(e["h"] == 0.0 for e in audio)
    # ref2va: a soundtrack sits on its video's own width axis, standalone audio on the target's.
    refs = [Reference.video(2, 4, 8, soundtrack_latents=3), Reference.audio(2)]
    table = build_layout("ref2va", tags, 2, 4, 4, 3, references=refs).row_table()
    rows = {}
    for e in table:
        rows.setdefault(e["block"], []).append(e)
    assert list(rows) == ["text", "ref0:soundtrack", "ref0:video", "ref1:audio", "target:audio", "target:video"]
    assert {e["role"] for b in ("ref0:soundtrack", "ref0:video", "ref1:audio") for e in rows[b]} == {"ref"}
    assert {e["w"] for e in rows["ref0:soundtrack"]} == {rows["ref0:video"][0]["w"], rows["ref0:video"][3]["w"]}
    assert {e["w"] for e in rows["ref1:audio"]} == {rows["target:video"][0]["w"], rows["target:video"][1]["w"]}
    assert {e["time_kind"] for b in ("ref0:soundtrack", "ref1:audio") for e in rows[b]} == {"ref_audio_t"}
    assert "timestep_index" not in table[0]


def _random_perm(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def test_legal_permutation_is_consistent_and_invertible():
    for seed, layout in enumerate(_small_layouts()):
        perm = _random_perm(layout.sequence_length, seed)
        permuted = layout.permute(perm)
        assert permuted.is_consistent and not permuted.is_canonical and permuted != layout
        # Every per-row field moved with its row; every stream kept its row order.
        assert torch.equal(permuted.position_ids, layout.position_ids[perm])
        assert torch.equal(permuted.token_tags, layout.token_tags[perm])
        for name in ("video_indices", "audio_indices", "text_indices"):
            old, new = getattr(layout, name), getattr(permuted, name)
            assert torch.equal(perm[new], old)
            assert torch.equal(permuted.position_ids[new], layout.position_ids[old])
        for t in ((0.3, 0.45), (0.0, 0.0), (0.9995, 0.5)):
            u0, i0 = layout.row_timesteps(*t)
            u1, i1 = permuted.row_timesteps(*t)
            assert torch.equal(u0, u1) and torch.equal(i1, i0[perm])
        before, after = layout.row_table(0.3, 0.45), permuted.row_table(0.3, 0.45)
        for i, e in enumerate(after):
            assert {**e, "row": perm[i].item()} == before[perm[i]]
        # canonical_order maps packed-row tensors back and restores the layout exactly.
        order = permuted.canonical_order()
        assert torch.equal(permuted.position_ids[order], layout.position_ids)
        restored = permuted.permute(order)
        assert restored == layout and restored.sha256() == layout.sha256() and restored.is_canonical
        assert torch.equal(layout.canonical_order(), torch.arange(layout.sequence_length))


def test_illegal_permutations_leave_exactly_one_tensor_behind():
    layout = _small_layouts()[3]
    perm = _random_perm(layout.sequence_length, 5)
    legal = layout.permute(perm)
    field_of = {"timestep": "row_time_kinds"}
    for name in PERMUTABLE:
        illegal = layout.permute(perm, leave_behind=name)
        assert illegal.left_behind == (name,) and not illegal.is_consistent
        left = field_of.get(name, name)
        assert torch.equal(getattr(illegal, left), getattr(layout, left))
        assert not torch.equal(getattr(illegal, left), getattr(legal, left))
        for other in ("position_ids", "token_tags", "row_time_kinds", "video_indices", "audio_indices",
                      "text_indices"):
            if other != left:
                assert torch.equal(getattr(illegal, other), getattr(legal, other))
        assert illegal.sha256() != legal.sha256()
        assert PackedLayout.from_json(illegal.to_json()) == illegal
        if name == "timestep":
            assert not torch.equal(illegal.row_timesteps(0.3, 0.45)[1], legal.row_timesteps(0.3, 0.45)[1])
    two = layout.permute(perm, leave_behind=["token_tags", "position_ids"])
    assert two.left_behind == ("position_ids", "token_tags")


def _tiny_transformer(dtype):
    """The tiny Diffusers transformer of facts §8 (video rows 4*1*2*2 = 16 wide, audio 8, text 16), all weights random
    (AdaLN and heads would otherwise start at zero and hide row-metadata errors)."""
    torch.manual_seed(15)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=2, attention_head_dim=12, hidden_size=16, num_layers=2, num_refiner_layers=1, ffn_dim=32,
        in_channels=4, audio_in_channels=8, text_dim=16, freq_dim=8, time_embed_hidden_dim=16, time_embed_dim=8,
        rope_freq_dim=2,
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.to(dtype)


def test_permutations_on_the_diffusers_transformer():
    """H-C3 / H1 on the real reference model: a legal permutation changes the outputs only by float32 reordering
    (at most 2x the float32 error of the canonical run against a float64 run), each illegal one by far more."""
    layout = build_layout("fl2va", torch.tensor([1, 1, 0, 0, 1, 1]), 3, 4, 6, 5, anchors=("first", "last"))
    g = torch.Generator().manual_seed(16)
    video = torch.randn(1, layout.video_indices.numel(), 16, generator=g)
    audio = torch.randn(1, layout.audio_indices.numel(), 8, generator=g)
    text = torch.randn(1, layout.num_text_tokens, 16, generator=g)
    model32, model64 = _tiny_transformer(torch.float32), _tiny_transformer(torch.float64)

    def run(model, lay, dtype):
        unique, indices = lay.row_timesteps(0.3, 0.45)
        with torch.no_grad():
            out = model(video.to(dtype), audio.to(dtype), text.to(dtype), unique.to(dtype), indices,
                        **lay.model_inputs(), return_dict=False)
        return torch.cat([o.double().flatten() for o in out])

    truth = run(model64, layout, torch.float64)
    base_err = (run(model32, layout, torch.float32) - truth).abs().max()
    assert base_err > 0
    perm = _random_perm(layout.sequence_length, 17)
    legal_err = (run(model32, layout.permute(perm), torch.float32) - truth).abs().max()
    assert legal_err <= 2 * base_err
    for name in PERMUTABLE:
        illegal_err = (run(model32, layout.permute(perm, leave_behind=name), torch.float32) - truth).abs().max()
        assert illegal_err > 2 * base_err, name


def test_hash_and_json_round_trip():
    layouts = _small_layouts()
    for layout in layouts:
        text = layout.to_json()
        back = PackedLayout.from_json(text)
        assert back == layout and back.sha256() == layout.sha256() and back.blocks == layout.blocks
        assert back.references == layout.references and back.position_ids.dtype == torch.float64
    assert len({lay.sha256() for lay in layouts}) == len(layouts)
    # Deterministic: an identical request hashes the same (H-C7); one changed tag does not.
    g = torch.Generator().manual_seed(13)
    tags = _tags("vision", 9, g)
    assert build_layout("t2va", tags, 7, 6, 10, 12).sha256() == layouts[0].sha256()
    flipped = tags.clone()
    flipped[0] = 1 - flipped[0]
    assert build_layout("t2va", flipped, 7, 6, 10, 12).sha256() != layouts[0].sha256()
    # Tampering is caught by the recorded hash; a foreign file by its format.
    data = json.loads(layouts[1].to_json())
    data["tensors"]["position_ids"][20][0] += 1e-9
    with pytest.raises(LayoutError, match="sha256"):
        PackedLayout.from_dict(data)
    with pytest.raises(LayoutError, match="format"):
        PackedLayout.from_json(json.dumps({"format": "something/1"}))
    with pytest.raises(LayoutError, match="not valid JSON"):
        PackedLayout.from_json("{")


def test_geometry_and_model_inputs():
    layout = build_layout("ref2va", torch.ones(4, dtype=torch.long), 7, 6, 10, 12, references=REFERENCE_MIXES[1])
    geometry = layout.geometry()
    assert geometry["grid"] == [3, 5] and layout.rows_per_frame == 15
    assert geometry["sequence_length"] == 4 + 15 + 60 + 24 + 105
    assert (layout.num_condition_video_rows, layout.num_condition_audio_rows) == (15, 60)
    assert (layout.num_target_video_rows, layout.num_target_audio_rows) == (105, 24)
    inputs = layout.model_inputs()
    assert set(inputs) == {"position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"}
    inputs["token_tags"][0] = 2  # a copy: the layout itself is untouched
    assert int(layout.token_tags[0]) == 1


TAGS = torch.tensor([1, 0, 1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(task="i2v"), "task='i2v'"),
        (dict(anchors=("first",)), "only fl2va takes keyframe anchors, not t2va"),
        (dict(task="ref2va", anchors=("last",), references=[Reference.image(2, 2)]), "not ref2va"),
        (dict(task="fl2va"), "anchors=\\(\\): fl2va needs one of"),
        (dict(task="fl2va", anchors=("last", "first")), "anchors=\\('last', 'first'\\)"),
        (dict(task="fl2va", anchors=("middle",)), "'middle'"),
        (dict(task="fl2va", anchors=("first",), references=[Reference.image(2, 2)]), "not fl2va"),
        (dict(references=[Reference.audio(3)]), "only ref2va takes references, not t2va"),
        (dict(task="ref2va"), "ref2va needs at least one reference"),
        (dict(task="ref2va", references=["image"]), "must be an h3lab.run.layout.Reference"),
        (dict(task="ref2va", references=[Reference.image(3, 4)]), "image reference latent_height=3"),
        (dict(num_latent_frames=0), "num_latent_frames=0"),
        (dict(num_latent_frames=2.0), "num_latent_frames=2.0"),
        (dict(latent_height=-4), "target latent_height=-4"),
        (dict(latent_width=5), "target latent_width=5: must be a multiple of the patch 2"),
        (dict(num_audio_latents=0), "num_audio_latents=0"),
        (dict(text_token_tags=torch.tensor([1, 2, 1])), "text_token_tags value 2"),
        (dict(text_token_tags=torch.tensor([1.0, 0.0])), "dtype torch.float32"),
        (dict(text_token_tags=torch.ones(2, 3, dtype=torch.long)), "shape \\(2, 3\\)"),
        (dict(text_token_tags=[]), "at least one text row"),
        (dict(patch_size=(2, 2, 2)), "patch_size=\\(2, 2, 2\\)"),
    ],
)
def test_build_errors(kwargs, match):
    args = dict(task="t2va", text_token_tags=TAGS, num_latent_frames=2, latent_height=4, latent_width=4,
                num_audio_latents=3)
    args.update(kwargs)
    with pytest.raises(LayoutError, match=match) as info:
        build_layout(**args)
    assert isinstance(info.value, H3Error) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Reference("sketch"), "reference kind 'sketch'"),
        (lambda: Reference.audio(0), "audio_latents=0"),
        (lambda: Reference("audio", 1, 2, 2, 3), "has no video grid"),
        (lambda: Reference("image", 2, 4, 4), "an image is one latent frame"),
        (lambda: Reference("image", 1, 4, 4, 3), "an image has no audio"),
        (lambda: Reference.video(0, 4, 4), "latent_frames=0"),
        (lambda: Reference.video(3, 4, 0), "latent_width=0"),
        (lambda: Reference.video(3, 4, 4, soundtrack_latents=-1), "audio_latents=-1"),
    ],
)
def test_reference_errors(make, match):
    with pytest.raises(LayoutError, match=match):
        make()


def test_permute_errors():
    layout = build_layout("t2va", TAGS, 2, 4, 4, 3)
    n = layout.sequence_length
    with pytest.raises(LayoutError, match=f"must be \\({n},\\) integers"):
        layout.permute(torch.arange(n - 1))
    with pytest.raises(LayoutError, match="integers"):
        layout.permute(torch.arange(n, dtype=torch.float32))
    with pytest.raises(LayoutError, match="exactly once"):
        layout.permute(torch.zeros(n, dtype=torch.long))
    with pytest.raises(LayoutError, match="leave_behind='weights'"):
        layout.permute(torch.arange(n), leave_behind="weights")
    with pytest.raises(LayoutError, match="give both"):
        layout.row_table(video_t=0.5)
    with pytest.raises(LayoutError, match="must pass together"):
        layout.timestep_plan(torch.zeros(3), torch.zeros(2))
