"""Test launcher: ``ddtree serve`` whose own CUDA context is then poisoned by a real device fault.

Usage (tests only; not part of the package)::

    python tests/reliability/sticky_server.py --fault trap --trigger /tmp/go -- SERVE-FLAGS...

It runs the real ``ddtree serve SERVE-FLAGS`` in this process. A background thread waits for the
``--trigger`` file to appear, then compiles a one-thread kernel through ``ddtree.kernels.jit``
(NVRTC, the same path as the service's kernels) and launches it on the server's device, in the
server's own (primary) CUDA context: ``trap`` executes ``asm volatile("trap;")`` (unspecified
launch failure), ``null-write`` stores through a null pointer (illegal address). Both are sticky
errors: the context is unusable from then on. The thread synchronises, logs
``event=fault_injected error=...`` to stderr and ends; what the server does next is the test.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import threading
import time
from pathlib import Path

import torch

from ddtree.kernels import jit
from ddtree.service.cli import main

_FAULT_SOURCE = r"""
extern "C" __global__ void ddtree_test_fault(int mode, int* target) {
    if (mode == 0) {
        asm volatile("trap;");
    } else {
        *(volatile int*)target = 1;
    }
}
"""
_MODES = {"trap": 0, "null-write": 1}


def inject(fault: str, device: torch.device) -> str:
    """Launch the faulting kernel on ``device``; returns the error the device reported."""
    from cuda.core import ObjectCode

    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = jit.device_arch(index)
    # jit's steps, as for the service's kernels: the primary context current in this thread,
    # NVRTC through cuda.core (here with this test-only source), launch on a torch stream.
    jit._make_current(index)
    cubin = jit._compile(_FAULT_SOURCE, (), arch, "ddtree_test_fault.cu", "sticky-test")
    kernel = ObjectCode.from_cubin(cubin, name="ddtree_test_fault.cu").get_kernel(
        "ddtree_test_fault"
    )
    params = jit.LaunchParams(grid=(1, 1, 1), block=(1, 1, 1))
    with torch.cuda.device(index), torch.cuda.stream(torch.cuda.Stream(index)):
        jit.launch(kernel, params, ctypes.c_int32(_MODES[fault]), 0, device=index)
    try:
        torch.cuda.synchronize(index)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return "no error (the fault did not happen)"


def _wait_and_inject(trigger: Path, fault: str, device: torch.device) -> None:
    while not trigger.exists():
        time.sleep(0.02)
    try:
        error = inject(fault, device)
    except Exception as err:  # reported to the test, which fails on it
        error = f"no error: the injection itself failed: {err!r}"
    sys.stderr.write(f"event=fault_injected fault={fault} error={error}\n")
    sys.stderr.flush()


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fault", choices=sorted(_MODES), required=True)
    parser.add_argument("--trigger", type=Path, required=True)
    parser.add_argument("--device", default="cuda:0", help="the server's --device")
    parser.add_argument("serve_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    flags = [f for f in args.serve_flags if f != "--"]
    device = torch.device(args.device)
    threading.Thread(
        target=_wait_and_inject, args=(args.trigger, args.fault, device), daemon=True
    ).start()
    return main(["serve", "--device", args.device, *flags])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
