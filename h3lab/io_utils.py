"""Output paths: checked before any work, written atomically, several written as one set.

Checks (`check_output_file`, `check_output_dir`), run before a model loads so a bad path costs nothing:
- a file: its suffix is one the caller allows; it is not an existing folder or special file; the nearest existing
  folder above it is a folder that accepts new files (probed by creating and removing an empty temp file there: the
  permission bits say nothing about /proc, read-only mounts or root);
- a folder: it is not an existing file; it (or, when it does not exist yet, its nearest existing parent) accepts new
  files the same way.
Every error is an `OutputError` naming the user's path (and `what`, the flag or command that gave it).

Writes: `atomic_write(path, writer)` calls `writer(tmp)` on a temp file in the target folder, fsyncs, then renames
it over the target, so a reader never sees a half-written file and a crash leaves the previous version in place.
`atomic_write_all([(path, writer), ...])` writes every temp file first and renames them only when all succeeded,
so a failing set leaves no partial outputs and no temp file. OS errors become `OutputError` naming the target.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from .errors import OutputError

Writer = Callable[[str], None]


# ------------------------------------------------------------------------------------------------ checks
def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink() and p != p.parent:
        p = p.parent
    return p


def _accepts_files(folder: Path, label: str) -> None:
    """Create and remove an empty temp file in `folder`: the only reliable writability test."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".h3lab-probe-", dir=folder)
    except OSError as err:
        raise OutputError(f"{label}: folder {str(folder)!r} does not accept new files ({err.strerror or err})") from None
    os.close(fd)
    os.unlink(probe)


def _label(what: str, path: Any) -> str:
    return f"{what} {str(path)!r}" if what else repr(str(path))


def _as_path(path: Any, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise OutputError(f"{what or 'output'}={path!r}: must be a file or folder path")
    return Path(path).expanduser()


def _check_parent_chain(p: Path, label: str) -> Path:
    """The nearest existing ancestor of `p` (exclusive) must be a folder accepting files."""
    base = _nearest_existing(p.parent)
    if not base.is_dir():
        raise OutputError(f"{label}: {str(base)!r} is a file, so no folder can be created under it")
    _accepts_files(base, label)
    return base


def check_output_file(path: Any, suffixes: Sequence[str], what: str = "") -> Path:
    """A file the caller will write (see the module docstring). `suffixes`: allowed lower-case endings, e.g.
    (".mp4",); empty allows any. Returns the expanded path."""
    p = _as_path(path, what)
    label = _label(what, path)
    if suffixes and p.suffix.lower() not in suffixes:
        rule = " or ".join(suffixes)
        raise OutputError(f"{label}: must end in {rule}")
    if p.is_dir():
        raise OutputError(f"{label}: is an existing folder; give a file path")
    if p.exists() and not p.is_file():
        raise OutputError(f"{label}: exists and is not a regular file")
    _check_parent_chain(p, label)
    return p


def check_output_dir(path: Any, what: str = "") -> Path:
    """A folder the caller will create (if needed) and write files into (see the module docstring)."""
    p = _as_path(path, what)
    label = _label(what, path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{label}: exists and is not a folder")
    if p.is_dir():
        _accepts_files(p, label)
    else:
        _check_parent_chain(p, label)
    return p


def check_distinct(paths: Iterable[tuple[str, Path | None]]) -> None:
    """Two outputs of one request must not name the same path."""
    seen: dict[Path, str] = {}
    for what, path in paths:
        if path is None:
            continue
        key = Path(os.path.abspath(path))
        if key in seen:
            raise OutputError(f"{what} {str(path)!r}: the same path as {seen[key]}; give each output its own path")
        seen[key] = what


# ------------------------------------------------------------------------------------------------ writes
def _stage(path: Path, writer: Writer) -> str:
    """Write `path`'s content to a fresh temp file beside it (fsynced, usual permissions); returns the temp name."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise OutputError(f"output {str(path)!r}: cannot create it ({err.strerror or err})") from None
    os.close(fd)
    try:
        writer(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; artifacts get the usual permissions
    except OSError as err:
        _discard([tmp])
        raise OutputError(f"output {str(path)!r}: cannot write it ({err.strerror or err})") from None
    except BaseException:
        _discard([tmp])
        raise
    return tmp


def _discard(tmps: Iterable[str]) -> None:
    for tmp in tmps:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def atomic_write_all(items: Sequence[tuple[str | os.PathLike, Writer]]) -> list[Path]:
    """Write every `(path, writer)` to a temp file, then rename all of them (see the module docstring)."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, writer in items:
            target = Path(path)
            staged.append((_stage(target, writer), target))
    except BaseException:
        _discard(tmp for tmp, _ in staged)
        raise
    done = 0
    try:
        for tmp, target in staged:
            os.replace(tmp, target)
            done += 1
    except OSError as err:
        _discard(tmp for tmp, _ in staged[done:])
        raise OutputError(f"output {str(staged[done][1])!r}: cannot move it into place ({err.strerror or err})") from None
    return [target for _, target in staged]


def atomic_write(path: str | os.PathLike, writer: Writer) -> Path:
    """Call `writer(tmp_path)` to produce the file, then atomically move it to `path`."""
    return atomic_write_all([(path, writer)])[0]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def bytes_writer(data: bytes) -> Writer:
    def writer(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    return writer


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, bytes_writer(data))


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
