"""Atomic artifact writes: write to a temp file in the target directory, fsync, then rename over the target, so a
reader never sees a half-written file and a crash leaves the previous version in place."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | os.PathLike, writer: Callable[[str], None]) -> Path:
    """Call `writer(tmp_path)` to produce the file, then atomically move it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; artifacts get the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    def writer(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return atomic_write(path, writer)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def atomic_write_dir(path: str | os.PathLike, writer: Callable[[Path], None]) -> Path:
    """Call `writer(tmp_dir)` to fill a hidden sibling directory, then rename it onto `path`. An existing directory
    at `path` is moved aside first and removed only after the rename, so a reader sees the old artifact or the new
    one, never a mix; on failure the old one is put back. Files inside should be written with the atomic writers
    above (fsynced), and the one that marks the artifact complete (a manifest) last."""
    import shutil
    import time

    target = Path(path)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{str(target)!r} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    old = None
    try:
        writer(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        if old is not None and not target.exists():
            os.replace(old, target)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
