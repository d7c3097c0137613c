"""Remote clients of ``ddtree.v1.TreeSpeculationService``: ``Client`` (sync), ``AsyncClient``.

Connect by ``host:port`` or ``unix:/path``. Tensors travel inline by default; results come back
on the device of the call's main input (``draft_logits``, ``tree``, ``q``). With
``tensor_transport="ipc"`` (or ``"auto"``) a client on the server's node sends CUDA tensors as
references into memory it registered once by CUDA IPC (``ddtree.clients.cuda``), the server
writes results straight into fresh tensors of the caller's (or into the caller's ``out=``), and a
KV cache is compacted in place; a call repeating an earlier one with the same buffers reuses its
request (``RequestMemo``); when the server has forgotten the registrations (restart) the client
registers again and retries once, transparently. Every call takes a
``timeout_s`` (default ``default_timeout_s``), which is the deadline for all attempts together.
Only UNAVAILABLE and RESOURCE_EXHAUSTED are retried, only for idempotent RPCs, with jittered
exponential back-off (at least the server's ``RetryInfo`` delay) and a retry budget shared by
the client's calls, so a down server is not hammered. The two clients share one copy of what a
call does (``_send_steps``: a generator of the RPCs it needs); each only drives it, blocking or
awaiting.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc
import torch

from ddtree.clients import _wire
from ddtree.clients.destinations import check_acceptance_out, check_kind, check_tree_out
from ddtree.clients.errors import (
    DDTreeClientError,
    DeadlineExceededError,
    MemoryTokenNotFoundError,
)
from ddtree.clients.types import KvCommit, MemoryRegion, ServerInfo
from ddtree.kernels.types import ACCEPTANCE_FIELDS, TREE_FIELDS, Acceptance, Tree, mask_words
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ddtree.clients.cuda import ClientIpc, MemoEntry, RequestRefs

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "AsyncClient",
    "Client",
    "PreparedCall",
    "RetryPolicy",
    "TlsOptions",
]

DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
"""Default largest message the client sends or accepts (the server's default limit)."""

_RETRYABLE = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})
_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
_T = TypeVar("_T")
_TRANSPORTS = ("inline", "ipc", "auto")


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


@dataclass(frozen=True)
class TlsOptions:
    """TLS settings of a connection to a server started with ``--tls-cert`` (and mTLS).

    Attributes
    ----------
    root_certificates : bytes, optional
        PEM CA bundle that signed the server's certificate; ``None`` uses the system roots.
    certificate_chain : bytes, optional
        PEM client certificate, for servers that require one (``--tls-client-ca``).
    private_key : bytes, optional
        PEM private key of ``certificate_chain``.
    server_name : str, optional
        Name to check the server's certificate against instead of the address's host.
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("tls: expected both certificate_chain and private_key, or neither")


def _credentials(
    address: str, tls: TlsOptions | None, options: list[tuple[str, Any]]
) -> grpc.ChannelCredentials | None:
    if tls is None:
        return None
    if address.startswith("unix:"):
        raise ValueError("tls: Unix sockets are not served with TLS; connect without tls")
    if tls.server_name is not None:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )


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


def _make_ipc(transport: str, client_id: str | None, use_ipc_events: bool) -> ClientIpc | None:
    if transport not in _TRANSPORTS:
        raise ValueError(f"tensor_transport: expected one of {_TRANSPORTS}, got {transport!r}")
    if transport == "inline":
        return None
    from ddtree.clients.cuda import ClientIpc

    return ClientIpc(transport, client_id, use_ipc_events)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Op(Generic[_T]):
    """One data RPC: its tensors, optional destinations, request maker and result decoder."""

    tensors: list[tuple[str, torch.Tensor | None]]
    """Tensors that may travel by reference (inputs and destinations)."""
    outputs: tuple[torch.Tensor, ...]
    """Destinations the server writes the results into when they travel by reference."""
    make: Callable[[RequestRefs | None, bool, bytes], Any]
    """``(refs, use_outputs, wait_event_ipc_handle) -> request``."""
    finish: Callable[[Any, bool], _T]
    """``(response, use_outputs) -> result``."""
    idempotent: bool
    memo_key: Hashable | None = None
    """Key of the request in the client's ``RequestMemo``; ``None``: never memoized (the
    client allocated the destinations, or some bytes always travel inline)."""
    check: Callable[[], None] = lambda: None
    """Checks of the arguments that the key decides: run before a request is built, skipped
    for a memoized one (an earlier call with the same key passed them)."""


def _memo_key(scalars: tuple[Any, ...], tensors: Iterable[torch.Tensor | None]) -> Hashable:
    """The RPC and scalar arguments (``scalars``) and where every tensor lies and how."""
    return scalars + tuple(
        None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
        for t in tensors
    )


def _build_tree_memo_key(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int,
    *,
    temperature: float,
    max_budget: int | None,
    model: str,
    out: Tree,
) -> Hashable:
    """The request memo's key of a BuildTree into ``out`` with one budget for all requests
    (per-request budgets travel inline: their values are not in the key)."""
    scalars = ("BuildTree", temperature, max_budget, model, budget, out.draft_len)
    return _memo_key(scalars, (draft_logits, root_tokens, *(getattr(out, n) for n in TREE_FIELDS)))


def _fields(prefix: str, names: Sequence[str], values: Sequence[torch.Tensor]) -> list[Any]:
    return [(f"{prefix}.{n}", v) for n, v in zip(names, values, strict=True)]


def _tree_tensors(prefix: str, tree: Tree) -> list[Any]:
    return _fields(prefix, TREE_FIELDS, [getattr(tree, n) for n in TREE_FIELDS])


def _build_tree_op(
    ipc: ClientIpc | None,
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int | torch.Tensor,
    *,
    temperature: float,
    max_budget: int | None,
    model: str,
    out: Tree | None,
) -> _Op[Tree]:
    outputs = out
    if out is not None:
        check_kind("build_tree.out", out, Tree)
    elif ipc is not None and draft_logits.is_cuda and draft_logits.dim() == 3:
        largest = max_budget or (int(budget.max()) if isinstance(budget, torch.Tensor) else budget)
        if 1 <= largest <= 1024:
            batch_size, draft_len, _ = draft_logits.shape
            pair = (batch_size, 1 + largest)
            device = draft_logits.device
            outputs = Tree(
                tokens=torch.empty(pair, dtype=torch.int64, device=device),
                parents=torch.empty(pair, dtype=torch.int32, device=device),
                depths=torch.empty(pair, dtype=torch.int32, device=device),
                log_probs=torch.empty(pair, dtype=torch.float32, device=device),
                num_nodes=torch.empty(batch_size, dtype=torch.int32, device=device),
                mask=torch.empty(
                    (*pair, mask_words(1 + largest)), dtype=torch.int64, device=device
                ),
                draft_len=draft_len,
            )

    def make(refs: RequestRefs | None, use_outputs: bool, wait: bytes) -> pb.BuildTreeRequest:
        return _wire.build_tree_request(
            draft_logits,
            root_tokens,
            budget,
            temperature=temperature,
            max_budget=max_budget,
            model=model,
            refs=refs,
            outputs=outputs if use_outputs else None,
            wait_event_ipc_handle=wait,
        )

    def finish(response: pb.BuildTreeResponse, use_outputs: bool) -> Tree:
        if use_outputs and outputs is not None:
            return outputs
        if out is not None:
            return _wire.decode_tree_into(response.tree, out)
        return _wire.decode_tree(response.tree, draft_logits.device)

    tensors: list[tuple[str, torch.Tensor | None]] = [
        ("draft_logits", draft_logits),
        ("root_tokens", root_tokens),
    ]
    if outputs is not None:
        tensors += _tree_tensors("outputs", outputs)
    if out is None:
        return _Op(
            tensors=tensors,
            outputs=() if outputs is None else tuple(getattr(outputs, n) for n in TREE_FIELDS),
            make=make,
            finish=finish,
            idempotent=True,
        )
    memo_key = None
    if ipc is not None and not isinstance(budget, torch.Tensor):
        memo_key = _build_tree_memo_key(
            draft_logits,
            root_tokens,
            budget,
            temperature=temperature,
            max_budget=max_budget,
            model=model,
            out=out,
        )
    return _Op(
        tensors=tensors,
        outputs=tuple(getattr(out, n) for n in TREE_FIELDS),
        make=make,
        finish=finish,
        idempotent=True,
        memo_key=memo_key,
        check=lambda: check_tree_out(out, draft_logits, budget, max_budget),
    )


def _accept_tree_op(
    ipc: ClientIpc | None,
    tree: Tree,
    target_tokens: torch.Tensor | None,
    *,
    target_logits: torch.Tensor | None,
    temperature: float,
    seed: int | None,
    kv_commit: KvCommit | None,
    model: str,
    out: Acceptance | None,
) -> _Op[Acceptance]:
    outputs = out
    if out is not None:
        check_kind("accept_tree.out", out, Acceptance)
    elif ipc is not None and tree.tokens.is_cuda and tree.tokens.dim() == 2:
        path = (tree.tokens.shape[0], tree.draft_len + 1)
        device = tree.tokens.device
        outputs = Acceptance(
            nodes=torch.empty(path, dtype=torch.int32, device=device),
            tokens=torch.empty(path, dtype=torch.int64, device=device),
            length=torch.empty(path[0], dtype=torch.int32, device=device),
            bonus=torch.empty(path[0], dtype=torch.int64, device=device),
        )

    def make(refs: RequestRefs | None, use_outputs: bool, wait: bytes) -> pb.AcceptTreeRequest:
        return _wire.accept_tree_request(
            tree,
            target_tokens,
            target_logits=target_logits,
            temperature=temperature,
            seed=seed,
            kv_commit=kv_commit,
            model=model,
            refs=refs,
            outputs=outputs if use_outputs else None,
            wait_event_ipc_handle=wait,
        )

    def finish(response: pb.AcceptTreeResponse, use_outputs: bool) -> Acceptance:
        if use_outputs:
            return _wire.finish_accept_tree(response, tree, kv_commit, outputs)
        return _wire.finish_accept_tree(response, tree, kv_commit, into=out)

    tensors: list[tuple[str, torch.Tensor | None]] = _tree_tensors("tree", tree)
    tensors += [("target_tokens", target_tokens), ("target_logits", target_logits)]
    if kv_commit is not None:
        tensors += [
            ("kv_commit.kv_cache", kv_commit.kv_cache),
            ("kv_commit.block_table", kv_commit.block_table),
            ("kv_commit.prefix_lens", kv_commit.prefix_lens),
        ]
    if outputs is not None:
        tensors += _fields(
            "outputs", ACCEPTANCE_FIELDS, [getattr(outputs, n) for n in ACCEPTANCE_FIELDS]
        )
    memo_key = None
    if out is not None and ipc is not None:
        scalars = ("AcceptTree", temperature, seed, model, tree.draft_len)
        memo_key = _memo_key(scalars, (t for _, t in tensors))
    return _Op(
        tensors=tensors,
        outputs=() if outputs is None else tuple(getattr(outputs, n) for n in ACCEPTANCE_FIELDS),
        make=make,
        finish=finish,
        # A cache compacted in place must not be compacted twice by a retry.
        idempotent=kv_commit is None or ipc is None,
        memo_key=memo_key,
        check=lambda: None if out is None else check_acceptance_out(out, tree),
    )


def _verify_attention_op(
    ipc: ClientIpc | None,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree: Tree,
    *,
    v_dim: int,
    sm_scale: float | None,
    model: str,
) -> _Op[tuple[torch.Tensor, torch.Tensor]]:
    out = lse = None
    if ipc is not None and q.is_cuda and q.dim() == 4:
        heads = tuple(q.shape[:3])
        out = torch.empty((*heads, v_dim), dtype=torch.bfloat16, device=q.device)
        lse = torch.empty(heads, dtype=torch.float32, device=q.device)

    def make(refs: RequestRefs | None, use_outputs: bool, wait: bytes) -> pb.VerifyAttentionRequest:
        return _wire.verify_attention_request(
            q,
            kv_cache,
            block_table,
            prefix_lens,
            tree,
            v_dim=v_dim,
            sm_scale=sm_scale,
            model=model,
            refs=refs,
            out=out if use_outputs else None,
            lse=lse if use_outputs else None,
            wait_event_ipc_handle=wait,
        )

    def finish(
        response: pb.VerifyAttentionResponse, use_outputs: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if use_outputs and out is not None and lse is not None:
            return out, lse
        return _wire.decode_tensor(response.out, q.device), _wire.decode_tensor(
            response.lse, q.device
        )

    tensors: list[tuple[str, torch.Tensor | None]] = [
        ("q", q),
        ("kv_cache", kv_cache),
        ("block_table", block_table),
        ("prefix_lens", prefix_lens),
        *_tree_tensors("tree", tree),
    ]
    outputs: tuple[torch.Tensor, ...] = ()
    if out is not None and lse is not None:
        tensors += [("out", out), ("lse", lse)]
        outputs = (out, lse)
    return _Op(tensors=tensors, outputs=outputs, make=make, finish=finish, idempotent=True)


def _memo_entry(ipc: ClientIpc, op: _Op[Any]) -> MemoEntry | None:
    return None if op.memo_key is None else ipc.memo.get(op.memo_key)


def _request(
    ipc: ClientIpc,
    op: _Op[Any],
    refs: RequestRefs | None,
    use_outputs: bool,
    entry: MemoEntry | None,
    generation: int,
) -> Any:
    """Order the inputs, then the request to send: the memo's ``entry`` (still valid), else
    built and remembered when all of it travels by reference."""
    wait = ipc.order_inputs(refs)  # every call: records the event or synchronises the stream
    # The event handle is one per client and device, so a memoized request carries this one.
    if entry is not None and entry.request.wait_event_ipc_handle == wait:
        return entry.request
    request = op.make(refs, use_outputs, wait)
    if op.memo_key is not None and refs is not None and refs.covers(op.tensors):
        ipc.memo.put(op.memo_key, request, refs, use_outputs, generation)
    return request


def _memory_regions(response: pb.ListMemoryResponse) -> list[MemoryRegion]:
    return [MemoryRegion(r.region_id, r.device_uuid, r.byte_size) for r in response.regions]


@dataclass(frozen=True)
class _Rpc:
    """One RPC that a client's steps ask their driver to send: ``method(request)``, with the
    client's deadline (``timeout_s``, ``None``: its default) and retry policy."""

    method: Callable[..., Any]
    request: Any
    timeout_s: float | None
    idempotent: bool


_Steps = Generator[_Rpc, Any, _T]
"""A client operation written once for both clients: it yields the RPCs it needs and gets
back each reply, or has the call's ``DDTreeClientError`` raised where it yielded
(``Client._run`` and ``AsyncClient._run`` drive it)."""


def _unregister_steps(stub: Any, token: str) -> _Steps[None]:
    """Unregister ``token``, ignoring errors: a region the server no longer knows, or a server
    that is gone, is fine (cleanup)."""
    try:
        yield _Rpc(
            stub.UnregisterMemory, pb.UnregisterMemoryRequest(region_token=token), None, False
        )
    except DDTreeClientError:
        return


def _send_steps(
    ipc: ClientIpc | None,
    stub: Any,
    method: Callable[..., Any],
    op: _Op[_T],
    timeout_s: float | None,
) -> _Steps[_T]:
    """One data RPC (``method`` of ``stub``) with its memory registrations: inline without
    ``ipc``; by reference, the server's devices first (once), then a memoized request or a new
    one, registering allocations not yet registered (and unregistering the ranges they make
    stale); on MEMORY_TOKEN_NOT_FOUND (the server restarted) everything again, once."""
    if ipc is None:
        op.check()
        response = yield _Rpc(method, op.make(None, False, b""), timeout_s, True)
        return op.finish(response, False)
    for attempt in range(2):
        if not ipc.knows_server:
            reply = yield _Rpc(stub.GetServerInfo, pb.GetServerInfoRequest(), timeout_s, True)
            info = _wire.decode_server_info(reply)
            ipc.set_server(info.supports_memory_references, [d.uuid for d in info.devices])
        # Read before any token: an entry stored with it is valid while it is unchanged.
        generation = ipc.registry.generation
        entry = _memo_entry(ipc, op)
        refs: RequestRefs | None
        if entry is not None:
            refs, use_outputs = entry.refs, entry.use_outputs
        else:
            op.check()
            refs = ipc.refs(op.tensors)
            if refs is not None:
                for allocation in refs.missing():
                    request = ipc.register_request(allocation)
                    registered = yield _Rpc(stub.RegisterMemory, request, timeout_s, False)
                    for stale in ipc.registry.add(allocation, registered.region_token):
                        yield from _unregister_steps(stub, stale)
            use_outputs = ipc.uses(refs, op.outputs)
        request = _request(ipc, op, refs, use_outputs, entry, generation)
        try:
            response = yield _Rpc(method, request, timeout_s, op.idempotent)
        except MemoryTokenNotFoundError:
            if attempt or refs is None:
                raise
            ipc.forget_server()  # the server restarted: its regions (and the memo) are gone
            continue
        return op.finish(response, use_outputs)
    raise AssertionError("unreachable: the loop returns or raises")


class PreparedCall(Generic[_T]):
    """One call of a decode loop, prepared once and sent again step after step.

    Made by ``Client.prepare_build_tree``; ``prepared()`` (or ``prepared(timeout_s=...)``) does
    the call for the current contents of its tensors and returns its result, as the
    ``Client`` method with the same arguments would, errors included.

    By reference (``tensor_transport`` ``"ipc"`` or ``"auto"``), the first calls register the
    tensors' memory and build the request; from then on a call orders the inputs and sends
    that request again: no memo key, no lookup and no driver query per call (``Client``'s
    request memo does all three on every call, about 0.1 ms of a call on the H200 host). That
    is safe because the prepared call holds its tensors: their memory stays allocated, so the
    registered allocations it names cannot be freed and handed out again. The tensors must
    keep their addresses and shapes (change their contents, not the tensors): every call
    checks both, and prepares itself again where one moved. A changed registration (another
    allocation registered over the range, a server restart) is noticed as by ``Client`` and
    the call is prepared again. Inline, every call is a plain ``Client`` call.

    Not thread-safe: one decode loop calls it, as it writes the tensors.
    """

    def __init__(
        self,
        client: Client,
        method: Callable[..., Any],
        make_op: Callable[[], _Op[_T]],
        timeout_s: float | None,
    ) -> None:
        self._client = client
        self._method = method
        self._make_op = make_op
        self._timeout_s = timeout_s
        self._entry: MemoEntry | None = None
        """The request the server last answered, once it is built from references only."""
        self._prepare()

    def _prepare(self) -> None:
        """The operation for where the tensors are now (again after one moved)."""
        self._op = self._make_op()
        self._tensors = [t for _, t in self._op.tensors if t is not None]
        """Held: the memory the request names stays allocated while this call lives."""
        self._layout = [(t.data_ptr(), t.shape) for t in self._tensors]
        self._entry = None

    def __call__(self, *, timeout_s: float | None = None) -> _T:
        """Do the call; ``timeout_s`` overrides the prepared deadline."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        client, entry = self._client, self._entry
        ipc = client._ipc
        in_place = self._in_place()
        if (
            in_place
            and entry is not None
            and ipc is not None
            and ipc.knows_server
            and entry.generation == ipc.registry.generation
        ):
            op = self._op
            reply = client._resend(self._method, entry, timeout, idempotent=op.idempotent)
            if reply is not None:
                return op.finish(reply, entry.use_outputs)
        if not in_place:
            self._prepare()
        op = self._op
        result = client._send(self._method, op, timeout)
        if ipc is not None and op.memo_key is not None:
            self._entry = ipc.memo.get(op.memo_key)
        return result

    def _in_place(self) -> bool:
        """Whether every tensor still has the address and shape it was prepared with."""
        for tensor, (pointer, shape) in zip(self._tensors, self._layout, strict=True):
            if tensor.data_ptr() != pointer or tensor.shape != shape:
                return False
        return True


class _Connection:
    """What both clients hold: the address, the default deadline, the retry budget, the IPC
    state and the channel (``_grpc``: ``grpc`` or ``grpc.aio``, whose channel makers take the
    same arguments). Parameters: see ``Client``."""

    _grpc: Any

    def __init__(
        self,
        address: str,
        *,
        default_timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tensor_transport: str = "inline",
        client_id: str | None = None,
        use_ipc_events: bool = False,
        tls: TlsOptions | None = None,
    ) -> None:
        self.address = address
        self.default_timeout_s = default_timeout_s
        self._retry = retry or RetryPolicy()
        self._budget = _RetryBudget(self._retry)
        self._ipc = _make_ipc(tensor_transport, client_id, use_ipc_events)
        options = _channel_options(max_message_bytes)
        credentials = _credentials(address, tls, options)
        if credentials is None:
            self._channel = self._grpc.insecure_channel(_target(address), options=options)
        else:
            self._channel = self._grpc.secure_channel(
                _target(address), credentials, options=options
            )
        self._stub = pb_grpc.TreeSpeculationServiceStub(self._channel)


class Client(_Connection):
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
    tensor_transport : {"inline", "ipc", "auto"}
        ``"inline"``: tensor bytes travel in the messages (any caller, any node). ``"ipc"``:
        CUDA tensors travel as references into memory registered by CUDA IPC (same node, shared
        IPC namespace; needs the ``cuda`` extra); a tensor that cannot be exported raises
        ``ddtree.clients.cuda.ExportError``. ``"auto"``: references where possible, inline
        otherwise. See docs/ipc.md for the ordering contract.
    client_id : str, optional
        Identity of this client's registrations (``list_memory``); default ``py-<pid>-<hex>``.
    use_ipc_events : bool
        With references, order the caller's pending writes by an interprocess CUDA event that
        the server's stream waits on, instead of synchronising the caller's current stream.
    tls : TlsOptions, optional
        Connect over TLS (with a client certificate for mTLS); ``None`` for plain text.

    Examples
    --------
    >>> with Client("127.0.0.1:50051") as client:  # doctest: +SKIP
    ...     tree = client.build_tree(torch.randn(1, 4, 32000), torch.tensor([7]), budget=16)
    ...     acceptance = client.accept_tree(tree, torch.zeros_like(tree.tokens))
    """

    _grpc = grpc
    _channel: grpc.Channel

    def close(self) -> None:
        """Unregister this client's memory regions (best effort), then close the channel."""
        if self._ipc is not None:
            for token in self._ipc.forget_server():
                self._run(_unregister_steps(self._stub, token))
        self._channel.close()

    def list_memory(self, *, timeout_s: float | None = None) -> list[MemoryRegion]:
        """This client's registered regions on the server (empty without references)."""
        client_id = "" if self._ipc is None else self._ipc.registry.client_id
        response = self._call(
            self._stub.ListMemory,
            pb.ListMemoryRequest(client_id=client_id),
            timeout_s,
            idempotent=True,
        )
        return _memory_regions(response)

    def _send(self, method: Callable[..., Any], op: _Op[_T], timeout_s: float | None) -> _T:
        """Run one data RPC, registering memory as needed (``_send_steps``)."""
        return self._run(_send_steps(self._ipc, self._stub, method, op, timeout_s))

    def _send_memoized(
        self,
        method: Callable[..., Any],
        key: Hashable,
        timeout_s: float | None,
        *,
        idempotent: bool,
    ) -> Any:
        """Send again the by-reference request the memo keeps under ``key`` (results into the
        caller's destinations): the reply, or ``None`` where the memo has no such request that
        still holds (``_send_steps`` then does the whole call). ``idempotent``: as ``_Op``.

        A repeated call of a decode loop, without building its operation, its closures and
        the generator of ``_send_steps``: what is left is the memo's checks, ordering the
        inputs and the RPC (``_resend``).
        """
        ipc = self._ipc
        if ipc is None or not ipc.knows_server:
            return None
        entry = ipc.memo.get(key)
        if entry is None or not entry.use_outputs:
            return None
        return self._resend(method, entry, timeout_s, idempotent=idempotent)

    def _resend(
        self,
        method: Callable[..., Any],
        entry: MemoEntry,
        timeout_s: float | None,
        *,
        idempotent: bool,
    ) -> Any:
        """Order the inputs of ``entry``'s request and send it again: the reply, or ``None``
        where it cannot go as it is (it names another IPC event handle) or the server lost its
        regions (a restart: MEMORY_TOKEN_NOT_FOUND). The server is then forgotten, so that the
        whole call that follows registers again, as ``_send_steps`` does after that answer."""
        ipc = self._ipc
        assert ipc is not None  # entries exist only by reference
        if entry.request.wait_event_ipc_handle != ipc.order_inputs(entry.refs):
            return None
        try:
            return self._call(method, entry.request, timeout_s, idempotent=idempotent)
        except MemoryTokenNotFoundError:
            ipc.forget_server()
            return None

    def _run(self, steps: _Steps[_T]) -> _T:
        """Drive ``steps``: send each RPC it yields and hand it the reply or the error."""
        reply: Any = None
        error: DDTreeClientError | None = None
        while True:
            try:
                rpc = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            try:
                reply = self._call(
                    rpc.method, rpc.request, rpc.timeout_s, idempotent=rpc.idempotent
                )
                error = None
            except DDTreeClientError as err:
                reply, error = None, err

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
        out: Tree | None = None,
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
        out : Tree, optional
            Where to put the result, returned itself; nothing is allocated for it. Tensors of
            exactly the returned ``Tree``'s shapes and dtypes (``num_nodes_max = 1 +
            (max_budget or budget)``, ``mask_words(num_nodes_max)`` mask words) and its
            ``draft_len``, on ``draft_logits.device``, contiguous, sharing no memory with each
            other or with the inputs. By reference the server writes them in place (nothing on
            an error); inline the decoded result is copied into them. A repeated by-reference
            call with the same tensors and arguments reuses its request (``RequestMemo``).
        timeout_s : float, optional
            Deadline of the call, all retries included.

        Returns
        -------
        Tree
            On ``draft_logits.device``; ``out`` when given.

        Raises
        ------
        InvalidArgumentError
            Bad input; ``field`` names it (``build_tree.out.tokens`` for a destination that does
            not fit, checked before anything is sent).
        """
        if type(out) is Tree and not isinstance(budget, torch.Tensor):
            key = _build_tree_memo_key(
                draft_logits,
                root_tokens,
                budget,
                temperature=temperature,
                max_budget=max_budget,
                model=model,
                out=out,
            )
            reply = self._send_memoized(self._stub.BuildTree, key, timeout_s, idempotent=True)
            if reply is not None:
                return out
        op = _build_tree_op(
            self._ipc,
            draft_logits,
            root_tokens,
            budget,
            temperature=temperature,
            max_budget=max_budget,
            model=model,
            out=out,
        )
        return self._send(self._stub.BuildTree, op, timeout_s)

    def prepare_build_tree(
        self,
        draft_logits: torch.Tensor,
        root_tokens: torch.Tensor,
        budget: int | torch.Tensor,
        *,
        out: Tree,
        temperature: float = 1.0,
        max_budget: int | None = None,
        model: str = "",
        timeout_s: float | None = None,
    ) -> PreparedCall[Tree]:
        """``build_tree(..., out=out)`` prepared for a decode loop's static buffers.

        Calling the result builds the trees of the tensors' current contents into ``out`` and
        returns ``out``, exactly as ``build_tree`` with these arguments would (see
        ``PreparedCall``). Arguments as ``build_tree``; ``timeout_s`` is the default deadline
        of each call. Nothing is sent before the first call.
        """
        return PreparedCall(
            self,
            self._stub.BuildTree,
            lambda: _build_tree_op(
                self._ipc,
                draft_logits,
                root_tokens,
                budget,
                temperature=temperature,
                max_budget=max_budget,
                model=model,
                out=out,
            ),
            timeout_s,
        )

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
        out: Acceptance | None = None,
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
        out : Acceptance, optional
            Where to put the result, returned itself: tensors of exactly the returned
            ``Acceptance``'s shapes and dtypes (``path_len = tree.draft_len + 1``), on
            ``tree.device``, contiguous; as ``build_tree``'s ``out``.
        timeout_s : float, optional
            Deadline of the call, all retries included.

        Returns
        -------
        Acceptance
            On ``tree.device``; ``out`` when given.

        Raises
        ------
        InvalidArgumentError
            Bad input; ``field`` names it (``accept_tree.out.nodes``, ...).
        """
        op = _accept_tree_op(
            self._ipc,
            tree,
            target_tokens,
            target_logits=target_logits,
            temperature=temperature,
            seed=seed,
            kv_commit=kv_commit,
            model=model,
            out=out,
        )
        return self._send(self._stub.AcceptTree, op, timeout_s)

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
        op = _verify_attention_op(
            self._ipc,
            q,
            kv_cache,
            block_table,
            prefix_lens,
            tree,
            v_dim=v_dim,
            sm_scale=sm_scale,
            model=model,
        )
        return self._send(self._stub.VerifyAttention, op, timeout_s)


class AsyncClient(_Connection):
    """``asyncio`` client of a ddtree server; the same methods as ``Client``, awaitable.

    Parameters are those of ``Client``. Create it inside a running event loop.
    """

    _grpc = grpc.aio
    _channel: grpc.aio.Channel

    async def close(self) -> None:
        """Unregister this client's memory regions (best effort), then close the channel."""
        if self._ipc is not None:
            for token in self._ipc.forget_server():
                await self._run(_unregister_steps(self._stub, token))
        await self._channel.close()

    async def list_memory(self, *, timeout_s: float | None = None) -> list[MemoryRegion]:
        """See ``Client.list_memory``."""
        client_id = "" if self._ipc is None else self._ipc.registry.client_id
        response = await self._call(
            self._stub.ListMemory,
            pb.ListMemoryRequest(client_id=client_id),
            timeout_s,
            idempotent=True,
        )
        return _memory_regions(response)

    async def _send(self, method: Callable[..., Any], op: _Op[_T], timeout_s: float | None) -> _T:
        """See ``Client._send``."""
        return await self._run(_send_steps(self._ipc, self._stub, method, op, timeout_s))

    async def _run(self, steps: _Steps[_T]) -> _T:
        """See ``Client._run``."""
        reply: Any = None
        error: DDTreeClientError | None = None
        while True:
            try:
                rpc = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            try:
                reply = await self._call(
                    rpc.method, rpc.request, rpc.timeout_s, idempotent=rpc.idempotent
                )
                error = None
            except DDTreeClientError as err:
                reply, error = None, err

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
        out: Tree | None = None,
        timeout_s: float | None = None,
    ) -> Tree:
        """See ``Client.build_tree``."""
        op = _build_tree_op(
            self._ipc,
            draft_logits,
            root_tokens,
            budget,
            temperature=temperature,
            max_budget=max_budget,
            model=model,
            out=out,
        )
        return await self._send(self._stub.BuildTree, op, timeout_s)

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
        out: Acceptance | None = None,
        timeout_s: float | None = None,
    ) -> Acceptance:
        """See ``Client.accept_tree``."""
        op = _accept_tree_op(
            self._ipc,
            tree,
            target_tokens,
            target_logits=target_logits,
            temperature=temperature,
            seed=seed,
            kv_commit=kv_commit,
            model=model,
            out=out,
        )
        return await self._send(self._stub.AcceptTree, op, timeout_s)

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
        op = _verify_attention_op(
            self._ipc,
            q,
            kv_cache,
            block_table,
            prefix_lens,
            tree,
            v_dim=v_dim,
            sm_scale=sm_scale,
            model=model,
        )
        return await self._send(self._stub.VerifyAttention, op, timeout_s)
