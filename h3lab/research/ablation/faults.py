"""Fault injection for the ablation matrix's distributed probes: a wrapper around a placement, never a branch in it.

Contract
--------
`faulty(placement, Faults(...)) -> FaultyPlacement` takes the place of a model's `Placement` (built by
`h3lab.distributed.parallelize`, weights already sharded) on the same model and mesh
(`h3lab.distributed.wrap_placement`): the plain placement's module hooks come off, the wrapper's go on, and the wrapper
overrides only the placement's seams (`frame`, `scatter`, `attention`) for the rows that plant a fault:

  rotate_rows (A4)     CP rank i holds the rows (and their metadata) of shard (i + 1) % cp: the forward's ownership
                       check refuses the run on every rank before any work (`OwnershipError`, non-comparable).
  local_metadata (H17) the hidden rows are sharded, the per-row metadata is not: local row j reads global row j.
  ring_merge (A7)      block attention as a ring plan -- the keys in 2 * cp blocks (each CP shard halved), an online
                       softmax over them in float32 torch with the running output rounded to the activation dtype
                       after every block -- merged in "canonical" block order on every rank, or in "rank" order
                       (each rank starts from its own shard).

Under a fault, block 0 cuts the packed rows by the (faulty) frame instead of the logged `scatter_rows`. Faults need
cp > 1 (refused in one line otherwise). The trace's placement record carries `faults` (`describe`). Production code
never builds one: `h3lab.distributed` knows nothing of faults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ...distributed.apply import wrap_placement
from ...distributed.collectives import gather_rows
from ...distributed.errors import DistributedError
from ...distributed.placement import Frame, Placement

RING_MERGES = ("", "canonical", "rank")


@dataclass(frozen=True)
class Faults:
    """Deliberate plan faults (module docstring); all off by default."""

    rotate_rows: bool = False
    local_metadata: bool = False
    ring_merge: str = ""

    def __post_init__(self) -> None:
        if self.ring_merge not in RING_MERGES:
            raise DistributedError(f"ring_merge={self.ring_merge!r}: must be '', 'canonical' or 'rank'")

    def to_dict(self) -> dict:
        return {k: v for k, v in (("rotate_rows", self.rotate_rows), ("local_metadata", self.local_metadata),
                                  ("ring_merge", self.ring_merge)) if v}


class FaultyPlacement(Placement):
    """A `Placement` with planted faults (module docstring). Build with `faulty(placement, faults)`."""

    def __init__(self, placement: Placement, faults: Faults):
        super().__init__(placement.model, placement.mesh, placement.name, placement.split, placement.tp_plan,
                         placement.cp_plan)
        self.faults = faults

    def describe(self) -> dict:
        out = super().describe()
        if self.faults.to_dict():
            out["faults"] = self.faults.to_dict()
        return out

    def frame(self, seq_len: int) -> Frame:
        frame = super().frame(seq_len)
        if self.faults.rotate_rows:
            part = (frame.cp_part + 1) % self.cp
            frame = super().frame(seq_len, cp_part=part)
        if self.faults.local_metadata:
            frame = replace(frame, meta_cp=(0, frame.cp_hi - frame.cp_lo), meta_sp=(0, frame.hi - frame.lo))
        return frame

    def scatter(self, x: torch.Tensor, metadata, frame: Frame, point: str) -> torch.Tensor:
        return self.cut(x, "sp", 1, metadata=False).contiguous()

    def attention(self, ops, point: str, frame: Frame, q, k, v, key_order):
        if not self.faults.ring_merge:
            return super().attention(ops, point, frame, q, k, v, key_order)
        return self._ring_attention(ops, point, frame, q, k, v, key_order)

    def _ring_attention(self, ops, point: str, frame: Frame, q, k, v, key_order):
        """The A7 fault: a ring-attention KV-block plan (module docstring), computed in float32 torch."""
        if key_order is not None:
            raise DistributedError(f"{point}: the ring-merge fault supports canonical layouts only (key_order=None)")
        keys = gather_rows(k, self.mesh, frame.cp_rows, dim=1, point=point)
        values = gather_rows(v, self.mesh, frame.cp_rows, dim=1, point=point)
        blocks = []
        for part in range(self.cp):
            lo, hi = frame.cp_rows.bounds(part)
            mid = lo + (hi - lo + 1) // 2
            blocks += [(lo, mid), (mid, hi)]
        blocks = [b for b in blocks if b[1] > b[0]]
        if self.faults.ring_merge == "rank":
            start = 2 * frame.cp_part
            blocks = blocks[start:] + blocks[:start]
        qf = q.float().permute(0, 2, 1, 3)
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = lse = None
        for lo, hi in blocks:
            kf = keys[:, lo:hi].float().permute(0, 2, 1, 3)
            vf = values[:, lo:hi].float().permute(0, 2, 1, 3)
            s = qf @ kf.transpose(-1, -2) * scale
            block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
            block_out = torch.softmax(s, dim=-1) @ vf
            if out is None:
                out, lse = block_out.to(q.dtype), block_lse
                continue
            new = torch.logaddexp(lse, block_lse)
            out = (out.float() * torch.exp(lse - new) + block_out * torch.exp(block_lse - new)).to(q.dtype)
            lse = new
        ops.log_served("attention", point, {"kernel_id": f"fault:ring_merge[{self.faults.ring_merge}]", "tile": "",
                                            "acc_dtype": "float32"}, (q, k, v))
        return out.permute(0, 2, 1, 3).contiguous()

    def __repr__(self) -> str:
        return f"FaultyPlacement({self.name!r}, {self.mesh!r}, faults {self.faults.to_dict()})"


def faulty(placement: Placement, faults: Faults) -> FaultyPlacement:
    """`placement` (of a parallelized model) replaced on its model by a `FaultyPlacement` with `faults`. Refused (one
    line): faults on a topology without CP."""
    if not isinstance(placement, Placement):
        raise DistributedError(f"faulty: {type(placement).__name__} is not a Placement (parallelize the model first)")
    if faults.to_dict() and placement.cp == 1:
        raise DistributedError(f"faults {faults.to_dict()} need cp > 1 (topology {placement.topology.name})")
    return wrap_placement(placement, lambda p: FaultyPlacement(p, faults))
