"""`ResearchViews`: the panel's research tabs -- "attention" (who attends to whom at one block of the last run) and
"A/B" (the last two runs side by side with numbers). Front end only: it asks the session (`Session.attention`,
`Session.compare`) and renders what comes back with `h3lab.research.plots`.

Contract
- `ResearchViews(state)` over the panel's `commands.SessionState` (the same results `!attention` / `!compare` read).
  `tab` is a `W.Tab` (CSS class `h3lab-research`) with two pages:
  attention  block, heads ("all", "0,2", "0-3"), pass (0: the last with a forward), from / to region words ("text",
             "video", "audio", "frame3", ... ; empty: every region), "show attention"; the figure
             (`plots.attention_figure`, `<img class="h3lab-attention">`) and the view's text table
  A/B        "compare last two": the two most recent results, matched seed; the A/B figure (`plots.compare_figure`,
             `<img class="h3lab-compare">`) and the table (`Comparison.lines()`)
- Each request runs on a worker thread (the kernel stays responsive); `wait(timeout)` joins it. Errors are one line
  in the tab's message (`h3lab-research-error`), never a traceback; a request leaves the session as it was.
"""

from __future__ import annotations

import html
import threading
from typing import Any, Callable

import ipywidgets as W

from ...research import plots
from ...errors import H3Error, ValidationError
from .controls import one_line


def _heads(text: str) -> tuple[int, ...] | None:
    from ..commands import parse_heads

    return parse_heads("attention", text.strip() or "all")


class ResearchViews:
    """The research tabs (module docstring)."""

    def __init__(self, state: Any):
        self.state = state
        self.thread: threading.Thread | None = None
        self.block = W.IntText(value=0, description="block", layout=W.Layout(width="140px"))
        self.heads = W.Text(value="all", description="heads", layout=W.Layout(width="160px"))
        self.step = W.IntText(value=0, description="pass", tooltip="0: the last pass with a forward",
                              layout=W.Layout(width="140px"))
        self.query = W.Text(value="", description="from", placeholder="text, video, frame3 ...",
                            layout=W.Layout(width="220px"))
        self.keys = W.Text(value="", description="to", placeholder="video, audio ...", layout=W.Layout(width="220px"))
        self.attention_button = W.Button(description="show attention", button_style="primary")
        self.attention_image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.attention_image.add_class("h3lab-attention")
        self.attention_text = W.HTML(value="")
        self.compare_button = W.Button(description="compare last two", button_style="primary")
        self.compare_image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.compare_image.add_class("h3lab-compare")
        self.compare_text = W.HTML(value="")
        self.message = W.HTML(value="")
        self.message.add_class("h3lab-research-error")
        attention = W.VBox([W.HBox([self.block, self.heads, self.step]), W.HBox([self.query, self.keys]),
                            self.attention_button, self.attention_text, self.attention_image])
        ab = W.VBox([self.compare_button, self.compare_text, self.compare_image])
        self.tab = W.Tab(children=[attention, ab])
        self.tab.set_title(0, "attention")
        self.tab.set_title(1, "A/B")
        self.tab.add_class("h3lab-research")
        self.box = W.VBox([self.tab, self.message])
        self.attention_button.on_click(lambda _b: self.show_attention())
        self.compare_button.on_click(lambda _b: self.show_compare())

    # ------------------------------------------------------------------------------------------------ requests
    def _start(self, work: Callable[[], None]) -> bool:
        if self.thread is not None and self.thread.is_alive():
            self.message.value = "a research view is still being computed"
            return False
        self.message.value = ""

        def run() -> None:
            try:
                work()
            except H3Error as err:
                self.message.value = html.escape(one_line(err))

        self.thread = threading.Thread(target=run, name="h3lab-research", daemon=True)
        self.thread.start()
        return True

    def show_attention(self) -> bool:
        """The attention view of the last result with the tab's block, heads, pass and regions."""
        def work() -> None:
            if not self.state.results:
                raise ValidationError("attention: no generation yet (generate first)")
            view = self.state.get_session().attention(
                self.state.results[-1], int(self.block.value), heads=_heads(self.heads.value),
                step=int(self.step.value) - 1 if self.step.value > 0 else None, query=self.query.value.strip() or None)
            keys = view.keys(self.keys.value.strip()) if self.keys.value.strip() else None
            self.attention_text.value = "<pre>" + html.escape("\n".join(view.lines(keys=keys))) + "</pre>"
            self.attention_image.value = plots.png_bytes(plots.attention_figure(view, keys=keys))

        return self._start(work)

    def show_compare(self) -> bool:
        """The matched-seed A/B of the two most recent results."""
        def work() -> None:
            if len(self.state.results) < 2:
                raise ValidationError(f"A/B: needs two generations, have {len(self.state.results)}")
            comparison = self.state.get_session().compare(*self.state.results[-2:])
            self.compare_text.value = "<pre>" + html.escape("\n".join(comparison.lines())) + "</pre>"
            self.compare_image.value = plots.png_bytes(plots.compare_figure(comparison))

        return self._start(work)

    def wait(self, timeout: float | None = None) -> bool:
        """Join the running request; True when none runs afterwards."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()
