"""The content hash of a checkpoint component (`component_hash`), read from safetensors headers and small samples.

Contract
- `component_hash(path) -> str`: SHA-256 hex of a component folder or one weight file under ``HASH_SCHEME``.
  `component_files(path)` lists the files it covers: every file under the folder in sorted relative-path order,
  hidden files and folders (`.cache/` and friends) skipped.
- Scheme ``HASH_SCHEME``: per file its relative path and size, then for `*.safetensors` the raw JSON header (names,
  dtypes, shapes, offsets) followed by a **sample** of each tensor: its middle `SAMPLE_BYTES` (64) bytes, or all of
  it when smaller; for any other file its whole content when <= 32 MiB (configs, tokenizer) else its first and last
  MiB. Header bytes alone would give two checkpoints of one architecture (e.g. `transformer/` and
  `transformer_ref/`) the same hash; the per-tensor sample tells them apart. Cost: one header read per shard plus
  one 64-byte `pread` per tensor (~1,100 for the 33B release), i.e. milliseconds for a 62 GiB snapshot; nothing is
  memory-mapped. It identifies a checkpoint; it does **not** prove integrity (bytes outside the samples are not read).

Below both `info.py` (the `--info` report) and `loader.py` (a loaded model's `fingerprint`), so neither imports the
other.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from . import discovery

HASH_SCHEME = "h3lab-header-sample64-sha256-v1"
SAMPLE_BYTES = 64
_FULL_CONTENT_LIMIT = 32 * 1024 * 1024
_EDGE = 1024 * 1024


def component_files(path: Path) -> list[Path]:
    """The files `component_hash` covers: `path` itself, or every non-hidden file under it in relative-path order."""
    if path.is_file():
        return [path]
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # skip .cache/ and friends
        out.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
    return sorted(out, key=lambda p: p.relative_to(path).as_posix())


def component_hash(path: str | os.PathLike) -> str:
    """SHA-256 hex of a component folder (or one file) under HASH_SCHEME (headers + 64-byte tensor samples)."""
    path = Path(path)
    h = hashlib.sha256(HASH_SCHEME.encode())
    for file in component_files(path):
        rel = file.name if path.is_file() else file.relative_to(path).as_posix()
        size = file.stat().st_size
        h.update(f"\0{rel}\0{size}\0".encode())
        if file.suffix == ".safetensors":
            header = discovery.read_header(file)
            h.update(header.raw)
            _hash_samples(h, file, header)
        elif size <= _FULL_CONTENT_LIMIT:
            h.update(file.read_bytes())
        else:
            with open(file, "rb") as f:
                h.update(f.read(_EDGE))
                f.seek(size - _EDGE)
                h.update(f.read(_EDGE))
    return h.hexdigest()


def _hash_samples(h, file: Path, header: discovery.Header) -> None:
    """Feed the middle SAMPLE_BYTES of every tensor (in file order) to `h`: one pread each, no mapping."""
    base = 8 + len(header.raw)  # data section start
    fd = os.open(file, os.O_RDONLY)
    try:
        for t in sorted(header.tensors.values(), key=lambda t: t.offsets):
            begin, end = t.offsets
            n = min(SAMPLE_BYTES, end - begin)
            h.update(os.pread(fd, n, base + begin + (end - begin - n) // 2))
    finally:
        os.close(fd)
