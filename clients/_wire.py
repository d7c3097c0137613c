"""Wire encoding shared by the remote clients: tensors, requests, responses and error details.

Knows only the wire contract (``ddtree.v1``) and ``ddtree.kernels.types``; never the server.
Tensors travel inline unless the request's ``refs`` (a ``ddtree.clients.cuda.RequestRefs``)
gives a reference into registered memory for them.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, Protocol

import grpc
import torch
from google.rpc import error_details_pb2, status_pb2

from ddtree.clients.errors import DDTreeClientError, InvalidArgumentError, error_for
from ddtree.clients.types import DeviceInfo, KvCommit, ServerInfo, ServerLimits
from ddtree.kernels.types import ACCEPTANCE_FIELDS, TREE_FIELDS, Acceptance, Tree
from ddtree.v1 import tensor_pb2, tree_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb

if sys.byteorder != "little":  # inline tensors are little-endian; torch uses host order
    raise ImportError("ddtree.clients needs a little-endian host")

_TO_WIRE: dict[torch.dtype, tensor_pb2.DType] = {
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
}
_FROM_WIRE: dict[int, torch.dtype] = {int(v): k for k, v in _TO_WIRE.items()}
_STATUS_DETAILS_KEY = "grpc-status-details-bin"


class TensorRefs(Protocol):
    """Where the tensors of one request live in registered memory (``cuda.RequestRefs``)."""

    def where(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        """``(region_token, offset_bytes)`` of ``tensor``, or ``None`` to send it inline."""
        ...


def encode_tensor(
    tensor: torch.Tensor, field: str, refs: TensorRefs | None = None
) -> tensor_pb2.Tensor:
    """Encode ``tensor`` by reference when ``refs`` has one, else inline (little-endian, C
    order, copied to the host if needed)."""
    message = tensor_pb2.Tensor()
    _fill_tensor(message, tensor, field, refs)
    return message


def _fill_tensor(
    message: tensor_pb2.Tensor, tensor: torch.Tensor, field: str, refs: TensorRefs | None
) -> None:
    # ``encode_tensor`` into an empty submessage of the request, in place: building messages
    # apart and copying them in costs about twice as much per call.
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{field}: expected a torch.Tensor, got {type(tensor).__name__}")
    dtype = _TO_WIRE.get(tensor.dtype)
    if dtype is None:
        raise TypeError(f"{field}: dtype {tensor.dtype} cannot travel on the wire")
    where = None if refs is None else refs.where(tensor)
    message.dtype = dtype
    if where is not None:
        message.shape.extend(tensor.shape)
        ref = message.ref
        ref.region_token, ref.offset_bytes = where
        return
    host = tensor.detach().to("cpu").contiguous()
    byte_size = host.numel() * host.element_size()
    message.shape.extend(host.shape)
    message.inline = ctypes.string_at(host.data_ptr(), byte_size) if byte_size else b""


def decode_tensor(message: tensor_pb2.Tensor, device: torch.device) -> torch.Tensor:
    """Decode an inline tensor of a response onto ``device``."""
    dtype = _FROM_WIRE.get(message.dtype)
    if dtype is None or message.WhichOneof("data") != "inline":
        raise DDTreeClientError(
            "DATA_LOSS", f"response tensor with dtype {message.dtype} and no inline data"
        )
    shape = tuple(message.shape)
    if not message.inline:
        return torch.empty(shape, dtype=dtype, device=device)
    host = torch.frombuffer(bytearray(message.inline), dtype=dtype).reshape(shape)
    return host.to(device)


def _decode_into(messages: Any, names: tuple[str, ...], out: Any, prefix: str) -> None:
    """Copy the inline tensors ``messages.<name>`` into ``out.<name>``, each checked first (a
    response that does not fit leaves ``out`` untouched)."""
    for name in names:
        message, dest = getattr(messages, name), getattr(out, name)
        dtype = _FROM_WIRE.get(message.dtype)
        shape = tuple(message.shape)
        byte_size = dest.numel() * dest.element_size()
        if (
            message.WhichOneof("data") != "inline"
            or dtype != dest.dtype
            or shape != dest.shape
            or len(message.inline) != byte_size
        ):
            raise DDTreeClientError(
                "DATA_LOSS",
                f"{prefix}.{name}: the response's tensor (dtype {dtype}, shape {shape}) does not "
                f"fit out.{name} (dtype {dest.dtype}, shape {tuple(dest.shape)})",
            )
    for name in names:
        message, dest = getattr(messages, name), getattr(out, name)
        if message.inline:
            host = torch.frombuffer(bytearray(message.inline), dtype=dest.dtype)
            dest.copy_(host.view(dest.shape))


def encode_tree(tree: Tree, refs: TensorRefs | None = None) -> tree_pb2.Tree:
    """Encode a ``Tree`` (by reference where ``refs`` has one, else inline)."""
    message = tree_pb2.Tree()
    _fill_tree(message, tree, refs)
    return message


def _fill_tree(message: tree_pb2.Tree, tree: Tree, refs: TensorRefs | None) -> None:
    for name in TREE_FIELDS:
        _fill_tensor(getattr(message, name), getattr(tree, name), f"tree.{name}", refs)
    message.draft_len = tree.draft_len


def _fill_ref(
    message: tensor_pb2.TensorRef, refs: TensorRefs, tensor: torch.Tensor, field: str
) -> None:
    where = refs.where(tensor)
    if where is None:
        raise ValueError(f"{field}: an output destination must be in registered memory")
    message.region_token, message.offset_bytes = where


def _fill_outputs(message: Any, names: tuple[str, ...], values: Any, refs: TensorRefs) -> None:
    for name in names:
        _fill_ref(getattr(message, name), refs, getattr(values, name), f"outputs.{name}")


def tree_output_refs(tree: Tree, refs: TensorRefs) -> tree_pb2.TreeOutputRefs:
    """Destinations for BuildTree: the six tensors of ``tree``, each registered."""
    message = tree_pb2.TreeOutputRefs()
    _fill_outputs(message, TREE_FIELDS, tree, refs)
    return message


def acceptance_output_refs(
    acceptance: Acceptance, refs: TensorRefs
) -> tree_pb2.AcceptanceOutputRefs:
    """Destinations for AcceptTree: the four tensors of ``acceptance``, each registered."""
    message = tree_pb2.AcceptanceOutputRefs()
    _fill_outputs(message, ACCEPTANCE_FIELDS, acceptance, refs)
    return message


def decode_tree(message: tree_pb2.Tree, device: torch.device) -> Tree:
    """Decode an inline ``Tree`` onto ``device``."""
    return Tree(
        tokens=decode_tensor(message.tokens, device),
        parents=decode_tensor(message.parents, device),
        depths=decode_tensor(message.depths, device),
        log_probs=decode_tensor(message.log_probs, device),
        num_nodes=decode_tensor(message.num_nodes, device),
        mask=decode_tensor(message.mask, device),
        draft_len=int(message.draft_len),
    )


def decode_tree_into(message: tree_pb2.Tree, out: Tree) -> Tree:
    """Copy an inline ``Tree`` into ``out`` (same shapes and dtypes) and return ``out``.

    Raises
    ------
    DDTreeClientError
        ``DATA_LOSS``: the response's tree does not fit ``out`` (nothing is copied).
    """
    if message.draft_len != out.draft_len:
        raise DDTreeClientError(
            "DATA_LOSS",
            f"tree.draft_len: the response's {message.draft_len} is not out's {out.draft_len}",
        )
    _decode_into(message, TREE_FIELDS, out, "tree")
    return out


def decode_acceptance(message: tree_pb2.Acceptance, device: torch.device) -> Acceptance:
    """Decode an inline ``Acceptance`` onto ``device``."""
    return Acceptance(
        nodes=decode_tensor(message.nodes, device),
        tokens=decode_tensor(message.tokens, device),
        length=decode_tensor(message.length, device),
        bonus=decode_tensor(message.bonus, device),
    )


def build_tree_request(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int | torch.Tensor,
    *,
    temperature: float,
    max_budget: int | None,
    model: str,
    refs: TensorRefs | None = None,
    outputs: Tree | None = None,
    wait_event_ipc_handle: bytes = b"",
) -> pb.BuildTreeRequest:
    """The BuildTree request for the client's arguments.

    With ``refs``, registered tensors travel by reference; ``outputs`` (registered) asks the
    server to write the tree there. Per-request budgets always travel inline.
    """
    request = pb.BuildTreeRequest(
        temperature=temperature,
        max_budget=max_budget or 0,
        model=model,
        wait_event_ipc_handle=wait_event_ipc_handle,
    )
    _fill_tensor(request.draft_logits, draft_logits, "draft_logits", refs)
    _fill_tensor(request.root_tokens, root_tokens, "root_tokens", refs)
    if isinstance(budget, torch.Tensor):
        _fill_tensor(request.budgets, budget, "budget", None)
    else:
        request.budget = int(budget)
    if outputs is not None and refs is not None:
        _fill_outputs(request.outputs, TREE_FIELDS, outputs, refs)
    return request


def accept_tree_request(
    tree: Tree,
    target_tokens: torch.Tensor | None,
    *,
    target_logits: torch.Tensor | None,
    temperature: float,
    seed: int | None,
    kv_commit: KvCommit | None,
    model: str,
    refs: TensorRefs | None = None,
    outputs: Acceptance | None = None,
    wait_event_ipc_handle: bytes = b"",
) -> pb.AcceptTreeRequest:
    """The AcceptTree request for the client's arguments.

    Tensors travel by reference where ``refs`` has one (a referenced KV cache is compacted in
    place by the server), else inline; ``outputs`` (registered) receives the acceptance.

    Raises
    ------
    InvalidArgumentError
        Both targets given: the wire's ``target`` oneof cannot carry both (reason
        ``MISSING_FIELD``, as the server and the embedded client report it).
    """
    if target_tokens is not None and target_logits is not None:
        raise InvalidArgumentError(
            "INVALID_ARGUMENT",
            "accept_tree.target: expected exactly one of target_tokens and target_logits, got both",
            reason="MISSING_FIELD",
            field="accept_tree.target",
        )
    request = pb.AcceptTreeRequest(
        temperature=temperature,
        model=model,
        wait_event_ipc_handle=wait_event_ipc_handle,
    )
    _fill_tree(request.tree, tree, refs)
    if target_tokens is not None:
        _fill_tensor(request.target_tokens, target_tokens, "target_tokens", refs)
    if target_logits is not None:
        _fill_tensor(request.target_logits, target_logits, "target_logits", refs)
    if seed is not None:
        request.seed = seed
    if kv_commit is not None:
        commit = request.kv_commit
        _fill_tensor(commit.kv_cache, kv_commit.kv_cache, "kv_commit.kv_cache", refs)
        _fill_tensor(commit.block_table, kv_commit.block_table, "kv_commit.block_table", refs)
        _fill_tensor(commit.prefix_lens, kv_commit.prefix_lens, "kv_commit.prefix_lens", refs)
    if outputs is not None and refs is not None:
        _fill_outputs(request.outputs, ACCEPTANCE_FIELDS, outputs, refs)
    return request


def finish_accept_tree(
    response: pb.AcceptTreeResponse,
    tree: Tree,
    kv_commit: KvCommit | None,
    outputs: Acceptance | None = None,
    *,
    into: Acceptance | None = None,
) -> Acceptance:
    """Decode the acceptance and copy a returned KV cache into the caller's tensor in place.

    With ``outputs`` (the server wrote the acceptance into them) they are the result; with
    ``into`` the inline acceptance is copied into it, and it is the result. A cache sent by
    reference was compacted in place by the server and is not returned.
    """
    if kv_commit is not None and response.HasField("kv_cache"):
        compacted = decode_tensor(response.kv_cache, kv_commit.kv_cache.device)
        kv_commit.kv_cache.copy_(compacted)
    if outputs is not None:
        return outputs
    if into is not None:
        _decode_into(response.acceptance, ACCEPTANCE_FIELDS, into, "acceptance")
        return into
    return decode_acceptance(response.acceptance, tree.device)


def verify_attention_request(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree: Tree,
    *,
    v_dim: int,
    sm_scale: float | None,
    model: str,
    refs: TensorRefs | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    wait_event_ipc_handle: bytes = b"",
) -> pb.VerifyAttentionRequest:
    """The VerifyAttention request; ``out`` / ``lse`` (registered) receive the results."""
    request = pb.VerifyAttentionRequest(
        v_dim=v_dim,
        model=model,
        wait_event_ipc_handle=wait_event_ipc_handle,
    )
    _fill_tensor(request.q, q, "q", refs)
    _fill_tensor(request.kv_cache, kv_cache, "kv_cache", refs)
    _fill_tensor(request.block_table, block_table, "block_table", refs)
    _fill_tensor(request.prefix_lens, prefix_lens, "prefix_lens", refs)
    _fill_tree(request.tree, tree, refs)
    if sm_scale is not None:
        request.sm_scale = sm_scale
    if out is not None and refs is not None:
        _fill_ref(request.out_ref, refs, out, "out")
    if lse is not None and refs is not None:
        _fill_ref(request.lse_ref, refs, lse, "lse")
    return request


def decode_server_info(response: pb.GetServerInfoResponse) -> ServerInfo:
    """Decode GetServerInfo."""
    limits = response.limits
    return ServerInfo(
        version=response.version,
        devices=tuple(
            DeviceInfo(
                uuid=d.uuid,
                name=d.name,
                compute_capability=(d.compute_capability_major, d.compute_capability_minor),
                total_memory_bytes=d.total_memory_bytes,
                backend=d.backend,
            )
            for d in response.devices
        ),
        limits=ServerLimits(
            max_budget=limits.max_budget,
            max_draft_len=limits.max_draft_len,
            max_message_bytes=limits.max_message_bytes,
            max_tensor_bytes=limits.max_tensor_bytes,
            max_batch_size=limits.max_batch_size,
            max_concurrent_calls=limits.max_concurrent_calls,
            request_deadline_cap_s=limits.request_deadline_cap_s,
            max_channels=limits.max_channels,
        ),
        supports_memory_references=response.supports_memory_references,
    )


def error_from_rpc(err: grpc.RpcError) -> DDTreeClientError:
    """The client exception for a failed call, from its status and ``google.rpc`` details."""
    call: Any = err
    code = call.code()
    code_name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    message = call.details() or ""
    reason = ""
    field = None
    metadata: dict[str, str] = {}
    retry_after_s = None
    for key, value in call.trailing_metadata() or ():
        if key != _STATUS_DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
                metadata.update(info.metadata)
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                if bad.field_violations:
                    field = bad.field_violations[0].field
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
    return error_for(
        code_name,
        message,
        reason=reason,
        field=field,
        metadata=metadata,
        retry_after_s=retry_after_s,
    )
