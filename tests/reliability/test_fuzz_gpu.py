"""The hostile-input fuzzer of ``test_fuzz.py`` against ``ddtree serve`` on a GPU.

The same tests and cases (>= 10,000), loaded as a second copy of ``test_fuzz`` with
``SERVER_DEVICE = "cuda"``, against a real server process on ``cuda:0`` (CUDA kernels): inline
tensors are copied to the GPU; references go through real CUDA IPC into this process's CUDA
memory (a zeroed 2 MiB region for inputs, a 2 KiB one for BuildTree outputs, whose bytes are
read back after every call); registrations of random handles reach the driver. Shapes are
those of the CPU run except the attention widths (head and value width 64: the CUDA kernel
takes multiples of 64). Answers that succeed are compared with the pure-torch reference's:
integers exactly, floats within the tolerances of ``test_fuzz.compare_responses`` (collected
and asserted by ``test_answers_match_the_reference``).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
import torch
from helpers.ipc import ServerProcess

from ddtree.clients.cuda import ipc_mem_handle, locate
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

pytestmark = pytest.mark.gpu


def _load_fuzz() -> ModuleType:
    path = Path(__file__).with_name("test_fuzz.py")
    spec = importlib.util.spec_from_file_location("ddtree_fuzz_on_gpu", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.SERVER_DEVICE = "cuda"
    module.HEAD_DIM = 64
    module.V_DIM = 64
    module.REGION_BYTES = 1 << 21
    return module


fuzz = _load_fuzz()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path_factory.mktemp("fuzz-gpu") / "ddtree.sock",
        "--max-batch-size",
        str(fuzz.MAX_BATCH_SIZE),
        "--max-tensor-bytes",
        str(fuzz.MAX_TENSOR_BYTES),
        "--max-message-bytes",
        str(fuzz.MAX_MESSAGE_BYTES),
        "--log-level",
        "INFO",  # wait_serving waits for the INFO line event=serving
    )
    try:
        yield process.wait_serving()
    finally:
        process.stop()
        assert process.process.returncode == 0, process.log.text()[-3000:]


@pytest.fixture(scope="module")
def served(server: ServerProcess) -> Iterator[Any]:
    channel = grpc.insecure_channel(
        server.address,
        options=[
            ("grpc.max_send_message_length", 4 * fuzz.MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", 4 * fuzz.MAX_MESSAGE_BYTES),
        ],
    )
    stub = pb_grpc.TreeSpeculationServiceStub(channel)
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=fuzz.CALL_TIMEOUT_S)
    assert info.supports_memory_references
    fuzz.SERVER_UUID = info.devices[0].uuid
    try:
        yield fuzz.Served(server, channel, stub)  # type: ignore[arg-type]
    finally:
        channel.close()


@pytest.fixture(scope="module")
def served_refs(served: Any) -> Any:
    """The same GPU server: it maps references through CUDA IPC."""
    return served


@pytest.fixture(scope="module")
def inputs(served: Any) -> Any:
    return fuzz.golden_inputs(served)


def _register(served: Any, buffer: torch.Tensor, client_id: str) -> str:
    """Register ``buffer`` (at the start of its own allocation) with the server."""
    allocation, offset = locate(buffer)
    assert offset == 0, f"{client_id}: buffer at offset {offset} of its allocation"
    response = served.stub.RegisterMemory(
        pb.RegisterMemoryRequest(
            ipc_handle=ipc_mem_handle(allocation, buffer.device.index or 0),
            device_uuid=allocation.device_uuid,
            byte_size=buffer.numel(),
            client_id=client_id,
        ),
        timeout=fuzz.CALL_TIMEOUT_S,
    )
    return str(response.region_token)


_buffers: list[torch.Tensor] = []
"""CUDA buffers the server has mapped: kept alive for the module."""


@pytest.fixture(scope="module")
def region(served_refs: Any) -> Any:
    """A zeroed region of ``REGION_BYTES`` in this process's GPU memory, registered."""
    buffer = torch.zeros(fuzz.REGION_BYTES, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    _buffers.append(buffer)
    return fuzz.Region(_register(served_refs, buffer, "fuzz"), fuzz.REGION_BYTES)


@pytest.fixture(scope="module")
def out_region(served_refs: Any) -> tuple[str, torch.Tensor]:
    """The caller's output buffer in GPU memory (its own small-pool allocation)."""
    buffer = torch.zeros(fuzz.OUT_REGION_BYTES, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    _buffers.append(buffer)
    return _register(served_refs, buffer, "fuzz-out"), buffer


# The tests of test_fuzz.py, in its order (registration fuzz before any region exists).
test_build_tree_fuzz = fuzz.test_build_tree_fuzz
test_accept_tree_fuzz = fuzz.test_accept_tree_fuzz
test_verify_attention_fuzz = fuzz.test_verify_attention_fuzz
test_memory_rpcs_fuzz = fuzz.test_memory_rpcs_fuzz
test_references_fuzz = fuzz.test_references_fuzz
test_output_references_written_only_on_success = fuzz.test_output_references_written_only_on_success
test_raw_bytes_fuzz = fuzz.test_raw_bytes_fuzz
test_messages_at_and_past_the_size_limit = fuzz.test_messages_at_and_past_the_size_limit
test_cases_total = fuzz.test_cases_total


def test_answers_match_the_reference() -> None:
    """Every successful answer of the CUDA server equalled the reference's (integers exactly,
    floats within tolerance, NaN and infinities in the same places)."""
    if len(fuzz.cases_run) < len(fuzz.EXAMPLES):
        pytest.skip(f"runs after every fuzz test (ran: {sorted(fuzz.cases_run)})")
    assert not fuzz.numeric_mismatches, fuzz.numeric_mismatches[:20]
