"""The service's exception hierarchy: each class carries its gRPC status and a stable reason.

Raised by ``convert``, the ``Engine`` and the server; one interceptor (``ddtree.service.server``)
maps them to a status code plus ``google.rpc`` details, table-driven from the class attributes.
This module imports no gRPC, so the engine stays transport-free: ``code`` is the name of a
``grpc.StatusCode`` member. ``reason`` strings are API (documented in the .proto) and never renamed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

__all__ = [
    "DDTreeError",
    "DeadlineExceeded",
    "DeviceMismatch",
    "EventHandlesUnsupported",
    "FailedPrecondition",
    "Internal",
    "InvalidAcceptance",
    "InvalidArgument",
    "InvalidBlockTable",
    "InvalidIpcHandle",
    "InvalidLength",
    "InvalidModelLabel",
    "InvalidReference",
    "InvalidTensor",
    "InvalidToken",
    "InvalidTree",
    "IpcOpenFailed",
    "MalformedRequest",
    "MemoryLimitExceeded",
    "MemoryReferencesUnsupported",
    "MemoryRegistrationUnsupported",
    "MemoryTokenNotFound",
    "MissingField",
    "NotFound",
    "OutOfMemory",
    "Overloaded",
    "ResourceExhausted",
    "ShuttingDown",
    "TensorTooLarge",
    "Unavailable",
    "ValueOutOfRange",
    "WarmingUp",
]


class DDTreeError(Exception):
    """Root of every error the service raises on purpose.

    Parameters
    ----------
    message : str
        What went wrong, what was expected and what was received; starts with the field path
        when one field is at fault (``"build_tree.budget: expected 1..1024, got 0"``).
    field : str, optional
        Dotted path of the offending request field (``"build_tree.draft_logits"``), reported as
        a ``google.rpc.BadRequest`` field violation.
    metadata : Mapping[str, str], optional
        Extra ``ErrorInfo.metadata`` entries (for example ``request_index``).
    retry_after_s : float, optional
        Suggested back-off, reported as ``google.rpc.RetryInfo``; defaults to the class's.
    """

    code: ClassVar[str] = "INTERNAL"
    """Name of the ``grpc.StatusCode`` member this error maps to."""
    reason: ClassVar[str] = "INTERNAL"
    """Stable UPPER_SNAKE ``ErrorInfo.reason``."""
    default_retry_after_s: ClassVar[float | None] = None
    """Back-off suggested to clients when retrying helps; ``None`` when it does not."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.metadata: dict[str, str] = dict(metadata or {})
        if retry_after_s is None:
            retry_after_s = self.default_retry_after_s
        self.retry_after_s = retry_after_s


class InvalidArgument(DDTreeError, ValueError):
    """A request field is malformed; the message names it."""

    code = "INVALID_ARGUMENT"
    reason = "INVALID_ARGUMENT"


class MissingField(InvalidArgument):
    """A required field is not set."""

    reason = "MISSING_FIELD"


class InvalidTensor(InvalidArgument):
    """A tensor's dtype, shape or byte length does not fit its field."""

    reason = "INVALID_TENSOR"


class TensorTooLarge(InvalidArgument):
    """A tensor or the batch exceeds the server's limits."""

    reason = "TENSOR_TOO_LARGE"


class ValueOutOfRange(InvalidArgument):
    """A scalar argument (budget, temperature, ...) is outside its valid range."""

    reason = "VALUE_OUT_OF_RANGE"


class InvalidModelLabel(InvalidArgument):
    """The ``model`` label is not at most 64 characters of ``[A-Za-z0-9_.:-]``."""

    reason = "INVALID_MODEL_LABEL"


class MalformedRequest(InvalidArgument):
    """The request bytes are not a valid protobuf message of the method's request type."""

    reason = "MALFORMED_REQUEST"


class InvalidToken(InvalidArgument):
    """A token id read from the request is out of range (``ErrorFlag.TOKEN``)."""

    reason = "INVALID_TOKEN"


class InvalidTree(InvalidArgument):
    """A tree is malformed (``ErrorFlag.TREE``)."""

    reason = "INVALID_TREE"


class InvalidBlockTable(InvalidArgument):
    """A block-table entry is outside ``[0, num_pages)`` (``ErrorFlag.BLOCK_TABLE``)."""

    reason = "INVALID_BLOCK_TABLE"


class InvalidLength(InvalidArgument):
    """A prefix length is negative or overflows the block table (``ErrorFlag.LENGTH``)."""

    reason = "INVALID_LENGTH"


class InvalidAcceptance(InvalidArgument):
    """An accepted path is malformed (``ErrorFlag.ACCEPTANCE``)."""

    reason = "INVALID_ACCEPTANCE"


class InvalidReference(InvalidArgument):
    """A tensor reference lies outside its region, overflows, or is misaligned for its dtype."""

    reason = "INVALID_REFERENCE"


class InvalidIpcHandle(InvalidArgument):
    """A CUDA IPC handle is not 64 bytes, or ``byte_size`` does not fit the allocation."""

    reason = "INVALID_IPC_HANDLE"


class NotFound(DDTreeError, LookupError):
    """A named resource does not exist."""

    code = "NOT_FOUND"
    reason = "NOT_FOUND"


class MemoryTokenNotFound(NotFound):
    """A region token is unknown or expired; the client re-registers."""

    reason = "MEMORY_TOKEN_NOT_FOUND"


class FailedPrecondition(DDTreeError, RuntimeError):
    """The request is well-formed but this server cannot serve it in its current setup."""

    code = "FAILED_PRECONDITION"
    reason = "FAILED_PRECONDITION"


class MemoryReferencesUnsupported(FailedPrecondition):
    """A tensor or output reference was sent to a server without registered memory."""

    reason = "MEMORY_REFERENCES_UNSUPPORTED"


class MemoryRegistrationUnsupported(FailedPrecondition):
    """``RegisterMemory`` on a server without registered memory."""

    reason = "MEMORY_REGISTRATION_UNSUPPORTED"


class EventHandlesUnsupported(FailedPrecondition):
    """A CUDA IPC event handle was sent to a server without IPC support."""

    reason = "EVENT_HANDLES_UNSUPPORTED"


class IpcOpenFailed(FailedPrecondition):
    """The driver cannot open a CUDA IPC handle (closed, foreign, other node, no hostIPC)."""

    reason = "IPC_OPEN_FAILED"


class DeviceMismatch(FailedPrecondition):
    """Memory on another GPU than the server's (devices are named by UUID)."""

    reason = "DEVICE_MISMATCH"


class ResourceExhausted(DDTreeError, RuntimeError):
    """A server limit or device memory is exhausted; retrying later may succeed."""

    code = "RESOURCE_EXHAUSTED"
    reason = "RESOURCE_EXHAUSTED"
    default_retry_after_s = 0.05


class Overloaded(ResourceExhausted):
    """More concurrent calls than ``max_concurrent_calls``."""

    reason = "OVERLOADED"


class MemoryLimitExceeded(ResourceExhausted):
    """Registering would pass the server's region-count or byte limit."""

    reason = "MEMORY_LIMIT_EXCEEDED"
    default_retry_after_s = 1.0  # regions free up as callers unregister or regions expire


class OutOfMemory(ResourceExhausted, MemoryError):
    """The device ran out of memory for this call."""

    reason = "OUT_OF_MEMORY"
    default_retry_after_s = 0.2


class Unavailable(DDTreeError, RuntimeError):
    """The server cannot take calls right now."""

    code = "UNAVAILABLE"
    reason = "UNAVAILABLE"
    default_retry_after_s = 0.5


class WarmingUp(Unavailable):
    """Kernels are still warming up; health reports NOT_SERVING."""

    reason = "WARMING_UP"


class ShuttingDown(Unavailable):
    """The server is draining after SIGTERM or ``close()``."""

    reason = "SHUTTING_DOWN"


class DeadlineExceeded(DDTreeError, TimeoutError):
    """The call's deadline passed before its work ran."""

    code = "DEADLINE_EXCEEDED"
    reason = "DEADLINE_EXCEEDED"


class Internal(DDTreeError, RuntimeError):
    """A broken invariant or a device failure; the message is safe to send to the client."""

    code = "INTERNAL"
    reason = "INTERNAL"
