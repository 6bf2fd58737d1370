"""01_quickstart runs top to bottom in a fresh kernel (nbclient; any cell error fails the test)."""

from __future__ import annotations

from nb_helpers import execute, images, outputs, stderr, text_of


def test_quickstart_runs():
    nb = execute("01_quickstart")
    text = text_of(nb)
    assert "t2va seed 42, 64x64, 22 frames" in text and "digest" in text
    assert images(nb) == 4  # frames, latent strip, norms, sigma grids
    assert "matches the prompt: {'colour': True, 'direction': True, 'tone': True, 'pan': True}" in text
    html = [o["data"]["text/html"] for o in outputs(nb) if "text/html" in o.get("data", {})]
    assert any("<video" in h and "data:video/mp4;base64" in h for h in html)
    widgets = [o for o in outputs(nb) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert widgets, "the Workbench panel was not displayed"
    assert "what ran: off: 0 strict / " in text and "strict on cpu: Triton's interpreter" in text
    assert any('width="384"' in h for h in html)  # a 64 px clip shown at a size where its controls fit
    assert stderr(nb) == []  # no FutureWarning in red
