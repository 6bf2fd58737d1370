"""CUDA graphs of whole forwards: the strict and fast graph fronts, one mechanism. Capture once per signature, replay
for the denoising passes.

Why: a strict forward is ~2,000 Triton launches (50 blocks); at 2,066 rows the host's launch path, not the GPU, set
its time (1.064x Diffusers on the H200 without graphs). A fast forward is fewer launches but as host-bound at short
layouts. A replayed graph launches the same kernels on the same buffers without the host.

Contract
--------
`run(model, args, body)` is what `H3Transformer.forward` calls with its checked inputs: the execution context
(`h3lab.execution.context`) picks the front -- a forward in a mode with a front (`POLICIES`: strict, fast) goes to that front's
cache, which captures it where the context's graph policy has the front on (`ExecutionContext.graphs`, set with
`use_graphs(mode, enabled)`) and the call is eligible; any other mode is `body(*args)`, the eager forward. The model
never chooses between strict and fast graphs. `GraphCache(policy).run(model, args, body)`: `body(*args)` is one
traced forward (a fresh op table, `H3Transformer._run_ops`) of the checked inputs `args` (tensors, or None for an
absent `key_order`), returning a tuple of tensors. A `Policy` names the graph front (the runtime mode it serves) and
its own refusal.
- The policies. strict: up to `STRICT_MAX_ROWS` packed rows (12,369 = 1344x768x39f and below, where the host's launch
  path is a visible part of a forward). fast: up to `FAST_MAX_ROWS` (37,853 = 1344x768x124f and below: at 109,205
  rows a 3-block forward is 2.3 s of GPU work and the graph's pool held 22 GiB of activations after the call), and
  never under `fast.use_emulation()` (the CPU dry runs). Past its limit a forward runs eager.
- Eligible calls: CUDA tensors, the front on, grad mode off, no hook registered on the model (h3lab hooks, torch
  forward hooks on any module, global torch hooks), no op override, no placement, no capture already running, not
  inside `torch.inference_mode()` (its tensors carry no version: the index caches cannot hold them), every tensor
  argument dense (`clone()` keeps its strides, so the graph computes on buffers laid out as the caller's), and the
  policy's own rule. Every other call is `body(*args)` itself: the eager forward, with the reason in `last_path()`.
- Signature: the digest of the execution context bound to the call (`signature`: `ExecutionContext.bind(...)
  .digest()`), and nothing else. The context's fields are the mode, overrides, placement, fast's switches, the graph
  policy and the rest of the execution state; bound to the call it adds the graph front, the strict kernels' tile
  tables (`runtime.kernel_settings()`: a graph replays the kernels it captured), every adapter layer's Python state
  (peft's adapter switch, active and merged adapters, scalings: `module_tree.adapter_state`; GRPO's adapter-off
  reference forward is another signature than the policy's), the model (its id -- the cache also holds it weakly,
  so a new model never meets an old graph --, fingerprint, the identity of each of its modules, every parameter and
  buffer's id, data pointer, dtype and `_version`: a weight updated in place, replaced, cast or added is a new
  signature; the walk of the module tree is cached per model and re-checked in one cheap pass a call,
  `h3lab.execution.module_tree`), each argument's shape, dtype, strides and device, and the *bytes* of every integer tensor
  argument. Integer arguments are the layout (index tensors): host-side decisions and device metadata derived from
  them (the strict kernels' validated index maps, the AdaLN row index `runtime.derived`) are resolved when the graph
  is captured and baked into it, so a graph serves exactly the layout it was captured with. A tensor's bytes are
  read to the host once while it is the same live tensor at the same `_version` (`runtime.derived`).
  Floating-point arguments are data: copied into the graph's buffers before each replay.
- A signature's first call copies the arguments into static buffers and runs the eager forward on them (the
  warm-up: Triton compilation, cuBLAS/cuDNN plans, FP8 weights, and every index cache entry of the static layout
  tensors); its result is the call's result. The second call captures the forward into a `torch.cuda.CUDAGraph`
  (private memory pool, thread-local capture errors) on those buffers, inside `runtime.frozen_index_caches()`: no
  index-cache entry may be built during the capture (a miss raises before any host sync could) and every entry the
  capture read is kept with the graph, whose kernels read those tensors by address. Then it replays; later calls
  copy their floating-point arguments into the buffers and replay. Outputs are cloned out of the graph's buffers, so
  a result stays valid after the next replay. A new signature starts again with an eager call. A capture that fails
  (an op that synchronises with the host, an index-cache miss) leaves that signature eager for good and says why.
- At most `max_graphs` graphs are held (least recently used dropped with its memory pool), and at most
  2 * `max_graphs` signatures waiting for their second call. Eligible calls from several threads are served one at
  a time (a lock around copy, replay and clone).
- The trace: a replay makes the captured forward's trace `runtime.last_trace()` again, with
  `Trace.graph = {"cuda_graph": "captured" | "replay", "replays": n}`; an eager forward in the policy's mode says
  {"cuda_graph": "eager", "reason": ...}. The mode, backends and kernel ids are those of the eager forward.
- The bytes: a replay runs the kernels the eager forward launched (same machine code, tiles, launch order, fixed
  reduction orders) on buffers with the caller's shapes, dtypes and strides, so a strict replay equals the eager
  strict forward byte for byte (benchmarks/benchmark_strict_graph.py asserts it on the H200 at 2,066 and 7,272 rows).
  Strict refusals (`StrictError`) are raised by the first, eager call of a signature, exactly as without graphs.
  Fast is not strict and promises no bytes; benchmarks/benchmark_every_length.py compares a replay's bytes with the
  eager fast forward's (`bytes_equal_fast_eager`).
`Backend` is the capture seam: `CudaBackend` on the GPU; tests pass a backend that replays by re-running the body on
the static buffers, so the signature, fallback and buffer logic runs on the CPU.
"""

from __future__ import annotations

import array
import contextvars
import dataclasses
import operator
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch

from . import context, module_tree, runtime

MAX_GRAPHS = 3
STRICT_MAX_ROWS = 16384
FAST_MAX_ROWS = 65536
# How the last forward of each front ran in this context: a record of what ran, not execution state (h3lab.execution.context).
_last_path: contextvars.ContextVar[dict] = contextvars.ContextVar("h3lab_graph_path", default={})


@dataclasses.dataclass(frozen=True)
class Policy:
    """One graph front. `mode`: the runtime mode it serves (and the front's name in `ExecutionContext.graphs`);
    `refuse(args)`: "" or why this call of the mode is not captured."""

    mode: str
    refuse: Callable[[tuple], str] = lambda args: ""

    def enabled(self) -> bool:
        return context.current().graphs_on(self.mode)

    def last_path(self) -> dict:
        return dict(_last_path.get().get(self.mode, {}))

    def set_path(self, path: dict) -> None:
        _last_path.set({**_last_path.get(), self.mode: path})


def _refuse_strict(args: tuple) -> str:
    return refuse_rows(args, STRICT_MAX_ROWS, "graphs.STRICT_MAX_ROWS")


def _refuse_fast(args: tuple) -> str:
    if context.current().fast_emulated:
        return "fast emulation (CPU dry run)"
    return refuse_rows(args, FAST_MAX_ROWS, "graphs.FAST_MAX_ROWS")


STRICT = Policy(mode="strict", refuse=lambda args: _refuse_strict(args))
FAST = Policy(mode="fast", refuse=lambda args: _refuse_fast(args))
POLICIES = {"strict": STRICT, "fast": FAST}


def use_graphs(mode: str, enabled: bool):
    """Enable (default) or disable the CUDA graphs of the enclosed forwards of `mode` ("strict" | "fast"): the graph
    policy of the execution context."""
    if mode not in POLICIES:
        raise ValueError(f"use_graphs mode {mode!r}: must be one of {', '.join(POLICIES)}")
    return context.use_graphs(mode, enabled, "use_graphs")


def last_path(mode: str) -> dict:
    """How the last forward of `mode` in this context ran: {"cuda_graph": "eager" | "captured" | "replay", ...}."""
    if mode not in POLICIES:
        raise ValueError(f"last_path mode {mode!r}: must be one of {', '.join(POLICIES)}")
    return POLICIES[mode].last_path()


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
    pins: list = dataclasses.field(default_factory=list)  # index-cache entries the captured kernels read
    calls: int = 0
    replays: int = 0
    failed: str = ""


class GraphCache:
    """Signature -> captured graph (see the module contract)."""

    def __init__(self, policy: Policy, backend: Any = None, max_graphs: int = MAX_GRAPHS):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy is a {type(policy).__name__}: must be an h3lab.execution.graphs.Policy")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs!r}: must be a positive integer")
        self.policy = policy
        self.backend = backend or CudaBackend()
        self.max_graphs = max_graphs
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._lock = threading.RLock()  # one thread at a time copies into a graph's buffers and replays it

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)

    def clear(self) -> None:
        """Drop every graph (and its memory pool) and every waiting signature."""
        with self._lock:
            self._entries.clear()

    def run(self, model: torch.nn.Module, args: tuple, body: Callable[..., tuple], *,
            device_ok: Callable[[tuple], bool] | None = None) -> tuple:
        reason = _ineligible(self.policy, model, args, self.backend, device_ok or _on_cuda)
        tree = module_tree.walk(model) if not reason else None
        if tree is not None and tree.hooked:
            reason = "a torch forward hook is registered"
        if reason:
            return self._eager(body, args, reason)
        key = signature(model, args, self.policy, tree)
        with self._lock:
            return self._run(model, args, body, key)

    def _run(self, model, args, body, key) -> tuple:
        entry = self._entries.get(key)
        if entry is None or entry.model() is not model:
            return self._first(model, args, body, key)
        self._entries.move_to_end(key)
        entry.calls += 1
        if entry.failed:
            return self._eager(body, args, entry.failed)
        if entry.graph is None:
            _copy_data(entry.static, args)
            try:
                with runtime.frozen_index_caches() as pins:
                    entry.graph, entry.outputs = self.backend.capture(lambda: body(*entry.static))
            except Exception as exc:  # noqa: BLE001 - a capture that fails leaves the eager forward, said why
                first = str(exc).splitlines()[0] if str(exc) else ""
                entry.failed = f"capture failed: {type(exc).__name__}: {first}"
                entry.static = ()
                return self._eager(body, args, entry.failed)
            entry.pins, entry.trace = pins, runtime.last_trace()
            self._evict()
            state = "captured"
        else:
            _copy_data(entry.static, args)
            state = "replay"
        entry.graph.replay()
        entry.replays += 1
        path = {"cuda_graph": state, "replays": entry.replays}
        self.policy.set_path(path)
        if entry.trace is not None:
            runtime.set_last_trace(dataclasses.replace(entry.trace, graph=path))
        return tuple(o.clone() for o in entry.outputs)

    def _first(self, model, args, body, key) -> tuple:
        """A new signature: static copies of the arguments, the eager forward on them (the warm-up)."""
        static = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        for i, (a, s) in enumerate(zip(args, static)):
            if isinstance(a, torch.Tensor) and s.stride() != a.stride():
                return self._eager(body, args, f"argument {i} of shape {list(a.shape)} has strides {a.stride()} that "
                                               "are not dense (a static copy would change them)")
        out = self._eager(body, static, "first call of this signature (the warm-up before capture)")
        self._entries[key] = _Entry(model=weakref.ref(model), static=static, calls=1)
        self._evict()
        return out

    def _eager(self, body, args, reason: str) -> tuple:
        out = body(*args)
        path = {"cuda_graph": "eager", "reason": reason}
        self.policy.set_path(path)
        trace = runtime.last_trace()
        if trace is not None and trace.mode == self.policy.mode:
            trace.graph = path
        return out

    def _evict(self) -> None:
        captured = [k for k, e in self._entries.items() if e.graph is not None]
        for key in captured[: max(0, len(captured) - self.max_graphs)]:
            del self._entries[key]
        waiting = [k for k, e in self._entries.items() if e.graph is None]
        for key in waiting[: max(0, len(waiting) - 2 * self.max_graphs)]:
            del self._entries[key]


def _copy_data(static: tuple, args: tuple) -> None:
    """The floating-point arguments into the static buffers (integer ones are equal by the signature)."""
    for dst, src in zip(static, args):
        if isinstance(dst, torch.Tensor) and dst.is_floating_point():
            dst.copy_(src)


def _on_cuda(args: tuple) -> bool:
    return all(a.is_cuda for a in args if isinstance(a, torch.Tensor))


def packed_rows(args: tuple) -> int:
    """The packed rows of `H3Transformer._run_ops`' checked inputs (args[6] is position_ids (S, 3)); 0 if absent."""
    return args[6].shape[0] if len(args) > 6 and isinstance(args[6], torch.Tensor) else 0


def refuse_rows(args: tuple, limit: int, name: str) -> str:
    """"" or why a forward of more than `limit` packed rows is not captured (`name` spells the limit): past it a
    forward is seconds of GPU work, the launches a graph saves are noise, and the graph's memory pool -- the
    forward's peak activations -- would stay held after the call."""
    rows = packed_rows(args)
    if rows > limit:
        return f"{rows} packed rows > {name} = {limit} (eager: graphs pay only at short layouts)"
    return ""


def _ineligible(policy: Policy, model, args, backend, device_ok) -> str:
    if not policy.enabled():
        return f"graphs disabled (graphs.use_graphs({policy.mode!r}, False))"
    refused = policy.refuse(args)
    if refused:
        return refused
    if not device_ok(args):
        return "inputs not on a CUDA device"
    if torch.is_grad_enabled():
        return "grad mode is on"
    return shared_refusal(model, backend)


def shared_refusal(model, backend) -> str:
    """"" or why no graph of `model` may be captured now, whatever is captured (a forward here, a training
    micro-batch in `h3lab.training.step_graph`): inference mode, an h3lab hook, an op override, a placement, AdaLN
    tables computed ahead, a capture already running, a global torch forward hook (a module's own: `module_tree.walk`)."""
    if torch.is_inference_mode_enabled():
        return ("inference mode (its tensors carry no version, so the index caches a graph is built on cannot hold "
                "them; use torch.no_grad())")
    if getattr(model, "_hooks", None):
        return "an h3lab hook is registered"
    if runtime.active_overrides():
        return f"op overrides {list(runtime.active_overrides())}"
    if runtime.current_placement() is not None:
        return "a placement (sharded forward)"
    if runtime.current_precomputed() is not None:
        return "AdaLN tables computed ahead (each forward selects its rows)"
    if backend.capturing():
        return "a capture is already running"
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "a torch forward hook is registered"
    return ""  # a module's own forward hooks: `module_tree.walk`


def signature(model: torch.nn.Module, args: tuple, policy: Policy, tree: module_tree.Tree | None = None) -> str:
    """The cache key of one call: the digest of the execution context bound to it (see the module contract); `tree`
    is `module_tree.walk(model)` when the caller has it."""
    tree = tree if tree is not None else module_tree.walk(model)
    return bound_context(model, tree, inputs=tuple(map(argument_key, args)), front=policy.mode).digest()


def bound_context(model: torch.nn.Module, tree: module_tree.Tree, *, inputs: tuple, front: str,
                  trainable: frozenset = frozenset(), extra: tuple = ()) -> context.ExecutionContext:
    """The current execution context bound to one call of `model` (`ExecutionContext.bind`): the graph front, the
    kernels' tile tables, the adapters' state, the model's identity state (`model_key`) and `inputs`."""
    return context.current().bind(front=front, kernel_tables=runtime.kernel_settings(), adapter_state=tree.state,
                                  model=model_key(model, tree, trainable) + extra, inputs=inputs)


def model_key(model: torch.nn.Module, tree: module_tree.Tree, trainable: frozenset = frozenset()) -> tuple:
    """The model's identity state: id, fingerprint, module ids, and every parameter and buffer's id, data pointer,
    dtype and `_version` (-1 for the `trainable` ids, updated in place between calls and read by address). Packed as
    arrays, one C-level pass each (~0.1 ms at 50 blocks; the walk itself is cached)."""
    module_ids, tensors, tensor_ids, _, _ = tree
    versions = map(_VERSION, tensors) if not trainable else (
        -1 if i in trainable else t._version for i, t in zip(tensor_ids, tensors))
    return (id(model), getattr(model, "fingerprint", ""), _ids(module_ids), _ids(tensor_ids),
            array.array("Q", map(torch.Tensor.data_ptr, tensors)), ",".join(map(str, map(_DTYPE, tensors))),
            array.array("q", versions))


def argument_key(a: Any) -> tuple | None:
    """One argument's shape, dtype, strides and device; an integer tensor's bytes too (the layout)."""
    if a is None:
        return None
    meta = repr((tuple(a.shape), str(a.dtype), a.stride(), str(a.device)))  # ints and names: stable bytes
    return (meta,) if a.is_floating_point() else (meta, runtime.host_bytes(a))


_IDS: dict = {}  # id(tuple) -> (the tuple, its array): a cached walk hands the same id tuples every call


def _ids(ids: tuple) -> array.array:
    hit = _IDS.get(id(ids))
    if hit is not None and hit[0] is ids:
        return hit[1]
    if len(_IDS) >= 16:
        _IDS.clear()
    _IDS[id(ids)] = (ids, array.array("Q", ids))  # the tuple is held, so its id names it
    return _IDS[id(ids)][1]


_DTYPE, _VERSION = operator.attrgetter("dtype"), operator.attrgetter("_version")
CACHES = {mode: GraphCache(policy) for mode, policy in POLICIES.items()}


def clear() -> None:
    """Drop every graph of every front (and their memory pools)."""
    for cache in CACHES.values():
        cache.clear()


def run(model: torch.nn.Module, args: tuple, body: Callable[..., tuple]) -> tuple:
    """The checked forward of `args`: through the graph cache of the context's mode when that front has one, else
    `body(*args)` (see the module contract)."""
    cache = CACHES.get(context.current().mode)
    return cache.run(model, args, body) if cache is not None else body(*args)
