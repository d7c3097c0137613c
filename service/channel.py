"""GPU doorbell channels: the service side (docs/channel.md).

A channel serves one op for a fixed shape. Its control block lives in the caller's GPU memory
(a registered region); its steps are described by descriptors the caller writes into that block,
each naming byte offsets into the channel's regions (registered memory of the same owner,
leased for the channel's lifetime). For each channel the service keeps, on a dedicated stream,
``depth`` whole steps enqueued ahead (``ChannelDevice.enqueue_step``: wait for the doorbell,
resolve and validate the descriptor on the device, the op's kernels, finish), and one host
thread per channel tops the queue up as steps complete and feeds each step's results, read from
pinned host memory, to the engine's observer (the same metrics as the RPCs).

A channel closes on CloseChannel, when its caller's WatchChannel stream ends (the caller died or
left), when it has had no watcher and no step for ``idle_timeout_s``, and when the engine closes.
Closing marks the control block CLOSED, fails the enqueued steps (status ``CLOSED``) by raising
the doorbell past them, waits for the stream, and releases the leases: afterwards the service
never touches the caller's memory again.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ddtree.kernels.channel import (
    DOORBELL_OFFSET,
    STATE_OFFSET,
    ChannelOp,
    ChannelShape,
    ChannelState,
    StepStatus,
    control_block_bytes,
)
from ddtree.service.calls import validate_model_label
from ddtree.service.errors import (
    FailedPrecondition,
    InvalidArgument,
    MissingField,
    NotFound,
    ResourceExhausted,
    ShuttingDown,
    ValueOutOfRange,
)
from ddtree.service.memory import Leases, RegionTable

__all__ = [
    "ChannelLimits",
    "ChannelLimitExceeded",
    "ChannelNotFound",
    "ChannelRegion",
    "ChannelTable",
    "ChannelsUnsupported",
    "OpenChannelArgs",
    "open_channel_args",
]

_log = logging.getLogger(__name__)

_BUSY_POLL_S = 20e-6
_IDLE_POLL_S = 1e-3
_BUSY_WINDOW_S = 0.05
"""After a step completed, poll the result slots every ``_BUSY_POLL_S`` for this long."""
_DRAIN_TIMEOUT_S = 5.0


class ChannelNotFound(NotFound):
    """Unknown or closed channel token (open a new channel)."""

    reason = "CHANNEL_NOT_FOUND"


class ChannelLimitExceeded(ResourceExhausted):
    """The server holds its maximum number of channels."""

    reason = "CHANNEL_LIMIT_EXCEEDED"


class ChannelsUnsupported(FailedPrecondition):
    """Channels need a CUDA device with registered memory."""

    reason = "CHANNELS_UNSUPPORTED"


@dataclass(frozen=True)
class ChannelLimits:
    """Bounds on channels (from ``ServiceConfig``).

    Attributes
    ----------
    max_channels : int
        Channels open at once, ``>= 1``.
    depth : int
        Steps kept enqueued ahead per channel, ``>= 2``; must exceed the ring size so that every
        step a caller may have in flight is enqueued.
    idle_timeout_s : float
        A channel with no WatchChannel stream and no step for this long closes.
    """

    max_channels: int = 64
    depth: int = 8
    idle_timeout_s: float = 600.0


@dataclass(frozen=True)
class ChannelRegion:
    """A window of a registered region: ``(token, offset_bytes, byte_size)``."""

    region_token: str
    offset_bytes: int
    byte_size: int


class _Channel:
    """One open channel: leases, device state, stream and step thread."""

    def __init__(
        self,
        token: str,
        channel_id: str,
        owner: str,
        shape: ChannelShape,
        model: str,
        leases: Leases,
        device_state: Any,
        limits: ChannelLimits,
        observer: Any,
        on_closed: Callable[[_Channel], None],
    ) -> None:
        self.token = token
        self.channel_id = channel_id
        self.owner = owner
        self.shape = shape
        self.model = model
        self.leases = leases
        self.dev = device_state
        self.limits = limits
        self.observer = observer
        self.on_closed = on_closed
        self.closed: Future[str] = Future()
        self.watchers = 0
        self.steps = 0
        self.failed_steps = 0
        self._close_reason: str | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"ddtree-channel-{channel_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def request_close(self, reason: str) -> None:
        with self._lock:
            if self._close_reason is None:
                self._close_reason = reason
        self._wake.set()

    def join(self, timeout_s: float) -> None:
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ step thread

    def _run(self) -> None:
        dev = self.dev
        index = dev.device.index
        torch.cuda.set_device(index)
        stream = torch.cuda.Stream(dev.device)
        enqueued = 0
        done = 0
        last_progress = time.monotonic()
        reason = "closed"
        try:
            with torch.cuda.stream(stream):
                while True:
                    while enqueued < done + self.limits.depth:
                        enqueued += 1
                        dev.enqueue_step(enqueued)
                    if self._close_reason is not None:
                        reason = self._close_reason
                        break
                    slot = dev.result_slot(done + 1)
                    if int(slot[:2].view(torch.int64)[0]) == done + 1:
                        done += 1
                        self._observe(slot)
                        last_progress = time.monotonic()
                        continue
                    now = time.monotonic()
                    if self.watchers == 0 and now - last_progress > self.limits.idle_timeout_s:
                        reason = "expired"
                        break
                    busy = now - last_progress < _BUSY_WINDOW_S
                    self._wake.wait(_BUSY_POLL_S if busy else _IDLE_POLL_S)
                self._drain(stream, enqueued)
        except Exception as err:  # a CUDA failure: log, close, never raise on a thread
            _log.exception("event=channel_failed channel_id=%s error=%s", self.channel_id, err)
            reason = f"failed: {err}"
        finally:
            self._finish(reason)

    def _observe(self, slot: torch.Tensor) -> None:
        words = slot[2:]
        status, batch, op = int(words[0]), int(words[1]), int(words[2])
        self.steps += 1
        if status != StepStatus.OK:
            self.failed_steps += 1
            _log.info(
                "event=channel_step_failed channel_id=%s status=%s",
                self.channel_id,
                StepStatus(status).name if status in StepStatus._value2member_map_ else status,
            )
            return
        base = 4
        b = self.shape.max_batch_size
        if op == ChannelOp.BUILD_TREE:
            self.observer.observe_trees(words[base : base + batch].clone(), model=self.model)
            return
        path_len = self.shape.draft_len + 1
        length = words[base : base + batch].clone()
        num_nodes = words[base + b : base + b + batch].clone()
        start = base + 2 * b
        nodes = words[start : start + batch * path_len].clone().view(batch, path_len)
        self.observer.observe_acceptance(nodes, length, num_nodes, model=self.model)

    def _drain(self, stream: torch.cuda.Stream, enqueued: int) -> None:
        """Fail every enqueued step and wait for the stream; bounded by ``_DRAIN_TIMEOUT_S``."""
        from ddtree.kernels.channel_cuda import write_values

        dev = self.dev
        index = dev.device.index or 0
        ctrl = dev.control.data_ptr()
        # The resolve kernels of the enqueued steps read the cancel word: CLOSED, no op runs.
        write_values(
            index,
            [
                (dev.cancel.data_ptr(), 1, 32),
                (ctrl + STATE_OFFSET, int(ChannelState.CLOSED), 32),
            ],
        )
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while not stream.query():
            # Raise the doorbell past every enqueued step (again, in case a caller's post that
            # read OPEN before the state changed wrote a smaller value meanwhile).
            write_values(index, [(ctrl + DOORBELL_OFFSET, enqueued & 0xFFFFFFFF, 32)])
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the channel's stream did not drain within {_DRAIN_TIMEOUT_S} s"
                )
            time.sleep(1e-3)

    def _finish(self, reason: str) -> None:
        if reason.startswith("failed"):
            # The stream may still hold work on the caller's memory: keep the mappings (leak)
            # rather than unmap under it. A sticky error makes the server exit anyway. Best
            # effort, mark the control block CLOSED so that the caller's next post returns.
            from ddtree.kernels.channel_cuda import write_values

            try:
                ctrl = self.dev.control.data_ptr()
                index = self.dev.device.index or 0
                write_values(index, [(ctrl + STATE_OFFSET, int(ChannelState.CLOSED), 32)])
            except Exception as err:
                _log.warning("event=channel_mark_closed_failed error=%s", err)
            _log.error("event=channel_leaked channel_id=%s", self.channel_id)
        else:
            self.leases.release()
        _log.info(
            "event=channel_closed channel_id=%s reason=%s steps=%d failed_steps=%d",
            self.channel_id,
            reason,
            self.steps,
            self.failed_steps,
        )
        self.on_closed(self)
        if not self.closed.done():
            self.closed.set_result(reason)


class ChannelTable:
    """The open channels of one device.

    Parameters
    ----------
    memory : RegionTable
        Registered memory of the device (regions are leased from it).
    limits : ChannelLimits
        Bounds and the pipelining depth.
    observer : object
        ``EngineObserver`` fed with each step's results.

    Notes
    -----
    Thread-safe. ``open`` compiles or loads the channel's kernels (seconds on a cold cache):
    call it off the event loop (``open_async``).
    """

    def __init__(self, memory: RegionTable, limits: ChannelLimits, observer: Any) -> None:
        self._memory = memory
        self.limits = limits
        self._observer = observer
        self._lock = threading.Lock()
        self._channels: dict[str, _Channel] = {}
        self._pending = 0
        self._is_closed = False
        self._opener = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddtree-channel-open")

    def __len__(self) -> int:
        with self._lock:
            return len(self._channels)

    def open_async(
        self,
        shape: ChannelShape,
        control: ChannelRegion,
        ring_size: int,
        regions: Sequence[ChannelRegion],
        *,
        owner: str = "",
        model: str = "",
    ) -> Future[str]:
        """``open`` on the opener thread; the future gives the channel token."""
        return self._opener.submit(
            self.open, shape, control, ring_size, regions, owner=owner, model=model
        )

    def open(
        self,
        shape: ChannelShape,
        control: ChannelRegion,
        ring_size: int,
        regions: Sequence[ChannelRegion],
        *,
        owner: str = "",
        model: str = "",
    ) -> str:
        """Open a channel; returns its token (a capability, like a region token).

        Parameters
        ----------
        shape : ChannelShape
            Op and fixed shape.
        control : ChannelRegion
            The control block: ``control_block_bytes(ring_size)`` bytes, 8-byte aligned.
        ring_size : int
            Descriptor slots, ``1 .. depth - 1``.
        regions : sequence of ChannelRegion
            The windows descriptors may reference, by index.
        owner : str
            The caller's identity (regions must be usable by it).
        model : str
            Metrics label.

        Raises
        ------
        ShuttingDown
            The table is closed.
        ChannelLimitExceeded
            ``max_channels`` channels are open.
        InvalidArgument
            A bad ring size, control block window or region window.
        MemoryTokenNotFound, InvalidReference, DeviceMismatch
            From resolving the regions.
        """
        from ddtree.kernels.channel_cuda import ChannelDevice

        if not 1 <= ring_size < self.limits.depth:
            raise InvalidArgument(
                f"open_channel.ring_size: expected 1..{self.limits.depth - 1} (the server keeps "
                f"{self.limits.depth} steps enqueued), got {ring_size}",
                field="open_channel.ring_size",
            )
        control_bytes = control_block_bytes(ring_size)
        if control.byte_size < control_bytes:
            raise InvalidArgument(
                f"open_channel.control.byte_size: expected >= {control_bytes} for ring_size "
                f"{ring_size}, got {control.byte_size}",
                field="open_channel.control.byte_size",
            )
        if control.offset_bytes % 8:
            raise InvalidArgument(
                "open_channel.control.offset_bytes: expected a multiple of 8, got "
                f"{control.offset_bytes}",
                field="open_channel.control.offset_bytes",
            )
        with self._lock:
            if self._is_closed:
                raise ShuttingDown("open_channel: the server is shutting down")
            if len(self._channels) + self._pending >= self.limits.max_channels:
                raise ChannelLimitExceeded(
                    f"open_channel: the server holds {self.limits.max_channels} channels, its "
                    "max_channels; close one or use another replica"
                )
            self._pending += 1
        leases = self._memory.leases(owner)
        try:
            ctrl = leases.resolve(
                "open_channel.control",
                control.region_token,
                control.offset_bytes,
                torch.uint8,
                (control_bytes,),
            )
            table: list[tuple[int, int]] = []
            for i, region in enumerate(regions):
                if region.byte_size < 1:
                    raise InvalidArgument(
                        f"open_channel.regions[{i}].byte_size: expected >= 1",
                        field=f"open_channel.regions[{i}].byte_size",
                    )
                view = leases.resolve(
                    f"open_channel.regions[{i}]",
                    region.region_token,
                    region.offset_bytes,
                    torch.uint8,
                    (region.byte_size,),
                )
                table.append((int(view.data_ptr()), region.byte_size))
            device = self._memory.device
            with torch.cuda.device(device):
                device_state = ChannelDevice(
                    shape, ctrl, ring_size, table, self.limits.depth, device
                )
                # Its tensors were filled on this thread's stream; the step thread uses another.
                # (Never a device-wide sync: other channels' streams wait on their doorbells.)
                torch.cuda.current_stream(device).synchronize()
        except BaseException:
            leases.release()
            with self._lock:
                self._pending -= 1
            raise
        token = secrets.token_urlsafe(24)
        channel = _Channel(
            token,
            secrets.token_hex(8),
            owner,
            shape,
            model,
            leases,
            device_state,
            self.limits,
            self._observer,
            self._forget,
        )
        with self._lock:
            self._pending -= 1
            self._channels[token] = channel
            is_closed = self._is_closed
        channel.start()
        if is_closed:
            channel.request_close("shutdown")
        _log.info(
            "event=channel_opened channel_id=%s op=%s max_batch_size=%d ring_size=%d regions=%d",
            channel.channel_id,
            shape.op.name,
            shape.max_batch_size,
            ring_size,
            len(table),
        )
        return token

    def _forget(self, channel: _Channel) -> None:
        with self._lock:
            if self._channels.get(channel.token) is channel:
                del self._channels[channel.token]

    def _find(self, token: str, owner: str, field: str) -> _Channel:
        with self._lock:
            channel = self._channels.get(token)
        if channel is None or channel.owner != owner:
            raise ChannelNotFound(
                f"{field}: unknown or closed channel token; open a new channel", field=field
            )
        return channel

    def close(self, token: str, owner: str = "", *, timeout_s: float = 10.0) -> int:
        """Close a channel and wait until its stream drained; returns the steps it served.

        Raises
        ------
        ChannelNotFound
            Unknown token, another owner's channel, or already closed.
        """
        channel = self._find(token, owner, "close_channel.channel_token")
        channel.request_close("close_channel")
        channel.closed.result(timeout_s)
        return channel.steps

    def watch(self, token: str, owner: str = "") -> Future[str]:
        """Attach a watcher; the future completes with the close reason.

        Call ``unwatch`` when the watcher leaves: the last watcher leaving closes the channel
        (its caller is gone).
        """
        channel = self._find(token, owner, "watch_channel.channel_token")
        with channel._lock:
            channel.watchers += 1
        return channel.closed

    def unwatch(self, token: str) -> None:
        """Detach a watcher; with none left, the channel closes (reason ``caller_gone``)."""
        with self._lock:
            channel = self._channels.get(token)
        if channel is None:
            return
        with channel._lock:
            channel.watchers -= 1
            last = channel.watchers == 0
        if last:
            channel.request_close("caller_gone")

    def close_all(self, timeout_s: float = 10.0) -> None:
        """Close every channel (engine shutdown) and refuse new ones. Idempotent."""
        with self._lock:
            self._is_closed = True
            channels = list(self._channels.values())
        for channel in channels:
            channel.request_close("shutdown")
        for channel in channels:
            try:
                channel.closed.result(timeout_s)
            except TimeoutError:
                _log.warning("event=channel_close_timeout channel_id=%s", channel.channel_id)
        self._opener.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------- wire conversion

_DTYPE_CODES = {1: 1, 2: 2, 3: 0}
"""``DType`` (BFLOAT16 1, FLOAT16 2, FLOAT32 3) -> channel.cu's ``DDTREE_DTYPE``."""
_DTYPE_BYTES = {1: 2, 2: 2, 3: 4}


@dataclass(frozen=True)
class OpenChannelArgs:
    """A decoded OpenChannel request."""

    shape: ChannelShape
    control: ChannelRegion
    ring_size: int
    regions: tuple[ChannelRegion, ...]
    model: str


def _region(message: Any, field: str) -> ChannelRegion:
    if not message.region_token:
        raise MissingField(f"{field}.region_token: required", field=f"{field}.region_token")
    return ChannelRegion(message.region_token, int(message.offset_bytes), int(message.byte_size))


def open_channel_args(request: Any, max_batch_size: int) -> OpenChannelArgs:
    """Decode and check an ``OpenChannelRequest``.

    Parameters
    ----------
    request : ddtree.v1.OpenChannelRequest
        The request.
    max_batch_size : int
        The server's batch limit (``ServerLimits.max_batch_size``).

    Returns
    -------
    OpenChannelArgs

    Raises
    ------
    MissingField
        ``op``, ``control`` or a region token is not set.
    ValueOutOfRange
        A size outside its range (the message names the field).
    InvalidModelLabel
        A malformed ``model``.
    """
    if request.op not in (ChannelOp.BUILD_TREE, ChannelOp.ACCEPT):
        raise MissingField(
            "open_channel.op: expected CHANNEL_OP_BUILD_TREE or ACCEPT", field="open_channel.op"
        )
    if not request.HasField("control"):
        raise MissingField("open_channel.control: required", field="open_channel.control")
    validate_model_label("open_channel.model", request.model)
    if request.max_batch_size > max_batch_size:
        raise ValueOutOfRange(
            f"open_channel.max_batch_size: expected 1..{max_batch_size}, got "
            f"{request.max_batch_size}",
            field="open_channel.max_batch_size",
        )
    reads_logits = request.op == ChannelOp.BUILD_TREE or request.vocab_size > 0
    if reads_logits and request.logits_dtype not in _DTYPE_CODES:
        raise ValueOutOfRange(
            "open_channel.logits_dtype: expected BFLOAT16, FLOAT16 or FLOAT32",
            field="open_channel.logits_dtype",
        )
    kv = request.kv if request.HasField("kv") else None
    if kv is not None and kv.dtype not in _DTYPE_BYTES:
        raise ValueOutOfRange(
            "open_channel.kv.dtype: expected BFLOAT16, FLOAT16 or FLOAT32",
            field="open_channel.kv.dtype",
        )
    try:
        shape = ChannelShape(
            op=ChannelOp(request.op),
            max_batch_size=request.max_batch_size,
            draft_len=request.draft_len,
            max_budget=request.max_budget,
            vocab_size=request.vocab_size,
            logit_code=_DTYPE_CODES.get(request.logits_dtype, 1),
            kv_row_bytes=0 if kv is None else kv.head_dim * _DTYPE_BYTES[kv.dtype],
            num_pages=0 if kv is None else kv.num_pages,
            page_size=0 if kv is None else kv.page_size,
            max_pages=0 if kv is None else kv.max_pages,
        )
    except ValueError as err:
        field = str(err).split(":", 1)[0]
        raise ValueOutOfRange(str(err), field=field) from err
    regions = tuple(_region(r, f"open_channel.regions[{i}]") for i, r in enumerate(request.regions))
    return OpenChannelArgs(
        shape=shape,
        control=_region(request.control, "open_channel.control"),
        ring_size=int(request.ring_size),
        regions=regions,
        model=request.model,
    )
