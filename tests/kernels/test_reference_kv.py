"""``reference.commit_kv`` against a scalar read-then-write loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.assertions import assert_equal
from helpers.generators import paged_cache, random_tree, target_tokens_for
from helpers.oracles import scalar_commit

from ddtree.kernels import ErrorFlag, reference
from ddtree.kernels.types import Acceptance


def _accepted(batch_size: int, num_nodes_max: int, draft_len: int, seed: int) -> tuple:
    tree = random_tree(batch_size, num_nodes_max, draft_len, 4, shape="mixed", seed=seed)
    targets = target_tokens_for(tree, 4, follow=0.9, seed=seed)
    return tree, reference.accept(tree, targets)


@pytest.mark.parametrize("page_size", [1, 16, 64], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("batch_size", [1, 3, 64], ids=lambda b: f"b{b}")
def test_matches_scalar_commit(page_size: int, batch_size: int) -> None:
    tree, acceptance = _accepted(batch_size, 24, 5, seed=batch_size + page_size)
    prefix_lens = torch.randint(0, 100, (batch_size,), dtype=torch.int32)
    prefix_lens[0] = 0
    cache, table = paged_cache(prefix_lens + tree.num_nodes, page_size, 8, seed=page_size)
    expected = cache.clone()
    scalar_commit(expected, table, prefix_lens, acceptance)
    reference.commit_kv(cache, table, prefix_lens, acceptance)
    assert_equal(cache, expected, "kv_cache")
    assert int(acceptance.length.max()) > 1


def test_overlapping_moves_read_before_write() -> None:
    """Path 0 -> 2 -> 3 -> 5: position 2 is both a source (m=1) and a destination (m=2)."""
    acceptance = Acceptance(
        nodes=torch.tensor([[0, 2, 3, 5, -1]], dtype=torch.int32),
        tokens=torch.tensor([[1, 2, 3, 4, -1]]),
        length=torch.tensor([4], dtype=torch.int32),
        bonus=torch.tensor([9]),
    )
    prefix_lens = torch.tensor([3], dtype=torch.int32)
    cache = torch.arange(12, dtype=torch.float32).reshape(12, 1, 1)
    table = torch.arange(12, dtype=torch.int32).reshape(1, 12)
    reference.commit_kv(cache, table, prefix_lens, acceptance)
    assert cache.flatten().tolist() == [0, 1, 2, 3, 5, 6, 8, 7, 8, 9, 10, 11]


def test_flagged_requests_leave_the_cache_untouched() -> None:
    _, acceptance = _accepted(4, 16, 4, seed=3)
    lengths = acceptance.length.clone()
    lengths[:] = lengths.clamp(min=2)
    nodes = acceptance.nodes.clone()
    nodes[:, 1] = nodes[:, 1].clamp(min=1)
    acceptance = dataclasses.replace(acceptance, nodes=nodes, length=lengths.clamp(max=2))
    prefix_lens = torch.tensor([5, 7, -1, 9], dtype=torch.int32)
    cache, table = paged_cache(torch.tensor([21, 23, 16, 25]), 4, 6, seed=1)
    table[0, 1] = cache.shape[0]  # request 0 touches block 1 (positions 5, 6)
    acceptance.length[3] = 0  # malformed path
    flags = torch.zeros(4, dtype=torch.int32)
    expected = cache.clone()
    scalar_commit(expected, table, prefix_lens, acceptance, skip=[True, False, True, True])
    reference.commit_kv(cache, table, prefix_lens, acceptance, error_flags=flags)
    bits = [int(ErrorFlag.BLOCK_TABLE), 0, int(ErrorFlag.LENGTH), int(ErrorFlag.ACCEPTANCE)]
    assert flags.tolist() == bits
    assert_equal(cache, expected, "kv_cache")


def test_path_beyond_the_block_table_is_a_length_error() -> None:
    acceptance = Acceptance(
        nodes=torch.tensor([[0, 9]], dtype=torch.int32),
        tokens=torch.tensor([[1, 2]]),
        length=torch.tensor([2], dtype=torch.int32),
        bonus=torch.tensor([3]),
    )
    cache = torch.zeros(4, 4, 2)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^prefix_lens: .* request\(s\) \[0\]"):
        reference.commit_kv(cache, table, torch.tensor([0], dtype=torch.int32), acceptance)


def test_bad_block_table_without_error_flags_raises_naming_it() -> None:
    _, acceptance = _accepted(3, 12, 3, seed=1)
    prefix_lens = torch.zeros(3, dtype=torch.int32)
    cache, table = paged_cache(torch.full((3,), 12), 4, 6, seed=1)
    table[1, 0] = -3
    with pytest.raises(ValueError, match=r"^block_table: .* request\(s\) \[1\]"):
        reference.commit_kv(cache, table, prefix_lens, acceptance)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        pytest.param(
            {"block_table": torch.zeros(2, 3, dtype=torch.int64)},
            "block_table: expected dtype int32",
            id="int64-block-table",
        ),
        pytest.param(
            {"prefix_lens": torch.zeros(3, dtype=torch.int32)},
            r"prefix_lens: expected shape \(batch_size,\) = \(2,\), got \(3,\)",
            id="prefix-lens-batch",
        ),
        pytest.param(
            {"kv_cache": torch.zeros(4, 300, 2)},
            "kv_cache: expected shape .* 1 <= page_size <= 256",
            id="page-size-300",
        ),
    ],
)
def test_bad_arguments_raise_naming_the_field(change: dict, pattern: str) -> None:
    _, acceptance = _accepted(2, 8, 3, seed=0)
    arguments = {
        "kv_cache": torch.zeros(8, 4, 2),
        "block_table": torch.zeros(2, 3, dtype=torch.int32),
        "prefix_lens": torch.zeros(2, dtype=torch.int32),
    }
    arguments.update(change)
    with pytest.raises(ValueError, match=pattern):
        reference.commit_kv(acceptance=acceptance, **arguments)


@pytest.mark.parametrize("entry_flag", [False, True], ids=["bad-table", "flagged-by-accept"])
def test_all_or_nothing_moves_nothing_when_any_request_is_flagged(entry_flag: bool) -> None:
    tree, acceptance = _accepted(3, 16, 4, seed=8)
    assert int(acceptance.length.max()) > 1  # a clean batch would move latents
    prefix_lens = torch.tensor([2, 4, 6], dtype=torch.int32)
    cache, table = paged_cache(prefix_lens + tree.num_nodes, 4, 6, seed=2)
    flags = torch.zeros(3, dtype=torch.int32)
    if entry_flag:
        flags[2] = int(ErrorFlag.TOKEN)
    else:
        table[1, :] = cache.shape[0]  # every page of request 1 out of range
    before = cache.clone()
    reference.commit_kv(
        cache, table, prefix_lens, acceptance, error_flags=flags, all_or_nothing=True
    )
    assert_equal(cache, before, "kv_cache")
    expected = [0, 0, int(ErrorFlag.TOKEN)] if entry_flag else [0, int(ErrorFlag.BLOCK_TABLE), 0]
    assert flags.tolist() == expected
    # A clean batch moves as without the option.
    flags.zero_()
    table, prefix = paged_cache(prefix_lens + tree.num_nodes, 4, 6, seed=2)[1], prefix_lens
    expected_cache = cache.clone()
    scalar_commit(expected_cache, table, prefix, acceptance)
    reference.commit_kv(cache, table, prefix, acceptance, error_flags=flags, all_or_nothing=True)
    assert_equal(cache, expected_cache, "kv_cache")
    assert flags.tolist() == [0, 0, 0]
