"""What arithmetic a generation actually ran, in one line, and whether strict can run in this process.

`what_ran(trace, mode, fallback_reasons)` is a pure function of a trajectory's provenance summary
(`result.trajectory.manifest["trace"]`: `mode`, `device`, `forwards`, `untraced_forwards`, `ops` = op -> {backend:
calls}) and the requested mode. It names the backends that served the op calls, with their counts, and says when the
request and the arithmetic differ -- `auto` that fell back to torch, `strict` that did not run strict (it cannot: strict
fails closed), ablation overrides:

    strict: 1,230 strict / 0 torch op calls in 20 forwards (strict kernels in Triton's interpreter, cpu)
    auto → torch: 0 strict / 1,620 torch op calls in 20 forwards (device cpu needs TRITON_INTERPRET=1 (Triton's
        interpreter) for strict mode)
    off: 0 strict / 1,620 torch op calls in 20 forwards (the reference torch arithmetic)
    off: 0 strict / 1,616 torch / 4 override op calls in 20 forwards (the reference torch arithmetic; 4 planted by ablations); ablations on: A6

`fallback_reasons` (optional) are the `OpRecord.fallback` strings of a traced forward (`result.trace.fallbacks`): the
summary keeps counts only, so the reason an `auto` call went to torch comes from there, quoted as recorded (the most
common one); without them the line says "reason not recorded".

`strict_setup(device)` reads this process's state (the environment and which Triton kernels exist) and says whether
strict can run on `device`, and if not, what would make it run. On CPU the strict kernels run only in Triton's
interpreter, and Triton decides interpreter or compiler when a kernel is *created* (`@triton.jit` at import of
`h3kernels`, which the first generation of any mode triggers): setting `TRITON_INTERPRET=1` works before that import
and never after it -- after it strict fails, and so does auto wherever it would call a kernel on the CPU (Triton's "0
active drivers"; a runtime whose auto runs torch on the CPU, `runtime.AUTO_ON_CPU == "torch"`, is unaffected) -- so
the only remedy then is a fresh kernel/process that sets it first.

`check_strict_runs(mode, device, what)` is the one refusal every front end applies before any work (the CLI with
its flag checks, `!mode strict`, `Session.generate` / `check_request`, a replay's validation): strict on a device
where `strict_setup` says it cannot run raises one `ValidationError` line naming the remedy. h3lab never sets
`TRITON_INTERPRET` behind the user's back from the CLI (it changes what every later kernel does); the notebook
panel's "set up strict" button does it on request (`enable_interpreter`).

No front-end imports; the REPL, the CLI and the notebook panel share these lines.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

INTERPRET_ENV = "TRITON_INTERPRET"
_EXPECTED = {"strict": "strict", "off": "torch", "audit": "torch", "fast": "fast"}  # auto: whatever served each call
_MODE_NOTES = {"off": "the reference torch arithmetic", "audit": "the production path, every op recorded as not strict",
               "fast": "FP8 projections and attention, not strict"}


def backend_counts(trace: Mapping[str, Any] | None) -> dict[str, int]:
    """backend -> op calls summed over every op of the summary (`strict`, `torch`, `override`, ...)."""
    out: dict[str, int] = {}
    for backends in ((trace or {}).get("ops") or {}).values():
        for backend, n in backends.items():
            out[backend] = out.get(backend, 0) + int(n)
    return out


def fallback_reason(text: str) -> str:
    """An `OpRecord.fallback` without its "auto fallback: " and "<op>: " prefixes: the reason itself, as recorded."""
    reason = str(text).removeprefix("auto fallback: ")
    head, sep, rest = reason.partition(": ")
    return rest if sep and head.isidentifier() else reason


def _reasons(fallback_reasons: Iterable[str]) -> str:
    """The most common recorded reason (word for word), and how many others there were."""
    counts: dict[str, int] = {}
    for text in fallback_reasons:
        reason = fallback_reason(text)
        if reason:
            counts[reason] = counts.get(reason, 0) + 1
    if not counts:
        return ""
    ordered = sorted(counts, key=lambda r: -counts[r])
    return ordered[0] + (f"; {len(ordered) - 1} other reason(s)" if len(ordered) > 1 else "")


def what_ran(trace: Mapping[str, Any] | None, mode: str | None = None, fallback_reasons: Iterable[str] = (),
             ablations: Iterable[str] = ()) -> str:
    """One line: requested mode (-> what actually served the calls when that differs), the op-call counts per
    backend and the number of forwards, and why (interpreter, fallback reason, the mode's meaning); `ablations`,
    the factors the run switched on (`settings.ablations`), are named at the end -- they change inputs, hooks or
    single ops, and only the op overrides among them show in the counts."""
    trace = trace or {}
    mode = mode or str(trace.get("mode") or "?")
    forwards = int(trace.get("forwards") or 0)
    untraced = int(trace.get("untraced_forwards") or 0)
    counts = backend_counts(trace)
    if forwards == 0:
        return f"{mode}: no forward ran"
    if untraced == forwards:
        return f"{mode}: {forwards:,} forwards untraced (the model records no provenance, e.g. Diffusers'): backend unknown"
    strict, torch_, override = counts.get("strict", 0), counts.get("torch", 0), counts.get("override", 0)
    fast_ = counts.get("fast", 0)
    other = {b: n for b, n in counts.items() if b not in ("strict", "torch", "override", "fast")}
    served = [b for b, n in (("strict", strict), ("torch", torch_), ("fast", fast_)) if n]
    actual = " + ".join(served) or ("override" if override else "nothing")
    head = mode if _EXPECTED.get(mode, "strict") == actual else f"{mode} → {actual}"
    parts = [f"{strict:,} strict", f"{torch_:,} torch"]
    parts += [f"{override:,} override"] if override else []
    parts += [f"{fast_:,} fast"] if fast_ else []
    parts += [f"{n:,} {b}" for b, n in sorted(other.items())]
    line = f"{head}: {' / '.join(parts)} op calls in {forwards:,} forwards"
    if untraced:
        line += f" ({untraced:,} untraced)"
    notes = []
    if strict:
        device = str(trace.get("device") or "?")
        notes.append(f"strict kernels in Triton's interpreter, {device}" if device.startswith("cpu")
                     else f"strict Triton kernels, {device}")
    if mode in _MODE_NOTES:
        notes.append(_MODE_NOTES[mode])
    elif torch_:  # strict/auto calls that went to torch
        notes.append(_reasons(fallback_reasons) or "reason not recorded")
    if override:
        notes.append(f"{override:,} planted by ablations")
    line += f" ({'; '.join(notes)})" if notes else ""
    factors = list(ablations)
    return line + (f"; ablations on: {', '.join(factors)}" if factors else "")


# ====================================================================================== strict in this process
@dataclass(frozen=True)
class StrictSetup:
    """Whether strict kernels can run on a device in this process: `ready`; `can_enable` (setting
    `TRITON_INTERPRET=1` now would make them run: CPU, no Triton kernel created yet); `line` says which, truthfully."""

    ready: bool
    can_enable: bool
    line: str
    auto_ok: bool = True  # False: an `auto` run would fail too (kernels compiled, TRITON_INTERPRET=1 set since, and
    # auto calls kernels on the CPU)


def _kernel_kind() -> str | None:
    """'interpreter' / 'compiled' for the Triton kernels `h3kernels` created at import, None before that import."""
    mods = [m for name, m in list(sys.modules.items()) if name == "h3kernels" or name.startswith("h3kernels.")]
    if not mods:
        return None
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a dependency
        return "compiled"
    for mod in mods:
        for value in vars(mod).values():
            if isinstance(value, InterpretedFunction):
                return "interpreter"
            if isinstance(value, JITFunction):
                return "compiled"
    return None


def _auto_runs_torch_on_cpu() -> bool:
    """The runtime's declared policy: auto on CPU tensors runs the torch op and never a kernel (`AUTO_ON_CPU`)."""
    from . import runtime

    return getattr(runtime, "AUTO_ON_CPU", "interpreter") == "torch"


def strict_setup(device: Any = "cpu") -> StrictSetup:
    """See the module docstring. `device`: the session's device (a `torch.device` or its string)."""
    kind = str(getattr(device, "type", device)).split(":")[0]
    if kind == "cuda":
        return StrictSetup(True, False, "strict: Triton kernels on cuda")
    if kind != "cpu":
        return StrictSetup(False, False, f"strict: no strict kernels for device {kind} (cuda, or cpu interpreted)")
    env = os.environ.get(INTERPRET_ENV, "0") == "1"
    created = _kernel_kind()
    if created == "interpreter":
        if env:
            return StrictSetup(True, False, "strict on cpu: Triton's interpreter (exact but slow: keep sizes tiny)")
        return StrictSetup(False, False, f"strict on cpu: the kernels were created for the interpreter but {INTERPRET_ENV} "
                                         "was unset since; set it back to 1")
    if created == "compiled":
        if env and not _auto_runs_torch_on_cpu():
            return StrictSetup(False, False, f"strict and auto on cpu: impossible in this process -- its Triton kernels "
                                             f"were created without {INTERPRET_ENV}=1 and it was set since (Triton then "
                                             "finds no driver); use off, or restart the kernel with it set first",
                               auto_ok=False)
        return StrictSetup(False, False, f"strict on cpu: impossible in this process -- its Triton kernels were created "
                                         f"without {INTERPRET_ENV}=1 (at the first generation); restart the kernel and set "
                                         f"os.environ['{INTERPRET_ENV}'] = '1' before the first generation")
    if env:
        return StrictSetup(True, False, "strict on cpu: Triton's interpreter (exact but slow: keep sizes tiny)")
    return StrictSetup(False, True, f"strict on cpu: needs {INTERPRET_ENV}=1, which can still be set now (no Triton "
                                    "kernel exists yet in this process)")


def enable_interpreter() -> StrictSetup:
    """Set `TRITON_INTERPRET=1` in this process when that still works (no Triton kernel created yet); returns the
    new `strict_setup("cpu")`. Never changes anything once kernels exist (it would break strict and auto)."""
    if strict_setup("cpu").can_enable:
        os.environ[INTERPRET_ENV] = "1"
    return strict_setup("cpu")


def check_strict_runs(mode: Any, device: Any, what: str = "mode strict") -> None:
    """Refuse `mode == "strict"` on a `device` where strict kernels cannot run in this process (module docstring):
    a one-line `ValidationError` saying what would make it run."""
    if mode != "strict":
        return
    setup = strict_setup(device)
    if setup.ready:
        return
    from ..errors import ValidationError

    kind = str(getattr(device, "type", device)).split(":")[0]
    if kind == "cpu" and os.environ.get(INTERPRET_ENV, "0") != "1":
        raise ValidationError(f"{what} on the {kind}: strict kernels run there only in Triton's interpreter; export "
                              f"{INTERPRET_ENV}=1 before starting h3lab (in a notebook: set it in os.environ before "
                              "the first generation), or use mode off or auto")
    raise ValidationError(f"{what} on the {kind}: {setup.line.split(': ', 1)[-1]}")
