"""The device mesh of a strict multi-GPU run: `init_mesh(tp=1, cp=1, sp=False, device=None, config=None)`.

A `Mesh` wraps a `torch.distributed.device_mesh.DeviceMesh` of shape (cp, tp) with dimension names ("cp", "tp"):
global rank = cp_index * tp + tp_index, so a TP group is `tp` consecutive ranks (one NVLink island) and a CP group
takes one rank of each TP group. It holds the process groups, this rank's coordinates and device, and the topology
(`Topology`: tp, cp, sp). NCCL serves CUDA devices, gloo CPU (the tests); nothing else moves bytes.

World size 1 (tp = cp = 1) needs no process group: without one, `init_mesh()` returns a mesh whose groups are None
and every collective is the local identity, so a single GPU runs the same code path (same kernels, same bytes) as a
mesh. Under `torchrun` (WORLD_SIZE in the environment) `init_mesh` initialises the default process group itself
(env://, nccl for cuda, gloo for cpu); tests initialise it first (gloo, a file:// rendezvous) and `init_mesh` uses it.

Topology rules (strict fails closed; every message is one line naming the value and the rule):
- tp, cp positive integers; sp requires tp > 1 (sequence parallel shards the rows of one CP shard over its TP group);
  `row_parallel` "auto", "k_chunks" (tp in 1, 2, 4, 8) or "n_split" (`shards.tree_strategy`);
- world size == tp * cp;
- with a config (`check_config`, also called when a plan is applied to a model): tp divides num_attention_heads
  (whole heads per rank: 56 -> 1, 2, 4, 7, 8, 14, 28, 56), hidden_size (AdaLN tables are sharded by hidden channel,
  and `n_split` row-parallel layers by output column) and ffn_dim; cp divides the heads of one TP rank (Ulysses gives
  each CP rank whole heads: tp 4 x cp 2 on 56 heads is 14 -> 7 per rank, tp 8 x cp 2 is refused);
- one device type on every rank (no cpu/cuda mix), the device exists, no two ranks on one CUDA device (unless
  `share_device`), and the process group's backend serves that device type;
- every rank asks for the same topology (and the same `share_device`).

Data-parallel replicas (`dp` > 1, training: `training.data_parallel_gradients(..., group=mesh.dp_group)`): the world
is dp replicas of the (cp, tp) mesh, DeviceMesh (dp, cp, tp), global rank = dp_index * tp * cp + the replica rank.
Everything above applies per replica (`group_ranks` and the collectives stay inside it; `replica_group` is the
process group of this rank's replica, which a placement's per-forward agreement uses: replicas run other requests);
`dp_group` joins the ranks of equal (cp, tp) coordinates. dp 1 is the mesh above, unchanged.

Shared-device ranks (`share_device=True`, a verification mode for bytes, not speed): every rank may sit on one CUDA
device (device None -> cuda:0 on every rank), the process group is gloo, and the collectives stage CUDA tensors
through host memory (`Mesh.staged`: a copy to the host, the gloo call, a copy back -- bytes are moved, never
changed). So one GPU proves a topology's bytes before eight are rented. Timings from such a mesh are labelled
`Mesh.timing_label` ("bytes only: ...") and are never scaling; `to_dict()` (the trace's placement) records the
transport ("gloo (host-staged cuda)"). On CPU ranks (gloo already) the flag changes nothing but the label.
On CUDA, `init_mesh` turns `Mesh.shared_memory` on: the collectives' bytes then go through slots every rank maps by
CUDA IPC (`mailbox.py`; transport "cuda ipc (shared device)"), gloo moving only a few integers per call -- the same
bytes, without the host copies that made a 50-block forward take minutes. Setting it False keeps host staging; the
CPU tests set it True to run the mailbox over /dev/shm ("shared memory (host)").
Rows are checked where they are known: `mesh.row_shards(seq_len)` refuses cp larger than the packed rows, and
`mesh.sp_shards(rows)` refuses tp larger than a CP shard's rows.

Every rank takes part in one exchange of what it asked for (`all_gather_object`) before anything is decided, then
every rank raises the same `TopologyError`: a refusal never leaves one rank waiting in a collective the others left.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .errors import TopologyError
from .shards import RowShards, tree_strategy

DIMS = ("cp", "tp")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    cp: int = 1
    sp: bool = False
    row_parallel: str = "auto"  # "auto" | "k_chunks" | "n_split" (shards.tree_strategy)

    @property
    def strategy(self) -> str:
        """The row-parallel strategy this topology runs ("k_chunks" or "n_split")."""
        return tree_strategy(self.tp, self.row_parallel)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp

    @property
    def name(self) -> str:
        return f"tp{self.tp}xcp{self.cp}" + ("+sp" if self.sp else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "name": self.name, "world_size": self.world_size, "strategy": self.strategy}


def check_degrees(tp, cp, sp, row_parallel: str = "auto") -> Topology:
    """The rules that need no model and no process group."""
    for name, value in (("tp", tp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TopologyError(f"{name}={value!r}: must be a positive integer")
    if not isinstance(sp, bool):
        raise TopologyError(f"sp={sp!r}: must be True or False")
    if sp and tp == 1:
        raise TopologyError("sp=True with tp=1: sequence parallel shards rows over a TP group, so it needs tp > 1")
    tree_strategy(tp, row_parallel)
    return Topology(tp, cp, sp, row_parallel)


def supported_tp(config) -> tuple[int, ...]:
    """TP degrees a config admits: whole heads, hidden channels and FFN channels per rank."""
    c = config
    return tuple(
        d for d in range(1, c.num_attention_heads + 1)
        if c.num_attention_heads % d == 0 and c.hidden_size % d == 0 and c.ffn_dim % d == 0
    )


def check_config(topology: Topology, config) -> None:
    """The rules that depend on the model's widths (`H3Config`)."""
    tp, cp, c = topology.tp, topology.cp, config
    allowed = ", ".join(map(str, supported_tp(c)))
    for field, value in (("num_attention_heads", c.num_attention_heads), ("hidden_size", c.hidden_size),
                         ("ffn_dim", c.ffn_dim)):
        if value % tp:
            raise TopologyError(f"tp={tp}: must divide {field}={value} (this config admits tp in {{{allowed}}})")
    heads = c.num_attention_heads // tp
    if heads % cp:
        raise TopologyError(
            f"cp={cp}: must divide the {heads} heads of one tp rank (num_attention_heads={c.num_attention_heads} "
            f"/ tp={tp}); Ulysses gives every cp rank whole heads"
        )


# ---------------------------------------------------------------------------------------------------- the mesh
class Mesh:
    """One rank's view of the (cp, tp) mesh. Build with `init_mesh`."""

    def __init__(self, topology: Topology, rank: int, device: torch.device, device_mesh=None, backend: str = "",
                 share_device: bool = False, dp: int = 1, replica_group=None):
        self.topology = topology
        self.rank = rank
        self.device = device
        self.device_mesh = device_mesh
        self.backend = backend
        self.share_device = share_device
        self.dp = dp
        self.dp_rank, local = divmod(rank, topology.world_size)
        self.replica_group = replica_group  # None: the default group (dp 1)
        # shared-device ranks' collectives through mapped slots (mailbox.py); init_mesh turns it on for CUDA
        self.shared_memory = False
        self.coords = {"cp": local // topology.tp, "tp": local % topology.tp}

    @property
    def dp_group(self):
        """The process group of the data-parallel ranks with this rank's (cp, tp) coordinates (None at dp 1)."""
        return None if self.dp == 1 else self.device_mesh.get_group("dp")

    @property
    def staged(self) -> bool:
        """True when gloo serves a CUDA device: its tensors (the hook agreement flag; the collectives' bytes unless
        `shared_memory`) are copied through host memory."""
        return self.device.type == "cuda" and self.backend == "gloo"

    @property
    def transport(self) -> str:
        """What moves the bytes: "nccl", "gloo", "gloo (host-staged cuda)", "cuda ipc (shared device)", "shared
        memory (host)" (`shared_memory` on CPU ranks, the tests), or "none" (world size 1)."""
        if not self.backend:
            return "none"
        if self.shared_memory:
            return "cuda ipc (shared device)" if self.device.type == "cuda" else "shared memory (host)"
        return f"{self.backend} (host-staged cuda)" if self.staged else self.backend

    @property
    def timing_label(self) -> str:
        """How timings from this mesh may be read: "bytes only" on shared-device ranks, else "timing"."""
        if self.share_device and self.topology.world_size > 1:
            how = "through shared memory slots" if self.shared_memory else "through host memory"
            return (f"bytes only: every rank shares one device and the collectives go {how}; these timings are not "
                    "scaling")
        return "timing"

    def size(self, dim: str) -> int:
        self._check_dim(dim)
        return getattr(self.topology, dim)

    def local_rank(self, dim: str) -> int:
        self._check_dim(dim)
        return self.coords[dim]

    def group(self, dim: str):
        """The process group along `dim` (None without a process group: world size 1)."""
        self._check_dim(dim)
        return None if self.device_mesh is None else self.device_mesh.get_group(dim)

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along `dim`, in group-rank order."""
        self._check_dim(dim)
        tp, cp = self.topology.tp, self.topology.cp
        base = self.dp_rank * tp * cp
        if dim == "tp":
            return [base + self.coords["cp"] * tp + j for j in range(tp)]
        return [base + i * tp + self.coords["tp"] for i in range(cp)]

    def row_shards(self, seq_len: int) -> RowShards:
        """The packed rows' partition over the CP group (refuses cp > seq_len)."""
        return RowShards(seq_len, self.topology.cp, "cp")

    def sp_shards(self, rows: int) -> RowShards:
        """The partition of one CP shard's `rows` over the TP group, for sequence-parallel regions."""
        if not self.topology.sp:
            raise TopologyError(f"sp_shards: topology {self.topology.name} has no sequence parallelism")
        return RowShards(rows, self.topology.tp, "tp")

    def check_config(self, config) -> None:
        check_config(self.topology, config)

    def to_dict(self) -> dict:
        out = {
            "topology": self.topology.to_dict(), "rank": self.rank, "coords": dict(self.coords),
            "device": str(self.device), "backend": self.backend or "none (world size 1, no process group)",
            "transport": self.transport, "share_device": self.share_device, "timings": self.timing_label,
        }
        if self.dp > 1:
            out["data_parallel"] = {"dp": self.dp, "dp_rank": self.dp_rank}
        return out

    def __repr__(self) -> str:
        c = self.coords
        return f"Mesh({self.topology.name}, rank {self.rank} (cp {c['cp']}, tp {c['tp']}), {self.device})"

    @staticmethod
    def _check_dim(dim: str) -> None:
        if dim not in DIMS:
            raise TopologyError(f"mesh dimension {dim!r}: must be one of {DIMS}")


# --------------------------------------------------------------------------------------------------- building
def init_mesh(tp: int = 1, cp: int = 1, sp: bool = False, device=None, config=None,
              row_parallel: str = "auto", share_device: bool = False, dp: int = 1) -> Mesh:
    """Build this rank's `Mesh` (see the module docstring for the rules). `device`: None picks cuda:LOCAL_RANK when
    CUDA is available (cuda:0 with `share_device`), else cpu. `config`: an `H3Config` to check the degrees against
    (`parallelize` checks too). `row_parallel`: the row-parallel strategy ("auto", "k_chunks", "n_split"; see
    `shards.tree_strategy`). `share_device`: shared-device ranks over gloo, host-staged (module docstring). `dp`:
    data-parallel replicas of the (cp, tp) mesh (module docstring)."""
    problem = _topology_problem(tp, cp, sp, row_parallel, config)
    if not problem and not isinstance(share_device, bool):
        problem = f"share_device={share_device!r}: must be True or False"
    if not problem and (not isinstance(dp, int) or isinstance(dp, bool) or dp < 1):
        problem = f"dp={dp!r}: must be a positive integer"
    topology = Topology(tp, cp, sp, row_parallel) if not problem else None
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        if problem:
            raise TopologyError(problem)
        device, device_problem = _resolve_device(device, 0, share_device)
        problem = _world_problem(topology, 1, dp) or device_problem
        if problem:
            raise TopologyError(problem)
        return Mesh(topology, 0, device, share_device=share_device)

    rank = int(os.environ.get("RANK", "0")) if not dist.is_initialized() else dist.get_rank()
    device, device_problem = _resolve_device(device, rank, share_device is True)
    if not dist.is_initialized():
        backend = backend_for(device.type, share_device is True) if not device_problem else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method="env://")
    elif device.type == "cuda" and not device_problem:
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    asked = {"tp": tp, "cp": cp, "sp": sp, "row_parallel": row_parallel, "share_device": share_device}
    if dp != 1:
        asked["dp"] = dp
    report = {"asked": asked, "device": str(device), "problem": problem, "device_problem": device_problem}
    reports: list = [None] * world
    dist.all_gather_object(reports, report)
    problem = _decide(reports, topology, world, dist.get_backend(), dp if isinstance(dp, int) else 1)
    if problem:
        raise TopologyError(problem)
    from torch.distributed.device_mesh import init_device_mesh

    # DeviceMesh's device type names where its groups' collectives run; host-staged ranks move CPU tensors
    mesh_type = "cpu" if share_device else device.type
    if dp == 1:
        device_mesh, replica = init_device_mesh(mesh_type, (cp, tp), mesh_dim_names=DIMS), None
    else:
        device_mesh = init_device_mesh(mesh_type, (dp, cp, tp), mesh_dim_names=("dp", *DIMS))
        width = tp * cp
        replicas = [dist.new_group(list(range(d * width, (d + 1) * width))) for d in range(dp)]  # every rank, in order
        replica = replicas[rank // width]
    mesh = Mesh(topology, rank, device, device_mesh, dist.get_backend(), share_device=share_device, dp=dp,
                replica_group=replica)
    mesh.shared_memory = share_device and device.type == "cuda"  # IPC slots instead of host staging (mailbox.py)
    for dim in DIMS:  # the arithmetic layout above is DeviceMesh's row-major one; check it once
        ranks = dist.get_process_group_ranks(mesh.group(dim))
        if ranks != mesh.group_ranks(dim):
            raise TopologyError(f"DeviceMesh {dim} group {ranks} differs from the declared layout {mesh.group_ranks(dim)}")
    return mesh


def _topology_problem(tp, cp, sp, row_parallel, config) -> str:
    try:
        topology = check_degrees(tp, cp, sp, row_parallel)
        if config is not None:
            check_config(topology, config)
    except TopologyError as exc:
        return str(exc)
    return ""


def _world_problem(topology: Topology, world: int, dp: int = 1) -> str:
    if dp == 1 and world != topology.world_size:
        return f"world size {world} != tp * cp = {topology.tp} * {topology.cp} = {topology.world_size}"
    if world != dp * topology.world_size:
        return (f"world size {world} != dp * tp * cp = {dp} * {topology.tp} * {topology.cp} = "
                f"{dp * topology.world_size}")
    return ""


def backend_for(device_type: str, share_device: bool = False) -> str:
    """The process group backend a mesh of `device_type` ranks needs: gloo for cpu and for shared-device ranks."""
    return "gloo" if share_device else BACKENDS.get(device_type, "gloo")


def _resolve_device(device, rank: int, share_device: bool = False) -> tuple[torch.device, str]:
    """(device, problem): the device this rank asked for, and why it cannot serve (empty when it can)."""
    if device is None:
        if torch.cuda.is_available():
            if share_device:
                return torch.device("cuda", 0), ""
            local = int(os.environ.get("LOCAL_RANK", rank))
            return torch.device("cuda", local % torch.cuda.device_count()), ""
        return torch.device("cpu"), ""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        return torch.device("cpu"), f"device {device!r}: not a torch device"
    if device.type not in BACKENDS:
        return device, f"device {device}: must be cpu or cuda"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return device, f"device {device}: CUDA is not available on rank {rank}"
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            return device, f"device {device}: rank {rank} sees {torch.cuda.device_count()} CUDA device(s)"
    return device, ""


def _decide(reports: list[dict], topology: Topology | None, world: int, backend: str, dp: int = 1) -> str:
    """The one verdict every rank reaches from the same gathered reports ("" = accepted)."""
    asked = [r["asked"] for r in reports]
    if any(a != asked[0] for a in asked):
        shared = any(a.get("share_device") for a in asked)  # named only where a rank asks for it
        names = ", ".join(f"rank {i} asks " + " ".join(f"{k}={v}" for k, v in a.items()
                                                         if k != "share_device" or shared) for i, a in enumerate(asked))
        return f"ranks disagree on the topology: {names}"
    if reports[0]["problem"]:
        return reports[0]["problem"]
    problem = _world_problem(topology, world, dp)
    if problem:
        return problem
    devices = [r["device"] for r in reports]
    types = {torch.device(d).type for d in devices}
    if len(types) > 1:
        listed = ", ".join(f"rank {i} {d}" for i, d in enumerate(devices))
        return f"mixed devices across ranks ({listed}): every rank of a mesh must use one device type"
    for i, r in enumerate(reports):
        if r["device_problem"]:
            return f"rank {i}: {r['device_problem']}"
    share = bool(asked[0].get("share_device"))
    cuda = [d for d in devices if d.startswith("cuda")]
    if len(set(cuda)) != len(cuda) and not share:
        return (f"two ranks share one CUDA device ({', '.join(devices)}): one device per rank, or share_device=True "
                "(--share-device) for a bytes-only verification run")
    device_type = types.pop()
    needed = backend_for(device_type, share)
    if needed not in backend:
        why = "shared-device ranks need gloo" if share else "cpu needs gloo, cuda needs nccl"
        return f"process group backend {backend!r} cannot serve device type {device_type} ({why})"
    return ""
