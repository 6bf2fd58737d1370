"""A rollout of a model carrying an injected LoRA adapter (a GRPO job's policy) records what ran: the base
fingerprint and the adapter by the sha256 of its content at that moment (`training.adapters.in_place_entry`), so
`trajectory.verify` re-runs it -- OK on the model carrying that adapter, refused in one line when the adapter changed
or is gone. Off mode, tiny snapshot, two passes."""

import pytest
import torch

from h3lab.run import trajectory as T
from h3lab.training import add_lora, remove_lora
from h3lab.adapters.lora import AdapterError, adapter_digest, base_fingerprint, lora_layers

SMALL = dict(width=64, height=64, frames=22, steps=2, mode="off")


def test_in_place_adapter_is_recorded_and_verified(session, tmp_path):
    model = session.transformer("transformer")
    handle = add_lora(model, 2, seed=1)
    try:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # a non-zero B: the adapter changes the velocities (an iteration after an update)
            for _, layer in lora_layers(model):
                w = layer.lora_B["default"].weight
                w.copy_(0.05 * torch.randn(w.shape, generator=g))
        sha = adapter_digest(model)
        out = session.rollout(["a red ball"], group=2, stepper="flow_sde", level=0.7, seed=5, **SMALL)
        traj = out.trajectories[0]
        (entry,) = traj.spec.adapters
        assert entry["name"] == "in-place" and entry["path"] is None and entry["sha256"] == sha
        assert entry["scale"] == 1.0
        assert traj.spec.fingerprint == base_fingerprint(model)
        sealed = T.load(traj.seal(tmp_path / "rollout"))
        assert sealed.digest == traj.digest and sealed.spec.adapters[0]["sha256"] == sha
        report = T.verify(sealed, model)
        assert report.ok and report.fingerprint_match, report

        with torch.no_grad():  # the policy moved on: the same trajectory is refused, naming both digests
            first = lora_layers(model)[0][1].lora_B["default"].weight
            kept = first.clone()
            first.add_(1e-3)
        with pytest.raises(AdapterError, match=f"injected adapter of sha256 .*, the run recorded {sha[:12]}") as err:
            T.verify(sealed, model)
        assert "\n" not in str(err.value)
        for _, layer in lora_layers(model):
            layer.set_scale("default", 0.5)
        with torch.no_grad():
            first.copy_(kept)  # the recorded content again, at another scale
        with pytest.raises(AdapterError, match="runs at scale 0.5, the run recorded 1"):
            T.verify(sealed, model)
    finally:
        remove_lora(model, handle)
    with pytest.raises(AdapterError, match="recorded no file; run it on the model carrying that adapter"):
        T.verify(sealed, model)
