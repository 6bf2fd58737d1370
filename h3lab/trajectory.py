"""Sealed trajectories: the per-pass recorder the loop feeds, the sealed artifact it writes, and `verify`.

Contract
--------
`record(spec, model, keep=(), keep_steps=None, meta=None, models=None, callback=None, cancel=None)` runs a `RunSpec`
through the one loop (`h3lab.run.denoise`) with a `TrajectoryRecorder` and returns the `Trajectory`. Any caller of the
loop can pass its own recorder instead (the session does). Per pass the recorder gets a `StepRecord` and keeps the
SHA-256 of the video and audio velocities the model returned (all rows) and of the latents after the step.

A sealed trajectory is a directory:

- `manifest.json`   format, checkpoint fingerprint, code revision, mode, hash scheme, layout hash, seeds, both sigma
                    grids with their SHA-256, the SHA-256 of every sealed input, the run settings (`run`: stepper,
                    reuse), the run spec (`spec`: `RunSpec.to_dict()`, and `spec_sha256`), per pass the SHA-256 of the
                    video and audio velocities and latents, the provenance trace summary, the kept tensors, `digest`;
- `inputs.safetensors`  the spec's sealed tensors: the `DenoiseInputs` and the layout's (`layout.<name>`);
- `tensors.safetensors` the tensors the user asked to keep (`keep=("latents", "velocities", "noise")`, optionally
                    only some passes), keys `video.0003`, `velocity_video.0003`, `noise_audio.0003`, ...

A stochastic stepper (`h3lab.stochastic`: flow_sde, dance_sde, cps) reports each pass (`StepRecord.transition`): the
pass entry then also holds `transition` (per modality: sigmas, level, std and, per request, the float32 log-density
mean and sum and the mean's SHA-256) and `transition_sha256` (its sorted-key JSON SHA-256); `noise` keeps the pass's
Gaussian draws. A pass without one (every Euler run) has neither key, so the digests of Euler runs are unchanged.

The manifest's `schedule`, `inputs`, `mode` and `run` are the spec's: what the run was asked to be. A factor's
changes (another plan, grid, stepper, model) are not sealed as tensors: the spec seals the factor's name, and a
replay re-derives them.

Writing is atomic at the directory level: every file is written (fsynced) into a hidden sibling directory, which is
then renamed onto the target; an existing trajectory at the target is moved aside first and removed only after the
rename, so a reader sees the old artifact or the new one, never a mix.

`Trajectory.digest` is one SHA-256 over the per-pass hashes in order (lines `i:vv:va:xv:xa`, plus `:tr` -- the
`transition_sha256` -- on a pass that has one); replays' `# expect` lines check it. `load(path)` re-hashes the
sealed tensors and kept tensors against the manifest, rebuilds the `RunSpec` and checks its `sha256`, checks every
`transition` against its `transition_sha256`, and recomputes the digest (a tampered file raises `TrajectoryError`).
`verify(path, model)` replays exactly the sealed spec (mode, factors, stepper and its parameters, reuse, preset,
placement, adapters, residency) and reports the first pass (and tensor, or transition entry: the recomputed
log-densities, means, stds, sigmas) that differs, or OK. A spec with custom callables cannot be replayed
from its description: `verify` refuses it. A manifest written before run specs existed (no `spec`) is read as a
plain spec of its mode, stepper and reuse; one that recorded ablation factors is refused (its factors were not sealed
by name).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from . import __version__, runtime
from .errors import H3Error
from .hashing import digest_mismatch, json_sha256, model_fingerprint, tensor_digest
from .io_utils import atomic_save_safetensors, atomic_write_dir, atomic_write_json
from .run import Custom, DenoiseInputs, ResolvedRun, RunSpec, StepRecord, denoise
from .run.fields import thaw
from .run.spec import schedule_from_dict
from .sampler import DualSchedule

FORMAT = "h3lab-trajectory/1"
MANIFEST = "manifest.json"
INPUTS_FILE = "inputs.safetensors"
TENSORS_FILE = "tensors.safetensors"
STEP_FIELDS = ("velocity_video", "velocity_audio", "video", "audio")  # per-pass hashed tensors, in digest order
KEEP_CHOICES = ("latents", "velocities", "noise")
TRANSITION = "transition_sha256"  # the per-pass hash of a stochastic stepper's record


class TrajectoryError(H3Error):
    """A sealed trajectory is missing, malformed or tampered with, or cannot be replayed as it ran."""


def check_keep(value: Any, what: str = "keep") -> tuple[str, ...]:
    """`value` -- a comma-separated string ("latents,velocities") or an iterable of names -- as a tuple of
    `KEEP_CHOICES` in their order; one-line `TrajectoryError` naming the value otherwise."""
    items = value.split(",") if isinstance(value, str) else list(value or ())
    if [k for k in items if k not in KEEP_CHOICES] or (isinstance(value, str) and not items):
        raise TrajectoryError(f"{what} {value!r}: must be {', '.join(KEEP_CHOICES)} or several of them, "
                              "comma-separated (latents: what `h3lab train --rollout` needs)")
    return tuple(k for k in KEEP_CHOICES if k in items)


def kept_kinds(trajectory: "Trajectory") -> tuple[str, ...]:
    """Which `KEEP_CHOICES` a trajectory holds for every pass (noise: any, it exists on stochastic passes only)."""
    passes = range(len(trajectory.steps))
    out = [kind for kind, key in (("latents", "video"), ("velocities", "velocity_video"))
           if all(f"{key}.{i:04d}" in trajectory.kept for i in passes)]
    if any(k.startswith("noise_") for k in trajectory.kept):
        out.append("noise")
    return tuple(out)


def check_seal_target(target: Path, what: str, label: str) -> Path:
    """Where a trajectory may be sealed: a folder name (a sealed trajectory is a folder of manifest.json and
    safetensors), not an existing file, and an existing folder only when it is empty or a sealed trajectory -- sealing
    replaces the folder whole, which must never swallow a folder of other files. `what` starts the messages,
    `label` names the folder for `io_utils.check_output_dir`."""
    from .io_utils import check_output_dir

    if target.suffix and not target.is_dir():
        raise TrajectoryError(f"{what}: a sealed trajectory is a folder (manifest.json + safetensors); give a folder "
                              f"name without the {target.suffix!r} ending")
    check_output_dir(target, label)
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise TrajectoryError(f"{what}: {str(target)!r} is a folder that is not a sealed trajectory; sealing replaces "
                              "the folder, so give a new or empty folder")
    return target


def digest_lines(steps: Sequence[dict]) -> str:
    """`Trajectory.digest`: SHA-256 over one line `i:vv:va:xv:xa[:tr]` per pass, in pass order (`tr`: the pass's
    `transition_sha256`, only on a pass that has one)."""
    h = hashlib.sha256()
    for s in steps:
        fields = [str(s["index"])] + [s[f] for f in STEP_FIELDS] + ([s[TRANSITION]] if TRANSITION in s else [])
        h.update((":".join(fields) + "\n").encode())
    return h.hexdigest()


def first_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The path of the first place two JSON values differ ("video.requests[1].logp_sum"), None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else key)
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for k, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{k}]")
            if found is not None:
                return found
        return None
    return None if a == b else (where or "value")


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


class TraceSummary:
    """Accumulates the per-forward traces of a run into the manifest's provenance summary."""

    def __init__(self) -> None:
        self.forwards = 0
        self.untraced = 0
        self.ops: dict[str, dict[str, int]] = {}
        self.kernels: set[str] = set()
        self.fallbacks = 0
        self.head: dict[str, Any] = {}
        self.collectives: dict[str, dict[str, int]] = {}  # sharded forwards (h3lab.distributed): name -> algorithm

    def add(self, trace: runtime.Trace | None) -> None:
        self.forwards += 1
        if trace is None:
            self.untraced += 1
            return
        if not self.head:
            self.head = {"mode": trace.mode, "device": trace.device, "fingerprint": trace.fingerprint,
                         "versions": trace.versions}
            if trace.placement is not None:  # topology, this rank and what it holds
                self.head["placement"] = trace.placement
        if trace.collectives is not None:
            for name, algorithms in trace.collectives.summary().items():
                slot = self.collectives.setdefault(name, {})
                for algorithm, n in algorithms.items():
                    slot[algorithm] = slot.get(algorithm, 0) + n
        for op, backends in trace.summary().items():
            slot = self.ops.setdefault(op, {})
            for backend, n in backends.items():
                slot[backend] = slot.get(backend, 0) + n
        self.kernels.update(r.kernel_id for r in trace.records)
        self.fallbacks += len(trace.fallbacks)

    def to_dict(self) -> dict[str, Any]:
        out = {**self.head, "forwards": self.forwards, "untraced_forwards": self.untraced, "ops": self.ops,
               "kernels": sorted(self.kernels), "non_strict_calls": self.fallbacks}
        if self.collectives:
            out["collectives"] = self.collectives
        return out


# ================================================================================================== recorder
class TrajectoryRecorder:
    """Fed by the loop (`begin(run)`, then one `StepRecord` per pass): hashes the four per-pass tensors (SHA-256),
    copies to the host only the ones asked for, aggregates the provenance trace, and builds the `Trajectory` in
    `finish()`. The sealed spec is the run's, with its fingerprint filled in from the model when it was empty.

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
        self.spec: RunSpec | None = None
        self.header: dict[str, Any] = {}
        self._pending: list[tuple[dict, dict[str, torch.Tensor], Any]] = []  # (entry, host copies, done event)
        self._stream = None

    def begin(self, run: ResolvedRun) -> None:
        spec, model = run.spec, run.base_model if run.base_model is not None else run.model
        fingerprint = model_fingerprint(model)
        self.spec = spec if spec.fingerprint else spec.replace(fingerprint=fingerprint)
        self.steps, self.kept, self.trace, self._pending = [], {}, TraceSummary(), []
        self.header = {
            "checkpoint": {
                "fingerprint": fingerprint,
                "model_class": type(model).__name__,
                "config": _config_of(model),
                "dtype_policy": getattr(model, "dtype_policy", ""),
            },
            "mode": spec.mode,
            "device": str(spec.inputs.video.device),
            "run": {"stepper": spec.stepper, "reuse": spec.reuse, "reuse_mode": spec.reuse_mode,
                    **({"stepper_params": thaw(spec.stepper_params)} if spec.stepper_params else {})},
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
        if rec.transition is not None:
            entry["transition"] = rec.transition
            entry[TRANSITION] = json_sha256(rec.transition)
            if "noise" in self.keep and (self.keep_steps is None or rec.index in self.keep_steps):
                for name, t in (rec.transition_tensors or {}).items():
                    self.kept[f"{name}.{rec.index:04d}"] = t.detach().cpu().clone()
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
        if self.spec is None:
            raise TrajectoryError("recorder was never started: pass it to the loop (h3lab.run.denoise) first")
        self.flush()
        spec, inputs = self.spec, self.spec.inputs
        manifest = {
            "format": FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **self.header,
            "code": {"revision": code_revision(), "h3lab": __version__, "versions": runtime.versions()},
            "hash_scheme": "sha256",
            "layout": {"sha256": inputs.layout_sha256, "task": inputs.task, "seq_len": inputs.seq_len},
            "seeds": inputs.seeds,
            "schedule": spec.schedule.to_dict(),
            "inputs": {"meta": inputs.meta(), "sha256": dict(spec.tensor_hashes)},
            "spec": spec.to_dict(),
            "spec_sha256": spec.sha256,
            "steps": self.steps,
            "trace": self.trace.to_dict(),
            "kept": {k: tensor_digest(v, "sha256") for k, v in self.kept.items()},
            "meta": self.meta,
            "digest": digest_lines(self.steps),
        }
        return Trajectory(manifest=manifest, spec=spec, kept=dict(self.kept))


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
    """A recorded run: the manifest (JSON-ready dict), the sealed `RunSpec`, and the kept tensors (host)."""

    manifest: dict[str, Any]
    spec: RunSpec
    kept: dict[str, torch.Tensor]
    path: Path | None = None

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def steps(self) -> list[dict]:
        return self.manifest["steps"]

    @property
    def inputs(self) -> DenoiseInputs:
        return self.spec.inputs

    @property
    def schedule(self) -> DualSchedule:
        return self.spec.schedule

    @property
    def mode(self) -> str:
        return self.spec.mode

    def seal(self, path: str | os.PathLike) -> Path:
        """Write the trajectory directory atomically (`io_utils.atomic_write_dir`, see the module docstring); returns
        its path."""
        target = Path(path)
        if target.exists() and not target.is_dir():
            raise TrajectoryError(f"trajectory path {str(target)!r} exists and is not a directory")

        def write(tmp: Path) -> None:
            atomic_save_safetensors(tmp / INPUTS_FILE, self.spec.tensors(), metadata={"format": FORMAT})
            if self.kept:
                atomic_save_safetensors(tmp / TENSORS_FILE, self.kept, metadata={"format": FORMAT})
            atomic_write_json(tmp / MANIFEST, self.manifest)  # last: a directory with a manifest is complete

        self.path = atomic_write_dir(target, write)
        return self.path


def record(
    spec: RunSpec,
    model: Any,
    *,
    keep: Iterable[str] = (),
    keep_steps: Iterable[int] | None = None,
    meta: dict[str, Any] | None = None,
    models: Mapping[str, Any] | Callable[[str], Any] | None = None,
    callback: Callable[[StepRecord], None] | None = None,
    cancel: Any = None,
) -> Trajectory:
    """Run `spec` on `model` with a fresh recorder; returns the in-memory trajectory (`.seal(path)` writes it)."""
    recorder = TrajectoryRecorder(keep=keep, keep_steps=keep_steps, meta=meta)
    denoise(spec, model, recorder, callback, cancel, models=models)
    return recorder.finish()


# ======================================================================================================= load
def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise TrajectoryError(f"{path}: not a readable safetensors file ({exc})") from None


_LEGACY_STEPPERS = {"ScheduleStepper": "euler", "DiffusersStepper": "diffusers"}


def _legacy_spec(manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> RunSpec:
    """The spec of a manifest written before run specs: plain, unless its stepper or ablations were not by name."""
    run = manifest.get("run", {})
    stepper = _LEGACY_STEPPERS.get(run.get("stepper", "ScheduleStepper"))
    ablations = (manifest.get("meta", {}).get("settings") or {}).get("ablations") or []
    custom = None
    if stepper is None or ablations:
        custom = Custom.described({"legacy": True, "stepper": run.get("stepper"), "ablations": list(ablations)})
    inputs = DenoiseInputs.from_tensors(tensors, manifest["inputs"]["meta"])
    return RunSpec(
        inputs=inputs, schedule=schedule_from_dict(manifest["schedule"]), mode=manifest["mode"],
        variant="transformer_ref" if inputs.task == "ref2va" else "transformer",  # the snapshot's partitions
        fingerprint=manifest.get("checkpoint", {}).get("fingerprint", ""), stepper=stepper or "euler",
        reuse=int(run.get("reuse", 1)), reuse_mode=run.get("reuse_mode", "linear"), custom=custom,
    )


def load(path: str | os.PathLike) -> Trajectory:
    """Read a sealed trajectory and check it: format, every sealed tensor and kept tensor against its recorded
    SHA-256, the run spec against its `spec_sha256`, and the digest against the per-pass hashes. Any mismatch
    raises `TrajectoryError` naming it."""
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
    for step in manifest["steps"]:
        if ("transition" in step) != (TRANSITION in step) or (
                "transition" in step and json_sha256(step["transition"]) != step[TRANSITION]):
            raise TrajectoryError(f"{manifest_path}: pass {step.get('index')}'s transition record does not match its "
                                  f"{TRANSITION}: the manifest was edited")
    tensors = _read_safetensors(root / INPUTS_FILE)
    problem = digest_mismatch(tensors, manifest["inputs"]["sha256"])
    if problem is not None:
        raise TrajectoryError(f"{root / INPUTS_FILE}: sealed input {problem} (manifest)")
    kept: dict[str, torch.Tensor] = {}
    if manifest["kept"]:
        kept = _read_safetensors(root / TENSORS_FILE)
        problem = digest_mismatch(kept, manifest["kept"])
        if problem is not None:
            raise TrajectoryError(f"{root / TENSORS_FILE}: kept {problem} (manifest)")
    try:
        if "spec" not in manifest:
            spec = _legacy_spec(manifest, tensors)
        else:
            spec = RunSpec.from_dict(manifest["spec"], tensors)
            if spec.sha256 != manifest.get("spec_sha256"):
                raise TrajectoryError(f"{manifest_path}: run spec hashes to {spec.sha256[:16]}, the manifest records "
                                      f"{str(manifest.get('spec_sha256'))[:16]}: the spec was edited")
    except TrajectoryError:
        raise
    except H3Error as exc:  # RunSpecError, and the schedule's and layout's own errors
        raise TrajectoryError(f"{manifest_path}: {exc}") from None
    if spec.mode != manifest["mode"]:
        raise TrajectoryError(f"{manifest_path}: mode {manifest['mode']!r} disagrees with its run spec's "
                              f"{spec.mode!r}: the manifest was edited")
    return Trajectory(manifest=manifest, spec=spec, kept=kept, path=root)


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
            note = f" ({self.note})" if self.note else ""
            return f"OK: {self.passes_checked}/{self.num_passes} passes byte-equal (digest {self.digest[:16]}){note}"
        note = "" if self.fingerprint_match else " (checkpoint fingerprint differs from the recorded one)"
        note += f" ({self.note})" if self.note else ""
        return (f"DRIFT at pass {self.first_step}: {self.field} hash {str(self.got)[:16]} != recorded "
                f"{str(self.expected)[:16]}{note}")


def verify(
    path: str | os.PathLike | Trajectory,
    model: Any,
    *,
    mode: str | None = None,
    device: torch.device | str | None = None,
    stop_at_first: bool = True,
    models: Mapping[str, Any] | Callable[[str], Any] | None = None,
) -> VerifyReport:
    """Replay a sealed trajectory's run spec exactly (in another runtime mode only if `mode` is given; on `device`
    if given) and compare every pass's four hashes; the report names the first differing pass and tensor, or says
    OK. `models`: the other variants, for a spec whose factors swap the transformer (H16). A spec with custom
    callables raises `TrajectoryError` instead of replaying something else."""
    traj = path if isinstance(path, Trajectory) else load(path)
    spec = traj.spec
    if not spec.sealable:
        raise TrajectoryError(
            f"trajectory {traj.digest[:16]} was recorded with custom callables {spec.custom.describe()}: its "
            "manifest names them but cannot re-create them, so it cannot be verified as it ran (attach the same "
            "callables and compare with h3lab.drift instead)"
        )
    note = ""
    if mode is not None and mode != spec.mode:
        note = f"replayed in mode {mode}, recorded in {spec.mode}"
        spec = spec.replace(mode=mode)
    if device is not None:
        spec = spec.to(device)
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
                for name in STEP_FIELDS + (TRANSITION,):
                    if want is None or got.get(name) != want.get(name):
                        first.update(step=rec.index, field=name, expected=None if want is None else want.get(name),
                                     got=got.get(name))
                        if name == TRANSITION:  # say which entry: a log-density, a mean, a std, a sigma
                            where = first_difference(got.get("transition"), (want or {}).get("transition"))
                            first["field"] = f"transition {where}"
                        break
                if first and stop_at_first:
                    raise _Stop

    try:
        denoise(spec, model, _Checker(), models=models)
    except _Stop:
        pass
    recorded_fp = traj.manifest.get("checkpoint", {}).get("fingerprint", "")
    fp_match = (not recorded_fp) or recorded_fp == model_fingerprint(model)
    common = dict(digest=traj.digest, fingerprint_match=fp_match, mode=spec.mode, note=note)
    if first:
        return VerifyReport(ok=False, passes_checked=len(replay), num_passes=len(expected), first_step=first["step"],
                            field=first["field"], expected=first["expected"] or "", got=first["got"] or "", **common)
    if len(replay) != len(expected):
        return VerifyReport(ok=False, passes_checked=len(replay), num_passes=len(expected), first_step=len(replay),
                            field="num_passes", expected=str(len(expected)), got=str(len(replay)), **common)
    return VerifyReport(ok=True, passes_checked=len(replay), num_passes=len(expected),
                        replay_digest=digest_lines(replay), **common)
