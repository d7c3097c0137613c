"""Typed, validated arguments and results of the engine's ops (no gRPC types).

``convert`` builds these from protobuf requests; the embedded client builds them from the
caller's tensors. Either way ``validate_*`` (run by the ``Engine`` on every call) checks shapes,
dtypes, sizes and scalar ranges on the host, so both paths raise the same errors, each naming
the request field (``"build_tree.draft_logits: ..."``). Values inside tensors (token ids, parents,
block-table entries, lengths) are checked by the ops themselves through ``error_flags``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ddtree.kernels.types import MAX_BUDGET, MAX_DRAFT_LEN, Acceptance, Tree, mask_words
from ddtree.service.errors import (
    InvalidModelLabel,
    InvalidTensor,
    MissingField,
    TensorTooLarge,
    ValueOutOfRange,
)

if TYPE_CHECKING:
    from ddtree.service.memory import Leases
    from ddtree.service.replay import LaunchKey

__all__ = [
    "FLOAT_DTYPES",
    "MAX_MODEL_LABEL_CHARS",
    "MAX_PAGE_SIZE",
    "AcceptTreeCall",
    "AcceptTreeResult",
    "BuildTreeCall",
    "CallLimits",
    "KvCommitArgs",
    "Prepared",
    "VerifyAttentionCall",
    "validate_accept_tree",
    "validate_build_tree",
    "validate_model_label",
    "validate_verify_attention",
]

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes accepted for logits."""

MAX_MODEL_LABEL_CHARS = 64
"""Longest ``model`` label."""

MAX_PAGE_SIZE = 256
"""Largest KV-cache ``page_size`` the ops support."""

_MODEL_RE = re.compile(r"[A-Za-z0-9_.:-]*")
_DTYPE_NAMES = {
    torch.bfloat16: "BFLOAT16",
    torch.float16: "FLOAT16",
    torch.float32: "FLOAT32",
    torch.int32: "INT32",
    torch.int64: "INT64",
    torch.uint8: "UINT8",
}


@dataclass(frozen=True)
class CallLimits:
    """Size limits every call is checked against (from ``ServiceConfig``)."""

    max_batch_size: int = 1024
    """Largest ``batch_size``."""
    max_tensor_bytes: int = 512 << 20
    """Largest single tensor, bytes."""


class Prepared:
    """What the engine and the servicer worked out once for a decoded call that is sent again.

    The servicer keeps decoded by-reference calls (``DecodedCalls``) and hands out copies of one
    with a fresh deadline and fresh leases for every request that repeats it byte for byte.
    Every copy shares this object (``dataclasses.replace`` copies the reference), and nothing
    else does: its tensors are the same views of the same caller memory and its scalars are the
    same, so what was derived from them holds for every copy.

    Attributes
    ----------
    validated_for : CallLimits or None
        The limits the call passed ``validate_*`` under (the engine's own, compared by
        identity); ``None`` until it has.
    launch_key : LaunchKey or None
        A BuildTree call's replay key of its launches (see ``service.replay``), ``None`` until
        computed.
    accept_keys : tuple of (LaunchKey, LaunchKey or None), or None
        An AcceptTree call's replay keys: the walk's and, when the call commits the KV cache,
        the commit's. ``None`` until computed.
    reply : object or None
        The servicer's response to a call whose results go into caller memory: it names only
        the destinations, so it is the same for every copy. ``None`` until first sent.
    """

    __slots__ = ("accept_keys", "launch_key", "reply", "validated_for")

    def __init__(self) -> None:
        self.validated_for: CallLimits | None = None
        self.launch_key: LaunchKey | None = None
        self.accept_keys: tuple[LaunchKey, LaunchKey | None] | None = None
        self.reply: object | None = None


@dataclass(frozen=True)
class BuildTreeCall:
    """Arguments of ``Engine.build_tree`` (see ``ddtree.kernels.build_tree``)."""

    draft_logits: torch.Tensor  # [batch_size, draft_len, vocab_size] bf16/fp16/fp32
    root_tokens: torch.Tensor  # [batch_size] int64
    budget: int | torch.Tensor  # int, or [batch_size] int32/int64
    max_budget: int | None = None
    temperature: float = 1.0
    model: str = ""
    result_device: torch.device | None = None
    """Device of the returned tensors; ``None`` leaves them on the engine's device."""
    deadline_s: float | None = None
    """``time.monotonic()`` after which the call is not started; ``None`` for no deadline."""
    out: Tree | None = None
    """Destination of the tree on the engine's device (registered caller memory): tensors of
    shape ``(batch_size, 1 + max budget)`` (mask ``(..., mask_words)``); the result is them."""
    wait_event_ipc_handle: bytes = b""
    """CUDA IPC event handle the engine's stream waits on before reading inputs; ``b""``: none."""
    leases: Leases | None = None
    """Registered regions the call's tensors live in; released when the call's work ends."""
    prepared: Prepared | None = field(default=None, compare=False, repr=False)
    """Shared by the reuses of one decoded call (``Prepared``); ``None`` for a one-off call."""


@dataclass(frozen=True)
class KvCommitArgs:
    """The caller's paged latent KV cache, compacted in place to the accepted path."""

    kv_cache: torch.Tensor  # [num_pages, page_size, head_dim], any dtype
    block_table: torch.Tensor  # [batch_size, max_pages] int32
    prefix_lens: torch.Tensor  # [batch_size] int32


@dataclass(frozen=True)
class AcceptTreeCall:
    """Arguments of ``Engine.accept_tree`` (see ``ddtree.kernels.accept``, ``commit_kv``)."""

    tree: Tree
    target_tokens: torch.Tensor | None = None  # [batch_size, num_nodes_max] int64
    target_logits: torch.Tensor | None = None  # [batch_size, num_nodes_max, vocab_size] float
    temperature: float = 0.0
    seed: int | None = None
    """Sampler seed, ``0 .. 2**64 - 1``; ``None`` draws a fresh one."""
    kv_commit: KvCommitArgs | None = None
    model: str = ""
    result_device: torch.device | None = None
    deadline_s: float | None = None
    out: Acceptance | None = None
    """Destination of the acceptance on the engine's device; the result is it."""
    wait_event_ipc_handle: bytes = b""
    leases: Leases | None = None
    prepared: Prepared | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class AcceptTreeResult:
    """Result of ``Engine.accept_tree``."""

    acceptance: Acceptance
    kv_cache: torch.Tensor | None
    """The compacted cache when a commit ran; else ``None``. It is the caller's own tensor,
    compacted in place, when that already lived contiguous on the engine's device (for example
    registered caller memory); otherwise a compacted copy on ``result_device``."""


@dataclass(frozen=True)
class VerifyAttentionCall:
    """Arguments of ``Engine.verify_attention`` (see ``ddtree.kernels.verify_attention``)."""

    q: torch.Tensor  # [batch_size, num_nodes_max, num_heads, head_dim] bf16
    kv_cache: torch.Tensor  # [num_pages, page_size, head_dim] bf16
    block_table: torch.Tensor  # [batch_size, max_pages] int32
    prefix_lens: torch.Tensor  # [batch_size] int32
    tree: Tree
    v_dim: int = 512
    sm_scale: float | None = None
    model: str = ""
    result_device: torch.device | None = None
    deadline_s: float | None = None
    out: torch.Tensor | None = None  # [batch_size, num_nodes_max, num_heads, v_dim] bf16
    """Destination of the output on the engine's device; the result is it."""
    lse: torch.Tensor | None = None  # [batch_size, num_nodes_max, num_heads] fp32
    """Destination of the log-sum-exp on the engine's device; the result is it."""
    wait_event_ipc_handle: bytes = b""
    leases: Leases | None = None
    prepared: Prepared | None = field(default=None, compare=False, repr=False)


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


def _check_tensor(
    field: str,
    tensor: object,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
    names: tuple[str, ...],
    limits: CallLimits,
) -> torch.Tensor:
    """Check one tensor's type, dtype, shape (``None`` = any extent) and size."""
    if tensor is None:
        raise MissingField(f"{field}: required tensor is not set", field=field)
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensor(
            f"{field}: expected a torch.Tensor, got {type(tensor).__name__}", field=field
        )
    if tensor.dtype not in dtypes:
        expected = "/".join(_dtype_name(d) for d in dtypes)
        raise InvalidTensor(
            f"{field}: expected dtype {expected}, got {_dtype_name(tensor.dtype)}", field=field
        )
    got = tuple(tensor.shape)
    # A plain loop: this runs for every tensor of every call, and a generator costs more.
    matches = len(got) == len(shape)
    if matches:
        for want_extent, extent in zip(shape, got):  # noqa: B905 (lengths checked above)
            if want_extent is not None and want_extent != extent:
                matches = False
                break
    if not matches:
        expected = ", ".join(names)
        want = ", ".join("?" if e is None else str(e) for e in shape)
        raise InvalidTensor(
            f"{field}: expected shape ({expected}) = ({want}), got {got}", field=field
        )
    byte_size = tensor.nbytes
    if byte_size > limits.max_tensor_bytes:
        raise TensorTooLarge(
            f"{field}: {byte_size} bytes exceeds the server's max_tensor_bytes "
            f"{limits.max_tensor_bytes}; split the batch",
            field=field,
        )
    return tensor


def _check_batch(field: str, batch_size: int, limits: CallLimits) -> None:
    if batch_size < 1:
        raise InvalidTensor(f"{field}: expected batch_size >= 1, got {batch_size}", field=field)
    if batch_size > limits.max_batch_size:
        raise TensorTooLarge(
            f"{field}: batch_size {batch_size} exceeds the server's max_batch_size "
            f"{limits.max_batch_size}; split the batch",
            field=field,
        )


def _check_range(field: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueOutOfRange(f"{field}: expected {low}..{high}, got {value}", field=field)


def validate_model_label(field: str, model: str) -> None:
    """Check a ``model`` label: at most 64 characters of ``[A-Za-z0-9_.:-]``.

    Raises
    ------
    InvalidModelLabel
        The label is too long or holds another character.
    """
    if len(model) > MAX_MODEL_LABEL_CHARS or not _MODEL_RE.fullmatch(model):
        raise InvalidModelLabel(
            f"{field}: expected at most {MAX_MODEL_LABEL_CHARS} characters of "
            f"[A-Za-z0-9_.:-], got {model[:80]!r}",
            field=field,
        )


def _validate_tree(field: str, tree: Tree, limits: CallLimits) -> tuple[int, int]:
    """Check a tree's tensors against each other; returns ``(batch_size, num_nodes_max)``."""
    if tree is None:
        raise MissingField(f"{field}: required tree is not set", field=field)
    tokens = _check_tensor(
        f"{field}.tokens",
        tree.tokens,
        (torch.int64,),
        (None, None),
        ("batch_size", "num_nodes_max"),
        limits,
    )
    batch_size, num_nodes_max = tokens.shape
    _check_batch(f"{field}.tokens", batch_size, limits)
    if not 1 <= num_nodes_max <= 1 + MAX_BUDGET:
        raise InvalidTensor(
            f"{field}.tokens: expected num_nodes_max in 1..{1 + MAX_BUDGET}, got {num_nodes_max}",
            field=f"{field}.tokens",
        )
    pair = (batch_size, num_nodes_max)
    names = ("batch_size", "num_nodes_max")
    _check_tensor(f"{field}.parents", tree.parents, (torch.int32,), pair, names, limits)
    _check_tensor(f"{field}.depths", tree.depths, (torch.int32,), pair, names, limits)
    _check_tensor(f"{field}.log_probs", tree.log_probs, (torch.float32,), pair, names, limits)
    _check_tensor(
        f"{field}.num_nodes", tree.num_nodes, (torch.int32,), (batch_size,), ("batch_size",), limits
    )
    _check_tensor(
        f"{field}.mask",
        tree.mask,
        (torch.int64,),
        (*pair, mask_words(num_nodes_max)),
        (*names, "mask_words"),
        limits,
    )
    _check_range(f"{field}.draft_len", tree.draft_len, 1, MAX_DRAFT_LEN)
    return batch_size, num_nodes_max


def _check_tree_out(
    field: str, out: Tree, batch_size: int, num_nodes_max: int, limits: CallLimits
) -> None:
    """Check destination tensors of a tree against the shapes the call will produce."""
    got = _validate_tree(field, out, limits)
    if got != (batch_size, num_nodes_max):
        raise InvalidTensor(
            f"{field}.tokens: expected shape (batch_size, num_nodes_max) = "
            f"({batch_size}, {num_nodes_max}), got {got}",
            field=f"{field}.tokens",
        )


def _check_finite(field: str, value: float, *, allow_zero: bool) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueOutOfRange(f"{field}: expected a finite value {bound}, got {value}", field=field)


def validate_build_tree(call: BuildTreeCall, limits: CallLimits) -> None:
    """Check every argument of a BuildTree call.

    Raises
    ------
    InvalidArgument
        A subclass naming the field: ``InvalidTensor``, ``TensorTooLarge``, ``ValueOutOfRange``,
        ``InvalidModelLabel`` or ``MissingField``.
    """
    logits = _check_tensor(
        "build_tree.draft_logits",
        call.draft_logits,
        FLOAT_DTYPES,
        (None, None, None),
        ("batch_size", "draft_len", "vocab_size"),
        limits,
    )
    batch_size, draft_len, vocab_size = logits.shape
    _check_batch("build_tree.draft_logits", batch_size, limits)
    if not 1 <= draft_len <= MAX_DRAFT_LEN:
        raise InvalidTensor(
            f"build_tree.draft_logits: expected draft_len (dim 1) in 1..{MAX_DRAFT_LEN}, "
            f"got {draft_len}",
            field="build_tree.draft_logits",
        )
    if vocab_size < 1:
        raise InvalidTensor(
            "build_tree.draft_logits: expected vocab_size (dim 2) >= 1, got 0",
            field="build_tree.draft_logits",
        )
    _check_tensor(
        "build_tree.root_tokens",
        call.root_tokens,
        (torch.int64,),
        (batch_size,),
        ("batch_size",),
        limits,
    )
    largest: int
    if isinstance(call.budget, torch.Tensor):
        budgets = _check_tensor(
            "build_tree.budgets",
            call.budget,
            (torch.int32, torch.int64),
            (batch_size,),
            ("batch_size",),
            limits,
        )
        low, high = int(budgets.min()), int(budgets.max())
        if low < 1 or high > MAX_BUDGET:
            bad = low if low < 1 else high
            raise ValueOutOfRange(
                f"build_tree.budgets: expected every budget in 1..{MAX_BUDGET}, got {bad}",
                field="build_tree.budgets",
            )
        largest = high
    elif isinstance(call.budget, int) and not isinstance(call.budget, bool):
        _check_range("build_tree.budget", call.budget, 1, MAX_BUDGET)
        largest = call.budget
    else:
        raise MissingField(
            f"build_tree.budget: expected an int or a tensor of budgets, got {call.budget!r}",
            field="build_tree.budget",
        )
    if call.max_budget is not None:
        _check_range("build_tree.max_budget", call.max_budget, largest, MAX_BUDGET)
    if call.out is not None:
        num_nodes_max = 1 + (call.max_budget or largest)
        _check_tree_out("build_tree.outputs", call.out, batch_size, num_nodes_max, limits)
    _check_finite("build_tree.temperature", call.temperature, allow_zero=False)
    validate_model_label("build_tree.model", call.model)


def validate_accept_tree(call: AcceptTreeCall, limits: CallLimits) -> None:
    """Check every argument of an AcceptTree call (including the optional KV commit).

    Raises
    ------
    InvalidArgument
        A subclass naming the field.
    """
    batch_size, num_nodes_max = _validate_tree("accept_tree.tree", call.tree, limits)
    if (call.target_tokens is None) == (call.target_logits is None):
        raise MissingField(
            "accept_tree.target: expected exactly one of target_tokens and target_logits, got "
            + ("both" if call.target_tokens is not None else "neither"),
            field="accept_tree.target",
        )
    if call.target_tokens is not None:
        _check_tensor(
            "accept_tree.target_tokens",
            call.target_tokens,
            (torch.int64,),
            (batch_size, num_nodes_max),
            ("batch_size", "num_nodes_max"),
            limits,
        )
    else:
        logits = _check_tensor(
            "accept_tree.target_logits",
            call.target_logits,
            FLOAT_DTYPES,
            (batch_size, num_nodes_max, None),
            ("batch_size", "num_nodes_max", "vocab_size"),
            limits,
        )
        if logits.shape[2] < 1:
            raise InvalidTensor(
                "accept_tree.target_logits: expected vocab_size (dim 2) >= 1, got 0",
                field="accept_tree.target_logits",
            )
    _check_finite("accept_tree.temperature", call.temperature, allow_zero=True)
    if call.temperature > 0 and call.target_logits is None:
        raise ValueOutOfRange(
            "accept_tree.temperature: sampling (temperature > 0) needs target_logits, "
            "got target_tokens; send logits or temperature 0",
            field="accept_tree.temperature",
        )
    if call.seed is not None:
        _check_range("accept_tree.seed", call.seed, 0, (1 << 64) - 1)
    if call.out is not None:
        path = (batch_size, call.tree.draft_len + 1)
        path_names = ("batch_size", "path_len")
        out = call.out
        field = "accept_tree.outputs"
        _check_tensor(f"{field}.nodes", out.nodes, (torch.int32,), path, path_names, limits)
        _check_tensor(f"{field}.tokens", out.tokens, (torch.int64,), path, path_names, limits)
        one = (batch_size,)
        _check_tensor(f"{field}.length", out.length, (torch.int32,), one, ("batch_size",), limits)
        _check_tensor(f"{field}.bonus", out.bonus, (torch.int64,), one, ("batch_size",), limits)
    if call.kv_commit is not None:
        _validate_paged_cache(
            "accept_tree.kv_commit",
            call.kv_commit.kv_cache,
            call.kv_commit.block_table,
            call.kv_commit.prefix_lens,
            batch_size,
            None,
            limits,
        )
    validate_model_label("accept_tree.model", call.model)


def _validate_paged_cache(
    field: str,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    batch_size: int,
    dtypes: tuple[torch.dtype, ...] | None,
    limits: CallLimits,
) -> int:
    """Check a paged cache with its block table and lengths; returns ``head_dim``."""
    cache_dtypes = dtypes or (
        torch.bfloat16,
        torch.float16,
        torch.float32,
        torch.int32,
        torch.int64,
        torch.uint8,
    )
    cache = _check_tensor(
        f"{field}.kv_cache",
        kv_cache,
        cache_dtypes,
        (None, None, None),
        ("num_pages", "page_size", "head_dim"),
        limits,
    )
    num_pages, page_size, head_dim = cache.shape
    if num_pages < 1 or not 1 <= page_size <= MAX_PAGE_SIZE or head_dim < 1:
        raise InvalidTensor(
            f"{field}.kv_cache: expected num_pages >= 1, page_size in 1..{MAX_PAGE_SIZE} and "
            f"head_dim >= 1, got {tuple(cache.shape)}",
            field=f"{field}.kv_cache",
        )
    table = _check_tensor(
        f"{field}.block_table",
        block_table,
        (torch.int32,),
        (batch_size, None),
        ("batch_size", "max_pages"),
        limits,
    )
    if table.shape[1] < 1:
        raise InvalidTensor(
            f"{field}.block_table: expected max_pages >= 1, got 0", field=f"{field}.block_table"
        )
    _check_tensor(
        f"{field}.prefix_lens", prefix_lens, (torch.int32,), (batch_size,), ("batch_size",), limits
    )
    return int(head_dim)


def validate_verify_attention(call: VerifyAttentionCall, limits: CallLimits) -> None:
    """Check every argument of a VerifyAttention call.

    Raises
    ------
    InvalidArgument
        A subclass naming the field.
    """
    batch_size, num_nodes_max = _validate_tree("verify_attention.tree", call.tree, limits)
    q = _check_tensor(
        "verify_attention.q",
        call.q,
        (torch.bfloat16,),
        (batch_size, num_nodes_max, None, None),
        ("batch_size", "num_nodes_max", "num_heads", "head_dim"),
        limits,
    )
    if q.shape[2] < 1 or q.shape[3] < 1:
        raise InvalidTensor(
            f"verify_attention.q: expected num_heads >= 1 and head_dim >= 1, got {tuple(q.shape)}",
            field="verify_attention.q",
        )
    head_dim = _validate_paged_cache(
        "verify_attention",
        call.kv_cache,
        call.block_table,
        call.prefix_lens,
        batch_size,
        (torch.bfloat16,),
        limits,
    )
    if head_dim != q.shape[3]:
        raise InvalidTensor(
            f"verify_attention.kv_cache: expected head_dim (dim 2) = q's head_dim {q.shape[3]}, "
            f"got {head_dim}",
            field="verify_attention.kv_cache",
        )
    _check_range("verify_attention.v_dim", call.v_dim, 1, head_dim)
    num_heads = q.shape[2]
    names = ("batch_size", "num_nodes_max", "num_heads")
    if call.out is not None:
        _check_tensor(
            "verify_attention.out_ref",
            call.out,
            (torch.bfloat16,),
            (batch_size, num_nodes_max, num_heads, call.v_dim),
            (*names, "v_dim"),
            limits,
        )
    if call.lse is not None:
        _check_tensor(
            "verify_attention.lse_ref",
            call.lse,
            (torch.float32,),
            (batch_size, num_nodes_max, num_heads),
            names,
            limits,
        )
    if call.sm_scale is not None:
        _check_finite("verify_attention.sm_scale", call.sm_scale, allow_zero=False)
    validate_model_label("verify_attention.model", call.model)
