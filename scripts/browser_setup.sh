#!/usr/bin/env bash
# Installs what the notebook browser test (tests/notebooks/test_browser.py) needs on a fresh Debian machine:
# Debian's `chromium` package (apt) and the `playwright` Python package (pip, into the active/project venv).
# Playwright's own browser download is never used (no network but the package registries): the test launches the
# system chromium through `executable_path`. Idempotent: when both are present it only checks and exits.
#
# Usage: scripts/browser_setup.sh [PYTHON]   (PYTHON defaults to .venv/bin/python of the repo, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${1:-}"
if [[ -z "$PY" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
fi

find_chromium() {
    local c
    for c in chromium chromium-browser; do
        if command -v "$c" >/dev/null 2>&1; then command -v "$c"; return 0; fi
    done
    return 1
}

if ! find_chromium >/dev/null; then
    if [[ "$(id -u)" -ne 0 ]]; then SUDO="sudo"; else SUDO=""; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # fonts-liberation: readable text in screenshots; chromium pulls its own shared libraries.
    $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null
fi
CHROMIUM="$(find_chromium)"

if ! "$PY" -c "import playwright.sync_api" >/dev/null 2>&1; then
    "$PY" -m pip install -q "playwright>=1.40"
fi

# Smoke check: the browser starts headless and prints its version.
"$CHROMIUM" --headless=new --no-sandbox --disable-gpu --version 2>/dev/null  # the Debian launcher script is chatty on stderr
"$PY" -c "import playwright, importlib.metadata as m; print('playwright', m.version('playwright'))"
echo "browser setup ok: $CHROMIUM"
