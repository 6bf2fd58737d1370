"""Run the multi-process paths that once raced, N times, optionally beside busy-loop processes: a gloo rank that
raises at once (it must be reported as itself, never as its peer's broken connect) and ablation row H-C5 (one
process vs every CP degree the tiny config admits, strict: byte-equal). Writes a JSON of every run.

    TRITON_INTERPRET=1 python scripts/ranks_under_load.py --runs 20 --load 2 --out results.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "distributed")]


def _busy() -> None:  # one core of load
    while True:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs of each case (default 20)")
    p.add_argument("--load", type=int, default=0, help="busy-loop processes beside the runs (default 0)")
    p.add_argument("--out", default=None, help="JSON file of every run (default: print only)")
    args = p.parse_args(argv)

    from test_refusals import _one_rank_fails

    from h3lab.research.ablation import tiny_bench
    from h3lab.research.ablation.distributed import run_row
    from h3lab.checkpoint.tiny import random_snapshot
    from h3lab.distributed.launch import RankFailed, spawn

    load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for proc in load:
        proc.start()
    bench = tiny_bench(str(random_snapshot()))
    out: dict[str, list] = {"rank_test": [], "h_c5": []}
    try:
        for i in range(args.runs):
            t = time.time()
            try:
                spawn(_one_rank_fails, 2)
                ok, msg = False, "no failure"
            except RankFailed as err:
                msg = str(err)
                ok = msg == "rank 1 failed: ValueError: boom on rank 1" and "Traceback" in str(err.__cause__)
            out["rank_test"].append({"ok": ok, "msg": msg, "s": round(time.time() - t, 2)})
            t = time.time()
            try:
                rows = run_row("H-C5", bench, "strict")
                ok = bool(rows) and all(r.get("report", {}).get("equal") is True for r in rows)
                msg = ", ".join(f"{r['a']} vs {r['b']}" for r in rows)
            except Exception as err:  # noqa: BLE001 - a failed run is a result here
                ok, msg = False, f"{type(err).__name__}: {err}"
            out["h_c5"].append({"ok": ok, "msg": msg[:300], "s": round(time.time() - t, 2)})
            print(i, out["rank_test"][-1], out["h_c5"][-1], flush=True)
    finally:
        for proc in load:
            proc.terminate()
    passed = {k: sum(r["ok"] for r in v) for k, v in out.items()}
    print(f"rank test {passed['rank_test']}/{args.runs}; H-C5 {passed['h_c5']}/{args.runs}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(v == args.runs for v in passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
