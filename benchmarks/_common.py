"""Plumbing shared by the benchmarks in this folder: imports from a bare checkout, the device, the provenance header
of the DESIGN.md "Evidence" schema, the JSON write, the printed table, the timers and the comparisons.

A kernel benchmark's main reads (forward / trajectory build their own parser and pass --tiny as the CPU flag):

    parser = kernel_parser(__doc__.splitlines()[0], "gemm")   # --out --dry-run --no-backward --sweep, then its own
    args = parser.parse_args(argv)
    device = prepare(parser, cpu=args.dry_run, flag="--dry-run")   # before anything imports triton
    doc = header("gemm", __file__, argv, device)                     # results: [] to fill
    ...
    write(args.out, doc)

- `prepare` makes `h3lab` and `h3kernels` importable without an install (the GPU image has none; `kernels/`
  imports as `h3kernels`), turns the Triton interpreter on for a CPU run, and returns "cpu" or "cuda" (refusing
  through `parser.error`, exit status 2, when CUDA is asked for and absent).
- `header` gives {name, date, gpu, gpu_total_gib, torch, triton, git_rev, command, results: []} plus any extra keys
  (`gpu_total_gib`: the card's total memory, null on the CPU); `git_rev` is
  `$H3LAB_GIT_REV` when set (gpu_env.sh sets it from the carried .git_rev: the device copy's own .git can be stale),
  else the checkout's HEAD ("-dirty" when the tree has changes), else "unknown". `command` is `python benchmarks/<script> <args>`, the way to run it again.
- `write` writes the document atomically (sorted keys, indent 2) and says where; nothing without a path.
- Timers: `measure` (do_bench median, L2 flushed, for kernels), `measure_gpu` (device time of calls queued behind a
  GPU sleep, for launch-bound ops), `timed` (CUDA-event seconds of each whole call, for a forward), `call_seconds`
  (one call, no warm-up: a first call that compiles), `sync`,
  `peak_mem_gib`. On CPU they fall back to `time.perf_counter`.
- `rel_l2(out, truth)` and `equal(a, b)` take a tensor or a tuple of tensors (an op with several outputs).
- `materialise(model, device)`: a model built on the meta device gets each parameter's released dtype while still on
  the meta device, then is allocated once on `device` (`to_empty`): a bfloat16 parameter is never first allocated in
  float32 (Diffusers' model builds in float32: 132 GB for 33B before a cast, more than an 80 GB card holds).
- `add_gpu_memory(parser)`: the `--gpu-memory GiB` flag of the benchmarks that can place the DiT under a budget.

Importable as `_common` because a script's own folder is first on `sys.path` (tests prepend this folder).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- imports, device
def bootstrap(cpu: bool) -> None:
    """Make `h3lab` and `h3kernels` importable from a bare checkout. A CPU run needs the Triton interpreter, which
    must be chosen before triton is imported."""
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        import h3kernels  # noqa: F401
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(
            "h3kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["h3kernels"] = module
        spec.loader.exec_module(module)


def kernel_parser(
    description: str, name: str, sweep_help: str = "time candidate tile configs instead"
) -> argparse.ArgumentParser:
    """The flags every kernel benchmark takes: --out, --dry-run (CPU, interpreter, tiny shapes), --no-backward,
    --sweep (exploration of other tiles). The script adds its own (--rows, --seqs, --only, ...)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help=f"JSON results path (e.g. benchmarks/results/{name}.json)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--sweep", action="store_true", help=sweep_help)
    return parser


def prepare(parser: argparse.ArgumentParser, cpu: bool, flag: str) -> str:
    """`bootstrap(cpu)`, then the device: "cpu" when `cpu`, else "cuda" (parser.error, exit 2, if there is none)."""
    bootstrap(cpu)
    import torch

    if cpu:
        return "cpu"
    if not torch.cuda.is_available():
        parser.error(f"no CUDA device: run on the GPU, or pass {flag}")
    return "cuda"


# ------------------------------------------------------------------------------------------- provenance, output
def git_rev() -> str:
    if os.environ.get("H3LAB_GIT_REV"):
        return os.environ["H3LAB_GIT_REV"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def header(name: str, script: str, argv: Sequence[str] | None, device: str, **extra: Any) -> dict:
    """The schema's provenance keys, `extra`, and an empty `results` list. `argv` None means `sys.argv[1:]`."""
    import torch
    import triton

    total = None
    if device == "cuda":
        gpu = torch.cuda.get_device_name()
        total = round(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30, 2)
    else:
        gpu = "cpu (triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else "cpu"
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "name": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "gpu_total_gib": total,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_rev": git_rev(),
        "command": " ".join(["python", f"benchmarks/{Path(script).name}", *args]),
        **extra,
        "results": [],
    }


def write(out: str | None, doc: dict) -> None:
    from h3lab.io_utils import atomic_write_json

    if out:
        atomic_write_json(out, doc)
        print(f"wrote {out}")


def table(rows: list[dict], cols: list[str]) -> str:
    """`cols` joined by " | ", one line per row: floats to 4 significant digits, a missing key as blank."""
    lines = [" | ".join(cols)]
    for r in rows:
        lines.append(" | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ models
def materialise(model, device):
    """`model` (built under `torch.device("meta")`) with every parameter in its released dtype
    (`h3lab.model.precision.policy_dtype`: the float32 modules float32, the rest bfloat16), cast on the meta device
    (no bytes), then allocated once on `device`. Works for H3Transformer and Diffusers' MiniMaxH3Transformer3DModel
    (the same parameter names); buffers keep their dtype. Values are uninitialised: fill them (`init_random_`)."""
    import torch

    from h3lab.model.precision import policy_dtype

    with torch.no_grad():
        for name, p in model.named_parameters():
            dtype = policy_dtype(name, "released")
            if not p.is_meta:
                raise ValueError(f"materialise: {name} is on {p.device}, not the meta device (build the model under "
                                 "torch.device('meta'))")
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model.to_empty(device=device)


def add_gpu_memory(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory", metavar="GiB", type=float, default=None,
                        help="budget of the DiT's tensors on the GPU: the blocks that fit stay resident, the rest "
                             "stream (h3lab.components.residency.plan_residency)")


# ------------------------------------------------------------------------------------------------------- timers
def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def peak_mem_gib(device: str) -> float:
    """Peak allocated CUDA memory since the last reset, GiB; NaN on CPU (not measured)."""
    if device != "cuda":
        return float("nan")
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


def measure(fn: Callable[[], Any], device: str) -> dict:
    """{"median_s", "runs", "peak_mem_gib"} of fn(). CUDA: do_bench over ~100 ms after warm-up (L2 flushed);
    CPU (dry run): one timed call, peak 0.0 (a dry run checks shapes, checks and JSON; an interpreter time is no
    measurement, and each call of a strict kernel costs seconds of Python there)."""
    import torch

    if device == "cuda":
        from triton.testing import do_bench

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times_ms = do_bench(fn, warmup=25, rep=100, return_mode="all")
        peak = torch.cuda.max_memory_allocated() / 2**30
        return {"median_s": statistics.median(times_ms) / 1e3, "runs": len(times_ms), "peak_mem_gib": round(peak, 3)}
    t0 = time.perf_counter()
    fn()
    times = [time.perf_counter() - t0]
    return {"median_s": statistics.median(times), "runs": len(times), "peak_mem_gib": 0.0}


def measure_gpu(fn: Callable[[], Any], device: str, reps: int = 20, trials: int = 7) -> float | None:
    """Median device seconds per call of fn() issued back to back with the launch queue pre-filled: a
    `torch.cuda._sleep` keeps the GPU busy while the host enqueues `reps` calls, so events around them time the
    kernels and not Python's launch overhead (inputs stay L2-warm across the reps). None on CPU."""
    if device != "cuda":
        return None
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time: longer than enqueueing reps calls
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def call_seconds(fn: Callable[[], Any], device: str) -> float:
    """Seconds of one call of fn(): CUDA events around it and a synchronisation (perf_counter on the CPU)."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def timed(fn: Callable[[], Any], runs: int, device: str) -> tuple[list[float], float]:
    """Seconds of each of `runs` calls after one warm-up (CUDA events on GPU, perf_counter on CPU) and the peak
    GiB over them (NaN on CPU): `timed_interleaved` of one implementation."""
    return timed_interleaved({"fn": fn}, runs, device)["fn"]


def timed_interleaved(fns: dict[str, Callable[[], Any]], runs: int, device: str) -> dict[str, tuple[list[float], float]]:
    """`timed` for several implementations at once, their calls interleaved (a, b, a, b, ...) so a drift of the
    GPU's clocks over the measurement hits every implementation alike: name -> (seconds of each run, peak GiB)."""
    import torch

    cuda = device == "cuda"
    for fn in fns.values():  # warm-up of each (compilation, allocator)
        fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    peaks: dict[str, float] = {name: 0.0 for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
                peaks[name] = max(peaks[name], peak_mem_gib(device))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                peaks[name] = float("nan")
    return {name: (times[name], peaks[name]) for name in fns}


# -------------------------------------------------------------------------------------------------- comparisons
def flat(out) -> tuple:
    """An op's output as a tuple of tensors (a single tensor becomes a 1-tuple)."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def equal(a, b) -> bool:
    """Same number of tensors, each pair `torch.equal` (same shape and values)."""
    import torch

    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(bool(torch.equal(x, y)) for x, y in zip(fa, fb))


def rel_l2(out, truth) -> float:
    """||out - truth|| / ||truth|| over all tensors of the (tuple) output, in float64. A zero truth gives 0.0 when
    out is zero too, else inf."""
    num = sum(float((o.double() - t.double()).norm() ** 2) for o, t in zip(flat(out), flat(truth)))
    den = sum(float(t.double().norm() ** 2) for t in flat(truth))
    if not den:
        return 0.0 if not num else float("inf")
    return (num / den) ** 0.5


def kernel_profile(fn, top: int = 25, no_grad: bool = True) -> list[dict]:
    """GPU time of one call of fn() per kernel name (torch.profiler, self device time), largest first:
    [{name, ms, calls}]; `no_grad=False` for a training step."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile

    with (torch.no_grad() if no_grad else contextlib.nullcontext()), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [{"name": e.key, "ms": e.self_device_time_total / 1e3, "calls": e.count}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def runtime_profile(fn, no_grad: bool = True, gaps: int = 12) -> dict:
    """Where a host-bound call loses the GPU (torch.profiler, CPU and CUDA activity, one call of fn()): the CUDA
    runtime/driver calls by count and host time ({name, calls, cpu_ms}: syncs, allocations, launches), the GPU's
    busy and idle time between its first and last kernel, and the `gaps` longest idle gaps with the kernel that
    ended each."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile

    with (torch.no_grad() if no_grad else contextlib.nullcontext()), \
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    calls = [{"name": e.key, "calls": e.count, "cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}
             for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))]
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) / 1e3 if kernels else 0.0
    holes = sorted(((b.time_range.start - a.time_range.end) / 1e3, a.name, b.name)
                   for a, b in zip(kernels, kernels[1:]))[::-1][:gaps]
    return {"runtime_calls": sorted(calls, key=lambda r: -r["cpu_ms"])[:20], "gpu_span_ms": round(span, 3),
            "gpu_busy_ms": round(busy, 3), "gpu_idle_ms": round(span - busy, 3), "kernels": len(kernels),
            "largest_gaps": [{"ms": round(g, 3), "after": a[:80], "before": b[:80]} for g, a, b in holes]}

