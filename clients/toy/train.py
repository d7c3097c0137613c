"""Train the toy target LM, then its block drafter, on the standard library's sources.

Reproducible: every random draw comes from generators seeded by ``--seed``, and the run is a
fixed number of steps on ``torch.set_num_threads(--threads)``. The weights are rounded to fp16
before they are evaluated and saved, and the drafter is trained against the fp16-rounded
target, so the saved pair is exactly what was measured. Usage::

    python -m ddtree.clients.toy.train --out clients/toy/weights
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from ddtree.clients.toy.data import load_corpus, stdlib_files
from ddtree.clients.toy.model import (
    DrafterConfig,
    TargetConfig,
    ToyDrafter,
    ToyTarget,
    count_parameters,
)

__all__ = ["main"]

_log = logging.getLogger(__name__)


def _crops(
    corpus: torch.Tensor, count: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    starts = torch.randint(0, corpus.numel() - length, (count,), generator=generator)
    return torch.stack([corpus[s : s + length] for s in starts.tolist()]).long()  # [count, length]


def _lr(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _round_fp16(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.half().float())


def _target_loss(target: ToyTarget, batch: torch.Tensor) -> torch.Tensor:
    logits, _ = target(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def _drafter_loss(
    target: ToyTarget,
    drafter: ToyDrafter,
    batch: torch.Tensor,
    anchors: torch.Tensor,
    depth_weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted loss and per-depth top-1 accuracy of the drafter at ``anchors``.

    Anchor ``t`` of a sequence gives the drafter the target's hidden state at ``t`` and the
    root token ``batch[t + 1]``; depth ``k`` must predict ``batch[t + 1 + k]``.
    """
    draft_len = drafter.config.draft_len
    with torch.no_grad():
        _, hidden = target(batch)  # [b, seq, d]
    rows = torch.arange(batch.shape[0])[:, None]
    h = hidden[rows, anchors].reshape(-1, hidden.shape[-1])  # [b * a, d]
    roots = batch[rows, anchors + 1].reshape(-1)  # [b * a]
    offsets = anchors[..., None] + 1 + torch.arange(1, draft_len + 1)  # [b, a, L]
    labels = batch[rows[..., None], offsets].reshape(-1, draft_len)  # [b * a, L]
    logits = drafter(h, roots)  # [b * a, L, V]
    per = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(0)  # [L]
    accuracy = (logits.argmax(-1) == labels).float().mean(0)  # [L]
    return (per * depth_weights).sum() / depth_weights.sum(), accuracy


def main(argv: list[str] | None = None) -> int:
    """Train both models and write ``target.pt``, ``drafter.pt`` and ``training.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target-steps", type=int, default=600)
    parser.add_argument("--drafter-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--anchors", type=int, default=32, help="drafter anchors per sequence")
    parser.add_argument("--lr", type=float, default=2e-3)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)

    train = load_corpus("train")
    held_out = load_corpus("held_out")
    eval_target = _crops(held_out, 64, args.seq_len + 1, torch.Generator().manual_seed(1234))
    _log.info(
        "corpus: train %d bytes (%d files), held-out %d bytes (%d files)",
        train.numel(),
        len(stdlib_files("train")),
        held_out.numel(),
        len(stdlib_files("held_out")),
    )

    target = ToyTarget(TargetConfig())
    optimizer = torch.optim.AdamW(target.parameters(), lr=args.lr, weight_decay=0.01)
    started = time.perf_counter()
    for step in range(args.target_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, args.target_steps, args.lr)
        loss = _target_loss(target, _crops(train, args.batch_size, args.seq_len + 1, generator))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(target.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == args.target_steps - 1:
            _log.info("target step %d loss %.4f", step, loss.item())
    target_seconds = time.perf_counter() - started
    _round_fp16(target)
    target.eval()
    target.requires_grad_(False)
    with torch.no_grad():
        target_train_loss = _target_loss(
            target, _crops(train, 64, args.seq_len + 1, torch.Generator().manual_seed(4321))
        ).item()
        target_held_out_loss = _target_loss(target, eval_target).item()
    _log.info("target held-out loss %.4f nats/byte", target_held_out_loss)

    config = DrafterConfig(target_d_model=target.config.d_model)
    drafter = ToyDrafter(config)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.01)
    depth_weights = 0.85 ** torch.arange(config.draft_len, dtype=torch.float32)
    span = args.seq_len + config.draft_len + 1

    def anchors_for(count: int, gen: torch.Generator) -> torch.Tensor:
        return torch.stack(
            [torch.randperm(args.seq_len - 1, generator=gen)[: args.anchors] for _ in range(count)]
        )  # [count, anchors]

    started = time.perf_counter()
    for step in range(args.drafter_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, args.drafter_steps, args.lr)
        batch = _crops(train, args.batch_size, span, generator)
        loss, _ = _drafter_loss(
            target, drafter, batch, anchors_for(args.batch_size, generator), depth_weights
        )
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == args.drafter_steps - 1:
            _log.info("drafter step %d loss %.4f", step, loss.item())
    drafter_seconds = time.perf_counter() - started
    _round_fp16(drafter)
    drafter.eval()
    eval_gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        drafter_loss, accuracy = _drafter_loss(
            target,
            drafter,
            _crops(held_out, 64, span, eval_gen),
            anchors_for(64, eval_gen),
            depth_weights,
        )

    args.out.mkdir(parents=True, exist_ok=True)
    for name, model in (("target", target), ("drafter", drafter)):
        torch.save(
            {
                "config": model.config.to_dict(),
                "state_dict": {k: v.half() for k, v in model.state_dict().items()},
            },
            args.out / f"{name}.pt",
        )
    record = {
        "command": "python -m ddtree.clients.toy.train " + " ".join(argv),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch": torch.__version__,
        "train_bytes": train.numel(),
        "held_out_bytes": held_out.numel(),
        "train_files": len(stdlib_files("train")),
        "held_out_files": len(stdlib_files("held_out")),
        "target_parameters": count_parameters(target),
        "drafter_parameters": count_parameters(drafter),
        "target_seconds": round(target_seconds, 1),
        "drafter_seconds": round(drafter_seconds, 1),
        "target_train_loss_nats_per_byte": round(target_train_loss, 4),
        "target_held_out_loss_nats_per_byte": round(target_held_out_loss, 4),
        "drafter_held_out_weighted_loss": round(drafter_loss.item(), 4),
        "drafter_held_out_top1_accuracy_by_depth": [round(a, 4) for a in accuracy.tolist()],
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    _log.info("done: %s", json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
