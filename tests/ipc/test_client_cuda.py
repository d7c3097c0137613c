"""Client-side CUDA IPC logic that needs no GPU: the import gate, refusals, the registry."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.rpc import error_details_pb2, status_pb2
from helpers.service_inputs import BUDGET, make_step
from helpers.serving import ServerThread

from ddtree.clients import AsyncClient, Client
from ddtree.clients.cuda import (
    Allocation,
    AllocationCache,
    ClientIpc,
    ExportError,
    MemoryRegistry,
    RequestMemo,
    RequestRefs,
    locate,
    require_cuda_python,
)
from ddtree.clients.errors import InvalidArgumentError
from ddtree.kernels.types import Tree
from ddtree.service.config import ServiceConfig
from ddtree.v1 import tree_speculation_service_pb2 as pb


def allocation(base: int, size: int, buffer_id: int, uuid: str = "GPU-a") -> Allocation:
    return Allocation(uuid, base, size, buffer_id)


class FakeCudaTensor(torch.Tensor):
    """A host tensor that claims to live at device address ``pointer`` on cuda:0."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, nbytes: int, pointer: int) -> FakeCudaTensor:
        tensor = torch.Tensor._make_subclass(cls, torch.empty(nbytes, dtype=torch.uint8))
        tensor.fake_pointer = pointer  # type: ignore[attr-defined]
        return tensor  # type: ignore[return-value]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def data_ptr(self) -> int:  # type: ignore[override]
        return self.fake_pointer  # type: ignore[no-any-return,attr-defined]


class FakeDriver:
    """Live allocations as the driver sees them; counts the queries the cache makes."""

    def __init__(self) -> None:
        self.live: list[Allocation] = []
        self.buffer_id_calls = 0
        self.describe_calls = 0
        self._next_id = 1

    def malloc(self, base: int, size: int) -> Allocation:
        made = allocation(base, size, self._next_id)
        self._next_id += 1
        self.live.append(made)
        return made

    def free(self, made: Allocation) -> None:
        self.live.remove(made)

    def _holding(self, pointer: int) -> Allocation:
        return next(a for a in self.live if a.base_pointer <= pointer < a.end_pointer)

    def buffer_id(self, pointer: int, device_index: int, field: str) -> int:
        self.buffer_id_calls += 1
        return self._holding(pointer).buffer_id

    def describe(self, tensor: torch.Tensor, field: str) -> tuple[Allocation, int]:
        self.describe_calls += 1
        found = self._holding(tensor.data_ptr())
        return found, tensor.data_ptr() - found.base_pointer


def fake_cache(driver: FakeDriver) -> AllocationCache:
    return AllocationCache(buffer_id=driver.buffer_id, describe=driver.describe)


def test_missing_cuda_python_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(ImportError, match=r"pip install 'ddtree\[cuda\]'"):
        require_cuda_python()
    with pytest.raises(ImportError, match=r"ddtree\[cuda\]"):
        ClientIpc("ipc", None, False)


def test_cuda_module_imports_without_cuda_python() -> None:
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
        "import ddtree.clients.cuda, ddtree.clients\n"
        "print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize(
    ("tensor", "needle"),
    [
        (torch.zeros(4), "CUDA tensors only, got one on cpu"),
        ([1, 2], "CUDA tensors only, got one on list"),
    ],
    ids=["cpu-tensor", "not-a-tensor"],
)
def test_locate_refuses_what_cannot_be_exported(tensor: object, needle: str) -> None:
    with pytest.raises(ExportError, match=needle) as raised:
        locate(tensor, "draft_logits")  # type: ignore[arg-type]
    assert str(raised.value).startswith("draft_logits")


def test_registry_reuses_tokens_per_allocation_and_reports_stale_ranges() -> None:
    registry = MemoryRegistry("me")
    first = allocation(0x1000, 0x1000, 1)
    assert registry.token(first) is None
    assert registry.add(first, "t1") == []
    assert registry.token(allocation(0x1000, 0x1000, 1)) == "t1"
    assert registry.add(allocation(0x8000, 0x1000, 2), "t2") == []
    assert registry.add(allocation(0x1000, 0x1000, 1, uuid="GPU-b"), "t3") == []
    # The allocator freed allocation 1 and a new one (buffer id 4) reuses part of its range.
    assert registry.add(allocation(0x1800, 0x2000, 4), "t4") == ["t1"]
    assert registry.token(first) is None
    assert len(registry) == 3
    assert sorted(registry.clear()) == ["t2", "t3", "t4"]
    assert len(registry) == 0


def test_cache_asks_the_driver_once_per_allocation_and_request() -> None:
    driver = FakeDriver()
    big = driver.malloc(0x100000, 0x100000)
    small = driver.malloc(0x400000, 0x200000)
    cache = fake_cache(driver)
    logits = FakeCudaTensor(0x80000, big.base_pointer + 0x200)
    outputs = [FakeCudaTensor(512, small.base_pointer + 512 * i) for i in range(6)]
    for request in range(3):
        confirmed: list[Allocation] = []
        assert cache.find(logits, "draft_logits", confirmed) == (big, 0x200)
        confirmed.append(big)
        for i, output in enumerate(outputs):
            assert cache.find(output, f"outputs.{i}", confirmed) == (small, 512 * i)
            if small not in confirmed:
                confirmed.append(small)
        # Two allocations: two buffer-id queries per request; located only on the first.
        assert driver.buffer_id_calls == 2 * (request + 1)
        assert driver.describe_calls == 2
    assert len(cache) == 2


def test_cache_never_reuses_an_entry_of_freed_memory() -> None:
    # torch.cuda.empty_cache() freed a segment and a new cudaMalloc took its address: same
    # pointer, same size, new buffer id. The cached entry must not be used for it.
    driver = FakeDriver()
    old = driver.malloc(0x200000, 0x200000)
    cache = fake_cache(driver)
    registry = MemoryRegistry("me")
    tensor = FakeCudaTensor(256, 0x200000 + 1024)
    found, offset = cache.find(tensor, "root_tokens", [])
    assert found == old and offset == 1024
    assert registry.add(found, "t-old") == []
    driver.free(old)
    new = driver.malloc(0x200000, 0x400000)
    found, offset = cache.find(tensor, "root_tokens", [])
    assert found == new and found.buffer_id != old.buffer_id and offset == 1024
    assert registry.token(found) is None  # so the client registers the new allocation
    assert registry.add(found, "t-new") == ["t-old"]  # and unregisters the old one


def test_cache_refuses_a_tensor_outside_the_allocation_the_driver_named() -> None:
    driver = FakeDriver()
    made = driver.malloc(0x10000, 0x1000)
    cache = fake_cache(driver)
    with pytest.raises(ExportError, match=r"q: bytes .* are not inside the allocation"):
        cache.find(FakeCudaTensor(0x1000, made.base_pointer + 0x800), "q", [])


def test_request_refs_share_the_client_cache_and_its_tokens() -> None:
    driver = FakeDriver()
    made = driver.malloc(0x200000, 0x200000)
    cache = fake_cache(driver)
    registry = MemoryRegistry("me")
    tensors = [FakeCudaTensor(64, made.base_pointer + 64 * i) for i in range(3)]
    first = RequestRefs(registry, "ipc", "GPU-a", cache)
    first.add([(f"t{i}", t) for i, t in enumerate(tensors)])
    assert first.missing() == [made]
    registry.add(made, "tok")
    refs = [first.ref_for(t) for t in tensors]
    assert [(r.region_token, r.offset_bytes) for r in refs if r] == [
        ("tok", 0),
        ("tok", 64),
        ("tok", 128),
    ]
    second = RequestRefs(registry, "ipc", "GPU-a", cache)
    second.add([("t0", tensors[0])])
    assert second.missing() == []
    assert driver.describe_calls == 1 and driver.buffer_id_calls == 2


def test_request_refs_refuse_a_tensor_on_another_gpu_than_the_servers() -> None:
    driver = FakeDriver()
    made = driver.malloc(0x200000, 0x200000)
    strict = RequestRefs(MemoryRegistry(), "ipc", "GPU-b", fake_cache(driver))
    with pytest.raises(ExportError, match="draft_logits: the tensor is on GPU-a, the server on"):
        strict.add([("draft_logits", FakeCudaTensor(64, made.base_pointer))])
    auto = RequestRefs(MemoryRegistry(), "auto", "GPU-b", fake_cache(driver))
    tensor = FakeCudaTensor(64, made.base_pointer)
    auto.add([("draft_logits", tensor)])
    assert not auto.is_ref(tensor) and auto.missing() == []


def test_default_client_id_is_valid_and_distinct() -> None:
    ids = {MemoryRegistry().client_id for _ in range(3)}
    assert len(ids) == 3
    assert all(i.startswith("py-") and len(i) <= 64 for i in ids)


def test_request_refs_fall_back_inline_only_when_allowed() -> None:
    cpu = torch.zeros(3)
    auto = RequestRefs(MemoryRegistry(), "auto", "GPU-a")
    auto.add([("draft_logits", cpu), ("budgets", None)])
    assert auto.ref_for(cpu) is None and not auto.is_ref(cpu) and auto.missing() == []
    strict = RequestRefs(MemoryRegistry(), "ipc", "GPU-a")
    with pytest.raises(ExportError, match="draft_logits"):
        strict.add([("draft_logits", cpu)])


def test_server_without_reference_support() -> None:
    auto = ClientIpc("auto", None, False)
    auto.set_server(False, ["cpu"])
    assert auto.refs([("q", torch.zeros(1))]) is None
    strict = ClientIpc("ipc", None, False)
    strict.set_server(False, ["cpu"])
    with pytest.raises(ExportError, match="does not support memory references"):
        strict.refs([("q", torch.zeros(1))])


def test_unknown_transport_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_transport"):
        Client("127.0.0.1:1", tensor_transport="shm")


@pytest.fixture
def cpu_server(tmp_path: Path) -> Iterator[ServerThread]:
    thread = ServerThread(ServiceConfig(listen=(f"unix:{tmp_path / 's.sock'}",), device="cpu"))
    thread.start()
    yield thread
    thread.stop()


def test_auto_transport_sends_inline_to_a_server_without_references(
    cpu_server: ServerThread,
) -> None:
    step = make_step(seed=2)
    address = cpu_server.addresses[0]
    with Client(address, tensor_transport="auto") as auto, Client(address) as inline:
        tree = auto.build_tree(step.draft_logits, step.root_tokens, BUDGET)
        expected = inline.build_tree(step.draft_logits, step.root_tokens, BUDGET)
        assert torch.equal(tree.tokens, expected.tokens)
        assert torch.equal(tree.mask, expected.mask)
        assert auto.list_memory() == []
    with Client(address, tensor_transport="ipc") as strict, pytest.raises(ExportError):
        strict.build_tree(step.draft_logits, step.root_tokens, BUDGET)


def test_async_client_auto_transport_falls_back_inline(cpu_server: ServerThread) -> None:
    step = make_step(seed=3)
    address = cpu_server.addresses[0]

    async def run() -> tuple[torch.Tensor, torch.Tensor, list[object]]:
        async with AsyncClient(address, tensor_transport="auto") as auto:
            tree = await auto.build_tree(step.draft_logits, step.root_tokens, BUDGET)
            acceptance = await auto.accept_tree(tree, step.target_tokens)
            return tree.tokens, acceptance.nodes, list(await auto.list_memory())

    tokens, nodes, regions = asyncio.run(run())
    with Client(address) as inline:
        expected = inline.build_tree(step.draft_logits, step.root_tokens, BUDGET)
        expected_acceptance = inline.accept_tree(expected, step.target_tokens)
    assert torch.equal(tokens, expected.tokens)
    assert torch.equal(nodes, expected_acceptance.nodes)
    assert regions == []


# --- RequestMemo: a repeated by-reference call reuses its request while that is safe ----------

HANDLE = b"e" * 64
TREE_NAMES = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")


def fake_tensor(shape: tuple[int, ...], dtype: torch.dtype, pointer: int) -> FakeCudaTensor:
    """A host tensor of ``shape`` and ``dtype`` that claims to live at ``pointer`` on cuda:0."""
    tensor = torch.Tensor._make_subclass(FakeCudaTensor, torch.zeros(shape, dtype=dtype))
    tensor.fake_pointer = pointer  # type: ignore[attr-defined]
    return tensor  # type: ignore[return-value]


class TokenNotFound(grpc.RpcError):
    """What a restarted server answers for a token of its previous life."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND

    def details(self) -> str:
        return "build_tree.draft_logits: unknown memory token"

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        status = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0])
        status.details.add().Pack(
            error_details_pb2.ErrorInfo(reason="MEMORY_TOKEN_NOT_FOUND", domain="ddtree.v1")
        )
        return (("grpc-status-details-bin", status.SerializeToString()),)


class FakeStub:
    """A server on GPU-a that records what it is sent and hands out fresh tokens."""

    def __init__(self) -> None:
        self.sent: list[pb.BuildTreeRequest] = []
        self.registered = 0
        self.unregistered: list[str] = []
        self.forget_next = False

    def GetServerInfo(self, request: object, timeout: float) -> pb.GetServerInfoResponse:  # noqa: N802
        return pb.GetServerInfoResponse(
            devices=[pb.Device(uuid="GPU-a")], supports_memory_references=True
        )

    def RegisterMemory(self, request: object, timeout: float) -> pb.RegisterMemoryResponse:  # noqa: N802
        self.registered += 1
        return pb.RegisterMemoryResponse(region_token=f"tok-{self.registered}")

    def UnregisterMemory(  # noqa: N802
        self, request: pb.UnregisterMemoryRequest, timeout: float
    ) -> pb.UnregisterMemoryResponse:
        self.unregistered.append(request.region_token)
        return pb.UnregisterMemoryResponse()

    def BuildTree(self, request: pb.BuildTreeRequest, timeout: float) -> pb.BuildTreeResponse:  # noqa: N802
        self.sent.append(request)
        if self.forget_next:
            self.forget_next = False
            raise TokenNotFound()
        return pb.BuildTreeResponse()


class AsyncFakeStub:
    """A ``FakeStub``'s server behind awaitable methods, failing as ``grpc.aio`` calls do."""

    def __init__(self, stub: FakeStub) -> None:
        self.stub = stub

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self.stub, name)

        async def call(request: Any, timeout: float) -> Any:
            try:
                return method(request, timeout=timeout)
            except TokenNotFound as err:
                trailing = grpc.aio.Metadata(*err.trailing_metadata())
                raise grpc.aio.AioRpcError(
                    err.code(), grpc.aio.Metadata(), trailing, err.details()
                ) from None

        return call


class Rig:
    """A ``Client(tensor_transport="ipc")`` (or the ``AsyncClient`` given, made in a running
    event loop) over a fake driver and a fake server.

    Logits live in one allocation; the root tokens and the six destinations of ``out`` in
    another, as torch's caching allocator places them.
    """

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, async_client: AsyncClient | None = None
    ) -> None:
        self.driver = FakeDriver()
        self.stub = FakeStub()
        self.client: Client | AsyncClient = async_client or Client(
            "127.0.0.1:1", tensor_transport="ipc", use_ipc_events=True
        )
        ipc = self.client._ipc
        assert ipc is not None
        self.ipc = ipc
        ipc.allocations = fake_cache(self.driver)
        ipc.memo = RequestMemo(ipc.registry, buffer_id=self.driver.buffer_id)
        self.ordered = 0

        def order_inputs(refs: RequestRefs | None) -> bytes:
            self.ordered += 1  # the event is recorded on every call, memo or not
            return HANDLE

        monkeypatch.setattr(ipc, "order_inputs", order_inputs)
        monkeypatch.setattr(
            ipc,
            "register_request",
            lambda found: pb.RegisterMemoryRequest(device_uuid=found.device_uuid),
        )
        stub: Any = self.stub if async_client is None else AsyncFakeStub(self.stub)
        self.client._stub = stub
        self.big = self.driver.malloc(0x1000000, 0x1000000)
        self.small = self.driver.malloc(0x4000000, 0x100000)
        self.logits = fake_tensor((2, 3, 5), torch.float32, self.big.base_pointer + 0x200)
        self.roots = fake_tensor((2,), torch.int64, self.small.base_pointer)
        shapes = {
            "tokens": ((2, 5), torch.int64),
            "parents": ((2, 5), torch.int32),
            "depths": ((2, 5), torch.int32),
            "log_probs": ((2, 5), torch.float32),
            "num_nodes": ((2,), torch.int32),
            "mask": ((2, 5, 1), torch.int64),
        }
        self.out = Tree(
            **{
                name: fake_tensor(shape, dtype, self.small.base_pointer + 256 * (i + 1))
                for i, (name, (shape, dtype)) in enumerate(shapes.items())
            },
            draft_len=3,
        )

    def build(self, **kwargs: Any) -> pb.BuildTreeRequest:
        """One call with the rig's buffers; returns the request the server got."""
        assert isinstance(self.client, Client)
        tree = self.client.build_tree(self.logits, self.roots, 4, out=self.out, **kwargs)
        assert tree is self.out
        return self.stub.sent[-1]

    async def build_async(self) -> pb.BuildTreeRequest:
        """``build`` through the rig's ``AsyncClient``."""
        assert isinstance(self.client, AsyncClient)
        tree = await self.client.build_tree(self.logits, self.roots, 4, out=self.out)
        assert tree is self.out
        return self.stub.sent[-1]


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    made = Rig(monkeypatch)
    yield made
    made.client.close()


def tokens_of(request: pb.BuildTreeRequest) -> set[str]:
    refs = [request.draft_logits.ref, request.root_tokens.ref]
    refs += [getattr(request.outputs, name) for name in TREE_NAMES]
    return {ref.region_token for ref in refs}


def test_a_repeated_call_reuses_its_request(rig: Rig) -> None:
    registering = rig.build()
    assert tokens_of(registering) == {"tok-1", "tok-2"}
    # The first call registered memory after reading the registry's generation, so its
    # request is not trusted; the second builds one that is.
    first = rig.build()
    assert first is not registering and tokens_of(first) == {"tok-1", "tok-2"}
    assert first.draft_logits.ref.offset_bytes == 0x200
    assert first.outputs.mask.offset_bytes == 256 * 6
    for _ in range(3):
        assert rig.build() is first
    assert (rig.ipc.memo.hits, rig.stub.registered, rig.ordered) == (3, 2, 5)
    assert first.wait_event_ipc_handle == HANDLE
    # Two allocations located once; a full build asks for their buffer ids, a hit too.
    assert rig.driver.describe_calls == 2
    assert rig.driver.buffer_id_calls == 2 * 5
    # Another scalar is another request.
    other = rig.build(temperature=0.5)
    assert other is not first and other.temperature == 0.5
    assert rig.build() is first


def test_memory_freed_and_reallocated_at_the_same_address_misses(rig: Rig) -> None:
    rig.build()
    first = rig.build()
    assert rig.build() is first and rig.ipc.memo.hits == 1
    # torch.cuda.empty_cache() freed the small segment; a new cudaMalloc returned the same
    # range. Same pointers, shapes and strides: only the buffer id tells them apart.
    rig.driver.free(rig.small)
    new = rig.driver.malloc(rig.small.base_pointer, rig.small.byte_size)
    second = rig.build()
    assert second is not first
    assert rig.ipc.memo.hits == 1
    # The new allocation was registered and the server is told to write there.
    assert rig.stub.registered == 3
    assert second.outputs.tokens.region_token == "tok-3"
    assert second.root_tokens.ref.region_token == "tok-3"
    assert second.draft_logits.ref.region_token == "tok-1"
    assert rig.stub.unregistered == ["tok-2"]  # the old allocation's registration
    assert rig.ipc.registry.token(new) == "tok-3"
    # Registering bumped the registry: one more full build, then the new request is reused.
    third = rig.build()
    assert rig.build() is third and tokens_of(third) == {"tok-1", "tok-3"}


def test_a_registry_change_misses_until_rebuilt(rig: Rig) -> None:
    rig.build()
    first = rig.build()
    assert rig.build() is first
    rig.ipc.registry.add(allocation(0x9000000, 0x1000, 99), "tok-other")
    second = rig.build()
    assert second is not first and tokens_of(second) == tokens_of(first)
    assert rig.build() is second


def test_token_not_found_drops_the_memo_and_registers_again(rig: Rig) -> None:
    rig.build()
    first = rig.build()
    assert rig.build() is first
    rig.stub.forget_next = True  # the server restarted
    retried = rig.build()
    assert rig.stub.sent[-2] is first  # the memoized request met the restarted server
    assert retried is not first
    assert tokens_of(retried) == {"tok-3", "tok-4"}
    assert all(rig.build() is not first for _ in range(2))
    assert "tok-1" not in tokens_of(rig.stub.sent[-1])


def test_the_async_client_runs_the_same_reference_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AsyncClient`` sends by reference through the sync client's steps: it registers each
    allocation once, reuses a memoized request, and registers again after a restart."""

    async def scenario() -> None:
        client = AsyncClient("127.0.0.1:1", tensor_transport="ipc", use_ipc_events=True)
        rig = Rig(monkeypatch, client)
        registering = await rig.build_async()
        assert tokens_of(registering) == {"tok-1", "tok-2"}
        first = await rig.build_async()
        assert first is not registering and await rig.build_async() is first
        assert (rig.ipc.memo.hits, rig.stub.registered) == (1, 2)
        rig.stub.forget_next = True  # the server restarted
        retried = await rig.build_async()
        assert rig.stub.sent[-2] is first and tokens_of(retried) == {"tok-3", "tok-4"}
        await client.close()
        assert sorted(rig.stub.unregistered) == ["tok-3", "tok-4"]

    asyncio.run(scenario())


def test_per_request_budgets_and_inline_tensors_are_never_memoized(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    budgets = torch.tensor([4, 3])
    for _ in range(2):
        rig.client.build_tree(rig.logits, rig.roots, budgets, max_budget=4, out=rig.out)
    assert len(rig.ipc.memo) == 0
    assert rig.stub.sent[0] is not rig.stub.sent[1]
    # "auto" sends a CPU tensor inline: its bytes, not its address, are in the request.
    monkeypatch.setattr(rig.ipc, "transport", "auto")
    rig.out = Tree(**{n: getattr(rig.out, n) for n in TREE_NAMES}, draft_len=3)
    cpu_roots = torch.tensor([1, 2])
    for value in (1, 2):
        cpu_roots.fill_(value)
        rig.client.build_tree(rig.logits, cpu_roots, 4, out=rig.out)
    assert len(rig.ipc.memo) == 0 and rig.ipc.memo.hits == 0
    sent = rig.stub.sent[-1].root_tokens
    assert sent.WhichOneof("data") == "inline"
    assert torch.frombuffer(bytearray(sent.inline), dtype=torch.int64).tolist() == [2, 2]


def test_memo_keeps_the_most_recent_requests_and_probes_each_allocation() -> None:
    driver = FakeDriver()
    made = driver.malloc(0x200000, 0x200000)
    registry = MemoryRegistry("me")
    registry.add(made, "tok")
    memo = RequestMemo(registry, max_entries=2, buffer_id=driver.buffer_id)
    refs = RequestRefs(registry, "ipc", "GPU-a", fake_cache(driver))
    refs.add([("q", FakeCudaTensor(64, made.base_pointer + 64))])
    assert refs.probes == ((made.base_pointer + 64, 0, made.buffer_id),)
    for key in ("a", "b"):
        memo.put(key, key, refs, True, registry.generation)
    assert memo.get("a") is not None  # "a" is now the most recent
    memo.put("c", "c", refs, True, registry.generation)
    assert memo.get("b") is None and memo.get("a") is not None and len(memo) == 2
    driver.free(made)  # the probe's address is no device memory any more
    calls = driver.buffer_id_calls

    def gone(pointer: int, device_index: int, field: str) -> int:
        raise ExportError("memo: cuPointerGetAttribute(BUFFER_ID) failed")

    unmapped = RequestMemo(registry, buffer_id=gone)
    unmapped.put("a", "a", refs, True, registry.generation)
    assert unmapped.get("a") is None and len(unmapped) == 0
    assert driver.buffer_id_calls == calls
    memo.clear()
    assert len(memo) == 0


def test_a_memoized_call_with_other_destinations_is_still_checked(rig: Rig) -> None:
    rig.build()
    rig.build()
    good = rig.out
    pointer = good.tokens.data_ptr()
    wrong_dtype = dataclasses.replace(good, tokens=fake_tensor((2, 5), torch.int32, pointer))
    with pytest.raises(InvalidArgumentError) as raised:
        rig.client.build_tree(rig.logits, rig.roots, 4, out=wrong_dtype)
    assert raised.value.field == "build_tree.out.tokens"
    # Same tensors, another draft_len: the key holds it, so the check runs again.
    with pytest.raises(InvalidArgumentError) as raised:
        rig.client.build_tree(rig.logits, rig.roots, 4, out=dataclasses.replace(good, draft_len=4))
    assert raised.value.field == "build_tree.out.draft_len"
    assert rig.build() is rig.stub.sent[1] and rig.ipc.memo.hits == 1


class AsyncStub:
    """``FakeStub``'s methods, awaitable."""

    def __init__(self, stub: FakeStub) -> None:
        self._stub = stub

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)

        async def call(request: Any, timeout: float) -> Any:
            return method(request, timeout)

        return call


def test_async_client_reuses_its_request(rig: Rig) -> None:
    async def run() -> None:
        async with AsyncClient("127.0.0.1:1", tensor_transport="ipc") as client:
            client._ipc = rig.ipc
            client._stub = AsyncStub(rig.stub)  # type: ignore[assignment]
            for _ in range(4):
                tree = await client.build_tree(rig.logits, rig.roots, 4, out=rig.out)
                assert tree is rig.out

    asyncio.run(run())
    assert rig.ipc.memo.hits == 2 and rig.ordered == 4
    assert rig.stub.sent[1] is rig.stub.sent[2] is rig.stub.sent[3]
    assert rig.stub.sent[0] is not rig.stub.sent[1]
