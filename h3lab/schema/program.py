"""The command lines' flags as declared settings: one registry (`Schema`) per program, filled by `declare_flag`.

Programs: "h3lab" (the CLI's infrastructure flags, beside the generated settings flags of `argv.py`), "train",
"train grpo", "train nft", "encode". A `Setting` of target "command" names the programs that take it
(`Setting.programs`) and is declared once for all of them; a program's registry imports its declaring modules on
first use (`MODULES`).

From the declarations:
- `add_program_flags(parser, program)` adds every flag of `program` in the schema's order: `flag` and `aliases`,
  the declared `default`, `type`, `choices` (a callable is read when the parser is built), `metavar`, `required`,
  `nargs`, `repeat` (append) or a custom `action`, a bool as a switch, and the help with its default appended
  ("(default: X)") unless the text says it, the default is None or False, or the flag is required;
- `sealed(args, program, seal)` -> {keyword: value} of the flags sealed in one record ("config", "optim",
  "objective", "job"), each value through the declaration's `parse`;
- `flag_names(program)` -> {dest and keyword: flag}, so a `SettingError` raised by the config that checked a value
  names the flag the user typed (`--group 1: must be an integer >= 2`, `--stepper 'x': ...` for `kind`);
- `program_actions(program)` -> {CLI action: keywords}: which of `h3lab`'s actions take a flag (`Setting.actions`),
  what `cli.check_flags` refuses the others by.
A bad declaration (an unknown program, two flags of one program with one dest) is a `ValueError` at import.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from .setting import Schema, Setting

MODULES = {
    "h3lab": ("h3lab.schema.cli_flags",),
    "train": ("h3lab.schema.train_flags",),
    "train grpo": ("h3lab.schema.train_flags",),
    "train nft": ("h3lab.schema.train_flags",),
    "encode": ("h3lab.schema.encode_flags",),
}
PROGRAMS = {name: Schema(modules=modules) for name, modules in MODULES.items()}


def declare_flag(setting: Setting) -> Setting:
    """Declare a command flag in the registry of every program it names."""
    if setting.target != "command":
        raise ValueError(f"setting {setting.name!r}: declare_flag takes a setting of target 'command'")
    unknown = [p for p in setting.programs if p not in PROGRAMS]
    if unknown:
        raise ValueError(f"setting {setting.name!r}: program {unknown[0]!r} must be one of {', '.join(PROGRAMS)}")
    for program in setting.programs:
        PROGRAMS[program].declare(setting)
    return setting


def help_text(s: Setting) -> str:
    """The declared help, with the default appended where it says something (module docstring)."""
    if (s.default is None or s.default is False or s.required or "(default" in s.help or s.repeat
            or s.action is not None):
        return s.help
    shown = s.word(s.default) if not isinstance(s.default, bool) else s.default
    return f"{s.help} (default {shown})"


def _kwargs(s: Setting) -> dict[str, Any]:
    kw: dict[str, Any] = {"dest": s.name, "help": help_text(s)}
    if s.action is not None:
        return {**kw, "action": s.action, "const": s.const, **({"nargs": s.nargs} if s.nargs else {}),
                **({"metavar": s.metavar} if s.metavar else {})}
    kw["default"] = [] if s.repeat and s.default is None else s.default
    if s.type is bool:
        return {**kw, "action": "store_true"}
    kw["type"] = s.type
    for name in ("metavar", "nargs"):
        if getattr(s, name) is not None:
            kw[name] = getattr(s, name)
    if s.required:
        kw["required"] = True
    if s.repeat:
        kw["action"] = "append"
    choices = s.allowed()
    if choices is not None:
        kw["choices"] = choices
    return kw


def add_program_flags(parser: argparse.ArgumentParser, program: str,
                      orders: tuple[float, float] = (-math.inf, math.inf)) -> None:
    """Every declared flag of `program` whose `order` lies in [lo, hi), in the schema's order."""
    for s in PROGRAMS[program]:
        if orders[0] <= s.order < orders[1]:
            parser.add_argument(*s.aliases, s.flag, **_kwargs(s))


def sealed(args: argparse.Namespace, program: str, seal: str) -> dict[str, Any]:
    """keyword -> value of the flags of `program` sealed in `seal`, through each declaration's `parse`."""
    out = {}
    for s in PROGRAMS[program]:
        if s.seal == seal:
            value = getattr(args, s.name)
            out[s.keyword] = s.parse(value) if s.parse is not None and value is not None else value
    return out


def program_actions(program: str) -> dict[str, set[str]]:
    """CLI action -> the keywords of the flags of `program` it takes (`Setting.actions`)."""
    out: dict[str, set[str]] = {}
    for s in PROGRAMS[program]:
        for action in s.actions:
            out.setdefault(action, set()).add(s.keyword)
    return out


def flag_names(program: str) -> dict[str, str]:
    """dest and sealed keyword -> the flag as typed, for naming a checked value's error."""
    out = {}
    for s in PROGRAMS[program]:
        out[s.name] = s.flag
        out.setdefault(s.keyword, s.flag)
    return out
