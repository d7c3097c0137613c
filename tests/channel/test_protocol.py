"""The doorbell channel protocol without a GPU: layout, descriptor bytes, validation, wire errors.

The layout constants of ``ddtree.kernels.channel`` are compared with the ``#define`` lines of
``channel.cu`` (the device side), the descriptor bytes with hand-computed offsets (what a C++
caller would write), and ``validate_descriptor`` with one case per verdict. The GPU tests compare
the device's verdicts with ``validate_descriptor`` on random descriptors.
"""

from __future__ import annotations

import math
import re
import struct
import sys
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2, status_pb2
from helpers.ipc import HostMapper
from helpers.serving import ServerThread

from ddtree.kernels import channel as ch
from ddtree.kernels import jit
from ddtree.kernels.channel import (
    ChannelOp,
    ChannelShape,
    DescriptorFlag,
    Ref,
    StepDescriptor,
    StepStatus,
)
from ddtree.service import channel as channel_module
from ddtree.service.channel import (
    ChannelLimits,
    ChannelNotFound,
    ChannelRegion,
    ChannelTable,
    open_channel_args,
)
from ddtree.service.config import ServiceConfig, config_from_args
from ddtree.service.errors import (
    Internal,
    InvalidArgument,
    InvalidIpcHandle,
    InvalidReference,
    MissingField,
    ValueOutOfRange,
)
from ddtree.service.memory import RegionTable
from ddtree.service.server import channel_limits
from ddtree.v1 import tensor_pb2
from ddtree.v1 import tree_speculation_service_pb2 as pb
from ddtree.v1 import tree_speculation_service_pb2_grpc as pb_grpc

BUILD = ChannelShape(ChannelOp.BUILD_TREE, 4, 5, 16, 4099, logit_code=1)
ACCEPT_TOKENS = ChannelShape(ChannelOp.ACCEPT, 4, 5, 16, 0)
ACCEPT_KV = ChannelShape(
    ChannelOp.ACCEPT, 4, 5, 16, 0, kv_row_bytes=1152, num_pages=32, page_size=16, max_pages=8
)
REGION = (1 << 20, 1 << 24)  # (base address, byte size) of a 16 MiB region


def _cu_defines() -> dict[str, int]:
    source = jit.load_source("channel.cu")
    found = {}
    for name, value in re.findall(r"^#define (DDTREE_\w+) (\d+)\b", source, re.MULTILINE):
        found[name] = int(value)
    return found


def test_layout_matches_channel_cu() -> None:
    defines = _cu_defines()
    assert defines["DDTREE_CH_DOORBELL"] == ch.DOORBELL_OFFSET
    assert defines["DDTREE_CH_COMPLETION"] == ch.COMPLETION_OFFSET
    assert defines["DDTREE_CH_DONE"] == ch.DONE_OFFSET
    assert defines["DDTREE_CH_STATE"] == ch.STATE_OFFSET
    assert defines["DDTREE_CH_LAST_STATUS"] == ch.LAST_STATUS_OFFSET
    assert defines["DDTREE_CH_RECORDS"] == ch.RECORDS_OFFSET
    assert defines["DDTREE_CH_DESC_BYTES"] == ch.DESCRIPTOR_BYTES
    assert defines["DDTREE_CH_REFS"] == ch.NUM_REFS
    for status in StepStatus:
        assert defines[f"DDTREE_ST_{status.name}"] == status, status.name
    assert defines["DDTREE_DF_BUDGETS"] == DescriptorFlag.BUDGETS
    assert defines["DDTREE_DF_ERROR_FLAGS"] == DescriptorFlag.ERROR_FLAGS
    assert defines["DDTREE_DF_KV_COMMIT"] == DescriptorFlag.KV_COMMIT
    assert defines["DDTREE_DF_CLEAR_FLAGS"] == DescriptorFlag.CLEAR_ERROR_FLAGS
    for i, name in enumerate(ch.BUILD_REFS):
        key = "DDTREE_B_" + {
            "draft_logits": "LOGITS",
            "root_tokens": "ROOTS",
            "error_flags": "FLAGS",
        }.get(name, name.upper())
        assert defines[key] == i, name
    for i, name in enumerate(ch.ACCEPT_REFS):
        key = "DDTREE_A_" + {"tree_tokens": "TOKENS", "error_flags": "FLAGS"}.get(
            name, name.upper()
        )
        assert defines[key] == i, name


@pytest.mark.parametrize("ring_size", [1, 2, 12, 13, 64])
def test_control_block_size(ring_size: int) -> None:
    ring = ch.ring_offset(ring_size)
    assert ring % 256 == 0
    assert ring >= ch.RECORDS_OFFSET + 16 * ring_size
    assert ring - 256 < ch.RECORDS_OFFSET + 16 * ring_size
    assert ch.control_block_bytes(ring_size) == ring + 256 * ring_size


@pytest.mark.parametrize("ring_size", [0, 65])
def test_control_block_refuses_ring_sizes(ring_size: int) -> None:
    with pytest.raises(ValueError, match="ring_size"):
        ch.control_block_bytes(ring_size)


def test_descriptor_bytes_at_documented_offsets() -> None:
    desc = StepDescriptor(
        op=ChannelOp.BUILD_TREE,
        batch_size=3,
        flags=DescriptorFlag.ERROR_FLAGS | DescriptorFlag.BUDGETS,
        budget=17,
        temperature=0.75,
        seed=-5,
        refs={"draft_logits": Ref(2, 4096), "error_flags": Ref(1, 1 << 40)},
    )
    data = ch.pack_descriptor(desc)
    assert len(data) == 256
    assert struct.unpack_from("<I", data, 0)[0] == 1
    assert struct.unpack_from("<I", data, 4)[0] == 3
    assert struct.unpack_from("<I", data, 8)[0] == 3
    assert struct.unpack_from("<I", data, 12)[0] == 17
    assert struct.unpack_from("<f", data, 16)[0] == 0.75
    assert struct.unpack_from("<q", data, 24)[0] == -5
    assert struct.unpack_from("<IIQ", data, 32) == (2, 0, 4096)  # slot 0: draft_logits
    assert struct.unpack_from("<IIQ", data, 32 + 16 * 9) == (1, 0, 1 << 40)  # slot 9
    assert data[32 + 16 * 10 :] == bytes(256 - 32 - 160)  # unused slots are zero
    back = ch.unpack_descriptor(data)
    assert (back.op, back.batch_size, back.flags, back.budget, back.seed) == (1, 3, 3, 17, -5)
    assert back.refs is not None and back.refs["draft_logits"] == Ref(2, 4096)
    assert back.refs["root_tokens"] == Ref(0, 0)


def test_wrong_ops_keep_their_slots_layout() -> None:
    """A descriptor with a wrong op (which the service must refuse) still packs its slots where
    the op they belong to has them: the GPU test posts such descriptors."""
    refs = {"root_tokens": Ref(3, 64), "parents": Ref(1, 128)}
    build = ch.pack_descriptor(StepDescriptor(1, 1, refs=refs))
    for op in (ChannelOp.ACCEPT, 0, 7, 2**32 - 1):
        data = ch.pack_descriptor(StepDescriptor(op, 1, refs=refs))
        assert struct.unpack_from("<I", data, 0)[0] == op
        assert data[4:] == build[4:]  # slot 1 root_tokens, slot 4 parents: the build layout
    accept = {"target": Ref(2, 8)}
    data = ch.pack_descriptor(StepDescriptor(ChannelOp.BUILD_TREE, 1, refs=accept))
    assert struct.unpack_from("<IIQ", data, 32 + 16 * 4) == (2, 0, 8)  # accept's slot 4


def test_descriptor_refuses_unknown_slots_and_wide_fields() -> None:
    with pytest.raises(ValueError, match="unknown slots"):
        ch.pack_descriptor(StepDescriptor(1, 1, refs={"nonsense": Ref(0, 0)}))
    with pytest.raises(ValueError, match="unknown slots"):
        ch.pack_descriptor(StepDescriptor(1, 1, refs={"target": Ref(0, 0), "mask": Ref(0, 0)}))
    with pytest.raises(ValueError, match="does not fit"):
        ch.pack_descriptor(StepDescriptor(1, 1 << 32))


def _build_refs(batch: int, shape: ChannelShape = BUILD) -> dict[str, Ref]:
    """Every build slot, packed one after another in region 0 (16-byte aligned)."""
    refs, offset = {}, 0
    for slot, name in enumerate(ch.BUILD_REFS):
        need, _ = ch.ref_requirement(shape, slot, batch, 0xFF)
        refs[name] = Ref(0, offset)
        offset += -(-need // 256) * 256
    return refs


def _good_build(batch: int = 3, **changes: object) -> StepDescriptor:
    fields: dict[str, object] = {
        "op": ChannelOp.BUILD_TREE,
        "batch_size": batch,
        "flags": DescriptorFlag.ERROR_FLAGS,
        "budget": 16,
        "temperature": 1.0,
        "refs": _build_refs(batch),
    }
    fields.update(changes)
    return StepDescriptor(**fields)  # type: ignore[arg-type]


def test_good_descriptor_is_ok() -> None:
    assert ch.validate_descriptor(BUILD, _good_build(), [REGION]) == (StepStatus.OK, 0)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"op": 2}, (StepStatus.BAD_OP, 0)),
        ({"op": 0}, (StepStatus.BAD_OP, 0)),
        ({"op": 7}, (StepStatus.BAD_OP, 0)),
        ({"batch_size": 0}, (StepStatus.BAD_BATCH, 0)),
        ({"batch_size": 5}, (StepStatus.BAD_BATCH, 0)),
        ({"flags": DescriptorFlag.KV_COMMIT}, (StepStatus.BAD_FLAGS, 0)),
        ({"flags": DescriptorFlag.CLEAR_ERROR_FLAGS}, (StepStatus.BAD_FLAGS, 0)),
        ({"flags": 64}, (StepStatus.BAD_FLAGS, 0)),
        ({"budget": 0}, (StepStatus.BAD_BUDGET, 0)),
        ({"budget": 17}, (StepStatus.BAD_BUDGET, 0)),
        ({"temperature": 0.0}, (StepStatus.BAD_TEMPERATURE, 0)),
        ({"temperature": -1.0}, (StepStatus.BAD_TEMPERATURE, 0)),
        ({"temperature": math.nan}, (StepStatus.BAD_TEMPERATURE, 0)),
        ({"temperature": math.inf}, (StepStatus.BAD_TEMPERATURE, 0)),
        ({"temperature": 1e39}, (StepStatus.BAD_TEMPERATURE, 0)),  # inf in fp32
    ],
    ids=lambda v: repr(v),
)
def test_header_verdicts(changes: dict[str, object], expected: tuple[StepStatus, int]) -> None:
    assert ch.validate_descriptor(BUILD, _good_build(**changes), [REGION]) == expected


def test_reference_verdicts_name_the_slot() -> None:
    refs = _build_refs(3)
    logits_slot = ch.BUILD_REFS.index("draft_logits")
    roots_slot = ch.BUILD_REFS.index("root_tokens")
    mask_slot = ch.BUILD_REFS.index("mask")
    cases = [
        ({"root_tokens": Ref(1, 0)}, (StepStatus.BAD_REGION, roots_slot)),
        ({"root_tokens": Ref(0, 4)}, (StepStatus.MISALIGNED, roots_slot)),
        ({"draft_logits": Ref(0, 1)}, (StepStatus.MISALIGNED, logits_slot)),
        ({"mask": Ref(0, REGION[1] - 8)}, (StepStatus.OUT_OF_BOUNDS, mask_slot)),
        ({"mask": Ref(0, REGION[1] + 256)}, (StepStatus.OUT_OF_BOUNDS, mask_slot)),
        ({"mask": Ref(0, (1 << 64) - 256)}, (StepStatus.OUT_OF_BOUNDS, mask_slot)),  # overflow
    ]
    for change, expected in cases:
        desc = _good_build(refs={**refs, **change})
        assert ch.validate_descriptor(BUILD, desc, [REGION]) == expected, change


def test_vectorized_logits_need_16_bytes() -> None:
    aligned = ChannelShape(ChannelOp.BUILD_TREE, 4, 5, 16, 4096, logit_code=1)
    refs = _build_refs(3, aligned)
    good = _good_build(refs=refs)
    assert ch.validate_descriptor(aligned, good, [REGION])[0] == StepStatus.OK
    bad = _good_build(refs={**refs, "draft_logits": Ref(0, 8)})
    assert ch.validate_descriptor(aligned, bad, [REGION]) == (StepStatus.MISALIGNED, 0)


def test_unused_slots_are_not_checked() -> None:
    # Without BUDGETS the budgets slot may hold anything; with it, it is checked.
    refs = {**_build_refs(3), "budgets": Ref(9, 3)}
    assert ch.validate_descriptor(BUILD, _good_build(refs=refs), [REGION])[0] == StepStatus.OK
    desc = _good_build(refs=refs, flags=DescriptorFlag.BUDGETS)
    assert ch.validate_descriptor(BUILD, desc, [REGION]) == (StepStatus.BAD_REGION, 2)


def test_per_request_budgets_are_checked() -> None:
    desc = _good_build(flags=DescriptorFlag.BUDGETS)
    assert ch.validate_descriptor(BUILD, desc, [REGION], [1, 16, 5])[0] == StepStatus.OK
    assert ch.validate_descriptor(BUILD, desc, [REGION], [1, 17, 5]) == (StepStatus.BAD_BUDGET, 2)
    assert ch.validate_descriptor(BUILD, desc, [REGION], [0, 1, 1]) == (StepStatus.BAD_BUDGET, 2)
    # Only the first batch_size values count.
    assert ch.validate_descriptor(BUILD, desc, [REGION], [1, 2, 3, 99])[0] == StepStatus.OK


def test_accept_verdicts() -> None:
    refs = {name: Ref(0, 256 * i) for i, name in enumerate(ch.ACCEPT_REFS)}
    good = StepDescriptor(ChannelOp.ACCEPT, 2, DescriptorFlag.ERROR_FLAGS, refs=refs)
    assert ch.validate_descriptor(ACCEPT_TOKENS, good, [REGION])[0] == StepStatus.OK
    sampled = StepDescriptor(ChannelOp.ACCEPT, 2, 0, temperature=0.5, refs=refs)
    # Target tokens need temperature 0.
    assert ch.validate_descriptor(ACCEPT_TOKENS, sampled, [REGION])[0] == StepStatus.BAD_TEMPERATURE
    kv = StepDescriptor(ChannelOp.ACCEPT, 2, DescriptorFlag.KV_COMMIT, refs=refs)
    assert ch.validate_descriptor(ACCEPT_TOKENS, kv, [REGION])[0] == StepStatus.BAD_FLAGS
    assert ch.validate_descriptor(ACCEPT_KV, kv, [REGION])[0] == StepStatus.OK
    # The cache needs num_pages * page_size * row bytes from its offset.
    small = (1 << 20, 256 * 10 + 32 * 16 * 1152 - 1)
    assert ch.validate_descriptor(ACCEPT_KV, kv, [small]) == (StepStatus.OUT_OF_BOUNDS, 10)


def test_requirements_follow_the_shapes() -> None:
    # build: logits (b, L, V) bf16; mask (b, N, words) int64 with N = 17 -> 1 word.
    assert ch.ref_requirement(BUILD, 0, 3, 0) == (3 * 5 * 4099 * 2, 2)  # 4099 % 8: 2-byte loads
    aligned = ChannelShape(ChannelOp.BUILD_TREE, 4, 5, 16, 4096, logit_code=1)
    assert ch.ref_requirement(aligned, 0, 3, 0) == (3 * 5 * 4096 * 2, 16)
    assert ch.ref_requirement(BUILD, 8, 3, 0) == (3 * 17 * 1 * 8, 8)
    assert ch.ref_requirement(BUILD, 2, 3, 0) == (0, 1)
    assert ch.ref_requirement(ACCEPT_TOKENS, 4, 2, 0) == (2 * 17 * 8, 8)
    logits = ChannelShape(ChannelOp.ACCEPT, 4, 5, 16, 1000, logit_code=0)
    assert ch.ref_requirement(logits, 4, 2, 0) == (2 * 17 * 1000 * 4, 4)
    assert ch.ref_requirement(ACCEPT_TOKENS, 6, 2, 0) == (2 * 6 * 8, 8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"draft_len": 33}, "draft_len"),
        ({"max_budget": 1025}, "max_budget"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"logit_code": 3}, "logits_dtype"),
        ({"kv_row_bytes": 16, "num_pages": 1, "page_size": 1, "max_pages": 1}, "accept channel"),
    ],
)
def test_shape_refusals(kwargs: dict[str, int], match: str) -> None:
    fields = {"max_batch_size": 4, "draft_len": 5, "max_budget": 16, "vocab_size": 10}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=match):
        ChannelShape(ChannelOp.BUILD_TREE, **fields)


def _open_request(**changes: object) -> pb.OpenChannelRequest:
    request = pb.OpenChannelRequest(
        op=pb.CHANNEL_OP_BUILD_TREE,
        control=pb.ChannelRegion(
            region_token="t", offset_bytes=0, byte_size=1024, ipc_handle=bytes(64)
        ),
        ring_size=2,
        regions=[
            pb.ChannelRegion(
                region_token="t", offset_bytes=0, byte_size=1 << 20, ipc_handle=bytes(64)
            )
        ],
        max_batch_size=4,
        draft_len=5,
        max_budget=16,
        vocab_size=4099,
        logits_dtype=tensor_pb2.DTYPE_BFLOAT16,
    )
    for name, value in changes.items():
        setattr(request, name, value)
    return request


def test_open_request_decodes() -> None:
    args = open_channel_args(_open_request(), max_batch_size=64)
    assert args.shape == BUILD
    assert args.ring_size == 2
    assert args.regions[0].byte_size == 1 << 20
    fp32 = open_channel_args(_open_request(logits_dtype=tensor_pb2.DTYPE_FLOAT32), 64)
    assert fp32.shape.logit_code == 0 and fp32.shape.logit_bytes == 4


@pytest.mark.parametrize(
    ("changes", "error", "field"),
    [
        ({"op": pb.CHANNEL_OP_UNSPECIFIED}, MissingField, "open_channel.op"),
        ({"max_batch_size": 65}, ValueOutOfRange, "open_channel.max_batch_size"),
        ({"draft_len": 0}, ValueOutOfRange, "open_channel.draft_len"),
        (
            {"logits_dtype": tensor_pb2.DTYPE_UNSPECIFIED},
            ValueOutOfRange,
            "open_channel.logits_dtype",
        ),
    ],
)
def test_open_request_refusals(changes: dict[str, object], error: type, field: str) -> None:
    with pytest.raises(error) as caught:
        open_channel_args(_open_request(**changes), max_batch_size=64)
    assert caught.value.field == field


def test_open_request_needs_ipc_handles() -> None:
    request = _open_request()
    request.regions[0].ipc_handle = bytes(63)
    with pytest.raises(InvalidIpcHandle) as caught:
        open_channel_args(request, max_batch_size=64)
    assert caught.value.field == "open_channel.regions[0].ipc_handle"


def _reason(err: grpc.RpcError) -> str:
    for key, value in err.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info.reason
    return ""


def test_cpu_server_refuses_channels(tmp_path: Path) -> None:
    config = ServiceConfig(listen=(f"unix:{tmp_path / 's.sock'}",), device="cpu")
    with ServerThread(config) as server, grpc.insecure_channel(server.addresses[0]) as rpc:
        stub = pb_grpc.TreeSpeculationServiceStub(rpc)
        with pytest.raises(grpc.RpcError) as caught:
            stub.OpenChannel(_open_request(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        assert _reason(caught.value) == "CHANNELS_UNSUPPORTED"
        with pytest.raises(grpc.RpcError) as watched:
            list(stub.WatchChannel(pb.WatchChannelRequest(channel_token="x"), timeout=10))
        assert watched.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]


def test_max_channels_reaches_the_engine_limits() -> None:
    """``--max-channels`` / DDTREE_MAX_CHANNELS set the channel table's bound (0: none), with
    the registered-memory idle expiry."""
    config = config_from_args(["--max-channels", "3", "--memory-idle-timeout-s", "42"], {})
    assert channel_limits(config) == ChannelLimits(max_channels=3, idle_timeout_s=42.0)
    assert config_from_args([], {"DDTREE_MAX_CHANNELS": "0"}).max_channels == 0
    assert config_from_args([], {}).max_channels == ChannelLimits().max_channels


class _Observer:
    def observe_trees(self, num_nodes: torch.Tensor, *, model: str = "") -> None:
        raise AssertionError("no step runs in this test")

    def observe_acceptance(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("no step runs in this test")


def test_open_leases_regions_and_releases_them_when_the_worker_fails() -> None:
    """ChannelTable.open checks every window against its region (capability, bounds), starts
    the channel's worker process and, when that worker fails (here: no CUDA device), answers
    INTERNAL with the worker's error and releases the leases (the region can be unregistered
    and its mapping closes at once)."""
    mapper = HostMapper()
    table = RegionTable(device=torch.device("cpu"), device_uuid="GPU-x", mapper=mapper)
    handle = mapper.export(torch.zeros(1 << 16, dtype=torch.uint8))
    token, _ = table.register(handle, "GPU-x", 1 << 16, "c")
    channels = ChannelTable(table, ChannelLimits(start_timeout_s=60.0), _Observer())
    try:
        control = ChannelRegion(token, 0, ch.control_block_bytes(2), bytes(64))
        outside = ChannelRegion(token, 1 << 15, 1 << 16, bytes(64))
        with pytest.raises(InvalidReference):
            channels.open(BUILD, control, 2, [outside])
        with pytest.raises(InvalidArgument, match="ring_size"):
            channels.open(BUILD, control, 8, [])
        with pytest.raises(Internal, match="worker failed"):
            channels.open(BUILD, control, 2, [ChannelRegion(token, 0, 1 << 16, bytes(64))])
        assert len(channels) == 0
        table.unregister(token)
        assert mapper.mapped == 0  # no lease was left behind
    finally:
        channels.close_all()
        table.close()


_FAKE_WORKER = """
import json, sys
spec = json.loads(sys.stdin.readline())
assert spec["shape"]["op"] == 1 and spec["depth"] == 8, spec
assert len(bytes.fromhex(spec["regions"][0]["ipc_handle"])) == 64
print(json.dumps({"ready": True}), flush=True)
print(json.dumps({"s": 1, "st": 0, "b": 2, "op": 1, "v": [5, 7, 0, 0]}), flush=True)
print(json.dumps({"s": 2, "st": 8, "b": 0, "op": 1, "v": [0, 0, 0, 0]}), flush=True)
line = sys.stdin.readline()
print(json.dumps({"closed": line.split(" ", 1)[1].strip() if line else "server_gone"}), flush=True)
"""


class _Trees:
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def observe_trees(self, num_nodes: torch.Tensor, *, model: str = "") -> None:
        assert model == "m"
        self.seen.append(num_nodes.tolist())

    def observe_acceptance(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a build channel walks nothing")


@pytest.mark.parametrize("how", ["close_channel", "caller_gone"])
def test_channel_process_plumbing(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """With a stand-in worker: the spec reaches it, finished steps feed the observer (failed
    ones do not), CloseChannel or the last watcher leaving closes it with that reason, and the
    leases are released."""
    monkeypatch.setattr(channel_module, "WORKER_COMMAND", (sys.executable, "-c", _FAKE_WORKER))
    mapper = HostMapper()
    table = RegionTable(device=torch.device("cpu"), device_uuid="GPU-x", mapper=mapper)
    handle = mapper.export(torch.zeros(4096, dtype=torch.uint8))
    token, _ = table.register(handle, "GPU-x", 4096, "c", owner="o")
    observer = _Trees()
    channels = ChannelTable(table, ChannelLimits(), observer)
    try:
        window = ChannelRegion(token, 0, 4096, bytes(range(64)))
        opened = channels.open(BUILD, window, 2, [window], owner="o", model="m")
        with pytest.raises(ChannelNotFound):
            channels.close(opened, owner="someone else")
        closed = channels.watch(opened, owner="o")
        if how == "close_channel":
            assert channels.close(opened, owner="o") == 2
        else:
            channels.unwatch(opened)
        assert closed.result(30) == how
        assert observer.seen == [[5, 7]]
        assert len(channels) == 0
        table.unregister(token, "o")
        assert mapper.mapped == 0
    finally:
        channels.close_all()
        table.close()
