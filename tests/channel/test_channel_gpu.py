"""GPU doorbell channels between two processes: ``ddtree serve`` and the test as caller.

Every step through a channel must equal the same step through the RPCs (bitwise where the
launch geometry is the same, at the channel's max batch; under build_tree's contract otherwise);
a step captured in a CUDA graph replays correctly; bad descriptors get the status that
``validate_descriptor`` predicts and touch nothing; a killed service releases the caller's
stream within a bound; a killed caller's channel is closed by the service, which keeps serving;
the channel's steps feed the same metrics as the RPCs.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.invariants import has_near_ties
from helpers.ipc import ServerProcess, serving

from ddtree import kernels
from ddtree.clients import Client, KvCommit
from ddtree.clients.channel import Channel, ChannelLostError
from ddtree.kernels import channel as ch
from ddtree.kernels import channel_cuda, tree_cuda
from ddtree.kernels.channel import (
    ChannelOp,
    ChannelShape,
    DescriptorFlag,
    Ref,
    StepDescriptor,
    StepStatus,
)
from ddtree.kernels.types import Acceptance, Tree

pytestmark = pytest.mark.gpu

MAX_BATCH = 8
DRAFT_LEN = 5
BUDGET = 16
VOCAB = 4099  # odd: the top-k reads 2-byte elements (the vectorised path is in the bench shape)
HEAD_DIM = 576
PAGE_SIZE = 16
MAX_PAGES = 4
RELEASE_BOUND_S = 5.0
"""The caller's stream is released within this long after the service dies (docs/channel.md)."""
STEP_TIMEOUT_S = 1.0
"""The step deadline of the hung-service test; released within it plus RELEASE_BOUND_S."""
TREE_FIELDS = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return _free_port()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, metrics_port: int
) -> Iterator[ServerProcess]:
    socket = tmp_path_factory.mktemp("main") / "ddtree.sock"
    with serving(socket, "--metrics-port", str(metrics_port)) as process:
        yield process


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.address, default_timeout_s=60.0) as connected:
        yield connected


class Buffers:
    """The caller's static buffers (as an inference server keeps them for its CUDA graphs)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator(device="cuda").manual_seed(seed)
        n = 1 + BUDGET
        b = MAX_BATCH

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="cuda")

        self.logits = empty((b, DRAFT_LEN, VOCAB), torch.bfloat16)
        self.roots = empty((b,), torch.int64)
        self.budgets = empty((b,), torch.int32)
        self.targets = empty((b, n), torch.int64)
        self.target_logits = empty((b, n, VOCAB), torch.bfloat16)
        self.cache = empty((b * MAX_PAGES, PAGE_SIZE, HEAD_DIM), torch.bfloat16)
        self.table = empty((b, MAX_PAGES), torch.int32)
        self.prefix = empty((b,), torch.int32)
        self.tree = {
            "tokens": empty((b, n), torch.int64),
            "parents": empty((b, n), torch.int32),
            "depths": empty((b, n), torch.int32),
            "log_probs": empty((b, n), torch.float32),
            "num_nodes": empty((b,), torch.int32),
            "mask": empty((b, n, 1), torch.int64),
        }

    def all(self) -> list[torch.Tensor]:
        """Every buffer (their allocations become the channel's regions)."""
        return [
            self.logits,
            self.roots,
            self.budgets,
            self.targets,
            self.target_logits,
            self.cache,
            self.table,
            self.prefix,
            *self.tree.values(),
        ]

    def fill_draft(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.generator
        logits = self.logits[:batch]
        logits.copy_(torch.randn(logits.shape, generator=g, device="cuda") * 3)
        roots = self.roots[:batch]
        roots.copy_(torch.randint(0, VOCAB, (batch,), generator=g, device="cuda"))
        return logits, roots

    def stage_tree(self, tree: Tree) -> Tree:
        """``tree`` copied into the static tree buffers; returns views of its rows."""
        batch = tree.batch_size
        views = {name: buffer[:batch] for name, buffer in self.tree.items()}
        for name, view in views.items():
            view.copy_(getattr(tree, name))
        return Tree(**views, draft_len=tree.draft_len)

    def fill_targets(self, tree: Tree) -> torch.Tensor:
        """Target tokens that follow the tree for a random number of levels."""
        g = self.generator
        targets = self.targets[: tree.batch_size]
        noise = torch.randint(0, VOCAB, tuple(targets.shape), generator=g, device="cuda")
        # At each node, the token of one of its children (or noise): walks of varied lengths.
        child_token = torch.full_like(targets, -1)
        child_token.scatter_(1, tree.parents.long().clamp(min=0), tree.tokens)
        child_token[:, 0] = torch.where(tree.num_nodes > 1, child_token[:, 0], -1)
        follow = torch.rand(tuple(targets.shape), generator=g, device="cuda") < 0.8
        targets.copy_(torch.where(follow & (child_token >= 0), child_token, noise))
        return targets

    def fill_cache(self, batch: int) -> KvCommit:
        g = self.generator
        self.cache.copy_(torch.randn(tuple(self.cache.shape), generator=g, device="cuda"))
        perm = torch.randperm(self.cache.shape[0], generator=g, device="cuda")
        self.table.copy_(perm.view(MAX_BATCH, MAX_PAGES).to(torch.int32))
        capacity = MAX_PAGES * PAGE_SIZE - (1 + BUDGET)
        self.prefix.copy_(torch.randint(0, capacity, (MAX_BATCH,), generator=g, device="cuda"))
        return KvCommit(self.cache, self.table[:batch], self.prefix[:batch])


def _copy(tree: Tree) -> Tree:
    return Tree(**{f: getattr(tree, f).clone() for f in TREE_FIELDS}, draft_len=tree.draft_len)


def _assert_same_trees(actual: Tree, expected: Tree, *, exact: bool) -> None:
    """Bitwise when the launch geometry is the same (the channel's max batch); else each request
    bitwise, or, where scores nearly tie (one ulp of a log-sum-exp summed over another chunking
    may order such a pair the other way), the same sorted log-probs."""
    for b in range(expected.batch_size):
        rows = {
            n: (getattr(actual, n)[b].cpu(), getattr(expected, n)[b].cpu()) for n in TREE_FIELDS
        }
        if all(torch.equal(x, y) for x, y in rows.values()):
            continue
        assert not exact, (
            f"request {b}: {[n for n, (x, y) in rows.items() if not torch.equal(x, y)]}"
        )
        one = Tree(
            **{n: getattr(expected, n)[b : b + 1] for n in TREE_FIELDS},
            draft_len=expected.draft_len,
        )
        assert has_near_ties(one), f"request {b} differs without near ties"
        torch.testing.assert_close(
            rows["log_probs"][0].sort().values, rows["log_probs"][1].sort().values
        )


def _assert_same_acceptance(actual: Acceptance, expected: Acceptance, where: str) -> None:
    for name in ("nodes", "tokens", "length", "bonus"):
        a, e = getattr(actual, name).cpu(), getattr(expected, name).cpu()
        assert torch.equal(a, e), f"acceptance.{name} at {where}"


def _kernel_seed(seed: int) -> int:
    """The sampler seed the server derives from an AcceptTree ``seed`` (engine.py)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    drawn = torch.randint(0, 2**62, (1,), generator=generator, device="cuda", dtype=torch.int64)
    return int(drawn.item())


def _open_build(address: str, bufs: Buffers, **kwargs: object) -> Channel:
    return Channel(
        address,
        op="build_tree",
        max_batch_size=MAX_BATCH,
        draft_len=DRAFT_LEN,
        max_budget=BUDGET,
        vocab_size=VOCAB,
        tensors=bufs.all(),
        **kwargs,  # type: ignore[arg-type]
    )


def _open_accept(address: str, bufs: Buffers, vocab_size: int = 0, **kwargs: object) -> Channel:
    return Channel(
        address,
        op="accept",
        max_batch_size=MAX_BATCH,
        draft_len=DRAFT_LEN,
        max_budget=BUDGET,
        vocab_size=vocab_size,
        tensors=bufs.all(),
        **kwargs,  # type: ignore[arg-type]
    )


def test_steps_match_the_rpcs(server: ServerProcess, client: Client) -> None:
    """1,000 build, accept (target tokens) and KV-commit steps through two channels equal the
    RPCs on the same inputs; batches vary from 1 to the channels' max."""
    bufs = Buffers(1)
    rng = random.Random(1)
    steps = 0
    with (
        _open_build(server.address, bufs, model="chan") as build,
        _open_accept(
            server.address, bufs, kv_cache=bufs.cache, max_pages=MAX_PAGES, model="chan"
        ) as accept,
    ):
        for step in range(500):  # 1,000 steps: 500 builds and 500 accepts
            batch = MAX_BATCH if step % 3 == 0 else rng.randint(1, MAX_BATCH)
            logits, roots = bufs.fill_draft(batch)
            temperature = 0.8 if step % 2 else 1.0
            if step % 4 == 1:
                budgets = bufs.budgets[:batch]
                budgets.copy_(torch.randint(1, BUDGET + 1, (batch,), device="cuda"))
                tree = build.build_tree(logits, roots, budgets, temperature=temperature)
                expected = client.build_tree(
                    logits,
                    roots,
                    budgets.clone(),
                    temperature=temperature,
                    max_budget=BUDGET,
                    model="rpc",
                )
            else:
                tree = build.build_tree(logits, roots, BUDGET, temperature=temperature)
                expected = client.build_tree(
                    logits, roots, BUDGET, temperature=temperature, model="rpc"
                )
            assert build.last_status().status == StepStatus.OK, step
            _assert_same_trees(tree, expected, exact=batch == MAX_BATCH)
            walked_tree = bufs.stage_tree(expected)  # both paths walk the same tree
            targets = bufs.fill_targets(walked_tree)
            if step % 2 == 0:
                commit = bufs.fill_cache(batch)
                reference = KvCommit(
                    commit.kv_cache.clone(), commit.block_table.clone(), commit.prefix_lens.clone()
                )
                walked = accept.accept(
                    walked_tree,
                    targets,
                    block_table=commit.block_table,
                    prefix_lens=commit.prefix_lens,
                )
                want = client.accept_tree(
                    _copy(walked_tree), targets.clone(), kv_commit=reference, model="rpc"
                )
                torch.cuda.synchronize()
                assert torch.equal(commit.kv_cache, reference.kv_cache), f"kv_cache at {step}"
            else:
                walked = accept.accept(walked_tree, targets)
                want = client.accept_tree(_copy(walked_tree), targets.clone(), model="rpc")
            assert accept.last_status().status == StepStatus.OK, step
            _assert_same_acceptance(walked, want, f"step {step}")
            steps += 2
    assert steps == 1000


def test_builds_of_an_early_select_match_the_rpcs(server: ServerProcess, client: Client) -> None:
    """A channel whose plan starts the select on the first depths (batch 32, draft_len 16: two
    waves of top-k blocks, tree_cuda's early_depths) takes its rows depth by depth over the
    step's own batch; its trees equal the RPCs' on shallow trees (random rows) and deep ones
    (peaked rows, where the select waits for every row), at full and partial batches."""
    max_batch, draft_len, budget = 32, 16, 64
    plan = tree_cuda.build_tree_plan(max_batch, draft_len, VOCAB, budget)
    assert plan.early_depths > 0
    generator = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.empty((max_batch, draft_len, VOCAB), dtype=torch.bfloat16, device="cuda")
    roots = torch.randint(0, VOCAB, (max_batch,), generator=generator, device="cuda")
    with Channel(
        server.address,
        op="build_tree",
        max_batch_size=max_batch,
        draft_len=draft_len,
        max_budget=budget,
        vocab_size=VOCAB,
        tensors=[logits, roots],
    ) as build:
        for step, (batch, scale) in enumerate([(32, 3.0), (20, 3.0), (32, 12.0), (7, 12.0)]):
            rows = torch.randn((max_batch, draft_len, VOCAB), generator=generator, device="cuda")
            logits.copy_(rows * scale)
            tree = build.build_tree(logits[:batch], roots[:batch], budget)
            expected = client.build_tree(logits[:batch], roots[:batch], budget, model="rpc")
            assert build.last_status().status == StepStatus.OK, step
            _assert_same_trees(tree, expected, exact=batch == max_batch)


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'^(ddtree_\w+_total)\{model="(\w+)"\} (\S+)$', line)
        if match:
            values[f"{match.group(1)}/{match.group(2)}"] = float(match.group(3))
    return values


def test_channel_steps_feed_the_metrics(
    server: ServerProcess, client: Client, metrics_port: int
) -> None:
    """The same steps through channels (model label "mchan") and through the RPCs ("mrpc")
    count the same in every tree and acceptance counter (fed asynchronously: wait for them)."""
    bufs = Buffers(9)
    with (
        _open_build(server.address, bufs, model="mchan") as build,
        _open_accept(server.address, bufs, model="mchan") as accept,
    ):
        for step in range(12):
            batch = 1 + step % MAX_BATCH
            logits, roots = bufs.fill_draft(batch)
            build.build_tree(logits, roots, BUDGET)
            tree = bufs.stage_tree(client.build_tree(logits, roots, BUDGET, model="mrpc"))
            targets = bufs.fill_targets(tree)
            accept.accept(tree, targets)
            client.accept_tree(_copy(tree), targets.clone(), model="mrpc")
        assert accept.last_status().status == StepStatus.OK
    names = (
        "ddtree_trees_built_total",
        "ddtree_draft_nodes_total",
        "ddtree_verify_walks_total",
        "ddtree_accepted_tokens_total",
    )
    deadline = time.monotonic() + 15
    while True:
        values = _scrape(metrics_port)
        pairs = [(values.get(f"{n}/mchan"), values.get(f"{n}/mrpc")) for n in names]
        if all(c is not None and c == r for c, r in pairs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for name, (chan, rpc) in zip(names, pairs, strict=True):
        assert rpc is not None and rpc > 0, (name, values)
        assert chan == rpc, (name, chan, rpc)


@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_accept_target_logits_match_the_rpc(
    server: ServerProcess, client: Client, temperature: float
) -> None:
    """Walks over target logits; the channel takes the sampler's raw seed, derived here as the
    server derives it from the RPC's ``seed``."""
    bufs = Buffers(2)
    with _open_accept(server.address, bufs, vocab_size=VOCAB) as accept:
        for step in range(24):
            batch = 1 + step % MAX_BATCH
            logits, roots = bufs.fill_draft(batch)
            tree = bufs.stage_tree(client.build_tree(logits, roots, BUDGET))
            target = bufs.target_logits[:batch]
            target.copy_(torch.randn(tuple(target.shape), generator=bufs.generator, device="cuda"))
            seed = 1000 + step
            walked = accept.accept(
                tree, target_logits=target, temperature=temperature, seed=_kernel_seed(seed)
            )
            want = client.accept_tree(
                _copy(tree), target_logits=target.clone(), temperature=temperature, seed=seed
            )
            assert accept.last_status().status == StepStatus.OK
            _assert_same_acceptance(walked, want, f"step {step}")


@pytest.mark.parametrize("use_memop_wait", [True, False], ids=["wait-value", "spin-kernel"])
def test_step_captured_in_a_cuda_graph(server: ServerProcess, use_memop_wait: bool) -> None:
    """post + wait captured once in a CUDA graph, replayed with new logits each time, equal the
    in-process kernels at the channel's max batch (the same launch geometry: bitwise)."""
    bufs = Buffers(3)
    with _open_build(server.address, bufs, use_memop_wait=use_memop_wait) as build:
        logits, roots = bufs.fill_draft(MAX_BATCH)
        build.build_tree(logits, roots, BUDGET)  # warm: kernels loaded, descriptor packed
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                tree = build.build_tree(logits, roots, BUDGET)
            for replay in range(30):
                bufs.fill_draft(MAX_BATCH)  # same buffers, new contents, on this stream
                graph.replay()
                flags = torch.zeros(MAX_BATCH, dtype=torch.int32, device="cuda")
                expected = kernels.build_tree(logits, roots, BUDGET, error_flags=flags)
                stream.synchronize()
                _assert_same_trees(tree, expected, exact=True)
                record = build.last_status()
                assert record.status == StepStatus.OK, replay
        steps = record.step
    assert steps == 31  # the warm step and 30 replays (capturing runs nothing)


BUILD_SHAPE = ChannelShape(ChannelOp.BUILD_TREE, MAX_BATCH, DRAFT_LEN, BUDGET, VOCAB, logit_code=1)


def _mutations(good: StepDescriptor, regions: list[tuple[int, int]]) -> list[StepDescriptor]:
    """Descriptors one field away from ``good``, each wrong in its own way."""
    refs = dict(good.refs or {})
    out = [replace(good, op=op) for op in (0, ChannelOp.ACCEPT, 3, 2**32 - 1)]
    out += [replace(good, batch_size=b) for b in (0, MAX_BATCH + 1, 2**32 - 1)]
    out += [
        replace(good, flags=f)
        for f in (int(DescriptorFlag.KV_COMMIT), 16, 2**31, int(DescriptorFlag.CLEAR_ERROR_FLAGS))
    ]
    out += [replace(good, budget=b) for b in (0, BUDGET + 1, 2**32 - 1)]
    out += [replace(good, temperature=t) for t in (0.0, -1.0, float("nan"), float("inf"))]
    rng = random.Random(7)
    for name in ch.BUILD_REFS:
        if name == "budgets":
            continue
        ref = refs[name]
        size = regions[ref.region][1]
        for bad in (
            Ref(len(regions), ref.offset_bytes),
            Ref(2**32 - 1, 0),
            Ref(ref.region, size - 8),
            Ref(ref.region, size + 256),
            Ref(ref.region, 2**64 - 256),
            Ref(ref.region, ref.offset_bytes + 1),
            Ref(ref.region, rng.randrange(size, 2**63)),
        ):
            out.append(replace(good, refs={**refs, name: bad}))
    return out


def test_bad_descriptors_get_their_status_and_touch_nothing(
    server: ServerProcess, client: Client
) -> None:
    """Every mutation of a good descriptor that ``validate_descriptor`` refuses gets exactly its
    status and slot from the device, and leaves the outputs untouched; the channel and the
    server go on serving."""
    bufs = Buffers(4)
    with _open_build(server.address, bufs) as build:
        logits, roots = bufs.fill_draft(MAX_BATCH)
        views = build._arena.views
        refs = {
            "draft_logits": build._ref(logits, "logits"),
            "root_tokens": build._ref(roots, "roots"),
            "budgets": build._ref(bufs.budgets, "budgets"),
            **{name: build._ref(views[name], name) for name in TREE_FIELDS},
            "error_flags": build._ref(views["error_flags"], "error_flags"),
        }
        good = StepDescriptor(
            op=ChannelOp.BUILD_TREE,
            batch_size=MAX_BATCH,
            flags=DescriptorFlag.ERROR_FLAGS | DescriptorFlag.CLEAR_ERROR_FLAGS,
            budget=BUDGET,
            temperature=1.0,
            refs=refs,
        )
        regions = [(a.base_pointer, a.byte_size) for a, _ in build._allocations]
        assert ch.validate_descriptor(BUILD_SHAPE, good, regions)[0] == StepStatus.OK
        build.post(good)
        assert build.last_status().status == StepStatus.OK
        for name in TREE_FIELDS:
            views[name].fill_(-7)
        snapshot = {name: views[name].clone() for name in TREE_FIELDS}
        refused = 0
        for desc in _mutations(good, regions):
            expected = ch.validate_descriptor(BUILD_SHAPE, desc, regions)
            if expected[0] == StepStatus.OK:
                continue  # still a valid step (it would run and write somewhere legitimate)
            build.post(desc)
            record = build.last_status()
            assert (record.status, record.detail) == expected, desc
            refused += 1
        # Per-request budgets out of range, checked on the device.
        bufs.budgets.copy_(torch.tensor([1, 2, 3, BUDGET + 1, 4, 5, 6, 7], dtype=torch.int32))
        per_request = replace(good, flags=good.flags | DescriptorFlag.BUDGETS)
        build.post(per_request)
        record = build.last_status()
        assert (record.status, record.detail) == (StepStatus.BAD_BUDGET, 2)
        for name in TREE_FIELDS:
            assert torch.equal(views[name], snapshot[name]), f"{name} was written"
        assert refused >= 50
        tree = build.build_tree(logits, roots, BUDGET)
        flags = torch.zeros(MAX_BATCH, dtype=torch.int32, device="cuda")
        _assert_same_trees(
            tree, kernels.build_tree(logits, roots, BUDGET, error_flags=flags), exact=True
        )
    assert client.health() == "SERVING"
    assert client.build_tree(logits[:1], roots[:1], 4).num_nodes_max == 5


def test_posting_after_close_completes_with_closed(server: ServerProcess) -> None:
    bufs = Buffers(5)
    build = _open_build(server.address, bufs)
    logits, roots = bufs.fill_draft(2)
    build.build_tree(logits, roots, BUDGET)
    assert build.last_status().status == StepStatus.OK
    build.close()
    build.build_tree(logits, roots, BUDGET)  # the control block says CLOSED: no wait
    assert build.last_status().status == StepStatus.CLOSED


def _release_or_fail(channel: Channel, started: float) -> float:
    """Seconds until the current stream ran dry; past twice the bound the test releases it
    itself (so that a failure does not hang the session) and fails."""
    stream = torch.cuda.current_stream()
    while not stream.query():
        if time.monotonic() - started > 2 * RELEASE_BOUND_S:
            channel._release("test", ChannelLostError("UNKNOWN", "released by the test"))
            stream.synchronize()
            pytest.fail("the caller's stream was not released")
        time.sleep(1e-3)
    return time.monotonic() - started


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def test_service_killed_releases_the_callers_stream(tmp_path: Path, cache_dir: Path) -> None:
    """With the service (server and channel worker) stopped, the steps enqueued ahead still run
    and the next one blocks the caller's stream; killing the service releases it within
    RELEASE_BOUND_S with SERVICE_LOST, and later steps complete at once with SERVICE_LOST."""
    process = ServerProcess(tmp_path / "killed.sock")
    try:
        process.wait_serving()
        bufs = Buffers(6)
        build = _open_build(process.address, bufs)
        logits, roots = bufs.fill_draft(2)
        for _ in range(5):
            build.build_tree(logits, roots, BUDGET)
        torch.cuda.synchronize()
        time.sleep(0.3)  # the step thread tops its queue up
        # The server and the channel's worker process stopped: the steps the worker enqueued
        # ahead still run on the GPU, the next one blocks the caller's stream.
        pids = [process.process.pid, *_children(process.process.pid)]
        assert len(pids) == 2, pids
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        for _ in range(build.pipeline_depth + 2):
            build.build_tree(logits, roots, BUDGET)
        time.sleep(0.5)
        assert not torch.cuda.current_stream().query(), "no step was left blocked"
        started = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        released_s = _release_or_fail(build, started)
        assert released_s < RELEASE_BOUND_S
        assert build.last_status().status == StepStatus.SERVICE_LOST
        assert build.closed_reason == "service_lost"
        _assert_lost_afterwards(build, logits, roots, "CHANNEL_SERVICE_LOST")
        build.close()
    finally:
        process.stop()


def _assert_lost_afterwards(
    channel: Channel, logits: torch.Tensor, roots: torch.Tensor, reason: str
) -> None:
    """Host calls raise; a post that bypasses the host check (as a graph replay does) completes
    at once with SERVICE_LOST."""
    assert not channel.is_open
    with pytest.raises(ChannelLostError) as raised:
        channel.build_tree(logits, roots, BUDGET)
    assert raised.value.reason == reason
    descriptor = ch.pack_descriptor(StepDescriptor(op=ChannelOp.BUILD_TREE, batch_size=1))
    channel_cuda.post_step(channel.control, channel.ring_size, descriptor)
    channel_cuda.wait_step(channel.control)
    assert channel.last_status().status == StepStatus.SERVICE_LOST


def test_hung_service_releases_the_callers_stream_at_the_step_deadline(
    tmp_path: Path, cache_dir: Path
) -> None:
    """The service (server and worker) stopped but connected: no WatchChannel break. A posted
    step that does not complete within step_timeout_s is released by the watchdog
    (SERVICE_LOST, reason step_timeout) and later host calls raise; the service, resumed,
    closes the channel and goes on serving."""
    process = ServerProcess(tmp_path / "hung.sock")
    try:
        process.wait_serving()
        bufs = Buffers(10)
        build = _open_build(process.address, bufs, step_timeout_s=STEP_TIMEOUT_S)
        logits, roots = bufs.fill_draft(2)
        for _ in range(5):
            build.build_tree(logits, roots, BUDGET)
        torch.cuda.synchronize()
        time.sleep(0.3)  # the worker tops its queue up
        pids = [process.process.pid, *_children(process.process.pid)]
        assert len(pids) == 2, pids
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            for _ in range(build.pipeline_depth + 2):
                build.build_tree(logits, roots, BUDGET)
            assert build.wait_lost(STEP_TIMEOUT_S + RELEASE_BOUND_S), "not released"
            released_s = _release_or_fail(build, started)
            assert released_s < STEP_TIMEOUT_S + RELEASE_BOUND_S
            assert build.closed_reason == "step_timeout"
            assert build.last_status().status == StepStatus.SERVICE_LOST
            _assert_lost_afterwards(build, logits, roots, "CHANNEL_STEP_TIMEOUT")
            views = build._arena.views
            for name in TREE_FIELDS:
                views[name].fill_(-7)
            snapshot = {name: views[name].clone() for name in TREE_FIELDS}
            torch.cuda.synchronize()
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        # The resumed worker reaches the overdue step only now: its resolve sees the block
        # marked SERVICE_LOST and runs nothing; closing drains the rest.
        build.close()
        process.log.wait_for("reason=close_channel", timeout_s=30)
        for name in TREE_FIELDS:
            assert torch.equal(views[name], snapshot[name]), f"{name} written after the release"
        with Client(process.address, default_timeout_s=60.0) as client:
            assert client.health() == "SERVING"
    finally:
        process.stop()


def test_service_drain_closes_the_channel(tmp_path: Path, cache_dir: Path) -> None:
    """SIGTERM: the server closes its channels first (the watcher hears CLOSED, "shutdown");
    later steps complete at once with CLOSED."""
    process = ServerProcess(tmp_path / "drained.sock")
    try:
        process.wait_serving()
        bufs = Buffers(7)
        build = _open_build(process.address, bufs)
        logits, roots = bufs.fill_draft(3)
        build.build_tree(logits, roots, BUDGET)
        assert build.last_status().status == StepStatus.OK
        process.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while build.closed_reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert build.closed_reason == "shutdown"
        started = time.monotonic()
        build.build_tree(logits, roots, BUDGET)
        _release_or_fail(build, started)
        assert build.last_status().status == StepStatus.CLOSED
        build.close()
    finally:
        process.stop()


_CALLER = """
import os, torch
from ddtree.clients.channel import Channel, ChannelLostError
logits = (torch.randn(2, {draft_len}, {vocab}, device="cuda") * 3).to(torch.bfloat16)
roots = torch.zeros(2, dtype=torch.int64, device="cuda")
channel = Channel({address!r}, op="build_tree", max_batch_size=2, draft_len={draft_len},
                  max_budget={budget}, vocab_size={vocab}, tensors=[logits, roots])
for _ in range(20):
    channel.build_tree(logits, roots, {budget})
torch.cuda.synchronize()
print("ready", flush=True)
for _ in range(2000):
    channel.build_tree(logits, roots, {budget})
os.kill(os.getpid(), 9)
"""


def test_caller_killed_closes_its_channel(server: ServerProcess, client: Client) -> None:
    """A caller killed with steps in flight: the service sees its watch end, closes the channel
    (drains its stream, releases its regions) and goes on serving channels and RPCs."""
    script = _CALLER.format(address=server.address, draft_len=DRAFT_LEN, vocab=VOCAB, budget=BUDGET)
    caller = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert caller.stdout is not None
        assert caller.stdout.readline().strip() == "ready"
        assert caller.wait(timeout=120) == -signal.SIGKILL
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        if caller.stdout is not None:
            caller.stdout.close()
    server.log.wait_for("reason=caller_gone", timeout_s=30)
    bufs = Buffers(8)
    with _open_build(server.address, bufs) as build:
        logits, roots = bufs.fill_draft(MAX_BATCH)
        build.build_tree(logits, roots, BUDGET)
        assert build.last_status().status == StepStatus.OK
    assert client.health() == "SERVING"
