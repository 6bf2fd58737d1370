"""User-facing errors. Each message is one line naming the offending value and the rule it breaks; front ends
print `str(err)` and keep the session.

`user_message(err)` is what a front end prints for *any* exception: an `H3Error`'s own line, or, for the failures a
user's environment can cause (files, encodings, devices, memory), one line in the same style naming the file or
device -- never an exception class name. Anything else is a bug; it gets a one-line "internal error" that says how
to see the traceback (`H3LAB_DEBUG=1`)."""

from __future__ import annotations


class H3Error(ValueError):
    """Base of every error a user can cause with bad input (paths, settings, media, checkpoints)."""


class CheckpointError(H3Error):
    """A snapshot or checkpoint file is missing, malformed, or does not match the config (names file and key)."""


class ValidationError(H3Error):
    """A generation setting breaks a rule (geometry, duration, references, anchors)."""


class CommandError(H3Error):
    """An unknown command or a bad argument (names the command, the value and the expected form)."""


class OutputError(ValidationError):
    """An output path (file or folder, given by a flag, a command or the environment) cannot be written; names the
    user's path, never a temporary file."""


def first_line(text: str) -> str:
    """The first non-blank line of `text`, stripped ("" when there is none)."""
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")


def user_message(err: BaseException) -> str:
    """One line for a front end to print (see the module docstring)."""
    if isinstance(err, H3Error):
        return first_line(str(err)) or "invalid input"
    if isinstance(err, UnicodeError):
        reason = getattr(err, "reason", "") or first_line(str(err))
        return f"text is not valid {getattr(err, 'encoding', None) or 'UTF-8'}: {reason}"  # callers name the file
    if isinstance(err, OSError):
        name = err.filename if err.filename is not None else ""
        reason = err.strerror or first_line(str(err)) or "input/output error"
        return f"{str(name)!r}: {reason}" if name != "" else f"input/output error: {reason}"
    if isinstance(err, MemoryError):
        return "out of memory: try a smaller size, fewer frames or --residency phased"
    if type(err).__name__ == "OutOfMemoryError":  # torch.cuda.OutOfMemoryError, without importing torch here
        return "out of GPU memory: try a smaller size, fewer frames or --residency phased"
    text = first_line(str(err))
    return f"internal error: {text or 'no message'} (set H3LAB_DEBUG=1 for the traceback)"
