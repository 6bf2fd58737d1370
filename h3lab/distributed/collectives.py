"""Strict collectives: data movement over torch.distributed plus the declared arithmetic, never an unordered sum.

Every collective here only *moves* bytes (all_gather, all_to_all_single) — no NCCL/gloo all_reduce or
reduce_scatter, whose summation order belongs to the library and the topology — and any arithmetic on the moved
bytes is a strict `h3kernels` kernel in a declared order. Each call appends a `CollectiveRecord` (name, algorithm,
mesh dimension, group ranks, hook point, shapes, dtypes, details) to the current `CollectiveLog`
(`begin_log(mesh)` starts one per forward; `last_log()` reads it back; `to_dict()` is what the runtime trace will
carry next to its op records). A mesh dimension of size 1 moves nothing and gives the same bytes through the same
code (world size 1 is the one-GPU path).

(a) `row_parallel_tree(x, weight, bias, mesh)`: the row-parallel `linear_tree` layers (attention `to_out.0`, FFN
    `ff.net.2`), byte-equal to one-process `linear_tree` on the full K for every TP degree, by the topology's
    strategy (`shards.tree_strategy`; tp 1 is one `linear_tree` call whatever the strategy):
    - "k_chunks" (auto at tp 2, 4, 8): rank r holds K columns [rK/tp, (r+1)K/tp) = the 8/tp consecutive chunks of
      the declared tree, computes their float32 subtree with `tree_partial`, the partials are all-gathered in rank
      order and `tree_combine` finishes ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)) on every rank; bias
      (replicated) added once in float32, one cast. Algorithm "all_gather + tree".
    - "n_split" (auto at any other tp, e.g. 7 on K = 7168, where a rank's 1024-wide K range cuts the 896-wide chunks;
      allowed at every tp): the K-sharded input is all-gathered to the full K, rank r runs the whole-K `linear_tree`
      for output columns [rN/tp, (r+1)N/tp) (weight and bias sharded by output row), and the column blocks are
      all-gathered. An output element's bytes do not depend on which columns share its tile (the kernel's
      contract), so this is TP1's bytes. Algorithm "all_gather(K) + linear_tree(N slice) + all_gather(N)".
    - Cost per packed row and layer, bytes each rank receives: k_chunks (tp-1) * N * 4 (float32 partials); n_split
      (tp-1)/tp * (K + N) * 2 (bf16 activations); a plain bf16 ring all-reduce (not strict) 2 (tp-1)/tp * N * 2.
      O-projection (K 7168, N 5376): k_chunks tp 8 150.5 KB; n_split tp 7 21.5 KB, tp 8 22.0 KB; all-reduce tp 8
      18.8 KB. FFN down (K 14336): n_split tp 8 34.5 KB. n_split also holds a transient full-K activation
      (B, S, K) per rank and issues two collectives instead of one; compute and weight memory are split the same.
    - `out_rows` (sequence parallel): the result is only this rank's rows of `out_rows` (a RowShards over the TP group):
      the partials (k_chunks) or column blocks (n_split) are exchanged by all_to_all instead of all-gathered, so each
      rank receives 1/tp of those bytes; the same tree or concatenation follows. Algorithms "all_to_all + tree" and
      "all_gather(K) + linear_tree(N slice) + all_to_all(rows)".
(b) Ulysses: `rows_to_heads` (B, S_r, H, D) row shard -> (B, S, H/cp, D) head shard, and `heads_to_rows` back, over
    the CP group with `all_to_all_single` and uneven split sizes (the RowShards sizes), so a packed length not divisible
    by cp needs no padding row anywhere: attention sees exactly the S real rows in packed order. CP rank i receives
    heads [i*H/cp, (i+1)*H/cp) of its TP rank's heads. `ulysses_attention` wraps an attention call in both exchanges;
    `key_order` (canonical key order over the whole document) is passed unchanged, because every rank attends over
    all S rows — it is document metadata, replicated, never sharded. Strict attention is one program per (batch,
    head), so a head's bytes do not depend on which other heads share the call: byte-equal to one process.
(c) `scatter_rows` co-shards a replicated packed tensor and every per-row metadata tensor with one RowShards (local
    slices, no communication: each rank already holds the replicated inputs), refusing document-level names
    (`key_order`, the stream index tensors, the timestep table); `gather_rows` restores all rows on every rank in rank
    order (all_gather; gloo needs equal sizes, so each shard is zero-padded to the largest for transport only and the
    pad is dropped before any use).
(d) `gather_columns(y, mesh, groups)`: all-gather of column-parallel outputs over the TP group, reassembled with the
    grouped layout of `shards.cat_grouped` (groups 1: heads or plain columns; 2: `[value; gate]` of `ff.net.0.proj`
    or `[shift | scale]` of `norm_out.linear`; 18: the six tensors x three modalities of `adaln_proj.linear`).

Timing (`use_timing()`, the benchmarks): a log begun inside it times every transport call (CUDA events on the
current stream around the NCCL call, so waiting for the slowest rank counts; perf_counter on gloo) and
`log.transport_seconds()` sums them after the forward, separating communication from compute.

Shared-device ranks (`init_mesh(share_device=True)`, gloo serving CUDA tensors): every transport call copies its
send buffer to the host, runs the gloo call on host tensors and copies the result back (`Mesh.staged`); bytes are
moved, never changed, and the record's `transport` says "gloo (host-staged cuda)". Timed on the host clock. With
`Mesh.shared_memory` (the default for shared-device CUDA ranks) the bytes go through slots every rank maps instead
(`mailbox.py`: CUDA IPC, gloo moves only a few integers per call; transport "cuda ipc (shared device)").

Forward only: the collectives refuse inputs that require grad while grad is enabled. Their declared backward lives in
`autograd.py` / `tp_autograd.py` (torch.autograd.Functions calling these functions: CP and TP training). Inputs are expected on the mesh's device; gloo moves CPU tensors, NCCL CUDA tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from h3kernels import attention as strict_attention
from h3kernels import gemm

from ..execution import context
from .errors import DistributedError
from .mailbox import mailbox
from .mesh import Mesh
from .shards import RowShards, cat_grouped

# Per-row tensors `scatter_rows` knows, with their row axis; document-level ones it refuses to shard.
ROW_DIMS = {
    "hidden_states": 1, "position_ids": 0, "token_tags": 0, "timestep_indices": 0, "adaln_indices": 0,
    "rope_cos": 0, "rope_sin": 0,
}
DOCUMENT_METADATA = ("key_order", "video_indices", "audio_indices", "text_indices", "timestep")
TREE_ORDER = "((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))"


# ------------------------------------------------------------------------------------------------------ the log
@dataclass
class CollectiveRecord:
    name: str
    algorithm: str
    dim: str  # mesh dimension: "tp" | "cp"
    group_ranks: list[int]
    transport: str  # "nccl" | "gloo" | "gloo (host-staged cuda)" | "cuda ipc (shared device)" | "none" (group of one)
    point: str
    shapes: list
    out_shapes: list
    dtypes: list
    detail: dict = field(default_factory=dict)
    fallback: str = ""  # strict collectives never fall back; kept for the trace schema


@dataclass
class CollectiveLog:
    mesh: dict
    records: list[CollectiveRecord] = field(default_factory=list)
    timed: bool = False
    transports: list = field(default_factory=list)  # timed: (start, end) CUDA events or perf_counter floats
    control_seconds: float = 0.0  # timed: host time of the placement's per-forward agreement exchange

    def transport_seconds(self) -> float:
        """Seconds spent in transport calls (synchronises CUDA events first); 0.0 when not timed."""
        total = 0.0
        for start, end in self.transports:
            if isinstance(start, float):
                total += end - start
            else:
                end.synchronize()
                total += start.elapsed_time(end) / 1e3
        return total

    def summary(self) -> dict[str, dict[str, int]]:
        """name -> {algorithm: count}."""
        out: dict[str, dict[str, int]] = {}
        for (name, algorithm), count in Counter((r.name, r.algorithm) for r in self.records).items():
            out.setdefault(name, {})[algorithm] = count
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "summary": self.summary(), "records": [asdict(r) for r in self.records]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


_log: contextvars.ContextVar[CollectiveLog | None] = contextvars.ContextVar("h3lab_collective_log", default=None)


@contextlib.contextmanager
def use_timing(on: bool = True) -> Iterator[None]:
    """Logs begun inside time their transport calls (module docstring)."""
    with context.use(collective_timing=on):  # a field of the one execution context
        yield


def begin_log(mesh: Mesh) -> CollectiveLog:
    """Start the collective log of one forward on this rank; it is what `last_log()` returns until the next."""
    log = CollectiveLog(mesh=mesh.to_dict(), timed=context.current().collective_timing)
    _log.set(log)
    return log


@contextlib.contextmanager
def _timed(device: torch.device) -> Iterator[None]:
    log = _log.get()
    if log is None or not log.timed:
        yield
        return
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        log.transports.append((start, end))
        return
    t0 = time.perf_counter()
    yield
    log.transports.append((t0, time.perf_counter()))


def last_log() -> CollectiveLog | None:
    return _log.get()


def _record(mesh: Mesh, name: str, algorithm: str, dim: str, point: str, inputs, outputs, **detail) -> None:
    log = _log.get()
    if log is None:
        return
    inputs = [t for t in inputs if t is not None]
    log.records.append(CollectiveRecord(
        name=name, algorithm=algorithm, dim=dim, group_ranks=mesh.group_ranks(dim),
        transport=mesh.transport if mesh.size(dim) > 1 else "none", point=point,
        shapes=[list(t.shape) for t in inputs], out_shapes=[list(t.shape) for t in outputs],
        dtypes=[str(t.dtype).replace("torch.", "") for t in inputs], detail=detail,
    ))


# ------------------------------------------------------------------------------------------------- transport
def _forward_only(name: str, *tensors: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise DistributedError(
            f"{name}: an input requires grad; strict collectives are forward-only (run under torch.no_grad())"
        )


def _all_gather(t: torch.Tensor, mesh: Mesh, dim: str) -> list[torch.Tensor]:
    """Every rank's `t` (equal shapes) along mesh dimension `dim`, in group-rank order."""
    if mesh.size(dim) == 1:
        return [t]
    if mesh.shared_memory:  # shared-device ranks: peers' slots read in place (mailbox.py)
        with _timed(torch.device("cpu")):
            return mailbox(mesh, dim).all_gather(t)
    device = t.device
    with _timed(_clock(mesh, device)):
        t = _to_transport(t.contiguous(), mesh)
        out = [torch.empty_like(t) for _ in range(mesh.size(dim))]
        dist.all_gather(out, t, group=mesh.group(dim))
        out = [_from_transport(o, mesh, device) for o in out]
    return out


def _all_to_all(send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], mesh: Mesh, dim: str) -> torch.Tensor:
    """all_to_all_single along axis 0: block i of `send` (send_sizes[i] rows) goes to group rank i; the result holds
    the block from rank j at position j (recv_sizes[j] rows)."""
    if mesh.size(dim) == 1:
        return send
    if mesh.shared_memory:
        with _timed(torch.device("cpu")):
            return mailbox(mesh, dim).all_to_all(send, send_sizes, recv_sizes)
    device = send.device
    with _timed(_clock(mesh, device)):
        send = _to_transport(send.contiguous(), mesh)
        recv = send.new_empty((sum(recv_sizes), *send.shape[1:]))
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                               group=mesh.group(dim))
        recv = _from_transport(recv, mesh, device)
    return recv


def _to_transport(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The tensor the process group moves: a host copy on shared-device (host-staged) ranks, else `t` itself."""
    return t.cpu() if mesh.staged else t


def _from_transport(t: torch.Tensor, mesh: Mesh, device: torch.device) -> torch.Tensor:
    """Back on the rank's device after a host-staged call (a byte copy), else `t` itself."""
    return t.to(device) if mesh.staged else t


def _clock(mesh: Mesh, device: torch.device) -> torch.device:
    """Host-staged calls are timed on the host clock (the copies block), NCCL calls with CUDA events."""
    return torch.device("cpu") if mesh.staged else device


def _my_rows(rows: RowShards, mesh: Mesh, t: torch.Tensor, row_dim: int, name: str) -> int:
    if rows.parts != mesh.size(rows.axis):
        raise DistributedError(f"{name}: {rows.parts} row shards for a {rows.axis} group of {mesh.size(rows.axis)}")
    mine = rows.sizes[mesh.local_rank(rows.axis)]
    if t.dim() <= row_dim or t.shape[row_dim] != mine:
        raise DistributedError(
            f"{name}: tensor of shape {tuple(t.shape)} must hold this {rows.axis} rank's {mine} rows on dim {row_dim}"
        )
    return mine


# ------------------------------------------------------------------------------------- (a) row-parallel tree
def row_parallel_tree(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mesh: Mesh,
                      out_rows: RowShards | None = None, point: str = "") -> torch.Tensor:
    """Row-parallel `linear_tree` over the TP group, byte-equal to `linear_tree(x_full, weight_full, bias)`.
    x (..., K/tp): this rank's K columns. "k_chunks": weight (N, K/tp), bias (N,) replicated. "n_split": weight
    (N/tp, K), bias (N/tp,). Returns (..., N) on every rank, or with `out_rows` (B, rows of this rank, N)."""
    name = "row_parallel_tree"
    _forward_only(name, x, weight, bias)
    tp, strategy = mesh.size("tp"), mesh.topology.strategy
    k_rank = x.shape[-1]
    k_weight = weight.shape[-1] if weight.dim() == 2 else -1
    if k_weight != (k_rank if strategy == "k_chunks" else k_rank * tp):
        want = f"(N, {k_rank})" if strategy == "k_chunks" else f"(N/{tp}, {k_rank * tp})"
        raise DistributedError(
            f"{name}: weight of shape {tuple(weight.shape)} for x (..., {k_rank}) at tp={tp} ({strategy}): must be {want}"
        )
    if out_rows is not None:
        rows = x.shape[1] if x.dim() == 3 else None
        if rows is None or (out_rows.axis, out_rows.parts, out_rows.seq_len) != ("tp", tp, rows):
            raise DistributedError(
                f"{name}: out_rows {out_rows.to_dict()} must split the rows of x {tuple(x.shape)} (B, S, K/tp) "
                f"over the tp group of {tp}"
            )
    if tp == 1:  # the whole tree in one kernel: the one-GPU path is plain strict `linear_tree`, bytes and time
        y = gemm.linear_tree(x, weight, bias)
        algorithm = "linear_tree (tp 1, nothing moved)"
        detail = {"strategy": strategy, "tree": TREE_ORDER}
    elif strategy == "k_chunks":
        partial = gemm.tree_partial(x, weight, gemm.TREE_CHUNKS // tp)  # (..., N) float32, this rank's subtree
        if out_rows is None:
            parts = _all_gather(partial, mesh, "tp")
            algorithm = "all_gather + tree"
        else:
            parts = _exchange_rows(partial, out_rows, mesh)
            algorithm = "all_to_all + tree"
        y = gemm.tree_combine(parts, bias, x.dtype)
        detail = {"strategy": strategy, "chunks_per_rank": gemm.TREE_CHUNKS // tp, "tree": TREE_ORDER,
                  "partial_dtype": "float32"}
    else:
        x_full = torch.cat(_all_gather(x, mesh, "tp"), dim=-1)  # (..., K) in rank order = K order
        y_cols = gemm.linear_tree(x_full, weight, bias)  # (..., N/tp): whole-K tree for this rank's columns
        if out_rows is None:
            y = torch.cat(_all_gather(y_cols, mesh, "tp"), dim=-1)
            algorithm = "all_gather(K) + linear_tree(N slice) + all_gather(N)"
        else:
            y = torch.cat(_exchange_rows(y_cols, out_rows, mesh), dim=-1)
            algorithm = "all_gather(K) + linear_tree(N slice) + all_to_all(rows)"
        detail = {"strategy": strategy, "columns_per_rank": weight.shape[0], "tree": TREE_ORDER}
    if out_rows is not None:
        detail["out_rows"] = out_rows.to_dict()
    _record(mesh, name, algorithm, "tp", point, (x, weight, bias), (y,), **detail)
    return y


def _exchange_rows(t: torch.Tensor, rows: RowShards, mesh: Mesh) -> list[torch.Tensor]:
    """t (B, S, C) full rows on every TP rank -> the TP ranks' versions of this rank's rows, (B, mine, C) each, in
    group-rank order (all_to_all with uneven split sizes)."""
    tp = mesh.size("tp")
    mine = rows.sizes[mesh.local_rank("tp")]
    recv = _all_to_all(t.transpose(0, 1), list(rows.sizes), [mine] * tp, mesh, "tp")  # (tp * mine, B, C)
    # contiguous (B, mine, C) blocks: with B > 1 the transposed views are strided, and the strict kernels
    # downstream (gated residual) take row-major tensors
    return [block.transpose(0, 1).contiguous() for block in recv.unflatten(0, (tp, mine)).unbind(0)]


# ------------------------------------------------------------------------------------------------- (b) Ulysses
def rows_to_heads(x: torch.Tensor, mesh: Mesh, rows: RowShards, point: str = "") -> torch.Tensor:
    """(B, S_r, H, D) this CP rank's rows, all its heads -> (B, S, H/cp, D) all rows, heads [i*H/cp, (i+1)*H/cp)."""
    name = "rows_to_heads"
    _forward_only(name, x)
    cp = mesh.size("cp")
    if rows.axis != "cp":
        raise DistributedError(f"{name}: rows {rows.to_dict()} must be the cp group's shards")
    mine = _my_rows(rows, mesh, x, 1, name)
    if x.dim() != 4 or x.shape[2] % cp:
        raise DistributedError(f"{name}: x of shape {tuple(x.shape)} must be (B, S_r, H, D) with H divisible by cp={cp}")
    B, _, H, D = x.shape
    send = x.unflatten(2, (cp, H // cp)).permute(2, 1, 0, 3, 4).reshape(cp * mine, B, H // cp, D)
    recv = _all_to_all(send, [mine] * cp, list(rows.sizes), mesh, "cp")  # (S, B, H/cp, D), rows in packed order
    out = recv.permute(1, 0, 2, 3).contiguous()
    _record(mesh, name, "all_to_all(uneven rows)", "cp", point, (x,), (out,),
            send_rows=[mine] * cp, recv_rows=list(rows.sizes))
    return out


def heads_to_rows(y: torch.Tensor, mesh: Mesh, rows: RowShards, point: str = "") -> torch.Tensor:
    """(B, S, H/cp, D) all rows, this CP rank's heads -> (B, S_r, H, D) this rank's rows, all heads."""
    name = "heads_to_rows"
    _forward_only(name, y)
    cp = mesh.size("cp")
    if y.dim() != 4 or y.shape[1] != rows.seq_len:
        raise DistributedError(f"{name}: y of shape {tuple(y.shape)} must be (B, {rows.seq_len}, H/cp, D)")
    if rows.parts != cp or rows.axis != "cp":
        raise DistributedError(f"{name}: rows {rows.to_dict()} must be the cp group's {cp} shards")
    B, _, Hl, D = y.shape
    mine = rows.sizes[mesh.local_rank("cp")]
    recv = _all_to_all(y.permute(1, 0, 2, 3), list(rows.sizes), [mine] * cp, mesh, "cp")  # (cp * mine, B, Hl, D)
    out = recv.unflatten(0, (cp, mine)).permute(2, 1, 0, 3, 4).reshape(B, mine, cp * Hl, D)
    _record(mesh, name, "all_to_all(uneven rows)", "cp", point, (y,), (out,),
            send_rows=list(rows.sizes), recv_rows=[mine] * cp)
    return out


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_order: torch.Tensor | None, mesh: Mesh,
                      rows: RowShards, attention: Callable[..., torch.Tensor] | None = None,
                      point: str = "") -> torch.Tensor:
    """Attention over the whole packed document from row shards: (B, S_r, H, D) q, k, v -> (B, S_r, H, D).
    `attention(q, k, v, key_order)` runs on (B, S, H/cp, D) (default: the strict kernel; the wiring passes the op
    table's); `key_order` is the document's canonical key order, the same on every rank."""
    attention = strict_attention.attention if attention is None else attention
    qh, kh, vh = (rows_to_heads(t, mesh, rows, point=point) for t in (q, k, v))
    return heads_to_rows(attention(qh, kh, vh, key_order), mesh, rows, point=point)


# ------------------------------------------------------------------------------------- (c) packed rows and metadata
def scatter_rows(tensors: Mapping[str, torch.Tensor], mesh: Mesh, rows: RowShards,
                 dims: Mapping[str, int] | None = None, point: str = "") -> dict[str, torch.Tensor]:
    """This rank's rows of every named tensor, all cut by the same `rows` (co-sharding): hidden states and per-row
    metadata (positions, tags, timestep indices, AdaLN indices, RoPE tables). Every rank holds the replicated
    tensors, so this is a local slice (views). `dims` gives the row axis of names outside `ROW_DIMS`."""
    name = "scatter_rows"
    dims = {**ROW_DIMS, **(dims or {})}
    if rows.parts != mesh.size(rows.axis):
        raise DistributedError(f"{name}: {rows.parts} row shards for a {rows.axis} group of {mesh.size(rows.axis)}")
    part = mesh.local_rank(rows.axis)
    out = {}
    for key, t in tensors.items():
        if key in DOCUMENT_METADATA:
            raise DistributedError(
                f"{name}: {key!r} is document metadata (attention and row selection see every row); it stays "
                "replicated with its global values, never sharded"
            )
        if key not in dims:
            raise DistributedError(f"{name}: {key!r} has no declared row axis; pass dims={{{key!r}: axis}}")
        out[key] = rows.take(t, part, dims[key])
    lo, hi = rows.bounds(part)
    _record(mesh, name, "replicated + local slice", rows.axis, point, list(tensors.values()), list(out.values()),
            names=list(tensors), rows=[lo, hi], shards=rows.to_dict())
    return out


def gather_rows(x: torch.Tensor, mesh: Mesh, rows: RowShards, dim: int = 1, point: str = "") -> torch.Tensor:
    """All `rows.seq_len` rows on every rank of the `rows.axis` group, in rank order (= packed order)."""
    name = "gather_rows"
    _forward_only(name, x)
    dim = dim % max(x.dim(), 1)
    mine = _my_rows(rows, mesh, x, dim, name)
    widest = max(rows.sizes)
    if widest > mine:  # transport padding only: the pad never reaches arithmetic
        pad_shape = list(x.shape)
        pad_shape[dim] = widest - mine
        x_t = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    else:
        x_t = x
    pieces = _all_gather(x_t, mesh, rows.axis)
    out = torch.cat([p.narrow(dim, 0, size) for p, size in zip(pieces, rows.sizes)], dim=dim)
    _record(mesh, name, "all_gather (rows zero-padded to the largest shard for transport, pad dropped)", rows.axis,
            point, (x,), (out,), shards=rows.to_dict())
    return out


# ---------------------------------------------------------------------------------------- (d) column gathers
def gather_columns(y: torch.Tensor, mesh: Mesh, groups: int = 1, point: str = "") -> torch.Tensor:
    """(..., C/tp) this rank's grouped column shard -> (..., C) on every TP rank (see `shards.cat_grouped`)."""
    name = "gather_columns"
    _forward_only(name, y)
    out = cat_grouped(_all_gather(y, mesh, "tp"), -1, groups, name=name)
    _record(mesh, name, "all_gather + grouped concat", "tp", point, (y,), (out,), groups=groups)
    return out
