"""Faults: SIGTERM under load, SIGKILL and restart, deadlines in the queue and during work, a
caller killed mid-call, and a poisoned device that must end the process with exit code 3."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.gates import Gate
from helpers.service_inputs import BUDGET, Step, make_step
from helpers.serving import LogWatcher, ServerThread

from ddtree.clients import Client, KvCommit, RetryPolicy
from ddtree.clients.errors import (
    DDTreeClientError,
    DeadlineExceededError,
    InternalError,
    UnavailableError,
)
from ddtree.service.config import ServiceConfig
from ddtree.service.server import SERVICE_NAME

NO_RETRY = RetryPolicy(max_attempts=1)


@pytest.fixture(scope="module")
def step() -> Step:
    return make_step()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def serve_process(
    *args: str, code: str | None = None
) -> Iterator[tuple[subprocess.Popen[str], LogWatcher]]:
    """``ddtree serve ARGS`` (or ``python -c CODE ARGS``) with its log collected; killed at exit."""
    command = [sys.executable, "-m", "ddtree.service", "serve", *args]
    if code is not None:
        command = [sys.executable, "-c", code, "serve", *args]
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stderr is not None
    log = LogWatcher(process.stderr)
    try:
        yield process, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.join()
        process.stderr.close()


def _slow_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """A BuildTree that takes seconds on the CPU reference."""
    generator = torch.Generator().manual_seed(3)
    return torch.randn(1, 32, 8192, generator=generator), torch.zeros(1, dtype=torch.int64)


def test_sigterm_under_load_drains_and_exits_0(tmp_path: Path, step: Step) -> None:
    address = f"127.0.0.1:{_free_port()}"
    flags = ("--listen", address, "--device", "cpu", "--log-level", "DEBUG", "--grace-s", "60")
    with serve_process(*flags) as (process, log):
        log.wait_for("event=serving")
        codes: list[str] = []
        codes_lock = threading.Lock()
        stop = threading.Event()
        health_seen: list[int] = []

        def load() -> None:
            with Client(address, retry=NO_RETRY) as client:
                while not stop.is_set():
                    try:
                        client.accept_tree(step.tree, step.target_tokens, timeout_s=30)
                        code = "OK"
                    except DDTreeClientError as err:
                        code = err.code
                    with codes_lock:
                        codes.append(code)
                    if code != "OK":
                        return

        def watch_health() -> None:
            channel = grpc.insecure_channel(address)
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                for reply in stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME)):
                    health_seen.append(reply.status)
            except grpc.RpcError:
                pass
            finally:
                channel.close()

        logits, roots = _slow_inputs()
        with ThreadPoolExecutor(6) as pool, Client(address) as slow_client:
            watcher = pool.submit(watch_health)
            workers = [pool.submit(load) for _ in range(4)]  # AcceptTree in a loop
            log.wait_for("event=rpc_received method=AcceptTree")
            slow = pool.submit(slow_client.build_tree, logits, roots, 1024)
            log.wait_for("event=rpc_received method=BuildTree")  # the slow call is in flight
            process.send_signal(signal.SIGTERM)
            log.wait_for("event=draining")
            # New calls after the drain began are refused with UNAVAILABLE.
            with (
                Client(address, retry=NO_RETRY) as late,
                pytest.raises(UnavailableError) as refused,
            ):
                late.build_tree(step.draft_logits, step.root_tokens, BUDGET, timeout_s=10)
            assert not slow.done()  # refused while the server drained, not after it left
            assert refused.value.reason == "SHUTTING_DOWN"
            assert refused.value.retry_after_s is not None
            tree = slow.result(timeout=120)
            for worker in workers:
                worker.result(timeout=60)
            stop.set()
            assert process.wait(timeout=60) == 0
            watcher.result(timeout=60)
        # The in-flight call finished; every load call either finished or was refused. The
        # server cancelled no call it had started. (One CI run, not reproduced since, saw a
        # worker's last call end CANCELLED: a call the server never handled, cut off as the
        # process exited. The server now refuses stragglers for a quiet period before it stops;
        # the log lines below tell the two cases apart if it happens again.)
        assert int(tree.num_nodes[0]) == 1025
        rpc_lines = [line for line in log.text().splitlines() if "event=rpc_" in line][-40:]
        assert not any("event=rpc_cancelled" in line for line in rpc_lines), rpc_lines
        assert set(codes) <= {"OK", "UNAVAILABLE", "CANCELLED"}, (codes, rpc_lines)
        assert codes.count("CANCELLED") <= 1, (codes, rpc_lines)
        refused = codes.count("UNAVAILABLE") + codes.count("CANCELLED")
        assert "OK" in codes and refused == 4, (codes, rpc_lines)  # each worker stops at one
        # Health said SERVING, then NOT_SERVING before the server went away.
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert health_seen[:1] == [serving] and not_serving in health_seen, health_seen
        text = log.text()
        assert text.index("event=signal_received") < text.index("event=draining")
        assert text.index("event=draining") < text.index("event=stopped")


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_sigkill_and_restart_clients_carry_on(step: Step, tmp_path: Path, transport: str) -> None:
    # On a Unix socket the killed process leaves its socket file behind; the new one replaces it.
    tcp = f"127.0.0.1:{_free_port()}"
    address = tcp if transport == "tcp" else f"unix:{tmp_path / 'd.sock'}"
    flags = ("--listen", address, "--device", "cpu")
    with Client(address, retry=NO_RETRY) as impatient, Client(address) as patient:
        with serve_process(*flags) as (process, log):
            log.wait_for("event=serving")
            expected = patient.build_tree(step.draft_logits, step.root_tokens, BUDGET).tokens
            process.send_signal(signal.SIGKILL)
            assert process.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(UnavailableError):
            impatient.build_tree(step.draft_logits, step.root_tokens, BUDGET, timeout_s=10)
        with serve_process(*flags) as (_, log):
            log.wait_for("event=serving")
            # The same client objects reconnect by themselves: no caller-side restart.
            deadline = time.monotonic() + 30
            while True:
                try:
                    tokens = patient.build_tree(
                        step.draft_logits, step.root_tokens, BUDGET, timeout_s=10
                    ).tokens
                    break
                except UnavailableError:
                    assert time.monotonic() < deadline, "no reconnection within 30 s"
            assert torch.equal(tokens, expected)
            assert torch.equal(
                impatient.build_tree(step.draft_logits, step.root_tokens, BUDGET).tokens, expected
            )


def _unix_config(tmp_path: Path) -> ServiceConfig:
    return ServiceConfig(listen=(f"unix:{tmp_path / 'd.sock'}",), device="cpu")


@pytest.fixture
def gated(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Gate, Client]]:
    """A server whose engine holds the op named by the parameter, and a client without retries."""
    gate = Gate(request.param)
    with ServerThread(_unix_config(tmp_path), engine_observer=gate) as thread:
        with Client(thread.addresses[0], retry=NO_RETRY) as client:
            yield gate, client
        gate.release.set()  # never leave the worker blocked at teardown


@pytest.mark.parametrize("gated", ["build_tree"], indirect=True)
def test_calls_whose_deadline_expires_in_the_queue_never_run(
    gated: tuple[Gate, Client], step: Step
) -> None:
    gate, client = gated
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.build_tree, step.draft_logits, step.root_tokens, BUDGET)
        assert gate.entered.wait(30)
        for _ in range(5):  # queued behind the held call, each past its deadline
            with pytest.raises(DeadlineExceededError):
                client.accept_tree(step.tree, step.target_tokens, timeout_s=0.1)
        gate.release.set()
        assert torch.equal(first.result(timeout=30).tokens, step.tree.tokens)
    client.accept_tree(step.tree, step.target_tokens)
    # One held build, then only the good accept: the five timed-out calls never launched.
    assert gate.ops == ["build_tree", "accept"]


@pytest.mark.parametrize("gated", ["commit_kv"], indirect=True)
def test_deadline_during_work_leaves_inline_caller_memory_untouched(
    gated: tuple[Gate, Client], step: Step
) -> None:
    gate, client = gated
    cache = step.kv_cache.clone()
    commit = KvCommit(cache, step.block_table, step.prefix_lens)
    with pytest.raises(DeadlineExceededError):
        client.accept_tree(step.tree, step.target_tokens, kv_commit=commit, timeout_s=0.5)
    assert gate.entered.is_set()  # the call was in the middle of its device work
    gate.release.set()
    # Inline tensors: the caller's cache is written only from a successful reply.
    assert torch.equal(cache, step.kv_cache)
    client.accept_tree(step.tree, step.target_tokens, kv_commit=commit)
    assert not torch.equal(cache, step.kv_cache)


class Calls:
    """Call observer recording finished calls' status codes; tests wait on them."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[tuple[str, str]] = []
        self._condition = threading.Condition()

    def wait_for(self, code: str, timeout_s: float = 30.0) -> bool:
        with self._condition:
            return self._condition.wait_for(
                lambda: any(c == code for _, c in self.finished), timeout_s
            )

    def wait_started(self, method: str, timeout_s: float = 30.0) -> bool:
        with self._condition:
            return self._condition.wait_for(lambda: method in self.started, timeout_s)

    def rpc_started(self, service: str, method: str) -> None:
        with self._condition:
            self.started.append(method)
            self._condition.notify_all()

    def rpc_finished(self, service: str, method: str, code: str, latency_seconds: float) -> None:
        with self._condition:
            self.finished.append((method, code))
            self._condition.notify_all()


_KILLED_CLIENT = """
import sys, torch
from ddtree.clients import Client
generator = torch.Generator().manual_seed(3)
logits = torch.randn(1, 16, 4096, generator=generator)
with Client(sys.argv[1]) as client:
    print("calling", flush=True)
    client.build_tree(logits, torch.zeros(1, dtype=torch.int64), 512)
"""


def test_caller_killed_mid_call_does_not_disturb_others(tmp_path: Path, step: Step) -> None:
    calls = Calls()
    with ServerThread(_unix_config(tmp_path), call_observer=calls) as thread:
        address = thread.addresses[0]
        caller = subprocess.Popen(
            [sys.executable, "-c", _KILLED_CLIENT, address], stdout=subprocess.PIPE, text=True
        )
        try:
            assert caller.stdout is not None
            assert caller.stdout.readline().strip() == "calling"
            assert calls.wait_started("BuildTree")  # the caller's slow call is in the server
            caller.kill()
            caller.wait(timeout=30)
            # The server notices the dead caller (its call ends CANCELLED) and serves on.
            assert calls.wait_for("CANCELLED")
            with Client(address) as other:
                for _ in range(3):
                    acceptance = other.accept_tree(step.tree, step.target_tokens)
                    assert int(acceptance.length.min()) >= 1
        finally:
            if caller.poll() is None:
                caller.kill()
                caller.wait()
            assert caller.stdout is not None
            caller.stdout.close()


# A ddtree serve process whose accept op fails like a sticky CUDA error once warm-up is over.
_POISONED_SERVER = """
import sys, torch
from ddtree import kernels
from ddtree.service.cli import main
real_accept = kernels.accept
def accept(tree, *args, **kwargs):
    if tree.batch_size > 1:  # warm-up uses batch size 1
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    return real_accept(tree, *args, **kwargs)
kernels.accept = accept
sys.exit(main(sys.argv[1:]))
"""


def test_poisoned_device_reports_not_serving_and_exits_3(tmp_path: Path, step: Step) -> None:
    address = f"unix:{tmp_path / 'p.sock'}"
    flags = ("--listen", address, "--device", "cpu", "--grace-s", "5")
    with serve_process(*flags, code=_POISONED_SERVER) as (process, log):
        log.wait_for("event=serving")
        with Client(address, retry=NO_RETRY) as client:
            assert client.health() == "SERVING"
            with pytest.raises(InternalError) as raised:
                client.accept_tree(step.tree, step.target_tokens)
            assert "illegal" not in raised.value.message  # the device error stays in the log
        assert process.wait(timeout=60) == 3
        text = log.text()
        assert "event=device_failed" in text
        assert text.index("event=device_failed_exiting exit_code=3") < text.index("event=stopped")
