"""The manifest of `h3lab encode`: a folder of clips and a CSV or JSONL file naming each clip and its prompt (the
convention of video fine-tuning tools: Hugging Face's `metadata.csv` / `metadata.jsonl` with `file_name`).

Contract
- `read_manifest(manifest, videos) -> (rows, problems)`: `rows` are the good `Row`s (line, file as written, resolved
  path, prompt) in file order; `problems` one line per bad row, naming the manifest line and the rule. Nothing is
  decoded here (the clips' own rules are `h3lab.app.clips_in.check_clip`'s).
- The file: `.csv` (a header row, then one row a clip; Python's csv dialect: commas, double quotes) or `.jsonl` (one
  JSON object a line; blank lines skipped), UTF-8 (a BOM is allowed; a row holding bytes that are not UTF-8 is
  named, the rest still read). The clip column is the one header / key of
  `FILE_KEYS` the file has, the prompt column the one of `PROMPT_KEYS`; none or two of them is an error of the file.
- A row is refused when its file is empty, absolute, escapes the folder (after resolving `..` and symlinks), is
  missing or not a regular file, or repeats an earlier row's clip; or when its prompt is missing, not text, not
  UTF-8 or blank (`settings.check_prompt`). A file error (missing, unreadable, a bad header or JSON line, no rows)
  raises `ValidationError` at once.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ValidationError
from ..schema.generation_settings import check_prompt

FILE_KEYS = ("file_name", "video", "path")
PROMPT_KEYS = ("prompt", "caption", "text")


@dataclass(frozen=True)
class Row:
    line: int  # 1-based line of the manifest the row starts on
    file: str  # as written
    path: Path  # resolved, inside the clips folder
    prompt: str


def _key(keys: list[str], wanted: tuple[str, ...], what: str, where: str) -> str:
    found = [k for k in wanted if k in keys]
    if len(found) != 1:
        have = ", ".join(repr(k) for k in keys) or "none"
        rule = "has none" if not found else f"has {len(found)} ({', '.join(found)})"
        raise ValidationError(f"{where}: the {what} column must be exactly one of {', '.join(wanted)}; it {rule} "
                              f"(columns: {have})")
    return found[0]


def _records(manifest: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line, record) of every row of the file."""
    where = f"--manifest {str(manifest)!r}"
    if manifest.suffix.lower() not in (".csv", ".jsonl"):
        raise ValidationError(f"{where}: must be a .csv or .jsonl file")
    if not manifest.is_file():
        raise ValidationError(f"{where}: {'no such file' if not manifest.exists() else 'not a regular file'}")
    try:
        data = manifest.read_bytes()
    except OSError as err:
        raise ValidationError(f"{where}: cannot read it ({err.strerror or err})") from None
    # Bytes that are not UTF-8 survive as surrogates, so the row holding them is named (`check_prompt`).
    text = data.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "surrogateescape")
    out: list[tuple[int, dict[str, Any]]] = []
    if manifest.suffix.lower() == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValidationError(f"{where} line {n}: not JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict):
                raise ValidationError(f"{where} line {n}: must be a JSON object, not {type(record).__name__}")
            out.append((n, record))
    else:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            start = 2
            for record in reader:
                if None in record:
                    raise ValidationError(f"{where} line {start}: more fields than the header's "
                                          f"{len(reader.fieldnames or [])}")
                if any((v or "").strip() for v in record.values()):
                    out.append((start, record))
                start = reader.line_num + 1
        except csv.Error as err:
            raise ValidationError(f"{where} line {reader.line_num}: not CSV ({err})") from None
        if reader.fieldnames is None:
            raise ValidationError(f"{where}: is empty (a header row naming the clip and prompt columns comes first)")
    if not out:
        raise ValidationError(f"{where}: has no rows (one clip and its prompt a row)")
    return out


def read_manifest(manifest: str | os.PathLike, videos: str | os.PathLike) -> tuple[list[Row], list[str]]:
    """(good rows, one problem line per bad row) of a manifest over the clips folder `videos` (module docstring)."""
    manifest, folder = Path(manifest), Path(videos)
    if not folder.is_dir():
        raise ValidationError(f"--videos {str(videos)!r}: {'no such folder' if not folder.exists() else 'not a folder'}")
    records = _records(manifest)
    keys = sorted({k for _, r in records for k in r}, key=lambda k: (k not in FILE_KEYS + PROMPT_KEYS, k))
    where = f"--manifest {str(manifest)!r}"
    file_key, prompt_key = _key(keys, FILE_KEYS, "clip", where), _key(keys, PROMPT_KEYS, "prompt", where)
    root = folder.resolve()
    rows, problems, seen = [], [], {}
    for line, record in records:
        at = f"{manifest.name} line {line}"
        name, prompt = record.get(file_key), record.get(prompt_key)
        if not isinstance(name, str) or not name.strip():
            problems.append(f"{at}: {file_key}={name!r}: must name a clip in --videos")
            continue
        path = Path(name)
        resolved = (root / path).resolve()
        if path.is_absolute() or not resolved.is_relative_to(root):
            problems.append(f"{at}: {file_key}={name!r}: escapes --videos {str(videos)!r} (give a path inside it)")
            continue
        if not resolved.is_file():
            state = "no such file" if not resolved.exists() else "not a regular file"
            problems.append(f"{at}: {file_key}={name!r}: {state} in --videos {str(videos)!r}")
            continue
        if resolved in seen:
            problems.append(f"{at}: {file_key}={name!r}: the same clip as line {seen[resolved]} (each clip once)")
            continue
        seen[resolved] = line
        try:
            check_prompt(prompt if prompt is not None else None)
        except ValidationError as err:
            problems.append(f"{at}: {prompt_key}: {err}" if prompt is not None else f"{at}: no {prompt_key}")
            continue
        rows.append(Row(line, name, resolved, prompt))
    return rows, problems
