"""RL that measurably learns on the embedded default (h3-shapes): a LoRA trained with `prompt_match` on the training
triples' prompts by GRPO or DiffusionNFT, held-out prompt-following measured before and after (and along the way).

    python scripts/rl_shapes.py --algorithm grpo --device cuda --mode strict    # one GPU: the full run, sealed
    python scripts/rl_shapes.py --algorithm nft --device cuda --mode strict
    python scripts/rl_shapes.py --algorithm grpo --quick                        # CPU, mode off, a couple of minutes

What it does, in order (every draw from `--seed`; nothing is downloaded):
1. A session on the embedded default; a LoRA (`--rank`, every attention and FFN projection, B = 0: the policy starts
   as the released model) injected into its transformer in place, so rollouts and evaluations run the policy.
2. Held-out prompt-following before training, by `scripts/eval_shapes.py`'s protocol (`clip_row`: t2va, 64x64,
   22 frames, `--eval-steps` Euler passes, mode off, measured with `h3lab.shapes.measure`, compared with the prompt):
   the 12 held-out triples x `--seeds` (42 43 44: 36 clips), "all four" = colour, direction, tone and pan; and
   `--training-eval` training triples (spread over the 48, first seed).
3. `--iterations` iterations of the algorithm (`grpo_run.grpo_train` / `nft.nft_train`, the sealed-run loop of
   `h3lab train grpo|nft`): iteration k rolls out `--per-iteration` training prompts (the 48 training triples'
   prompts, or `--prompts` of them spread over the list, or those of `--colours` / `--shapes`, in a seeded order
   walked round-robin) x `--group` members with `Session.rollout` -- GRPO: `flow_sde` at a = `--level` (0.3) with
   the SDE, and the training, on the passes of `--window` (0,3: MixGRPO's window on the passes that decide the
   colour; Euler elsewhere); NFT: the released Euler step -- seed `grpo_job.rollout_seed(seed, k)`, decoded,
   scored by `--reward` (default `prompt_match`, `rewards.score_parts`). Every `--eval-every` iterations (0: only
   before and after) the held-out evaluation runs again.
4. After the last iteration: the held-out (and training) evaluation, the run sealed into `--run-dir` and verified
   (`verify` re-runs every iteration from the sealed batches on the same model: byte-equal or the first difference).
5. One JSON (`--out`, the DESIGN.md "Evidence" schema: name, date, gpu, torch, triton, git_rev, command, results;
   one result entry per algorithm, a later run replacing only its own algorithm's entry and details, so the GRPO
   and the DiffusionNFT runs share one file) with the learning curve (`runs_by_algorithm.<algorithm>.curve`): per
   iteration the wall-clock (training seconds since the start, evaluations not counted), the mean reward (a sum's
   parts), the on-policy statistic of the first epoch (GRPO: every ratio exp(logp_train - logp_rollout) and how many
   are exactly 1; NFT: every generated-row velocity of the first training forward against the frozen previous
   policy's, how many are byte-equal) and, where evaluated, held-out all-four accuracy; the before/after table; the
   totals of those counts; the verify line. `--budget-s S` stops after the iteration that reaches S training
   seconds (the sealed run holds the iterations done).

Defaults: 12 of the 48 training prompts an iteration, G = 4, 8 rollout passes, 24 iterations, held-out every 4, AdamW
lr 1e-3, NFT reference weight 1e-2: on the CPU (mode off) this setting kept the training triples and nudged held-out
up, where lr 3e-3 with weight 1e-4 fixed the training triples but moved the held-out failures from yellow and white
triangles to green and blue shapes.

`--quick`: the CPU smoke form -- mode off, the 6 training triples of yellow and white triangles (the embedded
default's weakest binding: it draws them red or blue, as it does the held-out "a yellow triangle moves down"), G = 4,
8 rollout passes, 6 iterations, lr 3e-3, NFT reference weight 1e-4, held-out seed 42 only and 4 training triples;
any flag given explicitly still applies. Trained that narrowly for many more iterations the policy drifts: other
colours start to come out wrong, and held-out prompt-following falls. On a CPU torch runs on `--threads` threads
(default 1: on a shared machine a second thread made each tiny forward many times slower). Strict on a CPU needs
TRITON_INTERPRET=1 and is slow: use mode off there, strict on CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

FULL = dict(prompts=48, per_iteration=12, group=4, steps=8, iterations=24, eval_every=4, seeds=[42, 43, 44],
            eval_steps=20, training_eval=12, colours=None, shapes=None, lr=1e-3, ref_kl=1e-2)
QUICK = dict(prompts=6, per_iteration=6, group=4, steps=8, iterations=6, eval_every=0, seeds=[42], eval_steps=20,
             training_eval=4, colours="yellow,white", shapes="triangle", lr=3e-3, ref_kl=1e-4)
ALGORITHMS = ("grpo", "nft")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithm", choices=ALGORITHMS, required=True)
    p.add_argument("--quick", action="store_true", help="the CPU smoke form (module docstring)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--mode", choices=("strict", "off"), default=None, help="arithmetic of rollouts and training "
                   "(default strict on cuda, off on cpu)")
    for name in ("prompts", "per_iteration", "group", "steps", "iterations", "eval_every", "eval_steps",
                 "training_eval"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                       help=f"default {FULL[name]} ({QUICK[name]} with --quick)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="held-out seeds (default 42 43 44; 42 quick)")
    p.add_argument("--held-out", type=int, default=12, help="evaluate the first N of the 12 held-out triples "
                   "(default all 12: the protocol)")
    p.add_argument("--colours", default=None, help="only training triples of these colours (comma list; default all; "
                   "quick: yellow,white)")
    p.add_argument("--shapes", default=None, help="only training triples of these shapes (comma list; default all; "
                   "quick: triangle)")
    p.add_argument("--reward", default="prompt_match", help="reward spec (default prompt_match)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=None, help="AdamW lr (default 1e-3; 3e-3 with --quick)")
    p.add_argument("--stepper", default=None, help="rollout stepper (default flow_sde GRPO, euler NFT)")
    p.add_argument("--level", type=float, default=0.3, help="SDE noise level (GRPO; NFT with an SDE stepper; default "
                   "0.3: at 0.7 the SDE's noise alone turns most colours wrong on this model)")
    p.add_argument("--window", default="0,3", metavar="START,SIZE", help="GRPO: SDE (and training) only on passes "
                   "START..START+SIZE-1, Euler elsewhere (MixGRPO; default 0,3: the passes that decide the colour; "
                   "'all' for every pass)")
    p.add_argument("--beta", type=float, default=0.0, help="GRPO: KL weight to the adapter-off reference")
    p.add_argument("--nft-beta", type=float, default=1.0, help="NFT: beta")
    p.add_argument("--ref-kl", type=float, default=None, help="NFT: weight of |v - v_ref|^2 (default 1e-2; 1e-4, "
                   "verl-omni's, with --quick)")
    p.add_argument("--draws", type=int, default=2, help="NFT: forward noisings per request per iteration")
    p.add_argument("--budget-s", type=float, default=None, help="stop after the iteration whose training seconds "
                   "reach this (evaluations not counted); the run sealed and verified holds the iterations done")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (default 1)")
    p.add_argument("--out", default=None, help="JSON (default benchmarks/results/rl_shapes[_quick].json; an earlier "
                   "run of the other algorithm in it is kept)")
    p.add_argument("--run-dir", default=None, help="sealed run folder (default a fresh temporary folder)")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def training_prompts(n: int, colours: str | None = None, shapes: str | None = None) -> list[str]:
    """`n` training triples' prompts spread over the training triples (all 48, or those of `colours` / `shapes`,
    comma lists); all of them for n >= their count."""
    import numpy as np

    from h3lab.shapes import ClipSpec, prompt, training_combos

    combos = [c for c in training_combos() if (colours is None or c[0] in colours.split(",")) and (
        shapes is None or c[1] in shapes.split(","))]
    if not combos:
        raise SystemExit(f"--colours {colours!r} --shapes {shapes!r}: no training triple has them")
    picks = np.linspace(0, len(combos) - 1, min(n, len(combos))).round().astype(int)
    return [prompt(ClipSpec(*combos[k])) for k in picks]


def prompts_of(k: int, prompts: list[str], per: int, seed: int) -> list[str]:
    """Iteration k's prompts: a seeded order of `prompts`, `per` at a time, round-robin."""
    import random

    order = list(prompts)
    random.Random(seed).shuffle(order)
    return [order[(k * per + j) % len(order)] for j in range(min(per, len(order)))]


def evaluate(session, seeds, steps: int, training: int, held_out: int = 12) -> dict:
    """Held-out (`held_out` of the 12 triples x seeds) and training (`training` triples, first seed)
    prompt-following, mode off."""
    import numpy as np
    from eval_shapes import clip_row, fractions

    from h3lab.shapes import held_out_combos, training_combos

    t0 = time.perf_counter()
    held = [clip_row(session, "held_out", c, s, steps) for c in held_out_combos()[:held_out] for s in seeds]
    combos = training_combos()
    picks = [combos[k] for k in np.linspace(0, len(combos) - 1, training).round().astype(int)] if training else []
    train = [clip_row(session, "training", c, seeds[0], steps) for c in picks]
    return {"held_out_all_four": sum(r["all"] for r in held), "held_out_clips": len(held),
            "training_all_four": sum(r["all"] for r in train), "training_clips": len(train),
            **fractions(held), **fractions(train, "training_"), "seconds": round(time.perf_counter() - t0, 2),
            "clips": [{k: r[k] for k in ("prompt", "seed", "split", "match", "all")} for r in held + train]}


def algorithm(args):
    """(config, train, load, verify, make_batch, needs_density, on-policy statistic of an iteration record)."""
    if args.algorithm == "grpo":
        from h3lab.training.grpo_run import grpo_train, load, verify
        from h3lab.training.grpo_step import GrpoConfig, batch_from_rollout
        from h3lab.training.optim_config import OptimizerConfig

        from h3lab.training.grpo import PassSelection

        window = None if args.window == "all" else [int(x) for x in args.window.split(",")]
        selection = PassSelection("all") if window is None else PassSelection("window", start=window[0],
                                                                               size=window[1])
        config = GrpoConfig(kind=args.stepper or "flow_sde", level=args.level, group=args.group, beta=args.beta,
                            seed=args.seed, mode=args.mode, optim=OptimizerConfig(lr=args.lr),
                            selection=selection)

        def stat(record):
            r = record["epochs"][0]["ratio"]
            return {"count": r["count"], "exact": r["exactly_one"], "max_abs": r["max_abs"]}

        return config, grpo_train, load, verify, batch_from_rollout, True, stat
    from h3lab.training.nft import NftConfig, batch_from_rollout, load, nft_train, verify
    from h3lab.training.optim_config import OptimizerConfig

    kind = args.stepper or "euler"
    config = NftConfig(kind=kind, level=None if kind == "euler" else args.level, group=args.group,
                       beta=args.nft_beta, ref_kl=args.ref_kl, draws=args.draws, seed=args.seed, mode=args.mode,
                       optim=OptimizerConfig(lr=args.lr))

    def stat(record):
        g = record["epochs"][0]["on_policy"]
        return {"count": g["count"], "exact": g["exactly_equal"], "max_abs": g["max_abs"]}

    return config, nft_train, load, verify, batch_from_rollout, False, stat


def train(args, session, model, curve: list) -> tuple:
    """The iterations (module docstring, step 3); returns (run, config, verify, load, packed rows of a request)."""
    from h3lab.training.grpo_job import rollout_seed
    from h3lab.training.grpo_report import reward_samples
    from h3lab.training.rewards import resolve_reward, score_parts

    config, train_fn, load, verify, make_batch, density, stat = algorithm(args)
    reward = resolve_reward(args.reward)
    prompts = training_prompts(args.prompts, args.colours, args.shapes)
    gen = dict(steps=args.steps, width=64, height=64, frames=22, mode=args.mode)
    options = {"stepper": config.kind, "level": config.level or args.level, "needs_density": density}
    if args.algorithm == "grpo" and args.window != "all":
        start, size = (int(x) for x in args.window.split(","))
        options["window"] = {"start": start, "size": size}
    clock = {"train": 0.0, "start": time.perf_counter(), "rows": None}

    def rollout(k, _model):
        ro = session.rollout(prompts_of(k, prompts, args.per_iteration, args.seed), group=args.group, **options,
                             seed=rollout_seed(args.seed, k), decode=True, **gen)
        clock["rows"] = clock["rows"] or int(ro.trajectories[0].inputs.seq_len)
        return make_batch(ro, *score_parts(reward, reward_samples(ro, decoded=True)))

    def on_iteration(k, record, run):
        clock["train"] += time.perf_counter() - clock["start"]
        rewards = record["rewards"]
        row = {"iteration": k, "seconds": round(clock["train"], 2), "reward_mean": sum(rewards) / len(rewards),
               "on_policy": stat(record),
               **({"reward_parts": {p["name"]: p["mean"] for p in record["reward_parts"]}}
                  if record.get("reward_parts") else {})}
        if args.eval_every and (k + 1) % args.eval_every == 0 and k + 1 < args.iterations:
            ev = evaluate(session, args.seeds, args.eval_steps, 0, args.held_out)
            row.update(held_out_all_four=ev["held_out_all_four"], held_out_clips=ev["held_out_clips"])
        curve.append(row)
        print(f"{args.algorithm} {k + 1}/{args.iterations}: {row['seconds']:.1f} s, mean reward "
              f"{row['reward_mean']:.4f}, on-policy {row['on_policy']['exact']}/{row['on_policy']['count']} exact"
              + (f", held-out {row['held_out_all_four']}/{row['held_out_clips']}" if "held_out_all_four" in row
                 else ""), flush=True)
        if args.budget_s is not None and clock["train"] >= args.budget_s and k + 1 < args.iterations:
            print(f"training budget of {args.budget_s:g} s spent after {k + 1} iterations", flush=True)
            raise Budget(run)
        clock["start"] = time.perf_counter()

    try:
        run = train_fn(model, rollout, config, args.iterations, reward=reward.name, on_iteration=on_iteration,
                       meta={"script": "scripts/rl_shapes.py", "prompts": prompts,
                             "per_iteration": args.per_iteration})
    except Budget as stop:
        run = stop.run
    return run, config, verify, load, clock["rows"]


class Budget(Exception):
    """Raised after the iteration that spent `--budget-s` training seconds; carries the run so far."""

    def __init__(self, run):
        super().__init__("training budget spent")
        self.run = run


def run_one(args, session, model) -> tuple[dict, dict]:
    """Before, the iterations, after, seal and verify (module docstring, steps 2-4): (result entry, details)."""
    import tempfile

    from _common import peak_mem_gib

    curve: list = []
    before = evaluate(session, args.seeds, args.eval_steps, args.training_eval, args.held_out)
    print(f"before: held-out {before['held_out_all_four']}/{before['held_out_clips']}, training "
          f"{before['training_all_four']}/{before['training_clips']} all four ({before['seconds']} s)", flush=True)
    run, config, verify, load, rows = train(args, session, model, curve)
    after = evaluate(session, args.seeds, args.eval_steps, args.training_eval, args.held_out)
    print(f"after: held-out {after['held_out_all_four']}/{after['held_out_clips']}, training "
          f"{after['training_all_four']}/{after['training_clips']} all four", flush=True)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix=f"rl-shapes-{args.algorithm}-")) / "run"
    t0 = time.perf_counter()
    report = verify(load(run.seal(run_dir)), model)
    verify_s = time.perf_counter() - t0
    print(f"verify: {report} ({verify_s:.1f} s); sealed run in {run_dir}", flush=True)
    steps = [b["seconds"] - a["seconds"] for a, b in zip([{"seconds": 0.0}] + curve, curve)]
    entry = {
        "shape": "64x64x22f", "rows": rows, "impl": f"h3lab-{args.mode}", "algorithm": args.algorithm,
        "median_s": round(statistics.median(steps), 3), "runs": len(curve),
        "peak_mem_gib": peak_mem_gib("cuda") if args.device.startswith("cuda") else None,
        "train_seconds": curve[-1]["seconds"], "held_out_all_four_before": before["held_out_all_four"],
        "held_out_all_four_after": after["held_out_all_four"], "held_out_clips": after["held_out_clips"],
        "training_all_four_before": before["training_all_four"], "training_all_four_after": after["training_all_four"],
        "training_clips": after["training_clips"], "reward_first": curve[0]["reward_mean"],
        "reward_last": curve[-1]["reward_mean"], "verify": str(report), "verify_ok": report.ok,
        "verify_s": round(verify_s, 2), "digest": run.digest,
        "on_policy": {"count": sum(r["on_policy"]["count"] for r in curve),
                      "exact": sum(r["on_policy"]["exact"] for r in curve),
                      "max_abs": max(r["on_policy"]["max_abs"] for r in curve)}}
    details = {"config": config.to_dict(), "reward": args.reward, "curve": curve, "before": before, "after": after,
               "settings": {k: v for k, v in vars(args).items() if k not in ("out", "run_dir")}}
    return entry, details


def write_doc(args, argv, entry: dict, details: dict) -> dict:
    """The benchmarks-schema document at `--out`: this algorithm's result entry and run details replace any earlier
    ones of the same algorithm in it (so a GRPO run then an NFT run with one `--out` leave both curves in one file);
    the header is this run's."""
    from _common import header, write

    name = "rl_shapes" + ("_quick" if args.quick else "")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{name}.json")
    doc = header(name, __file__, argv, "cuda" if args.device.startswith("cuda") else "cpu")
    doc["command"] = " ".join(["python", "scripts/rl_shapes.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        old = json.loads(out.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        old = {}
    if old.get("name") == name:
        doc["results"] = [r for r in old.get("results", []) if r.get("algorithm") != args.algorithm]
        doc["runs_by_algorithm"] = {k: v for k, v in old.get("runs_by_algorithm", {}).items() if k != args.algorithm}
    entry = {**entry, "command": doc["command"], "git_rev": doc["git_rev"], "date": doc["date"], "gpu": doc["gpu"]}
    doc["results"].append(entry)
    doc.setdefault("runs_by_algorithm", {})[args.algorithm] = details
    write(str(out), doc)
    return doc


def main(argv=None) -> int:
    args = parse(argv)
    import os

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.mode = args.mode or ("strict" if args.device.startswith("cuda") else "off")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.mode == "strict" and args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from h3lab import Session
    from h3lab.training import add_lora, remove_lora

    session = Session(None, device=args.device)
    model = session.transformer("transformer")
    handle = add_lora(model, args.rank, None, seed=args.seed)
    try:
        entry, details = run_one(args, session, model)
    finally:
        remove_lora(model, handle)
    write_doc(args, argv, entry, details)
    print(json.dumps(entry, indent=1))
    return 0 if entry["verify_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
