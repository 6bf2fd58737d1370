"""Fixtures of the component tests: one seeded tiny snapshot per session (the shared `tiny_snapshot` when
`h3lab.checkpoint.tiny` exists, else `tiny_parts.make_component_snapshot`) and the components loaded from it once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The component models are tiny: thousands of microsecond ops, where a second intra-op thread on a shared,
    loaded CPU costs 10-50x (measured: a tiny Qwen3-VL encode 0.07 s on 1 thread, 0.8-3.6 s on 2). The root conftest
    asks for 2 threads; these tests run on 1 and restore the setting after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def component_snapshot(request, tmp_path_factory) -> Path:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see one_torch_thread; session fixtures are built before it applies
    try:
        if importlib.util.find_spec("h3lab.checkpoint.tiny") is not None:
            return Path(request.getfixturevalue("tiny_snapshot"))
        from tiny_parts import make_component_snapshot

        return make_component_snapshot(tmp_path_factory.mktemp("components") / "h3-tiny-parts", seed=0)
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def text_encoder(component_snapshot):
    from h3lab.components.text_encoder import TextEncoder

    return TextEncoder.from_pretrained(component_snapshot, processor_backend="pil")


@pytest.fixture(scope="session")
def video_vae(component_snapshot):
    from h3lab.components.video_vae import VideoVAE

    return VideoVAE.from_pretrained(component_snapshot)


@pytest.fixture(scope="session")
def audio_vae(component_snapshot):
    from h3lab.components.audio_vae import AudioVAE

    return AudioVAE.from_pretrained(component_snapshot)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A fresh generator per test, seeded from the test name (different inputs per test, reproducible)."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
