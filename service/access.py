"""Who may call, and what bytes are accepted: TLS/mTLS, Unix-socket modes, client identity, limits.

- ``bind`` opens one listen address: a TCP listener is plain, TLS (``tls_cert`` + ``tls_key``) or
  mutual TLS (also ``tls_client_ca``: a client must present a certificate signed by that CA, or
  the handshake fails before any call); a Unix socket is created owner-only and then set to
  ``unix_socket_mode`` (0660 by default), so only its owner and group can connect.
- ``client_identity`` names the caller of a call: the certificate subject on mTLS, the peer IP
  address on TCP, ``"unix"`` on a Unix socket (gRPC exposes no peer credentials there; the
  socket's mode and group decide who can connect at all). The servicer also hands it to the
  engine as the owner of registered regions (``--bind-regions-to-client``, per-client region and
  byte limits; ``ddtree.service.memory``).
- ``AccessInterceptor`` (the innermost interceptor) limits the calls each client identity has in
  flight (RESOURCE_EXHAUSTED, ``OVERLOADED``, past ``max_concurrent_calls_per_client``) and
  answers request bytes that are not a valid protobuf message with INVALID_ARGUMENT
  (``MALFORMED_REQUEST``) instead of gRPC's own UNKNOWN.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from ddtree.service.config import ServiceConfig, parse_listen
from ddtree.service.errors import MalformedRequest, Overloaded

__all__ = [
    "AccessInterceptor",
    "bind",
    "client_identity",
    "received_bytes",
    "server_credentials",
]

_log = logging.getLogger(__name__)

_IDENTITY: ContextVar[tuple[object, str] | None] = ContextVar("ddtree_identity", default=None)
"""``(context, identity)`` of the call being handled, set by ``AccessInterceptor`` (each call
runs in a task of its own, so the value never reaches another call; the context is compared
as well)."""

_OWNER_ONLY_UMASK = 0o177
"""umask while a Unix socket is created: the file starts as 0600, never wider than asked."""


def _read(path: Path, setting: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ValueError(f"{setting}: cannot read {str(path)!r}: {err.strerror}") from err


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of the TCP listeners, or ``None`` to serve them in plain text.

    With ``tls_client_ca`` set, clients must present a certificate that CA signed (mTLS).

    Raises
    ------
    ValueError
        A certificate, key or CA file cannot be read; the message names the setting.
    """
    if config.tls_cert is None or config.tls_key is None:
        return None
    key = _read(config.tls_key, "tls_key")
    chain = _read(config.tls_cert, "tls_cert")
    client_ca = None
    if config.tls_client_ca is not None:
        client_ca = _read(config.tls_client_ca, "tls_client_ca")
    return grpc.ssl_server_credentials(
        ((key, chain),),
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def bind(
    grpc_server: grpc.aio.Server,
    address: str,
    config: ServiceConfig,
    credentials: grpc.ServerCredentials | None,
) -> int:
    """Bind one listen address; returns the bound port (0 for a Unix socket).

    Parameters
    ----------
    grpc_server : grpc.aio.Server
        The server, not started yet.
    address : str
        ``host:port`` or ``unix:/abs/path``.
    config : ServiceConfig
        Gives ``unix_socket_mode``.
    credentials : grpc.ServerCredentials, optional
        From ``server_credentials``; TCP listeners use TLS when set.

    Raises
    ------
    RuntimeError
        The address cannot be bound.
    """
    kind, target = parse_listen(address)
    if kind == "tcp":
        if credentials is None:
            return int(grpc_server.add_insecure_port(address))
        return int(grpc_server.add_secure_port(address, credentials))
    # The umask is process-wide; it is narrowed only for the bind, before the server starts.
    previous = os.umask(_OWNER_ONLY_UMASK)
    try:
        grpc_server.add_insecure_port(address)
    finally:
        os.umask(previous)
    os.chmod(target, config.unix_socket_mode)
    return 0


def client_identity(context: grpc.aio.ServicerContext) -> str:
    """The identity a call's limits are counted against and its registered regions belong to.

    Returns
    -------
    str
        ``"x509:<subject>"`` for a client certificate (mTLS), ``"ip:<address>"`` for a TCP peer
        without one, ``"unix"`` for every caller on a Unix socket.
    """
    known = _IDENTITY.get()
    if known is not None and known[0] is context:
        return known[1]
    return _identity_of(context)


def _identity_of(context: grpc.aio.ServicerContext) -> str:
    peer: str = context.peer()
    if peer.startswith("unix"):  # "unix:" or "unix-abstract:"; ``bind`` serves them plain
        return "unix"
    auth: dict[str, list[bytes]] = context.auth_context()
    for key in ("x509_subject", "x509_common_name"):
        values = auth.get(key)
        if values:
            return "x509:" + values[0].decode("utf-8", "replace")
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer[len("ipv4:") :].rpartition(":")[0]
        return "ip:" + host.strip("[]")
    return "unix"


@dataclass(frozen=True)
class _Malformed:
    """Stands in for a request whose bytes did not parse (the handler refuses it)."""

    byte_size: int
    error: str


_RECEIVED: ContextVar[tuple[object, bytes] | None] = ContextVar("ddtree_received", default=None)
"""``(request, bytes)`` of the call being handled: the message its deserializer returned and the
bytes it came from (set in the call's own task, like ``_IDENTITY``)."""

_KEPT_REQUEST_BYTES = 4096
"""Requests up to this size (references, not inline tensors) are kept parsed by their bytes."""

_KEPT_REQUESTS = 32
"""Parsed requests kept per method."""


def received_bytes(request: object) -> bytes | None:
    """The bytes ``request`` was parsed from, if the call being handled got it through its
    deserializer (``AccessInterceptor``) and it is small (at most 4 KiB: references, not inline
    tensors); ``None`` otherwise (a large request, a handler called directly)."""
    received = _RECEIVED.get()
    if received is None or received[0] is not request:
        return None
    return received[1]


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """``deserializer`` that answers unparsable bytes with ``_Malformed``, and for a small
    request notes the bytes it was parsed from (``received_bytes``) and parses the same bytes
    only once.

    A decode loop sends the same by-reference request, byte for byte, step after step; it
    then gets the same message object each time. Handlers only read their requests.
    """
    if deserializer is None:
        return lambda raw: raw
    parse = deserializer
    parsed: dict[bytes, Any] = {}

    def tolerant_parse(raw: bytes) -> Any:
        try:
            return parse(raw)
        except (DecodeError, UnicodeDecodeError) as err:
            return _Malformed(len(raw), type(err).__name__)

    def deserialize(raw: bytes) -> Any:
        if len(raw) > _KEPT_REQUEST_BYTES:  # inline tensors: its bytes are let go at once
            return tolerant_parse(raw)
        message = parsed.get(raw)
        if message is None:
            message = tolerant_parse(raw)
            if isinstance(message, _Malformed):
                return message
            if len(parsed) >= _KEPT_REQUESTS:
                del parsed[next(iter(parsed))]  # the oldest
            parsed[raw] = message
        _RECEIVED.set((message, raw))
        return message

    return deserialize


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Per-client call limits and refusal of unparsable requests for one service.

    Install it after (inside) the error-mapping interceptor, which turns its errors into
    statuses.

    Parameters
    ----------
    service_name : str
        Fully qualified service whose methods it guards (others pass through).
    max_calls_per_client : int
        Calls one client identity may have in flight; ``0`` for no per-client limit.
    """

    def __init__(self, service_name: str, *, max_calls_per_client: int) -> None:
        self._prefix = f"/{service_name}/"
        self._max_calls_per_client = max_calls_per_client
        self._in_flight: dict[str, int] = {}
        # Method -> (the handler it wraps, the wrapper): gRPC asks for a call's handler on
        # every call, and wrapping the same handler again each time costs a closure and a
        # handler object per call.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or not method.startswith(self._prefix):
            return handler
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = grpc.unary_unary_rpc_method_handler(
            self._wrap(method[len(self._prefix) :], handler.unary_unary),
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(
        self, method: str, inner: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        request_field = f"{method}Request"

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                raise MalformedRequest(
                    f"request: {request.byte_size} bytes are not a valid ddtree.v1."
                    f"{request_field} protobuf message ({request.error})",
                    field="request",
                )
            limit = self._max_calls_per_client
            if limit == 0:
                return await inner(request, context)
            identity = _identity_of(context)
            _IDENTITY.set((context, identity))  # the servicer asks again
            count = self._in_flight.get(identity, 0)
            if count >= limit:
                raise Overloaded(
                    f"client {identity} has {count} calls in flight, the server's "
                    f"max_concurrent_calls_per_client is {limit}; retry after the suggested delay"
                )
            self._in_flight[identity] = count + 1
            try:
                return await inner(request, context)
            finally:
                left = self._in_flight[identity] - 1
                if left:
                    self._in_flight[identity] = left
                else:
                    del self._in_flight[identity]

        return handle
