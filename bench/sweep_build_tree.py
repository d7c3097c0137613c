"""Tuning sweep of the ``build_tree`` kernels: top-k variants and a per-kernel breakdown (GPU).

For each variant of the top-k kernel (``UNROLL`` loads per lane and step, ``TOPK_MIN_BLOCKS``
blocks per SM asked of the register allocator) and each shape (batch, budget) at draft_len 16,
vocab 163840, bf16 ``randn * 3`` logits: the device time of the whole op from a replayed CUDA
graph of calls over rotating logits buffers (at least 240 MB of them, so L2 cannot serve them),
and the time of each kernel (``ddtree_build_topk``, ``_merge``, ``_select``) from the PyTorch
profiler over the same calls. torch ``log_softmax`` + ``topk`` and the read-once floor (logit bytes
over the measured copy bandwidth) are measured in the same run, with the inputs and timing
helpers of ``bench_tree.py``. Writes ``bench/results/<date>-<gpu>-build-sweep.json`` (or
``--out``).

Usage: ``python bench/sweep_build_tree.py [--out PATH] [--variants 2x4,4x2,...]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path

import torch
from bench_tree import (
    DRAFT_LEN,
    VOCAB,
    bf16_logits,
    copy_bandwidth,
    cuda_graph_ms,
    log_softmax_topk,
    median_event_ms,
)
from torch.profiler import ProfilerActivity, profile

from ddtree.kernels import tree_cuda

SHAPES = [(1, 64), (8, 64), (32, 16), (32, 64), (32, 256), (32, 1024), (128, 64)]


def measure_build(batch_size: int, budget: int, buffers: list[torch.Tensor]) -> dict:
    """build_tree over the rotating logits ``buffers``: the op's device time in a replayed CUDA
    graph (``graph_ms``) and each kernel's mean device time per launch from the profiler
    (``kernels_us``, by kernel name; a message where the profiler fails)."""
    roots = torch.zeros(batch_size, dtype=torch.int64, device="cuda")
    flags = torch.zeros(batch_size, dtype=torch.int32, device="cuda")

    def call(i: int) -> object:
        return tree_cuda.build_tree(buffers[i % len(buffers)], roots, budget, error_flags=flags)

    graph_ms = cuda_graph_ms(call, len(buffers))
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(2 * len(buffers)):
                call(i)
            torch.cuda.synchronize()
    except RuntimeError as err:  # no CUPTI in this environment: keep the graph timing
        return {"graph_ms": round(graph_ms, 4), "kernels_us": f"profiler failed: {err}"}
    per_kernel = {
        avg.key: round(avg.self_device_time_total / max(avg.count, 1), 1)  # microseconds
        for avg in prof.key_averages()
        if avg.key.startswith("ddtree_build_")
    }
    return {"graph_ms": round(graph_ms, 4), "kernels_us": dict(sorted(per_kernel.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--variants", default="2x4,4x2,2x3,4x3", help="UNROLLxTOPK_MIN_BLOCKS, comma separated"
    )
    args = parser.parse_args()
    variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
    name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    results = []
    for batch_size in sorted({b for b, _ in SHAPES}):
        nbytes = batch_size * DRAFT_LEN * VOCAB * 2
        buffers = bf16_logits(batch_size, max(2, min(48, math.ceil(240e6 / nbytes))))
        for budget in [k for b, k in SHAPES if b == batch_size]:
            row: dict = {
                "batch_size": batch_size,
                "budget": budget,
                "read_once_floor_ms": round(nbytes / bandwidth * 1e3, 4),
            }
            row["torch_log_softmax_topk_ms"] = round(
                median_event_ms(lambda _, x=buffers[0], k=budget: log_softmax_topk(x, k), 10), 4
            )
            for unroll, min_blocks in variants:
                tree_cuda._TOPK_UNROLL = unroll
                tree_cuda._TOPK_MIN_BLOCKS = min_blocks
                row[f"u{unroll}_b{min_blocks}"] = measure_build(batch_size, budget, buffers)
            results.append(row)
            print(json.dumps(row), flush=True)
        del buffers
        torch.cuda.empty_cache()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    slug = name.lower().replace("nvidia ", "").replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"{date}-{slug}-build-sweep.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": date,
                "gpu": name,
                "torch": torch.__version__,
                "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                "shape": {"draft_len": DRAFT_LEN, "vocab_size": VOCAB, "dtype": "bf16"},
                "rows": results,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
