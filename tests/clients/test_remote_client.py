"""The remote client: base-dependency imports, address parsing, retries and error mapping."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddtree.clients import Client, RetryPolicy
from ddtree.clients.errors import (
    DDTreeClientError,
    InvalidArgumentError,
    MemoryTokenNotFoundError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    UnknownError,
    error_for,
)
from ddtree.clients.remote import _Plan, _RetryBudget

_ISOLATION_SCRIPT = """
import importlib.abc, sys

FORBIDDEN = ("cuda", "prometheus_client", "grpc_health", "grpc_reflection", "ddtree.service")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
            raise ImportError(f"{name} must not be imported by the remote client")
        return None

sys.meta_path.insert(0, Block())
from ddtree.clients import AsyncClient, Client, KvCommit
from ddtree.clients.errors import DDTreeClientError
client = Client("127.0.0.1:1")
client.close()
loaded = sorted(m for m in sys.modules if m.startswith(FORBIDDEN))
assert not loaded, loaded
print("ok")
"""


def test_remote_client_imports_with_base_dependencies_only() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _ISOLATION_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("address", ["localhost", "unix:relative.sock", ":50051", "host:port"])
def test_bad_addresses_are_refused(address: str) -> None:
    with pytest.raises(ValueError, match="address"):
        Client(address)


def test_unreachable_server_is_retried_then_unavailable(tmp_path: Path) -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02)
    started = time.monotonic()
    with (
        Client(f"unix:{tmp_path / 'nobody.sock'}", retry=policy) as client,
        pytest.raises(UnavailableError) as raised,
    ):
        client.server_info(timeout_s=10)
    assert raised.value.code == "UNAVAILABLE"
    assert time.monotonic() - started < 10


def test_timeout_bounds_all_attempts(tmp_path: Path) -> None:
    policy = RetryPolicy(max_attempts=100, initial_backoff_s=0.05, max_backoff_s=0.05)
    started = time.monotonic()
    with (
        Client(f"unix:{tmp_path / 'nobody.sock'}", retry=policy) as client,
        pytest.raises(DDTreeClientError),
    ):
        client.build_tree(torch.zeros(1, 1, 2), torch.zeros(1, dtype=torch.int64), 1, timeout_s=0.3)
    assert time.monotonic() - started < 5


def _unavailable(retry_after_s: float | None = None) -> DDTreeClientError:
    return error_for("UNAVAILABLE", "down", reason="WARMING_UP", retry_after_s=retry_after_s)


def test_plan_retries_only_retryable_codes_of_idempotent_calls() -> None:
    policy = RetryPolicy(initial_backoff_s=0.001)
    plan = _Plan(policy, _RetryBudget(policy), 30.0, idempotent=True)
    assert plan.next_delay_s(_unavailable()) is not None
    assert plan.next_delay_s(error_for("RESOURCE_EXHAUSTED", "busy")) is not None
    assert plan.next_delay_s(error_for("INVALID_ARGUMENT", "bad")) is None
    once = _Plan(policy, _RetryBudget(policy), 30.0, idempotent=False)
    assert once.next_delay_s(_unavailable()) is None


def test_plan_stops_after_max_attempts_and_honours_retry_info() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.001, max_backoff_s=0.001)
    plan = _Plan(policy, _RetryBudget(policy), 30.0, idempotent=True)
    assert plan.next_delay_s(_unavailable(retry_after_s=0.25)) == pytest.approx(0.25)
    assert plan.next_delay_s(_unavailable()) is not None
    assert plan.next_delay_s(_unavailable()) is None


def test_retry_budget_is_shared_and_refilled_by_successes() -> None:
    policy = RetryPolicy(initial_backoff_s=0.001, budget_tokens=2, budget_refill=1)
    budget = _RetryBudget(policy)
    for _ in range(2):
        assert _Plan(policy, budget, 30.0, idempotent=True).next_delay_s(_unavailable())
    assert _Plan(policy, budget, 30.0, idempotent=True).next_delay_s(_unavailable()) is None
    budget.refill()
    assert _Plan(policy, budget, 30.0, idempotent=True).next_delay_s(_unavailable())


def test_errors_map_by_reason_then_code() -> None:
    assert type(error_for("NOT_FOUND", "x", reason="MEMORY_TOKEN_NOT_FOUND")) is (
        MemoryTokenNotFoundError
    )
    assert type(error_for("NOT_FOUND", "x")) is NotFoundError
    invalid = error_for("INVALID_ARGUMENT", "f: bad", reason="INVALID_TENSOR", field="f")
    assert isinstance(invalid, InvalidArgumentError) and isinstance(invalid, ValueError)
    assert isinstance(error_for("RESOURCE_EXHAUSTED", "x"), ResourceExhaustedError)
    assert isinstance(error_for("UNAVAILABLE", "x"), ConnectionError)
    assert type(error_for("DATA_LOSS", "x")) is UnknownError


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": 0}, {"multiplier": 0.5}, {"initial_backoff_s": -1.0}],
    ids=["attempts", "multiplier", "backoff"],
)
def test_retry_policy_validates(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
