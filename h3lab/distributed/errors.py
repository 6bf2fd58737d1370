"""Errors of `h3lab.distributed`: one line naming the value and the rule, raised identically on every rank where the
value is shared (a topology), so no rank proceeds into a collective that the others refused."""

from __future__ import annotations

from ..errors import H3Error


class DistributedError(H3Error):
    """A distributed call cannot be served strictly (shapes, shard layout, grad, group); the message names it."""


class TopologyError(DistributedError):
    """An unsupported topology: TP/CP degrees, world size, devices, backend, or a row count the mesh cannot shard."""
