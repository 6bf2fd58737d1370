"""`PanelLayout`: every widget of the notebook panel and where it sits -- no handlers, no model.

Contract
- `PanelLayout(settings, model_name, factors, why_none, preview=False, drift=True, prompt_hint=..., num_blocks=None)`
  builds, from the initial `GenerationSettings`: the prompt; the declared settings' controls
  (`controls.setting_controls`, also attributes by name) placed by their `row` ("canvas", "run", "presets", then one
  row per other name); with `num_blocks` (the DiT's depth) the LoRA-strength sliders under the "lora" row
  (`lora_sliders.LoraScaleSliders`, attribute `lora_sliders`, else None); the random-seed button, the length in
  frames or seconds with its note, the strict set-up line and button; one toggle per ablation factor (`factors`:
  name -> "factor: description"; none: `why_none` is shown instead); the anchor and reference uploads and the
  reference list; Generate / Cancel, "live preview" and "drift vs previous run"; the progress bar and the status,
  error, "what ran" and timing lines; and the result's boxes (live preview, video, latent strip and drift heatmap,
  summary). `panel` is the whole `VBox` (CSS class `h3lab-workbench`).
- Text lines: `say(text)` sets the status, `show_error(message)` the error line; `status_text`, `error_text`,
  `whatran_text` read them back as plain text. `show_strict(setup)` shows a `whatran.StrictSetup` (colour by
  readiness, the button only where it can still help).
- `fixed_names()`: the attribute names of the layout's own widgets (a declared control may not take one).
"""

from __future__ import annotations

import html
import re
from typing import Any

import ipywidgets as W

from ...schema.generation_settings import GenerationSettings
from .controls import FIXED_ROWS, control_rows, setting_controls
from .lora_sliders import LoraScaleSliders

REFERENCE_UPLOAD_KINDS = ("image", "video", "silent-video", "audio")
STYLE = {"description_width": "70px"}


class PanelLayout:
    """The panel's widgets (see the module docstring)."""

    def __init__(self, s: GenerationSettings, model_name: str, factors: dict[str, str], why_none: str,
                 preview: bool = False, drift: bool = True, prompt_hint: str = "Describe the clip",
                 num_blocks: int | None = None):
        self.prompt = W.Textarea(value=s.prompt, description="prompt", placeholder=prompt_hint,
                                 layout=W.Layout(width="98%", height="60px"), style=STYLE)
        self._settings_widgets(s)
        self._ablation_widgets(s, factors, why_none)
        self._conditioning_widgets()
        self._run_widgets(s, preview, drift)
        self._result_widgets()
        self._fixed = set(vars(self)) | set(dir(type(self))) | {"_fixed", "controls", "panel", "lora_sliders"}
        # The declared settings' controls (h3lab.schema; `.seed`, `.steps`, `.layers`, ...), by panel row.
        self.controls = setting_controls(s, STYLE)
        for name, control in self.controls.items():
            if name not in self._fixed:
                setattr(self, name, control)
        # Sliders over the LoRA-strength text (per modality, per block) where the DiT's depth is known.
        text = self.controls.get("lora_scale")
        self.lora_sliders = LoraScaleSliders(text, num_blocks) if text is not None and num_blocks is not None else None
        self.panel = self._arrange(model_name)
        self.panel.add_class("h3lab-workbench")

    def fixed_names(self) -> set[str]:
        return set(self._fixed)

    # ---------------------------------------------------------------------------------------------- widgets
    def _settings_widgets(self, s: GenerationSettings) -> None:
        self.random_seed = W.Button(description="random", tooltip="draw a random seed", layout=W.Layout(width="80px"))
        by_seconds = s.seconds is not None
        self.length_unit = W.ToggleButtons(options=["frames", "seconds"], value="seconds" if by_seconds else "frames",
                                           style={"button_width": "80px"})
        self.length = W.FloatText(value=s.seconds if by_seconds else s.num_frames, description="length", style=STYLE,
                                  layout=W.Layout(width="160px"))
        self.length_note = W.Label(value="")
        self.strict_line = W.HTML(value="")
        self.strict_line.add_class("h3lab-strict-setup")
        self.strict_button = W.Button(description="set up strict (TRITON_INTERPRET=1)", icon="wrench",
                                      tooltip="set TRITON_INTERPRET=1 in this kernel before any Triton kernel exists",
                                      layout=W.Layout(width="auto", display="none"))

    def _ablation_widgets(self, s: GenerationSettings, factors: dict[str, str], why_none: str) -> None:
        self.ablation_toggles: dict[str, W.ToggleButton] = {}
        for name, text in factors.items():
            toggle = W.ToggleButton(value=name in s.ablations, description=name, tooltip=f"{name} -- {text}",
                                    layout=W.Layout(width="52px"), button_style="info" if name in s.ablations else "")
            toggle.add_class("h3lab-ablation")
            self.ablation_toggles[name] = toggle
        self.ablation_note = W.Label(value="" if factors else f"ablation toggles: none ({why_none})",
                                     layout=W.Layout(display="" if not factors else "none"))

    def _conditioning_widgets(self) -> None:
        self.first_upload = W.FileUpload(accept="image/*", multiple=False, description="first frame")
        self.last_upload = W.FileUpload(accept="image/*", multiple=False, description="last frame")
        self.first_label, self.last_label = W.Label(), W.Label()
        self.first_clear = W.Button(description="clear", layout=W.Layout(width="60px"))
        self.last_clear = W.Button(description="clear", layout=W.Layout(width="60px"))
        self.ref_kind = W.Dropdown(options=list(REFERENCE_UPLOAD_KINDS), value="image", description="reference",
                                   style=STYLE, layout=W.Layout(width="230px"))
        self.ref_upload = W.FileUpload(accept="", multiple=False, description="add reference")
        self.refs_box = W.VBox()

    def _run_widgets(self, s: GenerationSettings, preview: bool, drift: bool) -> None:
        self.generate_button = W.Button(description="Generate", button_style="success", icon="play")
        self.cancel_button = W.Button(description="Cancel", button_style="warning", icon="stop", disabled=True)
        self.preview_toggle = W.Checkbox(value=preview, indent=False, layout=W.Layout(width="auto"),
                                         description="live preview (one VAE decode per pass)")
        self.drift_toggle = W.Checkbox(value=drift, indent=False, layout=W.Layout(width="auto"),
                                       description="drift vs previous run (re-runs both)")
        self.progress = W.IntProgress(value=0, min=0, max=s.steps, description="passes", style=STYLE)
        self.status = W.HTML(value="ready", layout=W.Layout(flex="1 1 0%", margin="0 0 0 8px"))  # wraps
        self.error = W.HTML(value="")
        self.error.add_class("h3lab-error")
        self.whatran = W.HTML(value="<b>what ran:</b> no generation yet")
        self.whatran.add_class("h3lab-whatran")
        self.timing = W.HTML(value="")
        self.timing.add_class("h3lab-timing")

    def _result_widgets(self) -> None:
        self.preview = W.Image(format="png", layout=W.Layout(width="256px"))
        self.preview.add_class("h3lab-preview")
        self.video = W.Video(format="mp4", autoplay=False, loop=False, controls=True)
        self.video.add_class("h3lab-video")
        self.strip = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.strip.add_class("h3lab-latent-strip")
        self.drift_image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.drift_image.add_class("h3lab-drift")
        self.summary = W.HTML(value="")
        self.video_link = W.HTML(value="")
        self.preview_box = W.VBox()  # the newest pass's frame, while a run with live preview goes
        self.video_box = W.VBox()  # the result's video (or a link), once its MP4 is written
        self.results_box = W.VBox()  # latent strip, drift heatmap

    # ---------------------------------------------------------------------------------------------- arrangement
    def _arrange(self, model_name: str) -> W.VBox:
        ablation_box = W.HBox(list(self.ablation_toggles.values()), layout=W.Layout(flex_flow="row wrap"))
        ablation_box.add_class("h3lab-ablations")
        ablation_row = W.HBox([W.Label("ablations", layout=W.Layout(width="74px")), ablation_box],
                              layout=W.Layout(align_items="flex-start"))
        return W.VBox([
            W.HTML("<b>h3lab workbench</b> &mdash; " + html.escape(model_name)),
            self.prompt,
            self._row("canvas", {"seed": [self.random_seed]}),
            W.HBox([self.length_unit, self.length, self.length_note]),
            self._row("run", {"mode": [self.strict_button]}),
            self.strict_line,
            self._row("presets"),  # speed presets: validated by the settings (the DiT's depth by the session)
            *[part for row in control_rows(self.controls) if row not in FIXED_ROWS
              for part in ([self._row(row), self.lora_sliders.box] if row == "lora" and self.lora_sliders
                           else [self._row(row)])],
            ablation_row,
            self.ablation_note,
            W.HBox([self.first_upload, self.first_label, self.first_clear]),
            W.HBox([self.last_upload, self.last_label, self.last_clear]),
            W.HBox([self.ref_kind, self.ref_upload]),
            self.refs_box,
            W.HBox([self.generate_button, self.cancel_button, self.preview_toggle, self.drift_toggle]),
            W.HBox([self.progress, self.status], layout=W.Layout(align_items="center")),
            self.error,
            self.whatran,
            self.timing,
            W.HBox([self.preview_box, self.video_box, self.summary], layout=W.Layout(align_items="flex-start")),
            self.results_box,
        ])

    def _row(self, row: str, after: dict[str, list] | None = None) -> W.HBox:
        """One panel row of declared controls; `after` puts fixed widgets right after a control (seed: random)."""
        after = after or {}
        children = []
        for name in control_rows(self.controls).get(row, []):
            children += [self.controls[name], *after.get(name, [])]
        return W.HBox(children)

    # ---------------------------------------------------------------------------------------------- text lines
    def say(self, text: str) -> None:
        self.status.value = html.escape(text)

    def show_error(self, message: str) -> None:
        self.error.value = f"<span style='color:#c62828'>error: {html.escape(message)}</span>"

    def show_strict(self, setup: Any) -> None:
        """The strict set-up line: what strict needs on this device in this kernel, and the button where it helps."""
        colour = "#2e7d32" if setup.ready else "#8d6e00"
        self.strict_line.value = f"<span style='color:{colour}'>{html.escape(setup.line)}</span>"
        self.strict_button.layout.display = "" if setup.can_enable else "none"

    @property
    def status_text(self) -> str:
        """The status line as plain text."""
        return html.unescape(self.status.value)

    @property
    def error_text(self) -> str:
        """The error line as plain text ("" when none)."""
        return html.unescape(re.sub(r"<[^>]+>", "", self.error.value)).removeprefix("error: ")

    @property
    def whatran_text(self) -> str:
        """The "what ran" line as plain text."""
        return html.unescape(re.sub(r"<[^>]+>", "", self.whatran.value)).removeprefix("what ran: ")
