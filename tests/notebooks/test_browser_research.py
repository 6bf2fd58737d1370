"""The panel's research tabs in a real browser: JupyterLab and headless Chromium (the harness of test_browser.py),
a notebook that makes two generations on one seed in the embedded default and shows the Workbench; the "attention"
tab is filled and "show attention" clicked, then the "A/B" tab and "compare last two": each figure must decode in the
page and the tab's table must be there. Screenshots of both tabs go to test-artifacts/ (the docs show them)."""

from __future__ import annotations

import nbformat
import pytest

from nb_helpers import ARTIFACTS
from test_browser import NOTEBOOK_RUN_S, _require_browser, launch, open_and_run, start_lab

pytestmark = pytest.mark.browser

SETUP = """from h3lab import Session
from h3lab.frontends.widgets import Workbench
wb = Workbench(Session(device="cpu"), prompt="a blue square moves right, a middle tone", seed=42, steps=8,
               mode="off")
for steps in (8, 12):
    wb.steps.value = steps
    assert wb.generate(), wb.error_text
    assert wb.wait(300)
wb"""

_DECODED = "s => { const i = document.querySelector(s); return i && i.complete && i.naturalWidth > 0; }"


def _shot(page, locator, name: str) -> None:
    locator.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(500)
    locator.screenshot(path=str(ARTIFACTS / name))


def test_research_tabs_in_chromium(tmp_path):
    chromium = _require_browser()
    from playwright.sync_api import sync_playwright

    root = tmp_path / "lab"
    root.mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "research.ipynb")
    ARTIFACTS.mkdir(exist_ok=True)
    lab = start_lab(root, ARTIFACTS)
    try:
        with sync_playwright() as pw:
            browser = launch(pw, chromium)
            page = browser.new_page(viewport={"width": 1300, "height": 2000})
            page.set_default_timeout(60_000)
            try:
                open_and_run(page, lab, "research")
                tabs = page.locator(".h3lab-research")
                tabs.wait_for(state="visible", timeout=NOTEBOOK_RUN_S * 1000)
                show = page.locator(".h3lab-research button", has_text="show attention")
                block = page.locator(".h3lab-research .widget-inline-hbox", has_text="block").locator("input")
                block.first.fill("5")
                block.first.press("Enter")
                query = page.locator(".h3lab-research .widget-inline-hbox", has_text="from").locator("input")
                query.first.fill("text")
                query.first.press("Enter")
                show.scroll_into_view_if_needed()
                show.click()
                page.wait_for_function(_DECODED, arg="img.h3lab-attention", timeout=120_000)
                assert "attention block 5 pass 12" in tabs.inner_text()
                assert page.locator(".h3lab-research-error").inner_text() == ""
                _shot(page, page.locator(".h3lab-research").first, "panel_attention_tab.png")
                page.locator(".h3lab-research .lm-TabBar-tab", has_text="A/B").click()
                page.locator(".h3lab-research button", has_text="compare last two").click()
                page.wait_for_function(_DECODED, arg="img.h3lab-compare", timeout=120_000)
                text = tabs.inner_text()
                assert "A/B 8 steps vs 12 steps, seed 42" in text and "SSIM mean" in text
                _shot(page, page.locator(".h3lab-research").first, "panel_ab_tab.png")
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / "panel_research_failure.png"))
                raise
            finally:
                browser.close()
    finally:
        lab.stop()
