"""Plain result and argument types of the clients (no gRPC, no server code)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DeviceInfo", "KvCommit", "MemoryRegion", "ServerInfo", "ServerLimits"]


@dataclass(frozen=True)
class KvCommit:
    """The caller's paged latent KV cache that ``accept_tree`` compacts to the accepted path.

    After the call, logical positions ``prefix_len .. prefix_len + length - 1`` of each request
    hold the accepted nodes, root first, in ``kv_cache`` itself (in place, whether the cache
    travelled inline or by reference); ``prefix_lens`` is not modified.
    """

    kv_cache: torch.Tensor  # [num_pages, page_size, head_dim], e.g. bf16 with head_dim 576
    block_table: torch.Tensor  # [batch_size, max_pages] int32
    prefix_lens: torch.Tensor  # [batch_size] int32


@dataclass(frozen=True)
class DeviceInfo:
    """A device the server runs ops on."""

    uuid: str
    """GPU UUID (``"GPU-..."``), or ``"cpu"``."""
    name: str
    """Device name (``"NVIDIA H200"``) or the CPU architecture."""
    compute_capability: tuple[int, int]
    """``(major, minor)``; ``(0, 0)`` for the CPU."""
    total_memory_bytes: int
    """Device memory in bytes; 0 for the CPU."""
    backend: str
    """``"cuda"`` (compiled kernels) or ``"reference"`` (pure torch)."""


@dataclass(frozen=True)
class ServerLimits:
    """Limits every request must respect (``0`` where a limit does not apply)."""

    max_budget: int
    max_draft_len: int
    max_message_bytes: int
    max_tensor_bytes: int
    max_batch_size: int
    max_concurrent_calls: int
    request_deadline_cap_s: float
    max_channels: int = 0
    """GPU doorbell channels the server holds open at once; ``0``: it offers none."""


@dataclass(frozen=True)
class ServerInfo:
    """What ``server_info()`` returns."""

    version: str
    """ddtree version of the server."""
    devices: tuple[DeviceInfo, ...]
    limits: ServerLimits
    supports_memory_references: bool
    """Whether tensors may travel as references into registered memory."""


@dataclass(frozen=True)
class MemoryRegion:
    """A region of caller memory registered with the server (tokens are never listed)."""

    region_id: str
    """Non-secret identifier (16 hex characters), as in the server's log."""
    device_uuid: str
    """GPU holding the region."""
    byte_size: int
    """Bytes of the region, from the allocation base."""
