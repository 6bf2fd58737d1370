"""Layer thinning: the gate statistic (against a float64 recomputation of every AdaLN table), the protected first and
final blocks, the nested choice, exactly the chosen blocks run (and the same bytes as a model built from them
alone), the dropped blocks' weights released (and a run that needs one refused), the validated range."""

import math

import pytest
import torch
from preset_cases import Calls, deep_model, fl2va_layout, spec_for
from torch import nn

from h3lab import presets
from h3lab.config import NUM_MODALITIES
from h3lab.presets import PresetError
from h3lab.presets.layer_thinning import GATE_TIMESTEPS, check_layers, layer_range
from h3lab.run import denoise


def _table_scores(model) -> dict[int, float]:
    """The whole (T*3, 6*hidden) AdaLN table of each block in float64, straight from the weights: mean |gate_msa|
    and |gate_mlp| over every row and channel."""
    c = model.config
    t = torch.arange(GATE_TIMESTEPS, dtype=torch.float64) / (GATE_TIMESTEPS - 1)
    half = c.freq_dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    emb = t[:, None] * freqs[None]
    sinusoid = torch.cat([torch.cos(emb), torch.sin(emb)], dim=-1)
    te = model.time_embedder
    h = nn.functional.silu(sinusoid @ te.linear_1.weight.double().T + te.linear_1.bias.double())
    temb = h @ te.linear_2.weight.double().T + te.linear_2.bias.double()
    a = nn.functional.silu(temb)
    out = {}
    for i, block in enumerate(model.transformer_blocks):
        lin = block.adaln_proj.linear
        table = (a @ lin.weight.double().T + lin.bias.double()).view(-1, 6 * c.hidden_size)  # row t*3 + modality
        gates = torch.cat([table.chunk(6, dim=-1)[2], table.chunk(6, dim=-1)[5]], dim=-1)
        assert gates.shape == (GATE_TIMESTEPS * NUM_MODALITIES, 2 * c.hidden_size)
        out[i] = float(gates.abs().mean())
    return out


def test_gate_scores_are_the_mean_absolute_residual_gates():
    model = deep_model(8)
    got, want = presets.gate_scores(model), _table_scores(model)
    assert sorted(got) == list(range(8))
    for i in range(8):  # the float32 time embedding against a float64 one: a few float32 ulps
        assert got[i] == pytest.approx(want[i], rel=1e-5)
    assert len({round(v, 9) for v in got.values()}) == 8  # random weights: no ties


def test_the_choice_protects_the_ends_ranks_the_rest_and_is_nested():
    model = deep_model(10)
    scores = presets.gate_scores(model)
    choices = {n: presets.choose_blocks(model, n) for n in range(8, 11)}
    assert choices[10] == tuple(range(10))
    for n, blocks in choices.items():
        assert len(blocks) == n and blocks == tuple(sorted(blocks)) and {0, 9} <= set(blocks)
        inner = sorted((i for i in range(1, 9)), key=lambda i: -scores[i])
        assert set(blocks) == {0, 9, *inner[: n - 2]}
    assert set(choices[8]) < set(choices[9]) < set(choices[10])
    # The statistic decides: shrink one middle block's gate rows and it is the first to go.
    top = max(range(1, 9), key=lambda i: scores[i])
    lin = model.transformer_blocks[top].adaln_proj.linear
    H = model.config.hidden_size
    with torch.no_grad():
        for m in range(NUM_MODALITIES):
            for j in (2, 5):
                rows = slice(m * 6 * H + j * H, m * 6 * H + (j + 1) * H)
                lin.weight[rows] *= 1e-3
                lin.bias[rows] *= 1e-3
    assert top not in presets.choose_blocks(model, 9) and top in choices[9]
    # The protected blocks stay even when their gates are the smallest.
    with torch.no_grad():
        model.transformer_blocks[0].adaln_proj.linear.weight.mul_(1e-3)
    assert 0 in presets.choose_blocks(model, 8)


def test_exactly_the_chosen_blocks_run_and_match_a_model_of_them_alone():
    model = deep_model(8)
    layout = fl2va_layout()
    blocks = presets.choose_blocks(model, 7)
    spec = spec_for(model, layout, passes=3, preset={"layers": 7, "blocks": list(blocks)})
    calls = Calls(model, {f"b{i}": b.attn for i, b in enumerate(model.transformer_blocks)}
                  | {"proj_in": model.proj_in, "norm_out": model.norm_out})
    try:
        video, audio = denoise(spec, model)
    finally:
        calls.remove()
    for step in range(3):
        assert calls.at(step) == {**{f"b{i}": 1 for i in blocks}, "proj_in": 1, "norm_out": 1}
    assert model.transformer_blocks[3].__dict__.get("forward") is None  # restored after the run
    # The same model with only those blocks in its stack: byte-identical.
    full = model.transformer_blocks
    model.transformer_blocks = nn.ModuleList([full[i] for i in blocks])
    try:
        v2, a2 = denoise(spec_for(model, layout, passes=3), model)
    finally:
        model.transformer_blocks = full
    assert torch.equal(video, v2) and torch.equal(audio, a2)
    plain, _ = denoise(spec_for(model, layout, passes=3), model)
    assert not torch.equal(plain, video)


def test_released_blocks_free_their_weights_and_refuse_to_run():
    model = deep_model(8)
    layout = fl2va_layout()
    blocks = presets.choose_blocks(model, 7)
    spec = spec_for(model, layout, passes=2, preset={"layers": 7, "blocks": list(blocks)})
    before, _ = denoise(spec, model)
    assert model.fingerprint == ""
    numel = sum(p.numel() for p in model.parameters() if not p.is_meta)
    (gone,) = presets.release_dropped(model, blocks)
    assert presets.released_blocks(model) == (gone,) and gone not in blocks
    assert all(p.is_meta for p in model.transformer_blocks[gone].parameters())
    freed = sum(p.numel() for p in model.transformer_blocks[0].parameters())
    assert sum(p.numel() for p in model.parameters() if not p.is_meta) == numel - freed
    assert model.fingerprint.startswith("weights:")  # pinned to the weights it was loaded with
    after, _ = denoise(spec, model)  # the thinned run does not need the released block
    assert torch.equal(before, after)
    assert presets.needs_reload(model) and presets.needs_reload(model, 8) and not presets.needs_reload(model, 7)
    assert presets.needs_reload(model, blocks=[gone]) and not presets.needs_reload(model, blocks=blocks)
    with pytest.raises(PresetError, match=rf"block {gone} was released by layer thinning") as err:
        denoise(spec_for(model, layout, passes=2), model)  # the full path needs it
    assert "\n" not in str(err.value)
    with pytest.raises(PresetError, match="only 7 of 8 blocks are resident"):
        presets.choose_blocks(model, 8)
    assert presets.choose_blocks(model, 7) == blocks  # ranking the resident blocks gives the same choice


def test_validated_range():
    assert layer_range(50) == (40, 50) and layer_range(8) == (7, 8) and layer_range(2) == (2, 2)
    for bad, rule in ((39, "between 40 and 50"), (51, "between 40 and 50"), (True, "must be an integer"),
                      ("45", "must be an integer")):
        with pytest.raises(PresetError, match=rule) as err:
            check_layers(bad, 50)
        assert "\n" not in str(err.value)
    model = deep_model(8)
    with pytest.raises(PresetError, match="between 7 and 8"):
        denoise(spec_for(model, fl2va_layout(), passes=1, preset={"layers": 6}), model)
    with pytest.raises(PresetError, match="always runs the first and final blocks"):
        denoise(spec_for(model, fl2va_layout(), passes=1, preset={"layers": 7, "blocks": [1, 2, 3, 4, 5, 6, 7]}),
                model)
