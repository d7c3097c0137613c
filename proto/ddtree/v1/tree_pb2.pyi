from ddtree.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tree(_message.Message):
    __slots__ = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask", "draft_len")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    tokens: _tensor_pb2.Tensor
    parents: _tensor_pb2.Tensor
    depths: _tensor_pb2.Tensor
    log_probs: _tensor_pb2.Tensor
    num_nodes: _tensor_pb2.Tensor
    mask: _tensor_pb2.Tensor
    draft_len: int
    def __init__(self, tokens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., parents: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., depths: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., log_probs: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., num_nodes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., mask: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., draft_len: _Optional[int] = ...) -> None: ...

class TreeOutputRefs(_message.Message):
    __slots__ = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    tokens: _tensor_pb2.TensorRef
    parents: _tensor_pb2.TensorRef
    depths: _tensor_pb2.TensorRef
    log_probs: _tensor_pb2.TensorRef
    num_nodes: _tensor_pb2.TensorRef
    mask: _tensor_pb2.TensorRef
    def __init__(self, tokens: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., parents: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., depths: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., log_probs: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., num_nodes: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., mask: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ...) -> None: ...

class Acceptance(_message.Message):
    __slots__ = ("nodes", "tokens", "length", "bonus")
    NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    nodes: _tensor_pb2.Tensor
    tokens: _tensor_pb2.Tensor
    length: _tensor_pb2.Tensor
    bonus: _tensor_pb2.Tensor
    def __init__(self, nodes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., length: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bonus: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AcceptanceOutputRefs(_message.Message):
    __slots__ = ("nodes", "tokens", "length", "bonus")
    NODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    nodes: _tensor_pb2.TensorRef
    tokens: _tensor_pb2.TensorRef
    length: _tensor_pb2.TensorRef
    bonus: _tensor_pb2.TensorRef
    def __init__(self, nodes: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., tokens: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., length: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ..., bonus: _Optional[_Union[_tensor_pb2.TensorRef, _Mapping]] = ...) -> None: ...
