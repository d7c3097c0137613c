"""Benchmark tree-verify MLA attention: ddtree's kernel vs SDPA vs eager vs the matmul floor.

Counts ``2 * B * H * N * (prefix + N) * (576 + 512)`` FLOPs per call (issue 4) and reports
TFLOP/s for, side by side in one process:

* ``ddtree``: ``ddtree.kernels.attention_cuda.verify_attention`` on a paged cache (page 64,
  shuffled pages), with ``error_flags`` (no host sync);
* ``sdpa_rows``: ``torch.nn.functional.scaled_dot_product_attention`` with a dense boolean mask,
  node and head flattened into query rows over one shared K/V (the best layout for SDPA);
* ``sdpa_heads``: the same with the usual ``[B, H, N, D]`` layout and ``enable_gqa=True``;
* ``eager``: bf16 matmul, fp32 masked softmax, bf16 matmul over the flattened rows;
* ``floor``: the rate of one measured 8192^3 bf16 matmul, the compute ceiling.

The peers get dense, pre-gathered K/V and a pre-built mask (not timed), which favours them.
Timing: CUDA events around ``inner`` calls, warm-up first, median over repetitions; inputs
rotate over several sets so that the 60 MB L2 does not hold them between calls.

Usage::

    python bench/bench_attention.py [--out bench/results] [--sweep] [--shapes 0,2]

Writes ``<out>/<YYYY-MM-DD>-<gpu>-attention.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.kernels import attention_cuda
from ddtree.kernels.types import Tree, mask_words

SHAPES = [
    (1, 8, 65, 4096),
    (8, 8, 65, 8192),
    (32, 8, 65, 8192),
    (8, 64, 65, 8192),
    (32, 8, 17, 8192),
    (1, 8, 1025, 8192),
    (4, 128, 65, 32768),
]
HEAD_DIM = 576
V_DIM = 512
PAGE_SIZE = 64
TARGET_SHAPE = (32, 8, 65, 8192)
TARGET_TFLOPS = 300.0
ROTATE_BYTES = 256 << 20  # input bytes per rotation cycle: several times the H200's 60 MB L2


def flops(batch: int, heads: int, nodes: int, prefix: int) -> float:
    """FLOPs of one call as issue 4 counts them."""
    return 2.0 * batch * heads * nodes * (prefix + nodes) * (HEAD_DIM + V_DIM)


def random_tree(batch: int, nodes: int, gen: torch.Generator, device: torch.device) -> Tree:
    """Random trees: node i's parent uniform among the 8 previous nodes (bushy, depth ~ N/4)."""
    parents = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        low = max(0, i - 8)
        parents[:, i] = torch.randint(low, i, (batch,), generator=gen)
    words = mask_words(nodes)
    bits = torch.zeros(batch, nodes, nodes, dtype=torch.bool)
    rows = torch.arange(batch)
    for i in range(nodes):
        if i > 0:
            bits[:, i] = bits[rows, parents[:, i]]
        bits[:, i, i] = True
    padded = torch.zeros(batch, nodes, words * 64, dtype=torch.int64)
    padded[..., :nodes] = bits.long()
    weights = torch.ones(64, dtype=torch.int64) << torch.arange(64)
    mask = (padded.view(batch, nodes, words, 64) * weights).sum(-1)  # int64 wraps like the bits
    depths = torch.zeros(batch, nodes, dtype=torch.int32)
    for i in range(1, nodes):
        depths[:, i] = depths[rows, parents[:, i]] + 1
    return Tree(
        tokens=torch.zeros(batch, nodes, dtype=torch.int64, device=device),
        parents=parents.to(torch.int32).to(device),
        depths=depths.to(device),
        log_probs=torch.zeros(batch, nodes, device=device),
        num_nodes=torch.full((batch,), nodes, dtype=torch.int32, device=device),
        mask=mask.to(device),
        draft_len=32,
    )


@dataclasses.dataclass
class Inputs:
    """One rotation set: paged inputs for ddtree and dense ones for the peers."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    tree: Tree
    dense_k: torch.Tensor  # [B, T, 576]
    visible: torch.Tensor  # [B, N, T] bool


def make_inputs(batch: int, heads: int, nodes: int, prefix: int, seed: int) -> Inputs:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    total = prefix + nodes
    pages_per_request = math.ceil(total / PAGE_SIZE)
    num_pages = batch * pages_per_request
    kv_cache = torch.randn(num_pages, PAGE_SIZE, HEAD_DIM, device=device, dtype=torch.bfloat16)
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    block_table = perm.view(batch, pages_per_request).to(device)
    q = torch.randn(batch, nodes, heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    tree = random_tree(batch, nodes, gen, device)
    position = torch.arange(total, device=device)
    pages = block_table.long()[:, position // PAGE_SIZE]
    dense_k = kv_cache[pages, position % PAGE_SIZE]  # [B, T, 576]
    slot = (position - prefix).clamp(min=0)
    word = tree.mask[:, :, slot // 64]  # [B, N, T]
    tree_bit = ((word >> (slot % 64)) & 1).bool()
    visible = (position < prefix)[None, None, :] | tree_bit
    return Inputs(q, kv_cache, block_table, prefix_lens, tree, dense_k, visible)


def median_ms(fn: Callable[[int], object], calls_per_rep: int, reps: int, warmup: int) -> float:
    """Median milliseconds per call of ``fn(i)`` (i rotates the input set)."""
    for i in range(warmup):
        fn(i)
    times = []
    counter = 0
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_rep):
            fn(counter)
            counter += 1
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_rep)
    return statistics.median(times)


def timed(fn: Callable[[int], object], budget_ms: float = 150.0) -> float:
    """Calibrate repetitions to about ``budget_ms`` of device time, then return the median."""
    once = median_ms(fn, 1, 3, 2)
    calls = max(1, min(50, int(2.0 / max(once, 1e-3))))
    reps = max(5, min(30, int(budget_ms / max(once * calls, 1e-3))))
    return median_ms(fn, calls, reps, 2)


def graph_ms(fn: Callable[[int], object], num_sets: int, replays: int = 20) -> float:
    """Median device milliseconds per call from CUDA-graph replays (no CPU launch overhead)."""
    calls = max(num_sets, 8)
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)  # warm the allocator on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def matmul_floor_tflops() -> float:
    n = 8192
    sets = [
        (
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(2)
    ]
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def run(i: int) -> None:
        a, b = sets[i % 2]
        torch.matmul(a, b, out=out)

    ms = timed(run)
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def bench_shape(shape: tuple[int, int, int, int], sweep: bool) -> dict[str, object]:
    batch, heads, nodes, prefix = shape
    scale = 1.0 / math.sqrt(192.0)
    probe = make_inputs(batch, heads, nodes, prefix, seed=0)
    set_bytes = probe.kv_cache.numel() * 2 + probe.q.numel() * 2
    num_sets = max(2, min(8, math.ceil(ROTATE_BYTES / set_bytes)))
    sets = [probe] + [make_inputs(batch, heads, nodes, prefix, seed=s) for s in range(1, num_sets)]
    rows = nodes * heads
    work = flops(batch, heads, nodes, prefix)
    result: dict[str, object] = {
        "batch_size": batch,
        "num_heads": heads,
        "num_nodes": nodes,
        "prefix_len": prefix,
        "gflop": work / 1e9,
        "rotation_sets": num_sets,
    }

    out = torch.empty(batch, nodes, heads, V_DIM, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, nodes, heads, device="cuda")
    flags = torch.zeros(batch, dtype=torch.int32, device="cuda")
    index = torch.cuda.current_device()
    num_sms, max_smem = attention_cuda._device_limits(index)
    capacity = probe.block_table.shape[1] * PAGE_SIZE
    wgmma = attention_cuda.has_wgmma(index)
    plan = attention_cuda.plan_launch(
        batch, nodes, heads, HEAD_DIM, V_DIM, capacity, num_sms, max_smem, use_wgmma=wgmma
    )
    portable = attention_cuda.plan_launch(
        batch, nodes, heads, HEAD_DIM, V_DIM, capacity, num_sms, max_smem
    )

    def ours_with(p: attention_cuda.AttentionPlan) -> Callable[[int], object]:
        def run(i: int) -> object:
            s = sets[i % num_sets]
            return attention_cuda._run(
                p, s.q, s.kv_cache, s.block_table, s.prefix_lens, s.tree, scale, out, lse, flags
            )

        return run

    ms = timed(ours_with(plan))
    result["ddtree_ms"] = ms
    result["ddtree_tflops"] = work / (ms * 1e-3) / 1e12
    result["ddtree_num_splits"] = plan.num_splits
    result["ddtree_tile"] = dataclasses.asdict(plan.config)
    if plan.config != portable.config:
        ms = timed(ours_with(portable))
        result["ddtree_mma_sync_tflops"] = work / (ms * 1e-3) / 1e12
    if sweep:
        candidates = sorted({1, 2, 3, 4, 6, 8, 11, 16, 24, 32} | {plan.num_splits})
        swept = {}
        for splits in candidates:
            p = attention_cuda.plan_launch(
                batch,
                nodes,
                heads,
                HEAD_DIM,
                V_DIM,
                1,
                num_sms,
                max_smem,
                num_splits=splits,
                use_wgmma=wgmma,
            )
            swept[str(splits)] = work / (timed(ours_with(p), 60.0) * 1e-3) / 1e12
        result["ddtree_split_sweep_tflops"] = swept

    # Correctness spot check against the eager fp32 computation on set 0.
    s0 = sets[0]
    attention_cuda._run(
        plan, s0.q, s0.kv_cache, s0.block_table, s0.prefix_lens, s0.tree, scale, out, lse, None
    )
    q_rows = s0.q.reshape(batch, rows, HEAD_DIM)
    vis_rows = s0.visible.repeat_interleave(heads, dim=1)  # [B, R, T]
    worst_out = 0.0
    worst_lse = 0.0
    for b in range(batch):
        scores = (q_rows[b].float() @ s0.dense_k[b].float().T) * scale
        scores = scores.masked_fill(~vis_rows[b], -math.inf)
        ref_lse = torch.logsumexp(scores, -1)
        ref_out = torch.softmax(scores, -1) @ s0.dense_k[b, :, :V_DIM].float()
        got = out[b].reshape(rows, V_DIM).float()
        worst_out = max(worst_out, float((got - ref_out).norm() / ref_out.norm()))
        got_lse = lse[b].reshape(rows)
        worst_lse = max(worst_lse, float((got_lse - ref_lse).norm() / ref_lse.norm()))
        if b >= 3:
            break
    result["ddtree_rel_err_out"] = worst_out
    result["ddtree_rel_err_lse"] = worst_lse

    def sdpa_rows(i: int) -> object:
        s = sets[i % num_sets]
        k = s.dense_k[:, None]
        return F.scaled_dot_product_attention(
            s.q.reshape(batch, 1, rows, HEAD_DIM),
            k,
            k[..., :V_DIM],
            attn_mask=rows_masks[i % num_sets],
            scale=scale,
        )

    def sdpa_heads(i: int) -> object:
        s = sets[i % num_sets]
        k = s.dense_k[:, None]
        return F.scaled_dot_product_attention(
            s.q.transpose(1, 2),
            k,
            k[..., :V_DIM],
            attn_mask=s.visible[:, None],
            scale=scale,
            enable_gqa=True,
        )

    def eager(i: int) -> object:
        s = sets[i % num_sets]
        scores = torch.matmul(s.q.reshape(batch, rows, HEAD_DIM), s.dense_k.transpose(1, 2))
        probs = torch.softmax(
            (scores.float() * scale).masked_fill_(~rows_masks[i % num_sets][:, 0], -math.inf), -1
        )
        return torch.matmul(probs.to(torch.bfloat16), s.dense_k[..., :V_DIM])

    rows_masks = [s.visible.repeat_interleave(heads, dim=1)[:, None] for s in sets]
    for name, fn in (("sdpa_rows", sdpa_rows), ("sdpa_heads", sdpa_heads), ("eager", eager)):
        try:
            ms = timed(fn)
        except torch.OutOfMemoryError as err:
            result[f"{name}_error"] = f"out of memory: {err}".splitlines()[0]
            torch.cuda.empty_cache()
            continue
        except RuntimeError as err:
            result[f"{name}_error"] = str(err).splitlines()[0]
            continue
        result[f"{name}_ms"] = ms
        result[f"{name}_tflops"] = work / (ms * 1e-3) / 1e12
    # Last: a failed capture must not disturb the other measurements.
    try:
        ms = graph_ms(ours_with(plan), num_sets)
        result["ddtree_graph_ms"] = ms
        result["ddtree_graph_tflops"] = work / (ms * 1e-3) / 1e12
    except RuntimeError as err:
        result["ddtree_graph_error"] = str(err).splitlines()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--sweep", action="store_true", help="also time fixed split counts")
    parser.add_argument("--shapes", default="", help="comma-separated indices into SHAPES")
    args = parser.parse_args(argv)
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES

    props = torch.cuda.get_device_properties(0)
    floor = matmul_floor_tflops()
    results = []
    for shape in shapes:
        row = bench_shape(shape, args.sweep)
        torch.cuda.empty_cache()
        best_sdpa = max(
            float(row.get("sdpa_rows_tflops", 0.0)), float(row.get("sdpa_heads_tflops", 0.0))
        )
        row["ratio_vs_best_sdpa"] = row["ddtree_tflops"] / best_sdpa if best_sdpa else None
        row["fraction_of_floor"] = row["ddtree_tflops"] / floor
        results.append(row)
    target = next(
        (
            r
            for r in results
            if (r["batch_size"], r["num_heads"], r["num_nodes"], r["prefix_len"]) == TARGET_SHAPE
        ),
        None,
    )
    today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    gpu_slug = props.name.lower().replace("nvidia", "").strip().replace(" ", "-")
    report = {
        "date": today,
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flop_count": "2*B*H*N*(prefix+N)*(576+512)",
        "matmul_floor_tflops": floor,
        "target": {
            "shape": TARGET_SHAPE,
            "tflops": TARGET_TFLOPS,
            "met": bool(target and target["ddtree_tflops"] >= TARGET_TFLOPS),
        },
        "shapes": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{today}-{gpu_slug}-attention.json"
    path.write_text(json.dumps(report, indent=2) + "\n")

    header = f"{'B,H,N,prefix':>20} {'ddtree':>8} {'graph':>8} {'mma.sync':>8} {'sdpa_r':>8} "
    header += f"{'sdpa_h':>8} {'eager':>8} "
    header += f"{'x sdpa':>7} {'splits':>6} {'err':>8}"
    lines = [f"floor (bf16 matmul): {floor:.0f} TFLOP/s on {props.name}", header]
    for r in results:
        shape = f"{r['batch_size']},{r['num_heads']},{r['num_nodes']},{r['prefix_len']}"
        cells = [
            f"{float(r.get(k, float('nan'))):8.1f}"
            for k in (
                "ddtree_tflops",
                "ddtree_graph_tflops",
                "ddtree_mma_sync_tflops",
                "sdpa_rows_tflops",
                "sdpa_heads_tflops",
                "eager_tflops",
            )
        ]
        ratio = r["ratio_vs_best_sdpa"]
        lines.append(
            f"{shape:>20} {' '.join(cells)} {ratio if ratio is None else f'{ratio:7.2f}'} "
            f"{r['ddtree_num_splits']:6d} {r['ddtree_rel_err_out']:8.1e}"
        )
        if "ddtree_split_sweep_tflops" in r:
            sweep = ", ".join(f"{k}:{v:.0f}" for k, v in r["ddtree_split_sweep_tflops"].items())
            lines.append(f"{'':>20} splits sweep: {sweep}")
    sys.stdout.write("\n".join(lines) + f"\nwrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
