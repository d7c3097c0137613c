"""CUDA launches of the doorbell channel (kernels in ``channel.cu``; protocol in ``channel.py``).

Two sides:

* the caller's: ``post_step`` (write a descriptor and ring the doorbell on the current stream)
  and ``wait_step`` (make the current stream wait until the step is done), neither of which
  synchronises with the host, so both can be captured in a CUDA graph;
* the service's: ``ChannelDevice`` holds one channel's service memory (shape, region table,
  args block, scratch, pinned result slots) and ``enqueue_step`` puts one whole step on a stream:
  wait for the doorbell, resolve, the op's kernels, finish.

The op kernels are the RPC path's kernels (``build_tree.cu``, ``accept.cu``, ``commit_kv.cu``
compiled into ``channel.cu`` as device functions), launched with the geometry of the channel's
largest batch from ``tree_cuda``'s planning functions.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ddtree.kernels import jit
from ddtree.kernels.channel import (
    DONE_OFFSET,
    DOORBELL_OFFSET,
    ChannelOp,
    ChannelShape,
)
from ddtree.kernels.tree_cuda import (
    accept_launch_params,
    build_scratch,
    commit_kv_launch_params,
    device_build_tree_plan,
    max_dynamic_smem,
)
from ddtree.kernels.types import mask_words

__all__ = [
    "ARGS_BYTES",
    "RESULT_HEADER_INTS",
    "ChannelDevice",
    "ControlReader",
    "create_stream",
    "post_step",
    "relaxed_capture_mode",
    "result_slot_ints",
    "wait_step",
    "write_values",
]

ARGS_BYTES = 256
"""Bytes reserved for ``DdtreeChannelArgs`` (152 used)."""
RESULT_HEADER_INTS = 4
"""int32 words before the per-request results in a pinned result slot (status, batch, op)."""
_RESOLVE_THREADS = 128
_FINISH_THREADS = 128


def result_slot_ints(shape: ChannelShape) -> int:
    """int32 words of one pinned result slot after its int64 step word."""
    per_request = 1 if shape.op == ChannelOp.BUILD_TREE else 2 + shape.draft_len + 1
    return RESULT_HEADER_INTS + per_request * shape.max_batch_size


@functools.cache
def _protocol_kernel(entry: str, index: int) -> Any:
    return jit.get_kernel("channel.cu", entry, {}, index)


def _u64(value: int) -> ctypes.c_uint64:
    return ctypes.c_uint64(value)


def _i32(value: int) -> ctypes.c_int32:
    return ctypes.c_int32(int(value))


def post_step(control: torch.Tensor, ring_size: int, descriptor: bytes) -> None:
    """Write ``descriptor`` into the next ring slot and ring the doorbell (caller side).

    Runs on the current stream after everything already queued there, so inputs written by
    earlier work on that stream are visible to the service's step.

    Parameters
    ----------
    control : torch.Tensor
        The control block, uint8, CUDA, ``control_block_bytes(ring_size)`` bytes, 8-byte
        aligned.
    ring_size : int
        Slots of the ring (as opened).
    descriptor : bytes
        256 bytes from ``pack_descriptor``.
    """
    words = struct.unpack("<32Q", descriptor)
    index = control.device.index
    jit.launch(
        _protocol_kernel("ddtree_channel_post", index),
        jit.LaunchParams((1, 1, 1), (1, 1, 1)),
        control.data_ptr(),
        _i32(ring_size),
        *(_u64(w) for w in words),
        device=index,
    )


def wait_step(control: torch.Tensor, *, use_memop: bool = True) -> None:
    """Make the current stream wait until the posted step is done (``done == 1``).

    Parameters
    ----------
    control : torch.Tensor
        The control block (as in ``post_step``).
    use_memop : bool
        ``cuStreamWaitValue32`` (no SM is held while waiting); ``False`` launches the one-thread
        spin kernel ``ddtree_channel_wait`` instead.
    """
    index = control.device.index
    if not use_memop:
        jit.launch(
            _protocol_kernel("ddtree_channel_wait", index),
            jit.LaunchParams((1, 1, 1), (1, 1, 1)),
            control.data_ptr(),
            device=index,
        )
        return
    from cuda.bindings import driver

    jit._make_current(index)
    stream = torch.cuda.current_stream(index).cuda_stream
    (err,) = driver.cuStreamWaitValue32(
        driver.CUstream(stream),
        driver.CUdeviceptr(control.data_ptr() + DONE_OFFSET),
        1,
        driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise jit.CudaError("cuStreamWaitValue32 on the channel's done word", result_name=err.name)


@contextlib.contextmanager
def relaxed_capture_mode() -> Iterator[None]:
    """Run this thread's CUDA calls in the relaxed stream-capture mode, then restore its mode.

    The caller's watchdog threads read and write the control block while the caller may be
    capturing a CUDA graph; torch captures in the global mode, in which a potentially unsafe
    call from any other thread (creating a stream, allocating pinned memory, ...) invalidates
    that capture. Their streams are never captured, so relaxed is safe here.
    """
    from cuda.bindings import driver

    err, previous = driver.cuThreadExchangeStreamCaptureMode(
        driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise jit.CudaError("cuThreadExchangeStreamCaptureMode", result_name=err.name)
    try:
        yield
    finally:
        driver.cuThreadExchangeStreamCaptureMode(previous)


def create_stream(device_index: int) -> int:
    """A new non-blocking CUDA stream of the device's primary context (raw handle).

    Non-blocking, so that it never waits for the legacy default stream. Within one context,
    streams created one after the other land on different hardware queues (connections), which
    matters here: a queue whose head is a stream waiting on a doorbell holds every stream that
    shares it.
    """
    from cuda.bindings import driver

    jit._make_current(device_index)
    flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING
    err, stream = driver.cuStreamCreate(int(flags))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise jit.CudaError("cuStreamCreate for a channel", result_name=err.name)
    return int(stream)


def write_values(
    device_index: int, writes: Sequence[tuple[int, int, int]], stream: int | None = None
) -> None:
    """Write ``(address, value, bits)`` words in order on ``stream`` (a raw handle; a new
    non-blocking stream when ``None``) and wait for them: control-plane writes (the watchdog,
    closing a channel). In the relaxed capture mode (``relaxed_capture_mode``)."""
    from cuda.bindings import driver

    own = stream is None
    with relaxed_capture_mode():
        jit._make_current(device_index)
        handle = driver.CUstream(create_stream(device_index) if own else stream)
        try:
            for address, value, bits in writes:
                write = driver.cuStreamWriteValue64 if bits == 64 else driver.cuStreamWriteValue32
                (err,) = write(handle, driver.CUdeviceptr(address), value, 0)
                if err != driver.CUresult.CUDA_SUCCESS:
                    raise jit.CudaError("cuStreamWriteValue on a channel", result_name=err.name)
            (err,) = driver.cuStreamSynchronize(handle)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise jit.CudaError("cuStreamSynchronize of channel writes", result_name=err.name)
        finally:
            if own:
                driver.cuStreamDestroy(handle)


class ControlReader:
    """Reads the head of a control block from the host without waiting for any other stream.

    An asynchronous copy of the block's first 24 bytes (doorbell, completion, done, state) on a
    stream of its own into pinned memory: the caller's watchdog polls with it while the caller's
    stream may be blocked on a step's wait.

    Parameters
    ----------
    control : torch.Tensor
        The control block, uint8, CUDA (the caller's own memory).
    """

    def __init__(self, control: torch.Tensor) -> None:
        self._index = control.device.index or 0
        self._address = control.data_ptr()
        with relaxed_capture_mode():
            self._host = torch.zeros(3, dtype=torch.int64, pin_memory=True)  # [3]
            self._stream = create_stream(self._index)
        self._pending = False

    def read(self, timeout_s: float) -> tuple[int, int, int, int] | None:
        """Read the control block's head.

        Parameters
        ----------
        timeout_s : float
            How long to wait for the copy.

        Returns
        -------
        tuple of int or None
            ``(doorbell, completion, done, state)``, or ``None`` when the copy did not finish
            within ``timeout_s`` (its stream is held up; the next read waits for the same copy).

        Raises
        ------
        ddtree.kernels.jit.CudaError
            The copy could not be queued, or its stream failed.
        """
        from cuda.bindings import driver

        with relaxed_capture_mode():
            jit._make_current(self._index)
            return self._read(driver, timeout_s)

    def _read(self, driver: Any, timeout_s: float) -> tuple[int, int, int, int] | None:
        stream = driver.CUstream(self._stream)
        if not self._pending:
            (err,) = driver.cuMemcpyDtoHAsync(
                self._host.data_ptr(), driver.CUdeviceptr(self._address), 24, stream
            )
            if err != driver.CUresult.CUDA_SUCCESS:
                raise jit.CudaError("cuMemcpyDtoHAsync of a control block", result_name=err.name)
            self._pending = True
        deadline = time.monotonic() + timeout_s
        while True:
            (err,) = driver.cuStreamQuery(stream)
            if err == driver.CUresult.CUDA_SUCCESS:
                break
            if err != driver.CUresult.CUDA_ERROR_NOT_READY:
                raise jit.CudaError("cuStreamQuery of a control-block read", result_name=err.name)
            if time.monotonic() >= deadline:
                return None
            time.sleep(1e-3)
        self._pending = False
        doorbell, completion, words = self._host.tolist()
        return doorbell, completion, words & 0xFFFFFFFF, (words >> 32) & 0xFFFFFFFF

    def close(self) -> None:
        """Destroy the reader's stream (a copy still queued completes first). Idempotent."""
        if self._stream:
            from cuda.bindings import driver

            with relaxed_capture_mode():
                jit._make_current(self._index)
                driver.cuStreamDestroy(driver.CUstream(self._stream))
            self._stream = 0


def _config_words(shape: ChannelShape, num_regions: int) -> list[int]:
    return [
        int(shape.op),
        shape.max_batch_size,
        shape.draft_len,
        shape.vocab_size,
        shape.logit_bytes if shape.vocab_size else 0,
        shape.num_nodes_max,
        mask_words(shape.num_nodes_max),
        shape.max_budget,
        shape.logit_align,
        int(shape.has_kv),
        shape.kv_row_bytes,
        shape.num_pages,
        shape.page_size,
        shape.max_pages,
        16,
        num_regions,
    ]


class ChannelDevice:
    """The service memory and launches of one channel on one device.

    Parameters
    ----------
    shape : ChannelShape
        The channel's shape.
    control : torch.Tensor
        The caller's control block, uint8 view of IPC-mapped memory.
    ring_size : int
        Ring slots.
    regions : list of (int, int)
        ``(device address, byte_size)`` of each region the descriptors may reference.
    depth : int
        Steps kept enqueued ahead (one pinned result slot each).
    device : torch.device
        The CUDA device.

    Notes
    -----
    Compiles (or loads from the disk cache) the channel's kernels on construction, so the first
    step does not.
    """

    def __init__(
        self,
        shape: ChannelShape,
        control: torch.Tensor,
        ring_size: int,
        regions: list[tuple[int, int]],
        depth: int,
        device: torch.device,
    ) -> None:
        self.shape = shape
        self.control = control
        self.ring_size = ring_size
        self.depth = depth
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._index = index
        self.config = torch.tensor(_config_words(shape, len(regions)), dtype=torch.int32).to(
            device
        )  # [16]
        table = [v for base, size in regions for v in (base, size)] or [0, 0]
        self.regions = torch.tensor(
            [v - (1 << 64) if v >= 1 << 63 else v for v in table], dtype=torch.int64
        ).to(device)  # [num_regions, 2]
        self.cancel = torch.zeros(1, dtype=torch.int32, device=device)  # [1]
        self.args = torch.zeros(ARGS_BYTES, dtype=torch.uint8, device=device)  # [256]
        self.budgets = torch.zeros(shape.max_batch_size, dtype=torch.int32, device=device)
        self.own_flags = torch.zeros(shape.max_batch_size, dtype=torch.int32, device=device)
        self.slot_ints = result_slot_ints(shape)
        # Rows of a multiple of 4 words: each row's int64 step word is 16-byte aligned.
        width = -(-(2 + self.slot_ints) // 4) * 4
        self.results = torch.zeros(
            depth, width, dtype=torch.int32, pin_memory=True
        )  # [depth, width]: int64 step word, then the slot's int32 words
        self._resolve = _protocol_kernel("ddtree_channel_resolve", index)
        self._finish = _protocol_kernel("ddtree_channel_finish", index)
        if shape.op == ChannelOp.BUILD_TREE:
            self._prepare_build()
        else:
            self._prepare_accept()

    # ------------------------------------------------------------------ preparation

    def _prepare_build(self) -> None:
        shape, index = self.shape, self._index
        plan = device_build_tree_plan(
            shape.max_batch_size,
            shape.draft_len,
            shape.vocab_size,
            shape.max_budget,
            shape.logit_bytes,
            index,
        )
        self.plan = plan
        # The RPC path's variant macros (tree_cuda._build_kernel), plus the channel's op.
        defines = {"DDTREE_CHANNEL_OP": 1, "DDTREE_DTYPE": shape.logit_code, **plan.defines}
        self._topk = jit.get_kernel("channel.cu", "ddtree_channel_build_topk", defines, index)
        self._merge = jit.get_kernel("channel.cu", "ddtree_channel_build_merge", defines, index)
        self._select = jit.get_kernel("channel.cu", "ddtree_channel_build_select", defines, index)
        for kernel in (self._topk, self._merge, self._select):
            jit.set_max_dynamic_smem(kernel, max_dynamic_smem(index), index)
        self._scratch = build_scratch(plan, shape.max_batch_size * shape.draft_len, self.device)

    def _prepare_accept(self) -> None:
        shape, index = self.shape, self._index
        reads_logits = shape.vocab_size > 0
        self._accept_params = accept_launch_params(shape.max_batch_size, reads_logits=reads_logits)
        defines = {
            "DDTREE_CHANNEL_OP": 2,
            "DDTREE_DTYPE": shape.logit_code if reads_logits else 0,
            "ACCEPT_THREADS": self._accept_params.block[0],
            "COLS_PER_BLOCK": 64,
        }
        self._accept = jit.get_kernel("channel.cu", "ddtree_channel_accept", defines, index)
        self._commit = None
        if shape.has_kv:
            self._commit_params = commit_kv_launch_params(shape.max_batch_size, shape.kv_row_bytes)
            self._commit = jit.get_kernel("channel.cu", "ddtree_channel_commit_kv", defines, index)

    # ------------------------------------------------------------------ one step

    def result_slot(self, step: int) -> torch.Tensor:
        """The pinned result row of ``step`` (int32 view; words 0-1 hold the int64 step)."""
        return self.results[(step - 1) % self.depth]

    def enqueue_step(self, step: int) -> None:
        """Enqueue step ``step`` (1-based) on the current stream: wait for ``doorbell >= step``,
        resolve, the op's kernels, finish. Nothing here waits on the host."""
        from cuda.bindings import driver

        index = self._index
        jit._make_current(index)
        stream = torch.cuda.current_stream(index).cuda_stream
        # The doorbell's low word (little-endian), compared cyclically: 32-bit stream memory
        # operations are available on every device, the 64-bit ones only where the device says.
        (err,) = driver.cuStreamWaitValue32(
            driver.CUstream(stream),
            driver.CUdeviceptr(self.control.data_ptr() + DOORBELL_OFFSET),
            step & 0xFFFFFFFF,
            driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ,
        )
        if err != driver.CUresult.CUDA_SUCCESS:
            raise jit.CudaError(
                "cuStreamWaitValue32 on the channel's doorbell", result_name=err.name
            )
        ctrl = self.control.data_ptr()
        args = self.args.data_ptr()
        jit.launch(
            self._resolve,
            jit.LaunchParams((1, 1, 1), (_RESOLVE_THREADS, 1, 1)),
            ctrl,
            _i32(self.ring_size),
            _u64(step),
            self.config.data_ptr(),
            self.regions.data_ptr(),
            self.cancel.data_ptr(),
            args,
            self.budgets.data_ptr(),
            self.own_flags.data_ptr(),
            device=index,
        )
        if self.shape.op == ChannelOp.BUILD_TREE:
            self._launch_build(args)
        else:
            self._launch_accept(args)
        jit.launch(
            self._finish,
            jit.LaunchParams((1, 1, 1), (_FINISH_THREADS, 1, 1)),
            ctrl,
            _i32(self.ring_size),
            self.config.data_ptr(),
            args,
            self.result_slot(step).data_ptr(),
            device=index,
        )

    def _launch_build(self, args: int) -> None:
        shape, plan, index = self.shape, self.plan, self._index
        jit.launch(
            self._topk,
            plan.topk,
            args,
            _i32(shape.draft_len),
            _i32(shape.vocab_size),
            _i32(plan.span),
            _i32(plan.top_k),
            _i32(plan.cap),
            _i32(int(shape.is_vectorized)),
            self._scratch.part_keys,
            self._scratch.part_stats,
            _i32(int(plan.merge_here)),
            _i32(plan.sort_size),
            self._scratch.topk_lp,
            self._scratch.topk_tok,
            self._scratch.topk_count,
            self._scratch.row_ready,
            device=index,
        )
        if not plan.merge_here:
            jit.launch(
                self._merge,
                plan.merge,
                args,
                _i32(shape.draft_len),
                self._scratch.part_keys,
                self._scratch.part_stats,
                _i32(plan.num_parts),
                _i32(plan.top_k),
                _i32(plan.sort_size),
                _i32(shape.vocab_size),
                self._scratch.topk_lp,
                self._scratch.topk_tok,
                self._scratch.topk_count,
                device=index,
            )
        jit.launch(
            self._select,
            plan.select,
            args,
            self._scratch.topk_lp,
            self._scratch.topk_tok,
            self._scratch.topk_count,
            _i32(shape.vocab_size),
            _i32(shape.draft_len),
            _i32(plan.top_k),
            _i32(shape.num_nodes_max),
            _i32(mask_words(shape.num_nodes_max)),
            _i32(int(plan.lp_in_smem)),
            _i32(plan.wide_cap),
            _i32(plan.wide_min_budget),
            _i32(plan.wide_sort_size),
            self._scratch.row_ready,
            device=index,
        )

    def _launch_accept(self, args: int) -> None:
        shape, index = self.shape, self._index
        jit.launch(
            self._accept,
            self._accept_params,
            args,
            _i32(shape.num_nodes_max),
            _i32(shape.draft_len),
            _i32(shape.vocab_size),
            device=index,
        )
        if self._commit is not None:
            jit.launch(
                self._commit,
                self._commit_params,
                args,
                _i32(shape.num_pages),
                _i32(shape.page_size),
                _i32(shape.kv_row_bytes // 16),
                _i32(shape.max_pages),
                _i32(shape.draft_len + 1),
                device=index,
            )
