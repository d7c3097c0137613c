"""Pure-torch reference of every ddtree op: the test oracle and the CPU backend.

The four ops have exactly the signatures and semantics of the public ``ddtree.kernels`` functions
(``build_tree``, ``accept``, ``commit_kv``, ``verify_attention``) minus ``backend``; read those
docstrings for the contract. This module adds the details a second implementation (the CUDA
kernels) must reproduce bit for bit:

* ``scaled_logits``: how logits become fp32 scores (temperature, NaN and ``+inf`` rules).
* ``build_tree``: the exact best-first order, computed without a heap (see its docstring).
* ``sampling_noise``: the counter-based Gumbel noise used by ``accept`` when sampling.
* ``pack_mask`` / ``unpack_mask``: the ancestor bitmask layout.

Everything is vectorised over the batch (loops run over depths, never over requests) and runs
on any device. Unlike the CUDA kernels, the reference may synchronise with the host.
"""

from __future__ import annotations

import torch

from ddtree.kernels import checks
from ddtree.kernels.types import ACCEPTANCE_FIELDS, TREE_FIELDS, Acceptance, Tree, mask_words

__all__ = [
    "accept",
    "build_tree",
    "commit_kv",
    "pack_mask",
    "sampling_noise",
    "scaled_logits",
    "unpack_mask",
    "verify_attention",
]

_NEG_INF = float("-inf")
_UINT32 = 0xFFFFFFFF


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Turn logits into the fp32 scores every op ranks, soft-maxes and samples.

    ``x = logits.float() / temperature`` (a true fp32 division, not a multiplication by the
    reciprocal); NaN becomes ``-inf``; in a row (last dimension) holding ``+inf``, the ``+inf``
    entries become ``0`` and every other entry ``-inf``, so they share the mass equally.

    Parameters
    ----------
    logits : torch.Tensor
        Shape ``(..., vocab_size)``, bf16/fp16/fp32, any device.
    temperature : float
        ``> 0``.

    Returns
    -------
    torch.Tensor
        Same shape, fp32.
    """
    x = logits.float() / temperature  # [..., vocab]
    x = torch.where(torch.isnan(x), _NEG_INF, x)  # [..., vocab]
    is_pos_inf = x == float("inf")  # [..., vocab]
    row_has_pos_inf = is_pos_inf.any(dim=-1, keepdim=True)  # [..., 1]
    pos_inf_row = torch.where(is_pos_inf, 0.0, _NEG_INF)  # [..., vocab]
    return torch.where(row_has_pos_inf, pos_inf_row, x)  # [..., vocab]


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim; a row with no finite entry gives all ``-inf``."""
    log_probs = torch.log_softmax(x, dim=-1)  # [..., vocab]
    row_impossible = (x == _NEG_INF).all(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(row_impossible, _NEG_INF, log_probs)  # [..., vocab]


def pack_mask(ancestors: torch.Tensor) -> torch.Tensor:
    """Pack a boolean ancestor matrix into int64 words: bit ``j % 64`` of word ``j // 64``.

    Parameters
    ----------
    ancestors : torch.Tensor
        Shape ``(batch_size, num_nodes_max, num_nodes_max)``, bool; ``[b, i, j]`` is True when
        node ``j`` is an ancestor-or-self of node ``i``.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size, num_nodes_max, mask_words(num_nodes_max))``, int64. Bit 63 is the
        sign bit, so a word with it set is negative.
    """
    batch_size, rows, cols = ancestors.shape
    words = mask_words(cols)
    padded = torch.nn.functional.pad(ancestors, (0, words * 64 - cols))  # [batch, nodes, words*64]
    shifts = torch.arange(64, device=ancestors.device, dtype=torch.int64)  # [64]
    weights = torch.ones(64, dtype=torch.int64, device=ancestors.device) << shifts  # [64]
    mask = torch.empty(batch_size, rows, words, dtype=torch.int64, device=ancestors.device)
    # mask: [batch, nodes, words]
    for word in range(words):
        bits = padded[:, :, word * 64 : (word + 1) * 64].long()  # [batch, nodes, 64]
        # Distinct powers of two: the sum is their OR, and no partial sum overflows int64.
        mask[:, :, word] = (bits * weights).sum(dim=-1)  # [batch, nodes]
    return mask  # [batch, nodes, words]


def unpack_mask(mask: torch.Tensor, num_nodes_max: int) -> torch.Tensor:
    """Inverse of ``pack_mask``.

    Parameters
    ----------
    mask : torch.Tensor
        Shape ``(batch_size, rows, mask_words(num_nodes_max))``, int64.
    num_nodes_max : int
        Columns to return.

    Returns
    -------
    torch.Tensor
        Shape ``(batch_size, rows, num_nodes_max)``, bool.
    """
    shifts = torch.arange(64, device=mask.device, dtype=torch.int64)  # [64]
    bits = (mask[..., None] >> shifts) & 1  # [batch, rows, words, 64]
    return bits.flatten(-2)[..., :num_nodes_max].bool()  # [batch, rows, nodes]


def _descending_key(values: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
    """Unique int64 sort keys: ``values`` (fp32, no NaN) descending, then ``tie_break`` ascending.

    ``tie_break`` holds non-negative ints below ``2**31``; ``-0.0`` and ``0.0`` count as equal.
    """
    bits = (values + 0.0).view(torch.int32).long()  # [...]
    # Flipping the magnitude bits of negative floats makes the int order the float order.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # [...], in [-2**31, 2**31)
    return ((2**31 - 1) - ordered) * 2**31 + tie_break  # [...]


def _first_k(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` smallest (unique) keys along dim 1, smallest first."""
    return torch.topk(keys, k, dim=1, largest=False, sorted=True).indices  # [batch, k]


def _inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse[b, order[b, i]] = i`` for a batch of permutations along dim 1."""
    steps = torch.arange(order.shape[1], device=order.device).expand_as(order)  # [batch, n]
    return torch.empty_like(order).scatter_(1, order, steps)  # [batch, n]


def build_tree(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int | torch.Tensor,
    *,
    temperature: float = 1.0,
    max_budget: int | None = None,
    error_flags: torch.Tensor | None = None,
    out: Tree | None = None,
) -> Tree:
    """Reference ``build_tree`` (see ``ddtree.kernels.build_tree`` for the contract).

    Exact order without a heap. Per depth, ``x = scaled_logits(draft_logits, temperature)`` and
    ``log_p = log_softmax(x)`` in fp32 (an all ``-inf`` row gives all ``-inf``); the tokens of
    a depth are ranked by ``x`` descending, equal ``x`` smaller token id first, and the first
    ``K = min(max_budget, vocab_size)`` are kept. A prefix's score is the fp32 running sum of
    its tokens' ``log_p`` in depth order (``child = fl(parent + log_p)``).

    Define the total order on prefixes: score descending, then rank tuple lexicographically
    ascending (a prefix before its extensions). Scores never increase from a prefix to its
    first child or from a node to its next sibling (fp32 rounding is monotone), and both precede
    it in the order on equal scores, so the paper's best-first heap pops prefixes exactly in this
    order, skipping ``-inf`` scores. Hence the tree of budget ``b`` is the first ``b`` prefixes
    with a finite score (the nested property), and a beam of width ``max_budget`` per depth
    (keeping the first ``max_budget`` extensions of the previous depth's beam) followed by a
    merge of all depths in that order is exact.

    Requests skipped for a bad root token (see ``checks.resolve_flags``) get a root-only tree
    whose node 0 still carries the given root token. With ``out``, the trees are computed apart
    and copied into it only when no request of the batch is flagged (no host sync).
    """
    budgets, num_nodes_max = checks.check_build_tree_args(
        draft_logits,
        root_tokens,
        budget,
        temperature=temperature,
        max_budget=max_budget,
        error_flags=error_flags,
        out=out,
    )
    batch_size, draft_len, vocab_size = draft_logits.shape
    device = draft_logits.device
    skip = checks.resolve_flags(
        checks.root_token_flags(root_tokens, vocab_size),
        error_flags,
        checks.FLAG_MESSAGES["build_tree"],
    )  # [batch]
    beam = num_nodes_max - 1
    top_k = min(beam, vocab_size)

    # Per depth: the top-K token ids in rank order and their log-probabilities.
    shape = (batch_size, draft_len, top_k)
    top_ids = torch.empty(shape, dtype=torch.int64, device=device)  # [batch, depth, k]
    top_log_probs = torch.empty(shape, dtype=torch.float32, device=device)  # [batch, depth, k]
    vocab_ids = torch.arange(vocab_size, device=device)  # [vocab]
    for depth in range(draft_len):
        x = scaled_logits(draft_logits[:, depth], temperature)  # [batch, vocab]
        ranked = _first_k(_descending_key(x, vocab_ids), top_k)  # [batch, k]
        top_ids[:, depth] = ranked
        top_log_probs[:, depth] = _log_softmax(x).gather(1, ranked)  # [batch, k]

    # Beam per depth: score, beam index of the parent, rank, and the padded rank tuple.
    scores = torch.full((batch_size, draft_len, beam), _NEG_INF, device=device)  # [b, depth, beam]
    shape = (batch_size, draft_len, beam)
    parent_slot = torch.zeros(shape, dtype=torch.int64, device=device)  # [batch, depth, beam]
    ranks = torch.zeros(shape, dtype=torch.int64, device=device)  # [batch, depth, beam]
    # Ranks stay below MAX_BUDGET = 1024, so int16 holds the tuples (a quarter of int64).
    tuples = torch.full(
        (batch_size, draft_len, beam, draft_len), -1, dtype=torch.int16, device=device
    )  # [batch, depth, beam, depth]
    scores[:, 0, :top_k] = top_log_probs[:, 0]
    ranks[:, 0, :top_k] = torch.arange(top_k, device=device)
    tuples[:, 0, :, 0] = ranks[:, 0].to(torch.int16)
    # Beam slots in lexicographic order of their rank tuples (slots past top_k hold -inf).
    lex_order = torch.arange(beam, device=device).expand(batch_size, -1)  # [batch, beam]
    for depth in range(1, draft_len):
        # Parents taken in lexicographic order make the flat child index (parent position
        # times K plus rank) the children's lexicographic key.
        parent_scores = scores[:, depth - 1].gather(1, lex_order)  # [batch, beam]
        child = parent_scores[:, :, None] + top_log_probs[:, depth, None, :]  # [b, beam, k]
        lex_index = torch.arange(beam * top_k, device=device)  # [beam*k]
        kept = _first_k(_descending_key(child.flatten(1), lex_index), beam)  # [batch, beam]
        scores[:, depth] = child.flatten(1).gather(1, kept)
        parent_slot[:, depth] = lex_order.gather(1, kept // top_k)
        ranks[:, depth] = kept % top_k
        parent_tuple = tuples[:, depth - 1].gather(
            1, parent_slot[:, depth, :, None].expand(-1, -1, draft_len)
        )  # [batch, beam, depth]
        tuples[:, depth] = parent_tuple
        tuples[:, depth, :, depth] = ranks[:, depth].to(torch.int16)
        lex_order = torch.argsort(kept, dim=1)  # [batch, beam]

    # Merge all depths: lexicographic positions by a chain of stable sorts (last column
    # first), then the total order (score descending, lexicographic position ascending).
    flat_tuples = tuples.flatten(1, 2)  # [batch, depth*beam, depth]
    lex = torch.arange(draft_len * beam, device=device).expand(batch_size, -1)  # [b, d*beam]
    for column in reversed(range(draft_len)):
        keys = flat_tuples[:, :, column].gather(1, lex)  # [batch, depth*beam]
        lex = lex.gather(1, torch.sort(keys, dim=1, stable=True).indices)  # [b, d*beam]
    lex_position = _inverse_permutation(lex)  # [batch, depth*beam]
    flat_scores = scores.flatten(1)  # [batch, depth*beam]
    order = torch.sort(_descending_key(flat_scores, lex_position), dim=1).indices  # [b, d*b]
    position = _inverse_permutation(order)  # [batch, depth*beam]: place in the merged order

    # Cut each request at its budget and at the first impossible prefix.
    picked = order[:, :beam]  # [batch, beam]
    picked_scores = flat_scores.gather(1, picked)  # [batch, beam]
    slot = torch.arange(beam, device=device)  # [beam]
    is_node = (
        (slot < budgets[:, None]) & torch.isfinite(picked_scores) & ~skip[:, None]
    )  # [b, beam]
    picked_depth = picked // beam  # [batch, beam], 0-based depth - 1
    picked_rank = ranks.flatten(1).gather(1, picked)  # [batch, beam]
    picked_tokens = top_ids.flatten(1).gather(1, picked_depth * top_k + picked_rank)  # [b, beam]
    parent_beam_slot = parent_slot.flatten(1).gather(1, picked)  # [batch, beam]
    parent_flat = (picked_depth - 1).clamp(min=0) * beam + parent_beam_slot  # [batch, beam]
    parent_node = torch.where(
        picked_depth == 0, 0, 1 + position.gather(1, parent_flat)
    )  # [batch, beam]

    tokens = torch.cat(
        [root_tokens[:, None], torch.where(is_node, picked_tokens, -1)], dim=1
    )  # [batch, nodes]
    parents = torch.cat(
        [torch.full_like(parent_node[:, :1], -1), torch.where(is_node, parent_node, -1)], dim=1
    ).to(torch.int32)  # [batch, nodes]
    depths = torch.cat(
        [torch.zeros_like(picked_depth[:, :1]), torch.where(is_node, picked_depth + 1, -1)], dim=1
    ).to(torch.int32)  # [batch, nodes]
    log_probs = torch.cat(
        [torch.zeros_like(picked_scores[:, :1]), torch.where(is_node, picked_scores, _NEG_INF)],
        dim=1,
    )  # [batch, nodes]
    num_nodes = (1 + is_node.sum(dim=1)).to(torch.int32)  # [batch]

    # Ancestor-or-self bits: walk every node up to the root, one level per step.
    node_valid = torch.cat([torch.ones_like(is_node[:, :1]), is_node], dim=1)  # [batch, nodes]
    walker = torch.arange(num_nodes_max, device=device).expand(batch_size, -1)  # [batch, nodes]
    ancestors = torch.zeros(
        batch_size, num_nodes_max, num_nodes_max, dtype=torch.bool, device=device
    )  # [batch, nodes, nodes]
    for _ in range(draft_len + 1):
        ancestors.scatter_(2, walker[:, :, None], True)
        walker = parents.long().gather(1, walker).clamp(min=0)  # [batch, nodes]
    ancestors &= node_valid[:, :, None]
    tree = Tree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        log_probs=log_probs,
        num_nodes=num_nodes,
        mask=pack_mask(ancestors),  # [batch, nodes, words]
        draft_len=draft_len,
    )
    if out is None:
        return tree
    _write_if_clean(out, tree, TREE_FIELDS, skip)
    return out


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit integer hash ``lowbias32`` on uint32 values held in int64."""

    def mul(value: torch.Tensor, constant: int) -> torch.Tensor:
        # Split the constant so no int64 product overflows; the result is exact mod 2**32.
        low = value * (constant & 0xFFFF)  # [...]
        high = ((value * (constant >> 16)) & 0xFFFF) << 16  # [...]
        return (low + high) & _UINT32  # [...]

    x = x ^ (x >> 16)  # [...]
    x = mul(x, 0x7FEB352D)  # [...]
    x = x ^ (x >> 15)  # [...]
    x = mul(x, 0x846CA68B)  # [...]
    return x ^ (x >> 16)  # [...]


def sampling_noise(
    seed: torch.Tensor, requests: torch.Tensor, nodes: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Gumbel noise of ``accept``'s sampling for one node of each listed request.

    With ``M = 2**32 - 1`` and ``mix32`` the ``lowbias32`` hash on uint32
    (``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16``, products
    mod ``2**32``): ``k = mix32(mix32(mix32(mix32(seed & M) ^ (seed >> 32)) ^ b) ^ i)`` for
    request ``b`` and node ``i``; per token ``v``: ``h = mix32(k ^ v)``,
    ``u = ((h >> 9) + 0.5) * 2**-23`` (exact in fp32, inside ``(0, 1)``) and
    ``g = -log(-log(u))`` in fp32.

    Parameters
    ----------
    seed : torch.Tensor
        Shape ``(1,)``, int64 in ``[0, 2**62)``.
    requests : torch.Tensor
        Shape ``(rows,)``, int64 request indices ``b``.
    nodes : torch.Tensor
        Shape ``(rows,)``, int64 node indices ``i``.
    vocab_size : int
        Tokens per row.

    Returns
    -------
    torch.Tensor
        Shape ``(rows, vocab_size)``, fp32.
    """
    key = _mix32(_mix32(seed & _UINT32) ^ (seed >> 32))  # [1]
    key = _mix32(_mix32(key ^ requests) ^ nodes)  # [rows]
    tokens = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)  # [vocab]
    hashed = _mix32(key[:, None] ^ tokens)  # [rows, vocab]
    uniform = ((hashed >> 9).float() + 0.5) * 2.0**-23  # [rows, vocab]
    return -torch.log(-torch.log(uniform))  # [rows, vocab]


def accept(
    tree: Tree,
    target_tokens: torch.Tensor | None = None,
    *,
    target_logits: torch.Tensor | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    error_flags: torch.Tensor | None = None,
    out: Acceptance | None = None,
) -> Acceptance:
    """Reference ``accept`` (see ``ddtree.kernels.accept`` for the contract).

    The target's token at a visited node ``i`` of request ``b``:

    * ``target_tokens[b, i]`` if given;
    * greedy from logits: ``argmax(scaled_logits(target_logits[b, i], 1))``, equal values
      smaller token id first (an all ``-inf`` row gives token 0);
    * sampling (``temperature > 0``): one seed ``torch.randint(0, 2**62, (1,),
      generator=generator, device=tree.device)`` per call, then
      ``argmax(scaled_logits(target_logits[b, i], temperature) + sampling_noise(...))`` in
      fp32, equal values smaller token id first: the Gumbel-max trick, an exact sample of
      ``softmax(target_logits / temperature)``.

    The walk moves to the lowest-numbered child ``c < num_nodes`` with ``tokens[c]`` equal to
    the target's token and stops when there is none. Requests skipped for a malformed tree or a
    negative target token at a node ``< num_nodes`` get ``length`` 0, bonus ``-1`` and ``-1``
    paths. With ``out``, the acceptance is computed apart and copied into ``out`` only when no
    request of the batch is skipped.
    """
    checks.check_accept_args(
        tree,
        target_tokens,
        target_logits=target_logits,
        temperature=temperature,
        generator=generator,
        error_flags=error_flags,
        out=out,
    )
    batch_size, num_nodes_max = tree.batch_size, tree.num_nodes_max
    device = tree.device
    flags = checks.tree_flags(tree)  # [batch]
    if target_tokens is not None:
        flags = flags | checks.target_token_flags(tree, target_tokens)  # [batch]
    skip = checks.resolve_flags(flags, error_flags, checks.FLAG_MESSAGES["accept"])  # [batch]
    seed = None
    if temperature > 0:
        seed = torch.randint(
            0, 2**62, (1,), generator=generator, device=device, dtype=torch.int64
        )  # [1]

    requests = torch.arange(batch_size, device=device)  # [batch]
    node_ids = torch.arange(num_nodes_max, device=device)  # [nodes]
    in_tree = (node_ids >= 1) & (node_ids < tree.num_nodes.long()[:, None])  # [batch, nodes]
    path_len = tree.draft_len + 1
    path_nodes = torch.full((batch_size, path_len), -1, device=device)  # [batch, path]
    path_tokens = torch.full((batch_size, path_len), -1, device=device)  # [batch, path]
    length = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [batch]
    bonus = torch.full((batch_size,), -1, dtype=torch.int64, device=device)  # [batch]
    current = torch.zeros(batch_size, dtype=torch.int64, device=device)  # [batch]
    walking = ~skip  # [batch]
    for step in range(path_len):
        path_nodes[:, step] = torch.where(walking, current, path_nodes[:, step])
        node_tokens = tree.tokens.gather(1, current[:, None]).squeeze(1)  # [batch]
        path_tokens[:, step] = torch.where(walking, node_tokens, path_tokens[:, step])
        length += walking.long()
        if target_tokens is not None:
            chosen = target_tokens.gather(1, current[:, None]).squeeze(1)  # [batch]
        else:
            assert target_logits is not None  # checked: exactly one target is given
            rows = target_logits[requests, current]  # [batch, vocab]
            if seed is None:
                chosen = scaled_logits(rows, 1.0).argmax(dim=1)  # [batch]
            else:
                noise = sampling_noise(seed, requests, current, rows.shape[1])  # [batch, vocab]
                chosen = (scaled_logits(rows, temperature) + noise).argmax(dim=1)  # [batch]
        is_child = (
            in_tree & (tree.parents.long() == current[:, None]) & (tree.tokens == chosen[:, None])
        )  # [batch, nodes]
        has_child = is_child.any(dim=1)  # [batch]
        bonus = torch.where(walking & ~has_child, chosen, bonus)  # [batch]
        walking = walking & has_child  # [batch]
        current = torch.where(walking, is_child.long().argmax(dim=1), current)  # [batch]
    acceptance = Acceptance(
        nodes=path_nodes.to(torch.int32),  # [batch, path]
        tokens=path_tokens,  # [batch, path]
        length=length.to(torch.int32),  # [batch]
        bonus=bonus,  # [batch]
    )
    if out is None:
        return acceptance
    _write_if_clean(out, acceptance, ACCEPTANCE_FIELDS, skip)
    return out


def _write_if_clean(
    out: Tree | Acceptance, result: Tree | Acceptance, names: tuple[str, ...], skip: torch.Tensor
) -> None:
    """Copy the fields ``names`` of ``result`` into ``out``, all or nothing: a flagged request
    anywhere in ``skip`` (``[batch]`` bool) leaves every destination untouched."""
    clean = ~skip.any()  # [] bool
    for name in names:
        destination = getattr(out, name)
        destination.copy_(torch.where(clean, getattr(result, name), destination))


def commit_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    acceptance: Acceptance,
    *,
    error_flags: torch.Tensor | None = None,
    all_or_nothing: bool = False,
) -> None:
    """Reference ``commit_kv`` (see ``ddtree.kernels.commit_kv`` for the contract).

    Gathers every accepted source latent of every non-skipped request first, then scatters them
    to their destinations, so overlapping moves are safe. Flags are computed by
    ``checks.commit_kv_flags``; with ``all_or_nothing`` one skipped request skips them all.
    """
    checks.check_commit_kv_args(
        kv_cache, block_table, prefix_lens, acceptance, error_flags=error_flags
    )
    num_pages, page_size, _ = kv_cache.shape
    flags = checks.commit_kv_flags(block_table, prefix_lens, acceptance, num_pages, page_size)
    # flags: [batch]
    skip = checks.resolve_flags(flags, error_flags, checks.FLAG_MESSAGES["commit_kv"])  # [batch]
    if all_or_nothing:
        skip = skip | skip.any()  # [batch]
    path_len = acceptance.nodes.shape[1]
    slot = torch.arange(path_len, device=kv_cache.device)  # [path]
    moves = ~skip[:, None] & (slot < acceptance.length.long()[:, None])  # [batch, path]
    request, step = torch.nonzero(moves, as_tuple=True)  # [moves], [moves]
    prefix = prefix_lens.long()[request]  # [moves]
    source = prefix + acceptance.nodes.long()[request, step]  # [moves]
    dest = prefix + step  # [moves]
    table = block_table.long()  # [batch, max_pages]
    source_page = table[request, source // page_size]  # [moves]
    values = kv_cache[source_page, source % page_size].clone()  # [moves, head_dim]
    kv_cache[table[request, dest // page_size], dest % page_size] = values  # [moves, head_dim]


def verify_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree: Tree,
    *,
    v_dim: int = 512,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    error_flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference ``verify_attention`` (see ``ddtree.kernels.verify_attention``).

    fp32 math: scores ``q . k * sm_scale`` over the visible positions, ``lse`` their natural
    log-sum-exp, ``out = softmax @ v`` rounded to ``q.dtype``. A row with no visible position
    (padding nodes, or a node whose mask row is empty with ``prefix_len`` 0) gets ``out = 0``
    and ``lse = -inf``. Outputs allocated here start as ``0`` / ``-inf``, which is what skipped
    requests (``checks.attention_flags``) keep.
    """
    sm_scale = checks.check_verify_attention_args(
        q,
        kv_cache,
        block_table,
        prefix_lens,
        tree,
        v_dim=v_dim,
        sm_scale=sm_scale,
        out=out,
        lse=lse,
        error_flags=error_flags,
    )
    batch_size, num_nodes_max, num_heads, _ = q.shape
    num_pages, page_size, _ = kv_cache.shape
    device = q.device
    flags = checks.attention_flags(block_table, prefix_lens, tree, num_pages, page_size)  # [b]
    messages = checks.FLAG_MESSAGES["verify_attention"]
    skip = checks.resolve_flags(flags, error_flags, messages)  # [batch]
    if out is None:
        out = torch.zeros(batch_size, num_nodes_max, num_heads, v_dim, dtype=q.dtype, device=device)
        # out: [batch, nodes, heads, v_dim]
    if lse is None:
        lse = torch.full((batch_size, num_nodes_max, num_heads), _NEG_INF, device=device)
        # lse: [batch, nodes, heads]
    keep = ~skip  # [batch]
    prefix = torch.where(keep, prefix_lens.long(), 0)  # [batch]
    num_nodes = torch.where(keep, tree.num_nodes.long(), 1).clamp(1, num_nodes_max)  # [batch]
    capacity = block_table.shape[1] * page_size
    span = min(capacity, int((prefix + num_nodes).max()))  # longest touched range
    position = torch.arange(span, device=device)  # [span]
    pages = block_table.long()[:, position // page_size].clamp(0, num_pages - 1)  # [batch, span]
    keys = kv_cache[pages, position % page_size].float()  # [batch, span, head_dim]
    in_range = position[None, :] < (prefix + num_nodes)[:, None]  # [batch, span]
    keys = torch.where(in_range[..., None], keys, 0.0)  # rows past a request's range: unread

    tree_slot = position[None, :] - prefix[:, None]  # [batch, span]
    in_tree = (tree_slot >= 0) & (tree_slot < num_nodes[:, None])  # [batch, span]
    bits = unpack_mask(tree.mask, num_nodes_max)  # [batch, nodes, nodes]
    tree_visible = bits.gather(
        2, tree_slot.clamp(0, num_nodes_max - 1)[:, None, :].expand(-1, num_nodes_max, -1)
    )  # [batch, nodes, span]
    visible = (position[None, :] < prefix[:, None])[:, None, :] | (
        tree_visible & in_tree[:, None, :]
    )  # [batch, nodes, span]
    node_valid = torch.arange(num_nodes_max, device=device) < num_nodes[:, None]  # [b, nodes]
    visible &= node_valid[:, :, None]

    scores = torch.einsum("bnhd,btd->bnht", q.float(), keys) * sm_scale  # [b, nodes, heads, span]
    scores = scores.masked_fill(~visible[:, :, None, :], _NEG_INF)  # [batch, nodes, heads, span]
    new_lse = torch.logsumexp(scores, dim=-1)  # [batch, nodes, heads]
    has_any = (new_lse != _NEG_INF)[..., None]  # [batch, nodes, heads, 1]; NaN counts as some
    probs = torch.where(has_any, torch.exp(scores - new_lse[..., None]), 0.0)  # [b, n, h, span]
    new_out = torch.einsum("bnht,btv->bnhv", probs, keys[..., :v_dim])  # [b, nodes, heads, v_dim]
    new_out = torch.where(has_any, new_out, 0.0)  # rows that see nothing: 0 whatever the cache
    out[keep] = new_out[keep].to(out.dtype)
    lse[keep] = new_lse[keep]
    return out, lse
