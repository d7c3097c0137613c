"""CUDA launchers of ``build_tree``, ``accept`` and ``commit_kv`` (kernels in ``*.cu`` beside this).

Each function takes exactly the keyword arguments of the public op (minus ``backend``; see
``ddtree.kernels.build_tree``, ``accept``, ``commit_kv`` for the contract), checks shapes, dtypes
and limits on the host with ``ddtree.kernels.checks``, and launches on torch's current stream.
With ``error_flags`` given, nothing synchronises with the host: out-of-range caller data is
flagged by the kernels. Without it, the caller data is checked eagerly (a host sync) and bad data
raises ``ValueError``, as documented by the public ops.

Launch geometry is computed by pure functions (``build_tree_plan``, ``accept_launch_params``,
``commit_kv_launch_params``) that need no GPU.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from ddtree.kernels import checks, jit
from ddtree.kernels.types import MAX_DRAFT_LEN, Acceptance, Tree, mask_words

__all__ = [
    "BuildScratch",
    "BuildTreePlan",
    "accept",
    "accept_launch_params",
    "build_scratch",
    "build_tree",
    "build_tree_plan",
    "commit_kv",
    "commit_kv_launch_params",
    "device_build_tree_plan",
    "max_dynamic_smem",
]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_TOPK_WARPS = (8, 4, 2, 1)
"""Warps per ``ddtree_build_topk`` block (``TOPK_WARPS``): 8, fewer where shared memory is short,
or 4 where they were measured faster (``_four_warps_faster``)."""
_TOPK_UNROLL = 4
"""16-byte loads per lane and step (``UNROLL`` in build_tree.cu)."""
_TOPK_MIN_BLOCKS = 2
"""Blocks of ``ddtree_build_topk`` resident per SM that its ``__launch_bounds__`` asks for."""
_TOPK_BOUND_MAX_J = 16
"""Largest ``j = ceil(top_k / warps)`` for which a top-k warp publishes the j-th largest of its
lanes' running maxima while it streams (``TOPK_BOUND_MAX_J``)."""
_EXPAND_AT = 32
_EXPAND_AT_LATE = 128
_EXPAND_LATE_MIN_TOP_K = 17
"""Hit vectors a top-k warp records before it expands them (``DDTREE_EXPAND_AT``): 32, or 128
from top_k ``_EXPAND_LATE_MIN_TOP_K`` on where the larger hit buffers keep the blocks per SM
that the plan chose with the smaller ones. Expanding later tests the recorded vectors' entries
against a threshold that has risen meanwhile, so fewer become candidates (docs/kernels.md,
session 31)."""
_MERGE_RANKS_MIN_TOP_K = 17
"""From this top_k on, a top-k block that merges its row orders it by its warps' ranks
(``DDTREE_MERGE_RANKS``; build_tree_topk.cuh, ``ddtree_merge_here``); below, and in plans with
a merge launch, the kernels are compiled without that code (docs/kernels.md, session 31)."""
_TOPK_MIN_SHRINK = 512
"""A warp shrinks its candidate buffer once it holds more than ``max(2 * top_k, 512)``."""
_FOUR_WARP_ONE_WAVE_MAX_TOP_K = 16
"""Largest top_k at which rows that need two waves of eight-warp top-k blocks and fit one of
four-warp blocks take the four-warp blocks (``_four_warps_faster``)."""
_MERGE_THREADS = 256
"""Threads of a ``ddtree_build_merge`` block (``MERGE_THREADS``, its most) ..."""
_MERGE_THREADS_SMALL = 64
"""... and of one that gathers at most ``_MERGE_SMALL_ROW`` candidate slots (parts times top_k:
eight parts of top_k <= 64) when the rows are more than one wave of ``_MERGE_THREADS`` blocks
holds (``_MERGE_RESIDENT`` per SM): the small blocks then run in one wave (H200, kernel alone:
B 128 K 64, 2048 rows, 17.6 instead of 33.1 us), while rows that fit one wave merge faster with
256 threads (B 32 K 64, 512 rows: 10.8 against 12.0 us; docs/kernels.md, session 11)."""
_MERGE_SMALL_ROW = 512
_MERGE_RESIDENT = 2048 // _MERGE_THREADS
_SELECT_THREADS = 512
"""Threads of a select block: the serial pops use one warp, the wide select all of them (H200,
B 32 budget 256, the wide select launch alone: 31 us at 512 threads, 40 at 1024; session 14)."""
_EARLY_SELECT_THREADS = 128
"""Threads of an early plan's select block (``early_depths``): small enough to fit the slots the
second wave of top-k blocks leaves free (two in an eight-warp block's, one in a four-warp
block's; the select's registers are capped at 128 a thread, as with 512 threads), so that the
selects run while the top-k still streams the deeper rows."""
_WIDE_MIN_BUDGET = 97
"""Budgets from this many nodes take the wide select; smaller ones pop serially from registers
(build_tree_select.cuh). On the H200 the wide select won at budget 96 but lost at 16 and, on peaked
logits, at 64 (B 32, select alone: 98 against 51 us; docs/kernels.md, session 14)."""
_BULK_MIN_BATCH = 4
_BULK_MIN_BUDGET = 32
"""Batches of at least ``_BULK_MIN_BATCH`` requests with ``max_budget`` at least
``_BULK_MIN_BUDGET`` take the bulk select from a request's first round (budgets up to 96; the
register pops keep requests on peaked rows); others pop every node from registers. On the H200
(graph ms, bf16 ``randn * 3``) the bulk select took 4-8 % off at batch 4 and 8, 13-17 % at batch
32 with budget 64 and 96 and 4-5 % at batch 128 with budget 64; it added 2-9 % at batch 1 and 2-6
% at batch 32 with budget 16, and 1-5 % at batch 32 on peaked rows (``randn * 12``), where it
declines (docs/kernels.md, session 27)."""
_WIDE_MAX_CAP = 4096
"""Most nodes of the wide select's store (``4 * max_budget`` at most; its packed node indices
need 16 bits)."""
_WIDE_NODE_BYTES = 25
"""Shared memory per node of the wide select's store (see ``wide_select_bytes``)."""
_ACCEPT_THREADS = 256
_ACCEPT_LOGIT_THREADS = 1024
_COMMIT_THREADS = 128
_COMMIT_COLS = 64
_MAX_SMEM_BYTES = 200 * 1024
"""Dynamic shared memory a block may ask for (under the 227 KiB opt-in of sm_90 and sm_100;
sm_120 offers about 99 KiB, where ``build_tree_plan`` is called with a smaller limit)."""
_STATIC_SMEM_RESERVE = 36 * 1024
"""Upper bound of any of these kernels' static shared memory (the select kernel's node and
frontier tables take about 33 KiB)."""
_SM_SMEM_OVER_OPTIN = 1024
"""An SM's shared memory exceeds the per-block opt-in by 1 KiB (sm_90 and sm_100: 228 KiB and
227; sm_120: 100 and 99). The driver fits blocks on an SM while their dynamic and static shared
memory sum to at most the SM's (H200, the top-k kernel's occupancy at 1 to 4 blocks of 4 and 8
warps: bench/results/2026-12-01-h200-topk-occupancy-s32.json)."""
_TOPK_STATIC = 1200
_TOPK_STATIC_PER_WARP = 1044
"""A ``ddtree_build_topk`` block's static shared memory, 1,200 bytes and 1,044 per warp (mostly
the warps' radix histograms; the kernel's ``.nv.shared`` section in the sm_90 cubins, which
tests/kernels/test_compile.py checks)."""
_MAX_PARTS = 32
"""Most candidate lists per row (chunks times warps) that the merge gathers when rows are split
to fill the GPU."""


@dataclass(frozen=True)
class BuildTreePlan:
    """Geometry of the ``build_tree`` launches for one problem shape (see build_tree.cu)."""

    top_k: int
    """Tokens kept per (request, depth) row, ``min(max_budget, vocab_size)``."""
    warps: int
    """Warps per top-k block (``TOPK_WARPS``)."""
    unroll: int
    """16-byte loads per lane and step (``UNROLL``)."""
    min_blocks: int
    """Top-k blocks per SM asked of the compiler (``TOPK_MIN_BLOCKS``, caps registers)."""
    tile: int
    """Vocabulary entries a top-k block reads per step: ``warps * 32 * unroll`` vectors."""
    span: int
    """Vocabulary entries one top-k block covers (a multiple of ``tile``); its warps take turns
    over the span's steps of ``tile / warps`` entries."""
    num_chunks: int
    """Top-k blocks per row."""
    num_parts: int
    """Candidate lists per row handed to the merge, ``num_chunks * warps``."""
    expand_at: int
    """Hit vectors a warp records before it expands them (``DDTREE_EXPAND_AT``); its hit buffer
    holds ``expand_at + 32 * unroll``."""
    cap: int
    """Capacity of a warp's candidate buffer, ``max(2 * top_k, 512) + 32 * (16 /
    element_size)``: the warp shrinks it to at most ``2 * top_k`` before a round of hit
    expansion (32 vectors, at most ``32 * (16 / element_size)`` entries) could overflow it."""
    sort_size: int
    """Power of two >= top_k, the bitonic sort width."""
    merge_here: bool
    """Whether each top-k block merges its row itself and the merge launch is skipped: one
    block per row (``num_chunks == 1``), at most two waves of top-k blocks (past that, the
    blocks' merges add up to more than one merge launch: H200, B 128 K 64, 0.323 against 0.315
    ms) and room for the warps' ``top_k`` candidates each in hit buffers of ``32 * (unroll +
    1)`` vectors (``8 * top_k <= 20 * 32 * (unroll + 1)``, top_k up to 400 at unroll 4), also
    where late expansion makes them larger: larger rows merged in their blocks took longer than
    in the merge launch (H200, B 32 K 420: top-k 127 -> 270 us; docs/kernels.md, session 31)."""
    merge_ranks: bool
    """Whether the merging top-k blocks order their rows by their warps' ranks
    (``DDTREE_MERGE_RANKS``): with ``merge_here`` from top_k ``_MERGE_RANKS_MIN_TOP_K`` on."""
    lp_in_smem: bool
    """Whether the select kernel copies the per-depth log-prob table to shared memory."""
    wide_cap: int
    """Nodes of the wide select's store (0: no wide select; every budget pops serially): between
    ``2 * max_budget`` and ``4 * max_budget`` (at most ``_WIDE_MAX_CAP``) when ``max_budget >=
    wide_min_budget`` and the store fits in shared memory (beside the log-prob table if
    possible)."""
    wide_min_budget: int
    """The smallest budget that takes the wide select (``_WIDE_MIN_BUDGET``)."""
    wide_sort_size: int
    """Power of two >= max_budget, the wide select's sort width."""
    bulk_after: int
    """Register select rounds before the bulk select may take a request's remaining budget
    (``DDTREE_BULK_AFTER``): 0 for the batches and budgets of ``_BULK_MIN_BATCH`` and
    ``_BULK_MIN_BUDGET``, else -1 (never)."""
    early_depths: int
    """Depths whose rows the select may start on before the top-k ends (``DDTREE_EARLY_DEPTHS``;
    0: none, the select waits for the whole launch). Where the rows take two waves of top-k
    blocks that merge their rows, and no wide select: the top-k takes the rows depth by depth,
    flags those of the first ``early_depths`` depths (the rows the first wave holds:
    ``resident slots // batch``) once written, and the select pops over them while the second
    wave streams, falling back to every row only when the tree may reach deeper
    (build_tree.cu)."""
    topk: jit.LaunchParams
    merge: jit.LaunchParams
    select: jit.LaunchParams

    def __post_init__(self) -> None:
        # The top-k blocks flag the rows an early select waits for only when they write them
        # (merging their own rows); with a merge launch such a select would wait forever.
        if self.early_depths and not (self.merge_here and self.num_chunks == 1):
            raise ValueError("early_depths: an early select needs rows merged in top-k blocks")
        if not 0 <= self.early_depths <= MAX_DRAFT_LEN:
            raise ValueError(f"early_depths: expected 0..{MAX_DRAFT_LEN}, got {self.early_depths}")

    @property
    def defines(self) -> dict[str, int]:
        """The plan's macros for build_tree.cu: the top-k variant and the bulk select's start
        (every build kernel is compiled with them, so that the launches of one plan agree)."""
        return {
            "TOPK_WARPS": self.warps,
            "UNROLL": self.unroll,
            "TOPK_MIN_BLOCKS": self.min_blocks,
            "TOPK_BOUND_MAX_J": _TOPK_BOUND_MAX_J,
            "DDTREE_EXPAND_AT": self.expand_at,
            "DDTREE_MERGE_RANKS": int(self.merge_ranks),
            "DDTREE_BULK_AFTER": self.bulk_after,
            "DDTREE_EARLY_DEPTHS": self.early_depths,
            "SELECT_THREADS": self.select.block[0],
        }


@functools.lru_cache(maxsize=256)
def build_tree_plan(
    batch_size: int,
    draft_len: int,
    vocab_size: int,
    max_budget: int,
    *,
    element_size: int = 2,
    num_sms: int = 132,
    max_smem_bytes: int = _MAX_SMEM_BYTES,
    unroll: int = _TOPK_UNROLL,
    min_blocks: int = _TOPK_MIN_BLOCKS,
) -> BuildTreePlan:
    """Launch geometry of ``build_tree`` (pure; no GPU needed).

    Parameters
    ----------
    batch_size, draft_len, vocab_size : int
        Problem shape (B, L, V).
    max_budget : int
        ``num_nodes_max - 1``, ``1..1024``.
    element_size : int
        Bytes per logit (4, 2 or 2).
    num_sms : int
        Streaming multiprocessors of the device: rows are split into chunks until the top-k
        launch fills them.
    max_smem_bytes : int
        Dynamic shared memory one block may use on the target device.
    unroll, min_blocks : int
        ``UNROLL`` and ``TOPK_MIN_BLOCKS`` of the top-k kernel (tuning; see build_tree.cu).
        ``unroll`` is a power of two: the kernel sums a step's entries by pairwise trees.

    Returns
    -------
    BuildTreePlan

    Raises
    ------
    ValueError
        The candidate buffers or the merge do not fit in shared memory at this budget, there
        are more than 65535 rows, or ``unroll`` is not a power of two.
    """
    if unroll < 1 or unroll & (unroll - 1):
        raise ValueError(f"unroll: the top-k's loads per step must be a power of two, got {unroll}")
    top_k = min(max_budget, vocab_size)
    sort_size = _power_of_two_at_least(top_k)
    rows = batch_size * draft_len
    if rows > 65535:
        raise ValueError(
            f"draft_logits: batch_size * draft_len = {rows} exceeds 65535 rows per launch"
        )
    vec = 16 // element_size
    step = 32 * unroll * vec
    cap = max(2 * top_k, _TOPK_MIN_SHRINK) + 32 * vec
    expand_at = _EXPAND_AT
    warp_smem = _topk_warp_smem(cap, expand_at, unroll)
    for warps in _TOPK_WARPS:
        topk_smem = warps * warp_smem
        if topk_smem <= max_smem_bytes:
            break
    else:
        raise ValueError(
            f"max_budget: {max_budget} needs {topk_smem} bytes of shared memory per block, "
            f"{max_smem_bytes} available"
        )
    if warps == 8 and _four_warps_faster(
        top_k, rows, num_sms, warp_smem, max_smem_bytes, min_blocks
    ):
        warps, min_blocks = 4, 2 * min_blocks
        topk_smem = warps * warp_smem
    tile = warps * step
    tiles = -(-vocab_size // tile)
    # Blocks per SM that the shared memory allows, at most what the register cap was chosen for.
    resident = max(1, min(min_blocks, _blocks_fitting(topk_smem, warps, max_smem_bytes)))
    if top_k >= _EXPAND_LATE_MIN_TOP_K:
        # The larger hit buffers of late expansion, where as many blocks still fit.
        late_smem = warps * _topk_warp_smem(cap, _EXPAND_AT_LATE, unroll)
        late_blocks = _blocks_fitting(late_smem, warps, max_smem_bytes)
        if late_smem <= max_smem_bytes and late_blocks >= resident:
            expand_at, topk_smem = _EXPAND_AT_LATE, late_smem
    slots = num_sms * resident  # top-k blocks resident at once: one wave

    # Chunks per row: one once the rows fill every resident slot (on the H200 more chunks per
    # row cost more in per-block set-up and merge than they win back in the last wave), else
    # enough to fill the slots, with at most _MAX_PARTS candidate lists per row for the merge.
    # Never more than the merge's shared memory (all parts' candidates of a row) holds.
    chunks = max(1, min(slots // rows, _MAX_PARTS // warps))
    fit = (max_smem_bytes // 8 - 2 * sort_size) // (top_k * warps)
    if fit < 1:
        raise ValueError(
            f"max_budget: {max_budget} needs more merge shared memory than the "
            f"{max_smem_bytes} bytes available"
        )
    chunks = max(1, min(chunks, fit, tiles))
    span = -(-tiles // chunks) * tile
    num_chunks = -(-vocab_size // span)
    num_parts = num_chunks * warps
    # Room in hit buffers of _EXPAND_AT + 32 * unroll vectors, also where they are larger.
    room = _hit_buffer_bytes(_EXPAND_AT, unroll)
    merge_here = num_chunks == 1 and rows <= 2 * slots and 8 * top_k <= room
    merge_smem = (num_parts * top_k + 2 * sort_size) * 8
    small = num_parts * top_k <= _MERGE_SMALL_ROW and rows > num_sms * _MERGE_RESIDENT
    merge_threads = _MERGE_THREADS_SMALL if small else _MERGE_THREADS
    lp_bytes = draft_len * top_k * 4
    lp_in_smem = lp_bytes <= max_smem_bytes
    lp_table = -(-lp_bytes // 16) * 16  # the wide select's store follows it 16-byte aligned
    wide_sort_size = _power_of_two_at_least(max_budget)
    wide_cap = 0
    if max_budget >= _WIDE_MIN_BUDGET:
        # The largest store that fits beside the table, else alone (the table stays global).
        for table in (lp_table, 0) if lp_in_smem else (0,):
            room = max_smem_bytes - table - wide_select_bytes(0, wide_sort_size)
            nodes = min(room // _WIDE_NODE_BYTES // 256 * 256, 4 * max_budget, _WIDE_MAX_CAP)
            if nodes >= 2 * max_budget:
                wide_cap = nodes
                lp_in_smem = table > 0
                break
    select_smem = (lp_table if lp_in_smem else 0) + (
        wide_select_bytes(wide_cap, wide_sort_size) if wide_cap else 0
    )
    # The select starts on the first wave's depths where the rows take a second wave.
    early = merge_here and rows > slots and wide_cap == 0
    early_depths = min(draft_len, slots // batch_size) if early else 0
    select_threads = _EARLY_SELECT_THREADS if early_depths else _SELECT_THREADS
    return BuildTreePlan(
        top_k=top_k,
        warps=warps,
        unroll=unroll,
        min_blocks=min_blocks,
        tile=tile,
        span=span,
        num_chunks=num_chunks,
        num_parts=num_parts,
        expand_at=expand_at,
        cap=cap,
        sort_size=sort_size,
        merge_here=merge_here,
        merge_ranks=merge_here and top_k >= _MERGE_RANKS_MIN_TOP_K,
        lp_in_smem=lp_in_smem,
        wide_cap=wide_cap,
        wide_min_budget=_WIDE_MIN_BUDGET,
        wide_sort_size=wide_sort_size,
        bulk_after=0 if batch_size >= _BULK_MIN_BATCH and max_budget >= _BULK_MIN_BUDGET else -1,
        early_depths=early_depths,
        topk=jit.LaunchParams((num_chunks, rows, 1), (warps * 32, 1, 1), topk_smem),
        merge=jit.LaunchParams((rows, 1, 1), (merge_threads, 1, 1), merge_smem),
        select=jit.LaunchParams(
            (batch_size, 1, 1), (select_threads, 1, 1), select_smem, dependent=True
        ),
    )


def _topk_warp_smem(cap: int, expand_at: int, unroll: int) -> int:
    """Shared memory of one top-k warp's buffers: its ``cap`` candidates (8 bytes each; see
    BuildTreePlan.cap) and its hit buffer (``_hit_buffer_bytes``)."""
    return cap * 8 + _hit_buffer_bytes(expand_at, unroll)


def _hit_buffer_bytes(expand_at: int, unroll: int) -> int:
    """A top-k warp's hit buffer: its hit vectors not yet expanded, ``expand_at + 32 * unroll``
    (16 bytes and a 4-byte first token each)."""
    return (expand_at + 32 * unroll) * 20


def _blocks_fitting(topk_smem: int, warps: int, max_smem_bytes: int) -> int:
    """Top-k blocks of ``warps`` warps and ``topk_smem`` buffer bytes that one SM's shared memory
    holds with the kernel's static shared memory: ``max_smem_bytes + _STATIC_SMEM_RESERVE``
    stands in for the per-block opt-in (``max_dynamic_smem``)."""
    sm_smem = max_smem_bytes + _STATIC_SMEM_RESERVE + _SM_SMEM_OVER_OPTIN
    return sm_smem // (topk_smem + topk_static_smem(warps))


def topk_static_smem(warps: int) -> int:
    """Static shared memory of a ``ddtree_build_topk`` block of ``warps`` warps, bytes."""
    return _TOPK_STATIC + warps * _TOPK_STATIC_PER_WARP


def _four_warps_faster(
    top_k: int, rows: int, num_sms: int, warp_smem: int, max_smem_bytes: int, min_blocks: int
) -> bool:
    """Whether top-k blocks of four warps, asking for ``2 * min_blocks`` per SM (the same
    registers per thread), beat the blocks of eight that fit: rows of ``top_k`` candidates,
    ``warp_smem`` buffer bytes per warp. Measured on the H200 (docs/kernels.md, session 18):

    * large budgets (bf16 top_k above 509 there): eight warps' blocks fit one per SM, whose SM
      idles while the block ends its row; four-warp blocks keep two or more per SM, unless
      their rows would be split (B 32 K 1024: 0.646 -> 0.480 ms; B 8 K 576-768 would be
      1.12-1.15x the time; session 32, K 540-572: B 32 0.97-0.98x, B 16 1.00-1.01x);
    * rows that fill at least one wave of four-warp blocks, as evenly as eight-warp blocks
      fill theirs (four-warp blocks take twice as long per row), at budgets where halving the
      warps keeps ``j = ceil(top_k / warps)`` on the same side of ``TOPK_BOUND_MAX_J`` (the
      warps' running lane bounds): B 64-128, K 16-64 and 256-500, 0.80-0.96x the time; K
      96-128 would be 1.10x, B 48 (1.45 waves of four-warp blocks) 1.06-1.33x;
    * rows that one wave of four-warp blocks holds and eight-warp blocks need two waves for,
      at top_k up to ``_FOUR_WARP_ONE_WAVE_MAX_TOP_K`` (docs/kernels.md, session 30): B 32 and
      24, K 16, 0.97x and 0.92x the time; K 32 changed by less than the spread between
      processes, K 64 took 1.02x and K 96 1.12x (session 29).
    """
    blocks8 = min(min_blocks, _blocks_fitting(8 * warp_smem, 8, max_smem_bytes))
    blocks4 = min(2 * min_blocks, _blocks_fitting(4 * warp_smem, 4, max_smem_bytes))
    slots8, slots4 = num_sms * blocks8, num_sms * blocks4
    if blocks8 < min_blocks <= blocks4:
        return slots4 < 2 * rows  # the rows are not split
    one_wave = blocks4 == 2 * blocks8 and slots8 < rows <= slots4
    if one_wave and top_k <= _FOUR_WARP_ONE_WAVE_MAX_TOP_K:
        return True
    waves8 = -(-rows // slots8)
    even = blocks4 == 2 * blocks8 and rows >= slots4 and 2 * -(-rows // slots4) <= waves8
    bound = _TOPK_BOUND_MAX_J
    return even and (-(-top_k // 4) <= bound) == (-(-top_k // 8) <= bound)


def _power_of_two_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): a bitonic sort's width."""
    return 1 << max(0, (n - 1).bit_length())


def wide_select_bytes(cap: int, sort_size: int) -> int:
    """Shared memory of the wide select's store for ``cap`` nodes and a sort of ``sort_size``
    (build_tree_select_wide.cuh: 8-byte composites, the 2 * sort_size sort buffer, fp32
    scores, two int32 work arrays, int16 parents and ranks, int8 depths)."""
    return _WIDE_NODE_BYTES * cap + 16 * sort_size + 4


def accept_launch_params(batch_size: int, *, reads_logits: bool) -> jit.LaunchParams:
    """Launch geometry of ``accept``: one block per request (pure; no GPU needed)."""
    threads = _ACCEPT_LOGIT_THREADS if reads_logits else _ACCEPT_THREADS
    return jit.LaunchParams((batch_size, 1, 1), (threads, 1, 1), 0, dependent=True)


def commit_kv_launch_params(batch_size: int, row_bytes: int) -> jit.LaunchParams:
    """Launch geometry of ``commit_kv``: (request, 1 KiB column slice) blocks (pure).

    Raises
    ------
    ValueError
        ``row_bytes`` (head_dim times the element size) is not a multiple of 16.
    """
    if row_bytes % 16:
        raise ValueError(
            f"kv_cache: head_dim * element size must be a multiple of 16 bytes, got {row_bytes}"
        )
    column_blocks = -(-(row_bytes // 16) // _COMMIT_COLS)
    if batch_size > 2**31 - 1 or column_blocks > 65535:
        raise ValueError(f"kv_cache: rows of {row_bytes} bytes are too wide")
    return jit.LaunchParams(
        (batch_size, column_blocks, 1), (_COMMIT_THREADS, 1, 1), 0, dependent=True
    )


@functools.cache
def _build_kernel(
    entry: str, dtype_code: int, plan_defines: tuple[tuple[str, int], ...], index: int
) -> Any:
    defines = {"DDTREE_DTYPE": dtype_code, **dict(plan_defines)}
    kernel = jit.get_kernel("build_tree.cu", entry, defines, index)
    # Allow the largest dynamic size once (static shared memory stays under 36 KiB), so any
    # smaller size of a later launch fits too.
    jit.set_max_dynamic_smem(kernel, max_dynamic_smem(index), index)
    return kernel


def _i32(value: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(value))


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else int(tensor.data_ptr())


@functools.cache
def max_dynamic_smem(index: int) -> int:
    """Dynamic shared memory, bytes, that these kernels may ask for on CUDA device ``index``."""
    properties = torch.cuda.get_device_properties(index)
    optin = int(properties.shared_memory_per_block_optin)  # type: ignore[attr-defined]  # not in stubs
    return min(_MAX_SMEM_BYTES, optin - _STATIC_SMEM_RESERVE)


@functools.cache
def _num_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def device_build_tree_plan(
    batch_size: int, draft_len: int, vocab_size: int, max_budget: int, element_size: int, index: int
) -> BuildTreePlan:
    """``build_tree_plan`` for CUDA device ``index`` (its SMs and shared memory) with the
    current top-k tuning; the RPC path and the doorbell channels both launch by it."""
    return build_tree_plan(
        batch_size,
        draft_len,
        vocab_size,
        max_budget,
        element_size=element_size,
        num_sms=_num_sms(index),
        max_smem_bytes=max_dynamic_smem(index),
        unroll=_TOPK_UNROLL,
        min_blocks=_TOPK_MIN_BLOCKS,
    )


def _align(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


@dataclass(frozen=True)
class BuildScratch:
    """Device scratch of the ``build_tree`` launches: one uint8 allocation (``memory``) and the
    device pointers of its regions, each 256-byte aligned."""

    memory: torch.Tensor
    topk_lp: int
    """[rows, top_k] fp32 log-probs of each row's top-K."""
    topk_tok: int
    """[rows, top_k] int32 tokens."""
    topk_count: int
    """[rows] int32 possible tokens."""
    part_keys: int
    """[rows, num_parts, top_k] uint64 candidate composites (empty with ``plan.merge_here``)."""
    part_stats: int
    """[rows, num_parts, 3] fp32 statistics (empty with ``plan.merge_here``)."""
    row_ready: int
    """[rows] int32 flags of an early select (``plan.early_depths``; empty without one): a row of
    the first ``early_depths`` depths is written, a deeper row is not needed (the select's hint
    to its top-k block). The top-k resets every one itself, so they need no initial value."""


def build_scratch(plan: BuildTreePlan, rows: int, device: torch.device) -> BuildScratch:
    """Allocate the scratch of ``plan``'s launches over ``rows`` (request, depth) rows."""
    lp_bytes = _align(rows * plan.top_k * 4)
    count_bytes = _align(rows * 4)
    parts = 0 if plan.merge_here else rows * plan.num_parts
    part_bytes = _align(parts * plan.top_k * 8)
    stats_bytes = _align(parts * 3 * 4)
    ready_bytes = count_bytes if plan.early_depths else 0
    memory = torch.empty(
        2 * lp_bytes + count_bytes + part_bytes + stats_bytes + ready_bytes,
        dtype=torch.uint8,
        device=device,
    )
    topk_lp = memory.data_ptr()
    topk_tok = topk_lp + lp_bytes
    topk_count = topk_tok + lp_bytes
    part_keys = topk_count + count_bytes
    part_stats = part_keys + part_bytes
    return BuildScratch(
        memory, topk_lp, topk_tok, topk_count, part_keys, part_stats, part_stats + stats_bytes
    )


def build_tree(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int | torch.Tensor,
    *,
    temperature: float = 1.0,
    max_budget: int | None = None,
    error_flags: torch.Tensor | None = None,
    out: Tree | None = None,
) -> Tree:
    """CUDA ``build_tree``; see ``ddtree.kernels.build_tree`` for parameters and semantics."""
    budgets, num_nodes_max = checks.check_build_tree_args(
        draft_logits,
        root_tokens,
        budget,
        temperature=temperature,
        max_budget=max_budget,
        error_flags=error_flags,
        out=out,
    )
    batch_size, draft_len, vocab_size = draft_logits.shape
    device = draft_logits.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    if error_flags is None:
        checks.resolve_flags(
            checks.root_token_flags(root_tokens, vocab_size),
            None,
            checks.FLAG_MESSAGES["build_tree"],
        )
        flags = torch.zeros(batch_size, dtype=torch.int32, device=device)  # [batch]
    else:
        flags = error_flags
    element = draft_logits.element_size()
    plan = device_build_tree_plan(
        batch_size, draft_len, vocab_size, num_nodes_max - 1, element, index
    )
    code = _DTYPE_CODES[draft_logits.dtype]
    rows = batch_size * draft_len
    words = mask_words(num_nodes_max)
    vectorized = vocab_size % (16 // element) == 0 and draft_logits.data_ptr() % 16 == 0

    scratch = build_scratch(plan, rows, device)
    tree = (
        out
        if out is not None
        else Tree(
            tokens=torch.empty(batch_size, num_nodes_max, dtype=torch.int64, device=device),
            parents=torch.empty(batch_size, num_nodes_max, dtype=torch.int32, device=device),
            depths=torch.empty(batch_size, num_nodes_max, dtype=torch.int32, device=device),
            log_probs=torch.empty(batch_size, num_nodes_max, dtype=torch.float32, device=device),
            num_nodes=torch.empty(batch_size, dtype=torch.int32, device=device),
            mask=torch.empty(batch_size, num_nodes_max, words, dtype=torch.int64, device=device),
            draft_len=draft_len,
        )
    )
    variant = tuple(plan.defines.items())

    with torch.cuda.device(index):
        jit.launch(
            _build_kernel("ddtree_build_topk", code, variant, index),
            plan.topk,
            _ptr(draft_logits),
            ctypes.c_float(temperature),
            _i32(vocab_size),
            _i32(plan.span),
            _i32(plan.top_k),
            _i32(plan.cap),
            _i32(int(vectorized)),
            scratch.part_keys,
            scratch.part_stats,
            _i32(int(plan.merge_here)),
            _i32(plan.sort_size),
            scratch.topk_lp,
            scratch.topk_tok,
            scratch.topk_count,
            _i32(batch_size),
            _i32(draft_len),
            scratch.row_ready,
            device=index,
        )
        if not plan.merge_here:
            jit.launch(
                _build_kernel("ddtree_build_merge", code, variant, index),
                plan.merge,
                scratch.part_keys,
                scratch.part_stats,
                _i32(plan.num_parts),
                _i32(plan.top_k),
                _i32(plan.sort_size),
                _i32(vocab_size),
                scratch.topk_lp,
                scratch.topk_tok,
                scratch.topk_count,
                device=index,
            )
        jit.launch(
            _build_kernel("ddtree_build_select", code, variant, index),
            plan.select,
            scratch.topk_lp,
            scratch.topk_tok,
            scratch.topk_count,
            _ptr(root_tokens),
            _ptr(budgets),
            _ptr(flags),
            _ptr(tree.tokens),
            _ptr(tree.parents),
            _ptr(tree.depths),
            _ptr(tree.log_probs),
            _ptr(tree.num_nodes),
            _ptr(tree.mask),
            _i32(vocab_size),
            _i32(draft_len),
            _i32(plan.top_k),
            _i32(num_nodes_max),
            _i32(words),
            _i32(int(plan.lp_in_smem)),
            _i32(batch_size),
            _i32(int(out is not None)),
            _i32(plan.wide_cap),
            _i32(plan.wide_min_budget),
            _i32(plan.wide_sort_size),
            scratch.row_ready,
            device=index,
        )
    return tree


def accept(
    tree: Tree,
    target_tokens: torch.Tensor | None = None,
    *,
    target_logits: torch.Tensor | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    error_flags: torch.Tensor | None = None,
    out: Acceptance | None = None,
) -> Acceptance:
    """CUDA ``accept``; see ``ddtree.kernels.accept`` for parameters and semantics.

    Into ``out`` with ``error_flags``: a validating launch, then the walk, whose blocks write
    nothing when any request of the batch is flagged (accept.cu, PHASE 1 then 2).
    """
    checks.check_accept_args(
        tree,
        target_tokens,
        target_logits=target_logits,
        temperature=temperature,
        generator=generator,
        error_flags=error_flags,
        out=out,
    )
    if tree.draft_len > MAX_DRAFT_LEN:
        raise ValueError(f"tree.draft_len: expected at most {MAX_DRAFT_LEN}, got {tree.draft_len}")
    batch_size, num_nodes_max = tree.batch_size, tree.num_nodes_max
    device = tree.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    if error_flags is None:
        found = checks.tree_flags(tree)  # [batch]
        if target_tokens is not None:
            found = found | checks.target_token_flags(tree, target_tokens)  # [batch]
        checks.resolve_flags(
            found,
            None,
            checks.FLAG_MESSAGES["accept"],
        )
        flags = torch.zeros(batch_size, dtype=torch.int32, device=device)  # [batch]
    else:
        flags = error_flags
    seed = None
    if temperature > 0:
        # The reference's draw, so one generator state gives the reference's result.
        seed = torch.randint(
            0, 2**62, (1,), generator=generator, device=device, dtype=torch.int64
        )  # [1]
    mode = 0 if target_tokens is not None else (2 if temperature > 0 else 1)
    path_len = tree.draft_len + 1
    result = (
        out
        if out is not None
        else Acceptance(
            nodes=torch.empty(batch_size, path_len, dtype=torch.int32, device=device),
            tokens=torch.empty(batch_size, path_len, dtype=torch.int64, device=device),
            length=torch.empty(batch_size, dtype=torch.int32, device=device),
            bonus=torch.empty(batch_size, dtype=torch.int64, device=device),
        )
    )
    logits = target_logits if target_logits is not None else None
    code = _DTYPE_CODES[logits.dtype] if logits is not None else 0
    if logits is not None and not logits.is_contiguous():
        logits = logits.contiguous()
    vocab_size = logits.shape[2] if logits is not None else 0
    params = accept_launch_params(batch_size, reads_logits=logits is not None)
    kernel = _accept_kernel(code, params.block[0], index)
    # Flags already resolved on the host (no error_flags) leave nothing to gate on.
    phases = (1, 2) if out is not None and error_flags is not None else (0,)
    with torch.cuda.device(index):
        for phase in phases:
            jit.launch(
                kernel,
                params,
                _ptr(tree.tokens),
                _ptr(tree.parents),
                _ptr(tree.depths),
                _ptr(tree.num_nodes),
                _ptr(target_tokens),
                _ptr(logits),
                _ptr(seed),
                _ptr(flags),
                _ptr(result.nodes),
                _ptr(result.tokens),
                _ptr(result.length),
                _ptr(result.bonus),
                _i32(num_nodes_max),
                _i32(tree.draft_len),
                _i32(vocab_size),
                _i32(mode),
                ctypes.c_float(temperature),
                _i32(batch_size),
                _i32(phase),
                device=index,
            )
    return result


@functools.cache
def _accept_kernel(dtype_code: int, threads: int, index: int) -> Any:
    return jit.get_kernel(
        "accept.cu", "ddtree_accept", {"DDTREE_DTYPE": dtype_code, "ACCEPT_THREADS": threads}, index
    )


def commit_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    acceptance: Acceptance,
    *,
    error_flags: torch.Tensor | None = None,
    all_or_nothing: bool = False,
) -> None:
    """CUDA ``commit_kv``; see ``ddtree.kernels.commit_kv`` for parameters and semantics.

    All or nothing with ``error_flags``: a validating launch of one block per request, then
    the moves, whose blocks move nothing when any request of the batch is flagged
    (commit_kv.cu, PHASE 1 then 2).
    """
    checks.check_commit_kv_args(
        kv_cache, block_table, prefix_lens, acceptance, error_flags=error_flags
    )
    num_pages, page_size, head_dim = kv_cache.shape
    batch_size, path_len = acceptance.nodes.shape
    if path_len > MAX_DRAFT_LEN + 1:
        raise ValueError(
            f"acceptance.nodes: expected path_len <= {MAX_DRAFT_LEN + 1}, got {path_len}"
        )
    row_bytes = head_dim * kv_cache.element_size()
    params = commit_kv_launch_params(batch_size, row_bytes)
    if kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache: expected a 16-byte aligned tensor")
    device = kv_cache.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    if error_flags is None:
        checks.resolve_flags(
            checks.commit_kv_flags(block_table, prefix_lens, acceptance, num_pages, page_size),
            None,
            checks.FLAG_MESSAGES["commit_kv"],
        )
        flags = torch.zeros(batch_size, dtype=torch.int32, device=device)  # [batch]
    else:
        flags = error_flags
    nodes = acceptance.nodes.contiguous()
    table = block_table.contiguous()
    lens = prefix_lens.contiguous()
    length = acceptance.length.contiguous()
    launches = [(params, 0)]
    if all_or_nothing and error_flags is not None:
        validate = jit.LaunchParams(
            (batch_size, 1, 1), params.block, params.shared_mem_bytes, dependent=True
        )
        launches = [(validate, 1), (params, 2)]
    kernel = _commit_kernel(index)
    with torch.cuda.device(index):
        for launch_params, phase in launches:
            jit.launch(
                kernel,
                launch_params,
                _ptr(kv_cache),
                _ptr(table),
                _ptr(lens),
                _ptr(nodes),
                _ptr(length),
                _ptr(flags),
                _i32(num_pages),
                _i32(page_size),
                _i32(row_bytes // 16),
                _i32(table.shape[1]),
                _i32(path_len),
                _i32(batch_size),
                _i32(phase),
                device=index,
            )


@functools.cache
def _commit_kernel(index: int) -> Any:
    return jit.get_kernel(
        "commit_kv.cu", "ddtree_commit_kv", {"COLS_PER_BLOCK": _COMMIT_COLS}, index
    )
