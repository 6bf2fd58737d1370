"""`MediaView`: what the panel shows of a result -- its text at once, then its media, each as it is ready.

Contract
- `show_result(result)`: the "what ran" line (`h3lab.execution.whatran`, from the trajectory's trace summary), the settings'
  notices and summary, the trajectory hash, forwards and peak memory; the live preview gives way to it.
- `draw(t, result, mp4, pair, clicked, current)` (the media thread): the latent strip (`plots.latent_strip`, at most
  `strip_rows` rows), the numbered MP4 written through `session.save` and played with its sound (linked by path over
  `VIDEO_INLINE_LIMIT`, shown `VIDEO_MIN_PX`..`VIDEO_MAX_PX` wide), and, with a `pair` of results, their drift
  heatmaps (`session.drift`); each phase's seconds go to `t` and the timing line follows. A phase that fails shows
  one error line and the others still come. `current()` says whether this run still owns the panel: a newer run's
  panel is never touched, but the MP4 is still written.
- `show_timing(t, preview_on)`: the timing line (class `h3lab-timing`); `clear()` empties every result box.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any, Callable

import ipywidgets as W

from ...research import plots
from ...execution import whatran
from ...app.reruns import pass_label
from .controls import one_line
from .layout import PanelLayout

VIDEO_INLINE_LIMIT = 64 * 2**20  # larger clips are linked by path instead of sent to the browser
VIDEO_MIN_PX, VIDEO_MAX_PX = 320, 640  # display width of the result video (small clips scaled up, controls usable)


class MediaView:
    """The result part of the panel (see the module docstring)."""

    def __init__(self, view: PanelLayout, session: Any, strip_rows: int):
        self.view, self.session, self.strip_rows = view, session, strip_rows
        self.summary_lines: list[str] = []

    def clear(self) -> None:
        v = self.view
        v.preview_box.children = ()
        v.video_box.children = ()
        v.results_box.children = ()
        v.summary.value = ""
        v.timing.value = ""
        v.video.value = b""
        v.strip.value = b""
        self.summary_lines = []

    def show_result(self, result: Any) -> None:
        """What ran, the settings (ablations included) and the trajectory: text only, at once."""
        trace = result.trajectory.manifest.get("trace")
        reasons = [r.fallback for r in result.trace.fallbacks] if result.trace is not None else []
        line = whatran.what_ran(trace, result.settings.mode, reasons, result.settings.ablations)
        self.view.whatran.value = "<b>what ran:</b> " + html.escape(line)
        lines = list(result.settings.notices) + [result.settings.summary(), f"trajectory {result.trajectory_hash}"]
        lines += [f"forwards {result.evaluations}, peak memory {result.peak_memory / 2**20:.0f} MiB ({result.memory_kind})"]
        self.summary_lines = lines
        self._render_summary()
        self.view.preview_box.children = ()

    def _render_summary(self) -> None:
        self.view.summary.value = ("<pre style='font-size:12px; margin:0 0 0 12px'>"
                                   + html.escape("\n".join(self.summary_lines)) + "</pre>")

    # ---------------------------------------------------------------------------------------------- the media
    def draw(self, t: dict, result: Any, mp4: Path | None, pair: tuple | None, clicked: float,
             current: Callable[[], bool]) -> None:
        """The latent strip, the MP4 and its player, the drift heatmaps -- after the result is on screen, so the
        next generation can start meanwhile. `t` is this run's timings."""
        for phase, draw in (("strip", self._show_strip), ("mp4", self._show_video), ("drift", self._show_drift)):
            if phase == "drift" and pair is None:
                continue
            begun = time.perf_counter()
            try:
                draw(result, mp4, pair, current)
            except Exception as err:  # one line; the other media still come
                if current():
                    self.view.show_error(f"{phase}: {one_line(err)}")
            t[phase] = time.perf_counter() - begun
            if current():
                self.show_timing(t)
        t["media"] = time.perf_counter() - clicked
        if current():
            self.show_timing(t)

    def _show_strip(self, result: Any, _mp4: Any, _pair: Any, current: Any) -> None:
        steps = plots.latent_steps(result)
        fig = plots.latent_strip(steps.video, steps.audio, step_labels=steps.step_labels, max_rows=self.strip_rows)
        png = plots.png_bytes(fig)
        if current():
            v = self.view
            v.strip.value = png
            v.results_box.children = (v.strip,) + tuple(c for c in v.results_box.children if c is not v.strip)

    def _show_video(self, result: Any, mp4: Path | None, _pair: Any, current: Any) -> None:
        """Write the numbered MP4 (atomically, through the session) and show it, or link it when it is large."""
        v = self.view
        if mp4 is None:
            if current():
                v.video_box.children = (W.Label("no output folder: video not written"),)
            return
        path = self.session.save(result, mp4).resolve()
        result.outputs.append(path)
        if not current():
            return
        self.summary_lines.append(f"wrote {path}")
        self._render_summary()
        label = W.Label(f"result: {path.name}")
        if path.stat().st_size <= VIDEO_INLINE_LIMIT:
            v.video.width = str(min(VIDEO_MAX_PX, max(VIDEO_MIN_PX, result.settings.width)))
            v.video.value = path.read_bytes()
            v.video_box.children = (label, v.video)
        else:
            v.video_link.value = (f"video not inlined (over {VIDEO_INLINE_LIMIT >> 20} MiB): "
                                  f"<code>{html.escape(str(path))}</code>")
            v.video_box.children = (label, v.video_link)

    def _show_drift(self, _result: Any, _mp4: Any, pair: tuple, current: Any) -> None:
        report = self.session.drift(*pair)
        png = plots.png_bytes(plots.drift_heatmaps(**plots.drift_inputs(report)))
        if current():
            v = self.view
            v.drift_image.value = png
            if v.drift_image not in v.results_box.children:
                v.results_box.children = v.results_box.children + (v.drift_image,)
            first = ("byte-equal" if report.equal else "differs" if report.first is None
                     else f"first drift at {pass_label(report.first.step)} {report.first.point}")
            v.say(f"{v.status_text}; drift vs previous run: {first}")

    def show_timing(self, t: dict) -> None:
        line = f"result in {t['result']:.2f} s = session.generate {t['generate']:.2f} s"
        line += f" (model passes {t['passes']:.2f} s, denoise outside them {t['outside_passes']:.2f} s"
        line += ", live preview on)" if self.view.preview_toggle.value else ")"
        line += f" + panel {t['result'] - t['generate']:.2f} s"
        drawn = [f"{name} {t[key]:.2f} s" for key, name in (("strip", "latent strip"), ("mp4", "MP4 for playback"),
                                                           ("drift", "drift")) if key in t]
        if drawn:
            line += "; then, while the panel is free: " + ", ".join(drawn)
        if "media" in t:
            line += f" (all shown {t['media']:.2f} s after the click)"
        self.view.timing.value = f"<span style='font-size:12px'><b>time:</b> {html.escape(line)}</span>"
