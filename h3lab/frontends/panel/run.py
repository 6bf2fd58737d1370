"""`RunWorker`: the panel's generation worker -- one thread per run, its progress line, then the media thread.

Contract
- `start(settings, clicked)`: a new run takes over the panel (`run_id` + 1: media still being drawn for an earlier
  run no longer touch it), the previous result leaves it, and a worker thread ("h3lab-workbench") makes the same
  `session.generate(settings, progress=..., cancel=..., preview=...)` call a notebook cell would. When it returns,
  the result's text is on screen at once and Generate is usable again; the media follow on a second thread
  ("h3lab-workbench-media", `MediaView.draw`). Any failure ends as one error line, the session and panel usable.
- `cancel()` asks the running generation to stop before its next pass; `wait(timeout)` joins the worker, then the
  media thread; `running` says whether a generation runs.
- `timings` (the last run's, seconds): `generate` the session's call, `passes` the model passes as the session timed
  them, `outside_passes` the rest of its denoise phase (live preview decodes, progress callbacks, noise and
  recorder), `result` click -> result on screen; then, drawn meanwhile: `strip`, `mp4`, `drift`, and `media` click ->
  everything shown.
- Progress: pass k's wall time is measured from the end of pass k-1's callback (unknown for pass 1, whose start is
  inside the session); `StepInfo.seconds` is the session's own time of the pass, without the preview decode and the
  callbacks after it; the difference is shown when it is over a fifth of the wall time.
- `on_done()` runs when the worker ends, whatever the outcome (the panel refreshes what strict needs: the first
  generation creates the Triton kernels).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import ipywidgets as W

from ...app.results import GenerationCancelled, StepInfo
from ...schema.generation_settings import GenerationSettings
from .controls import one_line
from .layout import PanelLayout
from .media import MediaView


class RunWorker:
    """The generation worker of one panel (see the module docstring)."""

    def __init__(self, view: PanelLayout, state: Any, media: MediaView, on_done: Callable[[], None]):
        self.view, self.state, self.media, self.on_done = view, state, media, on_done
        self.timings: dict[str, float] = {}  # phases of the last run (see `_run`)
        self.thread: threading.Thread | None = None  # the generation
        self.media_thread: threading.Thread | None = None  # the latest result's strip, MP4 and drift
        self.run_id = 0
        self.cancel_event = threading.Event()
        self._pass_clock: float | None = None  # end of the previous progress callback (None before pass 1)
        self._pass_seconds = 0.0  # sum of the passes' own times (StepInfo.seconds)

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, settings: GenerationSettings, clicked: float) -> None:
        v = self.view
        self.run_id += 1  # media still being drawn for an earlier run no longer touch the panel
        v.error.value = ""
        self.media.clear()
        self.cancel_event.clear()
        v.progress.max = settings.steps
        v.progress.value = 0
        v.progress.bar_style = ""
        v.say(f"starting: {settings.summary()}")
        v.whatran.value = "<b>what ran:</b> running..."
        v.generate_button.disabled = True
        v.cancel_button.disabled = False
        self.thread = threading.Thread(target=self._run, args=(settings, clicked, self.run_id),
                                       name="h3lab-workbench", daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        if not self.running:
            return
        self.cancel_event.set()
        self.view.say("cancelling...")

    def wait(self, timeout: float | None = None) -> bool:
        for name in ("thread", "media_thread"):  # read in turn: the worker starts the media thread as it ends
            thread = getattr(self, name)
            if thread is not None:
                thread.join(timeout)
        return not self.running and not (self.media_thread is not None and self.media_thread.is_alive())

    # ---------------------------------------------------------------------------------------------- the worker
    def _run(self, settings: GenerationSettings, clicked: float, run_id: int) -> None:
        """The generation, then the result's text at once; the media follow on their own thread."""
        v, t = self.view, {}
        self.timings = t
        self._pass_clock, self._pass_seconds = None, 0.0
        state, session = self.state, self.state.get_session()
        try:
            start = time.perf_counter()
            result = session.generate(
                settings, progress=self._on_progress, cancel=self.cancel_event,
                preview=self._on_preview if v.preview_toggle.value else None,
            )
            t["generate"] = time.perf_counter() - start
            t["passes"] = self._pass_seconds
            t["outside_passes"] = max(0.0, result.timings.get("denoise", 0.0) - self._pass_seconds)
            with state.lock:
                previous = state.results[-1] if state.results else None
                state.results = (state.results + [result])[-2:]
                mp4 = self._reserve_output()
            v.progress.value = v.progress.max
            v.progress.bar_style = "success"
            self.media.show_result(result)
            t["result"] = time.perf_counter() - clicked
            v.say(f"done: {result.settings.summary()} in {t['result']:.2f} s")
            self.media.show_timing(t)
            pair = (previous, result) if v.drift_toggle.value and previous is not None else None
            current = lambda: run_id == self.run_id  # noqa: E731
            self.media_thread = threading.Thread(target=self.media.draw, args=(t, result, mp4, pair, clicked, current),
                                                 name="h3lab-workbench-media", daemon=True)
            self.media_thread.start()
        except GenerationCancelled as err:
            v.progress.bar_style = "warning"
            v.say(one_line(err))
            v.whatran.value = "<b>what ran:</b> cancelled, no result"
        except Exception as err:  # every failure becomes one line in the panel; the session stays usable
            v.progress.bar_style = "danger"
            v.say("failed")
            v.whatran.value = "<b>what ran:</b> failed, no result"
            self.media.clear()
            v.show_error(one_line(err))
        finally:
            v.generate_button.disabled = False
            v.cancel_button.disabled = True
            self.on_done()

    def _reserve_output(self) -> Path | None:
        """The next numbered MP4 path, taken now (numbers follow generation order) although the media thread writes
        it later: `SessionState.next_output()` gives (number, path) without reserving, so the number is taken here."""
        number, path = self.state.next_output()
        self.state.counter = number
        return path

    # ---------------------------------------------------------------------------------------------- callbacks
    def _on_progress(self, info: StepInfo) -> None:
        """The progress line of a pass (see the module docstring)."""
        now = time.perf_counter()
        self._pass_seconds += info.seconds
        self.view.progress.value = info.step
        kind = "model" if info.evaluated else "reused velocity"
        if self._pass_clock is None:
            line = f"pass {info.step}/{info.total}: {kind} {info.seconds:.2f} s"
        else:
            wall = now - self._pass_clock
            extra = max(0.0, wall - info.seconds)
            line = f"pass {info.step}/{info.total}: {wall:.2f} s"
            if extra > 0.2 * wall:
                what = "live preview decode" if self.view.preview_toggle.value else "outside the pass"
                line += f" ({kind} {info.seconds:.2f} s + {what} {extra:.2f} s)"
            else:
                line += f" ({kind})"
        self.view.say(line)
        self._pass_clock = time.perf_counter()

    def _on_preview(self, frame: Any, step: int, total: int) -> None:
        from ..preview import png_bytes

        v = self.view
        v.preview.value = png_bytes(frame)
        if v.preview not in v.preview_box.children:
            v.preview_box.children = (W.Label("live preview: newest pass, middle frame"), v.preview)
