"""Fixtures of the notebook-room tests: one tiny `Session` for the folder (per-step tensors kept) and two tiny
generations. Helpers shared by the test files live in `nb_helpers.py`."""

from __future__ import annotations

import pytest

from nb_helpers import TINY_REQUEST


@pytest.fixture(scope="session")
def tiny_session(tiny_snapshot):
    from h3lab import Session

    session = Session(tiny_snapshot, device="cpu")
    session.keep = ("latents", "velocities")
    return session


@pytest.fixture(scope="session")
def two_results(tiny_session):
    """Two tiny off-mode generations with different seeds (latents and velocities kept)."""
    a = tiny_session.generate("A red fox walks through fresh snow.", seed=11, **TINY_REQUEST)
    b = tiny_session.generate("A red fox walks through fresh snow.", seed=12, **TINY_REQUEST)
    return a, b
