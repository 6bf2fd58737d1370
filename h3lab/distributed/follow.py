"""Lead / follow: rank 0 runs a front end (one-shot, REPL, replay) as one process would; the other ranks run the
same sharded forwards. Used by `torchrun ... -m h3lab --tp T --cp C` (`frontend.py`).

Every rank holds the same parallelized models (each rank's session loads and parallelizes them alike); only rank 0
encodes, decodes, writes and prints. Rank 0 (`lead(channel)`) announces over a gloo control group whose timeout is
long (an idle REPL waits for its user; the mesh's own groups only carry forwards):

  ("resolve", key, spec)            a run with a placement starts (`RunSpec.placement`'s provider): the followers
                                    resolve the same spec on their model `key` (mode, the factors' overrides and
                                    hooks, the placement check) -- the inputs are rank 0's, broadcast
  ("forward", key, mode, args, hooked, i)   before every sharded forward on rank 0: its arguments (host copies), its
                                    mode, the points rank 0 has hooks at (followers observe the same points, so the
                                    hook view's gathers match) and the pass `i` of the run it belongs to (None outside
                                    a run's forward)
  ("end",)                          that run ended (also on error)
  ("stop",)                         the front end is done: `follow` returns

Per-pass transforms: a run's transforms may wrap its forward (`ResolvedRun.forward`) and decide per pass what the
model does -- core reuse skips the block stack on its reuse passes, token reduction picks the pass's restore block
(`h3lab.presets`). The placement provider wraps the finished run's forward with `passing`, so rank 0 announces each
forward's pass; a follower resolves the spec with an innermost forward that calls its model with the announced
arguments (`resolve(..., forward=...)`) and runs pass i's forward through its own run's wrappers, so every rank's
transforms take the same per-pass decisions (the placement's agreement still checks the inputs).

A run whose spec carries custom callables cannot be announced (callables do not travel) and is refused on rank 0.
A follower that fails a message (any exception: an agreement refusal, a strict kernel that cannot run) keeps
following and `follow` returns its first failure (wall time, one line); the front end (`frontend.run_on_mesh`)
exchanges every rank's first failure after "stop", so every rank reports the earliest one alike.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..execution import context, runtime
from ..errors import user_message
from .errors import DistributedError
from .mesh import Mesh
from .placement import Placement, add_announcer

CONTROL_TIMEOUT = timedelta(days=7)
_channel: list["Channel"] = []  # the lead channel while `lead` runs on rank 0


class Channel:
    """Rank 0 -> every rank, objects through `broadcast_object_list` on a dedicated gloo group (created
    collectively: every rank must build its Channel at the same point)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.group = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def send(self, message: tuple) -> None:
        if self.group is not None:
            dist.broadcast_object_list([message], src=0, group=self.group)

    def recv(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def leading() -> "Channel | None":
    return _channel[-1] if _channel else None


@contextlib.contextmanager
def lead(channel: Channel) -> Iterator[Channel]:
    """Rank 0: announce every sharded forward (and every placed run) to the followers; "stop" them at the end."""
    if channel.mesh.rank != 0:
        raise DistributedError(f"lead: rank {channel.mesh.rank} is a follower; rank 0 leads")
    remove = add_announcer(_announce_forward)
    _channel.append(channel)
    try:
        yield channel
    finally:
        _channel.pop()
        remove()
        channel.send(("stop",))


def _host(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _announce_forward(placement: Placement, arguments: dict) -> None:
    channel = leading()
    if channel is None:
        return
    args = {k: _host(v) for k, v in arguments.items() if k != "self"}
    hooked = sorted(placement.model.hooked_points())
    channel.send(("forward", placement.name, runtime.current_mode(), args, hooked, context.current().follow_pass))


def passing(inner: Callable) -> Callable:
    """A run's forward that marks its pass for the announcement (module docstring, "Per-pass transforms")."""
    def forward(m, inputs, video, audio, i):
        with context.use(follow_pass=i):  # a field of the one execution context
            return inner(m, inputs, video, audio, i)

    return forward


@contextlib.contextmanager
def announce_run(run: Any, placement: Placement) -> Iterator[None]:
    """The placement provider's part in lead mode: announce the run's spec ("resolve") and its end."""
    channel = leading()
    if channel is None:
        yield
        return
    spec = run.spec
    if not spec.sealable:
        raise DistributedError(
            f"a run with custom callables ({spec.custom.describe()}) cannot be announced to the other ranks of "
            f"{placement.topology.name}: use ablation factors (by name) or run the research code on every rank"
        )
    payload = {"spec": spec.to_dict(), "tensors": {k: _host(v) for k, v in spec.tensors().items()}}
    channel.send(("resolve", placement.name, payload))
    try:
        yield
    finally:
        channel.send(("end",))


def _observer(point, tensor) -> None:
    return None


def follow(channel: Channel, models: Callable[[str], Any]) -> tuple[float, str] | None:
    """A follower's loop (ranks > 0) until rank 0 says "stop". `models(key)`: this rank's parallelized model for
    a placement name ("transformer", "transformer_ref"). Returns this rank's first failure (time.time(), one line),
    or None."""
    from ..run import RunSpec, resolve

    device = channel.mesh.device
    runs: list[tuple[contextlib.ExitStack, Any, dict] | None] = []
    failure: tuple[float, str] | None = None
    while True:
        message = channel.recv()
        op = message[0]
        if op == "stop":
            for entry in reversed(runs):
                if entry is not None:
                    entry[0].close()
            return failure
        try:
            if op == "resolve":
                _, key, payload = message
                runs.append(None)
                spec = RunSpec.from_dict(payload["spec"], payload["tensors"]).to(device)
                stack, box = contextlib.ExitStack(), {}
                run = stack.enter_context(resolve(spec, models(key), models=models, forward=_announced(box)))
                runs[-1] = (stack, run, box)
            elif op == "end":
                entry = runs.pop() if runs else None
                if entry is not None:
                    entry[0].close()
            elif op == "forward":
                _, key, mode, args, hooked, i = message
                _forward(models(key), mode, args, hooked, device, runs[-1] if runs else None, i, in_run=bool(runs))
            else:
                raise DistributedError(f"follow: unknown message {op!r} from rank 0")
        except Exception as exc:  # noqa: BLE001 - keep following; the front end reports the earliest failure
            if failure is None:
                failure = (time.time(), user_message(exc))
            if os.environ.get("H3LAB_DEBUG"):
                print(f"h3lab rank {channel.mesh.rank}: {exc}", file=sys.stderr)


def _announced(box: dict) -> Callable:
    """A follower run's innermost forward: the model on the arguments rank 0 announced for this forward."""
    def forward(m, inputs, video, audio, i):  # noqa: ARG001 - the run's forward signature
        out = m(**box["args"])
        return (out[0], out[1]) if isinstance(out, tuple) else (out.sample, out.audio_sample)

    return forward


def _forward(model: Any, mode: str, args: dict, hooked: list[str], device, entry, i: int | None,
             in_run: bool) -> None:
    """One announced forward; pass `i` of the open run `entry` goes through that run's forward (its per-pass
    transforms), any other forward straight to the model."""
    from ..run.loop import set_hook_step

    missing = sorted(set(hooked) - model.hooked_points())
    handle = model.add_hook(_observer, names=missing) if missing else None
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    try:
        with contextlib.ExitStack() as stack:
            if not in_run:
                stack.enter_context(runtime.use_mode(mode))
            stack.enter_context(torch.no_grad())
            if entry is not None and i is not None and entry[1].model is model:
                _, run, box = entry
                box["args"] = args
                set_hook_step(model, i)
                run.forward(model, run.inputs, args.get("hidden_states"), args.get("audio_hidden_states"), i)
            else:
                model(**args)
    finally:
        if handle is not None:
            handle.remove()
