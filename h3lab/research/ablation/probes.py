"""The probes of the ablation matrix: how a row builds its two arms from the bench (`probe(bench, mode) -> (reference
Execution, probe Execution)`), and the checks of the rows without two arms (`check(bench, mode) -> (status,
observed, passed, report)`: A5, H-C7; C2, which runs the H-C2 row, sits beside the runner in `matrix.py`). A factor
row's probe is `factor_probe(name)`: the bench spec and the bench spec with the factor on; the others (controls,
batch and permutation rows, H15) are transforms of the bench's inputs, layout or execution options that are not
factors of a generation. `matrix.py` declares which row uses which.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ...execution import runtime
from ..drift import Execution, RowMap
from ...hashing import model_fingerprint, tensor_digest
from ...run import DenoiseInputs, model_forward
from ...run.sampler import CONDITION_T, draw_noise, noise_mix
from ...run.trajectory import TrajectoryRecorder, load
from .bench import Bench, _ones_tags, make_inputs
from .factors import _permutation


def _batched(bench: Bench, position: int, size: int, seed: int) -> DenoiseInputs:
    """The bench request at batch `position` of `size`, the other items independent random requests."""
    g = torch.Generator().manual_seed(seed)
    x = bench.inputs

    def stack(t: torch.Tensor) -> torch.Tensor:
        items = [torch.randn(t.shape, generator=g, dtype=t.dtype) for _ in range(size)]
        items[position] = t
        return torch.cat(items, dim=0)

    return x.replace(text=stack(x.text), video=stack(x.video), audio=stack(x.audio))


def factor_probe(name: str):
    """The probe of a factor row: the bench spec, and the bench spec with the factor switched on."""

    def probe(bench: Bench, mode: str):
        ref = bench.reference(mode)
        return ref, ref.with_spec(factors=(name,), label=name)

    probe.__name__ = probe.__qualname__ = f"probe_{name}"
    return probe


def _probe_repeat(scope: str):
    def probe(bench: Bench, mode: str):
        ref = bench.reference(mode, scope)
        return ref, ref.replace(label=f"repeat:{mode}")

    return probe


def _probe_sealed_replay(bench: Bench, mode: str):
    """A0 / H-C2: the reference trajectory sealed to disk, loaded back, and replayed from its sealed run spec."""
    key = ("sealed", mode)
    if key not in bench.cache:
        traj = bench.reference_trajectory(mode)
        folder = Path(tempfile.mkdtemp(prefix="h3lab-ablation-"))
        bench.cache[key] = load(traj.seal(folder / "reference"))
    sealed = bench.cache[key]
    replay = Execution(sealed.spec, bench.model, label=f"sealed-replay:{mode}", models=bench.models,
                       recorder=TrajectoryRecorder())
    return bench.reference(mode), replay


def _check_A5(bench, mode):
    """No KV cache: three calls (x1, x2, x1) on one model give byte-equal first and third outputs, and the model
    holds no cache state."""
    x1 = bench.inputs
    x2 = _batched(bench, 1, 2, seed=99)
    x2 = x2.replace(text=x2.text[:1], video=x2.video[:1], audio=x2.audio[:1])  # an unrelated request, same layout
    with runtime.use_mode(mode), torch.no_grad():
        first = model_forward(bench.model, x1, x1.video, x1.audio, 0)
        model_forward(bench.model, x2, x2.video, x2.audio, 0)
        third = model_forward(bench.model, x1, x1.video, x1.audio, 0)
    stateless = all(tensor_digest(a) == tensor_digest(b) for a, b in zip(first, third))
    cache_attrs = [n for n in ("past_key_values", "kv_cache", "cache") if getattr(bench.model, n, None) is not None]
    ok = stateless and not cache_attrs
    observed = ("N/A: no KV cache (calls x1, x2, x1 give byte-equal outputs for x1; no cache state)" if ok else
                f"cache semantics detected: stateless={stateless}, cache attributes {cache_attrs}")
    return "N/A" if ok else "FAIL", observed, ok, None


def _probe_C1(bench, mode):
    ref = bench.reference(mode)
    return ref, ref.with_spec(inputs=_batched(bench, 1, 2, seed=7), label="C1 batch[1/2]").replace(
        row_map=RowMap(batch_index=1))


def _probe_H15(bench, mode):
    """The anchor rows re-made from another noise draw: from the clean anchor latents when the bench kept them
    (`parts["x0"]`), else from the sealed (already augmented) rows — the second case is a double augmentation."""
    x = bench.inputs
    ncv = x.num_condition_video_rows
    x0 = bench.parts.get("x0", x.video[:, :ncv]).to(x.video.device)
    g = torch.Generator().manual_seed(int(bench.parts.get("seed", 0)) + 1000)
    noise = draw_noise(tuple(x0.shape), g, device=x.video.device)
    video = torch.cat([noise_mix(x0, noise, CONDITION_T).to(x.video.dtype), x.video[:, ncv:]], dim=1)
    ref = bench.reference(mode)
    return ref, ref.with_spec(inputs=x.replace(video=video), label="H15")


def _probe_HC1(bench, mode):
    ref = bench.reference(mode, "forward")
    return ref, ref.with_spec(inputs=_batched(bench, 0, 3, seed=5), label="H-C1 batch[0/3]").replace(
        row_map=RowMap(batch_index=0))


def _probe_HC3(bench, mode):
    layout = bench.layout.permute(_permutation(bench.inputs.seq_len, 13))
    ref = bench.reference(mode)
    # The permuted layout's sealed inputs carry its key_order, so attention visits keys canonically: no override.
    probe = ref.with_spec(inputs=bench.inputs_for(layout=layout), layout=layout, label="H-C3 permuted")
    return ref, probe.replace(row_map=RowMap(packed_order=layout.canonical_order()))


def _probe_HC6(bench, mode):
    ref = bench.reference(mode, "forward").replace(grad=True, checkpointing=False, label=f"checkpointing off:{mode}")
    return ref, ref.replace(checkpointing=True, label=f"checkpointing on:{mode}")


def _check_HC7(bench, mode):
    """Repeated FL2VA / Ref2VA preprocessing: layouts, their JSON artifacts and the sealed inputs built twice are
    identical; component hashes (weights of both variants, snapshot files) are identical when taken twice."""
    from ...run.layout import Reference, build_layout

    cfg = bench.model.config
    mismatches = []
    builds = {
        "fl2va": lambda: build_layout("fl2va", _ones_tags(5), 2, 4, 4, 3, anchors=("first", "last")),
        "ref2va": lambda: build_layout("ref2va", _ones_tags(5), 2, 4, 4, 3,
                                       references=(Reference.image(4, 4), Reference.audio(2))),
    }
    for task, build in builds.items():
        a, b = build(), build()
        if a.sha256() != b.sha256() or a.to_json() != b.to_json():
            mismatches.append(f"{task} layout")
        ia = make_inputs(cfg, a, bench.schedule, 3)
        ib = make_inputs(cfg, b, bench.schedule, 3)
        ha = {k: tensor_digest(v) for k, v in ia.tensors().items()}
        hb = {k: tensor_digest(v) for k, v in ib.tensors().items()}
        if ha != hb:
            mismatches.append(f"{task} sealed inputs")
    for name, m in (("transformer", bench.model), ("transformer_ref", bench.variant)):
        if model_fingerprint(m) != model_fingerprint(m) or _weights_digest(m) != _weights_digest(m):
            mismatches.append(f"{name} weights")
    if bench.snapshot is not None:
        from ...checkpoint.info import component_hash

        for comp in ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder"):
            folder = bench.snapshot / comp
            if folder.is_dir() and component_hash(folder) != component_hash(folder):
                mismatches.append(f"{comp} component hash")
    ok = not mismatches
    observed = ("PASS: fl2va/ref2va layouts, layout JSON, sealed inputs and component hashes identical over two builds"
                if ok else f"differs: {', '.join(mismatches)}")
    return "PASS" if ok else "FAIL", observed, ok, None


def _weights_digest(model: Any) -> str:
    return "|".join(f"{n}:{tensor_digest(t)}" for n, t in model.state_dict().items())
