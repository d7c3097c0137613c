"""Builds into caller memory replayed from CUDA graphs: same answers as the reference, every call.

The engine captures a build the second time it sees the same buffers and replays it after that
(``ddtree.service.replay.LaunchGraphs``). A replay must give exactly what a fresh launch gives
for the buffers' current contents, leave the destinations untouched when a request is bad, and
never be used for a call whose buffers or arguments differ. GPU only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace

import pytest
import torch
from helpers.assertions import assert_same_acceptance
from helpers.generators import (
    draft_logits,
    is_poisoned,
    paged_cache,
    poison,
    poisoned_acceptance,
    poisoned_tree,
    random_tree,
    target_tokens_for,
)
from prometheus_client import CollectorRegistry

from ddtree import kernels
from ddtree.kernels.types import TREE_FIELDS, Tree
from ddtree.service.calls import AcceptTreeCall, BuildTreeCall, KvCommitArgs, Prepared
from ddtree.service.engine import Engine
from ddtree.service.errors import InvalidToken
from ddtree.service.metrics import Metrics
from ddtree.service.replay import LaunchGraphs

pytestmark = pytest.mark.gpu

BATCH, DRAFT_LEN, VOCAB = 8, 16, 32000


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine(device="cuda:0") as running:
        running.warm_up()
        yield running


def _assert_same(actual: Tree, expected: Tree) -> None:
    for name in ("tokens", "parents", "depths", "num_nodes", "mask"):
        assert torch.equal(getattr(actual, name), getattr(expected, name)), name
    assert torch.allclose(actual.log_probs, expected.log_probs, atol=1e-4, rtol=0)


def _graphs(engine: Engine) -> LaunchGraphs[Tree]:
    graphs = engine._graphs
    assert graphs is not None
    return graphs


def test_repeated_builds_are_replayed_with_fresh_inputs(engine: Engine) -> None:
    logits = torch.empty(BATCH, DRAFT_LEN, VOCAB, dtype=torch.bfloat16, device="cuda")
    roots = torch.empty(BATCH, dtype=torch.int64, device="cuda")
    out = poisoned_tree(BATCH, 65, DRAFT_LEN, device="cuda")
    call = BuildTreeCall(draft_logits=logits, root_tokens=roots, budget=64, out=out)
    for step in range(5):  # eager, captured, then replayed
        logits.copy_(draft_logits(BATCH, DRAFT_LEN, VOCAB, seed=step, dtype=torch.bfloat16))
        roots.copy_(
            torch.randint(0, VOCAB, (BATCH,), generator=torch.Generator().manual_seed(step))
        )
        poison(out)
        tree = engine.build_tree(call, inline=True).result(timeout=60)
        assert tree is out
        _assert_same(out, kernels.build_tree(logits, roots, 64, backend="reference"))
    assert _graphs(engine).replays == 4
    assert len(_graphs(engine)) == 1


class _TreeSizes:
    """An engine observer that keeps the tree sizes each build reports (nothing else)."""

    def __init__(self) -> None:
        self.reported: list[list[int]] = []

    def time_op(
        self, op: str, device: torch.device, stream: torch.cuda.Stream | None = None
    ) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def observe_device_time(self, op: str, device: torch.device, seconds: float) -> None:
        return None

    def observe_trees(self, num_nodes: torch.Tensor, *, model: str = "") -> None:
        self.reported.append(num_nodes.tolist())

    def observe_acceptance(
        self,
        nodes: torch.Tensor,
        length: torch.Tensor,
        num_nodes: torch.Tensor,
        *,
        model: str = "",
    ) -> None:
        return None


def test_a_replayed_build_reports_its_own_tree_sizes() -> None:
    """A replayed build's graph writes the error flags and the tree sizes into the engine's
    pinned verdict memory (poisoned before each call here): the observer gets this call's
    sizes, never the capture's."""
    sizes = _TreeSizes()
    with Engine(device="cuda:0", observer=sizes) as engine:
        engine.warm_up()
        logits = torch.empty(BATCH, DRAFT_LEN, VOCAB, dtype=torch.float32, device="cuda")
        roots = torch.zeros(BATCH, dtype=torch.int64, device="cuda")
        out = poisoned_tree(BATCH, 1 + DRAFT_LEN, DRAFT_LEN, device="cuda")
        call = BuildTreeCall(draft_logits=logits, root_tokens=roots, budget=DRAFT_LEN, out=out)
        generator = torch.Generator().manual_seed(70)
        for step in range(6):  # eager, captured, then replayed
            depths = torch.randint(0, DRAFT_LEN + 1, (BATCH,), generator=generator).tolist()
            # Request r's tree is a chain of depths[r] drafted tokens: one finite logit at each
            # position before that depth, none after it.
            logits.fill_(float("-inf"))
            for row, depth in enumerate(depths):
                logits[row, :depth, step + row] = 0.0
            poison(out)
            views = engine._flag_rows(BATCH)
            for host in (views.host_flags, views.host_sizes):
                assert host is not None
                host.fill_(-7)
            engine.build_tree(call, inline=True).result(timeout=60)
            _assert_same(out, kernels.build_tree(logits, roots, DRAFT_LEN, backend="reference"))
            assert out.num_nodes.tolist() == [1 + depth for depth in depths]
            assert sizes.reported[-1] == [1 + depth for depth in depths]
        assert _graphs(engine).replays == 5


def test_every_build_is_timed_once_and_a_deferring_thread_gets_it_after_the_op() -> None:
    """Eager, captured or replayed, every build's device time and trees reach the metrics once
    (a replayed graph records its own timing events). On a thread that defers work (the
    server's event loop), a replayed build's observations wait for the deferred call, or for
    the next op, which hands them over before it starts."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    errors: list[BaseException] = []

    def samples() -> tuple[float | None, float | None, float | None]:
        metrics.flush()
        labels = {"op": "build_tree", "device": "cuda:0"}
        return (
            registry.get_sample_value("ddtree_op_device_seconds_count", labels),
            registry.get_sample_value("ddtree_op_device_seconds_sum", labels),
            registry.get_sample_value("ddtree_trees_built_total", {"model": ""}),
        )

    def run(engine: Engine) -> None:
        try:
            logits = torch.randn(BATCH, DRAFT_LEN, VOCAB, device="cuda")
            roots = torch.zeros(BATCH, dtype=torch.int64, device="cuda")
            out = poisoned_tree(BATCH, 1 + DRAFT_LEN, DRAFT_LEN, device="cuda")
            call = BuildTreeCall(draft_logits=logits, root_tokens=roots, budget=DRAFT_LEN, out=out)
            for _ in range(4):  # eager, captured, replayed twice; nothing deferred
                engine.build_tree(call, inline=True).result(timeout=60)
            count, seconds, trees = samples()
            assert (count, trees) == (4, 4 * BATCH)
            assert seconds is not None and 0 < seconds < 4
            deferred: list[Callable[[], None]] = []
            engine.own_thread(defer=deferred.append)
            engine.build_tree(call, inline=True).result(timeout=60)
            assert samples()[0] == 4 and len(deferred) == 1  # waits for the deferred call
            deferred.pop()()
            assert samples()[0] == 5 and samples()[2] == 5 * BATCH
            engine.build_tree(call, inline=True).result(timeout=60)
            engine.build_tree(call, inline=True).result(timeout=60)  # hands the last one over
            assert samples()[0] == 6
            for callback in deferred:  # the second call hands the last build over, the first
                callback()  # finds nothing left
            assert samples()[0] == 7 and samples()[2] == 7 * BATCH
            assert _graphs(engine).replays == 6
        except BaseException as err:  # reported on the test's thread
            errors.append(err)

    with Engine(device="cuda:0", observer=metrics) as engine:
        engine.warm_up()
        # On a thread of its own: ``own_thread`` leaves the engine's stream current there.
        thread = threading.Thread(target=run, args=(engine,))
        thread.start()
        thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors


def test_a_reused_call_keeps_its_replay_key(engine: Engine) -> None:
    # The servicer's copies of one decoded call share a Prepared: the key is computed once.
    logits = torch.empty(BATCH, DRAFT_LEN, VOCAB, dtype=torch.float16, device="cuda")
    roots = torch.empty(BATCH, dtype=torch.int64, device="cuda")
    out = poisoned_tree(BATCH, 17, DRAFT_LEN, device="cuda")
    kept = BuildTreeCall(
        draft_logits=logits, root_tokens=roots, budget=16, out=out, prepared=Prepared()
    )
    for step in range(4):
        logits.copy_(draft_logits(BATCH, DRAFT_LEN, VOCAB, seed=10 + step, dtype=torch.float16))
        roots.random_(0, VOCAB)
        poison(out)
        engine.build_tree(replace(kept, deadline_s=None), inline=True).result(timeout=60)
        _assert_same(out, kernels.build_tree(logits, roots, 16, backend="reference"))
        assert kept.prepared is not None and kept.prepared.launch_key is not None
        assert kept.prepared.validated_for is engine.limits
    assert _graphs(engine).replays == 3 and len(_graphs(engine)) == 1  # steps 1 (capture), 2, 3


def test_a_reused_call_with_an_inline_tensor_is_keyed_per_call(engine: Engine) -> None:
    # Inline roots (a host tensor of the decoded call) are copied to the device per call, maybe
    # to another address each time: the key must name this call's copy, never a kept one.
    logits = draft_logits(BATCH, DRAFT_LEN, VOCAB, seed=20, dtype=torch.bfloat16, device="cuda")
    roots = torch.randint(0, VOCAB, (BATCH,), generator=torch.Generator().manual_seed(20))
    out = poisoned_tree(BATCH, 17, DRAFT_LEN, device="cuda")
    kept = BuildTreeCall(
        draft_logits=logits, root_tokens=roots, budget=16, out=out, prepared=Prepared()
    )
    expected = kernels.build_tree(logits, roots.cuda(), 16, backend="reference")
    held = []
    for _ in range(4):
        poison(out)
        engine.build_tree(replace(kept, deadline_s=None), inline=True).result(timeout=60)
        _assert_same(out, expected)
        # Take the block the roots were copied to, so the next copy lands elsewhere.
        held.append(torch.full((BATCH,), VOCAB + 7, dtype=torch.int64, device="cuda"))
    assert kept.prepared is not None and kept.prepared.launch_key is None


def test_a_bad_root_in_a_replay_leaves_caller_memory_untouched(engine: Engine) -> None:
    logits = draft_logits(BATCH, DRAFT_LEN, VOCAB, seed=3, dtype=torch.bfloat16, device="cuda")
    roots = torch.randint(0, VOCAB, (BATCH,), device="cuda")
    out = poisoned_tree(BATCH, 33, DRAFT_LEN, device="cuda")
    call = BuildTreeCall(draft_logits=logits, root_tokens=roots, budget=32, out=out)
    for _ in range(3):
        engine.build_tree(call).result(timeout=60)
    assert _graphs(engine).replays == 2
    expected = kernels.build_tree(logits, roots, 32, backend="reference")
    roots[5] = VOCAB
    poison(out)
    with pytest.raises(InvalidToken, match=r"build_tree\.root_tokens\[5\]"):
        engine.build_tree(call).result(timeout=60)
    assert _graphs(engine).replays == 3
    assert is_poisoned(out)
    roots[5] = 0
    expected = kernels.build_tree(logits, roots, 32, backend="reference")
    engine.build_tree(call).result(timeout=60)  # the next call is clean again
    _assert_same(out, expected)


def test_other_buffers_or_arguments_are_not_replayed(engine: Engine) -> None:
    logits = draft_logits(BATCH, DRAFT_LEN, VOCAB, seed=4, dtype=torch.bfloat16, device="cuda")
    roots = torch.randint(0, VOCAB, (BATCH,), device="cuda")
    out = poisoned_tree(BATCH, 17, DRAFT_LEN, device="cuda")
    base = BuildTreeCall(draft_logits=logits, root_tokens=roots, budget=16, out=out)
    for _ in range(2):
        engine.build_tree(base).result(timeout=60)
    replays = _graphs(engine).replays
    variants = [
        BuildTreeCall(draft_logits=logits, root_tokens=roots, budget=16, out=out, temperature=0.5),
        BuildTreeCall(draft_logits=logits, root_tokens=roots, budget=9, max_budget=16, out=out),
        BuildTreeCall(draft_logits=logits.clone(), root_tokens=roots, budget=16, out=out),
    ]
    for variant in variants:
        engine.build_tree(variant).result(timeout=60)
        expected = kernels.build_tree(
            variant.draft_logits,
            roots,
            variant.budget,
            temperature=variant.temperature,
            max_budget=16,
            backend="reference",
        )
        _assert_same(out, expected)
    assert _graphs(engine).replays == replays


def test_repeated_accepts_with_a_commit_are_replayed_all_or_nothing(engine: Engine) -> None:
    """AcceptTree into caller memory with the cache compacted in place: the walk and the commit
    are replayed (one graph each) with fresh targets, equal to the reference every step; a bad
    request leaves ``out`` and the cache untouched."""
    cpu_tree = random_tree(BATCH, 33, 8, 500, shape="mixed", seed=50)
    tree = Tree(**{n: getattr(cpu_tree, n).cuda() for n in TREE_FIELDS}, draft_len=8)
    targets = torch.empty(BATCH, 33, dtype=torch.int64, device="cuda")
    prefix = torch.arange(BATCH, dtype=torch.int32, device="cuda") * 3
    cache, table = paged_cache(prefix.cpu() + 33, 16, 576, seed=51)
    cache, table = cache.cuda(), table.cuda()
    out = poisoned_acceptance(BATCH, 9, device="cuda")
    call = AcceptTreeCall(
        tree=tree,
        target_tokens=targets,
        kv_commit=KvCommitArgs(cache, table, prefix),
        out=out,
        prepared=Prepared(),
    )
    for step in range(5):  # eager, captured, then replayed
        targets.copy_(target_tokens_for(cpu_tree, 500, follow=0.9, seed=60 + step))
        before = cache.clone()
        poison(out)
        result = engine.accept_tree(replace(call), inline=True).result(timeout=60)
        assert result.acceptance is out and result.kv_cache is cache
        expected = kernels.accept(tree, targets, backend="reference")
        assert_same_acceptance(out, expected)
        kernels.commit_kv(before, table, prefix, expected, backend="reference")
        assert torch.equal(cache, before)
    assert _graphs(engine).replays == 2 * 4  # the walk and the commit, steps 1..4
    targets[3, 0] = -1
    before = cache.clone()
    poison(out)
    with pytest.raises(InvalidToken, match=r"target_tokens\[3\]"):
        engine.accept_tree(replace(call), inline=True).result(timeout=60)
    assert is_poisoned(out)
    assert torch.equal(cache, before)
    assert _graphs(engine).replays == 2 * 5
