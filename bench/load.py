"""Bounded load test: N concurrent clients against a ``ddtree serve`` process on loopback.

Each client loops BuildTree -> AcceptTree (with a KV commit) -> VerifyAttention over small
inputs for ``--duration-s`` seconds (after ``--warm-up-s`` seconds that are not counted), with
tensors inline; on a GPU server with registered memory, every other client sends them by
reference (``tensor_transport="ipc"``: real CUDA IPC, the server maps the clients' memory). The
driver reports calls per second, latency percentiles per method (and per transport), the error
count (must be 0), and, at the start and end of the measured window, the server process's
resident memory, threads and file descriptors, its GPU memory on a GPU, and the regions
registered: as the clients list them and as the server's Prometheus gauges count them.

Usage::

    python bench/load.py                       # 16 clients, 60 s, JSON to bench/results/
    python bench/load.py --duration-s 5 --clients 4 --out /tmp/load.json

Exit status: 0 when every check of ``checks`` passed (no call failed, resident and GPU memory
within ``--max-rss-growth``, threads, descriptors and registered regions not grown, exit 0 after
SIGTERM), else 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from caller_grpc_io import restart_with_server_grpc_io

from ddtree.clients import Client, KvCommit, RetryPolicy
from ddtree.clients.errors import DDTreeClientError
from ddtree.service.config import grpc_experiments

_log = logging.getLogger("ddtree.bench.load")

RESULTS = Path(__file__).resolve().parent / "results"

BATCH_SIZE, DRAFT_LEN, VOCAB_SIZE, BUDGET = 2, 4, 1024, 16
NUM_HEADS, HEAD_DIM, V_DIM, PAGE_SIZE, MAX_PAGES = 4, 64, 64, 16, 4  # CUDA: multiples of 64
METHODS = ("BuildTree", "AcceptTree", "VerifyAttention")
NO_RETRY = RetryPolicy(max_attempts=1)
"""Every failure counts: the load must not need retries."""


@dataclass(frozen=True)
class ProcessSample:
    """Resources of the server process at one moment (Linux ``/proc``)."""

    rss_bytes: int
    threads: int
    fds: int


def sample_process(pid: int) -> ProcessSample:
    """Resident memory, thread count and open file descriptors of ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    values = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(values["VmRSS"].split()[0])
    threads = int(values["Threads"])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return ProcessSample(rss_kib * 1024, threads, fds)


def _nvidia_smi(*query: str) -> list[list[str]]:
    """Rows of an ``nvidia-smi`` CSV query; empty without a GPU or the tool."""
    try:
        out = subprocess.run(
            ["nvidia-smi", *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_memory_used_bytes(pid: int) -> int | None:
    """GPU memory the server process holds (``nvidia-smi``), or ``None`` when not listed
    (no GPU, or a container whose process ids ``nvidia-smi`` does not see)."""
    for fields in _nvidia_smi("--query-compute-apps=pid,used_memory"):
        if len(fields) == 2 and fields[0] == str(pid):
            return int(fields[1]) << 20
    return None


def gpu_device_memory_used_bytes() -> int | None:
    """Memory in use on GPU 0 by every process (the server and this driver's IPC clients)."""
    rows = _nvidia_smi("--query-gpu=memory.used")
    return int(rows[0][0]) << 20 if rows and rows[0][0].isdigit() else None


def server_gauges(metrics_address: str | None) -> dict[str, float]:
    """``ddtree_registered_regions`` / ``ddtree_registered_bytes`` summed over devices, from the
    server's Prometheus endpoint (``{}`` without one)."""
    if metrics_address is None:
        return {}
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    totals = {"ddtree_registered_regions": 0.0, "ddtree_registered_bytes": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


@dataclass
class Tally:
    """Latencies (seconds) per method and per transport, and failures, shared by the client
    threads."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METHODS})
    by_transport: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, method: str, seconds: float, transport: str = "inline") -> None:
        with self.lock:
            self.latencies[method].append(seconds)
            self.by_transport.setdefault(f"{method} {transport}", []).append(seconds)

    def fail(self, method: str, err: Exception) -> None:
        with self.lock:
            self.errors.append(f"{method}: {err}")


def make_inputs(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One client's step inputs on ``device`` (small, so the CPU reference keeps up)."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = BATCH_SIZE * MAX_PAGES
    inputs = {
        "draft_logits": torch.randn(BATCH_SIZE, DRAFT_LEN, VOCAB_SIZE, generator=generator),
        "root_tokens": torch.randint(0, VOCAB_SIZE, (BATCH_SIZE,), generator=generator),
        "kv_cache": torch.randn(num_pages, PAGE_SIZE, HEAD_DIM, generator=generator).to(
            torch.bfloat16
        ),
        "block_table": torch.randperm(num_pages, generator=generator)
        .to(torch.int32)
        .reshape(BATCH_SIZE, MAX_PAGES),
        "prefix_lens": torch.tensor([5, 17], dtype=torch.int32),
        "q": torch.randn(BATCH_SIZE, 1 + BUDGET, NUM_HEADS, HEAD_DIM, generator=generator).to(
            torch.bfloat16
        ),
    }
    return {name: tensor.to(device) for name, tensor in inputs.items()}


def client_loop(
    client: Client,
    inputs: dict[str, torch.Tensor],
    tally: Tally,
    counting: threading.Event,
    stop: threading.Event,
    transport: str = "inline",
) -> None:
    """Run steps until ``stop``; record latencies once ``counting`` is set."""

    def timed(method: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            result = call(*args, **kwargs)
        except DDTreeClientError as err:
            tally.fail(method, err)
            return None
        if counting.is_set():
            tally.add(method, time.perf_counter() - started, transport)
        return result

    while not stop.is_set():
        tree = timed(
            "BuildTree", client.build_tree, inputs["draft_logits"], inputs["root_tokens"], BUDGET
        )
        if tree is None:
            continue
        targets = tree.tokens.roll(-1, dims=1).clamp(min=0)
        commit = KvCommit(
            kv_cache=inputs["kv_cache"].clone(),
            block_table=inputs["block_table"],
            prefix_lens=inputs["prefix_lens"],
        )
        timed("AcceptTree", client.accept_tree, tree, targets, kv_commit=commit)
        timed(
            "VerifyAttention",
            client.verify_attention,
            inputs["q"],
            inputs["kv_cache"],
            inputs["block_table"],
            inputs["prefix_lens"],
            tree,
            v_dim=V_DIM,
        )


def percentiles_ms(values: Sequence[float]) -> dict[str, float]:
    """p50/p99/p999 and max of ``values`` (seconds), in milliseconds."""
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {
        "p50_ms": round(at(0.50), 3),
        "p99_ms": round(at(0.99), 3),
        "p999_ms": round(at(0.999), 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_server(device: str, extra: Sequence[str]) -> tuple[subprocess.Popen[bytes], str, str]:
    """Start ``ddtree serve`` on a free loopback port with metrics on another; returns the
    process, its address and its metrics address."""
    address = f"127.0.0.1:{_free_port()}"
    metrics_port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree.service",
            "serve",
            "--listen",
            address,
            "--device",
            device,
            "--log-level",
            "WARNING",
            "--metrics-port",
            str(metrics_port),
            *extra,
        ],
    )
    return process, address, f"127.0.0.1:{metrics_port}"


def wait_serving(address: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with Client(address) as client:
        while True:
            try:
                if client.health(timeout_s=5) == "SERVING":
                    return
            except DDTreeClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {address} not SERVING within {timeout_s} s")
            time.sleep(0.2)


def hardware() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    driver = _nvidia_smi("--query-gpu=driver_version")
    if driver:
        info["gpu_driver"] = driver[0][0]
    return info


def host_label() -> str:
    """Short label of this machine for the result file name (``h200``, ``cpu2``)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        return name.replace("nvidia", "").strip().split()[0]
    return f"cpu{os.cpu_count()}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Drive the load and return the report (see the module docstring)."""
    process: subprocess.Popen[bytes] | None = None
    address, metrics_address = args.address, None
    if address is None:
        process, address, metrics_address = start_server(args.device, args.server_arg)
    try:
        wait_serving(address, args.start_timeout_s)
        with Client(address) as probe:
            info = probe.server_info()
        by_reference = info.supports_memory_references and torch.cuda.is_available()
        clients, devices = [], []
        for index in range(args.clients):
            # By reference, every other client keeps its tensors on the GPU and sends references.
            ipc = by_reference and index % 2 == 1
            clients.append(
                Client(address, tensor_transport="ipc" if ipc else "inline", retry=NO_RETRY)
            )
            devices.append(torch.device("cuda") if ipc else torch.device("cpu"))
        tally = Tally()
        counting, stop = threading.Event(), threading.Event()
        threads = [
            threading.Thread(
                target=client_loop,
                args=(client, make_inputs(index, devices[index]), tally, counting, stop),
                kwargs={"transport": "ipc" if devices[index].type == "cuda" else "inline"},
                name=f"load-client-{index}",
            )
            for index, client in enumerate(clients)
        ]
        for thread in threads:
            thread.start()
        time.sleep(args.warm_up_s)
        start = sample_process(process.pid) if process is not None else None
        gpu_start = gpu_memory_used_bytes(process.pid) if process is not None else None
        device_gpu_start = gpu_device_memory_used_bytes()
        gauges_start = server_gauges(metrics_address)
        load_start = os.getloadavg()[0]
        regions_start = sum(len(client.list_memory()) for client in clients)
        counting.set()
        began = time.perf_counter()
        peak_rss = start.rss_bytes if start is not None else 0
        while time.perf_counter() - began < args.duration_s:
            time.sleep(min(1.0, max(0.0, args.duration_s - (time.perf_counter() - began))))
            if process is not None:
                peak_rss = max(peak_rss, sample_process(process.pid).rss_bytes)
        counting.clear()
        elapsed = time.perf_counter() - began
        load_end = os.getloadavg()[0]
        # The process first: a metrics scrape briefly holds a thread and a socket there.
        end = sample_process(process.pid) if process is not None else None
        regions_end = sum(len(client.list_memory()) for client in clients)
        gauges_end = server_gauges(metrics_address)
        gpu_end = gpu_memory_used_bytes(process.pid) if process is not None else None
        device_gpu_end = gpu_device_memory_used_bytes()
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        for client in clients:
            client.close()
    finally:
        if process is not None:
            process.terminate()
            exit_code = process.wait(timeout=60)
    calls = {m: len(v) for m, v in tally.latencies.items()}
    everything = [x for v in tally.latencies.values() for x in v]
    report: dict[str, Any] = {
        "benchmark": "load",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": hardware(),
        "setup": {
            "clients": args.clients,
            "duration_s": args.duration_s,
            "warm_up_s": args.warm_up_s,
            "transport": "loopback TCP",
            "grpc_experiments": grpc_experiments(),  # caller and server
            "machine_load_average_1m": [round(load_start, 2), round(load_end, 2)],
            "tensors": "inline and by reference" if by_reference else "inline",
            "server_backend": info.devices[0].backend if info.devices else None,
            "shapes": {
                "batch_size": BATCH_SIZE,
                "draft_len": DRAFT_LEN,
                "vocab_size": VOCAB_SIZE,
                "budget": BUDGET,
                "num_heads": NUM_HEADS,
                "head_dim": HEAD_DIM,
                "v_dim": V_DIM,
                "page_size": PAGE_SIZE,
                "max_pages": MAX_PAGES,
            },
        },
        "calls": sum(calls.values()),
        "calls_per_s": round(sum(calls.values()) / elapsed, 1),
        "latency": {"all": percentiles_ms(everything)}
        | {m: {"calls": calls[m], **percentiles_ms(v)} for m, v in tally.latencies.items()},
        "latency_by_transport": {
            key: {"calls": len(v), **percentiles_ms(v)}
            for key, v in sorted(tally.by_transport.items())
        },
        "registered_regions": [regions_start, regions_end],
        "server_registered_regions": [
            gauges_start.get("ddtree_registered_regions"),
            gauges_end.get("ddtree_registered_regions"),
        ],
        "server_registered_bytes": [
            gauges_start.get("ddtree_registered_bytes"),
            gauges_end.get("ddtree_registered_bytes"),
        ],
        "errors": len(tally.errors),
        "first_errors": tally.errors[:10],
    }
    if start is not None and end is not None:
        growth = (end.rss_bytes - start.rss_bytes) / start.rss_bytes
        report["server"] = {
            "rss_start_bytes": start.rss_bytes,
            "rss_end_bytes": end.rss_bytes,
            "rss_peak_bytes": peak_rss,
            "rss_growth_fraction": round(growth, 4),
            "threads_start": start.threads,
            "threads_end": end.threads,
            "fds_start": start.fds,
            "fds_end": end.fds,
            "gpu_memory_start_bytes": gpu_start,
            "gpu_memory_end_bytes": gpu_end,
            "gpu_device_memory_used_start_bytes": device_gpu_start,
            "gpu_device_memory_used_end_bytes": device_gpu_end,
            "exit_code_after_sigterm": exit_code,
        }
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (16)")
    parser.add_argument("--duration-s", type=float, default=60.0, help="measured seconds (60)")
    parser.add_argument("--warm-up-s", type=float, default=3.0, help="uncounted seconds first")
    parser.add_argument("--address", help="load an already running server instead")
    parser.add_argument("--device", default="auto", help="--device of the started server")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra flag for ddtree serve"
    )
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--max-rss-growth", type=float, default=0.05, help="fail above (0.05)")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = run(args)
    report["checks"] = checks(report, args.max_rss_growth)
    out = args.out or RESULTS / f"{datetime.date.today():%Y-%m-%d}-{host_label()}-load.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    _log.info(
        "calls=%d calls_per_s=%.1f p50_ms=%s p99_ms=%s p999_ms=%s errors=%d -> %s",
        report["calls"],
        report["calls_per_s"],
        report["latency"]["all"].get("p50_ms"),
        report["latency"]["all"].get("p99_ms"),
        report["latency"]["all"].get("p999_ms"),
        report["errors"],
        out,
    )
    failed = sorted(name for name, passed in report["checks"].items() if passed is False)
    if failed:
        _log.error("failed checks: %s", ", ".join(failed))
    return 1 if failed else 0


def checks(report: dict[str, Any], max_growth: float) -> dict[str, bool | None]:
    """Pass/fail of each property the load must hold (``None``: not measured here).

    No call failed; the server's resident and GPU memory grew by at most ``max_growth``; its
    threads, file descriptors and registered regions (both counts) did not grow.
    """
    server = report.get("server", {})

    def flat(start: float | None, end: float | None, growth: float = 0.0) -> bool | None:
        if start is None or end is None:
            return None
        return end <= start * (1 + growth)

    return {
        "no_errors": report["errors"] == 0,
        "rss_flat": flat(server.get("rss_start_bytes"), server.get("rss_end_bytes"), max_growth),
        "gpu_memory_flat": flat(
            server.get("gpu_memory_start_bytes"), server.get("gpu_memory_end_bytes"), max_growth
        ),
        "gpu_device_memory_flat": flat(
            server.get("gpu_device_memory_used_start_bytes"),
            server.get("gpu_device_memory_used_end_bytes"),
            max_growth,
        ),
        "threads_flat": flat(server.get("threads_start"), server.get("threads_end")),
        "fds_flat": flat(server.get("fds_start"), server.get("fds_end")),
        "client_regions_flat": flat(*report["registered_regions"]),
        "server_regions_flat": flat(*report["server_registered_regions"]),
        "clean_exit": server.get("exit_code_after_sigterm", 0) == 0 if server else None,
    }


if __name__ == "__main__":
    restart_with_server_grpc_io()
    sys.exit(main())
