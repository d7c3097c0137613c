"""Exceptions of the ddtree clients, mapped from gRPC status plus ``google.rpc.ErrorInfo.reason``.

Every client (remote sync, remote async, embedded) raises these, so callers handle one set.
Each error carries the status ``code`` name, the server's stable ``reason`` (see the table in
``tree_speculation_service.proto``), the offending ``field`` when the server named one, the
server's ``retry_after_s`` hint, and the ``request_id`` that appears in the server log.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "CancelledError",
    "DDTreeClientError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "MemoryTokenNotFoundError",
    "NotFoundError",
    "ResourceExhaustedError",
    "UnavailableError",
    "UnknownError",
    "error_for",
]


class DDTreeClientError(Exception):
    """A ddtree call failed.

    Attributes
    ----------
    code : str
        gRPC status code name (``"INVALID_ARGUMENT"``, ``"UNAVAILABLE"``, ...).
    reason : str
        Stable ``ErrorInfo.reason`` (``"INVALID_TENSOR"``, ...); ``""`` when the server sent none
        (for example a transport failure).
    message : str
        The server's message; names the field for argument errors.
    field : str or None
        Dotted path of the offending request field (``"build_tree.draft_logits"``).
    metadata : dict of str to str
        ``ErrorInfo.metadata`` (``request_id``, ``request_index``, ...).
    retry_after_s : float or None
        The server's suggested back-off when retrying helps.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        reason: str = "",
        field: str | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"{code} {reason}: {message}" if reason else f"{code}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.field = field
        self.metadata: dict[str, str] = dict(metadata or {})
        self.retry_after_s = retry_after_s

    @property
    def request_id(self) -> str | None:
        """Id of the failed call in the server log, when the server sent one."""
        return self.metadata.get("request_id")


class InvalidArgumentError(DDTreeClientError, ValueError):
    """INVALID_ARGUMENT: the request was malformed; ``field`` says where. Do not retry."""


class NotFoundError(DDTreeClientError, LookupError):
    """NOT_FOUND: a named resource does not exist."""


class MemoryTokenNotFoundError(NotFoundError):
    """NOT_FOUND / ``MEMORY_TOKEN_NOT_FOUND``: re-register the memory region."""


class FailedPreconditionError(DDTreeClientError, RuntimeError):
    """FAILED_PRECONDITION: this server cannot serve the request as sent (see ``reason``)."""


class ResourceExhaustedError(DDTreeClientError, RuntimeError):
    """RESOURCE_EXHAUSTED: overloaded or out of device memory; retry after a back-off."""


class UnavailableError(DDTreeClientError, ConnectionError):
    """UNAVAILABLE: unreachable, warming up or draining; retry (elsewhere)."""


class DeadlineExceededError(DDTreeClientError, TimeoutError):
    """DEADLINE_EXCEEDED: the call did not finish within ``timeout_s``."""


class CancelledError(DDTreeClientError):
    """CANCELLED: the call was cancelled."""


class InternalError(DDTreeClientError, RuntimeError):
    """INTERNAL: a server-side failure; quote ``request_id`` when reporting it."""


class UnknownError(DDTreeClientError, RuntimeError):
    """Any other status."""


_BY_CODE: dict[str, type[DDTreeClientError]] = {
    "INVALID_ARGUMENT": InvalidArgumentError,
    "OUT_OF_RANGE": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "FAILED_PRECONDITION": FailedPreconditionError,
    "RESOURCE_EXHAUSTED": ResourceExhaustedError,
    "UNAVAILABLE": UnavailableError,
    "DEADLINE_EXCEEDED": DeadlineExceededError,
    "CANCELLED": CancelledError,
    "INTERNAL": InternalError,
}
_BY_REASON: dict[str, type[DDTreeClientError]] = {
    "MEMORY_TOKEN_NOT_FOUND": MemoryTokenNotFoundError,
}


def error_for(
    code: str,
    message: str,
    *,
    reason: str = "",
    field: str | None = None,
    metadata: Mapping[str, str] | None = None,
    retry_after_s: float | None = None,
) -> DDTreeClientError:
    """The exception for a status ``code`` name and ``reason`` (the most specific class)."""
    cls = _BY_REASON.get(reason) or _BY_CODE.get(code, UnknownError)
    return cls(
        code,
        message,
        reason=reason,
        field=field,
        metadata=metadata,
        retry_after_s=retry_after_s,
    )
