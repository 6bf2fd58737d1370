"""Runtime modes over the whole transformer (the tiny snapshot's released-policy transformer, t2va, batch 2).

- strict runs only the registered kernels (a spy on `runtime.REFERENCE_OPS` sees no torch op), and fails closed with a
  one-line `StrictError` naming op, point, shapes, dtypes and device when a kernel cannot serve: an op whose
  registration is removed, a float16 model, and the CPU without TRITON_INTERPRET (in a subprocess with the variable
  unset); the trace up to the failure holds only strict records.
- audit runs the production torch ops (bytes equal to `off`) and records every op as not strict.
- auto is strict wherever a kernel serves (bytes equal to strict) and records each fallback with its reason: an
  unregistered op, a refused dtype, the CPU without the interpreter.
- `use_overrides` records backend "override" in any mode.
- `last_trace()` is complete provenance: every hook point's op with kernel id, tile and accumulator, device, versions
  and the checkpoint fingerprint, and `to_json()` round-trips through `json.loads`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
from collections import Counter

import pytest
import torch
import triton
from strict_cases import ReferenceSpy, forward_kwargs, make_layout, make_request, strict_forward

from h3kernels import gemm, registry
from h3lab import H3Transformer
from h3lab.execution import runtime

BATCH_SEEDS = (201, 202)


@pytest.fixture(scope="module")
def model(tiny_snapshot) -> H3Transformer:
    model = H3Transformer.from_pretrained(tiny_snapshot, subfolder="transformer")
    assert model.dtype_policy == "released" and model.fingerprint
    return model


@pytest.fixture(scope="module")
def kwargs(model) -> dict:
    layout = make_layout("t2va", model.config.patch_size)
    return forward_kwargs(layout, [make_request(model.config, layout, s) for s in BATCH_SEEDS])


@pytest.fixture(scope="module")
def strict_run(model, kwargs):
    """One strict forward: (outputs, trace, torch reference calls seen by the spy)."""
    with pytest.MonkeyPatch.context() as mp:
        spy = ReferenceSpy().install(mp)
        out, _ = strict_forward(model, kwargs)
    return out, runtime.last_trace(), Counter(spy.calls)


@pytest.fixture(scope="module")
def half_model(model) -> H3Transformer:
    """The same weights, every parameter float16 (no strict GEMM or attention serves float16)."""
    half = H3Transformer(model.config, dtype_policy="float32")
    half.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in half.parameters():
            p.data = p.data.to(torch.float16)
    return half


@pytest.fixture
def spy(monkeypatch) -> ReferenceSpy:
    return ReferenceSpy().install(monkeypatch)


def run(model, kwargs, mode: str):
    with torch.no_grad(), runtime.use_mode(mode):
        out = model(**kwargs)
    return out, runtime.last_trace()


def same_bytes(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def op_sequence(trace) -> list[tuple[str, str]]:
    return [(r.op, r.point) for r in trace.records]


# ------------------------------------------------------------------------------------------- strict + trace
def test_strict_runs_only_kernels_and_traces_every_op(model, kwargs, strict_run):
    _, trace, torch_calls = strict_run
    assert torch_calls == Counter(), f"strict called torch reference ops: {dict(torch_calls)}"
    assert trace.mode == "strict" and trace.device == "cpu" and trace.fingerprint == model.fingerprint
    assert trace.versions == {"python": platform.python_version(), "torch": torch.__version__,
                              "triton": triton.__version__}
    assert trace.records and not trace.fallbacks
    for r in trace.records:
        assert (r.requested, r.actual, r.fallback) == ("strict", "strict", ""), r
        assert r.kernel_id and r.kernel_id != "torch" and r.tile and r.acc_dtype, r
        if r.op in ("linear", "linear_tree"):  # the fixed GEMM config of the operand dtype, float32 accumulator
            dtype = getattr(torch, r.dtypes[0])
            tiles = gemm.LINEAR_TILES if r.op == "linear" else gemm.TREE_TILES
            assert r.tile == tiles[dtype].describe() and r.acc_dtype == "float32", r
            assert r.kernel_id.startswith(f"h3kernels.gemm.{r.op}.") and r.kernel_id.endswith(r.dtypes[0]), r
        if r.op in ("attention", "rms_norm"):
            assert r.acc_dtype == "float32", r

    # Every hook point's op is recorded under that point, points appear in execution order, and nothing else is.
    # With no hook registered each AdaLN pre-norm is one fused `norm_modulate` call at its modulate point.
    fused = {f"blocks.{i}.norm{k}" for i in range(model.config.num_layers) for k in (1, 2)} | {"final_norm"}
    points = [p for p in model.hook_points() if p.name != "rope_sin" and p.name not in fused]  # rope_table: rope_cos
    recorded = {(r.point, r.op) for r in trace.records}
    assert {(p.name, "norm_modulate" if p.op == "modulate" else p.op) for p in points} <= recorded
    assert {r.point for r in trace.records} == {p.name for p in points}
    first_seen = list(dict.fromkeys(r.point for r in trace.records))
    assert first_seen == [p.name for p in points]
    video_rows = kwargs["hidden_states"].shape[1]
    first = trace.records[0]
    assert (first.op, first.point) == ("linear", "video_proj_in")
    assert first.shapes == [[len(BATCH_SEEDS), video_rows, model.config.video_patch_dim],
                            [model.config.hidden_size, model.config.video_patch_dim], [model.config.hidden_size]]
    assert first.dtypes == ["float32"] * 3  # proj_in is a float32 module in the released policy
    # Per op and layer: each block's attention is recorded once with (B, S, H, D) operands in bfloat16.
    for i in range(model.config.num_layers):
        (att,) = [r for r in trace.records if r.point == f"blocks.{i}.attention"]
        S = kwargs["position_ids"].shape[0]
        heads, head_dim = model.config.num_attention_heads, model.config.attention_head_dim
        assert att.shapes[:3] == [[len(BATCH_SEEDS), S, heads, head_dim]] * 3 and att.dtypes[:3] == ["bfloat16"] * 3


def test_trace_json_round_trip(model, strict_run):
    _, trace, _ = strict_run
    text = trace.to_json()
    data = json.loads(text)
    assert data == trace.to_dict()
    assert json.loads(trace.to_json(indent=2)) == data
    assert data["mode"] == "strict" and data["device"] == "cpu" and data["fingerprint"] == model.fingerprint
    assert data["versions"] == runtime.versions() and set(data["versions"]) == {"python", "torch", "triton"}
    assert data["summary"] == {op: {"strict": n} for op, n in Counter(r.op for r in trace.records).items()}
    assert len(data["records"]) == len(trace.records)
    fields = {f.name for f in dataclasses.fields(runtime.OpRecord)}
    assert fields >= {"op", "point", "requested", "actual", "kernel_id", "tile", "acc_dtype", "shapes", "dtypes"}
    for rec, obj in zip(data["records"], trace.records):
        assert set(rec) == fields and rec == dataclasses.asdict(obj)
        assert rec["kernel_id"] and rec["tile"] and rec["acc_dtype"]


# -------------------------------------------------------------------------------------------------- audit
def test_audit_runs_torch_and_records_every_op_as_not_strict(model, kwargs, strict_run, spy):
    out, trace = run(model, kwargs, "audit")
    torch_calls = Counter(spy.calls)
    off, _ = run(model, kwargs, "off")
    assert same_bytes(out, off), "audit must run the production (off) arithmetic"
    assert trace.mode == "audit" and trace.fingerprint == model.fingerprint
    assert op_sequence(trace) == op_sequence(strict_run[1])
    assert trace.fallbacks == trace.records, "audit must list every op as not strict"
    for r in trace.records:
        assert (r.requested, r.actual, r.kernel_id) == ("audit", "torch", "torch") and r.fallback, r
    assert torch_calls == Counter(r.op for r in trace.records), "each recorded op ran torch exactly once"


# --------------------------------------------------------------------------------------------------- auto
def test_auto_on_cpu_runs_torch_not_the_interpreter(model, kwargs, strict_run, spy):
    """auto never runs Triton's interpreter: on CPU tensors every op is the torch op (recorded, with the reason), the
    bytes are off's, and strict in the same process still runs every op strict."""
    out, trace = run(model, kwargs, "auto")
    assert spy.calls == Counter(r.op for r in trace.records)  # each op ran torch exactly once
    off, _ = run(model, kwargs, "off")
    assert same_bytes(out, off) and trace.records and trace.fallbacks == trace.records
    for r in trace.records:
        assert (r.requested, r.actual) == ("auto", "torch"), r
        assert r.fallback == f"auto fallback: {runtime.AUTO_CPU_REASON}", r
    assert all(r.actual == "strict" for r in strict_run[1].records)


# The three tests below check auto's per-op dispatch (the rule it follows on CUDA) on this CPU machine, through the
# interpreter: they ask for it with AUTO_ON_CPU = "interpreter".
def test_auto_is_strict_wherever_a_kernel_serves(model, kwargs, strict_run, spy, monkeypatch):
    monkeypatch.setattr(runtime, "AUTO_ON_CPU", "interpreter")
    strict_out, strict_trace, _ = strict_run
    out, trace = run(model, kwargs, "auto")
    assert spy.calls == Counter() and not trace.fallbacks
    assert same_bytes(out, strict_out)
    want = [dataclasses.replace(r, requested="auto") for r in strict_trace.records]
    assert trace.records == want


def test_auto_records_the_fallback_of_an_unregistered_op(model, kwargs, strict_run, spy, monkeypatch):
    monkeypatch.setattr(runtime, "AUTO_ON_CPU", "interpreter")
    monkeypatch.delitem(registry.STRICT_OPS, "rope")
    out, trace = run(model, kwargs, "auto")
    layers = model.config.num_layers
    assert spy.calls == Counter({"rope": 2 * layers})
    assert {r.point for r in trace.fallbacks} == {f"blocks.{i}.{qk}_rope" for i in range(layers) for qk in "qk"}
    for r in trace.fallbacks:
        assert (r.op, r.requested, r.actual, r.kernel_id) == ("rope", "auto", "torch", "torch"), r
        assert r.fallback == "auto fallback: no strict kernel is registered for op 'rope'", r
    assert all(r.actual == "strict" for r in trace.records if r.op != "rope")
    assert op_sequence(trace) == op_sequence(strict_run[1])
    # Strict rope is bit-equal to the reference by contract, so swapping it for torch leaves the bytes.
    assert same_bytes(out, strict_run[0])


def test_auto_records_the_fallback_of_a_refused_dtype(half_model, kwargs, spy, monkeypatch):
    monkeypatch.setattr(runtime, "AUTO_ON_CPU", "interpreter")
    out, trace = run(half_model, kwargs, "auto")
    assert all(torch.isfinite(o).all() and o.dtype == torch.float16 for o in out)
    fell_back = {r.op for r in trace.fallbacks}
    assert fell_back == {"linear", "linear_tree", "attention"}  # no float16 GEMM or attention kernel
    for r in trace.fallbacks:
        assert r.fallback.startswith(f"auto fallback: {r.op}: ") and "float16" in r.fallback, r
    served = {r.op for r in trace.records if r.actual == "strict"}
    assert {"rms_norm", "norm_modulate", "rope", "gated_residual", "swiglu", "pack_rows", "select_rows"} <= served
    assert spy.calls == Counter(r.op for r in trace.fallbacks)


# --------------------------------------------------------------------------------------------- fail closed
def test_strict_fails_closed_on_an_unregistered_op(model, kwargs, spy, monkeypatch):
    monkeypatch.delitem(registry.STRICT_OPS, "rope")
    with pytest.raises(runtime.StrictError) as info:
        run(model, kwargs, "strict")
    msg = str(info.value)
    S, B = kwargs["position_ids"].shape[0], len(BATCH_SEEDS)
    c = model.config
    assert "\n" not in msg
    assert msg.startswith("strict mode cannot run op 'rope' at blocks.0.q_rope ")
    assert f"[[{B}, {S}, {c.num_attention_heads}, {c.attention_head_dim}], [{S}, {c.rotary_dim}], " in msg
    assert "dtypes ['bfloat16', 'float32', 'float32']" in msg and "device cpu" in msg
    assert msg.endswith("no strict kernel is registered for op 'rope'")
    assert spy.calls == Counter(), "strict ran a torch op instead of failing"
    trace = runtime.last_trace()
    assert trace.records and all(r.actual == "strict" for r in trace.records)
    assert trace.records[-1].point == "blocks.0.k_norm"  # everything before the refused op ran strict


def test_strict_fails_closed_on_a_float16_model(half_model, kwargs, spy):
    with pytest.raises(runtime.StrictError) as info:
        run(half_model, kwargs, "strict")
    msg = str(info.value)
    c, B, nv = half_model.config, len(BATCH_SEEDS), kwargs["hidden_states"].shape[1]
    assert "\n" not in msg
    assert msg.startswith("strict mode cannot run op 'linear' at video_proj_in ")
    assert f"shapes [[{B}, {nv}, {c.video_patch_dim}], [{c.hidden_size}, {c.video_patch_dim}], [{c.hidden_size}]]" in msg
    assert "dtypes ['float16', 'float16', 'float16']" in msg and "device cpu" in msg and "torch.float16" in msg
    assert spy.calls == Counter() and runtime.last_trace().records == []


NO_INTERPRETER_SCRIPT = r"""
import json, os
import torch
from h3lab import H3Config, H3Transformer; from h3lab.execution import runtime
from h3lab.run.layout import build_layout

assert "TRITON_INTERPRET" not in os.environ
torch.set_num_threads(1)
calls = []
for name, fn in list(runtime.REFERENCE_OPS.items()):
    runtime.REFERENCE_OPS[name] = lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1]
config = H3Config.tiny()
torch.manual_seed(0)
model = H3Transformer(config)  # released policy
layout = build_layout("t2va", [1] * 5, 2, 4, 4, 3)
t, ti = layout.row_timesteps(0.42, 0.7)
g = torch.Generator().manual_seed(1)
kwargs = dict(
    hidden_states=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=g),
    audio_hidden_states=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=g),
    encoder_hidden_states=torch.randn(1, layout.num_text_tokens, config.text_dim, generator=g),
    timestep=t, timestep_indices=ti, **layout.model_inputs(),
)
result = {}
with torch.no_grad():
    try:
        with runtime.use_mode("strict"):
            model(**kwargs)
        result["strict"] = "ran"
    except runtime.StrictError as err:
        result["strict"] = str(err)
    result["strict_records"] = len(runtime.last_trace().records)
    result["strict_torch_calls"] = len(calls)
    with runtime.use_mode("auto"):
        auto = model(**kwargs)
    result["auto"] = [[r.op, r.actual, r.fallback] for r in runtime.last_trace().records]
    with runtime.use_mode("off"):
        off = model(**kwargs)
    result["auto_equals_off"] = all(torch.equal(a, b) for a, b in zip(auto, off))
print(json.dumps(result))
"""


def test_strict_fails_closed_on_cpu_without_the_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", NO_INTERPRETER_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    msg = result["strict"]
    assert msg.startswith("strict mode cannot run op 'linear' at video_proj_in (shapes [[1, 8, 16], [24, 16], [24]], "
                          "dtypes ['float32', 'float32', 'float32'], device cpu): "), msg
    assert "TRITON_INTERPRET=1" in msg and "\n" not in msg
    assert result["strict_records"] == 0 and result["strict_torch_calls"] == 0
    # auto without the interpreter: every op falls back to torch, each with the reason, and the bytes are off's.
    assert result["auto"] and result["auto_equals_off"]
    for op, actual, reason in result["auto"]:
        assert actual == "torch" and reason.startswith("auto fallback: ") and "TRITON_INTERPRET=1" in reason, op


# ------------------------------------------------------------------------------------------------ overrides
def test_overrides_are_recorded_as_override(model, kwargs, strict_run, spy):
    calls = []

    def doubled_rope(x, cos, sin):  # a perturbation: the reference rope, scaled (exact in bfloat16)
        calls.append(x.shape)
        return runtime.rope(x, cos, sin) * 2

    with runtime.use_overrides({"rope": doubled_rope}):
        out, trace = run(model, kwargs, "strict")
        _, off_trace = run(model, kwargs, "off")
    layers = model.config.num_layers
    assert len(calls) == 2 * 2 * layers  # q and k per block, in both forwards
    assert spy.calls == Counter(r.op for r in off_trace.records if r.actual == "torch")
    assert not any(torch.equal(a, b) for a, b in zip(out, strict_run[0])), "the override's result was not used"
    for tr, mode in ((trace, "strict"), (off_trace, "off")):
        over = [r for r in tr.records if r.actual == "override"]
        assert len(over) == 2 * layers and {r.op for r in over} == {"rope"}
        for r in over:
            assert (r.requested, r.kernel_id) == (mode, "override:rope"), r
        assert all(r.actual == ("strict" if mode == "strict" else "torch") for r in tr.records if r.op != "rope")
    assert op_sequence(trace) == op_sequence(strict_run[1])
    with pytest.raises(ValueError, match="unknown op"):
        with runtime.use_overrides({"fast_rope": doubled_rope}):
            pass


def test_use_mode_validates_nests_and_restores():
    assert runtime.current_mode() == "off"
    with pytest.raises(ValueError, match="mode 'turbo': must be one of strict, audit, auto, off, fast"):
        with runtime.use_mode("turbo"):
            pass
    with runtime.use_mode("strict"):
        with runtime.use_mode("audit"):
            assert runtime.current_mode() == "audit"
        assert runtime.current_mode() == "strict"
    assert runtime.current_mode() == "off"
