"""Checks of caller-provided destinations (``out=``) before a call, shared by the clients.

Errors are ``InvalidArgumentError`` naming the field (``build_tree.out.tokens``), reason
``INVALID_TENSOR``, raised before anything is sent or launched.
"""

from __future__ import annotations

import torch

from ddtree.clients.errors import InvalidArgumentError
from ddtree.kernels.types import MAX_BUDGET, Acceptance, Tree, mask_words

__all__ = ["check_acceptance_out", "check_kind", "check_tree_out"]


def _invalid(field: str, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        "INVALID_ARGUMENT", f"{field}: {problem}", reason="INVALID_TENSOR", field=field
    )


def check_kind(prefix: str, out: object, kind: type) -> None:
    """Refuse ``out`` unless it is a ``kind`` (``Tree`` or ``Acceptance``); ``prefix`` names
    it (``"build_tree.out"``)."""
    if not isinstance(out, kind):
        raise _invalid(prefix, f"expected a {kind.__name__}, got {type(out).__name__}")


def _check_out(
    prefix: str,
    out: object,
    kind: type,
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
    device: torch.device,
    main: str,
) -> None:
    """Refuse destinations ``out`` (a ``kind``) unless each tensor has its ``expected`` shape
    and dtype, lies on ``device`` (where the input ``main`` is) and is contiguous."""
    check_kind(prefix, out, kind)
    for name, (shape, dtype) in expected.items():
        field = f"{prefix}.{name}"
        tensor = getattr(out, name)
        if not isinstance(tensor, torch.Tensor):
            raise _invalid(field, f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != dtype:
            raise _invalid(field, f"expected dtype {dtype}, got {tensor.dtype}")
        if tuple(tensor.shape) != shape:
            raise _invalid(field, f"expected shape {shape}, got {tuple(tensor.shape)}")
        if tensor.device != device:
            raise _invalid(
                field, f"expected a tensor on {device}, where {main} is, got one on {tensor.device}"
            )
        if not tensor.is_contiguous():
            raise _invalid(field, f"expected a contiguous tensor; pass {name}.contiguous()")


def check_tree_out(
    out: Tree,
    draft_logits: torch.Tensor,
    budget: int | torch.Tensor,
    max_budget: int | None,
) -> None:
    """Refuse ``out`` unless it fits ``build_tree``'s result for these arguments exactly.

    Parameters
    ----------
    out : Tree
        Destinations: ``(batch_size, 1 + (max_budget or largest budget))`` tokens int64,
        parents and depths int32, log_probs float32, ``(batch_size,)`` num_nodes int32,
        ``(..., mask_words)`` mask int64, all on ``draft_logits.device``, contiguous, and
        ``draft_len`` equal to the logits'.
    draft_logits : torch.Tensor
        The call's logits, ``(batch_size, draft_len, vocab_size)``; when they (or the budget)
        are malformed only ``out``'s type is checked and the call's own validation names them.
    budget : int or torch.Tensor
        The call's budget (a per-request tensor is read on the host).
    max_budget : int, optional
        The call's ``max_budget``.

    Raises
    ------
    InvalidArgumentError
        Naming the field of ``out`` (``build_tree.out.mask``).
    """
    largest = max_budget or (
        int(budget.max()) if isinstance(budget, torch.Tensor) and budget.numel() else budget
    )
    if draft_logits.dim() != 3 or not isinstance(largest, int) or not 1 <= largest <= MAX_BUDGET:
        # Bad inputs: the server names them; out cannot be checked against them.
        _check_out("build_tree.out", out, Tree, {}, draft_logits.device, "draft_logits")
        return
    batch_size, draft_len, _ = draft_logits.shape
    pair = (batch_size, 1 + largest)
    _check_out(
        "build_tree.out",
        out,
        Tree,
        {
            "tokens": (pair, torch.int64),
            "parents": (pair, torch.int32),
            "depths": (pair, torch.int32),
            "log_probs": (pair, torch.float32),
            "num_nodes": ((batch_size,), torch.int32),
            "mask": ((*pair, mask_words(1 + largest)), torch.int64),
        },
        draft_logits.device,
        "draft_logits",
    )
    if out.draft_len != draft_len:
        raise _invalid("build_tree.out.draft_len", f"expected {draft_len}, got {out.draft_len}")


def check_acceptance_out(out: Acceptance, tree: Tree) -> None:
    """Refuse ``out`` unless it fits ``accept_tree``'s result for ``tree`` exactly:
    ``(batch_size, draft_len + 1)`` nodes int32 and tokens int64, ``(batch_size,)`` length int32
    and bonus int64, on ``tree.tokens.device``, contiguous.

    Raises
    ------
    InvalidArgumentError
        Naming the field of ``out`` (``accept_tree.out.nodes``).
    """
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if tree.tokens.dim() == 2:
        path = (tree.tokens.shape[0], tree.draft_len + 1)
        expected = {
            "nodes": (path, torch.int32),
            "tokens": (path, torch.int64),
            "length": (path[:1], torch.int32),
            "bonus": (path[:1], torch.int64),
        }
    _check_out("accept_tree.out", out, Acceptance, expected, tree.tokens.device, "tree.tokens")
