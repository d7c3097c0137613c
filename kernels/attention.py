"""``verify_attention``: tree-masked paged MLA attention for the target's verify pass."""

from __future__ import annotations

import torch

from ddtree.kernels import reference
from ddtree.kernels.backend import Backend, resolve_backend
from ddtree.kernels.types import Tree

__all__ = ["verify_attention"]


def verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree: Tree,
    *,
    v_dim: int = 512,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    error_flags: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every tree node over the committed prefix and its own ancestors-or-self.

    Node ``i`` of request ``b`` (query ``q[b, i]``) attends to logical positions
    ``p < prefix_len[b]`` and to ``prefix_len[b] + j`` for each ``j < num_nodes[b]`` whose bit
    is set in ``tree.mask[b, i]``. Keys are the full ``head_dim`` latent, values its first
    ``v_dim`` dims (MLA in absorbed form, one latent shared by all heads). Node slots at or past
    ``num_nodes[b]``, and rows whose visible scores are all ``-inf``, get ``out = 0`` and
    ``lse = -inf``. Cache rows past ``prefix_len[b] + num_nodes[b]`` are never read. A NaN or
    infinity in ``q`` or in a cache row of the range ``[0, prefix_len[b] + num_nodes[b])``
    (visible to a node or not: a kernel multiplies a probability of 0 by it), or a scaled score
    ``q . k * sm_scale`` that overflows fp32 (the CUDA kernel works in base 2, so at
    ``3.4e38 / log2(e)``), leaves that request's other rows unspecified: they may be NaN,
    infinite or finite. Other requests are unaffected.

    Parameters
    ----------
    q : torch.Tensor
        Shape ``(batch_size, num_nodes_max, num_heads, head_dim)``, bf16, CPU or CUDA.
    kv_cache : torch.Tensor
        Shape ``(num_pages, page_size, head_dim)``, bf16, same device. Node ``i``'s latent is at
        logical position ``prefix_len + i`` (written by the caller's verify pass).
    block_table : torch.Tensor
        Shape ``(batch_size, max_pages)``, int32. Page of each logical block.
    prefix_lens : torch.Tensor
        Shape ``(batch_size,)``, int32, ragged, ``>= 0``.
    tree : Tree
        The trees being verified; its ``num_nodes_max`` equals ``q.shape[1]``.
    v_dim : int
        Value width, ``1 <= v_dim <= head_dim``. The CUDA kernel takes ``head_dim`` a multiple
        of 64 and ``v_dim`` a multiple of 64 up to 512 (MLA: 576 and 512) and raises
        ``ValueError`` naming the limit otherwise; ``backend="reference"`` takes any.
    sm_scale : float, optional
        Softmax scale; default ``1 / sqrt(head_dim)``. MLA models pass their own (DeepSeek-V3:
        ``1 / sqrt(192)`` times any YaRN factor).
    out : torch.Tensor, optional
        Shape ``(batch_size, num_nodes_max, num_heads, v_dim)``, bf16. Written in place if given.
    lse : torch.Tensor, optional
        Shape ``(batch_size, num_nodes_max, num_heads)``, fp32. Natural-log log-sum-exp of the
        scaled scores; written in place if given.
    error_flags : torch.Tensor, optional
        Shape ``(batch_size,)``, int32. If given, a bad block-table entry or length is flagged
        (``ErrorFlag.BLOCK_TABLE`` / ``ErrorFlag.LENGTH``, or ``ErrorFlag.TREE`` for
        ``num_nodes`` outside ``[1, num_nodes_max]``) and that request's outputs are left
        untouched (``0`` / ``-inf`` where this call allocates them), as are those of requests
        flagged by an earlier op; if omitted it raises ``ValueError`` (a host sync on CUDA).
    backend : {"auto", "cuda", "reference"}
        See ``ddtree.kernels``.

    Returns
    -------
    tuple of torch.Tensor
        ``(out, lse)`` with the shapes above.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices that disagree.
    """
    if resolve_backend(backend, q.device) == "cuda":
        from ddtree.kernels import attention_cuda

        return attention_cuda.verify_attention(
            q,
            kv_cache,
            block_table,
            prefix_lens,
            tree,
            v_dim=v_dim,
            sm_scale=sm_scale,
            out=out,
            lse=lse,
            error_flags=error_flags,
        )
    return reference.verify_attention(
        q,
        kv_cache,
        block_table,
        prefix_lens,
        tree,
        v_dim=v_dim,
        sm_scale=sm_scale,
        out=out,
        lse=lse,
        error_flags=error_flags,
    )
