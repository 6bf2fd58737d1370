"""`Session.set_transformer`: an injected DiT runs exactly like the same weights loaded from disk, a DiT whose interface
does not fit the snapshot is refused with the session unchanged, and phased residency keeps an injected DiT."""

import pytest
import torch

from h3lab.errors import ValidationError
from h3lab.model import H3Transformer
from h3lab.app.session import Session

REQUEST = dict(width=64, height=64, frames=22, steps=2, mode="off", seed=7)


def _copy_of(model: H3Transformer) -> H3Transformer:
    """The same weights in a new module, unfingerprinted (as a model built in memory is)."""
    with torch.device("meta"):
        clone = H3Transformer(model.config)
    clone.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True, strict=True)
    clone.reset_buffers("cpu")
    return clone


def test_injected_equals_disk_loaded(snapshot):
    disk = Session(snapshot, device="cpu")
    a = disk.generate("a red fox in the snow", **REQUEST)
    model = _copy_of(H3Transformer.from_pretrained(snapshot, subfolder="transformer", device="cpu"))
    assert model.fingerprint == ""
    injected = Session(snapshot, device="cpu")
    injected.set_transformer(model)
    assert injected.injected == ["transformer"] and "transformer" not in injected.loaded
    b = injected.generate("a red fox in the snow", **REQUEST)
    assert injected.transformer() is model
    assert b.trajectory_hash == a.trajectory_hash
    assert torch.equal(b.latents, a.latents) and torch.equal(b.audio, a.audio)
    assert (b.frames == a.frames).all()
    # Fingerprinted once at injection with the weights digest, recorded in the trajectory.
    assert model.fingerprint.startswith("weights:")
    assert b.trajectory.manifest["checkpoint"]["fingerprint"] == model.fingerprint


def test_mismatched_interface_refused(snapshot):
    from h3lab.checkpoint.tiny import INTERFACE_CONFIG
    from h3lab.config import H3Config

    session = Session(snapshot, device="cpu")  # the tiny snapshot: text 16, video 4, audio 8 channels
    good = H3Config.tiny().to_diffusers()
    cases = {
        "text_dim=5120": H3Transformer(INTERFACE_CONFIG),
        "text_dim=32": H3Transformer(H3Config(**{**good, "text_dim": 32})),
        "in_channels=6": H3Transformer(H3Config(**{**good, "in_channels": 6})),
        "audio_in_channels=4": H3Transformer(H3Config(**{**good, "audio_in_channels": 4})),
        "patch_size=(1, 1, 1)": H3Transformer(H3Config(**{**good, "patch_size": (1, 1, 1)})),
        "dtype_policy='float32'": H3Transformer(H3Config.tiny(), dtype_policy="float32"),
    }
    for needle, model in cases.items():
        with pytest.raises(ValidationError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
            session.set_transformer(model)
        assert "\n" not in str(err.value)
    with torch.device("meta"):
        meta = H3Transformer(H3Config.tiny())
    with pytest.raises(ValidationError, match="meta tensor"):
        session.set_transformer(meta)
    with pytest.raises(ValidationError, match="must be an h3lab H3Transformer"):
        session.set_transformer(torch.nn.Linear(4, 4))
    with pytest.raises(ValidationError, match="variant='transformer_x'"):
        session.set_transformer(H3Transformer(H3Config.tiny()), variant="transformer_x")
    assert session.injected == [] and session.loaded == []  # nothing changed


def test_phased_residency_keeps_injected(snapshot):
    model = H3Transformer.from_pretrained(snapshot, subfolder="transformer", device="cpu")
    session = Session(snapshot, device="cpu", residency="phased")
    session.set_transformer(model)
    result = session.generate("waves on a pebble beach", **REQUEST)
    assert result.evaluations == REQUEST["steps"]
    assert session.loaded == ["transformer"]  # encoders and decoders released after their phases, the DiT pinned
    session.release()
    session.release("transformer")
    assert session.loaded == ["transformer"] and session.transformer() is model
    session.set_transformer(None)  # unpinned: the snapshot's weights load on next use
    assert session.injected == [] and session.loaded == []
    assert session.transformer() is not model
