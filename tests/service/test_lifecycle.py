"""Health transitions, warm-up, deadlines, overload, retries, internal errors and SIGTERM drain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.gates import Gate
from helpers.service_inputs import BUDGET, Step, make_step
from helpers.serving import LogWatcher, ServerThread

from ddtree.clients import Client, RetryPolicy
from ddtree.clients.errors import (
    DeadlineExceededError,
    InternalError,
    ResourceExhaustedError,
    UnavailableError,
)
from ddtree.service.config import ServiceConfig
from ddtree.service.server import SERVICE_NAME

NO_RETRY = RetryPolicy(max_attempts=1)


@pytest.fixture(scope="module")
def step() -> Step:
    return make_step()


class Calls:
    """Call observer that records the finished calls' status codes; tests wait on them."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, str]] = []
        self._condition = threading.Condition()

    def wait_for_code(self, *codes: str, count: int = 1, timeout_s: float = 30.0) -> bool:
        with self._condition:
            return self._condition.wait_for(
                lambda: sum(code in codes for _, code in self.finished) >= count, timeout_s
            )

    def rpc_started(self, service: str, method: str) -> None:
        assert service == SERVICE_NAME

    def rpc_finished(self, service: str, method: str, code: str, latency_seconds: float) -> None:
        with self._condition:
            self.finished.append((method, code))
            self._condition.notify_all()


@pytest.fixture
def gate() -> Iterator[Gate]:
    gate = Gate()
    yield gate
    gate.release.set()  # never leave the worker blocked at teardown


def start(tmp_path: Path, **kwargs: object) -> ServerThread:
    config_args = {k: kwargs.pop(k) for k in list(kwargs) if k in ServiceConfig.__annotations__}
    config = ServiceConfig(listen=(f"unix:{tmp_path / 'd.sock'}",), device="cpu", **config_args)  # type: ignore[arg-type]
    thread = ServerThread(config, **kwargs)  # type: ignore[arg-type]
    thread.start()
    return thread


def build(client: Client, step: Step, **kwargs: object) -> torch.Tensor:
    return client.build_tree(step.draft_logits, step.root_tokens, BUDGET, **kwargs).tokens  # type: ignore[arg-type]


def test_health_goes_not_serving_serving_not_serving(tmp_path: Path, step: Step) -> None:
    thread = start(tmp_path, warm_up=False)
    try:
        with Client(thread.addresses[0], retry=NO_RETRY) as client:
            assert client.health() == "NOT_SERVING"
            assert client.health(SERVICE_NAME) == "NOT_SERVING"
            with pytest.raises(UnavailableError) as raised:
                build(client, step)
            assert raised.value.reason == "WARMING_UP"
            assert raised.value.retry_after_s is not None
            server = thread.server
            assert server is not None
            server.engine.warm_up()
            thread.run(server.mark_serving())
            assert client.health() == client.health(SERVICE_NAME) == "SERVING"
            assert torch.equal(build(client, step), step.tree.tokens)
            thread.run(server.health.enter_graceful_shutdown())
            assert client.health() == client.health(SERVICE_NAME) == "NOT_SERVING"
    finally:
        thread.stop()


def test_client_retries_unavailable_until_warm(tmp_path: Path, step: Step) -> None:
    calls = Calls()
    thread = start(tmp_path, warm_up=False, call_observer=calls)
    try:
        server = thread.server
        assert server is not None
        with Client(thread.addresses[0]) as client, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(build, client, step)
            assert calls.wait_for_code("UNAVAILABLE")
            server.engine.warm_up()
            thread.run(server.mark_serving())
            assert torch.equal(pending.result(timeout=30), step.tree.tokens)
        assert ("BuildTree", "UNAVAILABLE") in calls.finished
        assert calls.finished[-1] == ("BuildTree", "OK")
    finally:
        thread.stop()


def test_client_deadline_cancels_queued_work(tmp_path: Path, step: Step, gate: Gate) -> None:
    calls = Calls()
    thread = start(tmp_path, engine_observer=gate, call_observer=calls)
    try:
        with Client(thread.addresses[0]) as client, ThreadPoolExecutor(1) as pool:
            first = pool.submit(build, client, step)
            assert gate.entered.wait(30)
            with pytest.raises(DeadlineExceededError):
                build(client, step, timeout_s=0.2)
            # The server's own deadline or the client's cancellation ends it, whichever is first.
            assert calls.wait_for_code("DEADLINE_EXCEEDED", "CANCELLED")
            gate.release.set()
            assert torch.equal(first.result(timeout=30), step.tree.tokens)
            assert torch.equal(build(client, step), step.tree.tokens)
        # The timed-out call was dropped from the queue and never launched.
        assert gate.ops == ["build_tree", "build_tree"]
    finally:
        thread.stop()


def test_server_caps_long_deadlines(tmp_path: Path, step: Step, gate: Gate) -> None:
    thread = start(tmp_path, engine_observer=gate, request_deadline_cap_s=0.2)
    try:
        with Client(thread.addresses[0]) as client:
            with pytest.raises(DeadlineExceededError) as raised:
                build(client, step, timeout_s=30)
            assert raised.value.reason == "DEADLINE_EXCEEDED"
            assert "capped at 0.2 s" in raised.value.message
            gate.release.set()
            assert torch.equal(build(client, step), step.tree.tokens)
    finally:
        thread.stop()


def test_overload_is_refused_with_retry_info_and_retried(
    tmp_path: Path, step: Step, gate: Gate
) -> None:
    calls = Calls()
    thread = start(tmp_path, engine_observer=gate, call_observer=calls, max_concurrent_calls=1)
    try:
        address = thread.addresses[0]
        with (
            Client(address) as client,
            Client(address, retry=NO_RETRY) as impatient,
            ThreadPoolExecutor(2) as pool,
        ):
            first = pool.submit(build, client, step)
            assert gate.entered.wait(30)
            with pytest.raises(ResourceExhaustedError) as raised:
                build(impatient, step)
            assert raised.value.reason == "OVERLOADED"
            assert raised.value.retry_after_s == pytest.approx(0.05)
            # A retrying client is refused too, backs off, and gets through after the first.
            second = pool.submit(build, client, step)
            assert calls.wait_for_code("RESOURCE_EXHAUSTED", count=2)
            gate.release.set()
            assert torch.equal(first.result(timeout=30), step.tree.tokens)
            assert torch.equal(second.result(timeout=30), step.tree.tokens)
    finally:
        thread.stop()


def test_unexpected_error_is_internal_with_request_id_only(
    tmp_path: Path, step: Step, gate: Gate
) -> None:
    gate.fail_op = "accept"
    gate.release.set()
    thread = start(tmp_path, engine_observer=gate)
    try:
        with Client(thread.addresses[0]) as client:
            with pytest.raises(InternalError) as raised:
                client.accept_tree(step.tree, step.target_tokens)
            error = raised.value
            assert error.reason == "INTERNAL"
            assert error.request_id and error.request_id in error.message
            assert "secret" not in error.message
            assert torch.equal(build(client, step), step.tree.tokens)
    finally:
        thread.stop()


def test_device_failure_turns_health_not_serving_and_refuses_calls(
    tmp_path: Path, step: Step, gate: Gate
) -> None:
    gate.fail_op = "accept"
    gate.failure = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    gate.release.set()
    thread = start(tmp_path, engine_observer=gate)
    try:
        with Client(thread.addresses[0], retry=NO_RETRY) as client:
            assert client.health() == "SERVING"
            with pytest.raises(InternalError) as raised:
                client.accept_tree(step.tree, step.target_tokens)
            assert "illegal" not in raised.value.message
            assert client.health() == client.health(SERVICE_NAME) == "NOT_SERVING"
            server = thread.server
            assert server is not None and server.failed.is_set()
            with pytest.raises(UnavailableError) as refused:
                build(client, step)
            assert refused.value.reason == "SHUTTING_DOWN"
    finally:
        thread.stop()


def test_sigterm_drains_in_flight_call_and_exits_0(tmp_path: Path) -> None:
    socket = tmp_path / "serve.sock"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree.service",
            "serve",
            "--listen",
            f"unix:{socket}",
            "--device",
            "cpu",
            "--log-level",
            "DEBUG",
            "--grace-s",
            "60",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log = LogWatcher(process.stderr)
    try:
        log.wait_for("event=serving")
        generator = torch.Generator().manual_seed(3)
        logits = torch.randn(1, 16, 4096, generator=generator)  # about a second on the CPU
        roots = torch.zeros(1, dtype=torch.int64)
        with Client(f"unix:{socket}") as client, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(client.build_tree, logits, roots, 512)
            log.wait_for("event=rpc_received method=BuildTree")
            process.send_signal(signal.SIGTERM)
            tree = pending.result(timeout=60)
        assert int(tree.num_nodes[0]) == 513
        assert process.wait(timeout=60) == 0
        log.wait_for("event=stopped")
        text = log.text()
        assert text.index("event=signal_received") < text.index("event=stopped")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.join()
        assert process.stderr is not None
        process.stderr.close()
