"""The schema's argparse side: `add_flags(parser, target)` adds one flag per declared setting, `changes(args)` reads
the given ones back as `GenerationSettings` changes, `session_options(args)` the `Session(...)` options, and
`flags(target)` / `flag_actions()` feed `cli.check_flags` (which action takes which flag).

Every generated flag defaults to None ("not given": the settings, or the session, keep their value), a bool flag is
`store_true` with default None, and flags sharing a `Setting.group` form one mutually exclusive group."""

from __future__ import annotations

import argparse
from typing import Any

from .setting import SETTINGS, Setting


def _kwargs(s: Setting) -> dict[str, Any]:
    kw: dict[str, Any] = {"dest": s.name, "default": None, "help": s.help or None}
    if s.type is bool:
        kw["action"] = "store_true"
    else:
        kw["type"] = s.type
        if s.metavar is not None:
            kw["metavar"] = s.metavar
        choices = s.allowed()
        if choices is not None:
            kw["choices"] = choices
    return kw


def add_flags(parser: argparse.ArgumentParser, target: str = "generation") -> None:
    """One flag per declared setting of `target` that has one, in the schema's order."""
    groups: dict[str, Any] = {}
    for s in SETTINGS.of(target):
        if s.flag is None:
            continue
        where = parser
        if s.group is not None:
            if s.group not in groups:  # never setdefault(..., add_group()): an unused empty group breaks --help
                groups[s.group] = parser.add_mutually_exclusive_group()
            where = groups[s.group]
        where.add_argument(s.flag, **_kwargs(s))


def flags(target: str = "generation") -> dict[str, str]:
    """argparse dest -> the flag as typed, for the settings of `target`."""
    return {s.name: s.flag for s in SETTINGS.of(target) if s.flag is not None}


def flag_actions() -> dict[str, set[str]]:
    """CLI action -> the dests of the declared flags it takes."""
    out: dict[str, set[str]] = {}
    for s in SETTINGS:
        if s.flag is not None:
            for action in s.actions:
                out.setdefault(action, set()).add(s.name)
    return out


def _given(args: argparse.Namespace, target: str) -> dict[str, Any]:
    """dest -> value of the flags of `target` that were given."""
    values = {s.name: getattr(args, s.name, None) for s in SETTINGS.of(target) if s.flag is not None}
    return {name: value for name, value in values.items() if value is not None}


def changes(args: argparse.Namespace) -> dict[str, Any]:
    """The generation settings the flags give (the ones not given are left out)."""
    return _given(args, "generation")


def session_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `Session(...)` keyword options the flags give."""
    return _given(args, "session")
