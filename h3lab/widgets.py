"""`Workbench(session)`: one ipywidgets panel over a `Session` -- the notebook front end of h3lab.

Contract
- Controls: prompt, seed (+ random), output size, length in frames or seconds, steps, runtime mode, the speed presets
  (layers -- 0 for all --, core reuse, token reduction, reference RoPE at 256x256; `h3lab.presets`), ablation
  factors (toggles, when `h3lab.ablation` offers `factor_names()`), first/last-frame anchors and ordered references
  (uploads; a list with move up / move down / remove), Generate / Cancel, and "drift vs previous run".
- State lives in a `commands.SessionState` (`wb.state`), the same object the REPL holds: anchors and references are
  added through the command grammar (`!first PATH`, `!ref-image PATH`, ... so they are validated exactly as in the
  REPL), the scalar controls become one validated `GenerationSettings.replace(...)` on Generate, and the generation
  is `commands.run_generation` (numbered MP4 in `out_dir`, the last two results kept for drift). `wb.command(line)`
  runs any other command line against the same state.
- Generate validates on the calling thread (a bad value shows its one-line message and nothing starts), then runs
  the generation on a worker thread so the kernel stays responsive: Cancel and other cells work meanwhile. While it
  runs the progress bar counts passes and the preview shows the newest pass's decoded middle frame (the session's
  `preview` callback). Only one generation runs at a time.
- The result shows the video with its sound (an ipywidgets `Video`: the MP4 bytes, played by the browser's
  `<video>` element; CSS class `h3lab-video`), the per-step latent strip (`plots.latent_strip`, an `<img>` with class
  `h3lab-latent-strip`) and, when two runs exist and the option is on, their drift heatmaps (`session.drift`,
  class `h3lab-drift`). Result widgets enter the panel only once a result exists.
- Any error -- validation, decoding, the model, cancellation -- ends up as one line in the panel (`wb.error`, class
  `h3lab-error`) and leaves the session and the panel usable. `wb.wait(timeout)` joins the worker (tests, scripts).

The workbench asks the session to keep per-step latents (`session.keep` gains "latents"); it never touches the
model: everything goes through `Session` and `h3lab.commands`.
"""

from __future__ import annotations

import hashlib
import html
import re
import secrets
import shlex
import tempfile
import threading
from pathlib import Path
from typing import Any

import ipywidgets as W

from . import commands, plots
from .errors import H3Error
from .runtime import MODES
from .session import GenerationCancelled, StepInfo
from .settings import GenerationSettings

REFERENCE_UPLOAD_KINDS = ("image", "video", "silent-video", "audio")
VIDEO_INLINE_LIMIT = 64 * 2**20  # larger clips are linked by path instead of sent to the browser
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    msg = text[0] if text else ""
    return msg if isinstance(err, H3Error) else f"{type(err).__name__}: {msg}"


class Workbench:
    """The panel (see the module docstring). `settings` are initial `GenerationSettings` values (prompt, seed,
    width, height, frames or seconds, steps, mode, ...). `out_dir` receives the numbered MP4s (default: a fresh
    temporary folder); `upload_dir` the uploaded anchors and references (default: inside `out_dir`)."""

    def __init__(
        self,
        session: Any,
        *,
        out_dir: str | Path | None = None,
        upload_dir: str | Path | None = None,
        drift: bool = True,
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
        self.state.progress = self._on_progress
        self.state.preview = self._on_preview
        self.state.show = True
        self._thread: threading.Thread | None = None
        self._cancel_requested = threading.Event()
        self._build(drift)

    # ================================================================================================== layout
    def _build(self, drift: bool) -> None:
        s = self.state.settings
        style = {"description_width": "70px"}
        self.prompt = W.Textarea(value=s.prompt, description="prompt", placeholder="Describe the clip",
                                 layout=W.Layout(width="98%", height="60px"), style=style)
        # Unbounded on purpose: the settings validate the range (0..2**63-1) with their one-line message, where a
        # bounded widget would clamp silently.
        self.seed = W.IntText(value=s.seed, description="seed", style=style, layout=W.Layout(width="220px"))
        self.random_seed = W.Button(description="random", tooltip="draw a random seed", layout=W.Layout(width="80px"))
        self.width = W.IntText(value=s.width, step=32, description="width", style=style, layout=W.Layout(width="160px"))
        self.height = W.IntText(value=s.height, step=32, description="height", style=style,
                                layout=W.Layout(width="160px"))
        by_seconds = s.seconds is not None
        self.length_unit = W.ToggleButtons(options=["frames", "seconds"], value="seconds" if by_seconds else "frames",
                                           style={"button_width": "80px"})
        self.length = W.FloatText(value=s.seconds if by_seconds else s.num_frames, description="length", style=style,
                                  layout=W.Layout(width="160px"))
        self.length_note = W.Label(value="")
        self.steps = W.BoundedIntText(value=s.steps, min=1, max=1000, description="steps", style=style,
                                      layout=W.Layout(width="160px"))
        self.mode = W.Dropdown(options=list(MODES), value=s.mode, description="mode", style=style,
                               layout=W.Layout(width="200px"))
        # Speed presets: validated by GenerationSettings (and the DiT's depth by the session) on Generate.
        self.layers = W.IntText(value=s.layers or 0, description="layers", tooltip="blocks to run; 0: all",
                                style=style, layout=W.Layout(width="160px"))
        self.core_reuse = W.IntText(value=s.core_reuse, description="core reuse", style=style,
                                    layout=W.Layout(width="160px"))
        self.token_reduction = W.Checkbox(value=s.token_reduction, description="token reduction", indent=False)
        self.reference_rope = W.Checkbox(value=s.reference_rope, description="reference RoPE (256x256)", indent=False)
        self.ablation_toggles: dict[str, W.ToggleButton] = {}
        factors = _ablation_factors()
        if factors:
            for name in factors:
                self.ablation_toggles[name] = W.ToggleButton(value=name in s.ablations, description=name,
                                                             layout=W.Layout(width="auto"))
            ablation_row = W.HBox([W.Label("ablations")] + list(self.ablation_toggles.values()))
        else:
            ablation_row = W.HBox([W.Label("ablation toggles: none (h3lab.ablation provides no factor_names() yet)")])

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
        self.drift_toggle = W.Checkbox(value=drift, description="drift vs previous run", indent=False)
        self.progress = W.IntProgress(value=0, min=0, max=s.steps, description="passes", style=style)
        self.status = W.Label(value="ready")
        self.error = W.HTML(value="")
        self.error.add_class("h3lab-error")
        self.preview = W.Image(format="png", layout=W.Layout(width="256px"))
        self.preview.add_class("h3lab-preview")
        self.video = W.Video(format="mp4", autoplay=False, loop=False, controls=True,
                             layout=W.Layout(width="320px"))
        self.video.add_class("h3lab-video")
        self.strip = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.strip.add_class("h3lab-latent-strip")
        self.drift_image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.drift_image.add_class("h3lab-drift")
        self.summary = W.HTML(value="")
        self.video_link = W.HTML(value="")
        self.preview_box = W.VBox()  # the newest pass's frame, from the first pass on
        self.video_box = W.VBox()  # the result's video (or a link), once a result exists
        self.results_box = W.VBox()  # latent strip, drift heatmap

        self.random_seed.on_click(lambda _b: self._random_seed())
        self.generate_button.on_click(lambda _b: self.generate())
        self.cancel_button.on_click(lambda _b: self.cancel())
        self.first_upload.observe(lambda ch: self._anchor_uploaded("first", ch), names="value")
        self.last_upload.observe(lambda ch: self._anchor_uploaded("last", ch), names="value")
        self.first_clear.on_click(lambda _b: self.command("!first clear"))
        self.last_clear.on_click(lambda _b: self.command("!last clear"))
        self.ref_upload.observe(self._reference_uploaded, names="value")
        for w in (self.length, self.length_unit):
            w.observe(lambda _ch: self._length_changed(), names="value")

        self.panel = W.VBox([
            W.HTML("<b>h3lab workbench</b> &mdash; " + html.escape(str(getattr(self.session, "model_name", "")))),
            self.prompt,
            W.HBox([self.seed, self.random_seed, self.width, self.height]),
            W.HBox([self.length_unit, self.length, self.length_note]),
            W.HBox([self.steps, self.mode]),
            W.HBox([self.layers, self.core_reuse, self.token_reduction, self.reference_rope]),
            ablation_row,
            W.HBox([self.first_upload, self.first_label, self.first_clear]),
            W.HBox([self.last_upload, self.last_label, self.last_clear]),
            W.HBox([self.ref_kind, self.ref_upload]),
            self.refs_box,
            W.HBox([self.generate_button, self.cancel_button, self.drift_toggle]),
            W.HBox([self.progress, self.status]),
            self.error,
            W.HBox([self.preview_box, self.video_box, self.summary], layout=W.Layout(align_items="flex-start")),
            self.results_box,
        ])
        self.panel.add_class("h3lab-workbench")
        self._length_changed()
        self._refresh_conditioning()

    def _repr_mimebundle_(self, **kwargs: Any):
        return self.panel._repr_mimebundle_(**kwargs)

    # ================================================================================================ settings
    def _random_seed(self) -> None:
        self.seed.value = secrets.randbelow(2**31)

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

    def current_settings(self) -> GenerationSettings:
        """The validated settings the controls describe (raises `H3Error` with one line)."""
        changes: dict[str, Any] = {
            "prompt": self.prompt.value,
            "seed": int(self.seed.value),
            "width": int(self.width.value),
            "height": int(self.height.value),
            "steps": int(self.steps.value),
            "mode": self.mode.value,
            "layers": int(self.layers.value) or None,
            "core_reuse": int(self.core_reuse.value),
            "token_reduction": bool(self.token_reduction.value),
            "reference_rope": bool(self.reference_rope.value),
            **self._length_settings(),
        }
        if self.ablation_toggles:
            changes["ablations"] = tuple(n for n, t in self.ablation_toggles.items() if t.value)
        if changes["steps"] < self.state.settings.reuse:
            changes["reuse"] = 1
        settings = self.state.settings.replace(**changes)
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
        self.status.value = out[-1] if out else "ok"
        self._sync_controls()
        return out

    def _sync_controls(self) -> None:
        """Controls <- `state.settings` (after a command changed them), then the anchor and reference lists."""
        s = self.state.settings
        self.seed.value, self.width.value, self.height.value = s.seed, s.width, s.height
        self.steps.value, self.mode.value = s.steps, s.mode
        self.layers.value, self.core_reuse.value = s.layers or 0, s.core_reuse
        self.token_reduction.value, self.reference_rope.value = s.token_reduction, s.reference_rope
        if s.seconds is not None:
            self.length_unit.value, self.length.value = "seconds", s.seconds
        else:
            self.length_unit.value, self.length.value = "frames", s.num_frames
        for name, toggle in self.ablation_toggles.items():
            toggle.value = name in s.ablations
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
        return self._thread is not None and self._thread.is_alive()

    def generate(self) -> bool:
        """The Generate handler: validate, then start the worker. Returns True when a generation started."""
        if self.running:
            self._show_error("a generation is already running")
            return False
        try:
            settings = self.current_settings()
        except H3Error as err:
            self._show_error(_one_line(err))
            return False
        self.state.settings = settings
        self.error.value = ""
        self._cancel_requested.clear()
        self.progress.max = settings.steps
        self.progress.value = 0
        self.progress.bar_style = ""
        self.status.value = f"starting: {settings.summary()}"
        self.generate_button.disabled = True
        self.cancel_button.disabled = False
        self._thread = threading.Thread(target=self._run, args=(settings,), name="h3lab-workbench", daemon=True)
        self._thread.start()
        return True

    def cancel(self) -> None:
        """Ask the running generation to stop before its next pass."""
        if not self.running:
            return
        self._cancel_requested.set()
        self.state.cancel.set()
        self.status.value = "cancelling..."

    def wait(self, timeout: float | None = None) -> bool:
        """Join the worker; True when no generation is running afterwards."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.running

    def _run(self, settings: GenerationSettings) -> None:
        try:
            lines = commands.run_generation(self.state, settings)
            result = self.state.last
            self.progress.value = self.progress.max
            self.progress.bar_style = "success"
            self._show_result(result, lines)
            self.status.value = f"done: {result.settings.summary()} in {result.total_seconds:.2f} s"
            if self.drift_toggle.value and len(self.state.results) >= 2:
                self._show_drift()
        except GenerationCancelled as err:
            self.progress.bar_style = "warning"
            self.status.value = _one_line(err)
        except Exception as err:  # every failure becomes one line in the panel; the session stays usable
            self.progress.bar_style = "danger"
            self.status.value = "failed"
            self._show_error(_one_line(err))
        finally:
            self.generate_button.disabled = False
            self.cancel_button.disabled = True

    # ============================================================================================== callbacks
    def _on_progress(self, info: StepInfo) -> None:
        if self._cancel_requested.is_set():
            self.state.cancel.set()  # run_generation clears the event when it starts; set it again
        self.progress.value = info.step
        kind = "model" if info.evaluated else "reused velocity"
        self.status.value = f"pass {info.step}/{info.total} ({kind}, {info.seconds:.2f} s)"

    def _on_preview(self, frame: Any, step: int, total: int) -> None:
        from .preview import png_bytes

        self.preview.value = png_bytes(frame)
        if self.preview not in self.preview_box.children:
            self.preview_box.children = (W.Label("newest pass: middle frame"), self.preview)

    # ================================================================================================ results
    def _show_result(self, result: Any, lines: list[str]) -> None:
        children: list[W.Widget] = []
        mp4 = next((p for p in result.outputs if str(p).endswith(".mp4")), None)
        label = W.Label(f"result: {Path(mp4).name if mp4 else 'not written'}")
        if mp4 is not None and Path(mp4).stat().st_size <= VIDEO_INLINE_LIMIT:
            self.video.value = Path(mp4).read_bytes()
            self.video_box.children = (label, self.video)
        else:
            where = html.escape(str(mp4)) if mp4 else "no output folder"
            self.video_link.value = f"video not inlined: <code>{where}</code>"
            self.video_box.children = (label, self.video_link)
        try:
            steps = plots.latent_steps(result)
            self.strip.value = plots.png_bytes(plots.latent_strip(steps.video, steps.audio,
                                                                  step_labels=steps.step_labels))
            children.append(self.strip)
        except H3Error as err:
            self._show_error(f"latent strip: {_one_line(err)}")
        self.summary.value = "<pre style='font-size:11px'>" + html.escape("\n".join(lines)) + "</pre>"
        self.results_box.children = tuple(children)

    def _show_drift(self) -> None:
        a, b = self.state.results[-2], self.state.results[-1]
        self.status.value = "computing drift vs the previous run..."
        try:
            report = self.session.drift(a, b)
            fig = plots.drift_heatmaps(**plots.drift_inputs(report))
            self.drift_image.value = plots.png_bytes(fig)
        except Exception as err:
            self._show_error(f"drift: {_one_line(err)}")
            return
        if self.drift_image not in self.results_box.children:
            self.results_box.children = self.results_box.children + (self.drift_image,)
        self.status.value = report.summary()

    def _show_error(self, message: str) -> None:
        self.error.value = f"<span style='color:#c62828'>error: {html.escape(message)}</span>"

    @property
    def error_text(self) -> str:
        """The error line as plain text ("" when none)."""
        return html.unescape(re.sub(r"<[^>]+>", "", self.error.value)).removeprefix("error: ")


def _ablation_factors() -> list[str]:
    try:
        from . import ablation
    except ImportError:
        return []
    names = getattr(ablation, "factor_names", None)
    return list(names()) if callable(names) else []
