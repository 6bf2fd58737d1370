"""The panel's LoRA-strength sliders: one per modality of the output rows (video, audio, text), one for the token
refiner and one per block of the DiT, written into and read from the `lora_scale` setting's text control -- the text
stays the one value the panel reads and seals (`h3lab.schema.lora_scale`); the sliders are a way to write it.

Contract
- `LoraScaleSliders(text, num_blocks)`: `box` holds a row of group sliders, a wrapping row of vertical per-block
  sliders (the block number under each) and a "reset" button. Sliders span `RANGE` in steps of `STEP`; a value
  typed outside it stays in the text until a slider moves (the slider shows it clamped, and moving any slider
  writes every slider's value).
- Moving a slider writes the normal form of every slider's value (`from_scales` -> `describe`) into `text`, keeping
  any block the text names at or beyond `num_blocks` (the session refuses those when the panel applies them, with
  its one-line message). Reset writes "" (every scale 1).
- Typing a valid text into `text` moves the sliders to it; an invalid text leaves them where they are (the panel's
  Generate reports the setting's error).
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W

from ...errors import H3Error
from ...schema.lora_scale import GROUPS, describe, from_scales, parse, scales_of

RANGE = (-1.0, 2.0)
STEP = 0.05


class LoraScaleSliders:
    """Sliders over the `lora_scale` text control (module docstring)."""

    def __init__(self, text: W.Text, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks!r}: must be an integer >= 0 (the DiT's blocks)")
        self.text = text
        self.num_blocks = num_blocks
        self._syncing = False
        self.groups = {g: W.FloatSlider(value=1.0, min=RANGE[0], max=RANGE[1], step=STEP, description=g,
                                        continuous_update=False, readout_format=".2f",
                                        layout=W.Layout(width="230px"), style={"description_width": "50px"})
                       for g in GROUPS}
        self.blocks = [W.FloatSlider(value=1.0, min=RANGE[0], max=RANGE[1], step=STEP, orientation="vertical",
                                     continuous_update=False, readout=False, description=str(b),
                                     tooltip=f"block {b}", layout=W.Layout(width="28px", height="110px"),
                                     style={"description_width": "0px"})
                       for b in range(num_blocks)]
        self.reset = W.Button(description="reset", tooltip="every scale 1 (the adapter's own scale)",
                              layout=W.Layout(width="70px"))
        for slider in [*self.groups.values(), *self.blocks]:
            slider.observe(self._slid, names="value")
        self.reset.on_click(lambda _b: setattr(self.text, "value", ""))
        text.observe(self._typed, names="value")
        block_row = W.HBox(self.blocks, layout=W.Layout(flex_flow="row wrap"))
        block_row.add_class("h3lab-lora-blocks")
        self.box = W.VBox([W.HBox([*self.groups.values(), self.reset]),
                           W.HBox([W.Label("blocks", layout=W.Layout(width="50px")), block_row])])
        self.box.add_class("h3lab-lora-sliders")
        self._typed({"new": text.value})

    def values(self) -> tuple[list[float], dict[str, float]]:
        """The sliders' block scales and group scales."""
        return [s.value for s in self.blocks], {g: s.value for g, s in self.groups.items()}

    def _slid(self, _change: Any) -> None:
        if self._syncing:
            return
        blocks, groups = self.values()
        try:
            beyond = {b: s for a, last, s in parse(self.text.value).get("blocks", []) for b in range(a, last + 1)
                      if b >= self.num_blocks} if self.text.value.strip() else {}
        except H3Error:
            beyond = {}
        text = describe(from_scales({**dict(enumerate(blocks)), **beyond}, groups))
        self._syncing = True
        try:
            self.text.value = text
        finally:
            self._syncing = False

    def _typed(self, change: Any) -> None:
        if self._syncing:
            return
        value = change["new"] if isinstance(change, dict) else change.new
        try:
            normal = parse(value) if value and value.strip() else {}
        except H3Error:
            return
        blocks, groups = scales_of(normal, self.num_blocks)
        self._syncing = True
        try:
            for slider, v in zip(self.blocks, blocks):
                slider.value = min(max(v, RANGE[0]), RANGE[1])
            for g, slider in self.groups.items():
                slider.value = min(max(groups[g], RANGE[0]), RANGE[1])
        finally:
            self._syncing = False
