"""CUDA IPC between two processes, as in production: ``ddtree serve`` and the test as caller.

Every RPC by reference must equal the inline path exactly; bad references, handles and tokens
get their status and reason; an unregister during a call defers the unmapping; a caller that
dies is released by the idle timeout; a restarted server gets re-registered transparently. After
each misuse the server still serves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2, status_pb2
from helpers.ipc import ServerProcess, serving
from helpers.serving import LogWatcher

from ddtree.clients import Client, KvCommit, RetryPolicy
from ddtree.clients.cuda import (
    AllocationCache,
    ExportError,
    device_uuid,
    ipc_mem_handle,
    locate,
    query_buffer_id,
)
from ddtree.kernels.types import TREE_FIELDS, Tree
from ddtree.v1 import tensor_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.gpu

TREE_NAMES = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")
HEAD_DIM = 576
V_DIM = 512
PAGE_SIZE = 16
NUM_HEADS = 4
SLEEP_CYCLES = 1_500_000_000  # about 0.75 s of one SM at H200 clocks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[ServerProcess]:
    with serving(tmp_path_factory.mktemp("main") / "ddtree.sock") as process:
        yield process


@pytest.fixture(scope="module")
def small_server(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[ServerProcess]:
    """Three regions at most, and regions expire after one idle second."""
    with serving(
        tmp_path_factory.mktemp("small") / "ddtree.sock",
        "--max-registered-regions",
        "3",
        "--memory-idle-timeout-s",
        "1",
    ) as process:
        yield process


@pytest.fixture
def stub(server: ServerProcess) -> Iterator[pb_grpc.TreeSpeculationServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TreeSpeculationServiceStub(channel)


def inputs(seed: int, batch_size: int = 3, vocab_size: int = 4099) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, 5, vocab_size, generator=generator) * 3
    roots = torch.randint(0, vocab_size, (batch_size,), generator=generator)
    return {
        "draft_logits": logits.to(torch.bfloat16).cuda(),
        "root_tokens": roots.cuda(),
    }


def targets_for(tree: Tree, seed: int) -> torch.Tensor:
    """Target tokens that accept the last depth-1 node and then continue where they can."""
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, 4099, tuple(tree.tokens.shape), generator=generator).cuda()
    slots = torch.arange(tree.num_nodes_max, device="cuda").expand_as(tree.depths)
    last_child = torch.where(tree.depths == 1, slots, 0).amax(dim=1)
    targets[:, 0] = tree.tokens.gather(1, last_child[:, None])[:, 0]
    return targets


def paged_cache(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    max_pages = 8
    num_pages = batch_size * max_pages
    cache = torch.randn(num_pages, PAGE_SIZE, HEAD_DIM, generator=generator).to(torch.bfloat16)
    table = torch.randperm(num_pages, generator=generator).to(torch.int32)
    lens = torch.tensor([0, 17, 40][:batch_size], dtype=torch.int32)
    return cache.cuda(), table.reshape(batch_size, max_pages).cuda(), lens.cuda()


def status_of(error: grpc.RpcError) -> tuple[str, str]:
    reason = ""
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    reason = info.reason
    return error.code().name, reason  # type: ignore[attr-defined]


def register(stub: pb_grpc.TreeSpeculationServiceStub, tensor: torch.Tensor) -> tuple[str, int]:
    """Register ``tensor``'s allocation by hand; returns ``(token, offset_bytes)``."""
    allocation, offset = locate(tensor)
    response = stub.RegisterMemory(
        pb.RegisterMemoryRequest(
            ipc_handle=ipc_mem_handle(allocation, 0),
            device_uuid=allocation.device_uuid,
            byte_size=allocation.byte_size,
            client_id="raw",
        ),
        timeout=30,
    )
    return response.region_token, offset


def ref_tensor(tensor: torch.Tensor, token: str, offset: int) -> tensor_pb2.Tensor:
    dtypes = {torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16, torch.int64: tensor_pb2.DTYPE_INT64}
    return tensor_pb2.Tensor(
        dtype=dtypes[tensor.dtype],
        shape=list(tensor.shape),
        ref=tensor_pb2.TensorRef(region_token=token, offset_bytes=offset),
    )


def assert_same_tree(got: Tree, expected: Tree) -> None:
    for name in TREE_NAMES:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert got.draft_len == expected.draft_len


@pytest.mark.parametrize("use_ipc_events", [False, True], ids=["stream-sync", "ipc-event"])
def test_every_rpc_by_reference_equals_inline(server: ServerProcess, use_ipc_events: bool) -> None:
    step = inputs(seed=1)
    with (
        Client(server.address, tensor_transport="ipc", use_ipc_events=use_ipc_events) as ipc,
        Client(server.address) as inline,
    ):
        tree = ipc.build_tree(step["draft_logits"], step["root_tokens"], 33)
        expected_tree = inline.build_tree(step["draft_logits"], step["root_tokens"], 33)
        assert tree.tokens.is_cuda
        assert_same_tree(tree, expected_tree)

        targets = targets_for(tree, seed=2)
        cache, table, lens = paged_cache(3, seed=3)
        inline_cache = cache.clone()
        acceptance = ipc.accept_tree(tree, targets, kv_commit=KvCommit(cache, table, lens))
        expected = inline.accept_tree(
            expected_tree, targets, kv_commit=KvCommit(inline_cache, table, lens)
        )
        assert int(expected.length.max()) > 1
        for name in ("nodes", "tokens", "length", "bonus"):
            assert torch.equal(getattr(acceptance, name), getattr(expected, name)), name
        assert torch.equal(cache, inline_cache)  # compacted in place, identically

        generator = torch.Generator().manual_seed(4)
        q = torch.randn(3, tree.num_nodes_max, NUM_HEADS, HEAD_DIM, generator=generator)
        q = q.to(torch.bfloat16).cuda()
        out, lse = ipc.verify_attention(q, cache, table, lens, tree, v_dim=V_DIM)
        expected_out, expected_lse = inline.verify_attention(
            q, cache, table, lens, tree, v_dim=V_DIM
        )
        assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
        regions = ipc.list_memory()
        assert regions and all(r.device_uuid == device_uuid(0) for r in regions)
    # close() unregistered them
    with grpc.insecure_channel(server.address) as channel:
        listed = pb_grpc.TreeSpeculationServiceStub(channel).ListMemory(
            pb.ListMemoryRequest(client_id=ipc._ipc.registry.client_id),  # type: ignore[union-attr]
            timeout=10,
        )
    assert list(listed.regions) == []


def test_bad_references_handles_and_tokens(
    server: ServerProcess, small_server: ServerProcess, stub: pb_grpc.TreeSpeculationServiceStub
) -> None:
    step = inputs(seed=5)
    logits, roots = step["draft_logits"], step["root_tokens"]
    token, offset = register(stub, logits)
    roots_token, roots_offset = register(stub, roots)
    allocation, _ = locate(logits)
    with grpc.insecure_channel(small_server.address) as channel:
        foreign_token, _ = register(pb_grpc.TreeSpeculationServiceStub(channel), logits)

    def build(logits_ref: tensor_pb2.Tensor) -> pb.BuildTreeResponse:
        return stub.BuildTree(  # type: ignore[no-any-return]
            pb.BuildTreeRequest(
                draft_logits=logits_ref,
                root_tokens=ref_tensor(roots, roots_token, roots_offset),
                budget=16,
            ),
            timeout=30,
        )

    end = allocation.byte_size
    itemsize = 2
    nbytes = logits.numel() * itemsize
    cases = {
        "out-of-bounds": (ref_tensor(logits, token, end - nbytes + itemsize), "INVALID_REFERENCE"),
        "overflowing": (ref_tensor(logits, token, (1 << 64) - itemsize), "INVALID_REFERENCE"),
        "misaligned": (ref_tensor(logits, token, offset + 1), "INVALID_REFERENCE"),
        "unknown-token": (ref_tensor(logits, "x" * 32, offset), "MEMORY_TOKEN_NOT_FOUND"),
        "other-server-token": (ref_tensor(logits, foreign_token, offset), "MEMORY_TOKEN_NOT_FOUND"),
    }
    for name, (message, reason) in cases.items():
        with pytest.raises(grpc.RpcError) as raised:
            build(message)
        assert status_of(raised.value)[1] == reason, (name, raised.value.details())
    handle = ipc_mem_handle(allocation, 0)
    registrations = {
        "short-handle": (handle[:63], allocation.byte_size, device_uuid(0), "INVALID_IPC_HANDLE"),
        "foreign-handle": (os.urandom(64), 4096, device_uuid(0), "IPC_OPEN_FAILED"),
        "oversized": (handle, allocation.byte_size + 1, device_uuid(0), "INVALID_IPC_HANDLE"),
        "other-gpu": (handle, 4096, "GPU-00000000-0000-0000-0000-000000000000", "DEVICE_MISMATCH"),
    }
    for name, (ipc_handle, byte_size, uuid, reason) in registrations.items():
        with pytest.raises(grpc.RpcError) as raised:
            stub.RegisterMemory(
                pb.RegisterMemoryRequest(
                    ipc_handle=ipc_handle, device_uuid=uuid, byte_size=byte_size, client_id="raw"
                ),
                timeout=30,
            )
        assert status_of(raised.value)[1] == reason, (name, raised.value.details())
    good = build(ref_tensor(logits, token, offset))
    with Client(server.address) as inline:
        expected = inline.build_tree(logits, roots, 16)
        assert inline.health() == "SERVING"
    assert bytes(good.tree.tokens.inline) == expected.tokens.cpu().numpy().tobytes()
    for each in (token, roots_token):
        stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=each), timeout=10)


def test_region_limit_is_resource_exhausted(small_server: ServerProcess) -> None:
    # 32 MiB each: torch gives requests of 10 MiB and more a cudaMalloc segment of their own.
    buffers = [torch.empty(32 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
    with grpc.insecure_channel(small_server.address) as channel:
        stub = pb_grpc.TreeSpeculationServiceStub(channel)
        tokens = []
        with pytest.raises(grpc.RpcError) as raised:
            for buffer in buffers:
                tokens.append(register(stub, buffer)[0])
        assert status_of(raised.value) == ("RESOURCE_EXHAUSTED", "MEMORY_LIMIT_EXCEEDED")
        assert len(tokens) <= 3
        for token in tokens:
            stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=token), timeout=10)


def wait_for_new_line(log: LogWatcher, text: str, start: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in log.lines[start:]):
        assert time.monotonic() < deadline, f"no new line with {text!r}"
        time.sleep(0.005)


def test_unregister_during_a_call_defers_the_unmapping(
    server: ServerProcess, stub: pb_grpc.TreeSpeculationServiceStub
) -> None:
    step = inputs(seed=6, batch_size=2)
    logits, roots = step["draft_logits"], step["root_tokens"]
    token, offset = register(stub, logits)
    roots_token, roots_offset = register(stub, roots)
    event = torch.cuda.Event(interprocess=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream is busy: the server must wait
    event.record()
    request = pb.BuildTreeRequest(
        draft_logits=ref_tensor(logits, token, offset),
        root_tokens=ref_tensor(roots, roots_token, roots_offset),
        budget=16,
        wait_event_ipc_handle=bytes(event.ipc_handle()),
    )
    start = len(server.log.lines)
    pending = stub.BuildTree.future(request, timeout=60)
    # The servicer resolves the references (taking the leases) right after this line, before
    # the loop can serve the next call.
    wait_for_new_line(server.log, "event=rpc_received method=BuildTree", start)
    stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=token), timeout=10)
    wait_for_new_line(server.log, "deferred=True", start)
    response = pending.result()
    with Client(server.address) as inline:
        expected = inline.build_tree(logits, roots, 16)
    assert bytes(response.tree.mask.inline) == expected.mask.cpu().numpy().tobytes()
    with pytest.raises(grpc.RpcError) as raised:
        stub.BuildTree(request, timeout=30)
    assert status_of(raised.value) == ("NOT_FOUND", "MEMORY_TOKEN_NOT_FOUND")
    stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=roots_token), timeout=10)


CALLER = """
import sys, time, torch
from ddtree.clients import Client
logits = torch.randn(2, 4, 1000, device="cuda")
roots = torch.zeros(2, dtype=torch.int64, device="cuda")
client = Client(sys.argv[1], tensor_transport="ipc", client_id="doomed")
client.build_tree(logits, roots, 8)
print("registered", len(client.list_memory()), flush=True)
time.sleep(600)
"""


def test_killed_caller_is_released_and_the_server_keeps_serving(
    small_server: ServerProcess,
) -> None:
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER, small_server.address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert caller.stdout is not None
        line = caller.stdout.readline()
        assert line.startswith("registered") and int(line.split()[1]) >= 1, line
        caller.send_signal(signal.SIGKILL)
        caller.wait(timeout=30)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        if caller.stdout is not None:
            caller.stdout.close()
    with grpc.insecure_channel(small_server.address) as channel:
        stub = pb_grpc.TreeSpeculationServiceStub(channel)
        deadline = time.monotonic() + 30
        while stub.ListMemory(pb.ListMemoryRequest(client_id="doomed"), timeout=10).regions:
            assert time.monotonic() < deadline, "the dead caller's regions never expired"
            time.sleep(0.2)
    small_server.log.wait_for("event=memory_expired")
    step = inputs(seed=7)
    with Client(small_server.address, tensor_transport="ipc") as client:
        assert client.health() == "SERVING"
        tree = client.build_tree(step["draft_logits"], step["root_tokens"], 8)
        assert int(tree.num_nodes.min()) >= 2


def test_restarted_server_is_re_registered_transparently(tmp_path: Path, cache_dir: Path) -> None:
    socket = tmp_path / "restart.sock"
    step = inputs(seed=8)
    first = ServerProcess(socket).wait_serving()
    try:
        patient = RetryPolicy(max_attempts=8, initial_backoff_s=0.2)
        with Client(first.address, tensor_transport="ipc", retry=patient) as client:
            before = client.build_tree(step["draft_logits"], step["root_tokens"], 12)
            first.stop()
            second = ServerProcess(socket).wait_serving()
            try:
                after = client.build_tree(step["draft_logits"], step["root_tokens"], 12)
                second.log.wait_for("event=memory_registered")
            finally:
                second.stop()
    finally:
        first.stop()
    assert_same_tree(after, before)


def test_memoized_and_prepared_requests_after_a_restart_are_re_registered(
    tmp_path: Path, cache_dir: Path
) -> None:
    # Static destinations: each client resends a kept request (one through its request memo,
    # one prepared), which names regions the restarted server never saw
    # (MEMORY_TOKEN_NOT_FOUND); it registers them and sends anew.
    socket = tmp_path / "restart-memo.sock"
    step = inputs(seed=9)
    logits, roots = step["draft_logits"], step["root_tokens"]
    first = ServerProcess(socket).wait_serving()
    patient = RetryPolicy(max_attempts=8, initial_backoff_s=0.2)
    try:
        with (
            Client(first.address, tensor_transport="ipc", retry=patient) as memoized,
            Client(first.address, tensor_transport="ipc", retry=patient) as preparing,
        ):
            expected = memoized.build_tree(logits, roots, 12)
            out = memoized.build_tree(logits, roots, 12)  # destinations in this process
            other_out = memoized.build_tree(logits, roots, 12)
            prepared = preparing.prepare_build_tree(logits, roots, 12, out=other_out)
            for _ in range(3):
                assert memoized.build_tree(logits, roots, 12, out=out) is out
                assert prepared() is other_out
            memo = memoized._ipc.memo  # type: ignore[union-attr]
            assert memo.hits >= 1
            first.stop()
            second = ServerProcess(socket).wait_serving()
            try:
                for tree in (out, other_out):
                    for name in TREE_FIELDS:
                        getattr(tree, name).fill_(-7)
                assert memoized.build_tree(logits, roots, 12, out=out) is out
                second.log.wait_for("event=memory_registered")
                assert_same_tree(out, expected)
                assert prepared() is other_out
                assert_same_tree(other_out, expected)
                # As on the first server: the request is built and kept again, then reused.
                for _ in range(2):
                    assert memoized.build_tree(logits, roots, 12, out=out) is out
                    assert prepared() is other_out
                hits = memo.hits
                assert memoized.build_tree(logits, roots, 12, out=out) is out
                assert memo.hits == hits + 1
                assert_same_tree(out, expected)
            finally:
                second.stop()
    finally:
        first.stop()


def test_allocation_cache_follows_the_allocator_and_needs_no_context() -> None:
    cache = AllocationCache()
    # 32 MiB: torch gives requests of 10 MiB and more a cudaMalloc segment of their own.
    first = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    view = first[1 << 20 : 2 << 20]
    found, offset = cache.find(view, "view", [])
    assert (found, offset) == locate(view)
    old = found
    del first, view
    torch.cuda.empty_cache()  # cudaFree: the next segment may reuse the address, not the id
    second = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    found, offset = cache.find(second, "second", [])
    assert (found, offset) == locate(second)
    assert found.buffer_id != old.buffer_id
    # A thread that never touched CUDA has no current context: the query makes one.
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(query_buffer_id(second.data_ptr(), 0)))
    thread.start()
    thread.join()
    assert seen == [found.buffer_id]


def test_a_freed_and_reused_segment_is_registered_again(server: ServerProcess) -> None:
    # The server must read the caller's current memory, never a mapping of freed memory that
    # a stale client cache would name.
    with (
        Client(server.address, tensor_transport="ipc") as ipc,
        Client(server.address) as inline,
    ):
        trees = []
        for seed in (11, 12):
            # 12 MiB of logits: a segment of their own, freed by empty_cache between the calls.
            step = inputs(seed=seed, batch_size=3, vocab_size=409_600)
            tree = ipc.build_tree(step["draft_logits"], step["root_tokens"], 24)
            assert_same_tree(tree, inline.build_tree(step["draft_logits"], step["root_tokens"], 24))
            trees.append(tree)
            del step
            torch.cuda.empty_cache()
        assert not torch.equal(trees[0].tokens, trees[1].tokens)


def test_expandable_segments_are_refused_clearly() -> None:
    code = (
        "import torch\n"
        "from ddtree.clients.cuda import ExportError, locate\n"
        "try:\n"
        "    locate(torch.zeros(1024, device='cuda'), 'draft_logits')\n"
        "except ExportError as err:\n"
        "    print('refused:', err)\n"
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "refused: draft_logits" in result.stdout and "expandable_segments" in result.stdout


def test_cpu_tensor_cannot_travel_by_reference(server: ServerProcess) -> None:
    with Client(server.address, tensor_transport="ipc") as client, pytest.raises(ExportError):
        client.build_tree(torch.randn(1, 2, 50), torch.zeros(1, dtype=torch.int64), 4)
