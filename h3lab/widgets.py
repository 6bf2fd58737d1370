"""`Workbench(session)`: one ipywidgets panel over a `Session` -- the notebook front end of h3lab.

Contract
- Controls: prompt, seed (+ random), output size, length in frames or seconds, steps, runtime mode (with what strict
  needs in this kernel and, where it can still work, a button that sets it up), the ablation factors as toggles
  (`h3lab.session.ablation_factors()`, the registry `!ablate` uses; tooltip = the factor), first/last-frame anchors
  and ordered references (uploads; a list with move up / move down / remove), Generate / Cancel, "live preview" and
  "drift vs previous run".
- State lives in a `commands.SessionState` (`wb.state`), the same object the REPL holds: anchors, references and
  ablations set through the command grammar (`wb.command("!ablate A1 on")`, `!first PATH`, ...) move the controls and
  vice versa; the scalar controls become one validated `GenerationSettings.replace(...)` on Generate.
- Validation happens before anything starts and never changes a value: every control is validated by the settings
  (steps 0, a bad size, an empty prompt, strict where it cannot run are refused with their one-line message, nothing
  is clamped); switching frames <-> seconds converts the number (22 frames <-> 0.9167 s), it does not reinterpret it.
- Generate runs on a worker thread (the kernel stays responsive, Cancel and other cells work). The run is the same
  `session.generate(settings, progress=..., cancel=...)` a notebook cell would make; the previous result leaves the
  panel when a run starts. Progress shows each pass's wall time and, when they differ, the model's share of it.
  "live preview" (off by default) decodes the newest pass's middle frames after every pass -- one VAE decode per pass,
  which can cost more than the pass itself; the status says how much.
- When the session returns, the result's text is on screen at once and Generate is usable again: the arithmetic that
  actually ran (`h3lab.whatran`: strict / torch / override counts from the trajectory's trace summary, e.g.
  "auto → torch ..." with the fallback's reason as recorded, CSS class `h3lab-whatran`), the
  settings summary (ablations included) and the trajectory hash. Its media follow on a second thread, each shown as
  it is ready: the per-step latent strip (`plots.latent_strip`, at most `strip_rows` rows, the rule printed;
  `<img class="h3lab-latent-strip">`), the numbered MP4 written into `out_dir` and played with its sound
  (`<video class="h3lab-video">`, at least 320 px wide, controls on), and, when two results exist and the option is
  on, their drift heatmaps (`session.drift`, class `h3lab-drift`). A new run started meanwhile takes over the panel;
  the earlier run's MP4 is still written (and a drift still being computed finishes first: the session runs one
  model job at a time). `wb.timings` and the timing line (class `h3lab-timing`) give every phase:
  the session's call, the preview share, the panel's own work, then the strip, the MP4 and the drift.
- The settings' controls (seed, width, height, steps, mode, the speed presets' layers / core reuse / token reduction /
  reference RoPE, and any setting declared later) are generated from the settings schema (`h3lab.schema`,
  `Setting.control`): `wb.controls` (name -> widget, also `wb.<name>`), placed by their `row` ("canvas", "run",
  "presets", then one row per other name); validated by `GenerationSettings` and, for the DiT's depth, by
  `Session.check_preset` on Generate.
- Any error -- validation, decoding, the model, cancellation -- ends up as one line in the panel (`wb.error`, class
  `h3lab-error`) and leaves the session and the panel usable; a failed run leaves no stale result on screen.
  `wb.wait(timeout)` joins the worker and the media thread (tests, scripts).

The workbench asks the session to keep per-step latents (`session.keep` gains "latents"); it never touches the
model: everything goes through `Session`, `h3lab.commands` and `h3lab.whatran`.
"""

from __future__ import annotations

import hashlib
import html
import re
import secrets
import shlex
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ipywidgets as W

from . import commands, plots, whatran
from .errors import H3Error, ValidationError
from .schema import NO_VALUE, SETTINGS, Setting
from .session import GenerationCancelled, StepInfo, ablation_factors
from .settings import FPS, GenerationSettings, seconds_to_frames

REFERENCE_UPLOAD_KINDS = ("image", "video", "silent-video", "audio")
VIDEO_INLINE_LIMIT = 64 * 2**20  # larger clips are linked by path instead of sent to the browser
VIDEO_MIN_PX, VIDEO_MAX_PX = 320, 640  # display width of the result video (small clips scaled up, controls usable)
STRIP_ROWS = 6  # latent-strip rows drawn in the panel (evenly spaced, first and last kept)
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    msg = text[0] if text else ""
    return msg if isinstance(err, H3Error) else f"{type(err).__name__}: {msg}"


FIXED_ROWS = ("canvas", "run", "presets")  # where the layout puts them; other rows follow the presets
_KINDS = {"int": W.IntText, "float": W.FloatText, "checkbox": W.Checkbox, "dropdown": W.Dropdown, "text": W.Text}


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


def _factors() -> tuple[dict[str, str], str]:
    """(name -> "factor: description", "") or ({}, the one-line reason there are none)."""
    try:
        return ablation_factors(), ""
    except H3Error as err:
        return {}, _one_line(err)


class Workbench:
    """The panel (see the module docstring). `settings` are initial `GenerationSettings` values (prompt, seed,
    width, height, frames or seconds, steps, mode, ablations, ...). `out_dir` receives the numbered MP4s (default: a
    fresh temporary folder); `upload_dir` the uploaded anchors and references (default: inside `out_dir`).
    `preview` turns the per-pass decoded preview on; `drift` the drift heatmaps against the previous run."""

    def __init__(
        self,
        session: Any,
        *,
        out_dir: str | Path | None = None,
        upload_dir: str | Path | None = None,
        drift: bool = True,
        preview: bool = False,
        strip_rows: int = STRIP_ROWS,
        **settings: Any,
    ):
        self.session = session
        if "latents" not in session.keep:
            session.keep = tuple(session.keep) + ("latents",)
        out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="h3lab-workbench-"))
        self.state = commands.SessionState(
            session=session, settings=GenerationSettings(**settings), out_dir=out, base_dir=Path.cwd()
        )
        self.upload_dir = Path(upload_dir) if upload_dir is not None else out / "uploads"
        self.strip_rows = strip_rows
        self.timings: dict[str, float] = {}  # phases of the last run (see `_run`)
        self._thread: threading.Thread | None = None  # the generation
        self._media: threading.Thread | None = None  # the latest result's strip, MP4 and drift
        self._run_id = 0
        self._summary_lines: list[str] = []
        self._cancel = threading.Event()
        self._syncing = False  # controls being set from the settings: no unit conversion, no re-validation
        self._pass_clock: float | None = None  # end of the previous progress callback (None before pass 1)
        self._pass_seconds = 0.0  # sum of the passes' own times (StepInfo.seconds)
        self._build(drift, preview)

    # ================================================================================================== layout
    def _build(self, drift: bool, preview: bool) -> None:
        s = self.state.settings
        style = {"description_width": "70px"}
        self.prompt = W.Textarea(value=s.prompt, description="prompt", placeholder="Describe the clip",
                                 layout=W.Layout(width="98%", height="60px"), style=style)
        # The declared settings' controls (h3lab.schema; `self.seed`, `self.steps`, `self.layers`, ...), by panel row.
        self.controls = setting_controls(s, style)
        for name, control in self.controls.items():
            setattr(self, name, control)
        self.random_seed = W.Button(description="random", tooltip="draw a random seed", layout=W.Layout(width="80px"))
        by_seconds = s.seconds is not None
        self.length_unit = W.ToggleButtons(options=["frames", "seconds"], value="seconds" if by_seconds else "frames",
                                           style={"button_width": "80px"})
        self.length = W.FloatText(value=s.seconds if by_seconds else s.num_frames, description="length", style=style,
                                  layout=W.Layout(width="160px"))
        self.length_note = W.Label(value="")
        self.strict_line = W.HTML(value="")
        self.strict_line.add_class("h3lab-strict-setup")
        self.strict_button = W.Button(description="set up strict (TRITON_INTERPRET=1)", icon="wrench",
                                      tooltip="set TRITON_INTERPRET=1 in this kernel before any Triton kernel exists",
                                      layout=W.Layout(width="auto", display="none"))

        factors, why_none = _factors()
        self.ablation_toggles: dict[str, W.ToggleButton] = {}
        for name, text in factors.items():
            toggle = W.ToggleButton(value=name in s.ablations, description=name, tooltip=f"{name} -- {text}",
                                    layout=W.Layout(width="52px"), button_style="info" if name in s.ablations else "")
            toggle.add_class("h3lab-ablation")
            toggle.observe(lambda ch: self._ablations_changed(ch["owner"]), names="value")
            self.ablation_toggles[name] = toggle
        self.ablation_note = W.Label(value="" if factors else f"ablation toggles: none ({why_none})",
                                     layout=W.Layout(display="" if not factors else "none"))
        ablation_box = W.HBox(list(self.ablation_toggles.values()), layout=W.Layout(flex_flow="row wrap"))
        ablation_box.add_class("h3lab-ablations")
        ablation_row = W.HBox([W.Label("ablations", layout=W.Layout(width="74px")), ablation_box],
                              layout=W.Layout(align_items="flex-start"))

        self.first_upload = W.FileUpload(accept="image/*", multiple=False, description="first frame")
        self.last_upload = W.FileUpload(accept="image/*", multiple=False, description="last frame")
        self.first_label, self.last_label = W.Label(), W.Label()
        self.first_clear = W.Button(description="clear", layout=W.Layout(width="60px"))
        self.last_clear = W.Button(description="clear", layout=W.Layout(width="60px"))
        self.ref_kind = W.Dropdown(options=list(REFERENCE_UPLOAD_KINDS), value="image", description="reference",
                                   style=style, layout=W.Layout(width="230px"))
        self.ref_upload = W.FileUpload(accept="", multiple=False, description="add reference")
        self.refs_box = W.VBox()

        self.generate_button = W.Button(description="Generate", button_style="success", icon="play")
        self.cancel_button = W.Button(description="Cancel", button_style="warning", icon="stop", disabled=True)
        self.preview_toggle = W.Checkbox(value=preview, indent=False, layout=W.Layout(width="auto"),
                                         description="live preview (one VAE decode per pass)")
        self.drift_toggle = W.Checkbox(value=drift, indent=False, layout=W.Layout(width="auto"),
                                       description="drift vs previous run (re-runs both)")
        self.progress = W.IntProgress(value=0, min=0, max=s.steps, description="passes", style=style)
        self.status = W.HTML(value="ready", layout=W.Layout(flex="1 1 0%", margin="0 0 0 8px"))  # wraps
        self.error = W.HTML(value="")
        self.error.add_class("h3lab-error")
        self.whatran = W.HTML(value="<b>what ran:</b> no generation yet")
        self.whatran.add_class("h3lab-whatran")
        self.timing = W.HTML(value="")
        self.timing.add_class("h3lab-timing")
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

        self.random_seed.on_click(lambda _b: self._random_seed())
        self.generate_button.on_click(lambda _b: self.generate())
        self.cancel_button.on_click(lambda _b: self.cancel())
        self.strict_button.on_click(lambda _b: self.set_up_strict())
        if "mode" in self.controls:
            self.mode.observe(lambda _ch: self._refresh_strict(), names="value")
        self.first_upload.observe(lambda ch: self._anchor_uploaded("first", ch), names="value")
        self.last_upload.observe(lambda ch: self._anchor_uploaded("last", ch), names="value")
        self.first_clear.on_click(lambda _b: self.command("!first clear"))
        self.last_clear.on_click(lambda _b: self.command("!last clear"))
        self.ref_upload.observe(self._reference_uploaded, names="value")
        self.length_unit.observe(self._unit_changed, names="value")
        self.length.observe(lambda _ch: self._length_changed(), names="value")

        self.panel = W.VBox([
            W.HTML("<b>h3lab workbench</b> &mdash; " + html.escape(str(getattr(self.session, "model_name", "")))),
            self.prompt,
            self._row("canvas", {"seed": [self.random_seed]}),
            W.HBox([self.length_unit, self.length, self.length_note]),
            self._row("run", {"mode": [self.strict_button]}),
            self.strict_line,
            self._row("presets"),  # speed presets: validated by the settings (the DiT's depth by the session)
            *[self._row(row) for row in dict.fromkeys(self._rows()) if row not in FIXED_ROWS],
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
        self.panel.add_class("h3lab-workbench")
        clash = [name for name, control in self.controls.items() if getattr(self, name) is not control]
        if clash:
            raise ValueError(f"setting {clash[0]!r}: its panel control's name is taken by the Workbench itself")
        self._length_changed()
        self._refresh_conditioning()
        self._refresh_strict()

    def _rows(self) -> dict[str, list[str]]:
        """panel row -> the names of the declared controls in it, in the schema's order."""
        rows: dict[str, list[str]] = {}
        for name in self.controls:
            rows.setdefault(SETTINGS.get(name).control.row, []).append(name)
        return rows

    def _row(self, row: str, after: dict[str, list] | None = None) -> W.HBox:
        """One panel row of declared controls; `after` puts fixed widgets right after a control (seed: random)."""
        after = after or {}
        children = []
        for name in self._rows().get(row, []):
            children += [self.controls[name], *after.get(name, [])]
        return W.HBox(children)

    def _repr_mimebundle_(self, **kwargs: Any):
        return self.panel._repr_mimebundle_(**kwargs)

    # ================================================================================================ settings
    def _random_seed(self) -> None:
        self.seed.value = secrets.randbelow(2**31)

    def _unit_changed(self, change: dict) -> None:
        """frames <-> seconds converts the number, so the request stays the same (22 frames = 0.9167 s); the note
        shows the snapped frame count either way."""
        if not self._syncing:
            value = float(self.length.value)
            if change["new"] == "seconds":
                self.length.value = value / FPS
            elif value > 0:
                self.length.value = float(seconds_to_frames(value))
        self._length_changed()

    def _length_changed(self) -> None:
        try:
            s = self.state.settings.replace(**self._length_settings())
            self.length_note.value = f"= {s.num_frames} frames ({s.duration:.3f} s)"
        except H3Error as err:
            self.length_note.value = _one_line(err)

    def _length_settings(self) -> dict[str, Any]:
        value = self.length.value
        if self.length_unit.value == "frames":
            return {"frames": int(value) if float(value).is_integer() else value, "seconds": None}
        return {"seconds": float(value), "frames": None}

    def _ablations_changed(self, toggle: W.ToggleButton | None = None) -> None:
        for t in [toggle] if toggle is not None else self.ablation_toggles.values():
            t.button_style = "info" if t.value else ""  # a switched-on factor is plainly visible
        if self._syncing or self.running:
            return
        try:
            self.state.settings = self.state.settings.replace(
                ablations=tuple(n for n, t in self.ablation_toggles.items() if t.value))
        except H3Error as err:
            self._show_error(_one_line(err))

    def _refresh_strict(self) -> None:
        """The strict set-up line: what strict needs on this device in this kernel, and the button where it helps."""
        setup = whatran.strict_setup(getattr(self.session, "device", "cpu"))
        colour = "#2e7d32" if setup.ready else "#8d6e00"
        self.strict_line.value = f"<span style='color:{colour}'>{html.escape(setup.line)}</span>"
        self.strict_button.layout.display = "" if setup.can_enable else "none"

    def set_up_strict(self) -> whatran.StrictSetup:
        """The "set up strict" button: `TRITON_INTERPRET=1` in this kernel, when that still works."""
        setup = whatran.enable_interpreter()
        self._refresh_strict()
        self._say(setup.line)
        return setup

    def current_settings(self) -> GenerationSettings:
        """The validated settings the controls describe (raises `H3Error` with one line; changes nothing)."""
        changes: dict[str, Any] = {
            "prompt": self.prompt.value,
            **{name: control_value(SETTINGS.get(name), c.value) for name, c in self.controls.items()},
            **self._length_settings(),
        }
        if self.ablation_toggles:
            changes["ablations"] = tuple(n for n, t in self.ablation_toggles.items() if t.value)
        settings = self.state.settings.replace(**changes)
        if not settings.prompt.strip():
            raise ValidationError("prompt='': empty prompt, describe the clip to generate")
        setup = whatran.strict_setup(getattr(self.session, "device", "cpu"))
        if settings.mode == "strict" and not setup.ready or settings.mode == "auto" and not setup.auto_ok:
            raise ValidationError(f"mode={settings.mode}: {setup.line}")
        if settings.layers is not None or settings.token_reduction:
            self.state.get_session().check_preset(settings)  # the DiT's depth, from its config
        return settings

    # ========================================================================================= commands / refs
    def command(self, line: str) -> list[str]:
        """Run one line of the shared grammar against this panel's state: a `!command` runs here and the controls
        follow the settings it changed; a prompt line becomes the prompt and starts a generation (on the worker,
        like the Generate button). Output (or the one-line error) shows in the panel; returns the output lines."""
        if self.running:
            self._show_error("a generation is running: wait for it or cancel it first")
            return []
        try:
            cmd = commands.parse(line)
            if cmd.name == "generate":
                self.prompt.value = cmd.args[0]
                return ["generating"] if self.generate() else []
            out = commands.execute(self.state, cmd)
        except H3Error as err:
            self._show_error(_one_line(err))
            return []
        self.error.value = ""
        self._say(out[-1] if out else "ok")
        self._sync_controls()
        return out

    def _sync_controls(self) -> None:
        """Controls <- `state.settings` (after a command changed them), then the anchor and reference lists."""
        s = self.state.settings
        self._syncing = True
        try:
            for name, control in self.controls.items():
                control.value = shown_value(SETTINGS.get(name), getattr(s, name))
            if s.seconds is not None:
                self.length_unit.value, self.length.value = "seconds", s.seconds
            else:
                self.length_unit.value, self.length.value = "frames", s.num_frames
            for name, toggle in self.ablation_toggles.items():
                toggle.value = name in s.ablations
        finally:
            self._syncing = False
        self._length_changed()
        self._refresh_conditioning()

    def _save_upload(self, change: dict) -> Path | None:
        files = change["new"]
        if not files:
            return None
        item = files[0]
        data = bytes(item["content"])
        change["owner"].value = ()  # reset the picker, so picking the same file again is a new change
        name = _SAFE.sub("_", Path(str(item.get("name", "upload"))).name)[-80:] or "upload"
        self.upload_dir.mkdir(parents=True, exist_ok=True)
        path = self.upload_dir / f"{hashlib.sha256(data).hexdigest()[:12]}-{name}"
        if not path.exists():
            from .io_utils import atomic_write_bytes

            atomic_write_bytes(path, data)
        return path

    def _anchor_uploaded(self, which: str, change: dict) -> None:
        path = self._save_upload(change)
        if path is not None:
            self.command(f"!{which} {shlex.quote(str(path))}")

    def _reference_uploaded(self, change: dict) -> None:
        path = self._save_upload(change)
        if path is not None:
            self.add_reference(self.ref_kind.value, path)

    def add_reference(self, kind: str, path: str | Path, audio: str | Path | None = None) -> list[str]:
        """Append a reference through the grammar (`!ref-<kind> PATH [AUDIO]`)."""
        args = " ".join(shlex.quote(str(p)) for p in (path, audio) if p is not None)
        return self.command(f"!ref-{kind} {args}")

    def move_reference(self, index: int, offset: int) -> None:
        """Move reference `index` (0-based) by `offset` places (request order is packing order)."""
        refs = list(self.state.settings.references)
        j = index + offset
        if not (0 <= index < len(refs) and 0 <= j < len(refs)):
            return
        refs[index], refs[j] = refs[j], refs[index]
        self.state.settings = self.state.settings.replace(references=tuple(refs))
        self._refresh_conditioning()

    def remove_reference(self, index: int) -> None:
        self.command(f"!ref-remove {index + 1}")

    def _refresh_conditioning(self) -> None:
        s = self.state.settings
        self.first_label.value = Path(s.first).name if s.first else "(none)"
        self.last_label.value = Path(s.last).name if s.last else "(none)"
        rows = []
        for i, ref in enumerate(s.references):
            up = W.Button(icon="arrow-up", tooltip="move up", layout=W.Layout(width="36px"), disabled=i == 0)
            down = W.Button(icon="arrow-down", tooltip="move down", layout=W.Layout(width="36px"),
                            disabled=i == len(s.references) - 1)
            remove = W.Button(icon="times", tooltip="remove", layout=W.Layout(width="36px"))
            up.on_click(lambda _b, i=i: self.move_reference(i, -1))
            down.on_click(lambda _b, i=i: self.move_reference(i, 1))
            remove.on_click(lambda _b, i=i: self.remove_reference(i))
            label = W.Label(f"{i + 1}. {ref.kind}: {Path(ref.path).name}" + (f" + {Path(ref.audio).name}" if ref.audio else ""))
            rows.append(W.HBox([label, up, down, remove]))
        self.refs_box.children = tuple(rows)

    # =============================================================================================== generate
    @property
    def running(self) -> bool:
        """A generation is running (the media of the previous result may still be drawn: see `wait`)."""
        return self._thread is not None and self._thread.is_alive()

    def generate(self) -> bool:
        """The Generate handler: validate, clear the previous result, start the worker. True when a run started."""
        clicked = time.perf_counter()
        if self.running:
            self._show_error("a generation is already running")
            return False
        try:
            settings = self.current_settings()
        except H3Error as err:
            self._show_error(_one_line(err))
            return False
        self.state.settings = settings
        self._run_id += 1  # media still being drawn for an earlier run no longer touch the panel
        self.error.value = ""
        self._clear_result()
        self._cancel.clear()
        self.progress.max = settings.steps
        self.progress.value = 0
        self.progress.bar_style = ""
        self._say(f"starting: {settings.summary()}")
        self.whatran.value = "<b>what ran:</b> running..."
        self.generate_button.disabled = True
        self.cancel_button.disabled = False
        self._thread = threading.Thread(target=self._run, args=(settings, clicked, self._run_id),
                                        name="h3lab-workbench", daemon=True)
        self._thread.start()
        return True

    def cancel(self) -> None:
        """Ask the running generation to stop before its next pass."""
        if not self.running:
            return
        self._cancel.set()
        self._say("cancelling...")

    def wait(self, timeout: float | None = None) -> bool:
        """Join the worker and then the media it started (latent strip, MP4, drift); True when nothing runs
        afterwards. `timeout` bounds each join."""
        for name in ("_thread", "_media"):
            thread = getattr(self, name)
            if thread is not None:
                thread.join(timeout)
        return not self.running and not (self._media is not None and self._media.is_alive())

    def _clear_result(self) -> None:
        self.preview_box.children = ()
        self.video_box.children = ()
        self.results_box.children = ()
        self.summary.value = ""
        self.timing.value = ""
        self.video.value = b""
        self.strip.value = b""
        self._summary_lines = []

    def _run(self, settings: GenerationSettings, clicked: float, run_id: int) -> None:
        """The worker: the generation, then the result's text at once; the media follow on their own thread.
        Phases in `self.timings` (seconds): `generate` the session's call (what a direct `session.generate` costs,
        plus the work it calls back into), `passes` the model passes as the session timed them, `outside_passes`
        the rest of its denoise phase (live preview decodes, progress callbacks, noise and recorder), `result` click
        -> result on screen and Generate usable again; then, drawn meanwhile: `strip`, `mp4` (writing the numbered
        MP4 and loading it into the player), `drift`, and `media` click -> everything shown."""
        t: dict[str, float] = {}
        self.timings = t
        self._pass_clock, self._pass_seconds = None, 0.0
        state, session = self.state, self.state.get_session()
        try:
            start = time.perf_counter()
            result = session.generate(
                settings, progress=self._on_progress, cancel=self._cancel,
                preview=self._on_preview if self.preview_toggle.value else None,
            )
            t["generate"] = time.perf_counter() - start
            t["passes"] = self._pass_seconds
            t["outside_passes"] = max(0.0, result.timings.get("denoise", 0.0) - self._pass_seconds)
            with state.lock:
                previous = state.results[-1] if state.results else None
                state.results = (state.results + [result])[-2:]
                mp4 = self._reserve_output()
            self.progress.value = self.progress.max
            self.progress.bar_style = "success"
            self._show_result(result)
            t["result"] = time.perf_counter() - clicked
            self._say(f"done: {result.settings.summary()} in {t['result']:.2f} s")
            self._show_timing()
            pair = (previous, result) if self.drift_toggle.value and previous is not None else None
            self._media = threading.Thread(target=self._draw_media, args=(t, result, mp4, pair, clicked, run_id),
                                           name="h3lab-workbench-media", daemon=True)
            self._media.start()
        except GenerationCancelled as err:
            self.progress.bar_style = "warning"
            self._say(_one_line(err))
            self.whatran.value = "<b>what ran:</b> cancelled, no result"
        except Exception as err:  # every failure becomes one line in the panel; the session stays usable
            self.progress.bar_style = "danger"
            self._say("failed")
            self.whatran.value = "<b>what ran:</b> failed, no result"
            self._clear_result()
            self._show_error(_one_line(err))
        finally:
            self.generate_button.disabled = False
            self.cancel_button.disabled = True
            self._refresh_strict()  # the first generation creates the Triton kernels: what strict needs may change

    def _reserve_output(self) -> Path | None:
        """The next numbered MP4 path, taken now (numbers follow generation order) although the media thread writes
        it later: `SessionState.next_output()` gives (number, path) without reserving, so the number is taken here."""
        number, path = self.state.next_output()
        self.state.counter = number
        return path

    def _draw_media(self, t: dict, result: Any, mp4: Path | None, pair: tuple | None, clicked: float,
                    run_id: int) -> None:
        """The latent strip, the MP4 and its player, the drift heatmaps -- after the result is on screen, so the
        next generation can start meanwhile; a newer run's panel is never touched (`run_id`), its MP4 is still
        written. `t` is this run's timings."""
        current = lambda: run_id == self._run_id  # noqa: E731
        for phase, draw in (("strip", self._show_strip), ("mp4", self._show_video), ("drift", self._show_drift)):
            if phase == "drift" and pair is None:
                continue
            begun = time.perf_counter()
            try:
                draw(result, mp4, pair, current)
            except Exception as err:  # one line; the other media still come
                if current():
                    self._show_error(f"{phase}: {_one_line(err)}")
            t[phase] = time.perf_counter() - begun
            if current():
                self._show_timing()
        t["media"] = time.perf_counter() - clicked
        if current():
            self._show_timing()

    # ============================================================================================== callbacks
    def _on_progress(self, info: StepInfo) -> None:
        """Pass k's wall time is measured from the end of pass k-1's callback (not known for pass 1, whose start is
        inside the session); `info.seconds` is the session's own time of the pass, without the preview decode and
        callbacks that follow it. The difference is shown when it matters."""
        now = time.perf_counter()
        self._pass_seconds += info.seconds
        self.progress.value = info.step
        kind = "model" if info.evaluated else "reused velocity"
        if self._pass_clock is None:
            line = f"pass {info.step}/{info.total}: {kind} {info.seconds:.2f} s"
        else:
            wall = now - self._pass_clock
            extra = max(0.0, wall - info.seconds)
            line = f"pass {info.step}/{info.total}: {wall:.2f} s"
            if extra > 0.2 * wall:
                what = "live preview decode" if self.preview_toggle.value else "outside the pass"
                line += f" ({kind} {info.seconds:.2f} s + {what} {extra:.2f} s)"
            else:
                line += f" ({kind})"
        self._say(line)
        self._pass_clock = time.perf_counter()

    def _on_preview(self, frame: Any, step: int, total: int) -> None:
        from .preview import png_bytes

        self.preview.value = png_bytes(frame)
        if self.preview not in self.preview_box.children:
            self.preview_box.children = (W.Label("live preview: newest pass, middle frame"), self.preview)

    # ================================================================================================ results
    def _show_result(self, result: Any) -> None:
        """What ran, the settings (ablations included) and the trajectory: text only, at once."""
        trace = result.trajectory.manifest.get("trace")
        reasons = [r.fallback for r in result.trace.fallbacks] if result.trace is not None else []
        line = whatran.what_ran(trace, result.settings.mode, reasons, result.settings.ablations)
        self.whatran.value = "<b>what ran:</b> " + html.escape(line)
        lines = list(result.settings.notices) + [result.settings.summary(), f"trajectory {result.trajectory_hash}"]
        lines += [f"forwards {result.evaluations}, peak memory {result.peak_memory / 2**20:.0f} MiB ({result.memory_kind})"]
        self._summary_lines = lines
        self._render_summary()
        self.preview_box.children = ()

    def _render_summary(self) -> None:
        self.summary.value = ("<pre style='font-size:12px; margin:0 0 0 12px'>"
                              + html.escape("\n".join(self._summary_lines)) + "</pre>")

    def _show_strip(self, result: Any, _mp4: Any, _pair: Any, current: Any) -> None:
        steps = plots.latent_steps(result)
        fig = plots.latent_strip(steps.video, steps.audio, step_labels=steps.step_labels, max_rows=self.strip_rows)
        png = plots.png_bytes(fig)
        if current():
            self.strip.value = png
            self.results_box.children = (self.strip,) + tuple(c for c in self.results_box.children if c is not self.strip)

    def _show_video(self, result: Any, mp4: Path | None, _pair: Any, current: Any) -> None:
        """Write the numbered MP4 (atomically, through the session) and show it, or link it when it is large."""
        if mp4 is None:
            if current():
                self.video_box.children = (W.Label("no output folder: video not written"),)
            return
        path = self.session.save(result, mp4).resolve()
        result.outputs.append(path)
        if not current():
            return
        self._summary_lines.append(f"wrote {path}")
        self._render_summary()
        label = W.Label(f"result: {path.name}")
        if path.stat().st_size <= VIDEO_INLINE_LIMIT:
            self.video.width = str(min(VIDEO_MAX_PX, max(VIDEO_MIN_PX, result.settings.width)))
            self.video.value = path.read_bytes()
            self.video_box.children = (label, self.video)
        else:
            self.video_link.value = (f"video not inlined (over {VIDEO_INLINE_LIMIT >> 20} MiB): "
                                     f"<code>{html.escape(str(path))}</code>")
            self.video_box.children = (label, self.video_link)

    def _show_drift(self, _result: Any, _mp4: Any, pair: tuple, current: Any) -> None:
        report = self.session.drift(*pair)
        png = plots.png_bytes(plots.drift_heatmaps(**plots.drift_inputs(report)))
        if current():
            self.drift_image.value = png
            if self.drift_image not in self.results_box.children:
                self.results_box.children = self.results_box.children + (self.drift_image,)
            first = ("byte-equal" if report.equal else "differs" if report.first is None
                     else f"first drift at pass {report.first.step} {report.first.point}")
            self._say(f"{self.status_text}; drift vs previous run: {first}")

    def _show_timing(self) -> None:
        t = self.timings
        line = f"result in {t['result']:.2f} s = session.generate {t['generate']:.2f} s"
        line += f" (model passes {t['passes']:.2f} s, denoise outside them {t['outside_passes']:.2f} s"
        line += ", live preview on)" if self.preview_toggle.value else ")"
        line += f" + panel {t['result'] - t['generate']:.2f} s"
        drawn = [f"{name} {t[key]:.2f} s" for key, name in (("strip", "latent strip"), ("mp4", "MP4 for playback"),
                                                           ("drift", "drift")) if key in t]
        if drawn:
            line += "; then, while the panel is free: " + ", ".join(drawn)
        if "media" in t:
            line += f" (all shown {t['media']:.2f} s after the click)"
        self.timing.value = f"<span style='font-size:12px'><b>time:</b> {html.escape(line)}</span>"

    def _say(self, text: str) -> None:
        self.status.value = html.escape(text)

    @property
    def status_text(self) -> str:
        """The status line as plain text."""
        return html.unescape(self.status.value)

    def _show_error(self, message: str) -> None:
        self.error.value = f"<span style='color:#c62828'>error: {html.escape(message)}</span>"

    @property
    def error_text(self) -> str:
        """The error line as plain text ("" when none)."""
        return html.unescape(re.sub(r"<[^>]+>", "", self.error.value)).removeprefix("error: ")

    @property
    def whatran_text(self) -> str:
        """The "what ran" line as plain text."""
        return html.unescape(re.sub(r"<[^>]+>", "", self.whatran.value)).removeprefix("what ran: ")
