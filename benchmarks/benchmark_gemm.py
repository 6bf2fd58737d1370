"""Strict GEMM vs torch/cuBLAS on the H3 projection shapes, with byte-equality checks at the real shapes.

    python benchmarks/benchmark_gemm.py --out benchmarks/results/gemm.json            # H200: forward + backward
    python benchmarks/benchmark_gemm.py --dry-run --out /tmp/gemm.json                # CPU interpreter, tiny shapes
    python benchmarks/benchmark_gemm.py --sweep                                       # H200: candidate tiles

Rows M in {2066, 7272} (512x512x22f and 864x480x56f); (K, N): q/k/v 5376->7168 (`linear`), o-proj 7168->5376
(`linear_tree`), ffn up 5376->28672 (`linear`), ffn down 14336->5376 (`linear_tree`); bfloat16 with bias.
Time: `triton.testing.do_bench` (L2 flushed between runs), median of all runs; TFLOP/s = 2*M*N*K / t forward and
4*M*N*K / t backward (dX and dW); `ratio` = strict time / torch time measured in the same run.
Checks on the strict output (strict rows of the JSON): `rows_equal` (the first row alone and the first half of the
rows give the same bytes as in the full batch), `repeat_equal`, `tp_equal` (tree ops: TP2/4/8 subtrees recombined
give the TP1 bytes), `bwd_repeat_equal` (two backward runs), and `rel_l2_vs_fp32` for strict and torch alike.
`--sweep` times other tile configs through the same kernel (exploration only; the contract's tiles are constants).
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

ROOT = Path(__file__).resolve().parents[1]

SHAPES = [  # (name, op, K, N)
    ("qkv", "linear", 5376, 7168),
    ("o_proj", "linear_tree", 7168, 5376),
    ("ffn_up", "linear", 5376, 28672),
    ("ffn_down", "linear_tree", 14336, 5376),
]
ROWS = (2066, 7272)
DRY_SHAPES = [("qkv", "linear", 96, 80), ("o_proj", "linear_tree", 128, 72)]
DRY_ROWS = (3, 67)


# ------------------------------------------------------------------------------ shared benchmark plumbing
def bootstrap(dry_run: bool) -> None:
    """Make `h3lab` and `h3kernels` importable from a bare checkout (the GPU image has no editable install); the
    interpreter must be chosen before triton is imported."""
    if dry_run:
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


def git_rev() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True,
                                   timeout=10).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("H3LAB_GIT_REV", "unknown")


def header(name: str, argv: list[str]) -> dict:
    import torch
    import triton

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (triton interpreter)"
    return {
        "name": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_rev": git_rev(),
        "command": " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *argv]),
        "results": [],
    }


def measure(fn, device: str) -> dict:
    """{"median_s", "runs", "peak_mem_gib"} of fn(). CUDA: do_bench over ~100 ms after warm-up (L2 flushed);
    CPU (dry run): 3 timed calls after one warm-up."""
    import torch

    if device == "cuda":
        from triton.testing import do_bench

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times_ms = do_bench(fn, warmup=25, rep=100, return_mode="all")
        peak = torch.cuda.max_memory_allocated() / 2**30
        return {"median_s": statistics.median(times_ms) / 1e3, "runs": len(times_ms), "peak_mem_gib": round(peak, 3)}
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "runs": len(times), "peak_mem_gib": 0.0}


def rel_l2(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def write(out: str | None, doc: dict) -> None:
    from h3lab.io_utils import atomic_write_json

    if out:
        atomic_write_json(out, doc)
        print(f"wrote {out}")


def table(rows: list[dict], cols: list[str]) -> str:
    lines = [" | ".join(cols)]
    for r in rows:
        lines.append(" | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the benchmark
def _rows_checks(fn, x, w, b, y) -> bool:
    half = x.shape[0] // 2 + 1
    return bool(torch_equal(fn(x[:1], w, b), y[:1]) and torch_equal(fn(x[:half], w, b), y[:half]))


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def _tp_check(gemm, x, w, b, y) -> bool:
    K = x.shape[1]
    for ranks in (2, 4, 8):
        width = K // ranks
        parts = [gemm.tree_partial(x[:, r * width:(r + 1) * width], w[:, r * width:(r + 1) * width], 8 // ranks)
                 for r in range(ranks)]
        if not torch_equal(gemm.tree_combine(parts, b, y.dtype), y):
            return False
    return True


def bench_shape(name: str, op: str, K: int, N: int, M: int, device: str, backward: bool) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from h3kernels import gemm

    gen = torch.Generator(device=device).manual_seed(M * 7 + K)
    x = torch.randn(M, K, device=device, generator=gen).bfloat16()
    w = (torch.randn(N, K, device=device, generator=gen) * K**-0.5).bfloat16()
    b = torch.randn(N, device=device, generator=gen).bfloat16()
    strict = getattr(gemm, op)
    truth = F.linear(x.float(), w.float(), b.float())  # float32 reference (TF32 is off for matmul by default)
    shape = f"{M}x{K}x{N}"
    flops = 2.0 * M * N * K
    rows = []
    for impl, fn in (("h3lab-strict", strict), ("h3lab-off", F.linear)):
        y = fn(x, w, b)
        row = {"shape": shape, "rows": M, "impl": impl, "op": op, "proj": name, "pass": "forward",
               "backend": "triton" if impl == "h3lab-strict" else "cuBLAS",
               "rel_l2_vs_fp32": rel_l2(y, truth), **measure(lambda: fn(x, w, b), device)}
        row["tflops"] = flops / row["median_s"] / 1e12
        if impl == "h3lab-strict":
            row["repeat_equal"] = torch_equal(fn(x, w, b), y)
            row["rows_equal"] = _rows_checks(fn, x, w, b, y)
            if op == "linear_tree":
                row["tp_equal"] = _tp_check(gemm, x, w, b, y)
        rows.append(row)
        del y
    rows[0]["ratio"] = rows[0]["median_s"] / rows[1]["median_s"]
    if backward:
        dy = torch.randn(M, N, device=device, generator=gen).bfloat16()
        bwd = []
        for impl, fn in (("h3lab-strict", strict), ("h3lab-off", F.linear)):
            xg, wg, bg = (t.detach().clone().requires_grad_() for t in (x, w, b))
            y = fn(xg, wg, bg)
            grads = lambda: torch.autograd.grad(y, (xg, wg, bg), dy, retain_graph=True)  # noqa: E731
            g1, g2 = grads(), grads()
            row = {"shape": shape, "rows": M, "impl": impl, "op": op, "proj": name, "pass": "backward",
                   "backend": "triton" if impl == "h3lab-strict" else "cuBLAS",
                   "bwd_repeat_equal": all(torch_equal(a, c) for a, c in zip(g1, g2)), **measure(grads, device)}
            row["tflops"] = 2 * flops / row["median_s"] / 1e12
            bwd.append(row)
            del y, g1, g2
        bwd[0]["ratio"] = bwd[0]["median_s"] / bwd[1]["median_s"]
        rows += bwd
    return rows


def sweep(device: str, rows_list, shapes) -> list[dict]:
    """Time candidate tile configs of the same kernel on each shape, forward through TMA descriptors and through
    pointers (and whether the two give the same bytes), plus the two backward GEMMs. Exploration only: the
    contract's tiles are the constants in `gemm`."""
    import torch
    from h3kernels import gemm

    T = gemm.Tile
    linear_candidates = [T(128, 256, 64, 8, 8, 3, True), T(128, 256, 64, 8, 8, 3, False),
                         T(128, 128, 64, 8, 4, 4, True)]
    tree_candidates = [T(128, 128, 64, 8, 8, 4, True), T(128, 128, 64, 8, 8, 3, True),
                       T(128, 128, 64, 8, 8, 3, False)]
    out = []

    def run(label, fn, flops, **keys):
        try:
            y = fn()
            t = measure(fn, device)["median_s"]
        except Exception as exc:  # a config that does not compile (shared memory, registers) is reported
            out.append({**keys, "what": label, "error": str(exc)[:300]})
            print(out[-1], flush=True)
            return None
        out.append({**keys, "what": label, "median_s": t, "tflops": flops / t / 1e12})
        print(out[-1], flush=True)
        return y

    for M in rows_list:
        for name, op, K, N in shapes:
            gen = torch.Generator(device=device).manual_seed(1)
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            w = (torch.randn(N, K, device=device, generator=gen) * K**-0.5).bfloat16()
            dy = torch.randn(M, N, device=device, generator=gen).bfloat16()
            chunks = gemm.TREE_CHUNKS if op == "linear_tree" else 1
            flops = 2.0 * M * N * K
            run("cublas-fwd", lambda: torch.nn.functional.linear(x, w), flops, rows=M, proj=name, tile="cuBLAS")
            run("cublas-dx", lambda: dy @ w, flops, rows=M, proj=name, tile="cuBLAS")
            run("cublas-dw", lambda: dy.t() @ x, flops, rows=M, proj=name, tile="cuBLAS")
            for tile in tree_candidates if op == "linear_tree" else linear_candidates:
                keys = dict(rows=M, proj=name, tile=tile.describe())
                y_tma = run("fwd-tma", lambda: gemm._gemm(x, w, None, chunks, tile, x.dtype, True), flops, **keys)
                y_ptr = run("fwd-ptr", lambda: gemm._gemm(x, w, None, chunks, tile, x.dtype, False), flops, **keys)
                if y_tma is not None and y_ptr is not None:
                    out[-1]["tma_equal"] = bool(torch.equal(y_tma, y_ptr))
                if op == "linear":
                    run("dx-tma", lambda: gemm._gemm(dy, w.t(), None, 1, tile, x.dtype), flops, **keys)
                    run("dw-tma", lambda: gemm._gemm(dy.t(), x.t(), None, 1, tile, x.dtype), flops, **keys)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON results path (e.g. benchmarks/results/gemm.json)")
    parser.add_argument("--rows", type=int, nargs="+", help="row counts M (default 2066 7272)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs instead")
    parser.add_argument("--projs", nargs="+", choices=[s[0] for s in SHAPES], help="only these projections")
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    bootstrap(args.dry_run)
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on the GPU, or pass --dry-run")
    doc = header("gemm", argv)
    rows_list = args.rows or (DRY_ROWS if args.dry_run else ROWS)
    shapes = [s for s in (DRY_SHAPES if args.dry_run else SHAPES) if not args.projs or s[0] in args.projs]
    if args.sweep:
        doc["results"] = sweep(device, rows_list, shapes)
    else:
        for M in rows_list:
            for name, op, K, N in shapes:
                doc["results"] += bench_shape(name, op, K, N, M, device, backward=not args.no_backward)
                print(table(doc["results"][-4:], ["proj", "rows", "impl", "pass", "median_s", "tflops", "ratio"]),
                      flush=True)
        print(table(doc["results"], ["proj", "shape", "impl", "pass", "median_s", "tflops", "ratio", "rel_l2_vs_fp32",
                                     "rows_equal", "repeat_equal", "tp_equal", "bwd_repeat_equal"]))
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
