"""Who owns what: the index arithmetic of sharding, with no communication and no arithmetic on values.

- `RowShards(seq_len, parts)`: packed rows cut into `parts` contiguous ranges in rank order. Sizes follow
  `torch.tensor_split`: the first `seq_len % parts` ranges hold one row more (19 rows over 3 ranks: 7, 6, 6). Uneven
  lengths are served this way, never by padding rows: no rank computes on a row that is not a real packed row, and
  the concatenation of the ranges in rank order is the packed order, so a gather in rank order restores every row's
  bytes and identity. `owner(row)` names the rank and local row that hold a logical packed row (first-drift across
  ranks). Refused: fewer rows than parts (a rank would own nothing; strict kernels refuse empty tensors).
- `split_grouped` / `cat_grouped`: channel sharding that preserves a grouped layout. An axis of size `groups * n` is
  read as `groups` consecutive blocks of `n` channels (the `[value; gate]` halves of `ff.net.0.proj`, the 6 x 3
  (tensor, modality) blocks of `adaln_proj.linear`, the `[shift | scale]` halves of `norm_out.linear`); part `i` of
  `parts` holds the i-th `n / parts` slice of every block, in block order. So a rank's shard has the same grouped
  layout over its channels (its `[value_r; gate_r]` feeds a local SwiGLU; its AdaLN rows view as six tensors x three
  modalities of `hidden / tp` channels), and `cat_grouped` of all parts in rank order is the original, byte for byte.
  `groups=1` is the plain contiguous split (heads, row-parallel K or N).
- `tree_strategy(tp, row_parallel="auto")`: how a row-parallel `linear_tree` layer is split at TP degree `tp` (see
  `collectives.py`): "auto" is "k_chunks" when the degree divides the 8-chunk tree (1, 2, 4, 8: each rank owns 8/tp
  whole consecutive chunks), else "n_split" (e.g. 7: a rank's K range [1024r, 1024(r+1)) of 7168 cuts the 896-wide
  chunks, so ranks split the output columns instead and every rank runs the whole K tree). "n_split" can be asked
  for at any degree; the weight layout follows the strategy, so it is part of the topology.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from h3kernels.gemm import TREE_CHUNKS

from .errors import DistributedError, TopologyError

STRATEGIES = ("k_chunks", "n_split")
ROW_PARALLEL = ("auto", *STRATEGIES)


def tree_strategy(tp: int, row_parallel: str = "auto") -> str:
    """The row-parallel strategy at TP degree `tp`: "auto" is "k_chunks" when `tp` divides the 8 chunks of the
    declared K tree, else "n_split"; "n_split" may be asked for at any degree (it moves fewer bytes, see
    `collectives.py`), "k_chunks" only where it exists."""
    if row_parallel not in ROW_PARALLEL:
        raise TopologyError(f"row_parallel={row_parallel!r}: must be one of {ROW_PARALLEL}")
    aligned = TREE_CHUNKS % tp == 0
    if row_parallel == "k_chunks" and not aligned:
        raise TopologyError(
            f"row_parallel='k_chunks' at tp={tp}: tp must divide the {TREE_CHUNKS} tree chunks (1, 2, 4, 8); "
            "use 'n_split' or 'auto'"
        )
    if row_parallel == "auto":
        return "k_chunks" if aligned else "n_split"
    return row_parallel


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TopologyError(f"{name}={value!r}: must be a positive integer")
    return value


@dataclass(frozen=True)
class RowShards:
    """`seq_len` packed rows in `parts` contiguous ranges, rank order; `axis` names the mesh dimension ("cp", or
    "tp" for sequence-parallel shards inside one CP shard) for messages and the trace."""

    seq_len: int
    parts: int
    axis: str = "cp"

    def __post_init__(self) -> None:
        _positive_int("seq_len", self.seq_len)
        _positive_int(self.axis, self.parts)
        if self.parts > self.seq_len:
            raise TopologyError(
                f"{self.axis}={self.parts} is larger than the {self.seq_len} rows to shard: every {self.axis} rank "
                "must own at least one row"
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        base, extra = divmod(self.seq_len, self.parts)
        return tuple(base + (i < extra) for i in range(self.parts))

    @property
    def offsets(self) -> tuple[int, ...]:
        out, start = [], 0
        for size in self.sizes:
            out.append(start)
            start += size
        return tuple(out)

    def bounds(self, part: int) -> tuple[int, int]:
        """[lo, hi) packed rows of `part`."""
        self._check_part(part)
        lo = self.offsets[part]
        return lo, lo + self.sizes[part]

    def owner(self, row: int) -> tuple[int, int]:
        """(part, local row) holding logical packed row `row`."""
        if not isinstance(row, int) or not 0 <= row < self.seq_len:
            raise DistributedError(f"row={row!r}: must be an integer in [0, {self.seq_len})")
        for part, (lo, size) in enumerate(zip(self.offsets, self.sizes)):
            if row < lo + size:
                return part, row - lo
        raise AssertionError("unreachable: the ranges cover [0, seq_len)")

    def take(self, t: torch.Tensor, part: int, dim: int) -> torch.Tensor:
        """The rows of `part` along `dim` of a tensor holding all `seq_len` rows there (a view)."""
        self._check_rows(t, dim)
        lo, hi = self.bounds(part)
        return t.narrow(dim, lo, hi - lo)

    def split(self, t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        """Every part's rows along `dim`, in rank order (views)."""
        self._check_rows(t, dim)
        return list(t.split(list(self.sizes), dim=dim))

    def to_dict(self) -> dict:
        return {"axis": self.axis, "seq_len": self.seq_len, "sizes": list(self.sizes)}

    def _check_part(self, part: int) -> None:
        if not isinstance(part, int) or not 0 <= part < self.parts:
            raise DistributedError(f"{self.axis} part {part!r}: must be an integer in [0, {self.parts})")

    def _check_rows(self, t: torch.Tensor, dim: int) -> None:
        if t.dim() == 0 or t.shape[dim] != self.seq_len:
            raise DistributedError(
                f"tensor of shape {tuple(t.shape)}: dim {dim} must hold the {self.seq_len} rows being sharded"
            )


def _grouped_width(name: str, size: int, groups: int, parts: int) -> int:
    if size % groups or (size // groups) % parts:
        raise DistributedError(
            f"{name}: axis of {size} channels is not {groups} group(s) of a multiple of {parts} channels"
        )
    return size // groups // parts


def split_grouped(t: torch.Tensor, dim: int, groups: int, parts: int, index: int, name: str = "tensor") -> torch.Tensor:
    """Part `index` of `parts` along `dim`, read as `groups` blocks: the index-th slice of every block, block order
    (a contiguous copy, shape[dim] = size / parts)."""
    dim = dim % t.dim()
    width = _grouped_width(name, t.shape[dim], groups, parts)
    blocks = t.unflatten(dim, (groups, parts, width))
    return blocks.select(dim + 1, index).flatten(dim, dim + 1).contiguous()


def cat_grouped(pieces: Sequence[torch.Tensor], dim: int, groups: int, name: str = "tensor") -> torch.Tensor:
    """Inverse of `split_grouped` over all parts in rank order: block g of the result is the rank-ordered
    concatenation of every piece's block g."""
    if not pieces:
        raise DistributedError(f"{name}: nothing to concatenate")
    dim = dim % pieces[0].dim()
    shapes = {tuple(p.shape) for p in pieces}
    if len(shapes) != 1:
        raise DistributedError(f"{name}: pieces of different shapes {sorted(shapes)}")
    width = _grouped_width(name, pieces[0].shape[dim], groups, 1)
    blocks = torch.stack([p.unflatten(dim, (groups, width)) for p in pieces], dim=dim + 1)
    return blocks.flatten(dim, dim + 2)
