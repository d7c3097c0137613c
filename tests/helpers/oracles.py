"""Slow, obviously-correct oracles: one request at a time, plain Python where it matters.

* ``heap_tree``: the paper's best-first heap, literally (Ringel & Romano, arXiv 2604.12989).
* ``brute_force_tree``: enumerate every prefix (tiny ``vocab_size ** draft_len``) and sort.
* ``scalar_accept``: the walk, node by node, with its own Python-int hash for sampling.
* ``scalar_commit``: read every source, then write, position by position.
* ``dense_attention``: softmax attention in fp64 with an explicit boolean mask built from parents.
* ``first_depths_suffice``: the early select's test of one request, in plain Python.

The per-depth fp32 log-probabilities come from ``depth_log_probs`` (plain torch on one row);
scores are accumulated one fp32 addition at a time (``add_fp32``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import struct
from dataclasses import dataclass

import torch

from ddtree.kernels.types import Acceptance, Tree

__all__ = [
    "OracleNode",
    "add_fp32",
    "brute_force_tree",
    "dense_attention",
    "depth_log_probs",
    "first_depths_suffice",
    "gumbel_noise_scalar",
    "heap_tree",
    "scalar_accept",
    "scalar_commit",
    "tree_from_nodes",
]

_NEG_INF = float("-inf")


def add_fp32(a: float, b: float) -> float:
    """``fl32(a + b)`` for fp32 values (the double sum rounded once more is exact for +)."""
    return struct.unpack("f", struct.pack("f", a + b))[0] if math.isfinite(a + b) else a + b


def _normalise_row(row: torch.Tensor, temperature: float) -> torch.Tensor:
    x = row.float() / temperature
    x = torch.where(torch.isnan(x), torch.tensor(_NEG_INF), x)
    if bool((x == float("inf")).any()):
        x = torch.where(x == float("inf"), torch.tensor(0.0), torch.tensor(_NEG_INF))
    return x


def depth_log_probs(row: torch.Tensor, temperature: float) -> tuple[list[int], list[float]]:
    """Rank one depth's vocabulary: token ids best first and their fp32 log-probabilities.

    Ranking is by the scaled logit descending, equal values smaller id first (Python's stable
    sort). NaN counts as ``-inf``; a row with ``+inf`` keeps only its ``+inf`` tokens, equally
    likely; a row with no possible token gives all ``-inf``.
    """
    x = _normalise_row(row, temperature)
    if bool((x == _NEG_INF).all()):
        log_p = torch.full_like(x, _NEG_INF)
    else:
        log_p = torch.log_softmax(x, dim=0)
    values = x.tolist()
    ids = sorted(range(len(values)), key=lambda v: -values[v])
    log_list = log_p.tolist()
    return ids, [log_list[v] for v in ids]


def first_depths_suffice(logits: torch.Tensor, temperature: float, use: int, budget: int) -> bool:
    """The early select's test (``ddtree_depths_suffice`` in build_tree_select.cuh) for one
    request's draft logits (``[draft_len, vocab_size]``, any float dtype, CPU): the tree over
    the first ``use`` depths is the whole tree when some of those depths has no possible token,
    or when the budget-th depth-1 token scores strictly above the chain of the first ``use``
    depths' best tokens (summed as scores are: fp32, in depth order)."""
    if budget == 0:
        return True
    chain, depth_one = 0.0, []
    for d in range(use):
        log_p = depth_log_probs(logits[d], temperature)[1]
        if not math.isfinite(log_p[0]):
            return True
        if d == 0:
            depth_one = log_p
        chain = add_fp32(chain, log_p[0])
    return budget <= len(depth_one) and depth_one[budget - 1] > chain


@dataclass(frozen=True)
class OracleNode:
    """One popped prefix: its rank tuple, token ids, fp32 score."""

    ranks: tuple[int, ...]
    tokens: tuple[int, ...]
    score: float


def heap_tree(
    logits: torch.Tensor, budget: int, temperature: float = 1.0, top_k: int | None = None
) -> list[OracleNode]:
    """The paper's heap for one request: nodes (without the root) in pop order.

    Parameters
    ----------
    logits : torch.Tensor
        Shape ``(draft_len, vocab_size)``, one request's draft logits.
    budget : int
        Nodes to pop at most.
    temperature : float
        Drafter temperature.
    top_k : int, optional
        Tokens kept per depth; defaults to ``min(budget, vocab_size)``.
    """
    draft_len, vocab_size = logits.shape
    top_k = min(budget, vocab_size) if top_k is None else top_k
    ranked = [depth_log_probs(logits[d], temperature) for d in range(draft_len)]

    def push(heap: list, ranks: tuple[int, ...], parent_score: float) -> None:
        depth = len(ranks) - 1
        if ranks[-1] >= top_k:
            return
        score = add_fp32(parent_score, ranked[depth][1][ranks[-1]])
        if score != _NEG_INF:
            heapq.heappush(heap, (-score, ranks, parent_score))

    heap: list = []
    push(heap, (0,), 0.0)
    popped: list[OracleNode] = []
    while heap and len(popped) < budget:
        neg_score, ranks, parent_score = heapq.heappop(heap)
        tokens = tuple(ranked[d][0][r] for d, r in enumerate(ranks))
        popped.append(OracleNode(ranks, tokens, -neg_score))
        push(heap, ranks[:-1] + (ranks[-1] + 1,), parent_score)
        if len(ranks) < draft_len:
            push(heap, ranks + (0,), -neg_score)
    return popped


def brute_force_tree(
    logits: torch.Tensor, budget: int, temperature: float = 1.0
) -> tuple[list[OracleNode], list[OracleNode]]:
    """Enumerate every prefix of one request; return (the first ``budget`` kept, all finite).

    The order is score descending, then rank tuple ascending (a prefix before its extensions),
    with ranks over the whole vocabulary; only prefixes with a finite score count.
    """
    draft_len, vocab_size = logits.shape
    ranked = [depth_log_probs(logits[d], temperature) for d in range(draft_len)]
    everything = []
    for depth in range(1, draft_len + 1):
        for ranks in itertools.product(range(vocab_size), repeat=depth):
            score = 0.0
            for d, r in enumerate(ranks):
                score = add_fp32(score, ranked[d][1][r])
            if score != _NEG_INF:
                tokens = tuple(ranked[d][0][r] for d, r in enumerate(ranks))
                everything.append(OracleNode(ranks, tokens, score))
    everything.sort(key=lambda node: (-node.score, node.ranks))
    return everything[:budget], everything


def tree_from_nodes(
    nodes: list[OracleNode], root_token: int, num_nodes_max: int
) -> dict[str, list]:
    """Lay out oracle nodes as one request's Tree rows (lists, root first, padded)."""
    index = {(): 0}
    tokens, parents, depths, log_probs = [root_token], [-1], [0], [0.0]
    for i, node in enumerate(nodes, start=1):
        index[node.ranks] = i
        tokens.append(node.tokens[-1])
        parents.append(index[node.ranks[:-1]])
        depths.append(len(node.ranks))
        log_probs.append(node.score)
    pad = num_nodes_max - len(tokens)
    return {
        "tokens": tokens + [-1] * pad,
        "parents": parents + [-1] * pad,
        "depths": depths + [-1] * pad,
        "log_probs": log_probs + [_NEG_INF] * pad,
        "num_nodes": len(nodes) + 1,
    }


def _mix32(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def gumbel_noise_scalar(seed: int, request: int, node: int, vocab_size: int) -> torch.Tensor:
    """The sampling noise of ``accept`` for one (request, node), from Python ints.

    Returns
    -------
    torch.Tensor
        Shape ``(vocab_size,)``, fp32.
    """
    key = _mix32(_mix32(_mix32(_mix32(seed & 0xFFFFFFFF) ^ (seed >> 32)) ^ request) ^ node)
    uniform = torch.tensor(
        [((_mix32(key ^ v) >> 9) + 0.5) * 2.0**-23 for v in range(vocab_size)],
        dtype=torch.float32,
    )
    return -torch.log(-torch.log(uniform))


def _argmax_smallest(values: list[float]) -> int:
    best = 0
    for v, value in enumerate(values):
        if value > values[best]:
            best = v
    return best


def scalar_accept(
    tree: Tree,
    target_tokens: torch.Tensor | None = None,
    target_logits: torch.Tensor | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
) -> list[tuple[list[int], list[int], int]]:
    """Walk every request's tree in Python: ``(nodes, tokens, bonus)`` per request.

    Sampling needs ``seed`` (the value ``accept`` drew, e.g. replayed from a cloned generator).
    """
    results = []
    for b in range(tree.batch_size):
        n = int(tree.num_nodes[b])
        parents = tree.parents[b].tolist()
        tokens = tree.tokens[b].tolist()
        current, path_nodes, path_tokens = 0, [0], [tokens[0]]
        while True:
            if target_tokens is not None:
                chosen = int(target_tokens[b, current])
            else:
                x = _normalise_row(target_logits[b, current], temperature or 1.0)
                if temperature > 0:
                    x = x + gumbel_noise_scalar(seed, b, current, x.shape[0])
                chosen = _argmax_smallest(x.tolist())
            children = [c for c in range(1, n) if parents[c] == current and tokens[c] == chosen]
            if not children:
                results.append((path_nodes, path_tokens, chosen))
                break
            current = children[0]
            path_nodes.append(current)
            path_tokens.append(tokens[current])
    return results


def scalar_commit(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    acceptance: Acceptance,
    skip: list[bool] | None = None,
) -> None:
    """``commit_kv`` one position at a time: read every source of the batch, then write."""
    page_size = kv_cache.shape[1]
    moves = []
    for b in range(block_table.shape[0]):
        if skip is not None and skip[b]:
            continue
        prefix = int(prefix_lens[b])
        for m in range(int(acceptance.length[b])):
            src = prefix + int(acceptance.nodes[b, m])
            dst = prefix + m
            value = kv_cache[int(block_table[b, src // page_size]), src % page_size].clone()
            moves.append((int(block_table[b, dst // page_size]), dst % page_size, value))
    for page, offset, value in moves:
        kv_cache[page, offset] = value


def dense_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree: Tree,
    v_dim: int,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 attention with an explicit mask built from ``tree.parents``: ``(out, lse)`` fp64.

    Padding nodes get ``out = 0`` and ``lse = -inf``.
    """
    batch_size, num_nodes_max, num_heads, _ = q.shape
    page_size = kv_cache.shape[1]
    out = torch.zeros(batch_size, num_nodes_max, num_heads, v_dim, dtype=torch.float64)
    lse = torch.full((batch_size, num_nodes_max, num_heads), _NEG_INF, dtype=torch.float64)
    for b in range(batch_size):
        prefix, n = int(prefix_lens[b]), int(tree.num_nodes[b])
        rows = [
            kv_cache[int(block_table[b, p // page_size]), p % page_size].double()
            for p in range(prefix + n)
        ]
        keys = torch.stack(rows)
        parents = tree.parents[b].tolist()
        for i in range(n):
            allowed = torch.zeros(prefix + n, dtype=torch.bool)
            allowed[:prefix] = True
            j = i
            while j >= 0:
                allowed[prefix + j] = True
                j = parents[j]
            scores = (keys @ q[b, i].double().T).T * sm_scale
            scores[:, ~allowed] = _NEG_INF
            lse[b, i] = torch.logsumexp(scores, dim=-1)
            out[b, i] = torch.softmax(scores, dim=-1) @ keys[:, :v_dim]
    return out, lse
