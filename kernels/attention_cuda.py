"""CUDA backend of ``verify_attention``: tree-masked paged MLA attention on tensor cores.

The kernels live in ``verify_attention.cu`` (compiled at first use by :mod:`ddtree.kernels.jit`
for the device in hand). One call launches, on torch's current stream and without a host sync
when ``error_flags`` is given:

1. ``ddtree_verify_attention_check``: per request, validates ``num_nodes``, ``prefix_lens`` and
   every block-table entry the request reads (the bits of ``checks.attention_flags``) and marks
   flagged requests to be skipped;
2. ``ddtree_verify_attention``: flash-style attention of 64 query rows (node-major, head-minor:
   all heads share the one latent K/V) over a range of key tiles. On compute capability 9.0 the
   ``sm_90a`` build issues wgmma from shared memory; elsewhere the portable build uses warp-level
   ``mma.sync`` (bf16 in, fp32 accumulation), with smaller tiles where shared memory is short
   (sm_120);
3. ``ddtree_verify_attention_combine`` (only when the key range is split across thread blocks
   to fill the GPU): merges the partial results by their log-sum-exp.

:func:`plan_launch` computes every launch parameter from sizes alone (no GPU needed).
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass

import torch

from ddtree.kernels import checks, jit
from ddtree.kernels.types import Tree

__all__ = [
    "AttentionPlan",
    "TileConfig",
    "has_wgmma",
    "plan_launch",
    "tile_config",
    "verify_attention",
]

_SOURCE = "verify_attention.cu"
_LOG2E = 1.4426950408889634
_CHECK_THREADS = 256
_COMBINE_THREADS = 128
_MAX_SPLITS = 64
_MAX_WORKSPACE_BYTES = 1 << 30
# Split cost model, in units of one BLOCK_M x BLOCK_N tile on one SM: an extra launch costs about
# one tile, and the fp32 partials cost their write plus read at about this many bytes per tile
# time (a 64 x 64 x 1088 tile takes about 6 us on an H200 SM; HBM moves about 3 TB/s).
_COMBINE_BYTES_PER_TILE = 18_000_000


@dataclass(frozen=True)
class TileConfig:
    """One compiled variant of the attention kernel (the ``VA_*`` macros of the source)."""

    head_dim: int
    v_dim: int
    block_m: int
    block_n: int
    warps_m: int
    warps_n: int
    wgmma: bool = False
    """Hopper path: compiled for ``sm_90a``, products on wgmma (two warpgroups)."""

    @property
    def arch(self) -> str | None:
        """Architecture to compile for, or ``None`` for the device's own."""
        return "sm_90a" if self.wgmma else None

    @property
    def threads(self) -> int:
        """Threads per block."""
        return 32 * self.warps_m * self.warps_n

    @property
    def shared_mem_bytes(self) -> int:
        """Dynamic shared memory: Q tile, two key tiles, the P tile and row-reduction scratch."""
        row_bytes = self.head_dim * 2
        p_bytes = self.block_m * (self.block_n * 2 + (0 if self.wgmma else 16))
        return (
            self.block_m * row_bytes
            + 2 * self.block_n * row_bytes
            + p_bytes
            + 4 * self.warps_n * self.block_m
        )

    def defines(self) -> dict[str, int]:
        """Preprocessor macros selecting this variant."""
        return {
            "VA_HEAD_DIM": self.head_dim,
            "VA_V_DIM": self.v_dim,
            "VA_BLOCK_M": self.block_m,
            "VA_BLOCK_N": self.block_n,
            "VA_WARPS_M": self.warps_m,
            "VA_WARPS_N": self.warps_n,
            "VA_WGMMA": int(self.wgmma),
        }


def tile_config(
    head_dim: int, v_dim: int, max_shared_mem_bytes: int, *, use_wgmma: bool = False
) -> TileConfig:
    """Pick the kernel variant for a device: wgmma on Hopper, else the largest that fits.

    Parameters
    ----------
    head_dim : int
        Latent width (576 for DeepSeek-V3 / Kimi K2 MLA).
    v_dim : int
        Value width (512).
    max_shared_mem_bytes : int
        The device's opt-in shared memory per block (232448 on H100/H200/B200, 101376 on sm_120).
    use_wgmma : bool
        Take the ``sm_90a`` wgmma variant (64 x 64 tiles, two warpgroups) when ``v_dim == 512``
        and it fits; only for compute capability 9.0 devices.

    Returns
    -------
    TileConfig
        The wgmma variant if asked for and possible; else 64 x 64 tiles with 8 warps on
        ``mma.sync`` where they fit, else 32 x 16 tiles with 4 warps.

    Raises
    ------
    ValueError
        ``head_dim`` is not a multiple of 64, ``v_dim`` is not a multiple of 64 or exceeds
        ``min(head_dim, 512)``, or no variant fits the shared memory.
    """
    if head_dim % 64 != 0 or not 64 <= v_dim <= min(head_dim, 512) or v_dim % 64 != 0:
        raise ValueError(
            "q: the CUDA verify_attention supports head_dim a multiple of 64 and v_dim a multiple "
            f"of 64 up to min(head_dim, 512), got head_dim={head_dim}, v_dim={v_dim}; "
            "use backend='reference' for other widths"
        )
    candidates = [
        TileConfig(head_dim, v_dim, 64, 64, 2, 4),
        TileConfig(head_dim, v_dim, 32, 16, 2, 2),
    ]
    if use_wgmma and v_dim == 512:
        candidates.insert(0, TileConfig(head_dim, v_dim, 64, 64, 4, 2, wgmma=True))
    for config in candidates:
        if config.shared_mem_bytes <= max_shared_mem_bytes:
            return config
    raise ValueError(
        f"q: head_dim={head_dim} needs more shared memory than the device's "
        f"{max_shared_mem_bytes} bytes per block; use backend='reference'"
    )


@dataclass(frozen=True)
class AttentionPlan:
    """Every launch of one ``verify_attention`` call."""

    config: TileConfig
    num_splits: int
    check: jit.LaunchParams
    attention: jit.LaunchParams
    combine: jit.LaunchParams | None
    """``None`` when ``num_splits == 1`` (the attention kernel writes ``out`` directly)."""


def _choose_splits(ctas: int, key_tiles: int, partial_bytes_per_split: int, num_sms: int) -> int:
    """Split count minimising waves x tiles per split + the combine's cost (see the constants)."""
    best, best_cost = 1, math.inf
    cost: float
    by_memory = max(1, _MAX_WORKSPACE_BYTES // partial_bytes_per_split)
    limit = min(_MAX_SPLITS, max(1, key_tiles), by_memory)
    for splits in range(1, limit + 1):
        waves = math.ceil(ctas * splits / num_sms)
        cost = waves * math.ceil(key_tiles / splits)
        if splits > 1:
            cost += 1 + 2 * splits * partial_bytes_per_split / _COMBINE_BYTES_PER_TILE
        if cost < best_cost:
            best, best_cost = splits, cost
    return best


def plan_launch(
    batch_size: int,
    num_nodes_max: int,
    num_heads: int,
    head_dim: int,
    v_dim: int,
    capacity_tokens: int,
    num_sms: int,
    max_shared_mem_bytes: int,
    num_splits: int | None = None,
    *,
    use_wgmma: bool = False,
) -> AttentionPlan:
    """Launch parameters of one call, from sizes alone.

    Parameters
    ----------
    batch_size, num_nodes_max, num_heads, head_dim, v_dim : int
        The problem (see ``ddtree.kernels.verify_attention``).
    capacity_tokens : int
        ``max_pages * page_size``: the longest key range a request can have. The split count is
        chosen for it, since the actual lengths live on the device; the kernel divides each
        request's actual tiles evenly over the splits.
    num_sms : int
        Multiprocessors of the device (132 on an H200).
    max_shared_mem_bytes : int
        The device's opt-in shared memory per block.
    num_splits : int, optional
        Force this many key-range splits (tests and benchmarks); default: the cost model's pick.
    use_wgmma : bool
        See :func:`tile_config`.

    Returns
    -------
    AttentionPlan
        Grids: check ``(batch_size,)``; attention ``(m_tiles, num_splits, batch_size)``;
        combine ``(num_nodes_max * num_heads, batch_size)``.
    """
    config = tile_config(head_dim, v_dim, max_shared_mem_bytes, use_wgmma=use_wgmma)
    rows = num_nodes_max * num_heads
    m_tiles = math.ceil(rows / config.block_m)
    key_tiles = max(1, math.ceil(min(capacity_tokens, 1 << 31) / config.block_n))
    partial_bytes = batch_size * rows * (v_dim + 1) * 4
    if num_splits is None:
        num_splits = _choose_splits(batch_size * m_tiles, key_tiles, partial_bytes, num_sms)
    elif not 1 <= num_splits <= 65535:
        raise ValueError(f"num_splits: expected 1 <= num_splits <= 65535, got {num_splits}")
    return AttentionPlan(
        config=config,
        num_splits=num_splits,
        check=jit.LaunchParams((batch_size, 1, 1), (_CHECK_THREADS, 1, 1)),
        attention=jit.LaunchParams(
            (m_tiles, num_splits, batch_size), (config.threads, 1, 1), config.shared_mem_bytes
        ),
        combine=None
        if num_splits == 1
        else jit.LaunchParams((rows, batch_size, 1), (_COMBINE_THREADS, 1, 1)),
    )


@functools.cache
def _device_limits(index: int) -> tuple[int, int]:
    """(multiprocessors, opt-in shared memory per block) of CUDA device ``index``."""
    from cuda.bindings import driver

    err, value = driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, index
    )
    if int(err) != 0:
        raise jit.CudaError("cannot read the device's shared memory limit", result_name=err.name)
    return torch.cuda.get_device_properties(index).multi_processor_count, int(value)


def has_wgmma(index: int) -> bool:
    """Whether CUDA device ``index`` runs the ``sm_90a`` wgmma variant (compute capability 9.0)."""
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.cache
def _kernels(config: TileConfig, index: int) -> tuple[object, object, object]:
    """The three kernels of ``config`` for device ``index``, with the shared-memory limit set."""
    defines = config.defines()
    entries = (
        "ddtree_verify_attention_check",
        "ddtree_verify_attention",
        "ddtree_verify_attention_combine",
    )
    if config.arch is None:
        check, attention, combine = (jit.get_kernel(_SOURCE, e, defines, index) for e in entries)
    else:
        # The check and combine kernels come from the device's portable build (shared with the
        # mma.sync variant); the attention kernel from an sm_90a build, compiled and cached by
        # jit like every other, loaded here because jit.get_kernel targets the device's own arch.
        from cuda.core import ObjectCode

        portable = tile_config(config.head_dim, config.v_dim, _device_limits(index)[1])
        check = jit.get_kernel(_SOURCE, entries[0], portable.defines(), index)
        combine = jit.get_kernel(_SOURCE, entries[2], portable.defines(), index)
        cubin, _ = jit.compile_cubin(_SOURCE, config.arch, defines)
        attention = ObjectCode.from_cubin(cubin, name=_SOURCE).get_kernel(entries[1])
    jit.set_max_dynamic_smem(attention, config.shared_mem_bytes, index)
    return check, attention, combine


def _require_aligned(tensor: torch.Tensor, name: str) -> None:
    if tensor.data_ptr() % 16 != 0:
        raise ValueError(f"{name}: expected a 16-byte aligned data pointer; pass {name}.clone()")


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA ``verify_attention`` (see ``ddtree.kernels.verify_attention`` for the contract).

    Parameters
    ----------
    q : torch.Tensor
        Shape ``(batch_size, num_nodes_max, num_heads, head_dim)``, bf16, CUDA, contiguous,
        16-byte aligned. ``head_dim`` a multiple of 64 (576 for MLA).
    kv_cache : torch.Tensor
        Shape ``(num_pages, page_size, head_dim)``, bf16, CUDA, contiguous, 16-byte aligned.
    block_table : torch.Tensor
        Shape ``(batch_size, max_pages)``, int32, CUDA, contiguous.
    prefix_lens : torch.Tensor
        Shape ``(batch_size,)``, int32, CUDA.
    tree : Tree
        Only ``num_nodes`` and ``mask`` are read.
    v_dim : int
        Value width, a multiple of 64 up to ``min(head_dim, 512)``.
    sm_scale : float, optional
        Softmax scale; default ``1 / sqrt(head_dim)``.
    out : torch.Tensor, optional
        Shape ``(batch_size, num_nodes_max, num_heads, v_dim)``, bf16, contiguous, 16-byte
        aligned; written in place if given.
    lse : torch.Tensor, optional
        Shape ``(batch_size, num_nodes_max, num_heads)``, fp32, contiguous; written in place if
        given.
    error_flags : torch.Tensor, optional
        Shape ``(batch_size,)``, int32. Bits are OR-ed in on the device; requests with any bit
        set (also from earlier ops) are left untouched. If omitted, a flagged request raises
        ``ValueError`` after the kernels ran (a host sync).

    Returns
    -------
    tuple of torch.Tensor
        ``(out, lse)``. Outputs allocated here start as ``0`` / ``-inf``, which skipped requests
        keep.

    Raises
    ------
    ValueError
        Shapes, dtypes, devices, layouts or widths the kernel does not support, or (without
        ``error_flags``) a request with an out-of-range ``num_nodes``, prefix length or
        block-table entry.
    """
    scale = checks.check_verify_attention_args(
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
    for tensor, name in ((q, "q"), (block_table, "block_table"), (tree.mask, "tree.mask")):
        checks.check_tensor(
            tensor,
            name,
            shape=(None,) * tensor.dim(),
            shape_doc="(as documented)",
            dtypes=(tensor.dtype,),
            contiguous=True,
        )
    batch_size, num_nodes_max, num_heads, head_dim = q.shape
    page_size = kv_cache.shape[1]
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    num_sms, max_smem = _device_limits(index)
    plan = plan_launch(
        batch_size,
        num_nodes_max,
        num_heads,
        head_dim,
        v_dim,
        block_table.shape[1] * page_size,
        num_sms,
        max_smem,
        use_wgmma=has_wgmma(index),
    )
    return _run(plan, q, kv_cache, block_table, prefix_lens, tree, scale, out, lse, error_flags)


def _run(
    plan: AttentionPlan,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree: Tree,
    scale: float,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    error_flags: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``plan`` on checked arguments (the benchmark calls this to compare split counts)."""
    batch_size, num_nodes_max, num_heads, _ = q.shape
    num_pages, page_size, _ = kv_cache.shape
    v_dim = plan.config.v_dim
    device = q.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    if out is None:
        out = torch.zeros(batch_size, num_nodes_max, num_heads, v_dim, dtype=q.dtype, device=device)
    elif not out.is_contiguous():
        raise ValueError("out: expected a contiguous tensor; pass out.contiguous()")
    if lse is None:
        lse = torch.full((batch_size, num_nodes_max, num_heads), -math.inf, device=device)
    elif not lse.is_contiguous():
        raise ValueError("lse: expected a contiguous tensor; pass lse.contiguous()")
    _require_aligned(q, "q")
    _require_aligned(kv_cache, "kv_cache")
    _require_aligned(out, "out")

    prefix = prefix_lens.contiguous()
    num_nodes = tree.num_nodes.contiguous()
    flags = torch.empty(batch_size, dtype=torch.int32, device=device)
    skip = torch.empty(batch_size, dtype=torch.int32, device=device)
    check, attention, combine = _kernels(plan.config, index)
    i32 = ctypes.c_int32
    jit.launch(
        check,
        plan.check,
        block_table.data_ptr(),
        prefix.data_ptr(),
        num_nodes.data_ptr(),
        flags.data_ptr(),
        0 if error_flags is None else error_flags.data_ptr(),
        skip.data_ptr(),
        i32(num_nodes_max),
        i32(num_pages),
        i32(page_size),
        i32(block_table.shape[1]),
        device=index,
    )
    rows = num_nodes_max * num_heads
    if plan.num_splits > 1:
        part_o = torch.empty(plan.num_splits, batch_size, rows, v_dim, device=device)
        part_lse = torch.empty(plan.num_splits, batch_size, rows, device=device)
        part_o_ptr, part_lse_ptr = part_o.data_ptr(), part_lse.data_ptr()
    else:
        part_o_ptr = part_lse_ptr = 0
    jit.launch(
        attention,
        plan.attention,
        q.data_ptr(),
        kv_cache.data_ptr(),
        block_table.data_ptr(),
        prefix.data_ptr(),
        num_nodes.data_ptr(),
        tree.mask.data_ptr(),
        skip.data_ptr(),
        out.data_ptr(),
        lse.data_ptr(),
        part_o_ptr,
        part_lse_ptr,
        i32(batch_size),
        i32(num_nodes_max),
        i32(num_heads),
        i32(tree.mask.shape[2]),
        i32(page_size),
        i32(block_table.shape[1]),
        ctypes.c_float(scale * _LOG2E),
        i32(plan.num_splits),
        device=index,
    )
    if plan.combine is not None:
        jit.launch(
            combine,
            plan.combine,
            part_o_ptr,
            part_lse_ptr,
            num_nodes.data_ptr(),
            skip.data_ptr(),
            out.data_ptr(),
            lse.data_ptr(),
            i32(batch_size),
            i32(rows),
            i32(num_heads),
            i32(plan.num_splits),
            device=index,
        )
    if error_flags is None:
        checks.resolve_flags(flags, None, checks.FLAG_MESSAGES["verify_attention"])
    return out, lse
