"""Data-parallel gradients over a `torch.distributed` process group, byte-equal to one process.

Contract
--------
- Every rank holds the same model and optimiser state and the same *global* request list, in global batch order.
  Rank r of W computes the requests of its contiguous block `rank_block(n, r, W)` = [r*n//W, (r+1)*n//W), each as
  its own micro-batch (`step.request_gradient`, same mode and checkpointing as one process).
- The combine is not an all-reduce sum. Each rank reduces its block into the maximal nodes of the global fixed tree
  that cover it (`combine.tree_nodes`; one node when the block is an aligned power-of-two range, e.g. 2 ranks x 2
  requests), appending the same tree over its request losses as one extra column. The node partials (float32, padded
  to the largest rank's node count) are all-gathered, and every rank finishes the tree from them
  (`combine.tree_sum_nodes`) and divides by n: the same additions, in the same association, on the same float32
  values as `step.compute_gradients` in one process, so the gradient, the loss and — after `StrictAdamW.step` on
  every rank — the weights are byte-equal to one process over the same global batch, whatever W.
- Per-request losses and gradient digests are gathered too (the sealed run records them); velocities and per-request
  gradients stay on the rank that computed them.
- Collectives: three `all_gather`s on tensors on the model's device (gloo for CPU, NCCL for CUDA). `group` is any
  process group (None: the default group), e.g. the data-parallel group of a `h3lab.distributed` mesh.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..run.trajectory import TraceSummary
from .combine import tree_nodes, tree_sum, tree_sum_nodes
from .objective import Objective, TrainingError
from .step import RequestGradient, StepResult, for_each_request, model_device, trainable_parameters

DIGEST_BYTES = 64  # hex SHA-256


def rank_block(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of the global requests rank `rank` of `world` computes: contiguous, sizes differ by <= 1."""
    if not 0 <= rank < world:
        raise TrainingError(f"rank {rank} of world size {world}: must be in [0, {world})")
    return rank * n // world, (rank + 1) * n // world


def _gather(tensor: torch.Tensor, world: int, group: Any) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def data_parallel_gradients(
    model: nn.Module,
    requests: Sequence[Any],
    objective: Objective,
    *,
    group: Any = None,
    mode: str = "strict",
    gradient_checkpointing: bool | None = None,
    trace: TraceSummary | None = None,
) -> StepResult:
    """The global batch gradient of `requests` computed across the ranks of `group` (module docstring)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise TrainingError("data-parallel gradients need an initialised torch.distributed process group")
    requests = list(requests)
    n = len(requests)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if n < world:
        raise TrainingError(f"global batch of {n} requests over {world} ranks: every rank needs at least one request")
    start, stop = rank_block(n, rank, world)
    local: list[RequestGradient] = []
    trace = TraceSummary() if trace is None else trace
    for_each_request(model, requests[start:stop], objective, lambda _, rg: local.append(rg), mode=mode,
                     gradient_checkpointing=gradient_checkpointing, trace=trace)

    device = model_device(model)
    numel = sum(p.numel() for _, p in trainable_parameters(model))
    layouts = [tree_nodes(*rank_block(n, r, world), n) for r in range(world)]
    max_nodes = max(len(nodes) for nodes in layouts)
    max_block = max(b - a for a, b in (rank_block(n, r, world) for r in range(world)))
    partials = torch.zeros(max_nodes, numel + 1, dtype=torch.float32, device=device)  # [gradient | loss] per node
    for j, (lo, hi) in enumerate(layouts[rank]):
        leaves = local[lo - start:hi - start]
        partials[j, :numel] = tree_sum(rg.gradient for rg in leaves)
        partials[j, numel] = tree_sum(rg.loss.to(torch.float32) for rg in leaves)
    losses = torch.zeros(max_block, dtype=torch.float32, device=device)
    digests = torch.zeros(max_block, DIGEST_BYTES, dtype=torch.uint8, device=device)
    for i, rg in enumerate(local):
        losses[i] = rg.loss.to(torch.float32)
        digests[i] = torch.frombuffer(bytearray(rg.digest.encode("ascii")), dtype=torch.uint8).to(device)

    gathered = _gather(partials, world, group)
    nodes = {node: gathered[r][j] for r in range(world) for j, node in enumerate(layouts[r])}
    total = tree_sum_nodes(n, nodes)
    all_losses, all_digests = _gather(losses, world, group), _gather(digests, world, group)
    request_losses, request_digests = [], []
    for r in range(world):
        a, b = rank_block(n, r, world)
        request_losses += [all_losses[r][i] for i in range(b - a)]
        request_digests += [bytes(all_digests[r][i].cpu().tolist()).decode("ascii") for i in range(b - a)]
    return StepResult(total[numel] / n, total[:numel] / n, request_losses, request_digests,
                      [rg.velocity for rg in local], [], trace)
