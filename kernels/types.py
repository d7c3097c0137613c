"""Result types shared by every op: the draft ``Tree``, the ``Acceptance`` and the error flags."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "ACCEPTANCE_FIELDS",
    "MAX_BUDGET",
    "MAX_DRAFT_LEN",
    "TREE_FIELDS",
    "Acceptance",
    "ErrorFlag",
    "Tree",
    "mask_words",
]

MAX_BUDGET = 1024
"""Largest draft budget (nodes besides the root) one tree may hold."""

MAX_DRAFT_LEN = 32
"""Largest draft length (depth of the deepest node)."""

TREE_FIELDS = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")
"""The tensor fields of a ``Tree``, in the order the wire and the kernels list them."""

ACCEPTANCE_FIELDS = ("nodes", "tokens", "length", "bonus")
"""The tensor fields of an ``Acceptance``, in wire order."""


def mask_words(num_nodes: int) -> int:
    """Number of int64 words of one ancestor-bitmask row for trees of ``num_nodes`` slots."""
    return (num_nodes + 63) // 64


class ErrorFlag(enum.IntFlag):
    """Per-request error bits that ops OR into ``error_flags`` when caller data is out of range.

    A request with any bit set, whether by this op or by an earlier op sharing the same
    ``error_flags`` tensor, has its outputs (and any caller memory the op would write) left
    untouched. ``ddtree.kernels.checks`` defines exactly when each bit is set. Values are part of
    the wire contract and never renumbered.
    """

    TOKEN = 1
    """A token id is negative or not below ``vocab_size`` (root, target or tree tokens)."""
    TREE = 2
    """The tree is malformed: ``num_nodes`` outside ``[1, num_nodes_max]``, a root whose depth is
    not 0, or a node whose parent is not an earlier node or whose depth is not its parent's
    plus one, at most ``draft_len``."""
    BLOCK_TABLE = 4
    """A block-table entry needed by the request is outside ``[0, num_pages)``."""
    LENGTH = 8
    """A prefix length is negative, or prefix plus tree does not fit the block table."""
    ACCEPTANCE = 16
    """An acceptance path is malformed (length outside ``[1, draft_len + 1]``, or nodes not a
    strictly increasing sequence starting at node 0)."""


@dataclass(frozen=True)
class Tree:
    """A batch of DDTree draft trees, nodes numbered in best-first pop order (node 0 = root).

    ``num_nodes_max`` below is ``1 + max budget``, the second dimension of every tensor; all
    tensors live on one device.
    """

    tokens: torch.Tensor  # [batch_size, num_nodes_max] int64, -1 past num_nodes
    parents: torch.Tensor  # [batch_size, num_nodes_max] int32, -1 for the root and padding
    depths: torch.Tensor  # [batch_size, num_nodes_max] int32, 0 for the root, -1 for padding
    log_probs: torch.Tensor  # [batch_size, num_nodes_max] fp32, 0 for the root, -inf padding
    num_nodes: torch.Tensor  # [batch_size] int32, 1 + nodes built
    mask: torch.Tensor  # [batch_size, num_nodes_max, mask_words] int64 ancestor-or-self bits
    draft_len: int
    """Largest depth a node may have (the drafter's ``draft_len``)."""

    @property
    def batch_size(self) -> int:
        """Number of requests (B)."""
        return int(self.tokens.shape[0])

    @property
    def num_nodes_max(self) -> int:
        """Node slots per request (N = 1 + max budget)."""
        return int(self.tokens.shape[1])

    @property
    def device(self) -> torch.device:
        """Device holding every tensor of the tree."""
        return self.tokens.device


@dataclass(frozen=True)
class Acceptance:
    """Accepted paths of a batch, root first (``path_len = draft_len + 1`` slots per request)."""

    nodes: torch.Tensor  # [batch_size, path_len] int32 node indices, -1 padded
    tokens: torch.Tensor  # [batch_size, path_len] int64 their tokens, -1 padded
    length: torch.Tensor  # [batch_size] int32, tau = accepted nodes including the root
    bonus: torch.Tensor  # [batch_size] int64, the target's token at the last accepted node
