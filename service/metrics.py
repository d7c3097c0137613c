"""Prometheus metrics of the ddtree service: RPCs, device time, speculation and the budget curve.

Every metric is built by :class:`Metrics` against an injected ``CollectorRegistry`` (tests use a
fresh one). Names follow Prometheus conventions: the ``ddtree_`` prefix, base units as suffixes,
counters ending in ``_total``; labels are low-cardinality (``service``, ``method``, ``code``,
``op``, ``device``, ``model``, ``depth``, ``budget``), never request ids, shapes or tokens.

Nothing here synchronises with a GPU. Device time comes from CUDA events recorded around an op on
the current stream, and speculation statistics from small device-to-host copies into pinned
memory followed by an event; both wait in a bounded queue that is drained without blocking (on
every new observation and before every scrape), so values appear once the device has passed
them. :meth:`Metrics.flush` waits for the queue (tests, shutdown).

The live budget curve uses the nested property of DDTree trees (Ringel & Romano, arXiv
2604.12989): the tree of budget ``b`` is exactly the first ``b`` popped nodes of any larger tree,
so an accepted path cut at the first node with index ``> b`` is what budget ``b`` would have
accepted. For each budget of :data:`BUDGET_LADDER` not above the tree's draft nodes, the sum of
those lengths and the number of walks are counted; their ratio in PromQL is the mean acceptance
length that budget would give::

    sum by (budget) (rate(ddtree_budget_curve_acceptance_length_total[5m]))
      / sum by (budget) (rate(ddtree_budget_curve_walks_total[5m]))
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ddtree.kernels.types import MAX_BUDGET, MAX_DRAFT_LEN

if TYPE_CHECKING:
    from ddtree.service.engine import Engine

__all__ = [
    "BUDGET_LADDER",
    "GRPC_CODES",
    "OPS",
    "OP_SECONDS_BUCKETS",
    "RPC_SECONDS_BUCKETS",
    "AcceptanceStats",
    "Metrics",
    "acceptance_stats",
    "budget_curve",
    "server_registry",
    "start_metrics_http_server",
]

BUDGET_LADDER: tuple[int, ...] = tuple(2**k for k in range(MAX_BUDGET.bit_length()))
"""Budgets of the live budget curve: 1, 2, 4, ..., 1024 (``MAX_BUDGET``)."""

OPS: tuple[str, ...] = ("build_tree", "accept", "commit_kv", "verify_attention")
"""Ops whose device time is measured (label ``op``)."""

GRPC_CODES: tuple[str, ...] = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
"""gRPC status code names (label ``code``), pre-initialised for every known method."""

RPC_SECONDS_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m}e{e}") for e in range(-5, 0) for m in (1, 2, 5)
) + (1.0, 2.0)
"""RPC latency buckets: 10 us to 2 s in 1-2-5 steps (a Python gRPC call floors near 0.4 ms)."""

OP_SECONDS_BUCKETS: tuple[float, ...] = tuple(
    float(f"{m}e{e}") for e in range(-6, 0) for m in (1, 2, 5)
) + (1.0,)
"""Device-time buckets: 1 us to 1 s in 1-2-5 steps (kernels run from microseconds up)."""

ACCEPTANCE_LENGTH_BUCKETS: tuple[float, ...] = tuple(float(n) for n in range(1, MAX_DRAFT_LEN + 2))
"""Acceptance-length buckets: every integer 1..``MAX_DRAFT_LEN + 1``."""

_NO_MODEL = ""
_OTHER_MODEL = "other"
_MAX_PENDING = 4096


@dataclass(frozen=True)
class AcceptanceStats:
    """Host-side summary of one batch of verify walks (requests with ``length >= 1``)."""

    walks: int
    """Verify walks counted (requests whose acceptance is not empty)."""
    accepted_tokens: int
    """Accepted draft tokens, ``sum(length - 1)``."""
    length_counts: torch.Tensor  # [path_len + 1] int64, walks per acceptance length (index = tau)
    depth_counts: torch.Tensor  # [path_len - 1] int64, walks that accepted a node at depth 1..
    ladder_length_sums: torch.Tensor  # [len(ladder)] int64, summed lengths per ladder budget
    ladder_walks: torch.Tensor  # [len(ladder)] int64, walks counted per ladder budget


def budget_curve(
    nodes: torch.Tensor,
    length: torch.Tensor,
    num_nodes: torch.Tensor,
    ladder: Sequence[int] = BUDGET_LADDER,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What every budget of ``ladder`` would have accepted, summed over a batch of walks.

    The tree of budget ``b`` is the first ``b`` draft nodes of the tree in pop order, so budget
    ``b`` would have accepted the path cut at its first node with index ``> b``. A walk counts for
    ``b`` when it is not empty (``length >= 1``) and its tree holds at least ``b`` draft nodes
    (``num_nodes - 1 >= b``); larger budgets are unknown from this tree.

    Parameters
    ----------
    nodes : torch.Tensor
        Shape ``(batch_size, path_len)``, int32/int64, any device. Accepted node indices, root
        (``0``) first, ``-1`` padded (``Acceptance.nodes``).
    length : torch.Tensor
        Shape ``(batch_size,)``, integer, same device. Acceptance length tau, ``0`` for a request
        whose walk was rejected (error flags), else ``1..path_len``.
    num_nodes : torch.Tensor
        Shape ``(batch_size,)``, integer, same device. ``1 + draft nodes`` of each tree
        (``Tree.num_nodes``).
    ladder : sequence of int
        Budgets to evaluate, each ``>= 1``.

    Returns
    -------
    length_sums : torch.Tensor
        Shape ``(len(ladder),)``, int64, same device. Sum over counted walks of the acceptance
        length each budget would have given.
    walks : torch.Tensor
        Shape ``(len(ladder),)``, int64, same device. Walks counted for each budget.
    """
    device = nodes.device
    path_len = nodes.shape[1]
    nodes64 = nodes.to(torch.int64)  # [batch, path_len]
    length64 = length.to(torch.int64)  # [batch]
    budgets = torch.tensor(list(ladder), dtype=torch.int64, device=device)  # [ladder]
    slots = torch.arange(path_len, device=device)  # [path_len]
    on_path = (slots[None, :] < length64[:, None]) & (nodes64 >= 0)  # [batch, path_len]
    within = on_path[:, None, :] & (nodes64[:, None, :] <= budgets[None, :, None])
    # [batch, ladder, path_len]; cumprod keeps the prefix before the first node past the budget.
    cut_length = within.to(torch.int64).cumprod(dim=2).sum(dim=2)  # [batch, ladder]
    draft_nodes = num_nodes.to(torch.int64) - 1  # [batch]
    counted = (length64 >= 1)[:, None] & (budgets[None, :] <= draft_nodes[:, None])
    # [batch, ladder]
    return (cut_length * counted).sum(dim=0), counted.to(torch.int64).sum(dim=0)


def acceptance_stats(
    nodes: torch.Tensor,
    length: torch.Tensor,
    num_nodes: torch.Tensor,
    ladder: Sequence[int] = BUDGET_LADDER,
) -> AcceptanceStats:
    """Summarise a batch of verify walks for the speculation metrics (runs where the data is).

    Parameters
    ----------
    nodes : torch.Tensor
        Shape ``(batch_size, path_len)``, int32/int64. Accepted node indices, ``-1`` padded.
    length : torch.Tensor
        Shape ``(batch_size,)``, integer. Acceptance length tau; ``0`` marks a rejected walk,
        which is left out of every count.
    num_nodes : torch.Tensor
        Shape ``(batch_size,)``, integer. ``1 + draft nodes`` of each tree.
    ladder : sequence of int
        Budgets of the budget curve (see :func:`budget_curve`).

    Returns
    -------
    AcceptanceStats
        Counts on the device of the inputs except ``walks`` and ``accepted_tokens`` (ints, a
        host sync for CUDA inputs: call it on host copies).
    """
    path_len = nodes.shape[1]
    length64 = length.to(torch.int64)  # [batch]
    counted = length64[length64 >= 1]  # [walks]
    length_counts = torch.bincount(counted, minlength=path_len + 1)  # [path_len + 1]
    depths = torch.arange(1, path_len, device=nodes.device)  # [path_len - 1]
    depth_counts = (counted[:, None] > depths[None, :]).to(torch.int64).sum(dim=0)
    # [path_len - 1]: walks whose path reached each depth
    ladder_sums, ladder_walks = budget_curve(nodes, length, num_nodes, ladder)
    return AcceptanceStats(
        walks=int(counted.numel()),
        accepted_tokens=int((counted - 1).sum()),
        length_counts=length_counts,
        depth_counts=depth_counts,
        ladder_length_sums=ladder_sums,
        ladder_walks=ladder_walks,
    )


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start an asynchronous copy of a CUDA tensor into fresh pinned host memory."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


class _Pending:
    """Work waiting for a CUDA event: ``apply()`` runs once ``event`` has completed."""

    __slots__ = ("apply", "event", "kind")

    def __init__(self, kind: str, event: torch.cuda.Event, apply: Callable[[], None]) -> None:
        self.kind = kind
        self.event = event
        self.apply = apply


class _DrainBeforeScrape(Collector):
    """A collector with no metrics of its own that drains finished GPU work on every scrape."""

    def __init__(self, drain: Callable[[], None]) -> None:
        self._drain = drain

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        self._drain()
        return []


class Metrics:
    """Every ddtree metric, registered in one ``CollectorRegistry``.

    Parameters
    ----------
    registry : prometheus_client.CollectorRegistry
        Where the metrics live; the service passes its own, tests a fresh one.
    methods : sequence of (str, str)
        ``(service, method)`` pairs of the RPCs served, e.g.
        ``("ddtree.v1.TreeSpeculationService", "BuildTree")``; their call counters (every code)
        and OK latency series exist from the start.
    max_models : int
        Distinct non-empty ``model`` labels kept; later ones are counted as ``"other"`` so that a
        misbehaving caller cannot blow up the series count.
    max_pending : int
        Observations waiting for the GPU at most; past it the oldest is dropped and counted in
        ``ddtree_metrics_dropped_total``.

    Notes
    -----
    The drain hook is registered before any metric, so each scrape first folds in every
    observation whose GPU work has finished. Methods are thread-safe.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        methods: Sequence[tuple[str, str]] = (),
        max_models: int = 16,
        max_pending: int = _MAX_PENDING,
    ) -> None:
        if max_models < 0:
            raise ValueError(f"max_models: expected >= 0, got {max_models}")
        if max_pending < 1:
            raise ValueError(f"max_pending: expected >= 1, got {max_pending}")
        self.registry = registry
        self._max_models = max_models
        self._models: set[str] = set()
        self._lock = threading.Lock()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._max_pending = max_pending
        registry.register(_DrainBeforeScrape(self.poll))

        self.rpc_calls = Counter(
            "ddtree_rpc_calls_total",
            "gRPC calls finished, by service, method and status code.",
            ["service", "method", "code"],
            registry=registry,
        )
        self.rpc_latency = Histogram(
            "ddtree_rpc_latency_seconds",
            "Server-side gRPC call latency from receipt to the final status, in seconds.",
            ["service", "method", "code"],
            buckets=RPC_SECONDS_BUCKETS,
            registry=registry,
        )
        self.rpc_in_flight = Gauge(
            "ddtree_rpc_in_flight_calls",
            "gRPC calls being handled now.",
            ["service", "method"],
            registry=registry,
        )
        self.op_device_seconds = Histogram(
            "ddtree_op_device_seconds",
            "Device time of one op launch (CUDA events; host wall time on the CPU backend).",
            ["op", "device"],
            buckets=OP_SECONDS_BUCKETS,
            registry=registry,
        )
        self.trees = Counter(
            "ddtree_trees_built_total",
            "Draft trees built (one per request of a BuildTree call).",
            ["model"],
            registry=registry,
        )
        self.draft_nodes = Counter(
            "ddtree_draft_nodes_total",
            "Draft nodes built, the root excluded.",
            ["model"],
            registry=registry,
        )
        self.walks = Counter(
            "ddtree_verify_walks_total",
            "Verify walks (one per request of an AcceptTree call with a well-formed tree).",
            ["model"],
            registry=registry,
        )
        self.accepted_tokens = Counter(
            "ddtree_accepted_tokens_total",
            "Accepted draft tokens, the root and the bonus token excluded (sum of length - 1).",
            ["model"],
            registry=registry,
        )
        self.acceptance_length = Histogram(
            "ddtree_acceptance_length",
            "Acceptance length tau of one verify walk (accepted nodes including the root).",
            ["model"],
            buckets=ACCEPTANCE_LENGTH_BUCKETS,
            registry=registry,
        )
        self.accepted_by_depth = Counter(
            "ddtree_accepted_tokens_by_depth_total",
            "Verify walks whose accepted path reached each draft depth (1..draft_len).",
            ["model", "depth"],
            registry=registry,
        )
        self.budget_length = Counter(
            "ddtree_budget_curve_acceptance_length_total",
            "Sum of the acceptance lengths each ladder budget would have given "
            "(accepted path cut at the first node index above the budget).",
            ["model", "budget"],
            registry=registry,
        )
        self.budget_walks = Counter(
            "ddtree_budget_curve_walks_total",
            "Verify walks whose tree held at least the ladder budget of draft nodes.",
            ["model", "budget"],
            registry=registry,
        )
        self.registered_regions = Gauge(
            "ddtree_registered_regions",
            "Caller memory regions registered now.",
            ["device"],
            registry=registry,
        )
        self.registered_bytes = Gauge(
            "ddtree_registered_bytes",
            "Bytes of caller memory registered now.",
            ["device"],
            registry=registry,
        )
        self.devices = Gauge(
            "ddtree_devices",
            "Devices the service runs ops on.",
            registry=registry,
        )
        self.device_info = Gauge(
            "ddtree_device_info",
            "One series per device, value 1: its name, UUID and compute capability.",
            ["device", "name", "uuid", "compute_capability"],
            registry=registry,
        )
        self.build_info = Info(
            "ddtree_build",
            "Version, kernel backend, GPU name and compute capability of this server.",
            registry=registry,
        )
        self.dropped = Counter(
            "ddtree_metrics_dropped_total",
            "Observations dropped because too many waited for the GPU.",
            ["kind"],
            registry=registry,
        )

        for service, method in methods:
            for code in GRPC_CODES:
                self.rpc_calls.labels(service, method, code)
            self.rpc_latency.labels(service, method, "OK")
            self.rpc_in_flight.labels(service, method)
        for kind in ("device_time", "tree", "acceptance"):
            self.dropped.labels(kind)
        self._init_model(_NO_MODEL)

    # ------------------------------------------------------------------ labels

    def _init_model(self, model: str) -> None:
        """Create every series of ``model`` so that rates start from zero."""
        self.trees.labels(model)
        self.draft_nodes.labels(model)
        self.walks.labels(model)
        self.accepted_tokens.labels(model)
        self.acceptance_length.labels(model)
        for depth in range(1, MAX_DRAFT_LEN + 1):
            self.accepted_by_depth.labels(model, str(depth))
        for budget in BUDGET_LADDER:
            self.budget_length.labels(model, str(budget))
            self.budget_walks.labels(model, str(budget))

    def model_label(self, model: str) -> str:
        """Return the label value used for ``model``, creating its series on first use.

        Parameters
        ----------
        model : str
            The caller's model label (already validated by the servicer), ``""`` for none.

        Returns
        -------
        str
            ``model`` itself, or ``"other"`` once ``max_models`` distinct labels are in use.
        """
        if model == _NO_MODEL:
            return model
        with self._lock:
            if model in self._models:
                return model
            if len(self._models) >= self._max_models:
                model = _OTHER_MODEL
                if model in self._models:
                    return model
            self._models.add(model)
        self._init_model(model)
        return model

    # ------------------------------------------------------------------ server facts

    def set_build_info(
        self, *, version: str, backend: str, gpu_name: str, compute_capability: str
    ) -> None:
        """Publish ``ddtree_build_info`` (``gpu_name`` and ``compute_capability`` of device 0,
        empty strings on a CPU-only server)."""
        self.build_info.info(
            {
                "version": version,
                "backend": backend,
                "gpu_name": gpu_name,
                "compute_capability": compute_capability,
            }
        )

    def set_devices(self, devices: Sequence[tuple[str, str, str, str]]) -> None:
        """Publish the devices served and create their per-device series.

        Parameters
        ----------
        devices : sequence of (str, str, str, str)
            ``(device, name, uuid, compute_capability)`` per device, e.g.
            ``("cuda:0", "NVIDIA H200", "GPU-...", "9.0")``; ``device`` is the ``device`` label
            of the other metrics.
        """
        self.devices.set(len(devices))
        for device, name, uuid, capability in devices:
            self.device_info.labels(device, name, uuid, capability).set(1)
            self.registered_regions.labels(device)
            self.registered_bytes.labels(device)
            for op in OPS:
                self.op_device_seconds.labels(op, device)

    def publish_engine(self, engine: Engine) -> None:
        """Publish build info and devices of ``engine`` (call once the server has made it).

        Parameters
        ----------
        engine : ddtree.service.engine.Engine
            The engine the server runs; its devices get ``device`` label ``str(engine.device)``.
        """
        info = engine.info()
        devices = []
        for device_info in info.devices:
            major, minor = device_info.compute_capability
            capability = f"{major}.{minor}" if engine.device.type == "cuda" else ""
            devices.append((str(engine.device), device_info.name, device_info.uuid, capability))
        self.set_devices(devices)
        _, gpu_name, _, capability = devices[0]
        self.set_build_info(
            version=info.version,
            backend=str(engine.backend),
            gpu_name=gpu_name if engine.device.type == "cuda" else "",
            compute_capability=capability,
        )

    def set_registered(self, device: str, *, regions: int, byte_size: int) -> None:
        """Set the registered-memory gauges of ``device`` (regions now held, their bytes)."""
        self.registered_regions.labels(device).set(regions)
        self.registered_bytes.labels(device).set(byte_size)

    # ------------------------------------------------------------------ RPCs

    def rpc_started(self, service: str, method: str) -> None:
        """Count a call of ``service/method`` as in flight."""
        self.rpc_in_flight.labels(service, method).inc()

    def rpc_finished(self, service: str, method: str, code: str, latency_seconds: float) -> None:
        """Record a finished call: its status ``code`` name (e.g. ``"OK"``) and latency."""
        self.rpc_in_flight.labels(service, method).dec()
        self.rpc_calls.labels(service, method, code).inc()
        self.rpc_latency.labels(service, method, code).observe(latency_seconds)

    # ------------------------------------------------------------------ device time

    @contextlib.contextmanager
    def time_op(self, op: str, device: torch.device) -> Iterator[None]:
        """Measure the device time of the op launched inside the ``with`` block.

        On CUDA two timing events are recorded on the current stream of ``device`` around the
        block and read once the device has passed the second one (no host sync); elsewhere the
        host wall time of the block is observed. Nothing is recorded if the block raises.

        Parameters
        ----------
        op : str
            One of :data:`OPS` (label ``op``).
        device : torch.device
            Device the op runs on; ``str(device)`` is the ``device`` label.
        """
        label = str(device)
        if device.type != "cuda":
            start_s = time.perf_counter()
            yield
            self.op_device_seconds.labels(op, label).observe(time.perf_counter() - start_s)
            return
        stream = torch.cuda.current_stream(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        histogram = self.op_device_seconds.labels(op, label)

        def apply() -> None:
            histogram.observe(start.elapsed_time(end) / 1000.0)

        self._enqueue(_Pending("device_time", end, apply))

    # ------------------------------------------------------------------ speculation

    def observe_trees(self, num_nodes: torch.Tensor, *, model: str = _NO_MODEL) -> None:
        """Count the trees of one BuildTree call and their draft nodes.

        Parameters
        ----------
        num_nodes : torch.Tensor
            Shape ``(batch_size,)``, int32, CPU or CUDA (``Tree.num_nodes``). On CUDA it is
            copied asynchronously and counted once the device has produced it.
        model : str
            The call's model label, ``""`` for none.
        """
        label = self.model_label(model)
        trees = self.trees.labels(label)
        nodes = self.draft_nodes.labels(label)

        def count(host: torch.Tensor) -> None:
            trees.inc(int(host.numel()))
            nodes.inc(int((host.to(torch.int64) - 1).clamp_min(0).sum()))

        if num_nodes.device.type != "cuda":
            count(num_nodes)
            return
        host = _to_host(num_nodes)
        self._enqueue(_Pending("tree", _record_event(num_nodes.device), lambda: count(host)))

    def observe_acceptance(
        self,
        nodes: torch.Tensor,
        length: torch.Tensor,
        num_nodes: torch.Tensor,
        *,
        model: str = _NO_MODEL,
    ) -> None:
        """Count the verify walks of one AcceptTree call, their depths and the budget curve.

        Parameters
        ----------
        nodes : torch.Tensor
            Shape ``(batch_size, path_len)``, int32, CPU or CUDA (``Acceptance.nodes``).
        length : torch.Tensor
            Shape ``(batch_size,)``, int32, same device (``Acceptance.length``; ``0`` for a
            rejected request, which is not counted).
        num_nodes : torch.Tensor
            Shape ``(batch_size,)``, int32, same device (``Tree.num_nodes`` of the walked trees).
        model : str
            The call's model label, ``""`` for none.
        """
        label = self.model_label(model)

        def count(nodes_h: torch.Tensor, length_h: torch.Tensor, num_h: torch.Tensor) -> None:
            self._count_acceptance(acceptance_stats(nodes_h, length_h, num_h), label)

        if nodes.device.type != "cuda":
            count(nodes, length, num_nodes)
            return
        hosts = (_to_host(nodes), _to_host(length), _to_host(num_nodes))
        self._enqueue(_Pending("acceptance", _record_event(nodes.device), lambda: count(*hosts)))

    def _count_acceptance(self, stats: AcceptanceStats, label: str) -> None:
        if stats.walks == 0:
            return
        self.walks.labels(label).inc(stats.walks)
        self.accepted_tokens.labels(label).inc(stats.accepted_tokens)
        histogram = self.acceptance_length.labels(label)
        for tau, count in enumerate(stats.length_counts.tolist()):
            for _ in range(count):
                histogram.observe(tau)
        for depth, count in enumerate(stats.depth_counts.tolist(), start=1):
            if count:
                self.accepted_by_depth.labels(label, str(depth)).inc(count)
        for budget, total, walks in zip(
            BUDGET_LADDER,
            stats.ladder_length_sums.tolist(),
            stats.ladder_walks.tolist(),
            strict=True,
        ):
            if walks:
                self.budget_length.labels(label, str(budget)).inc(total)
                self.budget_walks.labels(label, str(budget)).inc(walks)

    # ------------------------------------------------------------------ deferred queue

    def _enqueue(self, item: _Pending) -> None:
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self.dropped.labels(self._pending.popleft().kind).inc()
            self._pending.append(item)
        self.poll()

    def poll(self) -> None:
        """Fold in every queued observation whose GPU work has finished; never blocks."""
        while True:
            with self._lock:
                ready = next((p for p in self._pending if p.event.query()), None)
                if ready is None:
                    return
                self._pending.remove(ready)
            ready.apply()

    def flush(self) -> None:
        """Wait for every queued observation's GPU work and fold it in (tests, shutdown)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                item = self._pending.popleft()
            item.event.synchronize()
            item.apply()

    @property
    def pending(self) -> int:
        """Observations still waiting for the GPU."""
        with self._lock:
            return len(self._pending)


def _record_event(device: torch.device) -> torch.cuda.Event:
    """Record an event on the current stream of ``device`` (after the copies queued there)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def server_registry() -> CollectorRegistry:
    """A fresh registry with the process, platform and garbage-collector collectors.

    The server exposes this one rather than prometheus_client's global registry, so nothing
    another library registers globally leaks into ``/metrics``.
    """
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def start_metrics_http_server(
    registry: CollectorRegistry, *, host: str, port: int
) -> tuple[WSGIServer, threading.Thread, int]:
    """Serve ``registry`` in the Prometheus text format over HTTP on a daemon thread.

    Parameters
    ----------
    registry : prometheus_client.CollectorRegistry
        What to expose (``/metrics``; any path answers).
    host : str
        Address to bind, ``"127.0.0.1"`` for loopback only or ``"0.0.0.0"`` for every interface.
    port : int
        TCP port, ``0`` for a free one.

    Returns
    -------
    server : wsgiref.simple_server.WSGIServer
        Call ``shutdown()`` then ``server_close()`` to stop it.
    thread : threading.Thread
        The serving thread.
    bound_port : int
        The port actually bound.
    """
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, thread, int(server.server_port)
