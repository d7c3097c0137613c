"""build_tree on logits whose token ids correlate with value, against random rows (GPU).

``bench_tree.py`` draws ``randn * 3`` logits, whose token ids are in random order. Real
vocabularies are not: frequent tokens sit at low ids, so a drafter's large logits cluster there.
The top-k pass's warps take turns over each row's steps, and its running threshold comes from
what every warp has seen so far, so where the large entries sit changes how many vectors it
records. This benchmark builds batch 32, draft_len 16, vocab 163,840, budget 64 (bf16)
on:

* ``randn3``: ``randn * 3`` (the main benchmark's rows), first and last;
* ``zipfC``: ``randn * 3 - C * ln(1 + id)`` for C = 0.25, 0.5, 1 (a frequency prior);
* ``head_block``: the first 1/16 of the ids shifted up by 2;
* ``sorted_asc`` / ``sorted_desc``: each row's ``randn * 3`` values sorted by id (extremes).

For each, two passes of ``sweep_build_tree.measure_build``: the op in a CUDA graph (two buffers
rotating) and each kernel's device time by the profiler (the select is a dependent launch, so
its figure includes its wait for the top-k). Writes
``bench/results/<date>-<gpu>-structured-logits.json`` (or ``--out``).

Usage: ``python bench/bench_structured_logits.py [--out PATH]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from sweep_build_tree import measure_build

from ddtree.kernels import tree_cuda

BATCH, DRAFT_LEN, VOCAB, BUDGET = 32, 16, 163840, 64
KINDS = [
    "randn3",
    "zipf0.25",
    "zipf0.5",
    "zipf1.0",
    "head_block",
    "sorted_asc",
    "sorted_desc",
    "randn3",
]


def kind_logits(kind: str, gen: torch.Generator) -> torch.Tensor:
    """[BATCH, DRAFT_LEN, VOCAB] bf16 logits of one kind (see the module docstring)."""
    x = torch.randn(BATCH, DRAFT_LEN, VOCAB, device="cuda", generator=gen) * 3
    if kind.startswith("zipf"):
        ids = torch.arange(VOCAB, device="cuda", dtype=torch.float32)
        x -= float(kind[4:]) * torch.log1p(ids)
    elif kind == "sorted_desc":
        x = x.sort(-1, descending=True).values
    elif kind == "sorted_asc":
        x = x.sort(-1).values
    elif kind == "head_block":
        x[..., : VOCAB // 16] += 2
    return x.to(torch.bfloat16)


def bench_kind(kind: str) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(5)
    bufs = [kind_logits(kind, gen) for _ in range(2)]
    roots = torch.zeros(BATCH, dtype=torch.int64, device="cuda")
    tree = tree_cuda.build_tree(bufs[0], roots, BUDGET)
    passes = [measure_build(BATCH, BUDGET, bufs) for _ in range(2)]
    return {
        "kind": kind,
        "graph_ms": [p["graph_ms"] for p in passes],
        "kernels_us": passes[-1]["kernels_us"],
        "mean_depth_max": float(tree.depths.max(1).values.float().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for kind in KINDS:
        rows.append(bench_kind(kind))
        print(json.dumps(rows[-1]), flush=True)
    gpu, date = torch.cuda.get_device_name(), str(datetime.date.today())
    slug = gpu.lower().replace("nvidia ", "").replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"{date}-{slug}-structured-logits.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "date": date,
        "gpu": gpu,
        "torch": torch.__version__,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
