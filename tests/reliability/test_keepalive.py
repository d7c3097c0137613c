"""Connection keepalive: the server's gRPC keepalive and connection-lifetime settings are live.

Each test talks raw HTTP/2 to a real server over TCP (a peer that never answers pings, or one
that pings too often), so it sees exactly which frames the server sends and when it closes the
connection, and fails if a setting is not applied (gRPC's own defaults would send no ping for
two hours, never close an idle connection, and treat every ping without calls as a strike).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from helpers.serving import ServerThread

from ddtree.service.config import ServiceConfig
from ddtree.service.server import keepalive_options

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _PING, _GOAWAY = 4, 6, 7
_ACK = 1
_ENHANCE_YOUR_CALM = 11


def _frame(kind: int, flags: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + bytes(4) + payload


@dataclass
class Seen:
    """What the server sent a raw HTTP/2 peer, with seconds since the connection opened."""

    pings: list[float] = field(default_factory=list)
    goaway: tuple[float, int, bytes] | None = None
    """(time, error code, debug data) of the server's GOAWAY, if any."""
    closed_at: float | None = None


def raw_peer(address: str, seconds: float, *, ping_every_s: float | None = None) -> Seen:
    """Open an HTTP/2 connection without calls; never answer pings; optionally send our own.

    Returns once the server closes the connection or after ``seconds``.
    """
    host, _, port = address.rpartition(":")
    seen = Seen()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(_PREFACE + _frame(_SETTINGS, 0))
        sock.settimeout(0.02)
        started = time.monotonic()
        next_ping = started if ping_every_s is not None else float("inf")
        buffer = b""
        while (now := time.monotonic()) - started < seconds:
            if now >= next_ping and ping_every_s is not None:
                try:
                    sock.sendall(_frame(_PING, 0, struct.pack(">Q", int(now * 1e6))))
                except OSError:  # the server closed the connection
                    seen.closed_at = now - started
                    return seen
                next_ping = now + ping_every_s
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                seen.closed_at = time.monotonic() - started
                return seen
            if not data:
                seen.closed_at = time.monotonic() - started
                return seen
            buffer += data
            while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
                length = int.from_bytes(buffer[:3], "big")
                kind, flags, payload = buffer[3], buffer[4], buffer[9 : 9 + length]
                buffer = buffer[9 + length :]
                at = time.monotonic() - started
                if kind == _SETTINGS and not flags & _ACK:
                    sock.sendall(_frame(_SETTINGS, _ACK))
                elif kind == _PING and not flags & _ACK:
                    seen.pings.append(at)  # and never acknowledged
                elif kind == _GOAWAY and seen.goaway is None:
                    code = int.from_bytes(payload[4:8], "big")
                    seen.goaway = (at, code, payload[8:])
    return seen


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    started: list[ServerThread] = []

    def start(**settings: object) -> str:
        config = ServiceConfig(listen=("127.0.0.1:0",), device="cpu", **settings)  # type: ignore[arg-type]
        thread = ServerThread(config, warm_up=False)
        started.append(thread)
        return thread.start()[0]

    yield start
    for thread in started:
        thread.stop()


def test_a_peer_that_stops_answering_pings_is_dropped(serve: Callable[..., str]) -> None:
    """keepalive_time_s / keepalive_timeout_s: the server pings an idle connection, and closes
    it when the ping goes unanswered."""
    address = serve(keepalive_time_s=0.3, keepalive_timeout_s=0.5)
    seen = raw_peer(address, 10.0)
    assert seen.pings, "the server sent no keepalive ping"
    assert 0.2 <= seen.pings[0] <= 3.0, seen
    assert seen.closed_at is not None, f"connection still open after 10 s: {seen}"
    assert seen.closed_at - seen.pings[0] >= 0.4, seen  # not before the ping's timeout
    assert seen.closed_at <= 6.0, seen


def test_idle_connection_closed_after_max_connection_idle(serve: Callable[..., str]) -> None:
    address = serve(max_connection_idle_s=0.5)
    seen = raw_peer(address, 10.0)
    assert seen.goaway is not None, f"no GOAWAY within 10 s: {seen}"
    assert 0.4 <= seen.goaway[0] <= 5.0, seen
    assert b"idle" in seen.goaway[2], seen  # gRPC's "connection idle"; clients reconnect


def test_client_pings_within_the_policy_keep_the_connection(serve: Callable[..., str]) -> None:
    """keepalive_permit_without_calls and keepalive_min_ping_interval_s: a client that pings an
    idle connection no faster than allowed is not struck out (gRPC's defaults would send it
    GOAWAY too_many_pings within about a second)."""
    address = serve(keepalive_min_ping_interval_s=0.1)
    seen = raw_peer(address, 2.5, ping_every_s=0.2)
    assert seen.goaway is None and seen.closed_at is None, seen


def test_ping_flood_gets_goaway_too_many_pings(serve: Callable[..., str]) -> None:
    """With the defaults (10 s minimum interval, 2 strikes) a peer pinging every 50 ms is told
    GOAWAY ENHANCE_YOUR_CALM ``too_many_pings`` and disconnected."""
    address = serve()
    seen = raw_peer(address, 5.0, ping_every_s=0.05)
    assert seen.goaway is not None, f"no GOAWAY within 5 s: {seen}"
    assert seen.goaway[1] == _ENHANCE_YOUR_CALM, seen
    assert seen.goaway[2] == b"too_many_pings", seen
    assert seen.goaway[0] <= 2.0, seen


def test_unlimited_strikes_tolerate_the_flood(serve: Callable[..., str]) -> None:
    address = serve(keepalive_max_ping_strikes=0)
    seen = raw_peer(address, 1.5, ping_every_s=0.05)
    assert seen.goaway is None and seen.closed_at is None, seen


def test_keepalive_options_name_grpc_channel_arguments() -> None:
    options = dict(keepalive_options(ServiceConfig()))
    assert options == {
        "grpc.keepalive_time_ms": 60_000,
        "grpc.keepalive_timeout_ms": 20_000,
        "grpc.http2.ping_timeout_ms": 20_000,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
        "grpc.http2.min_ping_interval_without_data_ms": 10_000,
        "grpc.http2.max_ping_strikes": 2,
    }
    aged = dict(keepalive_options(ServiceConfig(max_connection_age_s=600, max_connection_idle_s=5)))
    assert aged["grpc.max_connection_age_ms"] == 600_000
    assert aged["grpc.max_connection_age_grace_ms"] == 30_000
    assert aged["grpc.max_connection_idle_ms"] == 5_000


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"keepalive_time_s": 0}, "keepalive_time_s: expected > 0"),
        ({"keepalive_timeout_s": float("nan")}, "keepalive_timeout_s: expected > 0"),
        ({"keepalive_max_ping_strikes": -1}, "keepalive_max_ping_strikes: expected >= 0"),
        ({"max_connection_idle_s": -1.0}, "max_connection_idle_s: expected >= 0"),
        ({"max_connection_age_s": 3e6}, "max_connection_age_s: expected at most"),
    ],
)
def test_bad_keepalive_settings_name_the_field(settings: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServiceConfig(**settings)  # type: ignore[arg-type]
