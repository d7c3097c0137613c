"""A small byte-level target LM with a paged KV cache, and its parallel block drafter.

Both are demonstration models (a few million parameters, trained in minutes on a CPU from the
Python standard library's sources); their numbers say nothing about large models.

The target is a pre-norm causal transformer with rotary position embeddings. Besides the usual
full-sequence ``forward`` used for training, ``forward_paged`` runs any set of new tokens
(a prompt chunk, one token, or a whole draft tree) against a paged KV cache of shape
``(num_pages, page_size, kv_dim)`` with ``kv_dim = 2 * num_layers * d_model`` (each layer's K then
V, concatenated), so the service's ``commit_kv`` compacts every layer in one call.

The drafter sees the target's final hidden state at the last committed token and the next
(root) token, and in one pass gives logits for the ``draft_len`` tokens after the root: one
marginal per position, which is what DDTree's ``build_tree`` expects.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "DrafterConfig",
    "TargetConfig",
    "ToyDrafter",
    "ToyTarget",
    "count_parameters",
    "paged_rows",
]


@dataclass(frozen=True)
class TargetConfig:
    """Shape of the target LM."""

    vocab_size: int = 256
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int = 1024
    rope_base: float = 10000.0

    @property
    def kv_dim(self) -> int:
        """Width of one paged KV-cache row: every layer's K and V concatenated."""
        return 2 * self.num_layers * self.d_model

    def to_dict(self) -> dict[str, float | int]:
        """Plain-dict form stored next to the weights."""
        return asdict(self)


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of the block drafter."""

    vocab_size: int = 256
    d_model: int = 256
    target_d_model: int = 256
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 768
    draft_len: int = 15

    def to_dict(self) -> dict[str, float | int]:
        """Plain-dict form stored next to the weights."""
        return asdict(self)


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x`` (``[batch, heads, seq, head_dim]``) by ``positions`` (``[batch, seq]``)."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)  # [half]
    angles = positions.to(torch.float64)[:, None, :, None] * inv_freq  # [batch, 1, seq, half]
    cos = angles.cos().to(x.dtype)
    sin = angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Block(nn.Module):
    """Pre-norm transformer block; attention is delegated so it can be causal, masked or paged."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm2 = nn.RMSNorm(d_model)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys, values of ``x`` (``[batch, seq, d_model]``), each ``[b, h, s, hd]``."""
        batch, seq, d_model = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.num_heads, d_model // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Add the attention output (``[batch, heads, seq, head_dim]``) and the MLP to ``x``."""
        batch, _, seq, _ = attn.shape
        x = x + self.out(attn.transpose(1, 2).reshape(batch, seq, -1))
        mlp: torch.Tensor = self.down(F.gelu(self.up(self.norm2(x))))
        return x + mlp


def _blocks(blocks: nn.ModuleList) -> list[_Block]:
    """The blocks with their type (``ModuleList`` iterates as plain ``Module``)."""
    return [cast(_Block, block) for block in blocks]


def paged_rows(block_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows of the flattened cache ``kv_cache.view(-1, kv_dim)`` holding logical ``positions``.

    Parameters
    ----------
    block_table : torch.Tensor
        Shape ``(batch_size, max_pages)``, int32. Page of each logical block.
    positions : torch.Tensor
        Shape ``(batch_size, n)``, int64, ``0 <= positions < max_pages * page_size``.
    page_size : int
        Token slots per page.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size, n)``, int64.
    """
    pages = torch.gather(block_table.long(), 1, positions // page_size)  # [batch, n]
    return pages * page_size + positions % page_size


class ToyTarget(nn.Module):
    """Byte-level causal LM (RoPE, RMSNorm, GELU MLP, tied embedding) with a paged-cache pass."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        # The embedding doubles as the output head: a unit-variance init would give logits of
        # standard deviation sqrt(d_model) at the start.
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(
            _Block(config.d_model, config.num_heads, config.d_ff) for _ in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(config.d_model)

    def _head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.norm(x)
        return hidden @ self.embed.weight.t(), hidden

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal pass over whole sequences (training and evaluation).

        Parameters
        ----------
        tokens : torch.Tensor
            Shape ``(batch_size, seq_len)``, int64 bytes.

        Returns
        -------
        tuple of torch.Tensor
            ``(logits, hidden)``: shapes ``(batch_size, seq_len, vocab_size)`` and
            ``(batch_size, seq_len, d_model)``; ``hidden`` is the final normed state (the
            drafter's input).
        """
        batch, seq = tokens.shape
        positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
        x = self.embed(tokens)
        for block in _blocks(self.blocks):
            q, k, v = block.split(x)
            q = _rope(q, positions, self.config.rope_base)
            k = _rope(k, positions, self.config.rope_base)
            x = block.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self._head(x)

    def forward_paged(
        self,
        tokens: torch.Tensor,
        depths: torch.Tensor,
        attend: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens against the paged cache, writing their K/V at ``prefix_len + i``.

        Token ``i`` of request ``b`` sits at RoPE position ``prefix_lens[b] + depths[b, i]``,
        attends to logical positions ``< prefix_lens[b]`` and to new token ``j`` where
        ``attend[b, i, j]``. Its keys and values are written to logical position
        ``prefix_lens[b] + i`` (the DDTree convention: tree node ``i`` at ``prefix_len + i``).
        Padding slots should be given ``depths = 0`` and ``attend`` = self only; their output
        is meaningless but harmless.

        Parameters
        ----------
        tokens : torch.Tensor
            Shape ``(batch_size, n)``, int64, in ``[0, vocab_size)``.
        depths : torch.Tensor
            Shape ``(batch_size, n)``, int64. Offset of each token's position from the prefix.
        attend : torch.Tensor
            Shape ``(batch_size, n, n)``, bool. Which new tokens each new token sees (for a
            tree: ancestor-or-self; for a prompt chunk: causal).
        kv_cache : torch.Tensor
            Shape ``(num_pages, page_size, kv_dim)``, the model's float dtype, same device;
            written in place.
        block_table : torch.Tensor
            Shape ``(batch_size, max_pages)``, int32. Page of each logical block; must cover
            ``prefix_len + n`` positions.
        prefix_lens : torch.Tensor
            Shape ``(batch_size,)``, int32. Committed tokens already in the cache.

        Returns
        -------
        tuple of torch.Tensor
            ``(logits, hidden)``: shapes ``(batch_size, n, vocab_size)`` and
            ``(batch_size, n, d_model)``.
        """
        config = self.config
        batch, n = tokens.shape
        page_size = kv_cache.shape[1]
        flat = kv_cache.view(-1, kv_cache.shape[2])  # [pages * page_size, kv_dim]
        prefix = prefix_lens.long()
        total = int(prefix.max()) + n
        span = torch.arange(total, device=tokens.device).expand(batch, total)  # [batch, total]
        new_positions = prefix[:, None] + torch.arange(n, device=tokens.device)  # [batch, n]
        read_rows = paged_rows(
            block_table, span.clamp(max=block_table.shape[1] * page_size - 1), page_size
        )  # [batch, total]
        write_rows = paged_rows(block_table, new_positions, page_size)  # [batch, n]
        # Key slot s is visible to new token i if s is committed (< prefix) or is new token j
        # (s = prefix + j) with attend[i, j].
        rel = span - prefix[:, None]  # [batch, total]
        in_tree = (rel >= 0) & (rel < n)
        tree_visible = torch.gather(
            attend, 2, rel.clamp(0, n - 1)[:, None, :].expand(batch, n, total)
        )  # [batch, n, total]
        visible = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_visible)
        rope_positions = prefix[:, None] + depths.long()  # [batch, n]
        x = self.embed(tokens)
        d = config.d_model
        heads = config.num_heads
        for layer, block in enumerate(_blocks(self.blocks)):
            q, k, v = block.split(x)
            q = _rope(q, rope_positions, config.rope_base)
            k = _rope(k, rope_positions, config.rope_base)
            base = 2 * layer * d
            flat[write_rows.reshape(-1), base : base + d] = k.transpose(1, 2).reshape(-1, d)
            flat[write_rows.reshape(-1), base + d : base + 2 * d] = v.transpose(1, 2).reshape(-1, d)
            kv = flat[read_rows.reshape(-1), base : base + 2 * d].view(batch, total, 2, heads, -1)
            keys = kv[:, :, 0].transpose(1, 2)  # [batch, heads, total, head_dim]
            values = kv[:, :, 1].transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible[:, None])
            x = block.finish(x, attn)
        return self._head(x)


class ToyDrafter(nn.Module):
    """Parallel block drafter: one pass gives logits for the ``draft_len`` tokens after the root.

    Input is the target's final hidden state at the last committed token (the one whose
    prediction was the root) and the root token. A context token built from both and
    ``draft_len`` learned position tokens go through a small bidirectional transformer; each
    position token's output gives that depth's marginal.
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.context = nn.Linear(config.target_d_model + config.d_model, config.d_model)
        self.slots = nn.Parameter(torch.randn(config.draft_len, config.d_model) * 0.02)
        self.blocks = nn.ModuleList(
            _Block(config.d_model, config.num_heads, config.d_ff) for _ in range(config.num_layers)
        )
        self.norm = nn.RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
        """Draft logits for depths ``1..draft_len`` after the root.

        Parameters
        ----------
        hidden : torch.Tensor
            Shape ``(batch_size, target_d_model)``, float. Target's final hidden state at the
            last committed token.
        root_tokens : torch.Tensor
            Shape ``(batch_size,)``, int64. The token after it (the tree's root).

        Returns
        -------
        torch.Tensor
            Shape ``(batch_size, draft_len, vocab_size)``, same float dtype.
        """
        ctx = self.context(torch.cat([hidden, self.embed(root_tokens)], dim=-1))  # [batch, d]
        x = torch.cat([ctx[:, None], ctx[:, None] + self.slots], dim=1)  # [batch, 1 + L, d]
        for block in _blocks(self.blocks):
            q, k, v = block.split(x)
            x = block.finish(x, F.scaled_dot_product_attention(q, k, v))
        logits: torch.Tensor = self.head(self.norm(x[:, 1:]))
        return logits


def count_parameters(module: nn.Module) -> int:
    """Number of parameters of ``module`` (tied weights counted once)."""
    return sum(p.numel() for p in module.parameters())
