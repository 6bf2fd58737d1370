"""The lean launcher (`kernels/_launch.py`): its cache key never reuses a launcher for a changed shape, dtype, stride,
alignment or constexpr; hits launch the cached compiled kernel with the arguments in parameter order; Triton's own
path is taken when lean is off, interpreted or not launchable; VERIFY catches a disagreement; and strict dispatch
validates a call once with the same bytes, still refusing bad inputs."""

from types import SimpleNamespace

import pytest
import torch

from h3kernels import _launch, gemm, registry
from h3kernels._launch import LeanKernel, LeanLaunchError, launch_key
from h3lab.execution import runtime


def _key(*args, **kwargs):
    return launch_key(args, kwargs)


def test_key_changes_with_everything_triton_specializes():
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    same = torch.randn(8, 32, dtype=torch.bfloat16)
    base = _key(x, 8, 32, x.stride(0), 1.0, BLOCK=64, PRECISION="ieee", num_warps=4)
    assert base == _key(same, 8, 32, same.stride(0), 1.0, BLOCK=64, PRECISION="ieee", num_warps=4)  # not by id
    changed = [
        _key(x.float(), 8, 32, x.stride(0), 1.0, BLOCK=64, PRECISION="ieee", num_warps=4),  # dtype
        _key(x, 9, 32, x.stride(0), 1.0, BLOCK=64, PRECISION="ieee", num_warps=4),  # a shape int
        _key(x, 8, 32, 64, 1.0, BLOCK=64, PRECISION="ieee", num_warps=4),  # a stride
        _key(x.view(-1)[1:], 8, 32, x.stride(0), 1.0, BLOCK=64, PRECISION="ieee", num_warps=4),  # 2-byte aligned
        _key(x, 8, 32, x.stride(0), 0.5, BLOCK=64, PRECISION="ieee", num_warps=4),  # a float (constexpr or not)
        _key(x, 8, 32, x.stride(0), 1.0, BLOCK=128, PRECISION="ieee", num_warps=4),  # a constexpr
        _key(x, 8, 32, x.stride(0), 1.0, BLOCK=64, PRECISION="tf32x3", num_warps=4),  # a constexpr string
        _key(x, 8, 32, x.stride(0), 1.0, BLOCK=64, PRECISION="ieee", num_warps=8),  # a launch option
        _key(x, True, 32, x.stride(0), 1.0, BLOCK=64, PRECISION="ieee", num_warps=4),  # bool is not int
    ]
    assert len({base, *changed}) == len(changed) + 1
    assert _key(x, 1) != _key(x, True) and _key(None) != _key(0)
    # tuples element by element, never by the tensors' identity
    assert _key((x, 3)) == _key((same, 3)) != _key((x.float(), 3))


def test_key_of_a_host_tensor_descriptor():
    from triton.tools.tensor_descriptor import TensorDescriptor

    w = torch.randn(64, 32)
    d = TensorDescriptor.from_tensor(w, [16, 8])
    assert _key(d) == _key(TensorDescriptor.from_tensor(torch.randn(64, 32), [16, 8]))
    assert len({_key(d), _key(TensorDescriptor.from_tensor(w, [32, 8])),  # block shape
                _key(TensorDescriptor.from_tensor(w[:32], [16, 8])),  # shape
                _key(TensorDescriptor.from_tensor(w.bfloat16(), [16, 8]))}) == 4  # dtype


class _Compiled:
    def __init__(self):
        self.function, self.packed_metadata, self.calls = "fn-handle", "meta", []

    def run(self, *a):
        self.calls.append(a)


class _FakeJit:
    """What LeanKernel reads of a JITFunction: params (name, default), [grid](...) and warmup(...)."""

    def __init__(self):
        self.params = [SimpleNamespace(name=n, default=d) for n, d in
                       (("x_ptr", None), ("n", None), ("BLOCK", None), ("FLAG", 7))]
        self.compiled, self.own_launches = {}, []

    def _compiled_for(self, args, kwargs):
        return self.compiled.setdefault(launch_key(args, kwargs), _Compiled())

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.own_launches.append((grid, args, kwargs))
            return self._compiled_for(args, kwargs)
        return go

    def warmup(self, *args, grid, **kwargs):
        return self._compiled_for(args, kwargs)


def _lean():
    fake = _FakeJit()
    return fake, LeanKernel(fake, stream=lambda: (0, 1234), lean_here=lambda: True)


def test_hits_launch_the_cached_kernel_in_parameter_order():
    fake, k = _lean()
    x = torch.randn(16)
    k[(3,)](x, 16, BLOCK=32, num_warps=4)  # miss: Triton's own launch
    assert len(fake.own_launches) == 1 and k.entries() == 1
    k[(5, 2)](torch.randn(16), 16, BLOCK=32, num_warps=4)  # hit: same key
    assert len(fake.own_launches) == 1
    (compiled,) = fake.compiled.values()
    (call,) = compiled.calls
    assert call[:9] == (5, 2, 1, 1234, "fn-handle", "meta", None, None, None)
    assert call[9].shape == (16,) and call[10:] == (16, 32, 7)  # parameter order, FLAG from its default
    k[(3,)](x, 17, BLOCK=32, num_warps=4)  # another shape int: a new key, Triton's path again
    k[(3,)](x.double(), 16, BLOCK=32, num_warps=4)  # another dtype
    assert len(fake.own_launches) == 3 and k.entries() == 3


def test_triton_path_when_off_unlaunchable_or_interpreted():
    fake, k = _lean()
    x = torch.randn(4)
    with _launch.enabled(False):
        k[(1,)](x, 4, BLOCK=8)
        k[(1,)](x, 4, BLOCK=8)
    assert len(fake.own_launches) == 2 and k.entries() == 0
    plain = LeanKernel(fake, stream=lambda: (0, 0), lean_here=lambda: False)  # the interpreter, a launch hook
    plain[(1,)](x, 4, BLOCK=8)
    plain[(1,)](x, 4, BLOCK=8)
    assert len(fake.own_launches) == 4 and plain.entries() == 0
    fake.compiled[launch_key((x, 5), {"BLOCK": 8})] = object()  # a compiled object without run/function/metadata
    odd = LeanKernel(fake, stream=lambda: (0, 0), lean_here=lambda: True)
    odd[(1,)](x, 5, BLOCK=8)
    odd[(1,)](x, 4, BLOCK=8)
    odd[(1,)](x, 5, BLOCK=8)  # not kept: Triton's path again
    assert len(fake.own_launches) == 7 and odd.entries() == 1


def test_verify_catches_a_kernel_triton_would_not_run():
    fake, k = _lean()
    x = torch.randn(4)
    k[(1,)](x, 4, BLOCK=8)
    with _launch.verified():
        k[(1,)](x, 4, BLOCK=8)  # agrees
        fake.compiled.clear()  # Triton's lookup now finds another object
        with pytest.raises(LeanLaunchError, match="not the one Triton's own lookup runs"):
            k[(1,)](x, 4, BLOCK=8)


def test_interpreted_launches_take_tritons_path():
    before = _launch.STATS["passes"]
    x, w = torch.randn(5, 16), torch.randn(8, 16)
    y = gemm.linear(x, w)
    assert _launch.STATS["passes"] > before and gemm._gemm_kernel.entries() == 0
    assert torch.allclose(y, gemm.reference(x, w), rtol=1e-5, atol=1e-5)


def test_dispatch_validates_once_same_bytes_and_still_refuses(monkeypatch):
    calls = []
    real = gemm._validate
    monkeypatch.setattr(gemm, "_validate", lambda *a: (calls.append(a[0]), real(*a))[1])
    x, w, b = torch.randn(2, 3, 16), torch.randn(8, 16), torch.randn(8)
    with runtime.use_mode("strict"):
        lean_out = runtime.ops().linear(x, w, b, point="p")
        assert calls == ["linear"]
        with _launch.enabled(False):
            before_out = runtime.ops().linear(x, w, b, point="p")
        assert calls == ["linear"] * 3  # the check, then linear's own validation again
        assert torch.equal(lean_out, before_out) and lean_out.shape == (2, 3, 8)
        with pytest.raises(runtime.StrictError, match=r"x.shape\[-1\] = 15 does not match weight K = 16"):
            runtime.ops().linear(torch.randn(2, 15), w, b, point="p")
        with pytest.raises(runtime.StrictError, match="K = 12 is not a multiple of 8"):
            runtime.ops().linear_tree(torch.randn(2, 12), torch.randn(8, 12), None, point="p")
    with pytest.raises(registry.StrictUnsupported, match="mixed dtypes"):
        gemm.linear(x.bfloat16(), w, b)  # the op called directly still validates


def test_gated_residual_and_modulate_checked_same_bytes_and_refusals():
    r, y = torch.randn(1, 6, 8), torch.randn(1, 6, 8)
    gate, index = torch.randn(3, 8), torch.tensor([0, 2, 1, 1, 0, 2])
    with runtime.use_mode("strict"):
        ops = runtime.ops()
        lean_out = (ops.gated_residual(r, gate, index, y, point="g"), ops.modulate(r, gate, gate, index, point="m"))
        with _launch.enabled(False):
            before = (ops.gated_residual(r, gate, index, y, point="g"), ops.modulate(r, gate, gate, index, point="m"))
        assert all(torch.equal(a, b) for a, b in zip(lean_out, before))
        with pytest.raises(runtime.StrictError, match="index value 3 out of range for a table of 3 rows"):
            ops.gated_residual(r, gate, torch.tensor([0, 2, 1, 3, 0, 2]), y, point="g")
        with pytest.raises(runtime.StrictError, match="differs from the activation dtype"):
            ops.modulate(r, gate.double(), gate, index, point="m")
