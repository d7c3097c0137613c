"""The load driver (bench/load.py) for a few seconds: no errors, flat memory, threads and fds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.scripts import load_bench


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_short_load_holds_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    load = load_bench("load")
    argv = ["--clients", "4", "--duration-s", "4", "--warm-up-s", "1", "--device", "cpu"]
    assert load.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == 0, report["first_errors"]
    assert report["calls"] > 0
    start, end = report["registered_regions"]
    assert end == start  # inline here: both 0; by reference the clients keep their regions
    assert report["server_registered_regions"] == [0, 0]  # from the server's metrics
    assert all(passed is not False for passed in report["checks"].values()), report["checks"]
    for method in ("BuildTree", "AcceptTree", "VerifyAttention"):
        latency = report["latency"][method]
        assert latency["calls"] > 0
        assert 0 < latency["p50_ms"] <= latency["p99_ms"] <= latency["p999_ms"]
    server = report["server"]
    assert server["threads_end"] == server["threads_start"]
    assert server["fds_end"] == server["fds_start"]
    assert server["rss_growth_fraction"] <= 0.05
    assert server["exit_code_after_sigterm"] == 0
