"""LoRA through peft on the module boundary: injection (targets by Diffusers paths, base frozen, float32 factors),
the op-table layer (traced points, strict-only kernels, `off` byte-equal to peft's own layer, default init byte-equal
to the base), PEFT-format files both ways (peft loads what h3lab saves into a plain copy; h3lab reads what peft and
Diffusers write), removal, full-parameter training beside it, and the one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
from lora_cases import ALPHA, RANK, lora_model, randomize_b
from training_cases import SMALL, build_model, make_clip, make_layout

from h3lab.execution import runtime
from h3lab.training import (
    PROJECTIONS,
    AdapterError,
    Objective,
    add_lora,
    adapter_digest,
    adapter_files,
    adapter_state_dict,
    compute_gradients,
    read_adapter,
    remove_lora,
    save_adapter,
    trainable_parameters,
)
from h3lab.adapters.adapter_file import check_shapes, files_digest
from h3lab.adapters.field import attached
from h3lab.adapters.lora import lora_layer_class, lora_layers

OBJECTIVE = Objective(audio_weight=0.5)


def sample():
    return make_clip(SMALL, make_layout("fl2va"), seed=11).sample(OBJECTIVE)


def forward(model, mode="off"):
    with runtime.use_mode(mode), torch.no_grad():
        return model(**sample().model_kwargs())


def test_injection_targets_freezes_and_upcasts():
    model = build_model(SMALL, "released", 41)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    handle = add_lora(model, RANK, ALPHA)
    expected = [f"{root}.{i}.{m}" for root, n in (("token_refiner.refiner_blocks", 1), ("transformer_blocks", 1))
                for i in range(n) for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj",
                                            "ff.net.2")]
    assert sorted(handle.modules) == sorted(expected)
    assert sorted(n for n, _ in lora_layers(model)) == sorted(expected)
    assert all(type(m) is lora_layer_class() for _, m in lora_layers(model))
    params = trainable_parameters(model)
    assert len(params) == 2 * len(expected) and all(".lora_A.default." in n or ".lora_B.default." in n
                                                    for n, _ in params)
    assert all(p.dtype == torch.float32 for _, p in params)
    for n, p in model.named_parameters():  # every base weight frozen and unchanged (peft's base_layer naming)
        if ".lora_" not in n:
            assert not p.requires_grad and torch.equal(p, base[n.replace(".base_layer.", ".")]), n
    a = dict(params)["transformer_blocks.0.attn.to_q.lora_A.default.weight"]
    assert a.shape == (RANK, SMALL.hidden_size) and a.abs().max() > 0
    remove_lora(model, handle)
    assert [n for n, _ in model.named_parameters()] == list(base)
    assert all(p.requires_grad for p in model.parameters()) and not hasattr(model, "peft_config")


def test_default_init_is_byte_equal_to_the_base_and_draws_repeat():
    plain = build_model(SMALL, "released", 41)
    want = forward(plain, "strict")
    model = build_model(SMALL, "released", 41)
    add_lora(model, RANK, ALPHA, seed=3)
    got = forward(model, "strict")  # B = 0: base + 0, one rounding back to bf16 -> the base bytes
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    again = build_model(SMALL, "released", 41)
    add_lora(again, RANK, ALPHA, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(adapter_state_dict(model).values(), adapter_state_dict(again).values()))


def test_off_mode_is_byte_equal_to_peft_and_strict_is_traced():
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.tuners_utils import cast_adapter_dtype

    model = lora_model()
    plain = build_model(SMALL, "released", 41)
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(PROJECTIONS)), plain)
    cast_adapter_dtype(plain, "default")
    assert type(plain.transformer_blocks[0].attn.to_q).__name__ == "Linear"  # peft's own layer: torch factors
    set_peft_model_state_dict(plain, adapter_state_dict(model))
    ours, peft = forward(model), forward(plain)
    assert all(torch.equal(x, y) for x, y in zip(ours, peft))
    assert not torch.equal(ours[0], forward(build_model(SMALL, "released", 41))[0])  # the adapter does something
    strict = forward(model, "strict")
    trace = runtime.last_trace()
    assert not trace.fallbacks
    points = {r.point: r.op for r in trace.records}
    assert points["blocks.0.q.lora_a"] == "linear" and points["blocks.0.q.lora_b"] == "linear"
    assert points["blocks.0.o_proj.lora_a"] == "linear_tree" and points["blocks.0.ffn_down.lora_a"] == "linear_tree"
    assert points["blocks.0.ffn_up.lora"] == "gated_residual" and points["refiner.0.v.lora_b"] == "linear"
    assert not all(torch.equal(x, y) for x, y in zip(strict, ours))  # strict is its own arithmetic, not torch's


def test_peft_loads_what_h3lab_saves(tmp_path):
    from peft import PeftModel

    model = lora_model()
    path, digest = save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert digest == adapter_digest(model) == read_adapter(path).sha256
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    assert config["target_modules"] == sorted(PROJECTIONS)
    from safetensors.torch import load_file

    keys = sorted(load_file(str(path / "adapter_model.safetensors")))
    assert keys[0].startswith("base_model.model.") and all(k.endswith((".lora_A.weight", ".lora_B.weight"))
                                                           for k in keys)
    plain = build_model(SMALL, "released", 41)  # a plain copy of the module tree: peft's own Linear wraps it
    loaded = PeftModel.from_pretrained(plain, str(path))
    inner = loaded.base_model.model
    assert type(inner.transformer_blocks[0].attn.to_q).__name__ == "Linear"
    assert all(torch.equal(x, y) for x, y in zip(forward(inner), forward(model)))
    # saving twice gives the same bytes (sorted keys, sets sorted)
    _, again = save_adapter(model, tmp_path / "again")
    assert again == digest


def test_h3lab_reads_what_peft_writes(tmp_path):
    from peft import LoraConfig, get_peft_model

    plain = build_model(SMALL, "released", 41)
    peft_model = get_peft_model(plain, LoraConfig(r=2, lora_alpha=4, target_modules=["to_v", "ff.net.2"]))
    randomize_b(peft_model, 5)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    adapter = read_adapter(tmp_path / "peft")
    assert adapter.kind == "peft" and adapter.rank == 2 and len(adapter.modules) == 4
    check_shapes(adapter, SMALL)
    want = forward(peft_model.base_model.model)
    model = build_model(SMALL, "released", 41)
    with attached(model, adapter):
        assert all(torch.equal(x, y) for x, y in zip(forward(model), want))
        assert type(model.transformer_blocks[0].ff.net[2]) is lora_layer_class()
    assert not lora_layers(model) and all(p.requires_grad for p in model.parameters())


def test_h3lab_reads_what_diffusers_writes(tmp_path):
    """Diffusers' `save_lora_adapter` on its own MiniMaxH3Transformer3DModel (the same module paths): h3lab reads
    the single safetensors file (config from its metadata) and computes what Diffusers computes (off mode)."""
    from diffusers import MiniMaxH3Transformer3DModel
    from peft import LoraConfig

    plain = build_model(SMALL, "float32", 41)
    ref = MiniMaxH3Transformer3DModel(**SMALL.to_diffusers())
    ref.load_state_dict(plain.state_dict())
    ref.add_adapter(LoraConfig(r=2, lora_alpha=6, target_modules=["to_q", "to_out.0"]))
    randomize_b(ref, 6)
    ref.save_lora_adapter(str(tmp_path / "diff"))
    (file,) = (tmp_path / "diff").iterdir()
    adapter = read_adapter(file)
    assert adapter.kind == "diffusers" and adapter.config.lora_alpha == 6
    s = sample()
    with torch.no_grad():
        out = ref(**{k: v for k, v in s.model_kwargs().items() if k != "key_order"}, return_dict=False)
    with attached(plain, adapter):
        assert all(torch.equal(x, y) for x, y in zip(forward(plain), out[:2]))


def test_full_parameter_training_still_gets_every_gradient():
    model = build_model(SMALL, "float32", 42)
    result = compute_gradients(model, [make_clip(SMALL, make_layout("fl2va"), seed=3)], OBJECTIVE, mode="off")
    params = trainable_parameters(model)
    assert len(params) == len(list(model.parameters()))
    offset = 0
    for name, p in params:
        g = result.gradient[offset:offset + p.numel()]
        offset += p.numel()
        assert torch.isfinite(g).all() and g.abs().max() > 0, name


def test_bad_lora_settings_raise_one_line():
    model = build_model(SMALL, "released", 41)
    for kwargs, match in (({"rank": 0}, "rank=0"), ({"rank": 2.5}, "rank=2.5"), ({"rank": 2, "alpha": -1},
                          "alpha=-1"), ({"rank": 2, "targets": "to_q,,to_k"}, "LoRA target ''"),
                          ({"rank": 2, "targets": "to_qq"}, "'to_qq' matches no module"),
                          ({"rank": 2, "targets": "attn"}, "LoRA wraps projections"),
                          ({"rank": 2, "init": "pissa"}, "init='pissa'"), ({"rank": 2, "seed": -1}, "seed=-1")):
        with pytest.raises(AdapterError, match=match) as err:
            add_lora(model, **kwargs)
        assert "\n" not in str(err.value)
        assert not lora_layers(model)
    add_lora(model, 2)
    with pytest.raises(AdapterError, match="already carries"):
        add_lora(model, 2)


def test_adapter_digest_covers_the_config():
    model = lora_model()
    files = adapter_files(model)
    other = dict(files, **{"adapter_config.json": files["adapter_config.json"].replace(b'"lora_alpha": 8.0',
                                                                                     b'"lora_alpha": 9.0')})
    assert other["adapter_config.json"] != files["adapter_config.json"]
    assert files_digest(other) != files_digest(files)


def test_layers_share_one_combine_index_so_a_forward_syncs_once(monkeypatch):
    """The strict gated_residual checks an index tensor once per object, with a host sync, in a cache of a bounded
    number of tensors. Every LoRA layer passes the same zero index, so with the cache cut below the number of layers
    (the full model's 312 layers overflowed its 64) a repeated strict forward validates no LoRA index again. One
    index tensor per layer failed this (the cache evicted them in turn: a host sync per layer and forward)."""
    from h3kernels import modulate

    model = lora_model()
    layers = [m for _, m in lora_layers(model)]
    monkeypatch.setattr(modulate._CACHE, "_max", len(layers) - 1)
    kwargs = sample().model_kwargs()

    def strict_forward():
        with runtime.use_mode("strict"), torch.no_grad():
            model(**kwargs)

    strict_forward()
    indexes = {id(index) for m in layers for _, index in m._h3_tables.values()}
    row_counts = {key[2] for m in layers for key in m._h3_tables}  # the refiner's text rows, the blocks' rows
    assert len(indexes) == len(row_counts) == 2, f"{len(indexes)} index tensors for {len(layers)} layers"
    syncs = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: syncs.append(tuple(self.shape)) or tolist(self))
    strict_forward()
    # at most the model's own per-forward modulation index (built inside the forward, so new each time); never one
    # per layer
    assert len(syncs) <= 1, f"the repeated strict forward synced {len(syncs)} times"
