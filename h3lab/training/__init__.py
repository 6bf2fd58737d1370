"""`h3lab.training`: strict training of H3 — the flow-matching objective, the per-request training step with its
fixed-order gradient combine, a deterministic AdamW, data-parallel gradients byte-equal to one process, and sealed,
verifiable training runs.

- `objective.py`      `Objective`, `ClipRequest` (fine-tuning), `rollout_request(s)` (RL on sealed trajectories),
                      `TrainingSample`, `flow_matching_loss`
- `combine.py`        the fixed binary tree per-request gradients combine in (`tree_sum`, `TreeAccumulator`, nodes)
- `step.py`           `compute_gradients`, `train_step`, `request_gradient`, `trainable_parameters`
- `step_graph.py`     CUDA graphs of the strict micro-batch (forward, loss, backward, flat gradient): `use_graphs`,
                      `last_path`; `request_gradient` goes through it where eligible (same bytes, no host launches)
- `optim.py`          `StrictAdamW`
- `data_parallel.py`  `data_parallel_gradients` over a torch.distributed group (gather + the same tree)
- `run.py`            `TrainConfig`, `train`, `TrainingRun.seal`, `load`, `verify`
- LoRA itself (`add_lora`, adapter files, the `RunSpec.adapters` and `lora_scale` providers) is `h3lab.adapters`,
  shared with inference; this package re-exports its names
- `rewards.py`        RL rewards: `Reward`, `RewardSample`, `score`, `resolve_reward` (NAME, module:function, a
                      weighted sum, a reward server URL); the shipped examples, `prompt_match` (h3-shapes)
- `reward_base.py`    the reward types (`Reward`, `RewardSample`, `score`, `score_parts`)
- `reward_mix.py`     weighted sums `NAME:W,NAME:W` (parts logged in the run records)
- `reward_protocol.py`, `reward_client.py`, `reward_server.py`   rewards from another process over HTTP
- `grpo.py`           GRPO pieces as pure functions: `group_advantages`, `clipped_surrogate`, `truncated_weight`,
                      `reference_kl`, `PassSelection`
- `grpo_step.py`      `GrpoConfig`, `Transition`, `RolloutBatch` (from SDE trajectories / `Session.rollout`),
                      `grpo_iteration`, `replay_ratios`
- `grpo_run.py`       sealed GRPO runs: `grpo_train` (resume), `load`, `verify`
- `grpo_job.py`       `h3lab train grpo` jobs (`GrpoJob.check`, `run_grpo_job`)
- `grpo_report.py`    the REPL's `!rollout` report (`rollout_report`), `reward_samples` of a `Session.rollout`
- `rl_run.py`         the sealed-run loop GRPO and DiffusionNFT share (train, resume, manifest, load, verify)
- `nft/`              DiffusionNFT (`h3lab.training.nft`: `NftConfig`, `nft_iteration`, `nft_train`, `verify`,
                      `NftJob` of `h3lab train nft`)

May import: the foundations, `schema`, `execution`, `checkpoint`, `run`, `model`, `adapters`, `stochastic`,
`shapes`. Never `components`, `research`, `app` or the front ends.
"""

from ..adapters import field as _adapters  # noqa: F401 - registers the RunSpec.adapters provider
from ..adapters import lora_scale as _lora_scale  # noqa: F401 - registers the RunSpec.lora_scale provider
from ..adapters.adapter_file import AdapterFile, check_shapes, read_adapter
from ..adapters.field import adapter_entry
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
from .optim_config import OptimizerConfig
from .run import RunVerifyReport, TrainConfig, TrainingRun, load, train, verify
from ..adapters.lora import (
    PROJECTIONS,
    AdapterError,
    add_lora,
    adapter_digest,
    adapter_files,
    adapter_state_dict,
    remove_lora,
    save_adapter,
)
from .step import RequestGradient, StepResult, compute_gradients, request_gradient, train_step, trainable_parameters
from .grpo import PassSelection, group_advantages
from .grpo_step import GrpoConfig, RolloutBatch, Transition, batch_from_rollout, grpo_iteration
from .grpo_run import GrpoRun, grpo_train
from .rewards import Reward, RewardError, RewardSample, resolve_reward

__all__ = [
    "TreeAccumulator", "tree_nodes", "tree_sum", "tree_sum_nodes", "data_parallel_gradients", "rank_block",
    "ClipRequest", "Objective", "SampleRequest", "TrainingError", "TrainingSample", "flow_matching_loss",
    "rollout_request", "rollout_requests", "StrictAdamW", "RunVerifyReport", "TrainConfig", "TrainingRun", "load",
    "train", "verify", "RequestGradient", "StepResult", "compute_gradients", "request_gradient", "train_step",
    "trainable_parameters", "AdapterFile", "check_shapes", "read_adapter", "adapter_entry", "PROJECTIONS",
    "AdapterError", "add_lora", "adapter_digest", "adapter_files", "adapter_state_dict", "remove_lora", "save_adapter",
    "PassSelection", "group_advantages", "GrpoConfig", "RolloutBatch", "Transition", "batch_from_rollout",
    "grpo_iteration", "GrpoRun", "grpo_train", "Reward", "RewardError", "RewardSample", "resolve_reward",
]
