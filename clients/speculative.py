"""A complete speculative decoding loop: the models run here, everything tree-shaped in ddtree.

The caller's process runs the target and the drafter; the tree work goes through a
``TreeOps`` object, which the remote ``Client``, the ``EmbeddedClient`` and ``KernelOps``
(the ``ddtree.kernels`` ops called directly, no service) all satisfy. One step:

1. the drafter gives ``draft_logits`` ``[batch_size, draft_len, vocab_size]`` from the target's
   hidden state at the last committed token and the root token;
2. ``build_tree`` turns them into a DDTree (or, for ``method="chain"``, into the chain of
   per-depth argmaxes: the logits are restricted to their top-1 before the call);
3. the target's verify pass runs over the tree's tokens at positions ``prefix_len + depth``
   under the tree's ancestor mask and writes node ``i``'s K/V at ``prefix_len + i``;
4. ``accept_tree`` walks the tree along the target's argmax (greedy) or its samples
   (``temperature > 0``), and compacts the paged KV cache to the accepted path;
5. the committed length grows by the acceptance length ``tau``, and the bonus token is the next
   root.

Greedy output is token-for-token the target's own greedy output; sampled output is distributed
as the target's own samples.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from ddtree import kernels
from ddtree.clients.types import KvCommit
from ddtree.kernels.types import Acceptance, Tree

__all__ = [
    "DecodeResult",
    "DecodeStats",
    "DrafterModel",
    "KernelOps",
    "Method",
    "SpeculativeDecoder",
    "TargetModel",
    "TreeOps",
    "budget_ladder",
]

Method = Literal["autoregressive", "chain", "ddtree"]


class _TargetConfig(Protocol):
    @property
    def kv_dim(self) -> int: ...


class TargetModel(Protocol):
    """What the loop needs of a target LM (``ddtree.clients.toy.ToyTarget`` fits)."""

    @property
    def config(self) -> _TargetConfig:
        """Model shape; ``kv_dim`` is the width of one paged KV-cache row."""
        ...

    def forward_paged(
        self,
        tokens: torch.Tensor,
        depths: torch.Tensor,
        attend: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and hidden states of new tokens against the paged cache (writes their K/V)."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The model's parameters (for its device and dtype)."""
        ...


class _DrafterConfig(Protocol):
    @property
    def draft_len(self) -> int: ...


class DrafterModel(Protocol):
    """What the loop needs of a parallel drafter (``ddtree.clients.toy.ToyDrafter`` fits)."""

    @property
    def config(self) -> _DrafterConfig:
        """Model shape; ``draft_len`` positions are drafted per pass."""
        ...

    def __call__(self, hidden: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[batch_size, draft_len, vocab_size]``."""
        ...


class TreeOps(Protocol):
    """The two tree operations the loop needs (the clients' ``build_tree`` and ``accept_tree``)."""

    def build_tree(
        self,
        draft_logits: torch.Tensor,
        root_tokens: torch.Tensor,
        budget: int,
        *,
        temperature: float = 1.0,
        max_budget: int | None = None,
    ) -> Tree:
        """Build the DDTree of ``budget`` nodes (see ``ddtree.kernels.build_tree``)."""
        ...

    def accept_tree(
        self,
        tree: Tree,
        target_tokens: torch.Tensor | None = None,
        *,
        target_logits: torch.Tensor | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        kv_commit: KvCommit | None = None,
    ) -> Acceptance:
        """Accept along the target's tokens and compact ``kv_commit`` (see ``kernels.accept``)."""
        ...


class KernelOps:
    """``TreeOps`` over the ``ddtree.kernels`` ops in this process, without a service.

    Parameters
    ----------
    backend : {"auto", "cuda", "reference"}
        Passed to every op (see ``ddtree.kernels``).
    """

    def __init__(self, backend: kernels.backend.Backend = "auto") -> None:
        self.backend: kernels.backend.Backend = backend

    def build_tree(
        self,
        draft_logits: torch.Tensor,
        root_tokens: torch.Tensor,
        budget: int,
        *,
        temperature: float = 1.0,
        max_budget: int | None = None,
    ) -> Tree:
        """``ddtree.kernels.build_tree`` with this object's backend."""
        return kernels.build_tree(
            draft_logits,
            root_tokens,
            budget,
            temperature=temperature,
            max_budget=max_budget,
            backend=self.backend,
        )

    def accept_tree(
        self,
        tree: Tree,
        target_tokens: torch.Tensor | None = None,
        *,
        target_logits: torch.Tensor | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        kv_commit: KvCommit | None = None,
    ) -> Acceptance:
        """``ddtree.kernels.accept`` then, if ``kv_commit`` is given, ``commit_kv``.

        ``seed`` seeds a fresh generator on the tree's device for sampling.
        """
        generator = None
        if seed is not None:
            generator = torch.Generator(device=tree.device).manual_seed(seed)
        acceptance = kernels.accept(
            tree,
            target_tokens,
            target_logits=target_logits,
            temperature=temperature,
            generator=generator,
            backend=self.backend,
        )
        if kv_commit is not None:
            kernels.commit_kv(
                kv_commit.kv_cache,
                kv_commit.block_table,
                kv_commit.prefix_lens,
                acceptance,
                backend=self.backend,
            )
        return acceptance


def budget_ladder(budget: int) -> list[int]:
    """Budgets ``1, 2, 4, ...`` below ``budget``, then ``budget`` itself."""
    ladder = []
    b = 1
    while b < budget:
        ladder.append(b)
        b *= 2
    ladder.append(budget)
    return ladder


@dataclass
class DecodeStats:
    """What one ``generate`` call measured (decode phase only, prefill excluded)."""

    method: Method
    budget: int
    """Draft nodes per tree (``0`` for autoregressive, ``draft_len`` for chain)."""
    new_tokens: int
    """Tokens kept over all requests (``batch_size * max_new_tokens``)."""
    seconds: float
    """Wall-clock time of the decode loop (device synchronised at the end)."""
    acceptance_lengths: list[int] = field(default_factory=list)
    """Acceptance length ``tau`` of every request at every step, root included."""
    budget_curve: dict[int, float] = field(default_factory=dict)
    """Mean acceptance length the same steps would have had at each smaller budget
    (the accepted path cut at the first node index past it; DDTree trees are nested)."""

    @property
    def tokens_per_second(self) -> float:
        """Kept tokens per second of decoding."""
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens emitted per target forward (``1`` for autoregressive)."""
        if not self.acceptance_lengths:
            return 1.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


@dataclass
class DecodeResult:
    """Generated tokens and the run's statistics."""

    tokens: list[list[int]]
    """Per request, exactly ``max_new_tokens`` generated token ids (after the prompt)."""
    stats: DecodeStats


def _unpack_mask(mask: torch.Tensor, num_nodes_max: int) -> torch.Tensor:
    """Bool ``[batch, nodes, nodes]`` from the int64 bit rows ``[batch, nodes, words]``."""
    index = torch.arange(num_nodes_max, device=mask.device)
    words = mask[:, :, index // 64]  # [batch, nodes, nodes]
    return ((words >> (index % 64)) & 1).bool()


def _tree_to(tree: Tree, device: torch.device) -> Tree:
    if tree.device == device:
        return tree
    return Tree(
        tokens=tree.tokens.to(device),
        parents=tree.parents.to(device),
        depths=tree.depths.to(device),
        log_probs=tree.log_probs.to(device),
        num_nodes=tree.num_nodes.to(device),
        mask=tree.mask.to(device),
        draft_len=tree.draft_len,
    )


class SpeculativeDecoder:
    """Decode with a target LM and a parallel drafter, tree work through ``ops``.

    Parameters
    ----------
    target : TargetModel
        Must offer ``forward_paged(tokens, depths, attend, kv_cache, block_table, prefix_lens)
        -> (logits, hidden)`` and ``config.kv_dim`` (see ``ddtree.clients.toy.model.ToyTarget``).
    drafter : DrafterModel
        ``drafter(hidden, root_tokens) -> draft_logits`` ``[batch_size, draft_len, vocab_size]``
        and ``config.draft_len``.
    ops : TreeOps
        A ``Client``, an ``EmbeddedClient`` or ``KernelOps``.
    page_size : int
        Token slots per page of the paged KV cache.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DrafterModel,
        ops: TreeOps,
        *,
        page_size: int = 16,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.ops = ops
        self.page_size = page_size

    @property
    def device(self) -> torch.device:
        """Device of the models."""
        return next(self.target.parameters()).device

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        method: Method = "ddtree",
        budget: int = 64,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> DecodeResult:
        """Continue every prompt by ``max_new_tokens`` tokens.

        Parameters
        ----------
        prompts : sequence of sequences of int
            ``batch_size`` prompts of token ids, each at least 2 long. The last prompt token is
            the first tree's root; the rest are prefilled.
        max_new_tokens : int
            Tokens to generate per request, ``>= 1``.
        method : {"autoregressive", "chain", "ddtree"}
            One target forward per token; the chain of per-depth drafter argmaxes; or the DDTree
            of ``budget`` nodes.
        budget : int
            Draft nodes per tree for ``"ddtree"``, ``1..1024``; ignored otherwise.
        temperature : float
            ``0`` for greedy; ``> 0`` samples from ``softmax(logits / temperature)``.
        seed : int
            Seed of every sampling step (step ``s`` uses ``seed * 2**20 + s``).

        Returns
        -------
        DecodeResult

        Raises
        ------
        ValueError
            An empty prompt list, a prompt shorter than 2, or ``max_new_tokens < 1``.
        """
        if not prompts:
            raise ValueError("prompts: expected at least one prompt, got none")
        if min(len(p) for p in prompts) < 2:
            raise ValueError("prompts: every prompt needs at least 2 tokens")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        draft_len = int(self.drafter.config.draft_len)
        if method == "autoregressive":
            tree_budget = 0
        elif method == "chain":
            tree_budget = draft_len
        elif method == "ddtree":
            tree_budget = budget
        else:
            raise ValueError(f"method: expected autoregressive, chain or ddtree, got {method!r}")
        device = self.device
        batch = len(prompts)
        longest = max(len(p) for p in prompts) + max_new_tokens + tree_budget + draft_len + 2
        max_pages = -(-longest // self.page_size)
        kv_cache = torch.zeros(
            batch * max_pages,
            self.page_size,
            int(self.target.config.kv_dim),
            dtype=next(self.target.parameters()).dtype,
            device=device,
        )
        block_table = torch.arange(batch * max_pages, dtype=torch.int32, device=device).view(
            batch, max_pages
        )
        prefix_lens, hidden, roots = self._prefill(prompts, kv_cache, block_table)
        stats = DecodeStats(method=method, budget=tree_budget, new_tokens=0, seconds=0.0)
        out: list[list[int]] = [[] for _ in range(batch)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step = 0
        while min(len(o) for o in out) < max_new_tokens:
            step_seed = seed * 2**20 + step
            # Finished requests ride along without advancing, so their cache stays in bounds.
            is_active = [len(o) < max_new_tokens for o in out]
            active = torch.tensor(is_active, device=device)
            if method == "autoregressive":
                picked = self._autoregressive_step(
                    roots, kv_cache, block_table, prefix_lens, temperature, step_seed
                )
                prefix_lens += active.int()
                roots = torch.where(active, picked, roots)
                for b, token in enumerate(picked.tolist()):
                    if is_active[b]:
                        out[b].append(token)
            else:
                roots, hidden = self._speculative_step(
                    roots,
                    hidden,
                    kv_cache,
                    block_table,
                    prefix_lens,
                    method,
                    tree_budget,
                    temperature,
                    step_seed,
                    is_active,
                    stats,
                    out,
                )
            step += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.seconds = time.perf_counter() - started
        stats.new_tokens = batch * max_new_tokens
        if stats.acceptance_lengths and method != "autoregressive":
            steps = len(stats.acceptance_lengths)
            stats.budget_curve = {b: total / steps for b, total in stats.budget_curve.items()}
        return DecodeResult(tokens=[o[:max_new_tokens] for o in out], stats=stats)

    def _prefill(
        self,
        prompts: Sequence[Sequence[int]],
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Commit every prompt but its last token; return prefix lengths, hidden, roots."""
        device = kv_cache.device
        hidden_rows: dict[int, torch.Tensor] = {}
        by_length: dict[int, list[int]] = {}
        for b, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(b)
        # Prompts of one length go through the target together.
        for length, requests in by_length.items():
            n = length - 1
            tokens = torch.tensor(
                [list(prompts[b][:-1]) for b in requests], dtype=torch.int64, device=device
            )  # [group, n]
            group = len(requests)
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            _, hidden = self.target.forward_paged(
                tokens,
                torch.arange(n, device=device).expand(group, n),
                causal.expand(group, n, n),
                kv_cache,
                block_table[torch.tensor(requests, device=device)],
                torch.zeros(group, dtype=torch.int32, device=device),
            )
            for row, b in enumerate(requests):
                hidden_rows[b] = hidden[row, -1]
        hiddens = [hidden_rows[b] for b in range(len(prompts))]
        prefix_lens = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.int32, device=device)
        roots = torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=device)
        return prefix_lens, torch.stack(hiddens), roots

    def _pick(self, logits: torch.Tensor, temperature: float, seed: int) -> torch.Tensor:
        """Argmax (ties: smaller token id) or a sample, over the last dim of ``[batch, V]``."""
        if temperature == 0.0:
            return logits.argmax(-1)
        generator = torch.Generator(device=logits.device).manual_seed(seed)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]

    def _autoregressive_step(
        self,
        roots: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        temperature: float,
        seed: int,
    ) -> torch.Tensor:
        batch = roots.shape[0]
        logits, _ = self.target.forward_paged(
            roots[:, None],
            torch.zeros(batch, 1, dtype=torch.int64, device=roots.device),
            torch.ones(batch, 1, 1, dtype=torch.bool, device=roots.device),
            kv_cache,
            block_table,
            prefix_lens,
        )
        return self._pick(logits[:, 0], temperature, seed)

    def _speculative_step(
        self,
        roots: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        method: Method,
        budget: int,
        temperature: float,
        seed: int,
        is_active: list[bool],
        stats: DecodeStats,
        out: list[list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = roots.device
        draft_logits = self.drafter(hidden, roots)  # [batch, draft_len, vocab]
        if method == "chain":
            # Only each depth's argmax stays possible, so the DDTree is the top-1 chain.
            top1 = draft_logits.argmax(-1, keepdim=True)
            draft_logits = torch.full_like(draft_logits, float("-inf")).scatter_(-1, top1, 0.0)
        tree = _tree_to(self.ops.build_tree(draft_logits, roots, budget, max_budget=budget), device)
        n = tree.num_nodes_max
        attend = _unpack_mask(tree.mask, n) | torch.eye(n, dtype=torch.bool, device=device)
        logits, node_hidden = self.target.forward_paged(
            tree.tokens.clamp(min=0),
            tree.depths.clamp(min=0).long(),
            attend,
            kv_cache,
            block_table,
            prefix_lens,
        )
        kv_commit = KvCommit(kv_cache, block_table, prefix_lens)
        if temperature == 0.0:
            acceptance = self.ops.accept_tree(tree, logits.argmax(-1), kv_commit=kv_commit)
        else:
            acceptance = self.ops.accept_tree(
                tree,
                target_logits=logits,
                temperature=temperature,
                seed=seed,
                kv_commit=kv_commit,
            )
        lengths = acceptance.length.to(device)
        nodes = acceptance.nodes.to(device)
        last = nodes.gather(1, (lengths.long() - 1)[:, None])[:, 0]  # [batch]
        next_hidden = node_hidden[torch.arange(roots.shape[0], device=device), last.long()]
        bonus = acceptance.bonus.to(device)
        active = torch.tensor(is_active, device=device)
        prefix_lens += lengths * active.int()
        ladder = budget_ladder(budget)
        for b, (tau, path, toks, bonus_token) in enumerate(
            zip(
                acceptance.length.tolist(),
                acceptance.nodes.tolist(),
                acceptance.tokens.tolist(),
                acceptance.bonus.tolist(),
                strict=True,
            )
        ):
            if not is_active[b]:
                continue
            out[b].extend(toks[1:tau])
            out[b].append(bonus_token)
            stats.acceptance_lengths.append(tau)
            for cut in ladder:
                cut_tau = sum(1 for node in path[:tau] if node <= cut)
                stats.budget_curve[cut] = stats.budget_curve.get(cut, 0.0) + cut_tau
        return (
            torch.where(active, bonus, roots),
            torch.where(active[:, None], next_hidden, hidden),
        )
