"""Small deterministic inputs for the service tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree import kernels
from ddtree.kernels.types import Tree

BATCH_SIZE = 3
DRAFT_LEN = 4
VOCAB_SIZE = 37
BUDGET = 9
HEAD_DIM = 24
PAGE_SIZE = 4
NUM_HEADS = 2
V_DIM = 16


@dataclass(frozen=True)
class Step:
    """One decoding step's inputs, with the tree the reference builds from them."""

    draft_logits: torch.Tensor  # [batch_size, draft_len, vocab_size] fp32
    root_tokens: torch.Tensor  # [batch_size] int64
    tree: Tree
    target_tokens: torch.Tensor  # [batch_size, num_nodes_max] int64
    target_logits: torch.Tensor  # [batch_size, num_nodes_max, vocab_size] fp32
    kv_cache: torch.Tensor  # [num_pages, page_size, head_dim] bf16
    block_table: torch.Tensor  # [batch_size, max_pages] int32
    prefix_lens: torch.Tensor  # [batch_size] int32
    q: torch.Tensor  # [batch_size, num_nodes_max, num_heads, head_dim] bf16


def make_step(seed: int = 0) -> Step:
    """Inputs whose greedy target accepts a depth-1 node other than node 1 (acceptance > 1)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH_SIZE, DRAFT_LEN, VOCAB_SIZE, generator=generator) * 3
    roots = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE,), generator=generator)
    tree = kernels.build_tree(logits, roots, BUDGET, backend="reference")
    targets = torch.randint(0, VOCAB_SIZE, tree.tokens.shape, generator=generator)
    # At the root the target picks the last-built depth-1 node, so the accepted path skips
    # node indices and a KV commit has latents to move.
    slots = torch.arange(tree.num_nodes_max).expand_as(tree.depths)
    last_child = torch.where(tree.depths == 1, slots, 0).amax(dim=1)
    targets[:, 0] = tree.tokens.gather(1, last_child[:, None])[:, 0]
    target_logits = torch.randn(*tree.tokens.shape, VOCAB_SIZE, generator=generator)
    max_pages = 8
    num_pages = BATCH_SIZE * max_pages
    kv_cache = torch.randn(num_pages, PAGE_SIZE, HEAD_DIM, generator=generator).to(torch.bfloat16)
    block_table = torch.randperm(num_pages, generator=generator).to(torch.int32)
    block_table = block_table.reshape(BATCH_SIZE, max_pages)
    prefix_lens = torch.tensor([0, 5, 11], dtype=torch.int32)
    q = torch.randn(BATCH_SIZE, tree.num_nodes_max, NUM_HEADS, HEAD_DIM, generator=generator)
    return Step(
        draft_logits=logits,
        root_tokens=roots,
        tree=tree,
        target_tokens=targets,
        target_logits=target_logits,
        kv_cache=kv_cache,
        block_table=block_table,
        prefix_lens=prefix_lens,
        q=q.to(torch.bfloat16),
    )
