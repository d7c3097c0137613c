"""The channel watchdog's step deadline (``StepDeadline``), on the CPU with a fake clock.

The GPU half (a service stopped with SIGSTOP: connected, not serving) is
``test_channel_gpu.py::test_hung_service_releases_the_callers_stream_at_the_step_deadline``.
"""

from __future__ import annotations

import pytest

from ddtree.clients import Channel
from ddtree.clients.channel import ChannelLostError, StepDeadline
from ddtree.clients.errors import DDTreeClientError


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
