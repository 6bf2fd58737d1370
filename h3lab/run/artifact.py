"""The sealed-artifact base that `Trajectory`, `TrainingRun` and `GrpoRun` share: seal, load, check stored tensors.

Contract
--------
A sealed artifact is a directory of safetensors files and `manifest.json` (JSON with a `format` key). A subclass
(a dataclass with `manifest: dict` and `path: Path | None` fields) names its `FORMAT`, what it is (`WHAT`, "a sealed
trajectory"), its error class (`ERROR`, an `H3Error`), and returns its tensors from `tensor_files()`:
file name -> {key: tensor}.

- `seal(path)` writes every non-empty tensor file (safetensors, metadata {"format": FORMAT}, fsynced) and the
  manifest last into a hidden sibling directory, renamed onto `path` (`io_utils.atomic_write_dir`): a reader sees the
  old artifact or the new one, never a mix. A `path` that exists and is not a directory raises `ERROR` naming it.
  Sets and returns `self.path`.
- `read_manifest(root, required=())` (classmethod): `root/manifest.json` as a dict of format `FORMAT` holding every
  `required` key; a missing, unreadable, other-format or incomplete manifest raises `ERROR` naming it.
- `read_tensors(file, expected, what="")` (classmethod): the safetensors file, each tensor checked against
  `expected` (name -> SHA-256, scheme "sha256"): an unreadable file, a missing or extra tensor or a changed one raises
  `ERROR` naming the file and the tensor (`what` prefixes the phrase: "sealed input ", "kept ").
- `stored_mismatch(tensors, digests, scheme, device)`: for verify, which re-runs an artifact and also checks that the
  tensors it stores are the ones its records sealed (the digest of each, under the record's hash scheme on the
  re-running device): None, or the first tensor name whose digest differs (or is missing).
- `code_provenance()`: the manifest's `code` entry (revision, h3lab version, library versions); `code_revision()`:
  `git:<sha>[+dirty]` of the checkout, else `h3lab-<version>`.

The verify half of each artifact (what it re-runs and compares) stays with it: a trajectory replays a `RunSpec`, a
training run its steps, a GRPO run its iterations; each reports the first difference.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

import torch

from .. import __version__
from ..errors import H3Error
from ..hashing import digest_mismatch, tensor_digest
from ..io_utils import atomic_save_safetensors, atomic_write_dir, atomic_write_json

MANIFEST = "manifest.json"


def code_revision() -> str:
    """`git:<sha>[+dirty]` of the h3lab checkout when it is a git work tree, else `h3lab-<version>`."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()
        return f"git:{rev}{'+dirty' if dirty else ''}"
    except (OSError, subprocess.SubprocessError):
        return f"h3lab-{__version__}"


def code_provenance() -> dict[str, Any]:
    """The `code` entry every sealed manifest holds."""
    from ..execution import runtime

    return {"revision": code_revision(), "h3lab": __version__, "versions": runtime.versions()}


def stored_mismatch(tensors: Mapping[str, torch.Tensor | None], digests: Mapping[str, str], scheme: str,
                    device: torch.device | str) -> str | None:
    """The first name in `digests` whose stored tensor is missing or hashes (scheme `scheme`, on `device`) to
    another digest; None when every one matches."""
    for name, digest in digests.items():
        stored = tensors.get(name)
        if stored is None or tensor_digest(stored.to(device), scheme) != digest:
            return name
    return None


class SealedArtifact:
    """The shared seal / read half of a sealed artifact (see the module docstring)."""

    FORMAT: ClassVar[str] = ""
    WHAT: ClassVar[str] = "a sealed artifact"
    ERROR: ClassVar[type[H3Error]] = H3Error

    manifest: dict[str, Any]
    path: Path | None

    def tensor_files(self) -> dict[str, Mapping[str, torch.Tensor]]:  # pragma: no cover - every subclass has one
        raise NotImplementedError

    def seal(self, path: str | os.PathLike) -> Path:
        """Write the artifact directory atomically (module docstring); returns its path."""
        target = Path(path)
        if target.exists() and not target.is_dir():
            raise self.ERROR(f"{str(target)!r} exists and is not a directory ({self.WHAT} is a directory)")
        files = self.tensor_files()

        def write(tmp: Path) -> None:
            for name, tensors in files.items():
                if tensors:
                    atomic_save_safetensors(tmp / name, dict(tensors), metadata={"format": self.FORMAT})
            atomic_write_json(tmp / MANIFEST, self.manifest)  # last: a directory with a manifest is complete

        try:
            self.path = atomic_write_dir(target, write)
        except FileExistsError as exc:  # raced: the path became a file meanwhile
            raise self.ERROR(str(exc)) from None
        return self.path

    @classmethod
    def read_manifest(cls, root: str | os.PathLike, required: Sequence[str] = ()) -> dict[str, Any]:
        """`root/manifest.json` of format `FORMAT` with every `required` key (module docstring)."""
        return read_manifest(Path(root), cls.FORMAT, cls.WHAT, cls.ERROR, required)

    @classmethod
    def read_tensors(cls, file: Path, expected: Mapping[str, str], what: str = "") -> dict[str, torch.Tensor]:
        """The tensors of `file`, each checked against its recorded SHA-256 (module docstring)."""
        return read_tensors(file, expected, cls.ERROR, what)


def read_manifest(root: Path, fmt: str, what: str, error: type[H3Error] = H3Error,
                  required: Sequence[str] = ()) -> dict[str, Any]:
    """`root/manifest.json` as a dict of format `fmt` holding `required`; anything else raises `error` saying `root`
    is not `what` (a sealed clip dataset reads through this too)."""
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise error(f"{str(root)!r} is not {what}: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise error(f"{manifest_path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise error(f"{manifest_path}: format {got!r} is not {fmt!r}")
    for key in required:
        if key not in manifest:
            raise error(f"{manifest_path}: manifest lacks {key!r}")
    return manifest


def read_tensors(file: Path, expected: Mapping[str, str], error: type[H3Error] = H3Error,
                 what: str = "") -> dict[str, torch.Tensor]:
    """The tensors of safetensors `file`, each checked against `expected` (name -> SHA-256); raises `error`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise error(f"{file}: not a readable safetensors file ({exc})") from None
    problem = digest_mismatch(tensors, expected)
    if problem is not None:
        raise error(f"{file}: {what}{problem} (manifest)")
    return tensors
