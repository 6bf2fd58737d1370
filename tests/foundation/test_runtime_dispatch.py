"""runtime: mode validation, overrides, and `mode_op` (dispatch as the mode would, without overrides or records)."""

import pytest
import torch

from h3lab import runtime


def test_unknown_mode_and_override_are_refused():
    with pytest.raises(ValueError, match="mode 'fast': must be one of strict, audit, auto, off"):
        with runtime.use_mode("fast"):
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
