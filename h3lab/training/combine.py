"""The fixed order in which per-request gradients (and losses) combine: one binary tree over request index.

The tree over n leaves (requests 0..n-1 of the global batch, in batch order):
    tree([x])  = x
    tree(xs)   = tree(xs[:k]) + tree(xs[k:]),  k = the largest power of two strictly below len(xs)
Every addition is one elementwise float32 `left + right` (left = lower request indices). So n = 4 is
(x0 + x1) + (x2 + x3), n = 5 is ((x0 + x1) + (x2 + x3)) + x4, n = 6 is ((x0 + x1) + (x2 + x3)) + (x4 + x5).
The batch gradient is `tree(g_0 .. g_{n-1}) / n` (one float32 division): the gradient of the mean request loss.

Why a tree rather than a left-to-right sum: its subtrees are ranges of requests, so a data-parallel rank owning a
contiguous block reduces it locally into the tree's own nodes (`tree_nodes`) and only those node partials are
gathered (`tree_sum_nodes` finishes the same tree) — one partial per rank when every rank owns an aligned
power-of-two block — and the bytes equal one process's. One process streams the same tree with O(log n) partials
(`TreeAccumulator`, the binary-counter evaluation of the rule above).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch


def tree_split(n: int) -> int:
    """The size of the left subtree of a tree over n >= 2 leaves: the largest power of two below n."""
    if n < 2:
        raise ValueError(f"tree_split({n}): a split needs at least 2 leaves")
    return 1 << ((n - 1).bit_length() - 1)


class TreeAccumulator:
    """Streams `tree(xs)` leaf by leaf: a stack of finished perfect subtrees, merged when two of one size meet;
    `result()` folds the remaining stack from the right (the rule's right spine)."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        self._stack.append((1, x))
        self.count += 1
        while len(self._stack) >= 2 and self._stack[-1][0] == self._stack[-2][0]:
            (size, right), (_, left) = self._stack.pop(), self._stack.pop()
            self._stack.append((2 * size, left + right))

    def result(self) -> torch.Tensor:
        if not self._stack:
            raise ValueError("TreeAccumulator.result(): no leaf was added")
        acc = self._stack[-1][1]
        for _, left in reversed(self._stack[:-1]):
            acc = left + acc
        return acc


def tree_sum(xs: Iterable[torch.Tensor]) -> torch.Tensor:
    """`tree(xs)` (module docstring)."""
    acc = TreeAccumulator()
    for x in xs:
        acc.add(x)
    return acc.result()


def tree_nodes(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """The maximal nodes `(lo, hi)` of the tree over [0, n) that exactly cover requests [start, stop), in order.
    A block [a * 2^j, (a + 1) * 2^j) inside [0, n) is one node."""
    if not 0 <= start <= stop <= n:
        raise ValueError(f"tree_nodes({start}, {stop}, {n}): need 0 <= start <= stop <= n")
    out: list[tuple[int, int]] = []

    def visit(lo: int, hi: int) -> None:
        if hi <= start or lo >= stop:
            return
        if start <= lo and hi <= stop:
            out.append((lo, hi))
            return
        mid = lo + tree_split(hi - lo)
        visit(lo, mid)
        visit(mid, hi)

    if start < stop:
        visit(0, n)
    return out


def tree_sum_nodes(n: int, nodes: Mapping[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """Finish the tree over [0, n) from node partials (each `tree` of its own leaves); every leaf must be covered."""

    def value(lo: int, hi: int) -> torch.Tensor:
        if (lo, hi) in nodes:
            return nodes[(lo, hi)]
        if hi - lo == 1:
            raise ValueError(f"tree_sum_nodes: request {lo} is covered by no node partial")
        mid = lo + tree_split(hi - lo)
        return value(lo, mid) + value(mid, hi)

    return value(0, n)
