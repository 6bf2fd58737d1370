"""Hook points and the runtime trace of an `off` forward: the documented names in execution order, one firing per
point with the documented row axis, perturbation vs observation, handles, the hook context, and a trace that lists
every op call with its point."""

import pytest
import torch
from model_cases import CONFIGS, small_case

from h3lab import H3Transformer
from h3lab.execution import runtime
from h3lab.model import HookError, HookPoint

REFINER = "norm1 q k v q_norm k_norm attention o_proj residual1 norm2 ffn_up swiglu ffn_down residual2".split()
BLOCK = (
    "adaln_table norm1 modulate1 q k v q_norm k_norm q_rope k_rope attention o_proj residual1 norm2 modulate2 "
    "ffn_up swiglu ffn_down residual2"
).split()


def documented_names(config):
    """docs/ARCHITECTURE.md, spelled out independently of the model code."""
    names = ["video_proj_in", "audio_proj_in", "text_proj_in"]
    names += [f"refiner.{i}.{op}" for i in range(config.num_refiner_layers) for op in REFINER]
    names += ["refiner.final_norm", "pack", "time_sinusoid", "time_mlp", "rope_cos", "rope_sin"]
    names += [f"blocks.{i}.{op}" for i in range(config.num_layers) for op in BLOCK]
    names += ["final_table", "final_norm", "final_modulate", "video_head", "audio_head", "video_out", "audio_out"]
    return names


def documented_trace(config, fused=True):
    """(op, point) of every op call of one forward, in order. `fused`: no hook registered, so each AdaLN pre-norm
    (norm1+modulate1, norm2+modulate2, final_norm+final_modulate) is one `norm_modulate` call at the modulate point."""
    out = [("linear", "video_proj_in"), ("linear", "audio_proj_in"), ("linear", "text_proj_in")]
    attn = ["linear", "linear", "linear", "rms_norm", "rms_norm"]
    for i in range(config.num_refiner_layers):
        p = f"refiner.{i}."
        ops = ["rms_norm", *attn, "attention", "linear_tree", "add", "rms_norm", "linear", "swiglu", "linear_tree",
               "add"]
        out += list(zip(ops, [p + n for n in REFINER]))
    out += [("rms_norm", "refiner.final_norm"), ("pack_rows", "pack"), ("timestep_embedding", "time_sinusoid")]
    out += [("linear", "time_mlp"), ("silu", "time_mlp"), ("linear", "time_mlp"), ("rope_table", "rope_cos")]
    for i in range(config.num_layers):
        p = f"blocks.{i}."
        out += [("silu", p + "adaln_table")]
        ops = ["linear", "rms_norm", "modulate", *attn, "rope", "rope", "attention", "linear_tree", "gated_residual",
               "rms_norm", "modulate", "linear", "swiglu", "linear_tree", "gated_residual"]
        out += list(zip(ops, [p + n for n in BLOCK]))
    out += [("silu", "final_table"), ("linear", "final_table"), ("rms_norm", "final_norm"),
            ("modulate", "final_modulate"), ("linear", "video_head"), ("linear", "audio_head"),
            ("select_rows", "video_out"), ("select_rows", "audio_out")]
    if fused:
        norms = {f"blocks.{i}.{n}" for i in range(config.num_layers) for n in ("norm1", "norm2")} | {"final_norm"}
        out = [("norm_modulate", pt) if op == "modulate" else (op, pt) for op, pt in out if pt not in norms]
    return out


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return H3Transformer(CONFIGS["tiny"], dtype_policy="float32")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hook_point_names_match_documentation(name):
    config = CONFIGS[name]
    points = H3Transformer(config).hook_points()
    assert [p.name for p in points] == documented_names(config)
    assert all(isinstance(p, HookPoint) for p in points)
    assert {p.rows for p in points} <= {"packed", "video", "audio", "text", "table", "time"}
    for p in points:
        if p.name.startswith(("blocks.", "refiner.")) and p.name != "refiner.final_norm":
            assert p.layer == int(p.name.split(".")[1])
        else:
            assert p.layer is None


def test_every_point_fires_once_in_order_with_its_rows(model):
    inputs = small_case(model.config, batch=2)
    seq = inputs["position_ids"].shape[0]
    sizes = {
        "packed": seq, "video": inputs["video_indices"].numel(), "audio": inputs["audio_indices"].numel(),
        "text": inputs["text_indices"].numel(), "time": inputs["timestep"].numel(),
        "table": 3 * inputs["timestep"].numel(),
    }
    seen = []

    def record(point, tensor):
        seen.append(point)
        assert tensor.shape[point.row_axis] == sizes[point.rows], point

    handle = model.add_hook(record)
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    assert seen == list(model.hook_points())
    # The op a point names is the op whose call the trace records at that point (last call there).
    last_op = {r.point: r.op for r in runtime.last_trace().records}
    for p in model.hook_points():
        assert last_op[p.name if p.name != "rope_sin" else "rope_cos"] == p.op, p


def test_observing_hook_keeps_bytes_and_perturbing_hook_changes_output(model):
    inputs = small_case(model.config, batch=2)
    with torch.no_grad():
        base = model(**inputs)
        handle = model.add_hook(lambda point, tensor: None)
        observed = model(**inputs)
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(base, observed))
    g = torch.Generator().manual_seed(1)
    for point in model.hook_points():
        def perturb(p, tensor):
            return tensor + 0.25 * torch.randn(tensor.shape, generator=g).to(tensor.dtype)

        handle = model.add_hook(perturb, names=[point.name])
        with torch.no_grad():
            out = model(**inputs)
        handle.remove()
        assert not all(torch.equal(a, b) for a, b in zip(base, out)), f"perturbing {point.name} changed nothing"
    with torch.no_grad():
        after = model(**inputs)
    assert all(torch.equal(a, b) for a, b in zip(base, after)), "a removed hook still acts"


def test_hooks_run_in_registration_order_and_read_the_context(model):
    inputs = small_case(model.config, batch=1)
    calls = []
    model.hook_context = {"step": 3}
    h1 = model.add_hook(lambda p, t: calls.append(("first", model.hook_context["step"])) or t * 2, names="pack")
    h2 = model.add_hook(lambda p, t: calls.append(("second", float(t.abs().sum()))), names=["pack"])
    with torch.no_grad():
        model(**inputs)
    h1.remove()
    h2.remove()
    model.hook_context = {}
    assert calls[0] == ("first", 3) and calls[1][0] == "second" and len(calls) == 2


def test_bad_hooks_raise(model):
    inputs = small_case(model.config, batch=1)
    with pytest.raises(HookError, match="blocks.9.q"):
        model.add_hook(lambda p, t: None, names=["blocks.9.q"])
    with pytest.raises(HookError, match="not callable"):
        model.add_hook("nope")
    handle = model.add_hook(lambda p, t: t[..., :1], names=["blocks.0.q"])
    with pytest.raises(HookError, match=r"blocks\.0\.q returned .* must be a tensor of shape"):
        with torch.no_grad():
            model(**inputs)
    handle.remove()
    handle = model.add_hook(lambda p, t: t.double(), names=["pack"])
    with pytest.raises(HookError, match="dtype torch.float32"):
        with torch.no_grad():
            model(**inputs)
    handle.remove()


@pytest.mark.parametrize("policy", ["released", "float32"])
def test_trace_lists_every_op_call_with_its_point(policy):
    config = CONFIGS["h3d8"]
    model = H3Transformer(config, dtype_policy=policy)
    model.fingerprint = "sha256:test"
    with torch.no_grad(), runtime.use_mode("off"):
        model(**small_case(config, batch=1))
    trace = runtime.last_trace()
    assert trace.mode == "off" and trace.fingerprint == "sha256:test" and trace.device == "cpu"
    assert [(r.op, r.point) for r in trace.records] == documented_trace(config)
    assert all(r.actual == "torch" and r.requested == "off" and r.shapes for r in trace.records)
    names = {p.name for p in model.hook_points()}
    fused_away = {f"blocks.{i}.{n}" for i in range(config.num_layers) for n in ("norm1", "norm2")} | {"final_norm"}
    assert {r.point for r in trace.records} == names - {"rope_sin"} - fused_away
    # An observing hook keeps every point apart: the unfused sequence, every point traced.
    handle = model.add_hook(lambda point, tensor: None)
    with torch.no_grad(), runtime.use_mode("off"):
        model(**small_case(config, batch=1))
    handle.remove()
    assert [(r.op, r.point) for r in runtime.last_trace().records] == documented_trace(config, fused=False)
    assert {r.point for r in runtime.last_trace().records} == names - {"rope_sin"}
    # Released cast points are visible in the recorded dtypes.
    by_point = {r.point: r for r in trace.records}
    assert by_point["video_proj_in"].dtypes[0] == "float32"
    assert by_point["text_proj_in"].dtypes[0] == ("bfloat16" if policy == "released" else "float32")
    assert by_point["video_head"].dtypes[0] == "float32"
    assert by_point["blocks.0.q"].dtypes == ["bfloat16" if policy == "released" else "float32"] * 2
