"""Ranks that hold only their shard: read each rank's slice of every TP-sharded tensor straight from the safetensors
files, or draw it from a seeded counter-based init, without the whole model in host or device memory.

`shard_ranges(key, full_shape, config, tp, rank, row_parallel)` -> (dim, [(lo, hi), ...]) is the plan's split
(`plan.split_rule`, `shards.split_grouped`) written as index ranges of the full tensor: the rank's shard is the
concatenation of those ranges along `dim`, in order (one range for heads and row-parallel K / N, one per group for
`[value; gate]` and the 6 x 3 AdaLN blocks). None for a replicated tensor. By construction
`full[ranges] == shard_tensor(full)` (tested).

`load_shard_state_dict(path, config, tp, rank, row_parallel="auto", layout="auto", qkv_layout=None, device=None,
dtype_policy="released")` -> this rank's Diffusers-keyed `StateDict`: sharded tensors are read with
`safe_open(...).get_slice` (only the rank's rows or columns leave the file), replicated ones as memory-mapped views;
each is moved to `device` (and cast under the float32 policy) before the next is read, so the host holds one slice
at a time. Every layout `checkpoint.load_state_dict` reads:
- ``diffusers``   a slice per range of the stored tensor;
- ``minimax``     (interleaved fused QKV, `mlp.fc1` as `[gate; value]`): the rank's heads are one contiguous row
                  range of the fused tensor (`[h0 .. h1) x (q, k, v) x D`), regrouped to q / k / v; a `[value; gate]`
                  range maps to the other half of `fc1`;
- ``single_file`` (stacked `[q; k; v]`): a q / k / v range is a row range of its third of the fused tensor.
Names, full shapes and dtypes are checked against the meta-constructed model as `load_transformer` checks them
(`loader.check_entries`: one-line `CheckpointError`s naming the file and key).

`load_sharded_transformer(path, mesh, subfolder=None, device=None, dtype_policy="released", ...)` builds the
`H3Transformer` on the meta device and assigns the rank's tensors (sharded shapes), with the fingerprint the
one-process loader records (`component_hash`: headers and samples of the whole component), so a sharded run's
sealed identity is the checkpoint's. It also gets `h3lab_read_whole(keys) -> {key: whole tensor}` (CPU, the
policy's dtypes: what one process loads, `read_whole_checkpoint`), which layer thinning's block ranking reads the
whole AdaLN projections through (each rank holds 1/tp of their channels); a counter-random shard's reader computes
the whole tensors from the counter. `parallelize(model, mesh)` recognises it (`model.h3lab_shard`) and does not
shard again.

`random_shard_state_dict(config, seed, tp=1, rank=0, ...)`: seeded random weights for full-size studies without a
checkpoint (no 66 GB file fits the lent machine's disk). Every element is a function of (seed, key, its flat index
in the full tensor) -- a 32-bit integer hash (two murmur3 finalizer rounds keyed by SHA-256 of seed and key, in
int64 arithmetic that never overflows) mapped to a uniform of unit variance -- so a rank's slice is computed alone,
on its device, and equals the slice of the full tensor (tested on CPU for every key, TP 2, 3, 4, k_chunks and
n_split). RMSNorm weights 1 + 0.2 u, biases 0.3 u, matrices u / sqrt(fan_in). `tp=1` is the full model.
`random_sharded_transformer(config, mesh, seed, device)` builds a rank's model from it (fingerprint
"random-counter:<seed>", the same for the full model from `random_sharded_transformer(config, None, seed)`).

`shard_nbytes(config, tp, rank, row_parallel, dtype_policy)`: parameter bytes one rank holds (from the meta model).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import discovery, keymap
from ..checkpoint.fingerprint import component_hash
from ..checkpoint.loader import DTYPE_POLICIES, StateDict, _read_config, check_entries, released_dtype
from ..config import H3Config
from ..errors import CheckpointError
from .errors import DistributedError
from .plan import _check, split_rule
from .shards import tree_strategy

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


# ------------------------------------------------------------------------------------------------ ranges
def shard_ranges(key: str, full_shape, config, tp: int, rank: int,
                 row_parallel: str = "auto") -> tuple[int, list[tuple[int, int]]] | None:
    """(dim, ranges) of the full tensor that make rank `rank`'s shard of parameter `key`; None when replicated."""
    rule = split_rule(key, tuple(full_shape), config, tp, row_parallel=row_parallel)
    if rule is None:
        return None
    dim, groups = rule
    size = full_shape[dim]
    if size % groups or (size // groups) % tp:
        raise DistributedError(f"{key}: axis of {size} channels is not {groups} group(s) of a multiple of {tp}")
    block, width = size // groups, size // groups // tp
    return dim, [(g * block + rank * width, g * block + (rank + 1) * width) for g in range(groups)]


def _full_ranges(shape) -> tuple[int, list[tuple[int, int]]]:
    return 0, [(0, shape[0])]


def _expected(config: H3Config, dtype_policy: str) -> dict[str, torch.Tensor]:
    from ..model import H3Transformer

    with torch.device("meta"):
        return H3Transformer(config, dtype_policy=dtype_policy).state_dict()


def shard_nbytes(config: H3Config, tp: int, rank: int = 0, row_parallel: str = "auto",
                 dtype_policy: str = "released") -> int:
    """Parameter bytes rank `rank` holds at TP degree `tp` (the meta model's shapes and dtypes; no memory)."""
    _check(config, tp, rank, row_parallel)
    total = 0
    for key, ref in _expected(config, dtype_policy).items():
        numel = ref.numel()
        got = shard_ranges(key, tuple(ref.shape), config, tp, rank, row_parallel)
        if got is not None:
            dim, ranges = got
            numel = numel // ref.shape[dim] * sum(hi - lo for lo, hi in ranges)
        total += numel * ref.element_size()
    return total


# ------------------------------------------------------------------------------------------------ sources
class _Source:
    """The stored tensors of one checkpoint, addressed by Diffusers key: full shape, dtype, and `read(dim, ranges)`
    returning the concatenation of those ranges (only they leave the file)."""

    def __init__(self, target: Path, layout: str, qkv_layout: str | None, config: H3Config, stack: Any):
        from safetensors import safe_open

        self.config = config
        wf = discovery.find_weight_files(target)
        key_files = wf.key_files
        if not key_files:
            raise CheckpointError(f"{target}: the weight files hold no tensors")
        if keymap.PRUNED_KEY in key_files:
            raise CheckpointError(f"{key_files[keymap.PRUNED_KEY]}: key {keymap.PRUNED_KEY!r} marks a pruned "
                                  "MiniMax-H3 checkpoint, which this model cannot load; use the unpruned release")
        if layout == "auto":
            layout = keymap.detect_layout(key_files, str(target), single_file=len(wf.files) == 1 and target.is_file())
        self.layout = layout
        self.qkv = None if layout == "diffusers" else (qkv_layout or keymap.DEFAULT_QKV[layout])
        self.handles = {}
        for file in wf.files:
            try:
                self.handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            except Exception as exc:  # safetensors' own error types
                raise CheckpointError(f"{file}: cannot map safetensors file ({type(exc).__name__}: {exc})") from None
        infos = {k: wf.headers[f].tensors[k] for k, f in key_files.items()}
        # Diffusers key -> (stored key, kind, detail)
        self.entries: dict[str, tuple[str, str, int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.files = {k: str(f) for k, f in key_files.items()}
        for stored, info in infos.items():
            if stored in keymap.DROPPED_KEYS:
                continue
            dtype = SAFETENSORS_DTYPES.get(info.dtype)
            if dtype is None:
                raise CheckpointError(f"{self.files[stored]}: key {stored!r} has dtype {info.dtype}: weights must be "
                                      "floating point")
            new = stored if layout == "diffusers" else keymap.rename_original_key(stored)
            shape = tuple(info.shape)
            if layout != "diffusers" and new.endswith(".attn.qkv_proj.weight"):
                if len(shape) != 2 or shape[0] % 3:
                    raise CheckpointError(f"{self.files[stored]}: key {stored!r} has shape {list(shape)}: a fused "
                                          "QKV needs 3*H*D rows")
                base = new[: -len("qkv_proj.weight")]
                for j, name in enumerate(("to_q", "to_k", "to_v")):
                    self._put(f"{base}{name}.weight", (stored, "qkv", j), (shape[0] // 3, shape[1]), dtype)
            elif layout != "diffusers" and new.endswith((".ff.net.0.proj.weight", ".ff.net.0.proj.bias")):
                if shape[0] % 2:
                    raise CheckpointError(f"{self.files[stored]}: key {stored!r} has {shape[0]} rows: fc1 needs "
                                          "[gate; value] halves")
                self._put(new, (stored, "swap", 0), shape, dtype)
            else:
                self._put(new, (stored, "plain", 0), shape, dtype)

    def _put(self, key, entry, shape, dtype) -> None:
        if key in self.entries:
            raise CheckpointError(f"{self.files[entry[0]]}: keys {self.entries[key][0]!r} and {entry[0]!r} both map "
                                  f"to {key!r}")
        self.entries[key], self.shapes[key], self.dtypes[key] = entry, shape, dtype

    def source(self, key: str) -> str:
        stored = self.entries[key][0]
        return self.files[stored] if stored == key else f"{self.files[stored]}:{stored}"

    def _slice(self, stored: str):
        return self.handles[Path(self.files[stored])].get_slice(stored)

    def read(self, key: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        stored, kind, j = self.entries[key]
        pieces = [self._read_range(key, stored, kind, j, dim, lo, hi) for lo, hi in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def _read_range(self, key, stored, kind, j, dim, lo, hi) -> torch.Tensor:
        sl = self._slice(stored)
        full = self.shapes[key]
        if kind == "plain":
            if dim == 0 and (lo, hi) == (0, full[0]):
                handle = self.handles[Path(self.files[stored])]
                return handle.get_tensor(stored)  # memory-mapped, copy-on-write: no host copy
            return sl[lo:hi] if dim == 0 else sl[:, lo:hi]
        if kind == "swap":  # Diffusers [value; gate] rows -> stored fc1 [gate; value] rows
            if dim != 0:
                raise DistributedError(f"{key}: fc1 is split by rows only")
            half = full[0] // 2
            parts = []
            for a, b in ((lo, min(hi, half)), (max(lo, half), hi)):
                if a < b:
                    parts.append(sl[a + half:b + half] if a < half else sl[a - half:b - half])
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        rows = full[0]  # kind "qkv": H * D rows of projection j
        if self.qkv == "stacked":
            return sl[j * rows + lo:j * rows + hi] if dim == 0 else sl[j * rows:(j + 1) * rows, lo:hi]
        head_dim = self._head_dim(key, stored)
        if dim != 0 or lo % head_dim or hi % head_dim:
            raise DistributedError(f"{key}: an interleaved fused QKV is read by whole heads of {head_dim} rows")
        h0, h1 = lo // head_dim, hi // head_dim
        block = sl[h0 * 3 * head_dim:h1 * 3 * head_dim]  # (heads, 3, D) rows of the rank's heads
        return block.view(h1 - h0, 3, head_dim, block.shape[-1])[:, j].reshape(hi - lo, block.shape[-1])

    def _head_dim(self, key: str, stored: str) -> int:
        norm = stored[: -len("qkv_proj.weight")] + "q_norm.weight"
        if norm not in self.files:
            raise CheckpointError(f"{self.files[stored]}: key {stored!r} needs {norm!r} (its head width) to "
                                  "de-interleave")
        head_dim = int(self._slice(norm).get_shape()[0])
        c = self.config
        heads = self.shapes[key][0] // head_dim
        if (heads, head_dim) != (c.num_attention_heads, c.attention_head_dim):
            raise CheckpointError(f"{self.files[stored]}: key {stored!r} holds {heads} heads x {head_dim}, config "
                                  f"says {c.num_attention_heads} x {c.attention_head_dim}")
        return head_dim


def load_shard_state_dict(path, config: H3Config | None = None, tp: int = 1, rank: int = 0,
                          row_parallel: str = "auto", layout: str = "auto", qkv_layout: str | None = None,
                          device=None, dtype_policy: str = "released", subfolder: str | None = None) -> StateDict:
    """Rank `rank`'s Diffusers-keyed tensors at TP degree `tp` (module docstring). `config`: read from the
    component's config.json when None (H3Config.full() for a bare file)."""
    if dtype_policy not in DTYPE_POLICIES:
        raise CheckpointError(f"dtype_policy={dtype_policy!r}: must be one of {', '.join(DTYPE_POLICIES)}")
    keymap.check_layout(layout, qkv_layout)
    target = discovery.resolve_component(path, subfolder)
    config = _read_config(target) if config is None else config
    _check(config, tp, rank, row_parallel)
    expected = _expected(config, dtype_policy)
    out = StateDict()
    with contextlib.ExitStack() as stack:
        src = _Source(target, layout, qkv_layout, config, stack)
        sources = {k: src.source(k) for k in src.entries}
        wanted = check_entries({k: (src.shapes[k], src.dtypes[k]) for k in src.entries}, sources, expected, target,
                               "H3Transformer", dtype_policy)
        for key, want in wanted.items():
            got = shard_ranges(key, src.shapes[key], config, tp, rank, row_parallel)
            dim, ranges = got if got is not None else _full_ranges(src.shapes[key])
            tensor = src.read(key, dim, ranges)
            if device is not None and torch.device(device).type != "cpu":
                tensor = tensor.to(device)
            out[key] = tensor.to(want) if tensor.dtype != want else tensor
        out.sources = sources
        out.layout, out.qkv_layout = src.layout, src.qkv
    out.fingerprint = f"{Path(target).name}:{component_hash(target)[:16]}"
    return out


# ------------------------------------------------------------------------------------------ counter random
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) (int64), in two 16-bit halves of c: no product reaches 2^63."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _keys(seed: int, key: str) -> tuple[int, int]:
    d = hashlib.sha256(f"h3lab-counter-random-v1|{seed}|{key}".encode()).digest()
    return int.from_bytes(d[:4], "little"), int.from_bytes(d[4:8], "little")


def counter_uniform(seed: int, key: str, index: torch.Tensor) -> torch.Tensor:
    """float32 uniforms of unit variance on (-sqrt 3, sqrt 3), one per int64 flat index (< 2^32) of tensor `key`:
    a function of (seed, key, index) only."""
    k1, k2 = _keys(seed, key)
    h = _fmix32(_fmix32((index + k1) & _M32) ^ k2)
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 2 ** 24)  # (0, 1), exact in float32
    return (u * 2.0 - 1.0) * math.sqrt(3.0)


def _counter_tensor(seed: int, key: str, full_shape, dim: int, ranges, device, scale, offset,
                    chunk: int = 1 << 24) -> torch.Tensor:
    """The ranges of the full tensor's counter uniforms, `offset + scale * u`, float32, built on `device` in row
    chunks of about `chunk` elements."""
    if len(full_shape) == 1:
        idx = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in ranges])
        return offset + scale * counter_uniform(seed, key, idx)
    n_cols = full_shape[1]
    along = torch.cat([torch.arange(lo, hi, device=device) for lo, hi in ranges])
    rows = along if dim == 0 else torch.arange(full_shape[0], device=device)
    cols = along if dim == 1 else torch.arange(n_cols, device=device)
    out = torch.empty(len(rows), len(cols), dtype=torch.float32, device=device)
    step = max(1, chunk // max(1, len(cols)))
    for a in range(0, len(rows), step):
        idx = rows[a:a + step, None] * n_cols + cols[None, :]
        out[a:a + step] = offset + scale * counter_uniform(seed, key, idx)
    return out


def random_shard_state_dict(config: H3Config, seed: int, tp: int = 1, rank: int = 0, row_parallel: str = "auto",
                            device=None, dtype_policy: str = "released",
                            keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Rank `rank`'s counter-random tensors at TP degree `tp` (module docstring), in the policy's dtypes; `keys`:
    only those (default: all)."""
    _check(config, tp, rank, row_parallel)
    device = torch.device("cpu") if device is None else torch.device(device)
    out = {}
    for key, ref in _expected(config, dtype_policy).items():
        if keys is not None and key not in keys:
            continue
        shape = tuple(ref.shape)
        if len(shape) == 1 and key.endswith(".weight"):  # RMSNorm weights
            scale, offset = 0.2, 1.0
        elif key.endswith(".bias"):
            scale, offset = 0.3, 0.0
        else:
            scale, offset = 1.0 / math.sqrt(shape[-1]), 0.0
        got = shard_ranges(key, shape, config, tp, rank, row_parallel)
        dim, ranges = got if got is not None else _full_ranges(shape)
        out[key] = _counter_tensor(seed, key, shape, dim, ranges, device, scale, offset).to(ref.dtype)
    return out


def read_whole_checkpoint(target, config: H3Config, layout: str, qkv_layout: str | None, dtype_policy: str,
                          keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The whole (one-process) tensors `keys` of a checkpoint, on the CPU in the policy's dtypes -- what
    `load_shard_state_dict` at tp 1 holds for them (`model.h3lab_read_whole` of a model holding only its shard)."""
    with contextlib.ExitStack() as stack:
        src = _Source(Path(target), layout, qkv_layout, config, stack)
        out = {}
        for key in keys:
            if key not in src.entries:
                raise CheckpointError(f"{target}: the checkpoint holds no tensor {key!r}")
            tensor = src.read(key, *_full_ranges(src.shapes[key])).clone()
            want = released_dtype(key) if dtype_policy == "released" else torch.float32  # check_entries' rule
            out[key] = tensor.to(want) if tensor.dtype != want else tensor
    return out


# ------------------------------------------------------------------------------------------------ models
def _assemble(config: H3Config, tensors: dict[str, torch.Tensor], dtype_policy: str, device, fingerprint: str,
              shard: tuple | None, read_whole=None):
    """An H3Transformer built on the meta device holding `tensors` (possibly sharded shapes), frozen, eval."""
    from ..model import H3Transformer

    with torch.device("meta"):
        model = H3Transformer(config, dtype_policy=dtype_policy)
    for key, tensor in tensors.items():
        path, _, leaf = key.rpartition(".")
        module = model.get_submodule(path)
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"sharded model still has meta parameters: {', '.join(leftover[:4])}")
    model.reset_buffers(device if device is not None else "cpu")
    model.fingerprint = fingerprint
    model.dtype_policy = dtype_policy
    model.h3lab_shard = shard
    if shard is not None:  # the block ranking of layer thinning reads whole tensors (presets.layer_thinning)
        model.h3lab_read_whole = read_whole
    return model.eval()


def _mesh_shard(mesh) -> tuple[int, int, str]:
    t = mesh.topology
    return t.tp, mesh.local_rank("tp"), tree_strategy(t.tp, t.row_parallel)


def load_sharded_transformer(path, mesh, subfolder: str | None = None, device=None, dtype_policy: str = "released",
                             *, layout: str = "auto", qkv_layout: str | None = None, config: H3Config | None = None):
    """This rank's `H3Transformer` holding only its TP shard, read from the checkpoint (module docstring)."""
    target = discovery.resolve_component(path, subfolder)
    config = _read_config(target) if config is None else config
    tp, rank, strategy = _mesh_shard(mesh)
    device = mesh.device if device is None else torch.device(device)
    sd = load_shard_state_dict(target, config, tp, rank, mesh.topology.row_parallel, layout, qkv_layout,
                               device=device, dtype_policy=dtype_policy)
    read = functools.partial(read_whole_checkpoint, target, config, sd.layout, sd.qkv_layout, dtype_policy)
    return _assemble(config, dict(sd), dtype_policy, device, sd.fingerprint, (tp, rank, strategy), read)


def random_sharded_transformer(config: H3Config, mesh=None, seed: int = 0, device=None,
                               dtype_policy: str = "released"):
    """A counter-random `H3Transformer`: this rank's shard on `mesh`, or the full model with `mesh=None`."""
    tp, rank, strategy = _mesh_shard(mesh) if mesh is not None else (1, 0, "k_chunks")
    row_parallel = mesh.topology.row_parallel if mesh is not None else "auto"
    device = (mesh.device if mesh is not None else torch.device("cpu")) if device is None else torch.device(device)
    tensors = random_shard_state_dict(config, seed, tp, rank, row_parallel, device, dtype_policy)

    def read(keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return random_shard_state_dict(config, seed, 1, 0, "auto", "cpu", dtype_policy, keys=tuple(keys))

    return _assemble(config, tensors, dtype_policy, device, f"random-counter:{seed}",
                     (tp, rank, strategy) if mesh is not None and tp > 1 else None, read)
