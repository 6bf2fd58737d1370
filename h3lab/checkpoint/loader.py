"""Lazy transformer loading: `load_state_dict` (any layout -> Diffusers keys) and `load_transformer` (config +
meta-device construction + assign), for `H3Transformer` and Diffusers' `MiniMaxH3Transformer3DModel` alike.

Contract
- `load_state_dict(path, layout="auto", qkv_layout=None, config=None) -> StateDict` (a dict of Diffusers key ->
  tensor; `.sources[key]` names the file and stored key it came from). `path`: a snapshot root (its `transformer/`),
  a component folder, a `*.safetensors` file or a `*.safetensors.index.json`. Tensors come from
  `safetensors.safe_open(...).get_tensor`, which returns copy-on-write views of the memory-mapped file (measured with
  safetensors 0.8, also the GPU image's version): nothing is read until used, and no second host copy exists. Only
  the original-layout transforms copy: the interleaved QKV regroup and the fc1 half swap (one tensor at a time);
  stacked QKV splits are views.
- `layout="auto"` reads Diffusers vs original names from the keys; an original-named folder is ``minimax``
  (interleaved QKV) and a single file ``single_file`` (stacked). `qkv_layout=` overrides (see `keymap`).
- `load_transformer(cls, path, subfolder=None, device=None, dtype_policy="released", ...)`: resolves the component
  (`discovery.resolve_component`), reads `config.json` into `H3Config.from_dict`, constructs `cls` on the meta device
  (`cls(config, dtype_policy=...)` for `H3Transformer`, `cls(**config.to_diffusers())` for the Diffusers class), checks
  every key, shape and dtype against the meta model, assigns the tensors (`load_state_dict(assign=True)`),
  recomputes the float32 `rope.inv_freq`, and moves the model to `device` (default: stays on the CPU, mapped).
- Dtype policies: ``released`` = the stored dtype must already be the released one (float32 for parameters under
  `config.FP32_MODULES`, bfloat16 otherwise) — a mismatch raises, nothing is cast silently; ``float32`` = every
  floating tensor is cast to float32 (a float32 copy; the host then holds the float32 model).
- Errors are one-line `CheckpointError`s naming the file and key: missing shard, index naming a missing file,
  unknown key, missing key, wrong shape, wrong dtype, pruned checkpoint, truncated file.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch

from ..config import FP32_MODULES, ConfigError, H3Config
from ..errors import CheckpointError
from . import discovery, keymap
from .fingerprint import component_hash

DTYPE_POLICIES = ("released", "float32")


class StateDict(dict):
    """Diffusers key -> tensor, plus `sources`: key -> "file[:stored key]" for error messages and provenance."""

    sources: dict[str, str]
    layout: str
    qkv_layout: str | None


def released_dtype(key: str) -> torch.dtype:
    """The released policy: float32 when a dotted component of `key` is in FP32_MODULES, else bfloat16 (the
    component match Diffusers' loader applies to `_keep_in_fp32_modules`)."""
    return torch.float32 if any(part in FP32_MODULES for part in key.split(".")) else torch.bfloat16


# ------------------------------------------------------------------------------------------------ state dicts
def load_state_dict(
    path: str | os.PathLike,
    layout: str = "auto",
    qkv_layout: str | None = None,
    config: H3Config | dict | None = None,
) -> StateDict:
    """Map a transformer checkpoint to Diffusers keys, lazily (see the module docstring)."""
    keymap.check_layout(layout, qkv_layout)
    if isinstance(config, dict):
        config = H3Config.from_dict(config)
    target = discovery.resolve_component(path)
    wf = discovery.find_weight_files(target)
    key_files = wf.key_files  # raises on a key stored twice
    source = str(target)
    if not key_files:
        raise CheckpointError(f"{source}: the weight files hold no tensors")
    if keymap.PRUNED_KEY in key_files:
        raise CheckpointError(
            f"{key_files[keymap.PRUNED_KEY]}: key {keymap.PRUNED_KEY!r} marks a pruned MiniMax-H3 checkpoint "
            "(time_embedder replaced by a table), which this model cannot load; use the unpruned release"
        )
    if layout == "auto":
        single = len(wf.files) == 1 and target.is_file()
        layout = keymap.detect_layout(key_files, source, single_file=single)

    raw: dict[str, torch.Tensor] = {}
    for file in wf.files:
        raw.update(_map_file(file))
    origin = {k: str(f) for k, f in key_files.items()}

    out = StateDict()
    if layout == "diffusers":
        out.update((k, v) for k, v in raw.items() if k not in keymap.DROPPED_KEYS)  # inv_freq is recomputed
        out.sources = {k: origin[k] for k in out}
        out.qkv_layout = None
    else:
        qkv = qkv_layout or keymap.DEFAULT_QKV[layout]
        mapped, from_key = keymap.original_to_diffusers(raw, qkv, config=config, source=source, origin=origin)
        out.update(mapped)
        out.sources = {k: f"{origin[old]}:{old}" for k, old in from_key.items()}
        out.qkv_layout = qkv
    out.layout = layout
    return out


def _map_file(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file as a lazy (memory-mapped, copy-on-write) tensor."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except Exception as exc:  # safetensors raises its own error types; the header was already validated
        raise CheckpointError(f"{file}: cannot map safetensors file ({type(exc).__name__}: {exc})") from None


# ------------------------------------------------------------------------------------------------- modules
def load_transformer(
    cls,
    path: str | os.PathLike,
    subfolder: str | None = None,
    device: torch.device | str | None = None,
    dtype_policy: str = "released",
    *,
    layout: str = "auto",
    qkv_layout: str | None = None,
    config: H3Config | dict | None = None,
):
    """Build `cls` from a snapshot root, component folder or weight file (see the module docstring).

    `config` is needed only for a bare weight file with no `config.json` beside it (default: `H3Config.full()`, the
    released architecture, which is what a single-file release holds)."""
    if dtype_policy not in DTYPE_POLICIES:
        raise CheckpointError(f"dtype_policy={dtype_policy!r}: must be one of {', '.join(DTYPE_POLICIES)}")
    target = discovery.resolve_component(path, subfolder)
    if isinstance(config, dict):
        config = H3Config.from_dict(config)
    if config is None:
        config = _read_config(target)
    sd = load_state_dict(target, layout=layout, qkv_layout=qkv_layout, config=config)

    with torch.device("meta"):
        model = _construct(cls, config, dtype_policy)
    expected = model.state_dict()  # persistent entries only: rope.inv_freq is not among them
    wanted = check_entries({k: (tuple(v.shape), v.dtype) for k, v in sd.items()}, sd.sources, expected, target,
                           cls.__name__, dtype_policy)
    for key, want in wanted.items():
        if sd[key].dtype != want:
            sd[key] = sd[key].to(want)  # float32 policy: one tensor at a time

    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as exc:  # pragma: no cover - keys and shapes were checked above
        raise CheckpointError(f"{target}: {exc}".splitlines()[0]) from None
    _reset_buffers(model, config)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftover:
        names = ", ".join(leftover[:4])
        raise CheckpointError(f"{target}: {cls.__name__} still has meta tensors after loading: {names}")
    if hasattr(model, "fingerprint") and isinstance(getattr(model, "fingerprint"), str):
        model.fingerprint = f"{Path(target).name}:{component_hash(target)[:16]}"
    if hasattr(model, "dtype_policy") and isinstance(getattr(model, "dtype_policy"), str):
        model.dtype_policy = dtype_policy
    model.eval()
    if device is not None and torch.device(device) != torch.device("cpu"):
        model.to(device)
    return model


def check_entries(entries: dict, sources: dict, expected: dict, target, cls_name: str,
                  dtype_policy: str) -> dict[str, torch.dtype]:
    """Check stored (full) shapes and dtypes, `entries[key] = (shape, dtype)`, against a meta model's `expected`
    state dict: shapes first (a wrong config shows up as a shape), then unknown keys, then missing keys, then dtypes.
    Returns key -> the dtype the policy loads it as. One-line `CheckpointError`s naming the file and key."""
    for key, ref in expected.items():
        if key in entries and tuple(entries[key][0]) != tuple(ref.shape):
            raise CheckpointError(
                f"{sources[key]}: key {key!r} has shape {list(entries[key][0])}, the config needs {list(ref.shape)}"
            )
    for key in entries:
        if key not in expected:
            raise CheckpointError(f"{sources[key]}: unknown key {key!r} ({cls_name} has no such parameter)")
    for key in expected:
        if key not in entries:
            raise CheckpointError(f"{target}: missing key {key!r} (no weight file stores it)")
    wanted = {}
    for key in expected:
        dtype = entries[key][1]
        want = released_dtype(key) if dtype_policy == "released" else torch.float32
        if dtype_policy == "released" and dtype != want:
            raise CheckpointError(
                f"{sources[key]}: key {key!r} is stored as {_name(dtype)}, the released dtype policy needs "
                f"{_name(want)} (float32 modules: {', '.join(FP32_MODULES)}); load with dtype_policy='float32' to cast"
            )
        if not dtype.is_floating_point:
            raise CheckpointError(
                f"{sources[key]}: key {key!r} is stored as {_name(dtype)}: weights must be floating point"
            )
        wanted[key] = want
    return wanted


def _read_config(target: Path) -> H3Config:
    folder = target if target.is_dir() else target.parent
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        if target.is_file():
            return H3Config.full()
        raise CheckpointError(f"{cfg_path}: missing (a component folder needs its config.json)")
    try:
        return H3Config.from_dict(discovery.read_json(cfg_path))
    except ConfigError as exc:
        raise CheckpointError(f"{cfg_path}: {exc}") from None


def _construct(cls, config: H3Config, dtype_policy: str):
    params = inspect.signature(cls).parameters
    if "config" in params:  # H3Transformer(config, dtype_policy=...)
        kwargs = {"dtype_policy": dtype_policy} if "dtype_policy" in params else {}
        return cls(config, **kwargs)
    return cls(**config.to_diffusers())  # Diffusers: MiniMaxH3Transformer3DModel(**config keys)


def _reset_buffers(model, config: H3Config) -> None:
    """Recompute the non-persistent float32 `rope.inv_freq` on the CPU, as the model's constructor would."""
    if hasattr(model, "reset_buffers"):
        model.reset_buffers("cpu")
        return
    f = config.rope_freq_dim  # Diffusers' MiniMaxH3RotaryPosEmbed formula
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))
    model.rope.register_buffer("inv_freq", inv_freq, persistent=False)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
