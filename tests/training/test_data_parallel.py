"""Two data-parallel ranks (gloo, spawned processes) vs one process over the same global batch: byte-equal per-request
losses and gradient digests, batch gradients and weights after every step — aligned blocks (one tree node per rank),
unaligned blocks (a rank sends two nodes), and strict mode; torch's usual data-parallel gradient (per-rank batched
backward + all-reduce sum) is not byte-equal to one process's batched gradient, nor to the fixed combine."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from dp_worker import CASES, WEIGHT_SEED, config, usual_requests, worker
from safetensors.torch import load_file
from training_cases import SMALL, batched_torch_gradient, build_model, make_dataset

from h3lab.training import Objective, TrainingError, compute_gradients, data_parallel_gradients, train


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    mp.spawn(worker, args=(2, str(out)), nprocs=2, join=True)
    return [(json.loads((out / f"rank{r}.json").read_text()), load_file(str(out / f"rank{r}.safetensors")))
            for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_process(ranks, name):
    model = build_model(SMALL, "released", WEIGHT_SEED)
    one = train(model, make_dataset(), config(name))
    for rank, (records, tensors) in enumerate(ranks):
        assert records[name] == one.steps, f"rank {rank} {name}: step records differ from one process"
        for n, p in model.named_parameters():
            assert torch.equal(tensors[f"{name}.{n}"], p.detach()), f"rank {rank} {name}: weight {n} differs"
    assert one.manifest["mode"] == CASES[name][0]


def test_usual_data_parallel_path_is_not_byte_equal(ranks):
    """Torch's usual data parallelism: each rank's batched backward over its block, all-reduced. With 2 ranks the
    all-reduce adds two partials (commutative: exactly (p0 + p1) / 2 on both ranks), so it is the per-rank batched
    backward, which groups the rows per block, that makes the gradient differ from one process's batched backward —
    and from the fixed combine."""
    usual = ranks[0][1]["usual.gradient"]
    assert torch.equal(usual, ranks[1][1]["usual.gradient"])  # the ranks agree with each other
    model = build_model(SMALL, "released", WEIGHT_SEED)
    requests = usual_requests()
    p0, p1 = (batched_torch_gradient(model, requests[a:b], Objective()) for a, b in ((0, 2), (2, 4)))
    assert torch.equal(usual, (p0 + p1) / 2) and torch.equal(usual, (p1 + p0) / 2)
    one_batched = batched_torch_gradient(model, requests, Objective())
    fixed = compute_gradients(model, requests, Objective(), mode="off").gradient
    assert not torch.equal(usual, one_batched)
    assert not torch.equal(usual, fixed)


def test_without_a_process_group_it_refuses():
    model = build_model(SMALL, "released", WEIGHT_SEED)
    with pytest.raises(TrainingError, match="process group"):
        data_parallel_gradients(model, make_dataset(), Objective(), mode="off")
