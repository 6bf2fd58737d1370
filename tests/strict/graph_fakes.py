"""A CPU stand-in for `torch.cuda.CUDAGraph` capture, shared by the fast and strict graph tests: capture runs the
body once on the graph's static buffers (under `guard()`, e.g. a context that forbids host reads), replay runs it
again and copies the results into the captured outputs."""

from __future__ import annotations

import contextlib


class Replay:
    def __init__(self, body, outputs):
        self.body, self.outputs = body, outputs

    def replay(self):
        for out, new in zip(self.outputs, self.body()):
            out.copy_(new)


class ReplayBackend:
    """The `cuda_graph.GraphCache` backend: `fail` makes capture raise a two-line error (a capture that breaks)."""

    def __init__(self, fail: bool = False, guard=contextlib.nullcontext):
        self.captures, self.fail, self.guard = 0, fail, guard

    def capture(self, body):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing\nsecond line")
        with self.guard():
            outputs = body()
        self.captures += 1
        return Replay(body, outputs), outputs

    def capturing(self):
        return False
