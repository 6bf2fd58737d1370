"""The flags of `h3lab train`, `h3lab train grpo` and `h3lab train nft`, each declared once (`h3lab.schema.program`).

A flag the three programs share (the LoRA, AdamW, seed, mode, the job folder) is one declaration naming the three;
a flag that means another thing in another program (`--steps`: optimiser steps of `train`, denoising passes of a
rollout; `--stepper` and `--level`, whose defaults differ) is one declaration per meaning. `seal` says which record
holds the value: "config" (`TrainConfig` / `GrpoConfig` / `NftConfig`), "optim" (their `OptimizerConfig`),
"objective" (their `Objective`), "job" (`TrainJob` / `GrpoJob`); the values of a flag without one are not sealed
(`--resume`, `--gpu-memory`, the mesh degrees: a record beside the run) or are combined by the front end
(`--reward` / `--reward-server`: exactly one, `h3lab.frontends.train`). The configs and jobs check the values; their
`SettingError`s name the flag through these declarations. `--stepper`'s choices are read from the stepper registry
(`stochastic.sde_steppers`) when a parser is built.
"""

from __future__ import annotations

from ..execution.runtime import MODES
from ..adapters.lora import PROJECTIONS
from ..training.nft.objective import OLD_BATCHES
from ..training.objective import SettingError
from .program import declare_flag
from .setting import Setting

TRAIN, GRPO, NFT = "train", "train grpo", "train nft"
RL = (GRPO, NFT)
ALL = (TRAIN, GRPO, NFT)
GPU_MEMORY_HELP = ("budget for the DiT's frozen weights on the device: the blocks that fit stay resident, the rest "
                   "stream through slots in the forward and again in the backward (needs --gradient-checkpointing; "
                   "bytes equal the resident run's; default: all resident)")


def flag(name: str, type_: type, default, help_: str, programs: tuple[str, ...], **kw) -> Setting:
    return declare_flag(Setting(name, type_, default, help_, target="command", programs=programs, **kw))


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise SettingError("", what, text, "must be a number") from None


def _rollouts(pairs: list) -> tuple[tuple[str, float], ...]:
    return tuple((path, _number(reward, f"--rollout {path} reward")) for path, reward in pairs)


def _selection(text: str):
    """--passes all | fraction:F | window:START,SIZE as a `PassSelection`."""
    from ..training.grpo import PassSelection
    from ..training.objective import TrainingError

    kind, _, arg = text.partition(":")
    fraction = _number(arg, "--passes fraction") if kind == "fraction" and arg else None
    try:
        if kind == "all" and not arg:
            return PassSelection("all")
        if fraction is not None:
            return PassSelection("fraction", fraction=fraction)
        if kind == "window" and arg.count(",") == 1:
            start, size = arg.split(",")
            if start.isdigit() and size.isdigit():
                return PassSelection("window", start=int(start), size=int(size))
    except TrainingError as err:
        raise SettingError("", "--passes", text, str(err)) from None
    raise SettingError("", "--passes", text, "must be all, fraction:F (0 < F <= 1) or window:START,SIZE")


def _sde_steppers() -> tuple[str, ...]:
    from ..stochastic import sde_steppers

    return sde_steppers()


def _nft_steppers() -> tuple[str, ...]:
    return ("euler", *_sde_steppers())  # the released deterministic step, then the registered SDE steppers


# ------------------------------------------------------------------------------------- the data and the folder
flag("prompts", str, None, "one prompt a line ('#' lines are comments)", RL, required=True, metavar="FILE",
     seal="job")
flag("group", int, 4, "rollouts per prompt", RL, metavar="G", seal="config")
flag("reward", str, None, "prompt_match (and its parts colour_match, ...), brightness, redness, colour, pitch, "
     "anchor_match, latent_mean, a weighted sum NAME:W,NAME:W, or package.module:function", RL,
     metavar="NAME|NAME:W,...|module:function")
flag("reward_server", str, None, "score with a reward server instead (http://HOST:PORT/PATH; scripts/reward_server.py)",
     RL, metavar="URL")
flag("reward_timeout", float, 60.0, "seconds per reward-server call", RL)
flag("reward_retries", int, 2, "retries of a failed reward-server call", RL)
flag("out", str, None, "job folder: checkpoints, final adapter, sealed run", ALL, required=True, metavar="DIR",
     seal="job")
flag("iterations", int, 1, "rollout + update iterations", RL, seal="job")
flag("snapshot", str, None, "snapshot (default: the embedded h3-shapes snapshot)", ALL, flag="--model",
     aliases=("-d",), metavar="PATH", seal="job")
flag("variant", str, "transformer", "transformer (t2va/fl2va) or transformer_ref (ref2va)", (TRAIN,), seal="job")
flag("device", str, None, "torch device (default: cuda if available, else cpu)", ALL, seal="job")
flag("clips", str, None, "sealed clip dataset (h3lab encode, training.save_dataset)", (TRAIN,), metavar="DATASET",
     seal="job")
flag("rollout", str, None, "sealed rollout (latents kept) and its reward; repeat for several", (TRAIN,), nargs=2,
     repeat=True, metavar=("TRAJECTORY", "REWARD"), seal="job", field="rollouts", parse=_rollouts)
flag("steps", int, 4, "denoising passes of each rollout", RL, seal="job")
for _side in ("width", "height"):
    flag(_side, int, None, f"rollout canvas {_side} (default: the snapshot's native)", RL, seal="job")
flag("frames", int, None, "rollout frames (default: the snapshot's native)", RL, seal="job")

# ------------------------------------------------------------------------------------------- the algorithms
flag("stepper", str, "flow_sde", "SDE transition of the rollouts", (GRPO,), choices=_sde_steppers, seal="config",
     field="kind")
flag("stepper", str, "euler", "rollout sampler (euler: the released deterministic step)", (NFT,),
     choices=_nft_steppers, seal="config", field="kind")
flag("level", float, 0.7, "noise level: flow_sde/cps a, dance_sde eta", (GRPO,), seal="config")
flag("level", float, None, "noise level of an SDE --stepper (default 0.7)", (NFT,), seal="config")
flag("clip_range", float, 1e-4, "surrogate clip range", (GRPO,), seal="config")
flag("nft_beta", float, 1.0, "DiffusionNFT's beta: how far the implicit policies sit from the previous one", (NFT,),
     seal="config", field="beta")
flag("ref_kl", float, 1e-4, "weight of |v - v_ref|^2 to the adapter-off reference", (NFT,), seal="config")
flag("adv_clip", float, 5.0, "advantage clip (DiffusionNFT: the advantage that maps to optimality 0 / 1)", RL,
     seal="config")
flag("beta", float, 0.0, "KL weight to the adapter-off reference", (GRPO,), seal="config")
flag("importance_cap", float, None, "truncated importance weights min(ratio, C) (default off)", (GRPO,), metavar="C",
     seal="config")
flag("draws", int, 1, "forward noisings per request per iteration", (NFT,), seal="config")
flag("inner_epochs", int, 1, "optimiser steps per iteration, each over the iteration's rollouts", RL, seal="config")
flag("passes", str, "all", "which SDE passes train (DanceGRPO fraction:0.6; MixGRPO window:0,4)", (GRPO,),
     metavar="all|fraction:F|window:S,W", seal="config", field="selection", parse=_selection)
flag("old_batch", str, "group", "previous-policy forwards per prompt group or per request (byte-equal in strict)",
     (NFT,), choices=OLD_BATCHES, seal="config")

# ------------------------------------------------------------------------------- the LoRA, the step, AdamW
flag("rank", int, 16, "LoRA rank", ALL, seal="job")
flag("alpha", float, None, "LoRA alpha (default = rank, a scaling of 1)", ALL, seal="job")
flag("targets", str, ",".join(PROJECTIONS), "Diffusers module paths/suffixes to adapt", ALL, seal="job",
     parse=lambda text: tuple(text.split(",")))
flag("lora_seed", int, 0, "seed of the adapter's initial A factors", ALL, seal="job")
flag("steps", int, 100, "optimiser steps", (TRAIN,), seal="config")
flag("batch_size", int, 1, "requests per step (their gradients combined in a fixed tree)", (TRAIN,), seal="config")
flag("lr", float, 1e-4, "AdamW learning rate", ALL, seal="optim")
flag("weight_decay", float, 0.0, "AdamW decoupled weight decay", ALL, seal="optim")
flag("seed", int, 0, "run seed (supervised: per-step clip sigma/noise draws; RL: rollout noise, pass selection, "
     "forward noisings)", ALL, seal="config")
flag("mode", str, "strict", "arithmetic of the rollouts and the step", ALL, choices=MODES, seal="config")
flag("gradient_checkpointing", bool, False, "recompute each block in the backward (byte-neutral; less memory)", ALL,
     seal="config")
flag("video_weight", float, 1.0, "weight of the video rows' loss", (TRAIN, NFT), seal="objective")
flag("audio_weight", float, 1.0, "weight of the audio rows' loss", (TRAIN, NFT), seal="objective")
flag("checkpoint_every", int, 10, "steps between checkpoints", (TRAIN,), metavar="K", seal="job")

# ------------------------------------------------------------------------------ how it runs (not sealed)
flag("resume", bool, False, "continue the job in --out from its newest checkpoint (from the start when it has none)",
     ALL)
flag("gpu_memory", float, None, GPU_MEMORY_HELP, ALL, metavar="GiB")
flag("cp", int, None, "context-parallel (Ulysses) degree, under torchrun", (TRAIN,))
flag("tp", int, None, "tensor-parallel degree, under torchrun", (TRAIN,))
flag("dp", int, None, "data-parallel replicas of the (tp, cp) mesh, under torchrun", (TRAIN,))
