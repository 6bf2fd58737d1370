"""Token reduction: the layout transform (pairs, singletons, exact non-target rows, a valid reduced PackedLayout that
permutes consistently), the rows each block sees per pass (the seed's schedule on a 42-block model, an explicit one
on 8 blocks), the pool and restore arithmetic against captured streams, and the 256x256 refusal."""

import pytest
import torch
from preset_cases import deep_model, fl2va_layout, spec_for

from h3lab.run.layout import PackedLayout, build_layout, pair_horizontal_tokens
from h3lab.presets import DEFAULT_SCHEDULE, PresetError
from h3lab.presets.token_reduction import check_schedule
from h3lab.run import denoise
from h3lab.schema.generation_settings import GenerationSettings


@pytest.mark.parametrize("width", [6, 8])  # a 3-wide grid (one singleton column) and a 4-wide one
def test_pairs_are_adjacent_target_tokens_and_everything_else_is_exact(width):
    layout = fl2va_layout(frames=2, height=4, width=width)
    pairs = pair_horizontal_tokens(layout)
    gh, gw = layout.grid
    S, R = layout.sequence_length, pairs.num_rows
    assert R == S - 2 * gh * (gw // 2) and pairs.num_pairs == 2 * gh * (gw // 2)
    table = layout.row_table()
    for r, (a, b) in enumerate(pairs.members.tolist()):
        ta, tb = table[a], table[b]
        if pairs.paired[r]:
            assert ta["block"] == tb["block"] == "target:video"
            assert (ta["frame"], ta["y"], ta["x"] + 1) == (tb["frame"], tb["y"], tb["x"]) and ta["x"] % 2 == 0
        else:
            assert a == b
            assert ta["block"] != "target:video" or (gw % 2 and ta["x"] == gw - 1)
        assert int(pairs.inverse[a]) == int(pairs.inverse[b]) == r
    red = pairs.layout
    assert isinstance(red, PackedLayout) and red.sequence_length == R and red.grid == (gh, (gw + 1) // 2)
    assert red.is_canonical and red.key_order() is None
    # Positions: the mean of the members'; exactly the row's own for singletons.
    pos = layout.position_ids
    assert torch.equal(red.position_ids, (pos[pairs.members[:, 0]] + pos[pairs.members[:, 1]]) / 2)
    single = ~pairs.paired
    assert torch.equal(red.position_ids[single], pos[pairs.members[single, 0]])
    assert torch.equal(red.token_tags, layout.token_tags[pairs.members[:, 0]])
    t, idx = red.row_timesteps(0.3, 0.6)
    t_full, idx_full = layout.row_timesteps(0.3, 0.6)
    assert torch.equal(t, t_full) and torch.equal(idx, idx_full[pairs.members[:, 0]])
    assert PackedLayout.from_json(red.to_json()) == red


def test_a_permuted_layout_reduces_to_a_permutation_of_the_reduction():
    layout = fl2va_layout()
    perm = torch.randperm(layout.sequence_length, generator=torch.Generator().manual_seed(5))
    red, red_p = pair_horizontal_tokens(layout).layout, pair_horizontal_tokens(layout.permute(perm)).layout
    assert not red_p.is_canonical and red_p.permute(red_p.canonical_order()) == red


def _rows_per_block(model, spec):
    """{pass: [rows the attention of block i saw]} (attn pre-hooks; they only look)."""
    seen = {}

    def hook(i):
        def pre(_m, args):
            seen.setdefault(model.hook_context["step"], {})[i] = args[0].shape[1]

        return pre

    handles = [b.attn.register_forward_pre_hook(hook(i)) for i, b in enumerate(model.transformer_blocks)]
    try:
        out = denoise(spec, model)
    finally:
        for h in handles:
            h.remove()
    return {p: [rows[i] for i in sorted(rows)] for p, rows in seen.items()}, out


def test_the_seed_schedule_on_42_blocks():
    model = deep_model(42)
    layout = fl2va_layout(frames=1, height=2, width=4, text=3)
    S, R = layout.sequence_length, pair_horizontal_tokens(layout).num_rows
    rows, _ = _rows_per_block(model, spec_for(model, layout, passes=12, preset={"token_reduction": True}))
    assert DEFAULT_SCHEDULE == {"start": 4, "end": 30, "early_end": 40, "early_evaluations": 10}
    for p in range(12):
        end = 40 if p < 10 else 30
        assert rows[p] == [S] * 4 + [R] * (end - 4) + [S] * (42 - end), p
    # With whole-velocity reuse the schedule counts evaluations, not passes: reuse 2 evaluates 0, 2, ..., 20, 21.
    rows, _ = _rows_per_block(model, spec_for(model, layout, passes=22, reuse=2, preset={"token_reduction": True}))
    evaluated = sorted(rows)
    assert evaluated == list(range(0, 22, 2)) + [21]
    for k, p in enumerate(evaluated):
        end = 40 if k < 10 else 30
        assert rows[p] == [S] * 4 + [R] * (end - 4) + [S] * (42 - end), p


def test_pool_and_restore_against_the_captured_streams():
    model = deep_model(8)
    layout = fl2va_layout()
    pairs = pair_horizontal_tokens(layout)
    schedule = {"start": 2, "end": 4, "early_end": 6, "early_evaluations": 1}
    cap = {}

    def pre(name):
        def hook(_m, args):
            cap[(model.hook_context["step"], name)] = args[0].clone()

        return hook

    def post(name):
        def hook(_m, _args, out):
            cap[(model.hook_context["step"], name)] = out.clone()

        return hook

    blocks = model.transformer_blocks
    # Registered before the run: these see the block's input before, and its output before, the preset's hooks.
    handles = [blocks[2].register_forward_pre_hook(pre("enter")), blocks[3].register_forward_hook(post("late")),
               blocks[4].register_forward_pre_hook(pre("after_late")), blocks[5].register_forward_hook(post("early")),
               blocks[6].register_forward_pre_hook(pre("after_early")), blocks[3].register_forward_pre_hook(pre("b3"))]
    try:
        rows, _ = _rows_per_block(model, spec_for(model, layout, passes=3, preset={"token_reduction": schedule}))
    finally:
        for h in handles:
            h.remove()
    S, R = layout.sequence_length, pairs.num_rows
    assert rows[0] == [S, S] + [R] * 4 + [S, S] and rows[1] == rows[2] == [S, S, R, R] + [S] * 4
    m0, m1, inv = pairs.members[:, 0], pairs.members[:, 1], pairs.inverse
    for step, (last, after) in ((0, ("early", "after_early")), (1, ("late", "after_late"))):
        x = cap[(step, "enter")]  # (B, S, D) full, entering block 2
        pool = ((x[:, m0].float() + x[:, m1].float()) * 0.5).to(x.dtype)
        assert cap[(step, "b3")].shape[1] == R  # block 3 receives the reduced stream
        single = ~pairs.paired
        assert torch.equal(pool[:, single], x[:, m0[single]])  # text, audio, anchor rows and singletons exact
        y = cap[(step, last)]  # (B, R, D): the last reduced block's output
        assert y.shape[1] == R
        restored = cap[(step, after)]
        assert restored.shape == x.shape
        from_pair = pairs.paired[inv]
        want = (x.float() + (y.float() - pool.float())[:, inv]).to(x.dtype)
        assert torch.equal(restored[:, from_pair], want[:, from_pair])
        assert torch.equal(restored[:, ~from_pair], y[:, inv][:, ~from_pair])


def test_schedule_values_and_the_256_refusal():
    assert check_schedule(True) == DEFAULT_SCHEDULE and check_schedule(False) is None
    for bad, rule in (({"start": 0, "end": 3, "early_end": 4, "early_evaluations": 1}, "1 <= start < end"),
                      ({"start": 4, "end": 3, "early_end": 4, "early_evaluations": 1}, "1 <= start < end"),
                      ({"start": 1, "end": 3}, "must be true, false or"), ("yes", "must be true, false or"),
                      ({"start": 1.0, "end": 3, "early_end": 4, "early_evaluations": 1}, "must be an integer")):
        with pytest.raises(PresetError, match=rule):
            check_schedule(bad)
    model = deep_model(6)
    native = build_layout("t2va", torch.ones(3, dtype=torch.long), 1, 16, 16, 2)
    with pytest.raises(PresetError, match="token reduction at 256x256: refused"):
        denoise(spec_for(model, native, passes=1, preset={"token_reduction": True}), model)
    with pytest.raises(PresetError, match="token_reduction at 256x256: refused"):
        GenerationSettings(width=256, height=256, token_reduction=True)
    with pytest.raises(PresetError, match="token_reduction at 256x256"):  # the model's canvas is what counts
        GenerationSettings(width=512, height=512, render_width=256, render_height=256, token_reduction=True)
    with pytest.raises(PresetError, match="start=4: the transformer has 3 blocks"):
        three = deep_model(3)
        denoise(spec_for(three, fl2va_layout(), passes=1, preset={"token_reduction": True}), three)
    with pytest.raises(PresetError, match="carries no layout"):
        denoise(spec_for(model, fl2va_layout(), passes=1, preset={"token_reduction": True}).replace(layout=None),
                model)
