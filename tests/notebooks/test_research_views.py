"""The panel's research tabs (`h3lab.frontends.panel.views`, `wb.research`) without a browser: after two generations on one
seed, "show attention" draws the last run's attention view and its table, "compare last two" the A/B figure and
table; a request without enough runs, or a bad region, is one line in the tab."""

from __future__ import annotations

import io

from PIL import Image

from h3lab.frontends.widgets import Workbench
from nb_helpers import TINY_REQUEST

WAIT_S = 300


def _png_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as img:
        return img.size


def test_attention_and_ab_tabs(tiny_session, tmp_path):
    wb = Workbench(tiny_session, out_dir=tmp_path / "out", prompt="A red fox walks through fresh snow.", seed=5,
                   **TINY_REQUEST)
    tabs = wb.research
    assert [tabs.tab.get_title(i) for i in range(2)] == ["attention", "A/B"] and tabs.box in wb.view.panel.children
    assert tabs.show_compare() and tabs.wait(WAIT_S)
    assert tabs.message.value == "A/B: needs two generations, have 0"
    for steps in (2, 3):
        wb.steps.value = steps
        assert wb.generate(), wb.error_text
        assert wb.wait(WAIT_S)
    tabs.block.value, tabs.heads.value, tabs.query.value, tabs.keys.value = 1, "0", "text", "video"
    assert tabs.show_attention() and tabs.wait(WAIT_S)
    assert tabs.message.value == "" and "attention block 1 pass 3, heads 0" in tabs.attention_text.value
    assert _png_size(tabs.attention_image.value)[0] <= 1000
    assert tabs.show_compare() and tabs.wait(WAIT_S)
    assert "A/B 2 steps vs 3 steps, seed 5" in tabs.compare_text.value and tabs.compare_image.value
    tabs.query.value = "nowhere"
    assert tabs.show_attention() and tabs.wait(WAIT_S)
    assert "region &#x27;nowhere&#x27;: not in this layout" in tabs.message.value and "\n" not in tabs.message.value
