"""The build_tree benchmark's command line (bench/bench_tree.py; the measurement needs a GPU)."""

from __future__ import annotations

import argparse

import pytest
from helpers.scripts import load_bench


def test_batch_sizes_and_budgets_are_comma_separated_positive_integers() -> None:
    sizes = load_bench("bench_tree")._sizes
    assert sizes("32") == [32]
    assert sizes("1,8,32,128") == [1, 8, 32, 128]
    for bad in ("0", "32,-1", "32,,64"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            sizes(bad)
