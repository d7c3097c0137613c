"""``reference.accept`` against a scalar walk, plus sampling reproducibility and statistics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.assertions import assert_equal, assert_same_acceptance
from helpers.generators import (
    draft_logits,
    is_poisoned,
    poisoned_acceptance,
    random_tree,
    target_tokens_for,
)
from helpers.invariants import assert_acceptance_valid
from helpers.oracles import gumbel_noise_scalar, scalar_accept

from ddtree.kernels import ErrorFlag, reference
from ddtree.kernels.types import Acceptance, Tree


def _assert_matches_walk(acceptance: Acceptance, expected: list) -> None:
    for b, (nodes, tokens, bonus) in enumerate(expected):
        where = f"request {b}"
        length = len(nodes)
        assert int(acceptance.length[b]) == length, where
        assert acceptance.nodes[b, :length].tolist() == nodes, where
        assert acceptance.tokens[b, :length].tolist() == tokens, where
        assert int(acceptance.bonus[b]) == bonus, where


def _replayed_seed(generator: torch.Generator) -> int:
    """The seed ``accept`` draws from ``generator`` (whose state is consumed)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


@pytest.mark.parametrize(
    ("batch_size", "shape"),
    [
        pytest.param(1, "chain", id="b1-chain"),
        pytest.param(3, "star", id="b3-star"),
        pytest.param(3, "random", id="b3-random"),
        pytest.param(64, "mixed", id="b64-mixed"),
    ],
)
def test_target_tokens_match_scalar_walk(batch_size: int, shape: str) -> None:
    tree = random_tree(batch_size, 40, 6, 5, shape=shape, seed=batch_size)
    follow = 1.0 if shape == "chain" else 0.7
    targets = target_tokens_for(tree, 5, follow=follow, seed=1)
    acceptance = reference.accept(tree, targets)
    assert_acceptance_valid(acceptance, tree)
    _assert_matches_walk(acceptance, scalar_accept(tree, targets))
    assert int(acceptance.length.max()) >= 2


def test_duplicate_sibling_tokens_take_the_lowest_index() -> None:
    tree = random_tree(1, 4, 2, 9, shape="star", seed=0)
    tokens = torch.tensor([[5, 7, 3, 3]])
    tree = dataclasses.replace(tree, tokens=tokens)
    targets = torch.tensor([[3, 0, 0, 0]])
    acceptance = reference.accept(tree, targets)
    assert acceptance.nodes[0].tolist() == [0, 2, -1]
    assert int(acceptance.bonus[0]) == 0


@pytest.mark.parametrize("style", ["random", "ties"])
def test_greedy_logits_match_scalar_walk(style: str) -> None:
    tree = random_tree(5, 30, 4, 6, shape="mixed", seed=2)
    logits = draft_logits(5, 30, 6, style=style, seed=3)
    logits[0, 0] = float("nan")
    logits[1, 0, 2] = float("inf")
    logits[2, 0, :] = float("-inf")
    acceptance = reference.accept(tree, target_logits=logits)
    assert_acceptance_valid(acceptance, tree)
    _assert_matches_walk(acceptance, scalar_accept(tree, target_logits=logits))


def test_greedy_logits_equal_argmax_tokens() -> None:
    tree = random_tree(4, 20, 5, 32000, shape="mixed", seed=4)
    logits = draft_logits(4, 20, 32000, style="ties", seed=5).to(torch.bfloat16)
    from_logits = reference.accept(tree, target_logits=logits)
    targets = logits.float().argmax(dim=2)
    assert_same_acceptance(from_logits, reference.accept(tree, targets))


def test_sampling_matches_scalar_walk_with_independent_hash() -> None:
    tree = random_tree(6, 25, 4, 7, shape="mixed", seed=6)
    logits = draft_logits(6, 25, 7, seed=7)
    logits[3, 0, 1] = float("nan")
    generator = torch.Generator().manual_seed(123)
    replay = torch.Generator().manual_seed(123)
    acceptance = reference.accept(tree, target_logits=logits, temperature=0.8, generator=generator)
    seed = _replayed_seed(replay)
    assert_acceptance_valid(acceptance, tree)
    _assert_matches_walk(
        acceptance, scalar_accept(tree, target_logits=logits, temperature=0.8, seed=seed)
    )


def test_sampling_is_reproducible_from_the_generator_state() -> None:
    tree = random_tree(8, 30, 5, 50, shape="mixed", seed=8)
    logits = draft_logits(8, 30, 50, seed=9)
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(77)
        runs.append(
            reference.accept(tree, target_logits=logits, temperature=1.3, generator=generator)
        )
    assert_same_acceptance(runs[0], runs[1])


def test_sampling_noise_matches_python_ints_and_is_finite() -> None:
    seed = torch.tensor([(2**62) - 12345], dtype=torch.int64)
    requests = torch.tensor([0, 5, 63])
    nodes = torch.tensor([0, 17, 1024])
    noise = reference.sampling_noise(seed, requests, nodes, 4096)
    assert torch.isfinite(noise).all()
    for row, (b, i) in enumerate(zip(requests.tolist(), nodes.tolist(), strict=True)):
        assert_equal(noise[row], gumbel_noise_scalar(int(seed), b, i, 4096), f"row {row}")


def test_flagged_trees_get_empty_acceptance() -> None:
    tree = random_tree(4, 10, 3, 5, shape="star", seed=1)
    parents = tree.parents.clone()
    parents[1, 1] = 1  # not an earlier node
    num_nodes = tree.num_nodes.clone()
    num_nodes[2] = 11  # more than num_nodes_max
    bad = dataclasses.replace(tree, parents=parents, num_nodes=num_nodes)
    targets = target_tokens_for(tree, 5, seed=2)
    targets[3, 0] = -4
    flags = torch.zeros(4, dtype=torch.int32)
    acceptance = reference.accept(bad, targets, error_flags=flags)
    tree_bit, token_bit = int(ErrorFlag.TREE), int(ErrorFlag.TOKEN)
    assert flags.tolist() == [0, tree_bit, tree_bit, token_bit]
    assert acceptance.length.tolist()[1:] == [0, 0, 0]
    assert acceptance.bonus.tolist()[1:] == [-1, -1, -1]
    assert (acceptance.nodes[1:] == -1).all() and (acceptance.tokens[1:] == -1).all()
    assert int(acceptance.length[0]) >= 1


def test_malformed_tree_without_error_flags_raises_naming_tree() -> None:
    tree = random_tree(3, 10, 3, 5, shape="chain", seed=1)
    depths = tree.depths.clone()
    depths[2, 1] = 3
    bad = dataclasses.replace(tree, depths=depths)
    with pytest.raises(ValueError, match=r"^tree: malformed .* request\(s\) \[2\]"):
        reference.accept(bad, target_tokens_for(tree, 5))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        pytest.param({}, "exactly one of them, got neither", id="neither-target"),
        pytest.param(
            {
                "target_tokens": torch.zeros(2, 6, dtype=torch.int64),
                "target_logits": torch.zeros(2, 6, 3),
            },
            "got both",
            id="both-targets",
        ),
        pytest.param(
            {"target_tokens": torch.zeros(2, 6, dtype=torch.int64), "temperature": 1.0},
            "temperature: sampling .* needs target_logits",
            id="sampling-without-logits",
        ),
        pytest.param(
            {"target_logits": torch.zeros(2, 6, 3), "temperature": -1.0},
            "temperature: expected a finite float >= 0",
            id="negative-temperature",
        ),
        pytest.param(
            {"target_tokens": torch.zeros(2, 5, dtype=torch.int64)},
            r"target_tokens: expected shape \(batch_size, num_nodes_max\) = \(2, 6\)",
            id="short-targets",
        ),
        pytest.param(
            {"target_tokens": torch.zeros(2, 6, dtype=torch.int32)},
            "target_tokens: expected dtype int64, got torch.int32",
            id="int32-targets",
        ),
    ],
)
def test_bad_arguments_raise_naming_the_field(kwargs: dict, pattern: str) -> None:
    tree = random_tree(2, 6, 3, 5, seed=0)
    with pytest.raises(ValueError, match=pattern):
        reference.accept(tree, **kwargs)


@pytest.mark.slow
def test_sampled_first_token_follows_the_target_distribution() -> None:
    """Lossless sampling: the token emitted after the root is distributed as the target's."""
    batch_size, vocab_size, temperature = 20000, 6, 0.7
    root_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("nan")])
    base = random_tree(1, 4, 2, vocab_size, shape="star", seed=0)
    tokens = torch.tensor([[0, 0, 1, 3]]).expand(batch_size, -1).contiguous()
    tree = Tree(
        tokens=tokens,
        parents=base.parents.expand(batch_size, -1).contiguous(),
        depths=base.depths.expand(batch_size, -1).contiguous(),
        log_probs=base.log_probs.expand(batch_size, -1).contiguous(),
        num_nodes=torch.full((batch_size,), 4, dtype=torch.int32),
        mask=base.mask.expand(batch_size, -1, -1).contiguous(),
        draft_len=2,
    )
    logits = torch.randn(batch_size, 4, vocab_size)
    logits[:, 0] = root_logits
    generator = torch.Generator().manual_seed(2024)
    acceptance = reference.accept(
        tree, target_logits=logits, temperature=temperature, generator=generator
    )
    first = torch.where(acceptance.length > 1, acceptance.tokens[:, 1], acceptance.bonus)
    counts = torch.bincount(first, minlength=vocab_size).double()
    expected = torch.softmax(torch.nan_to_num(root_logits, nan=float("-inf")) / temperature, 0)
    assert counts[5] == 0
    observed, probs = counts[:5], expected[:5].double()
    chi2 = float(((observed - batch_size * probs) ** 2 / (batch_size * probs)).sum())
    assert chi2 < 20.5, f"chi-square {chi2:.2f} (4 dof, p < 0.0004) counts {counts.tolist()}"


def test_accept_on_built_trees_follows_drafted_paths() -> None:
    logits = draft_logits(3, 5, 11, style="peaked", seed=4)
    tree = reference.build_tree(logits, torch.tensor([1, 2, 3]), 20)
    targets = target_tokens_for(tree, 11, follow=1.0, seed=5)
    acceptance = reference.accept(tree, targets)
    assert_acceptance_valid(acceptance, tree)
    _assert_matches_walk(acceptance, scalar_accept(tree, targets))
    # Following a child at every node walks until a leaf.
    for b in range(3):
        last = int(acceptance.nodes[b, int(acceptance.length[b]) - 1])
        assert not (tree.parents[b, : int(tree.num_nodes[b])] == last).any()


def test_out_receives_the_acceptance_and_is_returned() -> None:
    tree = random_tree(3, 24, 5, 6, shape="mixed", seed=4)
    targets = target_tokens_for(tree, 6, follow=0.8, seed=4)
    expected = reference.accept(tree, targets)
    out = poisoned_acceptance(3, 6)
    flags = torch.zeros(3, dtype=torch.int32)
    assert reference.accept(tree, targets, error_flags=flags, out=out) is out
    assert_same_acceptance(out, expected)


@pytest.mark.parametrize("entry_flag", [False, True], ids=["bad-target", "flagged-on-entry"])
def test_out_is_untouched_when_any_request_is_flagged(entry_flag: bool) -> None:
    tree = random_tree(3, 16, 4, 6, shape="mixed", seed=5)
    targets = target_tokens_for(tree, 6, follow=0.8, seed=5)
    flags = torch.zeros(3, dtype=torch.int32)
    if entry_flag:
        flags[1] = int(ErrorFlag.LENGTH)
    else:
        targets[2, 0] = -1  # a negative target at the root
    out = poisoned_acceptance(3, 5)
    reference.accept(tree, targets, error_flags=flags, out=out)
    assert is_poisoned(out)
    assert flags.tolist() == (
        [0, int(ErrorFlag.LENGTH), 0] if entry_flag else [0, 0, int(ErrorFlag.TOKEN)]
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda o: poisoned_acceptance(3, 4), r"out\.nodes: expected shape"),
        (
            lambda o: dataclasses.replace(o, bonus=o.bonus.to(torch.int32)),
            r"out\.bonus: expected dtype",
        ),
        (
            lambda o: dataclasses.replace(o, tokens=o.tokens.t().contiguous().t()),
            r"out\.tokens: expected a contiguous tensor",
        ),
        (lambda o: "not an acceptance", r"out: expected a ddtree\.kernels\.Acceptance"),
    ],
    ids=["shape", "dtype", "contiguity", "type"],
)
def test_bad_out_is_refused_naming_the_field(change: object, match: str) -> None:
    tree = random_tree(3, 16, 4, 6, shape="mixed", seed=6)
    targets = target_tokens_for(tree, 6, follow=0.8, seed=6)
    out = change(poisoned_acceptance(3, 5))  # type: ignore[operator]
    with pytest.raises((ValueError, TypeError), match=match):
        reference.accept(tree, targets, out=out)


def test_out_overlapping_an_input_or_itself_is_refused() -> None:
    tree = random_tree(2, 16, 4, 6, shape="mixed", seed=7)
    targets = target_tokens_for(tree, 6, follow=0.8, seed=7)
    out = poisoned_acceptance(2, 5)
    inside = dataclasses.replace(out, tokens=targets.flatten()[:10].view(2, 5))
    with pytest.raises(ValueError, match=r"overlaps"):
        reference.accept(tree, targets, out=inside)
    shared = dataclasses.replace(out, length=out.nodes.flatten()[:2])  # inside out.nodes
    with pytest.raises(ValueError, match="overlaps"):
        reference.accept(tree, targets, out=shared)
