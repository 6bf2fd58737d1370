"""Skipping transformer blocks from outside the model: the one mechanism layer thinning and core reuse share.

`skip_blocks(model, skip)` gives every block `i` of `model.transformer_blocks` an instance `forward` that returns
its input stream `x` unchanged while `skip(i)` is true and calls the forward it had before otherwise (accelerate's
way of overriding a module's forward: the module keeps its Diffusers path, its parameters and its torch hooks,
which still run around the new forward). Skips nest: a second `skip_blocks` wraps the first one's forwards, and
each restores exactly what it found on exit (the class forward, or the previous instance forward).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

_MISSING = object()


@contextlib.contextmanager
def skip_blocks(model: Any, skip: Callable[[int], bool]) -> Iterator[None]:
    """For the duration of the `with`: block i returns its input while `skip(i)` (see the module docstring)."""
    saved = []
    try:
        for i, block in enumerate(model.transformer_blocks):
            saved.append((block, block.__dict__.get("forward", _MISSING)))
            inner = block.forward  # the bound forward in force now (class or instance)

            def forward(x, *args, _i=i, _inner=inner, **kwargs):
                return x if skip(_i) else _inner(x, *args, **kwargs)

            block.forward = forward
        yield
    finally:
        for block, previous in reversed(saved):
            if previous is _MISSING:
                block.__dict__.pop("forward", None)
            else:
                block.forward = previous
