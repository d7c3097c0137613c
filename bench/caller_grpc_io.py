"""The benchmarks' callers run with the server's gRPC I/O, as a deployed caller should.

``ddtree serve`` serves its sockets with gRPC's polling I/O by default (``--grpc-io``,
``DDTREE_GRPC_IO``; docs/ipc.md). gRPC reads the choice from ``GRPC_EXPERIMENTS`` once, when it
is imported, so a caller process must start with it: ``restart_with_server_grpc_io()`` starts
this script again with it in the environment, unless it is already there (or
``DDTREE_GRPC_IO=event-engine``). The server the benchmark starts inherits the same variables.
"""

from __future__ import annotations

import os
import sys

from ddtree.service.config import ServiceConfig


def restart_with_server_grpc_io() -> None:
    """Replace this process by the same command with ``GRPC_EXPERIMENTS`` set; returns when
    nothing is to change. Call it first thing under ``if __name__ == "__main__"``."""
    env = ServiceConfig.from_env().grpc_environment()
    if env:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
