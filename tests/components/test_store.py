"""`ComponentStore` on its own (no `Session`): snapshot resolution, loading once with the time booked, the variant
switch, phased release, pinned injected transformers, and the refusals -- each a one-line error that changes nothing."""

from __future__ import annotations

import pytest
import torch

from h3lab.components.store import ComponentStore, resolve_snapshot
from h3lab.errors import CheckpointError, ValidationError


@pytest.fixture
def store(tiny_snapshot):
    return ComponentStore(tiny_snapshot, torch.device("cpu"))


def test_resolve_snapshot(tiny_snapshot, tmp_path):
    path, name = resolve_snapshot(tiny_snapshot)
    assert path == tiny_snapshot and name == tiny_snapshot.resolve().name
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_snapshot(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_snapshot(tmp_path / "file")


def test_bad_residency_and_variant(tiny_snapshot, store):
    with pytest.raises(ValidationError, match="residency='everything'"):
        ComponentStore(tiny_snapshot, torch.device("cpu"), residency="everything")
    with pytest.raises(ValidationError, match="variant='transformer_x'"):
        store.transformer("transformer_x")
    assert store.loaded == [] and store.load_seconds == 0.0


def test_load_once_books_time_and_switches_variants(store):
    dit = store.load("transformer")
    after_first = store.load_seconds
    assert after_first > 0 and store.loaded == ["transformer"]
    assert store.load("transformer") is dit and store.load_seconds == after_first  # served, not reloaded
    assert not any(p.requires_grad for p in dit.parameters()) and not dit.training
    ref = store.transformer("transformer_ref")
    assert store.loaded == ["transformer_ref"] and ref is not dit  # two partitions never coexist
    store.load("vae")
    store.phase_done("vae")  # resident: kept
    assert store.loaded == ["transformer_ref", "vae"]
    store.release()
    assert store.loaded == []


def test_phased_release_keeps_a_pinned_transformer(tiny_snapshot):
    store = ComponentStore(tiny_snapshot, torch.device("cpu"), residency="phased")
    model = store.load("transformer")
    store.phase_done("transformer")
    assert store.loaded == []
    store.set_transformer(model, "transformer")
    assert store.load("transformer") is model
    store.phase_done("transformer")
    store.release()
    store.load("transformer_ref")  # the variant switch keeps the pinned one too
    assert store.loaded == ["transformer", "transformer_ref"] and store.load("transformer") is model
    lookup = store.models_for("transformer_ref", store.load("transformer_ref"))
    assert lookup("transformer") is model  # H16's other partition: the pinned model, no disk read
    with pytest.raises(ValidationError, match="model 'diffusers'"):
        lookup("diffusers")
    store.set_transformer(None, "transformer")
    assert store.injected == {} and store.loaded == ["transformer_ref"]


def test_set_transformer_refuses_before_changing_anything(store):
    model = store.load("transformer")
    with pytest.raises(ValidationError, match="must be an h3lab H3Transformer"):
        store.set_transformer(torch.nn.Linear(2, 2))
    model.apply_dtype_policy("float32")
    with pytest.raises(ValidationError, match="dtype_policy='float32'"):
        store.set_transformer(model)
    assert store.injected == {} and store.loaded == ["transformer"]


def test_snapshot_metadata(store, tiny_snapshot):
    video, audio = store.read_shifts()
    assert isinstance(video, float) and isinstance(audio, float)
    cfg = store.read_pipeline_config({"canvas_short_edge": 64})
    assert cfg["canvas_short_edge"] == 64 and set(cfg) == {"canvas_short_edge", "canvas_max_pixels",
                                                          "reference_image_short_edge"}
    with pytest.raises(ValidationError, match="pipeline_config key 'canvas'"):
        store.read_pipeline_config({"canvas": 64})
    with pytest.raises(ValidationError, match="must be an integer >= 32"):
        store.read_pipeline_config({"canvas_short_edge": 16})
    with pytest.raises(CheckpointError, match="cannot read"):
        store.component_config("no_such_component")
