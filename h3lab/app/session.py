"""`Session`: one resident MiniMax-H3 workbench -- the orchestration of a generation, its lock and conditioning caches.

The work is in three places below it: `h3lab.components.store.ComponentStore` (snapshot paths, loading each
component, the variant switch, pinned injected transformers, residency, load timing), `h3lab.app.pipeline` (plain
functions: read the media, encode text and conditions, build the layout, draw the noise in the released order, build
the `RunSpec`, decode) and `h3lab.run.denoise` (the one loop). `Session` holds the store, the caches and the lock and
serialises requests; beside it, one job each: `h3lab.app.generation` (one request phase by phase, its timings and peak
memory), `h3lab.app.results` (`GenerationResult`, `StepInfo`, `PHASES`, `GenerationCancelled`), `h3lab.app.request_checks`
(output paths, preset depth, ablation factors), `h3lab.app.reruns` (drift and verify of sealed specs),
`h3lab.app.caches` (the conditioning LRUs) and `h3lab.app.rollout` (RL rollouts). Generation and rollout share their steps:
`h3lab.app.phases` (encode, denoise, decode, each timed) and `h3lab.app.prepared` (`PreparedRequest`: a checked request's
schedule, DiT, layout and adapters, from which its noise and `RunSpec` are built). The names they define that callers
import from `h3lab.app.session` stay importable from here.

Collaborator interface -- what those modules (and `h3lab.app.clips_in`, `h3lab.app.keep`) use of a session; none reaches
into its private members:
- `lock`: the session's `threading.RLock`; one request at a time, held around every use of the models.
- `component(name)`: a component loaded on first use (the one loading seam of the encoders and decoders);
  `phase_done(*names)`: a phase that used them ended (phased residency releases them); `store`: the
  `ComponentStore` (`dit`, `models_for`, `release_blocks`, `plan`, `component_config`).
- `read_media(settings)`: every input file decoded and checked; `encode_text(settings, media)` and
  `encode_conditions(media)`: the encoders through the session's caches, each returning (value, served from cache).
- `device`, `video_shift`, `audio_shift`, `keep`, `adapters`, `load_seconds`, `preview_frame`, `settings`,
  `check_prompt_length`, `check_preset`: as documented below.

Contract
- `Session(path=None, device=None, residency="resident", gpu_memory=None)`. `path=None` is the embedded default,
  the trained tiny h3-shapes snapshot (`h3lab.checkpoint.tiny.default_snapshot()`); `device=None` is CUDA when
  available, else the CPU. Components load on
  first use: the text encoder, the DiT of the variant a request needs (`transformer/` for t2va/fl2va,
  `transformer_ref/` for ref2va; switching variants releases the other, two 33B partitions do not share a GPU), the
  video VAE and the audio VAE. `residency="resident"` keeps them; `"phased"` releases each after its phase (text
  encode, condition encode, denoise, decode) so the 32B encoder, the 33B DiT and the decoders never coexist;
  `"streamed"` keeps them but streams the DiT's blocks from pinned host memory through two GPU slots (byte-identical
  to resident; with `gpu_memory` GiB the blocks that fit stay on the GPU). `adaln="tables"` keeps the blocks' AdaLN
  weights in pinned host memory and serves every forward from AdaLN tables computed ahead for the run's schedule
  (byte-identical; composes with each residency). `set_residency(residency, gpu_memory, adaln=None)` switches them
  (`!streaming on|off`); a streamed or tables run records it in `RunSpec.residency` and `result.streaming` holds its
  copy statistics (`--profile`).
- `mesh=` (an `h3lab.distributed.Mesh`; the torchrun front end passes one): every transformer the session loads or
  is given is parallelized on it in place (`h3lab.distributed.parallelize`, named by its variant) and every run
  spec records the topology (`RunSpec.placement`), so a sealed run replays on it.
- `set_transformer(model, variant="transformer")` gives the session an already-built `H3Transformer` for a variant
  instead of the snapshot's weights (a full-size random DiT built on the GPU, an edited model). It is checked against
  the snapshot's interface -- `text_dim` = the text encoder's hidden width, `in_channels` = the video VAE's latent
  channels, `audio_in_channels` = the audio VAE's, `patch_size` = the snapshot variant's when it has one -- and must
  live on the session device with the session's dtype policy (one-line `ValidationError`; an unreadable snapshot
  config is a `CheckpointError`). It is served by the normal loading path (`component`, booked under "load" at ~0 s).
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
  extrapolate velocities (`h3lab.run.sampler.reuse_plan`). Ablation factors (`h3lab.research.ablation`) are named in the spec
  and applied by the loop; `drift` and `verify` re-run a result's or a sealed trajectory's spec exactly.
- Every pass goes to a `trajectory.TrajectoryRecorder`; `result.trajectory` is the recorded `Trajectory` (sealed
  inputs, per-pass hashes, provenance) and `result.trajectory_hash` its digest, which replays' `# expect` lines
  check. `Session.keep` (`keep=` at construction, `--keep`) picks the per-pass tensors kept in memory and sealed with
  the trajectory (default none: hashes only; "latents" is what `h3lab train --rollout` needs).
- `rollout(prompts, group=G, stepper=..., level=..., seed=...)`: G stochastic requests per prompt on an SDE
  stepper, per-pass log-densities sealed in the trajectories (`h3lab.app.rollout` does the work).
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

import contextlib

import os
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import pipeline, reruns
from .caches import LRU, entries
from ..checkpoint.native import native_form
from ..components.residency import check_gpu_memory
from ..components.store import RESIDENCIES, VARIANTS, ComponentStore, check_residency, resolve_snapshot  # noqa: F401
from ..execution.devices import default_device, resolve_device  # noqa: F401 - re-exported: the session's device check
from ..errors import ValidationError
from .generation import run_generation
from ..io_utils import check_output_file
from .request_checks import (ablation_factors, check_ablations, check_lora_scale, check_outputs,  # noqa: F401
                             check_preset)
from .results import PHASES, GenerationCancelled, GenerationResult, StepInfo  # noqa: F401 - re-exported
from .reruns import drift_lines as _drift_lines  # noqa: F401 - re-exported (tests)
from ..schema.generation_settings import FPS, GenerationSettings, check_prompt, is_blank
from ..run.trajectory import check_keep, check_seal_target  # noqa: F401 - re-exported: the front ends' --keep checks
from ..execution.whatran import check_strict_runs


class Session:
    """A resident MiniMax-H3 workbench (see the module docstring)."""

    CACHE_LIMIT = 16

    def __init__(self, path: str | os.PathLike | None = None, device: str | torch.device | None = None,
                 residency: str = "resident", dtype_policy: str = "released",
                 pipeline_config: dict[str, int] | None = None, gpu_memory: float | None = None, mesh: Any = None,
                 keep: Any = (), adaln: str = "resident", card_memory: float | None = None):
        check_residency(residency, gpu_memory, adaln)
        self.card_memory = None if card_memory is None else check_gpu_memory(card_memory)  # GiB, a hypothetical card
        self.path, self.model_name = resolve_snapshot(path)
        self.device = resolve_device(device)
        self.mesh = mesh  # an h3lab.distributed Mesh: every transformer is parallelized on it, specs record it
        self.store = ComponentStore(self.path, self.device, residency, dtype_policy, gpu_memory, mesh=mesh,
                                    adaln=adaln)
        self.keep = check_keep(keep, "keep")  # per-pass trajectory tensors to keep ("latents", "velocities", "noise")
        self.adapters: tuple[dict, ...] = ()  # the LoRA adapter every run spec carries (`load_lora`)
        self.last_result: GenerationResult | None = None  # what `attention` views when given no result
        self.lock = threading.RLock()  # one request at a time: its collaborators hold it around model work
        self._text_cache = LRU(self.CACHE_LIMIT)
        self._cond_cache = LRU(4 * self.CACHE_LIMIT)
        self._prompt_bound = None  # components.text_encoder.PromptBound, loaded on the first prompt check
        self.video_shift, self.audio_shift = self.store.read_shifts()
        self.pipeline_config = self.store.read_pipeline_config(pipeline_config or {})
        self.native = native_form(self.path)  # the canvas and prompt form the snapshot was trained on, or None

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

    @property
    def adaln(self) -> str:
        """Where the DiT blocks' AdaLN weights live: "resident", or "tables" (host memory; tables on the GPU)."""
        return self.store.adaln

    def set_residency(self, residency: str, gpu_memory: float | None = None, adaln: str | None = None) -> list[str]:
        """Switch the residency ("resident", "phased", "streamed"; `gpu_memory` only with streamed; `adaln`
        "resident" | "tables", None keeps it) and re-place the loaded DiT in place; returns what it does now. A
        refusal changes nothing."""
        with self.lock:
            return self.store.set_residency(residency, gpu_memory, adaln)

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

    def component(self, name: str) -> Any:
        """Component `name` ("text_encoder", "transformer", "transformer_ref", "vae", "audio_vae"), loaded on first
        use (the one loading seam of the phases: a request's text encoder and VAEs come through here)."""
        return self.store.load(name)

    def phase_done(self, *names: str) -> None:
        """A phase that used `names` ended: phased residency releases them."""
        self.store.phase_done(*names)

    def release(self, *names: str) -> None:
        """Drop components (all when no name is given); they reload on next use. Caches are kept. A transformer
        injected with `set_transformer` is pinned and stays (see the module docstring)."""
        self.store.release(*names)

    def set_transformer(self, model: Any, variant: str = "transformer") -> None:
        """Serve `variant` ("transformer" or "transformer_ref") with `model`, an `H3Transformer` on the session
        device, instead of the snapshot's weights; `model=None` goes back to the snapshot's. Checked against the
        snapshot's interface before anything changes; the model is pinned (module docstring)."""
        with self.lock:
            self.store.set_transformer(model, variant)

    def check_preset(self, s: GenerationSettings) -> None:
        """The speed-preset rules that need the DiT's depth (`h3lab.presets.check_depth`), read from the injected
        model or the snapshot's config -- no model loads (`request_checks.check_preset`)."""
        check_preset(self.store, s)

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
            "adaln": self.adaln,
            "streaming": self.store.describe()[1:],
            "loaded": self.loaded,
            "cache_entries": len(self._text_cache) + len(self._cond_cache),
        }

    def cache_info(self) -> list[dict[str, str]]:
        return entries(self._text_cache, self._cond_cache)

    def clear_cache(self) -> int:
        n = len(self._text_cache) + len(self._cond_cache)
        self._text_cache.clear()
        self._cond_cache.clear()
        return n

    @contextlib.contextmanager
    def fresh_cache(self):
        """Run the block from empty conditioning caches and put the session's caches back afterwards (a replay's
        second run of a generation recomputes everything without changing what later lines find cached)."""
        kept = self._text_cache, self._cond_cache
        self._text_cache, self._cond_cache = LRU(self.CACHE_LIMIT), LRU(4 * self.CACHE_LIMIT)
        try:
            yield
        finally:
            self._text_cache, self._cond_cache = kept

    # -------------------------------------------------------------------------------------- validation
    def settings(self, request: str | GenerationSettings | None = None, **overrides: Any) -> GenerationSettings:
        """Validated settings from a prompt or a settings object plus overrides (no file is read). From a prompt, the
        snapshot's native canvas and length (`native`) are the defaults the overrides change."""
        if isinstance(request, GenerationSettings):
            return request.replace(**overrides) if overrides else request
        if request is not None:
            overrides["prompt"] = request
        return self.default_settings().replace(**overrides)  # replace: schema-declared settings (extras) too

    def default_settings(self) -> GenerationSettings:
        """The settings a request starts from: the schema's defaults on the snapshot's native canvas and length."""
        return GenerationSettings(**self.native.defaults()) if self.native else GenerationSettings()

    def canvas_notice(self, settings: GenerationSettings) -> str:
        """One line when `settings` run the DiT off the snapshot's native canvas, else ""."""
        if self.native is None:
            return ""
        return self.native.off_canvas(settings.render_width or settings.width,
                                      settings.render_height or settings.height)

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
        self.read_media(settings)
        return settings

    def check_prompt_length(self, prompt: str) -> int:
        """Tokens of `prompt`; a one-line `ValidationError` above the text encoder's context (tokenizer only, no
        weights: `components.text_encoder.PromptBound`). Anchors and references add label and vision tokens, which
        the text encoder checks again before it runs."""
        if self._prompt_bound is None:
            from ..components.text_encoder import PromptBound

            self._prompt_bound = PromptBound.from_pretrained(self.path)
        return self._prompt_bound.check(prompt)

    # -------------------------------------------------------------------------------------- encoders (cached)
    def read_media(self, s: GenerationSettings) -> pipeline.Media:
        """Every input file of `s` decoded, checked and normalised (`pipeline.read_media`); nothing encoded."""
        return pipeline.read_media(s, self.pipeline_config)

    def encode_text(self, s: GenerationSettings, media: pipeline.Media) -> tuple[pipeline.TextEntry, bool]:
        """(the prompt's and presented media's text conditioning, served from the cache) through the session's
        text cache (`pipeline.encode_text`)."""
        return pipeline.encode_text(s, media, self._text_cache, self.component)

    def encode_conditions(self, media: pipeline.Media) -> tuple[pipeline.CondSet, bool | None]:
        """(the anchors' and references' VAE latents, served entirely from the cache or None without conditioning)
        through the session's conditioning cache (`pipeline.encode_conditions`)."""
        return pipeline.encode_conditions(media, self._cond_cache, self.component)

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
        """Generate one clip with sound (see the module docstring; the phases are `h3lab.app.generation`'s). `output`
        (MP4), `frames_dir` (PNG per frame) and `wav` are checked before any work (`check_outputs`) and written in
        the `write` phase as one set: every file is written to a temp file first and all are renamed only when all
        succeeded (`io_utils.atomic_write_all`), so a failure leaves none of them."""
        s = self.settings(request, **overrides).checked_paths()
        check_prompt(s.prompt)
        check_strict_runs(s.mode, self.device)
        outputs = check_outputs(output, wav, frames_dir)
        s = s.with_notices(self.canvas_notice(s))
        self.check_prompt_length(s.prompt)
        self.check_preset(s)
        check_lora_scale(self.store, s, self.adapters)
        check_ablations(s.ablations)  # fail before any work
        self.check_memory(s)
        with self.lock:
            media = self.read_media(s)  # every input decoded and validated before anything is encoded
            self.last_result = run_generation(self, s, media, progress, cancel, preview, outputs)
            return self.last_result

    def plan(self, request: str | GenerationSettings | None = None, card_memory: float | None = None,
             **overrides: Any):
        """What the request needs on the GPU (`h3lab.app.memory_plan`): the DiT's resident / streamed split, the AdaLN
        tables, the activation estimate and the peak, against the card (`card_memory` GiB, else the session's, else
        its CUDA device). No model loads."""
        from .memory_plan import plan_request

        return plan_request(self, self.settings(request, **overrides), card_memory)

    def check_memory(self, settings: GenerationSettings) -> None:
        """Refuse, in one line and before any work, a request whose estimated peak exceeds the card (a CUDA device,
        or the hypothetical `card_memory`; nothing to check on the CPU without one)."""
        if self.device.type != "cuda" and self.card_memory is None:
            return
        from .memory_plan import check_fits

        check_fits(self.plan(settings))

    def encode_clip(self, video: str | os.PathLike, prompt: str, **options: Any):
        """An MP4 and its prompt -> one encoded t2va `ClipRequest` for `training.save_dataset` (its VAEs and text
        encoder; every rule checked first -- rate, length, size, audio track: `h3lab.app.clips_in`)."""
        from .clips_in import encode_clip

        with self.lock:
            return encode_clip(self, video, prompt, **options)

    # -------------------------------------------------------------------------------------- RL rollouts
    def rollout(self, prompts, *, group: int = 4, stepper: str = "flow_sde", level=0.7, seed: int = 0,
                window=None, decode: bool = False, batched: bool = True, keep=("latents",),
                needs_density: bool = True, **overrides: Any):
        """G stochastic requests per prompt on an SDE stepper, their per-pass log-densities sealed in the
        trajectories (`h3lab.app.rollout`: request order, seed derivation, what comes back; `needs_density=False` also
        takes the released `euler` step, for DiffusionNFT)."""
        from .rollout import rollout

        with self.lock:
            return rollout(self, prompts, group=group, stepper=stepper, level=level, seed=seed, window=window,
                           decode=decode, batched=batched, keep=keep, needs_density=needs_density, **overrides)

    def rollout_report(self, prompt: str, *, group: int, reward: str, settings: GenerationSettings) -> list[str]:
        """`!rollout`: G stochastic rollouts of `prompt`, each request's reward, and the on-policy ratio of every
        pass replayed alone (`h3lab.training.grpo_report.rollout_report`)."""
        from ..training.grpo_report import rollout_report

        with self.lock:
            return rollout_report(self, prompt, group=group, reward=reward, settings=settings)

    # -------------------------------------------------------------------------------------- adapters
    def load_lora(self, path: str | os.PathLike, scale: float = 1.0) -> dict[str, Any]:
        """Generate with the LoRA adapter at `path` (PEFT folder or Diffusers .safetensors) from now on: checked
        against the snapshot's transformer config before any model loads, sealed by its sha256 in every run spec
        and applied by the spec's `adapters` field (`h3lab.adapters.field`). Returns the spec entry."""
        from ..adapters.field import adapter_entry

        self.adapters = (adapter_entry(path, scale, snapshot=self.path),)
        return self.adapters[0]

    def unload_lora(self) -> None:
        """Generate without an adapter from now on."""
        self.adapters = ()

    # -------------------------------------------------------------------------------------- preview
    def preview_frame(self, latents: torch.Tensor) -> np.ndarray:
        """The preview of a latent clip (C, T, h, w): the middle frame of the smallest decodable window of middle
        latent frames, uint8 (H, W, 3) at the render canvas (`pipeline.preview_frame`)."""
        return pipeline.preview_frame(self.component("vae"), latents)

    # ---------------------------------------------------------------------------------------- save
    def save(self, result: GenerationResult, path: str | os.PathLike) -> Path:
        """Write a result: `.mp4` (H.264 + AAC 32 kHz stereo) or `.wav` (float32 stereo 32 kHz), atomically."""
        from ..components import media

        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in (".mp4", ".wav"):
            raise ValidationError(f"output {str(path)!r}: extension must be .mp4 (video + audio) or .wav (audio)")
        check_output_file(path, (suffix,), "output")
        if suffix == ".mp4":
            return media.write_mp4(path, result.frames, fps=FPS, audio=result.audio)
        return media.write_wav(path, result.audio, result.sample_rate)

    # ---------------------------------------------------------------------------------------- re-runs
    def drift(self, a: GenerationResult, b: GenerationResult):
        """First drift between two generations of the session (`drift.compare`, through `h3lab.app.reruns.drift`):
        each result's sealed `RunSpec` re-runs exactly as it ran -- inputs, schedule, mode, ablation factors, reuse
        -- with every operator boundary hashed."""
        return reruns.drift(self, a, b)

    def drift_lines(self, a: GenerationResult, b: GenerationResult) -> list[str]:
        return reruns.drift_lines(self.drift(a, b))

    def verify(self, path: str | os.PathLike):
        """Replay a sealed trajectory's `RunSpec` exactly (ablated, reused, in its mode) with the session's DiT of
        the spec's variant (`trajectory.verify`, through `h3lab.app.reruns.verify`); a trajectory with custom callables
        is refused."""
        return reruns.verify(self, path)

    # ---------------------------------------------------------------------------------------- research views
    def attention(self, result: GenerationResult | None = None, block: int = 0, *, step: int | None = None,
                  heads=None, query=None, audio_bin: int = 1, chunk: int | None = None, text: str = "word"):
        """The attention view of `result` (default: the last generation) at `block`: its sealed `RunSpec` re-run with
        a probe hook at the block's RoPE'd Q and K, exact float64 probabilities summed over the layout's regions
        (`h3lab.research.views`, through `h3lab.app.reruns.attention`). `step` is the pass (default the last with a forward),
        `heads` a list of head indices (default all), `query` region words ("text", "video", "frame3", ...) whose rows
        are the queries (default every region), `text` "word" (a region per prompt word, the rows of a word the
        tokenizer split summed) or "token" (a region per text row)."""
        if result is None:
            result = self.last_result
        if result is None:
            raise ValidationError("attention: no generation yet (generate first, or pass a result)")
        return reruns.attention(self, result, block, text, step=step, heads=heads, query=query, audio_bin=audio_bin,
                                chunk=chunk)

    def compare(self, a, b, settings: GenerationSettings | str | None = None, *, labels=None, drift: bool = True):
        """A matched-seed A/B of two sides -- results, or setting overrides (with "lora": PATH | None) generated on
        `settings`' seed: per-frame PSNR / SSIM, audio log-spectral distance and RMS ratio, the h3-shapes reads and
        the first drift, one table (`h3lab.research.views.compare`, through `h3lab.app.reruns.compare`)."""
        return reruns.compare(self, a, b, settings, labels, drift)
