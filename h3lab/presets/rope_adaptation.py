"""The 256x256 RoPE adaptation: at exactly a 256x256 canvas, halve every spatial rotary coordinate.

The seed (h3-metal): "At 256 square, H3 has only an 8x8 effective spatial-token grid ... H3 automatically halves
spatial RoPE coordinates at exactly 256 square. This removed repeating lattice artifacts ... without adding tokens or
runtime. Use `--use-reference-rope` to restore the released/MLX coordinates for parity checks."

Rule: when the target video latent grid is 16 x 16 (a 256 x 256 canvas: VAE x16; the canvas the DiT runs on, i.e.
the render size when one is set), the session seals `"rope": "halved"` in the run's preset, or `"rope": "reference"`
with `--use-reference-rope`; at any other size the preset has no `rope` key. `apply_rope_halving(run)` multiplies
the h and w columns of every row's `position_ids` by 0.5 (exact in float64: a power of two) -- target video, anchors,
references and audio (whose w sits on the width axis) alike, so the rows keep one coordinate system; text rows have
h = w = 0. The time axis is untouched. It changes the run's inputs only; the model has no special case.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .errors import PresetError

NATIVE_LATENT = 16  # 256 px / the video VAE's x16
ROPE_CHOICES = ("halved", "reference")


def is_native_256(layout: Any) -> bool:
    """True when the layout's target canvas is exactly 256 x 256 (a 16 x 16 latent grid)."""
    return layout is not None and (layout.latent_height, layout.latent_width) == (NATIVE_LATENT, NATIVE_LATENT)


def halve_spatial(position_ids: torch.Tensor) -> torch.Tensor:
    """(S, 3) positions with the h and w columns halved (a new tensor)."""
    out = position_ids.clone()
    out[:, 1:] = out[:, 1:] * 0.5
    return out


def check_native_256(run: Any, what: str) -> None:
    if run.layout is None:
        raise PresetError(f"{what}: the run spec carries no layout, so its canvas is unknown (RunSpec(layout=...))")
    if not is_native_256(run.layout):
        h, w = run.layout.latent_height, run.layout.latent_width
        raise PresetError(f"{what}: the RoPE adaptation is defined at exactly 256x256 (latents 16x16); this run's "
                          f"canvas has latents {w}x{h}")


@contextlib.contextmanager
def apply_rope_halving(run: Any) -> Iterator[Any]:
    """The run with its spatial rotary coordinates halved (module docstring)."""
    check_native_256(run, "rope='halved'")
    yield run.replace(inputs=run.inputs.replace(position_ids=halve_spatial(run.inputs.position_ids)))


# ------------------------------------------------------------------------------------------------ registration
def _validate(value: dict) -> dict:
    if "rope" not in value:
        return {}
    if value["rope"] not in ROPE_CHOICES:
        raise PresetError(f"rope={value['rope']!r}: must be one of {', '.join(ROPE_CHOICES)}")
    return {"rope": value["rope"]}


def _apply(value: dict, run: Any):
    if value["rope"] == "halved":
        return apply_rope_halving(run)
    check_native_256(run, "rope='reference'")
    return contextlib.nullcontext(run)


_DESCRIBE = {"halved": "rope: spatial coordinates halved at 256x256 (--use-reference-rope restores the released ones)",
             "reference": "rope: released coordinates at 256x256 (--use-reference-rope)"}


def _reply(new: Any, _state: Any) -> list[str]:
    return [f"reference rope {'on' if new.reference_rope else 'off'}"] + new.preset_notices


def _register() -> None:
    from ..schema import Control, Repl, Setting, declare
    from .registry import Preset, register_preset

    register_preset(Preset(
        "rope", _validate, _apply,
        lambda s, _model, layout: {"rope": "reference" if s.reference_rope else "halved"} if is_native_256(layout)
        else {},
        lambda p: [_DESCRIBE[p["rope"]]], order=40, apply_order=10))
    declare(Setting(
        "reference_rope", bool, False,
        "at 256x256 keep the released RoPE coordinates (default: spatial coordinates halved)", order=110,
        flag="--use-reference-rope",
        command=Repl(summary="at 256x256: the released RoPE coordinates, not halved ones", reply=_reply),
        control=Control("reference RoPE (256x256)", row="presets"),
        summary=lambda on: "reference rope" if on else None, maps="RunSpec.preset rope"))


_register()
