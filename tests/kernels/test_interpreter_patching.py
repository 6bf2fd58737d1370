"""`kernels/_interpreter_patching.py`: under TRITON_INTERPRET=1 a launch patches triton.language once, its @jit
helpers reuse that patching, every builtin is restored when the launch ends, and a kernel's bytes are those of
Triton's own per-call patching."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

import h3kernels  # noqa: F401 - installs the interpreter patches

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's own patching")


@triton.jit
def _scaled(x, s):
    return x * s + tl.sqrt(tl.abs(x))


@triton.jit
def _row_sums_kernel(x_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0)
    y = _scaled(x, 1.5)
    tl.store(out_ptr + row, tl.sum(y, axis=0) + tl.max(y, axis=0))


def _launch(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.float32)
    _row_sums_kernel[(x.shape[0],)](x, out, N=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def _fresh(rows: int = 7, cols: int = 13) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")))


def test_the_patched_interpreter_computes_the_reference():
    x = _fresh()
    y = x * 1.5 + x.abs().sqrt()
    torch.testing.assert_close(_launch(x), y.sum(1) + y.amax(1), rtol=1e-5, atol=1e-5)


def test_every_builtin_is_restored_after_a_launch():
    # before the test below: Triton's own helper patching leaves triton.language.core patched after a launch
    _launch(_fresh())
    for module in (tl, tl.core):
        for name in ("load", "store", "program_id", "arange"):
            assert tl.core.is_builtin(getattr(module, name)), f"{module.__name__}.{name} left patched"
    assert tl.core.is_builtin(tl.core.tensor.__add__)


def test_cached_lookups_answer_as_triton_does(monkeypatch):
    """`_cache_lookups`: the dtype table and the builtin lists give Triton's own answers (every language dtype,
    blocks of them, pointers and blocks of pointers; the same attributes patched on every language object), and a
    launch's bytes are those of Triton's own lookups. Before `test_bytes_equal_triton_own_patching`, whose run of
    Triton's own helper patching leaves triton.language.core patched (its scan would then find fewer builtins)."""
    from triton.runtime import interpreter

    ours_np, ours_patch = interpreter._get_np_dtype, interpreter._patch_builtin
    theirs_np, theirs_patch = ours_np._h3_original, ours_patch._h3_original
    scalars = [v for v in vars(tl).values() if type(v) is tl.dtype]
    assert len(scalars) >= 12
    for dtype in scalars:
        for view in (dtype, tl.block_type(dtype, [4, 2]), tl.pointer_type(dtype),
                     tl.block_type(tl.pointer_type(dtype), [8])):
            try:
                expected = theirs_np(view)
            except KeyError:
                with pytest.raises(KeyError):
                    ours_np(view)
                continue
            assert ours_np(view) == expected and ours_np(view) == expected, view  # the second from the table

    for obj in (tl, tl.core, tl.core.tensor, tl.math):
        ours, theirs = [], []
        monkeypatch.setattr(interpreter, "_patch_attr", lambda pkg, name, *a: ours.append(name))
        ours_patch(obj, None, None)
        monkeypatch.setattr(interpreter, "_patch_attr", lambda pkg, name, *a: theirs.append(name))
        theirs_patch(obj, None, None)
        assert ours == theirs and len(ours) > 3, obj
    monkeypatch.undo()
    x = _fresh(6, 17)
    ours = _launch(x)
    monkeypatch.setattr(interpreter, "_get_np_dtype", theirs_np)
    monkeypatch.setattr(interpreter, "_patch_builtin", theirs_patch)
    assert torch.equal(ours, _launch(x))


def test_bytes_equal_triton_own_patching(monkeypatch):
    from triton.runtime import interpreter

    x = _fresh(9, 21)
    ours = _launch(x)
    patch_lang, grid_call = interpreter._patch_lang._h3_originals
    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", grid_call)
    assert torch.equal(ours, _launch(x))


def test_one_patching_per_launch_whatever_the_helper_calls(monkeypatch):
    from triton.runtime import interpreter

    calls = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    _launch(_fresh(3, 5))
    per_launch = len(calls)
    calls.clear()
    _launch(_fresh(40, 5))  # 40 programs, each calling three helpers
    assert len(calls) == per_launch <= 12
