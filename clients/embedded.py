"""``EmbeddedClient``: the ``Client`` interface over an in-process engine, without gRPC.

For tests and single-process users. It runs the same validation and ops as the server (the
engine's public API, ``ddtree.service.engine``, imported when the client is created) and raises
the same ``ddtree.clients.errors`` exceptions. Results come back on the device of the call's
main input; a KV cache on the engine's device is compacted in place without a copy.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from ddtree.clients.destinations import check_acceptance_out, check_tree_out
from ddtree.clients.errors import DeadlineExceededError, error_for
from ddtree.clients.types import DeviceInfo, KvCommit, ServerInfo, ServerLimits
from ddtree.kernels.types import ACCEPTANCE_FIELDS, TREE_FIELDS, Acceptance, Tree

if TYPE_CHECKING:
    from ddtree.service.engine import Engine, Outcome

__all__ = ["EmbeddedClient"]

_T = TypeVar("_T")
_C = TypeVar("_C")


class EmbeddedClient:
    """The client interface over an ``Engine`` in this process.

    Parameters
    ----------
    device : str
        ``"auto"`` (first GPU if any, else the CPU), ``"cpu"`` or ``"cuda:N"``.
    backend : {"auto", "cuda", "reference"}
        Op implementation (see ``ddtree.kernels``).
    default_timeout_s : float
        Deadline of calls that pass no ``timeout_s``.
    max_batch_size, max_tensor_bytes : int
        Limits checked on every call, as on a server.

    Notes
    -----
    The engine warms up (compiling kernels if needed) in the constructor. ``close()`` releases it.
    """

    def __init__(
        self,
        *,
        device: str = "auto",
        backend: str = "auto",
        default_timeout_s: float = 30.0,
        max_batch_size: int = 1024,
        max_tensor_bytes: int = 512 << 20,
    ) -> None:
        from ddtree.service.calls import CallLimits
        from ddtree.service.engine import Engine

        self.default_timeout_s = default_timeout_s
        self._engine: Engine = Engine(
            device=device,
            backend=backend,
            limits=CallLimits(max_batch_size=max_batch_size, max_tensor_bytes=max_tensor_bytes),
        )
        self._engine.warm_up()

    def close(self) -> None:
        """Release the engine (finishes calls in flight)."""
        self._engine.close()

    def __enter__(self) -> EmbeddedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(
        self,
        submit: Callable[[_C], Outcome[_T]],
        make_call: Callable[[float], _C],
        timeout_s: float | None,
    ) -> _T:
        from ddtree.service.errors import DDTreeError

        budget_s = timeout_s or self.default_timeout_s
        deadline_s = time.monotonic() + budget_s
        if self._engine.device.type == "cuda":
            # The engine reads the caller's tensors on its own stream: the caller's pending
            # writes must land first. The call blocks on its result anyway, so a host wait on
            # the caller's stream costs nothing extra.
            torch.cuda.current_stream(self._engine.device).synchronize()
        try:
            future = submit(make_call(deadline_s))
            return future.result(timeout=budget_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DeadlineExceededError(
                "DEADLINE_EXCEEDED", f"no result within timeout_s={budget_s:g}"
            ) from None
        except DDTreeError as err:
            raise error_for(
                err.code,
                err.message,
                reason=err.reason,
                field=err.field,
                metadata=err.metadata,
                retry_after_s=err.retry_after_s,
            ) from err

    def server_info(self, *, timeout_s: float | None = None) -> ServerInfo:
        """Version, device and limits of the in-process engine (message limits are 0)."""
        info = self._engine.info()
        return ServerInfo(
            version=info.version,
            devices=tuple(
                DeviceInfo(
                    uuid=d.uuid,
                    name=d.name,
                    compute_capability=d.compute_capability,
                    total_memory_bytes=d.total_memory_bytes,
                    backend=d.backend,
                )
                for d in info.devices
            ),
            limits=ServerLimits(
                max_budget=info.max_budget,
                max_draft_len=info.max_draft_len,
                max_message_bytes=0,
                max_tensor_bytes=info.limits.max_tensor_bytes,
                max_batch_size=info.limits.max_batch_size,
                max_concurrent_calls=0,
                request_deadline_cap_s=0.0,
            ),
            supports_memory_references=False,
        )

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """``"SERVING"`` while the engine is warm and open, else ``"NOT_SERVING"``."""
        return "SERVING" if self._engine.is_ready else "NOT_SERVING"

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
        """See ``ddtree.clients.Client.build_tree``. ``out`` on the engine's device receives
        the tree from the kernels (all or nothing); elsewhere the result is copied into it."""
        from ddtree.service.calls import BuildTreeCall

        direct = None
        if out is not None:
            check_tree_out(out, draft_logits, budget, max_budget)
            if out.device == self._engine.device:
                direct = out
        tree = self._run(
            self._engine.build_tree,
            lambda deadline_s: BuildTreeCall(
                draft_logits=draft_logits,
                root_tokens=root_tokens,
                budget=budget,
                max_budget=max_budget,
                temperature=temperature,
                model=model,
                result_device=None if direct is not None else _device_of(draft_logits),
                deadline_s=deadline_s,
                out=direct,
            ),
            timeout_s,
        )
        if out is None or tree is out:
            return tree
        for name in TREE_FIELDS:
            getattr(out, name).copy_(getattr(tree, name))
        return out

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
        """See ``ddtree.clients.Client.accept_tree``. ``out`` on the engine's device is
        written by the engine after the verdict; elsewhere the result is copied into it."""
        from ddtree.service.calls import AcceptTreeCall, KvCommitArgs

        direct = None
        if out is not None:
            check_acceptance_out(out, tree)
            if tree.tokens.device == self._engine.device:
                direct = out

        commit = None
        if kv_commit is not None:
            commit = KvCommitArgs(
                kv_cache=kv_commit.kv_cache,
                block_table=kv_commit.block_table,
                prefix_lens=kv_commit.prefix_lens,
            )
        result = self._run(
            self._engine.accept_tree,
            lambda deadline_s: AcceptTreeCall(
                tree=tree,
                target_tokens=target_tokens,
                target_logits=target_logits,
                temperature=temperature,
                seed=seed,
                kv_commit=commit,
                model=model,
                result_device=None if direct is not None else _device_of(tree.tokens),
                deadline_s=deadline_s,
                out=direct,
            ),
            timeout_s,
        )
        compacted = result.kv_cache
        if kv_commit is not None and compacted is not None and compacted is not kv_commit.kv_cache:
            kv_commit.kv_cache.copy_(compacted)
        acceptance = result.acceptance
        if out is None or acceptance is out:
            return acceptance
        for name in ACCEPTANCE_FIELDS:
            getattr(out, name).copy_(getattr(acceptance, name))
        return out

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
        """See ``ddtree.clients.Client.verify_attention``."""
        from ddtree.service.calls import VerifyAttentionCall

        return self._run(
            self._engine.verify_attention,
            lambda deadline_s: VerifyAttentionCall(
                q=q,
                kv_cache=kv_cache,
                block_table=block_table,
                prefix_lens=prefix_lens,
                tree=tree,
                v_dim=v_dim,
                sm_scale=sm_scale,
                model=model,
                result_device=_device_of(q),
                deadline_s=deadline_s,
            ),
            timeout_s,
        )


def _device_of(tensor: object) -> torch.device | None:
    # Invalid inputs are reported by the engine's validation, naming the field.
    return tensor.device if isinstance(tensor, torch.Tensor) else None
