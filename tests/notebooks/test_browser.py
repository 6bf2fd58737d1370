"""A real browser on the quick-start notebook: JupyterLab on loopback (a free port, a token, no browser of its own),
headless Chromium through Playwright (Debian's chromium via `executable_path`; `scripts/browser_setup.sh` installs
both), every cell run. The Workbench must list the ablation toggles of `h3lab.app.session.ablation_factors()`, the strict
set-up line and the "what ran" line; an ablation toggle is clicked, then Generate, and the panel must then say what ran
(the mode, the op counts, the factor switched on), show a `<video>` that the browser can play (metadata decoded,
duration > 0, at least 320 px wide) and the latent strip `<img>` (decoded, non-empty). A screenshot goes to
test-artifacts/. Every wait is bounded; JupyterLab and its kernels are always shut down."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nb_helpers import ARTIFACTS, NOTEBOOKS
from ports import free_port

pytestmark = pytest.mark.browser

SERVER_START_S = 90
NOTEBOOK_RUN_S = 240
GENERATE_S = 180


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _require_browser() -> str:
    chromium = _chromium()
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (run scripts/browser_setup.sh)")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (run scripts/browser_setup.sh)")
    return chromium



def _api(base: str, token: str, path: str, method: str = "GET", timeout: float = 5.0):
    req = urllib.request.Request(f"{base}{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else None


class ServerExited(RuntimeError):
    """`jupyter lab` ended before it answered (its log's last lines in the message)."""


class JupyterLab:
    """`jupyter lab` on 127.0.0.1:<free port> serving `root`, started in its own process group."""

    def __init__(self, root: Path, log: Path):
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        state = root.parent / "jupyter-state"
        env = dict(os.environ)
        env.update(JUPYTER_RUNTIME_DIR=str(state / "runtime"), JUPYTER_CONFIG_DIR=str(state / "config"),
                   JUPYTERLAB_SETTINGS_DIR=str(state / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(state / "ws"))
        argv = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True"]
        if os.geteuid() == 0:
            argv.append("--allow-root")  # CI and the dev machines run as root
        # No news / update toast over the screenshot: the notification plugin's user settings.
        notes = state / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
        notes.parent.mkdir(parents=True, exist_ok=True)
        notes.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}), encoding="utf-8")
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            argv,
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                tail = Path(self.log.name).read_text(encoding="utf-8", errors="replace").strip().splitlines()[-6:]
                raise ServerExited(f"jupyter lab exited with {self.proc.returncode} ({self.log.name}): "
                                   + " | ".join(tail))
            try:
                _api(self.base, self.token, "/api/status")
                return
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        raise TimeoutError(f"jupyter lab did not answer on {self.base} within {timeout:.0f} s")

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                for kernel in _api(self.base, self.token, "/api/kernels") or []:
                    _api(self.base, self.token, f"/api/kernels/{kernel['id']}", method="DELETE", timeout=15)
        except (urllib.error.URLError, OSError, ValueError):
            pass  # the server is already gone or unresponsive: the signals below still end it
        finally:
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                if self.proc.poll() is not None:
                    break
                try:
                    os.killpg(self.proc.pid, sig)  # our own process group: the server and what it spawned there
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    continue
            self.log.close()


def start_lab(root: Path, log_dir: Path, attempts: int = 3) -> JupyterLab:
    """A JupyterLab that answers, on a fresh free port each attempt: the port is chosen before the server binds it,
    and the suite's other processes (gloo rendezvous, torchrun) take ephemeral ports on the other worker meanwhile, so
    a server that exits at start (the port taken in between) is started again, up to ATTEMPTS times; the last
    attempt's error names its log's last lines."""
    for attempt in range(1, attempts + 1):
        lab = JupyterLab(root, log_dir / f"jupyterlab-{attempt}.log")
        try:
            lab.wait_ready(SERVER_START_S)
            return lab
        except ServerExited:
            lab.stop()
            if attempt == attempts:
                raise
        except BaseException:
            lab.stop()
            raise
    raise AssertionError("unreachable")


# The notebook model, read in the page: every code cell has an execution count; which cells hold an error output.
_ALL_CELLS_RAN = """() => window.jupyterapp.shell.currentWidget.content.widgets
    .every(c => c.model.type !== 'code' || c.model.executionCount !== null)"""
_FAILED_CELLS = """() => window.jupyterapp.shell.currentWidget.content.widgets
    .filter(c => c.model.type === 'code' && c.model.outputs.toJSON().some(o => o.output_type === 'error'))
    .map(c => c.model.id)"""


def launch(pw, chromium: str):
    """Headless Debian chromium through Playwright, as every browser test here runs it."""
    return pw.chromium.launch(executable_path=chromium, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])


def open_and_run(page, lab: JupyterLab, name: str) -> None:
    """Open notebook NAME in a workspace of its own (reset: JupyterLab would otherwise restore the previous page's
    notebook as the current one), wait for its kernel, and start running every cell."""
    page.goto(f"{lab.base}/lab/workspaces/{name}/tree/{name}.ipynb?token={lab.token}&reset")
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext", timeout=60_000)
    page.wait_for_function(
        "() => { const w = window.jupyterapp.shell.currentWidget;"
        " const k = w.sessionContext.session && w.sessionContext.session.kernel;"
        " return k && k.status === 'idle'; }", timeout=90_000)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")


def test_quickstart_workbench_in_chromium(tmp_path):
    chromium = _require_browser()
    from playwright.sync_api import sync_playwright

    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOKS / "01_quickstart.ipynb", root / "01_quickstart.ipynb")
    ARTIFACTS.mkdir(exist_ok=True)
    lab = start_lab(root, ARTIFACTS)
    try:
        with sync_playwright() as pw:
            browser = launch(pw, chromium)
            page = None
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1200})
                page.set_default_timeout(60_000)
                open_and_run(page, lab, "01_quickstart")
                generate = page.locator(".h3lab-workbench button", has_text="Generate")
                generate.wait_for(state="visible", timeout=NOTEBOOK_RUN_S * 1000)
                page.wait_for_function(_ALL_CELLS_RAN, timeout=NOTEBOOK_RUN_S * 1000)
                failed = page.evaluate(_FAILED_CELLS)
                assert failed == [], f"notebook cells failed in the browser: {failed}"
                assert page.locator(".h3lab-workbench video").count() == 0  # nothing before Generate
                # The ablation toggles: every factor `!ablate` offers, one button each.
                from h3lab.app.session import ablation_factors

                factors = list(ablation_factors())
                toggles = page.locator(".h3lab-ablations .h3lab-ablation")
                assert toggles.count() == len(factors) and toggles.all_inner_texts() == factors
                assert "ablation toggles: none" not in page.locator(".h3lab-workbench").inner_text()
                whatran = page.locator(".h3lab-whatran")
                assert whatran.inner_text() == "what ran: no generation yet"
                assert "strict on cpu" in page.locator(".h3lab-strict-setup").inner_text()
                a1 = toggles.filter(has_text="A1")
                a1.scroll_into_view_if_needed()
                a1.click()
                page.wait_for_function("() => [...document.querySelectorAll('.h3lab-ablation')]"
                                       ".some(b => b.textContent.trim() === 'A1' && b.classList.contains('mod-active'))",
                                       timeout=10_000)
                generate.scroll_into_view_if_needed()
                generate.click()

                video = page.locator("video.h3lab-video")
                strip = page.locator("img.h3lab-latent-strip")
                error_line = page.locator(".h3lab-error")
                page.wait_for_function(  # a result, or the panel's error line
                    "() => document.querySelector('video.h3lab-video') && document.querySelector('img.h3lab-latent-strip')"
                    " || (document.querySelector('.h3lab-error') || {}).textContent", timeout=GENERATE_S * 1000)
                assert error_line.inner_text() == "", f"the Workbench reported: {error_line.inner_text()}"
                # What ran: the mode, the op counts of the trace, the factor the click switched on.
                ran = whatran.inner_text()
                assert ran.startswith("what ran: off: 0 strict / ") and " torch op calls in 20 forwards" in ran, ran
                assert ran.endswith("ablations on: A1"), ran
                assert "ablations A1" in page.locator(".h3lab-workbench").inner_text()
                assert video.evaluate("v => v.getBoundingClientRect().width") >= 320  # controls usable
                # The browser decoded the MP4 (H.264 + AAC) far enough to know its duration; the PNG strip decoded.
                page.wait_for_function(
                    "() => { const v = document.querySelector('video.h3lab-video');"
                    " return v && v.readyState >= 1 && v.duration > 0; }", timeout=60_000)
                duration = video.evaluate("v => v.duration")
                assert 0.5 < duration < 2.0  # 22 frames at 24 fps = 0.917 s
                # It plays: muted (headless autoplay policy), the clock advances, then it stops at 0.5 s.
                video.evaluate("v => { v.muted = true; return v.play(); }")
                page.wait_for_function("() => document.querySelector('video.h3lab-video').currentTime > 0.4",
                                       timeout=30_000)
                video.evaluate("v => { v.pause(); v.currentTime = 0.5; }")
                page.wait_for_function(
                    "() => { const i = document.querySelector('img.h3lab-latent-strip');"
                    " return i && i.complete && i.naturalWidth > 0; }", timeout=60_000)
                assert strip.evaluate("i => i.naturalWidth") > 200
                assert error_line.inner_text() == ""
                generate.evaluate("b => b.scrollIntoView({block: 'start'})")
                page.wait_for_timeout(500)  # let the scroll settle before the picture
                page.screenshot(path=str(ARTIFACTS / "notebook_workbench.png"))
            except BaseException:
                if page is not None:
                    page.screenshot(path=str(ARTIFACTS / "notebook_workbench_failure.png"))
                raise
            finally:
                browser.close()
    finally:
        lab.stop()
    assert lab.proc.poll() is not None
