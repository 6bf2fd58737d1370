"""`Session`: one resident MiniMax-H3 workbench -- snapshot, components, conditioning cache, `generate`.

Contract
- `Session(path=None, device=None, residency="resident")`. `path=None` is the embedded tiny snapshot
  (`h3lab.checkpoint.tiny.default_snapshot()`); `device=None` is CUDA when available, else the CPU. Components load on
  first use: the text encoder, the DiT of the variant a request needs (`transformer/` for t2va/fl2va,
  `transformer_ref/` for ref2va; switching variants releases the other, two 33B partitions do not share a GPU), the
  video VAE and the audio VAE. `residency="resident"` keeps them; `"phased"` releases each after its phase (text
  encode, condition encode, denoise, decode) so the 32B encoder, the 33B DiT and the decoders never coexist.
- `mesh=` (an `h3lab.distributed.Mesh`; the torchrun front end passes one): every transformer the session loads or
  is given is parallelized on it in place (`h3lab.distributed.parallelize`, named by its variant) and every run
  spec records the topology (`RunSpec.placement`), so a sealed run replays on it.
- `set_transformer(model, variant="transformer")` gives the session an already-built `H3Transformer` for a variant
  instead of the snapshot's weights (a full-size random DiT built on the GPU, an edited model). It is checked against
  the snapshot's interface -- `text_dim` = the text encoder's hidden width, `in_channels` = the video VAE's latent
  channels, `audio_in_channels` = the audio VAE's, `patch_size` = the snapshot variant's when it has one -- and must
  live on the session device with the session's dtype policy (one-line `ValidationError`; an unreadable snapshot
  config is a `CheckpointError`). It is served by the normal loading path (`_load`, booked under "load" at ~0 s).
  An injected model is **pinned**: `release`, phased residency and a variant switch keep it resident, because
  dropping the session's reference frees nothing while the caller holds the model and a reload would silently swap
  in the snapshot's weights. `set_transformer(None, variant)` unpins it; the snapshot's weights load on next use. A
  model whose `fingerprint` is empty gets its weights digest (`trajectory.model_fingerprint`) once, at injection, so
  trajectories record what ran without rehashing every parameter on every request.
- `generate(prompt | GenerationSettings, **overrides) -> GenerationResult`. Every setting, the prompt (not blank;
  within the text encoder's context, counted by the tokenizer alone) and every output path (`check_outputs`) are
  validated and every input file probed and decoded (kind, truncation, streams, reference rules, audio durations)
  before any model loads or anything is encoded, so a rejected request leaves the session exactly as it was. The
  outputs are written as one set (all to temp files, then all renamed); a cancel seen after the last pass stops
  before decoding. `device` is checked at construction (`resolve_device`: cpu, or cuda when this torch has it). Text conditioning is cached by the text encoder's
  `cache_key` over the prompt and the presented media; visual/audio conditioning latents per item by content hash +
  geometry. Repeating a prompt with a new seed therefore skips both encoders: `result.timings["text_encode"] == 0`
  and `result.cached["text"]`.
- The denoise loop is the released one (facts brief section 7; Diffusers `before_denoise.py` / `denoise.py`),
  run by `h3lab.run.denoise` (the one loop every caller shares) from the request's `RunSpec`: noise drawn from one
  CPU generator seeded with the request seed in the released order (one draw per visual condition, then the video
  noise as a latent tensor, then the audio noise in row layout); per pass one transformer forward over the packed
  rows in the request's runtime mode, then one Euler step per modality on its own schedule on the target rows only
  (conditioning rows are never written). `--steps N` = N passes = N + 1 grid points. With `reuse > 1` skipped passes
  extrapolate velocities (`h3lab.sampler.reuse_plan`). Ablation factors (`h3lab.ablation`) are named in the spec
  and applied by the loop; `drift` and `verify` re-run a result's or a sealed trajectory's spec exactly.
- Every pass goes to a `trajectory.TrajectoryRecorder`; `result.trajectory` is the recorded `Trajectory` (sealed
  inputs, per-pass hashes, provenance) and `result.trajectory_hash` its digest, which replays' `# expect` lines
  check. `Session.keep` picks the per-pass tensors kept in memory (default none: hashes only).
- `progress(StepInfo)` is called after every pass; `cancel` (a `threading.Event`) is checked before every pass and
  raises `GenerationCancelled` (the session stays usable). `preview(frame, step, total)` receives the preview frame
  of every pass (`preview_frame`: the x0 estimate's middle latent frames, decoded, middle pixel frame).
- Timings (seconds, CUDA-synchronised) per phase: text_encode, condition_encode, denoise, decode_video, decode_audio,
  write; component loading triggered inside a phase is booked under "load" instead (first use, phased residency), and
  a text / condition phase served entirely from the cache reports 0 (its key hashing is booked as "cache_lookup").
  Peak memory: `torch.cuda.max_memory_allocated` on CUDA (reset per request), else the process peak RSS (`VmHWM`,
  reset per request through /proc/self/clear_refs where the kernel allows it, else the process lifetime peak).
"""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .errors import CheckpointError, H3Error, ValidationError
from .io_utils import atomic_write_all, check_distinct, check_output_dir, check_output_file
from .settings import AUDIO_SAMPLE_RATE, FPS, REFERENCE_KINDS, GenerationSettings, check_prompt

VARIANTS = ("transformer", "transformer_ref")
PHASES = ("text_encode", "condition_encode", "denoise", "decode_video", "decode_audio", "write")
RESIDENCIES = ("resident", "phased")


class GenerationCancelled(H3Error):
    """The front end set the cancel event; the generation stopped between two passes."""


# ------------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class StepInfo:
    step: int  # 1-based pass number just completed
    total: int
    video_t: float
    audio_t: float
    evaluated: bool  # the model ran (False: reused velocity)
    seconds: float  # wall time of this pass


@dataclass
class GenerationResult:
    settings: GenerationSettings
    seed: int
    frames: np.ndarray  # uint8 (F, H, W, 3) at the output size
    audio: torch.Tensor  # float32 (2, S) stereo, in [-1, 1]
    sample_rate: int
    layout: Any  # h3lab.layout.PackedLayout
    latents: torch.Tensor  # final target video latents, normalised, (C, T, h, w) float32 CPU
    audio_latents: torch.Tensor  # final target audio rows, normalised, (2A, C) float32 CPU
    trajectory: Any  # the recorder the loop fed
    trajectory_hash: str
    timings: dict[str, float]
    cached: dict[str, bool]
    peak_memory: int  # bytes
    memory_kind: str
    trace: Any = None  # runtime Trace of the last forward
    outputs: list[Path] = field(default_factory=list)
    evaluations: int = 0  # transformer forwards run
    arm: Any = field(default=None, repr=False)  # the `RunSpec` that ran (= trajectory.spec): `Session.drift`

    @property
    def total_seconds(self) -> float:
        return sum(self.timings.values())

    @property
    def duration(self) -> float:
        return self.frames.shape[0] / FPS

    def timing_lines(self) -> list[str]:
        lines = []
        for phase in ("load", "cache_lookup") + PHASES:
            if phase == "cache_lookup" and phase not in self.timings:
                continue
            value = self.timings.get(phase, 0.0)
            note = ""
            if phase == "text_encode" and self.cached.get("text"):
                note = " (cached)"
            if phase == "condition_encode" and self.cached.get("conditions"):
                note = " (cached)"
            lines.append(f"  {phase:<16} {value:8.3f} s{note}")
        lines.append(f"  {'total':<16} {self.total_seconds:8.3f} s")
        lines.append(f"  peak memory      {self.peak_memory / 2**20:8.1f} MiB ({self.memory_kind})")
        lines.append(f"  forwards         {self.evaluations:8d}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no tensors)."""
        return {
            "settings": self.settings.to_dict(),
            "seed": self.seed,
            "frames": list(self.frames.shape),
            "audio": list(self.audio.shape),
            "sample_rate": self.sample_rate,
            "trajectory_hash": self.trajectory_hash,
            "trajectory_format": self.trajectory.manifest.get("format"),
            "timings": dict(self.timings),
            "cached": dict(self.cached),
            "peak_memory_bytes": self.peak_memory,
            "memory_kind": self.memory_kind,
            "evaluations": self.evaluations,
            "outputs": [str(p) for p in self.outputs],
        }


# ------------------------------------------------------------------------------------------------ helpers
def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a session runs on, checked before anything loads: `None` is `default_device()`; "cpu"; "cuda" or
    "cuda:N" only when this torch build has CUDA and GPU N exists. Anything else is a one-line `ValidationError`."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValidationError(f"device={device!r}: not a device name (cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValidationError(f"device={device!r}: h3lab runs on cpu or cuda (strict kernels exist for those two)")
    if torch.version.cuda is None:
        raise ValidationError(f"device={device!r}: this torch build ({torch.__version__}) has no CUDA; use --device cpu")
    if not torch.cuda.is_available():
        raise ValidationError(f"device={device!r}: no CUDA GPU is visible to torch {torch.__version__}; use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValidationError(f"device={device!r}: GPU {dev.index} does not exist ({count} visible: cuda:0..{count - 1})")
    return dev


def check_outputs(output: Any = None, wav: Any = None, frames_dir: Any = None) -> dict[str, Path | None]:
    """The output paths of one generation, checked before any work (`io_utils`: suffix, an existing file of the
    right kind, a folder that accepts new files, three distinct paths). Returns them expanded (None when unset)."""
    paths = {
        "output": check_output_file(output, (".mp4",), "output") if output else None,
        "wav": check_output_file(wav, (".wav",), "wav output") if wav else None,
        "frames_dir": check_output_dir(frames_dir, "frames folder") if frames_dir else None,
    }
    check_distinct([("output", paths["output"]), ("wav output", paths["wav"]), ("frames folder", paths["frames_dir"])])
    return paths


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def upscale_frames(frames: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 (F, h, w, 3) -> uint8 (F, height, width, 3), bicubic (torch, align_corners=False), clamped, rounded."""
    if frames.shape[1:3] == (height, width):
        return frames
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).to(torch.float32)
    y = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", align_corners=False)
    return y.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


class _Timer:
    """Wall time of one phase, CUDA-synchronised, minus the component loading it triggered (booked as "load")."""

    def __init__(self, session: "Session", timings: dict[str, float], phase: str):
        self.device, self.session, self.timings, self.phase = session.device, session, timings, phase

    def __enter__(self):
        self._sync()
        self.t0 = time.perf_counter()
        self.load0 = self.session.load_seconds
        return self

    def __exit__(self, *exc):
        self._sync()
        loading = self.session.load_seconds - self.load0
        self.timings[self.phase] = self.timings.get(self.phase, 0.0) + time.perf_counter() - self.t0 - loading
        self.timings["load"] = self.timings.get("load", 0.0) + loading
        return False

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ------------------------------------------------------------------------------------------------ session
@dataclass
class _Media:
    """A request's conditioning media, decoded and normalised (numpy, CPU)."""

    keyframes: list  # [components.references.Keyframe] on the canvas, packed order
    references: list  # [ImageRef | VideoRef | AudioRef], normalised, request order


class _LRU(dict):
    """A small insertion-ordered cache: the oldest entry goes when `limit` is exceeded; a hit moves to the end."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def hit(self, key: str) -> Any:
        value = self.pop(key, None)
        if value is not None:
            self[key] = value
        return value

    def put(self, key: str, value: Any) -> None:
        self.pop(key, None)
        self[key] = value
        while len(self) > self.limit:
            self.pop(next(iter(self)))


@dataclass
class _TextEntry:
    embeds: torch.Tensor  # (1, L, text_dim) on the session device
    tags: torch.Tensor  # (L,) int64 CPU
    summary: str


@dataclass
class _CondEntry:
    """One encoded keyframe or reference."""

    video: torch.Tensor | None  # (C, T, h, w) float32 CPU, normalised (keyframe, image or video reference)
    audio: torch.Tensor | None  # (2A, C) float32 CPU clean soundtrack rows (audio-bearing reference)
    summary: str


@dataclass
class _CondSet:
    """The conditioning latents of one request, in packed order."""

    video: list  # [(C, T, h, w)]
    audio: list  # [(2A, C)]


COND_SALT = "h3lab-condition-latents"


class Session:
    """A resident MiniMax-H3 workbench (see the module docstring)."""

    CACHE_LIMIT = 16

    def __init__(self, path: str | os.PathLike | None = None, device: str | torch.device | None = None,
                 residency: str = "resident", dtype_policy: str = "released",
                 pipeline_config: dict[str, int] | None = None, mesh: Any = None):
        if residency not in RESIDENCIES:
            raise ValidationError(f"residency={residency!r}: must be one of {', '.join(RESIDENCIES)}")
        if path is None:
            from .checkpoint.tiny import default_snapshot

            path = default_snapshot()
            self.model_name = "h3-tiny"
        else:
            self.model_name = Path(path).resolve().name or str(path)
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"snapshot {str(self.path)!r}: not a directory")
        self.device = resolve_device(device)
        self.residency = residency
        self.dtype_policy = dtype_policy
        self.mesh = mesh  # an h3lab.distributed Mesh: every transformer is parallelized on it, specs record it
        self.keep: tuple[str, ...] = ()  # trajectory tensors to keep in memory ("latents", "velocities")
        self._components: dict[str, Any] = {}
        self._injected: dict[str, Any] = {}  # variant -> pinned caller-built transformer (`set_transformer`)
        self.load_seconds = 0.0  # cumulative component loading time
        self._lock = threading.RLock()  # one generation at a time
        self._text_cache = _LRU(self.CACHE_LIMIT)
        self._cond_cache = _LRU(4 * self.CACHE_LIMIT)
        self._prompt_bound = None  # components.text_encoder.PromptBound, loaded on the first prompt check
        self.video_shift, self.audio_shift = self._read_shifts()
        self.pipeline_config = self._read_pipeline_config(pipeline_config or {})

    # -------------------------------------------------------------------------------------- snapshot
    def _read_shifts(self) -> tuple[float, float]:
        from .sampler import AUDIO_SHIFT, VIDEO_SHIFT

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

    def _read_pipeline_config(self, overrides: dict[str, int]) -> dict[str, int]:
        """The pipeline's ConfigSpecs that shape reference media (canvas_short_edge, canvas_max_pixels,
        reference_image_short_edge): the released values, replaced by the snapshot's `modular_model_index.json`
        (or, without one, `model_index.json`, as Diffusers' modular loader reads them), then by `overrides`."""
        from .components import references as refs

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

    # -------------------------------------------------------------------------------------- components
    def _load(self, name: str) -> Any:
        comp = self._components.get(name)
        if comp is not None:
            return comp
        t0 = time.perf_counter()
        try:
            comp = self._load_component(name)
        finally:
            self.load_seconds += time.perf_counter() - t0
        self._components[name] = comp
        return comp

    def _load_component(self, name: str) -> Any:
        if name in ("transformer", "transformer_ref"):
            # Two 33B partitions do not share a GPU: loading one variant releases the other.
            self.release("transformer_ref" if name == "transformer" else "transformer")
            comp = self._injected.get(name)  # pinned by set_transformer: no disk read
            if comp is None:
                from .model import H3Transformer

                comp = H3Transformer.from_pretrained(
                    self.path, subfolder=name, device=self.device, dtype_policy=self.dtype_policy
                )
                comp.eval().requires_grad_(False)
            self._place(comp, name)
        elif name == "text_encoder":
            from .components.text_encoder import TextEncoder

            comp = TextEncoder.from_pretrained(self.path, device=self.device)
        elif name == "vae":
            from .components.video_vae import VideoVAE

            comp = VideoVAE.from_pretrained(self.path, device=self.device)
        elif name == "audio_vae":
            from .components.audio_vae import AudioVAE

            comp = AudioVAE.from_pretrained(self.path, device=self.device)
        else:  # pragma: no cover - internal names only
            raise KeyError(name)
        return comp

    def release(self, *names: str) -> None:
        """Drop components (all when no name is given); they reload on next use. Caches are kept. A transformer
        injected with `set_transformer` is pinned and stays (see the module docstring)."""
        dropped = False
        for name in names or tuple(self._components):
            if name in self._injected:
                continue
            dropped |= self._components.pop(name, None) is not None
        if dropped:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _phase_done(self, *names: str) -> None:
        if self.residency == "phased":
            self.release(*names)

    @property
    def loaded(self) -> list[str]:
        return sorted(self._components)

    @property
    def injected(self) -> list[str]:
        """Variants served by a model given with `set_transformer` (pinned)."""
        return sorted(self._injected)

    def set_transformer(self, model: Any, variant: str = "transformer") -> None:
        """Serve `variant` ("transformer" or "transformer_ref") with `model`, an `H3Transformer` on the session
        device, instead of the snapshot's weights; `model=None` goes back to the snapshot's. Checked against the
        snapshot's interface before anything changes; the model is pinned (module docstring)."""
        if variant not in VARIANTS:
            raise ValidationError(f"variant={variant!r}: must be 'transformer' or 'transformer_ref'")
        with self._lock:
            if model is None:
                if self._injected.pop(variant, None) is not None:
                    self._components.pop(variant, None)
                return
            self._check_interface(model, variant)
            if isinstance(getattr(model, "fingerprint", None), str) and not model.fingerprint:
                from .trajectory import model_fingerprint

                model.fingerprint = model_fingerprint(model)
            model.eval().requires_grad_(False)
            self._components.pop(variant, None)  # the variant's previous model, if any; `_load` installs this one
            self._injected[variant] = model

    def _check_interface(self, model: Any, variant: str) -> None:
        """The rules of `set_transformer`: an H3Transformer whose interface widths are the snapshot's, on the
        session device, in the session's dtype policy, with no meta tensors."""
        from .model import H3Transformer

        where = f"set_transformer({variant})"
        if not isinstance(model, H3Transformer):
            raise ValidationError(f"{where}: model is a {type(model).__name__}; must be an h3lab H3Transformer")
        c = model.config
        text_cfg = self._component_config("text_encoder")
        text_width = text_cfg.get("text_config", text_cfg).get("hidden_size")
        wants: list[tuple[str, Any, Any, str]] = [
            ("text_dim", c.text_dim, text_width, "the text encoder's hidden width (text_encoder/config.json)"),
            ("in_channels", c.in_channels, self._component_config("vae").get("latent_channels"),
             "the video VAE's latent channels (vae/config.json)"),
            ("audio_in_channels", c.audio_in_channels, self._component_config("audio_vae").get("latent_channels"),
             "the audio VAE's latent channels (audio_vae/config.json)"),
        ]
        if (self.path / variant / "config.json").is_file():
            patch = self._component_config(variant).get("patch_size")
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
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_meta:
                raise ValidationError(f"{where}: {name} is a meta tensor; materialise the model first")
            if t.device.type != self.device.type or (
                self.device.index is not None and t.device.index not in (None, self.device.index)
            ):
                raise ValidationError(f"{where}: {name} is on {t.device}; must be on the session device {self.device}")

    def _component_config(self, folder: str) -> dict[str, Any]:
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

    def transformer(self, variant: str = "transformer"):
        """The DiT of a variant ("transformer" for t2va/fl2va, "transformer_ref" for ref2va), loaded on first use."""
        if variant not in ("transformer", "transformer_ref"):
            raise ValidationError(f"variant={variant!r}: must be 'transformer' or 'transformer_ref'")
        return self._load(variant)

    @staticmethod
    def variant_for(task: str) -> str:
        return "transformer_ref" if task == "ref2va" else "transformer"

    # -------------------------------------------------------------------------------------- status / cache
    def status(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "snapshot": str(self.path),
            "device": str(self.device),
            "residency": self.residency,
            "loaded": self.loaded,
            "cache_entries": len(self._text_cache) + len(self._cond_cache),
        }

    def cache_info(self) -> list[dict[str, str]]:
        out = [{"kind": "text", "key": k, "summary": v.summary} for k, v in self._text_cache.items()]
        out += [{"kind": "condition", "key": k, "summary": v.summary} for k, v in self._cond_cache.items()]
        return out

    def clear_cache(self) -> int:
        n = len(self._text_cache) + len(self._cond_cache)
        self._text_cache.clear()
        self._cond_cache.clear()
        return n

    # -------------------------------------------------------------------------------------- validation
    def settings(self, request: str | GenerationSettings | None = None, **overrides: Any) -> GenerationSettings:
        """Validated settings from a prompt or a settings object plus overrides (no file is read)."""
        if isinstance(request, GenerationSettings):
            return request.replace(**overrides) if overrides else request
        if request is not None:
            overrides["prompt"] = request
        return GenerationSettings(**overrides)

    def check_request(self, settings: GenerationSettings) -> GenerationSettings:
        """Check every input file of a request by decoding and normalising it (kinds, truncation, streams, reference
        counts, audio 2-15 s each and 15 s in total, video length) and a non-blank prompt against the text
        encoder's context (`check_prompt_length`), without loading any model or encoding anything. Returns the
        settings with validated paths."""
        settings = settings.checked_paths()
        if settings.prompt.strip():
            self.check_prompt_length(settings.prompt)
        self._load_media(settings)
        return settings

    def check_prompt_length(self, prompt: str) -> int:
        """Tokens of `prompt`; a one-line `ValidationError` above the text encoder's context (tokenizer only, no
        weights: `components.text_encoder.PromptBound`). Anchors and references add label and vision tokens, which
        the text encoder checks again before it runs."""
        if self._prompt_bound is None:
            from .components.text_encoder import PromptBound

            self._prompt_bound = PromptBound.from_pretrained(self.path)
        return self._prompt_bound.check(prompt)

    def _load_media(self, s: GenerationSettings) -> _Media:
        from .components import conditioning, media
        from .components import references as refmod

        width, height = s.canvas
        keyframes = []
        if s.anchors:
            first = media.read_image(s.first) if s.first is not None else None
            last = media.read_image(s.last) if s.last is not None else None
            keyframes = conditioning.prepare_keyframes(first, last, height, width)
        refs = []
        for r in s.references:
            flag = "--" + REFERENCE_KINDS[r.kind]
            if r.kind == "image":
                refs.append(refmod.ImageRef(media.read_image(r.path), source=r.path))
                continue
            if r.kind == "audio":
                media.check_audio_file(r.path, flag)
                refs.append(refmod.AudioRef(media.read_audio(r.path), AUDIO_SAMPLE_RATE, source=r.path))
                continue
            # Kind and completeness first, each error naming the file that is wrong: an image given as a video, a
            # truncated file, a missing soundtrack, a replacement audio file without sound.
            info = media.check_video(r.path, flag, needs_audio=r.kind == "video")
            if r.kind == "video-audio":
                media.check_audio_file(r.audio_path, f"{flag} audio")
            # Decode only what the 24 fps resampling and the truncation to num_frames can use.
            bound = math.ceil(s.num_frames * info.video.fps / FPS) + 2
            frames, fps = media.read_video(r.path, max_frames=bound)
            audio = media.read_audio(r.audio_path) if r.audio_path is not None else None
            refs.append(refmod.VideoRef(frames, fps, audio, AUDIO_SAMPLE_RATE, source=r.path,
                                        audio_source=r.audio or ""))
        if refs:
            cfg = self.pipeline_config
            refs = refmod.normalize_references(
                refs,
                s.num_frames,
                image_short_edge=cfg["reference_image_short_edge"],
                canvas_short_edge=cfg["canvas_short_edge"],
                canvas_max_pixels=cfg["canvas_max_pixels"],
            )
        return _Media(keyframes, refs)

    # -------------------------------------------------------------------------------------- generate
    def generate(
        self,
        request: str | GenerationSettings | None = None,
        *,
        progress: Callable[[StepInfo], None] | None = None,
        cancel: threading.Event | None = None,
        preview: Callable[[np.ndarray, int, int], Any] | None = None,
        output: str | os.PathLike | None = None,
        frames_dir: str | os.PathLike | None = None,
        wav: str | os.PathLike | None = None,
        **overrides: Any,
    ) -> GenerationResult:
        """Generate one clip with sound (see the module docstring). `output` (MP4), `frames_dir` (PNG per frame)
        and `wav` are checked before any work (`check_outputs`) and written in the `write` phase as one set: every
        file is written to a temp file first and all are renamed only when all succeeded (`io_utils.
        atomic_write_all`), so a failure leaves none of them."""
        s = self.settings(request, **overrides).checked_paths()
        check_prompt(s.prompt)
        outputs = check_outputs(output, wav, frames_dir)
        self.check_prompt_length(s.prompt)
        if s.ablations:
            unknown = [n for n in s.ablations if n not in ablation_factors()]
            if unknown:  # fail before any work
                raise ValidationError(f"ablation factor(s) {unknown}: must be among {', '.join(ablation_factors())}")
        with self._lock:
            media = self._load_media(s)  # every input decoded and validated before anything is encoded
            return self._generate(s, media, progress, cancel, preview, outputs["output"], outputs["frames_dir"],
                                  outputs["wav"])

    def _generate(self, s, media, progress, cancel, preview, output, frames_dir, wav) -> GenerationResult:
        from .sampler import DualSchedule

        timings = {phase: 0.0 for phase in ("load",) + PHASES}
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_peak_rss()
        schedule = DualSchedule.from_passes(s.steps, self.video_shift, self.audio_shift)
        if schedule.num_passes != s.steps:
            raise ValidationError(
                f"steps={s.steps}: the shifted sigma grid collapses to {schedule.num_passes} distinct passes"
            )

        with _Timer(self, timings, "text_encode"):
            text, text_cached = self._encode_text(s, media)
        _book_cache_hit(timings, "text_encode", text_cached)
        self._phase_done("text_encoder")

        with _Timer(self, timings, "condition_encode"):
            cond, cond_cached = self._encode_conditions(media)
        _book_cache_hit(timings, "condition_encode", cond_cached)
        self._phase_done("vae", "audio_vae")

        with _Timer(self, timings, "denoise"):
            loop = self._denoise(s, schedule, media, text, cond, progress, cancel, preview)
        self._phase_done("transformer", "transformer_ref")
        if cancel is not None and cancel.is_set():  # set during the last pass: stop before decoding and writing
            raise GenerationCancelled(
                f"cancelled after pass {schedule.num_passes} of {schedule.num_passes}, before decoding; the session "
                "is unchanged"
            )

        with _Timer(self, timings, "decode_video"):
            frames = self._load("vae").decode(loop["latents"])
            if frames.shape[0] != s.num_frames:
                raise RuntimeError(f"video VAE decoded {frames.shape[0]} frames for {s.num_frames} requested")
            if s.render_width is not None:
                frames = upscale_frames(frames, s.width, s.height)
        self._phase_done("vae")
        with _Timer(self, timings, "decode_audio"):
            audio = self._load("audio_vae").decode(loop["audio_rows"])
        self._phase_done("audio_vae")
        peak = torch.cuda.max_memory_allocated(self.device) if cuda else _peak_rss()
        trajectory = loop["trajectory"]
        result = GenerationResult(
            settings=s,
            seed=s.seed,
            frames=frames,
            audio=audio,
            sample_rate=AUDIO_SAMPLE_RATE,
            layout=loop["layout"],
            latents=loop["latents"],
            audio_latents=loop["audio_rows"],
            trajectory=trajectory,
            trajectory_hash=trajectory.digest,
            timings=timings,
            cached={"text": text_cached, "conditions": cond_cached},
            peak_memory=int(peak),
            memory_kind="cuda max allocated" if cuda else "process peak RSS",
            trace=loop["trace"],
            evaluations=loop["evaluations"],
            arm=loop["arm"],
        )
        with _Timer(self, timings, "write"):
            from .components import media as media_io

            items = []  # (path, writer): written together, renamed together (write all, then rename all)
            if output:
                items.append(media_io.mp4_writer(output, frames, fps=FPS, audio=audio))
            if wav:
                items.append(media_io.wav_writer(wav, audio, AUDIO_SAMPLE_RATE))
            if frames_dir:
                items += media_io.png_frame_writers(frames_dir, frames)
            atomic_write_all(items)
            result.outputs = [Path(p).resolve() for p in (output, wav, frames_dir) if p]
        return result

    # -------------------------------------------------------------------------------------- phases
    def _encode_text(self, s: GenerationSettings, media: _Media) -> tuple[_TextEntry, bool]:
        """Prompt (+ presented keyframes / references) -> layer-50 embeddings and row tags, cached by content."""
        from .components.text_encoder import cache_key

        key = cache_key(s.prompt, media.keyframes, media.references)
        hit = self._text_cache.hit(key)
        if hit is not None:
            return hit, True
        enc = self._load("text_encoder").encode(s.prompt, media.keyframes, media.references)
        summary = f"{len(enc.token_ids)} rows: {s.prompt[:40]!r}" + (
            f" + {len(media.keyframes)} anchors" if media.keyframes else ""
        ) + (f" + {len(media.references)} refs" if media.references else "")
        entry = _TextEntry(enc.embeds.detach(), enc.tags.cpu(), summary)
        self._text_cache.put(key, entry)
        return entry, False

    def _encode_conditions(self, media: _Media) -> tuple[_CondSet, bool | None]:
        """VAE encodes of anchors / references, cached per item by content (the normalised media bytes, so the
        canvas and the truncation are part of the key): adding a reference encodes only the new one. Returns
        (latents in packed order, cached) with cached None when the request has no conditioning, True when every
        item came from the cache."""
        from .components import conditioning
        from .components.text_encoder import cache_key

        items = [("keyframe", k) for k in media.keyframes] + [("reference", r) for r in media.references]
        if not items:
            return _CondSet([], []), None
        video, audio, all_cached = [], [], True
        for kind, item in items:
            key = (
                cache_key("", [item], (), salt=COND_SALT) if kind == "keyframe"
                else cache_key("", (), [item], salt=COND_SALT)
            )
            entry = self._cond_cache.hit(key)
            if entry is None:
                all_cached = False
                if kind == "keyframe":
                    v = conditioning.encode_keyframes(self._load("vae"), [item])[0]
                    entry = _CondEntry(v, None, f"{item.anchor} keyframe -> {tuple(v.shape)}")
                else:
                    vae = self._load("vae") if item.kind != "audio" else None
                    audio_vae = self._load("audio_vae") if item.has_audio else None
                    lat = conditioning.encode_references(vae, audio_vae, [item])
                    v = lat.video[0] if lat.video else None
                    a = lat.audio[0] if lat.audio else None
                    shapes = " + ".join(str(tuple(x.shape)) for x in (v, a) if x is not None)
                    entry = _CondEntry(v, a, f"{item.kind} reference {item.source} -> {shapes}")
                self._cond_cache.put(key, entry)
            if entry.video is not None:
                video.append(entry.video)
            if entry.audio is not None:
                audio.append(entry.audio)
        return _CondSet(video, audio), all_cached

    def _layout(self, s: GenerationSettings, media: _Media, text: _TextEntry, cond: _CondSet, patch):
        from . import layout as L

        refs = []
        video_iter, audio_iter = iter(cond.video), iter(cond.audio)
        for ref in media.references:
            if ref.kind == "image":
                lat = next(video_iter)
                refs.append(L.Reference.image(lat.shape[2], lat.shape[3]))
            elif ref.kind == "video":
                lat = next(video_iter)
                sound = next(audio_iter).shape[0] // 2 if ref.has_audio else 0
                refs.append(L.Reference.video(lat.shape[1], lat.shape[2], lat.shape[3], sound))
            else:
                refs.append(L.Reference.audio(next(audio_iter).shape[0] // 2))
        return L.build_layout(
            s.task,
            text.tags,
            s.num_latent_frames,
            s.latent_height,
            s.latent_width,
            s.num_audio_latents,
            anchors=tuple(k.anchor for k in media.keyframes),
            references=refs,
            patch_size=patch,
        )

    def _denoise(self, s, schedule, media, text, cond, progress, cancel, preview) -> dict[str, Any]:
        """Layout, the request's noise in the released order, its `RunSpec` (`_arm`), and the one loop
        (`h3lab.run.denoise`) with a trajectory recorder."""
        from . import trajectory as T
        from .components import conditioning
        from .components.video_vae import patchify, unpatchify
        from .run import DenoiseCancelled, DenoiseInputs, denoise
        from .sampler import draw_noise

        variant = self.variant_for(s.task)
        model = self._load(variant)
        cfg = model.config
        patch = tuple(cfg.patch_size)
        layout = self._layout(s, media, text, cond, patch)

        # Draw order on the one CPU generator: conditions, target video latents, target audio rows.
        generator = torch.Generator().manual_seed(s.seed)
        noised = conditioning.augment_conditions(cond.video, generator)
        video_noise = draw_noise((1, cfg.in_channels, s.num_latent_frames, s.latent_height, s.latent_width), generator)
        audio_noise = draw_noise((2 * s.num_audio_latents, cfg.audio_in_channels), generator)
        video_rows = torch.cat([patchify(c, patch) for c in noised] + [patchify(video_noise[0], patch)])
        audio_rows = torch.cat([a.to(torch.float32) for a in cond.audio] + [audio_noise])
        inputs = DenoiseInputs.from_layout(
            layout, schedule, text=text.embeds.to(self.device), video=video_rows, audio=audio_rows,
            seeds={"request": s.seed, "condition_encode": 42},
        ).to(self.device)
        spec = self._arm(s, model, layout, schedule, inputs)
        nv = inputs.num_condition_video_rows
        recorder = T.TrajectoryRecorder(keep=self.keep, meta={"settings": _settings_meta(s)})

        state = {"prev": inputs.video, "t0": time.perf_counter(), "evaluations": 0, "trace": None}

        def callback(rec) -> None:
            now = time.perf_counter()
            state["evaluations"] += int(rec.evaluated)
            if rec.trace is not None:
                state["trace"] = rec.trace
            if preview is not None:
                # x0 estimate of the pass: x_t + (1 - t) * v on the target rows (float32).
                t = torch.tensor(rec.t_video, dtype=torch.float32)
                x0 = state["prev"][0, nv:] + (1 - t) * rec.velocity_video[0, nv:].float()
                latents = unpatchify(x0.cpu(), s.num_latent_frames, s.latent_height, s.latent_width, patch)
                preview(self.preview_frame(latents), rec.index + 1, schedule.num_passes)
            state["prev"] = rec.video
            if progress is not None:
                progress(StepInfo(rec.index + 1, schedule.num_passes, rec.t_video, rec.t_audio, rec.evaluated,
                                  now - state["t0"]))
            state["t0"] = time.perf_counter()

        try:
            video, audio = denoise(spec, model, recorder, callback, cancel, models=self._arm_model(variant, model))
        except DenoiseCancelled as err:
            raise GenerationCancelled(f"{err}; the session is unchanged") from None
        final_video = video[0, nv:].float().cpu()
        latents = unpatchify(final_video, s.num_latent_frames, s.latent_height, s.latent_width, patch)
        audio_rows = audio[0, inputs.num_condition_audio_rows:].float().cpu()
        trajectory = recorder.finish()
        return {
            "layout": layout,
            "latents": latents,
            "audio_rows": audio_rows,
            "trajectory": trajectory,
            "trace": state["trace"],
            "evaluations": state["evaluations"],
            "arm": trajectory.spec,
        }

    # -------------------------------------------------------------------------------------- ablations
    def _other_variant(self, variant: str):
        """The other transformer partition, loaded beside the resident one without registering it (H16 only)."""
        from .model import H3Transformer

        other = "transformer" if variant == "transformer_ref" else "transformer_ref"
        if other in self._injected:
            return self._injected[other]
        t0 = time.perf_counter()
        model = H3Transformer.from_pretrained(self.path, subfolder=other, device=self.device,
                                              dtype_policy=self.dtype_policy)
        self.load_seconds += time.perf_counter() - t0
        return self._place(model.eval().requires_grad_(False), other)

    def _place(self, model, variant: str):
        """A transformer on this session's mesh (`h3lab.distributed.parallelize`, once per model; no-op without)."""
        if self.mesh is not None:
            from .distributed import parallelize, placement_of

            if placement_of(model) is None:
                parallelize(model, self.mesh, name=variant)
        return model

    def _arm_model(self, variant: str, model) -> Callable[[str], Any]:
        """The `models` lookup a run resolves its factors against: `variant` is `model`; the other partition is
        loaded on first ask (`_other_variant`, only a factor that swaps the transformer asks, H16) and kept for the
        runs of this lookup (drift's three executions load it once)."""
        loaded = {variant: model}

        def lookup(name: str):
            if name not in VARIANTS:
                raise ValidationError(f"model {name!r}: the session serves {', '.join(VARIANTS)}")
            if name not in loaded:
                loaded[name] = self._other_variant(variant)
            return loaded[name]

        return lookup

    def _arm(self, s: GenerationSettings, model, layout, schedule, inputs):
        """The request's `RunSpec`: its sealed inputs, schedule and layout, its mode, the transformer partition and
        its fingerprint, the ablation factors by name (`h3lab.ablation` applies them inside the loop, the same way
        each time the spec runs) and the reuse interval. Factor names are checked here (known factors, H1 alone,
        no two that change one thing)."""
        from .hashing import model_fingerprint
        from .run import RunSpec

        placement = {}
        if self.mesh is not None:
            t = self.mesh.topology
            placement = {"tp": t.tp, "cp": t.cp, "sp": t.sp, "row_parallel": t.row_parallel}
        return RunSpec(inputs, schedule, mode=s.mode, variant=self.variant_for(s.task),
                       fingerprint=model_fingerprint(model), layout=layout, factors=tuple(s.ablations),
                       reuse=s.reuse, placement=placement)

    # -------------------------------------------------------------------------------------- preview
    def preview_frame(self, latents: torch.Tensor) -> np.ndarray:
        """The preview of a latent clip (C, T, h, w): the smallest window of middle latent frames the video VAE can
        decode (`VideoVAE.min_decode_frames`, 3 as released: its temporal chunking yields nothing for fewer),
        decoded, and the middle pixel frame of that window: uint8 (H, W, 3) at the render canvas. It is the
        cheapest honest decode of the clip's middle; it is close to, not identical with, the middle frame of a full
        decode (the decoder's temporal windows see less context)."""
        vae = self._load("vae")
        n = min(max(2, vae.min_decode_frames), latents.shape[1])
        start = max(0, min(latents.shape[1] // 2 - n // 2, latents.shape[1] - n))
        frames = vae.decode(latents[:, start : start + n])
        return frames[frames.shape[0] // 2]

    # ---------------------------------------------------------------------------------------- save
    def save(self, result: GenerationResult, path: str | os.PathLike) -> Path:
        """Write a result: `.mp4` (H.264 + AAC 32 kHz stereo) or `.wav` (float32 stereo 32 kHz), atomically."""
        from .components import media

        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".mp4", ".wav"):
            raise ValidationError(f"output {str(path)!r}: extension must be .mp4 (video + audio) or .wav (audio)")
        check_output_file(path, (suffix,), "output")
        if suffix == ".mp4":
            return media.write_mp4(path, result.frames, fps=FPS, audio=result.audio)
        return media.write_wav(path, result.audio, result.sample_rate)

    def drift(self, a: GenerationResult, b: GenerationResult):
        """First drift between two generations of this session (`drift.compare`): each result's sealed `RunSpec`
        re-runs exactly as it ran -- inputs, schedule, mode, ablation factors, reuse -- with every operator boundary
        hashed."""
        from . import drift

        specs = [r.trajectory.spec for r in (a, b)]
        variants = {spec.variant for spec in specs}
        if len(variants) != 1:
            raise ValidationError(
                f"drift between a {a.settings.task} and a {b.settings.task} run: they use different transformers "
                f"({', '.join(sorted(variants))}); compare two runs of one variant"
            )
        with self._lock:
            variant = variants.pop()
            model = self._load(variant)
            models = self._arm_model(variant, model)
            arms = [drift.Execution(spec, model, label=f"{spec.tag}:{r.trajectory_hash[:12]}", models=models)
                    for spec, r in zip(specs, (a, b))]
            return drift.compare(*arms)

    def drift_lines(self, a: GenerationResult, b: GenerationResult) -> list[str]:
        return _drift_lines(self.drift(a, b))

    def verify(self, path: str | os.PathLike):
        """Replay a sealed trajectory's `RunSpec` exactly (ablated, reused, in its mode) with this session's DiT of
        the spec's variant (`trajectory.verify`); a trajectory with custom callables is refused."""
        from . import trajectory as T

        traj = T.load(path)
        variant = traj.spec.variant
        if variant not in VARIANTS:
            raise ValidationError(f"trajectory {str(path)!r} ran on model {variant!r}: the session serves "
                                  f"{', '.join(VARIANTS)}")
        with self._lock:
            model = self._load(variant)
            return T.verify(traj, model, device=self.device, models=self._arm_model(variant, model))


def _book_cache_hit(timings: dict[str, float], phase: str, cached: bool | None) -> None:
    """A phase served entirely from the cache encoded nothing: it reports 0, and the key hashing it took is booked
    under "cache_lookup"."""
    if cached:
        timings["cache_lookup"] = timings.get("cache_lookup", 0.0) + timings[phase]
        timings[phase] = 0.0


def _drift_lines(report) -> list[str]:
    lines = [report.summary()]
    if report.first is not None and report.first_in_block is not None and report.first_in_block != report.first:
        lines.append(f"first drift inside a block: {report.first_in_block}")
    if report.a_repeatable is False:
        lines.append("warning: the reference run did not repeat its own hashes (non-deterministic arithmetic)")
    for note in report.metadata[:3]:
        lines.append(f"layout differs: {note}")
    return lines


def _settings_meta(s: GenerationSettings) -> dict[str, Any]:
    """What a trajectory manifest records about the request beyond its run spec (which holds the mode, the reuse
    interval and the ablation factors): geometry, seed, media kinds. No file paths: they differ between machines."""
    return {
        "task": s.task, "seed": s.seed, "width": s.width, "height": s.height, "canvas": list(s.canvas),
        "num_frames": s.num_frames, "steps": s.steps, "references": [r.kind for r in s.references],
        "anchors": [name for name, _ in s.anchors],
    }


def ablation_factors() -> dict[str, str]:
    """The ablation factors a generation can switch on, name -> "factor: description": the rows of
    `h3lab.ablation.ROWS` that are transforms of a run spec (`ablation.FACTORS`; expected signature DRIFT, trajectory
    scope). The other rows compare executions rather than change one (controls, invariance, batch and permutation
    probes, distributed rows) or need what only the ablation bench keeps (H15 re-noises the anchor rows from their
    clean latents; a generation's sealed inputs hold the augmented rows only); they run with `h3lab.ablation`."""
    from . import ablation

    return {name: f"{ablation.ROWS[name].factor}: {ablation.ROWS[name].description}" for name in ablation.FACTORS}
