"""Per-call latency of ddtree RPCs by CUDA IPC reference vs inline, client and server apart (GPU).

The server (``ddtree serve``) runs in its own process on the GPU, listening on a Unix socket
and on loopback TCP; this process is the caller, as an inference server would be. Over each
transport, one run measures:

* the floor: a bare unary call of a few hundred bytes (GetServerInfo) through the same stack;
* BuildTree, batch 1 and 32, draft_len 16, vocab 163840, bf16 logits, budget 64: by reference
  (``Client(tensor_transport="ipc")``: logits read in place, the tree written into the caller's
  tensors) and inline (the logits' bytes in the message: 168 MB at batch 32);
* AcceptTree, batch 32, 65 nodes, greedy target tokens, by reference and inline;
* the same with 16 concurrent callers (threads, one client each) for calls per second;
* the kernels alone (CUDA events around ``ddtree.kernels`` calls in this process).

Reports p50/p99/mean per call and calls per second, and the ratio of BuildTree-by-reference
p50 (batch 32, Unix socket) to floor p50 + kernel time. Writes
``bench/results/<date>-<gpu>-ipc.json`` (or ``--out``).

Usage: ``python bench/bench_ipc.py [--out PATH] [--quick]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

from ddtree import kernels
from ddtree.clients import Client
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

VOCAB = 163840
DRAFT_LEN = 16
BUDGET = 64


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_server(unix_path: str, port: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree.service",
            "serve",
            "--listen",
            f"unix:{unix_path}",
            "--listen",
            f"127.0.0.1:{port}",
            "--device",
            "cuda:0",
            "--max-concurrent-calls",
            "64",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stderr is not None
    deadline = time.monotonic() + 600
    for line in process.stderr:
        if "event=serving" in line:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"server did not start within 600 s: {line}")
    else:
        raise RuntimeError(f"server exited before serving (exit code {process.wait()})")
    # Keep draining the log so the server never blocks on a full pipe.
    threading.Thread(target=_drain, args=(process.stderr,), daemon=True).start()
    return process


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def _stats(latencies_s: list[float], wall_s: float | None = None) -> dict[str, float]:
    ordered = sorted(latencies_s)
    p99_index = min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))
    result = {
        "calls": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1e3, 4),
        "p99_ms": round(ordered[p99_index] * 1e3, 4),
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 4),
    }
    total = wall_s if wall_s is not None else sum(ordered)
    result["calls_per_s"] = round(len(ordered) / total, 1)
    return result


def _serial(call: Callable[[], object], iters: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):
        call()
    latencies = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - start)
    return _stats(latencies)


def _concurrent(
    make_call: Callable[[Client], Callable[[], object]],
    clients: list[Client],
    iters_each: int,
) -> dict[str, float]:
    calls = [make_call(client) for client in clients]
    for call in calls:
        call()  # warm-up: registration, connection
    latencies: list[list[float]] = [[] for _ in clients]

    def worker(index: int) -> None:
        for _ in range(iters_each):
            start = time.perf_counter()
            calls[index]()
            latencies[index].append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(worker, range(len(clients))))
    wall = time.perf_counter() - start
    return _stats([x for each in latencies for x in each], wall)


def _kernel_ms(call: Callable[[], object], iters: int = 50) -> float:
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 4)


def _inputs(batch_size: int) -> dict[str, Any]:
    generator = torch.Generator(device="cuda").manual_seed(batch_size)
    logits = torch.randn(batch_size, DRAFT_LEN, VOCAB, generator=generator, device="cuda").to(
        torch.bfloat16
    )
    roots = torch.randint(0, VOCAB, (batch_size,), generator=generator, device="cuda")
    return {"logits": logits, "roots": roots}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    args = parser.parse_args(argv)
    scale = 0.2 if args.quick else 1.0

    def n(count: int) -> int:
        return max(3, int(count * scale))

    gpu = torch.cuda.get_device_name()
    batch1, batch32 = _inputs(1), _inputs(32)
    tree32 = kernels.build_tree(batch32["logits"], batch32["roots"], BUDGET)
    # The nodes' own tokens as the target's: short acceptances; accept's cost barely depends on it.
    targets32 = tree32.tokens.clamp(min=0)
    kernel = {
        "build_tree_b1_ms": _kernel_ms(
            lambda: kernels.build_tree(batch1["logits"], batch1["roots"], BUDGET)
        ),
        "build_tree_b32_ms": _kernel_ms(
            lambda: kernels.build_tree(batch32["logits"], batch32["roots"], BUDGET)
        ),
        "accept_b32_ms": _kernel_ms(lambda: kernels.accept(tree32, targets32)),
    }
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "grpcio": grpc.__version__,
        "shape": {"draft_len": DRAFT_LEN, "vocab_size": VOCAB, "budget": BUDGET, "dtype": "bf16"},
        "logits_bytes_b32": batch32["logits"].numel() * 2,
        "kernel": kernel,
        "transports": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        unix_path = f"{tmp}/bench.sock"
        port = _free_port()
        server = _start_server(unix_path, port)
        try:
            for name, address in (("unix", f"unix:{unix_path}"), ("tcp", f"127.0.0.1:{port}")):
                results["transports"][name] = _bench_transport(address, batch1, batch32, n)
        finally:
            server.terminate()
            server.wait(timeout=60)
    unix = results["transports"]["unix"]
    floor = unix["echo"]["p50_ms"] + kernel["build_tree_b32_ms"]
    results["target"] = {
        "build_tree_b32_ref_p50_ms": unix["build_tree_b32_ref"]["p50_ms"],
        "echo_plus_kernel_ms": round(floor, 4),
        "ratio": round(unix["build_tree_b32_ref"]["p50_ms"] / floor, 3),
        "goal": 1.3,
    }
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    out = args.out or Path(__file__).parent / "results" / f"{results['date']}-{slug}-ipc.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write(f"\nwrote {out}\n")


def _bench_transport(
    address: str, batch1: dict[str, Any], batch32: dict[str, Any], n: Callable[[int], int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TreeSpeculationServiceStub(channel)
        request = pb.GetServerInfoRequest()
        out["echo_reply_bytes"] = stub.GetServerInfo(request).ByteSize()
        out["echo"] = _serial(lambda: stub.GetServerInfo(request, timeout=10), n(500))
    ipc = Client(address, tensor_transport="ipc")
    inline = Client(address)
    try:
        for label, batch, iters_inline in (("b1", batch1, n(100)), ("b32", batch32, n(8))):
            logits, roots = batch["logits"], batch["roots"]
            out[f"build_tree_{label}_ref"] = _serial(
                lambda logits=logits, roots=roots: ipc.build_tree(logits, roots, BUDGET), n(300)
            )
            out[f"build_tree_{label}_inline"] = _serial(
                lambda logits=logits, roots=roots: inline.build_tree(logits, roots, BUDGET),
                iters_inline,
                warmup=1,
            )
        tree = ipc.build_tree(batch32["logits"], batch32["roots"], BUDGET)
        targets = tree.tokens.clamp(min=0)
        out["accept_tree_b32_ref"] = _serial(lambda: ipc.accept_tree(tree, targets), n(300))
        out["accept_tree_b32_inline"] = _serial(lambda: inline.accept_tree(tree, targets), n(300))
        out["registered_regions"] = len(ipc.list_memory())
    finally:
        ipc.close()
        inline.close()
    callers = 16
    ipc_clients = [Client(address, tensor_transport="ipc") for _ in range(callers)]
    inline_clients = [Client(address) for _ in range(callers)]
    try:
        b1, b32 = batch1, batch32
        out["concurrent_16"] = {
            "build_tree_b1_ref": _concurrent(
                lambda c: lambda: c.build_tree(b1["logits"], b1["roots"], BUDGET),
                ipc_clients,
                n(40),
            ),
            "build_tree_b1_inline": _concurrent(
                lambda c: lambda: c.build_tree(b1["logits"], b1["roots"], BUDGET),
                inline_clients,
                n(40),
            ),
            "build_tree_b32_ref": _concurrent(
                lambda c: lambda: c.build_tree(b32["logits"], b32["roots"], BUDGET),
                ipc_clients,
                n(20),
            ),
            "accept_tree_b32_ref": _concurrent(
                lambda c: lambda: c.accept_tree(tree, targets), ipc_clients, n(40)
            ),
            "accept_tree_b32_inline": _concurrent(
                lambda c: lambda: c.accept_tree(tree, targets), inline_clients, n(40)
            ),
        }
    finally:
        for client in ipc_clients + inline_clients:
            client.close()
    return out


if __name__ == "__main__":
    main()
