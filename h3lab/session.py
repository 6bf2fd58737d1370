"""`Session`: one resident MiniMax-H3 workbench -- the orchestration of a generation, its lock and conditioning caches.

The work is in three places below it: `h3lab.components.store.ComponentStore` (snapshot paths, loading each
component, the variant switch, pinned injected transformers, residency, load timing), `h3lab.pipeline` (plain
functions: read the media, encode text and conditions, build the layout, draw the noise in the released order, build
the `RunSpec`, decode) and `h3lab.run.denoise` (the one loop). `Session` calls them in order, books the timings,
holds the caches and serialises requests.

Contract
- `Session(path=None, device=None, residency="resident", gpu_memory=None)`. `path=None` is the embedded tiny snapshot
  (`h3lab.checkpoint.tiny.default_snapshot()`); `device=None` is CUDA when available, else the CPU. Components load on
  first use: the text encoder, the DiT of the variant a request needs (`transformer/` for t2va/fl2va,
  `transformer_ref/` for ref2va; switching variants releases the other, two 33B partitions do not share a GPU), the
  video VAE and the audio VAE. `residency="resident"` keeps them; `"phased"` releases each after its phase (text
  encode, condition encode, denoise, decode) so the 32B encoder, the 33B DiT and the decoders never coexist;
  `"streamed"` keeps them but streams the DiT's blocks from pinned host memory through two GPU slots (byte-identical
  to resident; with `gpu_memory` GiB the blocks that fit stay on the GPU). `set_residency(residency, gpu_memory)`
  switches it (`!streaming on|off`); a streamed run records it in `RunSpec.residency` and `result.streaming` holds
  its copy statistics (`--profile`).
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
- `rollout(prompts, group=G, stepper=..., level=..., seed=...)`: G stochastic requests per prompt on an SDE
  stepper, per-pass log-densities sealed in the trajectories (`h3lab.rollout` does the work).
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

import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import pipeline
from .components import streaming
from .components.store import RESIDENCIES, VARIANTS, ComponentStore, check_residency, resolve_snapshot  # noqa: F401
from .devices import default_device, resolve_device  # noqa: F401 - re-exported: the session's device check
from .errors import H3Error, ValidationError
from .io_utils import atomic_write_all, check_distinct, check_output_dir, check_output_file
from .settings import AUDIO_SAMPLE_RATE, FPS, GenerationSettings, check_prompt, is_blank
from .whatran import check_strict_runs

PHASES = ("text_encode", "condition_encode", "denoise", "decode_video", "decode_audio", "write")


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
    streaming: Any = None  # components.streaming.StreamStats of a streamed run (bytes moved, wait not hidden)

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
        if self.streaming is not None:
            lines += self.streaming.lines()
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
            "streaming": None if self.streaming is None else self.streaming.to_dict(),
        }


# ------------------------------------------------------------------------------------------------ helpers
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


class Session:
    """A resident MiniMax-H3 workbench (see the module docstring)."""

    CACHE_LIMIT = 16

    def __init__(self, path: str | os.PathLike | None = None, device: str | torch.device | None = None,
                 residency: str = "resident", dtype_policy: str = "released",
                 pipeline_config: dict[str, int] | None = None, gpu_memory: float | None = None, mesh: Any = None):
        check_residency(residency, gpu_memory)
        self.path, self.model_name = resolve_snapshot(path)
        self.device = resolve_device(device)
        self.mesh = mesh  # an h3lab.distributed Mesh: every transformer is parallelized on it, specs record it
        self.store = ComponentStore(self.path, self.device, residency, dtype_policy, gpu_memory, mesh=mesh)
        self.keep: tuple[str, ...] = ()  # trajectory tensors to keep in memory ("latents", "velocities")
        self.adapters: tuple[dict, ...] = ()  # the LoRA adapter every run spec carries (`load_lora`)
        self._lock = threading.RLock()  # one generation at a time
        self._text_cache = _LRU(self.CACHE_LIMIT)
        self._cond_cache = _LRU(4 * self.CACHE_LIMIT)
        self._prompt_bound = None  # components.text_encoder.PromptBound, loaded on the first prompt check
        self.video_shift, self.audio_shift = self.store.read_shifts()
        self.pipeline_config = self.store.read_pipeline_config(pipeline_config or {})

    # -------------------------------------------------------------------------------------- components (the store)
    @property
    def residency(self) -> str:
        return self.store.residency

    @property
    def dtype_policy(self) -> str:
        return self.store.dtype_policy

    @property
    def gpu_memory(self) -> float | None:
        """The streamed DiT's GPU budget in GiB (None: every block streams, or not streamed)."""
        return self.store.gpu_memory

    def set_residency(self, residency: str, gpu_memory: float | None = None) -> list[str]:
        """Switch the residency ("resident", "phased", "streamed"; `gpu_memory` only with streamed) and re-place the
        loaded DiT in place; returns what it does now. A refusal changes nothing."""
        with self._lock:
            return self.store.set_residency(residency, gpu_memory)

    @property
    def load_seconds(self) -> float:
        """Cumulative component loading time (booked under "load" in a result's timings)."""
        return self.store.load_seconds

    @property
    def loaded(self) -> list[str]:
        return self.store.loaded

    @property
    def injected(self) -> list[str]:
        """Variants served by a model given with `set_transformer` (pinned)."""
        return sorted(self.store.injected)

    def _load(self, name: str) -> Any:
        return self.store.load(name)

    def _phase_done(self, *names: str) -> None:
        self.store.phase_done(*names)

    def release(self, *names: str) -> None:
        """Drop components (all when no name is given); they reload on next use. Caches are kept. A transformer
        injected with `set_transformer` is pinned and stays (see the module docstring)."""
        self.store.release(*names)

    def set_transformer(self, model: Any, variant: str = "transformer") -> None:
        """Serve `variant` ("transformer" or "transformer_ref") with `model`, an `H3Transformer` on the session
        device, instead of the snapshot's weights; `model=None` goes back to the snapshot's. Checked against the
        snapshot's interface before anything changes; the model is pinned (module docstring)."""
        with self._lock:
            self.store.set_transformer(model, variant)

    def check_preset(self, s: GenerationSettings) -> None:
        """The speed-preset rules that need the DiT's depth (`h3lab.presets.check_depth`), read from the injected
        model or the snapshot's config -- no model loads."""
        from .presets import check_depth

        if s.layers is None and not s.token_reduction:
            return
        variant = self.variant_for(s.task)
        model = self.store.injected.get(variant)
        config = {} if model is not None else self.store.component_config(variant)
        depth = len(model.transformer_blocks) if model is not None else config.get("num_layers", 50)  # 50: the default
        check_depth(s, int(depth))

    def transformer(self, variant: str = "transformer"):
        """The DiT of a variant ("transformer" for t2va/fl2va, "transformer_ref" for ref2va), loaded on first use."""
        return self.store.transformer(variant)

    @staticmethod
    def variant_for(task: str) -> str:
        return pipeline.variant_for(task)

    # -------------------------------------------------------------------------------------- status / cache
    def status(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "snapshot": str(self.path),
            "device": str(self.device),
            "residency": self.residency,
            "gpu_memory_gib": self.gpu_memory,
            "streaming": self.store.describe()[1:],
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
        return GenerationSettings().replace(**overrides)  # replace: schema-declared settings (extras) too

    def check_request(self, settings: GenerationSettings) -> GenerationSettings:
        """Check every input file of a request by decoding and normalising it (kinds, truncation, streams, reference
        counts, audio 2-15 s each and 15 s in total, video length) and a non-blank prompt against the text
        encoder's context (`check_prompt_length`), without loading any model or encoding anything. Returns the
        settings with validated paths."""
        settings = settings.checked_paths()
        check_strict_runs(settings.mode, self.device)
        self.check_preset(settings)
        if not is_blank(settings.prompt):
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

    def _load_media(self, s: GenerationSettings) -> pipeline.Media:
        return pipeline.read_media(s, self.pipeline_config)

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
        check_strict_runs(s.mode, self.device)
        outputs = check_outputs(output, wav, frames_dir)
        self.check_prompt_length(s.prompt)
        self.check_preset(s)
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
            text, text_cached = pipeline.encode_text(s, media, self._text_cache, self._load)
        _book_cache_hit(timings, "text_encode", text_cached)
        self._phase_done("text_encoder")

        with _Timer(self, timings, "condition_encode"):
            cond, cond_cached = pipeline.encode_conditions(media, self._cond_cache, self._load)
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
            frames = pipeline.decode_video(self._load("vae"), loop["latents"], s)
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
            streaming=loop["streaming"],
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

    # -------------------------------------------------------------------------------------- denoise
    def _denoise(self, s, schedule, media, text, cond, progress, cancel, preview) -> dict[str, Any]:
        """Layout, the request's noise in the released order, its `RunSpec`, and the one loop (`h3lab.run.denoise`)
        with a trajectory recorder; the pipeline functions do the work, this wires the callbacks."""
        from . import trajectory as T
        from .components.video_vae import unpatchify
        from .run import DenoiseCancelled, denoise

        variant = self.variant_for(s.task)
        model = self.store.dit(variant, layers=s.layers)
        cfg = model.config
        patch = tuple(cfg.patch_size)
        layout = pipeline.build_layout(s, media, text, cond, patch)
        inputs = pipeline.draw_inputs(s, layout, schedule, text, cond, cfg, self.device)
        spec = pipeline.build_spec(s, model, layout, schedule, inputs, adapters=self.adapters,
                                   residency=self.store.residency_value(), mesh=self.mesh)
        if "blocks" in spec.preset:  # a pinned model stays whole
            self.store.release_blocks(variant, model, spec.preset["blocks"])
        nv = inputs.num_condition_video_rows
        recorder = T.TrajectoryRecorder(keep=self.keep, meta={"settings": pipeline.settings_meta(s)})

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
            video, audio = denoise(spec, model, recorder, callback, cancel,
                                   models=self.store.models_for(variant, model))
        except DenoiseCancelled as err:
            raise GenerationCancelled(f"{err}; the session is unchanged") from None
        latents, audio_rows = pipeline.final_latents(s, inputs, video, audio, patch)
        trajectory = recorder.finish()
        streamed = streaming.last_stats() if spec.residency else None
        return {
            "layout": layout,
            "latents": latents,
            "audio_rows": audio_rows,
            "trajectory": trajectory,
            "trace": state["trace"],
            "evaluations": state["evaluations"],
            "arm": trajectory.spec,
            "streaming": streamed,
        }

    # -------------------------------------------------------------------------------------- RL rollouts
    def rollout(self, prompts, *, group: int = 4, stepper: str = "flow_sde", level=0.7, seed: int = 0,
                window=None, decode: bool = False, batched: bool = True, keep=("latents",), **overrides: Any):
        """G stochastic requests per prompt on an SDE stepper, their per-pass log-densities sealed in the
        trajectories (`h3lab.rollout`: request order, seed derivation, what comes back)."""
        from .rollout import rollout

        with self._lock:
            return rollout(self, prompts, group=group, stepper=stepper, level=level, seed=seed, window=window,
                           decode=decode, batched=batched, keep=keep, **overrides)

    def rollout_report(self, prompt: str, *, group: int, reward: str, settings: GenerationSettings) -> list[str]:
        """`!rollout`: G stochastic rollouts of `prompt`, each request's reward, and the on-policy ratio of every
        pass replayed alone (`h3lab.training.grpo_report.rollout_report`)."""
        from .training.grpo_report import rollout_report

        with self._lock:
            return rollout_report(self, prompt, group=group, reward=reward, settings=settings)

    # -------------------------------------------------------------------------------------- adapters
    def load_lora(self, path: str | os.PathLike, scale: float = 1.0) -> dict[str, Any]:
        """Generate with the LoRA adapter at `path` (PEFT folder or Diffusers .safetensors) from now on: checked
        against the snapshot's transformer config before any model loads, sealed by its sha256 in every run spec
        and applied by the spec's `adapters` field (`h3lab.training.adapters`). Returns the spec entry."""
        from .training.adapters import adapter_entry

        self.adapters = (adapter_entry(path, scale, snapshot=self.path),)
        return self.adapters[0]

    def unload_lora(self) -> None:
        """Generate without an adapter from now on."""
        self.adapters = ()

    # -------------------------------------------------------------------------------------- preview
    def preview_frame(self, latents: torch.Tensor) -> np.ndarray:
        """The preview of a latent clip (C, T, h, w): the middle frame of the smallest decodable window of middle
        latent frames, uint8 (H, W, 3) at the render canvas (`pipeline.preview_frame`)."""
        return pipeline.preview_frame(self._load("vae"), latents)

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
        from .presets import needed_blocks

        specs = [r.trajectory.spec for r in (a, b)]
        variants = {spec.variant for spec in specs}
        if len(variants) != 1:
            raise ValidationError(
                f"drift between a {a.settings.task} and a {b.settings.task} run: they use different transformers "
                f"({', '.join(sorted(variants))}); compare two runs of one variant"
            )
        with self._lock:
            variant = variants.pop()
            model = self.store.dit(variant, *needed_blocks([spec.preset for spec in specs]))
            models = self.store.models_for(variant, model)
            arms = [drift.Execution(spec, model, label=f"{spec.tag}{'+lora' if spec.adapters else ''}:"
                                                      f"{r.trajectory_hash[:12]}", models=models)
                    for spec, r in zip(specs, (a, b))]
            return drift.compare(*arms)

    def drift_lines(self, a: GenerationResult, b: GenerationResult) -> list[str]:
        return _drift_lines(self.drift(a, b))

    def verify(self, path: str | os.PathLike):
        """Replay a sealed trajectory's `RunSpec` exactly (ablated, reused, in its mode) with this session's DiT of
        the spec's variant (`trajectory.verify`); a trajectory with custom callables is refused."""
        from . import trajectory as T
        from .presets import needed_blocks

        traj = T.load(path)
        variant = traj.spec.variant
        if variant not in VARIANTS:
            raise ValidationError(f"trajectory {str(path)!r} ran on model {variant!r}: the session serves "
                                  f"{', '.join(VARIANTS)}")
        with self._lock:
            model = self.store.dit(variant, *needed_blocks([traj.spec.preset]))
            return T.verify(traj, model, device=self.device, models=self.store.models_for(variant, model))


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
    from .drift import metadata_line

    for note in report.metadata[:3]:
        lines.append(f"layout differs: {metadata_line(note)}")
    return lines


def ablation_factors() -> dict[str, str]:
    """The ablation factors a generation can switch on, name -> "factor: description": the rows of
    `h3lab.ablation.ROWS` that are transforms of a run spec (`ablation.FACTORS`; expected signature DRIFT, trajectory
    scope). The other rows compare executions rather than change one (controls, invariance, batch and permutation
    probes, distributed rows) or need what only the ablation bench keeps (H15 re-noises the anchor rows from their
    clean latents; a generation's sealed inputs hold the augmented rows only); they run with `h3lab.ablation`."""
    from . import ablation

    return {name: f"{ablation.ROWS[name].factor}: {ablation.ROWS[name].description}" for name in ablation.FACTORS}
