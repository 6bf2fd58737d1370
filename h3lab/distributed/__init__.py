"""`h3lab.distributed`: strict tensor, context (Ulysses) and sequence parallelism over torch.distributed.

The contract (RFC section 4 rule 8): a TP/CP/SP run is byte-equal to the one-process strict run for the same logical
rows. Three things make that true here, and each file holds one:

- `mesh.py`         `init_mesh(tp, cp, sp, device, config)` -> `Mesh` over a (cp, tp) `DeviceMesh` (NCCL on CUDA,
                    gloo on CPU; no process group at world size 1); topology rules that fail closed, identically on
                    every rank, with one-line `TopologyError`s.
- `shards.py`       who owns what: contiguous uneven row shards (`RowShards`, no padding rows), grouped channel
                    splits that keep the `[value; gate]` and 6 x 3 AdaLN layouts, the row-parallel strategy per TP
                    degree (`tree_strategy`: "k_chunks" for 1/2/4/8, "n_split" otherwise).
- `collectives.py`  strict collectives — all_gather / all_to_all data movement plus declared arithmetic (the 8-chunk
                    tree of `h3kernels.gemm`), never an NCCL/gloo sum — each recorded in a per-forward
                    `CollectiveLog`.
- `plan.py`         the declarative plan at Diffusers' module paths (`TP_PLAN`: style + reason per entry; `CP_PLAN`:
                    where rows are cut and gathered, where heads are exchanged) and the weight sharding it implies,
                    with its exact inverse.

The model never imports this package; a plan is applied to a built model from outside (the wiring onto the model's
modules is the next step, see docs/ARCHITECTURE.md). Forward only for now.
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
from .mesh import Mesh, Topology, check_config, init_mesh, supported_tp
from .plan import CP_PLAN, TP_PLAN, PlanEntry, shard_parameters_, shard_state_dict, unshard_state_dict
from .shards import RowShards, cat_grouped, split_grouped, tree_strategy

__all__ = [
    "CP_PLAN", "CollectiveLog", "CollectiveRecord", "DistributedError", "Mesh", "PlanEntry", "RowShards", "TP_PLAN",
    "Topology", "TopologyError", "begin_log", "cat_grouped", "check_config", "gather_columns", "gather_rows",
    "heads_to_rows", "init_mesh", "last_log", "row_parallel_tree", "rows_to_heads", "scatter_rows",
    "shard_parameters_", "shard_state_dict", "split_grouped", "supported_tp", "tree_strategy", "ulysses_attention",
    "unshard_state_dict",
]
