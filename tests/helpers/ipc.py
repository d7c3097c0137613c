"""Test doubles and processes for registered-memory tests.

``HostMapper`` is an ``IpcMapper`` over host memory: a "handle" names a bytearray that a test
"caller" owns, and views are CPU tensors over it, so the region table, leases, references and
the engine's reference path run without a GPU, and writes through views land in the caller's
bytes exactly as they would in IPC-mapped device memory. ``ServerProcess`` runs ``ddtree serve``
in its own process, as in production, for the GPU tests.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddtree.service.errors import IpcOpenFailed
from helpers.serving import LogWatcher

__all__ = ["HostMapper", "ServerProcess"]


class HostMapper:
    """``IpcMapper`` whose allocations are host buffers registered with ``export``."""

    def __init__(self) -> None:
        self._buffers: dict[bytes, torch.Tensor] = {}  # handle -> [byte_size] uint8
        self._open: dict[int, bytes] = {}  # pointer -> handle
        self.opened: list[bytes] = []
        self.closed: list[int] = []
        self.events_opened: list[bytes] = []
        self.events_closed: list[Any] = []
        self.waits: list[tuple[Any, int]] = []

    def export(self, buffer: torch.Tensor) -> bytes:
        """A 64-byte handle naming ``buffer`` (a CPU uint8 tensor, the "allocation")."""
        handle = os.urandom(64)
        self._buffers[handle] = buffer
        return handle

    def open_memory(self, handle: bytes) -> tuple[int, int]:
        buffer = self._buffers.get(handle)
        if buffer is None:
            raise IpcOpenFailed("register_memory.ipc_handle: cuIpcOpenMemHandle failed (test)")
        self.opened.append(handle)
        pointer = buffer.data_ptr() + len(self.opened)  # distinct per open, like a new mapping
        self._open[pointer] = handle
        return pointer, buffer.numel()

    def close_memory(self, pointer: int) -> None:
        del self._open[pointer]
        self.closed.append(pointer)

    def open_event(self, handle: bytes) -> Any:
        self.events_opened.append(handle)
        return ("event", handle)

    def wait_event(self, event: Any, stream: int) -> None:
        self.waits.append((event, stream))

    def close_event(self, event: Any) -> None:
        self.events_closed.append(event)

    def as_bytes(self, pointer: int, byte_size: int, device: torch.device) -> torch.Tensor:
        return self._buffers[self._open[pointer]][:byte_size]

    def release(self) -> None:
        return None

    @property
    def mapped(self) -> int:
        """Mappings open now."""
        return len(self._open)


class ServerProcess:
    """``python -m ddtree.service serve`` on a Unix socket, until ``stop``.

    Parameters
    ----------
    socket : Path
        Socket path to listen on.
    args : str
        Extra ``serve`` flags.
    """

    def __init__(self, socket: Path, *args: str) -> None:
        self.address = f"unix:{socket}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ddtree.service",
                "serve",
                "--listen",
                self.address,
                "--device",
                "cuda:0",
                "--log-level",
                "DEBUG",
                *args,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log = LogWatcher(self.process.stderr)

    def wait_serving(self, timeout_s: float = 300.0) -> ServerProcess:
        """Block until the server reports SERVING."""
        self.log.wait_for("event=serving", timeout_s)
        return self

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and drain its log."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.join()
        if self.process.stderr is not None:
            self.process.stderr.close()


@contextlib.contextmanager
def serving(socket: Path, *args: str) -> Iterator[ServerProcess]:
    """A ``ServerProcess`` on ``socket`` (``args``: extra ``serve`` flags) that is serving,
    stopped when the block ends, also when it fails."""
    process = ServerProcess(socket, *args)
    try:
        yield process.wait_serving()
    finally:
        process.stop()
