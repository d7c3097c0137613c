"""The cross-process timeline diagnostic (bench/bench_ipc_timeline.py) keeps working on the CPU.

It wraps service and client internals by name; a rename would silently drop a segment, so every
segment must come back, fit inside the call, and the caller's wrapper must be removed after.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from ddtree.clients import remote

TIMELINE = Path(__file__).resolve().parents[2] / "bench" / "bench_ipc_timeline.py"


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ddtree_bench_ipc_timeline", TIMELINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_segment_of_every_kind_is_measured(tmp_path: Path) -> None:
    call = remote.Client._call
    out = tmp_path / "timeline.json"
    _load_module().main(["--cpu", "--calls", "5", "--out", str(out)])
    assert remote.Client._call is call
    kinds = json.loads(out.read_text())["kinds"]
    assert set(kinds) == {
        "bare_call",
        "build_tree",
        "accept_tree",
        "build_tree_out",
        "accept_tree_out",
    }
    for kind, figures in kinds.items():
        parts = ("caller_before", "inbound", "deserialise", "to_handler", "handler", "outbound")
        assert all(figures[part] > 0 for part in parts), (kind, figures)
        assert sum(figures[part] for part in parts) <= 1.5 * figures["total"], (kind, figures)
        if kind != "bare_call":
            for part in ("decode", "validate", "engine_op", "launch", "verdict", "reply"):
                assert 0 < figures[part] <= figures["handler"], (kind, part, figures)
