"""The words of a REPL command: parsers `(name, words) -> tuple` that check the words after a command's name.

Each raises a one-line `CommandError` naming the command, the words and the expected form, and converts nothing it
cannot check (ranges are the settings' rules). `h3lab.frontends.commands` and the generated setting commands share them.
"""

from __future__ import annotations

import re

from ..errors import CommandError


def no_args(name: str, args: list[str]) -> tuple:
    """The parser of a command that takes no arguments."""
    if args:
        raise CommandError(f"!{name} takes no arguments, got {' '.join(args)!r}")
    return ()


def one(name: str, args: list[str], form: str) -> str:
    """The single word of a command that takes exactly one."""
    if len(args) != 1:
        raise CommandError(f"!{name} expects {form}, got {' '.join(args)!r}" if args else f"!{name} expects {form}")
    return args[0]


def int_word(name: str, text: str, form: str) -> int:
    if not re.fullmatch(r"[+-]?\d+", text):
        raise CommandError(f"!{name} {text}: expected {form}")
    return int(text)


def choice(name: str, text: str, choices: tuple[str, ...]) -> str:
    if text not in choices:
        raise CommandError(f"!{name} {text}: expected one of {'|'.join(choices)}")
    return text


def p_int(name, args):
    return (int_word(name, one(name, args, "N"), "N"),)


def p_float(name, args, form: str = "X", what: str = "a number"):
    text = one(name, args, form)
    try:
        value = float(text)
    except ValueError:
        raise CommandError(f"!{name} {text}: expected {what}") from None
    return (value,)


def p_seconds(name, args):
    return p_float(name, args, "X (seconds)", "a number of seconds")


def p_on_off(name, args):
    return (choice(name, one(name, args, "on|off"), ("on", "off")),)


def p_choice(choices: tuple[str, ...]):
    """The parser of a command taking one of `choices`."""

    def parse(name, args):
        return (choice(name, one(name, args, "|".join(choices)), choices),)

    return parse


def p_word(name, args):
    return (one(name, args, "VALUE"),)


def size(name: str, text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)[xX](\d+)", text)
    if not m:
        raise CommandError(f"!{name} {text}: expected WIDTHxHEIGHT, e.g. 512x512")
    return int(m.group(1)), int(m.group(2))
