"""`fast` without the bfloat16 copies (`h3lab.execution.fast_weights`): on the embedded default (64 wide: its projections are
FP8-eligible) under `fast.use_emulation()`, a fast generation after the bf16 bytes of every FP8-eligible weight were
dropped -- replaced by zeros, so any read of them would change the result -- has the same trajectory hash as before;
`off` on the same model does change (the bytes really are gone), and with `keep="host"` the weights come back for a
drift run in `off`, byte-equal to the untouched model, and leave again after."""

from __future__ import annotations

import pytest
import torch

from h3lab import Session
from h3lab.execution import fast
from h3lab.execution.fast_weights import bf16_restored, drop_bf16, eligible, restore_bf16

PROMPT = "a red circle moves left, a low tone"
REQUEST = dict(width=64, height=64, frames=22, steps=2, seed=7)


@pytest.fixture(scope="module")
def reference():
    session = Session(None, device="cpu")
    off = session.generate(PROMPT, mode="off", **REQUEST).trajectory_hash
    with fast.use_emulation():
        quick = session.generate(PROMPT, mode="fast", **REQUEST).trajectory_hash
    return off, quick


def test_fast_outputs_keep_their_bytes_without_the_bf16_weights(reference):
    off, quick = reference
    session = Session(None, device="cpu")
    model = session.transformer()
    weights = eligible(model)
    assert len(weights) > 10
    freed = drop_bf16(model, keep="none")
    assert freed == sum(w.numel() * 2 for w in weights)
    assert all(w.stride() == (0, 0) and not w.any() for w in weights)  # the bytes are gone: zeros behind the shape
    with fast.use_emulation():
        assert session.generate(PROMPT, mode="fast", **REQUEST).trajectory_hash == quick
    assert session.generate(PROMPT, mode="off", **REQUEST).trajectory_hash != off  # off did read them
    with pytest.raises(ValueError, match="keep='none'"):
        restore_bf16(model)


def test_host_copies_come_back_for_drift(reference):
    off, quick = reference
    session = Session(None, device="cpu")
    model = session.transformer()
    before = {id(w): w.detach().clone() for w in eligible(model)}
    drop_bf16(model, keep="host")
    with fast.use_emulation():
        assert session.generate(PROMPT, mode="fast", **REQUEST).trajectory_hash == quick
    with bf16_restored(model):
        assert all(torch.equal(w, before[id(w)]) for w in eligible(model))
        assert session.generate(PROMPT, mode="off", **REQUEST).trajectory_hash == off
    assert all(w.data_ptr() != before[id(w)].data_ptr() for w in eligible(model))  # dropped again (host copies)
    with fast.use_emulation():
        assert session.generate(PROMPT, mode="fast", **REQUEST).trajectory_hash == quick
    with pytest.raises(ValueError, match="keep="):
        drop_bf16(model, keep="disk")
