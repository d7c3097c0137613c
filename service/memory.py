"""Registered caller memory: CUDA IPC regions, capability tokens, leases and tensor references.

A caller on the same node hands the service an allocation of its own GPU memory once
(``RegisterMemory``: a CUDA IPC memory handle naming the allocation base); the service maps it
with ``cuIpcOpenMemHandle`` and answers with an unguessable token. Later requests name tensors
inside the region by ``(token, offset_bytes, dtype, shape)``; ``Leases.resolve`` checks the
reference (bounds without overflow, dtype alignment, device) and returns a zero-copy torch view
of the caller's memory, which the ops read and write in place.

Safety rules kept here:

- A token is ``secrets.token_urlsafe(24)`` (192 random bits). It is a capability: it is never
  logged or listed; logs and ``ListMemory`` show a separate, non-secret ``region_id``.
- A region is bound to its owner: the identity of the caller that registered it, which the
  server derives from the connection (``access.client_identity``: certificate subject on mTLS,
  peer IP on TCP, ``"unix"`` for every Unix-socket caller), never from the request. With
  ``MemoryLimits.bind_to_owner`` another identity's use, listing or unregistering of the token
  gets NOT_FOUND exactly as an unknown token does, so a leaked token reveals nothing.
- Regions and their bytes are bounded per server and per owner (``MemoryLimits``); past them
  registration gets RESOURCE_EXHAUSTED and nothing is mapped.
- Every call that resolves references holds a lease on each region it uses. ``unregister`` makes
  the token unknown at once, but the mapping is closed only when the last lease is released, so
  an in-flight call never touches unmapped memory.
- A region unused for ``idle_timeout_s`` expires (its token becomes unknown, clients
  re-register). This is how mappings of callers that died without unregistering are released.

The CUDA driver calls live in ``CudaIpcMapper``; everything else is plain Python over the
``IpcMapper`` protocol, so the bookkeeping is testable without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ddtree.service.errors import (
    DeviceMismatch,
    InvalidArgument,
    InvalidIpcHandle,
    InvalidReference,
    IpcOpenFailed,
    MemoryLimitExceeded,
    MemoryTokenNotFound,
    ShuttingDown,
)

__all__ = [
    "IPC_HANDLE_BYTES",
    "MAX_CLIENT_ID_CHARS",
    "TOKEN_BYTES",
    "CudaIpcMapper",
    "EventWaiter",
    "IpcMapper",
    "Leases",
    "MemoryLimits",
    "RegionInfo",
    "RegionTable",
    "check_client_id",
    "check_reference",
    "device_bytes",
]

_log = logging.getLogger(__name__)

IPC_HANDLE_BYTES = 64
"""Size of a ``cudaIpcMemHandle_t`` / ``cudaIpcEventHandle_t``."""

TOKEN_BYTES = 24
"""Random bytes in a region token (192 bits; the token is their URL-safe base64, 32 chars)."""

MAX_CLIENT_ID_CHARS = 64
"""Longest ``client_id``."""

_CLIENT_ID_RE = re.compile(r"[A-Za-z0-9_.:-]*")
_MAX_TOKEN_CHARS = 128
_SWEEP_INTERVAL_S = 1.0
_MAX_CACHED_EVENTS = 64
_MAX_CACHED_VIEWS = 256
"""Resolved reference views kept per region; a caller reuses a few buffers call after call."""


@dataclass(frozen=True)
class MemoryLimits:
    """Per-server bounds on registered memory (from ``ServiceConfig``).

    Attributes
    ----------
    max_regions : int
        Regions registered at once, ``>= 1``.
    max_bytes : int
        Sum of the registered regions' ``byte_size``, ``>= 1``.
    idle_timeout_s : float
        A region no call has used for this long expires, ``> 0``; ``math.inf`` never expires.
    bind_to_owner : bool
        Whether only the owner (the identity that registered a region) can use, list or
        unregister it; other identities get NOT_FOUND as for an unknown token.
    max_regions_per_owner : int
        Regions one owner may have registered at once, ``>= 0``; ``0`` for no per-owner limit.
    max_bytes_per_owner : int
        Sum of one owner's regions' ``byte_size``, ``>= 0``; ``0`` for no per-owner limit.
    """

    max_regions: int = 1024
    max_bytes: int = 1 << 40
    idle_timeout_s: float = 600.0
    bind_to_owner: bool = True
    max_regions_per_owner: int = 0
    max_bytes_per_owner: int = 0

    def __post_init__(self) -> None:
        if self.max_regions < 1:
            raise ValueError(f"max_regions: expected >= 1, got {self.max_regions}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes: expected >= 1, got {self.max_bytes}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s: expected > 0, got {self.idle_timeout_s}")
        for name in ("max_regions_per_owner", "max_bytes_per_owner"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0 (0: no limit), got {getattr(self, name)}")


@dataclass(frozen=True)
class RegionInfo:
    """A registered region as ``ListMemory`` shows it (never with its token)."""

    region_id: str
    """Non-secret identifier, 16 hex characters (logs, ListMemory)."""
    client_id: str
    """The caller-chosen identity given at registration."""
    device_uuid: str
    """GPU holding the region (``"GPU-..."``)."""
    byte_size: int
    """Bytes of the region, from the allocation base."""


class IpcMapper(Protocol):
    """Opens and closes CUDA IPC handles on one device (``CudaIpcMapper``)."""

    def open_memory(self, handle: bytes) -> tuple[int, int]:
        """Map a 64-byte memory handle; returns ``(device_pointer, mapped_bytes)``.

        Raises ``IpcOpenFailed`` when the handle cannot be opened.
        """
        ...

    def close_memory(self, pointer: int) -> None:
        """Unmap a pointer returned by ``open_memory``."""
        ...

    def open_event(self, handle: bytes) -> Any:
        """Open a 64-byte event handle; raises ``IpcOpenFailed`` when it cannot be opened."""
        ...

    def wait_event(self, event: Any, stream: int) -> None:
        """Make ``stream`` (a ``CUstream`` address) wait for ``event``'s last record."""
        ...

    def close_event(self, event: Any) -> None:
        """Destroy an event returned by ``open_event``."""
        ...

    def as_bytes(self, pointer: int, byte_size: int, device: torch.device) -> torch.Tensor:
        """A uint8 tensor of ``byte_size`` bytes at ``pointer`` on ``device``, no copy."""
        ...

    def release(self) -> None:
        """Give up the driver resources the mapper holds."""
        ...


def check_reference(
    field: str,
    offset_bytes: int,
    shape: Sequence[int],
    itemsize: int,
    region_bytes: int,
) -> int:
    """Check that a tensor of ``shape`` at ``offset_bytes`` lies inside a region.

    Arithmetic is on Python integers, so no product or sum can wrap around; a tensor is inside
    when ``offset_bytes + prod(shape) * itemsize <= region_bytes``.

    Parameters
    ----------
    field : str
        Dotted request path for messages (``"build_tree.draft_logits"``).
    offset_bytes : int
        Offset of the first element from the region's base, ``>= 0``.
    shape : sequence of int
        Extents, each ``>= 0``.
    itemsize : int
        Bytes per element (``2`` for bf16); ``offset_bytes`` must be a multiple of it.
    region_bytes : int
        Size of the region.

    Returns
    -------
    int
        The tensor's byte size, ``prod(shape) * itemsize``.

    Raises
    ------
    InvalidReference
        A negative offset or extent, an offset that is not a multiple of ``itemsize``, or a
        tensor that ends past the region (``reason`` ``"INVALID_REFERENCE"``).
    """
    if offset_bytes < 0:
        raise InvalidReference(
            f"{field}.ref.offset_bytes: expected >= 0, got {offset_bytes}", field=f"{field}.ref"
        )
    if any(extent < 0 for extent in shape):
        raise InvalidReference(
            f"{field}.shape: expected extents >= 0, got {list(shape)}", field=f"{field}.shape"
        )
    if offset_bytes % itemsize:
        raise InvalidReference(
            f"{field}.ref.offset_bytes: expected a multiple of the dtype's itemsize {itemsize}, "
            f"got {offset_bytes}",
            field=f"{field}.ref",
        )
    byte_size = math.prod(shape) * itemsize
    end = offset_bytes + byte_size
    if end > region_bytes:
        raise InvalidReference(
            f"{field}.ref: bytes [{offset_bytes}, {end}) of shape {list(shape)} lie past the "
            f"region's {region_bytes} bytes; register the whole allocation or fix the offset",
            field=f"{field}.ref",
        )
    return byte_size


class _Region:
    """One mapped region (internal; mutated under ``RegionTable._lock``)."""

    __slots__ = (
        "byte_size",
        "bytes_view",
        "client_id",
        "device_uuid",
        "is_unregistered",
        "last_used_s",
        "leases",
        "owner",
        "pointer",
        "region_id",
        "views",
    )

    def __init__(
        self,
        *,
        region_id: str,
        client_id: str,
        owner: str,
        device_uuid: str,
        pointer: int,
        byte_size: int,
        bytes_view: torch.Tensor | None,
        now_s: float,
    ) -> None:
        self.region_id = region_id
        self.client_id = client_id
        self.owner = owner  # server-derived identity of the registering caller
        self.device_uuid = device_uuid
        self.pointer = pointer
        self.byte_size = byte_size
        self.bytes_view = bytes_view  # [byte_size] uint8 over the mapping, or None until used
        # (offset_bytes, dtype, shape) -> checked view of the mapping, reused by later calls
        self.views: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self.leases = 0
        self.is_unregistered = False
        self.last_used_s = now_s

    def info(self) -> RegionInfo:
        return RegionInfo(self.region_id, self.client_id, self.device_uuid, self.byte_size)


class RegionTable:
    """The registered regions of one device, with limits, leases and deferred closing.

    Parameters
    ----------
    device : torch.device
        The CUDA device whose memory the regions are (views are made on it).
    device_uuid : str
        Its UUID (``"GPU-..."``); registrations naming another UUID are refused.
    mapper : IpcMapper
        Opens and closes the IPC handles.
    limits : MemoryLimits
        Bounds on regions and bytes, and the idle timeout.
    on_change : callable, optional
        Called with ``(regions, byte_size)`` after every change (metrics gauges).
    clock : callable
        Monotonic seconds (tests pass a fake clock).

    Notes
    -----
    Thread-safe. Driver calls (open, close) run outside the lock.
    """

    def __init__(
        self,
        *,
        device: torch.device,
        device_uuid: str,
        mapper: IpcMapper,
        limits: MemoryLimits | None = None,
        on_change: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = device
        self.device_uuid = device_uuid
        self.limits = limits or MemoryLimits()
        self._mapper = mapper
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}
        self._bytes = 0
        self._pending = 0  # registrations between the limit check and the insert
        self._pending_bytes = 0
        self._usage: dict[str, list[int]] = {}  # owner -> [regions, bytes], pending included
        self._closing: list[_Region] = []
        self._last_sweep_s = -math.inf
        self._is_closed = False

    # ------------------------------------------------------------------ registration

    def register(
        self, ipc_handle: bytes, device_uuid: str, byte_size: int, client_id: str, owner: str = ""
    ) -> tuple[str, RegionInfo]:
        """Map a caller's allocation and return its token.

        Parameters
        ----------
        ipc_handle : bytes
            The allocation base's ``cudaIpcMemHandle_t``, exactly 64 bytes.
        device_uuid : str
            UUID of the GPU holding it; must be this table's device.
        byte_size : int
            Bytes the caller will reference from the base, ``1 ..`` the allocation's size.
        client_id : str
            Caller-chosen name for ``list``, ``<= 64`` chars of ``[A-Za-z0-9_.:-]``.
        owner : str
            The caller's identity as the server derived it (``access.client_identity``); with
            ``bind_to_owner`` only calls of this identity reach the region. ``""`` in-process.

        Returns
        -------
        tuple of (str, RegionInfo)
            The token (a capability: never log it) and the region.

        Raises
        ------
        InvalidIpcHandle
            A handle that is not 64 bytes, ``byte_size`` 0 or larger than the allocation.
        InvalidArgument
            A malformed ``client_id``.
        DeviceMismatch
            ``device_uuid`` is not this server's GPU.
        MemoryLimitExceeded
            Registering would pass ``max_regions`` or ``max_bytes``, or the owner's
            ``max_regions_per_owner`` or ``max_bytes_per_owner``.
        IpcOpenFailed
            The driver cannot open the handle (closed or foreign allocation, another node,
            no shared IPC namespace).
        """
        if len(ipc_handle) != IPC_HANDLE_BYTES:
            raise InvalidIpcHandle(
                f"register_memory.ipc_handle: expected {IPC_HANDLE_BYTES} bytes "
                f"(cudaIpcMemHandle_t), got {len(ipc_handle)}",
                field="register_memory.ipc_handle",
            )
        check_client_id("register_memory.client_id", client_id)
        if device_uuid != self.device_uuid:
            raise DeviceMismatch(
                f"register_memory.device_uuid: this server runs on {self.device_uuid}, got "
                f"{device_uuid!r}; register with a server on that GPU",
                field="register_memory.device_uuid",
            )
        if byte_size < 1:
            raise InvalidIpcHandle(
                f"register_memory.byte_size: expected >= 1, got {byte_size}",
                field="register_memory.byte_size",
            )
        self.sweep(force=True)
        with self._lock:
            self._raise_if_closed()
            self._check_limits(byte_size)
            self._check_owner_limits(owner, byte_size)
            self._pending += 1
            self._pending_bytes += byte_size
            self._charge(owner, 1, byte_size)
        try:
            pointer, mapped_bytes = self._mapper.open_memory(ipc_handle)
        except BaseException:
            self._unreserve(owner, byte_size)
            raise
        if byte_size > mapped_bytes:
            self._close_pointer(pointer, "oversized")
            self._unreserve(owner, byte_size)
            raise InvalidIpcHandle(
                f"register_memory.byte_size: {byte_size} bytes is larger than the allocation "
                f"the handle names ({mapped_bytes} bytes); send at most the allocation's size",
                field="register_memory.byte_size",
            )
        token = secrets.token_urlsafe(TOKEN_BYTES)
        region = _Region(
            region_id=secrets.token_hex(8),
            client_id=client_id,
            owner=owner,
            device_uuid=device_uuid,
            pointer=pointer,
            byte_size=byte_size,
            bytes_view=None,
            now_s=self._clock(),
        )
        with self._lock:
            self._pending -= 1
            self._pending_bytes -= byte_size
            self._regions[token] = region
            self._bytes += byte_size
        _log.info(
            "event=memory_registered region_id=%s client_id=%s byte_size=%d",
            region.region_id,
            client_id,
            byte_size,
        )
        self._changed()
        return token, region.info()

    def unregister(self, token: str, owner: str = "") -> RegionInfo:
        """Forget a region; its mapping closes once no call holds a lease on it.

        Parameters
        ----------
        token : str
            The region's token.
        owner : str
            The caller's identity (see ``register``).

        Raises
        ------
        MemoryTokenNotFound
            The token is unknown or expired, or (with ``bind_to_owner``) another owner's.
        """
        with self._lock:
            region = self._find(token, owner)
            if region is None:
                raise MemoryTokenNotFound(
                    "unregister_memory.region_token: unknown or expired region token",
                    field="unregister_memory.region_token",
                )
            del self._regions[token]
            self._bytes -= region.byte_size
            self._charge(region.owner, -1, -region.byte_size)
            region.is_unregistered = True
            close_now = region.leases == 0
        _log.info(
            "event=memory_unregistered region_id=%s deferred=%s",
            region.region_id,
            not close_now,
        )
        if close_now:
            self._close_region(region)
        self._changed()
        return region.info()

    def list(self, client_id: str, owner: str = "") -> list[RegionInfo]:
        """The regions registered with ``client_id``, oldest first.

        With ``bind_to_owner``, only those ``owner`` (the caller's identity) registered.

        Raises
        ------
        InvalidArgument
            A malformed ``client_id``.
        """
        check_client_id("list_memory.client_id", client_id)
        self.sweep(force=True)
        with self._lock:
            return [
                r.info()
                for r in self._regions.values()
                if r.client_id == client_id and self._may_use(r, owner)
            ]

    def stats(self) -> tuple[int, int]:
        """``(regions, byte_size)`` registered now (regions closing after unregister excluded)."""
        with self._lock:
            return len(self._regions), self._bytes

    def leases(self, owner: str = "") -> Leases:
        """A fresh, empty set of leases for one call of ``owner`` (see ``register``)."""
        return Leases(self, owner)

    # ------------------------------------------------------------------ expiry and shutdown

    def sweep(self, *, force: bool = False) -> int:
        """Expire regions idle for longer than ``idle_timeout_s``; returns how many.

        Without ``force`` it does nothing if it ran less than a second ago (it is called on
        the hot path).
        """
        now = self._clock()
        expired: list[_Region] = []
        with self._lock:
            if not force and now - self._last_sweep_s < _SWEEP_INTERVAL_S:
                return 0
            self._last_sweep_s = now
            timeout = self.limits.idle_timeout_s
            for token, region in list(self._regions.items()):
                if region.leases == 0 and now - region.last_used_s > timeout:
                    del self._regions[token]
                    self._bytes -= region.byte_size
                    self._charge(region.owner, -1, -region.byte_size)
                    region.is_unregistered = True
                    expired.append(region)
        for region in expired:
            _log.info("event=memory_expired region_id=%s", region.region_id)
            self._close_region(region)
        if expired:
            self._changed()
        return len(expired)

    def close(self) -> None:
        """Unregister every region (each closes when its last lease ends) and refuse new ones.

        Idempotent; failures to close are logged, not raised.
        """
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
            regions = list(self._regions.values())
            self._regions.clear()
            self._bytes = 0
            idle = []
            for region in regions:
                self._charge(region.owner, -1, -region.byte_size)
                region.is_unregistered = True
                if region.leases == 0:
                    idle.append(region)
        for region in idle:
            self._close_region(region)
        self._changed()

    # ------------------------------------------------------------------ leases (via Leases)

    def _acquire_all(self, tokens: Sequence[str], field: str, owner: str) -> Sequence[_Region]:
        """Lease the region of every token, or none of them (one pass under the lock)."""
        self.sweep()
        with self._lock:
            regions = []
            for token in tokens:
                region = self._find(token, owner)
                if region is None:
                    raise MemoryTokenNotFound(
                        f"{field}.ref.region_token: unknown or expired region token; register "
                        "the memory again",
                        field=f"{field}.ref.region_token",
                    )
                regions.append(region)
            now = self._clock()
            for region in regions:
                region.leases += 1
                region.last_used_s = now
            return regions

    def _release(self, regions: Sequence[_Region]) -> None:
        with self._lock:
            closing = []
            for region in regions:
                region.leases -= 1
                if region.leases == 0 and region.is_unregistered:
                    closing.append(region)
        for region in closing:
            self._close_region(region)

    def _bytes_view(self, region: _Region) -> torch.Tensor:
        # Made once per region: later references are slices of it (a few microseconds each).
        view = region.bytes_view
        if view is None:
            view = self._mapper.as_bytes(region.pointer, region.byte_size, self.device)
            region.bytes_view = view
        return view

    # ------------------------------------------------------------------ internals

    def _raise_if_closed(self) -> None:
        if self._is_closed:
            raise ShuttingDown("register_memory: the server is shutting down; register elsewhere")

    def _check_limits(self, byte_size: int) -> None:
        regions = len(self._regions) + self._pending
        if regions + 1 > self.limits.max_regions:
            raise MemoryLimitExceeded(
                f"register_memory: the server holds {regions} regions, its max_registered_regions "
                f"is {self.limits.max_regions}; unregister unused regions",
                field="register_memory",
            )
        total = self._bytes + self._pending_bytes
        if total + byte_size > self.limits.max_bytes:
            raise MemoryLimitExceeded(
                f"register_memory.byte_size: {byte_size} more bytes would pass the server's "
                f"max_registered_bytes {self.limits.max_bytes} ({total} registered)",
                field="register_memory.byte_size",
            )

    def _check_owner_limits(self, owner: str, byte_size: int) -> None:
        regions, held = self._usage.get(owner, [0, 0])
        max_regions = self.limits.max_regions_per_owner
        if max_regions and regions + 1 > max_regions:
            raise MemoryLimitExceeded(
                f"register_memory: client {owner or 'in-process'} holds {regions} regions, the "
                f"server's max_regions_per_client is {max_regions}; unregister unused regions",
                field="register_memory",
            )
        max_bytes = self.limits.max_bytes_per_owner
        if max_bytes and held + byte_size > max_bytes:
            raise MemoryLimitExceeded(
                f"register_memory.byte_size: {byte_size} more bytes would pass the server's "
                f"max_registered_bytes_per_client {max_bytes} for client "
                f"{owner or 'in-process'} ({held} registered)",
                field="register_memory.byte_size",
            )

    def _charge(self, owner: str, regions: int, byte_size: int) -> None:
        # Under the lock: counts an owner's regions and bytes (reservations included).
        usage = self._usage.setdefault(owner, [0, 0])
        usage[0] += regions
        usage[1] += byte_size
        if usage[0] == 0:
            del self._usage[owner]

    def _may_use(self, region: _Region, owner: str) -> bool:
        return not self.limits.bind_to_owner or region.owner == owner

    def _find(self, token: str, owner: str) -> _Region | None:
        # Under the lock. Another owner's region is not found, exactly like an unknown token.
        region = self._regions.get(token) if _is_token(token) else None
        if region is None or not self._may_use(region, owner):
            return None
        return region

    def _unreserve(self, owner: str, byte_size: int) -> None:
        with self._lock:
            self._pending -= 1
            self._pending_bytes -= byte_size
            self._charge(owner, -1, -byte_size)

    def _close_region(self, region: _Region) -> None:
        region.bytes_view = None
        region.views = {}
        self._close_pointer(region.pointer, region.region_id)

    def _close_pointer(self, pointer: int, region_id: str) -> None:
        try:
            self._mapper.close_memory(pointer)
        except Exception as err:  # cleanup: log, never raise
            _log.warning("event=memory_close_failed region_id=%s error=%s", region_id, err)

    def _changed(self) -> None:
        if self._on_change is None:
            return
        regions, byte_size = self.stats()
        self._on_change(regions, byte_size)


def _is_token(token: str) -> bool:
    return 0 < len(token) <= _MAX_TOKEN_CHARS


def check_client_id(field: str, client_id: str) -> None:
    """Check a ``client_id``: at most 64 characters of ``[A-Za-z0-9_.:-]``.

    Raises
    ------
    InvalidArgument
        Too long, or another character.
    """
    if len(client_id) > MAX_CLIENT_ID_CHARS or not _CLIENT_ID_RE.fullmatch(client_id):
        raise InvalidArgument(
            f"{field}: expected at most {MAX_CLIENT_ID_CHARS} characters of [A-Za-z0-9_.:-], "
            f"got {client_id[:80]!r}",
            field=field,
        )


class Leases:
    """The regions one call uses: each region a reference resolves to is held until ``release``.

    Made by ``RegionTable.leases(owner)``; release it once the call's device work has finished
    (the engine does, from the call's future). ``release`` is idempotent. References resolve
    only to regions ``owner`` may use (see ``MemoryLimits.bind_to_owner``). A call takes one
    lease per region, however many of its references name it: the first reference to a token
    looks the region up, later ones reuse it (a region leased by the call stays mapped until
    the call ends, even when it is unregistered meanwhile).
    """

    def __init__(self, table: RegionTable, owner: str = "") -> None:
        self._table = table
        self._owner = owner
        self._regions: list[_Region] = []
        self._held: dict[str, _Region] = {}  # token -> region leased by this call
        self._lock = threading.Lock()
        self._is_released = False

    def __bool__(self) -> bool:
        return bool(self._regions)

    def resolve(
        self,
        field: str,
        token: str,
        offset_bytes: int,
        dtype: torch.dtype,
        shape: Sequence[int],
    ) -> torch.Tensor:
        """A zero-copy tensor of ``shape`` and ``dtype`` at ``offset_bytes`` in a region.

        Parameters
        ----------
        field : str
            Dotted request path for messages.
        token : str
            Region token from ``register``.
        offset_bytes : int
            Offset of the first element from the region's base.
        dtype : torch.dtype
            Element type.
        shape : sequence of int
            Extents; the tensor is C-contiguous.

        Returns
        -------
        torch.Tensor
            A view of the caller's memory on the table's device (writes reach the caller).

        Raises
        ------
        MemoryTokenNotFound
            Unknown or expired token, or (with ``bind_to_owner``) another owner's region.
        InvalidReference
            Out of bounds or misaligned for ``dtype``.
        DeviceMismatch
            The region is on another device than the call's.
        """
        region = self._held.get(token)
        if region is None:
            region = self._acquire(field, (token,))[0]
        elif self._is_released:
            raise InvalidArgument(f"{field}: the call's leases were already released")
        key = (offset_bytes, dtype, tuple(shape))
        view = region.views.get(key)
        if view is not None:  # checked when it was made; the region's size never changes
            return view
        byte_size = check_reference(field, offset_bytes, shape, dtype.itemsize, region.byte_size)
        if byte_size == 0:
            return torch.empty(key[2], dtype=dtype, device=self._table.device)
        raw = self._table._bytes_view(region)[offset_bytes : offset_bytes + byte_size]
        view = raw.view(dtype).view(key[2])
        views = region.views
        if len(views) >= _MAX_CACHED_VIEWS:
            views.clear()
        views[key] = view
        return view

    @property
    def tokens(self) -> tuple[str, ...]:
        """Tokens of the regions this call holds, in the order they were first leased."""
        return tuple(self._held)

    def hold(self, field: str, tokens: Sequence[str]) -> None:
        """Lease the regions of ``tokens`` for this call without resolving references (a call
        decoded earlier whose views are reused), all in one pass over the table; raises as
        ``resolve`` does, and then holds none of them."""
        missing = [token for token in tokens if token not in self._held]
        if missing:
            self._acquire(field, missing)

    def _acquire(self, field: str, tokens: Sequence[str]) -> Sequence[_Region]:
        regions = self._table._acquire_all(tokens, field, self._owner)
        with self._lock:
            if self._is_released:
                self._table._release(regions)
                raise InvalidArgument(f"{field}: the call's leases were already released")
            self._regions.extend(regions)
            for token, region in zip(tokens, regions, strict=True):
                self._held[token] = region
        for region in regions:
            if region.device_uuid != self._table.device_uuid:
                raise DeviceMismatch(
                    f"{field}.ref: the region is on {region.device_uuid}, the call runs on "
                    f"{self._table.device_uuid}",
                    field=f"{field}.ref",
                )
        return regions

    def release(self) -> None:
        """End every lease of the call; regions unregistered meanwhile close now."""
        with self._lock:
            if self._is_released:
                return
            self._is_released = True
            regions, self._regions = self._regions, []
            self._held = {}
        if regions:
            self._table._release(regions)


class EventWaiter:
    """Opens CUDA IPC event handles (cached by handle) and makes a stream wait on them.

    Parameters
    ----------
    mapper : IpcMapper
        Opens, waits on and destroys the events.
    """

    def __init__(self, mapper: IpcMapper) -> None:
        self._mapper = mapper
        self._events: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    def wait(self, handle: bytes, stream: int, field: str) -> None:
        """Enqueue on ``stream`` a wait for the last record of the event ``handle`` names.

        Raises
        ------
        InvalidIpcHandle
            ``handle`` is not 64 bytes.
        IpcOpenFailed
            The driver cannot open it (not an interprocess event, another node).
        """
        if len(handle) != IPC_HANDLE_BYTES:
            raise InvalidIpcHandle(
                f"{field}: expected {IPC_HANDLE_BYTES} bytes (cudaIpcEventHandle_t), "
                f"got {len(handle)}",
                field=field,
            )
        with self._lock:
            event = self._events.get(handle)
            if event is not None:
                self._events.move_to_end(handle)
        if event is None:
            event = self._mapper.open_event(handle)
            evicted = []
            with self._lock:
                self._events[handle] = event
                while len(self._events) > _MAX_CACHED_EVENTS:
                    evicted.append(self._events.popitem(last=False)[1])
            for old in evicted:  # a pending wait on a destroyed event still completes
                self._mapper.close_event(old)
        self._mapper.wait_event(event, stream)

    def close(self) -> None:
        """Destroy every cached event; failures are logged."""
        with self._lock:
            events = list(self._events.values())
            self._events.clear()
        for event in events:
            try:
                self._mapper.close_event(event)
            except Exception as err:  # cleanup: log, never raise
                _log.warning("event=event_close_failed error=%s", err)


class _DeviceBytes:
    """Exposes ``byte_size`` bytes at a device pointer through ``__cuda_array_interface__``."""

    def __init__(self, pointer: int, byte_size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (byte_size,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
            "stream": None,  # no producer stream: ordering is the IPC contract's (docs/ipc.md)
        }


def device_bytes(pointer: int, byte_size: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of shape ``(byte_size,)`` over existing device memory at ``pointer``
    (no copy, no ownership): what an ``IpcMapper.as_bytes`` returns."""
    return torch.as_tensor(_DeviceBytes(pointer, byte_size), device=device)


class CudaIpcMapper:
    """``IpcMapper`` over the CUDA driver (cuda-python), on one device's primary context.

    Parameters
    ----------
    device : torch.device
        A CUDA device.

    Raises
    ------
    ImportError
        cuda-python is not installed (the ``server`` / ``cuda`` extras).
    IpcOpenFailed
        The driver cannot be initialised for the device.
    """

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver

        self._driver = driver
        self._device = device
        self._check(driver.cuInit(0), "cuInit")
        cu_device = self._check(driver.cuDeviceGet(device.index or 0), "cuDeviceGet")
        self._cu_device = cu_device
        self._context = self._check(
            driver.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain"
        )

    def _check(self, result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            name = getattr(err, "name", str(err))
            raise IpcOpenFailed(f"{what} failed with {name}")
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        driver = self._driver
        self._check(driver.cuCtxPushCurrent(self._context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            driver.cuCtxPopCurrent()

    def open_memory(self, handle: bytes) -> tuple[int, int]:
        """See ``IpcMapper.open_memory``."""
        driver = self._driver
        cu_handle = driver.CUipcMemHandle()
        ctypes.memmove(cu_handle.getPtr(), handle, IPC_HANDLE_BYTES)
        flags = int(driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.value)
        with self._current():
            err, pointer = driver.cuIpcOpenMemHandle(cu_handle, flags)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise IpcOpenFailed(
                    f"register_memory.ipc_handle: cuIpcOpenMemHandle failed with {err.name}; the "
                    "handle must name a live cudaMalloc allocation of a process on this node that "
                    "shares the IPC namespace (hostIPC), exported with cudaIpcGetMemHandle",
                    field="register_memory.ipc_handle",
                )
            err, _base, size = driver.cuMemGetAddressRange(pointer)
            if err != driver.CUresult.CUDA_SUCCESS:
                driver.cuIpcCloseMemHandle(pointer)
                raise IpcOpenFailed(
                    f"register_memory.ipc_handle: cuMemGetAddressRange failed with {err.name}",
                    field="register_memory.ipc_handle",
                )
        return int(pointer), int(size)

    def close_memory(self, pointer: int) -> None:
        """See ``IpcMapper.close_memory``."""
        driver = self._driver
        with self._current():
            self._check(driver.cuIpcCloseMemHandle(driver.CUdeviceptr(pointer)), "cuIpcClose")

    def open_event(self, handle: bytes) -> Any:
        """See ``IpcMapper.open_event``."""
        driver = self._driver
        cu_handle = driver.CUipcEventHandle()
        ctypes.memmove(cu_handle.getPtr(), handle, IPC_HANDLE_BYTES)
        with self._current():
            err, event = driver.cuIpcOpenEventHandle(cu_handle)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise IpcOpenFailed(
                f"wait_event_ipc_handle: cuIpcOpenEventHandle failed with {err.name}; record an "
                "event made with interprocess=True (and timing disabled) on this node",
                field="wait_event_ipc_handle",
            )
        return event

    def wait_event(self, event: Any, stream: int) -> None:
        """See ``IpcMapper.wait_event``."""
        driver = self._driver
        with self._current():
            result = driver.cuStreamWaitEvent(driver.CUstream(stream), event, 0)
        self._check(result, "cuStreamWaitEvent")

    def close_event(self, event: Any) -> None:
        """See ``IpcMapper.close_event``."""
        with self._current():
            self._check(self._driver.cuEventDestroy(event), "cuEventDestroy")

    def as_bytes(self, pointer: int, byte_size: int, device: torch.device) -> torch.Tensor:
        """See ``IpcMapper.as_bytes``."""
        return device_bytes(pointer, byte_size, device)

    def release(self) -> None:
        """See ``IpcMapper.release``."""
        try:
            self._check(self._driver.cuDevicePrimaryCtxRelease(self._cu_device), "ctx release")
        except IpcOpenFailed as err:
            _log.warning("event=mapper_release_failed error=%s", err)
