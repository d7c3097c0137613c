"""One GPU doorbell channel's device work, in a process of its own (``ddtree.service.channel``).

Why a process: a channel keeps steps enqueued that wait on the caller's doorbell for as long as
the caller is idle. In the server's own CUDA context such waits would stall every
device-synchronising call of the server (``cuIpcCloseMemHandle`` when a region is unregistered,
``cudaFree``, ``cudaDeviceSynchronize``) and every stream that shares a hardware queue with a
waiting stream. A process has its own context: its waits stall nothing of the server's, and
the only streams in it are the channel's and one control stream, created one after the other
so that they use different hardware queues.

Protocol with the server (``_ChannelProcess``): one JSON line on stdin describes the channel
(device, shape, ring size, depth, the IPC handles and windows of the control block and of the
regions); the worker answers ``{"ready": true}`` or ``{"error": ...}`` on stdout, then one line
per finished step ``{"s": step, "st": status, "b": batch, "op": op, "v": [int32 results]}``
(the metrics the server feeds), and ``{"closed": reason}`` last. A line ``close <reason>`` on
stdin, or stdin's end (the server is gone), closes the channel: its control block is marked
CLOSED, the enqueued steps fail with status CLOSED (they run nothing), the stream drains, the
process exits.

Run as ``python -m ddtree.service.channel_worker``; not a public interface.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

__all__ = ["main"]

_log = logging.getLogger(__name__)

_BUSY_POLL_S = 20e-6
_IDLE_POLL_S = 1e-3
_BUSY_WINDOW_S = 0.05
_DRAIN_TIMEOUT_S = 5.0


class _Closer:
    """Reads stdin: a ``close`` line or end of input requests the close."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.wake = threading.Event()
        threading.Thread(target=self._read, name="ddtree-channel-stdin", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            if line.startswith("close"):
                self.request(line[len("close") :].strip() or "closed")
                return
        self.request("server_gone")

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.wake.set()


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _map(spec: dict[str, Any]) -> tuple[Any, Any, list[tuple[int, int]]]:
    """Open the IPC handles once each; returns (device, control view, region table)."""
    import torch

    from ddtree.kernels.channel import control_block_bytes
    from ddtree.service.memory import CudaIpcMapper

    device = torch.device("cuda", int(spec["device_index"]))
    torch.cuda.set_device(device)
    mapper = CudaIpcMapper(device)
    opened: dict[str, tuple[int, int]] = {}

    def window(entry: dict[str, Any], field: str) -> tuple[int, int]:
        handle = entry["ipc_handle"]
        if handle not in opened:
            opened[handle] = mapper.open_memory(bytes.fromhex(handle))
        pointer, size = opened[handle]
        offset, byte_size = int(entry["offset_bytes"]), int(entry["byte_size"])
        if offset > size or byte_size > size - offset:
            raise ValueError(
                f"{field}: window [{offset}, {offset + byte_size}) lies outside the allocation "
                f"the IPC handle names ({size} bytes); send the handle of the region's allocation"
            )
        return pointer + offset, byte_size

    ring_size = int(spec["ring_size"])
    control_pointer, control_size = window(spec["control"], "open_channel.control")
    control = mapper.as_bytes(control_pointer, control_size, device)[
        : control_block_bytes(ring_size)
    ]
    regions = [window(r, f"open_channel.regions[{i}]") for i, r in enumerate(spec["regions"])]
    return device, control, regions


def _run(spec: dict[str, Any]) -> str:
    import torch

    from ddtree.kernels.channel import (
        DOORBELL_OFFSET,
        STATE_OFFSET,
        ChannelOp,
        ChannelShape,
        ChannelState,
    )
    from ddtree.kernels.channel_cuda import ChannelDevice, create_stream, write_values

    shape = ChannelShape(**{**spec["shape"], "op": ChannelOp(spec["shape"]["op"])})
    device, control, regions = _map(spec)
    index = device.index or 0
    # The channel's stream and the control stream, one after the other: different hardware
    # queues, so that a control write never queues behind a doorbell wait.
    stream_handle = create_stream(index)
    control_stream = create_stream(index)
    depth = int(spec["depth"])
    dev = ChannelDevice(shape, control, int(spec["ring_size"]), regions, depth, device)
    torch.cuda.current_stream(device).synchronize()
    closer = _Closer()
    stream = torch.cuda.ExternalStream(stream_handle, device=device)
    enqueued = done = 0
    last_progress = time.monotonic()
    with torch.cuda.stream(stream):
        while enqueued < depth:
            enqueued += 1
            dev.enqueue_step(enqueued)
        _emit({"ready": True})
        while closer.reason is None:
            slot = dev.result_slot(done + 1)
            if int(slot[:2].view(torch.int64)[0]) == done + 1:
                done += 1
                words = slot[2 : 2 + dev.slot_ints].tolist()
                _emit({"s": done, "st": words[0], "b": words[1], "op": words[2], "v": words[4:]})
                enqueued += 1
                dev.enqueue_step(enqueued)
                last_progress = time.monotonic()
                continue
            busy = time.monotonic() - last_progress < _BUSY_WINDOW_S
            closer.wake.wait(_BUSY_POLL_S if busy else _IDLE_POLL_S)
    reason = closer.reason or "closed"
    ctrl = dev.control.data_ptr()
    # The enqueued steps' resolve reads the cancel word: status CLOSED, no op runs. The caller's
    # next post sees the CLOSED state and completes at once.
    write_values(
        index,
        [(dev.cancel.data_ptr(), 1, 32), (ctrl + STATE_OFFSET, int(ChannelState.CLOSED), 32)],
        control_stream,
    )
    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    while not stream.query():
        # Raise the doorbell past every enqueued step (again, in case a post that read OPEN
        # before the state changed wrote a smaller value meanwhile).
        write_values(index, [(ctrl + DOORBELL_OFFSET, enqueued & 0xFFFFFFFF, 32)], control_stream)
        if time.monotonic() > deadline:
            return f"{reason}; drain timed out"
        time.sleep(1e-3)
    return reason


def main() -> None:
    """Serve one channel described by the first line of stdin (see the module docstring)."""
    logging.basicConfig(
        level=os.environ.get("DDTREE_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    spec = json.loads(sys.stdin.readline())
    try:
        reason = _run(spec)
    except Exception as err:  # reported to the server, which refuses or closes the channel
        _log.exception("event=channel_worker_failed")
        _emit({"error": f"{type(err).__name__}: {err}"})
        sys.exit(1)
    _emit({"closed": reason})


if __name__ == "__main__":
    main()
