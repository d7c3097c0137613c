"""The gRPC floor diagnostic (bench/bench_grpc_floor.py) keeps working on the CPU.

Its server picks each variant's work by method name; a misspelt name would silently measure an
empty handler, so every variant must come back, and the working handlers must take their time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers.scripts import load_bench


def test_every_variant_is_measured_and_handlers_work(tmp_path: Path) -> None:
    bench = load_bench("bench_grpc_floor")
    out = tmp_path / "floor.json"
    bench.main(["--calls", "5", "--rounds", "1", "--out", str(out)])
    (variants,) = json.loads(out.read_text())["rounds"]
    expected = set(bench.VARIANTS) | (
        set(bench.CUDA_VARIANTS) if torch.cuda.is_available() else set()
    )
    assert set(variants) == expected
    for kind, figures in variants.items():
        assert all(figures[part] > 0 for part in ("total_us", "inbound_us", "outbound_us")), kind
        # Medians: the parts' need not add up to the total's exactly.
        assert figures["inbound_us"] + figures["outbound_us"] <= 1.5 * figures["total_us"], kind
    # Busy-waits and sleeps are measured inside the handler, and the empty ones are short.
    assert variants["handler_spin_400us"]["handler_us"] >= 400
    assert variants["handler_spin_200us"]["handler_us"] >= 200
    assert variants["handler_sleep_400us"]["handler_us"] >= 400
    assert variants["bare"]["handler_us"] < 200
    if torch.cuda.is_available():
        assert variants["handler_cuda_wait_200us"]["handler_us"] >= 200
