"""Protobuf messages <-> engine call types, with wire-level validation naming the field.

Wire-level means what only the wire can get wrong: a dtype left unspecified, a byte length that
disagrees with the shape, a oneof left empty, a reference sent to a server that cannot resolve
it. Shapes, dtypes per field and ranges are checked by ``ddtree.service.calls`` (run by the
engine), the same checks the embedded client gets.

``TensorResolver.resolve`` is the one function that turns a wire ``Tensor`` into a torch tensor;
registered-memory references will be resolved there.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

from ddtree.kernels.types import Acceptance, Tree
from ddtree.service.calls import (
    AcceptTreeCall,
    BuildTreeCall,
    CallLimits,
    KvCommitArgs,
    VerifyAttentionCall,
)
from ddtree.service.engine import EngineInfo
from ddtree.service.errors import (
    EventHandlesUnsupported,
    InvalidTensor,
    MemoryReferencesUnsupported,
    MissingField,
    TensorTooLarge,
)
from ddtree.v1 import tensor_pb2, tree_pb2
from ddtree.v1 import tree_speculation_service_pb2 as service_pb2

__all__ = [
    "DTYPE_TO_TORCH",
    "TORCH_TO_DTYPE",
    "TensorResolver",
    "accept_tree_call",
    "acceptance_to_proto",
    "build_tree_call",
    "server_info_to_proto",
    "tensor_to_proto",
    "tree_from_proto",
    "tree_to_proto",
    "verify_attention_call",
]

if sys.byteorder != "little":  # inline tensors are little-endian; torch uses host order
    raise ImportError("ddtree.service.convert needs a little-endian host")

DTYPE_TO_TORCH: dict[tensor_pb2.DType, torch.dtype] = {
    tensor_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    tensor_pb2.DTYPE_FLOAT16: torch.float16,
    tensor_pb2.DTYPE_FLOAT32: torch.float32,
    tensor_pb2.DTYPE_INT32: torch.int32,
    tensor_pb2.DTYPE_INT64: torch.int64,
    tensor_pb2.DTYPE_UINT8: torch.uint8,
}
"""Wire dtype enum value -> torch dtype."""

TORCH_TO_DTYPE: dict[torch.dtype, tensor_pb2.DType] = {v: k for k, v in DTYPE_TO_TORCH.items()}
"""torch dtype -> wire dtype enum value."""


class TensorResolver:
    """Turns wire ``Tensor`` messages into torch tensors, checking them against the limits.

    Parameters
    ----------
    limits : CallLimits
        ``max_tensor_bytes`` bounds every tensor before any byte is copied.
    """

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits

    def resolve(self, message: tensor_pb2.Tensor, field: str) -> torch.Tensor:
        """Decode one tensor.

        Parameters
        ----------
        message : ddtree.v1.tensor_pb2.Tensor
            The wire tensor.
        field : str
            Dotted request path used in error messages (``"build_tree.draft_logits"``).

        Returns
        -------
        torch.Tensor
            A CPU tensor of ``message.shape`` owning a copy of the inline bytes.

        Raises
        ------
        InvalidTensor
            Unspecified or unknown dtype, a negative extent, or a byte length that disagrees
            with the shape.
        TensorTooLarge
            More bytes than ``max_tensor_bytes``.
        MissingField
            Neither ``inline`` nor ``ref`` is set.
        MemoryReferencesUnsupported
            ``ref`` is set (this server has no registered memory).
        """
        dtype = DTYPE_TO_TORCH.get(message.dtype)
        if dtype is None:
            raise InvalidTensor(
                f"{field}.dtype: expected one of "
                f"{', '.join(tensor_pb2.DType.Name(k) for k in DTYPE_TO_TORCH)}, got "
                f"{_dtype_name(message.dtype)}",
                field=f"{field}.dtype",
            )
        shape = tuple(message.shape)
        if any(extent < 0 for extent in shape):
            raise InvalidTensor(
                f"{field}.shape: expected extents >= 0, got {list(shape)}", field=f"{field}.shape"
            )
        itemsize = torch.empty((), dtype=dtype).element_size()
        byte_size = math.prod(shape) * itemsize
        if byte_size > self.limits.max_tensor_bytes:
            raise TensorTooLarge(
                f"{field}: shape {list(shape)} needs {byte_size} bytes, over the server's "
                f"max_tensor_bytes {self.limits.max_tensor_bytes}; split the batch",
                field=field,
            )
        kind = message.WhichOneof("data")
        if kind is None:
            raise MissingField(f"{field}: neither inline nor ref data is set", field=field)
        if kind == "ref":
            raise MemoryReferencesUnsupported(
                f"{field}.ref: this server does not support registered memory references; "
                "send the tensor inline",
                field=f"{field}.ref",
            )
        data = message.inline
        if len(data) != byte_size:
            raise InvalidTensor(
                f"{field}.inline: expected {byte_size} bytes for shape {list(shape)} "
                f"{_dtype_name(message.dtype)}, got {len(data)}",
                field=f"{field}.inline",
            )
        if byte_size == 0:
            return torch.empty(shape, dtype=dtype)
        # frombuffer needs a writable buffer to hand out a writable tensor: copy once.
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)

    def required(self, parent: object, name: str, field: str) -> torch.Tensor:
        """Decode the message-typed field ``name`` of ``parent``, which must be set."""
        if not parent.HasField(name):  # type: ignore[attr-defined]
            raise MissingField(f"{field}: required tensor is not set", field=field)
        return self.resolve(getattr(parent, name), field)

    def refuse_output_refs(self, parent: object, name: str, field: str) -> None:
        """Refuse an output reference field: this server cannot write into caller memory."""
        if parent.HasField(name):  # type: ignore[attr-defined]
            raise MemoryReferencesUnsupported(
                f"{field}: this server does not support registered memory; leave the output "
                "references unset to get the outputs inline",
                field=field,
            )


def _dtype_name(value: int) -> str:
    try:
        return str(tensor_pb2.DType.Name(value))
    except ValueError:
        return f"unknown dtype {value}"


def _refuse_event(handle: bytes, field: str) -> None:
    if handle:
        raise EventHandlesUnsupported(
            f"{field}: this server does not support CUDA IPC events; synchronise the producing "
            "stream before the call and leave it empty",
            field=field,
        )


def tensor_to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encode a tensor inline (little-endian, C order), copying it to the host if needed."""
    dtype = TORCH_TO_DTYPE.get(tensor.dtype)
    if dtype is None:
        raise TypeError(f"tensor_to_proto: dtype {tensor.dtype} has no wire dtype")
    host = tensor.detach().to("cpu").contiguous()
    byte_size = host.numel() * host.element_size()
    data = ctypes.string_at(host.data_ptr(), byte_size) if byte_size else b""
    return tensor_pb2.Tensor(dtype=dtype, shape=list(host.shape), inline=data)


def tree_from_proto(message: tree_pb2.Tree, field: str, resolver: TensorResolver) -> Tree:
    """Decode a wire ``Tree`` (all six tensors required)."""
    return Tree(
        tokens=resolver.required(message, "tokens", f"{field}.tokens"),
        parents=resolver.required(message, "parents", f"{field}.parents"),
        depths=resolver.required(message, "depths", f"{field}.depths"),
        log_probs=resolver.required(message, "log_probs", f"{field}.log_probs"),
        num_nodes=resolver.required(message, "num_nodes", f"{field}.num_nodes"),
        mask=resolver.required(message, "mask", f"{field}.mask"),
        draft_len=int(message.draft_len),
    )


def tree_to_proto(tree: Tree) -> tree_pb2.Tree:
    """Encode a ``Tree`` with inline tensors."""
    return tree_pb2.Tree(
        tokens=tensor_to_proto(tree.tokens),
        parents=tensor_to_proto(tree.parents),
        depths=tensor_to_proto(tree.depths),
        log_probs=tensor_to_proto(tree.log_probs),
        num_nodes=tensor_to_proto(tree.num_nodes),
        mask=tensor_to_proto(tree.mask),
        draft_len=tree.draft_len,
    )


def acceptance_to_proto(acceptance: Acceptance) -> tree_pb2.Acceptance:
    """Encode an ``Acceptance`` with inline tensors."""
    return tree_pb2.Acceptance(
        nodes=tensor_to_proto(acceptance.nodes),
        tokens=tensor_to_proto(acceptance.tokens),
        length=tensor_to_proto(acceptance.length),
        bonus=tensor_to_proto(acceptance.bonus),
    )


def _require(message: object, name: str, field: str) -> None:
    if not message.HasField(name):  # type: ignore[attr-defined]
        raise MissingField(f"{field}: required field is not set", field=field)


def build_tree_call(
    request: service_pb2.BuildTreeRequest,
    resolver: TensorResolver,
    *,
    deadline_s: float | None = None,
) -> BuildTreeCall:
    """Decode a BuildTree request; results are asked for on the host (inline replies)."""
    _refuse_event(request.wait_event_ipc_handle, "build_tree.wait_event_ipc_handle")
    resolver.refuse_output_refs(request, "outputs", "build_tree.outputs")
    logits = resolver.required(request, "draft_logits", "build_tree.draft_logits")
    roots = resolver.required(request, "root_tokens", "build_tree.root_tokens")
    spec = request.WhichOneof("budget_spec")
    budget: int | torch.Tensor
    if spec == "budgets":
        budget = resolver.resolve(request.budgets, "build_tree.budgets")
    elif spec == "budget":
        budget = int(request.budget)
    else:
        raise MissingField(
            "build_tree.budget: set budget (one for all requests) or budgets (one per request)",
            field="build_tree.budget",
        )
    return BuildTreeCall(
        draft_logits=logits,
        root_tokens=roots,
        budget=budget,
        max_budget=int(request.max_budget) or None,
        temperature=request.temperature if request.HasField("temperature") else 1.0,
        model=request.model,
        result_device=torch.device("cpu"),
        deadline_s=deadline_s,
    )


def accept_tree_call(
    request: service_pb2.AcceptTreeRequest,
    resolver: TensorResolver,
    *,
    deadline_s: float | None = None,
) -> AcceptTreeCall:
    """Decode an AcceptTree request (with its optional KV commit)."""
    _refuse_event(request.wait_event_ipc_handle, "accept_tree.wait_event_ipc_handle")
    resolver.refuse_output_refs(request, "outputs", "accept_tree.outputs")
    _require(request, "tree", "accept_tree.tree")
    tree = tree_from_proto(request.tree, "accept_tree.tree", resolver)
    target = request.WhichOneof("target")
    if target is None:
        raise MissingField(
            "accept_tree.target: set target_tokens (the target's token per node) or target_logits",
            field="accept_tree.target",
        )
    tokens = logits = None
    if target == "target_tokens":
        tokens = resolver.resolve(request.target_tokens, "accept_tree.target_tokens")
    else:
        logits = resolver.resolve(request.target_logits, "accept_tree.target_logits")
    kv_commit = None
    if request.HasField("kv_commit"):
        commit = request.kv_commit
        kv_commit = KvCommitArgs(
            kv_cache=resolver.required(commit, "kv_cache", "accept_tree.kv_commit.kv_cache"),
            block_table=resolver.required(
                commit, "block_table", "accept_tree.kv_commit.block_table"
            ),
            prefix_lens=resolver.required(
                commit, "prefix_lens", "accept_tree.kv_commit.prefix_lens"
            ),
        )
    return AcceptTreeCall(
        tree=tree,
        target_tokens=tokens,
        target_logits=logits,
        temperature=request.temperature,
        seed=request.seed if request.HasField("seed") else None,
        kv_commit=kv_commit,
        model=request.model,
        result_device=torch.device("cpu"),
        deadline_s=deadline_s,
    )


def verify_attention_call(
    request: service_pb2.VerifyAttentionRequest,
    resolver: TensorResolver,
    *,
    deadline_s: float | None = None,
) -> VerifyAttentionCall:
    """Decode a VerifyAttention request."""
    _refuse_event(request.wait_event_ipc_handle, "verify_attention.wait_event_ipc_handle")
    resolver.refuse_output_refs(request, "out_ref", "verify_attention.out_ref")
    resolver.refuse_output_refs(request, "lse_ref", "verify_attention.lse_ref")
    _require(request, "tree", "verify_attention.tree")
    return VerifyAttentionCall(
        q=resolver.required(request, "q", "verify_attention.q"),
        kv_cache=resolver.required(request, "kv_cache", "verify_attention.kv_cache"),
        block_table=resolver.required(request, "block_table", "verify_attention.block_table"),
        prefix_lens=resolver.required(request, "prefix_lens", "verify_attention.prefix_lens"),
        tree=tree_from_proto(request.tree, "verify_attention.tree", resolver),
        v_dim=request.v_dim if request.HasField("v_dim") else 512,
        sm_scale=request.sm_scale if request.HasField("sm_scale") else None,
        model=request.model,
        result_device=torch.device("cpu"),
        deadline_s=deadline_s,
    )


def server_info_to_proto(
    info: EngineInfo,
    *,
    max_message_bytes: int,
    max_concurrent_calls: int,
    request_deadline_cap_s: float,
) -> service_pb2.GetServerInfoResponse:
    """Encode the engine's info plus the server-level limits."""
    return service_pb2.GetServerInfoResponse(
        version=info.version,
        devices=[
            service_pb2.Device(
                uuid=d.uuid,
                name=d.name,
                compute_capability_major=d.compute_capability[0],
                compute_capability_minor=d.compute_capability[1],
                total_memory_bytes=d.total_memory_bytes,
                backend=d.backend,
            )
            for d in info.devices
        ],
        limits=service_pb2.ServerLimits(
            max_budget=info.max_budget,
            max_draft_len=info.max_draft_len,
            max_message_bytes=max_message_bytes,
            max_tensor_bytes=info.limits.max_tensor_bytes,
            max_batch_size=info.limits.max_batch_size,
            max_concurrent_calls=max_concurrent_calls,
            request_deadline_cap_s=request_deadline_cap_s,
        ),
        supports_memory_references=info.supports_memory_references,
    )
