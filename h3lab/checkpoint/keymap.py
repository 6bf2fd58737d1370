"""Key mapping between MiniMax-H3 checkpoint layouts and Diffusers' `MiniMaxH3Transformer3DModel` keys.

Layouts
- ``diffusers``   keys are already Diffusers keys; tensors pass through untouched.
- ``minimax``     the MiniMaxAI original shards: original module names, fused `attn.qkv_proj` with rows interleaved
                  per head `[h0: q k v, h1: q k v, ...]`, `mlp.fc1` stored `[gate; value]`, a `rope.inv_freq`
                  buffer. Default qkv layout: ``interleaved``.
- ``single_file`` Comfy-style single files: original names, but the fused QKV stacked `[q; k; v]`. Default qkv
                  layout: ``stacked``.
Stacked and interleaved fused QKV have identical keys and shapes, so they cannot be told apart from the file; the
rule here is *MiniMax shards (a folder) = interleaved, a single file = stacked*, and `qkv_layout=` overrides it.
`detect_layout` only decides original-vs-Diffusers names.

Mapping original -> Diffusers (facts §9; checked byte for byte against Diffusers'
`convert_minimax_h3_transformer_checkpoint_to_diffusers` in tests/checkpoint):
- module prefixes: `blocks.N` -> `transformer_blocks.N`, `token_refiner.blocks.N` -> `token_refiner.refiner_blocks.N`,
  `video_patch_proj` -> `proj_in`, `audio_patch_proj` -> `audio_proj_in`, `condition_proj` -> `context_embedder`,
  `time_embedder.proj_in/proj_out` -> `time_embedder.linear_1/linear_2`, `final_layer.{norm, adaln_proj.linear,
  video_out, audio_out}` -> `norm_out.norm`, `norm_out.linear`, `proj_out`, `audio_proj_out`;
- inside a (refiner) block: `attn.q_norm/k_norm/out_proj` -> `attn.norm_q/norm_k/to_out.0`,
  `mlp.fc1/fc2` -> `ff.net.0.proj/ff.net.2`;
- `attn.qkv_proj.weight` (3*H*D, hidden) -> `to_q/to_k/to_v.weight` (H*D, hidden) each. Stacked: three row slices
  (views, no copy). Interleaved: rows (H, 3, D) regrouped -> one copy per projection (no strided view can express
  it). H and D come from the checkpoint itself (D = the block's `attn.q_norm.weight` length), checked against the
  config when one is given;
- `mlp.fc1` `[gate; value]` -> `ff.net.0.proj` `[value; gate]` (Diffusers' SwiGLU order): one copy;
- `rope.inv_freq` is dropped (recomputed from the config); `adaln_t_table` (a pruned checkpoint) is refused.
Every other key is passed through; the loader reports keys the model does not have.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from ..errors import CheckpointError

LAYOUTS = ("auto", "diffusers", "minimax", "single_file")
QKV_LAYOUTS = ("stacked", "interleaved")
DEFAULT_QKV = {"minimax": "interleaved", "single_file": "stacked"}
PRUNED_KEY = "adaln_t_table"
DROPPED_KEYS = ("rope.inv_freq",)

# Top-level prefixes (original -> Diffusers), longest first so `time_embedder.proj_in.` wins over shorter ones.
_PREFIXES = (
    ("final_layer.adaln_proj.linear.", "norm_out.linear."),
    ("token_refiner.blocks.", "token_refiner.refiner_blocks."),
    ("time_embedder.proj_out.", "time_embedder.linear_2."),
    ("time_embedder.proj_in.", "time_embedder.linear_1."),
    ("final_layer.video_out.", "proj_out."),
    ("final_layer.audio_out.", "audio_proj_out."),
    ("video_patch_proj.", "proj_in."),
    ("audio_patch_proj.", "audio_proj_in."),
    ("final_layer.norm.", "norm_out.norm."),
    ("condition_proj.", "context_embedder."),
    ("blocks.", "transformer_blocks."),
)
# Submodules of a transformer block or refiner block (original -> Diffusers).
_BLOCK_MODULES = {
    "attn.q_norm": "attn.norm_q",
    "attn.k_norm": "attn.norm_k",
    "attn.out_proj": "attn.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
}
_BLOCK_RE = re.compile(r"^(?P<prefix>(?:token_refiner\.refiner_blocks|transformer_blocks)\.\d+\.)(?P<rest>.+)$")
_ORIGINAL_MARKERS = ("video_patch_proj.", "audio_patch_proj.", "condition_proj.", "final_layer.", "blocks.")
_DIFFUSERS_MARKERS = ("transformer_blocks.", "proj_in.", "audio_proj_in.", "context_embedder.", "norm_out.")


# ------------------------------------------------------------------------------------------------- layout
def check_layout(layout: str, qkv_layout: str | None) -> None:
    if layout not in LAYOUTS:
        raise CheckpointError(f"layout={layout!r}: must be one of {', '.join(LAYOUTS)}")
    if qkv_layout is not None and qkv_layout not in QKV_LAYOUTS:
        raise CheckpointError(
            f"qkv_layout={qkv_layout!r}: must be one of {', '.join(QKV_LAYOUTS)} (or None for the layout's default)"
        )
    if layout == "diffusers" and qkv_layout is not None:
        raise CheckpointError(
            f"qkv_layout={qkv_layout!r} with layout='diffusers': Diffusers keys have no fused QKV to split"
        )


def detect_layout(keys, source: str, single_file: bool) -> str:
    """'diffusers' for Diffusers names; else 'single_file' for one weight file, 'minimax' for a folder of shards."""
    keys = list(keys)
    original = any(k.startswith(_ORIGINAL_MARKERS) or ".attn.qkv_proj." in k for k in keys)
    diffusers = any(k.startswith(_DIFFUSERS_MARKERS) or ".attn.to_q." in k for k in keys)
    if original == diffusers:
        sample = keys[0] if keys else "<no keys>"
        what = "both original MiniMax and Diffusers" if original else "neither original MiniMax nor Diffusers"
        raise CheckpointError(
            f"{source}: keys look like {what} transformer keys (e.g. {sample!r}); pass layout= explicitly"
        )
    if diffusers:
        return "diffusers"
    return "single_file" if single_file else "minimax"


# -------------------------------------------------------------------------------------------- original -> diffusers
def rename_original_key(key: str) -> str:
    """One original key -> its Diffusers name (fused qkv keeps `attn.qkv_proj`; it is split separately)."""
    for old, new in _PREFIXES:
        if key.startswith(old):
            key = new + key[len(old):]
            break
    m = _BLOCK_RE.match(key)
    if m:
        rest = m["rest"]
        for old, new in _BLOCK_MODULES.items():
            if rest.startswith(old + "."):
                rest = new + rest[len(old):]
                break
        key = m["prefix"] + rest
    return key


def original_to_diffusers(
    tensors: Mapping[str, torch.Tensor],
    qkv_layout: str,
    config=None,
    source: str = "checkpoint",
    origin: Mapping[str, str] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Map an original-layout state dict to Diffusers keys. Returns (tensors, new key -> original key).

    `origin` (original key -> file) only sharpens error messages; `config` (an H3Config) is checked against the
    head geometry read from the checkpoint."""
    if qkv_layout not in QKV_LAYOUTS:
        raise CheckpointError(f"qkv_layout={qkv_layout!r}: must be one of {', '.join(QKV_LAYOUTS)}")

    def where(key: str) -> str:
        return (origin or {}).get(key, source)

    if PRUNED_KEY in tensors:
        raise CheckpointError(
            f"{where(PRUNED_KEY)}: key {PRUNED_KEY!r} {tuple(tensors[PRUNED_KEY].shape)} marks a pruned MiniMax-H3 "
            "checkpoint (time_embedder replaced by a table), which this model cannot load; use the unpruned release"
        )
    out: dict[str, torch.Tensor] = {}
    from_key: dict[str, str] = {}

    def put(new: str, value: torch.Tensor, old: str) -> None:
        if new in out:
            raise CheckpointError(f"{where(old)}: keys {from_key[new]!r} and {old!r} both map to {new!r}")
        out[new] = value
        from_key[new] = old

    for key, value in tensors.items():
        if key in DROPPED_KEYS:
            continue
        new = rename_original_key(key)
        if new.endswith(".attn.qkv_proj.weight"):
            base = new[: -len("qkv_proj.weight")]
            norm_key = key[: -len("qkv_proj.weight")] + "q_norm.weight"
            parts = _split_qkv(key, value, norm_key, tensors, qkv_layout, config, where)
            for name, part in zip(("to_q", "to_k", "to_v"), parts):
                put(f"{base}{name}.weight", part, key)
        elif new.endswith((".ff.net.0.proj.weight", ".ff.net.0.proj.bias")):
            put(new, _swap_halves(key, value, where), key)
        else:
            put(new, value, key)
    return out, from_key


def _split_qkv(key, fused, norm_key, tensors, qkv_layout, config, where) -> tuple[torch.Tensor, ...]:
    rows = fused.shape[0]
    if fused.ndim != 2 or rows % 3:
        raise CheckpointError(f"{where(key)}: key {key!r} has shape {list(fused.shape)}: a fused QKV needs 3*H*D rows")
    if qkv_layout == "stacked":
        n = rows // 3  # (3*H*D, hidden) -> three contiguous (H*D, hidden) row slices: views into the mapped file
        return fused[:n], fused[n : 2 * n], fused[2 * n :]
    if norm_key not in tensors:
        raise CheckpointError(f"{where(key)}: key {key!r} needs {norm_key!r} (its head width) to de-interleave")
    head_dim = int(tensors[norm_key].shape[0])
    if rows % (3 * head_dim):
        raise CheckpointError(f"{where(key)}: key {key!r} has {rows} rows, not a multiple of 3 x head_dim {head_dim}")
    heads = rows // (3 * head_dim)
    if config is not None and (heads, head_dim) != (config.num_attention_heads, config.attention_head_dim):
        raise CheckpointError(
            f"{where(key)}: key {key!r} holds {heads} heads x {head_dim}, config says "
            f"{config.num_attention_heads} x {config.attention_head_dim}"
        )
    per_head = fused.view(heads, 3, head_dim, fused.shape[1])  # rows grouped [head][q, k, v][d]
    return tuple(per_head[:, j].reshape(heads * head_dim, fused.shape[1]) for j in range(3))


def _swap_halves(key, value, where) -> torch.Tensor:
    if value.shape[0] % 2:
        raise CheckpointError(f"{where(key)}: key {key!r} has {value.shape[0]} rows: fc1 needs [gate; value] halves")
    half = value.shape[0] // 2
    return torch.cat([value[half:], value[:half]], dim=0)  # [gate; value] -> [value; gate]


# -------------------------------------------------------------------------------------------- diffusers -> original
def diffusers_to_original(
    state_dict: Mapping[str, torch.Tensor], qkv_layout: str, num_heads: int
) -> dict[str, torch.Tensor]:
    """The inverse mapping: write a Diffusers state dict in the original MiniMax naming with a fused QKV in
    `qkv_layout` (used to produce MiniMax-format files, e.g. the test fixtures). Adds no `rope.inv_freq`."""
    if qkv_layout not in QKV_LAYOUTS:
        raise CheckpointError(f"qkv_layout={qkv_layout!r}: must be one of {', '.join(QKV_LAYOUTS)}")
    inverse_prefix = sorted(((new, old) for old, new in _PREFIXES), key=lambda p: -len(p[0]))
    inverse_block = {new: old for old, new in _BLOCK_MODULES.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith((".attn.to_k.weight", ".attn.to_v.weight")):
            continue
        m = _BLOCK_RE.match(key)
        if m:
            rest = m["rest"]
            if rest == "attn.to_q.weight":
                base = key[: -len("to_q.weight")]
                q, k, v = (state_dict[base + n + ".weight"] for n in ("to_q", "to_k", "to_v"))
                if qkv_layout == "stacked":
                    value = torch.cat([q, k, v], dim=0)
                else:
                    head_dim = q.shape[0] // num_heads
                    per_head = [t.view(num_heads, head_dim, -1) for t in (q, k, v)]  # (H, D, hidden) each
                    value = torch.stack(per_head, dim=1).reshape(-1, q.shape[1])  # rows [h][q, k, v][d]
                rest = "attn.qkv_proj.weight"
            else:
                for new, old in inverse_block.items():
                    if rest.startswith(new + "."):
                        rest = old + rest[len(new):]
                        break
                if rest.startswith("mlp.fc1."):
                    half = value.shape[0] // 2
                    value = torch.cat([value[half:], value[:half]], dim=0)  # [value; gate] -> [gate; value]
            key = m["prefix"] + rest
        for new, old in inverse_prefix:
            if key.startswith(new):
                key = old + key[len(new):]
                break
        out[key] = value
    return out
