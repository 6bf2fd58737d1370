"""Hook points of `H3Transformer`: where a forward can be observed or perturbed.

Contract (docs/ARCHITECTURE.md, "Hook points"):

- `hook_points(config)` lists every `HookPoint(name, layer, op, rows, reshapable, sharded, tap)` in execution order
  (the last three have defaults, so `HookPoint(name, layer, op, rows)` still builds one). Each point is the output
  of one op-table call (`op`, a name of `h3lab.execution.runtime.OP_NAMES`), exactly the tensor the next op consumes:
  `blocks.3.q` is the to_q projection (B, S, inner) before the head split, `blocks.3.attention` the attention output
  (B, S, H, D) before the head merge, `blocks.3.adaln_table` the AdaLN table viewed as (T*3, 6*hidden).
- The tables below (`REFINER_POINTS`, `BLOCK_POINTS`, the stem and end tables) are the one declaration of the points:
  besides name, op and rows, each carries its `Sharded` layout on a rank of a TP / CP / SP placement (rows "sp" /
  "cp" / "all", columns None / groups / "heads": what `h3lab.distributed`'s hook view gathers and cuts back, and
  what names the rank owning a row; `sharded_layout(name)` for a name alone) and its `Tap`, the Diffusers module
  whose output is the same tensor (what `drift.DiffusersTaps` observes on Diffusers' model; None for inline
  arithmetic: modulate, RoPE application, attention, residual1, pack). A new point is one line there.
- `layer` is the block index for `blocks.{i}.*`, the refiner block index for `refiner.{i}.*`, None elsewhere.
- `rows` says what the row axis indexes: "packed" (rows of the packed sequence), "video" / "audio" / "text" (rows in
  the order of `video_indices` / `audio_indices` / `text_indices`), "table" (AdaLN table rows
  `timestep_index*3 + tag`) or "time" (one row per distinct timestep). `HookPoint.row_axis` says which axis that is:
  1 for (B, S, ...) activations, 0 for the tables ("table", "time") and for the rope tables `rope_cos` / `rope_sin`
  (shape (S, rotary_dim), one row per packed row).
- A hook is `fn(point: HookPoint, tensor) -> tensor | None`. A returned tensor replaces the value (it must keep the
  dtype, the device and, unless the point is reshapable, the shape); None leaves it. Hooks run in registration
  order; each sees the previous one's result. The tensor is live in the autograd graph: a capturing hook should
  store `tensor.detach()` (or a clone).
- Reshapable points (`HookPoint.reshapable`, declared in `RESHAPABLE`): the packed-row stream where it enters the
  block stack (`pack`) and where it leaves each block (`blocks.{i}.residual2`, the next block's input). There a
  replacement may have another shape (dtype and device still must match): these are the block boundaries where a
  batch may be split or merged (every later op reads B from the tensor) and where a sequence-parallel plan shards
  or gathers the stream. Every op after them indexes rows through per-row tables (`adaln_indices`, the rope tables,
  `key_order`, the output indices), so a replacement with another row count needs those to change with it — which
  a block-level wrapper or pre-hook (`transformer_blocks[i]` takes all of them as arguments) can do.
- Call sites: each point fires in one line, `q = self.hook_q(self.to_q(x))`, where
  `self.hook_q = HookSite("blocks.3.q")` is declared in the module that computes the value. It fires on the result
  of the module call — what the next op consumes — so a hook sees a wrapper's output. A `HookSite` is a plain
  callable, not an `nn.Module`, so `named_modules()` stays Diffusers' module tree (parallel plans, LoRA target
  lists and offload maps see exactly the Diffusers paths). The registry it fires is the one `use_hooks` made current
  for the running forward (the `hooks` field of the execution context, `h3lab.execution.context`; `H3Transformer.forward`
  enters it, with None when no hook is registered): with no hook registered a point costs one context read and one
  `is None`.
- Under gradient checkpointing a block's forward is replayed during backward; the hooks of that block run again
  (fully or up to torch's early stop), so a perturbation shapes the gradients exactly as it shaped the forward.
  `model.recomputing` is True during such a replay, for observers that must count each forward once.
- Sharded forwards (`h3lab.distributed`): a placement makes a `HookView` current for the forward (`use_view`), and
  a point that some hook selects fires on the tensor one process would hold there (rows, columns or heads gathered
  from the ranks); a replacement is cut back to each rank's shard and must be made on every rank alike. The model
  never knows; a point no hook selects costs nothing more.
- `model.hook_context` is a caller-owned dict (the denoise loop sets e.g. `{"step": 3}` before each forward) that a
  hook holding the model may read; during a checkpoint replay it reads the dict of the forward being replayed.

The trace (`h3lab.execution.runtime.last_trace()`) records every op call with the name of the point its result is exposed at;
ops internal to a point record that point (the silu and first linear of `time_mlp`, the silu of `adaln_table` /
`final_table`), and the single `rope_table` call records `rope_cos` (it produces `rope_cos` and `rope_sin`). A
module that outside code inserts records its own calls under `<point of the module it wraps>.<suffix>` (e.g.
`blocks.0.q.lora_a`); these are trace points, not hook points.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, NamedTuple, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ..execution import context
from ..config import H3Config
from ..errors import H3Error

ROWS = ("packed", "video", "audio", "text", "table", "time")
SHARD_ROWS = ("sp", "cp", "all")


class Sharded(NamedTuple):
    """Where a point's tensor lives on one rank of a TP / CP / SP placement (`h3lab.distributed` gathers it into the
    one-process tensor for hooks, and cuts a replacement back, from this alone). `rows`: "sp" (the rank's
    residual-stream rows: its SP shard under SP, else its CP shard), "cp" (its CP shard) or "all" (every row);
    `columns`: None (all), an int g (the last axis read as g channel groups, each split over the TP ranks,
    `split_grouped`) or "heads" (axis 2: whole heads per TP rank)."""

    rows: str = "all"
    columns: int | str | None = None


class Tap(NamedTuple):
    """The Diffusers module (path in `MiniMaxH3Transformer3DModel`; "" the model) whose forward output is a point's
    tensor, byte for byte: `take` None (the output), an int (that item of a tuple output) or "cat" (a tuple's items
    concatenated on the last axis). `drift.DiffusersTaps` observes Diffusers' model through it."""

    module: str
    take: int | str | None = None


ALL, STREAM, CP = Sharded(), Sharded("sp"), Sharded("cp")
HEADS = Sharded("cp", "heads")

# Per refiner block: (suffix, op, sharded, tap under the block); rows "text". Plain pre-norm block: no AdaLN, no
# RoPE. The refiner runs replicated over rows (text rows only), its projections column-split like the blocks'.
REFINER_POINTS = (
    ("norm1", "rms_norm", ALL, "norm1"),
    ("q", "linear", Sharded("all", 1), "attn.to_q"),
    ("k", "linear", Sharded("all", 1), "attn.to_k"),
    ("v", "linear", Sharded("all", 1), "attn.to_v"),
    ("q_norm", "rms_norm", Sharded("all", "heads"), "attn.norm_q"),
    ("k_norm", "rms_norm", Sharded("all", "heads"), "attn.norm_k"),
    ("attention", "attention", Sharded("all", "heads"), None),
    ("o_proj", "linear_tree", ALL, "attn.to_out.0"),
    ("residual1", "add", ALL, None),
    ("norm2", "rms_norm", ALL, "norm2"),
    ("ffn_up", "linear", Sharded("all", 2), "ff.net.0.proj"),
    ("swiglu", "swiglu", Sharded("all", 1), "ff.net.0"),
    ("ffn_down", "linear_tree", ALL, "ff.net.2"),
    ("residual2", "add", ALL, ""),
)

# Per transformer block: (suffix, op, rows, sharded, tap under the block). Under CP the block stack holds the rank's
# rows: the residual stream its SP rows, the attention and FFN inner tensors its CP rows (SP gathers them once).
BLOCK_POINTS = (
    ("adaln_table", "linear", "table", ALL, Tap("adaln_proj", "cat")),
    ("norm1", "rms_norm", "packed", STREAM, "norm1"),
    ("modulate1", "modulate", "packed", STREAM, None),
    ("q", "linear", "packed", Sharded("cp", 1), "attn.to_q"),
    ("k", "linear", "packed", Sharded("cp", 1), "attn.to_k"),
    ("v", "linear", "packed", Sharded("cp", 1), "attn.to_v"),
    ("q_norm", "rms_norm", "packed", HEADS, "attn.norm_q"),
    ("k_norm", "rms_norm", "packed", HEADS, "attn.norm_k"),
    ("q_rope", "rope", "packed", HEADS, None),
    ("k_rope", "rope", "packed", HEADS, None),
    ("attention", "attention", "packed", HEADS, None),
    ("o_proj", "linear_tree", "packed", STREAM, "attn.to_out.0"),
    ("residual1", "gated_residual", "packed", STREAM, None),
    ("norm2", "rms_norm", "packed", STREAM, "norm2"),
    ("modulate2", "modulate", "packed", STREAM, None),
    ("ffn_up", "linear", "packed", Sharded("cp", 2), "ff.net.0.proj"),
    ("swiglu", "swiglu", "packed", Sharded("cp", 1), "ff.net.0"),
    ("ffn_down", "linear_tree", "packed", STREAM, "ff.net.2"),
    ("residual2", "gated_residual", "packed", STREAM, ""),
)

# Points outside the blocks: (name, op, rows, sharded, tap). They run replicated but the final norm / modulation,
# which run on the rank's residual-stream rows.
_INPUT_POINTS = (
    ("video_proj_in", "linear", "video", ALL, "proj_in"),
    ("audio_proj_in", "linear", "audio", ALL, "audio_proj_in"),
    ("text_proj_in", "linear", "text", ALL, "context_embedder"),
)
_STEM_POINTS = (
    ("pack", "pack_rows", "packed", ALL, None),
    ("time_sinusoid", "timestep_embedding", "time", ALL, "time_proj"),
    ("time_mlp", "linear", "time", ALL, "time_embedder"),
    ("rope_cos", "rope_table", "packed", ALL, Tap("rope", 0)),
    ("rope_sin", "rope_table", "packed", ALL, Tap("rope", 1)),
)
# Points whose replacement may change shape (see the module docstring): the packed stream entering the block stack
# and each block's output. Refiner points are not: the text rows must still match `text_indices` at `pack`.
RESHAPABLE = ("pack", "blocks.*.residual2")

_END_POINTS = (
    ("final_table", "linear", "time", ALL, "norm_out.linear"),
    ("final_norm", "rms_norm", "packed", STREAM, "norm_out.norm"),
    ("final_modulate", "modulate", "packed", STREAM, "norm_out"),
    ("video_head", "linear", "packed", ALL, "proj_out"),
    ("audio_head", "linear", "packed", ALL, "audio_proj_out"),
    ("video_out", "select_rows", "video", ALL, Tap("", 0)),
    ("audio_out", "select_rows", "audio", ALL, Tap("", 1)),
)


class HookError(H3Error):
    """A hook was registered for an unknown point, or returned a tensor that cannot replace the value."""


class HookPoint(NamedTuple):
    name: str
    layer: int | None
    op: str
    rows: str
    reshapable: bool = False  # a hook's replacement may change the shape here (`RESHAPABLE`)
    sharded: Sharded = ALL  # where the tensor lives on a rank of a placement
    tap: Tap | None = None  # the Diffusers module whose output is this tensor (None: inline arithmetic)

    @property
    def row_axis(self) -> int:
        """Axis of the hooked tensor that `rows` indexes (0 for tables and the (S, R) rope tables, else 1)."""
        return 0 if self.rows in ("table", "time") or self.op == "rope_table" else 1


def _tap(prefix: str, tap: Tap | str | None) -> Tap | None:
    if tap is None:
        return None
    tap = Tap(tap) if isinstance(tap, str) else tap
    return tap._replace(module=".".join(p for p in (prefix, tap.module) if p))


def _point(name: str, layer: int | None, op: str, rows: str, sharded: Sharded = ALL, tap: Tap | None = None
           ) -> HookPoint:
    pattern = name if layer is None else name.replace(f".{layer}.", ".*.", 1)
    return HookPoint(name, layer, op, rows, pattern in RESHAPABLE, sharded, tap)


def hook_points(config: H3Config) -> tuple[HookPoint, ...]:
    """Every hook point of a model with this config, in execution order."""
    points = [_point(name, None, op, rows, sh, _tap("", tap)) for name, op, rows, sh, tap in _INPUT_POINTS]
    for i in range(config.num_refiner_layers):
        prefix = f"token_refiner.refiner_blocks.{i}"
        points += [_point(f"refiner.{i}.{s}", i, op, "text", sh, _tap(prefix, tap))
                   for s, op, sh, tap in REFINER_POINTS]
    points.append(_point("refiner.final_norm", None, "rms_norm", "text", ALL, Tap("token_refiner.final_norm")))
    points += [_point(name, None, op, rows, sh, _tap("", tap)) for name, op, rows, sh, tap in _STEM_POINTS]
    for i in range(config.num_layers):
        prefix = f"transformer_blocks.{i}"
        points += [_point(f"blocks.{i}.{s}", i, op, rows, sh, _tap(prefix, tap))
                   for s, op, rows, sh, tap in BLOCK_POINTS]
    points += [_point(name, None, op, rows, sh, _tap("", tap)) for name, op, rows, sh, tap in _END_POINTS]
    return tuple(points)


def _pattern_layouts() -> dict[str, Sharded]:
    out = {f"refiner.*.{s}": sh for s, _, sh, _ in REFINER_POINTS}
    out.update({f"blocks.*.{s}": sh for s, _, _, sh, _ in BLOCK_POINTS})
    for table in (_INPUT_POINTS, _STEM_POINTS, _END_POINTS):
        out.update({name: sh for name, _, _, sh, _ in table})
    return out


_LAYOUTS = _pattern_layouts()


def sharded_layout(name: str) -> Sharded:
    """The `Sharded` layout of the hook point called `name` (any config); `ALL` for a name that is not one (drift's
    input / scheduler points run replicated)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0] in ("blocks", "refiner") and parts[1].isdigit():
        name = f"{parts[0]}.*.{parts[2]}"
    return _LAYOUTS.get(name, ALL)


HookFn = Callable[[HookPoint, torch.Tensor], "torch.Tensor | None"]


class HookRegistry:
    """Registered hooks of one model: `add` returns a handle with `.remove()`; `fire` runs them at one point.
    Falsy while empty, which is the forward's only hook check."""

    def __init__(self, points: Iterable[HookPoint]):
        self.points: dict[str, HookPoint] = {p.name: p for p in points}
        self._hooks: OrderedDict[int, tuple[HookFn, frozenset | None]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def __len__(self) -> int:
        return len(self._hooks)

    def add(self, fn: HookFn, names: Iterable[str] | None = None) -> RemovableHandle:
        """Register `fn` at every point, or only at the points named in `names`."""
        if not callable(fn):
            raise HookError(f"hook {fn!r} is not callable: a hook is fn(point, tensor) -> tensor | None")
        selected = None
        if names is not None:
            selected = frozenset([names] if isinstance(names, str) else names)
            unknown = sorted(selected - set(self.points))
            if unknown:
                raise HookError(f"hook names {unknown} are not hook points of this model (see model.hook_points())")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = (fn, selected)
        return handle

    def hooked_points(self) -> frozenset[str]:
        """Names of the points at least one registered hook fires at."""
        if any(selected is None for _, selected in self._hooks.values()):
            return frozenset(self.points)
        return frozenset().union(*(selected for _, selected in self._hooks.values()))

    def fire(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        point = self.points[name]
        fns = [fn for fn, selected in list(self._hooks.values()) if selected is None or name in selected]
        if not fns:
            return tensor
        view = context.current().hook_view
        if view is None:
            return self._run(point, fns, tensor)
        # A placement's view (h3lab.distributed): hooks see the one-process tensor, a replacement is re-sharded.
        full = view.to_global(point, tensor)
        out = self._run(point, fns, full)
        replaced = view.agree(point, out is not full)
        return view.to_local(point, out) if replaced else tensor

    def _run(self, point: HookPoint, fns: list, tensor: torch.Tensor) -> torch.Tensor:
        name = point.name
        for fn in fns:
            out = fn(point, tensor)
            if out is None:
                continue
            if not isinstance(out, torch.Tensor) or out.dtype != tensor.dtype or out.device != tensor.device or (
                out.shape != tensor.shape and not point.reshapable
            ):
                got = f"{type(out).__name__} {list(out.shape)} {out.dtype} {out.device}" if isinstance(
                    out, torch.Tensor
                ) else type(out).__name__
                shape = "any shape (a reshapable point)" if point.reshapable else f"shape {list(tensor.shape)}"
                raise HookError(
                    f"hook {getattr(fn, '__name__', fn)!r} at {name} returned {got}: a replacement must be a tensor "
                    f"of {shape}, dtype {tensor.dtype}, device {tensor.device}"
                )
            tensor = out
        return tensor


# ------------------------------------------------------------------------------------------------ call sites
# The active registry and the hook view are fields of the one execution context (`h3lab.execution.context`: hooks, hook_view).


class HookView(Protocol):
    """How a placement that shards a forward (h3lab.distributed) shows hooks the one-process tensors: `to_global`
    gathers a point's local shard (rows, columns or heads) into the tensor one process would have there, `to_local`
    cuts a replacement back to this rank's shard, `agree(point, replaced)` makes every rank reach the same verdict
    (a replacement on some ranks only is refused) and returns it."""

    def to_global(self, point: HookPoint, tensor: torch.Tensor) -> torch.Tensor: ...

    def to_local(self, point: HookPoint, tensor: torch.Tensor) -> torch.Tensor: ...

    def agree(self, point: HookPoint, replaced: bool) -> bool: ...


@contextlib.contextmanager
def use_view(view: "HookView | None") -> Iterator[None]:
    """Fire the enclosed forward's hooks through `view` (None: hooks see the tensors as computed)."""
    with context.use(hook_view=view):
        yield


def active_hooks() -> HookRegistry | None:
    """The registry the running forward fires (None: no hook registered, or no forward running)."""
    return context.current().hooks


@contextlib.contextmanager
def use_hooks(registry: HookRegistry | None) -> Iterator[None]:
    """Make `registry` the one every `HookSite` of the enclosed code fires (None: sites pass values through)."""
    with context.use(hooks=registry):
        yield


class HookSite:
    """The call site of one hook point: `x = self.hook_pack(x)` returns x, or what the active hooks made of it."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        hooks = context.current().hooks
        return tensor if hooks is None else hooks.fire(self.name, tensor)

    def __repr__(self) -> str:
        return f"HookSite({self.name!r})"
