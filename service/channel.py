"""GPU doorbell channels: the service side (docs/channel.md).

A channel serves one op for a fixed shape. Its control block lives in the caller's GPU memory
(a registered region); its steps are described by descriptors the caller writes into that block,
each naming byte offsets into the channel's regions (registered memory of the same owner,
leased for the channel's lifetime).

Each channel's device work runs in a worker process of its own (``channel_worker``), which keeps
``depth`` whole steps enqueued ahead on its stream (``ChannelDevice.enqueue_step``: wait for the
doorbell, resolve and validate the descriptor on the device, the op's kernels, finish) and
reports each finished step's small results, which a reader thread here feeds to the engine's
observer (the same metrics as the RPCs). A process of its own because those waits, pending for
as long as the caller is idle, would otherwise stall every device-synchronising call of the
server's context (unmapping a region, freeing memory) and every stream sharing a hardware queue
with them.

A channel closes on CloseChannel, when its caller's WatchChannel stream ends (the caller died or
left), when it has had no watcher and no step for ``idle_timeout_s``, and when the engine closes.
Closing marks the control block CLOSED, fails the enqueued steps (status ``CLOSED``) by raising
the doorbell past them, waits for the worker's stream and process, and releases the leases:
afterwards nothing touches the caller's memory again. A worker that dies is replaced by nothing:
the server marks the block CLOSED and completes an outstanding step itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ddtree.kernels.channel import (
    DONE_OFFSET,
    LAST_STATUS_OFFSET,
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
    Internal,
    InvalidArgument,
    InvalidIpcHandle,
    InvalidReference,
    MissingField,
    NotFound,
    ResourceExhausted,
    ShuttingDown,
    ValueOutOfRange,
)
from ddtree.service.memory import IPC_HANDLE_BYTES, Leases, RegionTable

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

WORKER_COMMAND = (sys.executable, "-m", "ddtree.service.channel_worker")
"""How a channel's worker process is started (tests substitute a stand-in)."""
_EXIT_TIMEOUT_S = 15.0
"""How long a worker may take to exit after its last line (context teardown)."""
_IDLE_CHECK_S = 1.0


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
    start_timeout_s : float
        How long a channel's worker process may take to start (imports, CUDA context, kernels
        from the disk cache).
    """

    max_channels: int = 16
    depth: int = 8
    idle_timeout_s: float = 600.0
    start_timeout_s: float = 120.0


@dataclass(frozen=True)
class ChannelRegion:
    """A window of a registered region: ``(token, offset_bytes, byte_size)``, with the IPC
    handle of the region's allocation (the channel's worker process maps it itself)."""

    region_token: str
    offset_bytes: int
    byte_size: int
    ipc_handle: bytes = b""


def _parse(line: str) -> dict[str, Any]:
    """One line of a worker's stdout; anything but a JSON object is logged and ignored."""
    try:
        message = json.loads(line)
    except ValueError:
        message = None
    if not isinstance(message, dict):
        if line.strip():
            _log.warning("event=channel_worker_output line=%r", line[:200])
        return {}
    return message


def _window(region: ChannelRegion) -> dict[str, Any]:
    return {
        "ipc_handle": region.ipc_handle.hex(),
        "offset_bytes": region.offset_bytes,
        "byte_size": region.byte_size,
    }


class _Channel:
    """One open channel: its leases and the worker process that runs its steps."""

    def __init__(
        self,
        token: str,
        channel_id: str,
        owner: str,
        shape: ChannelShape,
        model: str,
        leases: Leases,
        control: torch.Tensor,
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
        self.control = control  # the caller's control block as the server maps it
        self.limits = limits
        self.observer = observer
        self.on_closed = on_closed
        self.closed: Future[str] = Future()
        self.watchers = 0
        self.steps = 0
        self.failed_steps = 0
        self.last_progress_s = time.monotonic()
        self._lock = threading.Lock()
        self._close_reason: str | None = None
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self, spec: dict[str, Any], timeout_s: float) -> None:
        """Start the worker and wait until its first steps are enqueued.

        Raises
        ------
        InvalidReference
            The worker refused a window (the IPC handle names another allocation).
        Internal
            The worker failed or did not answer within ``timeout_s``.
        """
        # Eager module loading: every kernel is in the worker's context before its first wait is
        # enqueued, so no lazy load can ever queue behind a doorbell wait.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_MODULE_LOADING": "EAGER"}
        self._process = subprocess.Popen(
            list(WORKER_COMMAND),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(spec) + "\n")
        self._process.stdin.flush()
        first: list[str] = []
        reader = threading.Thread(
            target=lambda: first.append(self._process.stdout.readline()),  # type: ignore[union-attr]
            daemon=True,
        )
        reader.start()
        reader.join(timeout_s)
        message = _parse(first[0] if first else "")
        if not message.get("ready"):
            self._kill()
            error = message.get("error") or f"no answer within {timeout_s:g} s"
            if "outside the allocation" in error:
                raise InvalidReference(error.split(": ", 1)[-1])
            raise Internal(f"open_channel: the channel's worker failed: {error}")
        self._reader = threading.Thread(
            target=self._read, name=f"ddtree-channel-{self.channel_id}", daemon=True
        )
        self._reader.start()

    def _kill(self) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            process.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        process = self._process
        if process is None:
            return
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    continue  # a broken pipe to a dead worker: nothing left to flush

    def request_close(self, reason: str) -> None:
        with self._lock:
            if self._close_reason is not None:
                return
            self._close_reason = reason
        process = self._process
        if process is None or process.stdin is None:
            return
        try:
            process.stdin.write(f"close {reason}\n")
            process.stdin.flush()
        except (OSError, ValueError):
            pass  # the worker is gone already; the reader finishes the close

    def _read(self) -> None:
        process = self._process
        assert process is not None and process.stdout is not None
        reason = "failed: the worker exited"
        for line in process.stdout:
            message = _parse(line)
            if "s" in message:
                self.last_progress_s = time.monotonic()
                self._observe(message)
            elif "closed" in message:
                reason = str(message["closed"])
            elif "error" in message:
                reason = f"failed: {message['error']}"
        try:
            process.wait(timeout=_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self._close_pipes()
        self._finish(reason)

    def _observe(self, message: dict[str, Any]) -> None:
        status, batch, op, values = message["st"], message["b"], message["op"], message["v"]
        self.steps += 1
        if status != StepStatus.OK:
            self.failed_steps += 1
            name = StepStatus(status).name if status in StepStatus._value2member_map_ else status
            _log.info("event=channel_step_failed channel_id=%s status=%s", self.channel_id, name)
            return
        words = torch.tensor(values, dtype=torch.int32)  # [slot_ints - 4]
        b = self.shape.max_batch_size
        if op == ChannelOp.BUILD_TREE:
            self.observer.observe_trees(words[:batch], model=self.model)
            return
        path_len = self.shape.draft_len + 1
        nodes = words[2 * b : 2 * b + batch * path_len].view(batch, path_len)
        self.observer.observe_acceptance(
            nodes, words[:batch], words[b : b + batch], model=self.model
        )

    def _finish(self, reason: str) -> None:
        # A caller that is gone (or presumed gone) needs no release, and its memory is best not
        # written from the server's own context: a fault there would take the server down.
        caller_gone = self._close_reason in ("caller_gone", "expired")
        if (reason.startswith("failed") or "drain timed out" in reason) and not caller_gone:
            # The worker died (or could not drain): it can no longer complete the caller's
            # steps. Mark the block CLOSED and complete an outstanding step from here, so that
            # the caller's stream is released (the worker's context is gone: nothing of it
            # writes the block any more).
            from ddtree.kernels.channel_cuda import write_values

            ctrl = self.control.data_ptr()
            try:
                write_values(
                    self.control.device.index or 0,
                    [
                        (ctrl + STATE_OFFSET, int(ChannelState.CLOSED), 32),
                        (ctrl + LAST_STATUS_OFFSET, int(StepStatus.CLOSED), 32),
                        (ctrl + DONE_OFFSET, 1, 32),
                    ],
                )
            except Exception as err:  # a dead context: the server is failing anyway
                _log.warning("event=channel_mark_closed_failed error=%s", err)
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
        self._monitor: threading.Thread | None = None

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
            for i, region in enumerate(regions):
                if region.byte_size < 1:
                    raise InvalidArgument(
                        f"open_channel.regions[{i}].byte_size: expected >= 1",
                        field=f"open_channel.regions[{i}].byte_size",
                    )
                # Capability, owner and bounds checks (and the lease that keeps the region).
                leases.resolve(
                    f"open_channel.regions[{i}]",
                    region.region_token,
                    region.offset_bytes,
                    torch.uint8,
                    (region.byte_size,),
                )
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
            ctrl,
            self.limits,
            self._observer,
            self._forget,
        )
        spec = {
            "device_index": self._memory.device.index or 0,
            "shape": {**dataclasses.asdict(shape), "op": int(shape.op)},
            "ring_size": ring_size,
            "depth": self.limits.depth,
            "control": _window(control),
            "regions": [_window(r) for r in regions],
        }
        try:
            channel.start(spec, self.limits.start_timeout_s)
        except BaseException:
            leases.release()
            with self._lock:
                self._pending -= 1
            raise
        with self._lock:
            self._pending -= 1
            self._channels[token] = channel
            is_closed = self._is_closed
            if self._monitor is None:
                self._monitor = threading.Thread(
                    target=self._expire, name="ddtree-channel-expiry", daemon=True
                )
                self._monitor.start()
        if is_closed:
            channel.request_close("shutdown")
        _log.info(
            "event=channel_opened channel_id=%s op=%s max_batch_size=%d ring_size=%d regions=%d",
            channel.channel_id,
            shape.op.name,
            shape.max_batch_size,
            ring_size,
            len(regions),
        )
        return token

    def _expire(self) -> None:
        """Close channels that nobody watches and that served no step for ``idle_timeout_s``
        (callers that never open a WatchChannel stream and died)."""
        while not self._is_closed:
            time.sleep(_IDLE_CHECK_S)
            now = time.monotonic()
            with self._lock:
                channels = list(self._channels.values())
            for channel in channels:
                idle_s = now - channel.last_progress_s
                if channel.watchers == 0 and idle_s > self.limits.idle_timeout_s:
                    channel.request_close("expired")

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

    def close(self, token: str, owner: str = "", *, timeout_s: float = 30.0) -> int:
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

    def close_all(self, timeout_s: float = 30.0) -> None:
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
    if len(message.ipc_handle) != IPC_HANDLE_BYTES:
        raise InvalidIpcHandle(
            f"{field}.ipc_handle: expected {IPC_HANDLE_BYTES} bytes, got {len(message.ipc_handle)}",
            field=f"{field}.ipc_handle",
        )
    return ChannelRegion(
        message.region_token,
        int(message.offset_bytes),
        int(message.byte_size),
        bytes(message.ipc_handle),
    )


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
