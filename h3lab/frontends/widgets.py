"""`Workbench(session)`: one ipywidgets panel over a `Session` -- the notebook front end of h3lab.

Contract
- Controls: prompt, seed (+ random), output size, length in frames or seconds, steps, runtime mode (with what strict
  needs in this kernel and, where it can still work, a button that sets it up), the ablation factors as toggles
  (`h3lab.app.session.ablation_factors()`, the registry `!ablate` uses; tooltip = the factor), first/last-frame anchors
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
  actually ran (`h3lab.execution.whatran`: strict / torch / override counts from the trajectory's trace summary, e.g.
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

- Research tabs below the results (`h3lab.frontends.panel.views`, `wb.research`): "attention" (one block of the last run: the
  region heatmap, text -> video frames, video <-> audio over time, and the table) and "A/B" (the last two runs side
  by side: frames, |A - B|, spectrograms, PSNR / SSIM per frame, the table), each computed on its own thread.

The workbench asks the session to keep per-step latents (`session.keep` gains "latents"); it never touches the
model: everything goes through `Session`, `h3lab.frontends.commands` and `h3lab.execution.whatran`. Its parts (`h3lab.frontends.panel`): the
widgets and where they sit (`PanelLayout`, `wb.view`; every widget is also `wb.<name>`), the generation worker
(`RunWorker`, `wb.runner`) and the result's media (`MediaView`, `wb.media`); `Workbench` holds the state and wires
the controls to the grammar and the worker.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

import ipywidgets as W

from . import commands
from ..execution import whatran
from ..errors import H3Error, ValidationError
from .panel.controls import FIXED_ROWS, control_value, setting_controls, shown_value  # noqa: F401 - re-exported
from .panel.controls import one_line as _one_line
from .panel.layout import REFERENCE_UPLOAD_KINDS, PanelLayout  # noqa: F401 - re-exported
from .panel.media import VIDEO_INLINE_LIMIT, VIDEO_MAX_PX, VIDEO_MIN_PX, MediaView  # noqa: F401 - re-exported
from .panel.run import RunWorker
from .panel.views import ResearchViews
from ..schema import SETTINGS
from ..app.session import ablation_factors
from ..schema.generation_settings import FPS, GenerationSettings, seconds_to_frames

STRIP_ROWS = 6  # latent-strip rows drawn in the panel (evenly spaced, first and last kept)
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _factors() -> tuple[dict[str, str], str]:
    """(name -> "factor: description", "") or ({}, the one-line reason there are none)."""
    try:
        return ablation_factors(), ""
    except H3Error as err:
        return {}, _one_line(err)


def _depth(session: Any) -> int | None:
    """The DiT's number of blocks (the LoRA sliders' count), from the session's store without loading a model; None
    where the session cannot say (a stand-in session)."""
    store = getattr(session, "store", None)
    if store is None:
        return None
    from ..app.request_checks import model_depth

    try:
        return model_depth(store)
    except (H3Error, AttributeError):
        return None


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
        start = session.default_settings() if hasattr(session, "default_settings") else GenerationSettings()
        self.state = commands.SessionState(
            session=session, settings=start.replace(**settings), out_dir=out, base_dir=Path.cwd()
        )
        self.upload_dir = Path(upload_dir) if upload_dir is not None else out / "uploads"
        self.strip_rows = strip_rows
        self._syncing = False  # controls being set from the settings: no unit conversion, no re-validation
        factors, why_none = _factors()
        native = getattr(session, "native", None)
        hint = f"e.g. {native.example} ({native.prompt_form})" if native is not None else "Describe the clip"
        self.view = PanelLayout(self.state.settings, str(getattr(session, "model_name", "")), factors, why_none,
                                preview=preview, drift=drift, prompt_hint=hint, num_blocks=_depth(session))
        self.media = MediaView(self.view, session, strip_rows)
        self.runner = RunWorker(self.view, self.state, self.media, on_done=self._refresh_strict)
        self.controls = self.view.controls
        self.research = ResearchViews(self.state)  # the "attention" and "A/B" tabs, below the results
        self.view.panel.children = self.view.panel.children + (self.research.box,)
        clash = [name for name in self.controls
                 if name in self.view.fixed_names() or hasattr(type(self), name) or name in vars(self)]
        if clash:
            raise ValueError(f"setting {clash[0]!r}: its panel control's name is taken by the Workbench itself")
        self._wire()
        self._length_changed()
        self._refresh_conditioning()
        self._refresh_strict()

    def __getattr__(self, name: str) -> Any:
        """The panel's widgets by name (`wb.prompt`, `wb.seed`, `wb.progress`, ...): the layout's (`wb.view`)."""
        view = self.__dict__.get("view")
        if view is None or name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(view, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    def _wire(self) -> None:
        """The handlers: buttons, uploads, the length and its unit, the mode, the ablation toggles."""
        v = self.view
        v.random_seed.on_click(lambda _b: self._random_seed())
        v.generate_button.on_click(lambda _b: self.generate())
        v.cancel_button.on_click(lambda _b: self.cancel())
        v.strict_button.on_click(lambda _b: self.set_up_strict())
        if "mode" in self.controls:
            self.controls["mode"].observe(lambda _ch: self._refresh_strict(), names="value")
        for toggle in v.ablation_toggles.values():
            toggle.observe(lambda ch: self._ablations_changed(ch["owner"]), names="value")
        v.first_upload.observe(lambda ch: self._anchor_uploaded("first", ch), names="value")
        v.last_upload.observe(lambda ch: self._anchor_uploaded("last", ch), names="value")
        v.first_clear.on_click(lambda _b: self.command("!first clear"))
        v.last_clear.on_click(lambda _b: self.command("!last clear"))
        v.ref_upload.observe(self._reference_uploaded, names="value")
        v.length_unit.observe(self._unit_changed, names="value")
        v.length.observe(lambda _ch: self._length_changed(), names="value")

    def _repr_mimebundle_(self, **kwargs: Any):
        return self.view.panel._repr_mimebundle_(**kwargs)

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
        self.view.show_strict(whatran.strict_setup(getattr(self.session, "device", "cpu")))

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
            from ..io_utils import atomic_write_bytes

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
        return self.runner.running

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
        self.runner.start(settings, clicked)
        return True

    def cancel(self) -> None:
        """Ask the running generation to stop before its next pass."""
        self.runner.cancel()

    def wait(self, timeout: float | None = None) -> bool:
        """Join the worker and then the media it started (latent strip, MP4, drift); True when nothing runs
        afterwards. `timeout` bounds each join."""
        return self.runner.wait(timeout)

    @property
    def timings(self) -> dict[str, float]:
        """The phases of the last run in seconds (`h3lab.frontends.panel.run`: generate, passes, outside_passes, result,
        then strip, mp4, drift, media)."""
        return self.runner.timings

    @property
    def _thread(self):
        """The last generation's worker thread (None before the first)."""
        return self.runner.thread

    # ============================================================================================== text lines
    def _say(self, text: str) -> None:
        self.view.say(text)

    def _show_error(self, message: str) -> None:
        self.view.show_error(message)

    @property
    def status_text(self) -> str:
        """The status line as plain text."""
        return self.view.status_text

    @property
    def error_text(self) -> str:
        """The error line as plain text ("" when none)."""
        return self.view.error_text

    @property
    def whatran_text(self) -> str:
        """The "what ran" line as plain text."""
        return self.view.whatran_text
