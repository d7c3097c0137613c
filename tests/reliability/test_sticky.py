"""A sticky device error ends the server: health NOT_SERVING, calls refused, exit code 3.

On the CPU the wiring is checked in-process: an op fails with a CUDA launch error that torch did
not raise (so the engine does not know its context is gone) and the device probe reports the
context dead. On a GPU (``gpu`` marker) a real sticky error is provoked in the server's own
CUDA context by ``sticky_server.py`` (a ``trap`` instruction, or a store through a null pointer),
and the real ``ddtree serve`` process must report NOT_SERVING and exit 3 within
``EXIT_BOUND_S``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.service_inputs import Step, make_step
from helpers.serving import LogWatcher, ServerThread

from ddtree import kernels
from ddtree.clients import Client, RetryPolicy
from ddtree.clients.errors import DDTreeClientError, InternalError, InvalidArgumentError
from ddtree.kernels import jit
from ddtree.service import server as server_module
from ddtree.service.config import ServiceConfig
from ddtree.service.server import SERVICE_NAME, device_failure

LAUNCHER = Path(__file__).resolve().parent / "sticky_server.py"
NO_RETRY = RetryPolicy(max_attempts=1)
GRACE_S = 5.0
EXIT_BOUND_S = GRACE_S + 25.0
"""From the fault to the process's exit: the drain's grace plus engine release and exit."""


@pytest.fixture(scope="module")
def step() -> Step:
    return make_step()


def watch_health(address: str, seen: list[str], stop: threading.Event) -> None:
    """Append every status of a health ``Watch`` of the service until the stream ends."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for reply in stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME)):
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                if stop.is_set():
                    return
        except grpc.RpcError:
            return


def test_device_failure_is_none_on_the_cpu() -> None:
    assert device_failure(torch.device("cpu")) is None


def test_a_launch_error_the_engine_missed_is_found_by_the_probe(
    step: Step, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An op fails with cuda-python's launch error (not a torch device error, so the engine
    keeps serving); the server's probe then finds the context dead and turns NOT_SERVING."""
    probed: list[torch.device] = []
    dead = threading.Event()

    def probe(device: torch.device) -> str | None:
        probed.append(device)
        return "CUDA error: unspecified launch failure" if dead.is_set() else None

    real_accept = kernels.accept

    def accept(tree: Any, *args: Any, **kwargs: Any) -> Any:
        if tree.batch_size > 1 and dead.is_set():  # warm-up uses batch size 1
            raise jit.CudaError("kernel launch failed", result_name="CUDA_ERROR_LAUNCH_FAILED")
        return real_accept(tree, *args, **kwargs)

    monkeypatch.setattr(server_module, "device_failure", probe)
    monkeypatch.setattr(kernels, "accept", accept)
    thread = ServerThread(ServiceConfig(listen=("127.0.0.1:0",), device="cpu"))
    address = thread.start()[0]
    try:
        assert thread.server is not None
        with Client(address, retry=NO_RETRY) as client:
            # A caller's mistake (INVALID_ARGUMENT) was answered by a working device: no probe.
            with pytest.raises(InvalidArgumentError):
                client.build_tree(step.draft_logits, step.root_tokens, 0)
            time.sleep(0.2)
            assert probed == []
            assert not thread.server.failed.is_set()
            assert client.health() == "SERVING"
            dead.set()
            with pytest.raises(InternalError) as raised:
                client.accept_tree(step.tree, step.target_tokens)
            assert "launch" not in raised.value.message  # the device error stays in the log
            thread.run(asyncio.wait_for(thread.server.failed.wait(), 10))
            assert probed == [torch.device("cpu")]
            assert client.health() == "NOT_SERVING"
    finally:
        thread.stop()


@pytest.fixture
def sticky_server() -> Iterator[Any]:
    """Starts ``sticky_server.py`` processes (killed at the end if still running)."""
    started: list[tuple[subprocess.Popen[str], LogWatcher]] = []

    def start(fault: str, address: str, trigger: Path) -> tuple[subprocess.Popen[str], LogWatcher]:
        command = [
            sys.executable,
            str(LAUNCHER),
            "--fault",
            fault,
            "--trigger",
            str(trigger),
            "--device",
            "cuda:0",
            "--",
            "--listen",
            address,
            "--grace-s",
            str(GRACE_S),
            "--log-level",
            "DEBUG",
        ]
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        assert process.stderr is not None
        started.append((process, LogWatcher(process.stderr)))
        return started[-1]

    yield start
    for process, log in started:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.join()
        assert process.stderr is not None
        process.stderr.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fault", ["trap", "null-write"])
def test_real_sticky_cuda_error_ends_the_server(
    fault: str, tmp_path: Path, step: Step, sticky_server: Any
) -> None:
    address = f"unix:{tmp_path / 'sticky.sock'}"
    trigger = tmp_path / "trigger"
    process, log = sticky_server(fault, address, trigger)
    log.wait_for("event=serving", 300)
    health_seen: list[str] = []
    stop_watch = threading.Event()
    watcher = threading.Thread(target=watch_health, args=(address, health_seen, stop_watch))
    watcher.start()
    with Client(address, retry=NO_RETRY) as client:
        before = client.accept_tree(step.tree, step.target_tokens)
        assert int(before.length.min()) >= 1
        assert client.health() == "SERVING"
        trigger.touch()
        injected = log.wait_for("event=fault_injected", 60)
        faulted_at = time.monotonic()
        assert "no error" not in injected, injected
        with pytest.raises(DDTreeClientError) as raised:
            client.accept_tree(step.tree, step.target_tokens, timeout_s=30)
        assert raised.value.code in ("INTERNAL", "UNAVAILABLE"), raised.value
    code = process.wait(timeout=EXIT_BOUND_S + 30)
    exited_after_s = time.monotonic() - faulted_at
    stop_watch.set()
    watcher.join(timeout=30)
    log.join()
    text = log.text()
    sys.stderr.write(
        f"sticky {fault}: {injected.strip()}; next call {raised.value.code}; "
        f"health {health_seen}; exit {code} after {exited_after_s:.1f} s\n"
    )
    assert code == 3, text[-3000:]
    assert exited_after_s <= EXIT_BOUND_S, text[-3000:]
    assert "NOT_SERVING" in health_seen[health_seen.index("SERVING") :], health_seen
    assert "event=device_failed" in text
    assert text.index("event=device_failed_exiting exit_code=3") < text.index("event=stopped")
