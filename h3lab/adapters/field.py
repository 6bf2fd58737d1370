"""`RunSpec.adapters`: a generation with a LoRA adapter, sealed by the adapter's sha256 and replayed from its bytes.

Contract
--------
- A spec's `adapters` value is a list of at most one entry (h3lab applies one adapter per run):
      {"name": str, "path": absolute path, "sha256": 64 hex (`adapter_file.files_digest`), "scale": finite number}
  `adapter_entry(path, scale, name, snapshot=None)` builds it: it reads and checks the file (`read_adapter`: format,
  pickles refused, factors and ranks) and, given a snapshot, fits every factor to that snapshot's transformer config
  (`check_shapes`, meta device) -- all before any model loads. `validate` (registered for the field) checks the
  entry's form when a spec is built.
- `apply(value, run)` (entered by `h3lab.run.resolve`, first among the extension fields): re-reads the file and
  refuses it when its sha256 is not the recorded one (so `verify` replays the same adapter bytes or says the file
  changed), checks its shapes against the run's model, injects it into `run.model` through peft (`lora.inject`,
  `LoraLinear`: factors and combine on the op table), loads the factors (float32), applies `scale` (peft's
  `set_scale`: scaling = scale * alpha / r), pins `model.fingerprint` at the base weights' fingerprint for the
  run (the checkpoint a trajectory records stays the base; the adapter is in the spec), claims "model:adapter"
  (a factor that swaps the transformer, H16, is refused with it) and, on exit, removes the adapter and restores the
  base modules and flags. The model is unchanged outside the run.
- An adapter injected in the model itself (`add_lora`, a GRPO job's policy: `Session.rollout` on such a model) is
  recorded as what ran by `in_place_entry(model)`: {"name": "in-place", "path": null (no file), "sha256": the PEFT
  files it would save as (`lora.adapter_digest`), "scale": its layers' scaling / (alpha / r)}. `apply` of any entry on
  a model that already carries an adapter checks that adapter instead of injecting one: its sha256 and scale must be
  the recorded ones (else a one-line `AdapterError` naming both digests), and the run goes on with it as it is (base
  fingerprint pinned). An in-place entry on a model without an adapter is refused (no file to inject: put the
  adapter the run used back in the model, e.g. `add_lora` + `load_adapter_weights`, or `attached`).
- Session side (`Session.load_lora` / `unload_lora`, `!lora PATH|off`, `--lora PATH`): the session holds the entry
  and puts it into every spec it builds; nothing is injected until a run starts. `describe(value)` is the words
  `!status`, the "ran" line and drift labels show for it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import numbers
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..run import FieldProvider, register_field
from .adapter_file import AdapterFile, check_shapes, read_adapter
from .lora import (ADAPTER, AdapterError, LoraHandle, adapter_digest, has_lora, inject, lora_layers, pinned_fingerprint,
                   remove_lora)

ENTRY_KEYS = ("name", "path", "scale", "sha256")
IN_PLACE = "in-place"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def check_scale(scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise AdapterError(f"adapter scale={scale!r}: must be a finite number")
    return float(scale)


def snapshot_config(snapshot: str | os.PathLike, variant: str = "transformer") -> Any:
    """The `H3Config` of a snapshot's transformer partition, from its config.json alone (no weights)."""
    from ..config import H3Config

    path = Path(snapshot) / variant / "config.json"
    try:
        return H3Config.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as exc:
        raise AdapterError(f"{path}: cannot read the transformer config to check the adapter against ({exc})") from None


def adapter_entry(path: str | os.PathLike, scale: float = 1.0, name: str | None = None, *,
                  snapshot: str | os.PathLike | None = None, variant: str = "transformer") -> dict[str, Any]:
    """The spec entry of the adapter at `path` (module docstring); every check runs here, before any model loads."""
    scale = check_scale(scale)
    adapter = read_adapter(path)
    if snapshot is not None:
        check_shapes(adapter, snapshot_config(snapshot, variant))
    label = name if name is not None else adapter.path.name
    if not isinstance(label, str) or not label.strip():
        raise AdapterError(f"adapter name={name!r}: must be a non-empty string")
    return {"name": label, "path": str(adapter.path), "scale": scale, "sha256": adapter.sha256}


def validate(value: Any) -> list[dict[str, Any]]:
    """The provider's `validate`: a list of at most one well-formed entry."""
    if not isinstance(value, list):
        raise AdapterError(f"adapters={value!r}: must be a list of adapter entries")
    if len(value) > 1:
        raise AdapterError(f"adapters: {len(value)} adapters given; h3lab applies one adapter per run")
    out = []
    for entry in value:
        if not isinstance(entry, dict) or sorted(entry) != sorted(ENTRY_KEYS):
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise AdapterError(f"adapter entry {got}: must have exactly the keys {', '.join(ENTRY_KEYS)}")
        if not isinstance(entry["sha256"], str) or not _HEX64.fullmatch(entry["sha256"]):
            raise AdapterError(f"adapter sha256={entry['sha256']!r}: must be 64 lowercase hex digits")
        if entry["path"] is not None and (not isinstance(entry["path"], str) or not Path(entry["path"]).is_absolute()):
            raise AdapterError(f"adapter path={entry['path']!r}: must be an absolute path (null: injected in place)")
        if not isinstance(entry["name"], str) or not entry["name"].strip():
            raise AdapterError(f"adapter name={entry['name']!r}: must be a non-empty string")
        out.append({**entry, "scale": check_scale(entry["scale"])})
    return out


@contextlib.contextmanager
def attached(model: nn.Module, adapter: AdapterFile, scale: float = 1.0) -> Iterator[LoraHandle]:
    """`adapter` injected into `model` (peft, `LoraLinear`), its factors loaded as float32 and `scale` applied, for
    the duration of the `with`; removed afterwards (base modules and requires_grad flags restored)."""
    from .lora import load_adapter_weights

    config = copy.deepcopy(adapter.config)
    config.target_modules = set(adapter.modules)
    handle = inject(model, config)
    try:
        device = next(model.parameters()).device
        load_adapter_weights(model, {k: v.to(device, torch.float32) for k, v in adapter.tensors.items()})
        if scale != 1.0:
            for _, layer in lora_layers(model):
                layer.set_scale(ADAPTER, scale)
        yield handle
    finally:
        remove_lora(model, handle)


@contextlib.contextmanager
def apply(value: list, run: Any) -> Iterator[Any]:
    """The provider's `apply` (module docstring)."""
    (entry,) = value
    model = run.model
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None:
        raise AdapterError(f"adapter {entry['name']!r}: the run's model is a {type(model).__name__}, not an "
                           "H3Transformer")
    if has_lora(model):  # the adapter is in the model already: it must be the recorded one
        check_in_place(model, entry)
        changed = run.claim(f"adapter {entry['name']}", "model:adapter", "model")
        with pinned_fingerprint(model):
            yield run.replace(changed=changed)
        return
    if entry["path"] is None:
        raise AdapterError(f"adapter {entry['name']!r} (sha256 {entry['sha256'][:12]}): the run used an adapter "
                           "injected in the model and recorded no file; run it on the model carrying that adapter")
    adapter = read_adapter(entry["path"], expect_sha256=entry["sha256"])
    check_shapes(adapter, config)
    changed = run.claim(f"adapter {entry['name']}", "model:adapter", "model")
    with pinned_fingerprint(model), attached(model, adapter, entry["scale"]):
        yield run.replace(changed=changed)


def _live_scale(model: nn.Module) -> float:
    """The common `scale` of the injected adapter's layers: scaling / (alpha / r), or alpha / sqrt(r) with rsLoRA."""
    config = model.peft_config[ADAPTER]
    scales = set()
    for _, layer in lora_layers(model):
        r, alpha = layer.r[ADAPTER], layer.lora_alpha[ADAPTER]
        scales.add(layer.scaling[ADAPTER] / (alpha / (math.sqrt(r) if config.use_rslora else r)))
    if len(scales) != 1:
        raise AdapterError(f"the model's injected adapter has layers at {len(scales)} different scales; h3lab "
                           "records one scale per adapter")
    return float(scales.pop())


def in_place_entry(model: nn.Module) -> dict[str, Any] | None:
    """The spec entry of the adapter injected in `model` (module docstring), or None when it carries none."""
    if not has_lora(model):
        return None
    return {"name": IN_PLACE, "path": None, "scale": _live_scale(model), "sha256": adapter_digest(model)}


def check_in_place(model: nn.Module, entry: dict[str, Any]) -> None:
    """Refuse (one line) when the adapter injected in `model` is not `entry`'s: another sha256 or another scale."""
    live = in_place_entry(model)
    if live["sha256"] != entry["sha256"]:
        raise AdapterError(f"adapter {entry['name']!r}: the model carries an injected adapter of sha256 "
                           f"{live['sha256'][:12]}, the run recorded {entry['sha256'][:12]} (put the adapter the run "
                           "used in the model)")
    if live["scale"] != entry["scale"]:
        raise AdapterError(f"adapter {entry['name']!r}: the model's injected adapter runs at scale "
                           f"{live['scale']:g}, the run recorded {entry['scale']:g}")


def describe(value) -> str:
    """The adapters of a spec (or a session) in a few words: "" without one, else "LoRA NAME x SCALE (sha256 …)"."""
    entries = list(value or ())
    return ", ".join(f"LoRA {e['name']} x{e['scale']:g} (sha256 {e['sha256'][:12]})" for e in entries)


register_field("adapters", FieldProvider(validate=validate, apply=apply))
