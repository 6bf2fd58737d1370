"""`h3lab.distributed`: strict tensor, context (Ulysses) and sequence parallelism over torch.distributed.

The contract (RFC section 4 rule 8): a TP/CP/SP run is byte-equal to the one-process strict run for the same logical
rows. Three things make that true here, and each file holds one:

- `mesh.py`         `init_mesh(tp, cp, sp, device, config)` -> `Mesh` over a (cp, tp) `DeviceMesh` (NCCL on CUDA,
                    gloo on CPU; no process group at world size 1); topology rules that fail closed, identically on
                    every rank, with one-line `TopologyError`s; `dp=` data-parallel replicas of it (training).
- `shards.py`       who owns what: contiguous uneven row shards (`RowShards`, no padding rows), grouped channel
                    splits that keep the `[value; gate]` and 6 x 3 AdaLN layouts, the row-parallel strategy per TP
                    degree (`tree_strategy`: "k_chunks" for 1/2/4/8, "n_split" otherwise).
- `collectives.py`  strict collectives — all_gather / all_to_all data movement plus declared arithmetic (the 8-chunk
                    tree of `h3kernels.gemm`), never an NCCL/gloo sum — each recorded in a per-forward
                    `CollectiveLog`.
- `plan.py`         the declarative plan at Diffusers' module paths (`TP_PLAN`: style + reason per entry; `CP_PLAN`:
                    where rows are cut and gathered, where heads are exchanged) and the weight sharding it implies,
                    with its exact inverse.
- `apply.py`        `apply_plan(model, mesh, TP_PLAN, CP_PLAN)` / `remove_plan(model)`: the plan applied to a built
                    `H3Transformer` from outside (weights sharded in place, the plans interpreted as hooks) and
                    undone; `parallelize(model, mesh)` (the model's plans); `wrap_placement` (a research wrapper,
                    e.g. the ablation's fault probes in `h3lab.research.ablation.faults`, takes a placement's place).
- `placement.py`    `Placement`: the interpretation of the plans (module hooks, the runtime's placement layer, the
                    hook view from each hook point's `Sharded` layout, the per-forward agreement of every rank);
                    `placement_of(model)`, `row_owner`.
- `field.py`        the `RunSpec.placement` provider (`{"tp", "cp", "sp", "row_parallel"}`): a sealed run records
                    its topology and replays on it.
- `follow.py`       lead / follow: rank 0 runs a front end, the other ranks its forwards (torchrun CLI).
- `frontend.py`     `torchrun --nproc-per-node N -m h3lab --tp T --cp C ...`: mesh, sessions, lead / follow.
- `launch.py`       `spawn(fn, n, *args)`: n local gloo CPU processes (the ablation rows, the tests).
- `shard_load.py`   ranks that hold only their TP shard: slices read from the safetensors files (`get_slice`), or a
                    counter-random init whose rank slice equals the full tensor's.
- `autograd.py`     the backward of the strict collectives (gather/slice, inverse all_to_all, never a reduce-scatter
                    sum) and weight gradients over the rows gathered in packed order: training on a CP mesh,
                    byte-equal to one process.
- `tp_autograd.py`  the backward of the TP pieces (the frozen base's dX from the gathered dY and weight, LoRA factors
                    replicated, split / gather with their inverse): training on TP and TP x CP meshes.
- `peers.py`        `watch(mesh)`: a rank that fails or dies in a torchrun job named in one line on every survivor.
- `mailbox.py`      the shared-device transport: collective bytes through slots every rank maps (CUDA IPC).
- `replicas.py`     one weight copy per CP group on a shared device (the other CP ranks map the owner's tensors).

The model never imports this package; a plan is applied to a built model from outside. A sharded forward runs in
mode strict on more than one rank; with grad on CP, TP and TP x CP meshes (no SP: `autograd.py`, `tp_autograd.py`;
under TP only LoRA factors train), else under no_grad.
`init_mesh(share_device=True)` puts every rank on one GPU (gloo for control, the collectives' bytes through CUDA IPC
slots; `benchmark_distributed.py --shared-transport staged`: host-staged over gloo) to prove a topology's bytes there; its timings are bytes
only.
"""

from .collectives import (
    CollectiveLog,
    CollectiveRecord,
    begin_log,
    gather_columns,
    gather_rows,
    heads_to_rows,
    last_log,
    row_parallel_tree,
    rows_to_heads,
    scatter_rows,
    ulysses_attention,
)
from .errors import DistributedError, TopologyError
from .field import check_placement
from .mesh import Mesh, Topology, check_config, init_mesh, supported_tp
from .apply import apply_plan, parallelize, remove_plan, wrap_placement
from .placement import OwnershipError, Placement, placement_of
from .plan import CP_PLAN, TP_PLAN, PlanEntry, shard_parameters_, shard_state_dict, unshard_state_dict
from .shards import RowShards, cat_grouped, split_grouped, tree_strategy

__all__ = [
    "CP_PLAN", "CollectiveLog", "CollectiveRecord", "DistributedError", "Mesh", "OwnershipError",
    "Placement", "PlanEntry", "RowShards", "TP_PLAN", "Topology", "TopologyError", "begin_log", "cat_grouped",
    "check_config", "check_placement", "gather_columns", "gather_rows", "heads_to_rows", "init_mesh", "last_log",
    "parallelize", "placement_of", "row_parallel_tree", "rows_to_heads", "scatter_rows", "shard_parameters_",
    "shard_state_dict", "split_grouped", "supported_tp", "tree_strategy", "ulysses_attention", "unshard_state_dict",
    "apply_plan", "remove_plan", "wrap_placement",
]
