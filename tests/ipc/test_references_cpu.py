"""Every RPC with tensor references, through a real gRPC server, without a GPU.

The server's engine runs on the CPU with a ``HostMapper``: "caller memory" is a host buffer the
test registers, requests name tensors in it by ``TensorRef``, and the service reads inputs and
writes outputs (tree, acceptance, attention output, KV cache) in place there. Results must equal
the inline path of the same server exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2, status_pb2
from helpers.ipc import HostMapper
from helpers.service_inputs import BUDGET, V_DIM, Step, make_step
from helpers.serving import ServerThread
from prometheus_client import CollectorRegistry

from ddtree.clients import Client, KvCommit
from ddtree.service.config import ServiceConfig
from ddtree.service.convert import TORCH_TO_DTYPE
from ddtree.service.engine import Engine
from ddtree.service.metrics import Metrics
from ddtree.v1 import tensor_pb2, tree_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

TREE_NAMES = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")
ACCEPTANCE_NAMES = ("nodes", "tokens", "length", "bonus")


class Arena:
    """A registered host buffer standing in for a caller's GPU allocation."""

    def __init__(self, stub: pb_grpc.TreeSpeculationServiceStub, mapper: HostMapper) -> None:
        self.buffer = torch.zeros(1 << 20, dtype=torch.uint8)
        handle = mapper.export(self.buffer)
        response = stub.RegisterMemory(
            pb.RegisterMemoryRequest(
                ipc_handle=handle, device_uuid="cpu", byte_size=self.buffer.numel(), client_id="t"
            ),
            timeout=10,
        )
        self.token = response.region_token
        self._used = 0
        self._offsets: dict[int, int] = {}

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor living in the buffer, 64-byte aligned."""
        offset = (self._used + 63) // 64 * 64
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self._used = offset + size
        view = self.buffer[offset : offset + size].view(dtype).view(shape)
        self._offsets[view.data_ptr()] = offset
        return view

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        view = self.alloc(tuple(tensor.shape), tensor.dtype)
        view.copy_(tensor)
        return view

    def ref(self, view: torch.Tensor, offset_delta: int = 0) -> tensor_pb2.TensorRef:
        offset = self._offsets[view.data_ptr()] + offset_delta
        return tensor_pb2.TensorRef(region_token=self.token, offset_bytes=offset)

    def tensor(self, view: torch.Tensor) -> tensor_pb2.Tensor:
        return tensor_pb2.Tensor(
            dtype=TORCH_TO_DTYPE[view.dtype], shape=list(view.shape), ref=self.ref(view)
        )


@pytest.fixture
def mapper() -> HostMapper:
    return HostMapper()


@pytest.fixture
def server(tmp_path: Path, mapper: HostMapper) -> Iterator[ServerThread]:
    engine = Engine(device="cpu", backend="reference", ipc_mapper=mapper)
    thread = ServerThread(
        ServiceConfig(listen=(f"unix:{tmp_path / 'ipc.sock'}",), device="cpu"), engine=engine
    )
    thread.start()
    yield thread
    thread.stop()


@pytest.fixture
def stub(server: ServerThread) -> Iterator[pb_grpc.TreeSpeculationServiceStub]:
    with grpc.insecure_channel(server.addresses[0]) as channel:
        yield pb_grpc.TreeSpeculationServiceStub(channel)


@pytest.fixture
def client(server: ServerThread) -> Iterator[Client]:
    with Client(server.addresses[0]) as connected:
        yield connected


@pytest.fixture
def step() -> Step:
    return make_step(seed=5)


def tree_message(arena: Arena, tree: object) -> tree_pb2.Tree:
    views = {name: arena.put(getattr(tree, name)) for name in TREE_NAMES}
    return tree_pb2.Tree(
        draft_len=tree.draft_len,  # type: ignore[attr-defined]
        **{name: arena.tensor(view) for name, view in views.items()},
    )


def build_tree_in(
    arena: Arena, step: Step
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], pb.BuildTreeRequest]:
    """``step``'s logits (bf16) and root tokens put into ``arena``, destinations for its tree
    allocated there, and the BuildTree request naming all of them by reference."""
    logits = arena.put(step.draft_logits.to(torch.bfloat16))
    roots = arena.put(step.root_tokens)
    batch, nodes = step.tree.tokens.shape
    outputs = {
        "tokens": arena.alloc((batch, nodes), torch.int64),
        "parents": arena.alloc((batch, nodes), torch.int32),
        "depths": arena.alloc((batch, nodes), torch.int32),
        "log_probs": arena.alloc((batch, nodes), torch.float32),
        "num_nodes": arena.alloc((batch,), torch.int32),
        "mask": arena.alloc((batch, nodes, step.tree.mask.shape[2]), torch.int64),
    }
    request = pb.BuildTreeRequest(
        draft_logits=arena.tensor(logits),
        root_tokens=arena.tensor(roots),
        budget=BUDGET,
        outputs=tree_pb2.TreeOutputRefs(
            **{name: arena.ref(view) for name, view in outputs.items()}
        ),
    )
    return logits, roots, outputs, request


def reason_of(error: grpc.RpcError) -> tuple[str, str, str]:
    """``(code, ErrorInfo.reason, BadRequest field)`` of a failed call."""
    reason = field = ""
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key != "grpc-status-details-bin":
            continue
        for detail in status_pb2.Status.FromString(value).details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                field = bad.field_violations[0].field
    return error.code().name, reason, field  # type: ignore[attr-defined]


def test_server_reports_reference_support(client: Client) -> None:
    assert client.server_info().supports_memory_references is True


def test_build_tree_writes_the_tree_into_caller_memory(
    stub: pb_grpc.TreeSpeculationServiceStub, mapper: HostMapper, client: Client, step: Step
) -> None:
    arena = Arena(stub, mapper)
    _, _, outputs, request = build_tree_in(arena, step)
    response = stub.BuildTree(request, timeout=30)
    expected = client.build_tree(step.draft_logits.to(torch.bfloat16), step.root_tokens, BUDGET)
    for name in TREE_NAMES:
        message = getattr(response.tree, name)
        assert message.WhichOneof("data") == "ref"
        assert message.ref == getattr(request.outputs, name)
        assert list(message.shape) == list(outputs[name].shape)
        assert torch.equal(outputs[name], getattr(expected, name)), name
    assert response.tree.draft_len == expected.draft_len


def test_a_repeated_request_reads_the_inputs_anew_each_time(
    stub: pb_grpc.TreeSpeculationServiceStub, mapper: HostMapper, client: Client
) -> None:
    """The same request bytes every step, as a caller with static buffers sends them (the
    server reuses its decoded call): each answer is computed from the memory's contents at that
    call, and once the region is unregistered the same bytes are refused."""
    arena = Arena(stub, mapper)
    logits, roots, outputs, request = build_tree_in(arena, make_step(seed=5))
    for seed in (5, 6, 7):
        step = make_step(seed=seed)
        logits.copy_(step.draft_logits.to(torch.bfloat16))
        roots.copy_(step.root_tokens)
        stub.BuildTree(request, timeout=30)
        expected = client.build_tree(step.draft_logits.to(torch.bfloat16), step.root_tokens, BUDGET)
        for name in TREE_NAMES:
            assert torch.equal(outputs[name], getattr(expected, name)), (seed, name)
    stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=arena.token), timeout=10)
    with pytest.raises(grpc.RpcError) as raised:
        stub.BuildTree(request, timeout=30)
    assert reason_of(raised.value)[:2] == ("NOT_FOUND", "MEMORY_TOKEN_NOT_FOUND")


def test_accept_tree_compacts_the_kv_cache_in_place(
    stub: pb_grpc.TreeSpeculationServiceStub, mapper: HostMapper, client: Client, step: Step
) -> None:
    arena = Arena(stub, mapper)
    cache = arena.put(step.kv_cache)
    path = (step.tree.batch_size, step.tree.draft_len + 1)
    outputs = {
        "nodes": arena.alloc(path, torch.int32),
        "tokens": arena.alloc(path, torch.int64),
        "length": arena.alloc(path[:1], torch.int32),
        "bonus": arena.alloc(path[:1], torch.int64),
    }
    request = pb.AcceptTreeRequest(
        tree=tree_message(arena, step.tree),
        target_tokens=arena.tensor(arena.put(step.target_tokens)),
        kv_commit=pb.KvCommit(
            kv_cache=arena.tensor(cache),
            block_table=arena.tensor(arena.put(step.block_table)),
            prefix_lens=arena.tensor(arena.put(step.prefix_lens)),
        ),
        outputs=tree_pb2.AcceptanceOutputRefs(
            **{name: arena.ref(view) for name, view in outputs.items()}
        ),
    )
    response = stub.AcceptTree(request, timeout=30)
    assert not response.HasField("kv_cache")  # compacted in place, nothing sent back
    inline_cache = step.kv_cache.clone()
    expected = client.accept_tree(
        step.tree,
        step.target_tokens,
        kv_commit=KvCommit(inline_cache, step.block_table, step.prefix_lens),
    )
    assert int(expected.length.max()) > 1  # the commit moved latents
    assert torch.equal(cache, inline_cache)
    for name in ACCEPTANCE_NAMES:
        assert response.acceptance.__getattribute__(name).WhichOneof("data") == "ref"
        assert torch.equal(outputs[name], getattr(expected, name)), name


@pytest.mark.parametrize("lse_by_ref", [True, False], ids=["out-and-lse", "out-only"])
def test_verify_attention_writes_out_and_lse(
    stub: pb_grpc.TreeSpeculationServiceStub,
    mapper: HostMapper,
    client: Client,
    step: Step,
    lse_by_ref: bool,
) -> None:
    arena = Arena(stub, mapper)
    batch, nodes, heads, _ = step.q.shape
    out = arena.alloc((batch, nodes, heads, V_DIM), torch.bfloat16)
    lse = arena.alloc((batch, nodes, heads), torch.float32)
    request = pb.VerifyAttentionRequest(
        q=arena.tensor(arena.put(step.q)),
        kv_cache=arena.tensor(arena.put(step.kv_cache)),
        block_table=arena.tensor(arena.put(step.block_table)),
        prefix_lens=arena.tensor(arena.put(step.prefix_lens)),
        tree=tree_message(arena, step.tree),
        v_dim=V_DIM,
        out_ref=arena.ref(out),
    )
    if lse_by_ref:
        request.lse_ref.CopyFrom(arena.ref(lse))
    response = stub.VerifyAttention(request, timeout=30)
    expected_out, expected_lse = client.verify_attention(
        step.q, step.kv_cache, step.block_table, step.prefix_lens, step.tree, v_dim=V_DIM
    )
    assert response.out.WhichOneof("data") == "ref"
    assert torch.equal(out, expected_out)
    if lse_by_ref:
        assert response.lse.WhichOneof("data") == "ref"
        assert torch.equal(lse, expected_lse)
    else:
        returned = torch.frombuffer(bytearray(response.lse.inline), dtype=torch.float32)
        assert torch.equal(returned.view(expected_lse.shape), expected_lse)


def test_bad_references_are_refused_and_the_server_keeps_serving(
    stub: pb_grpc.TreeSpeculationServiceStub, mapper: HostMapper, client: Client, step: Step
) -> None:
    arena = Arena(stub, mapper)
    logits = arena.put(step.draft_logits)
    roots = arena.put(step.root_tokens)

    def request(**changes: object) -> pb.BuildTreeRequest:
        message = pb.BuildTreeRequest(
            draft_logits=arena.tensor(logits), root_tokens=arena.tensor(roots), budget=BUDGET
        )
        for name, value in changes.items():
            getattr(message, name).CopyFrom(value)
        return message

    far = tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT32,
        shape=list(logits.shape),
        ref=tensor_pb2.TensorRef(region_token=arena.token, offset_bytes=(1 << 20) - 64),
    )
    misaligned = arena.tensor(logits)
    misaligned.ref.offset_bytes += 2
    wrapping = arena.tensor(logits)
    wrapping.ref.offset_bytes = (1 << 64) - 4
    unknown = arena.tensor(logits)
    unknown.ref.region_token = "not-a-token"
    budgets = arena.tensor(arena.put(torch.full((3,), BUDGET, dtype=torch.int32)))
    partial = tree_pb2.TreeOutputRefs(tokens=arena.ref(logits))
    cases = [
        (request(draft_logits=far), "INVALID_ARGUMENT", "INVALID_REFERENCE"),
        (request(draft_logits=misaligned), "INVALID_ARGUMENT", "INVALID_REFERENCE"),
        (request(draft_logits=wrapping), "INVALID_ARGUMENT", "INVALID_REFERENCE"),
        (request(draft_logits=unknown), "NOT_FOUND", "MEMORY_TOKEN_NOT_FOUND"),
        (request(budgets=budgets), "INVALID_ARGUMENT", "INVALID_REFERENCE"),
        (request(outputs=partial), "INVALID_ARGUMENT", "MISSING_FIELD"),
    ]
    for message, code, reason in cases:
        with pytest.raises(grpc.RpcError) as raised:
            stub.BuildTree(message, timeout=30)
        got_code, got_reason, field = reason_of(raised.value)
        assert (got_code, got_reason) == (code, reason), raised.value.details()
        assert field.startswith("build_tree."), field
        assert arena.token not in raised.value.details()
    # Refused calls hold no lease: unregistering closes the mapping at once.
    assert stub.BuildTree(request(), timeout=30).tree.num_nodes.inline
    stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=arena.token), timeout=10)
    assert mapper.mapped == 0
    assert client.health() == "SERVING"


def test_list_and_unregister(stub: pb_grpc.TreeSpeculationServiceStub, mapper: HostMapper) -> None:
    first = Arena(stub, mapper)
    Arena(stub, mapper)
    listed = stub.ListMemory(pb.ListMemoryRequest(client_id="t"), timeout=10).regions
    assert [r.byte_size for r in listed] == [1 << 20, 1 << 20]
    assert all(r.device_uuid == "cpu" and len(r.region_id) == 16 for r in listed)
    assert first.token not in str(listed)
    stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=first.token), timeout=10)
    listed = stub.ListMemory(pb.ListMemoryRequest(client_id="t"), timeout=10).regions
    assert len(listed) == 1 and mapper.mapped == 1
    with pytest.raises(grpc.RpcError) as raised:
        stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=first.token), timeout=10)
    assert reason_of(raised.value)[:2] == ("NOT_FOUND", "MEMORY_TOKEN_NOT_FOUND")


def test_registered_memory_gauges_follow_the_table(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    mapper = HostMapper()
    engine = Engine(device="cpu", backend="reference", ipc_mapper=mapper, observer=metrics)
    try:
        buffer = torch.zeros(4096, dtype=torch.uint8)
        token, _ = engine.register_memory(mapper.export(buffer), "cpu", 4096, "g").result()

        def gauge(name: str) -> float | None:
            return registry.get_sample_value(name, {"device": "cpu"})

        assert gauge("ddtree_registered_regions") == 1
        assert gauge("ddtree_registered_bytes") == 4096
        engine.unregister_memory(token)
        assert gauge("ddtree_registered_regions") == 0
        assert gauge("ddtree_registered_bytes") == 0
    finally:
        engine.close()
