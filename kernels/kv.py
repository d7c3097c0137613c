"""``commit_kv``: compact a paged latent KV cache to the accepted path, in place."""

from __future__ import annotations

import torch

from ddtree.kernels import reference
from ddtree.kernels.backend import Backend, resolve_backend
from ddtree.kernels.types import Acceptance

__all__ = ["commit_kv"]


def commit_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    acceptance: Acceptance,
    *,
    error_flags: torch.Tensor | None = None,
    all_or_nothing: bool = False,
    backend: Backend = "auto",
) -> None:
    """Move each accepted node's latent from ``prefix_len + nodes[m]`` to ``prefix_len + m``.

    Logical position ``p`` of request ``b`` lives at
    ``kv_cache[block_table[b, p // page_size], p % page_size]``. Moves are done as if every
    source were read before any destination is written, so overlapping paths are safe. After
    the call positions ``prefix_len .. prefix_len + length - 1`` hold the accepted nodes (root
    first); the caller's committed length becomes ``prefix_len + length``. ``prefix_lens`` is
    not modified.

    Parameters
    ----------
    kv_cache : torch.Tensor
        Shape ``(num_pages, page_size, head_dim)``, bf16 (any dtype works), modified in place.
        ``1 <= page_size <= 256``.
    block_table : torch.Tensor
        Shape ``(batch_size, max_pages)``, int32, same device. Page of each logical block.
    prefix_lens : torch.Tensor
        Shape ``(batch_size,)``, int32, same device. Committed tokens before the tree.
    acceptance : Acceptance
        Output of ``accept`` for the same batch, same device.
    error_flags : torch.Tensor, optional
        Shape ``(batch_size,)``, int32. If given, a request with a block-table entry outside
        ``[0, num_pages)`` on a touched position (``ErrorFlag.BLOCK_TABLE``), a bad prefix length
        (``ErrorFlag.LENGTH``) or a malformed path (``ErrorFlag.ACCEPTANCE``) is flagged and its
        cache left untouched; if omitted it raises ``ValueError`` (a host sync on CUDA).
    all_or_nothing : bool
        With ``error_flags``: if any request of the batch is flagged (by this op, or on entry
        by an earlier op such as ``accept``), no request's cache is touched. This lets a
        commit follow ``accept`` on the stream without waiting for its verdict.
    backend : {"auto", "cuda", "reference"}
        See ``ddtree.kernels``.

    Raises
    ------
    ValueError
        Shapes, dtypes or devices that disagree.
    """
    if resolve_backend(backend, kv_cache.device) == "cuda":
        from ddtree.kernels import tree_cuda

        tree_cuda.commit_kv(
            kv_cache,
            block_table,
            prefix_lens,
            acceptance,
            error_flags=error_flags,
            all_or_nothing=all_or_nothing,
        )
        return
    reference.commit_kv(
        kv_cache,
        block_table,
        prefix_lens,
        acceptance,
        error_flags=error_flags,
        all_or_nothing=all_or_nothing,
    )
