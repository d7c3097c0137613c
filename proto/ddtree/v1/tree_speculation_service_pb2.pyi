from ddtree.v1 import tensor_pb2 as _tensor_pb2
from ddtree.v1 import tree_pb2 as _tree_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChannelOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANNEL_OP_UNSPECIFIED: _ClassVar[ChannelOp]
    CHANNEL_OP_BUILD_TREE: _ClassVar[ChannelOp]
    CHANNEL_OP_ACCEPT: _ClassVar[ChannelOp]

class ChannelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANNEL_STATE_UNSPECIFIED: _ClassVar[ChannelState]
    CHANNEL_STATE_OPEN: _ClassVar[ChannelState]
    CHANNEL_STATE_CLOSED: _ClassVar[ChannelState]
CHANNEL_OP_UNSPECIFIED: ChannelOp
CHANNEL_OP_BUILD_TREE: ChannelOp
CHANNEL_OP_ACCEPT: ChannelOp
CHANNEL_STATE_UNSPECIFIED: ChannelState
CHANNEL_STATE_OPEN: ChannelState
CHANNEL_STATE_CLOSED: ChannelState

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Device(_message.Message):
    __slots__ = ("uuid", "name", "compute_capability_major", "compute_capability_minor", "total_memory_bytes", "backend")
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MAJOR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_MINOR_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    name: str
    compute_capability_major: int
    compute_capability_minor: int
    total_memory_bytes: int
    backend: str
    def __init__(self, uuid: _Optional[str] = ..., name: _Optional[str] = ..., compute_capability_major: _Optional[int] = ..., compute_capability_minor: _Optional[int] = ..., total_memory_bytes: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_budget", "max_draft_len", "max_message_bytes", "max_tensor_bytes", "max_batch_size", "max_concurrent_calls", "request_deadline_cap_s", "max_channels")
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_CALLS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_DEADLINE_CAP_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    max_budget: int
    max_draft_len: int
    max_message_bytes: int
    max_tensor_bytes: int
    max_batch_size: int
    max_concurrent_calls: int
    request_deadline_cap_s: float
    max_channels: int
    def __init__(self, max_budget: _Optional[int] = ..., max_draft_len: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_tensor_bytes: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_concurrent_calls: _Optional[int] = ..., request_deadline_cap_s: _Optional[float] = ..., max_channels: _Optional[int] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "devices", "limits", "supports_memory_references")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_MEMORY_REFERENCES_FIELD_NUMBER: _ClassVar[int]
    version: str
    devices: _containers.RepeatedCompositeFieldContainer[Device]
    limits: ServerLimits
    supports_memory_references: bool
    def __init__(self, version: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[Device, _Mapping]]] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., supports_memory_references: _Optional[bool] = ...) -> None: ...

class RegisterMemoryRequest(_message.Message):
    __slots__ = ("ipc_handle", "device_uuid", "byte_size", "client_id")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    device_uuid: str
    byte_size: int
    client_id: str
    def __init__(self, ipc_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., byte_size: _Optional[int] = ..., client_id: _Optional[str] = ...) -> None: ...

class RegisterMemoryResponse(_message.Message):
    __slots__ = ("region_token", "byte_size")
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region_token: str
    byte_size: int
    def __init__(self, region_token: _Optional[str] = ..., byte_size: _Optional[int] = ...) -> None: ...

class UnregisterMemoryRequest(_message.Message):
    __slots__ = ("region_token",)
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    region_token: str
    def __init__(self, region_token: _Optional[str] = ...) -> None: ...

class UnregisterMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMemoryRequest(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("region_id", "device_uuid", "byte_size")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    device_uuid: str
    byte_size: int
    def __init__(self, region_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., byte_size: _Optional[int] = ...) -> None: ...

class ListMemoryResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    def __init__(self, regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ...) -> None: ...

class BuildTreeRequest(_message.Message):
    __slots__ = ("draft_logits", "root_tokens", "budget", "budgets", "max_budget", "temperature", "model", "outputs", "wait_event_ipc_handle")
    DRAFT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    draft_logits: _tensor_pb2.Tensor
    root_tokens: _tensor_pb2.Tensor
    budget: int
    budgets: _tensor_pb2.Tensor
    max_budget: int
    temperature: float
    model: str
    outputs: _tree_pb2.TreeOutputRefs
    wait_event_ipc_handle: bytes
    def __init__(self, draft_logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., root_tokens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., budget: _Optional[int] = ..., budgets: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., max_budget: _Optional[int] = ..., temperature: _Optional[float] = ..., model: _Optional[str] = ..., outputs: _Optional[_Union[_tree_pb2.TreeOutputRefs, _Mapping]] = ..., wait_event_ipc_handle: _Optional[bytes] = ...) -> None: ...

class BuildTreeResponse(_message.Message):
    __slots__ = ("tree",)
    TREE_FIELD_NUMBER: _ClassVar[int]
    tree: _tree_pb2.Tree
    def __init__(self, tree: _Optional[_Union[_tree_pb2.Tree, _Mapping]] = ...) -> None: ...

class KvCommit(_message.Message):
    __slots__ = ("kv_cache", "block_table", "prefix_lens")
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENS_FIELD_NUMBER: _ClassVar[int]
    kv_cache: _tensor_pb2.Tensor
    block_table: _tensor_pb2.Tensor
    prefix_lens: _tensor_pb2.Tensor
    def __init__(self, kv_cache: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., block_table: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefix_lens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AcceptTreeRequest(_message.Message):
    __slots__ = ("tree", "target_tokens", "target_logits", "temperature", "seed", "kv_commit", "model", "outputs", "wait_event_ipc_handle")
    TREE_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOGITS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    KV_COMMIT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    tree: _tree_pb2.Tree
    target_tokens: _tensor_pb2.Tensor
    target_logits: _tensor_pb2.Tensor
    temperature: float
    seed: int
    kv_commit: KvCommit
    model: str
    outputs: _tree_pb2.AcceptanceOutputRefs
    wait_event_ipc_handle: bytes
    def __init__(self, tree: _Optional[_Union[_tree_pb2.Tree, _Mapping]] = ..., target_tokens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., target_logits: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., kv_commit: _Optional[_Union[KvCommit, _Mapping]] = ..., model: _Optional[str] = ..., outputs: _Optional[_Union[_tree_pb2.AcceptanceOutputRefs, _Mapping]] = ..., wait_event_ipc_handle: _Optional[bytes] = ...) -> None: ...

class AcceptTreeResponse(_message.Message):
    __slots__ = ("acceptance", "kv_cache")
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    acceptance: _tree_pb2.Acceptance
    kv_cache: _tensor_pb2.Tensor
    def __init__(self, acceptance: _Optional[_Union[_tree_pb2.Acceptance, _Mapping]] = ..., kv_cache: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class VerifyAttentionRequest(_message.Message):
    __slots__ = ("q", "kv_cache", "block_table", "prefix_lens", "tree", "v_dim", "sm_scale", "model", "out_ref", "lse_ref", "wait_event_ipc_handle")
    Q_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    V_DIM_FIELD_NUMBER: _ClassVar[int]
    SM_SCALE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUT_REF_FIELD_NUMBER: _ClassVar[int]
    LSE_REF_FIELD_NUMBER: _ClassVar[int]
    WAIT_EVENT_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    q: _tensor_pb2.Tensor
    kv_cache: _tensor_pb2.Tensor
    block_table: _tensor_pb2.Tensor
    prefix_lens: _tensor_pb2.Tensor
    tree: _tree_pb2.Tree
    v_dim: int
    sm_scale: float
    model: str
    out_ref: _tensor_pb2.TensorRef
    lse_ref: _tensor_pb2.TensorRef
    wait_event_ipc_handle: bytes
    def __init__(self, q: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., kv_cache: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., block_table: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefix_lens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tree: _Optional[_Union[_tree_pb2.Tree, _Mapping]] = ..., v_dim: _Optional[int] = ..., sm_scale: _Optional[float] = ..., model: _Optional[str] = ..., out_ref: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., lse_ref: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., wait_event_ipc_handle: _Optional[bytes] = ...) -> None: ...

class VerifyAttentionResponse(_message.Message):
    __slots__ = ("out", "lse")
    OUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    out: _tensor_pb2.Tensor
    lse: _tensor_pb2.Tensor
    def __init__(self, out: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., lse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ChannelRegion(_message.Message):
    __slots__ = ("region_token", "offset_bytes", "byte_size", "ipc_handle")
    REGION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    region_token: str
    offset_bytes: int
    byte_size: int
    ipc_handle: bytes
    def __init__(self, region_token: _Optional[str] = ..., offset_bytes: _Optional[int] = ..., byte_size: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ...) -> None: ...

class ChannelKvShape(_message.Message):
    __slots__ = ("num_pages", "page_size", "head_dim", "dtype", "max_pages")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    page_size: int
    head_dim: int
    dtype: _tensor_pb2.DType
    max_pages: int
    def __init__(self, num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., max_pages: _Optional[int] = ...) -> None: ...

class OpenChannelRequest(_message.Message):
    __slots__ = ("op", "control", "ring_size", "regions", "max_batch_size", "draft_len", "max_budget", "vocab_size", "logits_dtype", "kv", "model")
    OP_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    RING_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BUDGET_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    op: ChannelOp
    control: ChannelRegion
    ring_size: int
    regions: _containers.RepeatedCompositeFieldContainer[ChannelRegion]
    max_batch_size: int
    draft_len: int
    max_budget: int
    vocab_size: int
    logits_dtype: _tensor_pb2.DType
    kv: ChannelKvShape
    model: str
    def __init__(self, op: _Optional[_Union[ChannelOp, str]] = ..., control: _Optional[_Union[ChannelRegion, _Mapping]] = ..., ring_size: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[ChannelRegion, _Mapping]]] = ..., max_batch_size: _Optional[int] = ..., draft_len: _Optional[int] = ..., max_budget: _Optional[int] = ..., vocab_size: _Optional[int] = ..., logits_dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., kv: _Optional[_Union[ChannelKvShape, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class OpenChannelResponse(_message.Message):
    __slots__ = ("channel_token", "pipeline_depth")
    CHANNEL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    channel_token: str
    pipeline_depth: int
    def __init__(self, channel_token: _Optional[str] = ..., pipeline_depth: _Optional[int] = ...) -> None: ...

class CloseChannelRequest(_message.Message):
    __slots__ = ("channel_token",)
    CHANNEL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    channel_token: str
    def __init__(self, channel_token: _Optional[str] = ...) -> None: ...

class CloseChannelResponse(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    def __init__(self, steps: _Optional[int] = ...) -> None: ...

class WatchChannelRequest(_message.Message):
    __slots__ = ("channel_token",)
    CHANNEL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    channel_token: str
    def __init__(self, channel_token: _Optional[str] = ...) -> None: ...

class WatchChannelResponse(_message.Message):
    __slots__ = ("state", "reason")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    state: ChannelState
    reason: str
    def __init__(self, state: _Optional[_Union[ChannelState, str]] = ..., reason: _Optional[str] = ...) -> None: ...
