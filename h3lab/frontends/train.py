"""`h3lab train` (also `python -m h3lab.frontends.train`): a LoRA fine-tune on a sealed clip dataset, or a reward-weighted
update over sealed rollouts, with a progress bar, periodic atomic checkpoints and `--resume`.

    h3lab train --clips data/ --out runs/fox --rank 16 --steps 200 --batch-size 2 --lr 1e-4
    h3lab train --rollout traj/a 0.8 --rollout traj/b -0.8 --out runs/rl --steps 4 --mode strict
    h3lab train ... --resume                # continue the newest checkpoint of --out (same arguments)
    torchrun --nproc-per-node 2 -m h3lab train --clips data/ --out runs/fox --cp 2 --device cpu   # a CP2 mesh
    torchrun --nproc-per-node 4 -m h3lab train ... --tp 2 --dp 2 --batch-size 2 --device cpu    # TP2, two replicas
    h3lab train grpo --prompts prompts.txt --group 4 --reward brightness --out runs/grpo --iterations 10
    h3lab train grpo ... --reward mypkg.rewards:score --beta 0.04 --inner-epochs 2 --passes fraction:0.6
    h3lab train grpo ... --reward prompt_match:1.0,brightness:0.1    # a weighted sum, each part in the records
    h3lab train grpo ... --reward-server http://127.0.0.1:8000/score  # scripts/reward_server.py, or any such server
    h3lab train nft --prompts prompts.txt --group 4 --reward prompt_match --out runs/nft --iterations 10

A front end: it parses, checks and prints; the job is `h3lab.training.job` (`TrainJob.check`, `run_job`;
`grpo_job` for `grpo`, `nft.job` for `nft`, DiffusionNFT with `train grpo`'s flags where they mean the same). Every bad
argument, path or data file fails before any model loads with one line on stderr and exit status 2; Ctrl-C stops
after the running step (exit 130), keeping the newest checkpoint. Output: see `h3lab.training.job`.

On a mesh (`--cp C`, `--tp T`, `--dp D`, under torchrun with D * T * C ranks; `mesh_for`): every rank checks the
job, builds the mesh (`h3lab.distributed.init_mesh`; strict only), loads the model on its device, adds the LoRA and
parallelizes it, and trains the same steps (`h3lab.distributed.autograd` for CP, `tp_autograd` for TP,
`training.data_parallel` over the DP group: the loss, every gradient and the weights are byte-equal to one process,
so the sealed run's digest and the adapter are the one-process run's); rank 0 alone writes the job folder and
prints. What does not compose is refused with one line before the process group starts (exit 2 on every rank):
`--gradient-checkpointing` on a mesh, `--dp` above `--batch-size`, degrees the snapshot's heads do not admit. A rank
that dies mid-run ends every surviving rank with one line naming it (`distributed.peers.watch`, exit 2); the
job folder keeps only what rank 0 wrote atomically before.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence, TextIO

from ..errors import H3Error, user_message


class TrainArgError(H3Error):
    """A `h3lab train` usage error (one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise TrainArgError(message)


def check_gpu_memory_flag(args: argparse.Namespace) -> float | None:
    """--gpu-memory: None, or a number of GiB > 0 with --gradient-checkpointing (a streamed block's backward
    recomputes it; without checkpointing autograd would keep every block's weights)."""
    if args.gpu_memory is None:
        return None
    from ..components.residency import ResidencyError, check_gpu_memory

    try:
        gib = check_gpu_memory(args.gpu_memory)
    except ResidencyError:
        raise TrainArgError(f"--gpu-memory {args.gpu_memory!r}: must be a number of GiB > 0") from None
    if not args.gradient_checkpointing:
        raise TrainArgError(f"--gpu-memory {gib:g} streams blocks through the backward: add --gradient-checkpointing "
                            "(byte-neutral)")
    return gib


def streamed_model(job, gib: float):
    """The job's base transformer loaded into host memory and streamed onto its device under `gib` GiB
    (`components.streaming.stream_blocks`); (model, `run_job`'s `place` recording the residency in the run's meta)."""
    import torch

    from ..components.streaming import stream_blocks
    from ..execution.devices import resolve_device
    from ..training.job import load_model

    model = load_model(job, torch.device("cpu"))
    streamer = stream_blocks(model, resolve_device(job.device), gpu_memory_gib=gib)
    record = {"policy": "streamed", **streamer.plan.to_dict()}
    return model, lambda _model: {"residency": record}


DESCRIPTIONS = {
    "train": "LoRA fine-tune or reward-weighted update of the MiniMax-H3 DiT (strict, sealed, resumable).\nRL on "
             "rollouts of the current policy: h3lab train grpo --help, h3lab train nft --help.\nA finished job "
             "verifies with h3lab verify OUT.",
    "train grpo": "GRPO on the MiniMax-H3 DiT: stochastic rollouts of a LoRA policy on a prompt file, a reward per "
                  "request, the clipped GRPO step (strict, sealed, resumable).\nA finished job verifies with h3lab "
                  "verify OUT.",
    "train nft": "DiffusionNFT on the MiniMax-H3 DiT: rollouts of a LoRA policy (any sampler, the released Euler step "
                 "by default; no CFG) on a prompt file, a reward per request, flow matching on forward-noised final "
                 "latents split into implicit positive and negative policies around the frozen previous policy "
                 "(strict, sealed, resumable).\nA finished job verifies with h3lab verify OUT.",
}


def program_parser(program: str) -> argparse.ArgumentParser:
    """The parser of `h3lab <program>`: its declared flags (`h3lab.schema.train_flags`), each help with its default."""
    from ..schema.program import add_program_flags

    p = _Parser(prog=f"h3lab {program}", formatter_class=argparse.RawDescriptionHelpFormatter,
                description=DESCRIPTIONS[program])
    add_program_flags(p, program)
    return p


def build_parser() -> argparse.ArgumentParser:
    return program_parser("train")


def build_grpo_parser() -> argparse.ArgumentParser:
    return program_parser("train grpo")


def build_nft_parser() -> argparse.ArgumentParser:
    return program_parser("train nft")


def _reward_of(args: argparse.Namespace) -> dict:
    """The job's reward fields from --reward / --reward-server (exactly one of them)."""
    if (args.reward is None) == (args.reward_server is None):
        raise TrainArgError("--reward NAME or --reward-server URL: give exactly one")
    if args.reward_server is not None:
        from ..training.reward_client import check_url

        return {"reward": check_url(args.reward_server), "reward_timeout": args.reward_timeout,
                "reward_retries": args.reward_retries}
    return {"reward": args.reward}


@contextlib.contextmanager
def flags_named(program: str):
    """Inside: a `SettingError` of a value a flag of `program` gives (by the flag's dest or the keyword it is sealed
    as, `h3lab.schema.program.flag_names`) becomes a `TrainArgError` naming the flag (`--group 1: must be an integer
    >= 2`), not the config class that checked it; one whose name is a flag already keeps it."""
    from ..schema.program import flag_names
    from ..training.objective import SettingError

    flags = flag_names(program)
    try:
        yield
    except SettingError as err:
        flag = flags.get(err.name) or (err.name if err.name.startswith("-") else None)
        if flag is None:
            raise
        raise TrainArgError(err.as_flag(flag)) from None


def sealed_parts(args: argparse.Namespace, program: str) -> tuple[dict, dict]:
    """(config keywords with `optim` and, where declared, `objective`, job keywords) of the parsed flags."""
    from ..schema.program import sealed
    from ..training import Objective, OptimizerConfig

    config = {**sealed(args, program, "config"), "optim": OptimizerConfig(**sealed(args, program, "optim"))}
    objective = sealed(args, program, "objective")
    if objective:
        config["objective"] = Objective(**objective)
    return config, sealed(args, program, "job")


def grpo_job_from_args(args: argparse.Namespace):
    """The checked `GrpoJob` of the flags (every check before any model loads)."""
    from ..training.grpo_job import GrpoJob
    from ..training.grpo_step import GrpoConfig

    with flags_named("train grpo"):
        config, job = sealed_parts(args, "train grpo")
        return GrpoJob(config=GrpoConfig(**config), **job, **_reward_of(args)).check(resume=args.resume)


def nft_job_from_args(args: argparse.Namespace):
    """The checked `NftJob` of the flags (every check before any model loads)."""
    from ..training.nft import NftConfig, NftJob

    with flags_named("train nft"):
        config, job = sealed_parts(args, "train nft")
        return NftJob(config=NftConfig(**config), **job, **_reward_of(args)).check(resume=args.resume)


def grpo_main(argv: Sequence[str]) -> int:
    """`h3lab train grpo ...` (module docstring)."""
    def ratio_text(summary: dict) -> str:
        ratio = summary["ratio"]
        return (f"on-policy ratio - 1 in [{ratio['min']:.3g}, {ratio['max']:.3g}] ({ratio['exactly_one']}/"
                f"{ratio['count']} exactly 1)")

    return _rl_main("grpo", "GRPO", argv, build_grpo_parser, grpo_job_from_args, GrpoProgress(), ratio_text)


def nft_main(argv: Sequence[str]) -> int:
    """`h3lab train nft ...` (module docstring)."""
    def gap_text(summary: dict) -> str:
        gap = summary["on_policy"]
        return (f"first training forward vs the previous policy: {gap['exactly_equal']}/{gap['count']} byte-equal, "
                f"max |dv| {gap['max_abs']:.3g}")

    return _rl_main("nft", "DiffusionNFT", argv, build_nft_parser, nft_job_from_args, NftProgress(), gap_text)


def _rl_main(command: str, label: str, argv: Sequence[str], parser: Callable, job_of: Callable, progress: Callable,
             statistic: Callable[[dict], str]) -> int:
    """One RL front end: parse, check, train through `grpo_job.run_grpo_job` (the job's hooks pick the algorithm),
    print three lines."""
    def work() -> dict:
        args = parser().parse_args(argv)
        job = job_of(args)
        gib = check_gpu_memory_flag(args)
        from ..app.session import Session
        from ..training.grpo_job import run_grpo_job

        session = Session(job.snapshot, device=job.device, **({} if gib is None else
                                                              {"residency": "streamed", "gpu_memory": gib}))
        return run_grpo_job(job, session, resume=args.resume, progress=progress)

    code, summary = _guarded(f"h3lab train {command}", work)
    if code:
        return code
    print(f"trained {summary['iterations']} {label} iterations, last mean reward {summary['reward_mean']:.6g}; "
          f"{statistic(summary)}; run digest {summary['digest']}")
    print(f"adapter {summary['adapter_sha256']} in {summary['adapter']}")
    print(f"sealed run in {summary['run']}")
    return 0


class GrpoProgress:
    """One line per iteration on stderr: mean reward (a sum's parts) and the first epoch's ratio statistics; on a
    terminal also the phase the running iteration is in (rollout, reward, training step) and its seconds so far,
    redrawn."""

    label = "grpo"

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def phase(self, k: int, total: int, text: str) -> None:
        if self.live:
            self.stream.write(f"\r{self.label} {k + 1}/{total}: {text} ({time.perf_counter() - self.t0:.0f} s)\033[K")
            self.stream.flush()

    def line(self, k: int, total: int, record: dict, statistics: str) -> None:
        rewards = record["rewards"]
        self.stream.write(("\r\033[K" if self.live else "") +
                          f"{self.label} {k}/{total}: mean reward {sum(rewards) / len(rewards):.6g}"
                          f"{parts_text(record)}, {statistics}, {time.perf_counter() - self.t0:.1f} s\n")
        self.stream.flush()

    def __call__(self, k: int, total: int, record: dict) -> None:
        ratio = record["epochs"][0]["ratio"]
        self.line(k, total, record, f"ratio - 1 [{ratio['min']:.3g}, {ratio['max']:.3g}], clipped "
                                    f"{record['epochs'][-1]['clipped']}")


class NftProgress(GrpoProgress):
    """One line per iteration on stderr: mean reward (a sum's parts), the first epoch's loss and on-policy gap."""

    label = "nft"

    def __call__(self, k: int, total: int, record: dict) -> None:
        first = record["epochs"][0]
        gap = first["on_policy"]
        self.line(k, total, record, f"loss {first['loss']:.4g}, v_old gap {gap['exactly_equal']}/{gap['count']} "
                                    "byte-equal")


def parts_text(record: dict) -> str:
    """` (name mean, ...)` of a weighted-sum reward's parts; "" for one reward."""
    parts = [f"{p['name']} {p['mean']:.4g}" for p in record.get("reward_parts") or []]
    return f" ({', '.join(parts)})" if parts else ""


def job_from_args(args: argparse.Namespace):
    """The checked `TrainJob` of the flags (every check before any model loads)."""
    from ..training import TrainConfig
    from ..training.job import TrainJob

    with flags_named("train"):
        config, job = sealed_parts(args, "train")
        return TrainJob(config=TrainConfig(**config), **job).check(resume=args.resume)


class Progress:
    """One redrawn line per step on a terminal (`train [####....] 3/10 loss 0.1234 1.20 s/step`, then `graph` when
    the step's micro-batches replayed from a CUDA graph, `h3lab.training.step_graph`), nothing else."""

    def __init__(self, stream: TextIO | None = None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, step: int, total: int, record: dict) -> None:
        from ..training import step_graph

        graph = " graph" if step_graph.last_path().get("cuda_graph") in ("captured", "replay") else ""
        self.draw("train", step, total, f"loss {record['loss']:.4g} {self.rate(step):.2f} s/step{graph}")

    def rate(self, done: int) -> float:
        """Seconds per item so far."""
        return (time.perf_counter() - self.t0) / max(done, 1)

    def draw(self, label: str, done: int, total: int, text: str) -> None:
        """`label [####....] done/total text`, redrawn; a newline after the last item (`h3lab encode` draws too)."""
        if not self.enabled:
            return
        bar = int(self.width * done / total)
        self.stream.write(f"\r{label} [{'#' * bar}{'.' * (self.width - bar)}] {done}/{total} {text}   ")
        if done == total:
            self.stream.write("\n")
        self.stream.flush()


def _guarded(prog: str, work: Callable[[], dict], interrupted: str = "interrupted; continue with the same command "
             "and --resume") -> tuple[int, dict | None]:
    """(0, work()), or the exit status after one stderr line: 130 on Ctrl-C, 2 on any error (H3LAB_DEBUG=1 raises)."""
    try:
        return 0, work()
    except KeyboardInterrupt:
        print(f"{prog}: {interrupted}", file=sys.stderr)
        return 130, None
    except Exception as err:  # noqa: BLE001 - one line, exit 2
        if os.environ.get("H3LAB_DEBUG"):
            raise
        print(f"{prog}: error: {user_message(err)}", file=sys.stderr)
        return 2, None


def mesh_for(args: argparse.Namespace, job):
    """The training mesh the flags (or torchrun's WORLD_SIZE) ask for, built on every rank; None for one process.
    Every value is checked before the process group starts: degrees, data-parallel batch, strict mode, the
    snapshot's heads."""
    from types import SimpleNamespace

    from ..distributed.frontend import mesh_request
    from ..distributed.mesh import check_config, check_degrees

    if args.tp is None and args.cp is None and args.dp is None and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    topology = check_degrees(1 if args.tp is None else args.tp, 1 if args.cp is None else args.cp, False)
    dp = 1 if args.dp is None else args.dp
    if dp < 1:
        raise TrainArgError(f"--dp {dp}: must be a positive integer")
    if dp > job.config.batch_size:
        raise TrainArgError(f"--dp {dp} with --batch-size {job.config.batch_size}: every data-parallel replica needs "
                            "a request of each step (--batch-size >= --dp)")
    if args.gradient_checkpointing:
        flags = " ".join(f"--{k} {v}" for k, v in (("tp", topology.tp), ("cp", topology.cp)) if v > 1) or "--dp"
        raise TrainArgError(f"--gradient-checkpointing with {flags}: it recomputes blocks outside the "
                            "sharded forward; train on a mesh without it (it is byte-neutral)")
    from ..adapters.field import snapshot_config

    check_config(topology, snapshot_config(Path(job.snapshot), job.variant))
    request = SimpleNamespace(tp=topology.tp, cp=topology.cp, dp=dp, sp=False, row_parallel=None, share_device=False,
                              device=args.device, mode=None if args.mode == "strict" else args.mode)
    return mesh_request(request)


def _placer(mesh):
    """`run_job`'s `place`: parallelize the adapted model on `mesh`; the mesh record the manifest keeps."""
    def place(model) -> dict:
        from ..distributed import parallelize

        parallelize(model, mesh)
        return {"mesh": mesh.to_dict()}

    return place


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["grpo"]:
        return grpo_main(argv[1:])
    if argv[:1] == ["nft"]:
        return nft_main(argv[1:])
    lead = [True]

    def work() -> dict:
        args = build_parser().parse_args(argv)
        job = job_from_args(args)
        mesh = mesh_for(args, job)
        from ..training.job import load_model, run_job

        gib = check_gpu_memory_flag(args)
        if mesh is None:
            model, place = streamed_model(job, gib) if gib is not None else (load_model(job), None)
            return run_job(job, model, resume=args.resume, progress=Progress(), place=place)
        if gib is not None:
            raise TrainArgError("--gpu-memory on a mesh: a budget streams one process's blocks; shard them with "
                                "--tp / --cp instead")
        from ..distributed.frontend import close_mesh
        from ..distributed.peers import watch

        lead[0] = mesh.rank == 0
        with watch(mesh, "step"):  # a rank that fails or dies is named in one line on every survivor
            summary = run_job(job, load_model(job, mesh.device), resume=args.resume,
                              progress=Progress() if lead[0] else None, place=_placer(mesh), lead=lead[0],
                              dp_group=mesh.dp_group)
        close_mesh()
        return summary

    code, summary = _guarded("h3lab train", work)
    if code or not lead[0]:
        return code
    print(f"trained {summary['steps']} steps, last loss {summary['loss']:.6g}; run digest {summary['digest']}")
    print(f"adapter {summary['adapter_sha256']} in {summary['adapter']}")
    print(f"sealed run in {summary['run']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
