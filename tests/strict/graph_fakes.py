"""A CPU stand-in for `torch.cuda.CUDAGraph` capture, shared by the fast and strict graph tests: capture runs the
body once on the graph's static buffers (under `guard()`, e.g. a context that forbids host reads), replay runs it
again and copies the results into the captured outputs; `no_host_reads` is the guard the strict graph and step graph
tests capture under."""

from __future__ import annotations

import contextlib

import torch


class Replay:
    def __init__(self, body, outputs):
        self.body, self.outputs = body, outputs

    def replay(self):
        for out, new in zip(self.outputs, self.body()):
            out.copy_(new)


class ReplayBackend:
    """The `graphs.GraphCache` backend: `fail` makes capture raise a two-line error (a capture that breaks)."""

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


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """Every tensor -> host read raises `HostSync` inside (what a stream capture refuses)."""
    def refuse(name):
        def fn(*a, **k):
            raise HostSync(f"{name} during capture")
        return fn

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    saved_equal = torch.equal
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(f"Tensor.{n}"))
        torch.equal = refuse("torch.equal")
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)
        torch.equal = saved_equal
