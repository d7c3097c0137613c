"""Argument checks and per-request error flags shared by the reference and the CUDA ops.

Two kinds of checks live here.

*Host-side argument checks* (``check_*``, ``normalize_budget``) look only at tensor metadata and
Python numbers (rank, shape, dtype, device, contiguity, limits), never at tensor contents, so
they cost no device synchronisation. They raise ``TypeError`` for a value of the wrong type and
``ValueError`` otherwise; every message names the parameter, says what was expected and what
was received, and how to fix it.

*Data flags* (``*_flags``) look at the contents of caller tensors (token ids, trees, block
tables, lengths, acceptance paths) with vectorised torch code on the tensors' device and return
``ErrorFlag`` bits per request, shape ``(batch_size,)`` int32, without synchronising.
``resolve_flags`` then either ORs them into the caller's ``error_flags`` (asynchronous) or, when
the caller passed none, raises ``ValueError`` naming the field and the bad request indices (a
host sync on CUDA). The CUDA kernels compute the same bits on the device; these functions are
their specification and their eager fallback.

A request whose ``error_flags`` entry is non-zero after the OR, including bits set by an earlier
op, is skipped: ops leave its outputs (and any caller memory they would write) untouched, so a
flagged request flows harmlessly through ``build_tree``, ``accept`` and ``commit_kv`` when the
same ``error_flags`` tensor is passed to each.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from ddtree.kernels.types import (
    ACCEPTANCE_FIELDS,
    MAX_BUDGET,
    MAX_DRAFT_LEN,
    TREE_FIELDS,
    Acceptance,
    ErrorFlag,
    Tree,
)

__all__ = [
    "FLAG_MESSAGES",
    "FLOAT_DTYPES",
    "MAX_PAGE_SIZE",
    "acceptance_flags",
    "attention_flags",
    "check_accept_args",
    "check_acceptance_out",
    "check_build_tree_args",
    "check_commit_kv_args",
    "check_error_flags",
    "check_tensor",
    "check_tree",
    "check_verify_attention_args",
    "commit_kv_flags",
    "normalize_budget",
    "resolve_flags",
    "root_token_flags",
    "target_token_flags",
    "tree_flags",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Logit dtypes every op accepts."""

MAX_PAGE_SIZE = 256
"""Largest KV-cache page size ``commit_kv`` and ``verify_attention`` accept."""

_INT_DTYPES = (torch.int32, torch.int64)

FLAG_MESSAGES: dict[str, dict[ErrorFlag, str]] = {
    "build_tree": {ErrorFlag.TOKEN: "root_tokens: token id outside [0, vocab_size)"},
    "accept": {
        ErrorFlag.TREE: (
            "tree: malformed (num_nodes outside [1, num_nodes_max], a parent that is not an "
            "earlier node, or a depth that is not parent depth + 1 within draft_len)"
        ),
        ErrorFlag.TOKEN: "target_tokens: negative token id at a node of the tree",
    },
    "commit_kv": {
        ErrorFlag.ACCEPTANCE: (
            "acceptance: malformed path (length outside [1, path_len], or nodes not an "
            "increasing sequence starting at node 0)"
        ),
        ErrorFlag.LENGTH: (
            "prefix_lens: negative, or the accepted path reaches past max_pages * page_size"
        ),
        ErrorFlag.BLOCK_TABLE: "block_table: entry outside [0, num_pages) for a touched position",
    },
    "verify_attention": {
        ErrorFlag.TREE: "tree.num_nodes: outside [1, num_nodes_max]",
        ErrorFlag.LENGTH: (
            "prefix_lens: negative, or prefix_len + num_nodes beyond max_pages * page_size"
        ),
        ErrorFlag.BLOCK_TABLE: "block_table: entry outside [0, num_pages) for a touched position",
    },
}
"""Per op, what ``resolve_flags`` says for each bit the op can raise (field name first)."""


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    value: object,
    name: str,
    *,
    shape: Sequence[int | None],
    shape_doc: str,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument's type, rank, shape, dtype, device and layout.

    Parameters
    ----------
    value : object
        The argument as received.
    name : str
        Parameter name used in messages.
    shape : sequence of int or None
        Expected sizes; ``None`` accepts any size in that dimension.
    shape_doc : str
        The shape as the docs write it, e.g. ``"(batch_size, num_nodes_max)"``.
    dtypes : sequence of torch.dtype
        Accepted dtypes.
    device : torch.device, optional
        Required device (usually the first tensor argument's).
    contiguous : bool
        Whether the tensor must be contiguous.

    Returns
    -------
    torch.Tensor
        ``value``, unchanged.

    Raises
    ------
    TypeError
        ``value`` is not a tensor.
    ValueError
        Rank, a size, the dtype, the device or the layout differs from the expectation.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape {shape_doc}, got {type(value)}")
    sizes = ["*" if s is None else str(s) for s in shape]
    expected = f"({sizes[0]},)" if len(sizes) == 1 else f"({', '.join(sizes)})"
    if value.dim() != len(shape) or any(
        s is not None and s != got for s, got in zip(shape, value.shape, strict=True)
    ):
        raise ValueError(
            f"{name}: expected shape {shape_doc} = {expected}, got {tuple(value.shape)}"
        )
    if value.dtype not in dtypes:
        raise ValueError(
            f"{name}: expected dtype {_dtype_names(dtypes)}, got {value.dtype}; "
            f"convert it with .to(torch.{_dtype_names(dtypes[:1])})"
        )
    if device is not None and value.device != device:
        raise ValueError(
            f"{name}: expected a tensor on {device} like the other arguments, got {value.device}; "
            f"move it with .to({str(device)!r})"
        )
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor; pass {name}.contiguous()")
    return value


def _check_int(value: object, name: str, low: int, high: int, doc: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int in [{low}, {high}] ({doc}), got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name}: expected {low} <= {name} <= {high} ({doc}), got {value}")
    return value


def _check_float(value: object, name: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {value!r}")
    value = float(value)
    bound = ">= 0" if allow_zero else "> 0"
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}: expected a finite float {bound}, got {value}")
    return value


def check_error_flags(
    error_flags: torch.Tensor | None, batch_size: int, device: torch.device
) -> None:
    """Check an optional ``error_flags`` argument: shape ``(batch_size,)``, int32, ``device``.

    Raises
    ------
    TypeError, ValueError
        As ``check_tensor``.
    """
    if error_flags is not None:
        check_tensor(
            error_flags,
            "error_flags",
            shape=(batch_size,),
            shape_doc="(batch_size,)",
            dtypes=(torch.int32,),
            device=device,
        )


def normalize_budget(
    budget: int | torch.Tensor,
    batch_size: int,
    device: torch.device,
    max_budget: int | None,
) -> tuple[torch.Tensor, int]:
    """Turn ``budget`` (int or per-request tensor) and ``max_budget`` into a tensor and a bound.

    Parameters
    ----------
    budget : int or torch.Tensor
        One int in ``[1, 1024]``, or shape ``(batch_size,)`` int32/int64 on ``device``.
    batch_size : int
        Requests in the call.
    device : torch.device
        Device of the op's tensors.
    max_budget : int, optional
        Upper bound of ``budget``, ``1..1024``; it fixes ``num_nodes_max = 1 + max_budget``.
        With an int ``budget`` it must be ``>= budget``. With a tensor ``budget`` and
        ``max_budget`` given, the values are not read on the host: each is clamped into
        ``[1, max_budget]`` on the device. With a tensor ``budget`` and no ``max_budget``, the
        values are read (a host sync on CUDA) and must lie in ``[1, 1024]``.

    Returns
    -------
    tuple of (torch.Tensor, int)
        The budgets, shape ``(batch_size,)`` int32 on ``device``, and ``num_nodes_max``.

    Raises
    ------
    TypeError
        ``budget`` is neither an int nor a tensor, or ``max_budget`` is not an int.
    ValueError
        A budget or ``max_budget`` outside ``[1, 1024]``, ``max_budget < budget``, or a budget
        tensor of the wrong shape, dtype or device.
    """
    limit_doc = f"MAX_BUDGET = {MAX_BUDGET}"
    if max_budget is not None:
        _check_int(max_budget, "max_budget", 1, MAX_BUDGET, limit_doc)
    if isinstance(budget, torch.Tensor):
        check_tensor(
            budget,
            "budget",
            shape=(batch_size,),
            shape_doc="(batch_size,)",
            dtypes=_INT_DTYPES,
            device=device,
        )
        if max_budget is None:
            low, high = int(budget.min()), int(budget.max())
            if low < 1 or high > MAX_BUDGET:
                raise ValueError(
                    f"budget: expected every entry in [1, {MAX_BUDGET}], got values in "
                    f"[{low}, {high}]"
                )
            return budget.to(torch.int32), 1 + high  # [batch]
        return budget.clamp(1, max_budget).to(torch.int32), 1 + max_budget  # [batch]
    _check_int(budget, "budget", 1, MAX_BUDGET, limit_doc)
    if max_budget is not None and max_budget < budget:
        raise ValueError(
            f"max_budget: expected max_budget >= budget = {budget}, got {max_budget}; "
            "raise max_budget or leave it out"
        )
    bound = budget if max_budget is None else max_budget
    tensor = torch.full((batch_size,), budget, dtype=torch.int32, device=device)  # [batch]
    return tensor, 1 + bound


def check_build_tree_args(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int | torch.Tensor,
    *,
    temperature: float,
    max_budget: int | None,
    error_flags: torch.Tensor | None,
    out: Tree | None = None,
) -> tuple[torch.Tensor, int]:
    """Check ``build_tree``'s arguments (see ``ddtree.kernels.build_tree``).

    Returns
    -------
    tuple of (torch.Tensor, int)
        ``normalize_budget``'s result: budgets ``(batch_size,)`` int32 and ``num_nodes_max``.

    Raises
    ------
    TypeError, ValueError
        The message names the offending parameter.
    """
    check_tensor(
        draft_logits,
        "draft_logits",
        shape=(None, None, None),
        shape_doc="(batch_size, draft_len, vocab_size)",
        dtypes=FLOAT_DTYPES,
        contiguous=True,
    )
    batch_size, draft_len, vocab_size = draft_logits.shape
    if not 1 <= draft_len <= MAX_DRAFT_LEN or vocab_size < 1 or batch_size < 1:
        raise ValueError(
            "draft_logits: expected shape (batch_size, draft_len, vocab_size) with "
            f"batch_size >= 1, 1 <= draft_len <= {MAX_DRAFT_LEN} and vocab_size >= 1, "
            f"got {tuple(draft_logits.shape)}"
        )
    device = draft_logits.device
    check_tensor(
        root_tokens,
        "root_tokens",
        shape=(batch_size,),
        shape_doc="(batch_size,)",
        dtypes=(torch.int64,),
        device=device,
    )
    _check_float(temperature, "temperature", allow_zero=False)
    check_error_flags(error_flags, batch_size, device)
    budgets, num_nodes_max = normalize_budget(budget, batch_size, device, max_budget)
    if out is not None:
        check_tree_out(out, batch_size, num_nodes_max, draft_len, device)
        inputs = {"draft_logits": draft_logits, "root_tokens": root_tokens, "budget": budgets}
        if error_flags is not None:
            inputs["error_flags"] = error_flags
        check_disjoint(_fields("out", out, TREE_FIELDS), inputs)
    return budgets, num_nodes_max


def check_tree_out(
    out: Tree, batch_size: int, num_nodes_max: int, draft_len: int, device: torch.device
) -> None:
    """Check a ``build_tree`` destination: a ``Tree`` of exactly the result's shapes and dtypes
    (``batch_size`` requests, ``num_nodes_max`` slots, ``draft_len``) on ``device``, every
    tensor contiguous.

    Raises
    ------
    TypeError, ValueError
        The message names the offending field of ``out``.
    """
    check_tree(out, "out")
    if tuple(out.tokens.shape) != (batch_size, num_nodes_max):
        raise ValueError(
            f"out.tokens: expected shape (batch_size, 1 + max_budget) = "
            f"({batch_size}, {num_nodes_max}), got {tuple(out.tokens.shape)}"
        )
    if out.draft_len != draft_len:
        raise ValueError(f"out.draft_len: expected {draft_len}, got {out.draft_len}")
    for name, tensor in _fields("out", out, TREE_FIELDS).items():
        if tensor.device != device:
            raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor")


def check_disjoint(outputs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """Check that no tensor of ``outputs`` shares a byte with another one or with ``inputs``
    (both keyed by the name an error gives them).

    Raises
    ------
    ValueError
        Two of them overlap; the message names both.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in [*outputs.items(), *inputs.items()]
        if t.numel()
    )
    for (_, end, name), (start, _, other) in itertools.pairwise(spans):
        if start < end:
            raise ValueError(f"{other}: overlaps {name} (outputs must not share memory)")


def _fields(prefix: str, value: object, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``{"prefix.name": value.name}`` for the tensor fields ``names`` of a Tree or Acceptance."""
    fields: dict[str, torch.Tensor] = {f"{prefix}.{n}": getattr(value, n) for n in names}
    return fields


def check_tree(tree: object, name: str = "tree") -> Tree:
    """Check that a ``Tree``'s tensors agree in batch, node slots, dtype and device.

    Returns
    -------
    Tree
        ``tree``, unchanged.

    Raises
    ------
    TypeError
        ``tree`` is not a ``Tree``.
    ValueError
        A field's shape, dtype or device disagrees with ``tree.tokens``, or ``draft_len`` is
        outside ``[1, 32]``.
    """
    if not isinstance(tree, Tree):
        raise TypeError(f"{name}: expected a ddtree.kernels.Tree, got {type(tree)}")
    check_tensor(
        tree.tokens,
        f"{name}.tokens",
        shape=(None, None),
        shape_doc="(batch_size, num_nodes_max)",
        dtypes=(torch.int64,),
    )
    batch_size, num_nodes_max = tree.tokens.shape
    device = tree.tokens.device
    if batch_size < 1 or num_nodes_max < 1:
        raise ValueError(
            f"{name}.tokens: expected shape (batch_size, num_nodes_max) with both >= 1, "
            f"got {tuple(tree.tokens.shape)}"
        )
    pair = (batch_size, num_nodes_max)
    pair_doc = "(batch_size, num_nodes_max)"
    for field, dtype in (("parents", torch.int32), ("depths", torch.int32)):
        check_tensor(
            getattr(tree, field),
            f"{name}.{field}",
            shape=pair,
            shape_doc=pair_doc,
            dtypes=(dtype,),
            device=device,
        )
    check_tensor(
        tree.log_probs,
        f"{name}.log_probs",
        shape=pair,
        shape_doc=pair_doc,
        dtypes=(torch.float32,),
        device=device,
    )
    check_tensor(
        tree.num_nodes,
        f"{name}.num_nodes",
        shape=(batch_size,),
        shape_doc="(batch_size,)",
        dtypes=(torch.int32,),
        device=device,
    )
    check_tensor(
        tree.mask,
        f"{name}.mask",
        shape=(batch_size, num_nodes_max, (num_nodes_max + 63) // 64),
        shape_doc="(batch_size, num_nodes_max, mask_words(num_nodes_max))",
        dtypes=(torch.int64,),
        device=device,
    )
    _check_int(tree.draft_len, f"{name}.draft_len", 1, MAX_DRAFT_LEN, "MAX_DRAFT_LEN")
    return tree


def check_accept_args(
    tree: Tree,
    target_tokens: torch.Tensor | None,
    *,
    target_logits: torch.Tensor | None,
    temperature: float,
    generator: torch.Generator | None,
    error_flags: torch.Tensor | None,
    out: Acceptance | None = None,
) -> None:
    """Check ``accept``'s arguments (see ``ddtree.kernels.accept``).

    Raises
    ------
    TypeError, ValueError
        The message names the offending parameter.
    """
    check_tree(tree)
    batch_size, num_nodes_max = tree.tokens.shape
    device = tree.device
    if (target_tokens is None) == (target_logits is None):
        raise ValueError(
            "target_tokens, target_logits: expected exactly one of them, got "
            + ("both" if target_tokens is not None else "neither")
        )
    if target_tokens is not None:
        check_tensor(
            target_tokens,
            "target_tokens",
            shape=(batch_size, num_nodes_max),
            shape_doc="(batch_size, num_nodes_max)",
            dtypes=(torch.int64,),
            device=device,
        )
    else:
        check_tensor(
            target_logits,
            "target_logits",
            shape=(batch_size, num_nodes_max, None),
            shape_doc="(batch_size, num_nodes_max, vocab_size)",
            dtypes=FLOAT_DTYPES,
            device=device,
        )
        if target_logits is not None and target_logits.shape[2] < 1:
            raise ValueError("target_logits: expected vocab_size >= 1, got 0")
    temperature = _check_float(temperature, "temperature", allow_zero=True)
    if temperature > 0 and target_logits is None:
        raise ValueError(
            f"temperature: sampling (temperature = {temperature} > 0) needs target_logits; "
            "pass target_logits or use temperature=0"
        )
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator, got {type(generator)}")
        if generator.device.type != device.type:
            raise ValueError(
                f"generator: expected a generator on {device.type} like the tree, "
                f"got one on {generator.device}"
            )
    check_error_flags(error_flags, batch_size, device)
    if out is not None:
        check_acceptance_out(out, batch_size, tree.draft_len + 1, device)
        inputs = _fields("tree", tree, TREE_FIELDS)
        for name, tensor in (
            ("target_tokens", target_tokens),
            ("target_logits", target_logits),
            ("error_flags", error_flags),
        ):
            if tensor is not None:
                inputs[name] = tensor
        check_disjoint(_fields("out", out, ACCEPTANCE_FIELDS), inputs)


def check_acceptance_out(
    out: Acceptance, batch_size: int, path_len: int, device: torch.device
) -> None:
    """Check an ``accept`` destination: an ``Acceptance`` of exactly the result's shapes and
    dtypes (``batch_size`` requests, ``path_len`` slots) on ``device``, every tensor contiguous.

    Raises
    ------
    TypeError, ValueError
        The message names the offending field of ``out``.
    """
    if not isinstance(out, Acceptance):
        raise TypeError(f"out: expected a ddtree.kernels.Acceptance, got {type(out)}")
    pair, single = (batch_size, path_len), (batch_size,)
    for name, shape, dtype in (
        ("nodes", pair, torch.int32),
        ("tokens", pair, torch.int64),
        ("length", single, torch.int32),
        ("bonus", single, torch.int64),
    ):
        check_tensor(
            getattr(out, name),
            f"out.{name}",
            shape=shape,
            shape_doc="(batch_size, draft_len + 1)" if len(shape) == 2 else "(batch_size,)",
            dtypes=(dtype,),
            device=device,
            contiguous=True,
        )


def _check_acceptance(acceptance: object, batch_size: int, device: torch.device) -> None:
    if not isinstance(acceptance, Acceptance):
        raise TypeError(f"acceptance: expected a ddtree.kernels.Acceptance, got {type(acceptance)}")
    check_tensor(
        acceptance.nodes,
        "acceptance.nodes",
        shape=(batch_size, None),
        shape_doc="(batch_size, path_len)",
        dtypes=(torch.int32,),
        device=device,
    )
    path_len = acceptance.nodes.shape[1]
    if path_len < 1:
        raise ValueError("acceptance.nodes: expected path_len >= 1, got 0")
    check_tensor(
        acceptance.tokens,
        "acceptance.tokens",
        shape=(batch_size, path_len),
        shape_doc="(batch_size, path_len)",
        dtypes=(torch.int64,),
        device=device,
    )
    check_tensor(
        acceptance.length,
        "acceptance.length",
        shape=(batch_size,),
        shape_doc="(batch_size,)",
        dtypes=(torch.int32,),
        device=device,
    )


def _check_paged(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    batch_size: int | None,
    kv_dtypes: Sequence[torch.dtype] | None,
) -> int:
    check_tensor(
        kv_cache,
        "kv_cache",
        shape=(None, None, None),
        shape_doc="(num_pages, page_size, head_dim)",
        dtypes=kv_dtypes if kv_dtypes is not None else (kv_cache.dtype,),
        contiguous=True,
    )
    num_pages, page_size, head_dim = kv_cache.shape
    if num_pages < 1 or not 1 <= page_size <= MAX_PAGE_SIZE or head_dim < 1:
        raise ValueError(
            "kv_cache: expected shape (num_pages, page_size, head_dim) with num_pages >= 1, "
            f"1 <= page_size <= {MAX_PAGE_SIZE} and head_dim >= 1, got {tuple(kv_cache.shape)}"
        )
    device = kv_cache.device
    check_tensor(
        block_table,
        "block_table",
        shape=(batch_size, None),
        shape_doc="(batch_size, max_pages)",
        dtypes=(torch.int32,),
        device=device,
    )
    if block_table.shape[1] < 1:
        raise ValueError("block_table: expected max_pages >= 1, got 0")
    check_tensor(
        prefix_lens,
        "prefix_lens",
        shape=(block_table.shape[0],),
        shape_doc="(batch_size,)",
        dtypes=(torch.int32,),
        device=device,
    )
    return page_size


def check_commit_kv_args(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    acceptance: Acceptance,
    *,
    error_flags: torch.Tensor | None,
) -> None:
    """Check ``commit_kv``'s arguments (see ``ddtree.kernels.commit_kv``).

    Raises
    ------
    TypeError, ValueError
        The message names the offending parameter.
    """
    if not isinstance(acceptance, Acceptance):
        raise TypeError(f"acceptance: expected a ddtree.kernels.Acceptance, got {type(acceptance)}")
    _check_paged(kv_cache, block_table, prefix_lens, None, None)
    _check_acceptance(acceptance, block_table.shape[0], kv_cache.device)
    check_error_flags(error_flags, block_table.shape[0], kv_cache.device)


def check_verify_attention_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree: Tree,
    *,
    v_dim: int,
    sm_scale: float | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    error_flags: torch.Tensor | None,
) -> float:
    """Check ``verify_attention``'s arguments (see ``ddtree.kernels.verify_attention``).

    Returns
    -------
    float
        The softmax scale to use (``1 / sqrt(head_dim)`` when ``sm_scale`` is None).

    Raises
    ------
    TypeError, ValueError
        The message names the offending parameter.
    """
    check_tree(tree)
    batch_size, num_nodes_max = tree.tokens.shape
    check_tensor(
        q,
        "q",
        shape=(batch_size, num_nodes_max, None, None),
        shape_doc="(batch_size, num_nodes_max, num_heads, head_dim)",
        dtypes=(torch.bfloat16,),
        device=tree.device,
    )
    _, _, num_heads, head_dim = q.shape
    if num_heads < 1:
        raise ValueError("q: expected num_heads >= 1, got 0")
    _check_paged(kv_cache, block_table, prefix_lens, batch_size, (q.dtype,))
    if kv_cache.device != q.device:
        raise ValueError(f"kv_cache: expected a tensor on {q.device} like q, got {kv_cache.device}")
    if kv_cache.shape[2] != head_dim:
        raise ValueError(
            f"kv_cache: expected head_dim = q.shape[3] = {head_dim}, got {kv_cache.shape[2]}"
        )
    _check_int(v_dim, "v_dim", 1, head_dim, "the value width, at most head_dim")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    sm_scale = _check_float(sm_scale, "sm_scale", allow_zero=False)
    if out is not None:
        check_tensor(
            out,
            "out",
            shape=(batch_size, num_nodes_max, num_heads, v_dim),
            shape_doc="(batch_size, num_nodes_max, num_heads, v_dim)",
            dtypes=(q.dtype,),
            device=q.device,
        )
    if lse is not None:
        check_tensor(
            lse,
            "lse",
            shape=(batch_size, num_nodes_max, num_heads),
            shape_doc="(batch_size, num_nodes_max, num_heads)",
            dtypes=(torch.float32,),
            device=q.device,
        )
    check_error_flags(error_flags, batch_size, q.device)
    return sm_scale


# ----------------------------------------------------------------------------------------------
# Data flags: vectorised over the batch, no host synchronisation.


def _bits(condition: torch.Tensor, flag: ErrorFlag) -> torch.Tensor:
    return condition.to(torch.int32) * int(flag)  # [batch]


def root_token_flags(root_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``ErrorFlag.TOKEN`` for each root token outside ``[0, vocab_size)``.

    Parameters
    ----------
    root_tokens : torch.Tensor
        Shape ``(batch_size,)``, int64.
    vocab_size : int
        Vocabulary size of the draft logits.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size,)``, int32 flag bits.
    """
    return _bits((root_tokens < 0) | (root_tokens >= vocab_size), ErrorFlag.TOKEN)  # [batch]


def tree_flags(tree: Tree) -> torch.Tensor:
    """``ErrorFlag.TREE`` for each malformed tree.

    A tree is well formed when ``1 <= num_nodes <= num_nodes_max``, ``depths[0] == 0`` and,
    for every node ``1 <= i < num_nodes``, ``0 <= parents[i] < i``,
    ``depths[i] == depths[parents[i]] + 1`` and ``depths[i] <= draft_len``. Slots at or past
    ``num_nodes``, tokens, log-probabilities and the mask are not inspected.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size,)``, int32 flag bits.
    """
    num_nodes_max = tree.num_nodes_max
    num_nodes = tree.num_nodes.long()  # [batch]
    count_bad = (num_nodes < 1) | (num_nodes > num_nodes_max)  # [batch]
    node = torch.arange(num_nodes_max, device=tree.device)  # [nodes]
    in_tree = (node[None, :] >= 1) & (node[None, :] < num_nodes[:, None])  # [batch, nodes]
    parents = tree.parents.long()  # [batch, nodes]
    parent_ok = (parents >= 0) & (parents < node[None, :])  # [batch, nodes]
    parent_depth = tree.depths.gather(1, parents.clamp(0, num_nodes_max - 1))  # [batch, nodes]
    depth_ok = (tree.depths == parent_depth + 1) & (tree.depths <= tree.draft_len)  # [batch, nodes]
    node_bad = (in_tree & ~(parent_ok & depth_ok)).any(dim=1)  # [batch]
    root_bad = tree.depths[:, 0] != 0  # [batch]
    return _bits(count_bad | node_bad | root_bad, ErrorFlag.TREE)  # [batch]


def target_token_flags(tree: Tree, target_tokens: torch.Tensor) -> torch.Tensor:
    """``ErrorFlag.TOKEN`` for each request with a negative target token at a node of its tree.

    Only nodes ``i < num_nodes`` (clamped to ``[0, num_nodes_max]``) are inspected.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size,)``, int32 flag bits.
    """
    node = torch.arange(tree.num_nodes_max, device=tree.device)  # [nodes]
    in_tree = node[None, :] < tree.num_nodes.long()[:, None]  # [batch, nodes]
    return _bits((in_tree & (target_tokens < 0)).any(dim=1), ErrorFlag.TOKEN)  # [batch]


def acceptance_flags(acceptance: Acceptance) -> torch.Tensor:
    """``ErrorFlag.ACCEPTANCE`` for each malformed accepted path.

    A path is well formed when ``1 <= length <= path_len``, ``nodes[0] == 0`` and
    ``nodes[0] < nodes[1] < ... < nodes[length - 1]``. Slots past ``length`` are ignored.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size,)``, int32 flag bits.
    """
    nodes = acceptance.nodes.long()  # [batch, path]
    path_len = nodes.shape[1]
    length = acceptance.length.long()  # [batch]
    length_bad = (length < 1) | (length > path_len)  # [batch]
    step = torch.arange(1, path_len, device=nodes.device)  # [path - 1]
    in_path = step[None, :] < length[:, None]  # [batch, path - 1]
    not_increasing = (in_path & (nodes[:, 1:] <= nodes[:, :-1])).any(dim=1)  # [batch]
    return _bits(length_bad | not_increasing | (nodes[:, 0] != 0), ErrorFlag.ACCEPTANCE)  # [batch]


def _block_flags(
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    end: torch.Tensor,
    num_pages: int,
    page_size: int,
    touched: torch.Tensor | None = None,
) -> torch.Tensor:
    """LENGTH / BLOCK_TABLE bits for a request that touches logical positions below ``end``.

    ``touched`` (``[batch, positions]`` int64, ``-1`` for none) restricts the block check to
    those positions; otherwise every position in ``[0, end)`` counts as touched.
    """
    capacity = block_table.shape[1] * page_size
    prefix = prefix_lens.long()  # [batch]
    length_bad = (prefix < 0) | (end > capacity)  # [batch]
    if touched is None:
        block = torch.arange(block_table.shape[1], device=block_table.device)  # [pages]
        used = block[None, :] * page_size < end.clamp(max=capacity)[:, None]  # [batch, pages]
        entries = block_table  # [batch, pages]
    else:
        valid = (touched >= 0) & (touched < capacity)  # [batch, positions]
        block = (touched.clamp(0, capacity - 1) // page_size).long()  # [batch, positions]
        entries = block_table.gather(1, block)  # [batch, positions]
        used = valid
    bad_entry = (entries < 0) | (entries >= num_pages)  # [batch, pages or positions]
    block_bad = (used & bad_entry).any(dim=1)  # [batch]
    return _bits(length_bad, ErrorFlag.LENGTH) | _bits(block_bad, ErrorFlag.BLOCK_TABLE)  # [batch]


def commit_kv_flags(
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    acceptance: Acceptance,
    num_pages: int,
    page_size: int,
) -> torch.Tensor:
    """``ACCEPTANCE``, ``LENGTH`` and ``BLOCK_TABLE`` bits for ``commit_kv``.

    ``ErrorFlag.ACCEPTANCE`` as in ``acceptance_flags``. For a well-formed path, the touched
    positions are ``prefix_len + m`` (destinations) and ``prefix_len + nodes[m]`` (sources) for
    ``m < length``: ``ErrorFlag.LENGTH`` if ``prefix_len < 0`` or the last source
    ``prefix_len + nodes[length - 1]`` is not below ``max_pages * page_size``;
    ``ErrorFlag.BLOCK_TABLE`` if a touched position inside the table maps to an entry outside
    ``[0, num_pages)``.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size,)``, int32 flag bits.
    """
    path_flags = acceptance_flags(acceptance)  # [batch]
    well_formed = path_flags == 0  # [batch]
    nodes = acceptance.nodes.long()  # [batch, path]
    path_len = nodes.shape[1]
    length = acceptance.length.long().clamp(1, path_len)  # [batch]
    prefix = prefix_lens.long()  # [batch]
    slot = torch.arange(path_len, device=nodes.device)  # [path]
    in_path = slot[None, :] < length[:, None]  # [batch, path]
    last = nodes.gather(1, (length - 1)[:, None]).squeeze(1)  # [batch]
    sources = torch.where(in_path, prefix[:, None] + nodes, -1)  # [batch, path]
    dests = torch.where(in_path, prefix[:, None] + slot[None, :], -1)  # [batch, path]
    touched = torch.cat([sources, dests], dim=1)  # [batch, 2 * path]
    paged = _block_flags(block_table, prefix_lens, prefix + last + 1, num_pages, page_size, touched)
    return path_flags | torch.where(well_formed, paged, 0)  # [batch]


def attention_flags(
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree: Tree,
    num_pages: int,
    page_size: int,
) -> torch.Tensor:
    """``TREE``, ``LENGTH`` and ``BLOCK_TABLE`` bits for ``verify_attention``.

    ``ErrorFlag.TREE`` if ``num_nodes`` is outside ``[1, num_nodes_max]``. The touched positions
    are ``[0, prefix_len + num_nodes)``: ``ErrorFlag.LENGTH`` if ``prefix_len < 0`` or that end
    exceeds ``max_pages * page_size``; ``ErrorFlag.BLOCK_TABLE`` if an entry for a touched
    block is outside ``[0, num_pages)``.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size,)``, int32 flag bits.
    """
    num_nodes = tree.num_nodes.long()  # [batch]
    count_bad = (num_nodes < 1) | (num_nodes > tree.num_nodes_max)  # [batch]
    end = prefix_lens.long() + num_nodes.clamp(1, tree.num_nodes_max)  # [batch]
    paged = _block_flags(block_table, prefix_lens, end, num_pages, page_size)  # [batch]
    return _bits(count_bad, ErrorFlag.TREE) | paged  # [batch]


def resolve_flags(
    flags: torch.Tensor,
    error_flags: torch.Tensor | None,
    fields: dict[ErrorFlag, str],
) -> torch.Tensor:
    """Record or raise the data flags an op computed, and say which requests to skip.

    Parameters
    ----------
    flags : torch.Tensor
        Shape ``(batch_size,)``, int32: the bits this op found.
    error_flags : torch.Tensor, optional
        Shape ``(batch_size,)``, int32, the caller's flags. If given, ``flags`` are OR-ed into
        it in place (no sync) and every request with a non-zero entry, including bits set by an
        earlier op, is to be skipped. If omitted, any set bit raises ``ValueError`` (a host sync
        on CUDA).
    fields : dict of ErrorFlag to str
        For each bit the op can raise, what the message says, starting with the field name,
        e.g. ``{ErrorFlag.TOKEN: "root_tokens: token id outside [0, vocab_size)"}``.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size,)``, bool: ``True`` for requests the op must leave untouched.

    Raises
    ------
    ValueError
        ``error_flags`` is None and some request has a bit set; the message names the field,
        the bad request indices and the fix.
    """
    if error_flags is not None:
        error_flags |= flags
        return error_flags != 0  # [batch]
    if bool((flags != 0).any()):
        problems = []
        for flag, text in fields.items():
            bad = torch.nonzero(flags & int(flag)).flatten().tolist()
            if bad:
                shown = ", ".join(str(b) for b in bad[:16]) + (", ..." if len(bad) > 16 else "")
                problems.append(f"{text} in request(s) [{shown}]")
        raise ValueError(
            "; ".join(problems)
            + ". Fix the data, or pass error_flags to flag such requests instead of raising."
        )
    return torch.zeros_like(flags, dtype=torch.bool)  # [batch]
