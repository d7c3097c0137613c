"""``build_tree``: the DDTree draft tree from a parallel drafter's logits."""

from __future__ import annotations

import torch

from ddtree.kernels import reference
from ddtree.kernels.backend import Backend, resolve_backend
from ddtree.kernels.types import Tree

__all__ = ["build_tree"]


def build_tree(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int | torch.Tensor,
    *,
    temperature: float = 1.0,
    max_budget: int | None = None,
    error_flags: torch.Tensor | None = None,
    out: Tree | None = None,
    backend: Backend = "auto",
) -> Tree:
    """Build each request's DDTree: the ``budget`` most probable draft prefixes, best first.

    Per depth, ``log_softmax(draft_logits / temperature)`` over the full vocabulary in fp32
    gives the drafter's marginal; the top ``K = min(budget, vocab_size)`` tokens are ranked by
    scaled logit (``logit / temperature`` in fp32), equal values smaller token id first. A
    best-first search over rank tuples (seeded with rank 0 at depth 1; each pop pushes its next
    sibling and its first child) pops nodes in order of cumulative log-probability, equal scores
    lexicographically smaller rank tuple first, until ``budget`` nodes or no candidate with a
    finite score is left. Nodes are numbered in pop order after the root (node 0). See Ringel &
    Romano, arXiv 2604.12989.

    Non-finite logits: NaN counts as ``-inf`` (the token is impossible). If a row holds ``+inf``,
    its ``+inf`` tokens share the mass equally and every other token is impossible. Impossible
    tokens never enter the tree; a depth whose row is all impossible ends every path there.

    Parameters
    ----------
    draft_logits : torch.Tensor
        Shape ``(batch_size, draft_len, vocab_size)``, bf16/fp16/fp32, CPU or CUDA, contiguous.
        Drafter logits for depths ``1..draft_len``; ``1 <= draft_len <= 32``.
    root_tokens : torch.Tensor
        Shape ``(batch_size,)``, int64, same device. Bonus token of the previous step; must lie
        in ``[0, vocab_size)``.
    budget : int or torch.Tensor
        Draft nodes besides the root, ``1..1024``: one int for every request, or shape
        ``(batch_size,)`` int32/int64 on the same device for per-request budgets.
    temperature : float
        Drafter temperature, ``> 0``; logits are divided by it before the softmax.
    max_budget : int, optional
        Upper bound of ``budget`` that fixes ``num_nodes_max = 1 + max_budget``. Needed only
        for a tensor ``budget``; when omitted it is read from ``budget`` (a host sync on CUDA).
        With it, tensor budgets are not read on the host: each is clamped into
        ``[1, max_budget]``.
    error_flags : torch.Tensor, optional
        Shape ``(batch_size,)``, int32, same device. If given, a request with an out-of-range
        root token gets ``ErrorFlag.TOKEN`` OR-ed in and an empty tree (root only, node 0 still
        holding the given root token), as does a request already flagged by an earlier op; the
        op stays asynchronous. If omitted, such data raises ``ValueError`` (a host sync on CUDA).
    out : Tree, optional
        Where to write the result: tensors of exactly the returned ``Tree``'s shapes and dtypes
        (``num_nodes_max = 1 + max_budget``) and ``draft_len``, on the logits' device,
        contiguous, sharing no memory with each other or with the inputs (``ValueError``
        otherwise, naming the field). ``out`` is returned. All or nothing: with
        ``error_flags``, if any request of the batch is flagged (by this op or on entry),
        nothing is written to ``out``; without it, bad data raises before anything is written.
        For destinations in caller memory (the server's calls by reference).
    backend : {"auto", "cuda", "reference"}
        See ``ddtree.kernels``.

    Returns
    -------
    Tree
        ``num_nodes_max = 1 + max_budget`` slots per request, ``num_nodes[b] <= 1 + budget[b]``.

    Raises
    ------
    ValueError
        A shape, dtype, device, budget or temperature out of range; the message names it.
    """
    if resolve_backend(backend, draft_logits.device) == "cuda":
        from ddtree.kernels import tree_cuda

        return tree_cuda.build_tree(
            draft_logits,
            root_tokens,
            budget,
            temperature=temperature,
            max_budget=max_budget,
            error_flags=error_flags,
            out=out,
        )
    return reference.build_tree(
        draft_logits,
        root_tokens,
        budget,
        temperature=temperature,
        max_budget=max_budget,
        error_flags=error_flags,
        out=out,
    )
