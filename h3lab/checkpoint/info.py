"""`h3lab --info`: the fingerprint of a snapshot, read from configs and safetensors headers only.

Contract
- `snapshot_info(path=None, device=None) -> dict` (JSON-serialisable) and `format_info(info) -> str`. `path=None`
  means the embedded tiny snapshot (`tiny.default_snapshot()`); a snapshot root, a component folder or a single
  weight file are accepted. A bad path raises a one-line `CheckpointError`.
- Reported: the transformer architecture fingerprint (`H3Config.fingerprint()`, and which preset it equals), the
  variants present (`transformer` -> t2va/fl2va, `transformer_ref` -> ref2va) and the other components, per component
  the class, file count, bytes, parameter count (from the headers), stored dtypes per module group and the dtype
  policy they make up, a content hash per component and for the snapshot, and the device.
- Content hash per component: `fingerprint.component_hash` (``HASH_SCHEME``: headers, sizes, small files and a
  64-byte sample per tensor; see `fingerprint.py`), re-exported here; the snapshot hash is SHA-256 over the
  components' names and hashes.
- Apart from the samples, no tensor data is read or mapped (tests count the bytes read on a sparse 33B-sized
  snapshot and poison unsampled data bytes of a copy).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from ..config import FP32_MODULES, ConfigError, H3Config
from ..errors import CheckpointError
from . import discovery
from .fingerprint import HASH_SCHEME, SAMPLE_BYTES, component_files, component_hash
from .native import native_form

__all__ = ["snapshot_info", "format_info", "component_hash", "HASH_SCHEME", "SAMPLE_BYTES"]

TRANSFORMER_CLASS = "MiniMaxH3Transformer3DModel"
VARIANT_WORKFLOWS = {"transformer": ("t2va", "fl2va"), "transformer_ref": ("ref2va",)}


# ---------------------------------------------------------------------------------------------------- dtypes
def _released(key: str) -> str:
    return "F32" if any(part in FP32_MODULES for part in key.split(".")) else "BF16"


def _group(key: str) -> str:
    parts = key.split(".")
    # Transformers models nest one level deeper (model.language_model.*, model.visual.*).
    return ".".join(parts[:2]) if parts[0] == "model" and len(parts) > 2 else parts[0]


def _transformer_layout(keys) -> str | None:
    """'diffusers' / 'original' when the keys are H3 transformer keys in either naming, else None."""
    from . import keymap

    try:
        return "diffusers" if keymap.detect_layout(keys, "", single_file=True) == "diffusers" else "original"
    except CheckpointError:
        return None


def _dtype_summary(tensors: dict[str, discovery.TensorInfo], transformer: bool) -> tuple[dict, str, str]:
    if transformer and _transformer_layout(tensors) == "original":
        from .keymap import rename_original_key  # group and check original names under their Diffusers names

        tensors = {rename_original_key(k): t for k, t in tensors.items()}
    groups: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        g = groups.setdefault(_group(key), {"parameters": 0, "dtypes": {}})
        g["parameters"] += t.numel
        g["dtypes"][t.dtype] = g["dtypes"].get(t.dtype, 0) + t.numel
    dtypes = sorted({t.dtype for t in tensors.values()})
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    if transformer:
        off = [k for k, t in tensors.items() if t.dtype != _released(k)]
        if not off:
            return groups, "released", "float32: " + ", ".join(FP32_MODULES[:-1]) + "; bfloat16: the rest"
        if dtypes == ["F32"]:
            return groups, "float32", "every tensor float32"
        return groups, "non-released", f"{len(off)} tensors differ from released, e.g. {off[0]} {tensors[off[0]].dtype}"
    if len(dtypes) == 1:
        return groups, names.get(dtypes[0], dtypes[0]), f"every tensor {names.get(dtypes[0], dtypes[0])}"
    return groups, "mixed", "stored dtypes " + ", ".join(dtypes) + " (see groups)"


# --------------------------------------------------------------------------------------------------- report
def snapshot_info(path: str | os.PathLike | None = None, device: str | None = None) -> dict[str, Any]:
    """The fingerprint report of a snapshot root, component folder or weight file (see the module docstring)."""
    start = time.perf_counter()
    if path is None:
        from .tiny import default_snapshot

        path = default_snapshot()
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such snapshot, component folder or weight file")
    if path.is_file() and path.name.endswith(".index.json"):
        path = path.parent  # an index names the shards of its folder: report the folder
    info: dict[str, Any] = {"path": str(path.resolve()), "hash_scheme": HASH_SCHEME}
    if discovery.is_snapshot_root(path):
        snap = discovery.open_snapshot(path)
        info["kind"] = "snapshot"
        info["pipeline_class"] = snap.model_index.get("_class_name", "")
        entries = {name: (folder, *snap.library_class(name)) for name, folder in sorted(snap.components.items())}
        info["missing_components"] = sorted(snap.missing)
        manifest = path / "h3lab_manifest.json"
        if manifest.is_file():
            m = discovery.read_json(manifest)
            info["tiny"] = {"version": m.get("version"), "seed": m.get("seed")}
        native = native_form(path)
        if native is not None:
            info["native"] = native.to_dict()
    elif path.suffix == ".safetensors" or (path.is_dir() and any(path.glob("*.json"))):
        info["kind"] = "component" if path.is_dir() else "file"
        entries = {path.stem if path.is_file() else path.name: (path, "", "")}
        info["missing_components"] = []
    else:
        raise CheckpointError(
            f"{path}: not a snapshot root (model_index.json), component folder (*.json) or .safetensors file"
        )

    components: dict[str, Any] = {}
    configs: dict[str, H3Config] = {}
    for name, (folder, library, cls) in entries.items():
        comp: dict[str, Any] = {"library": library, "class": cls or _class_from_config(folder), "path": str(folder)}
        config = _transformer_config(folder)
        is_transformer = comp["class"] == TRANSFORMER_CLASS or config is not None
        if config is not None:
            configs[name] = config
            comp["class"] = comp["class"] or TRANSFORMER_CLASS
        files = component_files(folder)
        comp["files"] = len(files)
        comp["bytes"] = sum(f.stat().st_size for f in files)
        weights = _weights(folder)
        if weights is not None:
            tensors = {k: weights.headers[f].tensors[k] for k, f in weights.key_files.items()}
            comp["weight_files"] = len(weights.files)
            comp["sharded"] = weights.index is not None
            comp["parameters"] = sum(t.numel for t in tensors.values())
            is_transformer = is_transformer or _transformer_layout(tensors) is not None
            if is_transformer and not comp["class"]:
                comp["class"] = TRANSFORMER_CLASS
            comp["groups"], comp["dtype_policy"], comp["dtype_note"] = _dtype_summary(tensors, is_transformer)
        comp["hash"] = component_hash(folder)
        components[name] = comp
    info["components"] = components
    info["variants"] = {
        v: {"present": v in components, "workflows": list(w)} for v, w in VARIANT_WORKFLOWS.items()
    } if info["kind"] == "snapshot" else {}
    info["config"] = _config_report(configs)
    h = hashlib.sha256(HASH_SCHEME.encode())
    for name, comp in components.items():
        h.update(f"{name}\0{comp['hash']}\0".encode())
    info["snapshot_hash"] = h.hexdigest()
    info["scan_s"] = round(time.perf_counter() - start, 4)
    info["device"] = _device_report(device)
    return info


def _transformer_config(folder: Path) -> H3Config | None:
    cfg = (folder if folder.is_dir() else folder.parent) / "config.json"
    if not cfg.is_file():
        return None
    data = discovery.read_json(cfg)
    if data.get("_class_name") not in (None, TRANSFORMER_CLASS):
        return None
    try:
        return H3Config.from_dict(data)
    except (ConfigError, TypeError):
        if data.get("_class_name") == TRANSFORMER_CLASS:
            raise CheckpointError(f"{cfg}: not a valid {TRANSFORMER_CLASS} config") from None
        return None


def _weights(folder: Path) -> discovery.WeightFiles | None:
    """The component's weight files, or None for a config-only component (tokenizer/, processor/, scheduler/)."""
    if folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*" + discovery.INDEX_SUFFIX)):
        return None
    return discovery.find_weight_files(folder)


def _class_from_config(folder: Path) -> str:
    """`_class_name` (Diffusers) or `architectures[0]` (transformers) of a component folder's config, if any."""
    folder = folder if folder.is_dir() else folder.parent
    for name in ("config.json", "scheduler_config.json"):
        if (folder / name).is_file():
            data = discovery.read_json(folder / name)
            arch = data.get("architectures") or [""]
            return str(data.get("_class_name") or arch[0])
    return ""


def _config_report(configs: dict[str, H3Config]) -> dict[str, Any]:
    if not configs:
        return {}
    presets = {"full": H3Config.full(), "tiny": H3Config.tiny()}
    out: dict[str, Any] = {}
    first = next(iter(configs.values()))
    for name, cfg in configs.items():
        preset = next((p for p, ref in presets.items() if ref == cfg), "custom")
        out[name] = {"preset": preset, "fingerprint": cfg.fingerprint()}
    out["variants_share_config"] = all(cfg == first for cfg in configs.values())
    return out


def _device_report(device: str | None) -> dict[str, Any]:
    import torch

    resolved = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(resolved)
    except RuntimeError:
        raise CheckpointError(f"device={device!r}: not a torch device string (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    out: dict[str, Any] = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(f"device={device!r}: CUDA is not available on this machine")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        out["name"] = torch.cuda.get_device_name(index)
        out["count"] = torch.cuda.device_count()
        out["memory_gib"] = round(torch.cuda.get_device_properties(index).total_memory / 2**30, 1)
    return out


# -------------------------------------------------------------------------------------------------- formatting
def format_info(info: dict[str, Any]) -> str:
    """Human-readable `--info` text (the `--json` form is `json.dumps(info)`)."""
    lines = [f"snapshot     {info['path']}  ({info['kind']})"]
    if info.get("tiny"):
        seed = info["tiny"]["seed"]
        lines[0] += (f"  [h3lab tiny snapshot {info['tiny']['version']}, seed {seed}]" if seed is not None
                     else f"  [h3lab trained snapshot {info['tiny']['version']}]")
    shown: list[dict] = []
    for name, rep in ((k, v) for k, v in info.get("config", {}).items() if isinstance(v, dict)):
        fp = rep["fingerprint"]
        if fp in shown:
            continue  # identical architecture already printed (transformer_ref usually equals transformer)
        shown.append(fp)
        same = [k for k, v in info["config"].items() if isinstance(v, dict) and v["fingerprint"] == fp]
        lines.append(
            f"architecture {', '.join(same)}: preset {rep['preset']}; {fp['num_layers']} blocks, "
            f"{fp['num_refiner_layers']} refiner; "
            f"{fp['num_attention_heads']}x{fp['attention_head_dim']} heads (inner {fp['inner_dim']}), hidden "
            f"{fp['hidden_size']}, ffn {fp['ffn_dim']}; rotary {fp['rotary_dim']}/{fp['attention_head_dim']} theta "
            f"{fp['rope_theta']:g}; video {fp['in_channels']}ch patch {tuple(fp['patch_size'])} "
            f"({fp['video_patch_dim']}/row), audio {fp['audio_in_channels']}ch, text {fp['text_dim']}; "
            f"time {fp['freq_dim']}->{fp['time_embed_hidden_dim']}"
            f"->{fp['time_embed_dim']}"
        )
    if info.get("variants"):
        parts = [
            f"{v} ({'/'.join(r['workflows'])}): {'yes' if r['present'] else 'no'}" for v, r in info["variants"].items()
        ]
        lines.append("variants     " + "   ".join(parts))
        if sum(isinstance(v, dict) for v in info.get("config", {}).values()) > 1:
            lines[-1] += f"   same config: {'yes' if info['config']['variants_share_config'] else 'NO'}"
    if info.get("native"):
        n = info["native"]
        lines.append(f"native       {n['width']}x{n['height']}, {n['frames']} frames (the CLI, REPL and panel start "
                     f"there); prompts like \"{n['example']}\" ({n['prompt_form']})")
    if info.get("missing_components"):
        lines.append("missing      " + ", ".join(info["missing_components"]))
    dev = info["device"]
    gpu = f" ({dev['name']}, {dev['memory_gib']} GiB)" if "name" in dev else ""
    lines.append(f"device       {dev['device']}{gpu}  torch {dev['torch']}")
    lines.append(
        f"hash scheme  {info['hash_scheme']} (headers, sizes, small files, 64 B per tensor; not an integrity check)"
    )
    lines.append(f"snapshot     sha256 {info['snapshot_hash']}  (scanned in {info['scan_s']:.3f} s)")
    lines.append("")
    header = f"{'component':<16} {'class':<34} {'parameters':>15} {'bytes':>14}  {'dtype policy':<14} hash"
    lines.append(header)
    for name, c in info["components"].items():
        params = f"{c['parameters']:,}" if "parameters" in c else "-"
        policy = c.get("dtype_policy", "-")
        cls = c["class"] or "-"
        lines.append(f"{name:<16} {cls:<34} {params:>15} {c['bytes']:>14,}  {policy:<14} {c['hash'][:16]}")
    for name, c in info["components"].items():
        if name in info.get("config", {}) and "groups" in c:
            lines.append("")
            lines.append(f"{name} dtypes by module group ({c['dtype_policy']}: {c['dtype_note']}):")
            for g, rep in c["groups"].items():
                dts = ", ".join(f"{d} {n:,}" for d, n in sorted(rep["dtypes"].items()))
                lines.append(f"  {g:<22} {rep['parameters']:>15,}  {dts}")
    return "\n".join(lines)

