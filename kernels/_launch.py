"""Lean launches of the strict Triton kernels: one compiled kernel per (kernel, argument specialization), launched
directly, so the host pays Triton's binding, specialization and cache lookup once per shape instead of per call.

Contract
--------
- `@lean` on a top-level `@triton.jit` kernel returns a `LeanKernel`; `kernel[grid](*args, **kwargs)` launches the
  same compiled kernel with the same arguments as Triton's own `kernel[grid](...)` (the same machine code on the same
  bytes, so no output byte can change). Kernels called from other kernels stay plain `@triton.jit` functions.
- Key (`launch_key`, under the current device): everything Triton's specialization reads, made stricter so a stale
  entry is impossible: the type of every argument; a tensor's dtype and its address modulo 16 (Triton specializes
  pointers on 16-byte alignment); an int, bool, float, str or None by value (a float constexpr is compiled in); a
  tuple element by element; a host `TensorDescriptor` by its base's dtype and address modulo 16, shape, strides,
  block shape and padding; any other hashable value (a dtype, launch options such as `num_warps`) by value. A new
  shape, dtype, stride, alignment, constexpr or launch option is a new key, so it goes through Triton's own launch
  (which compiles or finds the kernel) and its compiled kernel is kept for the next call with that key. No key
  holds a tensor (no memory is kept alive). `MAX_ENTRIES` keys per kernel (oldest first out: an evicted key simply
  goes through Triton again).
- A hit launches `compiled.run(grid..., stream, function, metadata, None, None, None, *args)` -- what Triton's
  `JITFunction.run` does after its lookup -- with the arguments in the kernel's parameter order (constexprs
  included, which the launcher skips), on the current stream of the current device.
- Triton's own path is taken whenever the lean path cannot promise the same launch: `ENABLED` False (the
  `enabled(False)` context; the benchmark's "before"), the interpreter (TRITON_INTERPRET=1: CPU tests run Triton's
  own interpreted launch, unchanged), a launch hook installed (a Triton profiler); a launch whose result lacks the
  launch interface this code was written against (another Triton version, a future) is not kept, so the next call
  of its key goes through Triton again. Triton refuses a launch after a global its kernel read has changed; a hit
  does not re-check globals (the strict kernels read only module constants), VERIFY does.
- `VERIFY` True (the benchmark's check, and `verified()`): every hit also asks Triton which kernel its own lookup
  would run (`JITFunction.warmup`) and raises `LeanLaunchError` unless it is the very object the lean entry launches.
- `STATS` counts hits, misses (Triton's path, then cached) and passes (Triton's path, not cached).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Iterator

import torch

ENABLED = True
VERIFY = False
MAX_ENTRIES = 256
STATS = {"hits": 0, "misses": 0, "passes": 0}


class LeanLaunchError(RuntimeError):
    """The lean launcher's cached kernel differs from the one Triton's own lookup picks (VERIFY mode)."""


def _interpreted() -> bool:
    from .registry import interpreted

    return interpreted()


_KNOBS: Any = None


def _hooked() -> bool:
    """A Triton launch hook is installed (a profiler): Triton's own launch passes it the metadata it needs. (Triton
    3.6 keeps None there; later versions an empty HookChain.)"""
    global _KNOBS
    if _KNOBS is None:
        try:
            from triton import knobs
        except ImportError:  # pragma: no cover - a Triton without knobs: treat as hooked, i.e. never lean
            return True
        _KNOBS = knobs.runtime
    for hook in (_KNOBS.launch_enter_hook, _KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


_PLAIN = frozenset((int, str, bool, float, type(None)))
try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without host descriptors: `_arg_key` covers look-alikes
    _TensorDescriptor = None


def _arg_key(value: Any) -> Any:
    """One argument's part of the key (module docstring)."""
    if isinstance(value, torch.Tensor):
        return ("t", value.dtype, value.device, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value)
    if isinstance(value, float):
        return ("f", value)  # by value: a float constexpr is compiled in (a NaN never hits: a miss, never stale)
    if isinstance(value, (tuple, list)):  # Triton's tuple arguments, element by element (never a tensor's id)
        return ("T", type(value), tuple(_arg_key(v) for v in value))
    base = getattr(value, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(value, "block_shape"):  # a host TensorDescriptor
        return ("d", base.dtype, base.device, base.data_ptr() % 16 == 0, tuple(value.shape), tuple(value.strides),
                tuple(value.block_shape), getattr(value, "padding", None),
                getattr(value, "round_f32_to_tf32", None))
    hash(value)  # an unhashable argument is a bug at the call site: say so here, not as a stale entry
    return ("v", type(value), value)


def _special(a: Any) -> tuple:
    """The key part of an argument that is no plain value: a tensor's dtype and address modulo 16 (Triton
    specializes pointers on 16-byte alignment), else `_arg_key`."""
    t = type(a)
    if t is torch.Tensor or t is torch.nn.Parameter:
        return (a.dtype, a.data_ptr() & 15)
    if t is _TensorDescriptor:
        base = a.base
        return (base.dtype, base.data_ptr() & 15, tuple(a.shape), tuple(a.strides), tuple(a.block_shape), a.padding,
                getattr(a, "round_f32_to_tf32", None))
    return _arg_key(a)


def launch_key(args: tuple, kwargs: dict) -> tuple:
    """The cache key of one launch's arguments: the type of every argument (so 1, 1.0 and True differ), each plain
    value (int, str, bool, float, None) itself and any other argument as a `_special` tuple (a plain value is never a
    tuple, so the two cannot be confused); keyword arguments by (name, value) in the call's order (another order is
    only a miss) when all are plain, else name by name the same way."""
    values = kwargs.values()
    if _PLAIN.issuperset(map(type, values)):
        kw = (tuple(kwargs.items()), tuple(map(type, values)))
    else:
        kw = tuple((n, type(v), v if type(v) in _PLAIN else _special(v)) for n, v in kwargs.items())
    return (tuple(map(type, args)), tuple(a if type(a) in _PLAIN else _special(a) for a in args), kw)


_DRIVER: Any = None


def _current_stream() -> tuple[int, int]:
    global _DRIVER
    if _DRIVER is None:
        from triton.runtime import driver

        _DRIVER = driver
    active = _DRIVER.active
    device = active.get_current_device()
    return device, active.get_current_stream(device)


def _launchable(compiled: Any) -> bool:
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))


class _Entry:
    __slots__ = ("compiled", "order")

    def __init__(self, compiled: Any, order: Callable[[tuple, dict], list]) -> None:
        self.compiled = compiled
        self.order = order


class LeanKernel:
    """A top-level Triton kernel whose launches are cached per key (module docstring). `fn` is the `@triton.jit`
    function; `stream` returns (device, stream handle) of the launch (injectable for tests)."""

    def __init__(self, fn: Any, stream: Callable[[], tuple[int, int]] = _current_stream,
                 lean_here: Callable[[], bool] | None = None) -> None:
        self.fn = fn
        self._stream = stream
        if lean_here is None:  # the interpreter is fixed when the kernel is decorated (triton.jit chose it then)
            lean_here = (lambda: False) if _interpreted() else (lambda: not _hooked())
        self._lean_here = lean_here
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getattr__(self, name: str) -> Any:  # the JITFunction's own attributes (fn.cache, fn.warmup, ...)
        return getattr(self.__dict__["fn"], name)

    def __getitem__(self, grid: tuple) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def entries(self) -> int:
        return len(self._entries)

    def _order(self, n_args: int, kwargs: dict) -> Callable[[tuple, dict], list]:
        """args, kwargs -> the kernel's parameters in declaration order (the launcher's argument list)."""
        params = self.fn.params  # Triton's KernelParam list: .name, .default
        names = [p.name for p in params[n_args:]]
        defaults = {p.name: p.default for p in params[n_args:]}  # Triton's first launch refused any missing one

        def order(args: tuple, kw: dict) -> list:
            return [*args, *(kw[n] if n in kw else defaults[n] for n in names)]

        return order

    def launch(self, grid: tuple, args: tuple, kwargs: dict) -> Any:
        if not ENABLED or not self._lean_here():
            STATS["passes"] += 1
            return self.fn[grid](*args, **kwargs)
        device, stream = self._stream()
        key = (device, launch_key(args, kwargs))
        entry = self._entries.get(key)
        if entry is None:
            STATS["misses"] += 1
            compiled = self.fn[grid](*args, **kwargs)  # Triton's own launch: compiles or finds the kernel
            if not _launchable(compiled):  # (a Triton whose launch returns a future, or another interface): not kept
                return compiled
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.popitem(last=False)
            self._entries[key] = _Entry(compiled, self._order(len(args), kwargs))
            return compiled
        STATS["hits"] += 1
        compiled = entry.compiled
        if VERIFY:
            theirs = self.fn.warmup(*args, grid=grid, **kwargs)
            if theirs is not compiled:
                raise LeanLaunchError(f"{self.__name__}: the lean launcher's kernel for key {key} is not the one "
                                      "Triton's own lookup runs")
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *entry.order(args, kwargs))
        return compiled


def lean(fn: Any) -> LeanKernel:
    """Decorator for a top-level `@triton.jit` kernel (put it above `@triton.jit`)."""
    return LeanKernel(fn)


@contextlib.contextmanager
def enabled(on: bool) -> Iterator[None]:
    """Lean launches on or off inside the block (off: every launch is Triton's own, and strict dispatch validates a
    call in the kernel's run again, as before the lean path)."""
    global ENABLED
    saved, ENABLED = ENABLED, bool(on)
    try:
        yield
    finally:
        ENABLED = saved


@contextlib.contextmanager
def verified() -> Iterator[None]:
    """VERIFY inside the block: every lean hit is checked against Triton's own lookup."""
    global VERIFY
    saved, VERIFY = VERIFY, True
    try:
        yield
    finally:
        VERIFY = saved
