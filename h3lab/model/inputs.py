"""Validation of `H3Transformer.forward` inputs; every failure is one `ModelInputError` line naming value and rule.

Diffusers' two checks come first with Diffusers' messages (`position_ids` must be (seq_len, 3); `token_tags` and
`timestep_indices` must be (seq_len,)). Then: tensor types, 3-D inputs of the config's feature widths, one batch size
across the three inputs, 1-D float `timestep`, int64 index tensors whose lengths match the inputs' row counts, and
index values in range (packed positions in [0, seq_len), timestep indices in [0, num_timesteps), tags in {0, 1, 2}).
The range checks read every tensor's min/max back to the host together (one device sync), and the permutation check of
`key_order` reads it back once: both are kept while the tensors are the same live objects at the same `_version` and
data pointer (`runtime.derived`), so a forward on the layout tensors of the last one (every denoising pass, a CUDA
graph replay) checks them without a device sync; a changed or new tensor is read again.
"""

from __future__ import annotations

import torch

from ..execution import runtime
from ..config import NUM_MODALITIES, H3Config
from ..errors import H3Error


class ModelInputError(H3Error):
    """A forward input has the wrong shape, dtype, width or index range."""


def check_inputs(
    config: H3Config,
    hidden_states,
    audio_hidden_states,
    encoder_hidden_states,
    timestep,
    timestep_indices,
    token_tags,
    position_ids,
    video_indices,
    audio_indices,
    text_indices,
) -> None:
    named = {
        "hidden_states": hidden_states, "audio_hidden_states": audio_hidden_states,
        "encoder_hidden_states": encoder_hidden_states, "timestep": timestep, "timestep_indices": timestep_indices,
        "token_tags": token_tags, "position_ids": position_ids, "video_indices": video_indices,
        "audio_indices": audio_indices, "text_indices": text_indices,
    }
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise ModelInputError(f"{name} is a {type(value).__name__}: must be a torch.Tensor")
    seq_len = _check_diffusers_rules(position_ids, token_tags, timestep_indices)
    _check_streams(config, named)
    _check_timestep(timestep)
    _check_index_tensors(named)
    _check_index_ranges(named, seq_len, timestep.numel())


def _check_diffusers_rules(position_ids, token_tags, timestep_indices) -> int:
    """Diffusers' checks, Diffusers' wording; then a real `position_ids` dtype. Returns seq_len."""
    if position_ids.ndim != 2 or position_ids.shape[-1] != 3:
        raise ModelInputError(f"`position_ids` must be a `(seq_len, 3)` tensor, got {list(position_ids.shape)}.")
    seq_len = position_ids.shape[0]
    if token_tags.shape != (seq_len,) or timestep_indices.shape != (seq_len,):
        raise ModelInputError(
            "`token_tags` and `timestep_indices` must both be `(seq_len,)` tensors matching `position_ids`, got "
            f"{list(token_tags.shape)} and {list(timestep_indices.shape)} for seq_len={seq_len}."
        )
    if position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise ModelInputError(f"position_ids dtype {position_ids.dtype}: must be a real (float or integer) tensor")
    return seq_len


def _check_streams(c: H3Config, named: dict[str, torch.Tensor]) -> None:
    """The three row inputs: 3-D, floating point, the config's feature widths, one batch size."""
    p = c.patch_size
    video_rule = f"video_patch_dim = in_channels*prod(patch_size) = {c.in_channels}*{p[0]}*{p[1]}*{p[2]}"
    widths = {
        "hidden_states": (c.video_patch_dim, video_rule),
        "audio_hidden_states": (c.audio_in_channels, "audio_in_channels"),
        "encoder_hidden_states": (c.text_dim, "text_dim"),
    }
    for name, (width, rule) in widths.items():
        x = named[name]
        if x.ndim != 3:
            raise ModelInputError(f"{name} has shape {list(x.shape)}: must be (batch, rows, {width})")
        if x.shape[-1] != width:
            raise ModelInputError(f"{name} has {x.shape[-1]} features per row: the config needs {rule} = {width}")
        if not x.is_floating_point():
            raise ModelInputError(f"{name} dtype {x.dtype}: must be a floating-point tensor")
    batches = {name: named[name].shape[0] for name in widths}
    if len(set(batches.values())) != 1:
        raise ModelInputError(f"batch sizes differ across inputs {batches}: all three must share one batch size")


def _check_timestep(timestep: torch.Tensor) -> None:
    if timestep.ndim != 1 or timestep.numel() == 0:
        raise ModelInputError(
            f"timestep has shape {list(timestep.shape)}: must be (num_timesteps,) with at least one value"
        )
    if not timestep.is_floating_point():
        raise ModelInputError(f"timestep dtype {timestep.dtype}: must be a floating-point tensor of values in [0, 1]")


_ROW_SOURCES = {  # index tensor -> the row input it holds one packed position per row of
    "video_indices": "hidden_states",
    "audio_indices": "audio_hidden_states",
    "text_indices": "encoder_hidden_states",
}


def _check_index_tensors(named: dict[str, torch.Tensor]) -> None:
    """Every index tensor int64; the stream indices one per row of their input."""
    for name in ("timestep_indices", "token_tags", *_ROW_SOURCES):
        t = named[name]
        if t.dtype != torch.int64:
            raise ModelInputError(f"{name} dtype {t.dtype}: index tensors must be int64 (torch.long)")
    for name, src_name in _ROW_SOURCES.items():
        t, src = named[name], named[src_name]
        if t.shape != (src.shape[1],):
            raise ModelInputError(
                f"{name} has shape {list(t.shape)}: must be ({src.shape[1]},), "
                f"one packed position per row of {src_name}"
            )


def _check_index_ranges(named: dict[str, torch.Tensor], seq_len: int, num_timesteps: int) -> None:
    """Index values in range (every tensor's min/max read back to the host together: one device sync, kept while the
    tensors are unchanged)."""
    limits = {
        "video_indices": (seq_len, "a packed position in [0, seq_len)"),
        "audio_indices": (seq_len, "a packed position in [0, seq_len)"),
        "text_indices": (seq_len, "a packed position in [0, seq_len)"),
        "timestep_indices": (num_timesteps, "an index into timestep, in [0, num_timesteps)"),
        "token_tags": (NUM_MODALITIES, "a modality tag in {0 video, 1 text, 2 audio}"),
    }
    present = [name for name in limits if named[name].numel()]
    if not present:
        return
    tensors = tuple(named[name] for name in present)
    bounds = runtime.derived(tensors, f"index_bounds:{','.join(present)}",
                             lambda: torch.stack([torch.stack(torch.aminmax(t)) for t in tensors]).tolist())
    for name, (lo, hi) in zip(present, bounds):
        limit, rule = limits[name]
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise ModelInputError(f"{name} holds {bad}: each value must be {rule} (bound {limit})")


def check_key_order(key_order, position_ids) -> None:
    """`key_order` must be an int64 (S,) permutation of 0..S-1 on the inputs' device (checked once per forward)."""
    seq_len = position_ids.shape[0]
    if not isinstance(key_order, torch.Tensor) or key_order.dtype != torch.int64 or tuple(key_order.shape) != (seq_len,):
        got = f"{key_order.dtype} {list(key_order.shape)}" if isinstance(key_order, torch.Tensor) else type(key_order).__name__
        raise ModelInputError(f"key_order is {got}: must be an int64 tensor of shape ({seq_len},)")
    if key_order.device != position_ids.device:
        raise ModelInputError(f"key_order is on {key_order.device}: must be on {position_ids.device} with the layout")
    if not runtime.derived((key_order,), "is_permutation", lambda: torch.equal(
            torch.sort(key_order).values, torch.arange(seq_len, device=key_order.device))):
        raise ModelInputError(f"key_order is not a permutation of 0..{seq_len - 1}")
