"""Registry of strict kernels, keyed by the op names of `h3lab.execution.runtime.REFERENCE_OPS`.

A kernel file registers an entry with `register(op_name, run=fn, check=fn)`:
- `check(*args, **kwargs)` validates a call without running it and returns the provenance dict
  `{"kernel_id": str, "tile": str, "acc_dtype": str}`; it raises `StrictUnsupported` (message naming the value and
  the rule) for any shape, dtype, device or layout the kernel does not serve. Kernel ids follow one scheme,
  `h3kernels.<file>.<kernel>` plus qualifiers (version, dtype, math library), e.g. `h3kernels.rope.rope.v1`,
  `h3kernels.gemm.linear.kloop.bfloat16`.
- `run(*args, **kwargs)` computes the op (autograd-aware) with the same signature and semantics as the reference op.
- `run_checked` (optional) computes it without validating again: what strict dispatch calls after `check` passed,
  so a call is validated once (`StrictOp.checked`; with lean launches off, `_launch.enabled(False)`, dispatch calls
  `run` as before). Calling `run` directly still validates.

`STRICT_OPS` is filled by importing `OP_MODULES` in order; a module that is missing simply leaves its ops
unregistered, and strict mode then fails closed on them.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from . import _launch


class StrictUnsupported(ValueError):
    """The strict kernel refuses this call (shape, dtype, device, contiguity or index range)."""


@dataclass(frozen=True)
class StrictOp:
    name: str
    run: Callable[..., Any]
    check: Callable[..., dict]
    run_checked: Callable[..., Any] | None = None

    def checked(self, *args: Any, **kwargs: Any) -> Any:
        """The op on a call `check` has accepted: `run_checked` (no second validation) when lean launches are on."""
        if self.run_checked is not None and _launch.ENABLED:
            return self.run_checked(*args, **kwargs)
        return self.run(*args, **kwargs)


STRICT_OPS: dict[str, StrictOp] = {}


def register(name: str, *, run: Callable[..., Any], check: Callable[..., dict],
             run_checked: Callable[..., Any] | None = None) -> None:
    if name in STRICT_OPS:
        raise RuntimeError(f"strict op {name!r} registered twice")
    STRICT_OPS[name] = StrictOp(name=name, run=run, check=check, run_checked=run_checked)


def interpreted() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1), the only way strict runs on CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: Any, op: str) -> None:
    """Strict kernels run on CUDA, or on CPU only under the Triton interpreter; all tensors on one device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise StrictUnsupported(f"{op}: tensors on mixed devices {sorted(map(str, devices))}")
    for device in devices:
        if device.type == "cpu" and not interpreted():
            raise StrictUnsupported(f"{op}: device cpu needs TRITON_INTERPRET=1 (Triton's interpreter) for strict mode")
        if device.type not in ("cpu", "cuda"):
            raise StrictUnsupported(f"{op}: device {device} is not supported by strict kernels (cuda, or cpu interpreted)")


# Kernel modules, one op family each; imported in this order.
OP_MODULES = (
    "gemm",
    "attention",
    "rms_norm",
    "modulate",
    "norm_modulate",
    "rope",
    "qk_norm_rope",
    "residual_norm_modulate",
    "elementwise",
    "timestep",
    "packing",
)


def _load() -> None:
    for mod in OP_MODULES:
        try:
            importlib.import_module(f"h3kernels.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"h3kernels.{mod}":
                raise


_load()
