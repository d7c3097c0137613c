"""Benchmark of the tree kernels against the paths the public DDTree integrations take (GPU).

One run, side by side, on the same inputs:

* build_tree: ddtree's kernels; torch ``log_softmax`` + ``topk``; that plus the device-to-host
  copy and a Python ``heapq`` best-first search per request (the public integrations' path);
  and the read-once floor (logit bytes over the measured device copy bandwidth).
  Batch 1, 8, 32, 128; vocab 163840; draft_len 16; budgets 16, 64, 256, 1024; bf16 (or the
  batches and budgets given: each shape compiles its own kernels, minutes on a fresh machine).
* accept + commit_kv: ddtree's kernels (eager launches and replayed as a CUDA graph) vs a Python
  walk after a device-to-host copy and a torch ``index_select``/``index_copy_`` KV compaction.

Timing: CUDA events around each iteration after warm-up, medians; several logits buffers are
rotated so the 60 MB L2 cannot serve them. Writes ``bench/results/<date>-<gpu>-tree.json``
(or ``--out``).

Usage: ``python bench/bench_tree.py [--out PATH] [--quick] [--batch-sizes 32] [--budgets 16,64]``.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from ddtree.kernels import reference, tree_cuda
from ddtree.kernels.types import Tree

VOCAB = 163840
DRAFT_LEN = 16


def median_event_ms(fn: Callable[[int], object], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn(i)`` over ``iters`` iterations, CUDA events per iteration."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_graph_ms(fn: Callable[[int], object], calls: int) -> float:
    """Device time of one ``fn`` call: ``calls`` calls (rotating inputs) captured in a CUDA
    graph, replayed, median per call. Leaves out the Python launch overhead of eager calls."""
    for i in range(calls):
        fn(i)  # compile and warm the allocator outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    return median_event_ms(lambda _: graph.replay(), 10) / calls


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_event_ms(lambda _: dst.copy_(src), 10)
    return 2 * src.numel() / (ms * 1e-3)


def bf16_logits(
    batch_size: int, count: int, scale: float = 3.0, seed: int | None = None
) -> list[torch.Tensor]:
    """``count`` draft-logit buffers ``[batch_size, DRAFT_LEN, VOCAB]``, bf16 ``randn * scale``
    (seeded by ``seed``, by default the batch size), rotated so that the L2 cache cannot serve
    them."""
    gen = torch.Generator(device="cuda").manual_seed(batch_size if seed is None else seed)
    return [
        (torch.randn(batch_size, DRAFT_LEN, VOCAB, device="cuda", generator=gen) * scale).to(
            torch.bfloat16
        )
        for _ in range(count)
    ]


def log_softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch peer: ``topk(log_softmax(logits.float()), k)`` over the last dimension."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [b, l, v]
    return torch.topk(log_probs, k, dim=-1)


def _cpu_heap(values: list[list[list[float]]], ids: list[list[list[int]]], budget: int) -> list:
    """The integrations' best-first search over (depth, rank) tuples with Python's heapq."""
    trees = []
    for vals, toks in zip(values, ids, strict=True):
        heap = [(-vals[0][0], (0,), 0)]
        nodes = []
        while heap and len(nodes) < budget:
            neg, ranks, parent = heapq.heappop(heap)
            nodes.append((toks[len(ranks) - 1][ranks[-1]], parent, -neg))
            me = len(nodes)
            depth = len(ranks)
            if ranks[-1] + 1 < len(vals[depth - 1]):
                sib = ranks[:-1] + (ranks[-1] + 1,)
                base = -neg - vals[depth - 1][ranks[-1]]
                heapq.heappush(heap, (-(base + vals[depth - 1][ranks[-1] + 1]), sib, parent))
            if depth < len(vals):
                heapq.heappush(heap, (-(-neg + vals[depth][0]), ranks + (0,), me))
        trees.append(nodes)
    return trees


def bench_build(batch_sizes: list[int], budgets: list[int], floor_bw: float, quick: bool) -> list:
    rows = []
    for batch_size in batch_sizes:
        rows += _bench_batch(batch_size, budgets, floor_bw, quick)
        torch.cuda.empty_cache()
    return rows


def _bench_batch(batch_size: int, budgets: list[int], floor_bw: float, quick: bool) -> list:
    nbytes = batch_size * DRAFT_LEN * VOCAB * 2
    buffers = max(2, min(8, math.ceil(240e6 / nbytes)))
    logits = bf16_logits(batch_size, buffers)
    roots = torch.zeros(batch_size, dtype=torch.int64, device="cuda")
    # With error_flags the op never synchronises, so it can be captured in a CUDA graph.
    flags = torch.zeros(batch_size, dtype=torch.int32, device="cuda")
    rows = []
    for budget in budgets:
        iters = 10 if quick else 30

        def ours(i: int, budget: int = budget) -> object:
            return tree_cuda.build_tree(logits[i % buffers], roots, budget, error_flags=flags)

        def torch_topk(i: int, budget: int = budget) -> object:
            return log_softmax_topk(logits[i % buffers], budget)

        def cpu_heap(i: int, budget: int = budget) -> object:
            values, ids = log_softmax_topk(logits[i % buffers], budget)
            return _cpu_heap(values.cpu().tolist(), ids.cpu().tolist(), budget)

        ours_ms = median_event_ms(ours, iters)
        graph_ms = cuda_graph_ms(lambda i, budget=budget: ours(i, budget), buffers)
        topk_ms = median_event_ms(torch_topk, iters)
        heap_iters = 2 if batch_size * budget > 8192 else 5
        heap_ms = median_event_ms(cpu_heap, heap_iters, warmup=1)
        floor_ms = nbytes / floor_bw * 1e3
        rows.append(
            {
                "batch_size": batch_size,
                "budget": budget,
                "ddtree_ms": round(ours_ms, 4),
                "ddtree_graph_ms": round(graph_ms, 4),
                "torch_log_softmax_topk_ms": round(topk_ms, 4),
                "torch_topk_plus_cpu_heap_ms": round(heap_ms, 4),
                "read_once_floor_ms": round(floor_ms, 4),
                "ddtree_over_floor": round(ours_ms / floor_ms, 2),
                "ddtree_graph_over_floor": round(graph_ms / floor_ms, 2),
                "speedup_vs_torch_topk": round(topk_ms / ours_ms, 1),
                "speedup_vs_cpu_heap": round(heap_ms / ours_ms, 1),
            }
        )
    return rows


def _python_walk(tokens: list, parents: list, num: int, targets: list) -> list[int]:
    children: dict[int, list[int]] = {}
    for c in range(1, num):
        children.setdefault(parents[c], []).append(c)
    path = [0]
    while True:
        want = targets[path[-1]]
        nxt = next((c for c in children.get(path[-1], []) if tokens[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)


def bench_accept_commit(batch_size: int = 32, budget: int = 64) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(batch_size, DRAFT_LEN, VOCAB, device="cuda", generator=gen) * 3).to(
        torch.bfloat16
    )
    roots = torch.zeros(batch_size, dtype=torch.int64, device="cuda")
    tree = tree_cuda.build_tree(logits, roots, budget)
    # Targets follow each node's first child, so walks are long (worst case for the walk).
    first = torch.full_like(tree.tokens, 0)
    child = torch.arange(tree.num_nodes_max, device="cuda").expand(batch_size, -1)
    first.scatter_reduce_(
        1,
        tree.parents.clamp(min=0).long(),
        torch.where(tree.parents >= 0, child, 1 << 20),
        reduce="amin",
        include_self=False,
    )
    targets = tree.tokens.gather(1, first.clamp(max=tree.num_nodes_max - 1)).clamp(min=0)
    page_size, head_dim, prefix_len = 16, 576, 4096
    pages_per = (prefix_len + tree.num_nodes_max + page_size - 1) // page_size
    cache = torch.randn(batch_size * pages_per, page_size, head_dim, device="cuda").to(
        torch.bfloat16
    )
    table = torch.arange(batch_size * pages_per, dtype=torch.int32, device="cuda").view(
        batch_size, pages_per
    )
    prefix = torch.full((batch_size,), prefix_len, dtype=torch.int32, device="cuda")
    flags = torch.zeros(batch_size, dtype=torch.int32, device="cuda")

    def ours(_: int) -> object:
        acc = tree_cuda.accept(tree, targets, error_flags=flags)
        tree_cuda.commit_kv(cache, table, prefix, acc, error_flags=flags)
        return acc

    def ours_accept(_: int) -> object:
        return tree_cuda.accept(tree, targets, error_flags=flags)

    acc = ours_accept(0)

    def ours_commit(_: int) -> object:
        return tree_cuda.commit_kv(cache, table, prefix, acc, error_flags=flags)

    eager_ms = median_event_ms(ours, 50)
    accept_ms = median_event_ms(ours_accept, 50)
    commit_ms = median_event_ms(ours_commit, 50)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(10):
            ours(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph_ms = median_event_ms(lambda _: graph.replay(), 30) / 10

    def python_path(_: int) -> object:
        toks, pars, nums, tgts = (
            tree.tokens.cpu().tolist(),
            tree.parents.cpu().tolist(),
            tree.num_nodes.cpu().tolist(),
            targets.cpu().tolist(),
        )
        paths = [_python_walk(toks[b], pars[b], nums[b], tgts[b]) for b in range(batch_size)]
        src, dst = [], []
        for b, path in enumerate(paths):
            for m, node in enumerate(path):
                for pos, out in ((prefix_len + node, src), (prefix_len + m, dst)):
                    out.append(b * pages_per * page_size + pos)
        flat = cache.view(-1, head_dim)
        src_t = torch.tensor(src, device="cuda")
        dst_t = torch.tensor(dst, device="cuda")
        flat.index_copy_(0, dst_t, flat.index_select(0, src_t))
        return paths

    python_ms = median_event_ms(python_path, 10)
    return {
        "batch_size": batch_size,
        "num_nodes_max": tree.num_nodes_max,
        "mean_accept_length": float(acc.length.float().mean()),
        "ddtree_accept_ms": round(accept_ms, 4),
        "ddtree_commit_kv_ms": round(commit_ms, 4),
        "ddtree_accept_plus_commit_eager_ms": round(eager_ms, 4),
        "ddtree_accept_plus_commit_graph_ms": round(graph_ms, 4),
        "python_walk_plus_index_select_ms": round(python_ms, 4),
    }


def _sizes(text: str) -> list[int]:
    """A comma-separated list of positive integers (``--batch-sizes``, ``--budgets``)."""
    sizes = [int(part) for part in text.split(",")]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"positive integers, comma-separated: {text!r}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--batch-sizes", type=_sizes, default=[1, 8, 32, 128], help="e.g. 32,128")
    parser.add_argument("--budgets", type=_sizes, default=[16, 64, 256, 1024], help="e.g. 64")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    build = bench_build(args.batch_sizes, args.budgets, bandwidth, args.quick)
    accept_commit = bench_accept_commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    result = {
        "date": date,
        "gpu": name,
        "torch": torch.__version__,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "quick": args.quick,
        "shape": {"draft_len": DRAFT_LEN, "vocab_size": VOCAB, "dtype": "bf16"},
        "build_tree": build,
        "accept_commit_kv": accept_commit,
        "reference_check": _check_against_reference(),
    }
    slug = name.lower().replace("nvidia ", "").replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"{date}-{slug}-tree.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for row in build:
        print(json.dumps(row))
    print(json.dumps(accept_commit))


def _check_against_reference() -> dict:
    """How the benchmarked kernels agree with the reference on one benchmark-sized input (see
    ``reference_agreement``)."""
    logits = bf16_logits(32, 1, seed=99)[0]
    roots = torch.zeros(32, dtype=torch.int64, device="cuda")
    return reference_agreement(
        tree_cuda.build_tree(logits, roots, 64), reference.build_tree(logits, roots, 64)
    )


def reference_agreement(ours: Tree, ref: Tree) -> dict:
    """How a tree built by the kernels agrees with the reference's tree of the same inputs.

    ``exact_order``: identical tokens and parents. bf16 logits tie massively (many tokens share
    a logit), and a last-bit difference of a row's log-sum-exp may then reorder equal-score
    nodes, so the second check is the contract's: the same sorted node log-probabilities
    within 1e-5 (a tree of the same total probability).
    """
    got = ours.log_probs.sort(dim=1, descending=True).values
    want = ref.log_probs.sort(dim=1, descending=True).values
    finite = torch.isfinite(want)
    same_scores = bool(
        torch.equal(finite, torch.isfinite(got))
        and torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    )
    return {
        "exact_order": bool(
            torch.equal(ours.tokens, ref.tokens) and torch.equal(ours.parents, ref.parents)
        ),
        "same_sorted_log_probs": same_scores,
    }


if __name__ == "__main__":
    main()
