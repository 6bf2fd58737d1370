"""CUDA graphs for `--mode fast` forwards: capture once per input signature, replay for the denoising passes.

Contract
--------
`run(model, args, body)`: `body(*args)` is one traced forward (a fresh op table, `H3Transformer._run_ops`) of the
checked inputs `args` (tensors, or None for an absent `key_order`), returning a tuple of tensors.
- Eligible calls: mode "fast" on CUDA tensors, not emulated, graphs enabled (`use_graphs`, default on), grad mode
  off, no hook registered on the model (h3lab hooks, torch forward hooks on any module, global torch hooks), no op
  override, no placement, and no capture already running. Every other call is `body(*args)` itself: the eager fast
  forward, with the reason in `last_path()`.
- Signature: the model (a weak reference, so a new model never meets an old graph), each argument's shape, dtype,
  strides and device, the model's fingerprint, fast mode's switches (`fast.graph_key()`), and every parameter and buffer (id, data pointer, `_version`): a
  weight updated in place, replaced or added (an adapter) is a new signature.
- A signature's first call runs eager (the warm-up: Triton compilation, cuBLAS/cuDNN plans, FP8 weights quantised);
  its second captures the forward into a `torch.cuda.CUDAGraph` (private memory pool, thread-local capture errors),
  on static copies of the inputs, and replays it; later calls copy their inputs into those buffers and replay. The
  outputs are cloned out of the graph's buffers, so a result stays valid after the next replay. A new signature
  (a shape change, a new layout size, a weight update) starts again with an eager call: the exact fallback. A
  capture that fails (an op that synchronises with the host, say) leaves that signature eager for good and says why.
- At most MAX_GRAPHS graphs are held (least recently used dropped with its memory pool). Eligible calls from several
  threads are served one at a time (a lock around copy, replay and clone).
- The trace: a replay makes the captured forward's trace `runtime.last_trace()` again, with
  `Trace.graph = {"cuda_graph": "captured" | "replay", "replays": n}`; an eager fast forward's trace says
  {"cuda_graph": "eager", "reason": ...}. The mode, backends and kernel ids are those of the eager fast path.
- Not strict and promises no bytes; on the H200 a replay's output bytes are compared with the eager forward's in
  benchmarks/benchmark_every_length.py (section `graphs`).
`Backend` is the capture seam: `CudaBackend` on the GPU; tests pass a backend that replays by re-running the body on
the static buffers, so the signature, fallback and buffer logic runs on the CPU.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch

from . import fast, runtime

MAX_GRAPHS = 3
_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("h3lab_fast_graphs", default=True)
_last_path: contextvars.ContextVar[dict] = contextvars.ContextVar("h3lab_fast_graph_path", default={})


def use_graphs(enabled: bool):
    """Enable or disable CUDA graphs for the enclosed fast forwards (benchmarks compare both)."""
    return fast.switch(_enabled, enabled, "use_graphs")


def last_path() -> dict:
    """How the last fast forward in this context ran: {"cuda_graph": "eager" | "captured" | "replay", ...}."""
    return dict(_last_path.get())


class CudaBackend:
    """Capture with `torch.cuda.graph` (its own side stream and private pool), replay on the current stream."""

    def capture(self, body: Callable[[], tuple]) -> tuple[Any, tuple]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = body()
        return graph, outputs

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass
class _Entry:
    model: Any  # weakref to the model
    graph: Any = None
    static: tuple = ()
    outputs: tuple = ()
    trace: Any = None
    calls: int = 0
    replays: int = 0
    failed: str = ""


class GraphCache:
    """Signature -> captured graph (see the module contract)."""

    def __init__(self, backend: Any = None, max_graphs: int = MAX_GRAPHS):
        self.backend = backend or CudaBackend()
        self.max_graphs = max_graphs
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.RLock()  # one thread at a time copies into a graph's buffers and replays it

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)

    def clear(self) -> None:
        self._entries.clear()

    def run(self, model: torch.nn.Module, args: tuple, body: Callable[..., tuple], *,
            device_ok: Callable[[tuple], bool] | None = None) -> tuple:
        reason = _ineligible(model, args, self.backend, device_ok or _on_cuda)
        if reason:
            return _eager(body, args, reason)
        key = _signature(model, args)
        with self._lock:
            return self._run(model, args, body, key)

    def _run(self, model, args, body, key) -> tuple:
        entry = self._entries.get(key)
        if entry is None or entry.model() is not model:
            entry = self._entries[key] = _Entry(model=weakref.ref(model))
        self._entries.move_to_end(key)
        entry.calls += 1
        if entry.failed:
            return _eager(body, args, entry.failed)
        if entry.graph is None and entry.calls == 1:
            return _eager(body, args, "first call of this signature (the warm-up before capture)")
        if entry.graph is None:
            static = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            try:
                entry.graph, entry.outputs = self.backend.capture(lambda: body(*static))
            except Exception as exc:  # noqa: BLE001 - a capture that fails leaves the eager forward, said why
                entry.failed = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                return _eager(body, args, entry.failed)
            entry.static, entry.trace = static, runtime.last_trace()
            self._evict()
            state = "captured"
        else:
            for dst, src in zip(entry.static, args):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)
            state = "replay"
        entry.graph.replay()
        entry.replays += 1
        path = {"cuda_graph": state, "replays": entry.replays}
        _last_path.set(path)
        if entry.trace is not None:
            runtime.set_last_trace(dataclasses.replace(entry.trace, graph=path))
        return tuple(o.clone() for o in entry.outputs)

    def _evict(self) -> None:
        captured = [k for k, e in self._entries.items() if e.graph is not None]
        for key in captured[: max(0, len(captured) - self.max_graphs)]:
            del self._entries[key]
        while len(self._entries) > 4 * self.max_graphs:  # uncaptured signatures: bounded too
            self._entries.popitem(last=False)


def _on_cuda(args: tuple) -> bool:
    return all(a.is_cuda for a in args if isinstance(a, torch.Tensor))


def _ineligible(model, args, backend, device_ok) -> str:
    if not _enabled.get():
        return "graphs disabled (fast_graph.use_graphs(False))"
    if fast.emulated():
        return "fast emulation (CPU dry run)"
    if not device_ok(args):
        return "inputs not on a CUDA device"
    if torch.is_grad_enabled():
        return "grad mode is on"
    if getattr(model, "_hooks", None):
        return "an h3lab hook is registered"
    if runtime.active_overrides():
        return f"op overrides {list(runtime.active_overrides())}"
    if runtime.current_placement() is not None:
        return "a placement (sharded forward)"
    if backend.capturing():
        return "a capture is already running"
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks or any(
            m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "a torch forward hook is registered"
    return ""


def _signature(model, args) -> tuple:
    parts = [id(model), getattr(model, "fingerprint", ""), fast.graph_key()]
    for a in args:
        parts.append(None if a is None else (tuple(a.shape), a.dtype, a.stride(), str(a.device)))
    for t in model.parameters():
        parts.append((id(t), t.data_ptr(), t._version))
    for t in model.buffers():
        parts.append((id(t), t.data_ptr(), t._version))
    return tuple(parts)


def _eager(body, args, reason: str) -> tuple:
    out = body(*args)
    path = {"cuda_graph": "eager", "reason": reason}
    _last_path.set(path)
    trace = runtime.last_trace()
    if trace is not None and trace.mode == "fast":
        trace.graph = path
    return out


GRAPHS = GraphCache()


def run(model: torch.nn.Module, args: tuple, body: Callable[..., tuple]) -> tuple:
    """The fast forward of `args` through the process's graph cache (see the module contract)."""
    return GRAPHS.run(model, args, body)
