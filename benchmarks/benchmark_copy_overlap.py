"""Host -> GPU weight copies on a side stream beside GEMMs on the compute stream: how much of the copy hides.

Why: streamed residency (one DiT block's weights, 1.29 GB, copied while the previous block computes) rests on the
copy engine overlapping the SMs. A first quick test on the H200 overlapped only ~4 ms of a 23 ms copy beside 18.5 ms
of GEMMs (37.6 ms together). This benchmark separates the candidate causes, each variant timed with CUDA events on
both streams and a host clock around the enqueue:

- `pinned_reused`: one pinned host buffer allocated once, one device slot allocated once (the design to build);
- `pageable`: the same bytes in ordinary (pageable) host memory: `copy_(non_blocking=True)` then stages through a
  driver buffer and blocks the host thread, so the GEMMs are enqueued only after the copy;
- `pin_each_time`: `tensor.pin_memory()` inside the loop (host-side pinning cost before every copy);
- `alloc_each_time`: pinned source, but the device slot allocated on the side stream each time;
- `chunked_16`: pinned reused, the copy split into 16 pieces;
- `mmap_file`: the bytes memory-mapped from a file (what a safetensors shard gives before pinning);
- `copy_after`: pinned reused, but the copy enqueued after the GEMMs (host order matters for the first launch).

Per variant: `total_ms` (first event to both streams done), `compute_ms`, `copy_ms`, `enqueue_ms` (host time to
enqueue both), `hidden_fraction` = (compute + copy - total) / copy. Medians of `--repeats`. The GEMMs are the
shapes of one H3 block at 2,066 rows (QKV, O, FFN up/down: bf16 cuBLAS), repeated to ~18 ms.

Run: python3 benchmarks/benchmark_copy_overlap.py --out $OUT/copy_overlap.json   (CPU: --dry-run, tiny sizes)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def _gemm_chain(rows: int, repeats: int, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16)

    x = rnd(rows, 5376)
    ws = [rnd(7168, 5376), rnd(7168, 5376), rnd(7168, 5376), rnd(5376, 7168), rnd(2 * 7168, 5376), rnd(5376, 7168)]

    def run():
        for _ in range(repeats):
            q = x @ ws[0].T
            k = x @ ws[1].T
            v = x @ ws[2].T
            o = (q + k + v) @ ws[3].T
            h = o @ ws[4].T
            y = h[:, :7168] @ ws[5].T
        return y

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (checks the script runs)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mbytes", type=int, default=1290, help="copy size in MB (one H3 block: 1,290)")
    args = parser.parse_args(argv)
    device = _common.prepare(parser, cpu=args.dry_run, flag="--dry-run")
    import torch

    doc = _common.header("copy_overlap", __file__, argv, device)
    if device == "cpu":
        doc["results"].append({"shape": "dry-run", "rows": 0, "impl": "torch", "median_s": 0.0, "runs": 0,
                               "peak_mem_gib": 0.0, "note": "CPU dry run: no streams to measure"})
        _common.write(args.out, doc)
        return 0

    nbytes = args.mbytes * 10**6
    numel = nbytes // 2
    dev = torch.device("cuda")
    compute = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    pinned = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    pinned.normal_()
    pageable = pinned.clone()  # ordinary host memory
    tmpdir = Path(tempfile.mkdtemp())
    path = tmpdir / "block.bin"
    pinned.view(torch.uint8).numpy().tofile(path)
    import numpy as np

    mm = torch.from_numpy(np.memmap(path, dtype=np.uint16, mode="r", shape=(numel,))).view(torch.bfloat16)
    slot = torch.empty(numel, dtype=torch.bfloat16, device=dev)

    # GEMM chain sized to ~18 ms.
    probe = _gemm_chain(2066, 1, dev)
    probe()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        probe()
    t1.record()
    torch.cuda.synchronize()
    per = t0.elapsed_time(t1) / 5
    chain = _gemm_chain(2066, max(1, round(18.5 / per)), dev)

    def copy_into(dst, src, chunks=1):
        if chunks == 1:
            dst.copy_(src, non_blocking=True)
            return
        step = (src.numel() + chunks - 1) // chunks
        for i in range(0, src.numel(), step):
            dst[i : i + step].copy_(src[i : i + step], non_blocking=True)

    def variant(name):
        def copy_op():
            if name in ("pinned_reused", "copy_after"):
                copy_into(slot, pinned)
            elif name == "pageable":
                copy_into(slot, pageable)
            elif name == "pin_each_time":
                copy_into(slot, pageable.pin_memory())
            elif name == "alloc_each_time":
                dst = torch.empty(numel, dtype=torch.bfloat16, device=dev)
                copy_into(dst, pinned)
            elif name == "chunked_16":
                copy_into(slot, pinned, chunks=16)
            elif name == "mmap_file":
                copy_into(slot, mm)
        return copy_op

    names = ["pinned_reused", "pageable", "pin_each_time", "alloc_each_time", "chunked_16", "mmap_file", "copy_after"]

    def one(name, with_compute=True, with_copy=True):
        torch.cuda.synchronize()
        ev = {k: torch.cuda.Event(enable_timing=True) for k in ("start", "c0", "c1", "k0", "k1")}
        h0 = time.perf_counter()
        ev["start"].record(compute)
        side.wait_stream(compute)
        copy_op = variant(name)
        if with_copy and name != "copy_after":
            with torch.cuda.stream(side):
                ev["k0"].record(side)
                copy_op()
                ev["k1"].record(side)
        if with_compute:
            ev["c0"].record(compute)
            chain()
            ev["c1"].record(compute)
        if with_copy and name == "copy_after":
            with torch.cuda.stream(side):
                ev["k0"].record(side)
                copy_op()
                ev["k1"].record(side)
        compute.wait_stream(side)
        end = torch.cuda.Event(enable_timing=True)
        end.record(compute)
        enqueue = (time.perf_counter() - h0) * 1e3
        torch.cuda.synchronize()
        out = {"total_ms": ev["start"].elapsed_time(end), "enqueue_ms": enqueue}
        if with_compute:
            out["compute_ms"] = ev["c0"].elapsed_time(ev["c1"])
        if with_copy:
            out["copy_ms"] = ev["k0"].elapsed_time(ev["k1"])
        return out

    def median_of(fn):
        fn()  # warm-up
        runs = [fn() for _ in range(args.repeats)]
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}, runs

    base, _ = median_of(lambda: one("pinned_reused", with_copy=False))
    print(f"compute alone {base['total_ms']:.2f} ms")
    doc["results"].append({"shape": "2066-row block GEMMs", "rows": 2066, "impl": "compute_alone",
                           "median_s": base["total_ms"] / 1e3, "runs": args.repeats,
                           "peak_mem_gib": _common.peak_mem_gib("cuda"), **base})
    print(f"{'variant':<18}{'copy alone':>11}{'total':>9}{'compute':>9}{'copy':>8}{'enqueue':>9}{'hidden':>8}  GB/s")
    for name in names:
        alone, _ = median_of(lambda: one(name, with_compute=False))
        both, runs = median_of(lambda: one(name))
        hidden = (base["total_ms"] + alone["copy_ms"] - both["total_ms"]) / alone["copy_ms"]
        gbps = nbytes / (alone["copy_ms"] / 1e3) / 1e9
        print(f"{name:<18}{alone['copy_ms']:>11.2f}{both['total_ms']:>9.2f}{both['compute_ms']:>9.2f}"
              f"{both['copy_ms']:>8.2f}{both['enqueue_ms']:>9.2f}{hidden:>8.2f}  {gbps:.1f}")
        doc["results"].append({
            "shape": f"{args.mbytes} MB copy + 2066-row block GEMMs", "rows": 2066, "impl": name,
            "median_s": both["total_ms"] / 1e3, "runs": args.repeats, "peak_mem_gib": _common.peak_mem_gib("cuda"),
            "copy_alone_ms": alone["copy_ms"], "copy_alone_enqueue_ms": alone["enqueue_ms"],
            "copy_alone_gbps": gbps, "hidden_fraction": hidden, **{f"overlap_{k}": v for k, v in both.items()},
            "overlap_runs": runs,
        })
    os.remove(path)
    _common.write(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
