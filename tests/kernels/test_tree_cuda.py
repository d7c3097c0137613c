"""CUDA build_tree, accept and commit_kv against the reference, on fresh random inputs (GPU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from helpers.assertions import assert_close, assert_equal, assert_same_acceptance, assert_same_tree
from helpers.generators import (
    POISON,
    draft_logits,
    is_poisoned,
    paged_cache,
    poison,
    poison_rows,
    poisoned_acceptance,
    poisoned_tree,
    random_budgets,
    random_tree,
    target_tokens_for,
)
from helpers.invariants import assert_acceptance_valid, assert_tree_valid, has_near_ties
from helpers.oracles import first_depths_suffice

from ddtree.kernels import ErrorFlag, reference, tree_cuda
from ddtree.kernels.types import Acceptance, Tree

pytestmark = pytest.mark.gpu

_R = TypeVar("_R")
_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _poison_allocator() -> None:
    """Fill freed device memory with garbage so outputs the op forgets to write are caught."""
    junk = torch.empty(64 << 20, dtype=torch.uint8, device="cuda").fill_(0x7F)
    del junk


def _tree_to(tree: Tree, device: str) -> Tree:
    fields = {
        f.name: getattr(tree, f.name).to(device)
        for f in dataclasses.fields(tree)
        if isinstance(getattr(tree, f.name), torch.Tensor)
    }
    return dataclasses.replace(tree, **fields)


def _capture(step: Callable[[], _R]) -> tuple[torch.cuda.CUDAGraph, _R]:
    """Run ``step`` once (compile and warm up outside the capture), then capture it into a
    CUDA graph on a side stream; returns the graph and what the captured ``step`` returned."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        result = step()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, result


def _assert_same_tree(actual: Tree, expected: Tree, *, exact_order: bool) -> None:
    assert_equal(actual.num_nodes, expected.num_nodes, "num_nodes")
    if exact_order and not has_near_ties(expected):
        assert_same_tree(actual, expected, log_prob_atol=1e-4)
        return
    # Score ties across depths may be broken differently: still a valid tree of the same
    # (maximal) total probability, node by node in the sorted score sequence.
    assert_tree_valid(_tree_to(actual, "cpu"))
    got = actual.log_probs.sort(dim=1, descending=True).values
    want = expected.log_probs.sort(dim=1, descending=True).values
    assert_close(got, want, atol=1e-5, rtol=1e-5, name="sorted log_probs")


_BUILD_CASES = [
    # batch, draft_len, vocab, budget, dtype, style
    (1, 1, 8, 1, "f32", "random"),
    (3, 4, 17, 7, "bf16", "random"),
    (2, 16, 32000, 64, "bf16", "random"),
    (5, 15, 1000, 65, "f16", "random"),
    (64, 4, 4096, 64, "f32", "random"),
    (4, 32, 5000, 512, "bf16", "random"),
    (2, 8, 163840, 1024, "bf16", "random"),
    (8, 16, 163840, 64, "bf16", "random"),
    # Rows that fill one wave of four-warp top-k blocks and two of eight-warp ones (the H200's
    # plan at budgets up to 16, tree_cuda._four_warps_faster).
    (32, 16, 163840, 16, "bf16", "random"),
    (20, 16, 163840, 9, "f16", "random"),
    # Rows that their top-k blocks order by the warps' ranks (tree_cuda's merge_ranks, at most
    # 128 candidates a warp), and in the same build rows of one warp's 300 that take the sort.
    (32, 16, 163840, 256, "bf16", "random"),
    (3, 5, 300, 1024, "f32", "random"),
    (3, 5, 100, 1024, "f32", "random"),
    # Budgets at which one eight-warp block fits an SM (bf16 top_k 510-572 on the H200):
    # four-warp blocks, three per SM, expanding hits late; and fewer rows, unsplit.
    (16, 16, 163840, 540, "bf16", "random"),
    (6, 16, 163840, 520, "f16", "random"),
    # Two waves of top-k blocks that merge their rows: the select starts on the first depths
    # (tree_cuda's early_depths), which suffice on random rows and not on peaked ones.
    (32, 16, 163840, 64, "bf16", "random"),
    (24, 16, 163840, 96, "f16", "peaked"),
    (4, 6, 2000, 65, "f32", "ties"),
    (4, 6, 2000, 65, "f32", "flat"),
    (4, 6, 2000, 65, "bf16", "peaked"),
    (3, 7, 1001, 7, "f16", "ties"),
]


@pytest.mark.parametrize("budget", [64, 1024])  # eight- and four-warp blocks at batch 32
def test_the_plan_fits_as_many_topk_blocks_per_sm_as_the_driver(budget: int) -> None:
    """``tree_cuda._blocks_fitting``, by which the plan chooses warps, chunks and late hit
    expansion, gives the driver's occupancy of the compiled top-k kernel at every dynamic shared
    memory size (16-byte steps) where shared memory, not registers, sets it."""
    plan = tree_cuda.device_build_tree_plan(32, 16, 163840, budget, 2, 0)
    kernel = tree_cuda._build_kernel("ddtree_build_topk", 1, tuple(plan.defines.items()), 0)
    occupancy = kernel.occupancy.max_active_blocks_per_multiprocessor
    max_smem = tree_cuda.max_dynamic_smem(0)
    checked = 0
    for smem in range(0, max_smem + 1, 16):
        model = tree_cuda._blocks_fitting(smem, plan.warps, max_smem)
        if model <= plan.min_blocks:
            assert occupancy(plan.warps * 32, smem) == model, smem
            checked += 1
    assert checked > 1000


@pytest.mark.parametrize("peak", [1e3, 3e5, 1e20, 1e38])
def test_build_tree_large_logits_give_no_positive_log_prob(peak: float) -> None:
    """Rows whose largest logit is huge: each step's log-prob stays <= 0 and the tree matches the
    reference (exp(x - max) must not inherit the rounding error of max * log2(e): at 1e3 that
    once gave the top token +3e-5, at 1e38 +inf)."""
    logits = draft_logits(3, 4, 3000, seed=11)
    logits[:, :, 7] = peak
    logits[:, 1:, 8] = peak - 2.0  # a runner-up where fp32 still tells them apart (1e3, 3e5)
    logits = logits.cuda()
    roots = torch.arange(3, device="cuda")
    expected = reference.build_tree(logits, roots, 9)
    _poison_allocator()
    actual = tree_cuda.build_tree(logits, roots, 9)
    assert_tree_valid(_tree_to(actual, "cpu"), 3000)  # root 0 and no child above its parent
    _assert_same_tree(actual, expected, exact_order=True)


@pytest.mark.parametrize(
    ("batch_size", "draft_len", "vocab_size", "budget", "dtype", "style"),
    _BUILD_CASES,
    ids=[f"B{c[0]}-L{c[1]}-V{c[2]}-b{c[3]}-{c[4]}-{c[5]}" for c in _BUILD_CASES],
)
def test_build_tree_matches_reference(
    batch_size: int, draft_len: int, vocab_size: int, budget: int, dtype: str, style: str
) -> None:
    logits = draft_logits(
        batch_size,
        draft_len,
        vocab_size,
        style=style,
        dtype=_DTYPES[dtype],
        seed=budget,
        device="cuda",
    )
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    temperature = 0.7 if style == "random" else 1.0
    expected = reference.build_tree(logits, roots, budget, temperature=temperature)
    _poison_allocator()
    actual = tree_cuda.build_tree(logits, roots, budget, temperature=temperature)
    _assert_same_tree(actual, expected, exact_order=style == "random")
    if style == "random":
        assert_tree_valid(_tree_to(actual, "cpu"), vocab_size)


@pytest.mark.parametrize("order", ["ascending", "descending", "frequency-prior"])
@pytest.mark.parametrize("batch_size", [2, 32])
def test_build_tree_rows_whose_token_ids_order_their_values(order: str, batch_size: int) -> None:
    """Rows whose large logits sit at some token ids, as real vocabularies' do: the top-k's
    warps meet them at different times, and a row sorted ascending makes most vectors hits,
    with buffer shrinks all along. The tree is still the reference's."""
    vocab_size = 163840
    logits = draft_logits(batch_size, 4, vocab_size, seed=21 + batch_size, device="cuda")
    if order == "ascending":
        logits = logits.sort(-1).values
    elif order == "descending":
        logits = logits.sort(-1, descending=True).values
    else:
        ids = torch.arange(vocab_size, device="cuda", dtype=torch.float32)
        logits = logits - 0.5 * torch.log1p(ids)
    logits = logits.to(torch.bfloat16)
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    expected = reference.build_tree(logits, roots, 64)
    _poison_allocator()
    actual = tree_cuda.build_tree(logits, roots, 64)
    _assert_same_tree(actual, expected, exact_order=True)
    assert_tree_valid(_tree_to(actual, "cpu"), vocab_size)


def _styled_bf16_logits(
    batch_size: int, draft_len: int, vocab_size: int, style: str, seed: int
) -> torch.Tensor:
    """bf16 draft logits on the GPU in a ``draft_logits`` style, or ``non-finite``: random ones
    with non-finite rows."""
    logits = draft_logits(
        batch_size,
        draft_len,
        vocab_size,
        style="random" if style == "non-finite" else style,
        dtype=torch.bfloat16,
        seed=seed,
    )
    if style == "non-finite":
        logits = poison_rows(logits, seed=seed + 1)
    return logits.cuda()


def _not_early(plan: tree_cuda.BuildTreePlan) -> dict[str, object]:
    """The fields that make ``plan``'s select wait for the whole top-k launch (and take its
    usual 512 threads) instead of starting on the first depths."""
    select = dataclasses.replace(plan.select, block=(512, 1, 1))
    return {"early_depths": 0, "select": select}


def _build_with_plan(
    monkeypatch: pytest.MonkeyPatch, change: dict[str, object], *args: object, **kwargs: object
) -> Tree:
    """``tree_cuda.build_tree(*args, **kwargs)`` with the fields ``change`` of the device's plan
    replaced, after poisoning the allocator."""
    planned = tree_cuda.device_build_tree_plan
    with monkeypatch.context() as patch:
        patch.setattr(
            tree_cuda,
            "device_build_tree_plan",
            lambda *plan_args: dataclasses.replace(planned(*plan_args), **change),
        )
        _poison_allocator()
        return tree_cuda.build_tree(*args, **kwargs)


@pytest.mark.parametrize("style", ["random", "ties", "flat", "peaked", "non-finite"])
def test_build_tree_merge_in_the_topk_blocks_matches_the_merge_launch(
    style: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one top-k block per row each block merges its own row; the trees must be bit for
    bit those of the separate merge launch on the same logits (every ordering path: few
    candidates ranked, all sorted, radix-selected past 2 * sort_size on flat rows)."""
    batch_size, draft_len, vocab_size = 40, 8, 6000  # 320 rows: one block per row
    logits = _styled_bf16_logits(batch_size, draft_len, vocab_size, style, seed=17)
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    planned = tree_cuda.device_build_tree_plan
    for budget in (1, 64, 400):
        plan = planned(batch_size, draft_len, vocab_size, budget, 2, 0)
        assert plan.merge_here
        _poison_allocator()
        here = tree_cuda.build_tree(logits, roots, budget, temperature=0.9)
        change = {"merge_here": False, **_not_early(plan)}
        launched = _build_with_plan(monkeypatch, change, logits, roots, budget, temperature=0.9)
        assert_same_tree(here, launched)


@pytest.mark.parametrize("style", ["random", "ties", "flat", "peaked", "non-finite"])
@pytest.mark.parametrize("vocab_size", [8, 3000])
def test_build_tree_wide_select_matches_the_serial_select(
    style: str, vocab_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Budgets above 96 take the wide select (every node above a rising threshold, level by
    level); its trees must be bit for bit those of the serial pops, at ragged budgets 0..1024,
    with the plan's store, with the smallest one (2 * max_budget nodes: more compactions and
    raises; flat rows over 8 tokens tie wider than it holds and fall back to the serial pops)
    and for every budget from 1 (the register path's budgets too)."""
    batch_size, draft_len, max_budget = 12, 16, 1024
    logits = _styled_bf16_logits(batch_size, draft_len, vocab_size, style, seed=23)
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    budgets = torch.tensor([0, 1, 64, 96, 97, 128, 255, 256, 511, 700, 1023, 1024], device="cuda")
    planned = tree_cuda.device_build_tree_plan
    assert planned(batch_size, draft_len, vocab_size, max_budget, 2, 0).wide_cap > 0

    def build(**change: int) -> Tree:
        return _build_with_plan(
            monkeypatch,
            dict(change),
            logits,
            roots,
            budgets,
            temperature=0.9,
            max_budget=max_budget,
        )

    serial = build(wide_cap=0)
    assert_same_tree(build(), serial)
    assert_same_tree(build(wide_cap=2 * max_budget), serial)
    assert_same_tree(build(wide_min_budget=1), serial)


@pytest.mark.parametrize("style", ["random", "ties", "flat", "peaked", "non-finite"])
@pytest.mark.parametrize(("vocab_size", "draft_len"), [(8, 32), (3000, 16), (40000, 5)])
def test_build_tree_bulk_select_matches_the_serial_select(
    style: str, vocab_size: int, draft_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Budgets up to 96 pop from registers until round bulk_after + 1, where the bulk select may
    take the rest at once (not on peaked rows: their deep trees stay with the register pops);
    its trees must be bit for bit those of the register pops alone (bulk_after -1) when it takes
    over at once (the plan's 0, for batches of 4 and more), after some rounds (4) and late (16),
    at ragged budgets 0..96 (flat rows over 8 tokens tie wider than its store, and the register
    pops go on)."""
    batch_size = 12
    logits = _styled_bf16_logits(batch_size, draft_len, vocab_size, style, seed=29)
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    budgets = torch.tensor([0, 1, 2, 7, 31, 32, 33, 63, 64, 65, 95, 96], device="cuda")

    def build(bulk_after: int) -> Tree:
        change = {"bulk_after": bulk_after}
        return _build_with_plan(
            monkeypatch, change, logits, roots, budgets, temperature=0.9, max_budget=96
        )

    serial = build(-1)
    for bulk_after in (0, 4, 16):
        assert_same_tree(build(bulk_after), serial)


@pytest.mark.parametrize("style", ["random", "ties", "flat", "peaked", "non-finite"])
def test_build_tree_early_select_matches_the_select_after_the_top_k(
    style: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An early plan's top-k takes the rows depth by depth and flags those of the first
    ``early_depths`` depths; its select starts on them and pops over every depth only when the
    tree may reach deeper. Its trees must be bit for bit those of the select after the whole
    top-k launch, at ragged budgets 0..96, with 1 to draft_len early depths: where the first
    depths suffice (shallow trees) and where they do not (peaked rows: deep chains)."""
    batch_size, draft_len, vocab_size = 12, 16, 3000
    logits = _styled_bf16_logits(batch_size, draft_len, vocab_size, style, seed=37)
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    budgets = torch.tensor([0, 1, 2, 7, 31, 32, 33, 63, 64, 65, 95, 96], device="cuda")
    plan = tree_cuda.device_build_tree_plan(batch_size, draft_len, vocab_size, 96, 2, 0)
    assert plan.merge_here and plan.wide_cap == 0

    def build(change: dict[str, object]) -> Tree:
        return _build_with_plan(
            monkeypatch, change, logits, roots, budgets, temperature=0.9, max_budget=96
        )

    after = build(_not_early(plan))
    early_select = dataclasses.replace(plan.select, block=(128, 1, 1))
    for early_depths in (1, 2, 4, draft_len):
        assert_same_tree(build({"early_depths": early_depths, "select": early_select}), after)
    # Both ways are taken at four early depths (budgets of 31 and more), by the select's own
    # test (the oracle's, on the CPU).
    rows = logits.cpu()
    keeps = [
        first_depths_suffice(rows[b], 0.9, 4, budget)
        for b, budget in enumerate(budgets.tolist())
        if budget >= 31
    ]
    if style == "random":
        assert any(keeps)
    if style == "peaked":
        assert not any(keeps)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("vocab_size", [64, 3000, 20000])
def test_build_tree_non_finite_rows(vocab_size: int, dtype: str) -> None:
    """Rows of NaN, infinities, subnormals and signed zeros. For 16-bit logits the top-k takes
    a step's maxima from the raw packed pairs (max.bf16x2 / max.f16x2), which must read every
    such value as fmaxf over the widened entries would."""
    logits = poison_rows(draft_logits(6, 5, vocab_size, seed=3), seed=4)
    tiny = torch.finfo(_DTYPES[dtype]).smallest_normal / 4  # subnormal in the logits' dtype
    gen = torch.Generator().manual_seed(vocab_size)
    values = torch.tensor([0.0, -0.0, tiny, -tiny, 3 * tiny])
    # A row of nothing but subnormals and zeros, and a row with a tenth of its entries so.
    logits[5, 4] = values[torch.randint(0, 5, (vocab_size,), generator=gen)]
    some = torch.randperm(vocab_size, generator=gen)[: max(1, vocab_size // 10)]
    logits[4, 0, some] = values[torch.randint(0, 5, (some.numel(),), generator=gen)]
    logits = logits.to(_DTYPES[dtype]).cuda()
    roots = torch.arange(6, device="cuda")
    expected = reference.build_tree(logits, roots, 64)
    _poison_allocator()
    actual = tree_cuda.build_tree(logits, roots, 64)
    _assert_same_tree(actual, expected, exact_order=False)
    assert_equal(actual.num_nodes, expected.num_nodes, "num_nodes")


@pytest.mark.parametrize(
    ("possible", "budget", "dtype", "draft_len", "forced"),
    [
        (2, 1024, torch.float32, 12, 0),
        (3, 1024, torch.bfloat16, 12, 0),
        (2, 64, torch.float16, 12, 0),
        (4, 7, None, 12, 0),
        (2, 64, torch.bfloat16, 32, 20),
        (3, 96, torch.float32, 32, 19),
    ],
)
def test_build_tree_exact_ties_follow_rank_tuple_order(
    possible: int, budget: int, dtype: torch.dtype | None, draft_len: int, forced: int
) -> None:
    """Rows of ``possible`` equal logits (the rest ``-inf``), after ``forced`` depths of one
    possible token: every node of a depth has the same score, so the whole order comes from the
    rank-tuple tie-break, down to depths past the select kernel's packed tuples, where it walks
    parents: past 5 depths at budget 1024 (shared memory); past 18 at budgets 64 and 96 (the
    register select's two words), which only a chain of forced depths reaches."""
    batch_size, vocab_size = 3, 2048
    gen = torch.Generator().manual_seed(possible * budget)
    logits = torch.full((batch_size, draft_len, vocab_size), float("-inf"))
    for b in range(batch_size):
        for d in range(draft_len):
            picked = torch.randperm(vocab_size, generator=gen)[: 1 if d < forced else possible]
            logits[b, d, picked] = 1.5
    logits = logits.to(dtype or torch.float32).cuda()
    roots = torch.arange(batch_size, device="cuda")
    expected = reference.build_tree(logits, roots, budget)
    _poison_allocator()
    actual = tree_cuda.build_tree(logits, roots, budget)
    # Each implementation gives every possible token of a row the same log-prob, so the tie
    # structure (and with it every integer field) is the reference's even if log(possible)
    # differs in the last bit.
    assert_same_tree(actual, expected, log_prob_atol=1e-6)


def test_build_tree_ragged_and_padded_budgets() -> None:
    logits = draft_logits(7, 6, 3000, seed=5, dtype=torch.bfloat16, device="cuda")
    roots = torch.randint(0, 3000, (7,), device="cuda")
    budgets = random_budgets(7, 100, seed=6).cuda()
    expected = reference.build_tree(logits, roots, budgets, max_budget=130)
    actual = tree_cuda.build_tree(logits, roots, budgets, max_budget=130)
    _assert_same_tree(actual, expected, exact_order=True)
    padded = tree_cuda.build_tree(logits, roots, 40, max_budget=90)
    assert padded.num_nodes_max == 91
    _assert_same_tree(
        padded, reference.build_tree(logits, roots, 40, max_budget=90), exact_order=True
    )


def test_build_tree_bad_root_token_is_flagged_without_sync() -> None:
    logits = draft_logits(3, 4, 50, seed=7, device="cuda")
    roots = torch.tensor([1, 50, -2], device="cuda")
    flags = torch.zeros(3, dtype=torch.int32, device="cuda")
    expected_flags = flags.clone()
    expected = reference.build_tree(logits, roots, 9, error_flags=expected_flags)
    actual = tree_cuda.build_tree(logits, roots, 9, error_flags=flags)
    assert_equal(flags, expected_flags, "error_flags")
    assert flags.tolist() == [0, int(ErrorFlag.TOKEN), int(ErrorFlag.TOKEN)]
    _assert_same_tree(actual, expected, exact_order=True)
    with pytest.raises(ValueError, match="root_tokens"):
        tree_cuda.build_tree(logits, roots, 9)


@pytest.mark.parametrize(
    ("batch_size", "draft_len", "vocab_size", "budget"),
    [(1, 1, 8, 1), (3, 5, 1000, 7), (32, 16, 163840, 64), (2, 8, 163840, 1024), (64, 4, 4096, 65)],
    ids=["B1-b1", "B3-b7", "B32-b64", "B2-b1024", "B64-b65"],
)
def test_build_tree_out_matches_reference(
    batch_size: int, draft_len: int, vocab_size: int, budget: int
) -> None:
    logits = draft_logits(
        batch_size, draft_len, vocab_size, seed=budget, dtype=torch.bfloat16, device="cuda"
    )
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    expected = reference.build_tree(logits, roots, budget)
    out = poisoned_tree(batch_size, budget + 1, draft_len, device="cuda")
    flags = torch.zeros(batch_size, dtype=torch.int32, device="cuda")
    actual = tree_cuda.build_tree(logits, roots, budget, error_flags=flags, out=out)
    assert actual is out
    _assert_same_tree(out, expected, exact_order=True)
    assert not bool(flags.any())


@pytest.mark.parametrize("entry_flag", [False, True], ids=["bad-root", "flagged-on-entry"])
@pytest.mark.parametrize("batch_size", [2, 300])
def test_build_tree_out_is_untouched_when_any_request_is_flagged(
    entry_flag: bool, batch_size: int
) -> None:
    """All or nothing: one bad request of the batch (the last one, so the blocks of every other
    request finish their own work first) and nothing reaches ``out``; flags as the reference."""
    logits = draft_logits(batch_size, 3, 500, seed=8, device="cuda")
    roots = torch.randint(0, 500, (batch_size,), device="cuda")
    flags = torch.zeros(batch_size, dtype=torch.int32, device="cuda")
    if entry_flag:
        flags[-1] = int(ErrorFlag.LENGTH)
    else:
        roots[-1] = 500
    want_flags = flags.clone()
    reference.build_tree(logits, roots, 9, error_flags=want_flags)
    out = poisoned_tree(batch_size, 10, 3, device="cuda")
    tree_cuda.build_tree(logits, roots, 9, error_flags=flags, out=out)
    assert_equal(flags, want_flags, "error_flags")
    assert is_poisoned(out)
    flags.zero_()
    roots[-1] = 0
    tree_cuda.build_tree(logits, roots, 9, error_flags=flags, out=out)  # clean: written
    _assert_same_tree(out, reference.build_tree(logits, roots, 9), exact_order=True)


@pytest.mark.parametrize("batch_size", [8, 32])  # a merge launch; an early select
def test_build_tree_out_is_captured_in_a_cuda_graph(batch_size: int) -> None:
    """The server replays a captured build into caller memory: new logits, same buffers."""
    draft_len, vocab_size, budget = 16, 163840, 64
    logits = draft_logits(
        batch_size, draft_len, vocab_size, seed=31, dtype=torch.bfloat16, device="cuda"
    )
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    flags = torch.zeros(batch_size, dtype=torch.int32, device="cuda")
    out = poisoned_tree(batch_size, budget + 1, draft_len, device="cuda")
    graph, _ = _capture(
        lambda: tree_cuda.build_tree(logits, roots, budget, error_flags=flags, out=out)
    )
    for seed in (32, 33):
        logits.copy_(
            draft_logits(batch_size, draft_len, vocab_size, seed=seed, dtype=torch.bfloat16)
        )
        out.tokens.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_tree(out, reference.build_tree(logits, roots, budget), exact_order=True)
    roots[3] = -1
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert is_poisoned(out)
    assert flags.tolist() == [int(ErrorFlag.TOKEN) if b == 3 else 0 for b in range(batch_size)]


@pytest.mark.parametrize("shape", ["chain", "star", "random", "mixed"])
@pytest.mark.parametrize(
    ("batch_size", "num_nodes_max", "draft_len"), [(1, 2, 1), (9, 65, 16), (3, 1025, 32)]
)
def test_accept_tokens_matches_reference(
    shape: str, batch_size: int, num_nodes_max: int, draft_len: int
) -> None:
    tree = random_tree(batch_size, num_nodes_max, draft_len, 50, shape=shape, seed=num_nodes_max)
    targets = target_tokens_for(tree, 50, seed=1)
    tree, targets = _tree_to(tree, "cuda"), targets.cuda()
    expected = reference.accept(tree, targets)
    _poison_allocator()
    actual = tree_cuda.accept(tree, targets)
    assert_same_acceptance(actual, expected)
    assert_acceptance_valid(_acc_to(actual, "cpu"), _tree_to(tree, "cpu"))


def _acc_to(acc: Acceptance, device: str) -> Acceptance:
    return Acceptance(*(getattr(acc, f.name).to(device) for f in dataclasses.fields(acc)))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize(("dtype", "vocab_size"), [("f32", 300), ("bf16", 32000), ("f16", 1001)])
def test_accept_logits_matches_reference(temperature: float, dtype: str, vocab_size: int) -> None:
    logits = draft_logits(4, 6, vocab_size, seed=11, device="cuda")
    tree = reference.build_tree(logits, torch.arange(4, device="cuda"), 20)
    # Target logits that agree with the draft often enough for deep walks.
    gen = torch.Generator().manual_seed(12)
    target = torch.randn(4, tree.num_nodes_max, vocab_size, generator=gen).cuda()
    child_tok = torch.where(tree.parents >= 0, tree.tokens, 0)
    target[torch.arange(4)[:, None], tree.parents.clamp(min=0).long().cpu(), child_tok.cpu()] += 8
    target = poison_rows(target, seed=13).to(_DTYPES[dtype])
    expected = reference.accept(
        tree,
        target_logits=target,
        temperature=temperature,
        generator=torch.Generator("cuda").manual_seed(5),
    )
    _poison_allocator()
    actual = tree_cuda.accept(
        tree,
        target_logits=target,
        temperature=temperature,
        generator=torch.Generator("cuda").manual_seed(5),
    )
    assert_same_acceptance(actual, expected)


def test_accept_flags_malformed_trees() -> None:
    tree = _tree_to(random_tree(4, 17, 5, 30, shape="random", seed=2), "cuda")
    parents = tree.parents.clone()
    num_nodes = tree.num_nodes.clone()
    parents[1, 1] = 5  # parent after the node
    num_nodes[2] = 99  # more nodes than slots
    bad = dataclasses.replace(tree, parents=parents, num_nodes=num_nodes)
    targets = target_tokens_for(_tree_to(tree, "cpu"), 30, seed=3).cuda()
    targets[3, 0] = -4
    want_flags = torch.zeros(4, dtype=torch.int32, device="cuda")
    expected = reference.accept(bad, targets, error_flags=want_flags)
    flags = torch.zeros(4, dtype=torch.int32, device="cuda")
    actual = tree_cuda.accept(bad, targets, error_flags=flags)
    assert_equal(flags, want_flags, "error_flags")
    assert_same_acceptance(actual, expected)
    with pytest.raises(ValueError, match="tree"):
        tree_cuda.accept(bad, targets)


def _commit_case(page_size: int, head_dim: int, seed: int):
    tree = _tree_to(random_tree(5, 33, 8, 40, shape="mixed", seed=seed), "cuda")
    targets = target_tokens_for(_tree_to(tree, "cpu"), 40, follow=0.9, seed=seed).cuda()
    acceptance = reference.accept(tree, targets)
    prefix = torch.tensor([0, 5, 17, 1, 64], dtype=torch.int32)
    cache, table = paged_cache(prefix + 33, page_size, head_dim, seed=seed)
    return cache.cuda(), table.cuda(), prefix.cuda(), acceptance


@pytest.mark.parametrize(
    ("page_size", "head_dim"), [(1, 576), (16, 576), (64, 576), (256, 8), (7, 72)]
)
def test_commit_kv_matches_reference(page_size: int, head_dim: int) -> None:
    cache, table, prefix, acceptance = _commit_case(page_size, head_dim, seed=page_size)
    expected = cache.clone()
    reference.commit_kv(expected, table, prefix, acceptance)
    tree_cuda.commit_kv(cache, table, prefix, acceptance)
    assert_equal(cache, expected, "kv_cache")


def test_commit_kv_flags_bad_block_table_and_path() -> None:
    cache, table, prefix, acceptance = _commit_case(16, 576, seed=4)
    table[1, 0] = 10_000
    nodes = acceptance.nodes.clone()
    length = acceptance.length.clone()
    length[2] = 0
    bad = Acceptance(nodes=nodes, tokens=acceptance.tokens, length=length, bonus=acceptance.bonus)
    prefix = prefix.clone()
    prefix[3] = -1
    expected = cache.clone()
    want_flags = torch.zeros(5, dtype=torch.int32, device="cuda")
    reference.commit_kv(expected, table, prefix, bad, error_flags=want_flags)
    flags = torch.zeros(5, dtype=torch.int32, device="cuda")
    tree_cuda.commit_kv(cache, table, prefix, bad, error_flags=flags)
    assert_equal(flags, want_flags, "error_flags")
    assert_equal(cache, expected, "kv_cache")
    with pytest.raises(ValueError, match="block_table"):
        tree_cuda.commit_kv(cache, table, prefix, bad)


@pytest.mark.parametrize("mode", ["tokens", "greedy-logits", "sampled-logits"])
def test_accept_out_matches_reference(mode: str) -> None:
    tree = _tree_to(random_tree(9, 65, 16, 300, shape="mixed", seed=40), "cuda")
    targets = target_tokens_for(_tree_to(tree, "cpu"), 300, follow=0.8, seed=41).cuda()
    kwargs: dict = {"target_tokens": targets}
    if mode != "tokens":
        logits = torch.randn(9, 65, 300, generator=torch.Generator().manual_seed(42)).cuda()
        logits.scatter_add_(2, targets[..., None], torch.full_like(logits[..., :1], 6.0))
        kwargs = {"target_logits": logits, "temperature": 0.7 if mode == "sampled-logits" else 0.0}

    def run(implementation, out=None, flags=None):
        generator = torch.Generator("cuda").manual_seed(3)
        return implementation.accept(
            tree, generator=generator, error_flags=flags, out=out, **kwargs
        )

    expected = run(reference)
    out = poisoned_acceptance(9, 17, device="cuda")
    flags = torch.zeros(9, dtype=torch.int32, device="cuda")
    assert run(tree_cuda, out, flags) is out
    assert_same_acceptance(out, expected)
    assert not bool(flags.any())
    poison(out)
    assert run(tree_cuda, out) is out  # without error_flags: checked on the host, then written
    assert_same_acceptance(out, expected)
    assert int(expected.length.max()) > 1  # some walk left the root


@pytest.mark.parametrize("entry_flag", [False, True], ids=["bad-tree", "flagged-on-entry"])
@pytest.mark.parametrize("batch_size", [2, 300])
def test_accept_out_is_untouched_when_any_request_is_flagged(
    entry_flag: bool, batch_size: int
) -> None:
    tree = _tree_to(random_tree(batch_size, 17, 4, 40, shape="mixed", seed=43), "cuda")
    targets = target_tokens_for(_tree_to(tree, "cpu"), 40, follow=0.8, seed=44).cuda()
    flags = torch.zeros(batch_size, dtype=torch.int32, device="cuda")
    bad = tree
    if entry_flag:
        flags[-1] = int(ErrorFlag.LENGTH)
    else:
        num_nodes = tree.num_nodes.clone()
        num_nodes[-1] = 99  # more nodes than slots
        bad = dataclasses.replace(tree, num_nodes=num_nodes)
    want_flags = flags.clone()
    reference.accept(bad, targets, error_flags=want_flags)
    out = poisoned_acceptance(batch_size, 5, device="cuda")
    tree_cuda.accept(bad, targets, error_flags=flags, out=out)
    assert_equal(flags, want_flags, "error_flags")
    assert is_poisoned(out)
    flags.zero_()
    tree_cuda.accept(tree, targets, error_flags=flags, out=out)  # clean: written
    assert_same_acceptance(out, reference.accept(tree, targets))


@pytest.mark.parametrize("entry_flag", [False, True], ids=["bad-table", "flagged-by-accept"])
def test_commit_kv_all_or_nothing(entry_flag: bool) -> None:
    cache, table, prefix, acceptance = _commit_case(16, 576, seed=6)
    assert int(acceptance.length.max()) > 1
    flags = torch.zeros(5, dtype=torch.int32, device="cuda")
    if entry_flag:
        flags[4] = int(ErrorFlag.TOKEN)
    else:
        table[3, :] = 10_000  # every page of request 3 out of range
    want_flags = flags.clone()
    expected = cache.clone()
    reference.commit_kv(
        expected, table, prefix, acceptance, error_flags=want_flags, all_or_nothing=True
    )
    before = cache.clone()
    tree_cuda.commit_kv(cache, table, prefix, acceptance, error_flags=flags, all_or_nothing=True)
    assert_equal(flags, want_flags, "error_flags")
    assert_equal(cache, before, "kv_cache")
    assert_equal(expected, before, "reference kv_cache")
    clean_table = _commit_case(16, 576, seed=6)[1]
    flags.zero_()
    reference.commit_kv(expected, clean_table, prefix, acceptance)
    tree_cuda.commit_kv(
        cache, clean_table, prefix, acceptance, error_flags=flags, all_or_nothing=True
    )
    assert_equal(cache, expected, "kv_cache")
    assert not bool(flags.any())


def test_accept_out_and_gated_commit_are_captured_in_a_cuda_graph() -> None:
    """The server's AcceptTree into caller memory: accept into ``out`` and the commit after it,
    replayed with no host sync between them; a bad request anywhere leaves both untouched."""
    tree = _tree_to(random_tree(5, 33, 8, 40, shape="mixed", seed=45), "cuda")
    targets = target_tokens_for(_tree_to(tree, "cpu"), 40, follow=0.9, seed=46).cuda()
    prefix = torch.tensor([0, 5, 17, 1, 64], dtype=torch.int32, device="cuda")
    cache, table = paged_cache(prefix.cpu() + 33, 16, 576, seed=47)
    cache, table = cache.cuda(), table.cuda()
    flags = torch.zeros(5, dtype=torch.int32, device="cuda")
    out = poisoned_acceptance(5, 9, device="cuda")

    def step() -> None:
        tree_cuda.accept(tree, targets, error_flags=flags, out=out)
        tree_cuda.commit_kv(cache, table, prefix, out, error_flags=flags, all_or_nothing=True)

    original = cache.clone()
    graph, _ = _capture(step)
    cache.copy_(original)
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    expected = reference.accept(tree, targets)
    assert_same_acceptance(out, expected)
    want = original.clone()
    reference.commit_kv(want, table, prefix, expected)
    assert_equal(cache, want, "kv_cache after replay")
    cache.copy_(original)
    poison(out)
    targets[2, 0] = -1  # a bad request: nothing written, nothing moved
    graph.replay()
    torch.cuda.synchronize()
    assert is_poisoned(out)
    assert_equal(cache, original, "kv_cache")
    # The walk flags request 2; the commit, checking the paths the walk never wrote, may flag
    # malformed paths (ACCEPTANCE) but moves nothing.
    walk_bits = int(ErrorFlag.TREE | ErrorFlag.TOKEN)
    assert [v & walk_bits for v in flags.tolist()] == [0, 0, int(ErrorFlag.TOKEN), 0, 0]
    assert all(v & ~walk_bits in (0, int(ErrorFlag.ACCEPTANCE)) for v in flags.tolist())


def test_chain_is_captured_in_a_cuda_graph() -> None:
    batch_size, draft_len, vocab_size, budget = 4, 8, 32000, 64
    logits = draft_logits(
        batch_size, draft_len, vocab_size, seed=21, dtype=torch.bfloat16, device="cuda"
    )
    roots = torch.randint(0, vocab_size, (batch_size,), device="cuda")
    prefix = torch.tensor([3, 0, 100, 17], dtype=torch.int32, device="cuda")
    cache, table = paged_cache(prefix.cpu() + budget + 1, 16, 576, seed=22)
    cache, table = cache.cuda(), table.cuda()
    flags = torch.zeros(batch_size, dtype=torch.int32, device="cuda")

    def step() -> tuple[Tree, Acceptance]:
        tree = tree_cuda.build_tree(logits, roots, budget, error_flags=flags)
        # The target agrees with node 1's subtree: target token at node i = token of its
        # first child (computed on the device, no sync).
        first_child = torch.full_like(tree.tokens, 0)
        child = torch.arange(tree.num_nodes_max, device="cuda").expand(batch_size, -1)
        first_child.scatter_reduce_(
            1,
            tree.parents.clamp(min=0).long(),
            torch.where(tree.parents >= 0, child, 1 << 20),
            reduce="amin",
            include_self=False,
        )
        targets = tree.tokens.gather(1, first_child.clamp(max=tree.num_nodes_max - 1)).clamp(min=0)
        acc = tree_cuda.accept(tree, targets, error_flags=flags)
        tree_cuda.commit_kv(cache, table, prefix, acc, error_flags=flags)
        return tree, acc

    graph, (tree, acc) = _capture(step)
    before = cache.clone()
    graph.replay()
    torch.cuda.synchronize()
    reference.commit_kv(before, table, prefix, acc)
    assert_equal(cache, before, "kv_cache after replay")
    expected_tree = reference.build_tree(logits, roots, budget)
    _assert_same_tree(tree, expected_tree, exact_order=True)
    assert int(acc.length.min()) >= 2
    assert_equal(flags, torch.zeros_like(flags), "error_flags")
