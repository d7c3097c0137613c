"""``out=`` by CUDA IPC reference and the client's request memo, against ``ddtree serve``.

The server and the caller are separate processes. Results written into ``out`` by reference must
equal the inline path; a repeated call with the same buffers reuses its request; memory that was
freed and allocated again (at the same address, as the driver usually does, or another) must miss
the memo, and the server must write the new allocation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.ipc import ServerProcess, serving

from ddtree.clients import Client
from ddtree.clients.cuda import query_buffer_id
from ddtree.kernels.types import Acceptance, Tree, mask_words

pytestmark = pytest.mark.gpu

TREE_NAMES = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")
ACCEPTANCE_NAMES = ("nodes", "tokens", "length", "bonus")
BATCH_SIZE = 3
DRAFT_LEN = 5
BUDGET = 24
SEGMENT_BYTES = 32 << 20  # torch gives requests of 10 MiB and more a cudaMalloc of their own
SLEEP_CYCLES = 200_000_000  # about 0.1 s of one SM at H200 clocks


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[ServerProcess]:
    with serving(tmp_path_factory.mktemp("out") / "ddtree.sock") as process:
        yield process


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH_SIZE, DRAFT_LEN, 4099, generator=generator) * 3
    roots = torch.randint(0, 4099, (BATCH_SIZE,), generator=generator)
    return logits.to(torch.bfloat16).cuda(), roots.cuda()


def tree_in(buffer: torch.Tensor) -> Tree:
    """Destinations of a BuildTree carved out of ``buffer`` (a uint8 CUDA tensor), -7 filled."""
    nodes = 1 + BUDGET
    pair = (BATCH_SIZE, nodes)
    shapes = {
        "tokens": (pair, torch.int64),
        "parents": (pair, torch.int32),
        "depths": (pair, torch.int32),
        "log_probs": (pair, torch.float32),
        "num_nodes": ((BATCH_SIZE,), torch.int32),
        "mask": ((*pair, mask_words(nodes)), torch.int64),
    }
    views = {}
    offset = 0
    for name, (shape, dtype) in shapes.items():
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        view = buffer[offset : offset + size].view(dtype).view(shape)
        view.fill_(-7)
        views[name] = view
        offset += (size + 255) // 256 * 256
    return Tree(**views, draft_len=DRAFT_LEN)


def acceptance_like(tree: Tree) -> Acceptance:
    path = (BATCH_SIZE, tree.draft_len + 1)
    device = tree.device
    return Acceptance(
        nodes=torch.full(path, -7, dtype=torch.int32, device=device),
        tokens=torch.full(path, -7, dtype=torch.int64, device=device),
        length=torch.full((BATCH_SIZE,), -7, dtype=torch.int32, device=device),
        bonus=torch.full((BATCH_SIZE,), -7, dtype=torch.int64, device=device),
    )


def assert_same(got: object, expected: object, names: tuple[str, ...]) -> None:
    for name in names:
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


@pytest.mark.parametrize("use_ipc_events", [False, True], ids=["stream-sync", "ipc-event"])
def test_out_by_reference_equals_inline_and_repeats_hit_the_memo(
    server: ServerProcess, use_ipc_events: bool
) -> None:
    logits, roots = inputs(seed=1)
    buffer = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    out = tree_in(buffer)
    with (
        Client(server.address, tensor_transport="ipc", use_ipc_events=use_ipc_events) as ipc,
        Client(server.address) as inline,
    ):
        expected = inline.build_tree(logits, roots, BUDGET)
        for _ in range(5):
            for name in TREE_NAMES:
                getattr(out, name).fill_(-7)
            assert ipc.build_tree(logits, roots, BUDGET, out=out) is out
            assert_same(out, expected, TREE_NAMES)
        memo = ipc._ipc.memo  # type: ignore[union-attr]
        # The first call registers (its request is not kept), the second builds the request
        # that the other three reuse.
        assert memo.hits == 3

        targets = expected.tokens.clone()
        destination = acceptance_like(out)
        expected_acceptance = inline.accept_tree(expected, targets)
        for _ in range(3):
            assert ipc.accept_tree(out, targets, out=destination) is destination
            assert_same(destination, expected_acceptance, ACCEPTANCE_NAMES)
        assert memo.hits >= 4


def test_a_prepared_build_resends_its_request_with_the_current_contents(
    server: ServerProcess,
) -> None:
    """After the calls that register and build the request, a prepared call sends the same
    request again without looking it up (the memo is not consulted), and every step's result
    is that of the tensors' contents at the call."""
    logits, roots = inputs(seed=3)
    out = tree_in(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    with (
        Client(server.address, tensor_transport="ipc") as ipc,
        Client(server.address) as inline,
    ):
        prepared = ipc.prepare_build_tree(logits, roots, BUDGET, out=out)
        memo = ipc._ipc.memo  # type: ignore[union-attr]
        for seed in range(4, 10):
            new_logits, new_roots = inputs(seed)
            logits.copy_(new_logits)
            roots.copy_(new_roots)
            expected = inline.build_tree(logits, roots, BUDGET)
            for name in TREE_NAMES:
                getattr(out, name).fill_(-7)
            assert prepared() is out
            assert_same(out, expected, TREE_NAMES)
            if seed == 5:  # registered (4), then built and kept (5)
                hits = memo.hits
        assert memo.hits == hits


@pytest.mark.parametrize("where", ["side-stream", "default-stream", "new-thread"])
def test_a_prepared_build_waits_for_the_callers_pending_writes(
    server: ServerProcess, where: str
) -> None:
    """The inputs are ordered before the server reads them: the caller's current stream, busy
    for a while, then writing new logits, is synchronised before the request goes. On another
    stream than the default, on the default one, and from a thread that made no CUDA call
    before (the default stream is the whole process's: the writes queued on it by the main
    thread are waited for)."""
    logits, roots = inputs(seed=11)
    out = tree_in(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    new_logits, _ = inputs(seed=12)
    with (
        Client(server.address, tensor_transport="ipc") as ipc,
        Client(server.address) as inline,
    ):
        expected = inline.build_tree(new_logits, roots, BUDGET)
        prepared = ipc.prepare_build_tree(logits, roots, BUDGET, out=out)
        for _ in range(3):  # registered, built and kept, then resent as prepared
            prepared()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream() if where == "side-stream" else torch.cuda.default_stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the current stream stays busy for a while
            logits.copy_(new_logits)  # queued behind it
            if where != "new-thread":
                prepared()
        if where == "new-thread":
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    prepared()
                except BaseException as err:  # reported on the test's thread
                    errors.append(err)

            thread = threading.Thread(target=run)
            thread.start()
            thread.join(timeout=120)
            assert not thread.is_alive() and not errors, errors
        assert_same(out, expected, TREE_NAMES)


def test_a_prepared_build_follows_tensors_given_new_memory(server: ServerProcess) -> None:
    """A tensor given other memory in place (``set_``) is noticed: the call is prepared again
    for the new addresses, reads the new input and writes the new destination, never the old
    memory (still alive here, so a stale request would go unnoticed by the server)."""
    logits, roots = inputs(seed=11)
    out = tree_in(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    with (
        Client(server.address, tensor_transport="ipc") as ipc,
        Client(server.address) as inline,
    ):
        prepared = ipc.prepare_build_tree(logits, roots, BUDGET, out=out)
        for _ in range(3):
            prepared()
        old_tokens = out.tokens.view_as(out.tokens)  # the old memory, kept alive
        old_logits = logits.view_as(logits)
        new_logits, _ = inputs(seed=12)
        logits.set_(new_logits)
        out.tokens.set_(torch.full_like(old_tokens, -7))
        old_tokens.fill_(-7)
        expected = inline.build_tree(new_logits, roots, BUDGET)
        for _ in range(3):
            assert prepared() is out
            assert_same(out, expected, TREE_NAMES)
        assert bool((old_tokens == -7).all())
        assert not torch.equal(old_logits, logits)


def test_memory_freed_and_reallocated_at_the_same_address_is_written_anew(
    server: ServerProcess,
) -> None:
    """The driver usually hands the freed range out again at the same address (then the memo
    key is the same and only the buffer id tells the allocations apart); where it does not,
    the key differs. Either way the new allocation has a new buffer id, the memo misses and
    the server writes the new allocation."""
    logits, roots = inputs(seed=2)
    with (
        Client(server.address, tensor_transport="ipc") as ipc,
        Client(server.address) as inline,
    ):
        expected = inline.build_tree(logits, roots, BUDGET)
        memo = ipc._ipc.memo  # type: ignore[union-attr]
        buffer = torch.empty(SEGMENT_BYTES, dtype=torch.uint8, device="cuda")
        old_id = query_buffer_id(buffer.data_ptr(), 0)
        out = tree_in(buffer)
        for _ in range(3):
            ipc.build_tree(logits, roots, BUDGET, out=out)
        assert memo.hits == 1
        del out, buffer
        torch.cuda.empty_cache()  # cudaFree of the segment
        buffer = torch.empty(SEGMENT_BYTES, dtype=torch.uint8, device="cuda")
        assert query_buffer_id(buffer.data_ptr(), 0) != old_id
        out = tree_in(buffer)
        assert ipc.build_tree(logits, roots, BUDGET, out=out) is out
        assert memo.hits == 1  # a miss, at the old address or another
        assert_same(out, expected, TREE_NAMES)  # the server wrote the new allocation
