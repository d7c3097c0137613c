"""Client-side CUDA IPC logic that needs no GPU: the import gate, refusals, the registry."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.service_inputs import BUDGET, make_step
from helpers.serving import ServerThread

from ddtree.clients import AsyncClient, Client
from ddtree.clients.cuda import (
    Allocation,
    AllocationCache,
    ClientIpc,
    ExportError,
    MemoryRegistry,
    RequestRefs,
    locate,
    require_cuda_python,
)
from ddtree.service.config import ServiceConfig


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
