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
