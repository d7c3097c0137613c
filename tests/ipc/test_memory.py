"""Registered memory without a GPU: reference arithmetic, tokens, limits, leases and expiry.

The region table runs over ``HostMapper`` (host buffers standing in for IPC mappings), so every
rule of ``ddtree.service.memory`` is checked here on CPU CI; the GPU tests repeat the important
ones through real CUDA IPC between two processes.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers.ipc import HostMapper

from ddtree.service.errors import (
    DDTreeError,
    InvalidArgument,
    MemoryTokenNotFound,
)
from ddtree.service.memory import (
    TOKEN_BYTES,
    EventWaiter,
    MemoryLimits,
    RegionTable,
    check_reference,
)

UUID = "GPU-test-0000"


class FakeClock:
    """Monotonic seconds that only move when the test says so."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_table(
    mapper: HostMapper, clock: FakeClock | None = None, **limits: float
) -> tuple[RegionTable, list[tuple[int, int]]]:
    changes: list[tuple[int, int]] = []
    table = RegionTable(
        device=torch.device("cpu"),
        device_uuid=UUID,
        mapper=mapper,
        limits=MemoryLimits(**limits),  # type: ignore[arg-type]
        on_change=lambda regions, byte_size: changes.append((regions, byte_size)),
        clock=clock or FakeClock(),
    )
    return table, changes


def expect(error: type[DDTreeError], code: str, reason: str, call: object) -> DDTreeError:
    with pytest.raises(error) as raised:
        call()  # type: ignore[operator]
    assert (raised.value.code, raised.value.reason) == (code, reason), raised.value
    return raised.value


# ---------------------------------------------------------------------- reference arithmetic


@pytest.mark.parametrize(
    ("offset", "shape", "itemsize", "region", "expected"),
    [
        (0, (4, 8), 4, 128, 128),  # exactly fills the region
        (64, (8,), 8, 128, 64),  # ends exactly at the end
        (128, (0,), 2, 128, 0),  # empty tensor at the very end
        (6, (), 2, 8, 2),  # scalar
    ],
    ids=["fills", "ends-at-end", "empty-at-end", "scalar"],
)
def test_reference_inside_region(
    offset: int, shape: tuple[int, ...], itemsize: int, region: int, expected: int
) -> None:
    assert check_reference("t", offset, shape, itemsize, region) == expected


@pytest.mark.parametrize(
    ("offset", "shape", "itemsize", "region", "needle"),
    [
        (0, (33,), 4, 128, "past the region"),
        (8, (31,), 4, 128, "past the region"),
        (130, (0,), 2, 128, "past the region"),
        ((1 << 64) - 8, (1,), 8, 1 << 20, "past the region"),  # wraps in 64-bit arithmetic
        (0, (1 << 62, 1 << 62), 2, 1 << 20, "past the region"),  # product wraps
        (2, (4,), 4, 128, "multiple of the dtype's itemsize 4"),
        (4, (2,), 8, 128, "multiple of the dtype's itemsize 8"),
        (-8, (1,), 8, 128, "expected >= 0"),
        (0, (2, -1), 4, 128, "extents >= 0"),
    ],
    ids=[
        "one-past",
        "offset-plus-size-past",
        "empty-past-end",
        "offset-overflow",
        "size-overflow",
        "misaligned-fp32",
        "misaligned-int64",
        "negative-offset",
        "negative-extent",
    ],
)
def test_reference_rejected(
    offset: int, shape: tuple[int, ...], itemsize: int, region: int, needle: str
) -> None:
    error = expect(
        InvalidArgument,
        "INVALID_ARGUMENT",
        "INVALID_REFERENCE",
        lambda: check_reference("build_tree.draft_logits", offset, shape, itemsize, region),
    )
    assert needle in error.message
    assert error.message.startswith("build_tree.draft_logits")


# ---------------------------------------------------------------------- registration


def test_register_returns_unguessable_token_and_never_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mapper = HostMapper()
    table, changes = make_table(mapper)
    caplog.set_level(logging.DEBUG, logger="ddtree.service.memory")
    tokens = []
    for _ in range(3):
        token, info = table.register(
            mapper.export(torch.zeros(256, dtype=torch.uint8)), UUID, 256, "c1"
        )
        tokens.append(token)
        assert info.region_id in caplog.text
    assert TOKEN_BYTES * 8 >= 128
    assert all(len(t) >= math.ceil(TOKEN_BYTES * 4 / 3) for t in tokens)
    assert len(set(tokens)) == 3
    assert not any(t in caplog.text for t in tokens)
    assert changes[-1] == (3, 768)
    assert [r.byte_size for r in table.list("c1")] == [256, 256, 256]
    assert table.list("other") == []


def test_register_may_cover_part_of_the_allocation() -> None:
    mapper = HostMapper()
    table, _ = make_table(mapper)
    _, info = table.register(mapper.export(torch.zeros(512, dtype=torch.uint8)), UUID, 100, "c")
    assert info.byte_size == 100


@pytest.mark.parametrize(
    ("handle_bytes", "uuid", "byte_size", "client_id", "error", "reason", "field"),
    [
        (63, UUID, 64, "c", InvalidArgument, "INVALID_IPC_HANDLE", "register_memory.ipc_handle"),
        (65, UUID, 64, "c", InvalidArgument, "INVALID_IPC_HANDLE", "register_memory.ipc_handle"),
        (64, UUID, 0, "c", InvalidArgument, "INVALID_IPC_HANDLE", "register_memory.byte_size"),
        (64, "GPU-other", 64, "c", DDTreeError, "DEVICE_MISMATCH", "register_memory.device_uuid"),
        (64, UUID, 64, "bad id!", InvalidArgument, "INVALID_ARGUMENT", "register_memory.client_id"),
        (64, UUID, 64, "x" * 65, InvalidArgument, "INVALID_ARGUMENT", "register_memory.client_id"),
    ],
    ids=["handle-63", "handle-65", "size-0", "other-gpu", "client-id-char", "client-id-long"],
)
def test_register_rejects_without_mapping(
    handle_bytes: int,
    uuid: str,
    byte_size: int,
    client_id: str,
    error: type[DDTreeError],
    reason: str,
    field: str,
) -> None:
    mapper = HostMapper()
    table, _ = make_table(mapper)
    handle = mapper.export(torch.zeros(64, dtype=torch.uint8))[:handle_bytes].ljust(
        handle_bytes, b"\0"
    )
    with pytest.raises(error) as raised:
        table.register(handle, uuid, byte_size, client_id)
    assert raised.value.reason == reason
    assert raised.value.field == field
    assert mapper.opened == [] and table.stats() == (0, 0)


def test_register_size_larger_than_allocation_unmaps() -> None:
    mapper = HostMapper()
    table, _ = make_table(mapper)
    handle = mapper.export(torch.zeros(100, dtype=torch.uint8))
    error = expect(
        InvalidArgument,
        "INVALID_ARGUMENT",
        "INVALID_IPC_HANDLE",
        lambda: table.register(handle, UUID, 101, "c"),
    )
    assert "larger than the allocation" in error.message
    assert len(mapper.opened) == 1 and mapper.mapped == 0
    assert table.stats() == (0, 0)


def test_unopenable_handle_is_failed_precondition_and_frees_its_reservation() -> None:
    mapper = HostMapper()
    table, _ = make_table(mapper, max_regions=1)
    expect(
        DDTreeError,
        "FAILED_PRECONDITION",
        "IPC_OPEN_FAILED",
        lambda: table.register(bytes(64), UUID, 64, "c"),
    )
    table.register(mapper.export(torch.zeros(64, dtype=torch.uint8)), UUID, 64, "c")


def test_region_and_byte_limits_are_resource_exhausted() -> None:
    mapper = HostMapper()
    table, _ = make_table(mapper, max_regions=2, max_bytes=300)
    buffers = [torch.zeros(200, dtype=torch.uint8) for _ in range(3)]
    table.register(mapper.export(buffers[0]), UUID, 100, "c")
    expect(
        DDTreeError,
        "RESOURCE_EXHAUSTED",
        "MEMORY_LIMIT_EXCEEDED",
        lambda: table.register(mapper.export(buffers[1]), UUID, 201, "c"),
    )
    table.register(mapper.export(buffers[1]), UUID, 200, "c")
    error = expect(
        DDTreeError,
        "RESOURCE_EXHAUSTED",
        "MEMORY_LIMIT_EXCEEDED",
        lambda: table.register(mapper.export(buffers[2]), UUID, 1, "c"),
    )
    assert "max_registered_regions is 2" in error.message
    assert len(mapper.opened) == 2


def test_unregister_unknown_token_is_not_found() -> None:
    table, _ = make_table(HostMapper())
    for token in ("", "x" * 200, "nope"):
        expect(
            MemoryTokenNotFound,
            "NOT_FOUND",
            "MEMORY_TOKEN_NOT_FOUND",
            lambda token=token: table.unregister(token),
        )


# ---------------------------------------------------------------------- references and leases


def registered(
    size: int = 1024, **limits: float
) -> tuple[HostMapper, RegionTable, torch.Tensor, str, FakeClock]:
    mapper = HostMapper()
    clock = FakeClock()
    table, _ = make_table(mapper, clock, **limits)
    buffer = torch.zeros(size, dtype=torch.uint8)
    token, _ = table.register(mapper.export(buffer), UUID, size, "c")
    return mapper, table, buffer, token, clock


def test_resolved_reference_is_a_view_of_caller_memory() -> None:
    _, table, buffer, token, _ = registered()
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buffer[64 : 64 + 48].copy_(values.view(-1).view(torch.uint8))
    leases = table.leases()
    view = leases.resolve("verify_attention.lse", token, 64, torch.float32, (3, 4))
    assert torch.equal(view, values)
    view.mul_(2)  # a write through the view reaches the caller's bytes, no copy
    assert torch.equal(buffer[64 : 64 + 48].view(torch.float32).view(3, 4), values * 2)
    empty = leases.resolve("x", token, 1024, torch.int64, (0, 5))
    assert empty.shape == (0, 5)
    leases.release()


@pytest.mark.parametrize(
    ("offset", "dtype", "shape", "needle"),
    [
        (1024, torch.int64, (1,), "past the region"),
        (2, torch.float32, (2,), "itemsize 4"),
        (0, torch.bfloat16, (1 << 40, 1 << 40), "past the region"),
    ],
    ids=["out-of-bounds", "misaligned", "overflowing"],
)
def test_bad_reference_names_the_field_and_releases(
    offset: int, dtype: torch.dtype, shape: tuple[int, ...], needle: str
) -> None:
    mapper, table, _, token, _ = registered()
    leases = table.leases()
    error = expect(
        InvalidArgument,
        "INVALID_ARGUMENT",
        "INVALID_REFERENCE",
        lambda: leases.resolve("build_tree.draft_logits", token, offset, dtype, shape),
    )
    assert needle in error.message and error.field == "build_tree.draft_logits.ref"
    leases.release()
    table.unregister(token)
    assert mapper.mapped == 0  # the failed call held no lease past its release


def test_unknown_token_in_reference_is_not_found() -> None:
    _, table, _, _, _ = registered()
    other_mapper, other_table, _, other_token, _ = registered()
    error = expect(
        MemoryTokenNotFound,
        "NOT_FOUND",
        "MEMORY_TOKEN_NOT_FOUND",
        lambda: table.leases().resolve("q", other_token, 0, torch.uint8, (1,)),
    )
    assert error.field == "q.ref.region_token"
    assert other_token not in error.message


def test_unregister_during_call_defers_close_until_release() -> None:
    mapper, table, _, token, _ = registered()
    first, second = table.leases(), table.leases()
    first.resolve("a", token, 0, torch.int32, (4,))
    first.resolve("b", token, 16, torch.int32, (4,))
    second.resolve("c", token, 0, torch.int32, (4,))
    table.unregister(token)
    assert table.stats() == (0, 0) and mapper.mapped == 1
    expect(
        MemoryTokenNotFound,
        "NOT_FOUND",
        "MEMORY_TOKEN_NOT_FOUND",
        lambda: table.leases().resolve("d", token, 0, torch.int32, (1,)),
    )
    first.release()
    first.release()  # idempotent
    assert mapper.mapped == 1
    second.release()
    assert mapper.mapped == 0 and len(mapper.closed) == 1


def test_a_call_takes_one_lease_per_region_and_keeps_it_across_unregister() -> None:
    mapper, table, buffer, token, _ = registered()
    leases = table.leases()
    first = leases.resolve("a", token, 0, torch.int32, (4,))
    table.unregister(token)
    assert mapper.mapped == 1
    # The call already holds the region: its later references still resolve, to the same
    # memory; another call's do not.
    second = leases.resolve("b", token, 16, torch.int32, (4,))
    second.fill_(7)
    assert torch.equal(buffer[16:32].view(torch.int32), torch.full((4,), 7, dtype=torch.int32))
    assert first.data_ptr() + 16 == second.data_ptr()
    expect(
        MemoryTokenNotFound,
        "NOT_FOUND",
        "MEMORY_TOKEN_NOT_FOUND",
        lambda: table.leases().resolve("c", token, 0, torch.int32, (1,)),
    )
    leases.release()  # one release closes it: one lease was taken for both references
    assert mapper.mapped == 0 and len(mapper.closed) == 1
    # A released call no longer reaches the closed mapping through its old lease.
    expect(
        MemoryTokenNotFound,
        "NOT_FOUND",
        "MEMORY_TOKEN_NOT_FOUND",
        lambda: leases.resolve("d", token, 0, torch.int32, (1,)),
    )


def test_holding_several_regions_takes_all_of_them_or_none() -> None:
    """``Leases.hold`` (a call decoded earlier, leased again) leases every region in one pass;
    when one token is unknown it leases none, so the others close as soon as they are
    unregistered."""
    mapper, table, _, token, _ = registered()
    other, _ = table.register(mapper.export(torch.zeros(1024, dtype=torch.uint8)), UUID, 1024, "c")
    leases = table.leases()
    leases.hold("request", (token, other))
    assert leases.tokens == (token, other)
    leases.hold("request", (other, token))  # already held: nothing more is leased
    table.unregister(token)
    assert mapper.mapped == 2
    leases.release()
    assert mapper.mapped == 1  # one release per region closes the unregistered one
    refused = table.leases()
    expect(
        MemoryTokenNotFound,
        "NOT_FOUND",
        "MEMORY_TOKEN_NOT_FOUND",
        lambda: refused.hold("request", (other, token)),
    )
    assert refused.tokens == ()
    table.unregister(other)
    assert mapper.mapped == 0  # the refused call left no lease on it


def test_idle_regions_expire_but_leased_ones_do_not() -> None:
    mapper, table, _, token, clock = registered(idle_timeout_s=10.0)
    busy = mapper.export(torch.zeros(64, dtype=torch.uint8))
    busy_token, _ = table.register(busy, UUID, 64, "c")
    leases = table.leases()
    leases.resolve("x", busy_token, 0, torch.uint8, (8,))
    clock.now_s += 11
    assert table.sweep(force=True) == 1
    assert [r.byte_size for r in table.list("c")] == [64]
    expect(
        MemoryTokenNotFound,
        "NOT_FOUND",
        "MEMORY_TOKEN_NOT_FOUND",
        lambda: table.leases().resolve("y", token, 0, torch.uint8, (1,)),
    )
    assert mapper.mapped == 1
    leases.release()
    clock.now_s += 11
    assert table.list("c") == [] and mapper.mapped == 0


def test_close_unmaps_idle_regions_now_and_leased_ones_at_release() -> None:
    mapper, table, _, token, _ = registered()
    other, _ = table.register(mapper.export(torch.zeros(8, dtype=torch.uint8)), UUID, 8, "c")
    leases = table.leases()
    leases.resolve("x", token, 0, torch.uint8, (8,))
    table.close()
    assert mapper.mapped == 1
    leases.release()
    assert mapper.mapped == 0
    with pytest.raises(DDTreeError) as raised:
        table.register(mapper.export(torch.zeros(8, dtype=torch.uint8)), UUID, 8, "c")
    assert raised.value.reason == "SHUTTING_DOWN"
    assert other not in str(raised.value)


# ---------------------------------------------------------------------- IPC events


def test_event_handles_are_checked_cached_and_evicted() -> None:
    mapper = HostMapper()
    waiter = EventWaiter(mapper)
    expect(
        InvalidArgument,
        "INVALID_ARGUMENT",
        "INVALID_IPC_HANDLE",
        lambda: waiter.wait(b"\1" * 10, 7, "build_tree.wait_event_ipc_handle"),
    )
    first = bytes([1]) * 64
    waiter.wait(first, 7, "f")
    waiter.wait(first, 8, "f")
    assert mapper.events_opened == [first]
    assert [stream for _, stream in mapper.waits] == [7, 8]
    for i in range(2, 2 + 64):
        waiter.wait(bytes([i]) * 64, 7, "f")
    assert mapper.events_closed == [("event", first)]
    waiter.close()
    assert len(mapper.events_closed) == 65
