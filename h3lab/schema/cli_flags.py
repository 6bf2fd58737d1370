"""The infrastructure flags of `h3lab` (the one-shot CLI, `--info`, `--replay`, the REPL), each declared once
(`h3lab.schema.program`); the settings flags beside them are generated from `SETTINGS` (`h3lab.schema.argv`).

Each declaration's `actions` are the CLI actions (`cli.action_of`: info, plan, replay, one-shot, repl) that take the
flag; `cli.check_flags` refuses it with any other (`-o` in the REPL, `-p` with `--replay`). `-d` and `--device` go
with every action. The five reference flags append to one ordered `references` list (`RefAction`, sealed as the
request's `references`), so mixed reference flags keep their command-line order. Flags with `order` below
`LEAD_ORDER` come first in `--help`, before the settings flags. None is sealed by a declaration: a generation seals
its `RunSpec` (the settings, the references, the anchors) and records placement and mesh beside the result.
"""

from __future__ import annotations

import argparse

from .program import declare_flag
from .setting import ACTIONS, Setting

LEAD_ORDER = 100.0
EVERY = ACTIONS
GENERATING = ("one-shot", "repl")
RUNNING = ("replay", *GENERATING)
PLACEMENT = ("plan", *RUNNING)


class RefAction(argparse.Action):
    """Appends (kind, values) to one ordered `references` list, so mixed reference flags keep their order."""

    def __call__(self, parser, namespace, values, option_string=None):
        refs = list(getattr(namespace, "references", None) or [])
        values = values if isinstance(values, list) else [values]
        refs.append((self.const, values))
        namespace.references = refs


def flag(name: str, type_: type, help_: str, actions: tuple[str, ...], default=None, **kw) -> Setting:
    return declare_flag(Setting(name, type_, default, help_, target="command", programs=("h3lab",), actions=actions,
                                **kw))


def reference(kind: str, help_: str, metavar, nargs=None) -> Setting:
    return flag(f"ref_{kind.replace('-', '_')}", str, help_, GENERATING, flag=f"--ref-{kind}", action=RefAction,
                const=kind, metavar=metavar, nargs=nargs, field="references")


flag("model", str, "snapshot directory (default: the embedded h3-shapes snapshot)", EVERY, aliases=("-d",),
     metavar="PATH", order=0)
flag("prompt", str, "prompt; generates once and exits", ("one-shot",), aliases=("-p",), order=1)
flag("output", str, "MP4 path (default h3lab.mp4); -o '' disables the MP4", ("one-shot",), aliases=("-o",),
     metavar="OUT.mp4", order=2)
flag("first_frame", str, "first-frame anchor (fl2va)", ("plan", *GENERATING), metavar="IMAGE")
flag("last_frame", str, "last-frame anchor (fl2va)", ("plan", *GENERATING), metavar="IMAGE")
reference("image", "image reference", "IMAGE")
reference("video", "video reference with its soundtrack", "VIDEO")
reference("silent-video", "video reference, soundtrack ignored", "VIDEO")
reference("video-audio", "video reference with a replacement soundtrack", ("VIDEO", "AUDIO"), nargs=2)
reference("audio", "standalone audio reference (needs an image or video reference)", "AUDIO")
flag("frames_dir", str, "also write every frame as PNG", ("one-shot",), metavar="DIR")
flag("wav", str, "also write the soundtrack as float32 WAV", ("one-shot",), metavar="OUT.wav")
flag("trajectory", str, "also seal the generation's trajectory in DIR (with --keep latents: a rollout for "
     "`h3lab train --rollout`)", ("one-shot",), metavar="DIR")
flag("show", bool, "preview the middle frame after every denoising pass", GENERATING)
flag("zoom", int, "--show display factor (default 2 for Retina; 1-8)", GENERATING)
flag("profile", bool, "print phase timings and peak memory", RUNNING)
flag("info", bool, "report the snapshot (and one forward) without generating", EVERY)
flag("json", bool, "machine-readable output for --info and generations", ("info", "plan", "one-shot"))
flag("replay", str, "run a .h3 replay and check its expect lines", ("replay",), metavar="FILE")
flag("update", bool, "with --replay: rewrite the expect lines", ("replay",))
flag("allow_unchecked", bool, "with --replay: do not run a generation that has no expect line for this machine's "
     "arithmetic class a second time (by default it runs twice and must give the same digest)", ("replay",))
flag("device", str, "torch device (default cuda if available, else cpu)", EVERY)
flag("residency", str, "keep components resident (default), load/release them per phase, or stream the DiT's blocks "
     "from host memory through two GPU slots", PLACEMENT, choices=("resident", "phased", "streamed"))
flag("gpu_memory", float, "GPU budget of the streamed DiT: blocks that fit stay resident, the rest stream (implies "
     "--residency streamed)", PLACEMENT, metavar="GiB")
flag("adaln", str, "tables: keep the blocks' AdaLN weights (13B of the 33B parameters) in host memory and hold only "
     "the AdaLN tables of the run's schedule on the GPU (byte-identical; default resident)", PLACEMENT,
     choices=("resident", "tables"))
flag("plan", bool, "with --info: what the settings need on the GPU (resident/streamed split, AdaLN tables, estimated "
     "peak) for the card, without loading anything", ("plan",))
flag("card_memory", float, "plan for (and refuse requests that do not fit) a card of this many GiB instead of this "
     "machine's GPU", PLACEMENT, metavar="GiB")
flag("session_dir", str, "REPL outputs, previews and history (default ./h3lab-session)", RUNNING, metavar="DIR")
flag("lora", str, "generate with this LoRA adapter (PEFT folder or Diffusers .safetensors)", GENERATING,
     metavar="PATH")
flag("tp", int, "tensor-parallel degree (under torchrun; world = tp*cp)", RUNNING)
flag("cp", int, "context-parallel (Ulysses) degree (under torchrun)", RUNNING)
flag("sp", bool, "sequence parallel inside each TP group (needs --tp > 1)", RUNNING)
flag("row_parallel", str, "row-parallel layers: the 8-chunk tree split by K (k_chunks) or by output columns "
     "(n_split)", RUNNING, choices=("auto", "k_chunks", "n_split"))
flag("share_device", bool, "every rank on one GPU (gloo; the collectives' bytes through CUDA IPC slots): proves a "
     "topology's bytes on one GPU (timings are bytes-only, never scaling)", RUNNING)
