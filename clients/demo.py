"""``ddtree demo``: speculative decoding of a small trained model through the service.

Decodes a few held-out prompts (standard-library files the toy models never saw) with the toy
target alone (autoregressive), with the chain of the drafter's per-depth argmaxes, and with
DDTree at several budgets; prints tokens per second, mean acceptance length and the live budget
curve per method; checks that every speculative greedy output equals the target's own greedy
output; and shows the service's metrics endpoint when it reports one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import TextIO

import torch

from ddtree.clients import Client, DDTreeClientError, EmbeddedClient
from ddtree.clients.speculative import (
    DecodeResult,
    KernelOps,
    SpeculativeDecoder,
    TreeOps,
)
from ddtree.clients.toy import load_pair
from ddtree.clients.toy.data import held_out_prompts

__all__ = ["main"]


def _parse_budgets(text: str) -> list[int]:
    try:
        budgets = [int(part) for part in text.split(",") if part]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--budgets: expected e.g. 4,16,64, got {text!r}") from err
    if not budgets or min(budgets) < 1 or max(budgets) > 1024:
        raise argparse.ArgumentTypeError(f"--budgets: each budget must be in 1..1024, got {text!r}")
    return budgets


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddtree demo",
        description="Speculative decoding of a small trained byte-level model through ddtree.",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--server",
        metavar="ADDR",
        help="use a running service at host:port or unix:/path (default: start a local one)",
    )
    where.add_argument(
        "--embedded",
        action="store_true",
        help="use an embedded engine in this process (EmbeddedClient) instead of a local server",
    )
    where.add_argument(
        "--direct",
        action="store_true",
        help="call the ddtree.kernels ops in this process, without any service",
    )
    parser.add_argument(
        "--metrics-url",
        metavar="URL",
        help="Prometheus endpoint of the --server to show at the end (e.g. http://host:9400/)",
    )
    parser.add_argument(
        "--budgets", type=_parse_budgets, default=[4, 16, 64], help="DDTree budgets (4,16,64)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (96)")
    parser.add_argument("--prompts", type=int, default=3, help="held-out prompts (3)")
    parser.add_argument("--device", default="cpu", help="torch device of the models (cpu)")
    return parser


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_serving(client: Client, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Poll the health RPC until the fresh server reports SERVING (or fail with its exit)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the local ddtree server exited with status {process.returncode}")
        with contextlib.suppress(DDTreeClientError):
            if client.health(timeout_s=1.0) == "SERVING":
                return
        time.sleep(0.1)
    raise RuntimeError(f"the local ddtree server was not SERVING within {timeout_s:g} s")


@contextlib.contextmanager
def _local_server(device: str) -> Iterator[tuple[Client, str, str]]:
    """Run ``ddtree serve`` on a Unix socket with a metrics port, as a child process."""
    with tempfile.TemporaryDirectory(prefix="ddtree-demo-") as folder:
        address = f"unix:{folder}/ddtree.sock"
        metrics_port = _free_loopback_port()
        command = [
            sys.executable, "-m", "ddtree.service", "serve", "--listen", address,
            "--device", device, "--metrics-port", str(metrics_port), "--log-level", "WARNING",
        ]  # fmt: skip
        # One intra-op thread: on a small CPU two processes of spinning OpenMP pools starve
        # each other, and the server's ops here are tiny.
        process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            with Client(address) as client:
                _wait_serving(client, process, timeout_s=60.0)
                yield (
                    client,
                    f"a local ddtree server ({address})",
                    (f"http://127.0.0.1:{metrics_port}/metrics"),
                )
        finally:
            process.terminate()
            process.wait(timeout=30)


def _service_device(device: str) -> str:
    """The service's spelling (``cpu`` or ``cuda:N``) of a torch device string."""
    parsed = torch.device(device)
    return "cpu" if parsed.type == "cpu" else f"cuda:{parsed.index or 0}"


@contextlib.contextmanager
def _open_ops(args: argparse.Namespace) -> Iterator[tuple[TreeOps, str, str | None]]:
    """The tree ops the loop calls, where they run, and the metrics URL if there is one."""
    if args.direct:
        yield KernelOps(), "the ddtree.kernels ops in this process (no service)", None
    elif args.embedded:
        with EmbeddedClient(device=_service_device(args.device)) as embedded:
            yield embedded, "an embedded ddtree engine (in this process, no gRPC)", None
    elif args.server:
        with Client(args.server) as client:
            yield client, f"the ddtree server at {args.server}", args.metrics_url
    else:
        with _local_server(_service_device(args.device)) as served:
            yield served


def _metrics_lines(url: str) -> list[str]:
    """The ``ddtree_`` samples of a Prometheus text endpoint that are not zero."""
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (a URL we were given)
        text = response.read().decode()
    lines = []
    for line in text.splitlines():
        if not line.startswith("ddtree_") or "_bucket{" in line or "_created" in line:
            continue
        name_labels, _, value = line.rpartition(" ")
        if name_labels and float(value) != 0.0:
            lines.append(line)
    return lines


def _curve_text(result: DecodeResult) -> str:
    return "  ".join(f"{b}:{tau:.2f}" for b, tau in result.stats.budget_curve.items())


def _run(args: argparse.Namespace, out: TextIO) -> int:
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    target, drafter = load_pair(args.device)
    prompts = [list(p) for p in held_out_prompts(args.prompts)]
    out.write(
        f"toy models: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params "
        f"(byte-level, {target.config.num_layers} layers, d_model {target.config.d_model}), "
        f"drafter {sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params "
        f"(draft_len {drafter.config.draft_len}); device {args.device}\n"
        f"{len(prompts)} held-out prompts, {args.max_new_tokens} new tokens each, greedy\n"
    )
    with _open_ops(args) as (ops, where, metrics_url):
        out.write(f"tree ops: {where}\n\n")
        decoder = SpeculativeDecoder(target, drafter, ops)
        runs = [("autoregressive", 0), ("chain", 0)] + [("ddtree", b) for b in args.budgets]
        # One untimed warm-up pass so first-call costs (allocations, kernel compiles) do not
        # land in the first method's tokens per second.
        decoder.generate(prompts[:1], 8, method="ddtree", budget=max(args.budgets))
        results = []
        for method, budget in runs:
            results.append(
                decoder.generate(prompts, args.max_new_tokens, method=method, budget=budget)
            )
        reference = results[0].tokens
        out.write(f"{'method':<16}{'budget':>7}{'tokens/s':>10}{'accept len':>12}  lossless\n")
        is_lossless = True
        for result in results:
            stats = result.stats
            same = result.tokens == reference
            is_lossless = is_lossless and same
            out.write(
                f"{stats.method:<16}{stats.budget:>7}{stats.tokens_per_second:>10.1f}"
                f"{stats.mean_acceptance_length:>12.2f}  {'identical' if same else 'DIFFERENT'}\n"
            )
        out.write("\nlive budget curve (mean acceptance length had the tree been cut at b):\n")
        for result in results[1:]:
            out.write(f"  {result.stats.method} {result.stats.budget}: {_curve_text(result)}\n")
        sample = bytes(reference[0]).decode("utf-8", errors="replace")
        out.write(f"\nfirst prompt's continuation:\n{sample}\n\n")
        if is_lossless:
            out.write(
                "lossless: every speculative greedy output is identical, token for token, "
                "to the target's own greedy output\n"
            )
        else:
            out.write("NOT lossless: a speculative output differs from the target's greedy one\n")
        if metrics_url is not None:
            out.write(f"\nservice metrics ({metrics_url}), non-zero ddtree_ samples:\n")
            for line in _metrics_lines(metrics_url):
                out.write(f"  {line}\n")
    return 0 if is_lossless else 1


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status (1 if an output was not lossless).

    Parameters
    ----------
    argv : list of str, optional
        Arguments after ``ddtree demo``; default ``sys.argv[1:]``.

    Returns
    -------
    int
        ``0`` when every speculative output matched the target's greedy output.
    """
    args = _parser().parse_args(argv)
    return _run(args, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
