"""The channel watchdog's step deadline (``StepDeadline``, on a fake clock) and its poll loop
(with the control block faked), on the CPU.

The GPU half (a service stopped with SIGSTOP: connected, not serving) is
``test_channel_gpu.py::test_hung_service_releases_the_callers_stream_at_the_step_deadline``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ddtree.clients import Channel
from ddtree.clients.channel import ChannelLostError, StepDeadline
from ddtree.clients.errors import DDTreeClientError
from ddtree.kernels import channel_cuda
from ddtree.kernels.channel import (
    COMPLETION_OFFSET,
    DONE_OFFSET,
    LAST_STATUS_OFFSET,
    STATE_OFFSET,
    ChannelState,
    StepDescriptor,
    StepStatus,
    control_block_bytes,
)


def test_channel_is_exported_from_ddtree_clients() -> None:
    from ddtree.clients import channel

    assert Channel is channel.Channel
    assert issubclass(ChannelLostError, DDTreeClientError)


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan")])
def test_a_deadline_must_be_positive(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="step_timeout_s"):
        StepDeadline(timeout_s)


def test_nothing_posted_is_never_overdue() -> None:
    deadline = StepDeadline(1.0)
    for now in (0.0, 5.0, 100.0):
        assert deadline.observe((7, 7), now) is None


def test_an_outstanding_step_is_overdue_after_the_timeout_from_first_seen() -> None:
    deadline = StepDeadline(2.0)
    assert deadline.observe((0, 0), 0.0) is None
    assert deadline.observe((1, 0), 10.0) is None  # first seen posted at 10
    assert deadline.observe((1, 0), 11.9) is None
    assert deadline.observe((1, 0), 12.0) == 1


def test_progress_restarts_the_clock_for_the_next_step() -> None:
    deadline = StepDeadline(2.0)
    assert deadline.observe((3, 0), 0.0) is None  # steps 1..3 in flight
    assert deadline.observe((3, 1), 1.5) is None  # step 1 done: step 2 timed from 1.5
    assert deadline.observe((3, 1), 3.0) is None
    assert deadline.observe((3, 2), 3.4) is None  # step 3 timed from 3.4
    assert deadline.observe((3, 2), 5.3) is None
    assert deadline.observe((3, 2), 5.4) == 3


def test_completing_everything_clears_the_clock() -> None:
    deadline = StepDeadline(1.0)
    assert deadline.observe((1, 0), 0.0) is None
    assert deadline.observe((1, 1), 0.5) is None
    assert deadline.observe((2, 1), 5.0) is None  # a new step, timed from 5
    assert deadline.observe((2, 1), 5.9) is None
    assert deadline.observe((2, 1), 6.0) == 2


def test_reads_that_never_complete_count_as_no_progress() -> None:
    """A read held up behind the caller's blocked stream is no progress: a step posted before
    and the unreadable time together make it overdue; an unknown step is reported as -1."""
    deadline = StepDeadline(1.0)
    assert deadline.observe((4, 3), 0.0) is None
    assert deadline.observe(None, 0.6) is None
    assert deadline.observe(None, 1.0) == 4
    unknown = StepDeadline(1.0)
    assert unknown.observe(None, 0.0) is None
    assert unknown.observe(None, 0.99) is None
    assert unknown.observe(None, 1.0) == -1


def test_a_read_after_held_up_reads_keeps_the_held_up_time() -> None:
    deadline = StepDeadline(1.0)
    assert deadline.observe(None, 0.0) is None
    assert deadline.observe((5, 4), 0.7) is None  # step 5 was held up since 0.0
    assert deadline.observe((5, 4), 1.0) == 5


class _FakeReader:
    """Stands in for ``ControlReader``: returns ``head`` (doorbell, completion, done, state)."""

    head: tuple[int, int, int, int] = (5, 4, 0, 0)

    def __init__(self, control: torch.Tensor) -> None:
        del control

    def read(self, timeout_s: float) -> tuple[int, int, int, int]:
        del timeout_s
        return self.head

    def close(self) -> None:
        return None


def test_the_poller_releases_an_overdue_step_and_later_calls_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The watchdog's poll loop with the control block faked: a step outstanding past the
    deadline gets the block marked SERVICE_LOST, completion raised to the doorbell and done set;
    a post that raced the release (done back to 0) is released again; host calls raise."""
    writes: list[list[tuple[int, int, int]]] = []
    monkeypatch.setattr(channel_cuda, "ControlReader", _FakeReader)
    monkeypatch.setattr(
        channel_cuda, "write_values", lambda index, w, stream=None: writes.append(list(w))
    )
    channel = object.__new__(Channel)
    channel.control = torch.zeros(control_block_bytes(2), dtype=torch.uint8)
    channel.device = torch.device("cuda", 0)
    channel._lost = threading.Event()
    channel._lost_error = None
    channel._release_lock = threading.Lock()
    channel._stop = threading.Event()
    channel.closed_reason = None
    _FakeReader.head = (5, 4, 0, int(ChannelState.OPEN))
    poller = threading.Thread(target=channel._poll_steps, args=(StepDeadline(0.2),))
    poller.start()
    try:
        assert channel.wait_lost(5.0)
        assert channel.closed_reason == "step_timeout"
        base = channel.control.data_ptr()
        assert writes[0] == [
            (base + STATE_OFFSET, int(ChannelState.SERVICE_LOST), 32),
            (base + LAST_STATUS_OFFSET, int(StepStatus.SERVICE_LOST), 32),
            (base + COMPLETION_OFFSET, 5, 64),
            (base + DONE_OFFSET, 1, 32),
        ]
        _FakeReader.head = (5, 4, 0, int(ChannelState.SERVICE_LOST))
        deadline = time.monotonic() + 5.0
        while len(writes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writes[1][-1] == (base + DONE_OFFSET, 1, 32)
        with pytest.raises(ChannelLostError) as raised:
            channel.post(StepDescriptor(op=1, batch_size=1))
        assert (raised.value.code, raised.value.reason) == (
            "DEADLINE_EXCEEDED",
            "CHANNEL_STEP_TIMEOUT",
        )
        assert "step 5 did not complete within step_timeout_s=0.2 s" in raised.value.message
    finally:
        channel._stop.set()
        poller.join(5.0)
    assert not poller.is_alive()
