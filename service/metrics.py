"""Prometheus metrics of the ddtree service: RPCs, device time, speculation and the budget curve.

Every metric is built by :class:`Metrics` against an injected ``CollectorRegistry`` (tests use a
fresh one). Names follow Prometheus conventions: the ``ddtree_`` prefix, base units as suffixes,
counters ending in ``_total``; labels are low-cardinality (``service``, ``method``, ``code``,
``op``, ``device``, ``model``, ``depth``, ``budget``), never request ids, shapes or tokens.

Nothing here synchronises with a GPU, and the op path stays cheap. Device time comes from CUDA
events recorded around an op on its stream (a pool of events, reused once read); speculation
data is snapshotted (CPU: tree sizes read into a list, walks cloned; CUDA: device-to-host copies
into pinned memory followed by an event). Both wait in a bounded queue that is counted in
batches without blocking: before every scrape, so each scrape is exact for everything the device
has finished, and whenever ``batch`` observations have queued up. :meth:`Metrics.flush` waits
for the device and counts everything (tests, shutdown).

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
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast
from wsgiref.simple_server import WSGIServer

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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

_Metric = TypeVar("_Metric", bound=MetricWrapperBase)

_NO_MODEL = ""
_OTHER_MODEL = "other"
_MAX_PENDING = 4096
_BATCH = 256


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
        Budgets to evaluate, strictly increasing, each ``>= 1``.

    Returns
    -------
    length_sums : torch.Tensor
        Shape ``(len(ladder),)``, int64, same device. Sum over counted walks of the acceptance
        length each budget would have given.
    walks : torch.Tensor
        Shape ``(len(ladder),)``, int64, same device. Walks counted for each budget.

    Raises
    ------
    ValueError
        ``ladder`` is empty, not strictly increasing or holds a budget below 1.

    Notes
    -----
    Linear in ``batch_size * path_len``: a path slot survives budget ``b`` exactly when the
    running maximum of the path's node indices up to it is ``<= b``, so each slot counts for every
    ladder budget from the smallest one covering that running maximum up to the walk's largest
    ladder budget; difference arrays and a cumulative sum add those ranges up.
    """
    budget_list = list(ladder)
    if (
        not budget_list
        or budget_list[0] < 1
        or any(a >= b for a, b in zip(budget_list, budget_list[1:], strict=False))
    ):
        raise ValueError(f"ladder: expected strictly increasing budgets >= 1, got {budget_list}")
    device = nodes.device
    rungs = len(budget_list)
    budgets = torch.tensor(budget_list, dtype=torch.int64, device=device)  # [ladder]
    nodes64 = nodes.to(torch.int64)  # [batch, path_len]
    length64 = length.to(torch.int64)  # [batch]
    slots = torch.arange(nodes.shape[1], device=device)  # [path_len]
    on_path = slots[None, :] < length64[:, None]  # [batch, path_len]
    # Slots past tau, and every slot from a padding entry on, are past every budget.
    past_all = budget_list[-1] + 1
    index = torch.where(on_path & (nodes64 >= 0), nodes64, past_all)  # [batch, path_len]
    running_max = index.cummax(dim=1).values  # [batch, path_len]
    # Index of the smallest budget covering each slot (``rungs``: none), counted one rung at a
    # time: no [batch, path_len, ladder] temporary, and no torch.searchsorted, whose CPU kernel
    # costs milliseconds even on tiny inputs on a busy machine.
    first_rung = torch.zeros_like(running_max)  # [batch, path_len]
    for budget in budget_list:
        first_rung += running_max > budget
    draft_nodes = num_nodes.to(torch.int64) - 1  # [batch]
    last_rung = (draft_nodes[:, None] >= budgets).sum(dim=1) - 1  # [batch], -1 = none
    last_rung = torch.where(length64 >= 1, last_rung, -1)
    end = (last_rung + 1)[:, None].expand_as(first_rung)  # [batch, path_len]
    counts = first_rung < end  # [batch, path_len]: slot counts for rungs first..last
    delta = torch.bincount(first_rung[counts], minlength=rungs + 1)  # [ladder + 1]
    delta = delta - torch.bincount(end[counts], minlength=rungs + 1)
    walked = last_rung >= 0  # [batch]: each walk counts for rungs 0..last_rung
    walk_delta = -torch.bincount(last_rung[walked] + 1, minlength=rungs + 1)  # [ladder + 1]
    walk_delta[0] += walked.sum()
    return delta.cumsum(0)[:rungs], walk_delta.cumsum(0)[:rungs]


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


@dataclass(slots=True)
class _Pending:
    """One observation waiting to be counted: ready once ``event`` (if any) has completed."""

    kind: str
    """``"device_time"``, ``"tree"`` or ``"acceptance"`` (the ``kind`` of dropped ones)."""
    event: torch.cuda.Event | None
    """Completes when the device has produced the data; ``None`` for host data."""
    label: str
    """``model`` label (speculation) or unused (device time)."""
    rows: int = 1
    """Trees or walks it holds (1 for device time)."""
    tensors: tuple[torch.Tensor, ...] = ()
    """Pinned host copies: ``(num_nodes,)`` of trees built on the device, or
    ``(nodes, length, num_nodes)`` of walks."""
    counts: list[int] | None = None
    """``num_nodes`` of trees observed on the host, as read when observed."""
    timing: _Timing | None = None
    """Device time: its start event, histogram child and device index (``event`` is the end)."""

    def is_ready(self) -> bool:
        return self.event is None or bool(self.event.query())


@dataclass(frozen=True, slots=True)
class _Timing:
    """What a device-time observation needs besides its end event."""

    start: torch.cuda.Event
    histogram: Histogram
    device_index: int


class _DeviceTimer:
    """The ``with`` block of one op launch (:meth:`Metrics.time_op`).

    On CUDA it records a start and an end event, taken from the metrics' pool, on the op's
    stream and queues them; elsewhere it observes the host wall time. Nothing is recorded if
    the block raises.
    """

    __slots__ = ("_device", "_events", "_histogram", "_metrics", "_start_s", "_stream")

    def __init__(
        self,
        metrics: Metrics,
        histogram: Histogram,
        device: torch.device,
        stream: torch.cuda.Stream | None,
    ) -> None:
        self._metrics = metrics
        self._histogram = histogram
        self._device = device
        self._stream = stream
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._start_s = 0.0

    def __enter__(self) -> None:
        if self._device.type != "cuda":
            self._start_s = time.perf_counter()
            return
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self._device)
        self._events = self._metrics._take_events(self._stream.device_index)
        self._events[0].record(self._stream)

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        events = self._events
        if events is None:  # host wall time
            if exc_type is None:
                self._histogram.observe(time.perf_counter() - self._start_s)
            return
        stream = self._stream
        assert stream is not None  # set by __enter__ with the events
        if exc_type is not None:
            self._metrics._give_events(stream.device_index, events)
            return
        start, end = events
        end.record(stream)
        timing = _Timing(start, self._histogram, stream.device_index)
        self._metrics._enqueue(_Pending("device_time", end, "", timing=timing))


class _LengthHistogram(Collector):
    """A ``model``-labelled histogram with the buckets of ``ACCEPTANCE_LENGTH_BUCKETS``, fed
    whole count vectors at once (a batch of 1024 walks is one update, not 1024 observations)."""

    def __init__(self, name: str, documentation: str) -> None:
        self._name = name
        self._documentation = documentation
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}  # model -> walks per length (index = tau)

    def add(self, model: str, length_counts: Sequence[int]) -> None:
        """Add ``length_counts[tau]`` walks of each length ``tau`` (creates the series)."""
        with self._lock:
            counts = self._counts.setdefault(model, [0] * (len(ACCEPTANCE_LENGTH_BUCKETS) + 1))
            counts.extend([0] * (len(length_counts) - len(counts)))
            for tau, count in enumerate(length_counts):
                counts[tau] += count

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=["model"])

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        with self._lock:
            snapshot = {model: list(counts) for model, counts in self._counts.items()}
        for model, counts in snapshot.items():
            buckets = []
            cumulative = counts[0]  # length 0 never happens; kept so indices are lengths
            for bound in ACCEPTANCE_LENGTH_BUCKETS:
                cumulative += counts[int(bound)]
                buckets.append((floatToGoString(bound), cumulative))
            buckets.append(("+Inf", sum(counts)))
            total = sum(tau * count for tau, count in enumerate(counts))
            family.add_metric([model], buckets, sum_value=total)
        return [family]


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
        Observations queued at most; past it the oldest is dropped and counted in
        ``ddtree_metrics_dropped_total`` (only if the device falls that far behind).
    batch : int
        Queued observations (or ``64 * batch`` queued trees and walks) that trigger counting them
        on the observing thread, ``1..max_pending``.

    Notes
    -----
    Observations are queued and counted in batches, one statistics pass per model, so an op pays
    a queue append (plus, on CUDA, async copies and an event) rather than tens of small tensor
    ops. The drain hook is registered before any metric, so each scrape first counts every
    observation whose data is ready; values are exact at every scrape. Methods are thread-safe.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        methods: Sequence[tuple[str, str]] = (),
        max_models: int = 16,
        max_pending: int = _MAX_PENDING,
        batch: int = _BATCH,
    ) -> None:
        if max_models < 0:
            raise ValueError(f"max_models: expected >= 0, got {max_models}")
        if max_pending < 1:
            raise ValueError(f"max_pending: expected >= 1, got {max_pending}")
        if not 1 <= batch <= max_pending:
            raise ValueError(f"batch: expected 1..max_pending={max_pending}, got {batch}")
        self.registry = registry
        self._max_models = max_models
        self._models: set[str] = set()
        self._lock = threading.Lock()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._max_pending = max_pending
        self._batch = batch
        self._pending_rows = 0
        # Timing events no observation holds, by device index, and the series children of each
        # label set once used: a call and its op look them up instead of creating anything.
        self._free_events: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}
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
        self.acceptance_length = _LengthHistogram(
            "ddtree_acceptance_length",
            "Acceptance length tau of one verify walk (accepted nodes including the root).",
        )
        registry.register(self.acceptance_length)
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
        self.acceptance_length.add(model, [])
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
        self._child(self.rpc_in_flight, service, method).inc()

    def rpc_finished(self, service: str, method: str, code: str, latency_seconds: float) -> None:
        """Record a finished call: its status ``code`` name (e.g. ``"OK"``) and latency."""
        self._child(self.rpc_in_flight, service, method).dec()
        self._child(self.rpc_calls, service, method, code).inc()
        self._child(self.rpc_latency, service, method, code).observe(latency_seconds)

    def _child(self, metric: _Metric, *labels: str) -> _Metric:
        """``metric.labels(*labels)``, looked up once per label set: the series a call or an op
        updates cost a dictionary lookup instead of the client's label validation and lock."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return cast(_Metric, child)

    # ------------------------------------------------------------------ device time

    def time_op(
        self, op: str, device: torch.device, stream: torch.cuda.Stream | None = None
    ) -> AbstractContextManager[None]:
        """Measure the device time of the op launched inside the ``with`` block.

        On CUDA two timing events are recorded on ``stream`` around the block and read once
        the device has passed the second one (no host sync); the events are reused once read.
        Elsewhere the host wall time of the block is observed. Nothing is recorded if the block
        raises.

        Parameters
        ----------
        op : str
            One of :data:`OPS` (label ``op``).
        device : torch.device
            Device the op runs on; ``str(device)`` is the ``device`` label.
        stream : torch.cuda.Stream, optional
            Stream the op is queued on; ``None``: the current stream of ``device`` (looking it
            up costs more host time than the rest of this).
        """
        histogram = self._child(self.op_device_seconds, op, str(device))
        return _DeviceTimer(self, histogram, device, stream)

    def observe_device_time(self, op: str, device: torch.device, seconds: float) -> None:
        """Observe the device time of an op that timed itself (a replayed build: its CUDA graph
        records its own timing events); the same series as ``time_op``.

        Parameters
        ----------
        op : str
            One of :data:`OPS` (label ``op``).
        device : torch.device
            Device the op ran on (label ``device``).
        seconds : float
            Its device time.
        """
        self._child(self.op_device_seconds, op, str(device)).observe(seconds)

    def _take_events(self, device_index: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """A start and an end timing event for ``device_index``, from the pool if it has one."""
        with self._lock:
            free = self._free_events.get(device_index)
            if free:
                return free.pop()
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _give_events(
        self, device_index: int, events: tuple[torch.cuda.Event, torch.cuda.Event]
    ) -> None:
        """Return timing events nothing reads any more (read, dropped or never ended) to the
        pool; an event still pending on the device may be recorded again."""
        with self._lock:
            self._free_events.setdefault(device_index, []).append(events)

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
        rows = int(num_nodes.shape[0])
        if num_nodes.is_cuda:
            event, host = _snapshot(num_nodes)
            self._enqueue(_Pending("tree", event, label, rows, tensors=host))
        else:  # a list of a few ints: cheaper to take than a cloned tensor
            self._enqueue(_Pending("tree", None, label, rows, counts=num_nodes.tolist()))

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
        event, hosts = _snapshot(nodes, length, num_nodes)
        rows = int(nodes.shape[0])
        self._enqueue(_Pending("acceptance", event, self.model_label(model), rows, tensors=hosts))

    def _count_acceptance(self, stats: AcceptanceStats, label: str) -> None:
        if stats.walks == 0:
            return
        self.walks.labels(label).inc(stats.walks)
        self.accepted_tokens.labels(label).inc(stats.accepted_tokens)
        self.acceptance_length.add(label, stats.length_counts.tolist())
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
        dropped = None
        with self._lock:
            if len(self._pending) >= self._max_pending:
                dropped = self._pending.popleft()
                self._pending_rows -= dropped.rows
                self.dropped.labels(dropped.kind).inc()
            self._pending.append(item)
            self._pending_rows += item.rows
            # Walks, not calls, set the cost of a statistics pass: bound both.
            is_due = len(self._pending) >= self._batch or self._pending_rows >= 64 * self._batch
        if dropped is not None and dropped.timing is not None:
            assert dropped.event is not None  # device time always ends with an event
            self._give_events(dropped.timing.device_index, (dropped.timing.start, dropped.event))
        if is_due:
            self.poll()

    def poll(self) -> None:
        """Count every queued observation whose data is ready; never blocks on the device.

        Runs before every scrape and whenever ``batch`` observations have queued up.
        """
        with self._lock:
            ready: list[_Pending] = []
            keep: collections.deque[_Pending] = collections.deque()
            for item in self._pending:
                (ready if item.is_ready() else keep).append(item)
            self._pending = keep
            self._pending_rows = sum(item.rows for item in keep)
        self._count(ready)

    def flush(self) -> None:
        """Wait for every queued observation's device work and count it (tests, shutdown)."""
        with self._lock:
            items = list(self._pending)
            self._pending.clear()
            self._pending_rows = 0
        for item in items:
            if item.event is not None:
                item.event.synchronize()
        self._count(items)

    def _count(self, items: Sequence[_Pending]) -> None:
        """Fold observations into the metrics, one statistics pass per model and path length."""
        trees: dict[str, list[int]] = collections.defaultdict(list)  # num_nodes per label
        walks: dict[tuple[str, int], list[tuple[torch.Tensor, ...]]] = collections.defaultdict(list)
        for item in items:
            if item.timing is not None:
                timing = item.timing
                assert item.event is not None  # device time always ends with an event
                timing.histogram.observe(timing.start.elapsed_time(item.event) / 1000.0)
                self._give_events(timing.device_index, (timing.start, item.event))
            elif item.kind == "tree":
                counts = item.tensors[0].tolist() if item.counts is None else item.counts
                trees[item.label].extend(counts)
            else:
                walks[(item.label, item.tensors[0].shape[1])].append(item.tensors)
        for label, counts in trees.items():
            self.trees.labels(label).inc(len(counts))
            # Draft nodes: num_nodes - 1 per tree, none for a tree of 0 nodes (sizes are >= 0;
            # sum and count run in C, for the 16,384 trees a pass may hold).
            self.draft_nodes.labels(label).inc(sum(counts) - len(counts) + counts.count(0))
        for (label, _), batches in walks.items():
            columns = zip(*batches, strict=True)  # nodes, length, num_nodes
            nodes, length, num_nodes = (torch.cat(column) for column in columns)
            self._count_acceptance(acceptance_stats(nodes, length, num_nodes), label)

    @property
    def pending(self) -> int:
        """Observations not counted yet (waiting for the device or for the next batch)."""
        with self._lock:
            return len(self._pending)


def _snapshot(*tensors: torch.Tensor) -> tuple[torch.cuda.Event | None, tuple[torch.Tensor, ...]]:
    """Host copies of ``tensors`` that later writes to them cannot change.

    CUDA tensors are copied asynchronously into pinned memory, with an event recorded after the
    copies on the current stream (no host sync); CPU tensors are cloned.
    """
    if tensors[0].device.type != "cuda":
        return None, tuple(t.clone() for t in tensors)
    hosts = []
    for tensor in tensors:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        hosts.append(host)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return event, tuple(hosts)


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
