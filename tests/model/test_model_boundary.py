"""The module boundary: every projection and norm is a called `nn.Linear` / `nn.RMSNorm` at its Diffusers path whose
forward dispatches through the running forward's op table, so outside code can replace it, wrap it or hook it —
byte-identical when it only delegates, traced under its own point, correct against float64 when it adds a low-rank
update; the fused AdaLN pre-norm steps aside for anything that observes the norm; reshapable hook points; and a
checkpoint replay that dispatches through the forward's table even when backward runs outside its context."""

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from model_cases import CONFIGS, random_state_dict, small_case, weighted_loss
from torch import nn

from h3lab import H3Transformer
from h3lab.execution import runtime
from h3lab.model import HookError
from h3lab.model.layers import Linear, RMSNorm

TREE = {"attn.to_out.0", "ff.net.2"}


def build(policy="released", seed=0, config=CONFIGS["tiny"]):
    model = H3Transformer(config, dtype_policy=policy)
    model.load_state_dict(random_state_dict(config, seed))
    return model


def run(model, inputs, mode="off"):
    with torch.no_grad(), runtime.use_mode(mode):
        out = model(**inputs)
    return out, runtime.last_trace()


@pytest.fixture(scope="module")
def plain():
    """`plain(mode, batch)`: the plain forward of `build()` on `small_case(batch=batch)` in `mode` and its trace,
    computed once for the module (the wrapping, hook and reshaping tests compare their own freshly built model with
    it; a model built the same way has the same weights, so its plain forward is the same bytes)."""
    cache = {}

    def get(mode, batch):
        if (mode, batch) not in cache:
            model = build()
            cache[(mode, batch)] = run(model, small_case(model.config, batch=batch), mode)
        return cache[(mode, batch)]

    return get


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def ops_of(trace):
    return [(r.op, r.point) for r in trace.records]


class Shadow(nn.Module):
    """Delegates to the projection it replaces; on the side it runs its own op-table call (a probe of the input)."""

    def __init__(self, base: Linear, rank: int, seed: int):
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(seed)
        self.probe = nn.Parameter((torch.randn(rank, base.in_features, generator=g)).to(base.weight.dtype))
        self.seen = None

    def forward(self, x):
        self.seen = runtime.current_ops().linear(x, self.probe, point=f"{self.base.point}.probe")
        return self.base(x)


class LowRank(nn.Module):
    """y = base(x) + (x A^T) B^T, both factors through the op table (a LoRA layer written against the runtime)."""

    def __init__(self, base: Linear, rank: int, seed: int):
        super().__init__()
        self.base = base
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Parameter(torch.randn(rank, base.in_features, generator=g).to(base.weight.dtype) / 4)
        self.b = nn.Parameter(torch.randn(base.out_features, rank, generator=g).to(base.weight.dtype) / 4)

    def forward(self, x):
        ops = runtime.current_ops()
        h = ops.linear(x, self.a, point=f"{self.base.point}.lora_a")
        return self.base(x) + ops.linear(h, self.b, point=f"{self.base.point}.lora_b")


# ------------------------------------------------------------------------------------------------ the modules
def test_projections_and_norms_are_torch_modules_at_the_diffusers_paths():
    config = CONFIGS["tiny"]
    ours, ref = H3Transformer(config), MiniMaxH3Transformer3DModel(**config.to_diffusers())
    assert list(ours.state_dict()) == list(ref.state_dict())
    for cls in (nn.Linear, nn.RMSNorm):
        paths = {n for n, m in ours.named_modules() if isinstance(m, cls)}
        assert paths == {n for n, m in ref.named_modules() if isinstance(m, cls)} and paths, cls
    assert {n for n, _ in ours.named_modules()} <= {n for n, _ in ref.named_modules()}, "a module Diffusers lacks"
    for name, m in ours.named_modules():
        if isinstance(m, nn.Linear):
            assert type(m) is Linear and m.point and m.tree == any(name.endswith(t) for t in TREE), name
        if isinstance(m, nn.RMSNorm):
            assert type(m) is RMSNorm and m.point, name


def test_every_module_call_dispatches_through_the_op_table():
    model = build()
    inputs = small_case(model.config, batch=1)
    base, trace = run(model, inputs)
    counts = {"linear": 0, "linear_tree": 0}

    def counted(name):
        def op(*args):
            counts[name] += 1
            return runtime.mode_op(name)(*args)
        return op

    with runtime.use_overrides({n: counted(n) for n in counts}):
        out, over = run(model, inputs)
    assert same(out, base)
    n_linear = sum(1 for m in model.modules() if isinstance(m, Linear) and not m.tree)
    n_tree = sum(1 for m in model.modules() if isinstance(m, Linear) and m.tree)
    assert counts == {"linear": n_linear, "linear_tree": n_tree}
    assert [r.op for r in over.records if r.actual == "override"] == [
        r.op for r in trace.records if r.op in counts
    ]


def test_a_module_called_outside_a_forward_runs_in_the_current_mode(monkeypatch):
    model = build()
    x = torch.randn(2, 5, model.config.video_patch_dim)
    proj = model.proj_in
    with runtime.use_mode("off"):
        assert runtime.current_ops().mode == "off" and not runtime.current_ops().record
        assert torch.equal(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias))
    from h3kernels import registry

    monkeypatch.delitem(registry.STRICT_OPS, "linear")
    with runtime.use_mode("strict"), pytest.raises(runtime.StrictError, match="op 'linear' at video_proj_in"):
        proj(x)


# ---------------------------------------------------------------------------------------------- wrapping
@pytest.mark.parametrize("mode", ["off", "strict"])
def test_a_delegating_wrapper_keeps_the_bytes_and_its_own_calls_are_traced(mode, plain):
    model = build()
    inputs = small_case(model.config, batch=1)
    base, trace = plain(mode, 1)
    attn = model.transformer_blocks[0].attn
    original = attn.to_q
    attn.to_q = Shadow(original, rank=3, seed=7)
    try:
        out, wrapped = run(model, inputs, mode)
        seen = attn.to_q.seen
    finally:
        attn.to_q = original
    assert same(out, base)
    want = ops_of(trace)
    at = want.index(("linear", "blocks.0.q"))
    assert ops_of(wrapped) == want[:at] + [("linear", "blocks.0.q.probe")] + want[at:]
    (probe,) = [r for r in wrapped.records if r.point == "blocks.0.q.probe"]
    assert probe.requested == mode and probe.actual == ("strict" if mode == "strict" else "torch")
    assert seen.shape[-1] == 3 and seen.abs().sum() > 0


@pytest.mark.parametrize("mode", ["off", "strict"])
def test_torch_hooks_on_a_projection_see_and_change_its_input_and_output(mode, plain):
    model = build()
    inputs = small_case(model.config, batch=1)
    proj = model.transformer_blocks[1].attn.to_v  # not to_q: q_norm would undo a x2
    seen, points = {}, {}
    h1 = proj.register_forward_hook(lambda m, args, out: seen.update(x=args[0].clone(), y=out.clone()))
    h2 = model.add_hook(lambda p, t: points.update({p.name: t.clone()}), names=["blocks.1.modulate1", "blocks.1.v"])
    observed, _ = run(model, inputs, mode)
    h1.remove()
    h2.remove()
    assert torch.equal(seen["x"], points["blocks.1.modulate1"]) and torch.equal(seen["y"], points["blocks.1.v"])
    base = plain(mode, 1)[0]  # the same weights and inputs without observers
    assert same(observed, base), "the observers changed the bytes"
    # Doubling the input (pre-hook), the output (forward hook) or the hook point: one result (x2 is exact).
    outs = []
    for attach in (
        lambda: proj.register_forward_pre_hook(lambda m, args: (args[0] * 2,)),
        lambda: proj.register_forward_hook(lambda m, args, out: out * 2),
        lambda: model.add_hook(lambda p, t: t * 2, names=["blocks.1.v"]),
    ):
        handle = attach()
        outs.append(run(model, inputs, mode)[0])
        handle.remove()
    assert same(outs[0], outs[1]) and same(outs[1], outs[2])
    assert not same(outs[0], base)


def test_a_low_rank_wrapper_matches_the_float64_merged_weights():
    """Two wrapped projections (a `linear` and a `linear_tree` one): the wrapped float32 model against a float64
    model whose weights are W + B A, within 2x the error of the float32 model with those merged weights."""
    config = CONFIGS["tiny"]
    model = build("float32", seed=2)
    inputs = small_case(config, batch=2, seed=3)
    base, _ = run(model, inputs)
    targets = [("transformer_blocks.0.attn", "to_q"), ("transformer_blocks.1.ff.net", "2")]
    merged = {}
    for i, (parent, name) in enumerate(targets):
        owner = model.get_submodule(parent)
        wrapper = LowRank(owner.get_submodule(name), rank=4, seed=10 + i)
        merged[f"{parent}.{name}.weight"] = wrapper.base.weight.double() + wrapper.b.double() @ wrapper.a.double()
        setattr(owner, name, wrapper)
    out, trace = run(model, inputs)
    points = [r.point for r in trace.records]
    assert points.count("blocks.0.q.lora_a") == points.count("blocks.1.ffn_down.lora_b") == 1

    state = random_state_dict(config, 2)
    truth = H3Transformer(config, dtype_policy="float32")
    truth.load_state_dict({**state, **{k: v.float() for k, v in merged.items()}})
    plain32 = H3Transformer(config, dtype_policy="float32")
    plain32.load_state_dict({**state, **{k: v.float() for k, v in merged.items()}})
    with torch.no_grad():
        for p in truth.parameters():
            p.data = p.data.double()
        for k, v in merged.items():
            truth.get_parameter(k).data = v
    want, _ = run(truth, {k: (v.double() if v.is_floating_point() and k.endswith("states") else v)
                          for k, v in inputs.items()})
    ref32, _ = run(plain32, inputs)
    for o, r, t, b in zip(out, ref32, want, base):
        err = (o.double() - t).norm() / t.norm()
        ref_err = (r.double() - t).norm() / t.norm()
        assert err <= 2 * ref_err, (float(err), float(ref_err))
        assert (o - b).norm() / b.norm() > 1e3 * err, "the low-rank update did not reach the output"


# ----------------------------------------------------------------------------------------- fused pre-norm
def test_the_fused_pre_norm_steps_aside_for_an_observed_norm():
    model = build()
    inputs = small_case(model.config, batch=1)
    base, trace = run(model, inputs)
    by_point = {r.point: r.op for r in trace.records}
    assert by_point["blocks.0.modulate1"] == "norm_modulate" and "blocks.0.norm1" not in by_point
    seen = []
    handle = model.transformer_blocks[0].norm1.register_forward_hook(lambda m, a, out: seen.append(out.clone()))
    out, hooked = run(model, inputs)
    handle.remove()
    points = ops_of(hooked)
    assert ("rms_norm", "blocks.0.norm1") in points and ("modulate", "blocks.0.modulate1") in points
    assert ("norm_modulate", "blocks.0.modulate2") in points and ("norm_modulate", "blocks.1.modulate1") in points
    assert len(seen) == 1 and same(out, base)
    # A replaced norm module is called, not fused past.
    block = model.transformer_blocks[1]
    original = block.norm2
    calls = []

    class Counting(nn.Module):
        def forward(self, x):
            calls.append(1)
            return original(x)

    block.norm2 = Counting()
    try:
        out, replaced = run(model, inputs)
    finally:
        block.norm2 = original
    assert calls == [1] and same(out, base)
    assert ("rms_norm", "blocks.1.norm2") in ops_of(replaced) and ("modulate", "blocks.1.modulate2") in ops_of(replaced)
    assert ops_of(run(model, inputs)[1]) == ops_of(trace), "fusion did not come back"


# ------------------------------------------------------------------------------------------------ reshaping
def test_only_the_declared_points_are_reshapable():
    model = build("float32")
    reshapable = {p.name for p in model.hook_points() if p.reshapable}
    assert reshapable == {"pack"} | {f"blocks.{i}.residual2" for i in range(model.config.num_layers)}
    inputs = small_case(model.config, batch=2)
    for name in ("blocks.0.residual1", "refiner.1.residual2", "blocks.1.modulate2"):
        handle = model.add_hook(lambda p, t: t[:1], names=[name])
        with pytest.raises(HookError, match=rf"{name} returned Tensor \[1, .*must be a tensor of shape \[2, "):
            run(model, inputs)
        handle.remove()
    rule = r"a replacement must be a tensor of any shape \(a reshapable point\), dtype torch.float32, device cpu"
    for bad, got in ((lambda t: t[:1].double(), "torch.float64 cpu"),
                     (lambda t: torch.empty_like(t[:1], device="meta"), "torch.float32 meta")):
        handle = model.add_hook(lambda p, t, bad=bad: bad(t), names=["blocks.0.residual2"])
        with pytest.raises(HookError, match=rf"blocks\.0\.residual2 returned Tensor \[1, 34, 24\] {got}: {rule}$"):
            run(model, inputs)
        handle.remove()


@pytest.mark.parametrize("name", ["pack", "blocks.0.residual2"])
def test_a_reshapable_point_may_change_the_batch(name, plain):
    """Strict is batch-invariant, so dropping batch item 1 at a block boundary gives item 0's bytes."""
    model = build()
    inputs = small_case(model.config, batch=2)
    base, _ = plain("strict", 2)
    handle = model.add_hook(lambda p, t: t[:1], names=[name])
    out, _ = run(model, inputs, "strict")
    handle.remove()
    assert [tuple(o.shape) for o in out] == [(1, *b.shape[1:]) for b in base]
    assert same(out, [b[:1] for b in base])


# ------------------------------------------------------------------------------------- checkpoint replay
def test_a_checkpoint_replay_dispatches_through_the_forwards_table():
    """Backward runs after the forward's `use_overrides` has exited: the replay (model modules and an inserted
    wrapper alike) must still use the forward's table, so gradients equal the plain run's and nothing is traced."""
    config = CONFIGS["tiny"]
    model = build("float32", seed=5)
    block = model.transformer_blocks[0]
    block.attn.to_v = LowRank(block.attn.to_v, rank=2, seed=9)
    inputs = small_case(config, batch=1, seed=6)
    plant = {"silu": lambda x: runtime.mode_op("silu")(x) * 1.5}
    results = []
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        with runtime.use_overrides(plant):
            video, audio = model(**inputs)
        records = len(runtime.last_trace().records)
        weighted_loss(video, audio, 0).backward()
        assert len(runtime.last_trace().records) == records
        results.append({k: p.grad.clone() for k, p in model.named_parameters()})
    model.gradient_checkpointing = False
    assert results[0].keys() == results[1].keys()
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key
    assert results[0]["transformer_blocks.0.attn.to_v.a"].abs().sum() > 0


def test_accelerate_hooks_attach_to_blocks_and_norms():
    """accelerate's `ModelHook` (what its block offload is built on) wraps a module's forward in place; on a block and
    on a norm it runs once per forward, keeps the bytes, and the wrapped norm is no longer fused past."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Count(ModelHook):
        def __init__(self):
            self.calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    model = build()
    inputs = small_case(model.config, batch=1)
    base, trace = run(model, inputs)
    block, norm = model.transformer_blocks[1], model.transformer_blocks[0].norm2
    hooks = Count(), Count()
    add_hook_to_module(block, hooks[0])
    add_hook_to_module(norm, hooks[1])
    out, hooked = run(model, inputs)
    remove_hook_from_module(block)
    remove_hook_from_module(norm)
    assert [h.calls for h in hooks] == [1, 1] and same(out, base)
    assert ("rms_norm", "blocks.0.norm2") in ops_of(hooked) and ("rms_norm", "blocks.0.norm2") not in ops_of(trace)
    assert ops_of(run(model, inputs)[1]) == ops_of(trace)
