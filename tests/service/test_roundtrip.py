"""Every op over real gRPC (TCP and Unix socket) equals the reference and the embedded client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers.service_inputs import BUDGET, V_DIM, Step, make_step
from helpers.serving import ServerThread

from ddtree import kernels
from ddtree.clients import AsyncClient, Client, EmbeddedClient, KvCommit
from ddtree.kernels.types import Acceptance, Tree


@pytest.fixture(scope="module")
def embedded() -> Iterator[EmbeddedClient]:
    with EmbeddedClient(device="cpu") as client:
        yield client


@pytest.fixture(scope="module")
def step() -> Step:
    return make_step()


def assert_trees_equal(got: Tree, want: Tree) -> None:
    for name in ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.draft_len == want.draft_len


def assert_acceptances_equal(got: Acceptance, want: Acceptance) -> None:
    for name in ("nodes", "tokens", "length", "bonus"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_server_info_names_devices_and_limits(client: Client) -> None:
    info = client.server_info()
    assert info.devices[0].uuid == "cpu"
    assert info.devices[0].backend == "reference"
    assert info.limits.max_budget == 1024
    assert info.limits.max_draft_len == 32
    assert info.limits.max_message_bytes == 512 << 20
    assert info.limits.max_channels == 0  # doorbell channels need a CUDA device
    assert info.supports_memory_references is False


def test_health_is_serving(client: Client) -> None:
    assert client.health() == "SERVING"
    assert client.health("ddtree.v1.TreeSpeculationService") == "SERVING"


def test_build_tree_matches_reference_and_embedded(
    client: Client, embedded: EmbeddedClient, step: Step
) -> None:
    want = kernels.build_tree(step.draft_logits, step.root_tokens, BUDGET, backend="reference")
    assert_trees_equal(client.build_tree(step.draft_logits, step.root_tokens, BUDGET), want)
    assert_trees_equal(embedded.build_tree(step.draft_logits, step.root_tokens, BUDGET), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_build_tree_half_precision_logits(
    client: Client, embedded: EmbeddedClient, step: Step, dtype: torch.dtype
) -> None:
    logits = step.draft_logits.to(dtype)
    want = kernels.build_tree(logits, step.root_tokens, 5, temperature=0.7, backend="reference")
    got = client.build_tree(logits, step.root_tokens, 5, temperature=0.7)
    assert_trees_equal(got, want)
    assert_trees_equal(embedded.build_tree(logits, step.root_tokens, 5, temperature=0.7), want)


def test_build_tree_per_request_budgets(
    client: Client, embedded: EmbeddedClient, step: Step
) -> None:
    budgets = torch.tensor([1, 4, 7], dtype=torch.int32)
    want = kernels.build_tree(
        step.draft_logits, step.root_tokens, budgets, max_budget=8, backend="reference"
    )
    got = client.build_tree(step.draft_logits, step.root_tokens, budgets, max_budget=8)
    assert got.num_nodes_max == 9
    assert_trees_equal(got, want)
    assert_trees_equal(
        embedded.build_tree(step.draft_logits, step.root_tokens, budgets, max_budget=8), want
    )


def test_accept_greedy_tokens(client: Client, embedded: EmbeddedClient, step: Step) -> None:
    want = kernels.accept(step.tree, step.target_tokens, backend="reference")
    assert int(want.length.max()) > 1, "inputs should accept at least one draft token"
    assert_acceptances_equal(client.accept_tree(step.tree, step.target_tokens), want)
    assert_acceptances_equal(embedded.accept_tree(step.tree, step.target_tokens), want)


def test_accept_sampled_with_seed_is_reproducible_and_matches_embedded(
    client: Client, embedded: EmbeddedClient, step: Step
) -> None:
    kwargs = {"target_logits": step.target_logits, "temperature": 0.9, "seed": 1234}
    first = client.accept_tree(step.tree, **kwargs)
    assert_acceptances_equal(client.accept_tree(step.tree, **kwargs), first)
    assert_acceptances_equal(embedded.accept_tree(step.tree, **kwargs), first)
    generator = torch.Generator().manual_seed(1234)
    want = kernels.accept(
        step.tree,
        target_logits=step.target_logits,
        temperature=0.9,
        generator=generator,
        backend="reference",
    )
    assert_acceptances_equal(first, want)


def test_accept_with_kv_commit_compacts_the_callers_cache_in_place(
    client: Client, embedded: EmbeddedClient, step: Step
) -> None:
    want_cache = step.kv_cache.clone()
    want = kernels.accept(step.tree, step.target_tokens, backend="reference")
    kernels.commit_kv(want_cache, step.block_table, step.prefix_lens, want, backend="reference")
    assert not torch.equal(want_cache, step.kv_cache), "the commit should move latents"
    for tree_client in (client, embedded):
        cache = step.kv_cache.clone()
        commit = KvCommit(cache, step.block_table, step.prefix_lens)
        got = tree_client.accept_tree(step.tree, step.target_tokens, kv_commit=commit)
        assert_acceptances_equal(got, want)
        assert torch.equal(cache, want_cache), type(tree_client).__name__


def test_verify_attention_matches_reference_and_embedded(
    client: Client, embedded: EmbeddedClient, step: Step
) -> None:
    args = (step.q, step.kv_cache, step.block_table, step.prefix_lens, step.tree)
    want_out, want_lse = kernels.verify_attention(*args, v_dim=V_DIM, backend="reference")
    for tree_client in (client, embedded):
        out, lse = tree_client.verify_attention(*args, v_dim=V_DIM)
        assert torch.equal(out, want_out)
        assert torch.equal(lse, want_lse)
    out, _ = client.verify_attention(*args, v_dim=V_DIM, sm_scale=0.5)
    want_scaled, _ = kernels.verify_attention(*args, v_dim=V_DIM, sm_scale=0.5, backend="reference")
    assert torch.equal(out, want_scaled)


def test_async_client_gives_the_same_results(server: ServerThread, step: Step) -> None:
    async def run() -> tuple[Tree, Acceptance, str]:
        async with AsyncClient(server.addresses[0]) as client:
            tree = await client.build_tree(step.draft_logits, step.root_tokens, BUDGET)
            acceptance = await client.accept_tree(tree, step.target_tokens)
            await client.verify_attention(
                step.q, step.kv_cache, step.block_table, step.prefix_lens, tree, v_dim=V_DIM
            )
            return tree, acceptance, await client.health()

    tree, acceptance, health = asyncio.run(run())
    assert_trees_equal(tree, step.tree)
    assert_acceptances_equal(
        acceptance, kernels.accept(step.tree, step.target_tokens, backend="reference")
    )
    assert health == "SERVING"


def test_model_label_is_accepted(client: Client, step: Step) -> None:
    tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET, model="kimi-k2:v1.5")
    assert_trees_equal(tree, step.tree)


def test_large_inline_tensors_round_trip(client: Client, step: Step) -> None:
    # Over 1 MiB each way: converted on a helper thread instead of the event loop.
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 2, 300_000, generator=generator)
    roots = torch.tensor([299_999])
    want = kernels.build_tree(logits, roots, 4, backend="reference")
    assert_trees_equal(client.build_tree(logits, roots, 4), want)
    cache = torch.randn(64, 16, 576, generator=generator).to(torch.bfloat16)
    table = torch.arange(64, dtype=torch.int32).reshape(2, 32)[:1]
    lens = torch.tensor([100], dtype=torch.int32)
    targets = torch.zeros(1, want.num_nodes_max, dtype=torch.int64)
    targets[0, 0] = want.tokens[0, 2]
    want_cache = cache.clone()
    accepted = kernels.accept(want, targets, backend="reference")
    kernels.commit_kv(want_cache, table, lens, accepted, backend="reference")
    assert accepted.nodes[0, :2].tolist() == [0, 2], "node 2 moves to position 1"
    got = client.accept_tree(want, targets, kv_commit=KvCommit(cache, table, lens))
    assert_acceptances_equal(got, accepted)
    assert torch.equal(cache, want_cache)


def test_reflection_lists_the_services(server: ServerThread) -> None:
    with grpc.insecure_channel(server.addresses[0]) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in response.list_services_response.service}
    assert {"ddtree.v1.TreeSpeculationService", "grpc.health.v1.Health"} <= names
