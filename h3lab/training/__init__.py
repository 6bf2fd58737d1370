"""`h3lab.training`: strict training of H3 — the flow-matching objective, the per-request training step with its
fixed-order gradient combine, a deterministic AdamW, data-parallel gradients byte-equal to one process, and sealed,
verifiable training runs.

- `objective.py`      `Objective`, `ClipRequest` (fine-tuning), `rollout_request(s)` (RL on sealed trajectories),
                      `TrainingSample`, `flow_matching_loss`
- `combine.py`        the fixed binary tree per-request gradients combine in (`tree_sum`, `TreeAccumulator`, nodes)
- `step.py`           `compute_gradients`, `train_step`, `request_gradient`, `trainable_parameters`
- `optim.py`          `StrictAdamW`
- `data_parallel.py`  `data_parallel_gradients` over a torch.distributed group (gather + the same tree)
- `run.py`            `TrainConfig`, `train`, `TrainingRun.seal`, `load`, `verify`
- `_deps.py`          every name taken from the rest of h3lab (one place to update when those rooms move)
"""

from .combine import TreeAccumulator, tree_nodes, tree_sum, tree_sum_nodes
from .data_parallel import data_parallel_gradients, rank_block
from .objective import (
    ClipRequest,
    Objective,
    SampleRequest,
    TrainingError,
    TrainingSample,
    flow_matching_loss,
    rollout_request,
    rollout_requests,
)
from .optim import StrictAdamW
from .run import RunVerifyReport, TrainConfig, TrainingRun, load, train, verify
from .step import RequestGradient, StepResult, compute_gradients, request_gradient, train_step, trainable_parameters

__all__ = [
    "TreeAccumulator", "tree_nodes", "tree_sum", "tree_sum_nodes", "data_parallel_gradients", "rank_block",
    "ClipRequest", "Objective", "SampleRequest", "TrainingError", "TrainingSample", "flow_matching_loss",
    "rollout_request", "rollout_requests", "StrictAdamW", "RunVerifyReport", "TrainConfig", "TrainingRun", "load",
    "train", "verify", "RequestGradient", "StepResult", "compute_gradients", "request_gradient", "train_step",
    "trainable_parameters",
]
