"""Protobuf messages <-> engine call types, with wire-level validation naming the field.

Wire-level means what only the wire can get wrong: a dtype left unspecified, a byte length that
disagrees with the shape, a oneof left empty, a reference sent to a server that cannot resolve
it. Shapes, dtypes per field and ranges are checked by ``ddtree.service.calls`` (run by the
engine), the same checks the embedded client gets.

``TensorResolver.resolve`` is the one function that turns a wire ``Tensor`` into a torch tensor:
inline bytes become a CPU tensor, a reference into registered memory becomes a zero-copy view of
the caller's GPU memory (``ddtree.service.memory``). Each request decoder works on a per-call
resolver (``TensorResolver.for_call``) whose leases travel in the call and end with its work.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ddtree.kernels.types import ACCEPTANCE_FIELDS, TREE_FIELDS, Acceptance, Tree
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
    InvalidReference,
    InvalidTensor,
    MemoryReferencesUnsupported,
    MissingField,
    TensorTooLarge,
)
from ddtree.service.memory import Leases, RegionTable
from ddtree.v1 import tensor_pb2, tree_pb2
from ddtree.v1 import tree_speculation_service_pb2 as service_pb2

__all__ = [
    "DTYPE_TO_TORCH",
    "TORCH_TO_DTYPE",
    "TensorResolver",
    "accept_tree_call",
    "acceptance_refs_to_proto",
    "acceptance_to_proto",
    "build_tree_call",
    "ref_tensor_to_proto",
    "server_info_to_proto",
    "tensor_to_proto",
    "tree_from_proto",
    "tree_refs_to_proto",
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
    memory : RegionTable, optional
        The engine's registered memory; ``None`` refuses references (FAILED_PRECONDITION,
        ``MEMORY_REFERENCES_UNSUPPORTED``).
    owner : str
        Identity of the caller whose requests this resolver decodes (``access.client_identity``;
        ``""`` in-process): references resolve only to regions it may use.
    """

    def __init__(
        self, limits: CallLimits, memory: RegionTable | None = None, owner: str = ""
    ) -> None:
        self.limits = limits
        self.memory = memory
        self.owner = owner
        self.leases: Leases | None = None
        """Leases of the call this resolver decodes (``for_call``); ``None`` on the shared one."""

    def for_owner(self, owner: str) -> TensorResolver:
        """The same resolver for the requests of caller identity ``owner``."""
        return TensorResolver(self.limits, self.memory, owner)

    def for_call(self) -> TensorResolver:
        """A resolver for one request, collecting the leases of the regions it references."""
        resolver = TensorResolver(self.limits, self.memory, self.owner)
        if self.memory is not None:
            resolver.leases = self.memory.leases(self.owner)
        return resolver

    def release(self) -> None:
        """End the leases taken so far (the request was refused before reaching the engine)."""
        if self.leases is not None:
            self.leases.release()

    @property
    def supports_references(self) -> bool:
        """Whether references resolve (a CUDA engine with registered memory)."""
        return self.memory is not None

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
            Inline: a CPU tensor of ``message.shape`` owning a copy of the bytes. Reference: a
            view of the caller's registered GPU memory (no copy; writes reach the caller).

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
            ``ref`` is set and this server has no registered memory.
        MemoryTokenNotFound, InvalidReference, DeviceMismatch
            A reference to an unknown region, out of bounds or misaligned, or on another GPU.
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
        if shape and min(shape) < 0:
            raise InvalidTensor(
                f"{field}.shape: expected extents >= 0, got {list(shape)}", field=f"{field}.shape"
            )
        byte_size = self._checked_size(field, dtype, shape)
        kind = message.WhichOneof("data")
        if kind is None:
            raise MissingField(f"{field}: neither inline nor ref data is set", field=field)
        if kind == "ref":
            return self._view(message.ref, field, dtype, shape)
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

    def resolve_ref(
        self,
        ref: tensor_pb2.TensorRef,
        field: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """A view of registered memory for ``ref`` with ``dtype`` and ``shape`` (see ``resolve``).

        Also used for output destinations, whose dtype and shape follow from the request.
        """
        leases = self._call_leases(field)
        self._checked_size(field, dtype, shape)
        return leases.resolve(field, ref.region_token, ref.offset_bytes, dtype, shape)

    def _checked_size(self, field: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        """``prod(shape) * itemsize``, refused past ``max_tensor_bytes``."""
        byte_size = math.prod(shape) * dtype.itemsize
        if byte_size > self.limits.max_tensor_bytes:
            raise TensorTooLarge(
                f"{field}: shape {list(shape)} needs {byte_size} bytes, over the server's "
                f"max_tensor_bytes {self.limits.max_tensor_bytes}; split the batch",
                field=field,
            )
        return byte_size

    def _view(
        self, ref: tensor_pb2.TensorRef, field: str, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        # ``resolve_ref`` after the size check (``resolve`` has made it already).
        leases = self._call_leases(field)
        return leases.resolve(field, ref.region_token, ref.offset_bytes, dtype, shape)

    def _call_leases(self, field: str) -> Leases:
        leases = self.leases
        if leases is None:
            if self.memory is None:
                raise MemoryReferencesUnsupported(
                    f"{field}.ref: this server does not support registered memory references "
                    "(GetServerInfo.supports_memory_references is false); send the tensor inline",
                    field=f"{field}.ref",
                )
            raise RuntimeError("TensorResolver.resolve_ref: use a per-call resolver (for_call)")
        return leases

    def required(self, parent: object, name: str, field: str) -> torch.Tensor:
        """Decode the message-typed field ``name`` of ``parent``, which must be set."""
        if not parent.HasField(name):  # type: ignore[attr-defined]
            raise MissingField(f"{field}: required tensor is not set", field=field)
        return self.resolve(getattr(parent, name), field)

    def refuse_output_refs(self, parent: object, name: str, field: str) -> None:
        """Refuse an output reference field when this server cannot write into caller memory."""
        if parent.HasField(name) and not self.supports_references:  # type: ignore[attr-defined]
            raise MemoryReferencesUnsupported(
                f"{field}: this server does not support registered memory; leave the output "
                "references unset to get the outputs inline",
                field=field,
            )

    def refuse_event(self, handle: bytes, field: str) -> None:
        """Refuse a CUDA IPC event handle when this server has no IPC support."""
        if handle and not self.supports_references:
            raise EventHandlesUnsupported(
                f"{field}: this server does not support CUDA IPC events; synchronise the "
                "producing stream before the call and leave it empty",
                field=field,
            )

    def output(
        self,
        parent: object,
        name: str,
        field: str,
        dtype: torch.dtype,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """Resolve the output reference field ``name`` of ``parent``, which must be set."""
        if not parent.HasField(name):  # type: ignore[attr-defined]
            raise MissingField(
                f"{field}: set every output reference of the message or none", field=field
            )
        ref: tensor_pb2.TensorRef = getattr(parent, name)
        return self.resolve_ref(ref, field, dtype, shape)


def _dtype_name(value: int) -> str:
    try:
        return str(tensor_pb2.DType.Name(value))
    except ValueError:
        return f"unknown dtype {value}"


@contextmanager
def _per_call(resolver: TensorResolver) -> Iterator[TensorResolver]:
    """A per-call resolver whose leases end if decoding fails (else they travel in the call)."""
    call_resolver = resolver.for_call()
    try:
        yield call_resolver
    except BaseException:
        call_resolver.release()
        raise


def ref_tensor_to_proto(tensor: torch.Tensor, ref: tensor_pb2.TensorRef) -> tensor_pb2.Tensor:
    """A wire tensor that names ``tensor``'s dtype and shape and points at ``ref``."""
    return tensor_pb2.Tensor(dtype=TORCH_TO_DTYPE[tensor.dtype], shape=list(tensor.shape), ref=ref)


def _set_ref(message: tensor_pb2.Tensor, tensor: torch.Tensor, ref: tensor_pb2.TensorRef) -> None:
    # Filled in place: a submessage built apart and copied in costs half as much again.
    message.dtype = TORCH_TO_DTYPE[tensor.dtype]
    message.shape.extend(tensor.shape)
    message.ref.CopyFrom(ref)


def tree_refs_to_proto(
    refs: tree_pb2.TreeOutputRefs, tree: Tree, message: tree_pb2.Tree | None = None
) -> tree_pb2.Tree:
    """The response ``Tree`` of a tree written into caller memory: references, no bytes.

    Fills ``message`` (an empty ``Tree`` inside the response: no copy of it afterwards) when
    given, else a new one; returns it.
    """
    if message is None:
        message = tree_pb2.Tree()
    message.draft_len = tree.draft_len
    for name in TREE_FIELDS:
        _set_ref(getattr(message, name), getattr(tree, name), getattr(refs, name))
    return message


def acceptance_refs_to_proto(
    refs: tree_pb2.AcceptanceOutputRefs,
    acceptance: Acceptance,
    message: tree_pb2.Acceptance | None = None,
) -> tree_pb2.Acceptance:
    """The response ``Acceptance`` written into caller memory: references, no bytes.

    Fills ``message`` (an empty ``Acceptance`` inside the response) when given, else a new
    one; returns it.
    """
    if message is None:
        message = tree_pb2.Acceptance()
    for name in ACCEPTANCE_FIELDS:
        _set_ref(getattr(message, name), getattr(acceptance, name), getattr(refs, name))
    return message


def _leading(tensor: torch.Tensor, rank: int, dim: int) -> int:
    # Output shapes follow from the inputs; a malformed input gets its own error from the
    # engine's validation, so here it just yields an empty destination.
    return int(tensor.shape[dim]) if tensor.dim() == rank else 0


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
    """Decode a BuildTree request.

    Results come back inline (on the host) unless ``outputs`` names caller memory, where the
    engine writes the tree instead. ``budgets`` must travel inline: the server reads them on the
    host before the call's IPC event has been waited on.
    """
    resolver.refuse_event(request.wait_event_ipc_handle, "build_tree.wait_event_ipc_handle")
    resolver.refuse_output_refs(request, "outputs", "build_tree.outputs")
    with _per_call(resolver) as call_resolver:
        logits = call_resolver.required(request, "draft_logits", "build_tree.draft_logits")
        roots = call_resolver.required(request, "root_tokens", "build_tree.root_tokens")
        spec = request.WhichOneof("budget_spec")
        budget: int | torch.Tensor
        if spec == "budgets":
            if request.budgets.WhichOneof("data") == "ref":
                raise InvalidReference(
                    "build_tree.budgets.ref: per-request budgets are read on the host; send them "
                    "inline",
                    field="build_tree.budgets.ref",
                )
            budget = call_resolver.resolve(request.budgets, "build_tree.budgets")
            largest = int(budget.max()) if budget.numel() else 0
        elif spec == "budget":
            budget = largest = int(request.budget)
        else:
            raise MissingField(
                "build_tree.budget: set budget (one for all requests) or budgets (one per request)",
                field="build_tree.budget",
            )
        out = None
        if request.HasField("outputs"):
            out = _tree_outputs(
                call_resolver,
                request.outputs,
                "build_tree.outputs",
                batch_size=_leading(logits, 3, 0),
                num_nodes_max=1 + (int(request.max_budget) or largest),
                draft_len=_leading(logits, 3, 1),
            )
        return BuildTreeCall(
            draft_logits=logits,
            root_tokens=roots,
            budget=budget,
            max_budget=int(request.max_budget) or None,
            temperature=request.temperature if request.HasField("temperature") else 1.0,
            model=request.model,
            result_device=None if out is not None else torch.device("cpu"),
            deadline_s=deadline_s,
            out=out,
            wait_event_ipc_handle=request.wait_event_ipc_handle,
            leases=call_resolver.leases,
        )


def _tree_outputs(
    resolver: TensorResolver,
    refs: tree_pb2.TreeOutputRefs,
    field: str,
    *,
    batch_size: int,
    num_nodes_max: int,
    draft_len: int,
) -> Tree:
    pair = (batch_size, num_nodes_max)
    words = (num_nodes_max + 63) // 64
    return Tree(
        tokens=resolver.output(refs, "tokens", f"{field}.tokens", torch.int64, pair),
        parents=resolver.output(refs, "parents", f"{field}.parents", torch.int32, pair),
        depths=resolver.output(refs, "depths", f"{field}.depths", torch.int32, pair),
        log_probs=resolver.output(refs, "log_probs", f"{field}.log_probs", torch.float32, pair),
        num_nodes=resolver.output(
            refs, "num_nodes", f"{field}.num_nodes", torch.int32, (batch_size,)
        ),
        mask=resolver.output(refs, "mask", f"{field}.mask", torch.int64, (*pair, words)),
        draft_len=draft_len,
    )


def accept_tree_call(
    request: service_pb2.AcceptTreeRequest,
    resolver: TensorResolver,
    *,
    deadline_s: float | None = None,
) -> AcceptTreeCall:
    """Decode an AcceptTree request (with its optional KV commit).

    A KV cache sent by reference is compacted in place in the caller's memory; ``outputs``
    names caller memory for the acceptance.
    """
    resolver.refuse_event(request.wait_event_ipc_handle, "accept_tree.wait_event_ipc_handle")
    resolver.refuse_output_refs(request, "outputs", "accept_tree.outputs")
    _require(request, "tree", "accept_tree.tree")
    with _per_call(resolver) as call_resolver:
        return _accept_tree_call(request, call_resolver, deadline_s)


def _accept_tree_call(
    request: service_pb2.AcceptTreeRequest,
    resolver: TensorResolver,
    deadline_s: float | None,
) -> AcceptTreeCall:
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
    out = None
    if request.HasField("outputs"):
        field = "accept_tree.outputs"
        refs = request.outputs
        batch_size = _leading(tree.tokens, 2, 0)
        path = (batch_size, tree.draft_len + 1)
        out = Acceptance(
            nodes=resolver.output(refs, "nodes", f"{field}.nodes", torch.int32, path),
            tokens=resolver.output(refs, "tokens", f"{field}.tokens", torch.int64, path),
            length=resolver.output(refs, "length", f"{field}.length", torch.int32, (batch_size,)),
            bonus=resolver.output(refs, "bonus", f"{field}.bonus", torch.int64, (batch_size,)),
        )
    return AcceptTreeCall(
        tree=tree,
        target_tokens=tokens,
        target_logits=logits,
        temperature=request.temperature,
        seed=request.seed if request.HasField("seed") else None,
        kv_commit=kv_commit,
        model=request.model,
        result_device=None if out is not None else torch.device("cpu"),
        deadline_s=deadline_s,
        out=out,
        wait_event_ipc_handle=request.wait_event_ipc_handle,
        leases=resolver.leases,
    )


def verify_attention_call(
    request: service_pb2.VerifyAttentionRequest,
    resolver: TensorResolver,
    *,
    deadline_s: float | None = None,
) -> VerifyAttentionCall:
    """Decode a VerifyAttention request; ``out_ref`` / ``lse_ref`` name caller memory."""
    resolver.refuse_event(request.wait_event_ipc_handle, "verify_attention.wait_event_ipc_handle")
    resolver.refuse_output_refs(request, "out_ref", "verify_attention.out_ref")
    resolver.refuse_output_refs(request, "lse_ref", "verify_attention.lse_ref")
    _require(request, "tree", "verify_attention.tree")
    with _per_call(resolver) as call_resolver:
        q = call_resolver.required(request, "q", "verify_attention.q")
        v_dim = request.v_dim if request.HasField("v_dim") else 512
        heads = (_leading(q, 4, 0), _leading(q, 4, 1), _leading(q, 4, 2))
        out = lse = None
        if request.HasField("out_ref"):
            out = call_resolver.output(
                request, "out_ref", "verify_attention.out_ref", torch.bfloat16, (*heads, v_dim)
            )
        if request.HasField("lse_ref"):
            lse = call_resolver.output(
                request, "lse_ref", "verify_attention.lse_ref", torch.float32, heads
            )
        return VerifyAttentionCall(
            q=q,
            kv_cache=call_resolver.required(request, "kv_cache", "verify_attention.kv_cache"),
            block_table=call_resolver.required(
                request, "block_table", "verify_attention.block_table"
            ),
            prefix_lens=call_resolver.required(
                request, "prefix_lens", "verify_attention.prefix_lens"
            ),
            tree=tree_from_proto(request.tree, "verify_attention.tree", call_resolver),
            v_dim=v_dim,
            sm_scale=request.sm_scale if request.HasField("sm_scale") else None,
            model=request.model,
            result_device=torch.device("cpu"),
            deadline_s=deadline_s,
            out=out,
            lse=lse,
            wait_event_ipc_handle=request.wait_event_ipc_handle,
            leases=call_resolver.leases,
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
            max_channels=info.max_channels,
        ),
        supports_memory_references=info.supports_memory_references,
    )
