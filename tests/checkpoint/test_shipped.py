"""The shipped default snapshot ("h3-shapes"): it verifies against its manifest, it is what `path=None` means, its
layout is the release's with a >= 6-block transformer, its seal names the data and the weights, and a tampered,
extra or missing file is refused with one line naming it."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from h3lab.checkpoint import shipped, tiny
from h3lab.config import H3Config
from h3lab.errors import CheckpointError


def test_default_is_the_verified_shipped_snapshot():
    root = tiny.default_snapshot()
    assert root == shipped.SHIPPED and root.name == "h3-shapes"
    from h3lab.components.store import resolve_snapshot

    assert resolve_snapshot(None) == (root, "h3-shapes")
    index = json.loads((root / "model_index.json").read_text())
    for sub in ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder", "tokenizer", "processor",
                "scheduler", "audio_scheduler"):
        assert sub in index and (root / sub).is_dir()
    for variant in ("transformer", "transformer_ref"):
        cfg = H3Config.from_json(str(root / variant / "config.json"))
        assert cfg.num_layers >= 6 and cfg.in_channels == 4 and cfg.text_dim == H3Config.tiny().text_dim
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size <= 20e6


def test_seal_names_the_data_and_the_weights():
    root = shipped.SHIPPED
    seal = json.loads((root / shipped.SEAL).read_text())
    assert len(seal["data_digest"]) == 64 and seal["clips"] > 0 and seal["command"].startswith("python")
    assert {"video_vae", "audio_vae", "transformer"} <= set(seal["phases"])
    for rel, digest in seal["weights"].items():
        assert hashlib.sha256((root / rel).read_bytes()).hexdigest() == digest
    assert any(k.startswith("transformer/") for k in seal["weights"])


@pytest.mark.parametrize("damage", ["flip", "extra", "missing"])
def test_a_damaged_copy_is_refused_naming_the_file(tmp_path, damage):
    root = tmp_path / "h3-shapes"
    shutil.copytree(shipped.SHIPPED, root)
    assert shipped.shapes_snapshot(root) == root
    target = root / "vae" / "config.json"
    if damage == "flip":
        target.write_text(target.read_text().replace("4", "5", 1))
        expect = "vae/config.json does not match its SHA-256"
    elif damage == "extra":
        (root / "vae" / "notes.txt").write_text("x")
        expect = "vae/notes.txt is not in h3lab_manifest.json"
    else:
        target.unlink()
        expect = "vae/config.json is missing"
    with pytest.raises(CheckpointError, match=expect) as info:
        shipped.shapes_snapshot(root)
    assert "\n" not in str(info.value)
