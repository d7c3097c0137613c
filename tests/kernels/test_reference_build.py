"""``reference.build_tree`` against the paper's heap, brute force and the Tree invariants."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers.assertions import assert_equal, assert_same_tree
from helpers.generators import draft_logits, is_poisoned, poison_rows, poisoned_tree, random_budgets
from helpers.invariants import assert_tree_valid
from helpers.oracles import brute_force_tree, first_depths_suffice, heap_tree, tree_from_nodes
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.kernels import ErrorFlag, reference
from ddtree.kernels.types import Tree


def _assert_matches_heap(
    tree: Tree, logits: torch.Tensor, budgets: list[int], temperature: float = 1.0
) -> None:
    """Every request of ``tree`` equals the heap oracle's tree, bit for bit."""
    for b, budget in enumerate(budgets):
        nodes = heap_tree(logits[b].cpu(), budget, temperature)
        expected = tree_from_nodes(nodes, int(tree.tokens[b, 0]), tree.num_nodes_max)
        where = f"request {b}"
        assert int(tree.num_nodes[b]) == expected["num_nodes"], where
        assert tree.tokens[b].tolist() == expected["tokens"], where
        assert tree.parents[b].tolist() == expected["parents"], where
        assert tree.depths[b].tolist() == expected["depths"], where
        assert tree.log_probs[b].tolist() == expected["log_probs"], where


def _roots(batch_size: int, vocab_size: int) -> torch.Tensor:
    return torch.arange(batch_size, dtype=torch.int64) % vocab_size


SMALL_CASES = [
    pytest.param(3, 3, 5, 20, id="b3-l3-v5-budget20"),
    pytest.param(2, 4, 3, 50, id="b2-l4-v3-budget50"),
    pytest.param(4, 1, 7, 3, id="b4-l1-v7-budget3"),
    pytest.param(3, 5, 4, 1, id="b3-l5-v4-budget1"),
    pytest.param(1, 3, 6, 300, id="b1-l3-v6-budget300-more-than-prefixes"),
]


@pytest.mark.parametrize("style", ["random", "ties", "peaked", "flat", "poisoned"])
@pytest.mark.parametrize(("batch_size", "draft_len", "vocab_size", "budget"), SMALL_CASES)
def test_matches_heap_and_brute_force(
    style: str, batch_size: int, draft_len: int, vocab_size: int, budget: int
) -> None:
    base = "random" if style == "poisoned" else style
    logits = draft_logits(batch_size, draft_len, vocab_size, style=base, seed=budget)
    if style == "poisoned":
        logits = poison_rows(logits, seed=vocab_size)
    tree = reference.build_tree(logits, _roots(batch_size, vocab_size), budget)
    assert_tree_valid(tree, vocab_size)
    _assert_matches_heap(tree, logits, [budget] * batch_size)
    for b in range(batch_size):
        kept, everything = brute_force_tree(logits[b], budget)
        assert [n.ranks for n in heap_tree(logits[b], budget)] == [n.ranks for n in kept]
        # The kept set is the most probable one: nothing left out scores higher.
        if len(kept) < len(everything):
            assert min(n.score for n in kept) >= everything[len(kept)].score


@pytest.mark.parametrize(
    ("batch_size", "vocab_size"),
    [
        pytest.param(1, 17, id="b1-v17"),
        pytest.param(3, 32000, id="b3-v32000"),
        pytest.param(64, 17, id="b64-v17"),
    ],
)
def test_awkward_sizes_match_heap(batch_size: int, vocab_size: int) -> None:
    logits = draft_logits(batch_size, 4, vocab_size, seed=7)
    tree = reference.build_tree(logits, _roots(batch_size, vocab_size), 24)
    assert_tree_valid(tree, vocab_size)
    _assert_matches_heap(tree, logits, [24] * batch_size)


def test_vocab_163840_matches_heap() -> None:
    logits = draft_logits(1, 2, 163840, style="peaked", seed=3)
    tree = reference.build_tree(logits, _roots(1, 163840), 16)
    _assert_matches_heap(tree, logits, [16])


def test_budget_max_1024_matches_heap() -> None:
    logits = draft_logits(1, 3, 32000, seed=11)
    tree = reference.build_tree(logits, _roots(1, 32000), 1024)
    assert tree.num_nodes_max == 1025
    assert int(tree.num_nodes[0]) == 1025
    assert_tree_valid(tree, 32000)
    _assert_matches_heap(tree, logits, [1024])


def test_draft_len_32_matches_heap() -> None:
    logits = draft_logits(3, 32, 17, style="peaked", seed=5)
    tree = reference.build_tree(logits, _roots(3, 17), 64)
    assert int(tree.depths.max()) == 32
    assert_tree_valid(tree, 17)
    _assert_matches_heap(tree, logits, [64] * 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_logits_match_heap(dtype: torch.dtype) -> None:
    logits = draft_logits(3, 4, 40, dtype=dtype, seed=2)
    tree = reference.build_tree(logits, _roots(3, 40), 30)
    _assert_matches_heap(tree, logits, [30] * 3)


def test_temperature_matches_heap() -> None:
    logits = draft_logits(3, 3, 9, seed=4)
    tree = reference.build_tree(logits, _roots(3, 9), 25, temperature=0.37)
    _assert_matches_heap(tree, logits, [25] * 3, temperature=0.37)


def test_per_request_budgets_are_prefixes_of_the_largest_tree() -> None:
    """Nested property: the tree of budget b is the first b nodes of the max-budget tree."""
    logits = poison_rows(draft_logits(6, 4, 11, style="ties", seed=8), seed=1)
    roots = _roots(6, 11)
    budgets = random_budgets(6, 40, seed=3)
    full = reference.build_tree(logits, roots, 40)
    ragged = reference.build_tree(logits, roots, budgets, max_budget=40)
    assert_tree_valid(ragged, 11)
    _assert_matches_heap(ragged, logits, budgets.tolist())
    for b, budget in enumerate(budgets.tolist()):
        n = int(ragged.num_nodes[b])
        assert n == min(1 + budget, int(full.num_nodes[b]))
        for field in ("tokens", "parents", "depths", "log_probs"):
            assert_equal(getattr(ragged, field)[b, :n], getattr(full, field)[b, :n], field)
        words = ragged.mask.shape[2]
        assert_equal(ragged.mask[b, :n], full.mask[b, :n, :words], "mask")


def test_budget_tensor_without_max_budget_reads_the_largest() -> None:
    logits = draft_logits(3, 2, 9, seed=1)
    budgets = torch.tensor([5, 2, 7], dtype=torch.int32)
    tree = reference.build_tree(logits, _roots(3, 9), budgets)
    assert tree.num_nodes_max == 8
    assert tree.num_nodes.tolist() == [6, 3, 8]


def test_budget_tensor_is_clamped_into_one_to_max_budget() -> None:
    logits = draft_logits(2, 2, 9, seed=1)
    tree = reference.build_tree(logits, _roots(2, 9), torch.tensor([0, 99]), max_budget=6)
    assert tree.num_nodes.tolist() == [2, 7]


def test_max_budget_larger_than_budget_pads() -> None:
    logits = draft_logits(2, 3, 9, seed=6)
    tree = reference.build_tree(logits, _roots(2, 9), 5, max_budget=12)
    assert tree.num_nodes_max == 13
    assert tree.num_nodes.tolist() == [6, 6]
    assert_tree_valid(tree, 9)


def test_budget_one_keeps_the_best_first_token() -> None:
    logits = draft_logits(3, 4, 32000, seed=9)
    tree = reference.build_tree(logits, _roots(3, 32000), 1)
    assert tree.num_nodes.tolist() == [2, 2, 2]
    assert tree.tokens[:, 1].tolist() == logits[:, 0].argmax(dim=1).tolist()


def test_all_impossible_first_depth_gives_root_only_tree() -> None:
    logits = draft_logits(2, 3, 7, seed=1)
    logits[0, 0] = float("-inf")
    logits[1, 0] = float("nan")
    tree = reference.build_tree(logits, _roots(2, 7), 10)
    assert tree.num_nodes.tolist() == [1, 1]
    assert_tree_valid(tree, 7)
    assert not torch.isnan(tree.log_probs).any()


def test_impossible_depth_ends_every_path_there() -> None:
    logits = draft_logits(1, 3, 5, seed=2)
    logits[0, 1, :] = float("nan")
    tree = reference.build_tree(logits, _roots(1, 5), 20)
    n = int(tree.num_nodes[0])
    assert n == 6
    assert tree.depths[0, :n].tolist() == [0, 1, 1, 1, 1, 1]


def test_positive_infinity_tokens_share_the_mass() -> None:
    logits = draft_logits(1, 1, 6, seed=3)
    logits[0, 0, 4] = float("inf")
    logits[0, 0, 2] = float("inf")
    tree = reference.build_tree(logits, _roots(1, 6), 5)
    assert tree.num_nodes.tolist() == [3]
    assert tree.tokens[0, 1:3].tolist() == [2, 4]
    expected = torch.tensor([0.0, -math.log(2), -math.log(2)])
    assert_equal(tree.log_probs[0, :3], expected, "log_probs")


def test_equal_logits_rank_smaller_token_first() -> None:
    logits = torch.zeros(1, 2, 4)
    tree = reference.build_tree(logits, _roots(1, 4), 6)
    # All scores of one depth tie: depth 1 in token order, then the children of token 0.
    assert tree.tokens[0, 1:7].tolist() == [0, 1, 2, 3, 0, 1]
    assert tree.parents[0, 1:7].tolist() == [0, 0, 0, 0, 1, 1]


def test_mask_bit_63_is_the_sign_bit() -> None:
    logits = torch.zeros(1, 1, 200)
    tree = reference.build_tree(logits, _roots(1, 200), 130)
    assert_tree_valid(tree, 200)
    assert int(tree.mask[0, 63, 0]) < 0
    assert int(tree.mask[0, 63, 0]) == -(2**63) + 1


def test_pack_and_unpack_mask_round_trip() -> None:
    bits = torch.rand(3, 130, 130) < 0.5
    assert_equal(reference.unpack_mask(reference.pack_mask(bits), 130), bits, "mask bits")


def test_bad_root_token_is_flagged_and_gets_a_root_only_tree() -> None:
    logits = draft_logits(3, 2, 9, seed=1)
    roots = torch.tensor([1, 9, -1])
    flags = torch.zeros(3, dtype=torch.int32)
    tree = reference.build_tree(logits, roots, 4, error_flags=flags)
    assert flags.tolist() == [0, int(ErrorFlag.TOKEN), int(ErrorFlag.TOKEN)]
    assert tree.num_nodes.tolist() == [5, 1, 1]
    assert tree.tokens[1:, 0].tolist() == [9, -1]
    assert_tree_valid(tree)


def test_already_flagged_request_is_skipped() -> None:
    logits = draft_logits(2, 2, 9, seed=1)
    flags = torch.tensor([int(ErrorFlag.LENGTH), 0], dtype=torch.int32)
    tree = reference.build_tree(logits, _roots(2, 9), 4, error_flags=flags)
    assert tree.num_nodes.tolist() == [1, 5]
    assert flags.tolist() == [int(ErrorFlag.LENGTH), 0]


def test_bad_root_token_without_error_flags_raises_naming_the_request() -> None:
    logits = draft_logits(3, 2, 9, seed=1)
    with pytest.raises(ValueError, match=r"root_tokens: .* request\(s\) \[2\]"):
        reference.build_tree(logits, torch.tensor([0, 1, 9]), 4)


def test_out_receives_the_tree_and_is_returned() -> None:
    logits = draft_logits(3, 4, 200, seed=2)
    roots = _roots(3, 200)
    expected = reference.build_tree(logits, roots, 20, max_budget=30)
    out = poisoned_tree(3, 31, 4)
    flags = torch.zeros(3, dtype=torch.int32)
    tree = reference.build_tree(logits, roots, 20, max_budget=30, error_flags=flags, out=out)
    assert tree is out
    assert_same_tree(out, expected)


@pytest.mark.parametrize("entry_flag", [False, True], ids=["bad-root", "flagged-on-entry"])
def test_out_is_untouched_when_any_request_is_flagged(entry_flag: bool) -> None:
    logits = draft_logits(3, 2, 9, seed=1)
    roots = torch.tensor([1, 2, 3 if entry_flag else 9])
    flags = torch.tensor([0, int(ErrorFlag.LENGTH) if entry_flag else 0, 0], dtype=torch.int32)
    out = poisoned_tree(3, 5, 2)
    reference.build_tree(logits, roots, 4, error_flags=flags, out=out)
    assert is_poisoned(out)
    assert flags.tolist() == (
        [0, int(ErrorFlag.LENGTH), 0] if entry_flag else [0, 0, int(ErrorFlag.TOKEN)]
    )


def test_out_with_a_bad_root_and_no_error_flags_raises_before_writing() -> None:
    out = poisoned_tree(2, 5, 2)
    with pytest.raises(ValueError, match="root_tokens"):
        reference.build_tree(draft_logits(2, 2, 9, seed=1), torch.tensor([0, 9]), 4, out=out)
    assert is_poisoned(out)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda o: replace(o, draft_len=3), r"out\.draft_len: expected 2, got 3"),
        (lambda o: poisoned_tree(2, 4, 2), r"out\.tokens: expected shape"),
        (
            lambda o: replace(o, log_probs=o.log_probs.t().contiguous().t()),
            r"out\.log_probs: expected a contiguous tensor",
        ),
        (
            lambda o: replace(o, depths=o.parents),
            r"out\.parents: overlaps out\.depths|out\.depths: overlaps out\.parents",
        ),
        (lambda o: "not a tree", r"out: expected a ddtree\.kernels\.Tree"),
    ],
    ids=["draft-len", "shape", "contiguity", "overlap", "type"],
)
def test_bad_out_is_refused_naming_the_field(change: object, match: str) -> None:
    out = change(poisoned_tree(2, 5, 2))  # type: ignore[operator]
    with pytest.raises((ValueError, TypeError), match=match):
        reference.build_tree(draft_logits(2, 2, 9, seed=1), _roots(2, 9), 4, out=out)


def test_out_overlapping_an_input_is_refused() -> None:
    out = poisoned_tree(2, 5, 2)
    out.tokens[0, :2] = torch.tensor([1, 2])
    roots = out.tokens.flatten()[:2]  # the roots inside out.tokens
    with pytest.raises(ValueError, match=r"overlaps"):
        reference.build_tree(draft_logits(2, 2, 9, seed=1), roots, 4, out=out)


@pytest.mark.parametrize("style", ["random", "ties", "peaked", "flat", "poisoned"])
@pytest.mark.parametrize("scale", [0.5, 1.0, 3.0])
def test_the_early_select_test_keeps_the_tree(style: str, scale: float) -> None:
    """Wherever the early select's test passes on a request's first depths, the tree built from
    those depths alone is the whole tree, node for node (the reference on the truncated rows
    against the reference on all of them). Both outcomes occur on random rows."""
    batch_size, draft_len, vocab_size = 6, 8, 300
    kind = "random" if style == "poisoned" else style
    logits = draft_logits(batch_size, draft_len, vocab_size, style=kind, seed=int(scale * 10))
    if style == "poisoned":
        logits = poison_rows(logits, seed=6)
    logits = logits * scale
    roots = _roots(batch_size, vocab_size)
    outcomes = set()
    for budget in (1, 7, 31, 64, 96):
        full = reference.build_tree(logits, roots, budget, temperature=0.9)
        for use in (1, 2, 4, draft_len - 1):
            early = reference.build_tree(
                logits[:, :use].contiguous(), roots, budget, temperature=0.9
            )
            for b in range(batch_size):
                suffices = first_depths_suffice(logits[b], 0.9, use, budget)
                outcomes.add(suffices)
                if suffices:
                    n = int(full.num_nodes[b])
                    assert int(early.num_nodes[b]) == n, (b, use, budget)
                    for name in ("tokens", "parents", "depths", "log_probs"):
                        got, want = getattr(early, name)[b, :n], getattr(full, name)[b, :n]
                        assert torch.equal(got, want), (name, b, use, budget)
    if style == "random":
        assert outcomes == {True, False}


@pytest.mark.gpu
def test_runs_on_cuda_like_on_cpu() -> None:
    logits = draft_logits(3, 4, 1000, seed=5)
    cpu = reference.build_tree(logits, _roots(3, 1000), 50)
    gpu = reference.build_tree(logits.cuda(), _roots(3, 1000).cuda(), 50)
    assert_tree_valid(gpu, 1000)
    assert_same_tree(gpu, cpu, log_prob_atol=1e-5)


@pytest.mark.slow
def test_budget_max_draft_len_32_matches_heap() -> None:
    logits = draft_logits(2, 32, 1500, style="peaked", seed=12)
    tree = reference.build_tree(logits, _roots(2, 1500), 1024)
    assert_tree_valid(tree, 1500)
    _assert_matches_heap(tree, logits, [1024, 1024])


_LOGIT_VALUES = [0.0, 1.0, -1.0, 2.5, 30.0, -30.0, float("-inf"), float("inf"), float("nan")]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    data=st.data(),
    draft_len=st.integers(1, 4),
    vocab_size=st.integers(1, 6),
    budget=st.integers(1, 40),
)
def test_property_matches_heap_on_adversarial_logits(
    data: st.DataObject, draft_len: int, vocab_size: int, budget: int
) -> None:
    """Few distinct values (ties everywhere, +-inf, NaN, huge gaps): still the heap's tree."""
    values = data.draw(
        st.lists(
            st.sampled_from(_LOGIT_VALUES),
            min_size=2 * draft_len * vocab_size,
            max_size=2 * draft_len * vocab_size,
        )
    )
    logits = torch.tensor(values).reshape(2, draft_len, vocab_size)
    tree = reference.build_tree(logits, _roots(2, vocab_size), budget)
    assert_tree_valid(tree, vocab_size)
    _assert_matches_heap(tree, logits, [budget, budget])
