"""GPU doorbell channels: build_tree / accept steps with no RPC and no host sync per step.

A ``Channel`` serves one op for a fixed shape (docs/channel.md). Opening it registers the
caller's memory (a workspace holding the control block and the default outputs, plus every
tensor allocation given in ``tensors``) and calls ``OpenChannel``. A step (``build_tree``,
``accept``) then costs the caller two stream operations on its current stream: a one-thread
kernel that writes the step descriptor and rings the doorbell, and a ``cuStreamWaitValue32``
until the service marked the step done. Nothing synchronises with the host, so a step can be
captured in a CUDA graph (the descriptor is captured as kernel arguments: replay the graph with
the same tensors).

Inputs must be written by work queued earlier on the current stream (stream order is the only
ordering needed), and every tensor a step names must lie inside the memory the channel was
opened with. Outputs are the channel's own buffers by default (``Tree`` / ``Acceptance`` views,
overwritten by the next step of the channel), or caller tensors given as ``out``.

A watchdog keeps a ``WatchChannel`` stream open and polls the control block: when the service
dies (the stream breaks), or when a posted step has not completed within ``step_timeout_s``
(a service that is connected but hung), it marks the control block SERVICE_LOST and releases
the caller's stream, so an inference server never hangs on the service. Afterwards steps posted
by a graph replay complete at once with ``StepStatus.SERVICE_LOST``, and ``build_tree`` /
``accept`` / ``post`` raise ``ChannelLostError``. Read the outcome of steps with
``last_status`` (a host sync) or on the device from ``status`` and the error flags.

Needs the ``cuda`` extra (cuda-python); the channel kernels are compiled with NVRTC on first
use (``ddtree.kernels.jit``; cached on disk).
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from ddtree.clients import _wire
from ddtree.clients.cuda import Allocation, device_uuid, ipc_mem_handle, locate
from ddtree.clients.errors import DDTreeClientError
from ddtree.kernels.channel import (
    COMPLETION_OFFSET,
    DONE_OFFSET,
    LAST_STATUS_OFFSET,
    STATE_OFFSET,
    ChannelOp,
    ChannelState,
    DescriptorFlag,
    Ref,
    StepDescriptor,
    StepStatus,
    control_block_bytes,
    pack_descriptor,
)
from ddtree.kernels.types import Acceptance, Tree, mask_words
from ddtree.v1 import tensor_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

__all__ = ["Channel", "ChannelLostError", "StepDeadline", "StepRecord"]

_DTYPES = {
    torch.bfloat16: (tensor_pb2.DTYPE_BFLOAT16, 1),
    torch.float16: (tensor_pb2.DTYPE_FLOAT16, 2),
    torch.float32: (tensor_pb2.DTYPE_FLOAT32, 0),
}


_MAX_CACHED_DESCRIPTORS = 256
_LOST_CLEANUP_TIMEOUT_S = 5.0
"""Deadline of each control-plane call of ``close`` once the channel was lost (a service that
hung may never answer)."""


class ChannelLostError(DDTreeClientError):
    """The channel's watchdog released it: the service is gone, or a posted step did not
    complete within ``step_timeout_s``. Close the channel; use the RPCs or another replica.

    ``code`` is ``"UNAVAILABLE"`` (reason ``CHANNEL_SERVICE_LOST``) or ``"DEADLINE_EXCEEDED"``
    (reason ``CHANNEL_STEP_TIMEOUT``).
    """


class StepDeadline:
    """When is a posted step overdue? The watchdog's bookkeeping (pure; no CUDA).

    Fed with the control block's ``doorbell`` (steps posted) and ``completion`` (last step
    finished) at each poll, it times the oldest outstanding step, ``completion + 1``, from the
    first poll that saw it posted; progress restarts the clock.

    Parameters
    ----------
    timeout_s : float
        A step still outstanding this long after it was first seen posted is overdue; ``> 0``.
    """

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"step_timeout_s: expected > 0 or None, got {timeout_s}")
        self.timeout_s = timeout_s
        self._step: int | None = None
        self._since = 0.0

    def observe(self, words: tuple[int, int] | None, now: float) -> int | None:
        """Record one poll; returns the overdue step, or ``None``.

        Parameters
        ----------
        words : (int, int) or None
            ``(doorbell, completion)`` as read, or ``None`` when the read did not complete
            (the read queues behind the caller's stream: taken as no progress).
        now : float
            ``time.monotonic()`` of the poll.

        Returns
        -------
        int or None
            The overdue step's number (``-1`` when no read completed since the clock started,
            so the step is unknown), or ``None`` while nothing is overdue.
        """
        if words is None:
            if self._step is None:
                self._step, self._since = -1, now  # unknown step, but something is held up
            return self._overdue(now)
        doorbell, completion = words
        if doorbell <= completion:
            self._step = None
            return None
        oldest = completion + 1
        if self._step != oldest:
            if self._step != -1:
                self._since = now
            self._step = oldest
        return self._overdue(now)

    def _overdue(self, now: float) -> int | None:
        if self._step is not None and now - self._since >= self.timeout_s:
            return self._step
        return None


@dataclass(frozen=True)
class StepRecord:
    """A step's status record (``last_status``)."""

    status: StepStatus
    detail: int
    """Reference slot at fault for reference and budget errors, else 0."""
    step: int


def _align(n: int) -> int:
    return -(-n // 256) * 256


class _Arena:
    """Typed views carved from one uint8 CUDA tensor (one allocation, one region)."""

    def __init__(self, layout: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], device: Any):
        offsets = []
        total = 0
        for _, dtype, shape in layout:
            offsets.append(total)
            numel = 1
            for extent in shape:
                numel *= extent
            total += _align(numel * dtype.itemsize)
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=device)  # [total]
        self.views: dict[str, torch.Tensor] = {}
        for (name, dtype, shape), offset in zip(layout, offsets, strict=True):
            numel = 1
            for extent in shape:
                numel *= extent
            raw = self.buffer[offset : offset + numel * dtype.itemsize]
            self.views[name] = raw.view(dtype).view(shape)


class Channel:
    """A GPU doorbell channel of one op on a ddtree server of this node.

    Parameters
    ----------
    address : str
        The server, ``unix:/path`` or ``host:port`` (same node: CUDA IPC).
    op : {"build_tree", "accept"}
        The op the channel serves.
    max_batch_size : int
        Largest batch of a step.
    draft_len : int
        Tree depth L, 1..32.
    max_budget : int
        Largest budget, 1..1024; trees have ``num_nodes_max = 1 + max_budget`` slots.
    vocab_size : int
        Vocabulary of the draft logits (build_tree) or of the target logits (accept); ``0`` for
        an accept channel fed target tokens.
    logits_dtype : torch.dtype
        dtype of those logits: bfloat16, float16 or float32.
    kv_cache, max_pages : torch.Tensor, int, optional
        accept only: the paged KV cache steps may commit (shape ``(num_pages, page_size,
        head_dim)``, CUDA) and the block table width; its allocation joins the channel's memory.
    tensors : iterable of torch.Tensor
        CUDA tensors whose allocations steps will reference (logits buffers, root tokens,
        targets, block tables, output buffers...). Any tensor inside those allocations may be
        named by a step.
    ring_size : int
        Descriptor slots (steps in flight at most), ``1 .. pipeline_depth - 1``.
    use_memop_wait : bool
        Wait with ``cuStreamWaitValue32`` (default) or with a one-thread spin kernel.
    model : str
        Metrics label.
    timeout_s : float
        Deadline of the control-plane calls.
    step_timeout_s : float or None
        A posted step that has not completed this long after the watchdog first saw it posted
        releases the caller's stream (status ``SERVICE_LOST``) and makes later host calls
        raise ``ChannelLostError`` (a service that is connected but hung). ``None``: no step
        deadline (a service whose connection breaks is still detected).
    client_id : str, optional
        Identity of the registrations (ListMemory).

    Raises
    ------
    ddtree.clients.errors.DDTreeClientError
        The server refused (for example ``CHANNELS_UNSUPPORTED`` or ``CHANNEL_LIMIT_EXCEEDED``).
    ddtree.clients.cuda.ExportError
        A tensor's memory cannot be exported by CUDA IPC.

    Examples
    --------
    >>> channel = Channel("unix:/tmp/ddtree.sock", op="build_tree", max_batch_size=32,
    ...                   draft_len=16, max_budget=64, vocab_size=163840,
    ...                   tensors=[logits, roots])  # doctest: +SKIP
    >>> tree = channel.build_tree(logits, roots, 64)  # doctest: +SKIP
    """

    def __init__(
        self,
        address: str,
        *,
        op: str,
        max_batch_size: int,
        draft_len: int,
        max_budget: int,
        vocab_size: int,
        logits_dtype: torch.dtype = torch.bfloat16,
        kv_cache: torch.Tensor | None = None,
        max_pages: int = 0,
        tensors: Iterable[torch.Tensor] = (),
        ring_size: int = 2,
        use_memop_wait: bool = True,
        model: str = "",
        timeout_s: float = 60.0,
        step_timeout_s: float | None = 10.0,
        client_id: str | None = None,
    ) -> None:
        if op not in ("build_tree", "accept"):
            raise ValueError(f"op: expected 'build_tree' or 'accept', got {op!r}")
        if logits_dtype not in _DTYPES:
            raise ValueError(
                f"logits_dtype: expected bfloat16, float16 or float32, got {logits_dtype}"
            )
        self.op = ChannelOp.BUILD_TREE if op == "build_tree" else ChannelOp.ACCEPT
        self.max_batch_size = max_batch_size
        self.draft_len = draft_len
        self.max_budget = max_budget
        self.vocab_size = vocab_size
        self.logits_dtype = logits_dtype
        self.ring_size = ring_size
        self.use_memop_wait = use_memop_wait
        self.timeout_s = timeout_s
        self.kv_cache = kv_cache
        self.device = torch.device("cuda", torch.cuda.current_device())
        tensors = list(tensors)
        for t in tensors + ([kv_cache] if kv_cache is not None else []):
            if t.device.type == "cuda":
                self.device = t.device
                break
        deadline = StepDeadline(step_timeout_s) if step_timeout_s is not None else None
        self._descriptors: dict[Any, bytes] = {}
        self._closing = False
        self._lost = threading.Event()
        self._lost_error: ChannelLostError | None = None
        self._server_closed = False
        self._release_lock = threading.Lock()
        self._stop = threading.Event()
        self.closed_reason: str | None = None
        """Why the channel closed: the server's WatchChannel reason (``"shutdown"``,
        ``"close_channel"``, ...), or the watchdog's (``"service_lost"``, ``"step_timeout"``)."""

        n = 1 + max_budget
        b = max_batch_size
        p = draft_len + 1
        layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            ("control", torch.uint8, (control_block_bytes(ring_size),)),
        ]
        if self.op == ChannelOp.BUILD_TREE:
            layout += [
                ("tokens", torch.int64, (b, n)),
                ("parents", torch.int32, (b, n)),
                ("depths", torch.int32, (b, n)),
                ("log_probs", torch.float32, (b, n)),
                ("num_nodes", torch.int32, (b,)),
                ("mask", torch.int64, (b, n, mask_words(n))),
                ("error_flags", torch.int32, (b,)),
            ]
        else:
            layout += [
                ("nodes", torch.int32, (b, p)),
                ("path_tokens", torch.int64, (b, p)),
                ("length", torch.int32, (b,)),
                ("bonus", torch.int64, (b,)),
                ("error_flags", torch.int32, (b,)),
            ]
        self._arena = _Arena(layout, self.device)
        self.control = self._arena.views["control"]
        self.status = self.control[LAST_STATUS_OFFSET : LAST_STATUS_OFFSET + 8].view(torch.int32)
        """Shape ``(2,)``, int32, CUDA: the latest step's ``(status, detail)``, readable on the
        device after the step's wait (``StepStatus``)."""

        self._rpc = grpc.insecure_channel(address)
        self._stub = pb_grpc.TreeSpeculationServiceStub(self._rpc)
        self._allocations: list[tuple[Allocation, str]] = []
        self._handles: list[bytes] = []
        self._tokens: list[str] = []
        self._client_id = client_id or f"channel-{id(self):x}"
        try:
            for t in [self._arena.buffer, *tensors] + ([kv_cache] if kv_cache is not None else []):
                self._register(t)
            control_ref = self._ref(self.control, "control")
            request = pb.OpenChannelRequest(
                op=(
                    pb.CHANNEL_OP_BUILD_TREE
                    if self.op == ChannelOp.BUILD_TREE
                    else pb.CHANNEL_OP_ACCEPT
                ),
                control=pb.ChannelRegion(
                    region_token=self._allocations[control_ref.region][1],
                    offset_bytes=control_ref.offset_bytes,
                    byte_size=self.control.numel(),
                    ipc_handle=self._handles[control_ref.region],
                ),
                ring_size=ring_size,
                regions=[
                    pb.ChannelRegion(
                        region_token=token,
                        offset_bytes=0,
                        byte_size=a.byte_size,
                        ipc_handle=handle,
                    )
                    for (a, token), handle in zip(self._allocations, self._handles, strict=True)
                ],
                max_batch_size=max_batch_size,
                draft_len=draft_len,
                max_budget=max_budget,
                vocab_size=vocab_size,
                logits_dtype=_DTYPES[logits_dtype][0],
                model=model,
            )
            if kv_cache is not None:
                num_pages, page_size, head_dim = kv_cache.shape
                request.kv.CopyFrom(
                    pb.ChannelKvShape(
                        num_pages=num_pages,
                        page_size=page_size,
                        head_dim=head_dim,
                        dtype=_DTYPES.get(kv_cache.dtype, (tensor_pb2.DTYPE_BFLOAT16, 1))[0],
                        max_pages=max_pages,
                    )
                )
            response = self._call(self._stub.OpenChannel, request)
        except BaseException:
            self._unregister_all()
            self._rpc.close()
            raise
        self.token = response.channel_token
        self.pipeline_depth = response.pipeline_depth
        self._watch_open = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch, name="ddtree-channel-watch", daemon=True
        )
        self._watcher.start()
        self._watch_open.wait(timeout_s)
        self._poller: threading.Thread | None = None
        if deadline is not None:
            self._poller = threading.Thread(
                target=self._poll_steps,
                args=(deadline,),
                name="ddtree-channel-deadline",
                daemon=True,
            )
            self._poller.start()

    # ------------------------------------------------------------------ control plane

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            raise _wire.error_from_rpc(err) from None

    def _register(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:
            return
        allocation, _ = locate(tensor, "tensors")
        for known, _token in self._allocations:
            if known.base_pointer == allocation.base_pointer:
                return
        index = self.device.index or 0
        handle = ipc_mem_handle(allocation, index)
        response = self._call(
            self._stub.RegisterMemory,
            pb.RegisterMemoryRequest(
                ipc_handle=handle,
                device_uuid=device_uuid(index),
                byte_size=allocation.byte_size,
                client_id=self._client_id,
            ),
        )
        self._allocations.append((allocation, response.region_token))
        self._handles.append(handle)

    def _unregister_all(self) -> None:
        for _, token in self._allocations:
            try:
                self._stub.UnregisterMemory(
                    pb.UnregisterMemoryRequest(region_token=token), timeout=self.timeout_s
                )
            except grpc.RpcError:
                continue  # cleanup: a server that is gone has forgotten them anyway
        self._allocations = []
        self._handles = []

    def _watch(self) -> None:
        try:
            for message in self._stub.WatchChannel(
                pb.WatchChannelRequest(channel_token=self.token)
            ):
                if message.state == pb.CHANNEL_STATE_OPEN:
                    self._watch_open.set()
                elif message.state == pb.CHANNEL_STATE_CLOSED:
                    # The server marked the control block CLOSED and failed pending steps,
                    # except after a failure of its own: then release the stream here too.
                    reason = message.reason or "closed"
                    self._watch_open.set()
                    if reason.startswith("failed") and not self._closing:
                        self._release(
                            reason,
                            ChannelLostError(
                                "UNAVAILABLE",
                                f"the service failed the channel ({reason}); the caller's "
                                "stream was released. Close the channel; use the RPCs or "
                                "another replica",
                                reason="CHANNEL_SERVICE_LOST",
                            ),
                        )
                    self._server_closed = True
                    self.closed_reason = self.closed_reason or reason
                    return
        except grpc.RpcError:
            pass
        finally:
            self._watch_open.set()
        if not self._closing:
            self._release(
                "service_lost",
                ChannelLostError(
                    "UNAVAILABLE",
                    "the service's connection broke (the service died or was stopped); the "
                    "caller's stream was released and the channel's steps complete with "
                    "SERVICE_LOST. Close the channel; use the RPCs or another replica",
                    reason="CHANNEL_SERVICE_LOST",
                ),
            )

    def _poll_steps(self, deadline: StepDeadline) -> None:
        """Watchdog of step deadlines: release the caller's stream when a posted step is not
        completed in time (a service connected but hung: its stream breaks never)."""
        from ddtree.kernels.channel_cuda import ControlReader

        reader = ControlReader(self.control)
        poll_s = min(0.1, deadline.timeout_s / 10)
        try:
            while not self._stop.wait(poll_s):
                if self._lost.is_set():
                    self._rerelease(reader.read(poll_s))
                    continue
                if self.closed_reason is not None:
                    return
                head = reader.read(poll_s)
                if head is not None and head[3] != ChannelState.OPEN:
                    continue  # closed: posts complete at once, nothing is outstanding
                overdue = deadline.observe(None if head is None else head[:2], time.monotonic())
                if overdue is None:
                    continue
                step = "a posted step" if overdue < 0 else f"step {overdue}"
                self._release(
                    "step_timeout",
                    ChannelLostError(
                        "DEADLINE_EXCEEDED",
                        f"{step} did not complete within step_timeout_s={deadline.timeout_s:g} "
                        "s while the service stayed connected (hung or stalled); the caller's "
                        "stream was released with status SERVICE_LOST. Close the channel (a "
                        "step the service had already started may still write its outputs "
                        "until close() returns); use the RPCs or another replica",
                        reason="CHANNEL_STEP_TIMEOUT",
                    ),
                    completion=head[0] if head is not None else None,
                )
        finally:
            reader.close()

    def _rerelease(self, head: tuple[int, int, int, int] | None) -> None:
        """A post whose kernel read the state OPEN just before the release wrote SERVICE_LOST
        writes ``done = 0`` after the release's ``done = 1``: release that wait again."""
        from ddtree.kernels.channel_cuda import write_values

        if head is not None and head[2] == 0 and head[3] == ChannelState.SERVICE_LOST:
            ctrl = self.control.data_ptr()
            write_values(
                self.device.index or 0,
                [
                    (ctrl + LAST_STATUS_OFFSET, int(StepStatus.SERVICE_LOST), 32),
                    (ctrl + DONE_OFFSET, 1, 32),
                ],
            )

    def _release(self, reason: str, error: ChannelLostError, completion: int | None = None) -> None:
        """Mark the control block SERVICE_LOST and complete any outstanding step (watchdog).

        ``completion``: also raise the completion word to it (the doorbell last read), for
        callers that wait on ``completion >= k``. Once per channel."""
        from ddtree.kernels.channel_cuda import write_values

        with self._release_lock:
            if self._lost.is_set():
                return
            self.closed_reason = reason
            self._lost_error = error
            ctrl = self.control.data_ptr()
            writes = [
                (ctrl + STATE_OFFSET, int(ChannelState.SERVICE_LOST), 32),
                (ctrl + LAST_STATUS_OFFSET, int(StepStatus.SERVICE_LOST), 32),
            ]
            if completion is not None:
                writes.append((ctrl + COMPLETION_OFFSET, completion, 64))
            writes.append((ctrl + DONE_OFFSET, 1, 32))
            write_values(self.device.index or 0, writes)
            self._lost.set()

    @property
    def is_open(self) -> bool:
        """Whether steps can still run (neither closed by the server nor lost)."""
        return self.closed_reason is None and not self._closing

    def wait_lost(self, timeout_s: float) -> bool:
        """Block until the watchdog released the channel (service lost or a step overdue);
        for tests and tools."""
        return self._lost.wait(timeout_s)

    def close(self) -> None:
        """Close the channel (its stream drains first), unregister its memory. Idempotent.

        After the watchdog released the channel, each control-plane call gets at most
        5 s (a hung service may never answer) and failures are ignored."""
        if self._closing:
            return
        self._closing = True
        self._stop.set()
        if self._lost.is_set():
            self.timeout_s = min(self.timeout_s, _LOST_CLEANUP_TIMEOUT_S)
        if not self._server_closed and self.closed_reason != "service_lost":
            # The server closed it already or is gone: nothing of ours is in flight there.
            # After a step timeout the server still holds it: closing drains its stream.
            with contextlib.suppress(DDTreeClientError):
                self._call(
                    self._stub.CloseChannel, pb.CloseChannelRequest(channel_token=self.token)
                )
        self._unregister_all()
        self._rpc.close()
        self._watcher.join(self.timeout_s)
        if self._poller is not None:
            self._poller.join(self.timeout_s)

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ steps

    def _ref(self, tensor: torch.Tensor, field: str) -> Ref:
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(f"{field}: expected a contiguous tensor on {self.device}")
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for i, (a, _) in enumerate(self._allocations):
            if a.base_pointer <= start and end <= a.base_pointer + a.byte_size:
                return Ref(i, start - a.base_pointer)
        raise ValueError(
            f"{field}: the tensor is not in memory this channel was opened with; pass a tensor "
            "of its allocation in Channel(tensors=...)"
        )

    def post(self, descriptor: StepDescriptor) -> None:
        """Post a raw descriptor and make the current stream wait for its completion.

        ``build_tree`` and ``accept`` call this; it is public for protocol tests and tools.

        Raises
        ------
        ChannelLostError
            The watchdog released the channel (the service is gone, or a step was overdue).
        """
        self._post_bytes(pack_descriptor(descriptor))

    def _post_bytes(self, data: bytes) -> None:
        from ddtree.kernels.channel_cuda import post_step, wait_step

        lost = self._lost_error
        if lost is not None:
            raise ChannelLostError(lost.code, lost.message, reason=lost.reason)

        with torch.cuda.device(self.device):
            post_step(self.control, self.ring_size, data)
            wait_step(self.control, use_memop=self.use_memop_wait)

    def last_status(self) -> StepRecord:
        """The latest step's status record (synchronises the current stream first)."""
        torch.cuda.current_stream(self.device).synchronize()
        raw = bytes(self.control[LAST_STATUS_OFFSET : LAST_STATUS_OFFSET + 16].cpu().numpy())
        status, detail, step = struct.unpack("<IIQ", raw)
        return StepRecord(StepStatus(status), detail, step)

    def _remember(self, key: Any, data: bytes) -> None:
        # Callers reuse a few buffers step after step; the packed bytes are kept per call shape.
        if len(self._descriptors) >= _MAX_CACHED_DESCRIPTORS:
            self._descriptors.clear()
        self._descriptors[key] = data

    def _check_batch(self, batch_size: int, field: str) -> None:
        if not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(
                f"{field}: batch_size {batch_size} outside 1..{self.max_batch_size} (the "
                "channel's max_batch_size)"
            )

    def build_tree(
        self,
        draft_logits: torch.Tensor,
        root_tokens: torch.Tensor,
        budget: int | torch.Tensor,
        *,
        temperature: float = 1.0,
        out: Tree | None = None,
        error_flags: torch.Tensor | None = None,
    ) -> Tree:
        """Build the draft trees through the channel (``ddtree.kernels.build_tree``'s contract).

        Parameters
        ----------
        draft_logits : torch.Tensor
            Shape ``(batch_size, draft_len, vocab_size)``, the channel's dtype, CUDA, in the
            channel's memory.
        root_tokens : torch.Tensor
            Shape ``(batch_size,)``, int64, CUDA, in the channel's memory.
        budget : int or torch.Tensor
            One budget, ``1..max_budget``, or shape ``(batch_size,)`` int32 CUDA per-request
            budgets in the channel's memory (checked on the device).
        temperature : float
            Drafter temperature, > 0 and finite.
        out : Tree, optional
            Destination (``num_nodes_max = 1 + max_budget`` slots, at least ``batch_size``
            rows, in the channel's memory); the channel's own buffers by default.
        error_flags : torch.Tensor, optional
            Shape ``(batch_size,)``, int32, CUDA: per-request ``ErrorFlag`` bits, OR-ed by the
            kernels (non-zero on entry: that request gets a root-only tree); the channel's own
            by default.

        Returns
        -------
        Tree
            Views of the first ``batch_size`` rows of the destination, valid after the step
            (on the current stream; a failed step leaves them unchanged: see ``status``).
        """
        batch_size = draft_logits.shape[0]
        self._check_batch(batch_size, "build_tree.draft_logits")
        expected = (batch_size, self.draft_len, self.vocab_size)
        if tuple(draft_logits.shape) != expected or draft_logits.dtype != self.logits_dtype:
            raise ValueError(
                f"build_tree.draft_logits: expected shape {expected} {self.logits_dtype}, got "
                f"{tuple(draft_logits.shape)} {draft_logits.dtype}"
            )
        if root_tokens.shape != (batch_size,) or root_tokens.dtype != torch.int64:
            raise ValueError(f"build_tree.root_tokens: expected shape ({batch_size},) int64")
        views = self._arena.views
        tree = (
            out
            if out is not None
            else Tree(
                tokens=views["tokens"][:batch_size],
                parents=views["parents"][:batch_size],
                depths=views["depths"][:batch_size],
                log_probs=views["log_probs"][:batch_size],
                num_nodes=views["num_nodes"][:batch_size],
                mask=views["mask"][:batch_size],
                draft_len=self.draft_len,
            )
        )
        flags = views["error_flags"][:batch_size] if error_flags is None else error_flags
        per_request = isinstance(budget, torch.Tensor)
        key = (
            "build",
            batch_size,
            draft_logits.data_ptr(),
            root_tokens.data_ptr(),
            budget.data_ptr() if isinstance(budget, torch.Tensor) else int(budget),
            float(temperature),
            tree.tokens.data_ptr(),
            tree.mask.data_ptr(),
            flags.data_ptr(),
        )
        data = self._descriptors.get(key)
        if data is None:
            refs = {
                "draft_logits": self._ref(draft_logits, "build_tree.draft_logits"),
                "root_tokens": self._ref(root_tokens, "build_tree.root_tokens"),
                "tokens": self._ref(tree.tokens, "build_tree.out.tokens"),
                "parents": self._ref(tree.parents, "build_tree.out.parents"),
                "depths": self._ref(tree.depths, "build_tree.out.depths"),
                "log_probs": self._ref(tree.log_probs, "build_tree.out.log_probs"),
                "num_nodes": self._ref(tree.num_nodes, "build_tree.out.num_nodes"),
                "mask": self._ref(tree.mask, "build_tree.out.mask"),
                "error_flags": self._ref(flags, "build_tree.error_flags"),
            }
            if isinstance(budget, torch.Tensor):
                if budget.dtype != torch.int32 or budget.shape != (batch_size,):
                    raise ValueError(f"build_tree.budget: expected shape ({batch_size},) int32")
                refs["budgets"] = self._ref(budget, "build_tree.budget")
            data = pack_descriptor(
                StepDescriptor(
                    op=ChannelOp.BUILD_TREE,
                    batch_size=batch_size,
                    flags=DescriptorFlag.ERROR_FLAGS
                    | (DescriptorFlag.CLEAR_ERROR_FLAGS if error_flags is None else 0)
                    | (DescriptorFlag.BUDGETS if per_request else 0),
                    budget=0 if isinstance(budget, torch.Tensor) else int(budget),
                    temperature=temperature,
                    refs=refs,
                )
            )
            self._remember(key, data)
        self._post_bytes(data)
        return tree

    def accept(
        self,
        tree: Tree,
        target_tokens: torch.Tensor | None = None,
        *,
        target_logits: torch.Tensor | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        block_table: torch.Tensor | None = None,
        prefix_lens: torch.Tensor | None = None,
        out: Acceptance | None = None,
        error_flags: torch.Tensor | None = None,
    ) -> Acceptance:
        """Walk the trees through the channel (``ddtree.kernels.accept``'s contract), and commit
        the channel's KV cache when ``block_table`` and ``prefix_lens`` are given.

        Parameters
        ----------
        tree : Tree
            The verified trees (``num_nodes_max = 1 + max_budget``), in the channel's memory.
        target_tokens : torch.Tensor, optional
            Shape ``(batch_size, num_nodes_max)``, int64, CUDA (a target-tokens channel).
        target_logits : torch.Tensor, optional
            Shape ``(batch_size, num_nodes_max, vocab_size)``, the channel's dtype (a logits
            channel); argmax at temperature 0, else sampled with ``seed``.
        temperature : float
            >= 0; must be 0 with target tokens.
        seed : int
            The sampler's 64-bit noise seed (``ddtree_noise_key``): equal seeds and inputs give
            equal results.
        block_table, prefix_lens : torch.Tensor, optional
            Shapes ``(batch_size, max_pages)`` and ``(batch_size,)``, int32: commit the
            channel's ``kv_cache`` to the accepted paths in place.
        out : Acceptance, optional
            Destination; the channel's own buffers by default.
        error_flags : torch.Tensor, optional
            Shape ``(batch_size,)``, int32: per-request ``ErrorFlag`` bits (non-zero on entry:
            that request is skipped); the channel's own by default.

        Returns
        -------
        Acceptance
            Views of the first ``batch_size`` rows of the destination.
        """
        batch_size = tree.batch_size
        self._check_batch(batch_size, "accept.tree")
        target = target_tokens if target_tokens is not None else target_logits
        if target is None or (target_tokens is not None) == (self.vocab_size > 0):
            raise ValueError(
                "accept: this channel takes "
                + ("target_logits" if self.vocab_size else "target_tokens")
            )
        kv = block_table is not None or prefix_lens is not None
        if kv and (self.kv_cache is None or block_table is None or prefix_lens is None):
            raise ValueError(
                "accept.kv_commit: needs a channel opened with kv_cache, and both block_table "
                "and prefix_lens"
            )
        views = self._arena.views
        acceptance = (
            out
            if out is not None
            else Acceptance(
                nodes=views["nodes"][:batch_size],
                tokens=views["path_tokens"][:batch_size],
                length=views["length"][:batch_size],
                bonus=views["bonus"][:batch_size],
            )
        )
        flags = views["error_flags"][:batch_size] if error_flags is None else error_flags
        key = (
            "accept",
            batch_size,
            tree.tokens.data_ptr(),
            tree.parents.data_ptr(),
            tree.depths.data_ptr(),
            tree.num_nodes.data_ptr(),
            target.data_ptr(),
            float(temperature),
            int(seed),
            acceptance.nodes.data_ptr(),
            flags.data_ptr(),
            0 if block_table is None else block_table.data_ptr(),
            0 if prefix_lens is None else prefix_lens.data_ptr(),
        )
        data = self._descriptors.get(key)
        if data is None:
            refs = {
                "tree_tokens": self._ref(tree.tokens, "accept.tree.tokens"),
                "parents": self._ref(tree.parents, "accept.tree.parents"),
                "depths": self._ref(tree.depths, "accept.tree.depths"),
                "num_nodes": self._ref(tree.num_nodes, "accept.tree.num_nodes"),
                "target": self._ref(target, "accept.target"),
                "path_nodes": self._ref(acceptance.nodes, "accept.out.nodes"),
                "path_tokens": self._ref(acceptance.tokens, "accept.out.tokens"),
                "length": self._ref(acceptance.length, "accept.out.length"),
                "bonus": self._ref(acceptance.bonus, "accept.out.bonus"),
                "error_flags": self._ref(flags, "accept.error_flags"),
            }
            if self.kv_cache is not None and block_table is not None and prefix_lens is not None:
                refs["kv_cache"] = self._ref(self.kv_cache, "accept.kv_cache")
                refs["block_table"] = self._ref(block_table, "accept.block_table")
                refs["prefix_lens"] = self._ref(prefix_lens, "accept.prefix_lens")
            data = pack_descriptor(
                StepDescriptor(
                    op=ChannelOp.ACCEPT,
                    batch_size=batch_size,
                    flags=DescriptorFlag.ERROR_FLAGS
                    | (DescriptorFlag.CLEAR_ERROR_FLAGS if error_flags is None else 0)
                    | (DescriptorFlag.KV_COMMIT if kv else 0),
                    temperature=temperature,
                    seed=seed,
                    refs=refs,
                )
            )
            self._remember(key, data)
        self._post_bytes(data)
        return acceptance
