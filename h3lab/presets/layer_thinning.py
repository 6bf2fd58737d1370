"""Layer thinning (`--layers N`): run N of the transformer's blocks, chosen by the checkpoint's own AdaLN gates.

The seed (h3-metal) "ranks the checkpoint's actual AdaLN gates while protecting structurally important first and
final blocks"; it names no statistic, so h3lab fixes one and seals its result:

- Score of block i: the mean absolute value of its two residual gates, `gate_msa` and `gate_mlp` -- the columns of
  its AdaLN table that multiply the attention and FFN updates in `x + gate * y` -- over all three modality rows
  (video, text, audio), every hidden channel and `GATE_TIMESTEPS` = 21 timesteps t = 0, 0.05, ..., 1 (the whole
  noise range, independent of any request). The table is the block's `adaln_proj` applied to silu of the model's own
  timestep embedding (`time_embedder` of the float32 sinusoid), evaluated in float64 from the checkpoint's weights.
  A block whose gates are small adds little to the residual stream at every noise level. On a TP mesh a rank holds
  1/tp of every table's channels; the ranking reads the whole projections from the checkpoint (`_whole_adaln`).
- Protected: the first block (0) and the final block (num_layers - 1) always run.
- Chosen: the protected blocks plus the N - 2 highest-scoring other blocks (ties: the lower index), run in index
  order. Because the choice for N is a prefix-extension of the choice for N - 1, a smaller N never needs a block a
  larger N dropped.
- Validated range: the seed validated 40, 45 and 50 of 50 blocks; h3lab accepts N in [ceil(0.8 * num_layers),
  num_layers] (40..50 for the release) and N = num_layers is the full model (no preset).

The chosen list is sealed in the run's preset (`{"layers": 45, "blocks": [0, 1, ...]}`) and is what runs: a replay
runs the sealed list without re-ranking. `apply_layer_thinning(run, blocks)` makes each dropped block return its
input unchanged (`_blocks.skip_blocks`) for the run's duration; nothing inside the model knows.

Residency: `release_dropped(model, blocks)` moves every dropped block's parameters to the meta device (their memory is
freed) and gives the block a forward that raises `PresetError` naming it, so a later run that needs it fails loudly
instead of computing with missing weights. The session calls it after building the thinned run and reloads the DiT
when a later request needs a released block (`missing_blocks`, `needs_reload`); a model the caller pinned
(`Session.set_transformer`) is never released.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import torch

from ..execution import runtime
from ..config import NUM_MODALITIES
from ._blocks import skip_blocks
from .errors import PresetError

GATE_TIMESTEPS = 21  # t = k / 20, k = 0..20
GATE_CHUNKS = (2, 5)  # gate_msa, gate_mlp in [shift_msa | scale_msa | gate_msa | shift_mlp | scale_mlp | gate_mlp]
MIN_FRACTION = 0.8  # the seed's validated 40 of 50


def layer_range(num_layers: int) -> tuple[int, int]:
    """(smallest, largest) accepted N for a model of `num_layers` blocks (module docstring)."""
    return max(len(protected_blocks(num_layers)), math.ceil(MIN_FRACTION * num_layers)), num_layers


def protected_blocks(num_layers: int) -> tuple[int, ...]:
    """The blocks that always run: the first and the final one."""
    return tuple(sorted({0, num_layers - 1})) if num_layers else ()


def check_layers(n: Any, num_layers: int, what: str = "layers") -> int:
    """`n` as an int in `layer_range(num_layers)`, else a one-line `PresetError`."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise PresetError(f"{what}={n!r}: must be an integer number of transformer blocks")
    lo, hi = layer_range(num_layers)
    if not lo <= n <= hi:
        raise PresetError(f"{what}={n}: must be between {lo} and {hi} for this {num_layers}-block transformer "
                          f"(the validated range keeps at least {MIN_FRACTION:.0%} of the blocks)")
    return n


def _is_released(block: torch.nn.Module) -> bool:
    return any(p.is_meta for p in block.parameters())


def released_blocks(model: Any) -> tuple[int, ...]:
    """Indices of the blocks whose weights `release_dropped` freed."""
    return tuple(i for i, b in enumerate(model.transformer_blocks) if _is_released(b))


def missing_blocks(model: Any, blocks: Sequence[int] | None) -> tuple[int, ...]:
    """The blocks of `blocks` (None: all) that are released on `model`."""
    gone = released_blocks(model)
    return gone if blocks is None else tuple(i for i in blocks if i in gone)


def needs_reload(model: Any, layers: int | None = None, blocks: Sequence[int] | None = None) -> bool:
    """True when the resident blocks of `model` cannot serve a run of exactly `blocks`, or else of `layers` blocks
    chosen by the gate ranking (both None: every block)."""
    if blocks is not None:
        return bool(missing_blocks(model, blocks))
    resident = len(model.transformer_blocks) - len(released_blocks(model))
    return resident < (len(model.transformer_blocks) if layers is None else layers)


def needed_blocks(presets: Sequence[Any]) -> tuple[int | None, list[int] | None]:
    """(layers, blocks) that runs with these sealed presets need resident (`needs_reload`'s arguments): every block
    unless all of them thin, then the union of their block lists (or the largest N when a list is not sealed)."""
    presets = [dict(p or {}) for p in presets]
    if not presets or not all("layers" in p for p in presets):
        return None, None
    if not all("blocks" in p for p in presets):
        return max(p["layers"] for p in presets), None
    return None, sorted({i for p in presets for i in p["blocks"]})


@torch.no_grad()
def gate_scores(model: Any) -> dict[int, float]:
    """Block index -> mean |gate| (module docstring) for every resident block of `model`."""
    c = model.config
    lin1 = model.time_embedder.linear_1.weight
    t = torch.arange(GATE_TIMESTEPS, dtype=torch.float32, device=lin1.device) / (GATE_TIMESTEPS - 1)
    with runtime.use_mode("off"):  # an analysis of the weights, not a forward: the reference arithmetic
        sinusoid = runtime.REFERENCE_OPS["timestep_embedding"](t, c.freq_dim)
        temb = model.time_embedder(sinusoid.to(lin1.dtype))
    a = torch.nn.functional.silu(temb.float()).double()  # (T, time_embed_dim)
    H, scores = c.hidden_size, {}
    for i, block in enumerate(model.transformer_blocks):
        if _is_released(block):
            continue
        weight, bias = _whole_adaln(model, i, a.device)
        total = torch.zeros((), dtype=torch.float64, device=a.device)
        for m in range(NUM_MODALITIES):
            for j in GATE_CHUNKS:
                rows = slice(m * 6 * H + j * H, m * 6 * H + (j + 1) * H)
                gate = a @ weight[rows].double().T + bias[rows].double()  # (T, H)
                total += gate.abs().sum()
        scores[i] = float(total) / (GATE_TIMESTEPS * NUM_MODALITIES * len(GATE_CHUNKS) * H)
    return scores


def _whole_adaln(model: Any, i: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block i's whole AdaLN projection (weight, bias). A model holding only its TP shard (a mesh rank: 1/tp of
    every table block's channels) reads them whole through its loader's `h3lab_read_whole` (the checkpoint's or
    the counter init's tensors, what one process holds), so every topology ranks on the one-process bytes."""
    lin = model.transformer_blocks[i].adaln_proj.linear
    c = model.config
    full = NUM_MODALITIES * 6 * c.hidden_size
    if lin.weight.shape[0] == full:  # on the device of the analysis (AdaLN weights may sit in host memory)
        return lin.weight.to(device), lin.bias.to(device)
    read = getattr(model, "h3lab_read_whole", None)
    if read is None:
        raise PresetError(f"layers: block {i}'s AdaLN projection holds {lin.weight.shape[0]} of its {full} rows (a "
                          "TP shard) and the model names no checkpoint to read it whole from: rank the blocks on the "
                          "whole model, or seal them (preset blocks=[...])")
    key = f"transformer_blocks.{i}.adaln_proj.linear."
    got = read((key + "weight", key + "bias"))
    return got[key + "weight"].to(device), got[key + "bias"].to(device)


def choose_blocks(model: Any, n: int) -> tuple[int, ...]:
    """The N blocks layer thinning runs (module docstring), in index order. Needs the protected blocks and at least
    N blocks resident (`needs_reload`)."""
    num_layers = len(model.transformer_blocks)
    check_layers(n, num_layers)
    scores = gate_scores(model)
    keep = [i for i in protected_blocks(num_layers) if i in scores]
    if len(scores) < n or len(keep) < len(protected_blocks(num_layers)):
        raise PresetError(f"layers={n}: only {len(scores)} of {num_layers} blocks are resident (released "
                          f"{list(released_blocks(model))}); reload the transformer")
    others = sorted((i for i in scores if i not in keep), key=lambda i: (-scores[i], i))
    return tuple(sorted(keep + others[: n - len(keep)]))


def check_blocks(blocks: Any, layers: int) -> tuple[int, ...]:
    """A sealed block list: `layers` distinct non-negative ints in increasing order."""
    if not isinstance(blocks, (list, tuple)) or any(isinstance(b, bool) or not isinstance(b, int) for b in blocks):
        raise PresetError(f"blocks={blocks!r}: must be a list of block indices")
    if list(blocks) != sorted(set(blocks)) or (blocks and blocks[0] < 0):
        raise PresetError(f"blocks={list(blocks)}: must be distinct non-negative indices in increasing order")
    if len(blocks) != layers:
        raise PresetError(f"blocks={list(blocks)}: lists {len(blocks)} blocks, layers={layers}")
    return tuple(blocks)


def dropped(num_layers: int, blocks: Sequence[int]) -> tuple[int, ...]:
    kept = set(blocks)
    return tuple(i for i in range(num_layers) if i not in kept)


def release_dropped(model: Any, blocks: Sequence[int]) -> tuple[int, ...]:
    """Free the weights of every block not in `blocks` (module docstring); returns the blocks released now. The
    model's `fingerprint` is pinned first (when empty) so runs keep naming the checkpoint the weights came from."""
    from ..hashing import model_fingerprint

    if isinstance(getattr(model, "fingerprint", None), str) and not model.fingerprint:
        model.fingerprint = model_fingerprint(model)
    released = []
    for i in dropped(len(model.transformer_blocks), blocks):
        block = model.transformer_blocks[i]
        if _is_released(block):
            continue
        block.to("meta")
        block.forward = _released_forward(i)
        released.append(i)
    if released and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tuple(released)


def _released_forward(i: int):
    def forward(*args, **kwargs):
        raise PresetError(f"transformer block {i} was released by layer thinning (its weights are not resident): "
                          "reload the transformer to run it")

    return forward


@contextlib.contextmanager
def apply_layer_thinning(run: Any, blocks: Sequence[int]) -> Iterator[Any]:
    """Run only `blocks` of `run.model` for the duration of the `with`; yields `run` (the model is changed in
    place and restored on exit)."""
    model = run.model
    num_layers = len(model.transformer_blocks)
    if blocks and blocks[-1] >= num_layers:
        raise PresetError(f"blocks={list(blocks)}: the transformer has {num_layers} blocks (0..{num_layers - 1})")
    need = [i for i in protected_blocks(num_layers) if i not in blocks]
    if need:
        raise PresetError(f"blocks={list(blocks)}: layer thinning always runs the first and final blocks "
                          f"{list(protected_blocks(num_layers))}")
    gone = missing_blocks(model, blocks)
    if gone:
        raise PresetError(f"layer thinning runs blocks {list(gone)}, which were released: reload the transformer")
    kept = frozenset(blocks)
    with skip_blocks(model, lambda i: i not in kept):
        yield run


# ------------------------------------------------------------------------------------------------ registration
def _validate(value: dict) -> dict:
    if "blocks" in value and "layers" not in value:
        raise PresetError("preset blocks without layers: the sealed block list goes with layers=N")
    if "layers" not in value:
        return {}
    n = value["layers"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PresetError(f"layers={n!r}: must be a positive integer number of transformer blocks")
    out: dict[str, Any] = {"layers": n}
    if "blocks" in value:
        out["blocks"] = list(check_blocks(value["blocks"], n))
    return out


def _apply(value: dict, run: Any):
    check_layers(value["layers"], len(run.model.transformer_blocks))
    return apply_layer_thinning(run, value.get("blocks") or choose_blocks(run.model, value["layers"]))


def _from_settings(settings: Any, model: Any, layout: Any) -> dict:
    num_layers = len(model.transformer_blocks)
    if settings.layers is None or settings.layers == num_layers:
        return {}
    n = check_layers(settings.layers, num_layers)
    return {"layers": n, "blocks": list(choose_blocks(model, n))}


def _describe(p: dict) -> list[str]:
    blocks = p.get("blocks")
    if blocks:
        gone = dropped(blocks[-1] + 1, blocks)  # the final block is protected: its index + 1 is the depth
        return [f"layers {p['layers']} of {blocks[-1] + 1}: dropped blocks {', '.join(map(str, gone))} "
                "(lowest mean |AdaLN gate|; first and final protected)"]
    return [f"layers {p['layers']} (blocks ranked by the model's AdaLN gates at run time)"]


def _p_layers(name, args):
    from ..schema.words import int_word, one

    text = one(name, args, "N|off")
    return (None,) if text == "off" else (int_word(name, text, "N (transformer blocks to run) or 'off'"),)


def _check_depth(state: Any, new: Any) -> None:
    if new.layers is not None:
        state.get_session().check_preset(new)  # the range needs the DiT's depth: read from its config, no weights


def _reply(new: Any, _state: Any) -> list[str]:
    return ["layers off (every block runs)" if new.layers is None else f"layers {new.layers}"] + new.preset_notices


def _register() -> None:
    from ..schema import Control, Repl, Setting, declare
    from .registry import Preset, register_preset

    register_preset(Preset("layers", _validate, _apply, _from_settings, _describe, order=10, apply_order=30,
                           keys=("layers", "blocks")))
    declare(Setting(
        "layers", int, None, "run N transformer blocks ranked by AdaLN gates", order=80,
        command=Repl(usage="!layers N|off", summary="run N transformer blocks, ranked by their AdaLN gates (off: all)",
                     parse=_p_layers, complete=(("off",),), check=_check_depth, reply=_reply),
        control=Control("layers", row="presets", tooltip="blocks to run; 0: all", off=0),
        summary=lambda v: None if v is None else f"layers {v}", maps="RunSpec.preset layers + blocks"))


_register()
