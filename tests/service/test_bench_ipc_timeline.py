"""The cross-process timeline diagnostic (bench/bench_ipc_timeline.py) keeps working on the CPU.

It wraps service and client internals by name; a rename would silently drop a segment, so every
segment must come back, fit inside the call, and the caller's wrapper must be removed after.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.scripts import load_bench

from ddtree.clients import cuda, remote


@pytest.mark.parametrize("idle_ms", [0, 50])
def test_every_segment_of_every_kind_is_measured(tmp_path: Path, idle_ms: int) -> None:
    call, order = remote.Client._call, cuda.ClientIpc.order_inputs
    out = tmp_path / "timeline.json"
    argv = ["--cpu", "--calls", "5", "--idle-ms", str(idle_ms), "--out", str(out)]
    load_bench("bench_ipc_timeline").main(argv)
    assert remote.Client._call is call
    assert cuda.ClientIpc.order_inputs is order
    results = json.loads(out.read_text())
    assert results["caller_idle_ms"] == idle_ms
    kinds = results["kinds"]
    # The caller's idle time is outside every call.
    assert kinds["bare_call"]["total"] < 50_000
    assert set(kinds) == {
        "bare_call",
        "build_tree",
        "accept_tree",
        "build_tree_out",
        "build_tree_prepared",
        "accept_tree_out",
    }
    for kind, figures in kinds.items():
        parts = ("caller_before", "inbound", "deserialise", "to_handler", "handler", "outbound")
        assert all(figures[part] > 0 for part in parts), (kind, figures)
        assert sum(figures[part] for part in parts) <= 1.5 * figures["total"], (kind, figures)
        if kind != "bare_call":
            for part in ("decode", "validate", "engine_op", "launch", "verdict", "reply"):
                assert 0 < figures[part] <= figures["handler"], (kind, part, figures)


def test_the_kinds_asked_for_are_timed_alone(tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    kinds = "bare_call,build_tree_prepared"
    load_bench("bench_ipc_timeline").main(
        ["--cpu", "--calls", "3", "--kinds", kinds, "--out", str(out)]
    )
    assert list(json.loads(out.read_text())["kinds"]) == kinds.split(",")
    with pytest.raises(SystemExit):
        load_bench("bench_ipc_timeline").main(["--cpu", "--kinds", "echo", "--out", str(out)])
