"""The execution context: everything a forward's arithmetic and launches depend on, as one frozen value.

Contract
--------
`ExecutionContext` is a frozen dataclass held in ONE context variable (`current()`; threads and notebooks stay
independent). Its fields are the execution state: the runtime mode, op overrides, the placement and its per-forward
frame, AdaLN tables computed ahead, fast mode's switches, the CUDA-graph policy (which graph fronts are on), the
gradient checkpoint's RNG rule, the hook registry and hook view of the running forward, LoRA's per-row streams,
collective timing, the follower's pass index, the strict epilogue fusions switched on -- and, in a context bound to
one call (`bind`), the strict kernels' tile tables, every adapter layer's state, the model's identity state and the
call's inputs, and the graph front that binds it.
- `use(**changes)` (a context manager) makes `replace(current(), **changes)` current for the enclosed code; every
  `use_*` setter of the runtime, fast mode, the graph fronts, hooks, LoRA and the distributed room is a thin one
  over it. An unknown field name is refused in one line.
- `digest()` is the SHA-256 of the context's fields encoded as stable bytes (field name, a type tag, the value's
  bytes; never `id()` or `hash()` of a context field), so equal contexts give equal digests in any process. A
  bound context's digest IS a CUDA graph's signature (`h3lab.execution.graphs`, `h3lab.training.step_graph`): graph caches
  key on it and on nothing else, so a field added here is in every signature at once.
- Encoding: None, bool, int, float, str, bytes, tuples and lists (in order), dicts (sorted by key), dtypes and
  devices by name, tensors by dtype, shape and their bytes (read once per live tensor and `_version`), callables
  by module and qualified name, an object with `describe()` by what it returns, any other object by its type's
  qualified name. Objects in the context (a placement, a hook registry, overrides' functions) make a forward
  ineligible for graphs anyway (`graphs.shared_refusal`); their encoding only keeps the digest a function of the
  fields.
- `bind(...)` values are the process's own: the model field holds ids and data pointers (a graph is a process's
  own too). A context's own fields are encoded once per context value (the value is frozen; `bind` hands them to
  the bound context), so a call's digest encodes only what it binds.

Not execution state, kept in their own context variables: what a forward *recorded* (`runtime.last_trace`, the graph
fronts' `last_path`, `step_graph.last_path`, streaming's `last_stats`, the collective log of the running forward),
the op table of the running forward (`runtime.current_ops`: a recorder made from this context at a forward's start,
re-entered by a checkpoint replay), and the index caches' `frozen()` pin list (`h3kernels._index_cache`: a graph
capture's bookkeeping, per thread, below the h3lab rooms). The strict kernels' tile tables stay module globals of
`h3kernels` (below every h3lab room; the benchmarks swap them) and the adapters' state stays on peft's layers: a
bound context reads both when a signature is taken, so a graph never replays over a table or adapter it did not see.
"""

from __future__ import annotations

import array
import contextlib
import contextvars
import dataclasses
import hashlib
import struct
from typing import Any, Callable, Iterator

GRAPH_FRONTS = ("fast", "strict", "step")  # which CUDA-graph fronts exist: forwards by mode, training micro-batches


@dataclasses.dataclass(frozen=True)
class ExecutionContext:
    """What the enclosed forwards run with (module contract). Defaults: the process's defaults."""

    mode: str = "off"  # runtime mode: strict | audit | auto | off | fast
    overrides: tuple = ()  # ((op name, function), ...) sorted by name
    placement: Any = None  # h3lab.distributed placement serving ops on shards
    placement_frame: Any = None  # that placement's row frame of the running forward
    precomputed: Any = None  # AdaLN tables computed ahead
    fast_fused: bool = True  # fast: fused FP8 producers and shared row codes
    fast_emulated: bool = False  # fast: CPU emulation (tests and dry runs)
    fp8_attention: str = "auto"  # fast: "auto" | "on" | "off"
    graphs: tuple = GRAPH_FRONTS  # the CUDA-graph policy: the fronts whose graphs are on
    checkpoint_rng: bool = True  # gradient checkpoints save and restore the RNG state
    hooks: Any = None  # the hook registry the running forward fires
    hook_view: Any = None  # how a sharded forward shows hooks the one-process tensors
    lora_streams: Any = None  # (S,) int64 stream of each packed row, for LoRA's per-stream factors
    collective_timing: bool = False  # collective logs time their transport calls
    follow_pass: Any = None  # the denoising pass a follower rank runs
    fusions: tuple = ()  # strict epilogue fusions switched on (sorted names of `runtime.FUSIONS`)
    front: str = ""  # bound: the graph front the call is captured by ("strict" | "fast" | "step")
    kernel_tables: tuple = ()  # bound: the strict kernels' tile tables (`runtime.kernel_settings()`)
    adapter_state: tuple = ()  # bound: every adapter layer's state (`module_tree.adapter_state`)
    model: tuple = ()  # bound: the model's identity state (modules, parameters and buffers)
    inputs: tuple = ()  # bound: the call's arguments (metadata; integer tensors by their bytes)

    def replace(self, **changes: Any) -> "ExecutionContext":
        unknown = sorted(set(changes) - _FIELDS)
        if unknown:
            raise TypeError(f"execution context field(s) {unknown}: fields are {', '.join(sorted(_FIELDS))}")
        return dataclasses.replace(self, **changes)

    def bind(self, **call: Any) -> "ExecutionContext":
        """This context bound to one call (`front`, `kernel_tables`, `adapter_state`, `model`, `inputs`): its digest
        is the call's graph signature."""
        other = sorted(set(call) - set(BOUND))
        if other:
            raise TypeError(f"bind field(s) {other}: a call binds only {', '.join(BOUND)}")
        bound = self.replace(**call)
        object.__setattr__(bound, "_own", self._own_state())  # the same unbound fields: their bytes are fed once
        return bound

    def graphs_on(self, front: str) -> bool:
        return front in self.graphs

    def digest(self) -> str:
        """SHA-256 (hex) of the fields' stable bytes (module contract): the context's own fields, then the bound
        ones."""
        h = self._own_state().copy()
        for name in BOUND:
            _feed(h, name, getattr(self, name))
        return h.hexdigest()

    def _own_state(self):
        """The hash state after the unbound fields, computed once per context value (its fields are frozen)."""
        state = self.__dict__.get("_own")
        if state is None:
            state = hashlib.sha256()
            for name in _OWN:
                _feed(state, name, getattr(self, name))
            object.__setattr__(self, "_own", state)
        return state


def _feed(h, name: str, value: Any) -> None:
    h.update(name.encode() + b"=")
    if name == "kernel_tables":  # the same tables every call: their bytes are kept by value (a few entries)
        raw = _TABLES.get(value)
        if raw is None:
            parts: list = []
            _encode(value, parts.append)
            raw = b"".join(parts)
            if len(_TABLES) >= 8:
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[value] = raw
        h.update(raw)
    else:
        _encode(value, h.update)


_TABLES: dict = {}
BOUND = ("front", "kernel_tables", "adapter_state", "model", "inputs")
_OWN = tuple(f.name for f in dataclasses.fields(ExecutionContext) if f.name not in BOUND)
_FIELDS = frozenset(f.name for f in dataclasses.fields(ExecutionContext))
DEFAULT = ExecutionContext()
_CONTEXT: contextvars.ContextVar[ExecutionContext] = contextvars.ContextVar("h3lab_execution_context", default=DEFAULT)


def current() -> ExecutionContext:
    """The execution context of the enclosed code."""
    return _CONTEXT.get()


@contextlib.contextmanager
def use(**changes: Any) -> Iterator[ExecutionContext]:
    """Make the current context with `changes` current for the enclosed code."""
    token = _CONTEXT.set(_CONTEXT.get().replace(**changes))
    try:
        yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def use_flag(name: str, enabled: bool, what: str) -> Iterator[None]:
    """Set the boolean field `name` for the enclosed code; `what` names the switch in the refusal."""
    if not isinstance(enabled, bool):
        raise TypeError(f"{what}({enabled!r}): must be True or False")
    with use(**{name: enabled}):
        yield


def use_graphs(front: str, enabled: bool, what: str):
    """Turn the CUDA graphs of `front` ("fast" | "strict" | "step") on or off for the enclosed code."""
    if front not in GRAPH_FRONTS:
        raise ValueError(f"graph front {front!r}: must be one of {', '.join(GRAPH_FRONTS)}")
    if not isinstance(enabled, bool):
        raise TypeError(f"{what}({enabled!r}): must be True or False")
    return _use_front(front, enabled)


@contextlib.contextmanager
def _use_front(front: str, enabled: bool) -> Iterator[None]:
    fronts = set(current().graphs) - {front} | ({front} if enabled else set())  # read when entered
    with use(graphs=tuple(sorted(fronts))):
        yield


# ------------------------------------------------------------------------------------------------ stable bytes
def _encode(value: Any, put: Callable[[bytes], Any]) -> None:
    """Feed `value`'s type tag and stable bytes to `put` (module contract: Encoding)."""
    if value is None or isinstance(value, bool):
        put(b"N" if value is None else (b"T" if value else b"F"))
    elif isinstance(value, int):
        put(b"i%d;" % value)
    elif isinstance(value, float):
        put(b"f" + struct.pack("<d", value))
    elif isinstance(value, str):
        raw = value.encode()
        put(b"s%d:" % len(raw) + raw)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        put(b"b%d:" % len(raw) + raw)
    elif isinstance(value, array.array):
        put(b"a%s%d:" % (value.typecode.encode(), len(value)) + value.tobytes())
    elif isinstance(value, (tuple, list)):
        put(b"(%d:" % len(value))
        for v in value:
            _encode(v, put)
        put(b")")
    elif isinstance(value, dict):
        put(b"{%d:" % len(value))
        for k in sorted(value, key=str):
            _encode(k, put)
            _encode(value[k], put)
        put(b"}")
    else:
        _encode_object(value, put)


def _encode_object(value: Any, put: Callable[[bytes], Any]) -> None:
    import torch

    if isinstance(value, (torch.dtype, torch.device)):
        _encode(str(value), put)
    elif isinstance(value, torch.Tensor):
        put(b"t")
        _encode((str(value.dtype), tuple(value.shape), str(value.device.type)), put)
        _encode(tensor_bytes(value), put)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        put(b"d" + _qualname(type(value)).encode())
        _encode(tuple((f.name, getattr(value, f.name)) for f in dataclasses.fields(value)), put)
    elif callable(getattr(value, "describe", None)):
        put(b"o" + _qualname(type(value)).encode())
        _encode(value.describe(), put)
    elif callable(value):
        put(b"c" + _qualname(value).encode())
    else:
        put(b"o" + _qualname(type(value)).encode())


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


_BYTES: list = []  # the runtime's derived-value cache, set by `bind_bytes` (this module imports no room)


def bind_bytes(fn: Callable[[Any], bytes]) -> None:
    """The runtime hands over its tensor -> host bytes reader (cached per live tensor and `_version`)."""
    _BYTES[:] = [fn]


def tensor_bytes(t: Any) -> bytes:
    """A tensor's bytes on the host (through the runtime's cache when bound)."""
    if _BYTES:
        return _BYTES[0](t)
    return t.detach().reshape(-1).contiguous().cpu().view(__import__("torch").uint8).numpy().tobytes()
