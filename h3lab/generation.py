"""One generation of a `Session`, phase by phase: text encode, condition encode, denoise, decode video, decode audio,
write -- each timed, the component loading it triggers booked under "load" (see `h3lab.session`'s contract).

Contract
- `run_generation(session, s, media, progress, cancel, preview, outputs) -> GenerationResult`: `Session.generate`
  calls it under the session lock once every check passed (`s` validated settings, `media` the decoded inputs,
  `outputs` the checked paths of `session.check_outputs`). It calls the pipeline functions in order with the
  session's store, caches, device, adapters and mesh, runs the one loop (`h3lab.run.denoise`) with a trajectory
  recorder, and writes the outputs as one set (`io_utils.atomic_write_all`). A cancel seen after the last pass stops
  before decoding (`GenerationCancelled`).
- `PhaseTimer(session, timings, phase)`: the wall time of one phase, CUDA-synchronised, minus the component loading
  it triggered (`session.load_seconds`), which goes to "load". A text / condition phase served entirely from the
  cache reports 0 and its key hashing goes to "cache_lookup".
- Peak memory: `torch.cuda.max_memory_allocated` on CUDA (reset per request), else the process peak RSS (`VmHWM`,
  reset per request through /proc/self/clear_refs where the kernel allows it, else the process lifetime peak).
- The progress callback gets a `StepInfo` after every pass; the preview callback the decoded preview frame of every
  pass's x0 estimate (`session.preview_frame`).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any

import torch

from . import pipeline
from .components import streaming
from .errors import ValidationError
from .results import PHASES, GenerationCancelled, GenerationResult, StepInfo
from .settings import AUDIO_SAMPLE_RATE, FPS


def run_generation(session: Any, s, media, progress, cancel, preview, outputs: dict[str, Path | None]
                   ) -> GenerationResult:
    """The phases of one checked request (see the module docstring)."""
    from .sampler import DualSchedule

    timings = {phase: 0.0 for phase in ("load",) + PHASES}
    cuda = session.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(session.device)
    else:
        _reset_peak_rss()
    schedule = DualSchedule.from_passes(s.steps, session.video_shift, session.audio_shift)
    if schedule.num_passes != s.steps:
        raise ValidationError(
            f"steps={s.steps}: the shifted sigma grid collapses to {schedule.num_passes} distinct passes"
        )
    text, cond, cached = _encode(session, s, media, timings)
    with PhaseTimer(session, timings, "denoise"):
        loop = _denoise(session, s, schedule, media, text, cond, progress, cancel, preview)
    session.phase_done("transformer", "transformer_ref")
    if cancel is not None and cancel.is_set():  # set during the last pass: stop before decoding and writing
        raise GenerationCancelled(
            f"cancelled after pass {schedule.num_passes} of {schedule.num_passes}, before decoding; the session "
            "is unchanged"
        )
    with PhaseTimer(session, timings, "decode_video"):
        frames = pipeline.decode_video(session.component("vae"), loop["latents"], s)
    session.phase_done("vae")
    with PhaseTimer(session, timings, "decode_audio"):
        audio = session.component("audio_vae").decode(loop["audio_rows"])
    session.phase_done("audio_vae")
    peak = torch.cuda.max_memory_allocated(session.device) if cuda else _peak_rss()
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
        cached=cached,
        peak_memory=int(peak),
        memory_kind="cuda max allocated" if cuda else "process peak RSS",
        trace=loop["trace"],
        evaluations=loop["evaluations"],
        arm=loop["arm"],
        streaming=loop["streaming"],
    )
    with PhaseTimer(session, timings, "write"):
        result.outputs = _write(result, outputs["output"], outputs["wav"], outputs["frames_dir"])
    return result


def _encode(session: Any, s, media, timings: dict[str, float]) -> tuple[Any, Any, dict[str, bool]]:
    """The text and condition phases through the session's caches; returns (text, conditions, what was cached)."""
    with PhaseTimer(session, timings, "text_encode"):
        text, text_cached = session.encode_text(s, media)
    _book_cache_hit(timings, "text_encode", text_cached)
    session.phase_done("text_encoder")

    with PhaseTimer(session, timings, "condition_encode"):
        cond, cond_cached = session.encode_conditions(media)
    _book_cache_hit(timings, "condition_encode", cond_cached)
    session.phase_done("vae", "audio_vae")
    return text, cond, {"text": text_cached, "conditions": cond_cached}


def _denoise(session: Any, s, schedule, media, text, cond, progress, cancel, preview) -> dict[str, Any]:
    """Layout, the request's noise in the released order, its `RunSpec`, and the one loop (`h3lab.run.denoise`)
    with a trajectory recorder; the pipeline functions do the work, this wires the callbacks."""
    from . import trajectory as T
    from .run import DenoiseCancelled, denoise

    variant = session.variant_for(s.task)
    model = session.store.dit(variant, layers=s.layers)
    cfg = model.config
    patch = tuple(cfg.patch_size)
    layout = pipeline.build_layout(s, media, text, cond, patch)
    inputs = pipeline.draw_inputs(s, layout, schedule, text, cond, cfg, session.device)
    spec = pipeline.build_spec(s, model, layout, schedule, inputs, adapters=session.adapters,
                               execution=session.store.plan)
    if "blocks" in spec.preset:  # a pinned model stays whole
        session.store.release_blocks(variant, model, spec.preset["blocks"])
    recorder = T.TrajectoryRecorder(keep=session.keep, meta={"settings": pipeline.settings_meta(s)})
    callback, state = _pass_callback(session, s, schedule, inputs, patch, progress, preview)
    try:
        video, audio = denoise(spec, model, recorder, callback, cancel,
                               models=session.store.models_for(variant, model))
    except DenoiseCancelled as err:
        raise GenerationCancelled(f"{err}; the session is unchanged") from None
    latents, audio_rows = pipeline.final_latents(s, inputs, video, audio, patch)
    trajectory = recorder.finish()
    streamed = streaming.last_stats() if spec.residency.get("policy") == "streamed" else None
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


def _pass_callback(session: Any, s, schedule, inputs, patch, progress, preview):
    """The loop's per-pass callback (forwards counted, the last trace kept, the preview frame of the pass's x0
    estimate, the `StepInfo` with the pass's own time) and the state it fills."""
    from .components.video_vae import unpatchify

    nv = inputs.num_condition_video_rows
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
            preview(session.preview_frame(latents), rec.index + 1, schedule.num_passes)
        state["prev"] = rec.video
        if progress is not None:
            progress(StepInfo(rec.index + 1, schedule.num_passes, rec.t_video, rec.t_audio, rec.evaluated,
                              now - state["t0"]))
        state["t0"] = time.perf_counter()

    return callback, state


def _write(result: GenerationResult, output, wav, frames_dir) -> list[Path]:
    """The requested outputs as one set: all written to temp files, then all renamed (`atomic_write_all`)."""
    from .components import media as media_io
    from .io_utils import atomic_write_all

    items = []  # (path, writer): written together, renamed together (write all, then rename all)
    if output:
        items.append(media_io.mp4_writer(output, result.frames, fps=FPS, audio=result.audio))
    if wav:
        items.append(media_io.wav_writer(wav, result.audio, AUDIO_SAMPLE_RATE))
    if frames_dir:
        items += media_io.png_frame_writers(frames_dir, result.frames)
    atomic_write_all(items)
    return [Path(p).resolve() for p in (output, wav, frames_dir) if p]


class PhaseTimer:
    """Wall time of one phase, CUDA-synchronised, minus the component loading it triggered (booked as "load")."""

    def __init__(self, session: Any, timings: dict[str, float], phase: str):
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


def _book_cache_hit(timings: dict[str, float], phase: str, cached: bool | None) -> None:
    """A phase served entirely from the cache encoded nothing: it reports 0, and the key hashing it took is booked
    under "cache_lookup"."""
    if cached:
        timings["cache_lookup"] = timings.get("cache_lookup", 0.0) + timings[phase]
        timings[phase] = 0.0


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
