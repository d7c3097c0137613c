"""The gRPC server: config, engine, interceptors, health, reflection, signals and shutdown.

``create_server(config)`` builds everything and binds the listen addresses; ``Server.start()``
starts serving with health NOT_SERVING, warms the engine up, then reports SERVING; ``serve()``
runs it until SIGTERM/SIGINT and drains: health NOT_SERVING, ``stop(grace)``, engine released.

Errors: one interceptor (``ErrorMappingInterceptor``) turns every ``DDTreeError`` into its
status code with ``google.rpc`` details in ``grpc-status-details-bin`` (``ErrorInfo`` always,
``BadRequest`` when a field is at fault, ``RetryInfo`` when retrying helps), table-driven from
the error classes. Anything else becomes INTERNAL with a generic message and a request id; the
traceback goes to the log only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc
import torch
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ddtree.service.access import AccessInterceptor, bind, server_credentials
from ddtree.service.calls import CallLimits
from ddtree.service.channel import ChannelLimits
from ddtree.service.config import ServiceConfig, grpc_experiments, parse_listen
from ddtree.service.convert import TensorResolver
from ddtree.service.engine import Engine, EngineObserver
from ddtree.service.errors import DDTreeError, Internal, Overloaded, ShuttingDown
from ddtree.service.memory import MemoryLimits
from ddtree.service.metrics import Metrics, server_registry, start_metrics_http_server
from ddtree.service.servicer import TreeSpeculationServicer
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

__all__ = [
    "ERROR_DOMAIN",
    "SERVICE_NAME",
    "CallObserver",
    "ErrorMappingInterceptor",
    "Server",
    "channel_limits",
    "create_server",
    "device_failure",
    "keepalive_options",
    "memory_limits",
    "serve",
    "status_details",
]

_log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TreeSpeculationService"].full_name
"""Fully qualified service name, ``ddtree.v1.TreeSpeculationService``."""

ERROR_DOMAIN = "ddtree.v1"
"""``google.rpc.ErrorInfo.domain`` of every ddtree error."""

_STATUS_DETAILS_KEY = "grpc-status-details-bin"
_FINAL_GRACE_S = 1.0
"""After the service's calls drained: how long gRPC waits for other streams (health Watch)."""
_QUIET_S = 0.1
"""Seconds with no new call the drain waits for, after the last in-flight call ended."""
_EXIT_DEVICE_FAILED = 3


class CallObserver(Protocol):
    """Told about every call of the service (``ddtree.service.metrics.Metrics`` fits)."""

    def rpc_started(self, service: str, method: str) -> None:
        """A call of ``service/method`` was received."""
        ...

    def rpc_finished(self, service: str, method: str, code: str, latency_seconds: float) -> None:
        """The call ended with status ``code`` (``"OK"``, ``"INVALID_ARGUMENT"``, ...)."""
        ...


def status_details(error: DDTreeError, request_id: str) -> status_pb2.Status:
    """The ``google.rpc.Status`` sent for ``error``: code, message and details.

    Parameters
    ----------
    error : DDTreeError
        The error; its class gives the code, reason and retry delay.
    request_id : str
        Id of the call, also in the server log; added to ``ErrorInfo.metadata``.
    """
    code = grpc.StatusCode[error.code]
    info = error_details_pb2.ErrorInfo(
        reason=error.reason,
        domain=ERROR_DOMAIN,
        metadata={**error.metadata, "request_id": request_id},
    )
    details = [info]
    if error.field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=error.field, description=error.message
        )
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in details:
        wrapped = any_pb2.Any()
        wrapped.Pack(detail)
        packed.append(wrapped)
    return status_pb2.Status(code=code.value[0], message=error.message, details=packed)


async def _abort(context: grpc.aio.ServicerContext, error: DDTreeError, request_id: str) -> None:
    status = status_details(error, request_id)
    await context.abort(
        grpc.StatusCode[error.code],
        error.message,
        trailing_metadata=((_STATUS_DETAILS_KEY, status.SerializeToString()),),
    )


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions of ``TreeSpeculationService`` methods to statuses; limits concurrency.

    Parameters
    ----------
    max_concurrent_calls : int
        Calls of the service handled at once; one more gets RESOURCE_EXHAUSTED (``OVERLOADED``).
    call_observer : CallObserver, optional
        Told when each call starts and ends (metrics).
    on_failure : callable, optional
        Called after every failed call except INVALID_ARGUMENT (the server checks there for a
        poisoned device; a request refused by validation or by the kernels' error flags got an
        answer from a working device, and a storm of bad requests must not become a storm of
        device synchronisations).

    Notes
    -----
    Health and reflection calls pass through untouched and do not count against the limit.
    """

    def __init__(
        self,
        *,
        max_concurrent_calls: int,
        call_observer: CallObserver | None = None,
        on_failure: Callable[[], Awaitable[None]] | None = None,
    ):
        self._max_concurrent_calls = max_concurrent_calls
        self._observer = call_observer
        self._on_failure = on_failure
        self._in_flight = 0
        self.draining = False
        """Set when the server drains: new calls get UNAVAILABLE (``SHUTTING_DOWN``)."""
        self.last_started = 0.0
        """``time.monotonic()`` when the last call reached this interceptor."""

    @property
    def in_flight(self) -> int:
        """Calls of the service being handled now."""
        return self._in_flight

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full_method = handler_call_details.method
        if handler is None or handler.unary_unary is None:
            return handler
        if not full_method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._wrap(full_method.rsplit("/", 1)[1], handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap(
        self, method: str, inner: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            request_id = secrets.token_hex(8)
            started = time.perf_counter()
            self.last_started = time.monotonic()
            code = "OK"
            if self._observer is not None:
                self._observer.rpc_started(SERVICE_NAME, method)
            _log.debug("event=rpc_received method=%s request_id=%s", method, request_id)
            try:
                if self.draining:
                    raise ShuttingDown(
                        "server is draining (shutting down); send the call to another replica"
                    )
                if self._in_flight >= self._max_concurrent_calls:
                    raise Overloaded(
                        f"server is at max_concurrent_calls={self._max_concurrent_calls}; "
                        "retry after the suggested delay"
                    )
                self._in_flight += 1
                try:
                    response = await inner(request, context)
                finally:
                    self._in_flight -= 1
                _log.debug(
                    "event=rpc_done method=%s request_id=%s code=OK latency_ms=%.3f",
                    method,
                    request_id,
                    (time.perf_counter() - started) * 1e3,
                )
                return response
            except DDTreeError as err:
                code = err.code
                _log.info(
                    "event=rpc_error method=%s request_id=%s code=%s reason=%s message=%s",
                    method,
                    request_id,
                    err.code,
                    err.reason,
                    err.message,
                )
                await _abort(context, err, request_id)
            except asyncio.CancelledError:
                code = "CANCELLED"
                _log.info("event=rpc_cancelled method=%s request_id=%s", method, request_id)
                raise
            except Exception:
                code = "INTERNAL"
                _log.exception("event=rpc_internal method=%s request_id=%s", method, request_id)
                await _abort(
                    context,
                    Internal(
                        f"internal server error; quote request_id={request_id} when reporting"
                    ),
                    request_id,
                )
            finally:
                if code not in ("OK", "INVALID_ARGUMENT") and self._on_failure is not None:
                    await self._on_failure()
                if self._observer is not None:
                    self._observer.rpc_finished(
                        SERVICE_NAME, method, code, time.perf_counter() - started
                    )

        return handle


class Server:
    """A bound, not yet started ddtree server (made by ``create_server``).

    Attributes
    ----------
    config : ServiceConfig
        The configuration it was built from.
    engine : Engine
        The engine it serves; closed by ``stop``.
    grpc_server : grpc.aio.Server
        The underlying server.
    health : grpc_health.v1.health.aio.HealthServicer
        Health of ``""`` and ``SERVICE_NAME``.
    addresses : list of str
        The bound addresses, with the real port for ``host:0``.
    """

    def __init__(
        self,
        config: ServiceConfig,
        engine: Engine,
        grpc_server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        addresses: list[str],
        calls: ErrorMappingInterceptor | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.grpc_server = grpc_server
        self.health = health_servicer
        self.addresses = addresses
        self._calls = calls
        self.failed = asyncio.Event()
        """Set when the engine's device failed; ``serve`` then drains and exits non-zero."""
        self._stopped = False
        self._probe: asyncio.Task[None] | None = None
        self._probe_again = False

    async def check_engine(self) -> None:
        """After a failed call: if the device is poisoned, report NOT_SERVING and set ``failed``.

        The engine marks itself poisoned when torch raises a device error in an op. A sticky
        CUDA error can also first surface elsewhere (a kernel launch through cuda-python, an
        IPC mapping, a copy in the servicer), so every failed call but INVALID_ARGUMENT also
        starts a probe of the device context in the background (``device_failure``; nothing to
        probe on the CPU), one at a time; the failed call's answer does not wait for it.
        """
        if self.failed.is_set():
            return
        if self.engine.is_poisoned:
            await self._fail()
            return
        if self._probe is not None:
            self._probe_again = True  # the error may have come after the running probe synced
            return
        self._probe = asyncio.create_task(self._probe_device())

    async def _probe_device(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._probe_again = False
                error = await loop.run_in_executor(None, device_failure, self.engine.device)
                if error is not None:
                    _log.error(
                        "event=device_failed device=%s source=probe error=%s",
                        self.engine.device,
                        error,
                    )
                    await self._fail()
                    return
                if not self._probe_again:
                    return
        finally:
            self._probe = None

    async def _fail(self) -> None:
        if not self.failed.is_set():
            self.failed.set()
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self, *, warm_up: bool = True) -> None:
        """Serve with health NOT_SERVING, warm the engine up, then report SERVING.

        Calls that arrive during warm-up get UNAVAILABLE (``WARMING_UP``).

        Parameters
        ----------
        warm_up : bool
            Whether to warm up here; with ``False`` the caller calls ``mark_serving`` after
            warming the engine itself.
        """
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        # A lone call's op runs inline on this event loop (the servicer asks for it), which
        # queues no other CUDA work: its current stream may stay the engine's. An inline op's
        # bookkeeping (its leases, what it leaves for the metrics) runs on the loop's next
        # turn, after the reply.
        self.engine.own_thread(defer=asyncio.get_running_loop().call_soon)
        await self.grpc_server.start()
        _log.info("event=listening addresses=%s", ",".join(self.addresses))
        if warm_up:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.warm_up)
            await self.mark_serving()

    async def mark_serving(self) -> None:
        """Report SERVING for ``""`` and the service (after the engine is warm)."""
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        _log.info("event=serving device=%s backend=%s", self.engine.device, self.engine.backend)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: health NOT_SERVING, refuse new calls, let in-flight ones finish, release.

        Parameters
        ----------
        grace_s : float, optional
            Seconds in-flight calls get; ``config.grace_s`` by default. Idempotent.
        """
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        _log.info("event=draining grace_s=%s", grace)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if self._calls is not None:
            # Refuse new service calls with UNAVAILABLE and let those in flight finish; then
            # stop gRPC without waiting the whole grace for long-lived health Watch streams.
            self._calls.draining = True
            if self.engine.channels is not None:  # their watchers see CLOSED ("shutdown")
                await loop.run_in_executor(None, self.engine.channels.close_all)
            # Then a quiet period, so that calls the transport had already taken in reach the
            # interceptor and get their UNAVAILABLE rather than race the stop below.
            while (
                self._calls.in_flight or time.monotonic() - self._calls.last_started < _QUIET_S
            ) and loop.time() < deadline:
                await asyncio.sleep(0.01)
            grace = min(_FINAL_GRACE_S, max(0.0, deadline - loop.time()))
        await self.grpc_server.stop(grace)
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.close)
        except Exception:  # a failed device may refuse its cleanup; the process exits anyway
            _log.exception("event=engine_close_failed")
        _log.info("event=stopped")

    async def wait_for_termination(self) -> None:
        """Wait until the gRPC server has stopped."""
        await self.grpc_server.wait_for_termination()


def device_failure(device: torch.device) -> str | None:
    """The sticky CUDA error of ``device``'s context, or ``None`` (always ``None`` on the CPU).

    Launches a tiny op on a stream of its own and synchronises that stream, twice: an error of
    an earlier asynchronous launch that is not sticky is reported once and cleared, while a
    sticky one (illegal address, trap, ...) leaves the context unusable and is reported by every
    call, so only an error of both counts. Never a device-wide synchronisation: GPU doorbell
    channels keep steps enqueued that wait for their callers (docs/channel.md).
    """
    if device.type != "cuda":
        return None
    errors = []
    for _ in range(2):
        try:
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                torch.ones(1, device=device).add_(1)
            stream.synchronize()
        except RuntimeError as err:  # torch.AcceleratorError
            errors.append(str(err))
        else:
            return None
    return errors[-1]


def channel_limits(config: ServiceConfig) -> ChannelLimits:
    """The doorbell-channel bounds ``config`` sets for the engine (idle expiry as for regions)."""
    return ChannelLimits(
        max_channels=config.max_channels, idle_timeout_s=config.memory_idle_timeout_s
    )


def memory_limits(config: ServiceConfig) -> MemoryLimits:
    """The registered-memory bounds and identity binding ``config`` sets for the engine."""
    return MemoryLimits(
        max_regions=config.max_registered_regions,
        max_bytes=config.max_registered_bytes,
        idle_timeout_s=config.memory_idle_timeout_s,
        bind_to_owner=config.bind_regions_to_client,
        max_regions_per_owner=config.max_regions_per_client,
        max_bytes_per_owner=config.max_registered_bytes_per_client,
    )


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def keepalive_options(config: ServiceConfig) -> list[tuple[str, int]]:
    """The gRPC channel arguments of ``config``'s keepalive and connection-lifetime settings.

    The server pings every connection idle for ``keepalive_time_s`` and closes it (cancelling
    its calls) when a ping goes unanswered for ``keepalive_timeout_s``, with no cap on pings
    without data (``grpc.http2.max_pings_without_data`` 0), so a peer that vanished without
    closing its connection is found while its connection stays idle. Client pings are
    policed by ``keepalive_min_ping_interval_s`` and ``keepalive_max_ping_strikes``.
    """
    options = [
        ("grpc.keepalive_time_ms", _ms(config.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(config.keepalive_timeout_s)),
        # In current gRPC core (grpc/grpc#34647) the wait for a ping's ack is
        # grpc.http2.ping_timeout_ms (60 s by default), which overrides keepalive_timeout_ms: a
        # silent peer is dropped after keepalive_timeout_s only with both set.
        ("grpc.http2.ping_timeout_ms", _ms(config.keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", int(config.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(config.keepalive_min_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", config.keepalive_max_ping_strikes),
    ]
    if config.max_connection_idle_s > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(config.max_connection_idle_s)))
    if config.max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", _ms(config.max_connection_age_s)))
        options.append(("grpc.max_connection_age_grace_ms", _ms(config.max_connection_age_grace_s)))
    return options


def create_server(
    config: ServiceConfig,
    *,
    engine: Engine | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    call_observer: CallObserver | None = None,
    engine_observer: EngineObserver | None = None,
) -> tuple[Server, list[str]]:
    """Build the server for ``config`` and bind its listen addresses (call inside a loop).

    Parameters
    ----------
    config : ServiceConfig
        Addresses, limits, device and backend.
    engine : Engine, optional
        An engine to serve (tests); by default one is made from ``config``. Either way the
        server closes it on ``stop``.
    interceptors : sequence of grpc.aio.ServerInterceptor
        Extra interceptors, run outside the error-mapping one (so they see DDTree statuses).
    call_observer : CallObserver, optional
        Told about every service call (metrics).
    engine_observer : EngineObserver, optional
        Told about every op, when the engine is made here (metrics).

    Returns
    -------
    tuple of (Server, list of str)
        The server (not started) and its bound addresses, TCP ports resolved.

    Raises
    ------
    ValueError
        The device or backend in ``config`` is not available here, or a TLS file cannot be
        read.
    RuntimeError
        An address cannot be bound.
    """
    limits = CallLimits(
        max_batch_size=config.max_batch_size, max_tensor_bytes=config.max_tensor_bytes
    )
    credentials = server_credentials(config)  # before the engine: a bad file fails fast
    if engine is None:
        engine = Engine(
            device=config.device,
            backend=config.backend,
            limits=limits,
            observer=engine_observer,
            memory_limits=memory_limits(config),
            channel_limits=channel_limits(config),
        )
    servers: list[Server] = []
    error_interceptor = ErrorMappingInterceptor(
        max_concurrent_calls=config.max_concurrent_calls,
        call_observer=call_observer,
        on_failure=lambda: servers[0].check_engine(),
    )
    access_interceptor = AccessInterceptor(
        SERVICE_NAME, max_calls_per_client=config.max_concurrent_calls_per_client
    )
    grpc_server = grpc.aio.server(
        interceptors=[*interceptors, error_interceptor, access_interceptor],
        options=[
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *keepalive_options(config),
        ],
    )
    resolver = TensorResolver(engine.limits, engine.memory)
    pb_grpc.add_TreeSpeculationServiceServicer_to_server(
        TreeSpeculationServicer(engine, config, resolver), grpc_server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), grpc_server
    )
    addresses = []
    for address in config.listen:
        kind, _ = parse_listen(address)
        port = bind(grpc_server, address, config, credentials)
        if kind == "tcp":
            host = address.rpartition(":")[0]
            addresses.append(f"{host}:{port}")
        else:
            addresses.append(address)
    server = Server(config, engine, grpc_server, health_servicer, addresses, error_interceptor)
    servers.append(server)
    return server, addresses


async def _serve(config: ServiceConfig) -> int:
    metrics = metrics_http = None
    if config.metrics_port is not None:
        methods = pb.DESCRIPTOR.services_by_name["TreeSpeculationService"].methods
        metrics = Metrics(server_registry(), methods=[(SERVICE_NAME, m.name) for m in methods])
        try:
            metrics_http, _, metrics_port = start_metrics_http_server(
                metrics.registry, host=config.metrics_host, port=config.metrics_port
            )
        except OSError as err:
            _log.error("event=startup_failed error=metrics port: %s", err)
            return 1
        _log.info("event=metrics_listening address=%s:%s", config.metrics_host, metrics_port)
    try:
        server, _ = create_server(config, call_observer=metrics, engine_observer=metrics)
    except (ValueError, RuntimeError) as err:
        _log.error("event=startup_failed error=%s", err)
        return 1
    if metrics is not None:
        metrics.publish_engine(server.engine)
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    try:
        await server.start()
    except Exception:
        _log.exception("event=warm_up_failed")
        await server.stop(0)
        return 1
    signalled = asyncio.create_task(stop_requested.wait())
    failed = asyncio.create_task(server.failed.wait())
    await asyncio.wait((signalled, failed), return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    failed.cancel()
    exit_code = 0
    if server.failed.is_set():
        exit_code = _EXIT_DEVICE_FAILED
        _log.error("event=device_failed_exiting exit_code=%d", exit_code)
    else:
        _log.info("event=signal_received")
    await server.stop()
    if metrics_http is not None:
        metrics_http.shutdown()
        metrics_http.server_close()
    return exit_code


def serve(config: ServiceConfig) -> int:
    """Run a server for ``config`` until SIGTERM or SIGINT, then drain; returns the exit code.

    Exit codes: 0 after a clean drain, 1 when the server could not start (bind, device or
    warm-up failure; the log says why), 3 after a device failure poisoned the CUDA context
    (health turns NOT_SERVING first, so the orchestrator restarts the process).
    """
    logging.basicConfig(
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    os.environ.update(config.kernel_environment())
    missing = config.grpc_environment()
    if missing:
        # gRPC was imported before the command could set it (serve called from Python).
        _log.warning(
            "event=grpc_io_not_applied grpc_io=%s needs=GRPC_EXPERIMENTS=%s (set before start)",
            config.grpc_io,
            missing["GRPC_EXPERIMENTS"],
        )
    else:
        _log.info(
            "event=grpc_io grpc_io=%s grpc_experiments=%s",
            config.grpc_io,
            grpc_experiments() or "-",
        )
    return asyncio.run(_serve(config))
