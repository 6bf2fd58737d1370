"""Reading and checking a LoRA adapter file before any model loads: format, digest, tensors, shapes.

Contract
--------
`read_adapter(path, expect_sha256=None) -> AdapterFile` accepts
- a PEFT directory: `adapter_config.json` (a peft `LoraConfig`) + `adapter_model.safetensors` (what
  `PeftModel.save_pretrained` and `lora.save_adapter` write; keys `base_model.model.<module path>.lora_A.weight`);
- a `.safetensors` file in Diffusers' format (`ModelMixin.save_lora_adapter`, `pipeline.save_lora_weights`): keys
  `transformer.<module path>.lora_A.weight` (or bare module paths, or peft's `.default.` infix), the `LoraConfig` in
  the safetensors metadata `lora_adapter_metadata` when present, else Diffusers' alpha-less rule: alpha = rank.
Everything else is refused with one line naming the file and the rule: a missing path; pickles (`.bin`, `.pt`,
`.pth`, `.ckpt`: never unpickled); a file that is not safetensors; a config that is not plain LoRA (DoRA, biases,
variants); keys that are not `lora_A`/`lora_B` weights; a module with one factor only; factors that are not 2-D,
not floating point, not finite, or whose rank disagrees with the config. Tensors are read from the bytes that were
hashed, so what is checked is what runs.

Digest (`lora.files_digest`): SHA-256 of `h3lab-adapter/1` and each file's name and SHA-256 in name order, so a PEFT
directory's digest covers its config (alpha!) and its weights; `AdapterFile.sha256`. `expect_sha256` refuses a file
whose bytes changed since a run recorded it.

`check_shapes(adapter, config)` checks every targeted module against an `H3Config` on the meta device (no weights):
the path must be a projection (`layers.Linear`) and the factors must be (r, in_features) and (out_features, r).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .lora import CONFIG_NAME, PEFT_PREFIX, WEIGHTS_NAME, AdapterError, check_plain, files_digest

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
DIFFUSERS_PREFIXES = ("transformer.", "transformer_ref.")
METADATA_KEY = "lora_adapter_metadata"  # Diffusers' safetensors metadata entry holding the LoraConfig


@dataclass(frozen=True, eq=False)
class AdapterFile:
    """A read adapter: where it came from, its `sha256` (`files_digest`), the peft `config`, `kind` ("peft" or
    "diffusers"), and `tensors` keyed by module path (`<path>.lora_A.weight`, `<path>.lora_B.weight`), as stored."""

    path: Path
    sha256: str
    kind: str
    config: Any
    tensors: dict[str, torch.Tensor]

    @property
    def modules(self) -> list[str]:
        return sorted({k.rsplit(".lora_", 1)[0] for k in self.tensors})

    @property
    def rank(self) -> int:
        return int(self.config.r)

    def describe(self) -> str:
        c = self.config
        return (f"{self.kind} LoRA rank {c.r} alpha {c.lora_alpha:g} on {len(self.modules)} modules "
                f"(sha256 {self.sha256[:12]})")


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise AdapterError(f"adapter {str(path)!r}: cannot read {what} ({err.strerror or err})") from None


def _looks_like_safetensors(data: bytes) -> bool:
    """A safetensors file: an 8-byte little-endian header length that fits the file, then the JSON header's '{'.
    (Its first byte is the length's low byte, which can be 0x80 -- a pickle's first byte -- so the pickle test comes
    only after this one.)"""
    if len(data) < 9:
        return False
    header_len = int.from_bytes(data[:8], "little")
    return 0 < header_len <= len(data) - 8 and data[8:9] == b"{"


def _tensors(path: Path, data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not _looks_like_safetensors(data) and (len(data) < 8 or data[:1] == b"\x80" or data[:2] == b"PK"):
        kind = "too short" if len(data) < 8 else "a pickle"
        raise AdapterError(f"adapter {str(path)!r}: {kind}, not a safetensors file (h3lab never unpickles weights)")
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
        raise AdapterError(f"adapter {str(path)!r}: not a readable safetensors file ({exc})") from None
    header_len = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + header_len])
    except ValueError:
        header = {}
    meta = header.get("__metadata__") or {}
    return tensors, {str(k): str(v) for k, v in meta.items()}


def config_from_json(path: Path, data: dict, where: str) -> Any:
    """The plain-LoRA peft `LoraConfig` of `data` (an `adapter_config.json` object read from `path`); a one-line
    `AdapterError` naming `path` and `where` otherwise."""
    from peft import LoraConfig

    if not isinstance(data, dict):
        raise AdapterError(f"adapter {str(path)!r}: {where} must hold a JSON object")
    data = dict(data)
    data.pop("runtime_config", None)
    peft_type = data.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"adapter {str(path)!r}: peft_type {peft_type!r} is not LORA")
    try:
        config = LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**data))
    except (TypeError, ValueError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AdapterError(f"adapter {str(path)!r}: {where} is not a valid LoRA config ({msg})") from None
    check_plain(config, f"adapter {str(path)!r}")
    return config


def _module_key(key: str) -> str:
    """A stored key -> `<module path>.lora_A.weight` (prefixes and peft's `.default.` infix removed)."""
    for prefix in (PEFT_PREFIX, *DIFFUSERS_PREFIXES):
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    return key.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def _check_tensors(path: Path, tensors: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        k = _module_key(key)
        if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight")):
            raise AdapterError(f"adapter {str(path)!r}: tensor {key!r} is not a LoRA factor (lora_A/lora_B weight): "
                               "plain LoRA only")
        if k in out:
            raise AdapterError(f"adapter {str(path)!r}: module factor {k!r} appears twice")
        if t.ndim != 2 or not t.is_floating_point() or t.numel() == 0:
            raise AdapterError(f"adapter {str(path)!r}: {key!r} is {t.dtype} {tuple(t.shape)}: factors are non-empty "
                               "2-D floating-point matrices")
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"adapter {str(path)!r}: {key!r} holds non-finite values")
        out[k] = t
    if not out:
        raise AdapterError(f"adapter {str(path)!r}: holds no LoRA factors")
    for module in sorted({k.rsplit(".lora_", 1)[0] for k in out}):
        a, b = out.get(f"{module}.lora_A.weight"), out.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            raise AdapterError(f"adapter {str(path)!r}: module {module!r} has only one of lora_A / lora_B")
        r = _rank_of(config, module)
        if a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"adapter {str(path)!r}: {module!r} factors {tuple(a.shape)} / {tuple(b.shape)} do not "
                               f"have the config's rank {r}")
    return dict(sorted(out.items()))


def _rank_of(config: Any, module: str) -> int:
    """peft's per-module rank: `rank_pattern` (a key that is the path, a suffix or a `^`-anchored name), else r."""
    for pattern, r in (config.rank_pattern or {}).items():
        p = pattern.lstrip("^")
        if module == p or module.endswith("." + p) or p.startswith(module + ".lora_"):
            return int(r)
    return int(config.r)


def _diffusers_config(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Any:
    if METADATA_KEY in meta:
        try:
            data = json.loads(meta[METADATA_KEY])
        except ValueError:
            raise AdapterError(f"adapter {str(path)!r}: metadata {METADATA_KEY} is not JSON") from None
        return config_from_json(path, data, f"metadata {METADATA_KEY}")
    ranks = {t.shape[0] for k, t in tensors.items() if _module_key(k).endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise AdapterError(f"adapter {str(path)!r}: mixed ranks {sorted(ranks)} and no {METADATA_KEY} metadata: "
                           "cannot tell the LoRA config")
    modules = sorted({_module_key(k).rsplit(".lora_", 1)[0] for k in tensors})
    r = ranks.pop()
    return config_from_json(path, {"r": r, "lora_alpha": r, "target_modules": modules}, "derived config")


def read_adapter(path: str | os.PathLike, expect_sha256: str | None = None) -> AdapterFile:
    """Read and check an adapter (module docstring); `expect_sha256` refuses changed bytes."""
    p = Path(path).expanduser()
    if not p.exists():
        raise AdapterError(f"adapter {str(path)!r}: no such file or directory")
    if p.suffix.lower() in PICKLE_SUFFIXES:
        raise AdapterError(f"adapter {str(path)!r}: a {p.suffix} file is a pickle; h3lab loads safetensors only "
                           "(PEFT directory or .safetensors)")
    if p.is_dir():
        weights, cfg = p / WEIGHTS_NAME, p / CONFIG_NAME
        if not weights.is_file():
            pickled = [q.name for q in p.iterdir() if q.suffix.lower() in PICKLE_SUFFIXES]
            why = f"holds {pickled[0]} (a pickle; save with safetensors)" if pickled else f"has no {WEIGHTS_NAME}"
            raise AdapterError(f"adapter {str(path)!r}: {why}; a PEFT adapter is {CONFIG_NAME} + {WEIGHTS_NAME}")
        if not cfg.is_file():
            raise AdapterError(f"adapter {str(path)!r}: has no {CONFIG_NAME} (a PEFT adapter is {CONFIG_NAME} + "
                               f"{WEIGHTS_NAME})")
        files = {CONFIG_NAME: _read_bytes(cfg, CONFIG_NAME), WEIGHTS_NAME: _read_bytes(weights, WEIGHTS_NAME)}
        kind = "peft"
    elif p.is_file():
        if p.suffix.lower() != ".safetensors":
            raise AdapterError(f"adapter {str(path)!r}: must be a PEFT directory or a .safetensors file")
        files = {p.name: _read_bytes(p, "the file")}
        kind = "diffusers"
    else:
        raise AdapterError(f"adapter {str(path)!r}: not a regular file or directory")
    digest = files_digest(files)
    if expect_sha256 is not None and digest != expect_sha256:
        raise AdapterError(f"adapter {str(path)!r} changed: sha256 {digest[:16]} != recorded {expect_sha256[:16]} "
                           "(the run used other bytes; restore them to replay it)")
    if kind == "peft":
        tensors, _ = _tensors(p / WEIGHTS_NAME, files[WEIGHTS_NAME])
        try:
            data = json.loads(files[CONFIG_NAME].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise AdapterError(f"adapter {str(path)!r}: {CONFIG_NAME} is not JSON ({exc})") from None
        config = config_from_json(p, data, CONFIG_NAME)
    else:
        tensors, meta = _tensors(p, files[p.name])
        config = _diffusers_config(p, tensors, meta)
    if not math.isfinite(float(config.lora_alpha)):
        raise AdapterError(f"adapter {str(path)!r}: lora_alpha {config.lora_alpha!r} is not finite")
    return AdapterFile(p.resolve(), digest, kind, config, _check_tensors(p, tensors, config))


def check_shapes(adapter: AdapterFile, config: Any) -> None:
    """Every factor fits its module of an `H3Config` (built on the meta device, no weights); raises AdapterError."""
    from ..model import H3Transformer, layers

    with torch.device("meta"):
        modules = dict(H3Transformer(config).named_modules())
    for module in adapter.modules:
        m = modules.get(module)
        if not isinstance(m, layers.Linear):
            what = "no module" if m is None else f"a {type(m).__name__}, not a projection"
            raise AdapterError(f"adapter {str(adapter.path)!r}: {module!r} is {what} of this model")
        a = adapter.tensors[f"{module}.lora_A.weight"]
        b = adapter.tensors[f"{module}.lora_B.weight"]
        if a.shape[1] != m.in_features or b.shape[0] != m.out_features:
            raise AdapterError(
                f"adapter {str(adapter.path)!r}: {module!r} factors {tuple(a.shape)} / {tuple(b.shape)} do not fit "
                f"the projection {m.in_features} -> {m.out_features} (an adapter for another model size?)"
            )
