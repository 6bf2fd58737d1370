"""The strict contract at the level of the whole transformer (CPU, Triton interpreter).

Strict velocities are byte-identical across: a repeat; batch 1 vs 3 (each item of a batch of three distinct requests
equals its own batch-1 forward); batch position (a request at position 0 and at 2); mutation of an unrelated batch
item; a consistent permutation of the packed rows with all their metadata (`layout.permute(perm)` + `key_order`),
where the selected outputs are byte-equal and every hook-captured packed-row intermediate equals the canonical one
after the inverse permutation; gradient checkpointing on vs off (outputs and every gradient); a training-mode,
grad-enabled forward vs a no-grad forward. Two strict backward passes (the second checkpointed) give identical
gradients for every parameter and input. Accuracy: against a float64 truth (the same weights upcast, `off` mode), the
strict error of each output, and of every parameter and input gradient, is at most ~2x the error of the torch (`off`)
path in the same dtype policy (`strict_testing.assert_error_within`: factor 2 plus a floor of 4 float32 ulps of the
truth's norm).

Cases: `tiny` and `h3d8` (hidden != attention inner width, both ways), layouts t2va / fl2va (first + last) / ref2va
(image + video with soundtrack + audio references) from `build_layout`, released (bf16 + float32 modules) and
all-float32 weights, seeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strict_cases import (
    CONFIGS,
    Request,
    build_model,
    forward_kwargs,
    make_layout,
    make_request,
    strict_forward,
    forward_backward,
    truth_model,
)

from strict_testing import assert_error_within
from h3lab import H3Config, H3Transformer
from h3lab.execution import runtime
from h3lab.run.layout import PackedLayout

# (config, dtype policy, task, weight seed): both policies, both configs, all three layouts.
CASES = [
    ("tiny", "released", "fl2va", 11),
    ("tiny", "float32", "t2va", 12),
    ("h3d8", "released", "ref2va", 13),
]
REQUEST_SEEDS = (101, 102, 103)  # requests A, B, C of the batch


@dataclass
class Baseline:
    """One case's canonical batch-3 strict forward, with every hook point captured."""

    name: str
    policy: str
    config: H3Config
    model: H3Transformer
    layout: PackedLayout
    requests: list[Request]
    out: tuple[torch.Tensor, torch.Tensor]
    captured: dict[str, torch.Tensor]

    def item(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out[0][i:i + 1], self.out[1][i:i + 1]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def base(request) -> Baseline:
    name, policy, task, seed = request.param
    config = CONFIGS[name]
    model = build_model(config, policy, seed)
    layout = make_layout(task, config.patch_size)
    requests = [make_request(config, layout, s) for s in REQUEST_SEEDS]
    out, captured = strict_forward(model, forward_kwargs(layout, requests), capture=True)
    trace = runtime.last_trace()
    assert trace.mode == "strict" and trace.records and not trace.fallbacks
    video, audio = out
    assert video.dtype == audio.dtype == torch.float32
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()
    for i in range(3):  # distinct requests give distinct velocities (the comparisons below can fail)
        for j in range(i):
            assert not torch.equal(video[i], video[j]) and not torch.equal(audio[i], audio[j])
    return Baseline(f"{name}-{policy}-{task}", policy, config, model, layout, requests, out, captured)


def assert_same(got, want, what: str) -> None:
    for label, a, b in zip(("video", "audio"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {label} {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        if not torch.equal(a, b):
            diff = (a - b).abs()
            raise AssertionError(
                f"{what}: {label} velocities differ in {int((diff > 0).sum())} of {diff.numel()} values "
                f"(max |diff| {float(diff.max()):.3e})"
            )


# --------------------------------------------------------------------------------------------- invariance
def test_repeat(base):
    out, captured = strict_forward(base.model, forward_kwargs(base.layout, base.requests), capture=True)
    assert_same(out, base.out, f"{base.name} repeat")
    assert captured.keys() == base.captured.keys() == {p.name for p in base.model.hook_points()}
    for name, value in captured.items():
        assert torch.equal(value, base.captured[name]), f"{base.name} repeat: hook point {name} differs"


def test_batch_one_equals_its_item_in_batch_three(base):
    for i, req in enumerate(base.requests):
        out, _ = strict_forward(base.model, forward_kwargs(base.layout, [req]))
        assert_same(out, base.item(i), f"{base.name} batch 1 vs item {i} of batch 3")


def test_batch_position(base):
    a, b, c = base.requests
    out, _ = strict_forward(base.model, forward_kwargs(base.layout, [c, b, a]))
    assert_same((out[0][2:3], out[1][2:3]), base.item(0), f"{base.name} request A at position 0 vs 2")
    assert_same((out[0][0:1], out[1][0:1]), base.item(2), f"{base.name} request C at position 2 vs 0")
    assert_same((out[0][1:2], out[1][1:2]), base.item(1), f"{base.name} request B at position 1")


def test_unrelated_batch_item_mutation(base):
    a, b, c = base.requests
    g = torch.Generator().manual_seed(7)
    video, audio, text = b.video.clone(), b.audio.clone(), b.text.clone()
    video[:, ::2] = torch.randn(video[:, ::2].shape, generator=g)  # every other video row
    audio[:, :1] = torch.randn(audio[:, :1].shape, generator=g)
    text[:, -1:] = torch.randn(text[:, -1:].shape, generator=g)
    out, _ = strict_forward(base.model, forward_kwargs(base.layout, [a, Request(video, audio, text), c]))
    assert_same((out[0][0:1], out[1][0:1]), base.item(0), f"{base.name} item 0 after mutating item 1")
    assert_same((out[0][2:3], out[1][2:3]), base.item(2), f"{base.name} item 2 after mutating item 1")
    assert not torch.equal(out[0][1], base.out[0][1]), "the mutation did not reach item 1's velocities"


def test_consistent_row_permutation(base):
    layout = base.layout
    S = layout.sequence_length
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(S))
    permuted = layout.permute(perm)
    key_order = permuted.key_order()
    assert key_order is not None and permuted.is_consistent and not permuted.is_canonical
    assert not torch.equal(permuted.token_tags, layout.token_tags), "the permutation must mix the streams"
    out, captured = strict_forward(base.model, forward_kwargs(permuted, base.requests), capture=True)
    assert_same(out, base.out, f"{base.name} consistent row permutation")

    inverse = permuted.canonical_order()  # gather back to canonical order
    assert torch.equal(perm[inverse], torch.arange(S))
    packed = 0
    for point in base.model.hook_points():
        got, want = captured[point.name], base.captured[point.name]
        if point.rows == "packed":  # rows of the packed sequence moved: compare after the inverse permutation
            got = got.index_select(point.row_axis, inverse)
            packed += 1
        # video/audio/text rows keep their stream order; per-timestep tables are unchanged (same unique timesteps)
        assert torch.equal(got, want), f"{base.name} permutation: hook point {point.name} ({point.rows} rows) differs"
    assert packed >= 3 + 16 * base.config.num_layers  # every packed point was compared (pack, rope, blocks, heads)

    if base.policy == "float32":
        # The comparison can fail: in float32 the bytes depend on the order keys are summed in, so the same permuted
        # forward without the canonical key order differs (in bfloat16, at these sizes, the roundings absorb it).
        kwargs = forward_kwargs(permuted, base.requests)
        kwargs["key_order"] = None
        (video, _), _ = strict_forward(base.model, kwargs)
        assert not torch.equal(video, base.out[0]), "dropping key_order left the float32 bytes unchanged"


# ----------------------------------------------------------------------------------------------- accuracy
def test_accuracy_against_float64_truth(base):
    """Derived tolerance: strict error <= 2 x torch error in the same policy (+ 4 float32 ulps of the truth's norm)."""
    kwargs = forward_kwargs(base.layout, base.requests)
    with torch.no_grad(), runtime.use_mode("off"):
        torch_out = base.model(**kwargs)
        truth = truth_model(base.model)(**kwargs)
    assert truth[0].dtype == torch.float64
    for label, strict, ref, tru in zip(("video", "audio"), base.out, torch_out, truth):
        assert not torch.equal(strict.double(), tru), "strict output equals the float64 truth: nothing was measured"
        assert_error_within(strict, ref, tru, f"{base.name} {label} (strict vs off, against float64)")


# ------------------------------------------------------------------------------------------------ training
GRAD_CASES = [("tiny", "released", "fl2va", 21), ("h3d8", "float32", "ref2va", 22)]


@dataclass
class GradRuns:
    name: str
    model: H3Transformer
    kwargs: dict
    first: tuple
    checkpointed: tuple
    no_grad: tuple


@pytest.fixture(scope="module", params=GRAD_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def grad_runs(request) -> GradRuns:
    """Batch-2 strict forward+backward twice (plain, then checkpointed: the repeat, which recomputes the forward too)
    in training mode, and the same batch as a no-grad eval forward."""
    name, policy, task, seed = request.param
    config = CONFIGS[name]
    model = build_model(config, policy, seed)
    layout = make_layout(task, config.patch_size)
    kwargs = forward_kwargs(layout, [make_request(config, layout, s) for s in REQUEST_SEEDS[:2]])
    first = forward_backward(model, kwargs)
    model.gradient_checkpointing = True
    try:
        checkpointed = forward_backward(model, kwargs)
    finally:
        model.gradient_checkpointing = False
    no_grad, _ = strict_forward(model, kwargs)
    return GradRuns(f"{name}-{policy}-{task}", model, kwargs, first, checkpointed, no_grad)


def test_backward_is_deterministic(grad_runs):
    """Every gradient finite and non-zero; the second strict backward of the batch is the checkpointed one (its
    bytes equal the first's: `test_checkpointing_on_off`), so a backward that varied between runs fails there."""
    grads1 = grad_runs.first[1]
    assert {"input:hidden_states", "input:audio_hidden_states", "input:encoder_hidden_states"} <= grads1.keys()
    for key in grads1:
        g = grads1[key]
        assert torch.isfinite(g).all() and g.abs().max() > 0, f"{grad_runs.name}: gradient {key} is zero or not finite"


def test_checkpointing_on_off(grad_runs):
    (out1, grads1), (out_ckpt, grads_ckpt) = grad_runs.first, grad_runs.checkpointed
    assert_same(out_ckpt, out1, f"{grad_runs.name} checkpointing on vs off")
    assert grads_ckpt.keys() == grads1.keys()
    for key in grads1:
        assert torch.equal(grads_ckpt[key], grads1[key]), f"{grad_runs.name}: gradient {key} differs with checkpointing"


def test_training_forward_equals_no_grad_forward(grad_runs):
    assert_same(grad_runs.first[0], grad_runs.no_grad, f"{grad_runs.name} train+grad forward vs eval no-grad forward")


def test_gradient_accuracy_against_float64_truth(grad_runs):
    """Every parameter and input gradient of the strict backward: error against the float64 truth (same weights and
    inputs upcast, `off`) at most 2 x the torch backward's error in the same policy (+ 4 float32 ulps of its norm)."""
    _, strict_grads = grad_runs.first
    _, torch_grads = forward_backward(grad_runs.model, grad_runs.kwargs, mode="off")
    truth = {k: (v.double() if k.endswith("hidden_states") else v) for k, v in grad_runs.kwargs.items()}
    _, truth_grads = forward_backward(truth_model(grad_runs.model), truth, mode="off")
    assert strict_grads.keys() == torch_grads.keys() == truth_grads.keys()
    for key, grad in strict_grads.items():
        assert truth_grads[key].dtype == torch.float64
        assert_error_within(grad, torch_grads[key], truth_grads[key], f"{grad_runs.name} gradient {key}")
