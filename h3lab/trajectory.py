"""Sealed trajectories: the one denoise loop of h3lab, its per-step recorder, and the sealed artifact it writes.

Contract
--------
`denoise(model, inputs, schedule, recorder=None, callback=None, cancel=None)` is the loop every caller shares (the
session, `verify`, drift, the ablation matrix, the experiment arms). Per pass i of the `DualSchedule`:

1. the row timestep plan of pass i — `(timestep (T,), timestep_indices (S,))`, sealed in `inputs.plan` — and the
   current video/audio rows go through ONE transformer forward over the packed layout (`model.hook_context["step"]`
   is set to i first, when the model has one);
2. the video rows after the `num_condition_video_rows` leading conditioning rows step down the video grid, the audio
   rows after the reference rows down the audio grid (`stepper.step(modality, i, sample, velocity)`, default the
   sampler's Euler step on the schedule's own grid); conditioning rows are never written;
3. the recorder gets a `StepRecord`: the velocities the model returned (all rows) and the latents after the step.

`DenoiseInputs` is everything the loop reads besides the model and the schedule: text embeddings (B, Nt, text_dim),
initial video rows (B, Nv, video_patch_dim) and audio rows (B, Na, audio_in_channels) — conditioning rows first, then
the noise rows — the packed-layout index tensors, and the per-pass plan. All of it is sealed, so a replay needs no
layout builder, no text encoder and no VAE.

A sealed trajectory is a directory:

- `manifest.json`   format, checkpoint fingerprint, code revision, mode, hash scheme, layout hash, seeds, both sigma
                    grids with their SHA-256, the SHA-256 of every sealed input, per pass the SHA-256 of the video and
                    audio velocities and latents, the provenance trace summary, the kept tensors, and `digest`;
- `inputs.safetensors`  the sealed inputs (replays start from these);
- `tensors.safetensors` the tensors the user asked to keep (`keep=("latents", "velocities")`, optionally only some
                    passes), keys `video.0003`, `velocity_video.0003`, ...

Writing is atomic at the directory level: every file is written (fsynced) into a hidden sibling directory, which is
then renamed onto the target; an existing trajectory at the target is moved aside first and removed only after the
rename, so a reader sees the old artifact or the new one, never a mix.

`Trajectory.digest` is one SHA-256 over the per-pass hashes in order (lines `i:vv:va:xv:xa`); replays' `# expect`
lines check it. `load(path)` re-hashes the inputs and kept tensors against the manifest and recomputes the digest
(a tampered file raises `TrajectoryError`). `verify(path, model)` replays from the sealed inputs in the recorded mode
and reports the first pass (and tensor) whose hash differs, or OK.

Hashing
-------
`tensor_digest(t, scheme)` hashes a tensor's *bytes* and dtype (not its shape: (B, S, H*D) and (B, S, H, D) views of
one buffer hash alike). Schemes:

- ``sha256`` SHA-256 over `dtype|nbytes|` and the raw little-endian bytes. On CPU the bytes are read in place (a
  zero-copy numpy view of the contiguous tensor); on CUDA they are copied to the host, which is the only host copy
  the recorder makes. Trajectories always use this scheme: their tensors are the latents and velocities (a few MB).
- ``device`` for activations on an accelerator (drift capture): the bytes are read as unsigned 16-bit words w_i and
  reduced on the device to two lanes L_k = sum_i (w_i * c_k(i) mod p) mod p, p = 2^31 - 1, with pseudo-random
  coefficients c_k(i) in [0, 2^31) from a splitmix-style integer mix of (i, k) (int64 wrap-around arithmetic). Every
  term is an exact integer, so the sum does not depend on the reduction order; chunks of 2^22 words bound the
  temporaries. On CUDA one Triton pass computes them (`h3kernels.digest`, exact integers, so the same lanes as the
  torch formulation). Only the two lanes (16 bytes) go to the host, where SHA-256 over `dtype|nbytes|device-v1|` and the
  lanes gives the digest. Two different byte strings collide with probability ~2^-62 per pair (non-adversarial).
- ``auto`` is ``sha256`` on CPU and ``device`` on CUDA.
Digests of different schemes are not comparable; the manifest records the scheme.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from . import __version__, runtime
from .errors import H3Error
from .io_utils import atomic_save_safetensors, atomic_write_json
from .sampler import DualSchedule, extrapolate_velocity, reuse_plan

FORMAT = "h3lab-trajectory/1"
MANIFEST = "manifest.json"
INPUTS_FILE = "inputs.safetensors"
TENSORS_FILE = "tensors.safetensors"
STEP_FIELDS = ("velocity_video", "velocity_audio", "video", "audio")  # per-pass hashed tensors, in digest order
KEEP_CHOICES = ("latents", "velocities")
HASH_SCHEMES = ("sha256", "device", "auto")


class TrajectoryError(H3Error):
    """A sealed trajectory is missing, malformed or tampered with; or its inputs break a rule."""


class DenoiseCancelled(Exception):
    """Raised by `denoise` when `cancel` reports a cancellation before a pass (the session catches it)."""


# ================================================================================================= hashing
def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor (a view when already contiguous)."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _header(t: torch.Tensor, nbytes: int, scheme: str) -> bytes:
    return f"{str(t.dtype).replace('torch.', '')}|{nbytes}|{scheme}|".encode()


def _sha256_digest(t: torch.Tensor) -> str:
    raw = _bytes_view(t)
    h = hashlib.sha256(_header(t, raw.numel(), "sha256"))
    h.update(memoryview(raw.cpu().numpy()))
    return h.hexdigest()


def device_lanes(t: torch.Tensor, impl: str = "auto") -> tuple[int, int]:
    """The two mod-p lanes of the `device` scheme, computed where `t` lives (see the module docstring).
    impl: "kernel" (one Triton pass, `h3kernels.digest`), "torch" (plain integer ops), "auto" (the kernel on CUDA,
    torch elsewhere). Both give the same integers: the formula is exact."""
    from h3kernels import digest

    raw = _bytes_view(t)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    words = raw.view(torch.int16)
    if impl == "auto":
        impl = "kernel" if words.is_cuda else "torch"
    if impl == "kernel":
        return digest.lanes(words)
    if impl == "torch":
        return digest.reference_lanes(words)
    raise TrajectoryError(f"device_lanes impl {impl!r}: must be auto, kernel or torch")


def _device_digest(t: torch.Tensor) -> str:
    nbytes = t.numel() * t.element_size()
    h = hashlib.sha256(_header(t, nbytes, "device-v1"))
    for lane in device_lanes(t):
        h.update(lane.to_bytes(8, "little"))
    return h.hexdigest()


def resolve_scheme(scheme: str, device: torch.device | str) -> str:
    if scheme not in HASH_SCHEMES:
        raise TrajectoryError(f"hash scheme {scheme!r}: must be one of {', '.join(HASH_SCHEMES)}")
    if scheme == "auto":
        return "device" if torch.device(device).type != "cpu" else "sha256"
    return scheme


def tensor_digest(t: torch.Tensor, scheme: str = "sha256") -> str:
    """Hex digest of `t`'s dtype and bytes under `scheme` ("sha256" | "device" | "auto")."""
    scheme = resolve_scheme(scheme, t.device)
    return _sha256_digest(t) if scheme == "sha256" else _device_digest(t)


def digest_lines(steps: Sequence[dict]) -> str:
    """`Trajectory.digest`: SHA-256 over one line `i:vv:va:xv:xa` per pass, in pass order."""
    h = hashlib.sha256()
    for s in steps:
        h.update((":".join([str(s["index"])] + [s[f] for f in STEP_FIELDS]) + "\n").encode())
    return h.hexdigest()


# ============================================================================================ sealed inputs
@dataclass
class DenoiseInputs:
    """Everything the loop reads besides the model and the schedule (see the module docstring).

    text (B, Nt, text_dim); video (B, Nv, video_patch_dim) float32, conditioning rows first; audio (B, Na, C_audio)
    float32, reference rows first; position_ids (S, 3); token_tags, video/audio/text_indices int64; plan: per pass
    `(timestep (T,) float32, timestep_indices (S,) int64)`."""

    text: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    plan: list[tuple[torch.Tensor, torch.Tensor]]
    num_condition_video_rows: int = 0
    num_condition_audio_rows: int = 0
    layout_sha256: str = ""
    seeds: dict = field(default_factory=dict)
    task: str = ""
    key_order: torch.Tensor | None = None  # (S,) canonical attention key order; None for a canonical layout

    _LAYOUT_KEYS = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")

    def __post_init__(self) -> None:
        for name in ("text", "video", "audio"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor) or x.ndim != 3:
                got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise TrajectoryError(f"inputs.{name} is {got}: must be a (batch, rows, features) tensor")
        batches = {n: getattr(self, n).shape[0] for n in ("text", "video", "audio")}
        if len(set(batches.values())) != 1:
            raise TrajectoryError(f"inputs batch sizes {batches}: text, video and audio must share one batch size")
        if not 0 <= self.num_condition_video_rows <= self.video.shape[1]:
            raise TrajectoryError(
                f"num_condition_video_rows={self.num_condition_video_rows}: must be in [0, {self.video.shape[1]}]"
            )
        if not 0 <= self.num_condition_audio_rows <= self.audio.shape[1]:
            raise TrajectoryError(
                f"num_condition_audio_rows={self.num_condition_audio_rows}: must be in [0, {self.audio.shape[1]}]"
            )
        if not self.plan:
            raise TrajectoryError("inputs.plan is empty: one (timestep, timestep_indices) pair per pass is required")

    @property
    def batch_size(self) -> int:
        return self.video.shape[0]

    @property
    def num_passes(self) -> int:
        return len(self.plan)

    @property
    def seq_len(self) -> int:
        return self.position_ids.shape[0]

    @classmethod
    def from_layout(
        cls,
        layout: Any,
        schedule: DualSchedule,
        text: torch.Tensor,
        video: torch.Tensor,
        audio: torch.Tensor,
        seeds: dict | None = None,
    ) -> "DenoiseInputs":
        """Seal a `PackedLayout`'s tensors and its per-pass plan for `schedule` with the pre-encoded inputs.
        `video`/`audio` are the initial rows (B, N, C) (or (N, C), batch 1), conditioning rows first."""
        video = video if video.ndim == 3 else video[None]
        audio = audio if audio.ndim == 3 else audio[None]
        text = text if text.ndim == 3 else text[None]
        plan = [tuple(p) for p in layout.timestep_plan(schedule.video.timesteps, schedule.audio.timesteps)]
        return cls(
            text=text, video=video, audio=audio,
            position_ids=layout.position_ids, token_tags=layout.token_tags, video_indices=layout.video_indices,
            audio_indices=layout.audio_indices, text_indices=layout.text_indices, plan=plan,
            num_condition_video_rows=int(layout.num_condition_video_rows),
            num_condition_audio_rows=int(layout.num_condition_audio_rows),
            layout_sha256=layout.sha256(), seeds=dict(seeds or {}), task=str(getattr(layout, "task", "")),
            key_order=layout.key_order(),
        )

    def replace(self, **changes: Any) -> "DenoiseInputs":
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> "DenoiseInputs":
        mv = lambda x: x.to(device)  # noqa: E731
        return self.replace(
            text=mv(self.text), video=mv(self.video), audio=mv(self.audio), position_ids=mv(self.position_ids),
            token_tags=mv(self.token_tags), video_indices=mv(self.video_indices),
            audio_indices=mv(self.audio_indices), text_indices=mv(self.text_indices),
            plan=[(mv(t), mv(i)) for t, i in self.plan],
            key_order=None if self.key_order is None else mv(self.key_order),
        )

    def layout_kwargs(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self._LAYOUT_KEYS}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor dict of everything sealed (safetensors keys)."""
        out = {"text": self.text, "video": self.video, "audio": self.audio, **self.layout_kwargs()}
        if self.key_order is not None:
            out["key_order"] = self.key_order
        for i, (t, idx) in enumerate(self.plan):
            out[f"plan.{i:04d}.timestep"] = t
            out[f"plan.{i:04d}.timestep_indices"] = idx
        return out

    def meta(self) -> dict[str, Any]:
        return {
            "num_condition_video_rows": self.num_condition_video_rows,
            "num_condition_audio_rows": self.num_condition_audio_rows,
            "layout_sha256": self.layout_sha256,
            "seeds": self.seeds,
            "task": self.task,
            "num_passes": self.num_passes,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "DenoiseInputs":
        n = int(meta["num_passes"])
        try:
            plan = [(tensors[f"plan.{i:04d}.timestep"], tensors[f"plan.{i:04d}.timestep_indices"]) for i in range(n)]
            return cls(
                text=tensors["text"], video=tensors["video"], audio=tensors["audio"],
                **{k: tensors[k] for k in cls._LAYOUT_KEYS}, plan=plan,
                num_condition_video_rows=int(meta["num_condition_video_rows"]),
                num_condition_audio_rows=int(meta["num_condition_audio_rows"]),
                layout_sha256=str(meta.get("layout_sha256", "")), seeds=dict(meta.get("seeds", {})),
                task=str(meta.get("task", "")), key_order=tensors.get("key_order"),
            )
        except KeyError as exc:
            raise TrajectoryError(f"sealed inputs lack tensor {exc.args[0]!r}: the inputs file is incomplete") from None


# ================================================================================================== stepping
class Stepper(Protocol):
    """Advances one modality's generated rows by one pass: `step(modality, i, sample, velocity) -> next sample`."""

    def step(self, modality: str, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor: ...


class ScheduleStepper:
    """The default stepper: the sampler's Euler step on the schedule's own grid for each modality."""

    def __init__(self, schedule: DualSchedule):
        self.schedule = schedule

    def step(self, modality: str, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        return getattr(self.schedule, modality).step(i, sample, velocity)


@dataclass
class StepRecord:
    """One pass: t of each modality, whether the model ran (False: reused velocity), velocities as returned (all
    rows, (B, N, C)), latents after the step (B, N, C), and the provenance trace of the forward (None if none)."""

    index: int
    t_video: float
    t_audio: float
    evaluated: bool
    velocity_video: torch.Tensor
    velocity_audio: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    trace: runtime.Trace | None = None


def model_forward(model: Any, inputs: DenoiseInputs, video: torch.Tensor, audio: torch.Tensor, i: int):
    """One transformer forward of pass i over the packed layout; works for `H3Transformer` and Diffusers'
    `MiniMaxH3Transformer3DModel` (whose output object is unpacked)."""
    timestep, timestep_indices = inputs.plan[i]
    # Diffusers' model has no key_order; it only ever sees canonical layouts (packed order = canonical order).
    extra = {} if inputs.key_order is None else {"key_order": inputs.key_order}
    out = model(
        hidden_states=video,
        audio_hidden_states=audio,
        encoder_hidden_states=inputs.text,
        timestep=timestep,
        timestep_indices=timestep_indices,
        **inputs.layout_kwargs(),
        **extra,
    )
    if isinstance(out, tuple):
        return out[0], out[1]
    return out.sample, out.audio_sample


def _cancelled(cancel: Any) -> bool:
    if cancel is None:
        return False
    if hasattr(cancel, "is_set"):
        return bool(cancel.is_set())
    return bool(cancel())


def set_hook_step(model: Any, i: int) -> None:
    ctx = getattr(model, "hook_context", None)
    if isinstance(ctx, dict):
        ctx["step"] = i


def denoise(
    model: Any,
    inputs: DenoiseInputs,
    schedule: DualSchedule,
    recorder: "TrajectoryRecorder | None" = None,
    callback: Callable[[StepRecord], None] | None = None,
    cancel: Any = None,
    *,
    stepper: Stepper | None = None,
    reuse: int = 1,
    reuse_mode: str = "linear",
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every pass of `schedule` from the sealed `inputs`; returns the final (video, audio) rows (B, N, C).

    Runs in the current `runtime` mode (wrap it in `runtime.use_mode(...)`). `recorder` (a `TrajectoryRecorder`)
    and `callback(StepRecord)` see every pass; `cancel` (an Event-like `.is_set()` or a callable) is checked before
    each pass and raises `DenoiseCancelled`. `stepper` replaces the Euler step (ablations, Diffusers' scheduler);
    `reuse=k` evaluates the model on the first, last and every k-th pass and extrapolates the others per modality
    (`sampler.reuse_plan` / `extrapolate_velocity`); `forward` replaces `model_forward` (drift's input capture).
    The recorder's manifest notes the stepper class and the reuse setting, so a replay can be asked for the same."""
    if inputs.num_passes != schedule.num_passes:
        raise TrajectoryError(
            f"inputs carry a plan for {inputs.num_passes} passes but the schedule has {schedule.num_passes}: "
            "seal the inputs for this schedule (DenoiseInputs.from_layout)"
        )
    stepper = stepper or ScheduleStepper(schedule)
    forward = forward or model_forward
    evaluate = reuse_plan(schedule.num_passes, reuse)
    history: dict[str, list] = {"video": [], "audio": []}
    nv, na = inputs.num_condition_video_rows, inputs.num_condition_audio_rows
    video, audio = inputs.video, inputs.audio
    if recorder is not None:
        run = {"stepper": type(stepper).__name__, "reuse": reuse, "reuse_mode": reuse_mode}
        recorder.begin(model, inputs, schedule, run)
    with torch.no_grad():
        for i in range(schedule.num_passes):
            if _cancelled(cancel):
                raise DenoiseCancelled(f"cancelled before pass {i} of {schedule.num_passes}")
            trace = None
            if evaluate[i]:
                set_hook_step(model, i)
                before = runtime.last_trace()
                v_video, v_audio = forward(model, inputs, video, audio, i)
                trace = runtime.last_trace()
                trace = trace if trace is not before else None  # a model that does not trace (Diffusers)
                history["video"].append((schedule.video.sigmas[i], v_video))
                history["audio"].append((schedule.audio.sigmas[i], v_audio))
            else:
                v_video = extrapolate_velocity(schedule.video.sigmas[i], history["video"], reuse_mode)
                v_audio = extrapolate_velocity(schedule.audio.sigmas[i], history["audio"], reuse_mode)
            # Only the generated rows move; the conditioning / reference rows are kept as sealed.
            video = torch.cat([video[:, :nv], stepper.step("video", i, video[:, nv:], v_video[:, nv:].float())], 1)
            audio = torch.cat([audio[:, :na], stepper.step("audio", i, audio[:, na:], v_audio[:, na:].float())], 1)
            record = StepRecord(
                index=i,
                t_video=float(schedule.video.timesteps[i]),
                t_audio=float(schedule.audio.timesteps[i]),
                evaluated=evaluate[i],
                velocity_video=v_video,
                velocity_audio=v_audio,
                video=video,
                audio=audio,
                trace=trace,
            )
            if recorder is not None:
                recorder.record(record)
            if callback is not None:
                callback(record)
    return video, audio


# ================================================================================================ provenance
def code_revision() -> str:
    """`git:<sha>[+dirty]` of the h3lab checkout when it is a git work tree, else `h3lab-<version>`."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()
        return f"git:{rev}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return f"h3lab-{__version__}"


def model_fingerprint(model: Any) -> str:
    """The checkpoint identity a trajectory records: `model.fingerprint` when the loader set one, else a digest of
    every parameter and persistent buffer (name, dtype, bytes; device scheme on accelerators).

    The weights digest is cached on the model under a key of every tensor's (name, storage address, version counter,
    dtype, shape, device): an optimizer step, `load_state_dict` or `assign` changes the key and the digest is
    recomputed (0.22 s for the 33B DiT on an H200). Writes through `.data` bypass version counters and are not seen:
    set `model.fingerprint` yourself, or write without `.data`."""
    fp = getattr(model, "fingerprint", "")
    if isinstance(fp, str) and fp:
        return fp
    state = model.state_dict()
    key = tuple((n, t.data_ptr(), t._version, t.dtype, tuple(t.shape), str(t.device)) for n, t in state.items())
    cached = getattr(model, "_h3lab_weights_digest", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    h = hashlib.sha256(b"h3lab-weights-v1|")
    for name, tensor in state.items():
        h.update(f"{name}={tensor_digest(tensor, 'auto')};".encode())
    digest = "weights:" + h.hexdigest()
    try:
        object.__setattr__(model, "_h3lab_weights_digest", (key, digest))
    except (AttributeError, TypeError):  # a model that refuses new attributes is hashed every time
        pass
    return digest


class TraceSummary:
    """Accumulates the per-forward traces of a run into the manifest's provenance summary."""

    def __init__(self) -> None:
        self.forwards = 0
        self.untraced = 0
        self.ops: dict[str, dict[str, int]] = {}
        self.kernels: set[str] = set()
        self.fallbacks = 0
        self.head: dict[str, Any] = {}

    def add(self, trace: runtime.Trace | None) -> None:
        self.forwards += 1
        if trace is None:
            self.untraced += 1
            return
        if not self.head:
            self.head = {"mode": trace.mode, "device": trace.device, "fingerprint": trace.fingerprint,
                         "versions": trace.versions}
        for op, backends in trace.summary().items():
            slot = self.ops.setdefault(op, {})
            for backend, n in backends.items():
                slot[backend] = slot.get(backend, 0) + n
        self.kernels.update(r.kernel_id for r in trace.records)
        self.fallbacks += len(trace.fallbacks)

    def to_dict(self) -> dict[str, Any]:
        return {**self.head, "forwards": self.forwards, "untraced_forwards": self.untraced, "ops": self.ops,
                "kernels": sorted(self.kernels), "non_strict_calls": self.fallbacks}


# ================================================================================================== recorder
class TrajectoryRecorder:
    """Fed by `denoise`, one `StepRecord` per pass: hashes the four per-pass tensors (SHA-256), copies to the host
    only the ones asked for, aggregates the provenance trace, and builds the `Trajectory` in `finish()`.

    keep: subset of ("latents", "velocities"); keep_steps: pass indices to keep (None: all).

    On CUDA the host copies of a pass are made on a side stream that waits only for that pass's own work (pinned
    buffers, non-blocking), and hashed when the next pass is recorded or at `finish()`: the host does not wait for
    the GPU inside the loop and keeps queueing the next forward. `deferred = False` (verify's checker) hashes each
    pass at once instead. The bytes hashed are the same either way (checked on the H200 by
    benchmarks/benchmark_trajectory.py)."""

    deferred = True

    def __init__(
        self,
        keep: Iterable[str] = (),
        keep_steps: Iterable[int] | None = None,
        meta: dict[str, Any] | None = None,
    ):
        self.keep = tuple(keep)
        bad = [k for k in self.keep if k not in KEEP_CHOICES]
        if bad:
            raise TrajectoryError(f"keep={bad}: each entry must be one of {', '.join(KEEP_CHOICES)}")
        self.keep_steps = None if keep_steps is None else set(int(s) for s in keep_steps)
        self.meta = dict(meta or {})
        self.steps: list[dict] = []
        self.kept: dict[str, torch.Tensor] = {}
        self.trace = TraceSummary()
        self.inputs: DenoiseInputs | None = None
        self.schedule: DualSchedule | None = None
        self.header: dict[str, Any] = {}
        self._pending: list[tuple[dict, dict[str, torch.Tensor], Any]] = []  # (entry, host copies, done event)
        self._stream = None

    def begin(self, model: Any, inputs: DenoiseInputs, schedule: DualSchedule, run: dict | None = None) -> None:
        self.inputs, self.schedule = inputs, schedule
        self.steps, self.kept, self.trace, self._pending = [], {}, TraceSummary(), []
        self.header = {
            "checkpoint": {
                "fingerprint": model_fingerprint(model),
                "model_class": type(model).__name__,
                "config": _config_of(model),
                "dtype_policy": getattr(model, "dtype_policy", ""),
            },
            "mode": runtime.current_mode(),
            "device": str(inputs.video.device),
            "run": dict(run or {}),
        }

    def _host_copies(self, rec: StepRecord) -> tuple[dict[str, torch.Tensor], Any]:
        """The four tensors of a pass on the host, and an event that marks them complete (None: already are)."""
        tensors = {name: getattr(rec, name).detach() for name in STEP_FIELDS}
        if not (self.deferred and all(t.is_cuda for t in tensors.values())):
            return {name: t.cpu() for name, t in tensors.items()}, None
        device = tensors["video"].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))  # after this pass's step, nothing later
        host = {}
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for name, t in tensors.items():
                t = t.contiguous()
                host[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host[name].copy_(t, non_blocking=True)
                t.record_stream(self._stream)  # the allocator keeps t until the copy is done
        done = torch.cuda.Event()
        done.record(self._stream)
        return host, done

    def record(self, rec: StepRecord) -> None:
        entry: dict[str, Any] = {"index": rec.index, "t_video": rec.t_video, "t_audio": rec.t_audio,
                                 "evaluated": rec.evaluated}
        self.flush()  # the previous pass's copies finished long ago: hash them now
        host, done = self._host_copies(rec)
        self.steps.append(entry)
        if rec.evaluated:
            self.trace.add(rec.trace)
        self._pending.append((entry, host, done))
        if done is None:
            self.flush()

    def flush(self) -> None:
        """Hash (and keep) every pass recorded so far; `steps` is complete afterwards."""
        for entry, host, done in self._pending:
            if done is not None:
                done.synchronize()
            for name in STEP_FIELDS:
                entry[name] = tensor_digest(host[name], "sha256")
            i = entry["index"]
            if self.keep_steps is None or i in self.keep_steps:
                if "latents" in self.keep:
                    self.kept[f"video.{i:04d}"] = host["video"].clone()
                    self.kept[f"audio.{i:04d}"] = host["audio"].clone()
                if "velocities" in self.keep:
                    self.kept[f"velocity_video.{i:04d}"] = host["velocity_video"].clone()
                    self.kept[f"velocity_audio.{i:04d}"] = host["velocity_audio"].clone()
        self._pending = []

    def finish(self) -> "Trajectory":
        if self.inputs is None or self.schedule is None:
            raise TrajectoryError("recorder was never started: pass it to denoise(...) first")
        self.flush()
        inputs_hashes = {k: tensor_digest(v, "sha256") for k, v in self.inputs.tensors().items()}
        manifest = {
            "format": FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **self.header,
            "code": {"revision": code_revision(), "h3lab": __version__, "versions": runtime.versions()},
            "hash_scheme": "sha256",
            "layout": {"sha256": self.inputs.layout_sha256, "task": self.inputs.task, "seq_len": self.inputs.seq_len},
            "seeds": self.inputs.seeds,
            "schedule": self.schedule.to_dict(),
            "inputs": {"meta": self.inputs.meta(), "sha256": inputs_hashes},
            "steps": self.steps,
            "trace": self.trace.to_dict(),
            "kept": {k: tensor_digest(v, "sha256") for k, v in self.kept.items()},
            "meta": self.meta,
            "digest": digest_lines(self.steps),
        }
        return Trajectory(manifest=manifest, inputs=self.inputs, kept=dict(self.kept))


def _config_of(model: Any) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "to_diffusers"):
        return cfg.to_diffusers()
    if isinstance(cfg, dict):  # Diffusers' FrozenDict
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items() if not k.startswith("_")}
    return {}


# ================================================================================================ trajectory
@dataclass
class Trajectory:
    """A recorded run: the manifest (JSON-ready dict), the sealed inputs, and the kept tensors (host)."""

    manifest: dict[str, Any]
    inputs: DenoiseInputs
    kept: dict[str, torch.Tensor]
    path: Path | None = None

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def steps(self) -> list[dict]:
        return self.manifest["steps"]

    @property
    def schedule(self) -> DualSchedule:
        return DualSchedule.from_dict(self.manifest["schedule"])

    @property
    def mode(self) -> str:
        return self.manifest["mode"]

    def seal(self, path: str | os.PathLike) -> Path:
        """Write the trajectory directory atomically (see the module docstring); returns its path."""
        target = Path(path)
        if target.exists() and not target.is_dir():
            raise TrajectoryError(f"trajectory path {str(target)!r} exists and is not a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        old = None
        try:
            atomic_save_safetensors(tmp / INPUTS_FILE, self.inputs.tensors(), metadata={"format": FORMAT})
            if self.kept:
                atomic_save_safetensors(tmp / TENSORS_FILE, self.kept, metadata={"format": FORMAT})
            atomic_write_json(tmp / MANIFEST, self.manifest)  # last: a directory with a manifest is complete
            if target.exists():
                old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
                os.replace(target, old)
            os.replace(tmp, target)
        except BaseException:
            if old is not None and not target.exists():
                os.replace(old, target)
                old = None
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.path = target
        return target


def run_trajectory(
    model: Any,
    inputs: DenoiseInputs,
    schedule: DualSchedule,
    *,
    mode: str | None = None,
    keep: Iterable[str] = (),
    keep_steps: Iterable[int] | None = None,
    meta: dict[str, Any] | None = None,
    **denoise_kwargs: Any,
) -> Trajectory:
    """`denoise` with a fresh recorder, in `mode` (default: the current mode); returns the in-memory trajectory
    (call `.seal(path)` to write it)."""
    recorder = TrajectoryRecorder(keep=keep, keep_steps=keep_steps, meta=meta)
    if mode is None:
        denoise(model, inputs, schedule, recorder, **denoise_kwargs)
    else:
        with runtime.use_mode(mode):
            denoise(model, inputs, schedule, recorder, **denoise_kwargs)
    return recorder.finish()


# ======================================================================================================= load
def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise TrajectoryError(f"{path}: not a readable safetensors file ({exc})") from None


def load(path: str | os.PathLike) -> Trajectory:
    """Read a sealed trajectory and check it: format, every sealed input and kept tensor against its recorded
    SHA-256, and the digest against the per-pass hashes. Any mismatch raises `TrajectoryError` naming it."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise TrajectoryError(f"{str(root)!r} is not a sealed trajectory: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TrajectoryError(f"{manifest_path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise TrajectoryError(f"{manifest_path}: format {got!r} is not {FORMAT!r}")
    for key in ("steps", "inputs", "schedule", "digest", "mode", "kept"):
        if key not in manifest:
            raise TrajectoryError(f"{manifest_path}: manifest lacks {key!r}")
    recomputed = digest_lines(manifest["steps"])
    if recomputed != manifest["digest"]:
        raise TrajectoryError(
            f"{manifest_path}: digest {manifest['digest']} does not match its per-pass hashes ({recomputed}): "
            "the manifest was edited"
        )
    tensors = _read_safetensors(root / INPUTS_FILE)
    expected = manifest["inputs"]["sha256"]
    if set(tensors) != set(expected):
        odd = sorted(set(tensors) ^ set(expected))
        raise TrajectoryError(f"{root / INPUTS_FILE}: tensors {odd} do not match the manifest")
    for name, digest in expected.items():
        if tensor_digest(tensors[name], "sha256") != digest:
            raise TrajectoryError(f"{root / INPUTS_FILE}: sealed input {name!r} does not match its recorded sha256")
    kept: dict[str, torch.Tensor] = {}
    if manifest["kept"]:
        kept = _read_safetensors(root / TENSORS_FILE)
        if set(kept) != set(manifest["kept"]):
            raise TrajectoryError(f"{root / TENSORS_FILE}: kept tensors differ from the manifest's list")
        for name, digest in manifest["kept"].items():
            if tensor_digest(kept[name], "sha256") != digest:
                raise TrajectoryError(f"{root / TENSORS_FILE}: kept tensor {name!r} does not match its recorded sha256")
    inputs = DenoiseInputs.from_tensors(tensors, manifest["inputs"]["meta"])
    return Trajectory(manifest=manifest, inputs=inputs, kept=kept, path=root)


# ===================================================================================================== verify
@dataclass
class VerifyReport:
    """Outcome of `verify`: ok, or the first pass and tensor whose hash differs (expected vs replayed)."""

    ok: bool
    passes_checked: int
    num_passes: int
    first_step: int | None = None
    field: str | None = None
    expected: str | None = None
    got: str | None = None
    digest: str = ""
    replay_digest: str | None = None
    fingerprint_match: bool = True
    mode: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        if self.ok:
            return f"OK: {self.passes_checked}/{self.num_passes} passes byte-equal (digest {self.digest[:16]})"
        note = "" if self.fingerprint_match else " (checkpoint fingerprint differs from the recorded one)"
        note += f" ({self.note})" if self.note else ""
        return (f"DRIFT at pass {self.first_step}: {self.field} hash {self.got[:16]} != recorded "
                f"{self.expected[:16]}{note}")


def verify(
    path: str | os.PathLike | Trajectory,
    model: Any,
    *,
    mode: str | None = None,
    device: torch.device | str | None = None,
    stop_at_first: bool = True,
    **denoise_kwargs: Any,
) -> VerifyReport:
    """Replay a sealed trajectory from its sealed inputs (in its recorded mode unless `mode` is given) and compare
    every pass's four hashes; the report names the first differing pass and tensor, or says OK."""
    traj = path if isinstance(path, Trajectory) else load(path)
    schedule = traj.schedule
    run = traj.manifest.get("run", {})
    denoise_kwargs.setdefault("reuse", run.get("reuse", 1))
    denoise_kwargs.setdefault("reuse_mode", run.get("reuse_mode", "linear"))
    note = ""
    if run.get("stepper", "ScheduleStepper") != "ScheduleStepper" and "stepper" not in denoise_kwargs:
        note = f"recorded with stepper {run['stepper']}, replayed with the sampler's Euler step (pass stepper=)"
    inputs = traj.inputs if device is None else traj.inputs.to(device)
    expected = traj.steps
    replay: list[dict] = []
    first: dict[str, Any] = {}

    class _Stop(Exception):
        pass

    class _Checker(TrajectoryRecorder):
        deferred = False  # each pass is compared as it arrives

        def record(self, rec: StepRecord) -> None:
            super().record(rec)
            got = self.steps[-1]
            want = expected[rec.index] if rec.index < len(expected) else None
            replay.append(got)
            if not first:
                for name in STEP_FIELDS:
                    if want is None or got[name] != want[name]:
                        first.update(step=rec.index, field=name, expected=None if want is None else want[name],
                                     got=got[name])
                        break
                if first and stop_at_first:
                    raise _Stop

    checker = _Checker()
    with runtime.use_mode(mode or traj.mode):
        try:
            denoise(model, inputs, schedule, checker, **denoise_kwargs)
        except _Stop:
            pass
    recorded_fp = traj.manifest.get("checkpoint", {}).get("fingerprint", "")
    fp_match = (not recorded_fp) or recorded_fp == model_fingerprint(model)
    if first:
        return VerifyReport(ok=False, passes_checked=len(replay), num_passes=len(expected), first_step=first["step"],
                            field=first["field"], expected=first["expected"] or "", got=first["got"],
                            digest=traj.digest, fingerprint_match=fp_match, mode=mode or traj.mode, note=note)
    if len(replay) != len(expected):
        return VerifyReport(ok=False, passes_checked=len(replay), num_passes=len(expected), first_step=len(replay),
                            field="num_passes", expected=str(len(expected)), got=str(len(replay)),
                            digest=traj.digest, fingerprint_match=fp_match, mode=mode or traj.mode, note=note)
    return VerifyReport(ok=True, passes_checked=len(replay), num_passes=len(expected), digest=traj.digest,
                        replay_digest=digest_lines(replay), fingerprint_match=fp_match, mode=mode or traj.mode,
                        note=note)
