"""runtime: mode validation, overrides, `mode_op` (dispatch as the mode would, without overrides or records), and
which exceptions from a kernel's check mean "strict cannot serve"."""

import pytest
import torch

from h3lab.execution import runtime


def test_unknown_mode_and_override_are_refused():
    with pytest.raises(ValueError, match="mode 'turbo': must be one of strict, audit, auto, off, fast"):
        with runtime.use_mode("turbo"):
            pass
    with pytest.raises(ValueError, match=r"override for unknown op\(s\) \['gelu'\]"):
        with runtime.use_overrides({"gelu": lambda x: x}):
            pass


def test_mode_op_ignores_overrides_and_fails_closed(monkeypatch):
    x = torch.randn(3, 5)
    calls = []

    def plant(a):
        calls.append(1)
        return runtime.mode_op("silu")(a) + 1  # delegates to the mode's own op: no recursion into the override

    with runtime.use_overrides({"silu": plant}):
        out = runtime.ops().silu(x, point="t")
    assert calls == [1] and torch.equal(out, torch.nn.functional.silu(x) + 1)
    from h3kernels import registry

    monkeypatch.delitem(registry.STRICT_OPS, "silu")
    with runtime.use_mode("strict"), pytest.raises(runtime.StrictError, match="no strict kernel is registered for op 'silu'"):
        runtime.mode_op("silu")(x)
    with runtime.use_mode("auto"):
        assert torch.equal(runtime.mode_op("silu")(x), torch.nn.functional.silu(x))


def test_only_strict_unsupported_from_a_check_means_cannot_serve(monkeypatch):
    """A kernel's check refusing a call (`StrictUnsupported`) lets auto fall back and makes strict fail closed; any
    other exception from a check is a bug in the check and must surface in every mode, never a silent fallback."""
    from h3kernels import registry

    # auto's per-op dispatch on a CPU tensor (by default auto runs torch on CPU and never consults a check there)
    monkeypatch.setattr(runtime, "AUTO_ON_CPU", "interpreter")
    x = torch.randn(3, 5)
    real = registry.STRICT_OPS["silu"]

    def refusing(a):
        raise registry.StrictUnsupported(f"silu: refused shape {list(a.shape)}")

    def buggy(a):
        return {"kernel_id": a.no_such_attribute}  # AttributeError: a bug inside the check

    monkeypatch.setitem(registry.STRICT_OPS, "silu", registry.StrictOp("silu", run=real.run, check=refusing))
    with runtime.use_mode("auto"):
        ops = runtime.ops()
        assert torch.equal(ops.silu(x, point="p"), torch.nn.functional.silu(x))
    (rec,) = ops.trace.records
    assert (rec.actual, rec.fallback) == ("torch", "auto fallback: silu: refused shape [3, 5]")
    with runtime.use_mode("strict"), pytest.raises(runtime.StrictError, match=r"at p .*silu: refused shape \[3, 5\]$"):
        runtime.ops().silu(x, point="p")

    monkeypatch.setitem(registry.STRICT_OPS, "silu", registry.StrictOp("silu", run=real.run, check=buggy))
    for mode in ("auto", "strict"):
        with runtime.use_mode(mode), pytest.raises(AttributeError, match="no_such_attribute"):
            runtime.ops().silu(x, point="p")
        assert runtime.last_trace().records == []
