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
                    reuse), the run spec (`spec`: `RunSpec.to_dict()`), its result hash (`result_sha256`:
                    `RunSpec.sha256`) and its run record (`run_record`: `RunSpec.run_record()` -- placement, residency,
                    adapter names and paths -- and `machine`: device, CPU capability, GPU name), per pass the SHA-256
                    of the video and audio velocities and latents, the provenance trace summary, the kept tensors,
                    `digest`;
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
sealed tensors and kept tensors against the manifest (`artifact.SealedArtifact`) and each kept latent / velocity
against its pass's sealed hash (the `kept` digests are outside `digest`, the per-pass hashes are not), rebuilds the `RunSpec` and checks
its result hash against `result_sha256` and its run-record fields against `run_record` -- a manifest sealed before
the split holds one `spec_sha256` over the whole description instead, checked as it was
(`RunSpec.description_sha256`) -- checks every `transition` against its `transition_sha256`, and recomputes the
digest (a tampered file raises `TrajectoryError`). `verify(path, model, execution=None)` replays the sealed spec
(mode, factors, stepper and its parameters, reuse, preset, adapters; placement and residency as sealed, or as the
verifier's `execution` says: another run record, the same result hash) and reports the first pass (and tensor, or
transition entry: the recomputed log-densities, means, stds, sigmas) that differs, or OK, with the result hash and
the recorded and replayed run records (`record_differences` names the fields that differ). A spec with custom callables cannot be replayed
from its description: `verify` refuses it. A manifest written before run specs existed (no `spec`) is read as a
plain spec of its mode, stepper and reuse; one that recorded ablation factors is refused (its factors were not sealed
by name).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..execution import runtime
from ..execution.arithmetic import arithmetic_class
from .artifact import MANIFEST, SealedArtifact, code_provenance
from ..errors import H3Error
from ..hashing import json_sha256, model_fingerprint, tensor_digest
from . import Custom, DenoiseInputs, ResolvedRun, RunSpec, StepRecord, denoise
from .fields import thaw
from .spec import schedule_from_dict
from .sampler import DualSchedule

FORMAT = "h3lab-trajectory/1"
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
    from ..io_utils import check_output_dir

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
            "code": code_provenance(),
            "hash_scheme": "sha256",
            "layout": {"sha256": inputs.layout_sha256, "task": inputs.task, "seq_len": inputs.seq_len},
            "seeds": inputs.seeds,
            "schedule": spec.schedule.to_dict(),
            "inputs": {"meta": inputs.meta(), "sha256": dict(spec.tensor_hashes)},
            "spec": spec.to_dict(),
            "result_sha256": spec.sha256,
            "run_record": {**spec.run_record(), "machine": machine_record(inputs.video.device)},
            "steps": self.steps,
            "trace": self.trace.to_dict(),
            "kept": {k: tensor_digest(v, "sha256") for k, v in self.kept.items()},
            "meta": self.meta,
            "digest": digest_lines(self.steps),
        }
        return Trajectory(manifest=manifest, spec=spec, kept=dict(self.kept))


def machine_record(device: torch.device | str) -> dict[str, Any]:
    """Where a run ran, for its run record: the device, torch's CPU capability, the arithmetic class
    (`h3lab.execution.arithmetic`: which machines give the same non-strict bytes), and the GPU's name on CUDA."""
    device = torch.device(device)
    out: dict[str, Any] = {"device": str(device), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "arithmetic_class": arithmetic_class(device.type)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def _config_of(model: Any) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "to_diffusers"):
        return cfg.to_diffusers()
    if isinstance(cfg, dict):  # Diffusers' FrozenDict
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items() if not k.startswith("_")}
    return {}


# ================================================================================================ trajectory
@dataclass
class Trajectory(SealedArtifact):
    """A recorded run: the manifest (JSON-ready dict), the sealed `RunSpec`, and the kept tensors (host). Sealed,
    read and checked through `artifact.SealedArtifact` (`seal(path)` writes the directory atomically)."""

    FORMAT = FORMAT
    WHAT = "a sealed trajectory"
    ERROR = TrajectoryError

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

    def tensor_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """What `seal` writes (`artifact.SealedArtifact`): the spec's sealed tensors and the kept ones (if any)."""
        return {INPUTS_FILE: self.spec.tensors(), TENSORS_FILE: self.kept}


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


def _check_identity(manifest_path: Path, manifest: dict[str, Any], spec: RunSpec) -> None:
    """The sealed spec against the identity its manifest records. Current form: the result hash (`result_sha256`)
    and the run record's spec fields (placement, residency, adapter names and paths). The v1 form (no result
    hash / run record split) holds one `spec_sha256` over the whole description: checked as it was
    (`RunSpec.description_sha256`), its result hash derived from the spec."""
    if "result_sha256" in manifest:
        if spec.sha256 != manifest["result_sha256"]:
            raise TrajectoryError(f"{manifest_path}: run spec's result hash is {spec.sha256[:16]}, the manifest "
                                  f"records {str(manifest['result_sha256'])[:16]}: the spec was edited")
        record = manifest.get("run_record")
        ours = spec.run_record()
        if not isinstance(record, dict) or any(record.get(k) != v for k, v in ours.items()):
            raise TrajectoryError(f"{manifest_path}: run record {json.dumps(record, sort_keys=True)[:120]} disagrees "
                                  "with its run spec's placement, residency or adapter paths: the manifest was edited")
        return
    if spec.description_sha256 != manifest.get("spec_sha256"):
        raise TrajectoryError(f"{manifest_path}: run spec hashes to {spec.description_sha256[:16]}, the manifest "
                              f"records {str(manifest.get('spec_sha256'))[:16]}: the spec was edited")


def _check_kept_against_steps(where: Path, manifest: dict[str, Any]) -> None:
    """A kept latent or velocity (`video.0003`, `velocity_audio.0001`, ...) must be the tensor its pass's sealed hash
    names: the `kept` digests are not under `digest`, the per-pass hashes are (noise draws have no per-pass hash)."""
    steps = {s.get("index"): s for s in manifest["steps"]}
    for name, digest in manifest["kept"].items():
        field, _, index = name.rpartition(".")
        if field in STEP_FIELDS and index.isdigit():
            sealed = steps.get(int(index), {}).get(field)
            if sealed != digest:
                raise TrajectoryError(f"{where}: kept tensor {name!r} is not the pass-{int(index)} {field} its sealed "
                                      "step hash names: the tensors file and its manifest entry were edited")


def run_record_of(traj: "Trajectory") -> dict[str, Any]:
    """The run record of a trajectory: the manifest's (current form), or the spec's fields and the manifest's device
    (a manifest sealed before the result hash / run record split)."""
    record = traj.manifest.get("run_record")
    if isinstance(record, dict):
        return record
    return {**traj.spec.run_record(), "machine": {"device": traj.manifest.get("device", "")}}


def load(path: str | os.PathLike) -> Trajectory:
    """Read a sealed trajectory and check it: format, every sealed tensor and kept tensor against its recorded
    SHA-256, the run spec against its `result_sha256` and `run_record` (or, sealed before the split, its
    `spec_sha256`: `_check_identity`), and the digest against the per-pass hashes. Any mismatch raises
    `TrajectoryError` naming it."""
    root = Path(path)
    manifest_path = root / MANIFEST
    manifest = Trajectory.read_manifest(root, ("steps", "inputs", "schedule", "digest", "mode", "kept"))
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
    tensors = Trajectory.read_tensors(root / INPUTS_FILE, manifest["inputs"]["sha256"], "sealed input ")
    kept = Trajectory.read_tensors(root / TENSORS_FILE, manifest["kept"], "kept ") if manifest["kept"] else {}
    _check_kept_against_steps(root / TENSORS_FILE, manifest)
    try:
        if "spec" not in manifest:
            spec = _legacy_spec(manifest, tensors)
        else:
            spec = RunSpec.from_dict(manifest["spec"], tensors)
            _check_identity(manifest_path, manifest, spec)
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
    result_sha256: str = ""  # the sealed spec's result hash (what must come out the same)
    run_record: dict[str, Any] = dataclasses.field(default_factory=dict)  # where and how it was recorded
    replay_record: dict[str, Any] = dataclasses.field(default_factory=dict)  # where and how it was replayed
    record_differences: list[str] = dataclasses.field(default_factory=list)  # "residency", "machine.device", ...

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def record_note(self) -> str:
        """" (recorded ... , replayed ...)" for each run-record field that differs; "" when none does."""
        if not self.record_differences:
            return ""
        parts = [f"{k} {_short(k, _lookup(self.run_record, k))} -> {_short(k, _lookup(self.replay_record, k))}"
                 for k in self.record_differences]
        return f" (same result hash {self.result_sha256[:16]}, another run record: {'; '.join(parts)})"

    def __str__(self) -> str:
        if self.ok:
            note = f" ({self.note})" if self.note else ""
            return (f"OK: {self.passes_checked}/{self.num_passes} passes byte-equal (digest {self.digest[:16]}){note}"
                    f"{self.record_note()}")
        note = "" if self.fingerprint_match else " (checkpoint fingerprint differs from the recorded one)"
        note += f" ({self.note})" if self.note else ""
        note += self.record_note() + self.class_note()
        return (f"DRIFT at pass {self.first_step}: {self.field} hash {str(self.got)[:16]} != recorded "
                f"{str(self.expected)[:16]}{note}")

    def class_note(self) -> str:
        """Why a drift of a non-strict run may be the machine's, not the run's: off/auto bytes hold within one
        arithmetic class (`h3lab.execution.arithmetic`); "" for strict, or when both records name the same class."""
        if self.mode == "strict":
            return ""
        sealed = _lookup(self.run_record, "machine.arithmetic_class")
        here = _lookup(self.replay_record, "machine.arithmetic_class")
        if sealed == here:
            return ""
        where = f"sealed on arithmetic class {sealed}" if sealed else "sealed without naming its arithmetic class"
        return (f"; mode {self.mode} bytes hold only within one arithmetic class and this run was {where}, replayed "
                f"on {here} -- replay it on a machine of its class, or seal runs in strict to compare anywhere")


def _lookup(record: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        record = record.get(part) if isinstance(record, Mapping) else None
    return record


_DEFAULT_WORDS = {"placement": "one process", "residency": "resident", "adapters": "none"}


def _short(key: str, value: Any) -> str:
    if value in ({}, [], None, ""):
        return _DEFAULT_WORDS.get(key, "unknown")
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def record_differences(recorded: Mapping[str, Any], replayed: Mapping[str, Any]) -> list[str]:
    """The run-record fields two records disagree on (the spec's fields, then the machine's device and arithmetic
    class; a record that does not name one differs in nothing there)."""
    out = [k for k in ("placement", "residency", "adapters") if recorded.get(k) != replayed.get(k)]
    for key in ("machine.device", "machine.arithmetic_class"):
        if _lookup(recorded, key) not in (None, _lookup(replayed, key)):
            out.append(key)
    return out


def _replay_spec(spec: RunSpec, execution: Mapping[str, Any] | None) -> RunSpec:
    """The sealed spec in the verifier's run record (`execution`: placement, residency, adapters, e.g. an
    `ExecutionPlan.spec_fields()`), the result hash unchanged. Adapters are taken only when they are the sealed
    ones by content (another adapter is another result: the sealed entry stays)."""
    if not execution:
        return spec
    fields = {k: v for k, v in execution.items() if k != "adapters"}
    moved = spec.with_record(**fields)
    adapters = execution.get("adapters")
    if adapters is not None:
        try:
            moved = moved.with_record(adapters=list(adapters))
        except H3Error:  # not the sealed adapter: replay the sealed entry
            pass
    return moved


def _verify_spec(traj: Trajectory, mode: str | None, device: Any, execution: Mapping[str, Any] | None):
    """The spec `verify` replays (in `execution`'s run record, `mode`, on `device`) and the note saying so."""
    spec = traj.spec
    if not spec.sealable:
        raise TrajectoryError(
            f"trajectory {traj.digest[:16]} was recorded with custom callables {spec.custom.describe()}: its "
            "manifest names them but cannot re-create them, so it cannot be verified as it ran (attach the same "
            "callables and compare with h3lab.research.drift instead)"
        )
    try:
        spec = _replay_spec(spec, execution)
    except H3Error as exc:
        raise TrajectoryError(f"verify execution={dict(execution or {})!r}: {exc}") from None
    note = ""
    if mode is not None and mode != spec.mode:
        note = f"replayed in mode {mode}, recorded in {spec.mode}"
        spec = spec.replace(mode=mode)
    if device is not None:
        spec = spec.to(device)
    return spec, note


def verify(
    path: str | os.PathLike | Trajectory,
    model: Any,
    *,
    mode: str | None = None,
    device: torch.device | str | None = None,
    stop_at_first: bool = True,
    models: Mapping[str, Any] | Callable[[str], Any] | None = None,
    execution: Mapping[str, Any] | None = None,
) -> VerifyReport:
    """Replay a sealed trajectory's run spec exactly (in another runtime mode only if `mode` is given; on `device`
    if given) and compare every pass's four hashes; the report names the first differing pass and tensor, or says
    OK. `models`: the other variants, for a spec whose factors swap the transformer (H16). `execution`: the
    verifier's run record (placement, residency, adapters at their paths now -- a session's execution plan): the
    replay runs there, its result hash the sealed one; the report holds the recorded and the replayed run records
    and names the fields that differ. A spec with custom callables raises `TrajectoryError` instead of replaying
    something else."""
    traj = path if isinstance(path, Trajectory) else load(path)
    spec, note = _verify_spec(traj, mode, device, execution)
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
    recorded = run_record_of(traj)
    replayed = {**spec.run_record(), "machine": machine_record(spec.inputs.video.device)}
    common = dict(digest=traj.digest, fingerprint_match=fp_match, mode=spec.mode, note=note,
                  result_sha256=traj.spec.sha256, run_record=recorded, replay_record=replayed,
                  record_differences=record_differences(recorded, replayed))
    if first:
        return VerifyReport(ok=False, passes_checked=len(replay), num_passes=len(expected), first_step=first["step"],
                            field=first["field"], expected=first["expected"] or "", got=first["got"] or "", **common)
    if len(replay) != len(expected):
        return VerifyReport(ok=False, passes_checked=len(replay), num_passes=len(expected), first_step=len(replay),
                            field="num_passes", expected=str(len(expected)), got=str(len(replay)), **common)
    return VerifyReport(ok=True, passes_checked=len(replay), num_passes=len(expected),
                        replay_digest=digest_lines(replay), **common)
