"""Helpers for tests/checkpoint: random transformer state dicts (real Diffusers class, seeded), writers for every
checkpoint layout, a header-only sparse 33B snapshot, and process memory/IO counters."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from h3lab.checkpoint import keymap
from h3lab.checkpoint.loader import released_dtype
from h3lab.checkpoint.tiny import randomize_
from h3lab.config import H3Config

# A second small config with a different head geometry (3 heads x 12, rotary 12 = 2*3*2 of 12), so the QKV
# de-interleave is exercised with H != 2 and D != inner/2.
OTHER = H3Config(
    num_attention_heads=3, attention_head_dim=12, hidden_size=20, num_layers=3, num_refiner_layers=1, ffn_dim=28,
    in_channels=4, audio_in_channels=6, text_dim=10, freq_dim=8, time_embed_hidden_dim=16, time_embed_dim=8,
    rope_freq_dim=2,
)


def random_state_dict(config: H3Config, seed: int, policy: str = "released") -> dict[str, torch.Tensor]:
    """A Diffusers-keyed state dict of `MiniMaxH3Transformer3DModel(config)` with seeded random weights."""
    from diffusers import MiniMaxH3Transformer3DModel

    model = randomize_(MiniMaxH3Transformer3DModel(**config.to_diffusers()), seed, f"test-{seed}")
    return {
        k: v.detach().to(released_dtype(k) if policy == "released" else torch.float32).contiguous()
        for k, v in model.state_dict().items()
    }


def config_json(config: H3Config) -> str:
    return json.dumps({"_class_name": "MiniMaxH3Transformer3DModel", **config.to_diffusers()}, indent=2)


def write_shards(folder: Path, sd: dict, stem: str, shards: int, index_name: str | None) -> list[Path]:
    """Split `sd` (in key order) into `shards` files `{stem}-0000i-of-0000n.safetensors` (+ index json)."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = list(sd)
    per = math.ceil(len(keys) / shards)
    files, weight_map = [], {}
    for i in range(shards):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        files.append(folder / name)
    if index_name:
        total = sum(v.numel() * v.element_size() for v in sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / index_name).write_text(json.dumps(index, indent=2))
    return files


def write_diffusers_component(folder: Path, sd: dict, config: H3Config, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config_json(config))
    if shards == 1:
        save_file(sd, str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    else:
        write_shards(folder, sd, "diffusion_pytorch_model", shards, "diffusion_pytorch_model.safetensors.index.json")
    return folder


def original_state_dict(sd: dict, config: H3Config, qkv_layout: str) -> dict[str, torch.Tensor]:
    """`sd` in MiniMax original naming, fused QKV in `qkv_layout`, with the float32 `rope.inv_freq` buffer."""
    mapped = keymap.diffusers_to_original(sd, qkv_layout, config.num_attention_heads)
    out = {k: v.contiguous() for k, v in mapped.items()}
    f = config.rope_freq_dim
    out["rope.inv_freq"] = 1.0 / (config.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))
    return out


def copy_component(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ----------------------------------------------------------------------------------------------- sparse 33B
def write_header_only(path: Path, entries: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """A valid safetensors file whose data section is a sparse hole: header written, file extended to size."""
    sizes = {"F32": 4, "BF16": 2}
    order = sorted(entries, key=lambda k: (-sizes[entries[k][0]], k))  # safetensors' own alignment order
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for k in order:
        dtype, shape = entries[k]
        n = math.prod(shape) * sizes[dtype]
        header[k] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def write_sparse_full_component(folder: Path, shards: int = 12) -> int:
    """`transformer/` of the released 33B architecture (H3Config.full(), released dtypes) as sparse shards + index.
    Returns the total data bytes (~66 GB); the disk holds only the headers."""
    from diffusers import MiniMaxH3Transformer3DModel

    config = H3Config.full()
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config.to_diffusers())
    shapes = {
        k: ("F32" if released_dtype(k) == torch.float32 else "BF16", tuple(v.shape))
        for k, v in model.state_dict().items()
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config_json(config))
    keys = list(shapes)
    per = math.ceil(len(keys) / shards)
    total, weight_map = 0, {}
    for i in range(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: shapes[k] for k in keys[i * per:(i + 1) * per]}
        total += write_header_only(folder / name, part)
        weight_map.update({k: name for k in part})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    return total


# --------------------------------------------------------------------------------------------- process stats
def proc_status() -> dict[str, int]:
    """VmRSS / VmHWM / RssAnon / RssFile in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def bytes_read() -> int:
    """Bytes this process has read through read/pread so far (/proc/self/io rchar)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def poison(path: Path, offset: int, n: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]
