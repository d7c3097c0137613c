"""CUDA graphs of repeated launches: a call that comes back with the same buffers is replayed.

An inference server calls with the same buffers step after step (static buffers are what CUDA
graphs need on its side too), so the same kernels are launched with the same arguments again and
again. Launching them from Python costs more host time than the device spends on them (on the
H200 host, about 0.2 ms of Python and driver calls for the three build_tree kernels, which run
0.13 ms at batch 32); a captured graph replays them with one launch.

The key of a launch must name every pointer and value its kernels take: a replay reuses the
arguments of the capture. The caller builds the key from the call's tensors (already validated
for this call, so a replay touches only memory the call may touch) and scalars; scratch memory
the launch allocates during the capture belongs to the graph (a private pool of the caching
allocator) and lives as long as it does.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

import torch

__all__ = ["Graph", "LaunchGraphs", "LaunchKey"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")


class LaunchKey:
    """A key of ``LaunchGraphs``: a tuple of parts whose hash is computed once.

    A launch's key names every pointer, shape, stride and scalar of its kernels, dozens of
    values that a plain tuple hashes again on every lookup (tuples do not keep their hash). A
    call sent again keeps its key object (``calls.Prepared``): its lookups then cost the
    cached hash and an identity check.

    Parameters
    ----------
    *parts : hashable
        What identifies the launch.
    """

    __slots__ = ("_hash", "parts")

    def __init__(self, *parts: Hashable) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, LaunchKey):
            return NotImplemented
        return self._hash == other._hash and self.parts == other.parts

    def __repr__(self) -> str:
        return f"LaunchKey{self.parts!r}"


class Graph(Protocol):
    """What ``LaunchGraphs`` uses of ``torch.cuda.CUDAGraph``."""

    def capture_begin(self, *, capture_error_mode: str) -> None:
        """Start capturing the current stream's work."""
        ...

    def capture_end(self) -> None:
        """End the capture."""
        ...

    def replay(self) -> None:
        """Launch the captured work again on the current stream."""
        ...


class LaunchGraphs(Generic[_T]):
    """Captured launches by key, least recently used first out.

    A key seen for the first time runs eagerly; seen again, its launch is captured into a CUDA
    graph on the current stream (which must not be the default stream; thread-local capture
    mode, so other threads' CUDA calls are unaffected) and replayed from then on. A launch the
    driver refuses to capture runs eagerly, then and every later time (a warning is logged).

    Not thread-safe: the engine calls it under its device lock, and synchronises its stream
    after every op, so no replay is running when a capture evicts the oldest graph (whose
    scratch memory goes back to the allocator).

    Parameters
    ----------
    capacity : int
        Graphs kept; each holds its launch's scratch memory.
    graph_factory : callable, optional
        Makes an empty graph; ``torch.cuda.CUDAGraph`` by default (tests pass a fake).
    stream : int, optional
        The raw handle of the stream every launch is queued on (the engine's, current during
        every ``run``): a captured graph is then launched by one driver call where torch
        exposes it (``_launcher``); ``None``: by the graph's ``replay``.
    """

    def __init__(
        self,
        capacity: int = 8,
        *,
        graph_factory: Callable[[], Graph] = torch.cuda.CUDAGraph,
        stream: int | None = None,
    ) -> None:
        self._capacity = capacity
        self._new_graph = graph_factory
        self._stream = stream
        self._graphs: collections.OrderedDict[Hashable, tuple[Graph, _T, Callable[[], None]]] = (
            collections.OrderedDict()
        )
        self._seen: collections.OrderedDict[Hashable, bool] = collections.OrderedDict()
        """Keys seen without a graph: ``True`` for those whose capture failed (eager for good)."""
        self.replays = 0
        """Launches replayed from a graph (for tests and benchmarks)."""

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, launch: Callable[[], _T]) -> _T:
        """Queue ``launch``'s work on the stream: replayed, captured then replayed, or eager.

        Parameters
        ----------
        key : hashable
            Everything ``launch``'s kernels read as arguments (pointers, shapes, dtypes,
            scalars).
        launch : callable
            Queues the kernels on the current stream without synchronising; returns the
            result object (whose tensors must be the key's or allocated inside the launch).
            A ``ValueError`` it raises (bad arguments) propagates, as it would eagerly.

        Returns
        -------
        The result of ``launch`` (from the capture, for a replay).
        """
        entry = self._graphs.get(key)
        if entry is not None:
            self._graphs.move_to_end(key)
            entry[2]()
            self.replays += 1
            return entry[1]
        refused = self._seen.get(key)
        if refused is None or refused:  # first sighting, or not capturable
            self._seen[key] = bool(refused)
            self._seen.move_to_end(key)
            if len(self._seen) > 4 * self._capacity:
                self._seen.popitem(last=False)
            return launch()
        graph = self._new_graph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            result = launch()
        except ValueError:
            _end_quietly(graph)
            raise
        except RuntimeError as err:
            _end_quietly(graph)
            return self._refuse(key, err, launch)
        try:
            graph.capture_end()
        except RuntimeError as err:
            return self._refuse(key, err, launch)
        del self._seen[key]
        launch_graph = _launcher(graph, self._stream)
        self._graphs[key] = (graph, result, launch_graph)
        if len(self._graphs) > self._capacity:
            self._graphs.popitem(last=False)
        _log.debug("event=launch_captured graphs=%d", len(self._graphs))
        launch_graph()
        self.replays += 1
        return result

    def _refuse(self, key: Hashable, err: RuntimeError, launch: Callable[[], _T]) -> _T:
        """The capture of ``key`` failed: run it eagerly, now and from now on."""
        _log.warning("event=launch_capture_failed error=%s", str(err)[:200])
        self._seen[key] = True
        return launch()

    def clear(self) -> None:
        """Drop every graph and its scratch memory."""
        self._graphs.clear()
        self._seen.clear()


def _launcher(graph: Graph, stream: int | None) -> Callable[[], None]:
    """``graph.replay`` on ``stream``, as one driver call where it can be: a torch graph that
    exposes its executable graph (``raw_cuda_graph_exec``), cuda-python, a stream given.

    Torch's ``replay`` also sets the device and asks for the driver's version around the
    launch: on the H200 host, after a millisecond of idle, a replay and the verdict's
    synchronisation took 92 us through it against 77 us through the driver call (68 against
    66 hot). A launch the driver refuses goes to ``replay``, which raises what torch raises
    (nothing was queued).
    """
    exec_handle = getattr(graph, "raw_cuda_graph_exec", None)
    if exec_handle is None or stream is None:
        return graph.replay
    try:
        from cuda.bindings import driver
    except ImportError:
        return graph.replay
    raw = exec_handle()  # an int, or a cuda-python handle in some torch releases
    executable = driver.CUgraphExec(raw if isinstance(raw, int) else int(raw.getPtr()))
    queue = driver.CUstream(stream)
    launch, success = driver.cuGraphLaunch, driver.CUresult.CUDA_SUCCESS

    def replay() -> None:
        (err,) = launch(executable, queue)
        if err != success:
            graph.replay()

    return replay


def _end_quietly(graph: Graph) -> None:
    # The launch failed during the capture: end it, keeping the launch's own error.
    with contextlib.suppress(RuntimeError):
        graph.capture_end()
