"""Fixtures of the service tests: a real server on port 0 or a Unix socket, and clients."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.serving import ServerThread

from ddtree.clients import Client
from ddtree.service.config import ServiceConfig


def listen_address(transport: str, tmp_path: Path) -> str:
    """Port 0 on loopback, or a socket file in the test's temporary directory."""
    return "127.0.0.1:0" if transport == "tcp" else f"unix:{tmp_path / 'ddtree.sock'}"


@pytest.fixture(params=["tcp", "unix"])
def transport(request: pytest.FixtureRequest) -> str:
    """Each test using it runs over loopback TCP and over a Unix socket."""
    return str(request.param)


@pytest.fixture
def server(transport: str, tmp_path: Path) -> Iterator[ServerThread]:
    """A warmed-up server on ``transport`` with default limits."""
    thread = ServerThread(
        ServiceConfig(listen=(listen_address(transport, tmp_path),), device="cpu")
    )
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    """A sync client of ``server``."""
    with Client(server.addresses[0], default_timeout_s=30.0) as connected:
        yield connected
