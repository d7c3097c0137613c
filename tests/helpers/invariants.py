"""Structural invariants of trees and acceptances, checked request by request in Python."""

from __future__ import annotations

import torch

from ddtree.kernels.types import Acceptance, Tree

__all__ = [
    "ancestor_matrix",
    "assert_acceptance_valid",
    "assert_tree_valid",
    "has_near_ties",
]


def ancestor_matrix(parents: list[int], num_nodes: int, num_nodes_max: int) -> torch.Tensor:
    """Ancestor-or-self matrix of one request from its parent list, shape ``(N, N)`` bool."""
    matrix = torch.zeros(num_nodes_max, num_nodes_max, dtype=torch.bool)
    for i in range(num_nodes):
        j = i
        while j >= 0:
            matrix[i, j] = True
            j = parents[j]
    return matrix


def has_near_ties(tree: Tree, rel: float = 1e-5) -> bool:
    """Whether two popped scores of one request lie within ``rel`` of each other: a CUDA
    ``log_softmax`` that differs from torch's in the last bit can order such a pair the other
    way (the contract then asks only for a valid tree of the same sorted log-probs)."""
    scores = tree.log_probs[:, 1:].sort(dim=1, descending=True).values  # [batch, nodes - 1]
    gap = (scores[:, 1:] - scores[:, :-1]).abs()  # [batch, nodes - 2]
    finite = torch.isfinite(scores[:, 1:]) & torch.isfinite(scores[:, :-1])
    return bool((finite & (gap <= rel * scores[:, 1:].abs())).any())


def _mask_bits(words: list[int], num_nodes_max: int) -> list[bool]:
    return [bool((words[j // 64] >> (j % 64)) & 1) for j in range(num_nodes_max)]


def assert_tree_valid(tree: Tree, vocab_size: int | None = None) -> None:
    """Check every request of ``tree`` against the Tree contract.

    Root at node 0 (parent -1, depth 0, log-prob 0); each node ``1 <= i < num_nodes`` has an
    earlier parent, ``depth = parent depth + 1 <= draft_len``, a log-prob no larger than its
    parent's, and a token in ``[0, vocab_size)``; slots past ``num_nodes`` hold the sentinels
    (token -1, parent -1, depth -1, log-prob -inf, empty mask row); the mask is exactly the
    ancestor-or-self relation.
    """
    n_max = tree.num_nodes_max
    for b in range(tree.batch_size):
        n = int(tree.num_nodes[b])
        tokens = tree.tokens[b].tolist()
        parents = tree.parents[b].tolist()
        depths = tree.depths[b].tolist()
        log_probs = tree.log_probs[b].tolist()
        where = f"request {b}"
        assert 1 <= n <= n_max, f"{where}: num_nodes {n} outside [1, {n_max}]"
        assert (parents[0], depths[0], log_probs[0]) == (-1, 0, 0.0), f"{where}: bad root"
        for i in range(1, n):
            p = parents[i]
            assert 0 <= p < i, f"{where}: node {i} has parent {p}"
            assert depths[i] == depths[p] + 1, f"{where}: node {i} depth {depths[i]}"
            assert depths[i] <= tree.draft_len, f"{where}: node {i} deeper than draft_len"
            assert log_probs[i] <= log_probs[p], f"{where}: node {i} more probable than parent"
            if vocab_size is not None:
                assert 0 <= tokens[i] < vocab_size, f"{where}: node {i} token {tokens[i]}"
        for i in range(n, n_max):
            assert (tokens[i], parents[i], depths[i]) == (-1, -1, -1), f"{where}: slot {i}"
            assert log_probs[i] == float("-inf"), f"{where}: slot {i} log_prob {log_probs[i]}"
        expected = ancestor_matrix(parents, n, n_max)
        for i in range(n_max):
            row = _mask_bits(tree.mask[b, i].tolist(), n_max)
            assert row == expected[i].tolist(), f"{where}: mask row {i} is not ancestor-or-self"


def assert_acceptance_valid(acceptance: Acceptance, tree: Tree) -> None:
    """Each accepted path is a root-anchored chain of tree nodes, padded with -1.

    ``nodes[0] == 0``, each next node is a child of the previous one, ``tokens`` are the tree's
    tokens at those nodes, ``1 <= length <= draft_len + 1`` and slots past ``length`` are -1.
    """
    path_len = tree.draft_len + 1
    assert tuple(acceptance.nodes.shape) == (tree.batch_size, path_len)
    for b in range(tree.batch_size):
        length = int(acceptance.length[b])
        nodes = acceptance.nodes[b].tolist()
        tokens = acceptance.tokens[b].tolist()
        where = f"request {b}"
        assert 1 <= length <= path_len, f"{where}: length {length}"
        assert nodes[0] == 0, f"{where}: path does not start at the root"
        for m in range(1, length):
            assert int(tree.parents[b, nodes[m]]) == nodes[m - 1], f"{where}: slot {m} not a child"
        for m in range(length):
            assert tokens[m] == int(tree.tokens[b, nodes[m]]), f"{where}: token at slot {m}"
        assert nodes[length:] == [-1] * (path_len - length), f"{where}: node padding"
        assert tokens[length:] == [-1] * (path_len - length), f"{where}: token padding"
