"""Where one call's time goes, across the caller's and the server's processes (diagnostic).

Serial calls from this process (the caller, ``ddtree.clients.Client``) to ``ddtree serve`` in a
second process, over a Unix socket. Both processes stamp ``CLOCK_MONOTONIC`` (shared by the
processes of one host) at function boundaries, through wrappers installed at start-up (the
server through a launcher script), so each call splits into:

* ``caller_before``: from the client method's start to entering gRPC (destination checks,
  locating tensors, the request memo, ordering the inputs, building the request), of which
  ``order_inputs`` (``ClientIpc.order_inputs``: the caller's stream synchronisation);
* ``inbound``: entering gRPC -> the server starts deserialising the request;
* ``deserialise``, ``to_handler`` (interceptors), ``handler`` (the servicer method), and
  within the handler: ``decode`` (``DecodedCalls.decode``), ``validate``, ``engine_op``
  (``Engine.build_tree`` / ``accept_tree``: validation and queueing, and the whole op when it
  runs inline on the event loop, as a lone call does on CUDA), ``launch``
  (``Engine._launch_op``; on the CPU it runs on the device worker, inside the handler's span),
  ``verdict`` (``Engine._check_flags`` or ``_check_accept_flags``, whose stream
  synchronisation waits for the device), ``replay`` (``Engine._replay_build``: a build into
  caller memory launched from a CUDA graph, with its launch and its verdict) and ``reply``;
* ``outbound``: the servicer returns -> the caller's gRPC call returns;
* ``caller_after``: decoding the reply.

The same split for a bare call (GetServerInfo through the client's ``_call``) in the same run is
the reference. The kinds (``--kinds``, default all) are called in turn, one call of each per
round, so that drift hits them alike; medians over ``--calls`` rounds, in microseconds; the
wrappers add about a microsecond per stamped function. On a GPU: BuildTree and AcceptTree at
batch 32 (draft_len 16, vocab 163840, bf16, budget 64) by CUDA IPC reference, with fresh
destinations per call, with static ones (``out=``) and prepared for static ones
(``prepare_build_tree``). With ``--cpu``: the reference backend, batch 1, vocab 1024, budget 8,
tensors inline. Writes ``bench/results/<date>-<device>-ipc-timeline.json`` (or ``--out``).

``--idle-ms MS`` makes the caller sleep that long before each measured call, as a decode loop
calls once per step while the model runs (both processes' threads then wake from idle).

``--cpus SERVER/CALLER`` (e.g. ``2,3/4``) pins the server process and this one to those CPUs, as
a deployment that gives both exclusive cores would (Kubernetes' static CPU manager policy).

The server runs with its Prometheus metrics on (a free loopback port), as the Helm chart
deploys it (since session 18).

Usage: ``python bench/bench_ipc_timeline.py [--cpu] [--calls N] [--kinds K1,K2] [--idle-ms MS]
[--cpus S/C] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from caller_grpc_io import restart_with_server_grpc_io

from ddtree.clients import Client, cuda, remote
from ddtree.service.config import grpc_experiments
from ddtree.v1 import tree_speculation_service_pb2 as pb

_LAUNCHER = r"""
import json, os, signal, sys, time
from ddtree.service import call_memo, convert, engine, servicer

stamps = []
now = time.monotonic_ns


def stamped(function, tag):
    def wrapper(*args, **kwargs):
        start = now()
        try:
            return function(*args, **kwargs)
        finally:
            stamps.append((tag, start, now()))
    return wrapper


def stamped_async(function, tag):
    async def wrapper(*args, **kwargs):
        start = now()
        try:
            return await function(*args, **kwargs)
        finally:
            stamps.append((tag, start, now()))
    return wrapper


from ddtree.service import access
tolerant = access._tolerant
access._tolerant = lambda deserializer: stamped(tolerant(deserializer), "deserialise")
for name in ("BuildTree", "AcceptTree", "GetServerInfo"):
    cls = servicer.TreeSpeculationServicer
    setattr(cls, name, stamped_async(getattr(cls, name), "handler"))
call_memo.DecodedCalls.decode = stamped(call_memo.DecodedCalls.decode, "decode")
engine.validate_build_tree = stamped(engine.validate_build_tree, "validate")
engine.validate_accept_tree = stamped(engine.validate_accept_tree, "validate")
engine.Engine.build_tree = stamped(engine.Engine.build_tree, "engine_op")
engine.Engine.accept_tree = stamped(engine.Engine.accept_tree, "engine_op")
engine.Engine._launch_op = stamped(engine.Engine._launch_op, "launch")
engine.Engine._check_flags = stamped(engine.Engine._check_flags, "verdict")
engine.Engine._check_accept_flags = stamped(engine.Engine._check_accept_flags, "verdict")
engine.Engine._replay_build = stamped(engine.Engine._replay_build, "replay")
convert.tree_refs_to_proto = stamped(convert.tree_refs_to_proto, "reply")
convert.tree_to_proto = stamped(convert.tree_to_proto, "reply")
convert.acceptance_refs_to_proto = stamped(convert.acceptance_refs_to_proto, "reply")
convert.acceptance_to_proto = stamped(convert.acceptance_to_proto, "reply")


def dump(*_):
    with open(os.environ["DDTREE_TIMELINE_OUT"], "w") as stream:
        json.dump(stamps, stream)
    stamps.clear()


signal.signal(signal.SIGUSR1, dump)
from ddtree.service.cli import main
sys.exit(main(sys.argv[1:]))
"""
"""The server with its stamps: SIGUSR1 writes them (and forgets them) as JSON."""

_KINDS = (
    "bare_call",
    "build_tree",
    "accept_tree",
    "build_tree_out",
    "build_tree_prepared",
    "accept_tree_out",
)
"""What the timeline can time (``--kinds``)."""

_SERVER_SPANS = ("decode", "validate", "engine_op", "launch", "replay", "verdict", "reply")


class _CallerStamps:
    """The caller's stamps around gRPC (``Client._call``) and around the ordering of a call's
    inputs (``ClientIpc.order_inputs``), while the ``with`` block runs."""

    def __init__(self) -> None:
        self.grpc: list[tuple[int, int]] = []
        self.order: list[tuple[int, int]] = []
        self._call = remote.Client._call
        self._order = cuda.ClientIpc.order_inputs

    def __enter__(self) -> _CallerStamps:
        call, order = self._call, self._order

        def stamped_call(client: Client, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic_ns()
            try:
                return call(client, *args, **kwargs)
            finally:
                self.grpc.append((start, time.monotonic_ns()))

        def stamped_order(ipc: cuda.ClientIpc, *args: Any, **kwargs: Any) -> bytes:
            start = time.monotonic_ns()
            try:
                return order(ipc, *args, **kwargs)
            finally:
                self.order.append((start, time.monotonic_ns()))

        remote.Client._call = stamped_call  # type: ignore[method-assign]
        cuda.ClientIpc.order_inputs = stamped_order  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        remote.Client._call = self._call  # type: ignore[method-assign]
        cuda.ClientIpc.order_inputs = self._order  # type: ignore[method-assign]


@contextlib.contextmanager
def _server(
    socket_path: str, device: str, out: str, cpus: set[int] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``ddtree serve`` with its stamps, serving on ``socket_path`` for the ``with`` block
    (on ``cpus`` when given: every thread it starts inherits them), with its Prometheus metrics
    on a free loopback port, as deployed."""
    script = Path(socket_path).with_name("serve_timeline.py")
    script.write_text(_LAUNCHER)
    command = [sys.executable, str(script), "serve", "--listen", f"unix:{socket_path}"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics_port = str(probe.getsockname()[1])
    process = subprocess.Popen(
        [*command, "--device", device, "--metrics-port", metrics_port],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "DDTREE_TIMELINE_OUT": out},
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    assert process.stderr is not None
    log = process.stderr
    # Drained to the end, so that the server never blocks on a full pipe.
    drain = threading.Thread(target=_drain, args=(log,), daemon=True)
    try:
        for line in log:
            if "event=serving" in line:
                break
        else:
            raise RuntimeError(f"ddtree serve exited before serving ({process.wait()})")
        drain.start()
        yield process
    finally:
        process.terminate()
        process.wait(timeout=60)
        if drain.is_alive():
            drain.join(timeout=10)
        log.close()


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def _server_stamps(server: subprocess.Popen[str], path: str) -> list[list[Any]]:
    if os.path.exists(path):
        os.remove(path)
    server.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    with open(path) as stream:
        stamps: list[list[Any]] = json.load(stream)
    return stamps


def _timeline(
    kinds: dict[str, Callable[[], object]],
    calls: int,
    caller: _CallerStamps,
    server: subprocess.Popen[str],
    path: str,
    idle_s: float = 0.0,
) -> dict[str, dict[str, float]]:
    """Medians (us) of each segment of ``calls`` serial calls of each kind, the kinds in turn
    (one call of each per round, so that drift hits them alike), the caller sleeping
    ``idle_s`` before each call."""
    for _ in range(30):
        for call in kinds.values():
            call()
    _server_stamps(server, path)
    spans = []
    for _ in range(calls):
        for kind, call in kinds.items():
            if idle_s:
                time.sleep(idle_s)
            caller.grpc.clear()
            caller.order.clear()
            start = time.monotonic_ns()
            call()
            end = time.monotonic_ns()
            order = sum(e - s for s, e in caller.order)
            spans.append((kind, start, end, caller.grpc[-1], order))
    stamps = _server_stamps(server, path)
    by_tag: dict[str, list[list[Any]]] = {}
    for stamp in stamps:
        by_tag.setdefault(stamp[0], []).append(stamp)
    handlers, deserialised = by_tag["handler"], by_tag["deserialise"]
    assert len(handlers) == len(spans) == len(deserialised), (len(handlers), len(spans))
    rows: dict[str, list[dict[str, int]]] = {kind: [] for kind in kinds}
    for (kind, start, end, grpc_span, order), (_, h0, h1), (_, d0, d1) in zip(
        spans, handlers, deserialised, strict=True
    ):
        row = {
            "total": end - start,
            "caller_before": grpc_span[0] - start,
            "order_inputs": order,
            "inbound": d0 - grpc_span[0],
            "deserialise": d1 - d0,
            "to_handler": h0 - d1,
            "handler": h1 - h0,
            "outbound": grpc_span[1] - h1,
            "caller_after": end - grpc_span[1],
        }
        for tag in _SERVER_SPANS:
            inside = [s for s in by_tag.get(tag, []) if h0 <= s[1] <= h1]
            row[tag] = sum(s[2] - s[1] for s in inside)
        rows[kind].append(row)
    return {
        kind: {key: round(statistics.median(r[key] for r in each) / 1e3, 1) for key in each[0]}
        for kind, each in rows.items()
    }


def _placement(text: str) -> tuple[set[int], set[int]]:
    """``"2,3/4"`` -> ``({2, 3}, {4})``: the server's CPUs, then the caller's."""
    server, _, caller = text.partition("/")
    try:
        return {int(c) for c in server.split(",")}, {int(c) for c in caller.split(",")}
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected SERVER/CALLER CPU lists such as 2,3/4: {err}"
        ) from err


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="reference backend, inline tensors")
    parser.add_argument("--calls", type=int, default=400, help="calls per kind")
    parser.add_argument(
        "--cpus",
        type=_placement,
        default=None,
        metavar="S/C",
        help="CPUs of the server and of the caller, e.g. 2,3/4",
    )
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="caller sleep before each call, as a decode loop calls once per step (0)",
    )
    parser.add_argument(
        "--kinds",
        type=lambda text: text.split(","),
        default=list(_KINDS),
        help=f"calls to time, in turn, comma-separated (default all: {','.join(_KINDS)})",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = set(args.kinds) - set(_KINDS)
    if unknown:
        parser.error(f"--kinds: unknown {sorted(unknown)}; known: {', '.join(_KINDS)}")
    server_cpus = caller_cpus = None
    if args.cpus is not None:
        server_cpus, caller_cpus = args.cpus
        os.sched_setaffinity(0, caller_cpus)  # before gRPC starts its threads
    device = "cpu" if args.cpu else "cuda:0"
    if args.cpu:
        generator = torch.Generator().manual_seed(0)
        logits = torch.randn(1, 16, 1024, generator=generator)
        roots = torch.randint(0, 1024, (1,), generator=generator)
        budget, transport, name = 8, "inline", "cpu"
    else:
        generator = torch.Generator(device="cuda").manual_seed(32)
        logits = torch.randn(32, 16, 163840, generator=generator, device="cuda").bfloat16()
        roots = torch.randint(0, 163840, (32,), generator=generator, device="cuda")
        budget, transport = 64, "ipc"
        gpu = torch.cuda.get_device_name()
        name = re.sub(r"[^a-z0-9]+", "-", gpu.lower().replace("nvidia", "")).strip("-")
    date = datetime.date.today().isoformat()
    out = args.out or Path(__file__).parent / "results" / f"{date}-{name}-ipc-timeline.json"
    results: dict[str, Any] = {
        "date": date,
        "device": device if args.cpu else torch.cuda.get_device_name(),
        "transport": transport,
        "grpc_experiments": grpc_experiments(),  # caller and server
        "shape": {"batch_size": logits.shape[0], "vocab_size": logits.shape[2], "budget": budget},
        "calls": args.calls,
        "caller_idle_ms": args.idle_ms,
        "cpus": None
        if args.cpus is None
        else {"server": sorted(server_cpus), "caller": sorted(caller_cpus)},
        "unit": "us (medians)",
        "kinds": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        socket_path = f"{tmp}/timeline.sock"
        stamps_path = f"{tmp}/stamps.json"
        with (
            _server(socket_path, device, stamps_path, server_cpus) as server,
            _CallerStamps() as caller,
            Client(f"unix:{socket_path}", tensor_transport=transport) as client,
        ):
            tree = client.build_tree(logits, roots, budget)
            targets = tree.tokens.clamp(min=0)
            bare = pb.GetServerInfoRequest()
            kinds: dict[str, Callable[[], object]] = {
                "bare_call": lambda: client._call(
                    client._stub.GetServerInfo, bare, 10, idempotent=True
                ),
                "build_tree": lambda: client.build_tree(logits, roots, budget),
                "accept_tree": lambda: client.accept_tree(tree, targets),
            }
            static_tree = client.build_tree(logits, roots, budget)
            static_acceptance = client.accept_tree(tree, targets)
            kinds["build_tree_out"] = lambda: client.build_tree(
                logits, roots, budget, out=static_tree
            )
            kinds["build_tree_prepared"] = client.prepare_build_tree(
                logits, roots, budget, out=static_tree
            )
            kinds["accept_tree_out"] = lambda: client.accept_tree(
                tree, targets, out=static_acceptance
            )
            chosen = {kind: kinds[kind] for kind in args.kinds}
            results["kinds"] = _timeline(
                chosen, args.calls, caller, server, stamps_path, args.idle_ms / 1e3
            )
            for kind, figures in results["kinds"].items():
                sys.stdout.write(f"{kind:20s} {figures}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    sys.stdout.write(f"wrote {out}\n")


if __name__ == "__main__":
    restart_with_server_grpc_io()
    main()
