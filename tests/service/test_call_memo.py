"""Decoded by-reference calls reused by request bytes (``ddtree.service.call_memo``), on CPU.

A kept call must be reused only for the same caller and the same bytes, must lease its regions
again on every reuse, and must never outlive the registration it was decoded against.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import NamedTuple

import pytest
import torch
from helpers.ipc import HostMapper

from ddtree.kernels.types import TREE_FIELDS
from ddtree.service import convert
from ddtree.service.call_memo import DecodedCalls
from ddtree.service.calls import BuildTreeCall, CallLimits
from ddtree.service.config import ServiceConfig
from ddtree.service.engine import Engine
from ddtree.service.errors import InvalidArgument, MemoryTokenNotFound
from ddtree.service.memory import MemoryLimits, RegionTable
from ddtree.service.servicer import TreeSpeculationServicer
from ddtree.v1 import tensor_pb2, tree_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb

UUID = "GPU-test-0000"


def make_resolver(
    mapper: HostMapper, owner: str = "unix", **limits: bool
) -> tuple[convert.TensorResolver, RegionTable]:
    table = RegionTable(
        device=torch.device("cpu"),
        device_uuid=UUID,
        mapper=mapper,
        limits=MemoryLimits(**limits),  # type: ignore[arg-type]
    )
    return convert.TensorResolver(CallLimits(), table, owner), table


def register(table: RegionTable, mapper: HostMapper, owner: str = "unix") -> str:
    handle = mapper.export(torch.zeros(1 << 16, dtype=torch.uint8))
    token, _ = table.register(handle, UUID, 1 << 16, "t", owner)
    return token


class Region(NamedTuple):
    """A host-memory region registered by the default caller ("unix"), and its resolver."""

    mapper: HostMapper
    resolver: convert.TensorResolver
    table: RegionTable
    token: str


@pytest.fixture
def region() -> Region:
    mapper = HostMapper()
    resolver, table = make_resolver(mapper)
    return Region(mapper, resolver, table, register(table, mapper))


def request(token: str, budget: int = 4, inline_roots: bool = False) -> pb.BuildTreeRequest:
    logits = tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT32,
        shape=[2, 3, 64],
        ref=tensor_pb2.TensorRef(region_token=token, offset_bytes=0),
    )
    roots = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[2])
    if inline_roots:
        roots.inline = torch.zeros(2, dtype=torch.int64).numpy().tobytes()
    else:
        roots.ref.CopyFrom(tensor_pb2.TensorRef(region_token=token, offset_bytes=4096))
    return pb.BuildTreeRequest(draft_logits=logits, root_tokens=roots, budget=budget)


def decode(memo: DecodedCalls, message: pb.BuildTreeRequest, resolver: convert.TensorResolver):
    return memo.decode(convert.build_tree_call, message, resolver, deadline_s=12.5)


def test_the_same_bytes_reuse_the_decoded_call_with_fresh_leases(region: Region) -> None:
    mapper, resolver, table, token = region
    memo = DecodedCalls()
    first: BuildTreeCall = decode(memo, request(token), resolver)
    second: BuildTreeCall = decode(memo, request(token), resolver)
    assert memo.hits == 1
    assert second.draft_logits is first.draft_logits  # the same view of the caller's memory
    assert second.deadline_s == 12.5
    assert second.leases is not None and second.leases is not first.leases
    # Every other field is the first call's, the shared ``Prepared`` included.
    assert second == replace(first, leases=second.leases)
    assert second.prepared is not None and second.prepared is first.prepared
    assert second.leases.tokens == (token,)
    other: BuildTreeCall = decode(memo, request(token, budget=5), resolver)  # other bytes
    assert memo.hits == 1
    for call in (first, other):
        call.leases.release()  # type: ignore[union-attr]
    table.unregister(token, "unix")
    assert mapper.closed == []  # the reused call's lease keeps the mapping open
    second.leases.release()
    assert len(mapper.closed) == 1


def test_the_received_bytes_are_the_key(region: Region) -> None:
    """The server hands over the bytes the request came in (its deserializer keeps them): the
    same bytes hit without serialising the request again, other bytes miss."""
    _, resolver, _, token = region
    memo = DecodedCalls()
    message = request(token)
    raw = message.SerializeToString()

    def decode_raw(data: bytes) -> BuildTreeCall:
        call: BuildTreeCall = memo.decode(
            convert.build_tree_call,
            pb.BuildTreeRequest.FromString(data),
            resolver,
            deadline_s=1.0,
            raw=data,
        )
        assert call.leases is not None
        call.leases.release()
        return call

    first = decode_raw(raw)
    assert decode_raw(raw).draft_logits is first.draft_logits
    assert memo.hits == 1
    # The same message as other bytes (its budget first): a miss, decoded afresh.
    reordered = pb.BuildTreeRequest(budget=message.budget).SerializeToString() + (
        pb.BuildTreeRequest(
            draft_logits=message.draft_logits, root_tokens=message.root_tokens
        ).SerializeToString()
    )
    assert reordered != raw and pb.BuildTreeRequest.FromString(reordered) == message
    decode_raw(reordered)
    assert memo.hits == 1


def test_an_unregistered_token_is_refused_not_reused(region: Region) -> None:
    mapper, resolver, table, token = region
    memo = DecodedCalls()
    decode(memo, request(token), resolver).leases.release()  # type: ignore[union-attr]
    table.unregister(token, "unix")
    register(table, mapper)  # another region, maybe at the same place
    with pytest.raises(MemoryTokenNotFound):
        decode(memo, request(token), resolver)
    assert memo.hits == 0


def test_another_caller_never_reuses_a_call() -> None:
    mapper = HostMapper()
    resolver, table = make_resolver(mapper, owner="ip:10.0.0.1", bind_to_owner=True)
    token = register(table, mapper, owner="ip:10.0.0.1")
    memo = DecodedCalls()
    decode(memo, request(token), resolver)
    other = resolver.for_owner("ip:10.0.0.2")
    with pytest.raises(MemoryTokenNotFound):
        decode(memo, request(token), other)
    assert memo.hits == 0


def test_calls_without_references_are_not_kept() -> None:
    resolver = convert.TensorResolver(CallLimits(), None, "unix")
    memo = DecodedCalls()
    message = pb.BuildTreeRequest(
        draft_logits=tensor_pb2.Tensor(
            dtype=tensor_pb2.DTYPE_FLOAT32,
            shape=[1, 1, 4],
            inline=torch.zeros(4).numpy().tobytes(),
        ),
        root_tokens=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[1], inline=bytes(8)),
        budget=2,
    )
    for _ in range(3):
        decode(memo, message, resolver)
    assert memo.hits == 0


def test_the_least_recently_used_call_is_dropped_past_capacity(region: Region) -> None:
    resolver, token = region.resolver, region.token
    memo = DecodedCalls(capacity=2)
    for budget in (3, 4, 5, 4, 3):
        decode(memo, request(token, budget=budget), resolver)
    # 3, 4, 5 decoded; 4 reused; 3 was dropped when 5 came in
    assert memo.hits == 1


def test_the_copies_of_a_kept_call_share_one_prepared(region: Region) -> None:
    resolver, token = region.resolver, region.token
    memo = DecodedCalls()
    first: BuildTreeCall = decode(memo, request(token), resolver)
    second: BuildTreeCall = decode(memo, request(token), resolver)
    other: BuildTreeCall = decode(memo, request(token, budget=5), resolver)
    assert first.prepared is not None
    assert second.prepared is first.prepared  # what the engine derives once holds for both
    assert other.prepared is not None and other.prepared is not first.prepared
    inline: BuildTreeCall = decode(memo, request(token, inline_roots=True), resolver)
    assert inline.prepared is not None  # its logits are a reference: kept
    for call in (first, second, other, inline):
        call.leases.release()  # type: ignore[union-attr]


def test_the_engine_validates_a_reused_call_once_per_limits(region: Region) -> None:
    resolver, token = region.resolver, region.token
    memo = DecodedCalls()
    first: BuildTreeCall = decode(memo, request(token), resolver)
    second: BuildTreeCall = decode(memo, request(token), resolver)
    with (
        Engine(device="cpu", backend="reference") as engine,
        Engine(device="cpu", backend="reference", limits=CallLimits(max_batch_size=1)) as small,
    ):
        engine.warm_up()
        small.warm_up()
        engine.build_tree(replace(first, deadline_s=None)).result()
        assert first.prepared is not None and first.prepared.validated_for is engine.limits
        engine.build_tree(replace(second, deadline_s=None)).result()
        # Another engine's limits are not the ones it passed: checked again (batch 2 > 1).
        third: BuildTreeCall = decode(memo, request(token), resolver)
        with pytest.raises(InvalidArgument, match="batch"):
            small.build_tree(replace(third, deadline_s=None))
        assert third.prepared is first.prepared
        assert first.prepared.validated_for is engine.limits


class _Context:
    """What the servicer reads of a ``grpc.aio.ServicerContext`` (a Unix-socket caller)."""

    def time_remaining(self) -> None:
        return None

    def peer(self) -> str:
        return "unix:/tmp/ddtree-test.sock"


def _outputs(token: str) -> tree_pb2.TreeOutputRefs:
    """Destinations of a batch-2, budget-4 tree in the region, from offset 8 KiB."""
    return tree_pb2.TreeOutputRefs(
        **{
            name: tensor_pb2.TensorRef(region_token=token, offset_bytes=8192 + 1024 * index)
            for index, name in enumerate(TREE_FIELDS)
        }
    )


def test_a_reused_call_into_caller_memory_is_answered_with_its_first_reply(
    region: Region,
) -> None:
    message = request(region.token)
    message.outputs.CopyFrom(_outputs(region.token))
    with Engine(device="cpu", backend="reference") as engine:
        engine.warm_up()
        servicer = TreeSpeculationServicer(engine, ServiceConfig(), region.resolver)

        def build(request: pb.BuildTreeRequest) -> pb.BuildTreeResponse:
            return asyncio.run(servicer.BuildTree(request, _Context()))  # type: ignore[arg-type]

        first, second = build(message), build(message)
        assert second is first  # kept with the decoded call, sent again
        assert first.tree.tokens.ref == message.outputs.tokens
        assert list(first.tree.mask.shape) == [2, 5, 1]
        fresh = request(region.token)  # no destinations: the tree travels in the reply
        inline_replies = build(fresh), build(fresh)
        assert inline_replies[0] is not inline_replies[1]
        assert inline_replies[0] == inline_replies[1]
        assert inline_replies[0].tree.tokens.WhichOneof("data") == "inline"
