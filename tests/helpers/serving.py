"""A real ddtree gRPC server on its own event-loop thread, for tests with synchronous clients."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import grpc

from ddtree.service.config import ServiceConfig
from ddtree.service.engine import Engine, EngineObserver
from ddtree.service.server import CallObserver, Server, create_server

__all__ = ["LogWatcher", "ServerThread"]

_T = TypeVar("_T")


class ServerThread:
    """Runs ``create_server(config)`` in a background event loop until ``stop()``; as a context
    manager, ``start()`` on entry and ``stop()`` on exit.

    Parameters
    ----------
    config : ServiceConfig
        Use port 0 and/or a Unix socket under ``tmp_path``.
    warm_up : bool
        Whether ``start`` warms the engine up and reports SERVING (else it stays NOT_SERVING).
    call_observer, engine_observer, engine, interceptors
        Passed to ``create_server``.
    """

    def __init__(
        self,
        config: ServiceConfig,
        *,
        warm_up: bool = True,
        call_observer: CallObserver | None = None,
        engine_observer: EngineObserver | None = None,
        engine: Engine | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self._config = config
        self._warm_up = warm_up
        self._kwargs: dict[str, Any] = {
            "call_observer": call_observer,
            "engine_observer": engine_observer,
            "engine": engine,
            "interceptors": interceptors,
        }
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.server: Server | None = None
        self.addresses: list[str] = []

    def start(self) -> list[str]:
        """Start the loop and the server; returns the bound addresses."""
        self._thread.start()

        async def start() -> Server:
            server, addresses = create_server(self._config, **self._kwargs)
            self.addresses = addresses
            await server.start(warm_up=self._warm_up)
            return server

        self.server = self.run(start())
        return self.addresses

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def stop(self, grace_s: float = 0.0) -> None:
        """Drain and stop the server, then the loop. Idempotent."""
        if self.server is not None:
            self.run(self.server.stop(grace_s))
            self.server = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


class LogWatcher:
    """Collects a subprocess's text stream on a thread; tests wait for lines, never sleep."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._condition = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            with self._condition:
                self.lines.append(line.rstrip("\n"))
                self._condition.notify_all()
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def wait_for(self, text: str, timeout_s: float = 60.0) -> str:
        """Block until a line containing ``text`` arrives; fail if the stream ends first."""

        def found() -> bool:
            return self._closed or any(text in line for line in self.lines)

        with self._condition:
            if not self._condition.wait_for(found, timeout_s):
                raise TimeoutError(f"no line with {text!r} in {timeout_s} s: {self.lines[-20:]}")
            for line in self.lines:
                if text in line:
                    return line
        raise AssertionError(f"stream ended without {text!r}: {self.lines[-20:]}")

    def join(self) -> None:
        """Wait until the stream has ended (the process exited and its pipe drained)."""
        self._thread.join()

    def text(self) -> str:
        """Everything read so far."""
        with self._condition:
            return "\n".join(self.lines)
