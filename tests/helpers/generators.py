"""Seeded random inputs for op tests: logits, budgets, valid trees, targets, paged caches.

Every function takes a ``seed`` and builds on the CPU unless a ``device`` is given, so a test
is reproducible from its parameters alone.
"""

from __future__ import annotations

import torch

from ddtree.kernels.reference import pack_mask
from ddtree.kernels.types import ACCEPTANCE_FIELDS, TREE_FIELDS, Acceptance, Tree

__all__ = [
    "draft_logits",
    "paged_cache",
    "poison_rows",
    "random_budgets",
    "random_tree",
    "target_tokens_for",
]

LOGIT_STYLES = ("random", "ties", "peaked", "flat")


def draft_logits(
    batch_size: int,
    draft_len: int,
    vocab_size: int,
    *,
    style: str = "random",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Draft logits, shape ``(batch_size, draft_len, vocab_size)``.

    Styles: ``random`` (standard normal times 3), ``ties`` (integers 0..3, so most logits tie),
    ``peaked`` (one dominant token per row: log-probs near 0 and scores that collide after fp32
    rounding), ``flat`` (all zeros: every token ties).
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, draft_len, vocab_size)
    if style == "random":
        logits = torch.randn(shape, generator=gen) * 3
    elif style == "ties":
        logits = torch.randint(0, 4, shape, generator=gen).float()
    elif style == "peaked":
        logits = torch.randn(shape, generator=gen)
        top = torch.randint(0, vocab_size, (batch_size, draft_len, 1), generator=gen)
        logits.scatter_(2, top, 30.0)
    elif style == "flat":
        logits = torch.zeros(shape)
    else:
        raise ValueError(f"style: expected one of {LOGIT_STYLES}, got {style!r}")
    return logits.to(dtype).to(device)


def poison_rows(logits: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Copy of ``logits`` with non-finite rows at random (request, depth) positions.

    Cycles through: a row of NaN, a row of ``-inf``, a row with two ``+inf`` entries, a row
    with half its entries ``-inf`` and one NaN, a row with one ``+inf`` and one NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    out = logits.clone()
    batch_size, draft_len, vocab_size = out.shape
    cells = torch.randperm(batch_size * draft_len, generator=gen)[: max(1, out.shape[0])]
    for k, cell in enumerate(cells.tolist()):
        row = out[cell // draft_len, cell % draft_len]
        ids = torch.randperm(vocab_size, generator=gen)
        kind = k % 5
        if kind == 0:
            row[:] = float("nan")
        elif kind == 1:
            row[:] = float("-inf")
        elif kind == 2:
            row[ids[:2]] = float("inf")
        elif kind == 3:
            row[ids[: vocab_size // 2]] = float("-inf")
            row[ids[-1]] = float("nan")
        else:
            row[ids[0]] = float("inf")
            row[ids[-1]] = float("nan")
    return out


def random_budgets(batch_size: int, max_budget: int, seed: int = 0) -> torch.Tensor:
    """Per-request budgets in ``[1, max_budget]`` (int64), including both ends when B >= 2."""
    gen = torch.Generator().manual_seed(seed)
    budgets = torch.randint(1, max_budget + 1, (batch_size,), generator=gen)
    budgets[0] = max_budget
    if batch_size > 1:
        budgets[1] = 1
    return budgets


def random_tree(
    batch_size: int,
    num_nodes_max: int,
    draft_len: int,
    vocab_size: int,
    *,
    shape: str = "random",
    seed: int = 0,
) -> Tree:
    """A batch of valid trees (not DDTree-built) with ragged ``num_nodes``.

    Shapes: ``chain`` (each node the child of the previous, as deep as ``draft_len`` allows),
    ``star`` (every node a child of the root), ``random`` (a uniformly chosen earlier parent
    whose depth is below ``draft_len``), ``mixed`` (cycles through the three per request).
    Tokens are random, so siblings may repeat a token (``accept`` then takes the lowest index).
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = ("chain", "star", "random")
    tokens = torch.full((batch_size, num_nodes_max), -1, dtype=torch.int64)
    parents = torch.full((batch_size, num_nodes_max), -1, dtype=torch.int32)
    depths = torch.full((batch_size, num_nodes_max), -1, dtype=torch.int32)
    log_probs = torch.full((batch_size, num_nodes_max), float("-inf"))
    num_nodes = torch.zeros(batch_size, dtype=torch.int32)
    ancestors = torch.zeros(batch_size, num_nodes_max, num_nodes_max, dtype=torch.bool)
    for b in range(batch_size):
        kind = shapes[b % 3] if shape == "mixed" else shape
        limit = min(num_nodes_max, draft_len + 1) if kind == "chain" else num_nodes_max
        n = int(torch.randint(1, limit + 1, (1,), generator=gen)) if b else limit
        num_nodes[b] = n
        tokens[b, :n] = torch.randint(0, vocab_size, (n,), generator=gen)
        parents[b, 0], depths[b, 0], log_probs[b, 0] = -1, 0, 0.0
        ancestors[b, 0, 0] = True
        for i in range(1, n):
            if kind == "chain":
                p = i - 1
            elif kind == "star":
                p = 0
            else:
                allowed = [j for j in range(i) if int(depths[b, j]) < draft_len]
                p = allowed[int(torch.randint(0, len(allowed), (1,), generator=gen))]
            parents[b, i] = p
            depths[b, i] = depths[b, p] + 1
            log_probs[b, i] = log_probs[b, p] - float(torch.rand(1, generator=gen))
            ancestors[b, i] = ancestors[b, p]
            ancestors[b, i, i] = True
    return Tree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        log_probs=log_probs,
        num_nodes=num_nodes,
        mask=pack_mask(ancestors),
        draft_len=draft_len,
    )


def target_tokens_for(
    tree: Tree, vocab_size: int, *, follow: float = 0.7, seed: int = 0
) -> torch.Tensor:
    """Target tokens, shape ``(batch_size, num_nodes_max)`` int64: at each node, with
    probability ``follow`` the token of one of its children (so walks go deep), else random."""
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab_size, tuple(tree.tokens.shape), generator=gen)
    for b in range(tree.batch_size):
        n = int(tree.num_nodes[b])
        for i in range(n):
            children = [c for c in range(1, n) if int(tree.parents[b, c]) == i]
            if children and float(torch.rand(1, generator=gen)) < follow:
                pick = children[int(torch.randint(0, len(children), (1,), generator=gen))]
                targets[b, i] = tree.tokens[b, pick]
    return targets


def paged_cache(
    positions: torch.Tensor,
    page_size: int,
    head_dim: int,
    *,
    spare_pages: int = 3,
    spare_blocks: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random paged cache and a shuffled block table covering ``positions[b]`` tokens each.

    Parameters
    ----------
    positions : torch.Tensor
        Shape ``(batch_size,)``: logical positions each request needs (prefix + tree).
    page_size, head_dim : int
        Cache geometry.
    spare_pages : int
        Extra pages that no request uses (stale data the ops must not read).
    spare_blocks : int
        Extra block-table columns past the longest request, filled with ``-1``.

    Returns
    -------
    tuple of torch.Tensor
        ``kv_cache`` ``(num_pages, page_size, head_dim)`` and ``block_table``
        ``(batch_size, max_pages)`` int32; entries past a request's need are ``-1``.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks = [(int(p) + page_size - 1) // page_size for p in positions]
    max_pages = max(blocks) + spare_blocks
    num_pages = sum(blocks) + spare_pages
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(blocks), max_pages), -1, dtype=torch.int32)
    used = 0
    for b, count in enumerate(blocks):
        table[b, :count] = torch.tensor(order[used : used + count], dtype=torch.int32)
        used += count
    cache = torch.randn(num_pages, page_size, head_dim, generator=gen).to(dtype)
    return cache, table


POISON = 7777
"""The value ``poisoned_tree`` fills every element with."""


def poisoned_tree(
    batch_size: int, num_nodes_max: int, draft_len: int, *, device: str | torch.device = "cpu"
) -> Tree:
    """Destination tensors for a build (``out=``) with every element ``POISON``: shapes and
    dtypes of a ``Tree`` of ``batch_size`` requests and ``num_nodes_max`` slots."""
    pair = (batch_size, num_nodes_max)
    words = (num_nodes_max + 63) // 64
    return Tree(
        tokens=torch.full(pair, POISON, dtype=torch.int64, device=device),
        parents=torch.full(pair, POISON, dtype=torch.int32, device=device),
        depths=torch.full(pair, POISON, dtype=torch.int32, device=device),
        log_probs=torch.full(pair, float(POISON), device=device),
        num_nodes=torch.full((batch_size,), POISON, dtype=torch.int32, device=device),
        mask=torch.full((*pair, words), POISON, dtype=torch.int64, device=device),
        draft_len=draft_len,
    )


def poisoned_acceptance(
    batch_size: int, path_len: int, *, device: str | torch.device = "cpu"
) -> Acceptance:
    """Destination tensors for an accept (``out=``) with every element ``POISON``."""
    pair = (batch_size, path_len)
    return Acceptance(
        nodes=torch.full(pair, POISON, dtype=torch.int32, device=device),
        tokens=torch.full(pair, POISON, dtype=torch.int64, device=device),
        length=torch.full((batch_size,), POISON, dtype=torch.int32, device=device),
        bonus=torch.full((batch_size,), POISON, dtype=torch.int64, device=device),
    )


def _fields(value: Tree | Acceptance) -> tuple[str, ...]:
    return TREE_FIELDS if isinstance(value, Tree) else ACCEPTANCE_FIELDS


def poison(value: Tree | Acceptance) -> None:
    """Fill every tensor of ``value`` with ``POISON`` again, in place."""
    for name in _fields(value):
        getattr(value, name).fill_(POISON)


def is_poisoned(value: Tree | Acceptance) -> bool:
    """Whether every element of every tensor of ``value`` still holds ``POISON``."""
    return all(bool((getattr(value, name) == POISON).all()) for name in _fields(value))
