"""The thin ``grpc.aio`` servicer: decode (``convert``), one engine call, encode.

A by-reference request sent again byte for byte reuses its decoded call (``call_memo``).

No business logic and no device calls here. Errors are raised as ``DDTreeError`` subclasses and
mapped to status codes by the server's interceptor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar, cast

import grpc
import torch
from google.protobuf.message import Message

from ddtree.service import convert
from ddtree.service.access import client_identity, received_bytes
from ddtree.service.call_memo import DecodedCalls
from ddtree.service.calls import Prepared
from ddtree.service.channel import open_channel_args
from ddtree.service.config import ServiceConfig
from ddtree.service.engine import Completed, Engine, Outcome
from ddtree.service.errors import (
    DDTreeError,
    DeadlineExceeded,
)
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

__all__ = ["TreeSpeculationServicer"]

_T = TypeVar("_T")
_C = TypeVar("_C")
_R = TypeVar("_R", bound=Message)

_OFFLOAD_BYTES = 1 << 20
"""Requests and responses larger than this are converted on a helper thread: copying hundreds
of megabytes of inline tensors would otherwise stall every other call on the event loop."""


async def _convert(byte_size: int, work: Callable[[], _T]) -> _T:
    if byte_size <= _OFFLOAD_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(None, work)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _refs_reply(prepared: Prepared | None, respond: Callable[[], _R]) -> _R:
    """``respond()``, the response of a call whose results are in caller memory: it names only
    the call's destinations, so a call decoded once and sent again (``prepared``) keeps the
    first one and sends it every time (gRPC only serialises it)."""
    if prepared is None:
        return respond()
    if prepared.reply is None:
        prepared.reply = respond()
    return cast(_R, prepared.reply)  # made by ``respond`` for an earlier copy of the call


class TreeSpeculationServicer(pb_grpc.TreeSpeculationServiceServicer):
    """``ddtree.v1.TreeSpeculationService`` over an ``Engine``.

    Parameters
    ----------
    engine : Engine
        Runs the ops; owned by the server, not by the servicer.
    config : ServiceConfig
        Limits reported by GetServerInfo and the deadline cap.
    resolver : convert.TensorResolver
        Decodes request tensors (per call, for the caller's identity: registered regions are
        bound to the identity that registered them).
    """

    def __init__(
        self, engine: Engine, config: ServiceConfig, resolver: convert.TensorResolver
    ) -> None:
        self._engine = engine
        self._config = config
        self._resolver = resolver
        self._active = 0
        """Data calls (BuildTree, AcceptTree, VerifyAttention) being handled now."""
        self._calls = DecodedCalls()
        """By-reference calls decoded earlier, for callers that send the same request again."""

    def _budget_s(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        cap = self._config.request_deadline_cap_s
        return cap if remaining is None else min(remaining, cap)

    def _inline(self, byte_size: int) -> bool:
        """Whether a data call asks the engine to run its op on the event loop thread.

        A small call that is the only one in flight does (the engine agrees where
        ``Engine.inline_ops`` is on, CUDA, and the call waits on no caller IPC event): the loop
        has nothing else to do during the short device wait, and the two thread hops to the
        device worker and back cost more.
        Concurrent calls go through the worker, so that decoding one overlaps the device work
        of another; large inline tensors do too (their copies to the device take long).
        """
        return self._active == 1 and byte_size <= _OFFLOAD_BYTES

    async def _run(
        self,
        request: Message,
        context: grpc.aio.ServicerContext,
        decode: Callable[..., _C],
        submit: Callable[..., Outcome[_T]],
    ) -> tuple[_C, _T]:
        """One data call: ``decode(request, resolver, deadline_s=...)`` for the caller's
        identity, then ``submit(call, inline=...)`` on the engine, awaited within the call's
        deadline budget; returns the decoded call and the result."""
        budget_s = self._budget_s(context)
        deadline_s = time.monotonic() + budget_s
        resolver = self._resolver.for_owner(client_identity(context))
        raw = received_bytes(request)
        byte_size = request.ByteSize() if raw is None else len(raw)
        self._active += 1  # counted while handled: ``_inline`` reads the count
        try:
            if byte_size <= _OFFLOAD_BYTES:
                call = self._calls.decode(decode, request, resolver, deadline_s=deadline_s, raw=raw)
            else:
                call = await _convert(
                    byte_size, lambda: decode(request, resolver, deadline_s=deadline_s)
                )
            result = await self._await(submit(call, inline=self._inline(byte_size)), budget_s)
        finally:
            self._active -= 1
        return call, result

    async def _await(self, future: Outcome[_T], budget_s: float) -> _T:
        if isinstance(future, Completed):  # ran inline
            return future.result()
        if future.done():
            return future.result()
        # wait_for cancels the engine's future on timeout or when the RPC is cancelled, which
        # drops the work if it has not started yet.
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), budget_s)
        except asyncio.TimeoutError as err:
            raise DeadlineExceeded(
                f"the call did not finish within its deadline ({budget_s:.3f} s, capped at "
                f"{self._config.request_deadline_cap_s:g} s)"
            ) from err

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        """Version, devices and limits."""
        return convert.server_info_to_proto(
            self._engine.info(),
            max_message_bytes=self._config.max_message_bytes,
            max_concurrent_calls=self._config.max_concurrent_calls,
            request_deadline_cap_s=self._config.request_deadline_cap_s,
        )

    async def RegisterMemory(
        self, request: pb.RegisterMemoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterMemoryResponse:
        """Map the caller's CUDA IPC allocation; reply with its capability token."""
        future = self._engine.register_memory(
            request.ipc_handle,
            request.device_uuid,
            request.byte_size,
            request.client_id,
            owner=client_identity(context),
        )
        token, region = await self._await(future, self._budget_s(context))
        return pb.RegisterMemoryResponse(region_token=token, byte_size=region.byte_size)

    async def UnregisterMemory(
        self, request: pb.UnregisterMemoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterMemoryResponse:
        """Forget a region (its mapping closes when the calls using it end)."""
        self._engine.unregister_memory(request.region_token, owner=client_identity(context))
        return pb.UnregisterMemoryResponse()

    async def ListMemory(
        self, request: pb.ListMemoryRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListMemoryResponse:
        """The client's regions, without tokens."""
        return pb.ListMemoryResponse(
            regions=[
                pb.MemoryRegion(
                    region_id=r.region_id, device_uuid=r.device_uuid, byte_size=r.byte_size
                )
                for r in self._engine.list_memory(request.client_id, owner=client_identity(context))
            ]
        )

    async def BuildTree(
        self, request: pb.BuildTreeRequest, context: grpc.aio.ServicerContext
    ) -> pb.BuildTreeResponse:
        """Build the draft trees."""
        call, tree = await self._run(
            request, context, convert.build_tree_call, self._engine.build_tree
        )
        if call.out is not None:

            def respond() -> pb.BuildTreeResponse:
                response = pb.BuildTreeResponse()
                convert.tree_refs_to_proto(request.outputs, tree, response.tree)
                return response

            return _refs_reply(call.prepared, respond)
        return pb.BuildTreeResponse(tree=convert.tree_to_proto(tree))

    async def AcceptTree(
        self, request: pb.AcceptTreeRequest, context: grpc.aio.ServicerContext
    ) -> pb.AcceptTreeResponse:
        """Walk the trees; commit the KV cache when asked and return it (sent inline)."""
        call, result = await self._run(
            request, context, convert.accept_tree_call, self._engine.accept_tree
        )
        cache_is_ref = request.kv_commit.kv_cache.WhichOneof("data") == "ref"

        def respond() -> pb.AcceptTreeResponse:
            if call.out is not None:
                response = pb.AcceptTreeResponse()
                convert.acceptance_refs_to_proto(
                    request.outputs, result.acceptance, response.acceptance
                )
            else:
                response = pb.AcceptTreeResponse(
                    acceptance=convert.acceptance_to_proto(result.acceptance)
                )
            if result.kv_cache is not None and not cache_is_ref:
                response.kv_cache.CopyFrom(convert.tensor_to_proto(result.kv_cache))
            return response

        if call.out is not None and (result.kv_cache is None or cache_is_ref):
            return _refs_reply(call.prepared, respond)
        return await _convert(0 if cache_is_ref else _nbytes(result.kv_cache), respond)

    async def VerifyAttention(
        self, request: pb.VerifyAttentionRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifyAttentionResponse:
        """Tree-masked paged attention."""
        call, (out, lse) = await self._run(
            request, context, convert.verify_attention_call, self._engine.verify_attention
        )

        def respond() -> pb.VerifyAttentionResponse:
            return pb.VerifyAttentionResponse(
                out=convert.tensor_to_proto(out)
                if call.out is None
                else convert.ref_tensor_to_proto(out, request.out_ref),
                lse=convert.tensor_to_proto(lse)
                if call.lse is None
                else convert.ref_tensor_to_proto(lse, request.lse_ref),
            )

        inline = [t for t, dest in ((out, call.out), (lse, call.lse)) if dest is None]
        return await _convert(_nbytes(*inline), respond)

    async def OpenChannel(
        self, request: pb.OpenChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenChannelResponse:
        """Open a GPU doorbell channel over the caller's registered memory."""
        channels = self._engine.require_channels()
        args = open_channel_args(request, self._engine.limits.max_batch_size)
        future = channels.open_async(
            args.shape,
            args.control,
            args.ring_size,
            args.regions,
            owner=client_identity(context),
            model=args.model,
        )
        token = await self._await(future, self._budget_s(context))
        return pb.OpenChannelResponse(channel_token=token, pipeline_depth=channels.limits.depth)

    async def CloseChannel(
        self, request: pb.CloseChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseChannelResponse:
        """Close a channel once its stream has drained."""
        channels = self._engine.require_channels()
        owner = client_identity(context)
        steps = await asyncio.get_running_loop().run_in_executor(
            None, channels.close, request.channel_token, owner
        )
        return pb.CloseChannelResponse(steps=steps)

    async def WatchChannel(
        self, request: pb.WatchChannelRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchChannelResponse]:
        """OPEN now, CLOSED when the channel closes; the last watch leaving closes it.

        (Streams bypass the unary error interceptor: errors are mapped to their status here.)
        """
        try:
            channels = self._engine.require_channels()
            closed = channels.watch(request.channel_token, client_identity(context))
        except DDTreeError as err:
            await context.abort(grpc.StatusCode[err.code], f"{err.reason}: {err.message}")
            return
        try:
            yield pb.WatchChannelResponse(state=pb.CHANNEL_STATE_OPEN)
            reason = await asyncio.shield(asyncio.wrap_future(closed))
            yield pb.WatchChannelResponse(state=pb.CHANNEL_STATE_CLOSED, reason=reason)
        finally:
            channels.unwatch(request.channel_token)
