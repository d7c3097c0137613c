"""AcceptTree with a KV commit in the engine: the walk and the commit, all or nothing (CPU).

The commit follows the walk on the stream with no wait for the walk's verdict, so it must move
nothing when any request's walk failed, and nothing when any request's own commit data is bad:
a failed call leaves the caller's cache exactly as it was. Destinations in caller memory
(``out``) are written only by a clean call.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from helpers.assertions import assert_same_acceptance
from helpers.generators import is_poisoned, poisoned_acceptance
from helpers.service_inputs import Step, make_step

from ddtree import kernels
from ddtree.service.calls import AcceptTreeCall, KvCommitArgs
from ddtree.service.engine import Engine
from ddtree.service.errors import InvalidBlockTable, InvalidToken


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine(device="cpu", backend="reference") as running:
        running.warm_up()
        yield running


@pytest.fixture
def step() -> Step:
    return make_step(seed=3)


def _call(step: Step, **changes: object) -> AcceptTreeCall:
    commit = KvCommitArgs(step.kv_cache.clone(), step.block_table.clone(), step.prefix_lens)
    call = AcceptTreeCall(tree=step.tree, target_tokens=step.target_tokens, kv_commit=commit)
    return replace(call, **changes)


def test_a_clean_call_walks_and_commits_in_place(engine: Engine, step: Step) -> None:
    out = poisoned_acceptance(step.tree.batch_size, step.tree.draft_len + 1)
    call = _call(step, out=out)
    assert call.kv_commit is not None
    result = engine.accept_tree(call).result(timeout=30)
    expected = kernels.accept(step.tree, step.target_tokens, backend="reference")
    assert result.acceptance is out
    assert_same_acceptance(out, expected)
    want = step.kv_cache.clone()
    kernels.commit_kv(want, step.block_table, step.prefix_lens, expected, backend="reference")
    assert result.kv_cache is call.kv_commit.kv_cache  # compacted in place
    assert torch.equal(call.kv_commit.kv_cache, want)
    assert not torch.equal(want, step.kv_cache)  # latents moved


def test_a_bad_block_table_in_one_request_moves_nothing(engine: Engine, step: Step) -> None:
    call = _call(step)
    assert call.kv_commit is not None
    call.kv_commit.block_table[2] = 10_000
    with pytest.raises(InvalidBlockTable, match=r"block_table\[2\]"):
        engine.accept_tree(call).result(timeout=30)
    assert torch.equal(call.kv_commit.kv_cache, step.kv_cache)  # requests 0 and 1 too


def test_a_failed_walk_writes_and_moves_nothing(engine: Engine, step: Step) -> None:
    targets = step.target_tokens.clone()
    targets[1, 0] = -3
    out = poisoned_acceptance(step.tree.batch_size, step.tree.draft_len + 1)
    call = _call(step, target_tokens=targets, out=out)
    assert call.kv_commit is not None
    with pytest.raises(InvalidToken, match=r"target_tokens\[1\]"):
        engine.accept_tree(call).result(timeout=30)
    assert is_poisoned(out)
    assert torch.equal(call.kv_commit.kv_cache, step.kv_cache)
