"""The fixed combine tree: the streaming accumulator evaluates exactly the declared recursive tree (bytes), the
association matters (a left-to-right sum differs, so the checks can fail), every contiguous rank split covers the
requests with tree nodes (aligned power-of-two blocks are one node), and finishing the tree from any split's node
partials gives the one-process bytes."""

import pytest
import torch

from h3lab.training import TreeAccumulator, rank_block, tree_nodes, tree_sum, tree_sum_nodes
from h3lab.training.combine import tree_split


def leaves(n: int, seed: int = 0) -> list[torch.Tensor]:
    # widely spread magnitudes so float32 association changes the bytes
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(257, generator=g) * 10.0 ** float(torch.randint(-3, 4, (1,), generator=g)) for _ in range(n)]


def recursive_tree(xs: list[torch.Tensor]) -> torch.Tensor:
    """The declared rule, written independently: split at the largest power of two strictly below len(xs)."""
    if len(xs) == 1:
        return xs[0]
    k = 1
    while 2 * k < len(xs):
        k *= 2
    return recursive_tree(xs[:k]) + recursive_tree(xs[k:])


def test_split_sizes():
    assert [tree_split(n) for n in range(2, 11)] == [1, 2, 2, 4, 4, 4, 4, 8, 8]
    with pytest.raises(ValueError):
        tree_split(1)


@pytest.mark.parametrize("n", range(1, 18))
def test_accumulator_is_the_declared_tree(n):
    xs = leaves(n, seed=n)
    assert torch.equal(tree_sum(xs), recursive_tree(xs))
    acc = TreeAccumulator()
    for x in xs:
        acc.add(x)
    assert acc.count == n and torch.equal(acc.result(), recursive_tree(xs))


def test_association_matters():
    xs = leaves(7, seed=3)
    left_to_right = xs[0]
    for x in xs[1:]:
        left_to_right = left_to_right + x
    assert not torch.equal(tree_sum(xs), left_to_right)


@pytest.mark.parametrize("n,world", [(n, w) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12) for w in (1, 2, 3, 4) if w <= n])
def test_rank_splits_finish_the_same_tree(n, world):
    xs = leaves(n, seed=100 + n)
    blocks = [rank_block(n, r, world) for r in range(world)]
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    nodes = {}
    for start, stop in blocks:
        covered = []
        for lo, hi in tree_nodes(start, stop, n):
            nodes[(lo, hi)] = tree_sum(xs[lo:hi])
            covered += list(range(lo, hi))
        assert covered == list(range(start, stop))
    assert torch.equal(tree_sum_nodes(n, nodes), tree_sum(xs))


def test_aligned_blocks_are_single_nodes():
    assert tree_nodes(0, 4, 8) == [(0, 4)] and tree_nodes(4, 8, 8) == [(4, 8)]
    assert tree_nodes(4, 6, 6) == [(4, 6)] and tree_nodes(2, 4, 6) == [(2, 4)]
    assert tree_nodes(1, 3, 3) == [(1, 2), (2, 3)]  # [0,1,2] is (0+1)+2: requests 1, 2 never add first
    assert tree_nodes(3, 3, 5) == []


def test_missing_leaf_and_bad_ranges_raise():
    xs = leaves(3)
    with pytest.raises(ValueError, match="request 2"):
        tree_sum_nodes(3, {(0, 2): xs[0] + xs[1]})
    with pytest.raises(ValueError):
        tree_nodes(2, 1, 3)
    with pytest.raises(ValueError):
        TreeAccumulator().result()
