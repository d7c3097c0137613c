"""``out=`` of the remote clients: destinations checked before sending, results copied in.

Checks run on the client, so a bad ``out`` is refused with an ``InvalidArgumentError`` naming the
field even when no server is reachable. Inline (no CUDA IPC), the decoded result is copied into
``out``, which is returned and equals the result of the same call without ``out``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace as replaced
from pathlib import Path

import pytest
import torch
from helpers.service_inputs import BUDGET, Step, make_step
from helpers.serving import ServerThread

from ddtree.clients import AsyncClient, Client, _wire
from ddtree.clients.errors import DDTreeClientError, InvalidArgumentError
from ddtree.kernels.types import Acceptance, Tree, mask_words
from ddtree.service.config import ServiceConfig

TREE_NAMES = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")
ACCEPTANCE_NAMES = ("nodes", "tokens", "length", "bonus")


def empty_tree(batch_size: int, budget: int, draft_len: int, device: str = "cpu") -> Tree:
    """Destinations of the exact shapes and dtypes ``build_tree`` returns."""
    nodes = 1 + budget
    pair = (batch_size, nodes)
    return Tree(
        tokens=torch.full(pair, 7, dtype=torch.int64, device=device),
        parents=torch.full(pair, 7, dtype=torch.int32, device=device),
        depths=torch.full(pair, 7, dtype=torch.int32, device=device),
        log_probs=torch.full(pair, 7.0, dtype=torch.float32, device=device),
        num_nodes=torch.full((batch_size,), 7, dtype=torch.int32, device=device),
        mask=torch.full((*pair, mask_words(nodes)), 7, dtype=torch.int64, device=device),
        draft_len=draft_len,
    )


def empty_acceptance(batch_size: int, draft_len: int) -> Acceptance:
    path = (batch_size, draft_len + 1)
    return Acceptance(
        nodes=torch.full(path, 7, dtype=torch.int32),
        tokens=torch.full(path, 7, dtype=torch.int64),
        length=torch.full((batch_size,), 7, dtype=torch.int32),
        bonus=torch.full((batch_size,), 7, dtype=torch.int64),
    )


def step_tree_out(step: Step) -> Tree:
    batch_size, draft_len, _ = step.draft_logits.shape
    return empty_tree(batch_size, BUDGET, draft_len)


BAD_TREES: dict[str, tuple[Callable[[Tree], object], str, str]] = {
    "dtype": (
        lambda t: replaced(t, tokens=t.tokens.to(torch.int32)),
        "build_tree.out.tokens",
        "expected dtype torch.int64, got torch.int32",
    ),
    "nodes": (
        lambda t: replaced(t, parents=t.parents[:, :-1].contiguous()),
        "build_tree.out.parents",
        f"expected shape (3, {1 + BUDGET}), got (3, {BUDGET})",
    ),
    "mask-words": (
        lambda t: replaced(t, mask=torch.zeros(3, 1 + BUDGET, 2, dtype=torch.int64)),
        "build_tree.out.mask",
        f"expected shape (3, {1 + BUDGET}, 1), got (3, {1 + BUDGET}, 2)",
    ),
    "device": (
        lambda t: replaced(t, log_probs=t.log_probs.to("meta")),
        "build_tree.out.log_probs",
        "expected a tensor on cpu, where draft_logits is, got one on meta",
    ),
    "contiguity": (
        lambda t: replaced(t, num_nodes=torch.zeros(3, 2, dtype=torch.int32)[:, 0]),
        "build_tree.out.num_nodes",
        "expected a contiguous tensor",
    ),
    "draft-len": (
        lambda t: replaced(t, draft_len=t.draft_len + 1),
        "build_tree.out.draft_len",
        "expected",
    ),
    "type": (lambda t: (t.tokens, t.parents), "build_tree.out", "expected a Tree, got tuple"),
}


@pytest.mark.parametrize("case", list(BAD_TREES), ids=list(BAD_TREES))
def test_a_bad_tree_out_is_refused_before_sending(case: str) -> None:
    step = make_step(seed=1)
    spoil, field, needle = BAD_TREES[case]
    out = spoil(step_tree_out(step))
    # Nothing listens on port 1: a check made after sending would raise UnavailableError.
    with Client("127.0.0.1:1") as client, pytest.raises(InvalidArgumentError) as raised:
        client.build_tree(
            step.draft_logits,
            step.root_tokens,
            BUDGET,
            out=out,
            timeout_s=5,  # type: ignore[arg-type]
        )
    assert raised.value.field == field
    assert raised.value.reason == "INVALID_TENSOR"
    assert str(raised.value.message).startswith(f"{field}: ")
    assert needle in raised.value.message


def test_tree_out_follows_max_budget_for_per_request_budgets() -> None:
    step = make_step(seed=1)
    budgets = torch.tensor([2, BUDGET, 4], dtype=torch.int64)
    out = empty_tree(3, 20, step.draft_logits.shape[1])  # max_budget=20: 21 slots
    with Client("127.0.0.1:1") as client, pytest.raises(InvalidArgumentError) as raised:
        client.build_tree(step.draft_logits, step.root_tokens, budgets, out=out, timeout_s=5)
    # Without max_budget the slots follow the largest budget (BUDGET).
    assert raised.value.field == "build_tree.out.tokens"
    assert f"expected shape (3, {1 + BUDGET}), got (3, 21)" in raised.value.message


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("nodes", torch.zeros(3, 4, dtype=torch.int32), "accept_tree.out.nodes: expected shape"),
        ("bonus", torch.zeros(3, dtype=torch.int32), "accept_tree.out.bonus: expected dtype"),
    ],
    ids=["path-len", "dtype"],
)
def test_a_bad_acceptance_out_is_refused_before_sending(
    name: str, value: torch.Tensor, needle: str
) -> None:
    step = make_step(seed=1)
    fields = {n: getattr(empty_acceptance(3, step.tree.draft_len), n) for n in ACCEPTANCE_NAMES}
    fields[name] = value
    with Client("127.0.0.1:1") as client, pytest.raises(InvalidArgumentError) as raised:
        client.accept_tree(step.tree, step.target_tokens, out=Acceptance(**fields), timeout_s=5)
    assert raised.value.field == f"accept_tree.out.{name}"
    assert needle in raised.value.message


@pytest.fixture
def address(tmp_path: Path) -> Iterator[str]:
    thread = ServerThread(ServiceConfig(listen=(f"unix:{tmp_path / 'out.sock'}",), device="cpu"))
    thread.start()
    yield thread.addresses[0]
    thread.stop()


def assert_same(got: object, expected: object, names: tuple[str, ...]) -> None:
    for name in names:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_inline_out_is_filled_and_returned(address: str) -> None:
    step = make_step(seed=4)
    with Client(address) as client:
        expected_tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET)
        out = step_tree_out(step)
        tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET, out=out)
        assert tree is out
        assert_same(tree, expected_tree, TREE_NAMES)

        expected = client.accept_tree(expected_tree, step.target_tokens)
        destination = empty_acceptance(3, tree.draft_len)
        acceptance = client.accept_tree(tree, step.target_tokens, out=destination)
        assert acceptance is destination
        assert int(expected.length.max()) > 1  # a path longer than the root was copied in
        assert_same(acceptance, expected, ACCEPTANCE_NAMES)


def test_a_prepared_build_inline_equals_the_plain_call_every_step(address: str) -> None:
    # Inline there is nothing to resend: every call is a plain one, with the tensors' current
    # contents, into ``out`` (whose tensors may even be given new storage between calls).
    first, second = make_step(seed=4), make_step(seed=5)
    logits, roots = first.draft_logits.clone(), first.root_tokens.clone()
    out = step_tree_out(first)
    with Client(address) as client:
        prepared = client.prepare_build_tree(logits, roots, BUDGET, out=out)
        for step in (first, second, first):
            logits.copy_(step.draft_logits)
            roots.copy_(step.root_tokens)
            expected = client.build_tree(logits, roots, BUDGET)
            assert prepared() is out
            assert_same(out, expected, TREE_NAMES)
        out.tokens.set_(torch.full_like(out.tokens, 7))
        assert prepared(timeout_s=30) is out
        assert_same(out, expected, TREE_NAMES)


def test_async_inline_out_is_filled_and_returned(address: str) -> None:
    step = make_step(seed=6)
    out = step_tree_out(step)
    destination = empty_acceptance(3, step.tree.draft_len)

    async def run() -> tuple[Tree, Acceptance]:
        async with AsyncClient(address) as client:
            tree = await client.build_tree(step.draft_logits, step.root_tokens, BUDGET, out=out)
            return tree, await client.accept_tree(tree, step.target_tokens, out=destination)

    tree, acceptance = asyncio.run(run())
    assert tree is out and acceptance is destination
    with Client(address) as client:
        expected_tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET)
        expected = client.accept_tree(expected_tree, step.target_tokens)
    assert_same(tree, expected_tree, TREE_NAMES)
    assert_same(acceptance, expected, ACCEPTANCE_NAMES)


def test_a_response_that_does_not_fit_out_leaves_it_untouched(address: str) -> None:
    step = make_step(seed=4)
    with Client(address) as client:
        tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET)
    message = _wire.encode_tree(tree)
    out = step_tree_out(step)
    small = replaced(out, mask=torch.zeros(3, 1 + BUDGET, 1, dtype=torch.int64))
    message.mask.shape[2] = 2  # the server sent two mask words where out holds one
    with pytest.raises(DDTreeClientError) as raised:
        _wire.decode_tree_into(message, small)
    assert raised.value.code == "DATA_LOSS" and "tree.mask" in raised.value.message
    assert bool((out.tokens == 7).all())  # checked before any copy
    assert _wire.decode_tree_into(_wire.encode_tree(tree), out) is out
    assert_same(out, tree, TREE_NAMES)
