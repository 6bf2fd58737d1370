"""The panel's controls of the declared generation settings (`h3lab.schema`, `Setting.control`) and the one-line text
of an error.

Contract
- `setting_controls(settings, style)`: name -> widget for every generation setting with a control, in the schema's
  order, showing its current value. Numeric fields are unbounded on purpose: the settings validate every range with
  their one-line message, where a bounded widget would clamp silently (steps 0 -> 1).
- `shown_value(setting, value)` / `control_value(setting, value)`: a setting's value as its control shows it and back
  (None <-> the control's `off` value; typed as declared).
- `one_line(err)`: the first line of an error; an `H3Error` as it is, anything else prefixed with its class name.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W

from ...errors import H3Error
from ...schema import NO_VALUE, SETTINGS, Setting
from ...schema.generation_settings import GenerationSettings

FIXED_ROWS = ("canvas", "run", "presets")  # where the layout puts them; other rows follow the presets
_KINDS = {"int": W.IntText, "float": W.FloatText, "checkbox": W.Checkbox, "dropdown": W.Dropdown, "text": W.Text}


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    msg = text[0] if text else ""
    return msg if isinstance(err, H3Error) else f"{type(err).__name__}: {msg}"


def shown_value(setting: Setting, value: Any) -> Any:
    """A setting's value as its control shows it (None -> the control's `off` value)."""
    return setting.control.off if value is None and setting.control.off is not NO_VALUE else value


def control_value(setting: Setting, value: Any) -> Any:
    """A control's value as the setting's value: typed as declared, the `off` value -> None."""
    if setting.control.off is not NO_VALUE and value == setting.control.off:
        return None
    return setting.type(value) if setting.type in (int, float, bool) and setting.allowed() is None else value


def setting_controls(settings: GenerationSettings, style: dict) -> dict[str, W.Widget]:
    """name -> the control of every declared generation setting that has one (`h3lab.schema`, `Setting.control`).
    Numeric fields are unbounded on purpose: the settings validate every range with their one-line message, where a
    bounded widget would clamp silently (steps 0 -> 1)."""
    controls = {}
    for setting in SETTINGS.of("generation"):
        c = setting.control
        if c is None:
            continue
        kind = c.kind or ("checkbox" if setting.type is bool else "dropdown" if setting.allowed() is not None else
                          {int: "int", float: "float"}.get(setting.type, "text"))
        kw: dict[str, Any] = {"value": shown_value(setting, getattr(settings, setting.name)),
                              "description": c.description}
        if c.tooltip is not None:
            kw["tooltip"] = c.tooltip
        if kind == "checkbox":
            kw["indent"] = False
        else:
            kw.update(style=style, layout=W.Layout(width=c.width))
        if kind == "dropdown":
            kw["options"] = list(setting.allowed())
        if c.step is not None:
            kw["step"] = c.step
        controls[setting.name] = _KINDS[kind](**kw)
    return controls


def control_rows(controls: dict[str, W.Widget]) -> dict[str, list[str]]:
    """panel row -> the names of the declared controls in it, in the schema's order."""
    rows: dict[str, list[str]] = {}
    for name in controls:
        rows.setdefault(SETTINGS.get(name).control.row, []).append(name)
    return rows
