"""Fixtures of tests/checkpoint: a header-only sparse snapshot of the released 33B transformer (~66 GB of holes)."""

from __future__ import annotations

import json

import pytest
from ckpt_helpers import write_sparse_full_component


@pytest.fixture(scope="session")
def sparse_full_snapshot(tmp_path_factory):
    """A snapshot root whose `transformer/` has the released architecture and dtypes in 12 sparse shards: valid
    safetensors headers, data sections that are filesystem holes (reading them yields zeros, costs no disk)."""
    root = tmp_path_factory.mktemp("sparse") / "h3-full"
    total = write_sparse_full_component(root / "transformer")
    (root / "model_index.json").write_text(
        json.dumps(
            {"_class_name": "MiniMaxH3ModularPipeline", "transformer": ["diffusers", "MiniMaxH3Transformer3DModel"]}
        )
    )
    return root, total
