"""The parallel plan applied to a built model, and undone: `apply_plan(model, mesh, TP_PLAN, CP_PLAN)` /
`remove_plan(model)`, the way Diffusers' context-parallel hooks interpret a model's `_cp_plan` (the plan is data;
one interpreter applies it, its inverse removes it). `parallelize(model, mesh)` is `apply_plan` with the model's
plans (`plan.TP_PLAN`, `plan.CP_PLAN`).

apply_plan (in place, once per model): checks (an h3lab `H3Transformer`, not placed yet, a `Mesh`, a topology the
config admits, parameters on the mesh's device); the model's fingerprint taken from the full weights first (so a
sharded run records the one-process checkpoint identity); TP (tp > 1): the weights sharded by `tp_plan` with the
mesh's row-parallel strategy (a model that holds only its shard already, from `shard_load`, is checked and kept);
then the `Placement` interprets both plans as hooks (`Placement._install`, see `placement.py`) and becomes the
model's (`placement_of`).

remove_plan: every hook of the placement removed, the TP shards gathered back over the TP group into the full
weights (`gather_columns` along each tensor's split axis, in rank order: the original bytes, `cat_grouped`), the
model forgotten by `placement_of`. Afterwards the model's forward is byte-equal to a model never placed (tested).

`wrap_placement(placement, wrap)`: a research wrapper (a `Placement` subclass built from the placement, e.g. the
ablation's fault probes in `h3lab.research.ablation.faults`) takes the placement's place: the old hooks off, the new on, the
weights as they are.

A new plan entry is one declaration in `plan.py`; e.g. cutting one more per-row argument of `norm_out` to the rank's
stream rows is `"norm_out": (RowSplit("timestep_indices", 0, "sp", "..."), RowSplit("extra", 0, "sp", "why")),`.
"""

from __future__ import annotations

import weakref
from typing import Callable, Mapping

import torch
from torch import nn

from ..hashing import model_fingerprint
from .collectives import gather_columns
from .errors import DistributedError
from .mesh import Mesh, check_config
from .placement import _PLACEMENTS, Placement, placement_of
from .plan import CP_PLAN, TP_PLAN, PlanEntry, _full_shape, shard_parameters_, split_rule


def apply_plan(model: nn.Module, mesh: Mesh, tp_plan: Mapping[str, PlanEntry] = TP_PLAN,
               cp_plan: Mapping[str, tuple] = CP_PLAN, *, name: str = "transformer",
               weights_on_host: bool = False) -> Placement:
    """Apply `tp_plan` and `cp_plan` on `mesh.topology` to `model` (an `H3Transformer` on `mesh.device`) in place and
    return its `Placement` (module docstring). `weights_on_host`: the model may sit in host memory (the caller
    streams its blocks right after, `ExecutionPlan.place`: each rank then pins only its shard). Refused (one line): a
    model that is not an H3Transformer, one already placed, one whose blocks are streamed (parallelize first, then
    stream), a topology its widths do not admit, parameters off the mesh's device, a plan entry naming no module."""
    if not all(hasattr(model, a) for a in ("config", "transformer_blocks", "hook_points", "norm_out")):
        raise DistributedError(f"parallelize: {type(model).__name__} is not an h3lab H3Transformer")
    if placement_of(model) is not None:
        raise DistributedError(f"parallelize: the model is already parallelized ({placement_of(model)!r})")
    if _streamed(model):
        raise DistributedError("parallelize: the model's blocks are streamed (sharding would replace the tensors the "
                               "streamer packed); parallelize first, then stream")
    if not isinstance(mesh, Mesh):
        raise DistributedError(f"parallelize: mesh is a {type(mesh).__name__}; build it with init_mesh(tp=..., cp=...)")
    check_config(mesh.topology, model.config)
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    bad = [d for d in devices if d.type != mesh.device.type or (d.type == "cuda" and d != mesh.device)]
    if weights_on_host:
        bad = [d for d in bad if d.type != "cpu"]
    if bad:
        raise DistributedError(f"parallelize: the model is on {sorted(map(str, devices))}, the mesh's rank "
                               f"{mesh.rank} on {mesh.device}: move the model to its rank's device first")
    t = mesh.topology
    held = getattr(model, "h3lab_shard", None)  # set by shard_load: the model holds only its TP shard already
    if held is not None:
        want = (t.tp, mesh.local_rank("tp"), t.strategy)
        if tuple(held) != want:
            raise DistributedError(f"parallelize: the model holds the shard (tp, rank, strategy) = {tuple(held)}, "
                                   f"rank {mesh.rank} of {t.name} needs {want}: load the shard for this mesh")
        if not getattr(model, "fingerprint", ""):
            raise DistributedError("parallelize: a model holding only its shard needs the full weights' fingerprint "
                                   "(set by its loader)")
    if isinstance(getattr(model, "fingerprint", None), str) and not model.fingerprint:
        model.fingerprint = model_fingerprint(model)  # the full weights' identity, before sharding
    split = []
    if held is not None:
        split = [n for n, p in model.named_parameters()
                 if split_rule(n, _full_shape(p.shape, n, t.tp, tp_plan), model.config, t.tp, tp_plan,
                               row_parallel=t.row_parallel) is not None]
    elif t.tp > 1:
        split = shard_parameters_(model, model.config, t.tp, mesh.local_rank("tp"), tp_plan,
                                  row_parallel=t.row_parallel)
    placement = Placement(model, mesh, name, split, tp_plan, cp_plan)
    try:
        placement._install()
    except BaseException:
        _remove(placement)
        raise
    _register(model, placement)
    return placement


def _streamed(model: nn.Module) -> bool:
    """Whether a `components.streaming.BlockStreamer` drives `model` (its `streamer_of`, read here through the same
    attribute: the distributed room sits below components in the layer table and cannot import it)."""
    return model.__dict__.get("_h3lab_streamer") is not None


def parallelize(model: nn.Module, mesh: Mesh, *, name: str = "transformer", weights_on_host: bool = False) -> Placement:
    """`apply_plan(model, mesh, TP_PLAN, CP_PLAN, name=name)`: the model's own plans on `mesh.topology`."""
    return apply_plan(model, mesh, TP_PLAN, CP_PLAN, name=name, weights_on_host=weights_on_host)


def remove_plan(model: nn.Module) -> None:
    """Undo `apply_plan` on `model` (module docstring). Under TP every rank of the TP group must call it (the shards
    are gathered back). Refused (one line): a model with no placement."""
    placement = placement_of(model)
    if placement is None:
        raise DistributedError(f"remove_plan: the {type(model).__name__} has no placement (apply_plan first)")
    if _streamed(model):
        raise DistributedError("remove_plan: the model's blocks are streamed; stop streaming first "
                               "(ExecutionPlan resident, or its streamer's remove(restore=True))")
    _remove(placement)
    if getattr(model, "h3lab_shard", None) is not None:
        del model.h3lab_shard  # the model holds its full weights again
        model.__dict__.pop("h3lab_read_whole", None)
    del _PLACEMENTS[model]
    model.__dict__.pop("_h3lab_placement", None)


def _register(model: nn.Module, placement: Placement) -> None:
    """`placement` is the model's (`placement_of`): the model holds it, the registry a weak reference, so a model and
    its placement are one cycle the garbage collector frees (a strong registry value kept every placed model alive)."""
    model.__dict__["_h3lab_placement"] = placement
    _PLACEMENTS[model] = weakref.ref(placement)


def _remove(placement: Placement) -> None:
    """The placement's hooks off and the parameters it split gathered back (every rank of the TP group at once)."""
    for handle in placement.handles:
        handle.remove()
    placement.handles = []
    model, t = placement.model, placement.topology
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in placement.split:
            param = params[key]
            dim, groups = split_rule(key, _full_shape(param.shape, key, t.tp, placement.tp_plan), model.config, t.tp,
                                     placement.tp_plan, row_parallel=t.row_parallel)
            moved = param.data.movedim(dim, -1)
            param.data = gather_columns(moved, placement.mesh, groups, point=key).movedim(-1, dim).contiguous()


def wrap_placement(placement: Placement, wrap: Callable[[Placement], Placement]) -> Placement:
    """Put `wrap(placement)` (a `Placement` built from it, e.g. a research wrapper overriding its seams) in the
    placement's place on its model: the old placement's module hooks come off, the new one's go on, the weights stay
    as sharded. Returns the new placement (`placement_of(model)` from now on)."""
    model = placement.model
    if placement_of(model) is not placement:
        raise DistributedError(f"wrap_placement: {placement!r} is not the current placement of its model")
    new = wrap(placement)
    if not isinstance(new, Placement) or new.model is not model:
        raise DistributedError(f"wrap_placement: the wrapper returned {type(new).__name__}, not a Placement of the "
                               "same model")
    for handle in placement.handles:
        handle.remove()
    placement.handles = []
    new._install()
    _register(model, new)
    return new
