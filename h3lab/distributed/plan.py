"""The declarative parallel plan of `H3Transformer`, at Diffusers' module paths, and the weight sharding it implies.

`TP_PLAN` maps a module path pattern (`*` = one ModuleList index) to a `PlanEntry(style, reason)`; every parameter
of the model (`<module path>.weight` / `.bias`) matches exactly one entry, or sharding refuses it. Styles (W is a
`Linear` weight (out, in); tp the TP degree, r the rank):

  colwise_heads   W rows split in tp contiguous blocks: rank r owns heads [rH/tp, (r+1)H/tp) of q, k or v. The heads
                  stay apart until the O-projection (per-head Q/K norm, RoPE per head channel, attention per
                  (batch, head)), so the output stays sharded.
  colwise_swiglu  W rows are [value (ffn); gate (ffn)]; rank r owns value slice r and gate slice r, stored as
                  [value_r; gate_r] (`split_grouped`, 2 groups), so the op table's `swiglu` runs locally on matching
                  channels and its output is FFN channels [r*ffn/tp, (r+1)*ffn/tp).
  colwise_adaln   W rows are G blocks of `hidden` channels (adaln_proj.linear: G = 6 tensors x 3 modalities = 18, in
                  the table order [m0: shift_msa ... gate_mlp | m1: ... | m2: ...]; norm_out.linear: G = 2,
                  [shift | scale]); rank r owns channels [r*hidden/tp, (r+1)*hidden/tp) of every block, weight and
                  bias, so its output is the same table layout over its channels; `gather_columns(groups=G)`
                  restores the full table byte for byte.
  rowwise_tree    the `linear_tree` layers, by the topology's `row_parallel` strategy (`shards.tree_strategy`).
                  "k_chunks" (auto for tp in {1, 2, 4, 8}): W columns split in tp contiguous blocks (8/tp tree
                  chunks each), bias replicated. "n_split" (auto for other tp, e.g. 7): W rows (and bias) split in
                  tp contiguous blocks. `collectives.row_parallel_tree` gives the one-process bytes either way.
  replicated      every rank holds the whole tensor.

A peft-wrapped layer (`training.lora`) keeps its module's entry: `<module>.base_layer.weight` is read as
`<module>.weight`; its LoRA factors (`<module>.lora_A.<adapter>.weight`, `is_lora_factor`) are replicated whole on
every rank, and the placement serves their TP arithmetic (`tp_autograd.py`).

Every sharding function takes `row_parallel` ("auto" by default) and must be given the mesh's choice.
`shard_state_dict(sd, config, tp, rank)` slices a Diffusers-keyed state dict (a checkpoint, or a built model's
`state_dict()`) for one rank; `unshard_state_dict([sd_0, ..., sd_tp-1], config)` reassembles the original bytes and
refuses replicated tensors that differ between ranks; `shard_parameters_(model, config, tp, rank)` replaces a built
model's parameter data in place (parameter objects kept, buffers untouched).

`CP_PLAN` declares, the way Diffusers' `_cp_plan` does, where context (and sequence) parallelism cuts and restores
the packed rows -- `StreamSplit` (the hidden rows entering the block stack), `RowSplit` (per-row metadata cut with
them), `RowGather` (rows gathered back, by SP or by SP then CP) -- and where the Ulysses exchange surrounds attention
(`HeadExchange`). Both plans are data: `apply.apply_plan(model, mesh, TP_PLAN, CP_PLAN)` interprets them (TP: the
weights sharded, a `colwise_adaln` output gathered by `gather_columns`, `rowwise_tree` served as the row-parallel
tree; CP: one pre-hook / forward hook per matched module applying its entries in order) and `apply.remove_plan`
undoes it; nothing else restates them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from .errors import DistributedError
from .mesh import Topology, check_config
from .shards import cat_grouped, split_grouped, tree_strategy

STYLES = ("colwise_heads", "colwise_swiglu", "colwise_adaln", "rowwise_tree", "replicated")


@dataclass(frozen=True)
class PlanEntry:
    style: str
    reason: str

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise DistributedError(f"plan style {self.style!r}: must be one of {STYLES}")


def _block_plan(prefix: str, adaln: bool) -> dict[str, PlanEntry]:
    heads = "whole heads per rank: per-head Q/K norm, RoPE and attention never mix heads"
    out = {
        f"{prefix}.norm1": PlanEntry("replicated", "RMSNorm over the full hidden row (the residual stream is replicated)"),
        f"{prefix}.norm2": PlanEntry("replicated", "RMSNorm over the full hidden row (the residual stream is replicated)"),
        f"{prefix}.attn.to_q": PlanEntry("colwise_heads", heads),
        f"{prefix}.attn.to_k": PlanEntry("colwise_heads", heads),
        f"{prefix}.attn.to_v": PlanEntry("colwise_heads", heads),
        f"{prefix}.attn.norm_q": PlanEntry("replicated", "per-head RMSNorm: one (head_dim,) weight shared by every head, local"),
        f"{prefix}.attn.norm_k": PlanEntry("replicated", "per-head RMSNorm: one (head_dim,) weight shared by every head, local"),
        f"{prefix}.attn.to_out.0": PlanEntry("rowwise_tree", "K = heads x head_dim arrives head-sharded; fixed 8-chunk tree"),
        f"{prefix}.ff.net.0.proj": PlanEntry("colwise_swiglu", "[value; gate] split so each rank holds matching halves"),
        f"{prefix}.ff.net.2": PlanEntry("rowwise_tree", "K = ffn channels arrive sharded from the local SwiGLU; 8-chunk tree"),
    }
    if adaln:
        out[f"{prefix}.adaln_proj.linear"] = PlanEntry(
            "colwise_adaln", "2688 -> 96768 (the largest per-block weight): hidden channels of all 6 x 3 table blocks")
    return out


_SMALL = "float32 or narrow, outside the block stack: cheap to replicate, and its bytes never depend on tp"
TP_PLAN: dict[str, PlanEntry] = {
    "proj_in": PlanEntry("replicated", _SMALL),
    "audio_proj_in": PlanEntry("replicated", _SMALL),
    "context_embedder": PlanEntry("replicated", "text rows only, one projection before the refiner"),
    "time_embedder.linear_1": PlanEntry("replicated", _SMALL),
    "time_embedder.linear_2": PlanEntry("replicated", _SMALL),
    **_block_plan("token_refiner.refiner_blocks.*", adaln=False),
    "token_refiner.final_norm": PlanEntry("replicated", "RMSNorm over full hidden text rows"),
    **_block_plan("transformer_blocks.*", adaln=True),
    "norm_out.norm": PlanEntry("replicated", "RMSNorm over the full hidden row"),
    "norm_out.linear": PlanEntry("colwise_adaln", "[shift | scale] per timestep: hidden channels of both halves"),
    "proj_out": PlanEntry("replicated", _SMALL),
    "audio_proj_out": PlanEntry("replicated", _SMALL),
}


# ---------------------------------------------------------------------------------------------- CP row plan
ROW_LEVELS = ("sp", "cp")


@dataclass(frozen=True)
class RowSplit:
    """Cut per-row metadata `what` -- a forward argument by name (pre-hook), or output item `int` (forward hook) -- to
    this rank's rows along `dim`: `rows` "sp" (the rank's residual-stream rows) or "cp" (its CP shard)."""

    what: str | int
    dim: int
    rows: str
    reason: str

    def __post_init__(self) -> None:
        if self.rows not in ROW_LEVELS:
            raise DistributedError(f"RowSplit rows={self.rows!r}: must be one of {ROW_LEVELS}")


@dataclass(frozen=True)
class StreamSplit:
    """The packed hidden rows, argument `what` along dim 1: where they arrive whole (all S rows) they are cut to the
    rank's residual-stream rows by one logged `scatter_rows` together with their per-row metadata argument `with_`;
    then the module must hold exactly the rank's stream rows (else a one-line error naming them)."""

    what: str
    with_: str
    reason: str


@dataclass(frozen=True)
class RowGather:
    """All-gather rows along `dim` in rank order (= packed order): `what` the output ("output", forward hook) or
    positional input `int` (pre-hook); `to` "cp" (the SP rows of the rank's CP shard: only under SP) or "all" (SP
    then CP: every packed row)."""

    what: str | int
    dim: int
    to: str
    reason: str

    def __post_init__(self) -> None:
        if self.to not in ("cp", "all"):
            raise DistributedError(f"RowGather to={self.to!r}: must be 'cp' or 'all'")


@dataclass(frozen=True)
class HeadExchange:
    """Ulysses all-to-all (rows -> heads) around the attention op of this module, and back."""

    reason: str


CP_ENTRIES = (RowSplit, StreamSplit, RowGather, HeadExchange)

# Applied (with TP_PLAN) by `apply.apply_plan`, one module hook per matched module, entries in this order. A new
# entry is one declaration here, e.g. `"norm_out": (RowSplit("timestep_indices", 0, "sp", "..."),)`.
CP_PLAN: dict[str, tuple] = {
    "rope": (
        RowSplit(0, 0, "cp", "RoPE tables (cos) are per packed row; built over all rows, then co-sharded at the CP "
                             "level (q/k hold the CP shard's rows)"),
        RowSplit(1, 0, "cp", "RoPE tables (sin) are per packed row; built over all rows, then co-sharded"),
    ),
    "transformer_blocks.*": (
        StreamSplit("x", "adaln_indices", "rows are cut after `pack`, at block 0 (the input projections, the refiner "
                                          "over the text rows and the timestep MLP run replicated)"),
        RowSplit("adaln_indices", 0, "sp", "each row's AdaLN table row travels with it; the table is replicated"),
    ),
    "transformer_blocks.*.attn": (
        RowGather(0, 1, "cp", "SP: the stream rows gathered once for the column-parallel q / k / v"),
        HeadExchange("all rows, H/cp heads per rank; key_order stays global (every rank attends over the document)"),
    ),
    "transformer_blocks.*.ff": (
        RowGather(0, 1, "cp", "SP: the stream rows gathered once for the column-parallel up-projection"),
    ),
    "norm_out": (
        RowSplit("timestep_indices", 0, "sp", "the final modulation reads the per-timestep table row of each local "
                                              "row"),
    ),
    "proj_out": (RowGather("output", 1, "all", "all packed rows back before select_rows with the global "
                                               "video_indices"),),
    "audio_proj_out": (RowGather("output", 1, "all", "all packed rows back before select_rows with the global "
                                                     "audio_indices"),),
}


# ----------------------------------------------------------------------------------------------- matching
def _regex(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+") + r"\.[^.]+")


def module_regex(pattern: str) -> re.Pattern:
    """The module paths a plan key names (`*` = one ModuleList index)."""
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))


LORA_FACTORS = (".lora_A.", ".lora_B.")  # peft's adapter factors (`training.lora`): replicated on every TP rank


def is_lora_factor(key: str) -> bool:
    """True for a peft LoRA factor's key (`<module>.lora_A.<adapter>.weight`): replicated whole on every TP rank, its
    TP arithmetic served by the placement (`tp_autograd.py`), so every rank holds the one-process factor."""
    return any(f in key for f in LORA_FACTORS)


def plan_entry(key: str, plan: Mapping[str, PlanEntry] = TP_PLAN) -> tuple[str, PlanEntry]:
    """(pattern, entry) of the one plan entry whose module path owns parameter `key` (a peft-wrapped layer's
    `<module>.base_layer.weight` is its module's `<module>.weight`)."""
    key = key.replace(".base_layer.", ".")
    hits = [(p, e) for p, e in plan.items() if _regex(p).fullmatch(key)]
    if len(hits) != 1:
        found = "no plan entry" if not hits else f"{len(hits)} plan entries ({', '.join(p for p, _ in hits)})"
        raise DistributedError(f"parameter {key!r}: {found}; every parameter needs exactly one")
    return hits[0]


_GROUPS = {"colwise_heads": 1, "colwise_swiglu": 2}  # colwise_adaln: out_features / hidden_size


def split_rule(key: str, shape: Sequence[int], config, tp: int, plan: Mapping[str, PlanEntry] = TP_PLAN,
               row_parallel: str = "auto") -> tuple[int, int] | None:
    """(dim, groups) by which parameter `key` of full `shape` is split over `tp` ranks, or None when replicated."""
    if is_lora_factor(key):
        return None
    _, entry = plan_entry(key, plan)
    style = entry.style
    if style == "replicated" or tp == 1:
        return None
    if style == "rowwise_tree":
        if tree_strategy(tp, row_parallel) == "k_chunks":
            return None if key.endswith(".bias") else (1, 1)
        return (0, 1)
    return (0, _GROUPS.get(style) or _adaln_groups(key, shape[0], config))


def _adaln_groups(key: str, out_features: int, config) -> int:
    groups, rest = divmod(out_features, config.hidden_size)
    if rest:
        raise DistributedError(f"{key}: {out_features} output channels are not blocks of hidden_size={config.hidden_size}")
    return groups


def column_groups(module_path: str, out_features: int, config, plan: Mapping[str, PlanEntry] = TP_PLAN) -> int:
    """Channel groups of the output of column-parallel module `module_path` (`gather_columns(groups=...)`)."""
    key = f"{module_path}.weight"
    style = plan_entry(key, plan)[1].style
    if not style.startswith("colwise"):
        raise DistributedError(f"{module_path}: style {style!r} is not column-parallel")
    return _GROUPS.get(style) or _adaln_groups(key, out_features, config)


# ---------------------------------------------------------------------------------------------- sharding
def _check(config, tp: int, rank: int | None = None, row_parallel: str = "auto") -> None:
    check_config(Topology(tp=tp, row_parallel=row_parallel), config)
    tree_strategy(tp, row_parallel)
    if rank is not None and (not isinstance(rank, int) or not 0 <= rank < tp):
        raise DistributedError(f"rank={rank!r}: must be an integer in [0, {tp})")


def shard_tensor(key: str, tensor: torch.Tensor, config, tp: int, rank: int,
                 plan: Mapping[str, PlanEntry] = TP_PLAN, row_parallel: str = "auto") -> torch.Tensor:
    """Rank `rank`'s part of parameter `key` (the tensor itself when replicated, else a contiguous copy)."""
    rule = split_rule(key, tuple(tensor.shape), config, tp, plan, row_parallel)
    if rule is None:
        return tensor
    dim, groups = rule
    return split_grouped(tensor, dim, groups, tp, rank, name=key)


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], config, tp: int, rank: int,
                     plan: Mapping[str, PlanEntry] = TP_PLAN, row_parallel: str = "auto") -> dict[str, torch.Tensor]:
    """Rank `rank`'s state dict at TP degree `tp` (same keys, sharded tensors)."""
    _check(config, tp, rank, row_parallel)
    return {k: shard_tensor(k, v, config, tp, rank, plan, row_parallel) for k, v in state_dict.items()}


def unshard_state_dict(shards: Sequence[Mapping[str, torch.Tensor]], config, plan: Mapping[str, PlanEntry] = TP_PLAN,
                       row_parallel: str = "auto") -> dict[str, torch.Tensor]:
    """The full state dict from every rank's shard, in rank order (inverse of `shard_state_dict`)."""
    tp = len(shards)
    if tp == 0:
        raise DistributedError("unshard_state_dict: no shards")
    _check(config, tp, row_parallel=row_parallel)
    keys = list(shards[0])
    for r, sd in enumerate(shards[1:], start=1):
        if set(sd) != set(keys):
            diff = sorted(set(sd) ^ set(keys))[:3]
            raise DistributedError(f"unshard_state_dict: rank {r}'s keys differ from rank 0's (e.g. {diff})")
    out = {}
    for key in keys:
        pieces = [sd[key] for sd in shards]
        rule = split_rule(key, _full_shape(pieces[0].shape, key, tp, plan), config, tp, plan, row_parallel)
        if rule is None:
            for r, piece in enumerate(pieces[1:], start=1):
                if piece.dtype != pieces[0].dtype or not torch.equal(piece, pieces[0]):
                    raise DistributedError(f"{key}: replicated parameter differs between rank 0 and rank {r}")
            out[key] = pieces[0]
        else:
            out[key] = cat_grouped(pieces, rule[0], rule[1], name=key)
    return out


def _full_shape(shard_shape, key: str, tp: int, plan) -> tuple[int, ...]:
    """The unsharded shape (only axis 0 of colwise_adaln matters to `split_rule`: its group count)."""
    shape = list(shard_shape)
    if shape and not is_lora_factor(key) and plan_entry(key, plan)[1].style == "colwise_adaln":
        shape[0] *= tp
    return tuple(shape)


def shard_parameters_(model: nn.Module, config, tp: int, rank: int, plan: Mapping[str, PlanEntry] = TP_PLAN,
                      row_parallel: str = "auto") -> list[str]:
    """Shard a built model's parameters in place for `rank` (`param.data` replaced, objects kept); returns the names
    of the parameters that were split."""
    _check(config, tp, rank, row_parallel)
    split = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if split_rule(name, tuple(param.shape), config, tp, plan, row_parallel) is not None:
                param.data = shard_tensor(name, param.data, config, tp, rank, plan, row_parallel)
                split.append(name)
    return split
