"""Fine-tune the toy drafter on the target's own greedy continuations (self-distillation).

A drafter trained only on real text is calibrated for real text, but at decoding time it
drafts the target's greedy output, which a small target makes far more repetitive; there its
marginals are underconfident, and DDTree spreads its budget wide instead of deep. So, as
speculative-decoding drafters usually are, it is fine-tuned on what the target generates:
each step crops prompts from the training files, lets the (frozen) target continue them
greedily with the paged-cache loop, and trains the drafter at anchors inside the continuation.
Seeded and reproducible like ``ddtree.clients.toy.train``. Usage::

    python -m ddtree.clients.toy.distill --weights clients/toy/weights
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from ddtree.clients.speculative import KernelOps, SpeculativeDecoder
from ddtree.clients.toy import load_pair
from ddtree.clients.toy.data import load_corpus
from ddtree.clients.toy.train import _crops, _drafter_loss, _lr, _round_fp16

__all__ = ["main"]

_log = logging.getLogger(__name__)


def _greedy_sequences(
    decoder: SpeculativeDecoder, prompts: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """Prompts ``[count, prompt_len]`` followed by the target's greedy continuation."""
    generated = decoder.generate(prompts.tolist(), new_tokens, method="autoregressive").tokens
    return torch.cat([prompts, torch.tensor(generated)], dim=1)  # [count, prompt + new]


def main(argv: list[str] | None = None) -> int:
    """Fine-tune ``drafter.pt`` in ``--weights`` and record the run in ``training.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, required=True, help="folder of target/drafter")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=80)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    target, drafter = load_pair(weights_dir=args.weights)
    drafter.requires_grad_(True).train()
    decoder = SpeculativeDecoder(target, drafter, KernelOps())
    train = load_corpus("train")
    held_out = load_corpus("held_out")
    draft_len = drafter.config.draft_len
    depth_weights = 0.85 ** torch.arange(draft_len, dtype=torch.float32)
    # Anchor t needs the hidden state at t and labels up to t + 1 + draft_len; the first
    # anchor is the last prompt token, whose root is the first generated token.
    last_anchor = args.prompt_len + args.new_tokens - draft_len - 2

    def anchors_for(count: int, gen: torch.Generator) -> torch.Tensor:
        span = last_anchor - (args.prompt_len - 1) + 1
        picks = [torch.randperm(span, generator=gen)[: args.anchors] for _ in range(count)]
        return torch.stack(picks) + int(args.prompt_len) - 1  # [count, anchors]

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.01)
    started = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, args.steps, args.lr)
        prompts = _crops(train, args.batch_size, args.prompt_len, generator)
        with torch.no_grad():
            batch = _greedy_sequences(decoder, prompts, args.new_tokens)
        loss, _ = _drafter_loss(
            target, drafter, batch, anchors_for(args.batch_size, generator), depth_weights
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == args.steps - 1:
            _log.info("distill step %d loss %.4f", step, loss.item())
    seconds = time.perf_counter() - started
    _round_fp16(drafter)
    drafter.eval().requires_grad_(False)
    eval_gen = torch.Generator().manual_seed(77)
    with torch.no_grad():
        eval_batch = _greedy_sequences(
            decoder, _crops(held_out, 64, args.prompt_len, eval_gen), args.new_tokens
        )
        eval_loss, accuracy = _drafter_loss(
            target, drafter, eval_batch, anchors_for(64, eval_gen), depth_weights
        )
    torch.save(
        {
            "config": drafter.config.to_dict(),
            "state_dict": {k: v.half() for k, v in drafter.state_dict().items()},
        },
        args.weights / "drafter.pt",
    )
    record_path = args.weights / "training.json"
    record = json.loads(record_path.read_text())
    record["distill"] = {
        "command": "python -m ddtree.clients.toy.distill " + " ".join(argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "seconds": round(seconds, 1),
        "held_out_greedy_weighted_loss": round(eval_loss.item(), 4),
        "held_out_greedy_top1_accuracy_by_depth": [round(a, 4) for a in accuracy.tolist()],
    }
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    _log.info("done: %s", json.dumps(record["distill"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
