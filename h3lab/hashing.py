"""Hashing, the leaf every sealed artifact stands on: tensor digests, the device checksum, the weights fingerprint.

Contract
--------
`tensor_digest(t, scheme)` hashes a tensor's *bytes* and dtype (not its shape: (B, S, H*D) and (B, S, H, D) views of
one buffer hash alike). Schemes:

- ``sha256`` SHA-256 over `dtype|nbytes|` and the raw little-endian bytes. On CPU the bytes are read in place (a
  zero-copy numpy view of the contiguous tensor); on CUDA they are copied to the host, which is the only host copy
  the trajectory recorder makes. Trajectories and run specs always use this scheme: their tensors are the latents,
  velocities and sealed inputs (a few MB).
- ``device`` for activations on an accelerator (drift capture): the bytes are read as unsigned 16-bit words w_i and
  reduced on the device to two lanes L_k = sum_i (w_i * c_k(i) mod p) mod p, p = 2^31 - 1, with pseudo-random
  coefficients c_k(i) in [0, 2^31) from a splitmix-style integer mix of (i, k) (int64 wrap-around arithmetic). Every
  term is an exact integer, so the sum does not depend on the reduction order; chunks of 2^22 words bound the
  temporaries. On CUDA one Triton pass computes them (`h3kernels.digest`, exact integers, so the same lanes as the
  torch formulation). Only the two lanes (16 bytes) go to the host, where SHA-256 over `dtype|nbytes|device-v1|` and the
  lanes gives the digest. Two different byte strings collide with probability ~2^-62 per pair (non-adversarial).
- ``auto`` is ``sha256`` on CPU and ``device`` on CUDA.
Digests of different schemes are not comparable; whatever records one records its scheme.

`model_fingerprint(model)` is the checkpoint identity a run records (the loader's fingerprint, else a cached digest
of every weight). `json_sha256(obj)` is SHA-256 of sorted-key, compact JSON: the identity of a JSON description.
`digest_mismatch(tensors, expected)` checks sealed tensors against their recorded SHA-256. `key_seed(key)` is the
63-bit seed the training rooms derive from a text key: the first 8 bytes of SHA-256(key) read little-endian, shifted
right by one bit.

This module imports nothing of h3lab but its errors (and, lazily, the `h3kernels.digest` kernel).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch

from .errors import H3Error

HASH_SCHEMES = ("sha256", "device", "auto")


class HashError(H3Error):
    """A hash scheme or implementation name breaks a rule."""


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
    raise HashError(f"device_lanes impl {impl!r}: must be auto, kernel or torch")


def _device_digest(t: torch.Tensor) -> str:
    nbytes = t.numel() * t.element_size()
    h = hashlib.sha256(_header(t, nbytes, "device-v1"))
    for lane in device_lanes(t):
        h.update(lane.to_bytes(8, "little"))
    return h.hexdigest()


def resolve_scheme(scheme: str, device: torch.device | str) -> str:
    if scheme not in HASH_SCHEMES:
        raise HashError(f"hash scheme {scheme!r}: must be one of {', '.join(HASH_SCHEMES)}")
    if scheme == "auto":
        return "device" if torch.device(device).type != "cpu" else "sha256"
    return scheme


def tensor_digest(t: torch.Tensor, scheme: str = "sha256") -> str:
    """Hex digest of `t`'s dtype and bytes under `scheme` ("sha256" | "device" | "auto")."""
    scheme = resolve_scheme(scheme, t.device)
    return _sha256_digest(t) if scheme == "sha256" else _device_digest(t)


def digest_mismatch(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, str]) -> str | None:
    """None when `tensors` are exactly the tensors `expected` names, each with its recorded SHA-256 (scheme
    "sha256"); else a phrase naming the first difference."""
    if set(tensors) != set(expected):
        return f"tensors {sorted(set(tensors) ^ set(expected))[:4]} do not match the record"
    for name, digest in expected.items():
        if tensor_digest(tensors[name], "sha256") != digest:
            return f"tensor {name!r} does not match its recorded sha256"
    return None


def key_seed(key: str) -> int:
    """63 bits of SHA-256 of `key` (module docstring): `int.from_bytes(sha256(key)[:8], "little") >> 1`."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def json_sha256(obj: Any) -> str:
    """SHA-256 of `obj` as sorted-key, compact JSON (the identity of a JSON description)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_fingerprint(model: Any) -> str:
    """The checkpoint identity a run records: `model.fingerprint` when the loader set one, else a digest of every
    parameter and persistent buffer (name, dtype, bytes; device scheme on accelerators).

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
