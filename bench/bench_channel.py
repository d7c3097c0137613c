"""Per-step latency of build_tree + accept: in-process kernels, a GPU doorbell channel, gRPC (GPU).

The server (``ddtree serve``) runs in its own process on the GPU, on a Unix socket; this process
is the caller. For batch 1 and 32 (draft_len 16, vocab 163840 bf16 logits, budget 64, greedy
target tokens) one step is build_tree followed by accept, through:

* ``in_process``: ``ddtree.kernels.build_tree`` + ``accept`` in this process, launched as the
  server launches them (with ``error_flags``: no host synchronisation inside);
* ``channel``: two channels (``ddtree.clients.channel.Channel``, one per op, each opened for the
  step's batch as its max), both steps posted on the current stream;
* ``grpc``: ``Client(tensor_transport="ipc")`` BuildTree + AcceptTree by CUDA IPC reference;

and, to tell the protocol's cost from the op's, ``build_only`` (build_tree alone, in process and
through the channel) and ``round_trip_refused_step`` (a descriptor the service refuses, BAD_OP:
post, resolve, finish, wait; no op kernels).

Timed three ways where they apply, in microseconds per step: ``host`` (one step then a stream
synchronisation, wall clock: what a caller that waits sees; p50 and p99 of ``--steps``),
``events`` (CUDA events around one step, median: launch gaps included, no host wait) and
``graph`` (10 steps captured in one CUDA graph, replayed; median per step: the device's own
time, no host in the loop, steps back to back) and ``graph_single`` (one step captured, each
replay timed alone after a synchronisation: one step's device latency). The target of issue
#8: channel p50 within 25 us of in-process.

``service_refused_step``: the service side of a refused step alone, in this process (the channel
worker's host time per step and the device time of such steps back to back), to tell what in a
round trip is the worker's.

Writes ``bench/results/2026-11-30-h200-channel.json`` (or ``--out``).
Usage: ``python bench/bench_channel.py [--out PATH] [--steps N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ddtree import kernels
from ddtree.clients import Client
from ddtree.clients.channel import Channel
from ddtree.kernels.channel import StepDescriptor, StepStatus, pack_descriptor

VOCAB = 163840
DRAFT_LEN = 16
BUDGET = 64
BATCHES = (1, 32)
DEFAULT_OUT = Path(__file__).parent / "results" / "2026-11-30-h200-channel.json"


def _start_server(socket_path: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddtree.service",
            "serve",
            "--listen",
            f"unix:{socket_path}",
            "--device",
            "cuda:0",
            "--log-level",
            "INFO",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stderr is not None
    for line in process.stderr:
        if "event=serving" in line:
            break
    else:
        raise RuntimeError(f"server exited before serving (exit code {process.wait()})")
    threading.Thread(target=lambda: [None for _ in process.stderr or ()], daemon=True).start()
    return process


def _host_us(step: Callable[[], object], steps: int) -> dict[str, float]:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        stream.synchronize()
        times.append(time.perf_counter() - start)
    ordered = sorted(times)
    return {
        "p50": round(statistics.median(ordered) * 1e6, 1),
        "p99": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e6, 1),
        "mean": round(statistics.fmean(ordered) * 1e6, 1),
    }


def _events_us(step: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return round(statistics.median(times), 1)


def _graph_us(step: Callable[[], object], per_graph: int, key: str) -> dict[str, Any]:
    """``per_graph`` steps captured in one CUDA graph; the median over 20 replays (each timed
    alone, after a synchronisation) of the device time per step."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(per_graph):
                step()
    except Exception as err:  # recorded: one failed capture must not lose the run
        return {key: None, f"{key}_error": f"{type(err).__name__}: {str(err)[:300]}"}
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_graph)
    return {key: round(statistics.median(times), 1)}


def _measure(step: Callable[[], object], steps: int, *, graph: bool = True) -> dict[str, Any]:
    result: dict[str, Any] = {"host": _host_us(step, steps), "events": _events_us(step, steps)}
    if graph:
        # Back to back (10 steps a replay: throughput, the service must keep up) and one step a
        # replay (latency: the service side had time to queue its next steps).
        result.update(_graph_us(step, 10, "graph"))
        result.update(_graph_us(step, 1, "graph_single"))
    return result


def _inputs(batch: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(batch)
    n = 1 + BUDGET
    return {
        "logits": (torch.randn(batch, DRAFT_LEN, VOCAB, generator=generator, device="cuda") * 3)
        .to(torch.bfloat16)
        .contiguous(),
        "roots": torch.randint(0, VOCAB, (batch,), generator=generator, device="cuda"),
        "targets": torch.randint(0, VOCAB, (batch, n), generator=generator, device="cuda"),
    }


def _bench_batch(address: str, batch: int, steps: int) -> dict[str, Any]:
    data = _inputs(batch)
    logits, roots, targets = data["logits"], data["roots"], data["targets"]
    out: dict[str, Any] = {"batch_size": batch}
    flags = torch.zeros(batch, dtype=torch.int32, device="cuda")

    def in_process() -> object:
        tree = kernels.build_tree(logits, roots, BUDGET, error_flags=flags)
        return kernels.accept(tree, targets, error_flags=flags)

    out["in_process"] = _measure(in_process, steps)
    print(f"batch {batch}: in_process {out['in_process']}", flush=True)
    expected = in_process()

    build = Channel(
        address,
        op="build_tree",
        max_batch_size=batch,
        draft_len=DRAFT_LEN,
        max_budget=BUDGET,
        vocab_size=VOCAB,
        tensors=[logits, roots, targets],
    )
    accept = Channel(
        address,
        op="accept",
        max_batch_size=batch,
        draft_len=DRAFT_LEN,
        max_budget=BUDGET,
        vocab_size=0,
        tensors=[logits, roots, targets, build.control],
    )
    try:

        def channel() -> object:
            tree = build.build_tree(logits, roots, BUDGET)
            return accept.accept(tree, targets)

        walked = channel()
        torch.cuda.synchronize()
        same = all(
            torch.equal(getattr(walked, name), getattr(expected, name))
            for name in ("nodes", "tokens", "length", "bonus")
        )
        out["channel_matches_in_process"] = same
        out["channel"] = _measure(channel, steps)
        print(f"batch {batch}: channel {out['channel']}", flush=True)
        out["channel"]["build_status"] = build.last_status().status.name
        out["channel"]["accept_status"] = accept.last_status().status.name
        out["channel"]["ok"] = (
            build.last_status().status == StepStatus.OK
            and accept.last_status().status == StepStatus.OK
        )

        def build_only() -> object:
            return build.build_tree(logits, roots, BUDGET)

        def build_in_process() -> object:
            return kernels.build_tree(logits, roots, BUDGET, error_flags=flags)

        out["build_only"] = {
            "in_process": _measure(build_in_process, steps),
            "channel": _measure(build_only, steps),
        }
        # The protocol alone: a step the service refuses (BAD_OP) runs only the resolve and
        # finish kernels, so this is the round trip with no op work.
        refused = pack_descriptor(StepDescriptor(op=0, batch_size=1))
        out["round_trip_refused_step"] = _measure(lambda: build._post_bytes(refused), steps)
    finally:
        accept.close()
        build.close()

    with Client(address, tensor_transport="ipc", default_timeout_s=60.0) as client:

        def grpc_step() -> object:
            tree = client.build_tree(logits, roots, BUDGET)
            return client.accept_tree(tree, targets)

        out["grpc"] = _measure(grpc_step, max(20, steps // 4), graph=False)

    p50 = {k: out[k]["host"]["p50"] for k in ("in_process", "channel", "grpc")}
    out["channel_minus_in_process_us"] = {
        "host_p50": round(p50["channel"] - p50["in_process"], 1),
        "events": round(out["channel"]["events"] - out["in_process"]["events"], 1),
    }
    for key in ("graph", "graph_single"):
        if out["channel"].get(key) is not None and out["in_process"].get(key) is not None:
            out["channel_minus_in_process_us"][key] = round(
                out["channel"][key] - out["in_process"][key], 1
            )
    return out


def _service_step_cost(batch: int, steps: int = 50) -> dict[str, float]:
    """The service side of one refused step, alone in this process (no second process, no
    doorbell wait that blocks): ``ChannelDevice.enqueue_step`` as the channel worker calls it
    (a doorbell wait already satisfied, resolve, the op's kernels, which exit at once, finish).

    ``enqueue_host_us``: the worker's host time per step (Python launches), which bounds how
    fast back-to-back steps can follow one another (the worker refills its queue one step per
    finished step); ``device_us``: the device time per step of ``steps`` such steps captured
    in one CUDA graph and replayed (no host in the loop).
    """
    from ddtree.kernels.channel import (
        DOORBELL_OFFSET,
        ChannelOp,
        ChannelShape,
        control_block_bytes,
    )
    from ddtree.kernels.channel_cuda import ChannelDevice

    device = torch.device("cuda", 0)
    shape = ChannelShape(ChannelOp.BUILD_TREE, batch, DRAFT_LEN, BUDGET, VOCAB, logit_code=1)
    ring_size = 2
    # A zeroed ring: every descriptor has op 0 (BAD_OP). The doorbell is raised far ahead.
    control = torch.zeros(control_block_bytes(ring_size), dtype=torch.uint8, device=device)
    control[DOORBELL_OFFSET : DOORBELL_OFFSET + 8].view(torch.int64).fill_(1 << 30)
    service = ChannelDevice(
        shape, control, ring_size, [(control.data_ptr(), control.numel())], 8, device
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    step = 0
    with torch.cuda.stream(stream):
        for _ in range(20):
            step += 1
            service.enqueue_step(step)
        stream.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            step += 1
            service.enqueue_step(step)
        host_us = (time.perf_counter() - started) * 1e6 / steps
        stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(steps):
            step += 1
            service.enqueue_step(step)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / steps)
    return {"enqueue_host_us": round(host_us, 1), "device_us": round(statistics.median(times), 1)}


def _kernel_attributes(batch: int) -> dict[str, Any]:
    """Registers, local memory and max threads of the RPC path's build kernels and of their
    channel wrappers (same source, same variant macros: the numbers should agree)."""
    from ddtree.kernels import jit, tree_cuda

    plan = tree_cuda.device_build_tree_plan(batch, DRAFT_LEN, VOCAB, BUDGET, 2, 0)
    base = {"DDTREE_DTYPE": 1, **plan.defines}
    out: dict[str, Any] = {}
    for name in ("topk", "merge", "select"):
        rpc = jit.get_kernel("build_tree.cu", f"ddtree_build_{name}", base, 0).attributes
        chan = jit.get_kernel(
            "channel.cu", f"ddtree_channel_build_{name}", {**base, "DDTREE_CHANNEL_OP": 1}, 0
        ).attributes
        out[name] = {
            path: {
                "num_regs": a.num_regs,
                "local_size_bytes": a.local_size_bytes,
                "max_threads_per_block": a.max_threads_per_block,
            }
            for path, a in (("rpc", rpc), ("channel", chan))
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--label", default="", help="recorded in the JSON (for example 'mps' for a run under MPS)"
    )
    args = parser.parse_args(argv)
    torch.cuda.init()
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "shape": {"draft_len": DRAFT_LEN, "vocab_size": VOCAB, "budget": BUDGET, "dtype": "bf16"},
        "steps": args.steps,
        "label": args.label,
        "units": "microseconds per step (build_tree + accept)",
        "batches": [],
    }
    try:
        results["kernels_batch_32"] = _kernel_attributes(32)
    except Exception as err:  # recorded, not fatal
        results["kernels_batch_32"] = {"error": f"{type(err).__name__}: {err}"[:500]}
    print(json.dumps(results["kernels_batch_32"]))
    results["service_refused_step"] = {}
    for batch in BATCHES:
        try:
            results["service_refused_step"][str(batch)] = _service_step_cost(batch)
        except Exception as err:  # recorded, not fatal
            results["service_refused_step"][str(batch)] = {"error": f"{type(err).__name__}: {err}"}
    print(f"service side of a refused step, alone: {results['service_refused_step']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        server = _start_server(str(Path(tmp) / "ddtree.sock"))
        try:
            for batch in BATCHES:
                try:
                    results["batches"].append(
                        _bench_batch(f"unix:{tmp}/ddtree.sock", batch, args.steps)
                    )
                except Exception as err:  # recorded, so the other batch still runs
                    results["batches"].append(
                        {
                            "batch_size": batch,
                            "error": "".join(traceback.format_exception(err))[-2000:],
                        }
                    )
        finally:
            server.terminate()
            server.wait(timeout=60)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for entry in results["batches"]:
        if "error" in entry:
            print(f"batch {entry['batch_size']}: ERROR {entry['error'][-500:]}")
            continue
        for path in ("in_process", "channel", "grpc"):
            m = entry[path]
            print(
                f"batch {entry['batch_size']:>2} {path:<10} host p50 {m['host']['p50']:>8} us  "
                f"p99 {m['host']['p99']:>8} us  events {m['events']:>8} us  "
                f"graph {m.get('graph')} us  single {m.get('graph_single')} us"
            )
        print(f"  channel - in_process: {entry['channel_minus_in_process_us']}")
        for name, m in (
            ("build in_process", entry["build_only"]["in_process"]),
            ("build channel", entry["build_only"]["channel"]),
            ("refused step", entry["round_trip_refused_step"]),
        ):
            print(
                f"  {name:<16} host p50 {m['host']['p50']:>8} us  events {m['events']:>8} us  "
                f"graph {m.get('graph')} us  single {m.get('graph_single')} us"
            )


if __name__ == "__main__":
    main()
