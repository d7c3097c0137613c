"""State the engine keeps between calls to save per-call host work never leaks into a result.

The error-flag buffer is reused by every op and zeroed only when it may hold a flag: a request
flagged in one call must never be reported again for a later call (of any batch size), and a
call after a failed one must still see its own bad requests. Reference backend, CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ddtree import kernels
from ddtree.service.calls import AcceptTreeCall, BuildTreeCall
from ddtree.service.engine import Engine
from ddtree.service.errors import InvalidToken, InvalidTree

VOCAB_SIZE = 64
DRAFT_LEN = 3
BUDGET = 5


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine(device="cpu", backend="reference") as running:
        running.warm_up()
        yield running


def build_call(batch_size: int, bad: tuple[int, ...] = (), seed: int = 0) -> BuildTreeCall:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, DRAFT_LEN, VOCAB_SIZE, generator=generator)
    roots = torch.randint(0, VOCAB_SIZE, (batch_size,), generator=generator)
    roots[list(bad)] = VOCAB_SIZE + 3  # out of range: flagged by the op, per request
    return BuildTreeCall(draft_logits=logits, root_tokens=roots, budget=BUDGET)


def build(engine: Engine, call: BuildTreeCall) -> kernels.Tree:
    return engine.build_tree(call).result(timeout=60)


def expect_bad_root(engine: Engine, call: BuildTreeCall, index: int) -> None:
    with pytest.raises(InvalidToken) as raised:
        build(engine, call)
    assert f"build_tree.root_tokens[{index}]" in raised.value.message


def test_a_flagged_request_is_not_reported_again(engine: Engine) -> None:
    expect_bad_root(engine, build_call(8, bad=(5,)), 5)
    for batch_size in (3, 8, 12):  # smaller, equal and larger batches than the failed one
        call = build_call(batch_size, seed=batch_size)
        tree = build(engine, call)
        expected = kernels.build_tree(
            call.draft_logits, call.root_tokens, BUDGET, backend="reference"
        )
        assert torch.equal(tree.tokens, expected.tokens)
        assert torch.equal(tree.num_nodes, expected.num_nodes)


def test_calls_after_a_failure_still_see_their_own_bad_requests(engine: Engine) -> None:
    expect_bad_root(engine, build_call(8, bad=(6,)), 6)
    expect_bad_root(engine, build_call(2, bad=(1,)), 1)
    build(engine, build_call(4))
    expect_bad_root(engine, build_call(4, bad=(0, 3)), 0)
    expect_bad_root(engine, build_call(8, bad=(7,)), 7)
    build(engine, build_call(8))


def test_flags_of_one_op_are_not_carried_into_the_next(engine: Engine) -> None:
    good = build(engine, build_call(4))
    targets = good.tokens.clamp(min=0)
    bad_parents = good.parents.clone()
    bad_parents[2, 1] = 7  # not an earlier node: the walk flags request 2's tree
    broken = kernels.Tree(
        tokens=good.tokens,
        parents=bad_parents,
        depths=good.depths,
        log_probs=good.log_probs,
        num_nodes=good.num_nodes,
        mask=good.mask,
        draft_len=good.draft_len,
    )
    with pytest.raises(InvalidTree) as raised:
        engine.accept_tree(AcceptTreeCall(tree=broken, target_tokens=targets)).result(timeout=60)
    assert "[2]" in raised.value.message
    # A build of the same batch after the failed walk: clean flags, and the walk of its tree
    # succeeds too.
    tree = build(engine, build_call(4))
    result = engine.accept_tree(
        AcceptTreeCall(tree=tree, target_tokens=tree.tokens.clamp(min=0))
    ).result(timeout=60)
    assert torch.all(result.acceptance.length >= 1)
