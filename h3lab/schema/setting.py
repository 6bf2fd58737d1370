"""`Setting`, its REPL (`Repl`) and panel (`Control`) parts, and the one registry `SETTINGS` they are declared in.

A `Setting` is data: the front ends read it (`h3lab.schema.argv` builds the argparse flags, `h3lab.frontends.commands` the
`@command` entries, `h3lab.frontends.widgets` the panel's controls, `GenerationSettings.summary` the summary), nothing here
imports a front end. See `h3lab.schema` for how to declare one.

Targets: "generation" -- a value of `GenerationSettings` (a dataclass field there, or an *extra* the settings hold
for a setting declared only here), validated on every `GenerationSettings(...)` / `.replace(...)`; "session" -- an
option of `Session(...)` (a CLI flag read once by `cli.session_from_args`, no REPL command or control); "command" --
a flag of one or more command lines (`programs`: `h3lab train`, `h3lab encode`, the CLI's infrastructure flags),
declared in `PROGRAMS` (`h3lab.schema.program`), never in `SETTINGS`.

An extra's value is checked here (`check_extra`): its type (ints accept whole floats, floats accept ints, bools only
bools), `choices`, `bounds` (inclusive), then its `rule(value, settings) -> notices`; each failure is one
`ValidationError` line naming the value and the rule.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ValidationError

TARGETS = ("generation", "session", "command")
SEALS = ("config", "optim", "objective", "job")  # where a command flag's value is sealed (`Setting.seal`)
ACTIONS = ("one-shot", "repl", "replay", "info", "plan")  # the CLI's actions (`cli.action_of`)
NO_VALUE = object()  # `Control.off` unset: the control has no value meaning None


@dataclass(frozen=True)
class Repl:
    """The REPL command of a setting (`!name ...`). Every part is optional; the defaults follow the setting's type:
    `usage` "!name N" (int) / "X" (float) / "on|off" (bool) / "a|b" (choices) / "VALUE" (str); `parse(name, words)
    -> tuple` (raises `CommandError`, see `h3lab.schema.words`); `changes(state, *args) -> dict` of settings
    changes (default {setting: the parsed value}); `check(state, new)` runs before the new settings are kept (e.g.
    a session check); `reply(new, state) -> lines` (default ["name value"]); `complete`: keywords per argument
    position for the REPL's completer; `drain`: queued generations finish first."""

    name: str | None = None
    usage: str | None = None
    summary: str | None = None
    parse: Callable[[str, list[str]], tuple] | None = None
    changes: Callable[..., dict[str, Any]] | None = None
    check: Callable[[Any, Any], None] | None = None
    reply: Callable[[Any, Any], list[str]] | None = None
    complete: tuple[tuple[str, ...], ...] | None = None
    drain: bool = False


@dataclass(frozen=True)
class Control:
    """The panel control of a setting. `kind`: "int" | "float" | "checkbox" | "dropdown" | "text" (default from the
    type); `row`: the panel row it sits in ("canvas", "run", "presets" exist; another name makes a new row below the
    presets); `off`: the control value that stands for None (layers: 0); `width`, `step`, `tooltip` as ipywidgets."""

    description: str
    kind: str | None = None
    row: str = "settings"
    width: str = "160px"
    step: float | None = None
    tooltip: str | None = None
    off: Any = NO_VALUE


@dataclass(frozen=True)
class Setting:
    """One user setting, declared once (module docstring; `h3lab.schema` shows an example).

    `name` is the attribute (`settings.<name>`) and the argparse dest; `flag` the CLI flag (default
    "--name-with-dashes"; None: no flag); `group` puts flags in one mutually exclusive argparse group;
    `actions` the CLI actions that take the flag; `command` / `control` the REPL command and panel control (None:
    none); `summary(value) -> str | None` its part of `GenerationSettings.summary()` (None: nothing shown);
    `spec(value, settings) -> dict` the `RunSpec` keyword arguments it contributes (extras only; the fields of
    `GenerationSettings` are mapped by `pipeline.build_spec`), and `maps` says in words where it lands in the run;
    `order` sorts flags, commands, controls and summary parts.

    A command flag (target "command") also has: `programs`, the command lines that take it; `aliases` (short
    spellings, "-d"); `required`; `nargs` / `repeat` (argparse's nargs / append); `action` and `const` (a custom
    argparse action); `seal`, where its value is sealed ("config", "optim", "objective", "job": the keyword `field`
    (default `name`) of that record; None: not sealed, or combined with other flags by the front end); `parse`,
    applied to the given value when it is collected (may raise `SettingError`); its `default` is argparse's and the
    help shows it."""

    name: str
    type: type
    default: Any
    help: str
    target: str = "generation"
    order: float = 1000.0
    choices: tuple | Callable[[], tuple] | None = None
    bounds: tuple[float | None, float | None] | None = None
    rule: Callable[[Any, Any], list[str]] | None = None
    flag: str | None = ""
    metavar: str | None = None
    group: str | None = None
    actions: tuple[str, ...] = ("one-shot", "repl")
    command: Repl | None = None
    control: Control | None = None
    summary: Callable[[Any], str | None] | None = None
    spec: Callable[[Any, Any], dict[str, Any]] | None = None
    maps: str = ""
    programs: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    required: bool = False
    nargs: int | str | None = None
    repeat: bool = False
    action: Any = None
    const: Any = None
    seal: str | None = None
    field: str | None = None
    parse: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"setting {self.name!r}: the name must be a Python identifier (it is the argparse dest)")
        if self.target not in TARGETS:
            raise ValueError(f"setting {self.name!r}: target {self.target!r} must be one of {', '.join(TARGETS)}")
        if self.type not in (int, float, bool, str, tuple):
            raise ValueError(f"setting {self.name!r}: type {self.type!r} must be int, float, bool, str or tuple")
        unknown = sorted(set(self.actions) - set(ACTIONS))
        if unknown:
            raise ValueError(f"setting {self.name!r}: action {unknown[0]!r} must be one of {', '.join(ACTIONS)}")
        if self.flag == "":
            object.__setattr__(self, "flag", "--" + self.name.replace("_", "-"))
        if self.target in ("session", "command") and (self.command is not None or self.control is not None):
            raise ValueError(f"setting {self.name!r}: a {self.target} option has a flag only (no command, no control)")
        if (self.target == "command") != bool(self.programs):
            raise ValueError(f"setting {self.name!r}: programs {self.programs!r} go with target 'command' only")
        if self.seal is not None and self.seal not in SEALS:
            raise ValueError(f"setting {self.name!r}: seal {self.seal!r} must be one of {', '.join(SEALS)}")

    @property
    def keyword(self) -> str:
        """The keyword of the record a command flag's value is sealed in (`field`, default `name`)."""
        return self.field or self.name

    # ------------------------------------------------------------------------------------------------ values
    def allowed(self) -> tuple | None:
        return tuple(self.choices()) if callable(self.choices) else self.choices

    def word(self, value: Any) -> str:
        """The value as a user types it ("on"/"off" for a bool)."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return "off" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

    def check_extra(self, value: Any, settings: Any) -> tuple[Any, list[str]]:
        """(normalised value, notices) of an extra (module docstring); raises one `ValidationError` line."""
        if value is None and self.default is None:
            return None, []
        value = self._typed(value)
        choices = self.allowed()
        if choices is not None and value not in choices:
            raise ValidationError(f"{self.name}={value!r}: must be one of {', '.join(map(str, choices))}")
        if self.bounds is not None:
            lo, hi = self.bounds
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                span = f"between {lo:g} and {hi:g}" if lo is not None and hi is not None else (
                    f"at least {lo:g}" if lo is not None else f"at most {hi:g}")
                raise ValidationError(f"{self.name}={value!r}: must be {span}")
        return value, list(self.rule(value, settings) if self.rule is not None else [])

    def _typed(self, value: Any) -> Any:
        t = self.type
        if t is bool:
            if not isinstance(value, bool):
                raise ValidationError(f"{self.name}={value!r}: must be true or false")
            return value
        if t is int:
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValidationError(f"{self.name}={value!r}: must be an integer")
            return value
        if t is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValidationError(f"{self.name}={value!r}: must be a finite number")
            return float(value)
        if t is str and not isinstance(value, str):
            raise ValidationError(f"{self.name}={value!r}: must be a string")
        if t is tuple:
            return tuple(value)
        return value


class Schema:
    """The registry: name -> `Setting`, iterated in `order` (then declaration order). Listeners (`on_declare`) hear
    of every declaration, so a front end that generated its entries earlier (the command registry) adds the new
    one at once."""

    def __init__(self, modules: tuple[str, ...] = ()) -> None:
        self.modules = list(modules)  # imported on first use: they declare the settings
        self._settings: dict[str, Setting] = {}
        self._listeners: list[Callable[[Setting], None]] = []
        self._loaded = False

    def load(self) -> None:
        """Import the declaring modules once (lazily: `h3lab.schema.generation_settings` imports the presets, which declare here)."""
        if not self._loaded:
            self._loaded = True
            for module in self.modules:
                importlib.import_module(module)

    def declare(self, setting: Setting) -> Setting:
        if setting.name in self._settings:
            raise ValueError(f"setting {setting.name!r} is already declared")
        self._settings[setting.name] = setting
        for listener in list(self._listeners):
            listener(setting)
        return setting

    def withdraw(self, name: str) -> Setting | None:
        """Remove a declaration (tests); front ends generated from it keep what they built."""
        return self._settings.pop(name, None)

    def on_declare(self, listener: Callable[[Setting], None]) -> None:
        self._listeners.append(listener)

    def __iter__(self):
        self.load()
        return iter(sorted(self._settings.values(), key=lambda s: s.order))

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self._settings

    def get(self, name: str) -> Setting | None:
        self.load()
        return self._settings.get(name)

    def of(self, target: str) -> list[Setting]:
        return [s for s in self if s.target == target]

    def spec_fields(self, settings: Any) -> dict[str, Any]:
        """The `RunSpec` keyword arguments the declared settings contribute (`Setting.spec`) for `settings`; two
        settings naming one argument is a declaration error."""
        out: dict[str, Any] = {}
        for s in self.of("generation"):
            if s.spec is not None:
                fields = s.spec(getattr(settings, s.name), settings)
                taken = sorted(set(fields) & set(out))
                if taken:
                    raise ValueError(f"setting {s.name!r}: RunSpec argument {taken[0]!r} is set by another setting")
                out.update(fields)
        return out


# The modules that declare settings: a new room that declares one at import adds its module here.
SETTINGS = Schema(modules=("h3lab.schema.builtin", "h3lab.presets", "h3lab.stochastic.settings",
                           "h3lab.schema.lora_scale"))
declare = SETTINGS.declare
