"""Remote clients of ``ddtree.v1.TreeSpeculationService``: ``Client`` (sync), ``AsyncClient``.

Connect by ``host:port`` or ``unix:/path``. Tensors travel inline; results come back on the
device of the call's main input (``draft_logits``, ``tree``, ``q``). Every call takes a
``timeout_s`` (default ``default_timeout_s``), which is the deadline for all attempts together.
Only UNAVAILABLE and RESOURCE_EXHAUSTED are retried, only for idempotent RPCs, with jittered
exponential back-off (at least the server's ``RetryInfo`` delay) and a retry budget shared by
the client's calls, so a down server is not hammered.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from ddtree.clients import _wire
from ddtree.clients.errors import DDTreeClientError, DeadlineExceededError
from ddtree.clients.types import KvCommit, ServerInfo
from ddtree.kernels.types import Acceptance, Tree
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "AsyncClient", "Client", "RetryPolicy"]

DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
"""Default largest message the client sends or accepts (the server's default limit)."""

_RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})
_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
_T = TypeVar("_T")


@dataclass(frozen=True)
class RetryPolicy:
    """How idempotent calls are retried on UNAVAILABLE and RESOURCE_EXHAUSTED.

    Attributes
    ----------
    max_attempts : int
        Attempts per call including the first, ``>= 1`` (1 disables retries).
    initial_backoff_s : float
        Upper bound of the first back-off; each later bound is ``multiplier`` times larger.
    max_backoff_s : float
        Largest back-off bound.
    multiplier : float
        Growth of the bound per attempt, ``>= 1``.
    budget_tokens : float
        Retry budget: each retry spends one token, each successful call returns
        ``budget_refill`` tokens; no retries while fewer than one token is left.
    budget_refill : float
        Tokens a successful call returns to the budget.
    """

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    budget_tokens: float = 10.0
    budget_refill: float = 0.1

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: expected >= 1, got {self.max_attempts}")
        if not self.initial_backoff_s >= 0 or not self.max_backoff_s >= 0:
            raise ValueError("initial_backoff_s and max_backoff_s: expected >= 0")
        if self.multiplier < 1:
            raise ValueError(f"multiplier: expected >= 1, got {self.multiplier}")


class _RetryBudget:
    """Token bucket shared by one client's calls (thread-safe)."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy
        self._tokens = policy.budget_tokens
        self._lock = threading.Lock()

    def try_spend(self) -> bool:
        with self._lock:
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True

    def refill(self) -> None:
        with self._lock:
            refilled = self._tokens + self._policy.budget_refill
            self._tokens = min(self._policy.budget_tokens, refilled)


def _backoff_s(policy: RetryPolicy, attempt: int, error: DDTreeClientError) -> float:
    bound = min(policy.max_backoff_s, policy.initial_backoff_s * policy.multiplier**attempt)
    delay = random.uniform(0, bound)  # full jitter
    if error.retry_after_s is not None:
        delay = max(delay, error.retry_after_s)
    return delay


def _target(address: str) -> str:
    if address.startswith("unix:"):
        if not address[len("unix:") :].startswith("/"):
            raise ValueError(f"address: expected unix:/absolute/path, got {address!r}")
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address: expected host:port or unix:/path, got {address!r}")
    return address


def _channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class _Plan:
    """One call's deadline and retry decisions, shared by the sync and async loops."""

    def __init__(
        self,
        policy: RetryPolicy,
        budget: _RetryBudget,
        timeout_s: float,
        idempotent: bool,
    ) -> None:
        self.policy = policy
        self.budget = budget
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.idempotent = idempotent
        self.attempt = 0

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def next_delay_s(self, error: DDTreeClientError) -> float | None:
        """Seconds to wait before the next attempt, or ``None`` to give up with ``error``."""
        self.attempt += 1
        if not self.idempotent or error.code not in _RETRYABLE:
            return None
        if self.attempt >= self.policy.max_attempts:
            return None
        delay = _backoff_s(self.policy, self.attempt - 1, error)
        if delay >= self.remaining_s() or not self.budget.try_spend():
            return None
        return delay

    def timed_out(self) -> DeadlineExceededError:
        return DeadlineExceededError(
            "DEADLINE_EXCEEDED", f"no reply within timeout_s={self.timeout_s:g}"
        )


class Client:
    """Synchronous client of a ddtree server.

    Parameters
    ----------
    address : str
        ``host:port`` or ``unix:/absolute/path``.
    default_timeout_s : float
        Deadline of calls that pass no ``timeout_s``.
    retry : RetryPolicy
        Retries of idempotent calls on UNAVAILABLE / RESOURCE_EXHAUSTED.
    max_message_bytes : int
        Largest message sent or accepted; keep it at or below the server's limit.

    Examples
    --------
    >>> with Client("127.0.0.1:50051") as client:  # doctest: +SKIP
    ...     tree = client.build_tree(torch.randn(1, 4, 32000), torch.tensor([7]), budget=16)
    ...     acceptance = client.accept_tree(tree, torch.zeros_like(tree.tokens))
    """

    def __init__(
        self,
        address: str,
        *,
        default_timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.default_timeout_s = default_timeout_s
        self._retry = retry or RetryPolicy()
        self._budget = _RetryBudget(self._retry)
        self._channel = grpc.insecure_channel(
            _target(address), options=_channel_options(max_message_bytes)
        )
        self._stub = pb_grpc.TreeSpeculationServiceStub(self._channel)

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: Callable[..., Any],
        request: Any,
        timeout_s: float | None,
        *,
        idempotent: bool,
    ) -> Any:
        plan = _Plan(self._retry, self._budget, timeout_s or self.default_timeout_s, idempotent)
        while True:
            remaining = plan.remaining_s()
            if remaining <= 0:
                raise plan.timed_out()
            try:
                response = method(request, timeout=remaining)
            except grpc.RpcError as err:
                error = _wire.error_from_rpc(err)
                delay = plan.next_delay_s(error)
                if delay is None:
                    raise error from None
                time.sleep(delay)
                continue
            self._budget.refill()
            return response

    def server_info(self, *, timeout_s: float | None = None) -> ServerInfo:
        """Version, devices (by UUID), backend and limits of the server."""
        response = self._call(
            self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout_s, idempotent=True
        )
        return _wire.decode_server_info(response)

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """The server's grpc.health.v1 status: ``"SERVING"``, ``"NOT_SERVING"``, ...

        Parameters
        ----------
        service : str
            ``""`` for the whole server, or ``"ddtree.v1.TreeSpeculationService"``.
        timeout_s : float, optional
            Deadline of the check.
        """
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        response = self._call(
            stub.Check, health_pb2.HealthCheckRequest(service=service), timeout_s, idempotent=False
        )
        return _HEALTH_NAMES.get(response.status, "UNKNOWN")

    def build_tree(
        self,
        draft_logits: torch.Tensor,
        root_tokens: torch.Tensor,
        budget: int | torch.Tensor,
        *,
        temperature: float = 1.0,
        max_budget: int | None = None,
        model: str = "",
        timeout_s: float | None = None,
    ) -> Tree:
        """Build each request's DDTree (see ``ddtree.kernels.build_tree``).

        Parameters
        ----------
        draft_logits : torch.Tensor
            Shape ``(batch_size, draft_len, vocab_size)``, bf16/fp16/fp32, any device.
        root_tokens : torch.Tensor
            Shape ``(batch_size,)``, int64. Previous bonus tokens, in ``[0, vocab_size)``.
        budget : int or torch.Tensor
            Draft nodes besides the root, ``1..1024``: one int, or shape ``(batch_size,)``
            int32/int64 per request.
        temperature : float
            Drafter temperature, ``> 0``.
        max_budget : int, optional
            Fixes ``num_nodes_max = 1 + max_budget`` for per-request budgets.
        model : str
            Optional label for per-model metrics, ``<= 64`` chars of ``[A-Za-z0-9_.:-]``.
        timeout_s : float, optional
            Deadline of the call, all retries included.

        Returns
        -------
        Tree
            On ``draft_logits.device``.

        Raises
        ------
        InvalidArgumentError
            Bad input; ``field`` names it.
        """
        request = _wire.build_tree_request(
            draft_logits,
            root_tokens,
            budget,
            temperature=temperature,
            max_budget=max_budget,
            model=model,
        )
        response = self._call(self._stub.BuildTree, request, timeout_s, idempotent=True)
        return _wire.decode_tree(response.tree, draft_logits.device)

    def accept_tree(
        self,
        tree: Tree,
        target_tokens: torch.Tensor | None = None,
        *,
        target_logits: torch.Tensor | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        kv_commit: KvCommit | None = None,
        model: str = "",
        timeout_s: float | None = None,
    ) -> Acceptance:
        """Walk each tree along the target's verdict; optionally compact the KV cache.

        Parameters
        ----------
        tree : Tree
            The verified trees, as ``build_tree`` returned them.
        target_tokens : torch.Tensor, optional
            Shape ``(batch_size, num_nodes_max)``, int64: the target's token at each node.
        target_logits : torch.Tensor, optional
            Shape ``(batch_size, num_nodes_max, vocab_size)``, float: the target's logits
            (argmax at ``temperature == 0``, sampled otherwise). Exactly one target is given.
        temperature : float
            ``0`` for greedy, ``> 0`` to sample from the target's distribution.
        seed : int, optional
            Sampler seed, ``0 .. 2**64 - 1``; same seed and inputs give the same result.
        kv_commit : KvCommit, optional
            The caller's paged KV cache, compacted in place to the accepted path.
        model : str
            Optional label for per-model metrics.
        timeout_s : float, optional
            Deadline of the call, all retries included.

        Returns
        -------
        Acceptance
            On ``tree.device``.
        """
        request = _wire.accept_tree_request(
            tree,
            target_tokens,
            target_logits=target_logits,
            temperature=temperature,
            seed=seed,
            kv_commit=kv_commit,
            model=model,
        )
        # Idempotent: the cache travels inline, so a retry recomputes the same compaction.
        response = self._call(self._stub.AcceptTree, request, timeout_s, idempotent=True)
        return _wire.finish_accept_tree(response, tree, kv_commit)

    def verify_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        tree: Tree,
        *,
        v_dim: int = 512,
        sm_scale: float | None = None,
        model: str = "",
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tree-masked paged MLA attention (see ``ddtree.kernels.verify_attention``).

        Parameters
        ----------
        q : torch.Tensor
            Shape ``(batch_size, num_nodes_max, num_heads, head_dim)``, bf16.
        kv_cache : torch.Tensor
            Shape ``(num_pages, page_size, head_dim)``, bf16.
        block_table : torch.Tensor
            Shape ``(batch_size, max_pages)``, int32.
        prefix_lens : torch.Tensor
            Shape ``(batch_size,)``, int32.
        tree : Tree
            The trees being verified.
        v_dim : int
            Value width, ``1 <= v_dim <= head_dim``.
        sm_scale : float, optional
            Softmax scale; default ``1 / sqrt(head_dim)``.
        model : str
            Optional label for per-model metrics.
        timeout_s : float, optional
            Deadline of the call, all retries included.

        Returns
        -------
        tuple of torch.Tensor
            ``out`` ``(batch_size, num_nodes_max, num_heads, v_dim)`` bf16 and ``lse``
            ``(batch_size, num_nodes_max, num_heads)`` fp32, on ``q.device``.
        """
        request = _wire.verify_attention_request(
            q,
            kv_cache,
            block_table,
            prefix_lens,
            tree,
            v_dim=v_dim,
            sm_scale=sm_scale,
            model=model,
        )
        response = self._call(self._stub.VerifyAttention, request, timeout_s, idempotent=True)
        return _wire.decode_tensor(response.out, q.device), _wire.decode_tensor(
            response.lse, q.device
        )


class AsyncClient:
    """``asyncio`` client of a ddtree server; the same methods as ``Client``, awaitable.

    Parameters are those of ``Client``. Create it inside a running event loop.
    """

    def __init__(
        self,
        address: str,
        *,
        default_timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.address = address
        self.default_timeout_s = default_timeout_s
        self._retry = retry or RetryPolicy()
        self._budget = _RetryBudget(self._retry)
        self._channel = grpc.aio.insecure_channel(
            _target(address), options=_channel_options(max_message_bytes)
        )
        self._stub = pb_grpc.TreeSpeculationServiceStub(self._channel)

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(
        self,
        method: Callable[..., Awaitable[_T]],
        request: Any,
        timeout_s: float | None,
        *,
        idempotent: bool,
    ) -> _T:
        plan = _Plan(self._retry, self._budget, timeout_s or self.default_timeout_s, idempotent)
        while True:
            remaining = plan.remaining_s()
            if remaining <= 0:
                raise plan.timed_out()
            try:
                response = await method(request, timeout=remaining)
            except grpc.aio.AioRpcError as err:
                error = _wire.error_from_rpc(err)
                delay = plan.next_delay_s(error)
                if delay is None:
                    raise error from None
                await asyncio.sleep(delay)
                continue
            self._budget.refill()
            return response

    async def server_info(self, *, timeout_s: float | None = None) -> ServerInfo:
        """See ``Client.server_info``."""
        response = await self._call(
            self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout_s, idempotent=True
        )
        return _wire.decode_server_info(response)

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """See ``Client.health``."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        response = await self._call(
            stub.Check, health_pb2.HealthCheckRequest(service=service), timeout_s, idempotent=False
        )
        return _HEALTH_NAMES.get(response.status, "UNKNOWN")

    async def build_tree(
        self,
        draft_logits: torch.Tensor,
        root_tokens: torch.Tensor,
        budget: int | torch.Tensor,
        *,
        temperature: float = 1.0,
        max_budget: int | None = None,
        model: str = "",
        timeout_s: float | None = None,
    ) -> Tree:
        """See ``Client.build_tree``."""
        request = _wire.build_tree_request(
            draft_logits,
            root_tokens,
            budget,
            temperature=temperature,
            max_budget=max_budget,
            model=model,
        )
        response = await self._call(self._stub.BuildTree, request, timeout_s, idempotent=True)
        return _wire.decode_tree(response.tree, draft_logits.device)

    async def accept_tree(
        self,
        tree: Tree,
        target_tokens: torch.Tensor | None = None,
        *,
        target_logits: torch.Tensor | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
        kv_commit: KvCommit | None = None,
        model: str = "",
        timeout_s: float | None = None,
    ) -> Acceptance:
        """See ``Client.accept_tree``."""
        request = _wire.accept_tree_request(
            tree,
            target_tokens,
            target_logits=target_logits,
            temperature=temperature,
            seed=seed,
            kv_commit=kv_commit,
            model=model,
        )
        response = await self._call(self._stub.AcceptTree, request, timeout_s, idempotent=True)
        return _wire.finish_accept_tree(response, tree, kv_commit)

    async def verify_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        prefix_lens: torch.Tensor,
        tree: Tree,
        *,
        v_dim: int = 512,
        sm_scale: float | None = None,
        model: str = "",
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``Client.verify_attention``."""
        request = _wire.verify_attention_request(
            q,
            kv_cache,
            block_table,
            prefix_lens,
            tree,
            v_dim=v_dim,
            sm_scale=sm_scale,
            model=model,
        )
        response = await self._call(self._stub.VerifyAttention, request, timeout_s, idempotent=True)
        return _wire.decode_tensor(response.out, q.device), _wire.decode_tensor(
            response.lse, q.device
        )
