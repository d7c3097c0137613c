"""The embedded client: same errors as the remote one, health, info and shutdown."""

from __future__ import annotations

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
