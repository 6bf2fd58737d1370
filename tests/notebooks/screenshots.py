"""Screenshots of the notebooks and of the Workbench panel, as a person sees them in JupyterLab (headless
Chromium, the same set-up as `test_browser.py`): every cell run; in the quick start the panel then generates twice
(the second run with ablation A1 switched on, so the drift heatmaps show where A1 first changes the run).

    python tests/notebooks/screenshots.py --out docs/screenshots

Writes NAME.png per notebook (the whole notebook, the viewport grown to its height) and workbench.png (the panel
after the second run). Not a test (pytest collects test_*.py only); it takes a few minutes on a CPU.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nb_helpers import NOTEBOOKS  # noqa: E402
from test_browser import _ALL_CELLS_RAN, _FAILED_CELLS, _chromium, open_and_run, start_lab  # noqa: E402

NAMES = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
WIDTH = 1280
MAX_HEIGHT = 9000
RUN_S = 900
_CONTENT_HEIGHT = """() => { const o = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
    return o ? o.scrollHeight : 0; }"""


def _open(page, lab, name: str) -> None:
    open_and_run(page, lab, name)
    page.evaluate("() => { const s = window.jupyterapp.shell; if (!s.leftCollapsed) s.collapseLeft(); }")
    page.wait_for_function(_ALL_CELLS_RAN, timeout=RUN_S * 1000)
    page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
                           " === 'idle'", timeout=RUN_S * 1000)
    failed = page.evaluate(_FAILED_CELLS)
    if failed:
        raise RuntimeError(f"{name}: cells failed: {failed}")


def _workbench_runs(page) -> None:
    """Generate, then switch A1 on and generate again; wait for the drift heatmaps of the pair."""
    generate = page.locator(".h3lab-workbench button", has_text="Generate")
    generate.scroll_into_view_if_needed()
    generate.click()
    page.wait_for_function("() => document.querySelector('video.h3lab-video')", timeout=RUN_S * 1000)
    page.wait_for_function("() => !document.querySelector('.h3lab-workbench button.mod-success').disabled",
                           timeout=RUN_S * 1000)
    page.locator(".h3lab-ablations .h3lab-ablation", has_text="A1").click()
    generate.click()
    page.wait_for_function("() => { const i = document.querySelector('img.h3lab-drift');"
                           " return i && i.complete && i.naturalWidth > 0; }", timeout=RUN_S * 1000)
    page.wait_for_function("() => { const v = document.querySelector('video.h3lab-video');"
                           " return v && v.readyState >= 1 && v.duration > 0; }", timeout=60_000)
    error = page.locator(".h3lab-error").inner_text()
    if error:
        raise RuntimeError(f"the Workbench reported: {error}")


def _grow_and_shoot(page, path: Path) -> None:
    height = min(MAX_HEIGHT, page.evaluate(_CONTENT_HEIGHT) + 140)
    page.set_viewport_size({"width": WIDTH, "height": height})
    page.evaluate("() => { document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer').scrollTop = 0; }")
    page.wait_for_timeout(1500)  # re-layout, lazy cell rendering
    page.locator(".jp-NotebookPanel").screenshot(path=str(path))
    _crop_bottom(path)


def _crop_bottom(path: Path, margin: int = 24) -> None:
    """Drop the empty page below the last cell (the viewport is grown to the notebook's height plus a margin)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        rgb = np.asarray(img.convert("RGB")).astype(int)
    # Rows that differ from the page background (the commonest colour of the lowest 200 rows), the panel's borders
    # (a few pixels at each edge and at the bottom) left out.
    core = rgb[:-8, 40:-40]
    colours, counts = np.unique(core[-200:].reshape(-1, 3), axis=0, return_counts=True)
    background = colours[np.argmax(counts)]
    busy = np.nonzero(np.abs(core - background).sum(axis=2).max(axis=1) > 30)[0]
    bottom = min(rgb.shape[0], int(busy[-1]) + margin) if busy.size else rgb.shape[0]
    _save_small(Image.fromarray(rgb[:bottom].astype(np.uint8)), path)


def _save_small(img, path: Path) -> None:
    """A 256-colour PNG (a quarter of the bytes of RGB for these pages; text and plots stay sharp, no dithering)."""
    from PIL import Image

    img.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument("--only", nargs="*", default=NAMES, choices=NAMES)
    args = parser.parse_args()
    chromium = _chromium()
    if chromium is None:
        raise SystemExit("Debian's chromium is not installed (run scripts/browser_setup.sh)")
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="h3lab-screenshots-"))
    root = work / "lab"
    (root / "notebooks").mkdir(parents=True)
    shutil.copytree(NOTEBOOKS.parent / "benchmarks" / "results", root / "benchmarks" / "results")
    for name in args.only:
        shutil.copy(NOTEBOOKS / f"{name}.ipynb", root / "notebooks" / f"{name}.ipynb")
    lab = start_lab(root / "notebooks", work)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            try:
                for name in args.only:
                    page = browser.new_page(viewport={"width": WIDTH, "height": 1000})
                    page.set_default_timeout(60_000)
                    _open(page, lab, name)
                    if name == "01_quickstart":
                        _workbench_runs(page)
                        page.set_viewport_size({"width": WIDTH, "height": 2600})
                        page.locator(".h3lab-workbench").scroll_into_view_if_needed()
                        page.wait_for_timeout(1000)
                        page.locator(".h3lab-workbench").screenshot(path=str(args.out / "workbench.png"))
                        from PIL import Image

                        with Image.open(args.out / "workbench.png") as img:
                            _save_small(img.copy(), args.out / "workbench.png")
                    _grow_and_shoot(page, args.out / f"{name}.png")
                    print("wrote", args.out / f"{name}.png", flush=True)
                    page.close()
            finally:
                browser.close()
    finally:
        lab.stop()


if __name__ == "__main__":
    main()
