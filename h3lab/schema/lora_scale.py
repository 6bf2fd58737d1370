"""The `lora_scale` setting: the strength of the loaded LoRA adapter per block and per modality of the output rows,
declared once -- `--lora-scale "blocks 0-19:0, audio:0.3"`, `!lora-scale SPEC|off`, the panel's "lora" row, the
summary part "LoRA scale ..." and the sealed `RunSpec.lora_scale` (applied by `h3lab.adapters.lora_scale`).

Grammar (`parse`): items separated by commas, each `TARGET:SCALE` with SCALE a finite number --
  `blocks A-B` / `blocks A` / `block A`   transformer blocks A..B (0-based, inclusive)
  `refiner`                              the token refiner's layers
  `video` / `audio` / `text`             the adapter's delta on the output rows of that modality (the packed rows
                                         of the video, audio and text streams; the refiner's rows are text rows)
A projection's delta is scaled by (its block's or the refiner's scale) x (its row's modality scale), on top of the
adapter's own scale; a target not named keeps 1. A block named twice or a modality named twice is refused.

Normal form (`normalise`, the sealed JSON): {"blocks": [[first, last, scale], ...] (maximal runs of consecutive
blocks with one scale, ascending, scale != 1), "refiner": s, "video": s, "audio": s, "text": s (only those != 1)};
{} means every scale 1 (the default: no field in the spec, its hash unchanged). Two spellings of one scaling give one
normal form and one result hash ("blocks 0-9:0, blocks 10-19:0" == "blocks 0-19:0"; "video:1" == nothing).
`describe(value)` writes the normal form back as text. Errors are one `ValidationError` line naming the flag, the
value and the rule. Pure: imports nothing of h3lab but the schema and errors.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from ..errors import CommandError, ValidationError
from .setting import Control, Repl, Setting, declare

MODALITIES = ("video", "audio", "text")
GROUPS = ("refiner",) + MODALITIES
FLAG = "--lora-scale"
_BLOCKS = re.compile(r"blocks?\s*(\d+)(?:\s*-\s*(\d+))?")
FORM = "TARGET:SCALE[, ...] with TARGET blocks A-B | block A | refiner | video | audio | text"


def _fail(text: str, rule: str) -> ValidationError:
    return ValidationError(f"{FLAG} {text!r}: {rule}")


def _scale(text: str, item: str, word: str) -> float:
    try:
        value = float(word)
    except ValueError:
        raise _fail(text, f"item {item!r}: the scale {word!r} must be a number") from None
    if not math.isfinite(value):
        raise _fail(text, f"item {item!r}: the scale must be a finite number")
    return value + 0.0  # -0.0 -> 0.0: one normal form


def parse(text: str) -> dict[str, Any]:
    """The normal form of a `--lora-scale` text (module docstring)."""
    if not isinstance(text, str) or not text.strip():
        raise _fail(str(text), f"expected {FORM}")
    blocks: dict[int, float] = {}
    groups: dict[str, float] = {}
    for raw in text.split(","):
        item = raw.strip()
        target, colon, word = item.rpartition(":")
        target = target.strip()
        if not colon or not target:
            raise _fail(text, f"item {item!r} must be TARGET:SCALE ({FORM})")
        scale = _scale(text, item, word.strip())
        found = _BLOCKS.fullmatch(target)
        if found is not None:
            first, last = int(found.group(1)), int(found.group(2) or found.group(1))
            if last < first:
                raise _fail(text, f"item {item!r}: the block range must ascend (A-B with A <= B)")
            taken = [b for b in range(first, last + 1) if b in blocks]
            if taken:
                raise _fail(text, f"item {item!r}: block {taken[0]} is named twice")
            blocks.update({b: scale for b in range(first, last + 1)})
        elif target in GROUPS:
            if target in groups:
                raise _fail(text, f"item {item!r}: {target} is named twice")
            groups[target] = scale
        else:
            raise _fail(text, f"item {item!r}: unknown target {target!r} ({FORM})")
    return _normal(blocks, groups)


def _normal(blocks: Mapping[int, float], groups: Mapping[str, float]) -> dict[str, Any]:
    runs: list[list] = []
    for b in sorted(blocks):
        s = blocks[b]
        if s == 1.0:
            continue
        if runs and runs[-1][1] == b - 1 and runs[-1][2] == s:
            runs[-1][1] = b
        else:
            runs.append([b, b, s])
    out: dict[str, Any] = {"blocks": runs} if runs else {}
    out.update({g: groups[g] for g in GROUPS if g in groups and groups[g] != 1.0})
    return out


def normalise(value: Any) -> dict[str, Any]:
    """The normal form of a `RunSpec.lora_scale` JSON value (itself normal or not); one-line error otherwise."""
    if not isinstance(value, Mapping):
        raise ValidationError(f"lora_scale={value!r}: must be an object like {{\"blocks\": [[0, 19, 0.0]], "
                              "\"audio\": 0.3}")
    unknown = sorted(set(value) - {"blocks", *GROUPS})
    if unknown:
        raise ValidationError(f"lora_scale key {unknown[0]!r}: keys are blocks, {', '.join(GROUPS)}")
    blocks: dict[int, float] = {}
    for run in value.get("blocks", []):
        ok = isinstance(run, (list, tuple)) and len(run) == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in run[:2]) and run[0] <= run[1]
        if not ok or isinstance(run[2], bool) or not isinstance(run[2], (int, float)) or not math.isfinite(run[2]):
            raise ValidationError(f"lora_scale blocks entry {run!r}: must be [first, last, scale] with "
                                  "0 <= first <= last and a finite scale")
        taken = [b for b in range(run[0], run[1] + 1) if b in blocks]
        if taken:
            raise ValidationError(f"lora_scale blocks entry {list(run)!r}: block {taken[0]} is named twice")
        blocks.update({b: float(run[2]) + 0.0 for b in range(run[0], run[1] + 1)})
    groups = {}
    for g in GROUPS:
        if g in value:
            v = value[g]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValidationError(f"lora_scale {g}={v!r}: must be a finite number")
            groups[g] = float(v) + 0.0
    return _normal(blocks, groups)


def _word(v: float) -> str:
    text = repr(float(v))
    return text[:-2] if text.endswith(".0") else text


def describe(value: Mapping[str, Any] | None) -> str:
    """The normal form as `--lora-scale` text ("" for every scale 1)."""
    if not value:
        return ""
    items = [f"blocks {a}-{b}:{_word(s)}" if a != b else f"block {a}:{_word(s)}" for a, b, s in value.get("blocks", [])]
    items += [f"{g}:{_word(value[g])}" for g in GROUPS if g in value]
    return ", ".join(items)


def from_scales(blocks: Mapping[int, float], groups: Mapping[str, float]) -> dict[str, Any]:
    """The normal form of per-block scales (block -> scale) and group scales (refiner / video / audio / text ->
    scale); a scale of 1 is left out (the panel's sliders write their values through this)."""
    return normalise({"blocks": [[int(b), int(b), float(v)] for b, v in sorted(blocks.items())],
                      **{g: float(v) for g, v in groups.items()}})


def scales_of(value: Mapping[str, Any] | None, num_blocks: int) -> tuple[list[float], dict[str, float]]:
    """Every block's scale (blocks 0..num_blocks-1) and every group's (`GROUPS`) of a normal form (None: all 1)."""
    blocks = [1.0] * num_blocks
    for a, b, s in (value or {}).get("blocks", []):
        for k in range(a, min(b, num_blocks - 1) + 1):
            blocks[k] = float(s)
    return blocks, {g: float((value or {}).get(g, 1.0)) for g in GROUPS}


def deepest_block(value: Mapping[str, Any]) -> int:
    """The highest block index the value names (-1 for none)."""
    return max((b for _, b, _ in value.get("blocks", [])), default=-1)


def _rule(value: Any, settings: Any) -> list[str]:
    if value is not None:
        parse(value)
    return []


def _spec(value: Any, settings: Any) -> dict[str, Any]:
    if value is None:
        return {}
    normal = parse(value)
    return {"lora_scale": normal} if normal else {}


def _p_scale(name: str, args: list[str]) -> tuple:
    if not args:
        raise CommandError(f"!{name} expects SPEC|off, e.g. !{name} blocks 0-19:0, audio:0.3")
    text = " ".join(args)
    return (None,) if text == "off" else (text,)


def _reply(new: Any, _state: Any) -> list[str]:
    text = describe(parse(new.lora_scale)) if new.lora_scale is not None else ""
    return [f"LoRA scale {text}" if text else "LoRA scale 1 everywhere (the adapter's own scale)"]


declare(Setting(
    "lora_scale", str, None,
    "the loaded LoRA adapter's strength per block and per modality of the output rows, e.g. "
    "\"blocks 0-19:0, audio:0.3\" (targets: blocks A-B, block A, refiner, video, audio, text; default 1 everywhere)",
    order=140, rule=_rule, spec=_spec, metavar="SPEC",
    maps="RunSpec.lora_scale (normal form; h3lab.adapters.lora_scale scales each LoRA layer's delta)",
    command=Repl(usage="!lora-scale SPEC|off", summary="LoRA strength per block and per modality (video/audio/text)",
                 parse=_p_scale, reply=_reply, complete=(("off", "blocks", "video:", "audio:", "text:"),)),
    control=Control("LoRA scale", kind="text", row="lora", width="320px", off=""),
    summary=lambda v: None if v is None or not parse(v) else f"LoRA scale {describe(parse(v))}",
))
