"""The tiny snapshot's "interface" preset: released interface widths (text 5120, video latents 24, audio latents 32)
with tiny internals; its components load, interlock with its transformer, and a generation runs on it."""

import json

import pytest
import torch


@pytest.fixture(scope="module")
def interface(tmp_path_factory):
    from h3lab.checkpoint.tiny import make_tiny_snapshot

    return make_tiny_snapshot(tmp_path_factory.mktemp("iface") / "h3-interface", seed=0, preset="interface")


def test_interface_components_interlock(interface):
    from h3lab.checkpoint.tiny import INTERFACE_CONFIG, verify_snapshot
    from h3lab.components.audio_vae import AudioVAE
    from h3lab.components.text_encoder import TextEncoder
    from h3lab.components.video_vae import VideoVAE
    from h3lab.config import H3Config
    from h3lab.model import H3Transformer

    assert verify_snapshot(interface)
    assert json.loads((interface / "h3lab_manifest.json").read_text())["preset"] == "interface"
    for variant in ("transformer", "transformer_ref"):
        cfg = H3Config.from_json(str(interface / variant / "config.json"))
        assert cfg == INTERFACE_CONFIG
        assert (cfg.text_dim, cfg.in_channels, cfg.audio_in_channels) == (5120, 24, 32)  # the released widths
    model = H3Transformer.from_pretrained(interface, subfolder="transformer", device="cpu")
    text = TextEncoder.from_pretrained(interface, device="cpu")
    assert sum(p.numel() for p in text.model.parameters()) < 40_000_000  # ~80 MB in bf16
    enc = text.encode("a fox")
    assert enc.embeds.shape[-1] == model.config.text_dim == 5120
    assert torch.isfinite(enc.embeds.float()).all() and enc.embeds.float().std() > 0
    assert VideoVAE.from_pretrained(interface, device="cpu").latent_channels == model.config.in_channels
    assert AudioVAE.from_pretrained(interface, device="cpu").latent_channels == model.config.audio_in_channels


def test_interface_generates(interface):
    from h3lab.app.session import Session

    result = Session(interface, device="cpu").generate("a fox", width=64, height=64, frames=22, steps=1, mode="off")
    assert result.frames.shape == (22, 64, 64, 3) and result.audio.shape[0] == 2
    assert result.latents.shape[0] == 24 and result.audio_latents.shape[1] == 32
