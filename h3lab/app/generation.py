"""One generation of a `Session`, phase by phase: text encode, condition encode, denoise, decode video, decode audio,
write -- each timed, the component loading it triggers booked under "load" (see `h3lab.app.session`'s contract).

Contract
- `run_generation(session, s, media, progress, cancel, preview, outputs) -> GenerationResult`: `Session.generate`
  calls it under the session lock once every check passed (`s` validated settings, `media` the decoded inputs,
  `outputs` the checked paths of `session.check_outputs`). The steps a rollout shares are not here: the encode,
  denoise and decode phases are `h3lab.app.phases`', the request's DiT, layout, noise and `RunSpec` its
  `h3lab.app.prepared.PreparedRequest`. This module adds what one generation alone has: the schedule check before any
  encode (steps whose shifted grid collapses are refused), the progress and preview callbacks, the cancel, the peak
  memory, the `GenerationResult` and its outputs, written as one set (`io_utils.atomic_write_all`). A cancel seen
  after the last pass stops before decoding (`GenerationCancelled`).
- Timings: `phases.PhaseTimer` per phase (CUDA-synchronised, component loading booked under "load"; a text /
  condition phase served entirely from the cache reports 0 and its key hashing goes to "cache_lookup"); the
  "denoise" phase covers preparing the request and the loop.
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

from . import phases, pipeline
from ..components import streaming
from ..errors import ValidationError
from .phases import PhaseTimer
from .prepared import prepare
from .results import PHASES, GenerationCancelled, GenerationResult, StepInfo
from ..schema.generation_settings import AUDIO_SAMPLE_RATE, FPS


def run_generation(session: Any, s, media, progress, cancel, preview, outputs: dict[str, Path | None]
                   ) -> GenerationResult:
    """The phases of one checked request (see the module docstring)."""
    timings = {phase: 0.0 for phase in ("load",) + PHASES}
    cuda = session.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(session.device)
    else:
        _reset_peak_rss()
    schedule = _schedule(session, s)
    encoded = phases.encode(session, [(s, media)], timings)[0]
    with PhaseTimer(session, timings, "denoise"):
        prepared = prepare(session, s, media, encoded, schedule=schedule)
        loop = _denoise(session, prepared, progress, cancel, preview)
    session.phase_done("transformer", "transformer_ref")
    if cancel is not None and cancel.is_set():  # set during the last pass: stop before decoding and writing
        raise GenerationCancelled(
            f"cancelled after pass {schedule.num_passes} of {schedule.num_passes}, before decoding; the session "
            "is unchanged"
        )
    (frames,), (audio,) = phases.decode(session, [(s, loop["latents"], loop["audio_rows"])], timings)
    peak = torch.cuda.max_memory_allocated(session.device) if cuda else _peak_rss()
    trajectory = loop["trajectory"]
    result = GenerationResult(
        settings=s,
        seed=s.seed,
        frames=frames,
        audio=audio,
        sample_rate=AUDIO_SAMPLE_RATE,
        layout=prepared.layout,
        latents=loop["latents"],
        audio_latents=loop["audio_rows"],
        trajectory=trajectory,
        trajectory_hash=trajectory.digest,
        timings=timings,
        cached=encoded.cached,
        peak_memory=int(peak),
        memory_kind="cuda max allocated" if cuda else "process peak RSS",
        trace=loop["trace"],
        evaluations=loop["evaluations"],
        arm=trajectory.spec,
        streaming=loop["streaming"],
    )
    with PhaseTimer(session, timings, "write"):
        result.outputs = _write(result, outputs["output"], outputs["wav"], outputs["frames_dir"])
    return result


def _schedule(session: Any, s):
    """The request's dual schedule; steps whose shifted grid collapses are refused before anything is encoded."""
    from ..run.sampler import DualSchedule

    schedule = DualSchedule.from_passes(s.steps, session.video_shift, session.audio_shift)
    if schedule.num_passes != s.steps:
        raise ValidationError(
            f"steps={s.steps}: the shifted sigma grid collapses to {schedule.num_passes} distinct passes"
        )
    return schedule


def _denoise(session: Any, prepared, progress, cancel, preview) -> dict[str, Any]:
    """The prepared request's noise and `RunSpec` through the shared denoise phase with a trajectory recorder; this
    wires the callbacks."""
    from ..run import trajectory as T
    from ..run import DenoiseCancelled

    s = prepared.settings
    inputs = prepared.draw()
    spec = prepared.spec(inputs)
    recorder = T.TrajectoryRecorder(keep=session.keep, meta={"settings": pipeline.settings_meta(s)})
    callback, state = _pass_callback(session, s, prepared.schedule, inputs, prepared.patch, progress, preview)
    try:
        video, audio = phases.denoise(session, prepared, spec, recorder, callback, cancel)
    except DenoiseCancelled as err:
        raise GenerationCancelled(f"{err}; the session is unchanged") from None
    latents, audio_rows = prepared.final(inputs, video, audio)
    trajectory = recorder.finish()
    streamed = streaming.last_stats() if spec.residency.get("policy") == "streamed" else None
    return {
        "latents": latents,
        "audio_rows": audio_rows,
        "trajectory": trajectory,
        "trace": state["trace"],
        "evaluations": state["evaluations"],
        "streaming": streamed,
    }


def _pass_callback(session: Any, s, schedule, inputs, patch, progress, preview):
    """The loop's per-pass callback (forwards counted, the last trace kept, the preview frame of the pass's x0
    estimate, the `StepInfo` with the pass's own time) and the state it fills."""
    from ..components.video_vae import unpatchify

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
    from ..components import media as media_io
    from ..io_utils import atomic_write_all

    items = []  # (path, writer): written together, renamed together (write all, then rename all)
    if output:
        items.append(media_io.mp4_writer(output, result.frames, fps=FPS, audio=result.audio))
    if wav:
        items.append(media_io.wav_writer(wav, result.audio, AUDIO_SAMPLE_RATE))
    if frames_dir:
        items += media_io.png_frame_writers(frames_dir, result.frames)
    atomic_write_all(items)
    return [Path(p).resolve() for p in (output, wav, frames_dir) if p]


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
