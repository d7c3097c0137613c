"""Shared pytest configuration: GPU markers, fixed seeds and a per-module kernel cache.

Tests marked ``gpu`` skip with a precise reason when no CUDA device is usable; with
``DDTREE_REQUIRE_GPU=1`` (GPU CI) such a skip becomes a failure, so a green run means the GPU
tests really ran. Tests marked ``sm90`` additionally need compute capability 9.0.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

_REQUIRE_GPU = os.environ.get("DDTREE_REQUIRE_GPU", "") == "1"


def _gpu_missing_reason(needs_sm90: bool) -> str | None:
    if not torch.cuda.is_available():
        return (
            f"needs a CUDA GPU; torch {torch.__version__} reports none "
            f"(torch.version.cuda = {torch.version.cuda})"
        )
    if needs_sm90:
        capability = torch.cuda.get_device_capability()
        if capability != (9, 0):
            name = torch.cuda.get_device_name()
            return f"needs compute capability 9.0 (sm_90), found {capability} on {name}"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    needs_sm90 = item.get_closest_marker("sm90") is not None
    if item.get_closest_marker("gpu") is None and not needs_sm90:
        return
    reason = _gpu_missing_reason(needs_sm90)
    if reason is None:
        return
    if _REQUIRE_GPU:
        pytest.fail(f"DDTREE_REQUIRE_GPU=1 but this test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    """Seed Python and torch before every test so failures reproduce."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One kernel cache for every server a test module starts (compile once).

    ``DDTREE_CACHE_DIR`` when the environment sets it (a GPU run reuses its compiled kernels),
    else a fresh directory; the variable is set for the module and restored afterwards.
    """
    path = Path(os.environ.get("DDTREE_CACHE_DIR") or tmp_path_factory.mktemp("kernels"))
    previous = os.environ.get("DDTREE_CACHE_DIR")
    os.environ["DDTREE_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        del os.environ["DDTREE_CACHE_DIR"]
    else:
        os.environ["DDTREE_CACHE_DIR"] = previous
