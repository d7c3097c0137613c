"""The embedded client: same errors as the remote one, health, info and shutdown."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from helpers.service_inputs import BUDGET, Step, make_step

from ddtree.clients import EmbeddedClient
from ddtree.clients.errors import InvalidArgumentError, UnavailableError


@pytest.fixture(scope="module")
def step() -> Step:
    return make_step()


@pytest.fixture
def client() -> Iterator[EmbeddedClient]:
    with EmbeddedClient(device="cpu", max_batch_size=8) as embedded:
        yield embedded


def test_info_and_health(client: EmbeddedClient) -> None:
    info = client.server_info()
    assert info.devices[0].uuid == "cpu"
    assert info.limits.max_batch_size == 8
    assert client.health() == "SERVING"


@pytest.mark.parametrize(
    ("kwargs", "reason", "field"),
    [
        ({"budget": 2000}, "VALUE_OUT_OF_RANGE", "build_tree.budget"),
        ({"root_tokens": torch.tensor([0, 1, 99])}, "INVALID_TOKEN", "build_tree.root_tokens"),
        ({"draft_logits": torch.zeros(9, 2, 5)}, "TENSOR_TOO_LARGE", "build_tree.draft_logits"),
        ({"model": "bad label"}, "INVALID_MODEL_LABEL", "build_tree.model"),
    ],
    ids=["budget", "token", "batch", "model"],
)
def test_errors_match_the_remote_mapping(
    client: EmbeddedClient, step: Step, kwargs: dict[str, object], reason: str, field: str
) -> None:
    arguments: dict[str, object] = {
        "draft_logits": step.draft_logits,
        "root_tokens": step.root_tokens,
        "budget": BUDGET,
    }
    arguments.update(kwargs)
    with pytest.raises(InvalidArgumentError) as raised:
        client.build_tree(**arguments)  # type: ignore[arg-type]
    assert (raised.value.code, raised.value.reason, raised.value.field) == (
        "INVALID_ARGUMENT",
        reason,
        field,
    )
    assert raised.value.message.startswith(field)
    tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET)
    assert torch.equal(tree.tokens, step.tree.tokens)


def _poisoned(result: object) -> object:
    """A destination of ``result``'s shapes and dtypes, every element a marker value."""
    fields = {
        name: torch.full_like(value, 77)
        for name, value in vars(result).items()
        if isinstance(value, torch.Tensor)
    }
    return dataclasses.replace(result, **fields)  # type: ignore[type-var]


def test_out_receives_the_results(client: EmbeddedClient, step: Step) -> None:
    """``out=`` as on the remote client: the same values, ``out`` returned, calls repeated."""
    expected_tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET)
    expected = client.accept_tree(expected_tree, step.target_tokens)
    tree_out, acceptance_out = _poisoned(expected_tree), _poisoned(expected)
    for _ in range(2):
        tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET, out=tree_out)
        acceptance = client.accept_tree(tree, step.target_tokens, out=acceptance_out)
        assert tree is tree_out and acceptance is acceptance_out
        for name in ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask"):
            assert torch.equal(getattr(tree, name), getattr(expected_tree, name)), name
        for name in ("nodes", "tokens", "length", "bonus"):
            assert torch.equal(getattr(acceptance, name), getattr(expected, name)), name


def test_out_is_checked_and_left_untouched_on_an_error(client: EmbeddedClient, step: Step) -> None:
    tree_out = _poisoned(client.build_tree(step.draft_logits, step.root_tokens, BUDGET))
    bad = dataclasses.replace(tree_out, mask=tree_out.mask[:, :, :0])  # type: ignore[type-var]
    with pytest.raises(InvalidArgumentError) as raised:
        client.build_tree(step.draft_logits, step.root_tokens, BUDGET, out=bad)
    assert raised.value.field == "build_tree.out.mask"
    roots = step.root_tokens.clone()
    roots[-1] = 10**6
    with pytest.raises(InvalidArgumentError) as raised:
        client.build_tree(step.draft_logits, roots, BUDGET, out=tree_out)
    assert raised.value.reason == "INVALID_TOKEN"
    for value in vars(tree_out).values():
        if isinstance(value, torch.Tensor):
            assert bool((value == 77).all())


def test_closed_client_refuses_calls(step: Step) -> None:
    client = EmbeddedClient(device="cpu")
    client.close()
    assert client.health() == "NOT_SERVING"
    with pytest.raises(UnavailableError) as raised:
        client.build_tree(step.draft_logits, step.root_tokens, BUDGET)
    assert raised.value.reason == "SHUTTING_DOWN"


@pytest.mark.gpu
def test_cuda_inputs_written_on_the_callers_stream_are_read_after_the_writes() -> None:
    """The engine works on its own stream: it must see what the caller's stream wrote last."""
    from ddtree.kernels import reference

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(7)
    with EmbeddedClient(device="cuda:0") as client:
        side = torch.cuda.Stream(device)
        for _ in range(5):
            with torch.cuda.stream(side):
                logits = torch.full((8, 16, 32000), float("nan"), device=device)
                # A slow write the engine would race without the stream ordering.
                big = torch.randn(4096, 4096, device=device, generator=generator)
                for _ in range(8):
                    big = big @ big / 64.0
                logits.copy_(torch.randn(8, 16, 32000, device=device, generator=generator))
                roots = torch.zeros(8, dtype=torch.int64, device=device)
                tree = client.build_tree(logits, roots, 64)
            expected = reference.build_tree(logits, roots, 64)
            assert torch.equal(tree.num_nodes, expected.num_nodes)
            assert torch.equal(tree.tokens[:, :1], expected.tokens[:, :1])
            assert torch.isfinite(tree.log_probs[:, 1:2]).all()
