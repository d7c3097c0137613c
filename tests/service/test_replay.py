"""When ``LaunchGraphs`` launches eagerly, captures and replays, on CPU with a fake graph.

The GPU tests (``test_replay_gpu.py``) check that replays compute the right trees; these check
the bookkeeping: first sighting eager, second captured and replayed, least recently used graph
dropped, a launch the driver refuses to capture eager for good, bad arguments raised as they are
eagerly.
"""

from __future__ import annotations

import logging

import pytest

from ddtree.service.replay import LaunchGraphs, LaunchKey


class FakeGraph:
    """Records what is done to it; ``fail_at`` makes one step raise like the driver would."""

    made: list[FakeGraph] = []

    def __init__(self, fail_at: str = "") -> None:
        self.fail_at = fail_at
        self.steps: list[str] = []
        FakeGraph.made.append(self)

    def capture_begin(self, *, capture_error_mode: str) -> None:
        assert capture_error_mode == "thread_local"
        self.steps.append("begin")

    def capture_end(self) -> None:
        self.steps.append("end")
        if self.fail_at == "end":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    def replay(self) -> None:
        self.steps.append("replay")


class Launches:
    """A launch that counts its calls and may raise."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.calls = 0
        self.error = error

    def __call__(self) -> str:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return f"result {self.calls}"


@pytest.fixture(autouse=True)
def fresh_graphs() -> None:
    FakeGraph.made = []


def test_first_eager_then_captured_then_replayed() -> None:
    graphs: LaunchGraphs[str] = LaunchGraphs(graph_factory=FakeGraph)
    launch = Launches()
    assert graphs.run("k", launch) == "result 1"  # eager
    assert FakeGraph.made == []
    assert graphs.run("k", launch) == "result 2"  # captured (launched once, inside), replayed
    assert graphs.run("k", launch) == "result 2"  # replayed: the capture's result
    assert launch.calls == 2
    assert FakeGraph.made[0].steps == ["begin", "end", "replay", "replay"]
    assert graphs.replays == 2 and len(graphs) == 1


def test_the_least_recently_used_graph_is_dropped() -> None:
    graphs: LaunchGraphs[str] = LaunchGraphs(capacity=2, graph_factory=FakeGraph)
    launches = {key: Launches() for key in "abc"}
    for key in "ababcc":  # a and b captured; c captured drops a (b was used last)
        graphs.run(key, launches[key])
    graphs.run("b", launches["b"])
    assert len(graphs) == 2
    assert launches["b"].calls == 2  # replayed, not launched again
    graphs.run("a", launches["a"])  # a was dropped: its key is new again, eager
    assert launches["a"].calls == 3


def test_a_refused_capture_runs_eagerly_from_then_on(caplog: pytest.LogCaptureFixture) -> None:
    graphs: LaunchGraphs[str] = LaunchGraphs(graph_factory=lambda: FakeGraph(fail_at="end"))
    launch = Launches()
    graphs.run("k", launch)
    with caplog.at_level(logging.WARNING, logger="ddtree.service.replay"):
        assert graphs.run("k", launch) == "result 3"  # the capture's launch, then eager
    assert "launch_capture_failed" in caplog.text
    for expected in ("result 4", "result 5"):
        assert graphs.run("k", launch) == expected
    assert len(FakeGraph.made) == 1 and graphs.replays == 0


def test_a_runtime_error_inside_the_capture_falls_back_to_eager() -> None:
    graphs: LaunchGraphs[str] = LaunchGraphs(graph_factory=FakeGraph)
    launch = Launches()
    graphs.run("k", launch)
    launch.error = RuntimeError("CUDA error: stream capture invalidated")
    with pytest.raises(RuntimeError, match="invalidated"):  # the eager retry raises it too
        graphs.run("k", launch)
    assert FakeGraph.made[0].steps == ["begin", "end"]  # the capture was ended
    launch.error = None
    graphs.run("k", launch)
    assert len(FakeGraph.made) == 1  # never captured again


def test_bad_arguments_raise_as_they_do_eagerly() -> None:
    graphs: LaunchGraphs[str] = LaunchGraphs(graph_factory=FakeGraph)
    launch = Launches()
    graphs.run("k", launch)
    launch.error = ValueError("out.tokens: expected shape (2, 5), got (2, 4)")
    with pytest.raises(ValueError, match="out.tokens"):
        graphs.run("k", launch)
    assert launch.calls == 2  # not retried eagerly
    assert FakeGraph.made[0].steps == ["begin", "end"]
    launch.error = None
    assert graphs.run("k", launch) == "result 3"  # still capturable
    assert len(graphs) == 1


def test_launch_keys_with_equal_parts_name_one_graph() -> None:
    graphs: LaunchGraphs[str] = LaunchGraphs(graph_factory=FakeGraph)
    launch = Launches()
    layout = (0x7F00, (32, 65), (65, 1), "int64")
    graphs.run((LaunchKey("build_tree", layout, 64), 0x1000), launch)  # eager
    graphs.run((LaunchKey("build_tree", layout, 64), 0x1000), launch)  # captured
    # A key built again from equal parts finds the graph; any differing part does not.
    assert graphs.run((LaunchKey("build_tree", layout, 64), 0x1000), launch) == "result 2"
    assert graphs.run((LaunchKey("build_tree", layout, 65), 0x1000), launch) == "result 3"
    assert graphs.run((LaunchKey("build_tree", layout, 64), 0x2000), launch) == "result 4"
    assert len(FakeGraph.made) == 1 and graphs.replays == 2


def test_a_launch_key_hashes_its_parts_once() -> None:
    class Part:
        hashed = 0

        def __hash__(self) -> int:
            Part.hashed += 1
            return 7

    key = LaunchKey("accept", Part())
    for _ in range(3):
        assert {key: 1}[key] == 1
    assert Part.hashed == 1
    assert key == key and key != LaunchKey("accept", 7) and key != ("accept",)
