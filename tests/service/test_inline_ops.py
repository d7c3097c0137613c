"""Ops run on the caller's thread (``inline=True``) behave exactly like ops run on the worker.

``Engine.inline_ops`` is on by default only on CUDA; here it is switched on for CPU engines so
that the inline path (the servicer's choice for a call alone in flight) runs without a GPU:
same results, errors through the future, deadlines checked before the op, a busy device
falling back to the worker queue, leases of registered memory released when the call ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from helpers.gates import Gate
from helpers.ipc import HostMapper
from helpers.service_inputs import BUDGET, Step, make_step
from helpers.serving import ServerThread

from ddtree.clients import Client
from ddtree.service.calls import AcceptTreeCall, BuildTreeCall
from ddtree.service.config import ServiceConfig
from ddtree.service.convert import TORCH_TO_DTYPE
from ddtree.service.engine import Completed, Engine
from ddtree.service.errors import DeadlineExceeded, InvalidToken
from ddtree.v1 import tensor_pb2, tree_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

TREE_NAMES = ("tokens", "parents", "depths", "log_probs", "num_nodes", "mask")


@pytest.fixture
def step() -> Step:
    return make_step(seed=11)


@pytest.fixture
def recorder() -> Gate:
    return Gate(None, released=True)


@pytest.fixture
def engine(recorder: Gate) -> Iterator[Engine]:
    with Engine(device="cpu", backend="reference", observer=recorder) as made:
        made.warm_up()
        made.inline_ops = True
        yield made


def build_call(step: Step, **overrides: object) -> BuildTreeCall:
    fields: dict[str, object] = {
        "draft_logits": step.draft_logits,
        "root_tokens": step.root_tokens,
        "budget": BUDGET,
    }
    fields.update(overrides)
    return BuildTreeCall(**fields)  # type: ignore[arg-type]


def test_inline_call_runs_on_the_calling_thread_with_the_worker_result(
    engine: Engine, recorder: Gate, step: Step
) -> None:
    inline = engine.build_tree(build_call(step), inline=True)
    assert isinstance(inline, Completed) and inline.done() and inline.exception() is None
    queued = engine.build_tree(build_call(step)).result(timeout=30)
    for name in TREE_NAMES:
        assert torch.equal(getattr(inline.result(), name), getattr(queued, name)), name
        assert torch.equal(getattr(queued, name), getattr(step.tree, name)), name
    (_, inline_thread), (_, worker_thread) = recorder.launches
    assert inline_thread == threading.get_ident()
    assert worker_thread != threading.get_ident()


def test_inline_accept_matches_the_worker(engine: Engine, step: Step) -> None:
    call = AcceptTreeCall(tree=step.tree, target_tokens=step.target_tokens)
    inline = engine.accept_tree(call, inline=True)
    assert inline.done()
    queued = engine.accept_tree(call).result(timeout=30)
    for name in ("nodes", "tokens", "length", "bonus"):
        assert torch.equal(
            getattr(inline.result().acceptance, name), getattr(queued.acceptance, name)
        ), name


def test_without_inline_ops_the_worker_runs_the_call(
    engine: Engine, recorder: Gate, step: Step
) -> None:
    engine.inline_ops = False
    tree = engine.build_tree(build_call(step), inline=True).result(timeout=30)
    assert torch.equal(tree.tokens, step.tree.tokens)
    assert recorder.launches[-1][1] != threading.get_ident()


def test_inline_errors_come_through_the_future(engine: Engine, step: Step) -> None:
    roots = step.root_tokens.clone()
    roots[1] = step.draft_logits.shape[2]  # out of [0, vocab_size)
    future = engine.build_tree(build_call(step, root_tokens=roots), inline=True)
    assert isinstance(future, Completed) and future.done() and not future.cancel()
    assert isinstance(future.exception(), InvalidToken)
    with pytest.raises(InvalidToken, match=r"build_tree\.root_tokens\[1\]"):
        future.result()


def test_an_expired_deadline_is_not_run_inline(engine: Engine, recorder: Gate, step: Step) -> None:
    future = engine.build_tree(build_call(step, deadline_s=time.monotonic() - 1), inline=True)
    with pytest.raises(DeadlineExceeded):
        future.result()
    assert recorder.launches == []


def test_a_call_waiting_on_a_caller_event_goes_to_the_worker(step: Step) -> None:
    recorder = Gate(None, released=True)
    # A mapper gives the engine IPC support, so the call may carry an event handle.
    with Engine(
        device="cpu", backend="reference", observer=recorder, ipc_mapper=HostMapper()
    ) as engine:
        engine.warm_up()
        engine.inline_ops = True
        call = build_call(step, wait_event_ipc_handle=bytes(64))
        tree = engine.build_tree(call, inline=True).result(timeout=30)
    assert torch.equal(tree.tokens, step.tree.tokens)
    assert recorder.launches[-1][1] != threading.get_ident()


@pytest.mark.gpu
def test_an_owned_thread_keeps_the_engine_stream_and_others_get_theirs_back(step: Step) -> None:
    """An inline op on a thread the engine owns (``own_thread``: the server's event loop) leaves
    the engine's stream current; on any other thread the thread's own stream is restored."""
    errors: list[BaseException] = []

    def run(engine: Engine) -> None:
        try:
            own = torch.cuda.Stream()
            torch.cuda.set_stream(own)
            call = build_call(
                step, draft_logits=step.draft_logits.cuda(), root_tokens=step.root_tokens.cuda()
            )
            first = engine.build_tree(call, inline=True).result(timeout=60)
            assert torch.cuda.current_stream() == own
            engine.own_thread()
            assert torch.cuda.current_stream() == engine._stream
            again = engine.build_tree(call, inline=True).result(timeout=60)
            assert torch.cuda.current_stream() == engine._stream
            for name in TREE_NAMES:
                assert torch.equal(getattr(first, name), getattr(again, name)), name
            for name in ("tokens", "parents", "depths", "num_nodes", "mask"):
                assert torch.equal(getattr(again, name).cpu(), getattr(step.tree, name)), name
        except BaseException as err:  # reported on the test's thread
            errors.append(err)

    with Engine(device="cuda:0") as engine:
        engine.warm_up()
        thread = threading.Thread(target=run, args=(engine,))
        thread.start()
        thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors


def test_a_busy_device_queues_the_call_on_the_worker(
    engine: Engine, recorder: Gate, step: Step
) -> None:
    recorder.release.clear()
    first = engine.build_tree(build_call(step))
    assert recorder.entered.wait(30)
    second = engine.build_tree(build_call(step), inline=True)
    assert not second.done()  # the device is busy: queued, not run on this thread
    recorder.release.set()
    assert torch.equal(first.result(timeout=30).tokens, step.tree.tokens)
    assert torch.equal(second.result(timeout=30).tokens, step.tree.tokens)
    assert all(thread != threading.get_ident() for _, thread in recorder.launches)


@pytest.fixture
def mapper() -> HostMapper:
    return HostMapper()


@pytest.fixture
def server(tmp_path: Path, mapper: HostMapper) -> Iterator[ServerThread]:
    engine = Engine(device="cpu", backend="reference", ipc_mapper=mapper)
    engine.inline_ops = True
    thread = ServerThread(
        ServiceConfig(listen=(f"unix:{tmp_path / 'inline.sock'}",), device="cpu"), engine=engine
    )
    thread.start()
    yield thread
    thread.stop()


def test_server_inline_references_release_their_leases(
    server: ServerThread, mapper: HostMapper, step: Step
) -> None:
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    logits = step.draft_logits.to(torch.bfloat16)
    batch, nodes = step.tree.tokens.shape
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "tokens": (torch.int64, (batch, nodes)),
        "parents": (torch.int32, (batch, nodes)),
        "depths": (torch.int32, (batch, nodes)),
        "log_probs": (torch.float32, (batch, nodes)),
        "num_nodes": (torch.int32, (batch,)),
        "mask": (torch.int64, tuple(step.tree.mask.shape)),
    }
    offset = 0
    views: dict[str, tuple[int, torch.Tensor]] = {}
    for name, (dtype, shape) in {"logits": (logits.dtype, tuple(logits.shape)), **layout}.items():
        size = torch.Size(shape).numel() * dtype.itemsize
        views[name] = (offset, buffer[offset : offset + size].view(dtype).view(shape))
        offset = (offset + size + 63) // 64 * 64
    views["logits"][1].copy_(logits)
    with grpc.insecure_channel(server.addresses[0]) as channel:
        stub = pb_grpc.TreeSpeculationServiceStub(channel)
        token = stub.RegisterMemory(
            pb.RegisterMemoryRequest(
                ipc_handle=mapper.export(buffer),
                device_uuid="cpu",
                byte_size=buffer.numel(),
                client_id="inline",
            ),
            timeout=10,
        ).region_token

        def ref(name: str) -> tensor_pb2.TensorRef:
            return tensor_pb2.TensorRef(region_token=token, offset_bytes=views[name][0])

        request = pb.BuildTreeRequest(
            draft_logits=tensor_pb2.Tensor(
                dtype=TORCH_TO_DTYPE[logits.dtype], shape=list(logits.shape), ref=ref("logits")
            ),
            root_tokens=tensor_pb2.Tensor(
                dtype=tensor_pb2.DTYPE_INT64,
                shape=[batch],
                inline=step.root_tokens.numpy().tobytes(),
            ),
            budget=BUDGET,
            outputs=tree_pb2.TreeOutputRefs(**{name: ref(name) for name in layout}),
        )
        for _ in range(2):  # the second call reuses the resolved views
            response = stub.BuildTree(request, timeout=30)
            assert response.tree.tokens.WhichOneof("data") == "ref"
        expected = Client(server.addresses[0]).build_tree(logits, step.root_tokens, BUDGET)
        for name in layout:
            assert torch.equal(views[name][1], getattr(expected, name)), name
        stub.UnregisterMemory(pb.UnregisterMemoryRequest(region_token=token), timeout=10)
    assert mapper.mapped == 0  # no lease outlived its call


def test_server_inline_and_concurrent_calls_agree(server: ServerThread, step: Step) -> None:
    with Client(server.addresses[0], default_timeout_s=60.0) as client:

        def build(_: int) -> torch.Tensor:
            return client.build_tree(step.draft_logits, step.root_tokens, BUDGET).tokens

        alone = build(0)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(build, range(24)))
    assert torch.equal(alone, step.tree.tokens)
    assert all(torch.equal(tokens, step.tree.tokens) for tokens in results)


def test_server_inline_errors_keep_their_status(server: ServerThread, step: Step) -> None:
    roots = step.root_tokens.clone()
    roots[0] = -1
    with grpc.insecure_channel(server.addresses[0]) as channel:
        stub = pb_grpc.TreeSpeculationServiceStub(channel)
        logits = step.draft_logits
        request = pb.BuildTreeRequest(
            draft_logits=tensor_pb2.Tensor(
                dtype=tensor_pb2.DTYPE_FLOAT32,
                shape=list(logits.shape),
                inline=logits.numpy().tobytes(),
            ),
            root_tokens=tensor_pb2.Tensor(
                dtype=tensor_pb2.DTYPE_INT64,
                shape=list(roots.shape),
                inline=roots.numpy().tobytes(),
            ),
            budget=BUDGET,
        )
        with pytest.raises(grpc.RpcError) as raised:
            stub.BuildTree(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "build_tree.root_tokens[0]" in raised.value.details()  # type: ignore[attr-defined]
