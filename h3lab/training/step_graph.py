"""CUDA graphs of the strict training micro-batch: one request's forward, loss, backward and flat gradient,
captured once per signature and replayed for the steps after.

Why: a strict LoRA step at 512x512x22f is ~15,000 kernel launches through Python (Triton's and ATen's), and the
host, not the GPU, set its time: the GPU sat idle ~0.9 s of a ~1.9 s step (lora_runtime_profile.json, H200). A
replayed graph launches the same kernels on the same buffers without the host.

Contract
--------
`StepGraphs().run(model, sample, objective, params, body)` returns `body(sample)`'s
`(loss, gradient, v_video, v_audio)`: `body` is `step.request_gradient`'s micro-batch on a canonical sample in the
train context (forward in the runtime mode, the flow-matching loss, `loss.backward()`, the flat float32 gradient of
`params`, every `.grad` cleared again).
- Eligible calls: graphs enabled (`use_graphs`, default on), runtime mode `strict`, every tensor of the sample and
  every trainable parameter on CUDA, at most `MAX_ROWS` packed rows, the default loss and no input gradients (the
  caller's rule: `request_gradient` passes other calls straight to the eager body), and what every graph of a model
  needs (`graphs.shared_refusal`: no hook, op override, placement, nested capture or inference mode; no torch
  forward hook on any module). Every other call is `body(sample)` itself with the reason in `last_path()`.
- Signature: the digest of the execution context (`h3lab.execution.context`: the runtime mode and every other field) bound to
  the call (`graphs.bound_context`, front "step"), and nothing else. Bound, it holds the model (weakly held here) and
  its modules' identities, every adapter layer's Python state (`module_tree.adapter_state`), the strict kernels' tile
  tables (`runtime.kernel_settings`), fingerprint, train mode and checkpointing flag; the trainable parameters'
  names, identities, data pointers, dtypes and shapes -- not their `_version`: the optimiser updates them in place
  between steps, and the graph reads them by address, which is the
  point; every other parameter and buffer's identity, data pointer, dtype and `_version` (a frozen weight written in
  place is a new signature, as in `h3lab.execution.graphs`); the objective's weights, the request's weight and
  conditioning-row counts (they are constants of the loss); each sample tensor's name, shape, dtype, strides and
  device; and the bytes of every integer sample tensor (the layout: the strict kernels' validated index maps and the
  AdaLN row index are built from it before capture and baked into the graph), read to the host in one copy a call.
  Floating-point sample tensors (inputs, timesteps, targets) are data: copied into the graph's buffers.
- A signature's first call clones the sample into static buffers and runs the eager body on them (the warm-up:
  Triton compilation, every index-cache entry of the static layout); its result is the call's result. The second
  call captures the body on those buffers into a `torch.cuda.CUDAGraph` (private pool) inside
  `runtime.frozen_index_caches()` and `checkpoint_rng_state(False)` (torch refuses to read the CUDA RNG state during
  a capture; the model draws no random numbers), keeps every index-cache entry live at the capture's end (the
  backward's lookups run on autograd's thread, outside the frozen context), then replays; later calls copy their
  floating-point tensors in and replay. Outputs are cloned out of the graph's buffers. A capture that fails (a host
  sync, an index-cache miss) leaves the signature eager for good and says why in `last_path()`.
- The bytes: a replay runs the kernels the eager body launched, in the same order, on buffers of the same shapes and
  strides, reading the parameters by address, so the gradient, loss and velocities equal the eager step's byte for
  byte; benchmarks/benchmark_lora.py --step-graph checks that on the H200 (step by step against the eager strict
  step, over optimiser updates). The trace of a replay is the captured forward's, with
  `graph = {"cuda_graph": "replay", "replays": n, "scope": "training micro-batch"}`.
- Memory: a captured graph keeps its pool (the micro-batch's activations and gradients) and its static buffers;
  at most `max_graphs` graphs are held; past it the least recently used one is dropped and its signature runs eager
  from then on (more layouts cycle through the steps than graphs are held: capturing again every cycle would cost
  more than it saves), said in `last_path()`. At most 2 * `max_graphs` signatures wait for a second call and as many
  eager ones are remembered (the oldest forgotten); `clear()` drops them all. One call at a time (a lock around
  copy, replay and clone).
`backend` is the capture seam (`graphs.CudaBackend` on the GPU; the CPU tests replay by re-running the body,
and pass `device_ok` to stand in for the CUDA rule).
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch

from ..execution import context, graphs, module_tree, runtime
from ..model.transformer import checkpoint_rng_state

MAX_ROWS = 16384  # as strict forwards (`graphs.STRICT_MAX_ROWS`): past it a step is GPU-bound and the pool is large
MAX_GRAPHS = 2
SCOPE = "training micro-batch"
# The switch is the "step" front of the execution context's graph policy (`h3lab.execution.context`); the path is a record.
_last_path: contextvars.ContextVar[dict] = contextvars.ContextVar("h3lab_step_graph_path", default={})


def use_graphs(enabled: bool):
    """Enable (default) or disable CUDA graphs of the enclosed strict training micro-batches."""
    return context.use_graphs("step", enabled, "step_graph.use_graphs")


def last_path() -> dict:
    """How the last micro-batch in this context ran: {"cuda_graph": "eager" | "captured" | "replay", ...}."""
    return dict(_last_path.get())


def set_eager(reason: str) -> None:
    """Record that the caller ran its micro-batch eagerly, and why (a call this module never saw)."""
    _last_path.set({"cuda_graph": "eager", "reason": reason, "scope": SCOPE})


@dataclasses.dataclass
class _Entry:
    model: Any  # weakref to the model
    static: Any = None  # the TrainingSample on the graph's buffers
    graph: Any = None
    outputs: tuple = ()
    trace: Any = None
    pins: list = dataclasses.field(default_factory=list)
    replays: int = 0
    failed: str = ""


class StepGraphs:
    """Signature -> captured micro-batch (see the module contract)."""

    def __init__(self, backend: Any = None, max_graphs: int = MAX_GRAPHS,
                 device_ok: Callable[[], bool] | None = None):
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs!r}: must be a positive integer")
        self.backend = backend or graphs.CudaBackend()
        self.max_graphs = max_graphs
        self._device_ok = device_ok  # tests: stand-in for "every tensor on CUDA"
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)

    def clear(self) -> None:
        """Drop every graph (and its memory pool) and every waiting signature."""
        with self._lock:
            self._entries.clear()

    def run(self, model: torch.nn.Module, sample, objective, params: Sequence[tuple[str, torch.nn.Parameter]],
            body: Callable[[Any], tuple]) -> tuple:
        reason = self._ineligible(model, sample, params)
        tree = None if reason else module_tree.walk(model)
        if tree is not None and tree.hooked:
            reason = "a torch forward hook is registered"
        if reason:
            return _eager(body, sample, reason)
        key = signature(model, sample, objective, params, tree)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.model() is not model:
                return self._first(model, sample, body, key)
            self._entries.move_to_end(key)
            if entry.failed:
                return _eager(body, sample, entry.failed)
            _copy_data(entry.static, sample)
            if entry.graph is None:
                try:
                    with runtime.frozen_index_caches() as pins, checkpoint_rng_state(False):
                        entry.graph, entry.outputs = self.backend.capture(lambda: body(entry.static))
                except Exception as exc:  # noqa: BLE001 - a capture that fails leaves the eager body, said why
                    first = str(exc).splitlines()[0] if str(exc) else ""
                    entry.failed = f"capture failed: {type(exc).__name__}: {first}"
                    entry.static = None
                    return _eager(body, sample, entry.failed)
                entry.pins = pins + runtime.live_index_entries()
                entry.trace = runtime.last_trace()
                state = "captured"
                self._evict()
            else:
                state = "replay"
            entry.graph.replay()
            entry.replays += 1
            path = {"cuda_graph": state, "replays": entry.replays, "scope": SCOPE}
            _last_path.set(path)
            if entry.trace is not None:
                runtime.set_last_trace(dataclasses.replace(entry.trace, graph=path))
            return tuple(o.clone() for o in entry.outputs)

    def _first(self, model, sample, body, key) -> tuple:
        """A new signature: static copies of the sample's tensors, the eager body on them (the warm-up)."""
        tensors = sample.tensors()
        static = {n: t.clone() for n, t in tensors.items()}
        for name, t in tensors.items():
            if static[name].stride() != t.stride():
                return _eager(body, sample, f"sample tensor {name} of shape {list(t.shape)} has strides {t.stride()} "
                                            "that are not dense (a static copy would change them)")
        static_sample = dataclasses.replace(sample, **static)
        with checkpoint_rng_state(False):
            out = _eager(body, static_sample, "first call of this signature (the warm-up before capture)")
        self._entries[key] = _Entry(model=weakref.ref(model), static=static_sample)
        self._evict()
        return out

    def _ineligible(self, model, sample, params) -> str:
        if not context.current().graphs_on("step"):
            return "graphs disabled (step_graph.use_graphs(False))"
        mode = runtime.current_mode()
        if mode != "strict":
            return f"runtime mode {mode!r} (step graphs serve strict micro-batches)"
        if self._device_ok is not None:
            on_device = self._device_ok()
        else:
            on_device = all(t.is_cuda for t in sample.tensors().values()) and all(p.is_cuda for _, p in params)
        if not on_device:
            return "inputs not on a CUDA device"
        rows = sample.position_ids.shape[0]
        if rows > MAX_ROWS:
            return f"{rows} packed rows > step_graph.MAX_ROWS = {MAX_ROWS} (eager: graphs pay only at short layouts)"
        return graphs.shared_refusal(model, self.backend)

    def _evict(self) -> None:
        captured = [k for k, e in self._entries.items() if e.graph is not None]
        for key in captured[: max(0, len(captured) - self.max_graphs)]:
            # Its graph and buffers go; the signature stays, eager from now on: more layouts cycle through the
            # steps than graphs are held, and capturing again each cycle would cost more than it saves.
            self._entries[key] = _Entry(model=self._entries[key].model, failed=(
                f"its graph was dropped for another signature's (more layouts cycle than step_graph max_graphs = "
                f"{self.max_graphs}; eager from then on)"))
        for remembered in (lambda e: e.graph is None and not e.failed, lambda e: bool(e.failed)):  # waiting, eager
            keys = [k for k, e in self._entries.items() if remembered(e)]
            for key in keys[: max(0, len(keys) - 2 * self.max_graphs)]:
                del self._entries[key]


def _eager(body, sample, reason: str) -> tuple:
    out = body(sample)
    set_eager(reason)
    return out


def _copy_data(static, sample) -> None:
    """The floating-point tensors into the static buffers (integer ones are equal by the signature)."""
    for name, src in sample.tensors().items():
        dst = getattr(static, name)
        if dst.is_floating_point():
            dst.copy_(src)


def _integer_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """The bytes of every integer (or bool) tensor, in name order, through one device -> host copy."""
    ints = [t.detach().reshape(-1).contiguous().view(torch.uint8) for _, t in sorted(tensors.items())
            if not t.is_floating_point() and not t.is_complex()]
    if not ints:
        return b""
    return torch.cat(ints).cpu().numpy().tobytes()


def signature(model: torch.nn.Module, sample, objective, params: Sequence[tuple[str, torch.nn.Parameter]],
              tree: module_tree.Tree) -> str:
    """The cache key of one call: the digest of the execution context bound to it (see the module contract)."""
    sample_tensors = sample.tensors()
    inputs = (
        tuple(sorted(objective.to_dict().items())), float(sample.weight),
        sample.num_condition_video_rows, sample.num_condition_audio_rows,
        tuple((n, tuple(t.shape), str(t.dtype), t.stride(), str(t.device)) for n, t in sample_tensors.items()),
        _integer_bytes(sample_tensors),
    )
    trainable = tuple((n, id(p), p.data_ptr(), str(p.dtype), tuple(p.shape)) for n, p in params)
    extra = (model.training, getattr(model, "gradient_checkpointing", None), trainable)
    return graphs.bound_context(model, tree, inputs=inputs, front="step", trainable=frozenset(id(p) for _, p in params),
                                extra=extra).digest()


GRAPHS = StepGraphs()


def run(model, sample, objective, params, body) -> tuple:
    """The micro-batch through the process's step graph cache (see the module contract)."""
    return GRAPHS.run(model, sample, objective, params, body)
