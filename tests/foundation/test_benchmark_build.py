"""The benchmarks' model build (`benchmarks/_common.materialise`): a model built on the meta device is allocated once,
in its released dtypes, for H3Transformer and for Diffusers' model alike: the bytes allocated per dtype are exactly
the released parameters' and buffers' (counted on the CPU with a dispatch mode that sees every allocation), where
allocating first and casting after (the old path) allocated every parameter in float32. The card and its memory are
in every header."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from h3lab import H3Config, H3Transformer
from h3lab.model.precision import policy_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _common  # noqa: E402


class Allocations(TorchDispatchMode):
    """Bytes per dtype of every tensor a factory op (`empty*`) creates off the meta device."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith("empty") and isinstance(out, torch.Tensor) and not out.is_meta:
            self.bytes[out.dtype] += out.numel() * out.element_size()
        return out


def released_bytes(model) -> Counter:
    want: Counter = Counter()
    for name, p in model.named_parameters():
        dtype = policy_dtype(name, "released")
        want[dtype] += p.numel() * torch.finfo(dtype).bits // 8
    for b in model.buffers():
        want[b.dtype] += b.numel() * b.element_size()
    return want


@pytest.mark.parametrize("kind", ["h3lab", "diffusers"])
def test_materialise_allocates_only_the_released_bytes(kind):
    config = H3Config.tiny()

    def meta_model():
        with torch.device("meta"):
            if kind == "h3lab":
                return H3Transformer(config)
            from diffusers import MiniMaxH3Transformer3DModel

            return MiniMaxH3Transformer3DModel(**config.to_diffusers())

    model = meta_model()
    want = released_bytes(model)
    with Allocations() as seen:
        built = _common.materialise(model, "cpu")
    assert seen.bytes == want and set(want) == {torch.float32, torch.bfloat16}
    assert all(p.dtype == policy_dtype(n, "released") for n, p in built.named_parameters())
    if kind == "diffusers":  # the old path: allocate (Diffusers builds float32), then cast
        with Allocations() as old:
            meta_model().to_empty(device="cpu")
        assert old.bytes[torch.float32] > want[torch.float32] and old.bytes[torch.bfloat16] == 0
    with pytest.raises(ValueError, match="not the meta device"):
        _common.materialise(built, "cpu")


def test_header_names_the_card_and_its_memory():
    doc = _common.header("x", "benchmarks/x.py", [], "cpu")
    assert "gpu" in doc and "gpu_total_gib" in doc and doc["gpu_total_gib"] is None
