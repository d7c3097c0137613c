"""Speculative decoding of the toy models: acceptance against budget, and tokens per second.

Part 1 (acceptance): greedy DDTree at budgets 1, 2, 4, ..., 1024 and the chain of per-depth
argmaxes, on held-out prompts (standard-library files the models never saw); mean acceptance
length per run, plus the live budget curve of the largest run.
Part 2 (speed): wall-clock tokens per second of autoregressive decoding, chain and DDTree at a
few budgets, per batch size, on the chosen device.

The models are 3.2M (target) and 1.6M (drafter) parameters: small-model numbers. Usage::

    python bench/bench_speculative.py --device cpu --out bench/results/<date>-<hw>-speculative.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

from ddtree.clients.speculative import KernelOps, SpeculativeDecoder, budget_ladder
from ddtree.clients.toy import load_pair
from ddtree.clients.toy.data import held_out_prompts
from ddtree.kernels.backend import resolve_backend


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> int:
    """Run both parts and write the JSON record to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--acceptance-tokens", type=int, default=128)
    parser.add_argument("--max-budget", type=int, default=1024)
    parser.add_argument("--speed-tokens", type=int, default=128)
    parser.add_argument("--speed-budgets", default="8,32,64,256")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    target, drafter = load_pair(device)
    decoder = SpeculativeDecoder(target, drafter, KernelOps(args.backend))
    prompts = [list(p) for p in held_out_prompts(args.prompts)]
    record: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": _hardware(device),
        "device": str(device),
        "backend": args.backend,
        "resolved_backend": resolve_backend(args.backend, device),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "command": "python bench/bench_speculative.py " + " ".join(argv or sys.argv[1:]),
        "models": {
            "target_parameters": sum(p.numel() for p in target.parameters()),
            "drafter_parameters": sum(p.numel() for p in drafter.parameters()),
            "draft_len": drafter.config.draft_len,
            "vocab_size": target.config.vocab_size,
            "note": "toy byte-level models trained on the Python stdlib; not large-model numbers",
        },
        "prompts": {"count": len(prompts), "bytes_each": len(prompts[0]), "split": "held_out"},
    }
    greedy = decoder.generate(prompts, args.acceptance_tokens, method="autoregressive").tokens

    def lossless(tokens: list[list[int]]) -> bool:
        return tokens == greedy

    if not args.skip_acceptance:
        chain = decoder.generate(prompts, args.acceptance_tokens, method="chain")
        runs = []
        for budget in budget_ladder(args.max_budget):
            result = decoder.generate(prompts, args.acceptance_tokens, budget=budget)
            runs.append(
                {
                    "budget": budget,
                    "mean_acceptance_length": result.stats.mean_acceptance_length,
                    "steps": len(result.stats.acceptance_lengths),
                    "lossless": lossless(result.tokens),
                }
            )
            if budget == args.max_budget:
                live_curve = result.stats.budget_curve
        record["acceptance"] = {
            "new_tokens_per_prompt": args.acceptance_tokens,
            "chain": {
                "budget": chain.stats.budget,
                "mean_acceptance_length": chain.stats.mean_acceptance_length,
                "budget_curve": {str(b): v for b, v in chain.stats.budget_curve.items()},
                "lossless": lossless(chain.tokens),
            },
            "ddtree": runs,
            "ddtree_live_budget_curve_of_largest_run": {str(b): v for b, v in live_curve.items()},
        }

    speed = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        batch = (prompts * batch_size)[:batch_size]
        decoder.generate(batch, 8, budget=64)  # warm-up: allocations, kernel compiles
        methods = [("autoregressive", 0), ("chain", 0)] + [
            ("ddtree", int(b)) for b in args.speed_budgets.split(",")
        ]
        batch_greedy: list[list[int]] | None = None
        for method, budget in methods:
            result = decoder.generate(batch, args.speed_tokens, method=method, budget=budget)
            if batch_greedy is None:
                batch_greedy = result.tokens
            speed.append(
                {
                    "batch_size": batch_size,
                    "method": method,
                    "budget": result.stats.budget,
                    "tokens_per_second": result.stats.tokens_per_second,
                    "mean_acceptance_length": result.stats.mean_acceptance_length,
                    "seconds": result.stats.seconds,
                    "lossless": result.tokens == batch_greedy,
                }
            )
    record["speed"] = {"new_tokens_per_request": args.speed_tokens, "runs": speed}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    sys.stdout.write(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
