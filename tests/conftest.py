"""Shared test setup: strict kernels run on CPU through Triton's interpreter, so the variable is set before any
test module imports triton. `tiny_snapshot` is the seeded tiny snapshot every test that needs weights uses."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models: one thread is faster than two (thread start-up dominates) and keeps timings stable.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory):
    """Path of a freshly generated tiny snapshot (seed 0), shared by the whole test session."""
    from h3lab.checkpoint.tiny import make_tiny_snapshot

    return make_tiny_snapshot(tmp_path_factory.mktemp("snapshot") / "h3-tiny", seed=0)
