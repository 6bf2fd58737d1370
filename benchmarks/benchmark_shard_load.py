"""Per-rank memory of loading only a rank's TP shard (`h3lab.distributed.shard_load.load_sharded_transformer`) of the
released 33B transformer, from a header-only sparse snapshot (the released architecture and dtypes in 12 shards +
index; the data sections are filesystem holes, so reading them costs no disk and yields zeros).

    python benchmarks/benchmark_shard_load.py --tps 2,4,8 --out benchmarks/results/shard_load.json
    python benchmarks/benchmark_shard_load.py --tiny --tps 2 --out x.json      # CPU smoke (tiny config, real data)

For each TP degree, rank 0's shard (every rank's shard has the same size) is read straight to the device, one tensor
at a time: `peak_mem_gib` is the device's peak allocation, `param_gib` the plan's parameter bytes of one rank
(`shard_nbytes`), `host_anon_peak_gib` the largest growth of the process's anonymous host memory (RssAnon,
sampled every 2 ms while loading: the slice in flight, never the model), `host_file_peak_gib` the page cache it
mapped (RssFile, reclaimable), and `median_s` the load time (one run: reading holes measures the path, not a disk).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from _common import header, prepare, write

ROOT = Path(__file__).resolve().parents[1]


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler:
    """Peak RssAnon / RssFile growth over a `with` block (a thread reading /proc/self/status)."""

    def __enter__(self):
        self.base, self.peak, self.stop = _status(), {"RssAnon": 0, "RssFile": 0}, False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop:
            now = _status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], now[k] - self.base[k])
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.thread.join()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tps", default="2,4,8")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: the tiny snapshot (real data), tp 2")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.tiny, flag="--tiny")
    from h3lab.config import H3Config
    from h3lab.distributed.mesh import Mesh, Topology
    from h3lab.distributed.shard_load import load_sharded_transformer, shard_nbytes

    dev = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    with tempfile.TemporaryDirectory(prefix="h3lab-shard-load-") as tmp:
        if args.tiny:
            from h3lab.checkpoint.tiny import make_tiny_snapshot

            component = make_tiny_snapshot(Path(tmp) / "h3-tiny", seed=0) / "transformer"
        else:
            sys.path.insert(0, str(ROOT / "tests" / "checkpoint"))
            from ckpt_helpers import write_sparse_full_component

            component = Path(tmp) / "transformer"
            write_sparse_full_component(component)
        config = H3Config.from_dict(__import__("json").loads((component / "config.json").read_text()))
        results = []
        for tp in [int(t) for t in args.tps.split(",")]:
            mesh = Mesh(Topology(tp=tp), 0, dev)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with Sampler() as sampled:
                model = load_sharded_transformer(component, mesh, device=dev)
            seconds = time.perf_counter() - t0
            held = sum(p.numel() * p.element_size() for p in model.parameters())
            param = shard_nbytes(config, tp, 0)
            results.append({
                "shape": "-", "rows": 0, "impl": f"h3lab-shard-load-tp{tp}", "tp": tp, "rank": 0,
                "median_s": seconds, "runs": 1,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan"),
                "param_gib": param / 2**30, "held_param_gib": held / 2**30, "held_equals_plan": held == param,
                "full_model_gib": shard_nbytes(config, 1) / 2**30,
                "host_anon_peak_gib": sampled.peak["RssAnon"] / 2**30,
                "host_file_peak_gib": sampled.peak["RssFile"] / 2**30,
            })
            r = results[-1]
            print(f"tp{tp}: {r['held_param_gib']:.2f} GiB of {r['full_model_gib']:.2f} held, device peak "
                  f"{r['peak_mem_gib']:.2f} GiB, host anon peak {r['host_anon_peak_gib']:.3f} GiB, file "
                  f"{r['host_file_peak_gib']:.2f} GiB, {seconds:.1f} s", flush=True)
            del model
    doc = header("shard_load" if not args.tiny else "shard_load_tiny_smoke", __file__, argv, device,
                 snapshot="header-only sparse snapshot of the released architecture (zeros)" if not args.tiny
                 else "tiny snapshot")
    doc["results"] = results
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
