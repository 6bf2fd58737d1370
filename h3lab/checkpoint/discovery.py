"""Find things in a snapshot without reading tensor data: the snapshot root, its components, a component's weight
files (single file, shards + index json, MiniMax original shards) and the safetensors headers.

Contract
- A **snapshot root** is a folder with `model_index.json`; each entry `name: [library, class]` names a component
  subfolder. A **component folder** holds `config.json` (or another `*config.json`) and weights. A **weight file** is
  a `*.safetensors` file.
- `resolve_component(path, subfolder)` accepts a snapshot root (then `subfolder`, default `transformer`, picks the
  component; `t2va`/`fl2va` alias `transformer`, `ref2va`/`ref` alias `transformer_ref`), a component folder or a
  weight file, and returns the folder or file to load.
- `find_weight_files(path)` returns the shards to read, in order, and the index json when there is one. Rules, in
  order: a file path is itself the single weight file (an `*.index.json` path selects that index); in a folder, the
  one `*.safetensors.index.json` (Diffusers' `diffusion_pytorch_model.safetensors.index.json` is preferred when
  several exist) names the shards; else `diffusion_pytorch_model.safetensors`; else every `*.safetensors` in the
  folder, sorted by name. A `-NNNNN-of-MMMMM` shard series with a gap is reported as a missing shard.
- `read_header(file)` parses the safetensors header (8-byte little-endian length + JSON) and checks every tensor's
  byte range lies inside the file, so a truncated file is reported before anything maps it. It reads only the
  header bytes.
- Every failure is a one-line `CheckpointError` naming the file (and the key where there is one).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError

MODEL_INDEX = "model_index.json"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
TRANSFORMER_VARIANTS = {
    "transformer": "transformer", "t2va": "transformer", "fl2va": "transformer",
    "transformer_ref": "transformer_ref", "ref2va": "transformer_ref", "ref": "transformer_ref",
}
# A safetensors header larger than this is not a header (the 33B release's largest is a few hundred KB).
MAX_HEADER_BYTES = 64 * 1024 * 1024
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors$")

# safetensors dtype name -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors name: "BF16", "F32", ...
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # [begin, end) within the data section

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    path: Path
    raw: bytes  # the JSON header bytes exactly as stored (hashed by the fingerprint)
    file_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


@dataclass
class WeightFiles:
    files: list[Path]  # shards in read order
    index: Path | None = None  # the *.index.json naming them, if any
    weight_map: dict[str, str] | None = None  # key -> shard file name, from the index
    headers: dict[Path, Header] = field(default_factory=dict)

    @property
    def key_files(self) -> dict[str, Path]:
        """Every stored key -> the shard holding it (shard keys are checked against the index and each other)."""
        out: dict[str, Path] = {}
        for path in self.files:
            for key in self.headers[path].tensors:
                if key in out:
                    raise CheckpointError(f"{path}: key {key!r} is also stored in {out[key]} (duplicate key)")
                out[key] = path
        return out


# ------------------------------------------------------------------------------------------------- headers
def read_header(path: str | os.PathLike) -> Header:
    """Parse and bounds-check one safetensors header; reads 8 + header-length bytes of the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: {size} bytes is too short for a safetensors file (needs an 8-byte header length)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} does not fit the file size {size} "
                    "(not a safetensors file, or truncated)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = data.pop("__metadata__", None) or {}
    data_size = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for key, entry in data.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: key {key!r} has a malformed header entry {entry!r}") from None
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: key {key!r} has unknown dtype {dtype!r}")
        if not 0 <= begin <= end or end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise CheckpointError(
                f"{path}: key {key!r} byte range [{begin}, {end}) does not match {dtype} shape {list(shape)}"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: key {key!r} ends at data byte {end} but the file holds {data_size} data bytes "
                "(truncated file)"
            )
        tensors[key] = TensorInfo(dtype, shape, (begin, end))
    return Header(path=path, raw=raw, file_size=size, tensors=tensors, metadata=dict(metadata))


# -------------------------------------------------------------------------------------------- weight files
def find_weight_files(path: str | os.PathLike, read_headers: bool = True) -> WeightFiles:
    """The weight files of a component folder or a single weight/index file (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        if path.name.endswith(".index.json"):
            wf = _from_index(path)
        elif path.suffix == ".safetensors":
            wf = WeightFiles(files=[path])
        else:
            raise CheckpointError(f"{path}: not a .safetensors weight file or a .safetensors.index.json index")
    else:
        indexes = sorted(path.glob("*" + INDEX_SUFFIX))
        if indexes:
            preferred = [p for p in indexes if p.name == DIFFUSERS_WEIGHTS + ".index.json"]
            if len(indexes) > 1 and not preferred:
                names = ", ".join(p.name for p in indexes)
                raise CheckpointError(f"{path}: {len(indexes)} index files ({names}); keep one, or pass the index file")
            wf = _from_index(preferred[0] if preferred else indexes[0])
        elif (path / DIFFUSERS_WEIGHTS).is_file():
            wf = WeightFiles(files=[path / DIFFUSERS_WEIGHTS])
        else:
            files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors weight files in this folder")
            _check_series(path, files)
            wf = WeightFiles(files=files)
    if read_headers:
        wf.headers = {p: read_header(p) for p in wf.files}
        if wf.weight_map is not None:
            _check_index_against_shards(wf)
    return wf


def _from_index(index: Path) -> WeightFiles:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{index}: not a safetensors index (needs a non-empty 'weight_map' object)") from None
    order: list[str] = []
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise CheckpointError(f"{index}: key {key!r} maps to {shard!r}, which is not a file name in this folder")
        if shard not in order:
            order.append(shard)
    for shard in sorted(order):
        shard_path = index.parent / shard
        if not shard_path.is_file():
            first = next(k for k, s in weight_map.items() if s == shard)
            raise CheckpointError(f"{index}: names shard {shard!r} (key {first!r}) but {shard_path} does not exist")
    return WeightFiles(files=[index.parent / s for s in sorted(order)], index=index, weight_map=dict(weight_map))


def _check_series(folder: Path, files: list[Path]) -> None:
    """In an index-less folder, a `name-0000i-of-0000n.safetensors` series must be complete."""
    series: dict[tuple[str, int, int], set[int]] = {}  # (stem, shard count, digits) -> shard numbers present
    for p in files:
        m = _SHARD_RE.match(p.name)
        if m:
            series.setdefault((m["stem"], int(m["n"]), len(m["i"])), set()).add(int(m["i"]))
    for (stem, n, width), seen in series.items():
        for i in range(1, n + 1):
            if i not in seen:
                missing = f"{stem}-{i:0{width}d}-of-{n:0{width}d}.safetensors"
                raise CheckpointError(f"{folder / missing}: missing shard {i} of {n} (no index json in {folder})")


def _check_index_against_shards(wf: WeightFiles) -> None:
    assert wf.weight_map is not None and wf.index is not None
    for path in wf.files:
        stored = wf.headers[path].tensors
        for key, shard in wf.weight_map.items():
            if shard == path.name and key not in stored:
                raise CheckpointError(
                    f"{path}: index {wf.index.name} puts key {key!r} in this shard but it is not stored there"
                )
        for key in stored:
            if wf.weight_map.get(key) != path.name:
                raise CheckpointError(
                    f"{path}: stores key {key!r} which index {wf.index.name} "
                    + (f"puts in {wf.weight_map[key]}" if key in wf.weight_map else "does not list")
                )


# ------------------------------------------------------------------------------------------------ snapshots
@dataclass
class Snapshot:
    root: Path
    model_index: dict
    components: dict[str, Path]  # component name -> its folder, for every model_index entry present on disk
    missing: list[str]  # model_index entries whose folder is absent

    def library_class(self, name: str) -> tuple[str, str]:
        value = self.model_index.get(name)
        return (str(value[0]), str(value[1])) if isinstance(value, (list, tuple)) and len(value) == 2 else ("", "")


def is_snapshot_root(path: Path) -> bool:
    return path.is_dir() and (path / MODEL_INDEX).is_file()


def open_snapshot(path: str | os.PathLike) -> Snapshot:
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root}: no such snapshot folder")
    if not is_snapshot_root(root):
        raise CheckpointError(f"{root}: not a snapshot root (no {MODEL_INDEX})")
    try:
        index = json.loads((root / MODEL_INDEX).read_text(encoding="utf-8"))
        if not isinstance(index, dict):
            raise TypeError
    except (OSError, ValueError, TypeError):
        raise CheckpointError(f"{root / MODEL_INDEX}: not a JSON object") from None
    components, missing = {}, []
    for name, value in index.items():
        if name.startswith("_") or not (isinstance(value, (list, tuple)) and len(value) == 2):
            continue
        if value[0] is None:  # Diffusers writes [null, null] for an optional component left out
            continue
        if "/" in name or "\\" in name or name in (".", ".."):
            raise CheckpointError(f"{root / MODEL_INDEX}: component name {name!r} is not a folder name")
        folder = root / name
        if folder.is_dir():
            components[name] = folder
        else:
            missing.append(name)
    return Snapshot(root=root, model_index=index, components=components, missing=missing)


def resolve_component(path: str | os.PathLike, subfolder: str | None = None, default: str = "transformer") -> Path:
    """Snapshot root -> its `subfolder` (aliases in TRANSFORMER_VARIANTS); component folder or file -> itself."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if is_snapshot_root(path):
        name = TRANSFORMER_VARIANTS.get(subfolder or default, subfolder or default)
        snap = open_snapshot(path)
        if name not in snap.components:
            known = ", ".join(sorted(snap.components)) or "none"
            raise CheckpointError(f"{path}: snapshot has no component {name!r} (components present: {known})")
        return snap.components[name]
    if subfolder is not None:
        sub = path / TRANSFORMER_VARIANTS.get(subfolder, subfolder)
        if path.is_dir() and sub.is_dir():
            return sub
        raise CheckpointError(f"{path}: has no subfolder {subfolder!r} (and is not a snapshot root)")
    return path


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data
