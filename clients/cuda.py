"""Export torch CUDA tensors to a ddtree server on the same node by CUDA IPC (the ``cuda`` extra).

A tensor travels as a reference ``(region_token, offset_bytes, dtype, shape)`` into an
allocation the client registered once with ``RegisterMemory``. torch's caching allocator
sub-allocates tensors out of large ``cudaMalloc`` segments, so the unit of registration is the
segment: ``locate`` finds a tensor's allocation base and offset with ``cuMemGetAddressRange``,
``ipc_mem_handle`` exports the base with ``cuIpcGetMemHandle``, and a ``MemoryRegistry`` keeps
one token per allocation (keyed by the driver's never-reused buffer id) for every later call.
An ``AllocationCache`` keeps what ``locate`` found per allocation, so a call costs one driver
call per allocation it touches (the tensor's buffer id) instead of four per tensor, and a
``RequestMemo`` keeps a client's last few by-reference requests, so that a call repeating one
with the same buffers (static buffers, ``out=``) skips locating and building altogether.

Export is impossible, and refused with an ``ExportError`` that says why, for CPU tensors, for
memory of the ``cudaMallocAsync`` allocator backend and for expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``): neither is a legacy-IPC-capable
``cudaMalloc`` allocation. The remote clients fall back to inline tensors only when asked to
(``tensor_transport="auto"``).

cuda-python is imported lazily, on first use, so ``ddtree.clients`` imports with the base
dependencies alone; ``require_cuda_python`` names the extra to install when it is missing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from ddtree.v1 import tensor_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb

__all__ = [
    "IPC_HANDLE_BYTES",
    "Allocation",
    "AllocationCache",
    "ClientIpc",
    "ExportError",
    "MemoEntry",
    "MemoryRegistry",
    "RequestMemo",
    "RequestRefs",
    "TensorTransport",
    "device_uuid",
    "ipc_mem_handle",
    "locate",
    "query_buffer_id",
    "require_cuda_python",
]

IPC_HANDLE_BYTES = 64
"""Size of a ``cudaIpcMemHandle_t``."""

TensorTransport = Literal["inline", "ipc", "auto"]
"""How a remote client sends tensors: ``"inline"`` bytes always; ``"ipc"`` CUDA tensors by
reference, failing where that is impossible; ``"auto"`` by reference where possible, else
inline."""

_EXTRA = "pip install 'ddtree[cuda]'"


class ExportError(ValueError):
    """A tensor cannot travel by CUDA IPC reference; the message says why and what to do."""


def require_cuda_python() -> ModuleType:
    """The ``cuda.bindings.driver`` module.

    Raises
    ------
    ImportError
        cuda-python is not installed; the message names the ``cuda`` extra.
    """
    try:
        from cuda.bindings import driver as module
    except ImportError as err:
        raise ImportError(
            "ddtree.clients.cuda needs cuda-python (cuda-bindings) to export GPU tensors by "
            f"CUDA IPC; install the extra: {_EXTRA}"
        ) from err
    driver: ModuleType = module
    return driver


@dataclass(frozen=True)
class Allocation:
    """One ``cudaMalloc`` allocation (a caching-allocator segment) holding tensors."""

    device_uuid: str
    """GPU UUID (``"GPU-..."``), as the server names its device."""
    base_pointer: int
    """Device address of the allocation's first byte."""
    byte_size: int
    """Bytes of the allocation."""
    buffer_id: int
    """The driver's id of the allocation, never reused within the process."""

    @property
    def end_pointer(self) -> int:
        """Device address one past the allocation's last byte."""
        return self.base_pointer + self.byte_size


@functools.cache
def device_uuid(index: int) -> str:
    """UUID (``"GPU-..."``) of CUDA device ``index`` as the server reports it."""
    return f"GPU-{torch.cuda.get_device_properties(index).uuid}"


def _check(driver: ModuleType, result: Any, what: str) -> Any:
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ExportError(f"{what} failed with {getattr(err, 'name', err)}")
    return values[0] if len(values) == 1 else tuple(values)


def _ensure_context(driver: ModuleType, index: int) -> None:
    # Driver calls need a current context; torch's runtime makes the primary context current
    # on threads that used the device, other threads get it here.
    context = _check(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if context is not None and int(context) != 0:
        return
    cu_device = _check(driver, driver.cuDeviceGet(index), "cuDeviceGet")
    primary = _check(driver, driver.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain")
    _check(driver, driver.cuCtxSetCurrent(primary), "cuCtxSetCurrent")


def _refusal_hint() -> str:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.lower().replace(" ", ""):
        return (
            "PYTORCH_CUDA_ALLOC_CONF enables expandable_segments, whose memory cannot be "
            "exported by CUDA IPC handles; run the caller without expandable_segments"
        )
    return (
        "the allocation is not legacy-IPC capable (expandable segments, a memory pool or a "
        "virtual-memory allocation); allocate the tensor with torch's native cudaMalloc "
        "allocator"
    )


def _check_exportable(tensor: torch.Tensor, field: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
        where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ExportError(
            f"{field}: CUDA IPC exports CUDA tensors only, got one on {where}; move it to the "
            "GPU or send it inline"
        )
    if tensor.numel() == 0:
        raise ExportError(f"{field}: an empty tensor has no memory to export; send it inline")
    if not tensor.is_contiguous():
        raise ExportError(f"{field}: expected a C-contiguous tensor; pass {field}.contiguous()")


def locate(tensor: torch.Tensor, field: str = "tensor") -> tuple[Allocation, int]:
    """The allocation holding ``tensor`` and the tensor's byte offset in it.

    Parameters
    ----------
    tensor : torch.Tensor
        A C-contiguous CUDA tensor with at least one element.
    field : str
        Name used in error messages.

    Returns
    -------
    tuple of (Allocation, int)
        The allocation and ``offset_bytes`` of ``tensor.data_ptr()`` from its base.

    Raises
    ------
    ExportError
        A CPU, empty or non-contiguous tensor, memory of the ``cudaMallocAsync`` backend or of
        expandable segments, or a driver failure.
    ImportError
        cuda-python is missing (the ``cuda`` extra).
    """
    _check_exportable(tensor, field)
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        raise ExportError(
            f"{field}: torch uses the cudaMallocAsync allocator backend "
            "(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), whose pool memory cannot be "
            "exported by CUDA IPC handles; run the caller with the native allocator"
        )
    driver = require_cuda_python()
    index = tensor.device.index if tensor.device.index is not None else 0
    pointer = tensor.data_ptr()
    with torch.cuda.device(index):
        _ensure_context(driver, index)
        cu_pointer = driver.CUdeviceptr(pointer)
        base, size = _check(driver, driver.cuMemGetAddressRange(cu_pointer), "cuMemGetAddressRange")
        attributes = driver.CUpointer_attribute
        capable = _check(
            driver,
            driver.cuPointerGetAttribute(
                attributes.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, pointer
            ),
            "cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)",
        )
        if not capable:
            raise ExportError(f"{field}: {_refusal_hint()}")
        buffer_id = _check(
            driver,
            driver.cuPointerGetAttribute(attributes.CU_POINTER_ATTRIBUTE_BUFFER_ID, pointer),
            "cuPointerGetAttribute(BUFFER_ID)",
        )
    allocation = Allocation(device_uuid(index), int(base), int(size), int(buffer_id))
    return allocation, pointer - allocation.base_pointer


def ipc_mem_handle(allocation: Allocation, device_index: int) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` of ``allocation`` (on CUDA device ``device_index``).

    Raises
    ------
    ExportError
        ``cuIpcGetMemHandle`` failed (for example on memory that is not IPC capable).
    """
    driver = require_cuda_python()
    with torch.cuda.device(device_index):
        _ensure_context(driver, device_index)
        err, handle = driver.cuIpcGetMemHandle(driver.CUdeviceptr(allocation.base_pointer))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ExportError(f"cuIpcGetMemHandle failed with {err.name}: {_refusal_hint()}")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)


def query_buffer_id(pointer: int, device_index: int, field: str = "tensor") -> int:
    """The driver's buffer id of the allocation holding device address ``pointer``.

    One driver call (``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_BUFFER_ID)``); the id is unique
    within the process and never reused, so it names one allocation for the process's lifetime.

    Parameters
    ----------
    pointer : int
        A device address inside a live allocation.
    device_index : int
        CUDA device of the allocation (its primary context is made current if no context is).
    field : str
        Name used in error messages.

    Raises
    ------
    ExportError
        The driver call failed (for example ``pointer`` is no device memory).
    """
    driver = require_cuda_python()
    attribute = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID
    err, value = driver.cuPointerGetAttribute(attribute, pointer)
    if err != driver.CUresult.CUDA_SUCCESS:
        # A thread that never used the device may have no current context: make the device's
        # primary context current and ask again.
        with torch.cuda.device(device_index):
            _ensure_context(driver, device_index)
            err, value = driver.cuPointerGetAttribute(attribute, pointer)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise ExportError(
            f"{field}: cuPointerGetAttribute(BUFFER_ID) failed with {getattr(err, 'name', err)}"
        )
    return int(value)


class AllocationCache:
    """What ``locate`` found per allocation, checked per call by the allocation's buffer id.

    A caller sends the same few allocations call after call (torch's caching allocator serves a
    step's tensors from the segments of the last step), and ``locate`` costs four driver calls
    per tensor. The cache keeps each ``Allocation`` under the driver's buffer id, and
    ``find`` asks the driver for one thing per call: the buffer id of the memory the tensor
    lives in now. Buffer ids are never reused within a process, so memory that the allocator
    freed and a new ``cudaMalloc`` took over at the same address (``torch.cuda.empty_cache()``,
    an out-of-memory retry) has a new id and misses; a cached entry can never describe memory
    it does not hold. Within one request, a tensor whose bytes lie inside an allocation already
    confirmed for another of the request's tensors costs no driver call at all: allocations
    alive at once never overlap.

    Parameters
    ----------
    max_entries : int
        Entries kept; the cache starts over past it (entries of freed allocations are never
        hit again, so they only take room).
    buffer_id : callable, optional
        ``(pointer, device_index, field) -> int``; by default ``query_buffer_id`` (one driver
        call). Tests pass a fake driver.
    describe : callable, optional
        ``(tensor, field) -> (Allocation, offset_bytes)`` for a miss; by default ``locate``.

    Notes
    -----
    Thread-safe: the clients of several threads may share one.
    """

    def __init__(
        self,
        max_entries: int = 1024,
        *,
        buffer_id: Callable[[int, int, str], int] | None = None,
        describe: Callable[[torch.Tensor, str], tuple[Allocation, int]] | None = None,
    ) -> None:
        self.max_entries = max_entries
        self._buffer_id = buffer_id or query_buffer_id
        self._describe = describe or locate
        self._lock = threading.Lock()
        self._entries: dict[int, Allocation] = {}

    def find(
        self, tensor: torch.Tensor, field: str, confirmed: list[Allocation]
    ) -> tuple[Allocation, int]:
        """The allocation holding ``tensor`` and the tensor's byte offset in it (see ``locate``).

        Parameters
        ----------
        tensor : torch.Tensor
            A C-contiguous CUDA tensor with at least one element.
        field : str
            Name used in error messages.
        confirmed : list of Allocation
            Allocations already confirmed live for the same request (found by this method for
            another of its tensors); a tensor inside one of them needs no driver call.

        Raises
        ------
        ExportError
            As ``locate``.
        """
        _check_exportable(tensor, field)
        pointer = tensor.data_ptr()
        end = pointer + tensor.numel() * tensor.element_size()
        for allocation in confirmed:
            if allocation.base_pointer <= pointer and end <= allocation.end_pointer:
                return allocation, pointer - allocation.base_pointer
        index = tensor.device.index if tensor.device.index is not None else 0
        cached = self._entries.get(self._buffer_id(pointer, index, field))
        if cached is None:
            allocation, _ = self._describe(tensor, field)
            with self._lock:
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
                self._entries[allocation.buffer_id] = allocation
        else:
            allocation = cached
        if not allocation.base_pointer <= pointer or end > allocation.end_pointer:
            # The driver's range and its buffer id disagree: never send such a reference.
            raise ExportError(
                f"{field}: bytes [{pointer:#x}, {end:#x}) are not inside the allocation "
                f"[{allocation.base_pointer:#x}, {allocation.end_pointer:#x}) the driver named"
            )
        return allocation, pointer - allocation.base_pointer

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class MemoryRegistry:
    """The allocations one client registered with one server, and their tokens.

    Parameters
    ----------
    client_id : str, optional
        Identity sent with every registration (``ListMemory`` groups by it), ``<= 64`` chars of
        ``[A-Za-z0-9_.:-]``; by default ``"py-<pid>-<random>"``.

    Notes
    -----
    Thread-safe. Tokens are capabilities: the registry never logs them.
    """

    def __init__(self, client_id: str | None = None) -> None:
        self.client_id = client_id or f"py-{os.getpid()}-{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, int], tuple[Allocation, str]] = {}
        self._generation = 0

    @property
    def generation(self) -> int:
        """Count of changes (``add``, ``clear``): tokens read at one value are current while
        it stays the same."""
        return self._generation

    def token(self, allocation: Allocation) -> str | None:
        """The token of ``allocation``, or ``None`` when it is not registered."""
        with self._lock:
            entry = self._tokens.get((allocation.device_uuid, allocation.buffer_id))
        return None if entry is None else entry[1]

    def add(self, allocation: Allocation, token: str) -> list[str]:
        """Remember ``token`` for ``allocation``; returns tokens of stale registrations.

        A registered allocation that overlaps the new one on the same device was freed by the
        caller's allocator (its address range was reused); its token is dropped here and
        returned so that the client can unregister it and release the server's mapping.
        """
        stale = []
        end = allocation.base_pointer + allocation.byte_size
        with self._lock:
            for key, (old, old_token) in list(self._tokens.items()):
                if old.device_uuid != allocation.device_uuid:
                    continue
                old_end = old.base_pointer + old.byte_size
                if old.base_pointer < end and allocation.base_pointer < old_end:
                    del self._tokens[key]
                    stale.append(old_token)
            self._tokens[(allocation.device_uuid, allocation.buffer_id)] = (allocation, token)
            self._generation += 1
        return stale

    def clear(self) -> list[str]:
        """Forget every registration (after a server restart); returns their tokens."""
        with self._lock:
            tokens = [token for _, token in self._tokens.values()]
            self._tokens.clear()
            self._generation += 1
        return tokens

    def __len__(self) -> int:
        with self._lock:
            return len(self._tokens)


class RequestRefs:
    """How the tensors of one request travel: a reference each where possible.

    Parameters
    ----------
    registry : MemoryRegistry
        The client's registrations.
    transport : {"ipc", "auto"}
        ``"ipc"`` raises ``ExportError`` for a tensor that cannot be exported; ``"auto"`` sends
        it inline.
    server_device_uuid : str
        The server's GPU; tensors on another GPU cannot be referenced.
    cache : AllocationCache, optional
        Where allocations are looked up (the client's, shared by its requests); by default a
        fresh one.
    """

    def __init__(
        self,
        registry: MemoryRegistry,
        transport: TensorTransport,
        server_device_uuid: str,
        cache: AllocationCache | None = None,
    ) -> None:
        self._registry = registry
        self._transport = transport
        self._server_uuid = server_device_uuid
        self._cache = cache if cache is not None else AllocationCache()
        self._confirmed: list[Allocation] = []
        self._where: dict[int, tuple[Allocation, int]] = {}
        self._devices: set[int] = set()
        self._tokens: dict[int, str] = {}  # buffer id -> token, once registered
        self._probes: list[tuple[int, int, int]] = []

    def add(self, tensors: Iterable[tuple[str, torch.Tensor | None]]) -> None:
        """Locate each ``(field, tensor)``; tensors that cannot be exported stay inline (auto).

        Raises
        ------
        ExportError
            With ``transport="ipc"``, a tensor that cannot be exported or lives on another GPU
            than the server's.
        """
        for field, tensor in tensors:
            if tensor is None or tensor.numel() == 0:
                continue
            try:
                allocation, offset = self._cache.find(tensor, field, self._confirmed)
                if allocation.device_uuid != self._server_uuid:
                    raise ExportError(
                        f"{field}: the tensor is on {allocation.device_uuid}, the server on "
                        f"{self._server_uuid}; CUDA IPC references need the server's GPU"
                    )
            except ExportError:
                if self._transport == "ipc":
                    raise
                continue
            if allocation not in self._confirmed:
                self._confirmed.append(allocation)
                index = tensor.device.index or 0
                self._probes.append((tensor.data_ptr(), index, allocation.buffer_id))
            self._where[id(tensor)] = (allocation, offset)
            self._devices.add(tensor.device.index or 0)

    def is_ref(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` travels by reference."""
        return id(tensor) in self._where

    def covers(self, tensors: Iterable[tuple[str, torch.Tensor | None]]) -> bool:
        """Whether every non-empty tensor of ``tensors`` travels by reference."""
        return all(t is None or t.numel() == 0 or self.is_ref(t) for _, t in tensors)

    @property
    def probes(self) -> tuple[tuple[int, int, int], ...]:
        """``(pointer, device_index, buffer_id)`` per allocation of the request: a tensor's
        address in it, its device, and the allocation's buffer id when it was located."""
        return tuple(self._probes)

    @property
    def device_indices(self) -> set[int]:
        """CUDA devices (by this process's ordinal) of the referenced tensors."""
        return set(self._devices)

    def missing(self) -> list[Allocation]:
        """Allocations of this request not yet registered, each once."""
        seen: dict[int, Allocation] = {}
        for allocation in self._confirmed:
            if allocation.buffer_id in self._tokens or allocation.buffer_id in seen:
                continue
            token = self._registry.token(allocation)
            if token is None:
                seen[allocation.buffer_id] = allocation
            else:
                self._tokens[allocation.buffer_id] = token
        return list(seen.values())

    def where(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        """``(region_token, offset_bytes)`` of ``tensor``, or ``None`` to send it inline."""
        located = self._where.get(id(tensor))
        if located is None:
            return None
        allocation, offset = located
        token = self._tokens.get(allocation.buffer_id)
        if token is None:
            token = self._registry.token(allocation)
            if token is None:
                raise RuntimeError("RequestRefs.where: register missing() allocations first")
            self._tokens[allocation.buffer_id] = token
        return token, offset

    def ref_for(self, tensor: torch.Tensor) -> tensor_pb2.TensorRef | None:
        """The wire reference of ``tensor``, or ``None`` to send it inline."""
        located = self.where(tensor)
        if located is None:
            return None
        return tensor_pb2.TensorRef(region_token=located[0], offset_bytes=located[1])


@dataclass(frozen=True)
class MemoEntry:
    """A by-reference request as built, with what it was built from."""

    request: Any
    """The request message (``BuildTreeRequest``, ``AcceptTreeRequest``)."""
    refs: RequestRefs
    """The references it was built from (their devices order the inputs)."""
    use_outputs: bool
    """Whether the server writes the results into the caller's destinations."""
    generation: int
    """``MemoryRegistry.generation`` read before the references' tokens were."""


class RequestMemo:
    """The last few by-reference requests of one client, reused while they still hold.

    A caller with static buffers sends the same request, byte for byte, call after call: the
    same tensors at the same addresses, the same scalars. The memo keeps the last
    ``max_entries`` requests under a key of the RPC, every tensor's ``(data_ptr, shape, stride,
    dtype, device)`` and every scalar argument, so that such a call skips locating its tensors
    and building its message. A key alone is not enough: after torch frees memory
    (``torch.cuda.empty_cache()``) a new ``cudaMalloc`` may return the same address, and the
    registry's tokens change when the client registers or forgets memory. So ``get`` returns an
    entry only when the registry's generation is the one the entry was built at (every token in
    the request is still current) and, per allocation of the request, the driver still reports
    the buffer id the allocation had (one driver call each, as ``AllocationCache.find``; buffer
    ids are never reused, so a freed-and-reallocated range misses). Only requests whose every
    tensor travels by reference belong here: inline bytes would be stale.

    Parameters
    ----------
    registry : MemoryRegistry
        The client's registrations.
    max_entries : int
        Requests kept; the least recently used is dropped past it.
    buffer_id : callable, optional
        ``(pointer, device_index, field) -> int``; by default ``query_buffer_id``. Tests pass a
        fake driver.

    Notes
    -----
    Thread-safe. Entries hold no tensors, so the memo keeps no caller memory alive.
    """

    def __init__(
        self,
        registry: MemoryRegistry,
        max_entries: int = 8,
        *,
        buffer_id: Callable[[int, int, str], int] | None = None,
    ) -> None:
        self.max_entries = max_entries
        self.hits = 0
        """Calls that reused a request."""
        self.misses = 0
        """Lookups that found no entry, or one that no longer holds."""
        self._registry = registry
        self._buffer_id = buffer_id or query_buffer_id
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, MemoEntry] = OrderedDict()

    def get(self, key: Hashable) -> MemoEntry | None:
        """The entry of ``key`` if it still holds (see the class), else ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is not None and self._holds(entry):
            with self._lock:
                self.hits += 1
            return entry
        with self._lock:
            self.misses += 1
            if entry is not None and self._entries.get(key) is entry:
                del self._entries[key]
        return None

    def _holds(self, entry: MemoEntry) -> bool:
        if entry.generation != self._registry.generation:
            return False
        for pointer, device_index, buffer_id in entry.refs.probes:
            try:
                if self._buffer_id(pointer, device_index, "memo") != buffer_id:
                    return False
            except ExportError:
                return False
        return True

    def put(
        self,
        key: Hashable,
        request: Any,
        refs: RequestRefs,
        use_outputs: bool,
        generation: int,
    ) -> None:
        """Remember ``request``, built from ``refs`` with tokens read at ``generation``."""
        with self._lock:
            self._entries[key] = MemoEntry(request, refs, use_outputs, generation)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class ClientIpc:
    """The CUDA IPC side of one remote client: its registry, the server's GPU, input ordering.

    Parameters
    ----------
    transport : {"ipc", "auto"}
        See ``TensorTransport``.
    client_id : str, optional
        Sent with registrations (``MemoryRegistry``).
    use_ipc_events : bool
        Order inputs with an interprocess CUDA event recorded on the current stream, which the
        server's stream waits on; ``False`` synchronises the current stream on the host instead.

    Raises
    ------
    ImportError
        cuda-python is missing (the ``cuda`` extra).
    """

    def __init__(
        self, transport: TensorTransport, client_id: str | None, use_ipc_events: bool
    ) -> None:
        if transport not in ("ipc", "auto"):
            raise ValueError(f"tensor_transport: expected 'ipc' or 'auto', got {transport!r}")
        require_cuda_python()
        self.transport: TensorTransport = transport
        self.registry = MemoryRegistry(client_id)
        self.allocations = AllocationCache()
        """Allocations this client located, checked per call by buffer id."""
        self.memo = RequestMemo(self.registry)
        """The client's last by-reference requests, reused by calls with the same buffers."""
        self.use_ipc_events = use_ipc_events
        self.server_uuid: str | None = None
        self.server_supports_refs = False
        self._events: dict[int, torch.cuda.Event] = {}
        self._event_handles: dict[int, bytes] = {}

    @property
    def knows_server(self) -> bool:
        """Whether ``set_server`` has run since the last ``forget_server``."""
        return self.server_uuid is not None

    def set_server(self, supports_memory_references: bool, device_uuids: Iterable[str]) -> None:
        """Record what GetServerInfo said: reference support and the server's GPU."""
        uuids = list(device_uuids)
        self.server_supports_refs = supports_memory_references and bool(uuids)
        self.server_uuid = uuids[0] if uuids else ""

    def forget_server(self) -> list[str]:
        """The server forgot our regions (restart): drop every token, every memoized request
        and the server's facts."""
        self.server_uuid = None
        self.memo.clear()
        return self.registry.clear()

    def refs(self, tensors: Iterable[tuple[str, torch.Tensor | None]]) -> RequestRefs | None:
        """References for a request's tensors; ``None`` to send everything inline (auto).

        Raises
        ------
        ExportError
            ``transport="ipc"`` and a tensor cannot be exported, or the server has no registered
            memory support.
        """
        if not self.server_supports_refs:
            if self.transport == "ipc":
                raise ExportError(
                    "tensor_transport='ipc' but the server does not support memory references "
                    "(it runs on the CPU or without cuda-python); use 'auto' or 'inline'"
                )
            return None
        refs = RequestRefs(self.registry, self.transport, self.server_uuid or "", self.allocations)
        refs.add(tensors)
        return refs

    def register_request(self, allocation: Allocation) -> pb.RegisterMemoryRequest:
        """The RegisterMemory request of ``allocation`` (exports its IPC handle)."""
        handle = ipc_mem_handle(allocation, _device_index(allocation.device_uuid))
        return pb.RegisterMemoryRequest(
            ipc_handle=handle,
            device_uuid=allocation.device_uuid,
            byte_size=allocation.byte_size,
            client_id=self.registry.client_id,
        )

    @staticmethod
    def uses(refs: RequestRefs | None, outputs: Iterable[torch.Tensor]) -> bool:
        """Whether every output destination travels by reference (else results come inline)."""
        outputs = list(outputs)
        return refs is not None and bool(outputs) and all(refs.is_ref(t) for t in outputs)

    def order_inputs(self, refs: RequestRefs | None) -> bytes:
        """Make the referenced tensors' pending writes visible to the server.

        Returns the IPC event handle to send (``use_ipc_events``), else ``b""`` after
        synchronising the current stream of the tensors' device.
        """
        if refs is None:
            return b""
        handle = b""
        for index in refs.device_indices:
            if not self.use_ipc_events:
                _synchronize_current_stream(index)
                continue
            stream = torch.cuda.current_stream(index)
            event = self._events.get(index)
            if event is None:
                with torch.cuda.device(index):
                    event = torch.cuda.Event(interprocess=True)
                self._events[index] = event
            event.record(stream)
            if index not in self._event_handles:
                self._event_handles[index] = bytes(event.ipc_handle())
            handle = self._event_handles[index]
        return handle


def _synchronize_current_stream(index: int) -> None:
    """Wait for the work queued so far on the current stream of CUDA device ``index``.

    ``torch.cuda.current_stream(index).synchronize()`` makes a ``Stream`` object first: on the
    H200 host, after a millisecond of idle, it took 39 us against 23 us for the stream's raw
    handle and one driver call (12 against 7 us hot). The driver call is made only with device
    ``index`` current (the handle of the default stream names the current context's); where it
    fails (no context current on this thread yet, or a device error) torch's way takes over,
    and raises what it raises.
    """
    if torch._C._cuda_getDevice() == index:  # torch.cuda.current_device(), CUDA initialised
        synchronize, success = _stream_synchronize()
        (err,) = synchronize(torch._C._cuda_getCurrentRawStream(index))
        if err == success:
            return
    torch.cuda.current_stream(index).synchronize()


@functools.cache
def _stream_synchronize() -> tuple[Callable[[int], tuple[Any]], object]:
    """``cuStreamSynchronize`` and the result that means success, looked up once."""
    driver = require_cuda_python()
    return driver.cuStreamSynchronize, driver.CUresult.CUDA_SUCCESS


@functools.cache
def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise ExportError(f"no visible CUDA device has UUID {uuid}")
