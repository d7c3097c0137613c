"""Server configuration: one frozen dataclass, filled from ``DDTREE_*`` env vars and CLI flags.

This is the only module that reads the environment. Precedence: command-line flag, then the
environment variable, then the default. Every variable has a flag:

=================================  ===========================  ===============================
environment variable               flag                         default
=================================  ===========================  ===============================
``DDTREE_LISTEN`` (comma list)     ``--listen`` (repeatable)    ``127.0.0.1:50051``
``DDTREE_MAX_MESSAGE_BYTES``       ``--max-message-bytes``      512 MiB
``DDTREE_MAX_TENSOR_BYTES``        ``--max-tensor-bytes``       512 MiB
``DDTREE_MAX_BATCH_SIZE``          ``--max-batch-size``         1024
``DDTREE_MAX_CONCURRENT_CALLS``    ``--max-concurrent-calls``   64
``DDTREE_GRACE_S``                 ``--grace-s``                10
``DDTREE_REQUEST_DEADLINE_CAP_S``  ``--request-deadline-cap-s``  30
``DDTREE_DEVICE``                  ``--device``                 ``auto``
``DDTREE_BACKEND``                 ``--backend``                ``auto``
``DDTREE_LOG_LEVEL``               ``--log-level``              ``INFO``
``DDTREE_CACHE_DIR``               ``--cache-dir``              (kernel cache default)
``DDTREE_DISABLE_JIT``             ``--disable-jit``            off
``DDTREE_METRICS_PORT``            ``--metrics-port``           off
``DDTREE_METRICS_HOST``            ``--metrics-host``           ``127.0.0.1``
``DDTREE_MAX_REGISTERED_REGIONS``  ``--max-registered-regions``  1024
``DDTREE_MAX_REGISTERED_BYTES``    ``--max-registered-bytes``   1 TiB
``DDTREE_MEMORY_IDLE_TIMEOUT_S``   ``--memory-idle-timeout-s``  600
``DDTREE_MAX_CHANNELS``            ``--max-channels``           16 (0: no doorbell channels)
``DDTREE_TLS_CERT``                ``--tls-cert``               off (plain-text TCP)
``DDTREE_TLS_KEY``                 ``--tls-key``                off
``DDTREE_TLS_CLIENT_CA``           ``--tls-client-ca``          off (no client certificates)
``DDTREE_UNIX_SOCKET_MODE``        ``--unix-socket-mode``       ``0660``
``DDTREE_GRPC_IO``                 ``--grpc-io``                ``polling``
=================================  ===========================  ===============================

``DDTREE_MAX_CONCURRENT_CALLS_PER_CLIENT`` / ``--max-concurrent-calls-per-client``: 0 (no limit).
``DDTREE_BIND_REGIONS_TO_CLIENT`` / ``--bind-regions-to-client`` (``--no-bind-regions-to-client``):
on. ``DDTREE_MAX_REGIONS_PER_CLIENT`` / ``--max-regions-per-client`` and
``DDTREE_MAX_REGISTERED_BYTES_PER_CLIENT`` / ``--max-registered-bytes-per-client``: 0 (no
per-client limit beyond the server-wide ones).

Connection keepalive (gRPC channel arguments of the server; ``0`` turns the last three off):

==========================================  ======================================  ========
environment variable                        flag                                    default
==========================================  ======================================  ========
``DDTREE_KEEPALIVE_TIME_S``                 ``--keepalive-time-s``                  60
``DDTREE_KEEPALIVE_TIMEOUT_S``              ``--keepalive-timeout-s``               20
``DDTREE_KEEPALIVE_PERMIT_WITHOUT_CALLS``   ``--keepalive-permit-without-calls``    on
``DDTREE_KEEPALIVE_MIN_PING_INTERVAL_S``    ``--keepalive-min-ping-interval-s``     10
``DDTREE_KEEPALIVE_MAX_PING_STRIKES``       ``--keepalive-max-ping-strikes``        2
``DDTREE_MAX_CONNECTION_IDLE_S``            ``--max-connection-idle-s``             0 (off)
``DDTREE_MAX_CONNECTION_AGE_S``             ``--max-connection-age-s``              0 (off)
``DDTREE_MAX_CONNECTION_AGE_GRACE_S``       ``--max-connection-age-grace-s``        30
==========================================  ======================================  ========
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

__all__ = [
    "ENV_PREFIX",
    "POLLING_GRPC_EXPERIMENTS",
    "ServiceConfig",
    "add_arguments",
    "config_from_args",
    "grpc_experiments",
    "parse_listen",
]

ENV_PREFIX = "DDTREE_"
"""Prefix of every environment variable ddtree reads."""

_MIB = 1 << 20
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda:\d+)$")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_BACKENDS = ("auto", "cuda", "reference")
_GRPC_IO_MODES = ("polling", "event-engine")
POLLING_GRPC_EXPERIMENTS = ("-event_engine_client", "-event_engine_listener")
"""The ``GRPC_EXPERIMENTS`` entries of ``grpc_io="polling"``: gRPC core's sockets served without
its EventEngine, by the threads that wait for completions."""
_GRPC_MAX_MESSAGE_BYTES = (1 << 31) - 1  # gRPC's own ceiling (int32 lengths)
_GRPC_MAX_MILLISECONDS = (1 << 31) - 1  # gRPC channel arguments are C ints


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the server and engine need, validated on construction.

    Attributes
    ----------
    listen : tuple of str
        Addresses to serve on: ``host:port`` (port 0 picks a free port) or ``unix:/abs/path``.
    max_message_bytes : int
        Largest request or response message, bytes, ``1 MiB .. 2 GiB - 1``.
    max_tensor_bytes : int
        Largest single tensor of a request, bytes, ``>= 1``.
    max_batch_size : int
        Largest ``batch_size`` of one call, ``>= 1``.
    max_concurrent_calls : int
        Calls served at once; more get RESOURCE_EXHAUSTED (``OVERLOADED``), ``>= 1``.
    grace_s : float
        Seconds in-flight calls get to finish after SIGTERM, ``>= 0``.
    request_deadline_cap_s : float
        Every call's deadline is capped at this many seconds (also the deadline of calls that
        carry none), ``> 0``.
    device : str
        ``"auto"`` (first GPU if any, else CPU), ``"cpu"`` or ``"cuda:N"``.
    backend : str
        ``"auto"``, ``"cuda"`` or ``"reference"`` (see ``ddtree.kernels``).
    log_level : str
        ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or ``CRITICAL``.
    cache_dir : Path, optional
        Directory of the compiled-kernel cache; ``None`` for the kernels' default.
    disable_jit : bool
        Whether a kernel-cache miss is an error instead of a compile (pre-baked images).
    metrics_port : int, optional
        TCP port of the Prometheus endpoint, ``0..65535``; ``None`` serves no metrics.
    metrics_host : str
        Address the Prometheus endpoint binds: ``127.0.0.1`` (loopback) or ``0.0.0.0`` (every
        interface, as in a pod).
    max_registered_regions : int
        Caller memory regions registered at once (RegisterMemory), ``>= 1``.
    max_registered_bytes : int
        Sum of the registered regions' bytes, ``>= 1``.
    memory_idle_timeout_s : float
        A registered region no call used for this long expires (releases the mapping of
        callers that exited without unregistering), ``> 0``.
    max_channels : int
        GPU doorbell channels open at once (OpenChannel; each runs a worker process with a CUDA
        context of its own), ``>= 0``; ``0`` offers none.
    tls_cert : Path, optional
        PEM certificate chain of the TCP listeners; with ``tls_key`` they serve TLS only.
    tls_key : Path, optional
        PEM private key of ``tls_cert``.
    tls_client_ca : Path, optional
        PEM CA bundle; when set, TCP clients must present a certificate it signed (mTLS).
    unix_socket_mode : int
        Permission bits of Unix sockets, ``0 .. 0o777`` (``0o660``: owner and group connect).
    grpc_io : str
        How gRPC core serves the sockets: ``"polling"`` (the thread that waits for a completion
        polls the socket itself: gRPC's experiments ``event_engine_client`` and
        ``event_engine_listener`` off) or ``"event-engine"`` (gRPC's default: EventEngine
        threads read the socket and hand each completion over). On the H200 host polling took
        0.14-0.39 ms off each call (docs/ipc.md, session 37). gRPC reads the setting once, when
        it is imported, so ``ddtree serve`` applies it before importing gRPC (see
        ``grpc_environment``); a name in ``GRPC_EXPERIMENTS`` wins over it.
    max_concurrent_calls_per_client : int
        Calls one client identity (certificate subject, peer IP, or ``unix``) may have in
        flight; more get RESOURCE_EXHAUSTED (``OVERLOADED``); ``0`` for no per-client limit.
    bind_regions_to_client : bool
        Whether a registered region is bound to the client identity that registered it: calls
        of another identity that use, list or unregister its token get NOT_FOUND
        (``MEMORY_TOKEN_NOT_FOUND``), as for an unknown token. Every Unix-socket caller has the
        identity ``unix``, so there the socket's mode and group are the boundary.
    max_regions_per_client : int
        Regions one client identity may have registered at once, ``>= 0``; more get
        RESOURCE_EXHAUSTED (``MEMORY_LIMIT_EXCEEDED``); ``0`` for no per-client limit.
    max_registered_bytes_per_client : int
        Sum of one client identity's registered bytes, ``>= 0``; ``0`` for no per-client limit.
    keepalive_time_s : float
        The server pings a connection after this many seconds without activity on it, ``> 0``
        (``grpc.keepalive_time_ms``).
    keepalive_timeout_s : float
        A ping unanswered for this long closes the connection and cancels its calls, ``> 0``
        (``grpc.keepalive_timeout_ms``): a caller whose host vanished frees its slots after
        ``keepalive_time_s + keepalive_timeout_s`` at most.
    keepalive_permit_without_calls : bool
        Whether clients may send keepalive pings on connections without calls
        (``grpc.keepalive_permit_without_calls``): sidecar callers keep idle connections open.
    keepalive_min_ping_interval_s : float
        Client pings closer together than this (without data) count as strikes, ``>= 0``
        (``grpc.http2.min_ping_interval_without_data_ms``).
    keepalive_max_ping_strikes : int
        Strikes after which the server closes the connection with GOAWAY ``too_many_pings``,
        ``>= 0``; ``0`` for unlimited (``grpc.http2.max_ping_strikes``).
    max_connection_idle_s : float
        A connection without calls for this long is closed gracefully (GOAWAY; the client
        reconnects on its next call), ``>= 0``; ``0`` for never (``grpc.max_connection_idle_ms``).
    max_connection_age_s : float
        A connection older than this is closed gracefully (spreads callers over replicas behind
        a load balancer), ``>= 0``; ``0`` for never (``grpc.max_connection_age_ms``).
    max_connection_age_grace_s : float
        Seconds calls in flight get after ``max_connection_age_s`` before the connection is
        closed, ``>= 0`` (``grpc.max_connection_age_grace_ms``).
    """

    listen: tuple[str, ...] = ("127.0.0.1:50051",)
    max_message_bytes: int = 512 * _MIB
    max_tensor_bytes: int = 512 * _MIB
    max_batch_size: int = 1024
    max_concurrent_calls: int = 64
    grace_s: float = 10.0
    request_deadline_cap_s: float = 30.0
    device: str = "auto"
    backend: str = "auto"
    log_level: str = "INFO"
    cache_dir: Path | None = None
    disable_jit: bool = False
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    max_registered_regions: int = 1024
    max_registered_bytes: int = 1 << 40
    memory_idle_timeout_s: float = 600.0
    max_channels: int = 16
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    unix_socket_mode: int = 0o660
    grpc_io: str = "polling"
    max_concurrent_calls_per_client: int = 0
    bind_regions_to_client: bool = True
    max_regions_per_client: int = 0
    max_registered_bytes_per_client: int = 0
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    keepalive_permit_without_calls: bool = True
    keepalive_min_ping_interval_s: float = 10.0
    keepalive_max_ping_strikes: int = 2
    max_connection_idle_s: float = 0.0
    max_connection_age_s: float = 0.0
    max_connection_age_grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.listen:
            raise ValueError("listen: expected at least one address, got none")
        for address in self.listen:
            parse_listen(address)
        if not _MIB <= self.max_message_bytes <= _GRPC_MAX_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes: expected {_MIB}..{_GRPC_MAX_MESSAGE_BYTES}, "
                f"got {self.max_message_bytes}"
            )
        for name in (
            "max_tensor_bytes",
            "max_batch_size",
            "max_concurrent_calls",
            "max_registered_regions",
            "max_registered_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s: expected >= 0, got {self.grace_s}")
        if not self.request_deadline_cap_s > 0:
            raise ValueError(
                f"request_deadline_cap_s: expected > 0, got {self.request_deadline_cap_s}"
            )
        if not _DEVICE_RE.match(self.device):
            raise ValueError(f"device: expected 'auto', 'cpu' or 'cuda:N', got {self.device!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {_BACKENDS}, got {self.backend!r}")
        if self.log_level not in _LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {_LOG_LEVELS}, got {self.log_level!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: expected 0..65535, got {self.metrics_port}")
        if self.max_channels < 0:
            raise ValueError(f"max_channels: expected >= 0, got {self.max_channels}")
        if not self.memory_idle_timeout_s > 0:
            raise ValueError(
                f"memory_idle_timeout_s: expected > 0, got {self.memory_idle_timeout_s}"
            )
        if not self.metrics_host:
            raise ValueError("metrics_host: expected an address such as 127.0.0.1, got ''")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert, tls_key: expected both (TLS) or neither (plain text)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca: client certificates need TLS; set tls_cert, tls_key")
        if self.grpc_io not in _GRPC_IO_MODES:
            raise ValueError(f"grpc_io: expected one of {_GRPC_IO_MODES}, got {self.grpc_io!r}")
        if not 0 <= self.unix_socket_mode <= 0o777:
            raise ValueError(
                f"unix_socket_mode: expected 0..0o777, got {oct(self.unix_socket_mode)}"
            )
        for name in (
            "max_concurrent_calls_per_client",
            "max_regions_per_client",
            "max_registered_bytes_per_client",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0 (0: no limit), got {getattr(self, name)}")
        for name in ("keepalive_time_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected > 0, got {getattr(self, name)}")
        for name in (
            "keepalive_min_ping_interval_s",
            "keepalive_max_ping_strikes",
            "max_connection_idle_s",
            "max_connection_age_s",
            "max_connection_age_grace_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: expected >= 0 (0: off), got {getattr(self, name)}")
        for name in (
            "keepalive_time_s",
            "keepalive_timeout_s",
            "keepalive_min_ping_interval_s",
            "max_connection_idle_s",
            "max_connection_age_s",
            "max_connection_age_grace_s",
        ):
            if getattr(self, name) * 1000 > _GRPC_MAX_MILLISECONDS:
                raise ValueError(
                    f"{name}: expected at most {_GRPC_MAX_MILLISECONDS // 1000} s, "
                    f"got {getattr(self, name)}"
                )

    def kernel_environment(self) -> dict[str, str]:
        """The ``DDTREE_*`` variables ``ddtree.kernels.jit`` reads, as set by this config.

        The kernel layer reads its two settings from the process environment; the server
        exports them there before the engine starts so that ``--cache-dir`` and
        ``--disable-jit`` take effect.
        """
        env = {"DDTREE_DISABLE_JIT": "1" if self.disable_jit else "0"}
        if self.cache_dir is not None:
            env["DDTREE_CACHE_DIR"] = str(self.cache_dir)
        return env

    def grpc_environment(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables to set before gRPC is imported so that it serves as ``grpc_io`` says.

        Parameters
        ----------
        environ : Mapping[str, str], optional
            The environment gRPC would start with; ``os.environ`` by default.

        Returns
        -------
        dict of str to str
            ``{"GRPC_EXPERIMENTS": ...}``, the given list with the polling entries appended, or
            ``{}`` when nothing is to change: ``"event-engine"`` (gRPC's default), or every
            experiment concerned already named in ``GRPC_EXPERIMENTS`` (on or off: the
            operator's choice wins).
        """
        if self.grpc_io != "polling":
            return {}
        current = [item.strip() for item in grpc_experiments(environ).split(",")]
        current = [item for item in current if item]
        named = {item.lstrip("-") for item in current}
        missing = [item for item in POLLING_GRPC_EXPERIMENTS if item.lstrip("-") not in named]
        return {"GRPC_EXPERIMENTS": ",".join(current + missing)} if missing else {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServiceConfig:
        """Build a config from ``DDTREE_*`` variables (``os.environ`` by default).

        Raises
        ------
        ValueError
            A variable does not parse or is out of range; the message names it.
        """
        return config_from_args([], environ)


def grpc_experiments(environ: Mapping[str, str] | None = None) -> str:
    """``GRPC_EXPERIMENTS`` of ``environ`` (``os.environ`` by default), ``""`` when unset: the
    experiments gRPC turns on (a bare name) or off (``-name``) when it is imported."""
    env = os.environ if environ is None else environ
    return env.get("GRPC_EXPERIMENTS", "")


def parse_listen(address: str) -> tuple[str, str]:
    """Split a listen address into ``("tcp", "host:port")`` or ``("unix", "/path")``.

    Raises
    ------
    ValueError
        Neither ``host:port`` with a port in ``0..65535`` nor ``unix:/absolute/path``.
    """
    if address.startswith("unix:"):
        path = address[len("unix:") :]
        if not path.startswith("/"):
            raise ValueError(f"listen: expected unix:/absolute/path, got {address!r}")
        return "unix", path
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen: expected host:port or unix:/path, got {address!r}")
    return "tcp", address


def _env_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {value!r}")


def _octal(value: str) -> int:
    return int(value, 8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ``ServiceConfig`` field to ``parser`` (defaults resolved later)."""
    d = ServiceConfig()
    group = parser.add_argument_group("serving")
    group.add_argument(
        "--listen",
        action="append",
        metavar="ADDR",
        help=f"address to serve on, host:port or unix:/abs/path; repeat for several "
        f"[env DDTREE_LISTEN, comma-separated; default {','.join(d.listen)}]",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        metavar="N",
        help="largest request/response message "
        f"[env DDTREE_MAX_MESSAGE_BYTES; default {d.max_message_bytes}]",
    )
    group.add_argument(
        "--max-tensor-bytes",
        type=int,
        metavar="N",
        help=f"largest single tensor [env DDTREE_MAX_TENSOR_BYTES; default {d.max_tensor_bytes}]",
    )
    group.add_argument(
        "--max-batch-size",
        type=int,
        metavar="N",
        help="largest batch_size of a call "
        f"[env DDTREE_MAX_BATCH_SIZE; default {d.max_batch_size}]",
    )
    group.add_argument(
        "--max-concurrent-calls",
        type=int,
        metavar="N",
        help="calls served at once, more are refused with RESOURCE_EXHAUSTED "
        f"[env DDTREE_MAX_CONCURRENT_CALLS; default {d.max_concurrent_calls}]",
    )
    group.add_argument(
        "--grpc-io",
        choices=_GRPC_IO_MODES,
        help="how gRPC core serves the sockets: polling (the waiting thread polls them; "
        "lower latency) or event-engine (gRPC's default); applied before gRPC starts "
        f"[env DDTREE_GRPC_IO; default {d.grpc_io}]",
    )
    group.add_argument(
        "--grace-s",
        type=float,
        metavar="S",
        help="seconds in-flight calls get after SIGTERM "
        f"[env DDTREE_GRACE_S; default {d.grace_s:g}]",
    )
    group.add_argument(
        "--request-deadline-cap-s",
        type=float,
        metavar="S",
        help="cap on every call's deadline "
        f"[env DDTREE_REQUEST_DEADLINE_CAP_S; default {d.request_deadline_cap_s:g}]",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this TCP port [env DDTREE_METRICS_PORT; default off]",
    )
    group.add_argument(
        "--metrics-host",
        metavar="ADDR",
        help="address the metrics port binds, e.g. 0.0.0.0 in a pod "
        f"[env DDTREE_METRICS_HOST; default {d.metrics_host}]",
    )
    memory = parser.add_argument_group("registered memory (CUDA IPC)")
    memory.add_argument(
        "--max-registered-regions",
        type=int,
        metavar="N",
        help="caller memory regions registered at once "
        f"[env DDTREE_MAX_REGISTERED_REGIONS; default {d.max_registered_regions}]",
    )
    memory.add_argument(
        "--max-registered-bytes",
        type=int,
        metavar="N",
        help="sum of registered regions' bytes "
        f"[env DDTREE_MAX_REGISTERED_BYTES; default {d.max_registered_bytes}]",
    )
    memory.add_argument(
        "--memory-idle-timeout-s",
        type=float,
        metavar="S",
        help="a registered region unused this long expires "
        f"[env DDTREE_MEMORY_IDLE_TIMEOUT_S; default {d.memory_idle_timeout_s:g}]",
    )
    memory.add_argument(
        "--max-channels",
        type=int,
        metavar="N",
        help="GPU doorbell channels open at once, 0 for none "
        f"[env DDTREE_MAX_CHANNELS; default {d.max_channels}]",
    )
    access = parser.add_argument_group("access control")
    access.add_argument(
        "--tls-cert",
        type=Path,
        metavar="PEM",
        help="certificate chain: TCP listeners serve TLS only [env DDTREE_TLS_CERT; default off]",
    )
    access.add_argument(
        "--tls-key",
        type=Path,
        metavar="PEM",
        help="private key of --tls-cert [env DDTREE_TLS_KEY]",
    )
    access.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="PEM",
        help="CA of client certificates: TCP clients without one are refused (mTLS) "
        "[env DDTREE_TLS_CLIENT_CA; default off]",
    )
    access.add_argument(
        "--unix-socket-mode",
        type=_octal,
        metavar="MODE",
        help="permission bits of Unix sockets, octal "
        f"[env DDTREE_UNIX_SOCKET_MODE; default {d.unix_socket_mode:04o}]",
    )
    access.add_argument(
        "--max-concurrent-calls-per-client",
        type=int,
        metavar="N",
        help="calls one client (certificate subject, peer IP, or all Unix-socket callers) may "
        "have in flight, 0 for no limit [env DDTREE_MAX_CONCURRENT_CALLS_PER_CLIENT; default 0]",
    )
    access.add_argument(
        "--bind-regions-to-client",
        action=argparse.BooleanOptionalAction,
        help="only the client identity that registered a region can use, list or unregister "
        "it; all Unix-socket callers share one identity "
        "[env DDTREE_BIND_REGIONS_TO_CLIENT; default on]",
    )
    access.add_argument(
        "--max-regions-per-client",
        type=int,
        metavar="N",
        help="regions one client identity may have registered, 0 for no per-client limit "
        "[env DDTREE_MAX_REGIONS_PER_CLIENT; default 0]",
    )
    access.add_argument(
        "--max-registered-bytes-per-client",
        type=int,
        metavar="N",
        help="registered bytes of one client identity, 0 for no per-client limit "
        "[env DDTREE_MAX_REGISTERED_BYTES_PER_CLIENT; default 0]",
    )
    keepalive = parser.add_argument_group("connection keepalive")
    keepalive.add_argument(
        "--keepalive-time-s",
        type=float,
        metavar="S",
        help="ping a connection idle this long "
        f"[env DDTREE_KEEPALIVE_TIME_S; default {d.keepalive_time_s:g}]",
    )
    keepalive.add_argument(
        "--keepalive-timeout-s",
        type=float,
        metavar="S",
        help="close a connection whose ping is unanswered this long, cancelling its calls "
        f"[env DDTREE_KEEPALIVE_TIMEOUT_S; default {d.keepalive_timeout_s:g}]",
    )
    keepalive.add_argument(
        "--keepalive-permit-without-calls",
        action=argparse.BooleanOptionalAction,
        help="accept client keepalive pings on connections without calls "
        "[env DDTREE_KEEPALIVE_PERMIT_WITHOUT_CALLS; default on]",
    )
    keepalive.add_argument(
        "--keepalive-min-ping-interval-s",
        type=float,
        metavar="S",
        help="client pings closer together than this (without data) are strikes "
        f"[env DDTREE_KEEPALIVE_MIN_PING_INTERVAL_S; default {d.keepalive_min_ping_interval_s:g}]",
    )
    keepalive.add_argument(
        "--keepalive-max-ping-strikes",
        type=int,
        metavar="N",
        help="strikes before GOAWAY too_many_pings, 0 for unlimited "
        f"[env DDTREE_KEEPALIVE_MAX_PING_STRIKES; default {d.keepalive_max_ping_strikes}]",
    )
    keepalive.add_argument(
        "--max-connection-idle-s",
        type=float,
        metavar="S",
        help="close connections without calls this long (GOAWAY), 0 for never "
        "[env DDTREE_MAX_CONNECTION_IDLE_S; default 0]",
    )
    keepalive.add_argument(
        "--max-connection-age-s",
        type=float,
        metavar="S",
        help="close connections older than this (GOAWAY), 0 for never "
        "[env DDTREE_MAX_CONNECTION_AGE_S; default 0]",
    )
    keepalive.add_argument(
        "--max-connection-age-grace-s",
        type=float,
        metavar="S",
        help="seconds calls get after --max-connection-age-s "
        f"[env DDTREE_MAX_CONNECTION_AGE_GRACE_S; default {d.max_connection_age_grace_s:g}]",
    )
    compute = parser.add_argument_group("compute")
    compute.add_argument(
        "--device",
        metavar="DEV",
        help="auto (first GPU, else CPU), cpu or cuda:N [env DDTREE_DEVICE; default auto]",
    )
    compute.add_argument(
        "--backend",
        choices=_BACKENDS,
        help="op implementation: auto, cuda kernels or pure-torch reference "
        "[env DDTREE_BACKEND; default auto]",
    )
    compute.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="compiled-kernel cache directory [env DDTREE_CACHE_DIR; default: user cache dir]",
    )
    compute.add_argument(
        "--disable-jit",
        action="store_const",
        const=True,
        help="fail on a kernel-cache miss instead of compiling [env DDTREE_DISABLE_JIT=1]",
    )
    parser.add_argument(
        "--log-level",
        choices=_LOG_LEVELS,
        help="logging threshold [env DDTREE_LOG_LEVEL; default INFO]",
    )


_PARSERS: dict[str, Callable[[str], object]] = {
    "listen": lambda v: tuple(a.strip() for a in v.split(",") if a.strip()),
    "max_message_bytes": int,
    "max_tensor_bytes": int,
    "max_batch_size": int,
    "max_concurrent_calls": int,
    "grace_s": float,
    "request_deadline_cap_s": float,
    "device": str,
    "backend": str,
    "log_level": lambda v: v.strip().upper(),
    "cache_dir": Path,
    "disable_jit": _env_bool,
    "metrics_port": int,
    "metrics_host": str,
    "max_registered_regions": int,
    "max_registered_bytes": int,
    "memory_idle_timeout_s": float,
    "max_channels": int,
    "tls_cert": Path,
    "tls_key": Path,
    "tls_client_ca": Path,
    "unix_socket_mode": _octal,
    "grpc_io": lambda v: v.strip().lower(),
    "max_concurrent_calls_per_client": int,
    "bind_regions_to_client": _env_bool,
    "max_regions_per_client": int,
    "max_registered_bytes_per_client": int,
    "keepalive_time_s": float,
    "keepalive_timeout_s": float,
    "keepalive_permit_without_calls": _env_bool,
    "keepalive_min_ping_interval_s": float,
    "keepalive_max_ping_strikes": int,
    "max_connection_idle_s": float,
    "max_connection_age_s": float,
    "max_connection_age_grace_s": float,
}


def config_from_args(
    argv: Sequence[str] | argparse.Namespace, environ: Mapping[str, str] | None = None
) -> ServiceConfig:
    """Resolve flags, then ``DDTREE_*`` variables, then defaults into a ``ServiceConfig``.

    Parameters
    ----------
    argv : sequence of str or argparse.Namespace
        Command-line arguments (parsed here with ``add_arguments``) or an already parsed
        namespace from a parser that called ``add_arguments``.
    environ : Mapping[str, str], optional
        Environment to read; ``os.environ`` by default.

    Raises
    ------
    ValueError
        A value does not parse or is out of range; the message names the flag or variable.
    """
    if isinstance(argv, argparse.Namespace):
        namespace = argv
    else:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        namespace = parser.parse_args(list(argv))
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for f in fields(ServiceConfig):
        flag_value = getattr(namespace, f.name, None)
        if flag_value is not None:
            values[f.name] = tuple(flag_value) if f.name == "listen" else flag_value
            continue
        env_name = ENV_PREFIX + f.name.upper()
        raw = env.get(env_name)
        if raw is None or raw == "":
            continue
        try:
            values[f.name] = _PARSERS[f.name](raw)
        except ValueError as err:
            raise ValueError(f"{env_name}: {err}") from err
    return ServiceConfig(**values)  # type: ignore[arg-type]
