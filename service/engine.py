"""The engine: owns the device, runs the ops of ``ddtree.kernels`` and turns bad data into errors.

No gRPC here. Ops run on one dedicated worker thread per device, so blocking device waits
(the error-flag check, device-to-host copies of results) never block the caller's event loop;
the typed methods return ``concurrent.futures.Future`` objects (``.result()`` for synchronous
callers, ``asyncio.wrap_future`` for asynchronous ones). Cancelling a future before its work
started drops the work. A caller may ask for an op to run on its own thread instead
(``inline=True``): it does when the device is free, ``Engine.inline_ops`` is on (CUDA) and the
call waits on no caller IPC event, and the op's outcome comes back ``Completed`` (read like a
done future; ``Outcome`` is either). Two thread hops cost more
than the short device wait they would spare the caller; the servicer asks for it when a call
is the only one in flight.

Two seams for instrumentation: an ``EngineObserver`` (implemented by ``ddtree.service.metrics``)
is told about every op (``time_op`` wraps the launch, ``observe_*`` get the results), and
``_launch_op`` is the one place every op passes through.

A build into caller memory (registered regions) is written by the kernels all or nothing and,
when the same buffers come back, replayed from a CUDA graph (``ddtree.service.replay``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import platform
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar, Union, cast

import torch

import ddtree
from ddtree import kernels
from ddtree.kernels.backend import Backend, resolve_backend
from ddtree.kernels.types import (
    ACCEPTANCE_FIELDS,
    MAX_BUDGET,
    MAX_DRAFT_LEN,
    TREE_FIELDS,
    Acceptance,
    ErrorFlag,
    Tree,
)
from ddtree.service.calls import (
    AcceptTreeCall,
    AcceptTreeResult,
    BuildTreeCall,
    CallLimits,
    KvCommitArgs,
    VerifyAttentionCall,
    validate_accept_tree,
    validate_build_tree,
    validate_verify_attention,
)
from ddtree.service.channel import ChannelLimits, ChannelsUnsupported, ChannelTable
from ddtree.service.errors import (
    DeadlineExceeded,
    Internal,
    InvalidAcceptance,
    InvalidArgument,
    InvalidBlockTable,
    InvalidLength,
    InvalidToken,
    InvalidTree,
    MemoryRegistrationUnsupported,
    MemoryTokenNotFound,
    OutOfMemory,
    ShuttingDown,
    WarmingUp,
)
from ddtree.service.memory import (
    CudaIpcMapper,
    EventWaiter,
    IpcMapper,
    Leases,
    MemoryLimits,
    RegionInfo,
    RegionTable,
    device_bytes,
)
from ddtree.service.replay import LaunchGraphs, LaunchKey

__all__ = ["Completed", "DeviceInfo", "Engine", "EngineInfo", "EngineObserver", "Outcome"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_Call = TypeVar("_Call", BuildTreeCall, AcceptTreeCall, VerifyAttentionCall)

# Which request field each error flag blames, per op, in the order they are reported.
_FLAG_FIELDS: dict[str, tuple[tuple[ErrorFlag, type[InvalidArgument], str, str], ...]] = {
    "build_tree": (
        (ErrorFlag.TOKEN, InvalidToken, "root_tokens", "token id outside [0, vocab_size)"),
    ),
    "accept": (
        (ErrorFlag.TREE, InvalidTree, "tree", "malformed tree (num_nodes, parents or depths)"),
        (ErrorFlag.TOKEN, InvalidToken, "target_tokens", "negative or out-of-range token id"),
        (ErrorFlag.ACCEPTANCE, InvalidAcceptance, "tree", "accepted path is malformed"),
    ),
    "commit_kv": (
        (
            ErrorFlag.BLOCK_TABLE,
            InvalidBlockTable,
            "kv_commit.block_table",
            "block-table entry outside [0, num_pages)",
        ),
        (
            ErrorFlag.LENGTH,
            InvalidLength,
            "kv_commit.prefix_lens",
            "prefix length negative or prefix plus path past the block table",
        ),
        (ErrorFlag.ACCEPTANCE, InvalidAcceptance, "tree", "accepted path is malformed"),
    ),
    "verify_attention": (
        (
            ErrorFlag.BLOCK_TABLE,
            InvalidBlockTable,
            "block_table",
            "block-table entry outside [0, num_pages)",
        ),
        (
            ErrorFlag.LENGTH,
            InvalidLength,
            "prefix_lens",
            "prefix length negative or prefix plus tree past the block table",
        ),
        (ErrorFlag.TREE, InvalidTree, "tree", "malformed tree (num_nodes, parents or depths)"),
    ),
}
_RPC_OF_OP = {
    "build_tree": "build_tree",
    "accept": "accept_tree",
    "commit_kv": "accept_tree",
    "verify_attention": "verify_attention",
}


class EngineObserver(Protocol):
    """What the engine reports about its ops (``ddtree.service.metrics.Metrics`` fits)."""

    def time_op(
        self, op: str, device: torch.device, stream: torch.cuda.Stream | None = None
    ) -> AbstractContextManager[None]:
        """Wrap the launch of ``op`` (``build_tree``, ``accept``, ``commit_kv``,
        ``verify_attention``) on ``device``, queued on ``stream`` (``None``: the device's
        current stream); called on the thread that runs the op."""
        ...

    def observe_device_time(self, op: str, device: torch.device, seconds: float) -> None:
        """The device time of an op that timed itself (a replayed build: its CUDA graph
        records its own timing events), instead of ``time_op``."""
        ...

    def observe_trees(self, num_nodes: torch.Tensor, *, model: str = "") -> None:
        """Trees built by one call: ``Tree.num_nodes``, shape ``(batch_size,)`` int32."""
        ...

    def observe_acceptance(
        self,
        nodes: torch.Tensor,
        length: torch.Tensor,
        num_nodes: torch.Tensor,
        *,
        model: str = "",
    ) -> None:
        """Walks of one call: ``Acceptance.nodes``, ``Acceptance.length``, ``Tree.num_nodes``."""
        ...


_NO_TIMER: AbstractContextManager[None] = contextlib.nullcontext()
"""The ``with`` block of an op that is not timed (stateless, so one serves every op)."""
_NO_EVENT = (b"", "")
"""The ``wait_event`` of a call without a caller IPC event: ``(handle, field)``."""


class _NullObserver:
    """Observer that records nothing."""

    def time_op(
        self, op: str, device: torch.device, stream: torch.cuda.Stream | None = None
    ) -> AbstractContextManager[None]:
        return _NO_TIMER

    def observe_device_time(self, op: str, device: torch.device, seconds: float) -> None:
        return None

    def observe_trees(self, num_nodes: torch.Tensor, *, model: str = "") -> None:
        return None

    def observe_acceptance(
        self,
        nodes: torch.Tensor,
        length: torch.Tensor,
        num_nodes: torch.Tensor,
        *,
        model: str = "",
    ) -> None:
        return None


@dataclass(frozen=True)
class DeviceInfo:
    """One device the engine runs ops on."""

    uuid: str
    """GPU UUID (``"GPU-..."``), or ``"cpu"``."""
    name: str
    """Device name (``"NVIDIA H200"``) or the CPU architecture."""
    compute_capability: tuple[int, int]
    """``(major, minor)``; ``(0, 0)`` for the CPU."""
    total_memory_bytes: int
    """Device memory, bytes; 0 for the CPU."""
    backend: str
    """``"cuda"`` or ``"reference"``."""


@dataclass(frozen=True)
class EngineInfo:
    """What ``Engine.info`` reports."""

    version: str
    devices: tuple[DeviceInfo, ...]
    limits: CallLimits
    max_budget: int = MAX_BUDGET
    max_draft_len: int = MAX_DRAFT_LEN
    supports_memory_references: bool = False
    max_channels: int = 0
    """GPU doorbell channels open at once; ``0``: this engine offers none."""


class Completed(Generic[_T]):
    """The outcome of an op that ran on the calling thread (``inline=True``): its result or its
    error, read like a done ``concurrent.futures.Future`` (``done``, ``result``,
    ``exception``).

    A ``Future`` made, settled and read costs a condition variable and three lock round trips:
    2.4 us on the CPU machine, 22-36 us on the H200 host after a millisecond of idle (the state
    a lone call finds the server in).
    """

    __slots__ = ("_error", "_value")

    def __init__(self, value: _T | None = None, *, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    def done(self) -> bool:
        """Always ``True``."""
        return True

    def result(self, timeout: float | None = None) -> _T:
        """The op's result; raises its error. ``timeout`` is ignored (it is done)."""
        if self._error is not None:
            raise self._error
        return cast(_T, self._value)  # set by the op when it has no error

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The op's error, ``None`` when it succeeded."""
        return self._error

    def cancel(self) -> bool:
        """Always ``False``: the op has run."""
        return False


Outcome = Union[Future[_T], Completed[_T]]  # noqa: UP007 (a generic alias, subscripted below)
"""What a data op returns: a ``Future`` from the device worker, or ``Completed`` inline."""


def _supports_graph_timing() -> bool:
    """Whether ``torch.cuda.Event`` can record inside a CUDA graph capture (``external``, in
    recent torch releases); without it a replayed build is timed around its launch."""
    return "external" in inspect.signature(torch.cuda.Event.__new__).parameters


_GRAPHS_TIME_THEMSELVES = _supports_graph_timing()


def _graph_timing_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """A start and an end timing event that a CUDA graph capture records as its own nodes."""
    return (
        torch.cuda.Event(enable_timing=True, external=True),
        torch.cuda.Event(enable_timing=True, external=True),
    )


class _ThreadOwner(threading.local):
    """Per thread: the engine whose device and stream are current on it for good
    (``Engine.own_thread``; the last engine to call it on the thread), if any, and how the
    thread runs work soon (``defer``: the server's event loop's ``call_soon``), if it can."""

    engine: Engine | None = None
    defer: Callable[[Callable[[], None]], object] | None = None


@dataclass(slots=True)
class _Unobserved:
    """What a replayed build leaves for its observer (``Engine._observe``): its graph's timing
    events and the tree sizes in the pinned verdict buffer, both valid until the engine's next
    op (which replays the graph again or writes new flags or sizes there)."""

    op: str
    timing: tuple[torch.cuda.Event, torch.cuda.Event]  # start, end; both done
    model: str
    sizes: torch.Tensor | None = None  # [batch_size] int32, pinned host; None: flagged call


_THREAD_OWNER = _ThreadOwner()


@dataclass(frozen=True, slots=True)
class _FlagViews:
    """An engine's verdict buffers seen at one batch size (``Engine._flag_rows``)."""

    flags: torch.Tensor  # [batch_size] int32, device: the ops' error_flags
    host_flags: torch.Tensor | None  # [batch_size] int32, pinned host (CUDA only)
    host_sizes: torch.Tensor | None  # [batch_size] int32, pinned host (CUDA only)
    verdict: torch.Tensor | None
    """``[2 * batch_size]`` int32: ``host_flags`` then ``host_sizes``, as a CUDA tensor over the
    pinned memory (CUDA only), where a replayed build's graph writes both with one kernel."""
    pointers: tuple[int, int]  # addresses of ``flags`` and ``verdict``, for replay keys


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (pinned by torch, contiguous) as a tensor of the CUDA ``device`` over the same
    memory, at the same address; it owns nothing.

    Under unified addressing (every 64-bit process) CUDA maps pinned host memory into the
    device's address space at its host address: all of ``cudaHostAlloc``'s (torch's
    ``pin_memory``), and ``cudaHostRegister``'s with the default flags (torch's
    ``pinned_use_cuda_host_register``) on GPUs that can use host pointers for registered
    memory, which every Hopper and Blackwell GPU on x86-64 Linux can.
    """
    pointer, byte_size = host.data_ptr(), host.numel() * host.element_size()
    return device_bytes(pointer, byte_size, device).view(host.dtype)


def _layout(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    """What a kernel launch reads of a tensor: address, shape, strides, dtype."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


def _release(leases: Leases | None) -> None:
    # A call refused before its work is queued never reaches the future's release.
    if leases is not None:
        leases.release()


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} requested but torch sees no CUDA device")
        if resolved.index is None or resolved.index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {device!r} requested but only {torch.cuda.device_count()} "
                "CUDA devices are visible"
            )
    elif resolved.type != "cpu":
        raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda:N', got {device!r}")
    return resolved


def _device_info(device: torch.device, backend: str) -> DeviceInfo:
    if device.type != "cuda":
        return DeviceInfo("cpu", platform.machine() or "cpu", (0, 0), 0, backend)
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo(
        uuid=f"GPU-{props.uuid}",
        name=props.name,
        compute_capability=(props.major, props.minor),
        total_memory_bytes=int(props.total_memory),
        backend=backend,
    )


class Engine:
    """Runs the DDTree ops for callers, on one device, validating every call.

    Parameters
    ----------
    device : str
        ``"auto"`` (first GPU if torch sees one, else the CPU), ``"cpu"`` or ``"cuda:N"``.
    backend : {"auto", "cuda", "reference"}
        Op implementation (see ``ddtree.kernels``).
    limits : CallLimits
        Size limits every call is checked against.
    observer : EngineObserver, optional
        Told about every op (metrics); ``None`` records nothing.
    memory_limits : MemoryLimits, optional
        Bounds on registered caller memory (regions, bytes, idle timeout).
    ipc_mapper : IpcMapper, optional
        Opens caller memory; by default ``CudaIpcMapper`` on a CUDA device (registered memory
        needs cuda-python) and none on the CPU. Tests pass a host-memory mapper to run the
        reference path without a GPU.
    channel_limits : ChannelLimits, optional
        Bounds on GPU doorbell channels (CUDA devices with registered memory only);
        ``max_channels=0`` offers none. Default: ``ChannelLimits`` with the registered-memory
        idle timeout.

    Notes
    -----
    Calls are refused with ``WarmingUp`` until ``warm_up()`` has run and with ``ShuttingDown``
    after ``close()``. Methods are thread-safe.

    Examples
    --------
    >>> engine = Engine(device="cpu")
    >>> engine.warm_up()
    >>> tree = engine.build_tree(BuildTreeCall(logits, roots, 8)).result()  # doctest: +SKIP
    >>> engine.close()
    """

    def __init__(
        self,
        *,
        device: str = "auto",
        backend: str = "auto",
        limits: CallLimits | None = None,
        observer: EngineObserver | None = None,
        memory_limits: MemoryLimits | None = None,
        ipc_mapper: IpcMapper | None = None,
        channel_limits: ChannelLimits | None = None,
    ) -> None:
        self.device = _resolve_device(device)
        self.backend: Backend = resolve_backend(backend, self.device)  # type: ignore[arg-type]
        self.limits = limits or CallLimits()
        self._observer: EngineObserver = observer or _NullObserver()
        self._state_lock = threading.Lock()
        self._is_ready = False
        self._is_closed = False
        self._poisoned_by: str | None = None
        self._info = EngineInfo(
            version=ddtree.__version__,
            devices=(_device_info(self.device, self.backend),),
            limits=self.limits,
        )
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._device_lock = threading.Lock()  # held while an op runs, on whichever thread
        self._flags: tuple[torch.Tensor, torch.Tensor | None] | None = None
        """``[size]`` int32 on the device (``error_flags``) and ``[2 * size]`` int32 pinned on
        the host (their verdict and a replayed build's tree sizes), reused; see
        ``_flag_buffers`` and ``_flag_rows``."""
        self._flag_views: dict[int, _FlagViews] = {}
        self._flags_are_zero = False
        """Whether the whole device flag row is known to be zero (``_flag_buffers``)."""
        self._settled = False
        """Set by an op whose verdict's stream synchronisation was its last device work: the
        call's closing synchronisation (``_run_on_stream``) is then skipped."""
        self._unobserved: _Unobserved | None = None
        """What the last op, a replayed build, left for the observer: handed over before the
        next op starts at the latest (``_observe``; after the reply on the server's loop)."""
        self._graphs: LaunchGraphs[Any] | None = (
            LaunchGraphs(stream=self._stream.cuda_stream) if self._stream is not None else None
        )
        """Captured builds into caller memory, replayed for the same buffers (CUDA only)."""
        self.inline_ops = self.device.type == "cuda"
        """Whether ``inline=True`` calls run on the calling thread when the device is free (on
        by default on CUDA, where an op's host work and device wait take well under a
        millisecond; off on the CPU, whose reference ops can take much longer)."""
        # One worker per device: ops on a device are serialised on its stream anyway, and the
        # worker is where blocking device waits belong. Its current device and stream are set
        # once, when the thread starts, not around every op.
        self._worker = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"ddtree-{self.device}",
            initializer=self.own_thread,
        )
        self.memory: RegionTable | None = None
        """Registered caller memory (CUDA IPC); ``None`` on the CPU or without cuda-python."""
        self._events: EventWaiter | None = None
        self._mapper: IpcMapper | None = None
        self.channels: ChannelTable | None = None
        """GPU doorbell channels (``ddtree.service.channel``); ``None`` without registered
        memory on a CUDA device."""
        if self.device.type == "cuda" or ipc_mapper is not None:
            self._open_memory(memory_limits or MemoryLimits(), ipc_mapper, channel_limits)

    def _open_memory(
        self, limits: MemoryLimits, mapper: IpcMapper | None, channel_limits: ChannelLimits | None
    ) -> None:
        if mapper is None:
            try:
                mapper = CudaIpcMapper(self.device)
            except ImportError as err:
                _log.warning("event=memory_references_off reason=%s", err)
                return
        self._mapper = mapper
        set_registered = getattr(self._observer, "set_registered", None)
        label = str(self.device)

        def on_change(regions: int, byte_size: int) -> None:
            if set_registered is not None:
                set_registered(label, regions=regions, byte_size=byte_size)

        self.memory = RegionTable(
            device=self.device,
            device_uuid=self._info.devices[0].uuid,
            mapper=mapper,
            limits=limits,
            on_change=on_change,
        )
        self._events = EventWaiter(mapper)
        self._info = replace(self._info, supports_memory_references=True)
        channel_limits = channel_limits or ChannelLimits(idle_timeout_s=limits.idle_timeout_s)
        if self.device.type == "cuda" and channel_limits.max_channels > 0:
            self.channels = ChannelTable(self.memory, channel_limits, self._observer)
            self._info = replace(self._info, max_channels=channel_limits.max_channels)

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_ready(self) -> bool:
        """Whether warm-up finished and the engine is not closed."""
        return self._is_ready and not self._is_closed

    @property
    def is_poisoned(self) -> bool:
        """Whether a device error left the CUDA context unusable (the process must restart)."""
        return self._poisoned_by is not None

    def info(self) -> EngineInfo:
        """Version, devices and limits of this engine."""
        return self._info

    def warm_up(self) -> None:
        """Run every op once on tiny inputs (compiling kernels if needed), then accept calls.

        Blocks until done. Idempotent.

        Raises
        ------
        ShuttingDown
            The engine is closed.
        """
        if self._is_closed:
            raise ShuttingDown("engine: closed, cannot warm up")
        future = self._worker.submit(self._warm_up_on_worker)
        future.result()
        with self._state_lock:
            self._is_ready = not self._is_closed
        _log.info("event=warm_up_done device=%s backend=%s", self.device, self.backend)

    def _warm_up_on_worker(self) -> None:
        # Under the device lock like every op (they share the flag buffers); warming up again
        # while serving only queues the inline calls behind it.
        with self._device_lock:
            if self._unobserved is not None:
                self._observe()
            self._warm_up_ops()

    def _warm_up_ops(self) -> None:
        # Tiny inputs through every op: compiles (or loads) the kernels and proves they run.
        backend = self.backend
        device = self.device
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(1, 2, 8, generator=generator).to(device)
        roots = torch.zeros(1, dtype=torch.int64, device=device)

        def build(flags: torch.Tensor) -> Tree:
            return kernels.build_tree(logits, roots, 3, error_flags=flags, backend=backend)

        tree = self._run_op("build_tree", build, observe=False)
        targets = torch.zeros(1, tree.num_nodes_max, dtype=torch.int64, device=device)

        def walk(flags: torch.Tensor) -> Acceptance:
            return kernels.accept(tree, targets, error_flags=flags, backend=backend)

        acceptance = self._run_op("accept", walk, observe=False)
        head_dim = 64
        cache = torch.zeros(2, 4, head_dim, dtype=torch.bfloat16, device=device)
        table = torch.tensor([[0, 1]], dtype=torch.int32, device=device)
        lens = torch.zeros(1, dtype=torch.int32, device=device)

        def commit(flags: torch.Tensor) -> None:
            kernels.commit_kv(cache, table, lens, acceptance, error_flags=flags, backend=backend)

        self._run_op("commit_kv", commit, observe=False)
        q = torch.zeros(1, tree.num_nodes_max, 1, head_dim, dtype=torch.bfloat16, device=device)

        def attend(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return kernels.verify_attention(
                q, cache, table, lens, tree, v_dim=64, error_flags=flags, backend=backend
            )

        self._run_op("verify_attention", attend, observe=False)

    def close(self) -> None:
        """Refuse new calls, finish queued ones, release the worker and device resources.

        Idempotent; never raises for cleanup problems (they are logged).
        """
        with self._state_lock:
            if self._is_closed:
                return
            self._is_closed = True
        if self.channels is not None:
            self.channels.close_all()
        self._worker.shutdown(wait=True, cancel_futures=False)
        self.observe_pending()
        if self._stream is not None:
            try:
                self._stream.synchronize()
            except RuntimeError as err:
                _log.warning("event=close_sync_failed device=%s error=%s", self.device, err)
        if self._graphs is not None:
            self._graphs.clear()  # their scratch memory; the stream is idle
        if self.memory is not None and self._events is not None and self._mapper is not None:
            self.memory.close()
            self._events.close()
            self._mapper.release()
        _log.info("event=engine_closed device=%s", self.device)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ registered memory

    def register_memory(
        self, ipc_handle: bytes, device_uuid: str, byte_size: int, client_id: str, owner: str = ""
    ) -> Future[tuple[str, RegionInfo]]:
        """Map a caller's CUDA IPC allocation; the future gives ``(token, region)``.

        The driver calls run on the device worker. See ``RegionTable.register`` for the
        parameters (``owner``: the caller's identity as the server derived it, ``""``
        in-process) and the errors (raised through the future).

        Raises
        ------
        MemoryRegistrationUnsupported
            This engine has no registered memory (CPU device or no cuda-python).
        ShuttingDown
            The engine is closed.
        """
        memory = self._require_memory()
        return self._submit(
            None, lambda: memory.register(ipc_handle, device_uuid, byte_size, client_id, owner)
        )

    def unregister_memory(self, token: str, owner: str = "") -> RegionInfo:
        """Forget a region of ``owner``; its mapping closes when the calls using it end.

        Raises
        ------
        MemoryTokenNotFound
            Unknown or expired token, another owner's region (identity-bound regions), and
            always on an engine without registered memory.
        """
        if self.memory is None:
            raise MemoryTokenNotFound(
                "unregister_memory.region_token: unknown region token",
                field="unregister_memory.region_token",
            )
        return self.memory.unregister(token, owner)

    def list_memory(self, client_id: str, owner: str = "") -> list[RegionInfo]:
        """Regions registered with ``client_id`` that ``owner`` may see (identity-bound regions:
        only its own); none on an engine without registered memory."""
        if self.memory is None:
            return []
        return self.memory.list(client_id, owner)

    def require_channels(self) -> ChannelTable:
        """The channel table, or ``ChannelsUnsupported`` (no CUDA device or no registered
        memory), or ``ShuttingDown``/``WarmingUp`` when calls are refused."""
        self._check_state()
        if self.channels is None:
            raise ChannelsUnsupported(
                f"open_channel: channels need a CUDA server with registered memory; this one runs "
                f"on {self.device}"
            )
        return self.channels

    def _require_memory(self) -> RegionTable:
        if self._is_closed:
            raise ShuttingDown("engine: shutting down, register with another replica")
        if self.memory is None:
            raise MemoryRegistrationUnsupported(
                "register_memory: this server does not support registered memory (it runs on "
                f"{self.device}{'' if self.device.type == 'cpu' else ' without cuda-python'}); "
                "send tensors inline (GetServerInfo.supports_memory_references is false)"
            )
        return self.memory

    # ------------------------------------------------------------------ ops

    def build_tree(self, call: BuildTreeCall, *, inline: bool = False) -> Outcome[Tree]:
        """Build the draft trees of ``call`` (see ``ddtree.kernels.build_tree``).

        Parameters
        ----------
        call : BuildTreeCall
            The decoded call.
        inline : bool
            Run on this thread when the device is free and the call waits on no IPC event
            (see ``inline_ops``); the outcome is then ``Completed``.

        Raises
        ------
        InvalidArgument
            Synchronously for bad shapes, dtypes and ranges; through the outcome for token ids
            out of range (``InvalidToken``, naming the request index).
        WarmingUp, ShuttingDown
            The engine is not ready or closed.
        """
        return self._submit_call(
            call, validate_build_tree, lambda: self._build_tree(call), "build_tree", inline
        )

    def accept_tree(
        self, call: AcceptTreeCall, *, inline: bool = False
    ) -> Outcome[AcceptTreeResult]:
        """Walk the trees of ``call`` and optionally commit the KV cache in place.

        All or nothing: the commit moves nothing unless every request's walk succeeded and every
        request's commit data (block table, prefix length) holds; a bad request fails the call.
        It follows the walk on the stream with no wait for the walk's verdict. Into caller
        memory (``call.out``) the walk writes nothing either when a request fails, and a
        repeated greedy call with the same buffers is replayed from CUDA graphs.

        Parameters
        ----------
        call : AcceptTreeCall
            The decoded call.
        inline : bool
            Run on this thread when the device is free (see ``inline_ops``).

        Raises
        ------
        InvalidArgument
            Synchronously for bad shapes, dtypes and ranges; through the outcome for bad data in
            the tensors (naming the field and request index).
        WarmingUp, ShuttingDown
            The engine is not ready or closed.
        """
        return self._submit_call(
            call, validate_accept_tree, lambda: self._accept_tree(call), "accept_tree", inline
        )

    def verify_attention(
        self, call: VerifyAttentionCall, *, inline: bool = False
    ) -> Outcome[tuple[torch.Tensor, torch.Tensor]]:
        """Tree-masked paged attention of ``call``: ``(out, lse)``.

        Parameters
        ----------
        call : VerifyAttentionCall
            The decoded call.
        inline : bool
            Run on this thread when the device is free (see ``inline_ops``).

        Raises
        ------
        InvalidArgument
            Synchronously for bad shapes, dtypes and ranges; through the outcome for bad block
            tables or lengths (naming the field and request index).
        WarmingUp, ShuttingDown
            The engine is not ready or closed.
        """
        return self._submit_call(
            call,
            validate_verify_attention,
            lambda: self._verify_attention(call),
            "verify_attention",
            inline,
        )

    # ------------------------------------------------------------------ internals

    def _check_state(self) -> None:
        if self._is_closed or self._poisoned_by is not None:
            raise ShuttingDown("engine: shutting down, send the call to another replica")
        if not self._is_ready:
            raise WarmingUp("engine: kernels are warming up, retry shortly")

    def _validate(self, call: _Call, validate: Callable[[_Call, CallLimits], None]) -> None:
        """``validate(call, self.limits)``, once per decoded call that the servicer reuses.

        A reused call (``call.prepared``, shared by its copies) has the tensors and scalars it
        had when it passed: it passes again, so only the first copy is checked.
        """
        prepared = call.prepared
        if prepared is not None and prepared.validated_for is self.limits:
            return
        validate(call, self.limits)
        if prepared is not None:
            prepared.validated_for = self.limits

    def _submit_call(
        self,
        call: _Call,
        validate: Callable[[_Call, CallLimits], None],
        work: Callable[[], _T],
        op: str,
        inline: bool,
    ) -> Outcome[_T]:
        """A data call's checks (engine state, ``validate``), then ``work`` with the call's
        deadline, leases and IPC event (``op``.wait_event_ipc_handle names it in errors): run
        here (``inline``, see ``inline_ops``) or queued on the device worker. The leases are
        released here when the call is refused before it runs or is queued."""
        leases = call.leases
        try:
            self._check_state()
            self._validate(call, validate)
            handle = call.wait_event_ipc_handle
            touches_caller_memory = bool(leases) or bool(handle)
            # A call that waits on the caller's IPC event never runs inline: the caller's
            # stream, not this engine's work, decides how long that wait blocks this thread.
            if (
                inline
                and not handle
                and self.inline_ops
                and self._device_lock.acquire(blocking=False)
            ):
                return self._run_inline(call.deadline_s, work, touches_caller_memory, leases)
            wait_event = (handle, f"{op}.wait_event_ipc_handle") if handle else _NO_EVENT
            return self._submit(
                call.deadline_s,
                work,
                leases=leases,
                touches_caller_memory=touches_caller_memory,
                wait_event=wait_event,
            )
        except BaseException:
            _release(leases)
            raise

    def _run_inline(
        self,
        deadline_s: float | None,
        work: Callable[[], _T],
        touches_caller_memory: bool,
        leases: Leases | None,
    ) -> Completed[_T]:
        """``work`` on this thread, the device lock already taken (released here, with the
        leases); its result or error comes back as a ``Completed``."""
        outcome: Completed[_T]
        try:
            if _THREAD_OWNER.engine is self:
                result = self._run_checked(deadline_s, work, touches_caller_memory, _NO_EVENT)
            else:
                result = self._on_stream(
                    lambda: self._run_checked(deadline_s, work, touches_caller_memory, _NO_EVENT)
                )
        except BaseException as err:  # delivered like the worker's: through the outcome
            outcome = Completed(error=err)
        else:
            outcome = Completed(result)
        finally:
            self._device_lock.release()
        owner = _THREAD_OWNER
        if owner.engine is not self or owner.defer is None:
            self._after_reply(leases)
        elif leases is not None or self._unobserved is not None:
            try:
                owner.defer(functools.partial(self._after_reply, leases))
            except RuntimeError:  # the loop is closing: no later turn will come
                self._after_reply(leases)
        return outcome

    def _after_reply(self, leases: Leases | None) -> None:
        """An inline op's bookkeeping, which its result does not wait for: its leases end (its
        device work is complete) and its observations are handed over (``observe_pending``).
        Run by the owning thread's ``defer`` after the reply has gone (see ``own_thread``),
        else at once."""
        _release(leases)
        if self._unobserved is not None:
            self.observe_pending()

    def _submit(
        self,
        deadline_s: float | None,
        work: Callable[[], _T],
        *,
        leases: Leases | None = None,
        touches_caller_memory: bool = False,
        wait_event: tuple[bytes, str] = _NO_EVENT,
    ) -> Future[_T]:
        """Queue ``work`` on the device worker.

        With caller memory in the call (``touches_caller_memory``: registered regions, held by
        ``leases``, or an IPC event), the stream first waits on the caller's IPC event (if any,
        ``(handle, field)``), and the work ends with a stream synchronisation, so every read and
        write of caller memory is complete before the future resolves; the leases are released
        when the future is done (also when it is cancelled before running).
        """
        try:
            future = self._worker.submit(
                self._run_locked, deadline_s, work, touches_caller_memory, wait_event
            )
        except RuntimeError as err:  # the executor was shut down between check and submit
            raise ShuttingDown("engine: shutting down, send the call to another replica") from err
        if leases is not None:
            future.add_done_callback(lambda _: leases.release())
        return future

    def _run_locked(
        self,
        deadline_s: float | None,
        work: Callable[[], _T],
        touches_caller_memory: bool,
        wait_event: tuple[bytes, str],
    ) -> _T:
        # On the device worker.
        with self._device_lock:
            try:
                return self._run_checked(deadline_s, work, touches_caller_memory, wait_event)
            finally:
                if self._unobserved is not None:
                    self._observe()

    def _run_checked(
        self,
        deadline_s: float | None,
        work: Callable[[], _T],
        touches_caller_memory: bool,
        wait_event: tuple[bytes, str],
    ) -> _T:
        """``work()`` under the device lock, on this engine's stream: the deadline and engine
        state checked first, device errors mapped (a device failure poisons the engine). The
        observations the previous op left are handed over first."""
        if self._unobserved is not None:
            self._observe()
        if deadline_s is not None and time.monotonic() > deadline_s:
            raise DeadlineExceeded("deadline passed while the call waited for the device")
        if self._poisoned_by is not None:
            raise ShuttingDown("engine: the device failed earlier, the server is restarting")
        try:
            return self._run_on_stream(work, touches_caller_memory, wait_event)
        except torch.OutOfMemoryError as err:
            raise OutOfMemory(f"device {self.device} is out of memory: {err}") from err
        except torch.AcceleratorError as err:
            # A device error is sticky: the CUDA context is unusable from here on.
            self._poisoned_by = str(err)
            _log.error("event=device_failed device=%s error=%s", self.device, err)
            raise Internal(
                f"device {self.device} failed; this server instance stops serving"
            ) from err

    def _run_on_stream(
        self, work: Callable[[], _T], touches_caller_memory: bool, wait_event: tuple[bytes, str]
    ) -> _T:
        """``work()`` after the stream's wait on the caller's IPC event (if any); a call that
        touches caller memory (registered regions or an event) ends with its stream idle."""
        handle, field = wait_event
        if handle and self._events is not None and self._stream is not None:
            self._events.wait(handle, self._stream.cuda_stream, field)
        self._settled = False
        try:
            return work()
        finally:
            # Also on errors: no launched read or write of caller memory may outlive the
            # call (its leases end with it). An op that ended with its verdict's
            # synchronisation and queued nothing after it says so (``_settled``).
            if touches_caller_memory and self._stream is not None and not self._settled:
                self._stream.synchronize()

    def own_thread(self, defer: Callable[[Callable[[], None]], object] | None = None) -> None:
        """Make this engine's device and stream current on the calling thread for good.

        Inline ops (``inline=True``) on such a thread skip switching to the engine's stream
        and back (four torch calls, 7 us per op on the H200 host when hot, about 29 us after
        a millisecond of idle). For a thread that queues no other CUDA work without naming
        its stream: the server's event loop, and the device worker (which every engine owns).
        A thread has one owner: another engine that takes it over makes this one switch and
        restore streams there again.

        ``defer`` runs a function soon on this thread (the server passes its event loop's
        ``call_soon``): an inline op's bookkeeping (the end of its leases, a replayed build's
        device time and tree sizes for the observer) then runs after the call's reply has gone
        out, not before it. Its device work is complete either way.
        """
        if self._stream is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self._stream)
        _THREAD_OWNER.engine = self
        _THREAD_OWNER.defer = defer

    def observe_pending(self) -> None:
        """Hand what the last op left for the observer (a replayed build's device time and
        tree sizes) to it, if it is still waiting. A no-op while an op runs: every op does it
        before it starts."""
        if self._unobserved is None or not self._device_lock.acquire(blocking=False):
            return
        try:
            if self._unobserved is not None:
                self._observe()
        finally:
            self._device_lock.release()

    def _observe(self) -> None:
        # Under the device lock, before anything replays the graph or copies new tree sizes.
        pending, self._unobserved = self._unobserved, None
        assert pending is not None
        start, end = pending.timing
        try:
            seconds = start.elapsed_time(end) / 1e3
        except RuntimeError as err:  # the device failed since the op's verdict
            _log.warning("event=op_time_unreadable device=%s error=%s", self.device, err)
            return
        self._observer.observe_device_time(pending.op, self.device, seconds)
        if pending.sizes is not None:
            self._observer.observe_trees(pending.sizes, model=pending.model)

    def _on_stream(self, work: Callable[[], _T]) -> _T:
        """``work()`` on this thread with this engine's stream (and with it its device) current,
        restoring the thread's stream after it: an inline op on a thread it does not own.

        ``torch.cuda.stream`` does the same through two current-device lookups that each check
        whether CUDA is available; this reads the current device once, and takes that path
        only when it is another device (whose stream must be restored too).
        """
        stream = self._stream
        if stream is None:
            return work()
        index = stream.device_index
        if torch.cuda.current_device() != index:
            with torch.cuda.stream(stream):
                return work()
        previous = torch.cuda.current_stream(index)
        torch.cuda.set_stream(stream)
        try:
            return work()
        finally:
            torch.cuda.set_stream(previous)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        # A reference into caller memory is already there: two property reads instead of two
        # torch calls (``to`` and ``contiguous`` would return it unchanged).
        if tensor.device == self.device and tensor.is_contiguous():
            return tensor
        return tensor.to(self.device, non_blocking=True).contiguous()

    def _tree_to_device(self, tree: Tree) -> Tree:
        tensors = (
            tree.tokens,
            tree.parents,
            tree.depths,
            tree.log_probs,
            tree.num_nodes,
            tree.mask,
        )
        moved = [self._to_device(tensor) for tensor in tensors]
        if all(new is old for new, old in zip(moved, tensors, strict=True)):
            return tree
        tokens, parents, depths, log_probs, num_nodes, mask = moved
        return replace(
            tree,
            tokens=tokens,
            parents=parents,
            depths=depths,
            log_probs=log_probs,
            num_nodes=num_nodes,
            mask=mask,
        )

    def _run_op(
        self,
        op: str,
        launch: Callable[[torch.Tensor], _T],
        batch_size: int = 1,
        *,
        observe: bool = True,
    ) -> _T:
        """``_launch_op`` followed by ``_check_flags``: launch, wait, raise on a flagged request."""
        result, flags = self._launch_op(op, launch, batch_size, observe=observe)
        self._check_flags(op, flags)
        return result

    def _launch_op(
        self,
        op: str,
        launch: Callable[[torch.Tensor], _T],
        batch_size: int = 1,
        *,
        observe: bool = True,
        continues: bool = False,
        copy_flags: bool = True,
    ) -> tuple[_T, torch.Tensor]:
        """Launch one op with a fresh ``error_flags`` tensor; returns its result and host flags.

        This is the single place every op passes through: the observer times it here (skipped
        for warm-up). On CUDA the flags come back by a non-blocking copy, valid once
        ``_check_flags`` has synchronised the stream; results the caller wants on the host can
        be queued for copying before that, so one synchronisation serves them all.
        ``continues``: the op takes over the flags of the op launched just before it, with no
        verdict between (they are not zeroed; a commit gated on the walk's flags).
        ``copy_flags=False`` skips the host copy, for an op that another one ``continues``.
        """
        flags, host = self._flag_buffers(batch_size)
        if not self._flags_are_zero and not continues:
            # The whole row: a failed op may have flagged requests past this op's batch.
            whole = self._flags
            assert whole is not None  # made by _flag_buffers
            whole[0].zero_()
        self._flags_are_zero = False  # until _check_flags reads this launch's flags back
        timer = self._observer.time_op(op, self.device, self._stream) if observe else _NO_TIMER
        try:
            with timer:
                result = launch(flags)
        except ValueError as err:
            if isinstance(err, InvalidArgument):
                raise
            raise InvalidArgument(f"{_RPC_OF_OP[op]}: {err}") from err
        if host is None:
            return result, flags
        if copy_flags:
            host.copy_(flags, non_blocking=True)
        return result, host

    def _flag_buffers(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``error_flags`` of one op (``[batch_size]`` int32 on the device) and, on CUDA,
        the pinned host buffer its verdict is copied into (``host_flags`` of ``_flag_rows``).

        Both are this engine's, reused by every op: every op (warm-up's too) holds the device
        lock, every use is ordered on the engine's stream (zeroed there before the launch,
        copied there after it), and the host copy is read only after the stream
        synchronisation of ``_check_flags``, before the next op of the call zeroes it again.
        A fresh allocation per op cost a device allocation and a pinned host allocation (whose
        release records an event) each time. The views of each batch size are kept too.

        The device row is zeroed before an op only when it may not be zero: after an op whose
        flags ``_check_flags`` read back as all zero (following the stream synchronisation
        that completes every write to them), the whole row is known to be zero, since ops
        write only their own batch's flags and nothing else writes the row. A launch clears
        that knowledge until its flags are read back; a flagged request, or an op that failed
        before its verdict, leaves the row to be zeroed whole before the next op. On a busy
        host a kernel launch is the costliest step of the op's own host work (the zeroing
        launch took about 50 us on the H200 machine, the profile of
        ``bench/results/2026-11-30-h200-ipc-s4-server-profile.txt``).
        """
        views = self._flag_rows(batch_size)
        return views.flags, views.host_flags

    def _flag_rows(self, batch_size: int) -> _FlagViews:
        """The views of ``batch_size`` requests into this engine's verdict buffers: the
        device's ``error_flags``, and on CUDA the pinned host memory that receives them
        followed by the tree sizes of a replayed build (``_replay_build``).

        A replayed build's graph writes flags and sizes straight into that pinned memory with
        one kernel (``verdict``: the same memory as a CUDA tensor, ``_on_device``). A
        device-to-device copy of the sizes next to the flags and a device-to-host copy of both
        took 7 us more of the graph than that kernel on the H200
        (``bench/results/2026-12-02-h200-verdict-s40.json``).
        """
        views = self._flag_views.get(batch_size)
        if views is not None:
            return views
        buffers = self._flags
        if buffers is None or buffers[0].shape[0] < batch_size:
            size = max(batch_size, self.limits.max_batch_size)
            flags_row = torch.zeros(size, dtype=torch.int32, device=self.device)  # [size]
            host = None
            if self._stream is not None:
                host = torch.zeros(2 * size, dtype=torch.int32, pin_memory=True)  # [2 * size]
            buffers = self._flags = (flags_row, host)
            self._flag_views = {}
            self._flags_are_zero = True  # zeroed on this stream, before any op's launch
        flags_row, host = buffers
        flags = flags_row[:batch_size]
        verdict = None if host is None else _on_device(host[: 2 * batch_size], self.device)
        views = _FlagViews(
            flags=flags,
            host_flags=None if host is None else host[:batch_size],
            host_sizes=None if host is None else host[batch_size : 2 * batch_size],
            verdict=verdict,
            pointers=(flags.data_ptr(), 0 if verdict is None else verdict.data_ptr()),
        )
        self._flag_views[batch_size] = views
        return views

    def _check_flags(self, op: str, flags: torch.Tensor) -> None:
        """Wait for the work queued so far (CUDA), then raise for the first flagged request.

        Flags become errors naming the field and request index. This synchronisation is the
        op's one wait on the device: the caller needs the verdict anyway.
        """
        if self._stream is not None:
            self._stream.synchronize()
        self._raise_flagged(op, flags.tolist())

    def _raise_flagged(self, op: str, values: list[int]) -> None:
        """Raise for the first request of ``values`` (the read-back flags of ``op``) with a
        flag set; note the buffer as zero when none is."""
        if not any(values):
            self._flags_are_zero = True  # see _flag_buffers
            return
        bad = [index for index, value in enumerate(values) if value]
        index = bad[0]
        value = ErrorFlag(values[index])
        rpc = _RPC_OF_OP[op]
        for flag, error_type, field, what in _FLAG_FIELDS[op]:
            if flag in value:
                others = f" (and {len(bad) - 1} more requests)" if len(bad) > 1 else ""
                raise error_type(
                    f"{rpc}.{field}[{index}]: {what}{others}",
                    field=f"{rpc}.{field}",
                    metadata={"request_index": str(index), "error_flags": str(int(value))},
                )
        raise InvalidArgument(
            f"{rpc}: request {index} was rejected by {op} (error_flags={int(value)})",
            metadata={"request_index": str(index), "error_flags": str(int(value))},
        )

    def _result(self, tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
        """``tensor`` on ``device`` (``None``: where it is). A copy from the GPU to the host is
        queued without waiting: it is complete after the next ``_check_flags``."""
        if device is None or device == tensor.device:
            return tensor
        return tensor.to(device, non_blocking=device.type == "cpu" and tensor.is_cuda)

    def _build_tree(self, call: BuildTreeCall) -> Tree:
        prepared = call.prepared
        if prepared is not None and prepared.launch_key is not None:
            # A copy of a call replayed before: the same views of caller memory (on this
            # device, contiguous: moved by nothing) and the same scalars.
            return self._replay_build(call, prepared.launch_key)
        logits = self._to_device(call.draft_logits)
        roots = self._to_device(call.root_tokens)
        budget = call.budget
        max_budget = call.max_budget
        if isinstance(budget, torch.Tensor):
            if max_budget is None:
                max_budget = int(budget.max())
            budget = self._to_device(budget)
        out = call.out
        if out is None or self._graphs is None or not isinstance(budget, int):

            def launch(flags: torch.Tensor) -> Tree:
                return self._launch_build(call, flags, logits, roots, budget, max_budget)

            tree, flags = self._launch_op("build_tree", launch, logits.shape[0])
            result = tree if out is not None else self._tree_result(tree, call.result_device)
            self._check_flags("build_tree", flags)
            self._observer.observe_trees(tree.num_nodes, model=call.model)
            return result
        # Outputs in caller memory on CUDA: the same buffers as an earlier call replay its
        # launches (``LaunchGraphs``); the key names every argument of the kernels.
        # A key naming only the call's own tensors is the same for every reuse of the call;
        # one naming a device copy made for this call (an inline tensor) is not.
        tensors = (logits, roots, *(getattr(out, n) for n in TREE_FIELDS))
        launch_key = LaunchKey(
            "build_tree", *(_layout(t) for t in tensors), budget, max_budget, call.temperature
        )
        if prepared is not None and logits is call.draft_logits and roots is call.root_tokens:
            prepared.launch_key = launch_key
        return self._replay_build(replace(call, draft_logits=logits, root_tokens=roots), launch_key)

    def _launch_build(
        self,
        call: BuildTreeCall,
        flags: torch.Tensor,
        logits: torch.Tensor,
        roots: torch.Tensor,
        budget: int | torch.Tensor,
        max_budget: int | None,
    ) -> Tree:
        """``kernels.build_tree`` of ``call`` with its tensors on the device.

        Into caller memory (``call.out``) the kernels write all or nothing: a flagged request
        anywhere in the batch leaves every destination untouched.
        """
        return kernels.build_tree(
            logits,
            roots,
            budget,
            temperature=call.temperature,
            max_budget=max_budget,
            error_flags=flags,
            out=call.out,
            backend=self.backend,
        )

    def _replay_build(self, call: BuildTreeCall, launch_key: LaunchKey) -> Tree:
        """A build into caller memory (``call.out``, one int ``budget``; tensors on the device)
        launched through ``LaunchGraphs`` under ``launch_key``: captured the second time its
        key is seen, replayed from then on.

        The launch also writes the error flags and the tree sizes into the pinned verdict
        memory (one kernel, ``_flag_rows``) and records its own timing events around all of it
        (captured with it, replayed with it): the verdict needs no launch or copy of its own
        and is the call's last device work (``_settled``), and the observer's timing costs no
        event records before the launch. The device time and the tree sizes are handed to the
        observer by ``_observe``, at the latest before the next op (the graph's events and the
        pinned sizes are this engine's until then).
        """
        graphs, stream = self._graphs, self._stream
        assert graphs is not None and stream is not None  # CUDA
        logits = call.draft_logits
        views = self._flag_rows(logits.shape[0])
        verdict, host_flags, host_sizes = views.verdict, views.host_flags, views.host_sizes
        assert verdict is not None and host_flags is not None and host_sizes is not None
        key = (launch_key, views.pointers)
        timed = _GRAPHS_TIME_THEMSELVES

        def launch_and_stage() -> tuple[Tree, tuple[torch.cuda.Event, torch.cuda.Event] | None]:
            timing = _graph_timing_events() if timed else None
            if timing is not None:
                timing[0].record(stream)
            # ``views.flags`` is the op's ``error_flags`` (``_launch_op`` hands out the same
            # view), whose address the key names.
            tree = self._launch_build(
                call, views.flags, logits, call.root_tokens, call.budget, call.max_budget
            )
            torch.cat((views.flags, tree.num_nodes), out=verdict)  # into pinned host memory
            if timing is not None:
                timing[1].record(stream)
            return tree, timing

        tree: Tree
        (tree, timing), _ = self._launch_op(
            "build_tree",
            lambda _: graphs.run(key, launch_and_stage),
            logits.shape[0],
            observe=not timed,
            copy_flags=False,
        )
        stream.synchronize()  # the verdict's: flags and sizes in pinned memory, events done
        if timing is None:
            self._raise_flagged("build_tree", host_flags.tolist())
            self._observer.observe_trees(host_sizes, model=call.model)
        else:
            pending = self._unobserved = _Unobserved("build_tree", timing, call.model)
            self._raise_flagged("build_tree", host_flags.tolist())
            pending.sizes = host_sizes
        self._settled = True
        return tree

    def _tree_result(self, tree: Tree, device: torch.device | None) -> Tree:
        if device is None or device == self.device:
            return tree
        return replace(
            tree,
            tokens=self._result(tree.tokens, device),
            parents=self._result(tree.parents, device),
            depths=self._result(tree.depths, device),
            log_probs=self._result(tree.log_probs, device),
            num_nodes=self._result(tree.num_nodes, device),
            mask=self._result(tree.mask, device),
        )

    def _acceptance_result(self, acceptance: Acceptance, device: torch.device | None) -> Acceptance:
        if device is None or device == self.device:
            return acceptance
        return Acceptance(
            nodes=self._result(acceptance.nodes, device),
            tokens=self._result(acceptance.tokens, device),
            length=self._result(acceptance.length, device),
            bonus=self._result(acceptance.bonus, device),
        )

    def _accept_tree(self, call: AcceptTreeCall) -> AcceptTreeResult:
        tree = self._tree_to_device(call.tree)
        tokens = None if call.target_tokens is None else self._to_device(call.target_tokens)
        logits = None if call.target_logits is None else self._to_device(call.target_logits)
        generator = None
        if call.temperature > 0:
            seed = call.seed if call.seed is not None else secrets.randbits(64)
            generator = torch.Generator(device=self.device).manual_seed(seed)
        args = call.kv_commit
        commit = None if args is None else self._commit_args(args)
        cache_in_place = commit is None or (args is not None and commit[0] is args.kv_cache)
        out = call.out

        def walk(flags: torch.Tensor) -> Acceptance:
            # Into caller memory (``out``) all or nothing, as build_tree.
            return kernels.accept(
                tree,
                tokens,
                target_logits=logits,
                temperature=call.temperature,
                generator=generator,
                error_flags=flags,
                out=out,
                backend=self.backend,
            )

        def move(flags: torch.Tensor, acceptance: Acceptance) -> None:
            # Gated on the walk's flags: nothing moves unless every request walked and every
            # request's commit data holds (all or nothing), so no verdict is awaited between.
            assert commit is not None
            kernels.commit_kv(
                *commit, acceptance, error_flags=flags, all_or_nothing=True, backend=self.backend
            )

        graphs = self._graphs
        batch_size = tree.batch_size
        run_walk: Callable[[torch.Tensor], Acceptance] = walk
        run_move: Callable[[torch.Tensor, Acceptance], None] = move
        if (
            graphs is not None
            and out is not None
            and generator is None  # a sampled walk draws a fresh seed per call
            and cache_in_place
        ):
            # Outputs and cache in caller memory on CUDA: the same buffers as an earlier call
            # replay its launches (``LaunchGraphs``), the walk and the commit one graph each.
            walk_key, move_key = self._accept_keys(call, tree, tokens, logits, commit)
            flags_ptr = self._flag_buffers(batch_size)[0].data_ptr()

            def run_walk(flags: torch.Tensor) -> Acceptance:
                acceptance: Acceptance = graphs.run((walk_key, flags_ptr), lambda: walk(flags))
                return acceptance

            def run_move(flags: torch.Tensor, acceptance: Acceptance) -> None:
                graphs.run((move_key, flags_ptr), lambda: move(flags, acceptance))

        acceptance, flags = self._launch_op(
            "accept", run_walk, batch_size, copy_flags=commit is None
        )
        kv_cache = None
        if commit is not None:
            _, flags = self._launch_op(
                "commit_kv", lambda f: run_move(f, acceptance), batch_size, continues=True
            )
            kv_cache = commit[0]
            if not cache_in_place:
                # Compacted in a device copy (the caller's cache was elsewhere): carry it back.
                # A cache compacted in place (registered caller memory) is never copied.
                kv_cache = self._result(kv_cache, call.result_device)
        result = acceptance
        if out is None:
            result = self._acceptance_result(acceptance, call.result_device)
        self._check_accept_flags(flags)
        self._observer.observe_acceptance(
            acceptance.nodes, acceptance.length, tree.num_nodes, model=call.model
        )
        return AcceptTreeResult(acceptance=result, kv_cache=kv_cache)

    def _commit_args(self, args: KvCommitArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(kv_cache, block_table, prefix_lens)`` on this device. The caller's cache is
        compacted in place when it already lives here, contiguous; an inline (host) cache in a
        device copy that the result carries back."""
        cache = args.kv_cache
        if cache.device != self.device or not cache.is_contiguous():
            cache = self._to_device(cache)
        return cache, self._to_device(args.block_table), self._to_device(args.prefix_lens)

    def _accept_keys(
        self,
        call: AcceptTreeCall,
        tree: Tree,
        tokens: torch.Tensor | None,
        logits: torch.Tensor | None,
        commit: tuple[torch.Tensor, ...] | None,
    ) -> tuple[LaunchKey, LaunchKey | None]:
        """The replay keys of the walk and of the commit of ``call`` (``LaunchGraphs``): every
        argument of their kernels but the flags; kept in ``call.prepared`` when it has one and
        they name only the call's own tensors (no device copy made for this call)."""
        own = (
            tree is call.tree
            and tokens is call.target_tokens
            and logits is call.target_logits
            and (
                commit is None
                or call.kv_commit is not None
                and commit[1] is call.kv_commit.block_table
                and commit[2] is call.kv_commit.prefix_lens
            )
        )
        prepared = call.prepared if own else None
        if prepared is not None and prepared.accept_keys is not None:
            return prepared.accept_keys
        assert call.out is not None  # replayed only into caller memory
        out_tensors = tuple(_layout(getattr(call.out, n)) for n in ACCEPTANCE_FIELDS)
        walk_key = LaunchKey(
            "accept",
            *(_layout(getattr(tree, n)) for n in TREE_FIELDS),
            tree.draft_len,
            call.temperature,
            None if tokens is None else _layout(tokens),
            None if logits is None else _layout(logits),
            *out_tensors,
        )
        move_key = None
        if commit is not None:
            move_key = LaunchKey("commit_kv", *(_layout(t) for t in commit), *out_tensors)
        keys = (walk_key, move_key)
        if prepared is not None:
            prepared.accept_keys = keys
        return keys

    def _check_accept_flags(self, flags: torch.Tensor) -> None:
        """``_check_flags`` for AcceptTree: the walk's errors (tree, target tokens) first. After a
        failed walk the commit still checks its data (nothing moves), and may flag paths the
        walk never wrote: only the walk's bits are reported then."""
        walk_bits = ErrorFlag.TREE | ErrorFlag.TOKEN
        if self._stream is not None:
            self._stream.synchronize()
        values = flags.tolist()
        walk = [value & walk_bits for value in values]
        if any(walk):
            self._raise_flagged("accept", walk)
        self._raise_flagged("commit_kv", values)

    def _verify_attention(self, call: VerifyAttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        tree = self._tree_to_device(call.tree)
        q = self._to_device(call.q)
        cache = self._to_device(call.kv_cache)
        table = self._to_device(call.block_table)
        lens = self._to_device(call.prefix_lens)
        (out, lse), flags = self._launch_op(
            "verify_attention",
            lambda f: kernels.verify_attention(
                q,
                cache,
                table,
                lens,
                tree,
                v_dim=call.v_dim,
                sm_scale=call.sm_scale,
                out=call.out,
                lse=call.lse,
                error_flags=f,
                backend=self.backend,
            ),
            tree.batch_size,
        )
        # Outputs written into caller memory stay there; the others go to result_device.
        if call.out is None:
            out = self._result(out, call.result_device)
        if call.lse is None:
            lse = self._result(lse, call.result_device)
        self._check_flags("verify_attention", flags)
        return out, lse
