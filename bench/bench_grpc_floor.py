"""How the Python gRPC floor moves when either side of a call does work or idles (no ddtree code).

Issue #5 measures ddtree's calls against a bare unary call of a few hundred bytes. A real call
differs from the bare one not only by ddtree's own host work: the server's handler runs for a
while (the op, the device wait), during which the caller's thread sleeps in gRPC, and the
caller prepares the next request, during which the server sleeps in its event loop. This
benchmark shows what that alone does to gRPC's own part of a call, with a minimal
``grpc.aio`` server (the stack ddtree's server uses) in a second process and a synchronous
caller (as ``ddtree.clients.Client``), over a Unix socket.

Each variant runs serial calls; both processes stamp ``CLOCK_MONOTONIC`` (shared by processes on
one host), which splits a call into *inbound* (caller enters gRPC -> server handler starts),
*handler* and *outbound* (handler returns -> caller has the reply). Variants:

* ``bare``: empty request, 8-byte reply, the handler returns at once (the floor);
* ``sized``: a 500-byte request and a 400-byte reply (the size of a BuildTree by reference);
* ``caller_spin_250us`` / ``caller_sleep_250us``: the caller busy-waits or sleeps 250 us before
  each call (its own preparation), the handler returns at once;
* ``handler_spin_400us`` / ``handler_sleep_400us``: the handler busy-waits or sleeps 400 us;
* ``handler_torch_work``: the handler runs small torch CPU ops for a while (code that evicts
  gRPC's from the caches, as an op's host work does);
* ``handler_spin_200us``, and where the server has a GPU ``handler_cuda_wait_200us``: the
  handler busy-waits 200 us, or launches a 200 us kernel and synchronises the stream (GIL
  released, as ddtree's op waits for the device).

Reports medians (microseconds) per variant and round and writes
``bench/results/<date>-<host>-grpc-floor.json`` (or ``--out``).
Usage: ``python bench/bench_grpc_floor.py [--calls N] [--rounds R] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

_SERVER = r"""
import asyncio, json, signal, sys, time
import grpc, torch

stamps = []
CUDA = torch.cuda.is_available()
if CUDA:
    # torch.cuda._sleep's clock cycles per microsecond, measured after a warm-up launch.
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(20_000_000)
    torch.cuda.synchronize()
    CYCLES_PER_US = 20_000_000 / ((time.perf_counter() - start) * 1e6)


def torch_work():
    x = torch.zeros(64)
    for _ in range(60):
        x = x.add(1).mul(1.0)


async def handle(kind, request):
    start = time.monotonic_ns()
    if kind in ("handler_spin_400us", "handler_spin_200us"):
        end = time.perf_counter() + (400e-6 if kind == "handler_spin_400us" else 200e-6)
        while time.perf_counter() < end:
            pass
    elif kind == "handler_cuda_wait_200us":
        torch.cuda._sleep(int(200 * CYCLES_PER_US))
        torch.cuda.current_stream().synchronize()
    elif kind == "handler_sleep_400us":
        time.sleep(400e-6)
    elif kind == "handler_torch_work":
        torch_work()
    reply = b"r" * (400 if kind == "sized" else 8)
    stamps.append((start, time.monotonic_ns()))
    return reply


class Handlers(grpc.GenericRpcHandler):
    def service(self, details):
        kind = details.method.rsplit("/", 1)[1]

        async def unary(request, context):
            return await handle(kind, request)

        return grpc.unary_unary_rpc_method_handler(unary)


async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Handlers(),))
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()

    def dump():
        with open(sys.argv[1] + ".json", "w") as stream:
            json.dump(stamps, stream)
        stamps.clear()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
    print("ready cuda" if CUDA else "ready", flush=True)
    await server.wait_for_termination()


asyncio.run(main())
"""

VARIANTS = (
    "bare",
    "sized",
    "caller_spin_250us",
    "caller_sleep_250us",
    "handler_spin_400us",
    "handler_sleep_400us",
    "handler_torch_work",
    "handler_spin_200us",
)
CUDA_VARIANTS = ("handler_cuda_wait_200us",)
"""Variants run only where the server process has a GPU."""


def _caller_gap(kind: str) -> None:
    if kind == "caller_spin_250us":
        end = time.perf_counter() + 250e-6
        while time.perf_counter() < end:
            pass
    elif kind == "caller_sleep_250us":
        time.sleep(250e-6)


def _stamps(server: subprocess.Popen[str], path: str) -> list[list[int]]:
    """The server's ``(handler start, handler end)`` stamps since the last call of this."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    server.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # the file is written in one go; let it close
    with open(path) as stream:
        stamps: list[list[int]] = json.load(stream)
    return stamps


def _variant(
    channel: grpc.Channel, server: subprocess.Popen[str], path: str, kind: str, calls: int
) -> dict[str, float]:
    method = channel.unary_unary(f"/floor/{kind}")
    request = b"q" * (500 if kind == "sized" else 0)
    for _ in range(50):
        method(request)
    _stamps(server, path)  # drop the warm-up's
    spans = []
    for _ in range(calls):
        _caller_gap(kind)
        start = time.monotonic_ns()
        method(request)
        spans.append((start, time.monotonic_ns()))
    handled = _stamps(server, path)
    assert len(handled) == len(spans), (len(handled), len(spans))

    def median_us(values: list[int]) -> float:
        return round(statistics.median(values) / 1e3, 1)

    return {
        "total_us": median_us([end - start for start, end in spans]),
        "inbound_us": median_us([h[0] - c[0] for c, h in zip(spans, handled, strict=True)]),
        "handler_us": median_us([h[1] - h[0] for h in handled]),
        "outbound_us": median_us([c[1] - h[1] for c, h in zip(spans, handled, strict=True)]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=2, help="passes over every variant")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    date = datetime.date.today().isoformat()
    host = platform.node().split(".")[0] or "host"
    out = args.out or Path(__file__).parent / "results" / f"{date}-{host}-grpc-floor.json"
    results: dict[str, Any] = {
        "date": date,
        "cpu_count": os.cpu_count(),
        "grpcio": grpc.__version__,
        "python": platform.python_version(),
        "calls": args.calls,
        "rounds": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "server.py"
        script.write_text(_SERVER)
        socket_path = f"{tmp}/floor.sock"
        server = subprocess.Popen(
            [sys.executable, str(script), socket_path], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            kinds = VARIANTS + (CUDA_VARIANTS if "cuda" in server.stdout.readline() else ())
            with grpc.insecure_channel(f"unix:{socket_path}") as channel:
                for _ in range(args.rounds):
                    round_results = {
                        kind: _variant(channel, server, socket_path + ".json", kind, args.calls)
                        for kind in kinds
                    }
                    results["rounds"].append(round_results)
                    for kind, figures in round_results.items():
                        sys.stdout.write(f"{kind:22s} {figures}\n")
        finally:
            server.terminate()
            server.wait(timeout=30)
            if server.stdout is not None:
                server.stdout.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    sys.stdout.write(f"wrote {out}\n")


if __name__ == "__main__":
    main()
