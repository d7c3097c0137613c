"""Requests as the server receives them (``ddtree.service.access``): small requests parsed once
per distinct bytes, and the bytes of the call's request known to its handler, on CPU.

The decoded-call memo keys a by-reference request by the bytes it came in
(``access.received_bytes``), so those must be exactly the bytes of the request the handler got,
never another call's.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import grpc

from ddtree.service import access
from ddtree.v1 import tensor_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb


def _request(budget: int, inline_bytes: int = 0) -> bytes:
    roots = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[1], inline=b"\0" * 8)
    logits = tensor_pb2.Tensor(
        dtype=tensor_pb2.DTYPE_FLOAT32,
        shape=[1, 1, inline_bytes // 4] if inline_bytes else [1, 1, 64],
    )
    if inline_bytes:
        logits.inline = b"\0" * inline_bytes
    else:
        logits.ref.region_token = "token"
    return pb.BuildTreeRequest(
        draft_logits=logits, root_tokens=roots, budget=budget
    ).SerializeToString()


def _receive(deserialize: Any, raw: bytes) -> tuple[Any, bytes | None]:
    """What one call's handler sees: the request, and the bytes it knows it came from."""

    def call() -> tuple[Any, bytes | None]:
        message = deserialize(raw)
        return message, access.received_bytes(message)

    return contextvars.copy_context().run(call)  # each call runs in a task of its own


def test_the_same_small_bytes_are_parsed_once() -> None:
    deserialize = access._tolerant(pb.BuildTreeRequest.FromString)
    raw = _request(4)
    first, first_raw = _receive(deserialize, raw)
    second, second_raw = _receive(deserialize, bytes(bytearray(raw)))  # equal, not identical
    assert second is first and first_raw == second_raw == raw
    other, other_raw = _receive(deserialize, _request(5))
    assert other is not first and other.budget == 5 and other_raw == _request(5)
    assert access.received_bytes(first) is None  # outside the call's context


def test_large_requests_are_parsed_every_time_and_their_bytes_not_held() -> None:
    deserialize = access._tolerant(pb.BuildTreeRequest.FromString)
    raw = _request(4, inline_bytes=8192)
    first, first_raw = _receive(deserialize, raw)
    second, _ = _receive(deserialize, raw)
    assert second is not first and second == first
    assert first_raw is None  # inline tensors: the call does not keep its bytes alive


def test_the_oldest_parsed_request_goes_first() -> None:
    deserialize = access._tolerant(pb.BuildTreeRequest.FromString)
    first, _ = _receive(deserialize, _request(1))
    for budget in range(2, 2 + access._KEPT_REQUESTS):
        _receive(deserialize, _request(budget))
    last, _ = _receive(deserialize, _request(1 + access._KEPT_REQUESTS))
    assert _receive(deserialize, _request(1))[0] is not first  # dropped, parsed again
    assert _receive(deserialize, _request(1 + access._KEPT_REQUESTS))[0] is last


def test_unparsable_bytes_are_not_kept() -> None:
    deserialize = access._tolerant(pb.BuildTreeRequest.FromString)
    for data in (b"\xff\xff", b"\xff" * 5000):
        for _ in range(2):
            malformed, raw = _receive(deserialize, data)
            assert isinstance(malformed, access._Malformed) and raw is None
            assert malformed.byte_size == len(data)


def test_a_served_handler_sees_its_own_request_bytes() -> None:
    """Through gRPC's asyncio server: the interceptor's deserializer runs in the call's task,
    so the handler reads the bytes of its own request, call after call."""
    budgets = (3, 3, 7, 3)
    seen: list[tuple[int, bytes | None]] = []

    async def handler(request: pb.BuildTreeRequest, context: Any) -> pb.BuildTreeResponse:
        seen.append((request.budget, access.received_bytes(request)))
        return pb.BuildTreeResponse()

    async def main() -> None:
        server = grpc.aio.server(
            interceptors=[access.AccessInterceptor("ddtree.v1.T", max_calls_per_client=0)]
        )
        methods = {
            "BuildTree": grpc.unary_unary_rpc_method_handler(
                handler,
                request_deserializer=pb.BuildTreeRequest.FromString,
                response_serializer=pb.BuildTreeResponse.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("ddtree.v1.T", methods),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/ddtree.v1.T/BuildTree")
                for budget in budgets:
                    await call(_request(budget), timeout=10)
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert seen == [(budget, _request(budget)) for budget in budgets]
