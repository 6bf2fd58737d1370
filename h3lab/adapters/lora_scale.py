"""`RunSpec.lora_scale`: the run's LoRA adapter scaled per block and per modality of the output rows, sealed and
replayed byte for byte.

Contract
--------
- Value: the normal form of `h3lab.schema.lora_scale` ({"blocks": [[first, last, scale], ...], "refiner": s,
  "video": s, "audio": s, "text": s}; {} is the default and is never applied). `validate` normalises it.
- `apply(value, run)` (entered by `h3lab.run.resolve` right after the adapters, so the adapter is in the model):
  every LoRA layer gets a `LayerScale`: its block factor (the block's scale for `transformer_blocks.{i}`, the
  refiner's for `token_refiner`) and one factor per modality of its output rows (video, text, audio; the refiner's
  rows are text rows, so its layers take the text factor for every row). On exit the layers are put back as they
  were. A run whose model carries no adapter, or a block the model does not have, is refused in one line.
- The arithmetic (`LoraLinear.forward`, `training.lora`): a layer whose factors are all 0 returns the base
  projection's output unchanged -- exactly the block without the adapter. Otherwise the combine is the op table's
  `gated_residual(y, gate, index, d)` as before, with gate values `scaling * block * modality` (Python floats
  multiplied in float64, rounded once to the gate's dtype): one gate row when the three modality factors are equal
  (so scale 1 everywhere is byte-equal to no `lora_scale`), else three rows (video, text, audio) indexed by each
  output row's stream; a row whose factor is 0 takes the base output (a selection, no arithmetic). Each row's bytes
  therefore depend only on its own gate value: the rows of a modality whose factor is 1 are byte-equal, in that
  layer, to the unscaled adapter's.
- Per-modality factors need each packed row's stream: `apply` wraps the run's forward so every forward publishes
  the stream of each row from its own `video_indices` / `audio_indices` / `text_indices` (`row_streams`); a layer
  that sees another row count (a CP / SP placement cuts rows, token reduction merges them) refuses in one line. CUDA
  graphs of the forward are off while per-row gates run (the row index is a per-forward tensor a captured graph
  would hold by address).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ..execution import context, runtime
from ..config import AUDIO, TEXT, VIDEO
from ..errors import ValidationError
from ..run import FieldProvider, register_field
from ..schema.lora_scale import deepest_block, describe, normalise
from .lora import AdapterError, lora_layers

_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.")


def validate(value: Any) -> dict[str, Any]:
    try:
        return normalise(value)
    except ValidationError as err:
        raise AdapterError(str(err)) from None


def _row_streams(inputs: Any) -> torch.Tensor:
    """(S,) int64 stream of each packed row (0 video, 1 text, 2 audio), one tensor per layout (`runtime.derived`)."""
    v, a, t = inputs.video_indices, inputs.audio_indices, inputs.text_indices

    def make() -> torch.Tensor:
        out = torch.empty(v.numel() + a.numel() + t.numel(), dtype=torch.long, device=v.device)
        out[v], out[t], out[a] = VIDEO, TEXT, AUDIO
        return out

    return runtime.derived((v, a, t), "lora_row_streams", make)


@contextlib.contextmanager
def row_streams(inputs: Any) -> Iterator[torch.Tensor]:
    """Publish the packed rows' streams of `inputs` to the LoRA layers for the enclosed forward."""
    with context.use(lora_streams=_row_streams(inputs)) as ctx:  # a field of the one execution context
        yield ctx.lora_streams


@dataclass(frozen=True, eq=False)
class LayerScale:
    """One LoRA layer's factors (module docstring): `block`, and `streams` indexed by stream (video, text, audio)."""

    point: str
    block: float
    streams: tuple[float, float, float]
    _gates: dict = field(default_factory=dict, repr=False)

    @property
    def silent(self) -> bool:
        return all(self.block * s == 0 for s in self.streams)

    @property
    def uniform(self) -> bool:
        return len(set(self.streams)) == 1

    def state(self) -> tuple:
        """What a CUDA graph of the forward depends on (`module_tree.adapter_state`)."""
        return (self.block, self.streams)

    def uniform_scaling(self, scaling: float) -> float:
        return scaling * self.block * self.streams[0]

    def rows(self, rows: int, ref: torch.Tensor) -> torch.Tensor:
        """(rows,) int64 stream of each of the layer's output rows (the forward's rows, repeated per batch item)."""
        streams = context.current().lora_streams
        if streams is None:
            raise AdapterError(f"lora_scale at {self.point}: per-modality factors need the rows' streams; run the "
                               "model through the run spec (h3lab.run.denoise), not directly")
        S = streams.numel()
        if rows % S:
            raise AdapterError(f"lora_scale at {self.point}: the projection sees {rows} rows and the layout has {S} "
                               "(a CP / SP placement or token reduction): per-modality factors need one process and "
                               "the full layout")
        return streams if rows == S else runtime.derived((streams,), f"lora_rows_{rows}",
                                                         lambda: streams.repeat(rows // S))

    def gate(self, name: str, scaling: float, ref: torch.Tensor) -> torch.Tensor:
        """(3, out) gate rows (video, text, audio) of `scaling * block * factor`, rounded once to `ref`'s dtype."""
        key = (name, scaling, ref.shape[-1], ref.dtype, ref.device)
        found = self._gates.get(key)
        if found is None:
            values = [scaling * self.block * f for f in self.streams]
            found = torch.tensor(values, dtype=torch.float64).to(ref.dtype)[:, None].expand(3, ref.shape[-1])
            found = self._gates[key] = found.to(ref.device).contiguous()
        return found

    def keep_base(self, result: torch.Tensor, out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`out` with the rows whose factor is 0 taken from the base output `result`."""
        zero = [self.block * f == 0 for f in self.streams]
        if not any(zero):
            return out
        mask = torch.tensor(zero, device=index.device)[index]  # (rows,)
        shape = out.shape
        return torch.where(mask[:, None], result.reshape(index.numel(), -1), out.reshape(index.numel(), -1)
                           ).reshape(shape)


def layer_scales(value: dict[str, Any], model: Any) -> dict[str, LayerScale]:
    """module path -> `LayerScale` of every LoRA layer of `model` under `value` (module docstring)."""
    blocks: dict[int, float] = {b: s for first, last, s in value.get("blocks", []) for b in range(first, last + 1)}
    v, a, t = (float(value.get(m, 1.0)) for m in ("video", "audio", "text"))
    streams = tuple({VIDEO: v, TEXT: t, AUDIO: a}[i] for i in range(3))  # by stream number: the gate's row order
    out = {}
    for path, layer in lora_layers(model):
        point = getattr(layer.get_base_layer(), "point", path)
        found = _BLOCK.search(path)
        if found is not None:
            out[path] = LayerScale(point, blocks.get(int(found.group(1)), 1.0), streams)
        else:  # the token refiner: text rows only
            out[path] = LayerScale(point, float(value.get("refiner", 1.0)), (t, t, t))
    return out


@contextlib.contextmanager
def apply(value: dict[str, Any], run: Any) -> Iterator[Any]:
    """The provider's `apply` (module docstring)."""
    model = run.model
    layers = dict(lora_layers(model))
    text = describe(value)
    if not layers:
        raise AdapterError(f"lora_scale {text!r}: the run's model carries no LoRA adapter (load one: --lora PATH, "
                           "!lora PATH)")
    depth = int(model.config.num_layers)
    if deepest_block(value) >= depth:
        raise AdapterError(f"lora_scale {text!r}: block {deepest_block(value)} does not exist (the model has blocks "
                           f"0..{depth - 1})")
    scales = layer_scales(value, model)
    per_row = any(not s.uniform and not s.silent for s in scales.values())
    changed = run.claim("lora_scale", "model:adapter_scale")
    inner = run.forward

    def forward(m: Any, inputs: Any, video: torch.Tensor, audio: torch.Tensor, i: int):
        with row_streams(inputs):
            return inner(m, inputs, video, audio, i)

    for path, layer in layers.items():
        layer._h3_row_scale = scales[path]
    try:
        with contextlib.ExitStack() as stack:
            if per_row:
                from ..execution import graphs

                stack.enter_context(graphs.use_graphs("strict", False))
                stack.enter_context(graphs.use_graphs("fast", False))
            yield run.replace(changed=changed, forward=forward if per_row else inner)
    finally:
        for layer in layers.values():
            layer.__dict__.pop("_h3_row_scale", None)


register_field("lora_scale", FieldProvider(validate=validate, apply=apply))
