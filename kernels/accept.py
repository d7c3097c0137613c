"""``accept``: walk each draft tree along the target's tokens."""

from __future__ import annotations

import torch

from ddtree.kernels import reference
from ddtree.kernels.backend import Backend, resolve_backend
from ddtree.kernels.types import Acceptance, Tree

__all__ = ["accept"]


def accept(
    tree: Tree,
    target_tokens: torch.Tensor | None = None,
    *,
    target_logits: torch.Tensor | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    error_flags: torch.Tensor | None = None,
    out: Acceptance | None = None,
    backend: Backend = "auto",
) -> Acceptance:
    """Accept the longest root-anchored path of ``tree`` that the target agrees with.

    From the root, repeatedly take the target's token at the current node and move to the child
    carrying that token (the lowest-numbered one if a malformed tree has several); stop when no
    child does. The target's token at the last accepted node is the bonus token. Greedy when
    ``temperature == 0`` (the given tokens, or the argmax of the logits, NaN counted as ``-inf``,
    equal logits smaller token id first). With ``temperature > 0`` the token at each visited node
    is sampled from ``softmax(target_logits / temperature)`` (NaN impossible; a row holding
    ``+inf`` samples among its ``+inf`` tokens), which keeps the output distributed exactly as
    the target's own sampling (lossless sample-and-walk). The sampler is counter-based Gumbel-max
    noise, specified in ``ddtree.kernels.reference.accept``, so CPU and GPU agree.

    Parameters
    ----------
    tree : Tree
        The trees the target verified, ``num_nodes_max`` slots per request.
    target_tokens : torch.Tensor, optional
        Shape ``(batch_size, num_nodes_max)``, int64, tree's device. The target's token at each
        node (read only at visited nodes); ``>= 0``. Exactly one of ``target_tokens`` and
        ``target_logits`` is given.
    target_logits : torch.Tensor, optional
        Shape ``(batch_size, num_nodes_max, vocab_size)``, bf16/fp16/fp32, tree's device.
    temperature : float
        ``0`` for greedy, ``> 0`` to sample (needs ``target_logits``).
    generator : torch.Generator, optional
        Random source for sampling, on the tree's device. Sampling draws one 62-bit seed from it
        (on the device, no sync) and derives every node's noise from that seed, so one generator
        state gives one result.
    error_flags : torch.Tensor, optional
        Shape ``(batch_size,)``, int32. If given, a malformed tree (``ErrorFlag.TREE``) or a
        negative target token at a node below ``num_nodes`` (``ErrorFlag.TOKEN``) is flagged
        there and that request, like one flagged by an earlier op, gets an empty acceptance
        (``length`` 0, bonus ``-1``, paths ``-1``); if omitted it raises ``ValueError`` (a host
        sync on CUDA).
    out : Acceptance, optional
        Where to write the result: tensors of exactly the returned ``Acceptance``'s shapes and
        dtypes, on the tree's device, contiguous, sharing no memory with each other or with the
        inputs (``ValueError`` otherwise, naming the field). ``out`` is returned. All or
        nothing: with ``error_flags``, if any request of the batch is flagged (by this op or on
        entry), nothing is written to ``out``; without it, bad data raises before anything is
        written. For destinations in caller memory (the server's calls by reference).
    backend : {"auto", "cuda", "reference"}
        See ``ddtree.kernels``.

    Returns
    -------
    Acceptance
        ``path_len = tree.draft_len + 1`` slots per request; ``out`` when given.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices that disagree with ``tree``, both or neither target given,
        ``temperature < 0``, sampling without logits, or an ``out`` that does not fit.
    """
    if resolve_backend(backend, tree.device) == "cuda":
        from ddtree.kernels import tree_cuda

        return tree_cuda.accept(
            tree,
            target_tokens,
            target_logits=target_logits,
            temperature=temperature,
            generator=generator,
            error_flags=error_flags,
            out=out,
        )
    return reference.accept(
        tree,
        target_tokens,
        target_logits=target_logits,
        temperature=temperature,
        generator=generator,
        error_flags=error_flags,
        out=out,
    )
