"""The device a run is asked for, checked before anything loads (`resolve_device`), and the default one.

Below every room that takes a `--device` / `device=` (the session, the training jobs, the CLI's preflight): it
imports nothing of h3lab but `errors`.
"""

from __future__ import annotations

import torch

from ..errors import ValidationError


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a session runs on, checked before anything loads: `None` is `default_device()`; "cpu"; "cuda" or
    "cuda:N" only when this torch build has CUDA and GPU N exists. Anything else is a one-line `ValidationError`."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValidationError(f"device={device!r}: not a device name (cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValidationError(f"device={device!r}: h3lab runs on cpu or cuda (strict kernels exist for those two)")
    if torch.version.cuda is None:
        raise ValidationError(f"device={device!r}: this torch build ({torch.__version__}) has no CUDA; use --device cpu")
    if not torch.cuda.is_available():
        raise ValidationError(f"device={device!r}: no CUDA GPU is visible to torch {torch.__version__}; use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValidationError(f"device={device!r}: GPU {dev.index} does not exist ({count} visible: cuda:0..{count - 1})")
    return dev
