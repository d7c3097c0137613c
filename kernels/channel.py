"""The GPU doorbell channel protocol: control-block layout, step descriptors, status codes.

Pure Python (no GPU): the byte layout that ``channel.cu`` reads and writes, ``pack_descriptor``
(which the caller side uses to fill a ring slot) and ``validate_descriptor``, the host twin of
``ddtree_channel_resolve``'s checks (the CPU tests exercise it; the GPU tests compare the
device's verdicts with it). ``docs/channel.md`` describes the protocol byte by byte.

A channel serves one op (``ChannelOp.BUILD_TREE`` or ``ChannelOp.ACCEPT``) for a fixed shape
(``ChannelShape``), up to ``max_batch_size`` requests per step.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddtree.kernels.types import MAX_BUDGET, MAX_DRAFT_LEN, mask_words

__all__ = [
    "ACCEPT_REFS",
    "BUILD_REFS",
    "DESCRIPTOR_BYTES",
    "DONE_OFFSET",
    "DOORBELL_OFFSET",
    "COMPLETION_OFFSET",
    "LAST_STATUS_OFFSET",
    "MAX_RING_SIZE",
    "NUM_REFS",
    "RECORDS_OFFSET",
    "STATE_OFFSET",
    "ChannelOp",
    "ChannelShape",
    "ChannelState",
    "DescriptorFlag",
    "Ref",
    "StepDescriptor",
    "StepStatus",
    "control_block_bytes",
    "pack_descriptor",
    "ref_requirement",
    "ring_offset",
    "unpack_descriptor",
    "validate_descriptor",
]

DOORBELL_OFFSET = 0
"""u64: steps posted by the caller (the caller's post writes ``k``)."""
COMPLETION_OFFSET = 8
"""u64: the last step the service finished (``k``)."""
DONE_OFFSET = 16
"""u32: ``0`` while a posted step is outstanding, ``1`` once it finished (or was failed)."""
STATE_OFFSET = 20
"""u32: ``ChannelState``."""
LAST_STATUS_OFFSET = 24
"""Status record ``{u32 status, u32 detail, u64 step}`` of the latest step."""
RECORDS_OFFSET = 64
"""``ring_size`` status records of 16 bytes, one per ring slot."""
DESCRIPTOR_BYTES = 256
"""One step descriptor: 32 little-endian u64 words."""
NUM_REFS = 14
"""Reference slots in a descriptor."""
MAX_RING_SIZE = 64
"""Largest ring (slots); steps in flight per channel are at most ``ring_size``."""

_HEADER = struct.Struct("<IIIIfIq")
_FLT_MAX = 3.4028234663852886e38
_REF = struct.Struct("<IIQ")


class ChannelOp(enum.IntEnum):
    """The op a channel serves (descriptor word 0, low half)."""

    BUILD_TREE = 1
    ACCEPT = 2


class ChannelState(enum.IntEnum):
    """Word at ``STATE_OFFSET`` of the control block."""

    OPEN = 0
    CLOSED = 1
    """Written by the service when it closed the channel (CloseChannel, expiry, drain)."""
    SERVICE_LOST = 2
    """Written by the caller's watchdog when the service died or drains."""


class StepStatus(enum.IntEnum):
    """Status of a step (status records; ``detail`` names the reference slot where it applies).

    Only ``OK`` means the op ran; with any other status nothing was read or written in the
    caller's memory except the control block.
    """

    OK = 0
    PENDING = 1
    BAD_OP = 2
    BAD_BATCH = 3
    BAD_FLAGS = 4
    BAD_BUDGET = 5
    BAD_TEMPERATURE = 6
    BAD_REGION = 7
    OUT_OF_BOUNDS = 8
    MISALIGNED = 9
    CLOSED = 10
    SERVICE_LOST = 11


class DescriptorFlag(enum.IntFlag):
    """Descriptor word 1, low half."""

    BUDGETS = 1
    """build_tree: per-request budgets in reference slot ``budgets`` (else the scalar)."""
    ERROR_FLAGS = 2
    """The caller's error-flags tensor is in slot ``error_flags`` (else the service's own)."""
    KV_COMMIT = 4
    """accept: commit the KV cache (slots ``kv_cache``, ``block_table``, ``prefix_lens``)."""
    CLEAR_ERROR_FLAGS = 8
    """With ``ERROR_FLAGS``: the service zeroes the caller's error flags before the op (else
    a non-zero entry on entry skips that request)."""


BUILD_REFS = (
    "draft_logits",
    "root_tokens",
    "budgets",
    "tokens",
    "parents",
    "depths",
    "log_probs",
    "num_nodes",
    "mask",
    "error_flags",
)
"""Reference slots of a build_tree descriptor, in order."""
ACCEPT_REFS = (
    "tree_tokens",
    "parents",
    "depths",
    "num_nodes",
    "target",
    "path_nodes",
    "path_tokens",
    "length",
    "bonus",
    "error_flags",
    "kv_cache",
    "block_table",
    "prefix_lens",
)
"""Reference slots of an accept descriptor, in order (``target``: tokens or logits)."""


@dataclass(frozen=True)
class Ref:
    """A reference into one of the channel's regions (index into OpenChannel's region list)."""

    region: int
    offset_bytes: int


@dataclass(frozen=True)
class StepDescriptor:
    """One step, as written into a ring slot."""

    op: int
    batch_size: int
    flags: int = 0
    budget: int = 0
    temperature: float = 0.0
    seed: int = 0
    refs: Mapping[str, Ref] | None = None
    """By slot name (``BUILD_REFS`` / ``ACCEPT_REFS``); missing slots are region 0, offset 0."""


@dataclass(frozen=True)
class ChannelShape:
    """The fixed shape of a channel (OpenChannel's arguments).

    Attributes
    ----------
    op : ChannelOp
        The op served.
    max_batch_size : int
        Largest ``batch_size`` of a step, ``>= 1``.
    draft_len : int
        ``1..32``.
    max_budget : int
        ``1..1024``; ``num_nodes_max = 1 + max_budget``.
    vocab_size : int
        Vocabulary of the draft logits (build_tree) or of the target logits (accept); ``0`` for
        an accept channel fed target tokens.
    logit_code : int
        dtype of those logits as channel.cu's ``DDTREE_DTYPE``: 0 fp32, 1 bf16, 2 fp16; ignored
        when ``vocab_size == 0``.
    kv_row_bytes, num_pages, page_size, max_pages : int
        accept with KV commit: the cache's ``head_dim * element size`` (a multiple of 16) and
        shape, and the block table's width; all ``0`` for a channel without KV commit.
    """

    op: ChannelOp
    max_batch_size: int
    draft_len: int
    max_budget: int
    vocab_size: int
    logit_code: int = 1
    kv_row_bytes: int = 0
    num_pages: int = 0
    page_size: int = 0
    max_pages: int = 0

    def __post_init__(self) -> None:
        checks = (
            ("max_batch_size", self.max_batch_size, 1, 1 << 16),
            ("draft_len", self.draft_len, 1, MAX_DRAFT_LEN),
            ("max_budget", self.max_budget, 1, MAX_BUDGET),
            ("vocab_size", self.vocab_size, 1 if self.op == ChannelOp.BUILD_TREE else 0, 1 << 30),
        )
        for name, value, low, high in checks:
            if not low <= value <= high:
                raise ValueError(f"open_channel.{name}: expected {low}..{high}, got {value}")
        if self.logit_code not in (0, 1, 2):
            raise ValueError(
                f"open_channel.logits_dtype: expected code 0, 1 or 2, got {self.logit_code}"
            )
        if self.has_kv:
            if self.op != ChannelOp.ACCEPT:
                raise ValueError("open_channel.kv: a KV commit needs an accept channel")
            if self.kv_row_bytes % 16 or min(self.num_pages, self.max_pages) < 1:
                raise ValueError(
                    "open_channel.kv: head_dim * element size must be a positive multiple of 16 "
                    f"and num_pages, max_pages >= 1; got {self.kv_row_bytes}, {self.num_pages}, "
                    f"{self.max_pages}"
                )
            if not 1 <= self.page_size <= 256:
                raise ValueError(
                    f"open_channel.kv.page_size: expected 1..256, got {self.page_size}"
                )

    @property
    def has_kv(self) -> bool:
        """Whether steps may commit a KV cache."""
        return self.kv_row_bytes > 0

    @property
    def logit_bytes(self) -> int:
        """Element size of the logits: 4 for fp32, else 2."""
        return 4 if self.logit_code == 0 else 2

    @property
    def num_nodes_max(self) -> int:
        """``1 + max_budget``."""
        return 1 + self.max_budget

    @property
    def logit_align(self) -> int:
        """Byte alignment the logits need (16 where the top-k reads 16-byte vectors)."""
        if self.op == ChannelOp.BUILD_TREE and self.vocab_size % (16 // self.logit_bytes) == 0:
            return 16
        return self.logit_bytes

    @property
    def is_vectorized(self) -> bool:
        """build_tree: whether the top-k kernel streams 16-byte vectors."""
        return self.logit_align == 16


def _f32(value: float) -> float:
    """``value`` rounded to fp32 as the descriptor stores it (too large: +-inf, NaN stays)."""
    if math.isfinite(value) and abs(value) > _FLT_MAX:
        return math.copysign(math.inf, value)
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def ring_offset(ring_size: int) -> int:
    """Byte offset of descriptor slot 0 (after the records, rounded up to 256)."""
    return -(-(RECORDS_OFFSET + 16 * ring_size) // 256) * 256


def control_block_bytes(ring_size: int) -> int:
    """Bytes of a control block with ``ring_size`` slots.

    Raises
    ------
    ValueError
        ``ring_size`` outside ``1..MAX_RING_SIZE``.
    """
    if not 1 <= ring_size <= MAX_RING_SIZE:
        raise ValueError(f"open_channel.ring_size: expected 1..{MAX_RING_SIZE}, got {ring_size}")
    return ring_offset(ring_size) + ring_size * DESCRIPTOR_BYTES


def _names(op: int) -> Sequence[str]:
    return BUILD_REFS if op == ChannelOp.BUILD_TREE else ACCEPT_REFS


def _layout(op: int, names: set[str]) -> Sequence[str]:
    """The slot order to pack ``names`` in: the op's own, or (for a descriptor whose op is not
    the one its slots belong to, which the service refuses with BAD_OP) the one layout that
    has every given slot."""
    if names <= set(_names(op)):
        return _names(op)
    for layout in (BUILD_REFS, ACCEPT_REFS):
        if names <= set(layout):
            return layout
    raise ValueError(f"descriptor.refs: unknown slots {sorted(names - set(_names(op)))}")


def pack_descriptor(desc: StepDescriptor) -> bytes:
    """The 256 descriptor bytes of ``desc`` (little-endian; layout in docs/channel.md).

    Slots are laid out in the op's order; a descriptor whose op is not 1 or 2, or does not
    match its slots' names (a deliberately wrong descriptor), uses the order of the op whose
    slots it names.

    Raises
    ------
    ValueError
        A reference names a slot of neither op, or a field does not fit its width.
    """
    refs = dict(desc.refs or {})
    names = _layout(desc.op, set(refs))
    try:
        out = bytearray(
            _HEADER.pack(
                desc.op,
                desc.batch_size,
                int(desc.flags),
                desc.budget,
                _f32(desc.temperature),
                0,
                desc.seed,
            )
        )
        for i in range(NUM_REFS):
            ref = refs.get(names[i]) if i < len(names) else None
            out += _REF.pack(0, 0, 0) if ref is None else _REF.pack(ref.region, 0, ref.offset_bytes)
    except struct.error as err:
        raise ValueError(f"descriptor: a field does not fit its width: {err}") from err
    return bytes(out)


def unpack_descriptor(data: bytes) -> StepDescriptor:
    """Inverse of ``pack_descriptor`` (every slot of the op is returned)."""
    if len(data) != DESCRIPTOR_BYTES:
        raise ValueError(f"descriptor: expected {DESCRIPTOR_BYTES} bytes, got {len(data)}")
    op, batch, flags, budget, temperature, _, seed = _HEADER.unpack_from(data, 0)
    names = _names(op)
    refs = {}
    for i, name in enumerate(names):
        region, _, offset = _REF.unpack_from(data, _HEADER.size + i * _REF.size)
        refs[name] = Ref(region, offset)
    return StepDescriptor(op, batch, flags, budget, temperature, seed, refs)


def ref_requirement(shape: ChannelShape, slot: int, batch_size: int, flags: int) -> tuple[int, int]:
    """``(byte_size, alignment)`` reference ``slot`` needs for a step (``(0, 1)``: unused).

    Mirrors ``ddtree_ref_need`` in channel.cu.
    """
    b = batch_size
    n = shape.num_nodes_max
    p = shape.draft_len + 1
    if shape.op == ChannelOp.BUILD_TREE:
        table = {
            0: (b * shape.draft_len * shape.vocab_size * shape.logit_bytes, shape.logit_align),
            1: (b * 8, 8),
            2: (b * 4 if flags & DescriptorFlag.BUDGETS else 0, 4),
            3: (b * n * 8, 8),
            4: (b * n * 4, 4),
            5: (b * n * 4, 4),
            6: (b * n * 4, 4),
            7: (b * 4, 4),
            8: (b * n * mask_words(n) * 8, 8),
            9: (b * 4 if flags & DescriptorFlag.ERROR_FLAGS else 0, 4),
        }
    else:
        kv = bool(flags & DescriptorFlag.KV_COMMIT)
        target = (
            (b * n * 8, 8)
            if shape.vocab_size == 0
            else (b * n * shape.vocab_size * shape.logit_bytes, shape.logit_bytes)
        )
        table = {
            0: (b * n * 8, 8),
            1: (b * n * 4, 4),
            2: (b * n * 4, 4),
            3: (b * 4, 4),
            4: target,
            5: (b * p * 4, 4),
            6: (b * p * 8, 8),
            7: (b * 4, 4),
            8: (b * 8, 8),
            9: (b * 4 if flags & DescriptorFlag.ERROR_FLAGS else 0, 4),
            10: (shape.num_pages * shape.page_size * shape.kv_row_bytes if kv else 0, 16),
            11: (b * shape.max_pages * 4 if kv else 0, 4),
            12: (b * 4 if kv else 0, 4),
        }
    byte_size, align = table.get(slot, (0, 1))
    return (byte_size, align) if byte_size else (0, 1)


def validate_descriptor(
    shape: ChannelShape,
    desc: StepDescriptor,
    regions: Sequence[tuple[int, int]],
    budgets: Sequence[int] | None = None,
) -> tuple[StepStatus, int]:
    """The verdict ``ddtree_channel_resolve`` gives a descriptor: ``(status, detail)``.

    Parameters
    ----------
    shape : ChannelShape
        The channel's shape.
    desc : StepDescriptor
        The step (as ``unpack_descriptor`` reads it back: every slot present).
    regions : sequence of (int, int)
        ``(base_address, byte_size)`` of each region of the channel, in OpenChannel order.
    budgets : sequence of int, optional
        build_tree with ``DescriptorFlag.BUDGETS``: the values in the budgets slot.

    Returns
    -------
    tuple of (StepStatus, int)
        The status and its detail (the reference slot for reference and budget errors).
    """
    op, b, flags = desc.op, desc.batch_size, int(desc.flags)
    temperature = _f32(desc.temperature)
    build = shape.op == ChannelOp.BUILD_TREE
    allowed = DescriptorFlag.ERROR_FLAGS | DescriptorFlag.CLEAR_ERROR_FLAGS
    allowed |= DescriptorFlag.BUDGETS if build else 0
    allowed |= DescriptorFlag.KV_COMMIT if not build and shape.has_kv else 0
    finite = math.isfinite(temperature)
    if op != shape.op:
        return StepStatus.BAD_OP, 0
    if not 1 <= b <= shape.max_batch_size:
        return StepStatus.BAD_BATCH, 0
    clear_alone = (
        flags & DescriptorFlag.CLEAR_ERROR_FLAGS and not flags & DescriptorFlag.ERROR_FLAGS
    )
    if flags & ~int(allowed) or clear_alone:
        return StepStatus.BAD_FLAGS, 0
    if build and not flags & DescriptorFlag.BUDGETS and not 1 <= desc.budget <= shape.max_budget:
        return StepStatus.BAD_BUDGET, 0
    if build:
        bad_temperature = not (finite and temperature > 0)
    else:
        bad_temperature = not (finite and temperature >= 0) or (
            shape.vocab_size == 0 and temperature != 0
        )
    if bad_temperature:
        return StepStatus.BAD_TEMPERATURE, 0
    refs = desc.refs or {}
    for slot, name in enumerate(_names(op)):
        need, align = ref_requirement(shape, slot, b, flags)
        if need == 0:
            continue
        ref = refs.get(name, Ref(0, 0))
        if ref.region >= len(regions):
            return StepStatus.BAD_REGION, slot
        base, size = regions[ref.region]
        if (base + ref.offset_bytes) % align:
            return StepStatus.MISALIGNED, slot
        if ref.offset_bytes > size or need > size - ref.offset_bytes:
            return StepStatus.OUT_OF_BOUNDS, slot
    if build and flags & DescriptorFlag.BUDGETS:
        values = list(budgets or [])[:b]
        if any(not 1 <= v <= shape.max_budget for v in values):
            return StepStatus.BAD_BUDGET, BUILD_REFS.index("budgets")
    return StepStatus.OK, 0
