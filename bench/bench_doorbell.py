"""Round trip of a GPU doorbell between two processes, by how each side signals (GPU).

What the channel protocol (docs/channel.md) can cost at best, with no op in it: the caller's
stream posts step ``k`` and waits for ``done >= k``; the service's stream, in another process
(another CUDA context, or the same MPS server), waits for the post, runs ``--kernels`` tiny
kernels (stand-ins for the resolve and the op) and signals ``done = k``. Everything is enqueued
ahead on the service side, as a channel worker does. Each round is timed alone with CUDA events
on the caller's stream after ``--gap-us`` of host idle time (a caller's steps are not back to
back); ``host_us`` is the caller's wall time for the round including its launches and the wait.

Variants (caller post / service wait / service signal):

* ``kernel/geq/kernel``: a one-thread kernel writes the 256-byte descriptor and the doorbell
  ``k``; the service waits ``doorbell >= k`` (``cuStreamWaitValue32``) and a kernel writes
  ``done``. The protocol as built (``ddtree_channel_post``, ``ddtree_channel_finish``).
* ``kernel/geq/memop``: the same, the service signals with ``cuStreamWriteValue32``.
* ``kernel+bell/bell/memop``: the kernel writes the descriptor, a constant ``bell = 1`` is
  written by ``cuStreamWriteValue32`` (graph-capturable: no per-step value), the service waits
  ``bell == 1`` and clears it.
* ``batch/bell/memop``: the descriptor's 32 words and the bell by one ``cuStreamBatchMemOp``.
* ``memop/geq/memop``: the doorbell ``k`` by ``cuStreamWriteValue32`` (no descriptor): the floor,
  but a CUDA graph would replay the same ``k``.
* ``atomic/geq/memop``: the doorbell incremented by a stream atomic (``cuStreamBatchMemOp``
  with ``CU_STREAM_MEM_OP_ATOMIC_REDUCTION``), graph-capturable; needs a driver that has it.

Run under MPS and without (see docs/channel.md, "MPS"). Writes JSON to ``--out``.
Usage: ``python bench/bench_doorbell.py --out PATH [--gap-us 50] [--rounds 60] [--kernels 2]``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import queue
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

VARIANTS = {
    "kernel/geq/kernel": ("kernel", "geq", "kernel"),
    "kernel/geq/memop": ("kernel", "geq", "memop"),
    "kernel+bell/bell/memop": ("kernel+bell", "bell", "memop"),
    "batch/bell/memop": ("batch", "bell", "memop"),
    "memop/geq/memop": ("memop", "geq", "memop"),
    "atomic/geq/memop": ("atomic", "geq", "memop"),
}

_SOURCE = r"""
extern "C" __global__ void post(volatile unsigned long long* slot, volatile unsigned* bell,
                                unsigned k) {
  for (int i = 0; i < 32; ++i) slot[i] = 0x1234ull + i + k;
  __threadfence_system();
  if (bell != nullptr) *bell = k;
}
extern "C" __global__ void store(volatile unsigned* word, unsigned v) {
  __threadfence_system();
  *word = v;
}
extern "C" __global__ void work(const volatile unsigned long long* slot, unsigned long long* out) {
  if (threadIdx.x == 0) out[0] = slot[3];
}
"""

# Byte offsets in the shared control words (one int64 tensor of 256 entries).
_DOORBELL, _DONE, _BELL, _SLOT, _OUT = 0, 64, 128, 256, 1024


class _Side:
    """One process's stream, the three kernels, and the stream memory operations."""

    def __init__(self) -> None:
        from cuda.core import Device, LaunchConfig, Program, ProgramOptions, Stream

        torch.cuda.init()
        Device(0).set_current()
        arch = "sm_" + "".join(map(str, torch.cuda.get_device_capability(0)))
        program = Program(_SOURCE, "c++", options=ProgramOptions(arch=arch, std="c++17"))
        module = program.compile("cubin")
        self.kernels = {name: module.get_kernel(name) for name in ("post", "store", "work")}
        self.one = LaunchConfig(grid=1, block=1)
        self.block = LaunchConfig(grid=1, block=128)
        self.torch_stream = torch.cuda.Stream()
        self.stream = Stream.from_handle(self.torch_stream.cuda_stream)
        # Load every kernel now: a lazy load while a stream waits on the other side deadlocks.
        scratch = torch.zeros(256, dtype=torch.int64, device="cuda")
        base = scratch.data_ptr()
        self.launch("post", base + _SLOT, base + _BELL, ctypes.c_uint32(0))
        self.launch("store", base + _DONE, ctypes.c_uint32(0))
        self.launch("work", base + _SLOT, base + _OUT, config=self.block)
        self.torch_stream.synchronize()

    def launch(self, name: str, *args: Any, config: Any = None) -> None:
        from cuda.core import launch

        launch(self.stream, config or self.one, self.kernels[name], *args)

    def _check(self, result: Any, what: str) -> None:
        (err,) = result
        if int(err) != 0:
            raise RuntimeError(f"{what}: {err.name}")

    def write(self, address: int, value: int) -> None:
        from cuda.bindings import driver

        handle = driver.CUstream(self.torch_stream.cuda_stream)
        self._check(
            driver.cuStreamWriteValue32(handle, driver.CUdeviceptr(address), value, 0),
            "cuStreamWriteValue32",
        )

    def wait(self, address: int, value: int, *, equal: bool = False) -> None:
        from cuda.bindings import driver

        flags = driver.CUstreamWaitValue_flags
        flag = flags.CU_STREAM_WAIT_VALUE_EQ if equal else flags.CU_STREAM_WAIT_VALUE_GEQ
        handle = driver.CUstream(self.torch_stream.cuda_stream)
        self._check(
            driver.cuStreamWaitValue32(handle, driver.CUdeviceptr(address), value, flag),
            "cuStreamWaitValue32",
        )

    def batch(self, params: list[Any]) -> None:
        from cuda.bindings import driver

        handle = driver.CUstream(self.torch_stream.cuda_stream)
        self._check(driver.cuStreamBatchMemOp(handle, len(params), params, 0), "cuStreamBatchMemOp")


def _write_op(address: int, value: int, bits: int) -> Any:
    from cuda.bindings import driver

    op = driver.CUstreamBatchMemOpParams()
    kinds = driver.CUstreamBatchMemOpType
    op.writeValue.operation = (
        kinds.CU_STREAM_MEM_OP_WRITE_VALUE_64
        if bits == 64
        else kinds.CU_STREAM_MEM_OP_WRITE_VALUE_32
    )
    op.writeValue.address = driver.CUdeviceptr(address)
    if bits == 64:
        op.writeValue.value64 = value
    else:
        op.writeValue.value = value
    op.writeValue.flags = 0
    return op


def _increment_op(address: int) -> Any:
    from cuda.bindings import driver

    op = driver.CUstreamBatchMemOpParams()
    op.atomicReduction.operation = driver.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_ATOMIC_REDUCTION
    op.atomicReduction.flags = 0
    op.atomicReduction.reductionOp = (
        driver.CUstreamAtomicReductionOpType.CU_STREAM_ATOMIC_REDUCTION_OP_ADD
    )
    op.atomicReduction.dataType = (
        driver.CUstreamAtomicReductionDataType.CU_STREAM_ATOMIC_REDUCTION_UNSIGNED_32
    )
    op.atomicReduction.address = driver.CUdeviceptr(address)
    op.atomicReduction.value = 1
    return op


def _service(requests: Any, replies: Any) -> None:
    """The service process: per request, enqueue every round of one variant, then drain."""
    side = _Side()
    while True:
        request = requests.get()
        if request is None:
            return
        words, rounds, wait, signal, kernels = request
        base = words.data_ptr()
        try:
            for k in range(1, rounds + 1):
                if wait == "bell":
                    side.wait(base + _BELL, 1, equal=True)
                    side.write(base + _BELL, 0)
                else:
                    side.wait(base + _DOORBELL, k)
                for _ in range(kernels):
                    side.launch("work", base + _SLOT, base + _OUT, config=side.block)
                if signal == "memop":
                    side.write(base + _DONE, k)
                else:
                    side.launch("store", base + _DONE, ctypes.c_uint32(k))
        except RuntimeError as err:
            replies.put(f"error: {err}")
            continue
        replies.put("ready")
        side.torch_stream.synchronize()
        replies.put("done")
        del words


def _post(side: _Side, post: str, base: int, k: int, ops: dict[str, list[Any]]) -> None:
    if post == "kernel":
        side.launch("post", base + _SLOT, base + _DOORBELL, ctypes.c_uint32(k))
    elif post == "kernel+bell":
        side.launch("post", base + _SLOT, 0, ctypes.c_uint32(k))
        side.write(base + _BELL, 1)
    elif post == "batch":
        side.batch(ops["batch"])
    elif post == "atomic":
        side.batch(ops["atomic"])
    else:
        side.write(base + _DOORBELL, k)


def _variant(
    side: _Side, requests: Any, replies: Any, name: str, args: argparse.Namespace
) -> dict[str, Any]:
    post, wait, signal = VARIANTS[name]
    device_us, host_us = [], []
    for _ in range(args.repeats):
        words = torch.zeros(256, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        base = words.data_ptr()
        ops = {
            "batch": [_write_op(base + _SLOT + 8 * i, 0x1234 + i, 64) for i in range(32)]
            + [_write_op(base + _BELL, 1, 32)],
            "atomic": [_increment_op(base + _DOORBELL)],
        }
        requests.put((words, args.rounds, wait, signal, args.kernels))
        reply = replies.get(timeout=60)
        if reply != "ready":
            return {"error": reply}
        rounds_device, rounds_host = [], []
        for k in range(1, args.rounds + 1):
            until = time.perf_counter() + args.gap_us * 1e-6
            while time.perf_counter() < until:
                pass
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            began = time.perf_counter()
            start.record(side.torch_stream)
            _post(side, post, base, k, ops)
            side.wait(base + _DONE, k)
            end.record(side.torch_stream)
            end.synchronize()
            rounds_host.append((time.perf_counter() - began) * 1e6)
            rounds_device.append(start.elapsed_time(end) * 1e3)
        if replies.get(timeout=60) != "done":
            return {"error": "the service did not drain"}
        device_us.append(statistics.median(rounds_device))
        host_us.append(statistics.median(rounds_host))
        del words
    return {
        "device_us_per_repeat": [round(x, 2) for x in device_us],
        "device_us": round(statistics.median(device_us), 2),
        "host_us": round(statistics.median(host_us), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--label", default="", help="recorded in the JSON (e.g. 'mps')")
    parser.add_argument("--gap-us", type=float, default=50.0, help="host idle time per round")
    parser.add_argument("--rounds", type=int, default=60, help="rounds timed per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", type=int, default=2, help="service kernels per round")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    context = mp.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    service = context.Process(target=_service, args=(requests, replies), daemon=True)
    service.start()
    side = _Side()
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "label": args.label,
        "gap_us": args.gap_us,
        "rounds": args.rounds,
        "service_kernels": args.kernels,
        "variants": {},
    }
    for name in args.variants.split(","):
        try:
            line = _variant(side, requests, replies, name, args)
        except (RuntimeError, queue.Empty) as err:
            # The service may still wait for a post that never came: stop here.
            results["variants"][name] = {"error": str(err)}
            print(name, results["variants"][name], flush=True)
            break
        results["variants"][name] = line
        print(name, line, flush=True)
    requests.put(None)
    service.join(5)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
