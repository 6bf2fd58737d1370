"""LoRA on `H3Transformer` through peft, with the adapter arithmetic on the strict op table.

Contract
--------
- `add_lora(model, rank, alpha=None, targets=PROJECTIONS, *, seed=0, init="default")` injects a LoRA adapter in place
  with peft's own machinery (`LoraConfig`, `inject_adapter_in_model`, its state-dict functions): `targets` are
  Diffusers module-path suffixes (peft's `target_modules` list rule: a module matches when its path equals a target
  or ends with `.` + target), e.g. every attention and FFN projection `to_q,to_k,to_v,to_out.0,ff.net.0.proj,
  ff.net.2` (the default; in the transformer blocks and the token refiner). peft freezes every base parameter
  (`requires_grad=False`); the adapter factors are the trainable parameters, float32 (peft's own upcast of a bf16
  model's adapters), named as peft names them (`transformer_blocks.0.attn.to_q.lora_A.default.weight`), in
  `named_parameters()` order -- so they enter the training step's flat gradient, the fixed-order combine,
  `StrictAdamW` and the sealed run unchanged. `init="default"` is peft's (A Kaiming-uniform, B zero: the adapted
  model starts byte-equal to the base), drawn on the CPU from `seed` whatever the model's device. `remove_lora(model)`
  puts the base modules and their `requires_grad` back.
- The layer (`LoraLinear`, registered with peft for `layers.Linear` through `LoraConfig._register_custom_module`) is
  peft's LoRA `Linear` (same adapter bookkeeping, scaling `alpha / r` or `alpha / sqrt(r)` with rsLoRA, `set_scale`,
  merge) whose factors are `layers.Linear` modules, so every multiply dispatches through the op table of the running
  forward and is traced under the wrapped projection's point:
      y   = base(x)                                         the projection as before (`linear` / `linear_tree`), at P
      h   = lora_A(x.to(float32))                           `linear` at P.lora_a (`linear_tree` when the base is a
                                                            row-parallel tree projection: its K is the sharded axis)
      d   = lora_B(h)                                       `linear` at P.lora_b, float32
      out = gated_residual(y.to(f32), [[scaling ...]], 0, d).to(y.dtype)        at P.lora
  `gated_residual(residual, gate, index, y) = residual + gate[index] * y` with a one-row gate table holding the
  scaling is peft's `result + lora_B(lora_A(x)) * scaling` (bf16 result promoted to float32, one rounding back to the
  base dtype at the end), so `off` mode is byte-equal to peft's own layer (tests) and strict runs only strict kernels.
  Every layer passes the same (rows,) zero index tensor (`_row_index`): the strict gated_residual validates an index
  once per tensor object, with a device sync, and keeps 64 of them; one index per layer (312 at full size) overflowed
  that cache and synced the host with the GPU on every call (516 syncs per training step on the H200).
  A run's `RunSpec.lora_scale` (`training.lora_scale`) sets per-layer factors (`_h3_row_scale`): a layer whose
  factors are all 0 returns the base output; the gate then holds `scaling * block * modality`, one row, or three
  rows (video, text, audio) indexed by each output row's stream.
  No dropout is applied (peft's eval-mode behaviour; `add_lora` refuses dropout, a random op has no strict kernel).
  An op override of `linear` or `gated_residual` (an ablation factor) sees these calls like the model's own.
- Files: `adapter_files(model)` is the adapter in PEFT's format -- `adapter_config.json` (the `LoraConfig`, sorted
  keys, sets as sorted lists, no runtime config) and `adapter_model.safetensors` (float32 factors under peft's
  `PeftModel.save_pretrained` keys `base_model.model.<module path>.lora_A.weight`, metadata `{"format": "pt"}`),
  as bytes; `save_adapter` writes them atomically; `adapter_digest` is their sha256 (`files_digest`).
  `load_adapter_weights` copies a state dict (module paths) into an injected adapter through peft's
  `set_peft_model_state_dict` and refuses missing or unexpected keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..execution import runtime
from ..errors import H3Error
from ..hashing import model_fingerprint
from ..io_utils import atomic_write_dir

PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")  # every attention and FFN projection
ADAPTER = "default"  # peft's adapter name; h3lab holds one adapter at a time
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel.save_pretrained's key prefix
INITS = ("default", "gaussian")
FILES_FORMAT = "h3lab-adapter/1"


def files_digest(files: dict[str, bytes]) -> str:
    """An adapter's sha256: SHA-256 over `h3lab-adapter/1` and (name, sha256) of every file, in name order, so a
    PEFT directory's digest covers its config (alpha!) and its weights."""
    h = hashlib.sha256(FILES_FORMAT.encode())
    for name in sorted(files):
        h.update(f"|{name}={hashlib.sha256(files[name]).hexdigest()}".encode())
    return h.hexdigest()


class AdapterError(H3Error):
    """A LoRA adapter, its file or its settings break a rule (one line: the value and the rule)."""


# ================================================================================================ the layer
def _peft_linear() -> type:
    from peft.tuners.lora.layer import Linear

    return Linear


_LAYER: type | None = None


_ROW_INDEX: dict[tuple[int, torch.device], torch.Tensor] = {}
_ROW_INDEX_SHAPES = 8  # row counts kept (a training step and a rollout at a few shapes)


def _row_index(rows: int, device: torch.device) -> torch.Tensor:
    """The (rows,) int64 zeros every LoRA layer's combine reads its one-row gate with, one tensor per (rows, device),
    never written, so the strict kernel's per-tensor index check (a host sync) runs once for all layers."""
    key = (rows, device)
    index = _ROW_INDEX.get(key)
    if index is None:
        if len(_ROW_INDEX) >= _ROW_INDEX_SHAPES:
            _ROW_INDEX.pop(next(iter(_ROW_INDEX)))
        index = _ROW_INDEX[key] = torch.zeros(rows, dtype=torch.long, device=device)
    return index


def lora_layer_class() -> type:
    """`LoraLinear`: peft's LoRA `Linear` on the op table (module docstring); built on first use so that importing
    h3lab.training does not import peft."""
    global _LAYER
    if _LAYER is None:
        from ..model import layers

        base_cls = _peft_linear()

        class LoraLinear(base_cls):
            """peft's LoRA Linear whose factors and combine dispatch through `runtime.current_ops()`."""

            def update_layer(self, adapter_name: str, r: int, lora_alpha: float, config: Any, **kwargs: Any) -> None:
                super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
                base = self.get_base_layer()
                for kind, suffix, tree in (("lora_A", "lora_a", bool(getattr(base, "tree", False))),
                                           ("lora_B", "lora_b", False)):
                    old = getattr(self, kind)[adapter_name]
                    new = layers.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                                        point=f"{base.point}.{suffix}", tree=tree)
                    new.weight = old.weight  # the same Parameter peft initialised, placed and flagged
                    if old.bias is not None:
                        new.bias = old.bias
                    getattr(self, kind)[adapter_name] = new
                self._h3_tables = {}

            def _tables(self, name: str, rows: int, ref: torch.Tensor, scaling: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
                """(gate (1, out) holding the scaling -- peft's, or `scaling` -- and index (rows,) zeros shared by all
                layers), cached per value, shape and device (the strict gated_residual checks an index tensor once per
                object)."""
                scaling = float(self.scaling[name]) if scaling is None else scaling
                key = (name, scaling, rows, ref.shape[-1], ref.dtype, ref.device)
                found = self._h3_tables.get(key)
                if found is None:
                    gate = torch.full((1, ref.shape[-1]), scaling, dtype=ref.dtype, device=ref.device)
                    index = _row_index(rows, ref.device)
                    self._h3_tables = {k: v for k, v in self._h3_tables.items() if k[0] != name or k[2] != rows}
                    found = self._h3_tables[key] = (gate, index)
                return found

            def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                result = self.base_layer(x, *args, **kwargs)
                if self.disable_adapters or self.merged:
                    return result
                active = [a for a in self.active_adapters if a in self.lora_A]
                scale = self.__dict__.get("_h3_row_scale")  # RunSpec.lora_scale's factors (training.lora_scale)
                if not active or scale is not None and scale.silent:
                    return result  # every factor 0: the base projection, exactly as without the adapter
                ops = runtime.current_ops()
                point = f"{self.get_base_layer().point}.lora"
                out = index = None
                for name in active:
                    a, b = self.lora_A[name], self.lora_B[name]
                    d = b(a(x.to(a.weight.dtype)))  # (..., out) float32: two op-table linears
                    if out is None:
                        out = result.to(d.dtype)
                    rows = out.numel() // d.shape[-1]  # d holds a TP rank's columns on a TP mesh
                    if scale is None or scale.uniform:
                        factor = None if scale is None else scale.uniform_scaling(float(self.scaling[name]))
                        gate, index = self._tables(name, rows, d, factor)
                    else:  # one gate row per stream (video, text, audio), each output row reads its stream's
                        gate, index = scale.gate(name, float(self.scaling[name]), d), scale.rows(rows, d)
                    out = ops.gated_residual(out.reshape(1, rows, -1), gate, index, d.reshape(1, rows, -1),
                                             point=point).reshape(d.shape)
                out = out.to(result.dtype)
                return out if scale is None or scale.uniform else scale.keep_base(result, out, index)

            def __repr__(self) -> str:
                return "h3lab." + super().__repr__()

        _LAYER = LoraLinear
    return _LAYER


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module path, layer) of every peft LoRA layer in `model`, in `named_modules()` order."""
    from peft.tuners.lora.layer import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def has_lora(model: nn.Module) -> bool:
    return isinstance(getattr(model, "peft_config", None), dict) and ADAPTER in model.peft_config


# ================================================================================================ config
def _number(name: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or (
            positive and value <= 0):
        raise AdapterError(f"{name}={value!r}: must be a finite number{' > 0' if positive else ''}")
    return float(value)


def parse_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """Module-path suffixes from a comma-separated string or a sequence; refuses empty or malformed names."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    out = []
    for item in items:
        name = item.strip() if isinstance(item, str) else item
        if not isinstance(name, str) or not name or any(c.isspace() for c in name) or name.startswith(".") \
                or name.endswith(".") or ".." in name:
            raise AdapterError(f"LoRA target {item!r}: must be a Diffusers module path or suffix, e.g. to_q or "
                               "ff.net.2")
        out.append(name)
    if not out:
        raise AdapterError(f"LoRA targets {targets!r}: name at least one module (e.g. {','.join(PROJECTIONS)})")
    return tuple(dict.fromkeys(out))


def match_targets(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Paths of the `layers.Linear` modules `targets` select (peft's suffix rule); a target that selects none, or
    that selects a module which is not a projection, raises `AdapterError`."""
    from ..model import layers

    modules = dict(model.named_modules())
    chosen: list[str] = []
    for target in targets:
        hits = [p for p in modules if p == target or p.endswith("." + target)]
        if not hits:
            raise AdapterError(f"LoRA target {target!r} matches no module of the model (targets are Diffusers module "
                               f"paths or suffixes, e.g. {','.join(PROJECTIONS)})")
        odd = [p for p in hits if not isinstance(modules[p], layers.Linear)]
        if odd:
            raise AdapterError(f"LoRA target {target!r} matches {odd[0]!r}, a {type(modules[odd[0]]).__name__}: LoRA "
                               "wraps projections (layers.Linear) only")
        chosen += hits
    return sorted(set(chosen), key=list(modules).index)


def lora_config(rank: int, alpha: float | None, targets: Sequence[str], init: str = "default") -> Any:
    """The peft `LoraConfig` of an h3lab adapter (plain LoRA: no dropout, bias, DoRA or variants), with `LoraLinear`
    registered for `layers.Linear`."""
    from peft import LoraConfig

    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise AdapterError(f"LoRA rank={rank!r}: must be an integer >= 1")
    alpha = float(rank) if alpha is None else _number("LoRA alpha", alpha)
    if init not in INITS:
        raise AdapterError(f"LoRA init={init!r}: must be one of {', '.join(INITS)}")
    config = LoraConfig(r=int(rank), lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        init_lora_weights=True if init == "default" else "gaussian")
    return register_layer(config)


def register_layer(config: Any) -> Any:
    """`config` with `LoraLinear` registered for `layers.Linear` (peft's custom-module hook); returns it."""
    from ..model import layers

    config._register_custom_module({layers.Linear: lora_layer_class()})
    return config


def check_plain(config: Any, where: str) -> None:
    """Refuse what the op-table layer does not compute: DoRA, LoRA biases, fan-in/fan-out, peft's LoRA variants."""
    bad = [(k, getattr(config, k, None)) for k in ("use_dora", "lora_bias", "fan_in_fan_out", "use_qalora",
                                                   "use_bdlora", "alora_invocation_tokens", "arrow_config",
                                                   "velora_config", "monteclora_config", "kasa_config",
                                                   "layer_replication", "trainable_token_indices",
                                                   "modules_to_save", "target_parameters")
           if getattr(config, k, None) not in (None, False, [], {}, ())]
    if getattr(config, "bias", "none") != "none":
        bad.append(("bias", config.bias))
    if bad:
        raise AdapterError(f"{where}: {bad[0][0]}={bad[0][1]!r} is not plain LoRA (h3lab runs plain LoRA only)")


# ============================================================================================== injection
@dataclass
class LoraHandle:
    """What `add_lora` did: the peft config, the wrapped module paths, and the base `requires_grad` flags that
    `remove_lora` restores."""

    config: Any
    modules: list[str]
    requires_grad: dict[str, bool] = field(default_factory=dict)


def inject(model: nn.Module, config: Any, seed: int = 0) -> LoraHandle:
    """Inject `config`'s adapter with peft (CPU draws from `seed`), upcast its factors to float32; see add_lora."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype

    if has_lora(model):
        raise AdapterError("the model already carries a LoRA adapter: remove_lora(model) first (one adapter at a time)")
    check_plain(config, "LoRA config")
    targets = config.target_modules
    if isinstance(targets, str):
        raise AdapterError(f"LoRA target_modules={targets!r}: a regular expression; h3lab takes module-path suffixes")
    modules = match_targets(model, sorted(targets))
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(register_layer(config), model, adapter_name=ADAPTER)
    cast_adapter_dtype(model, adapter_name=ADAPTER, autocast_adapter_dtype=True)
    _factors_where_the_model_computes(model)
    cls = lora_layer_class()
    odd = [n for n, m in lora_layers(model) if type(m) is not cls]
    if odd:  # peft chose another layer class: its factors would run outside the op table
        remove_lora(model, LoraHandle(config, modules, flags))
        raise AdapterError(f"peft wrapped {odd[0]!r} with a layer that is not h3lab's LoraLinear")
    return LoraHandle(config, modules, flags)


def _factors_where_the_model_computes(model: nn.Module) -> None:
    """peft creates each factor beside its base weight; a streamed block's base weights sit in host memory between
    its forwards, so its factors would too. Every factor goes to the device of the model's first parameter (its
    input projection: resident in every residency), keeping its Parameter object (`.data`)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for name, p in layer.named_parameters():
                if "lora_" in name and p.device != device:
                    p.data = p.data.to(device)


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, targets: str | Sequence[str] = PROJECTIONS,
             *, seed: int = 0, init: str = "default") -> LoraHandle:
    """Inject a fresh LoRA adapter into `model` in place (module docstring); returns the handle."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise AdapterError(f"LoRA seed={seed!r}: must be an integer >= 0")
    return inject(model, lora_config(rank, alpha, parse_targets(targets), init), seed=int(seed))


def remove_lora(model: nn.Module, handle: LoraHandle | None = None) -> None:
    """Put every wrapped module's base layer back, drop peft's config from the model and restore the base parameters'
    `requires_grad` flags (those `handle` recorded; without a handle they are left as peft set them)."""
    for path, layer in lora_layers(model):
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, layer.get_base_layer())
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        model.__dict__.pop(attr, None)
    if handle is not None:
        for name, p in model.named_parameters():
            if name in handle.requires_grad:
                p.requires_grad_(handle.requires_grad[name])


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model as the reference policy: every LoRA layer's adapter switched off with peft's own
    `enable_adapters(False)` (what `PeftModel.disable_adapter` does), no second copy of the weights; the adapter and
    every `requires_grad` flag are put back on exit. A model without LoRA is refused (its reference is itself)."""
    layers = lora_layers(model)
    if not layers:
        raise AdapterError("the model carries no LoRA adapter: the adapter-off reference policy needs one")
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for _, layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for _, layer in layers:
            layer.enable_adapters(True)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])


@contextlib.contextmanager
def pinned_fingerprint(model: nn.Module) -> Iterator[str]:
    """Hold `model.fingerprint` at the base weights' fingerprint while an adapter is attached (the checkpoint a run
    records is the base; the adapter is recorded by its own digest), restored afterwards."""
    had = model.__dict__.get("fingerprint", None) if isinstance(model, nn.Module) else None
    fp = base_fingerprint(model)  # the adapter may be injected already (an in-place adapter, `adapters.apply`)
    model.fingerprint = fp
    try:
        yield fp
    finally:
        if had is None:
            model.__dict__.pop("fingerprint", None)
        else:
            model.fingerprint = had


def base_fingerprint(model: nn.Module) -> str:
    """The fingerprint of the base weights of a model that may carry an adapter: `model.fingerprint` when set, else
    the weights digest of the state dict with the adapter removed (peft's `base_layer.` renaming undone)."""
    fp = getattr(model, "fingerprint", "")
    if isinstance(fp, str) and fp:
        return fp
    if not has_lora(model):
        return model_fingerprint(model)

    class _Base:
        def state_dict(self) -> dict[str, torch.Tensor]:
            return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}

    return model_fingerprint(_Base())


# ================================================================================================ files
def config_json(config: Any) -> bytes:
    """`adapter_config.json` bytes: peft's `to_dict`, sets as sorted lists, no runtime config, sorted keys."""
    data = config.to_dict()
    data.pop("runtime_config", None)
    data = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in data.items()}
    data["peft_type"] = str(getattr(data["peft_type"], "value", data["peft_type"]))
    if data.get("task_type") is not None:
        data["task_type"] = str(getattr(data["task_type"], "value", data["task_type"]))
    return json.dumps(data, indent=2, sort_keys=True).encode("utf-8")


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under module-path keys (`transformer_blocks.0.attn.to_q.lora_A.weight`), float32,
    contiguous host copies, through peft's `get_peft_model_state_dict`."""
    from peft import get_peft_model_state_dict

    if not has_lora(model):
        raise AdapterError("the model carries no LoRA adapter (add_lora or load an adapter first)")
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in sorted(state.items())}


def adapter_files(model: nn.Module) -> dict[str, bytes]:
    """The adapter in PEFT's format as bytes: {adapter_config.json, adapter_model.safetensors} (module docstring)."""
    from safetensors.torch import save

    tensors = {PEFT_PREFIX + k: v for k, v in adapter_state_dict(model).items()}
    return {CONFIG_NAME: config_json(model.peft_config[ADAPTER]),
            WEIGHTS_NAME: save(tensors, metadata={"format": "pt"})}


def adapter_digest(model: nn.Module) -> str:
    """The sha256 the adapter's PEFT files would have (`files_digest` of `adapter_files(model)`)."""
    return files_digest(adapter_files(model))


def save_adapter(model: nn.Module, path: str | Path) -> tuple[Path, str]:
    """Write the adapter as a PEFT directory (atomically: a temp folder renamed into place); returns (path, sha256)."""
    files = adapter_files(model)

    def write(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).write_bytes(data)

    try:
        written = atomic_write_dir(path, write)
    except FileExistsError as exc:
        raise AdapterError(str(exc)) from None
    return written, files_digest(files)


def load_adapter_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy factors keyed by module path (`<path>.lora_A.weight`) into the model's injected adapter (peft's
    `set_peft_model_state_dict`); every adapter tensor must be given and every key must land."""
    from peft import set_peft_model_state_dict

    want = set(adapter_state_dict(model))
    if set(state) != want:
        extra, missing = sorted(set(state) - want), sorted(want - set(state))
        raise AdapterError(f"adapter tensors do not match the injected adapter (missing {missing[:2]}, unexpected "
                           f"{extra[:2]})")
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise AdapterError(f"peft did not place adapter tensor {unexpected[0]!r}")
