"""`ComponentStore`: the components of one snapshot -- where they are, loading them, which stay loaded.

Contract
- `resolve_snapshot(path) -> (Path, model name)`: `None` is the embedded tiny snapshot
  (`h3lab.checkpoint.tiny.default_snapshot()`: the shipped trained snapshot, named "h3-shapes"); anything else must be a directory (one-line
  `CheckpointError`).
- `ComponentStore(path, device, residency="resident", dtype_policy="released", gpu_memory=None)` serves the text encoder, the DiT of
  each variant (`transformer/` for t2va/fl2va, `transformer_ref/` for ref2va), the video VAE and the audio VAE,
  each loaded on first use by `load(name)`. Loading one DiT variant releases the other: two 33B partitions do not
  share a GPU. `load_seconds` accumulates the wall time spent loading (the session books it under "load").
- Residency: `"resident"` keeps every loaded component; `"phased"` releases each after its phase (`phase_done`:
  text encode, condition encode, denoise, decode), so the 32B encoder, the 33B DiT and the decoders never coexist;
  `"streamed"` keeps the components like resident but the DiT's blocks live in (pinned) host memory and stream
  through two GPU slots while they run (`h3lab.components.streaming`): a snapshot DiT is mapped on the CPU and
  packed block by block, never whole on the GPU. `gpu_memory` (GiB, streamed only) is a budget for the DiT's tensors
  on the GPU: the blocks that fit stay resident, the rest stream (refused at construction when even streaming every
  block does not fit). `set_residency(residency, gpu_memory)` switches the policy and re-places the loaded DiTs in
  place (`!streaming on|off`). Device, mesh, residency and budget are one `ExecutionPlan` (`execution.py`, `plan`):
  it places every DiT and hands each run spec its placement and residency (`plan.spec_fields()`).
  `release(*names)` drops components (all without names); they reload on next use.
- Pinned transformers: `set_transformer(model, variant)` serves `variant` with an already-built `H3Transformer`
  instead of the snapshot's weights, after `check_interface` (text_dim = the text encoder's hidden width,
  in_channels / audio_in_channels = the VAEs' latent channels, patch_size = the snapshot variant's when it has one;
  the session device and dtype policy; no meta tensors: one-line `ValidationError`, an unreadable snapshot config is
  a `CheckpointError`). It is served by `load` (booked under "load" at ~0 s) and pinned: `release`, phased
  residency and a variant switch keep it, because dropping the store's reference frees nothing while the caller
  holds the model and a reload would silently swap in the snapshot's weights. `set_transformer(None, variant)`
  unpins it. A model with an empty `fingerprint` gets its weights digest once, at injection.
- `models_for(variant, model)`: the variant lookup a run resolves its factors against (the other partition is
  loaded beside the resident one only when a factor asks for it, H16).
- Snapshot metadata: `read_shifts()` (the two schedulers' `shift`), `read_pipeline_config(overrides)` (the
  ConfigSpecs that shape reference media), `component_config(folder)`.

The store holds no lock: `Session` serialises its calls. Importing it registers the provider of the run-spec field
`residency` (`streaming.check_residency_value` / `residency_field.apply_residency`).
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError, ValidationError
from ..run import FieldProvider, register_field
from . import adaln_host, residency_field, streaming
from .execution import RESIDENCIES, ExecutionPlan, check_plan  # noqa: F401 - RESIDENCIES re-exported

VARIANTS = ("transformer", "transformer_ref")

register_field("residency", FieldProvider(validate=streaming.check_residency_value,
                                          apply=residency_field.apply_residency), replace=True)


def resolve_snapshot(path: str | os.PathLike | None) -> tuple[Path, str]:
    """The snapshot directory and its display name (see the module docstring)."""
    if path is None:
        from ..checkpoint.tiny import default_snapshot

        path = default_snapshot()
        name = "h3-shapes"
    else:
        name = Path(path).resolve().name or str(path)
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"snapshot {str(path)!r}: not a directory")
    return path, name


def check_residency(residency: str, gpu_memory: float | None = None, adaln: str = "resident") -> str:
    """The residency rules of an `ExecutionPlan` (`execution.check_plan`), before anything is built."""
    return check_plan(residency, gpu_memory, adaln=adaln)


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValidationError(f"variant={variant!r}: must be 'transformer' or 'transformer_ref'")
    return variant


class ComponentStore:
    """The loaded components of one snapshot and their residency (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, device: torch.device, residency: str = "resident",
                 dtype_policy: str = "released", gpu_memory: float | None = None, mesh: Any = None,
                 adaln: str = "resident"):
        self.path = Path(path)
        # the one owner of device, mesh, residency, budget and AdaLN placement: it places every DiT and hands specs
        # their fields
        self.plan = ExecutionPlan(device, residency, gpu_memory, mesh, adaln)
        self.dtype_policy = dtype_policy
        self.components: dict[str, Any] = {}
        self.injected: dict[str, Any] = {}  # variant -> pinned caller-built transformer (`set_transformer`)
        self.load_seconds = 0.0  # cumulative component loading time
        if self.gpu_memory is not None:
            self.plan_for("transformer")  # an impossible budget fails here, before anything loads

    @property
    def device(self) -> torch.device:
        return self.plan.device

    @property
    def residency(self) -> str:
        return self.plan.residency

    @property
    def gpu_memory(self) -> float | None:
        return self.plan.gpu_memory

    @property
    def adaln(self) -> str:
        """Where the blocks' AdaLN weights live: "resident" or "tables" (host memory; tables on the device)."""
        return self.plan.adaln

    @property
    def mesh(self) -> Any:
        """The `h3lab.distributed` Mesh every transformer is parallelized on in place (None: one process)."""
        return self.plan.mesh

    # -------------------------------------------------------------------------------------- snapshot
    def read_shifts(self) -> tuple[float, float]:
        from ..run.sampler import AUDIO_SHIFT, VIDEO_SHIFT

        shifts = []
        for folder, default in (("scheduler", VIDEO_SHIFT), ("audio_scheduler", AUDIO_SHIFT)):
            cfg = self.path / folder / "scheduler_config.json"
            if cfg.is_file():
                try:
                    shifts.append(float(json.loads(cfg.read_text(encoding="utf-8"))["shift"]))
                    continue
                except (ValueError, KeyError, TypeError) as err:
                    raise CheckpointError(f"{cfg}: cannot read 'shift' ({err})") from None
            shifts.append(default)
        return shifts[0], shifts[1]

    def read_pipeline_config(self, overrides: dict[str, int]) -> dict[str, int]:
        """The pipeline's ConfigSpecs that shape reference media (canvas_short_edge, canvas_max_pixels,
        reference_image_short_edge): the released values, replaced by the snapshot's `modular_model_index.json`
        (or, without one, `model_index.json`, as Diffusers' modular loader reads them), then by `overrides`."""
        from . import references as refs

        out = {
            "canvas_short_edge": refs.CANVAS_SHORT_EDGE,
            "canvas_max_pixels": refs.CANVAS_MAX_PIXELS,
            "reference_image_short_edge": refs.IMAGE_SHORT_EDGE,
        }
        for name in ("modular_model_index.json", "model_index.json"):
            index = self.path / name
            if not index.is_file():
                continue
            try:
                data = json.loads(index.read_text(encoding="utf-8"))
            except ValueError as err:
                raise CheckpointError(f"{index}: not JSON ({err})") from None
            out.update({k: int(data[k]) for k in out if isinstance(data.get(k), int)})
            break
        for key, value in overrides.items():
            if key not in out:
                raise ValidationError(f"pipeline_config key {key!r}: must be one of {', '.join(out)}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 32:
                raise ValidationError(f"pipeline_config {key}={value!r}: must be an integer >= 32")
            out[key] = value
        return out

    def component_config(self, folder: str) -> dict[str, Any]:
        path = self.path / folder / "config.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read ({err.strerror or err})") from None
        except ValueError as err:
            raise CheckpointError(f"{path}: not JSON ({err})") from None
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: must hold a JSON object")
        return data

    # -------------------------------------------------------------------------------------- loading
    def load(self, name: str) -> Any:
        """Component `name` ("text_encoder", "transformer", "transformer_ref", "vae", "audio_vae"), loaded on first
        use; the loading time goes to `load_seconds`."""
        comp = self.components.get(name)
        if comp is not None:
            return comp
        t0 = time.perf_counter()
        try:
            comp = self._load_component(name)
        finally:
            self.load_seconds += time.perf_counter() - t0
        self.components[name] = comp
        return comp

    def dit(self, variant: str, layers: int | None = None, blocks=None):
        """The DiT of `variant` with the blocks a run needs resident (`layers` of them, or exactly `blocks`; None:
        all): a snapshot model whose blocks layer thinning released is loaded again (`h3lab.presets`). A pinned
        (`set_transformer`) model is never released, so never reloaded."""
        from ..presets import needs_reload

        model = self.load(variant)
        if variant not in self.injected and needs_reload(model, layers, blocks):
            self.components.pop(variant, None)
            model = self.load(variant)
        return model

    def release_blocks(self, variant: str, model, blocks) -> tuple[int, ...]:
        """Free the weights of the blocks of `model` (the DiT of `variant`) that a thinned run does not run
        (`h3lab.presets.release_dropped`); a streamed DiT's streamer forgets them and plans the rest again, the AdaLN
        tables' host source drops their host buffers. A pinned
        (`set_transformer`) model is never released. Returns the blocks released now."""
        from ..presets import release_dropped

        if variant in self.injected:
            return ()
        released = release_dropped(model, blocks)
        streamer, source = streaming.streamer_of(model), adaln_host.source_of(model)
        if released and streamer is not None:
            streamer.forget_released()
        if released and source is not None:
            source.forget_released()
        return released

    def _load_component(self, name: str) -> Any:
        if name in VARIANTS:
            # Two 33B partitions do not share a GPU: loading one variant releases the other.
            self.release("transformer_ref" if name == "transformer" else "transformer")
            comp = self.injected.get(name)  # pinned by set_transformer: no disk read
            comp = self._load_transformer(name) if comp is None else self._place(comp, name)
        elif name == "text_encoder":
            from .text_encoder import TextEncoder

            comp = TextEncoder.from_pretrained(self.path, device=self.device)
        elif name == "vae":
            from .video_vae import VideoVAE

            comp = VideoVAE.from_pretrained(self.path, device=self.device)
        elif name == "audio_vae":
            from .audio_vae import AudioVAE

            comp = AudioVAE.from_pretrained(self.path, device=self.device)
        else:  # pragma: no cover - internal names only
            raise KeyError(name)
        return comp

    def _load_transformer(self, variant: str):
        """The snapshot's DiT of `variant` on the store device, in the store's dtype policy, frozen. Streamed: mapped
        on the CPU, then placed (the blocks never sit on the GPU all at once)."""
        from ..model import H3Transformer

        streamed = self.residency == "streamed" or self.plan.tables  # mapped on the CPU, placed block by block
        if self.mesh is not None and self.mesh.topology.tp > 1:  # each rank reads only its TP shard from the files
            from ..distributed.shard_load import load_sharded_transformer

            model = load_sharded_transformer(self.path, self.mesh, subfolder=variant,
                                             device="cpu" if streamed else self.device,
                                             dtype_policy=self.dtype_policy)  # streamed: placed from host memory
            return self._place(model.requires_grad_(False), variant)
        model = H3Transformer.from_pretrained(self.path, subfolder=variant, device=None if streamed else self.device,
                                              dtype_policy=self.dtype_policy)
        return self._place(model.eval().requires_grad_(False), variant)

    # -------------------------------------------------------------------------------------- residency
    def _place(self, model, variant: str):
        """Make a DiT's placement the execution plan's (`ExecutionPlan.place`)."""
        return self.plan.place(model, variant)

    def plan_for(self, model_or_variant):
        """The streaming plan of a model (or of a snapshot variant, read on the meta device) under the store's
        budget; raises when the budget cannot hold even the streamed DiT."""
        model = model_or_variant
        if isinstance(model, str):
            from ..config import H3Config
            from ..model import H3Transformer

            with torch.device("meta"):
                model = H3Transformer(H3Config.from_dict(self.component_config(model)), dtype_policy=self.dtype_policy)
        return self.plan.streaming_plan(model)

    def set_residency(self, residency: str, gpu_memory: float | None = None, adaln: str | None = None) -> list[str]:
        """Switch the policy (and, given, the AdaLN placement) and re-place every loaded DiT in place; returns what
        each now does. The refusals (an unknown policy, a budget that cannot hold the streamed DiT, blocks that do
        not fit back on the GPU) are checked before any block moves."""
        dits = [(v, self.components[v]) for v in VARIANTS if v in self.components]
        before = self.plan
        changes = {"residency": residency, "gpu_memory": gpu_memory, **({"adaln": adaln} if adaln else {})}
        self.plan = self.plan.replace(**changes)  # checks the rules first
        try:
            if residency == "streamed":
                for _, model in dits:
                    self.plan_for(model)  # every plan checked before any block moves
            for variant, model in dits:
                self._place(model, variant)
        except Exception:
            self.plan = before
            raise
        return self.describe()

    def describe(self) -> list[str]:
        """The policy, and per loaded DiT what stays on the GPU."""
        return self.plan.describe({v: self.components[v] for v in VARIANTS if v in self.components})

    def transformer(self, variant: str = "transformer"):
        """The DiT of a variant ("transformer" for t2va/fl2va, "transformer_ref" for ref2va), loaded on first use."""
        return self.load(check_variant(variant))

    def release(self, *names: str) -> None:
        """Drop components (all when no name is given); they reload on next use. A transformer injected with
        `set_transformer` is pinned and stays (see the module docstring)."""
        dropped = False
        for name in names or tuple(self.components):
            if name in self.injected:
                continue
            dropped |= self.components.pop(name, None) is not None
        if dropped:
            gc.collect()
            streaming.empty_caches(self.device)  # device blocks, and the pinned host buffers of a streamed DiT

    def phase_done(self, *names: str) -> None:
        """A phase that used `names` ended: phased residency releases them."""
        if self.residency == "phased":
            self.release(*names)

    @property
    def loaded(self) -> list[str]:
        return sorted(self.components)

    # -------------------------------------------------------------------------------------- pinned transformers
    def set_transformer(self, model: Any, variant: str = "transformer") -> None:
        """Serve `variant` with `model` (or, with None, the snapshot's weights again); see the module docstring."""
        check_variant(variant)
        if model is None:
            if self.injected.pop(variant, None) is not None:
                self.components.pop(variant, None)
            return
        self.check_interface(model, variant)
        if isinstance(getattr(model, "fingerprint", None), str) and not model.fingerprint:
            from ..hashing import model_fingerprint

            model.fingerprint = model_fingerprint(model)
        model.eval().requires_grad_(False)
        self.components.pop(variant, None)  # the variant's previous model, if any; `load` installs this one
        self.injected[variant] = model

    def check_interface(self, model: Any, variant: str) -> None:
        """The rules of `set_transformer`: an H3Transformer whose interface widths are the snapshot's, on the
        store device, in the store's dtype policy, with no meta tensors."""
        from ..model import H3Transformer

        where = f"set_transformer({variant})"
        if not isinstance(model, H3Transformer):
            raise ValidationError(f"{where}: model is a {type(model).__name__}; must be an h3lab H3Transformer")
        c = model.config
        text_cfg = self.component_config("text_encoder")
        text_width = text_cfg.get("text_config", text_cfg).get("hidden_size")
        wants: list[tuple[str, Any, Any, str]] = [
            ("text_dim", c.text_dim, text_width, "the text encoder's hidden width (text_encoder/config.json)"),
            ("in_channels", c.in_channels, self.component_config("vae").get("latent_channels"),
             "the video VAE's latent channels (vae/config.json)"),
            ("audio_in_channels", c.audio_in_channels, self.component_config("audio_vae").get("latent_channels"),
             "the audio VAE's latent channels (audio_vae/config.json)"),
        ]
        if (self.path / variant / "config.json").is_file():
            patch = self.component_config(variant).get("patch_size")
            wants.append(("patch_size", c.patch_size, patch, f"the snapshot's {variant}/config.json patch_size"))
        for key, got, want, rule in wants:
            want = tuple(want) if isinstance(want, list) else want  # patch_size is a JSON list
            if want is None:
                raise CheckpointError(f"{self.path}: the snapshot does not state {rule}")
            if got != want:
                raise ValidationError(f"{where}: {key}={got!r} must equal {rule}, {want!r}")
        if model.dtype_policy != self.dtype_policy:
            raise ValidationError(
                f"{where}: dtype_policy={model.dtype_policy!r} must be the session's, {self.dtype_policy!r}"
            )
        streamer = streaming.streamer_of(model)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_meta:
                raise ValidationError(f"{where}: {name} is a meta tensor; materialise the model first")
            if streamer is not None and streamer.device == self.device:
                continue  # streamed: its blocks live in host memory by design
            if t.device.type != self.device.type or (
                self.device.index is not None and t.device.index not in (None, self.device.index)
            ):
                raise ValidationError(f"{where}: {name} is on {t.device}; must be on the session device {self.device}")

    # -------------------------------------------------------------------------------------- factor lookups
    def other_variant(self, variant: str):
        """The other transformer partition, loaded beside the resident one without registering it (H16 only)."""
        other = "transformer" if variant == "transformer_ref" else "transformer_ref"
        if other in self.injected:
            return self._place(self.injected[other], other)
        t0 = time.perf_counter()
        try:
            return self._load_transformer(other)
        finally:
            self.load_seconds += time.perf_counter() - t0

    def models_for(self, variant: str, model) -> Callable[[str], Any]:
        """The `models` lookup a run resolves its factors against: `variant` is `model`; the other partition is
        loaded on first ask (`other_variant`, only a factor that swaps the transformer asks, H16) and kept for the
        runs of this lookup (drift's three executions load it once)."""
        loaded = {variant: model}

        def lookup(name: str):
            if name not in VARIANTS:
                raise ValidationError(f"model {name!r}: the session serves {', '.join(VARIANTS)}")
            if name not in loaded:
                loaded[name] = self.other_variant(variant)
            return loaded[name]

        return lookup
