"""Every malformed request gets its status code, stable reason and a message naming the field,
and the server goes on serving the next good request."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from helpers.service_inputs import BUDGET, V_DIM, Step, make_step
from helpers.serving import ServerThread

from ddtree.clients import Client, KvCommit
from ddtree.clients import _wire as wire
from ddtree.clients.errors import DDTreeClientError, InvalidArgumentError
from ddtree.service.config import ServiceConfig
from ddtree.v1 import tensor_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def step() -> Step:
    return make_step()


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.TreeSpeculationServiceStub]:
    with grpc.insecure_channel(server.addresses[0]) as channel:
        yield pb_grpc.TreeSpeculationServiceStub(channel)


def expect_error(
    call: Callable[[], Any], code: str, reason: str, field: str | None
) -> DDTreeClientError:
    """Run ``call``; it must fail with ``code`` and ``reason``, naming ``field``."""
    try:
        call()
    except grpc.RpcError as raw:
        error = wire.error_from_rpc(raw)
    except DDTreeClientError as raised:
        error = raised
    else:
        pytest.fail(f"expected {code} {reason}, the call succeeded")
    assert (error.code, error.reason) == (code, reason), error
    if field is not None:
        assert field in error.message, error.message
        assert error.field is not None and field.startswith(error.field), error
    assert error.request_id, "every error carries the request id of the server log"
    return error


def assert_still_serving(client: Client, step: Step) -> None:
    tree = client.build_tree(step.draft_logits, step.root_tokens, BUDGET)
    assert torch.equal(tree.tokens, step.tree.tokens)


def build_request(step: Step) -> pb.BuildTreeRequest:
    return wire.build_tree_request(
        step.draft_logits,
        step.root_tokens,
        BUDGET,
        temperature=1.0,
        max_budget=None,
        model="",
    )


BUILD_CASES = [
    pytest.param(
        lambda s: {"draft_logits": s.draft_logits.to(torch.int32)},
        "INVALID_TENSOR",
        "build_tree.draft_logits: expected dtype BFLOAT16/FLOAT16/FLOAT32, got INT32",
        id="logits-int32",
    ),
    pytest.param(
        lambda s: {"draft_logits": s.draft_logits[0]},
        "INVALID_TENSOR",
        "build_tree.draft_logits",
        id="logits-rank-2",
    ),
    pytest.param(
        lambda s: {"draft_logits": torch.zeros(3, 33, 5)},
        "INVALID_TENSOR",
        "build_tree.draft_logits",
        id="draft-len-33",
    ),
    pytest.param(
        lambda s: {"root_tokens": torch.zeros(4, dtype=torch.int64)},
        "INVALID_TENSOR",
        "build_tree.root_tokens",
        id="roots-batch-mismatch",
    ),
    pytest.param(
        lambda s: {"root_tokens": s.root_tokens.to(torch.int32)},
        "INVALID_TENSOR",
        "build_tree.root_tokens",
        id="roots-int32",
    ),
    pytest.param(
        lambda s: {"root_tokens": torch.tensor([0, 37, 1])},
        "INVALID_TOKEN",
        "build_tree.root_tokens[1]",
        id="root-out-of-vocab",
    ),
    pytest.param(
        lambda s: {"root_tokens": torch.tensor([0, 1, -2])},
        "INVALID_TOKEN",
        "build_tree.root_tokens[2]",
        id="root-negative",
    ),
    pytest.param(lambda s: {"budget": 0}, "VALUE_OUT_OF_RANGE", "build_tree.budget", id="budget-0"),
    pytest.param(
        lambda s: {"budget": 1025}, "VALUE_OUT_OF_RANGE", "build_tree.budget", id="budget-1025"
    ),
    pytest.param(
        lambda s: {"budget": torch.tensor([1, 0, 3])},
        "VALUE_OUT_OF_RANGE",
        "build_tree.budgets",
        id="budgets-0",
    ),
    pytest.param(
        lambda s: {"budget": 8, "max_budget": 4},
        "VALUE_OUT_OF_RANGE",
        "build_tree.max_budget",
        id="max-budget-below-budget",
    ),
    pytest.param(
        lambda s: {"temperature": 0.0},
        "VALUE_OUT_OF_RANGE",
        "build_tree.temperature",
        id="temperature-0",
    ),
    pytest.param(
        lambda s: {"temperature": float("nan")},
        "VALUE_OUT_OF_RANGE",
        "build_tree.temperature",
        id="temperature-nan",
    ),
    pytest.param(
        lambda s: {"model": "no spaces allowed"},
        "INVALID_MODEL_LABEL",
        "build_tree.model",
        id="model-label-space",
    ),
    pytest.param(
        lambda s: {"model": "m" * 65}, "INVALID_MODEL_LABEL", "build_tree.model", id="model-65"
    ),
]


@pytest.mark.parametrize(("change", "reason", "field"), BUILD_CASES)
def test_build_tree_rejects(
    client: Client, step: Step, change: Callable[[Step], dict[str, Any]], reason: str, field: str
) -> None:
    kwargs: dict[str, Any] = {
        "draft_logits": step.draft_logits,
        "root_tokens": step.root_tokens,
        "budget": BUDGET,
    }
    kwargs.update(change(step))
    expect_error(lambda: client.build_tree(**kwargs), "INVALID_ARGUMENT", reason, field)
    assert_still_serving(client, step)


def _unspecified_dtype(request: pb.BuildTreeRequest) -> None:
    request.draft_logits.dtype = tensor_pb2.DTYPE_UNSPECIFIED


def _short_bytes(request: pb.BuildTreeRequest) -> None:
    request.draft_logits.inline = request.draft_logits.inline[:-2]


def _negative_extent(request: pb.BuildTreeRequest) -> None:
    request.draft_logits.shape[0] = -3


def _no_data(request: pb.BuildTreeRequest) -> None:
    request.root_tokens.ClearField("inline")


def _no_logits(request: pb.BuildTreeRequest) -> None:
    request.ClearField("draft_logits")


def _no_budget(request: pb.BuildTreeRequest) -> None:
    request.ClearField("budget")


def _huge_shape(request: pb.BuildTreeRequest) -> None:
    request.draft_logits.shape[:] = [1 << 40, 1 << 40, 1 << 40]


def _ref_input(request: pb.BuildTreeRequest) -> None:
    request.root_tokens.ref.region_token = "not-a-region"


def _output_refs(request: pb.BuildTreeRequest) -> None:
    request.outputs.tokens.region_token = "not-a-region"


def _wait_event(request: pb.BuildTreeRequest) -> None:
    request.wait_event_ipc_handle = bytes(64)


WIRE_CASES = [
    (_unspecified_dtype, "INVALID_ARGUMENT", "INVALID_TENSOR", "build_tree.draft_logits.dtype"),
    (_short_bytes, "INVALID_ARGUMENT", "INVALID_TENSOR", "build_tree.draft_logits.inline"),
    (_negative_extent, "INVALID_ARGUMENT", "INVALID_TENSOR", "build_tree.draft_logits.shape"),
    (_no_data, "INVALID_ARGUMENT", "MISSING_FIELD", "build_tree.root_tokens"),
    (_no_logits, "INVALID_ARGUMENT", "MISSING_FIELD", "build_tree.draft_logits"),
    (_no_budget, "INVALID_ARGUMENT", "MISSING_FIELD", "build_tree.budget"),
    (_huge_shape, "INVALID_ARGUMENT", "TENSOR_TOO_LARGE", "build_tree.draft_logits"),
    (
        _ref_input,
        "FAILED_PRECONDITION",
        "MEMORY_REFERENCES_UNSUPPORTED",
        "build_tree.root_tokens.ref",
    ),
    (_output_refs, "FAILED_PRECONDITION", "MEMORY_REFERENCES_UNSUPPORTED", "build_tree.outputs"),
    (
        _wait_event,
        "FAILED_PRECONDITION",
        "EVENT_HANDLES_UNSUPPORTED",
        "build_tree.wait_event_ipc_handle",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "code", "reason", "field"), WIRE_CASES, ids=[c[0].__name__[1:] for c in WIRE_CASES]
)
def test_wire_level_errors(
    client: Client,
    stub: pb_grpc.TreeSpeculationServiceStub,
    step: Step,
    mutate: Callable[[pb.BuildTreeRequest], None],
    code: str,
    reason: str,
    field: str,
) -> None:
    request = build_request(step)
    mutate(request)
    expect_error(lambda: stub.BuildTree(request, timeout=10), code, reason, field)
    assert_still_serving(client, step)


def _malformed_parents(step: Step) -> dict[str, Any]:
    parents = step.tree.parents.clone()
    parents[1, 2] = 5  # a parent after its child
    return {"tree": replace(step.tree, parents=parents), "target_tokens": step.target_tokens}


def _bad_block_table(step: Step) -> dict[str, Any]:
    table = step.block_table.clone()
    table[2] = 10_000
    commit = KvCommit(step.kv_cache.clone(), table, step.prefix_lens)
    return {"tree": step.tree, "target_tokens": step.target_tokens, "kv_commit": commit}


def _negative_prefix(step: Step) -> dict[str, Any]:
    lens = torch.tensor([0, -1, 3], dtype=torch.int32)
    commit = KvCommit(step.kv_cache.clone(), step.block_table, lens)
    return {"tree": step.tree, "target_tokens": step.target_tokens, "kv_commit": commit}


ACCEPT_CASES = [
    pytest.param(
        lambda s: {"tree": s.tree},
        "MISSING_FIELD",
        "accept_tree.target",
        id="no-target",
    ),
    pytest.param(
        lambda s: {"tree": s.tree, "target_tokens": s.target_tokens, "temperature": 0.5},
        "VALUE_OUT_OF_RANGE",
        "accept_tree.temperature",
        id="sampling-without-logits",
    ),
    pytest.param(
        lambda s: {"tree": s.tree, "target_tokens": s.target_tokens[:, :-1]},
        "INVALID_TENSOR",
        "accept_tree.target_tokens",
        id="targets-too-short",
    ),
    pytest.param(
        lambda s: {
            "tree": replace(s.tree, mask=s.tree.mask.to(torch.int32)),
            "target_tokens": s.target_tokens,
        },
        "INVALID_TENSOR",
        "accept_tree.tree.mask",
        id="mask-int32",
    ),
    pytest.param(
        lambda s: {"tree": replace(s.tree, draft_len=0), "target_tokens": s.target_tokens},
        "VALUE_OUT_OF_RANGE",
        "accept_tree.tree.draft_len",
        id="draft-len-0",
    ),
    pytest.param(
        lambda s: {"tree": s.tree, "target_tokens": torch.full_like(s.target_tokens, -4)},
        "INVALID_TOKEN",
        "accept_tree.target_tokens[0]",
        id="negative-target-token",
    ),
    pytest.param(
        _malformed_parents, "INVALID_TREE", "accept_tree.tree[1]", id="parent-after-child"
    ),
    pytest.param(
        _bad_block_table,
        "INVALID_BLOCK_TABLE",
        "accept_tree.kv_commit.block_table[2]",
        id="block-table",
    ),
    pytest.param(
        _negative_prefix, "INVALID_LENGTH", "accept_tree.kv_commit.prefix_lens[1]", id="prefix-len"
    ),
]


@pytest.mark.parametrize(("make", "reason", "field"), ACCEPT_CASES)
def test_accept_tree_rejects(
    client: Client, step: Step, make: Callable[[Step], dict[str, Any]], reason: str, field: str
) -> None:
    kwargs = make(step)
    tree = kwargs.pop("tree")
    expect_error(lambda: client.accept_tree(tree, **kwargs), "INVALID_ARGUMENT", reason, field)
    assert_still_serving(client, step)


VERIFY_CASES = [
    pytest.param(lambda s: {"q": s.q.float()}, "INVALID_TENSOR", "verify_attention.q", id="q-fp32"),
    pytest.param(
        lambda s: {"kv_cache": s.kv_cache[..., :-1]},
        "INVALID_TENSOR",
        "verify_attention.kv_cache",
        id="head-dim-mismatch",
    ),
    pytest.param(
        lambda s: {"v_dim": 10_000}, "VALUE_OUT_OF_RANGE", "verify_attention.v_dim", id="v-dim"
    ),
    pytest.param(
        lambda s: {"sm_scale": -1.0},
        "VALUE_OUT_OF_RANGE",
        "verify_attention.sm_scale",
        id="sm-scale",
    ),
    pytest.param(
        lambda s: {"block_table": torch.full_like(s.block_table, -1)},
        "INVALID_BLOCK_TABLE",
        "verify_attention.block_table[0]",
        id="block-table",
    ),
]


@pytest.mark.parametrize(("change", "reason", "field"), VERIFY_CASES)
def test_verify_attention_rejects(
    client: Client, step: Step, change: Callable[[Step], dict[str, Any]], reason: str, field: str
) -> None:
    kwargs: dict[str, Any] = {
        "q": step.q,
        "kv_cache": step.kv_cache,
        "block_table": step.block_table,
        "prefix_lens": step.prefix_lens,
        "tree": step.tree,
        "v_dim": V_DIM,
    }
    kwargs.update(change(step))
    expect_error(lambda: client.verify_attention(**kwargs), "INVALID_ARGUMENT", reason, field)
    assert_still_serving(client, step)


def test_memory_registration_is_refused_until_supported(
    client: Client, stub: pb_grpc.TreeSpeculationServiceStub, step: Step
) -> None:
    register = pb.RegisterMemoryRequest(ipc_handle=bytes(64), device_uuid="cpu", byte_size=64)
    error = expect_error(
        lambda: stub.RegisterMemory(register, timeout=10),
        "FAILED_PRECONDITION",
        "MEMORY_REGISTRATION_UNSUPPORTED",
        None,
    )
    assert "inline" in error.message
    expect_error(
        lambda: stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token="x"), timeout=10),
        "NOT_FOUND",
        "MEMORY_TOKEN_NOT_FOUND",
        "unregister_memory.region_token",
    )
    assert list(stub.ListMemory(pb.ListMemoryRequest(client_id="me"), timeout=10).regions) == []
    assert_still_serving(client, step)


def test_message_over_the_size_limit_is_refused(tmp_path: Path, step: Step) -> None:
    config = ServiceConfig(
        listen=("127.0.0.1:0",), device="cpu", max_message_bytes=1 << 20, max_tensor_bytes=1 << 30
    )
    thread = ServerThread(config)
    thread.start()
    try:
        with Client(thread.addresses[0], max_message_bytes=64 << 20) as client:
            big = torch.zeros(1, 1, 300_000)  # 1.2 MB of logits
            with pytest.raises(DDTreeClientError) as raised:
                client.build_tree(big, torch.zeros(1, dtype=torch.int64), 1)
            assert raised.value.code == "RESOURCE_EXHAUSTED"
            assert_still_serving(client, step)
    finally:
        thread.stop()


def test_tensor_and_batch_limits(tmp_path: Path, step: Step) -> None:
    config = ServiceConfig(
        listen=(f"unix:{tmp_path / 's.sock'}",),
        device="cpu",
        max_tensor_bytes=4096,
        max_batch_size=2,
    )
    thread = ServerThread(config)
    thread.start()
    try:
        with Client(thread.addresses[0]) as client:
            expect_error(
                lambda: client.build_tree(
                    torch.zeros(2, 4, 600), torch.zeros(2, dtype=torch.int64), 3
                ),
                "INVALID_ARGUMENT",
                "TENSOR_TOO_LARGE",
                "build_tree.draft_logits",
            )
            expect_error(
                lambda: client.build_tree(
                    torch.zeros(3, 1, 4), torch.zeros(3, dtype=torch.int64), 2
                ),
                "INVALID_ARGUMENT",
                "TENSOR_TOO_LARGE",
                "build_tree.draft_logits",
            )
            tree = client.build_tree(torch.zeros(2, 1, 4), torch.zeros(2, dtype=torch.int64), 2)
            assert tree.num_nodes.tolist() == [3, 3]
    finally:
        thread.stop()


def test_both_targets_are_refused_before_sending(client: Client, step: Step) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        client.accept_tree(
            step.tree, step.target_tokens, target_logits=step.target_logits, timeout_s=5
        )
    assert raised.value.reason == "MISSING_FIELD"
    assert raised.value.field == "accept_tree.target"
    assert_still_serving(client, step)
