"""The declarations of `GenerationSettings`' own scalar settings: seed, length, size, render canvas, steps, reuse,
ablations (summary only: `!ablate` and the panel's toggles list the factors) and mode. The speed presets declare
theirs in their own files (`h3lab.presets.*`). Their rules live in `GenerationSettings.__post_init__`; the REPL
replies below are the lines each command prints."""

from __future__ import annotations

import os
import secrets
from typing import Any

from ..execution.runtime import MODES
from .generation_settings import DEFAULT_MODE, DEFAULT_SEED, DEFAULT_STEPS, DEFAULT_WIDTH, DEFAULT_HEIGHT
from .setting import Control, Repl, Setting, declare
from .words import int_word, one, p_seconds, size


def _p_seed(name, args):
    text = one(name, args, "N|random")
    return ("random",) if text == "random" else (int_word(name, text, "an integer seed or 'random'"),)


def _p_size(name, args):
    return size(name, one(name, args, "WxH"))


def _p_render(name, args):
    text = one(name, args, "WxH|off")
    return ("off",) if text == "off" else size(name, text)


def _length(new: Any, _state: Any) -> list[str]:
    return [f"{new.num_frames} frames ({new.duration:.3f} s)"] + list(new.notices)


def _render(new: Any, _state: Any) -> list[str]:
    if new.render_width is None:
        return ["render size off (model runs at the output size)"]
    return [f"render {new.render_width}x{new.render_height}, upscaled to {new.width}x{new.height}"]


def _check_mode(state: Any, new: Any) -> None:
    """`!mode strict` on a started CPU session without TRITON_INTERPRET=1 is refused now, not at the generation
    (the REPL state's `check_mode`: the session room owns what a device can run)."""
    check = getattr(state, "check_mode", None)
    if check is not None:
        check(new.mode)


def _mode(new: Any, state: Any) -> list[str]:
    mode = new.mode
    lines = [f"mode {mode}"]
    device = getattr(state.session, "device", None)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    on_cpu = getattr(device, "type", "") == "cpu"
    if mode == "strict" and on_cpu and not interpreted:
        lines.append("note: on the CPU strict kernels run only under TRITON_INTERPRET=1; without it strict fails "
                     "closed")
    elif mode == "strict" and on_cpu:
        lines.append("note: strict on the CPU runs Triton's interpreter: exact but slow (keep sizes small)")
    elif mode == "auto" and on_cpu:
        lines.append("note: auto on the CPU runs the torch ops (the interpreter only when strict is asked for)")
    elif mode == "fast":
        lines.append("note: fast is not strict (FP8 projections, cuDNN attention); CUDA inference only, refused on "
                     "the CPU")
    return lines


for _setting in (
    Setting("seed", int, DEFAULT_SEED, "seed (default 42)", order=10, maps="the noise generator's seed",
            command=Repl(usage="!seed N|random", summary="seed of the next generation (default 42)", parse=_p_seed,
                         complete=(("random",),),
                         changes=lambda _st, v: {"seed": secrets.randbelow(2**31) if v == "random" else v},
                         reply=lambda new, _st: [f"seed {new.seed}"]),
            control=Control("seed", row="canvas", width="220px")),
    Setting("seconds", float, None, "duration at 24 fps, rounded up to a legal count", order=20, group="length",
            maps="the frame count (RunSpec inputs)",
            command=Repl(usage="!seconds X", summary="duration at 24 fps, rounded up to a legal frame count",
                         parse=p_seconds, changes=lambda _st, v: {"seconds": v, "frames": None}, reply=_length)),
    Setting("frames", int, None, "frame count, snapped up to 17n+5", order=30, group="length",
            maps="the frame count (RunSpec inputs)",
            command=Repl(changes=lambda _st, v: {"frames": v, "seconds": None}, reply=_length)),
    Setting("width", int, DEFAULT_WIDTH, "", order=40, maps="the output canvas (RunSpec layout)",
            command=Repl(name="size", usage="!size WxH",
                         summary="output size (multiples of 32, area <= 768x1344, aspect 1:4-4:1)", parse=_p_size,
                         changes=lambda _st, w, h: {"width": w, "height": h},
                         reply=lambda new, _st: [f"size {new.width}x{new.height}"]),
            control=Control("width", row="canvas", step=32)),
    Setting("height", int, DEFAULT_HEIGHT, "", order=41, maps="the output canvas (RunSpec layout)",
            control=Control("height", row="canvas", step=32)),
    Setting("render_width", int, None, "internal canvas width (with --render-height)", order=50,
            maps="the canvas the model runs on (RunSpec layout)",
            command=Repl(name="render", usage="!render WxH|off",
                         summary="internal canvas, same aspect, upscaled to the output size", parse=_p_render,
                         complete=(("off",),), reply=_render,
                         changes=lambda _st, *v: {"render_width": None, "render_height": None} if v == ("off",)
                         else {"render_width": v[0], "render_height": v[1]})),
    Setting("render_height", int, None, "internal canvas height (with --render-width)", order=51,
            maps="the canvas the model runs on (RunSpec layout)"),
    Setting("steps", int, DEFAULT_STEPS, "denoising passes (default 20)", order=60, maps="RunSpec schedule",
            command=Repl(reply=lambda new, _st: [f"{new.steps} denoising passes ({new.num_points} sigma grid points)"]),
            control=Control("steps", row="run")),
    Setting("reuse", int, 1, "whole-velocity reuse interval (default 1)", order=70, maps="RunSpec.reuse",
            command=Repl(summary="whole-velocity reuse interval (1 = every pass runs the model)"),
            summary=lambda k: f"reuse {k}" if k > 1 else None),
    Setting("ablations", tuple, (), "ablation factors switched on (!ablate, the panel's toggles)", order=75,
            flag=None, maps="RunSpec.factors", summary=lambda v: f"ablations {','.join(v)}" if v else None),
    Setting("mode", str, DEFAULT_MODE, "transformer arithmetic (default auto)", order=120, choices=lambda: MODES,
            maps="RunSpec.mode", command=Repl(summary="arithmetic of the transformer", check=_check_mode, reply=_mode),
            control=Control("mode", kind="dropdown", row="run", width="200px")),
):
    declare(_setting)

# Session options (`Session(...)` keywords, passed on by `cli.session_from_args` when the flag is given).
declare(Setting("keep", str, None, "per-pass tensors the trajectory keeps (with -p: sealed in --trajectory DIR): latents "
                "(what `h3lab train --rollout` needs), velocities, noise; comma-separated", target="session",
                metavar="WHAT", actions=("one-shot", "repl"), order=900,
                maps="Session.keep, the trajectory recorder's keep (the digest does not change)"))
