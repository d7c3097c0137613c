"""An engine metrics observer that records op launches and can hold or fail them, for tests of
deadlines, draining, limits and threading."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["Gate"]


class Gate:
    """Engine observer (``Engine(observer=...)``) that records every op launch and holds the
    launches of ``op`` until ``release`` is set.

    Parameters
    ----------
    op : str, optional
        The op whose launches wait for ``release`` (``"build_tree"`` by default); None holds
        every op.
    released : bool
        Start with ``release`` set, so nothing waits until a test clears it.

    Attributes
    ----------
    entered : threading.Event
        Set when a held launch starts waiting.
    release : threading.Event
        Lets held launches go on (a launch waits 30 s at most, then fails the test).
    launches : list of (str, int)
        Every launch: the op's name and the thread that ran it.
    fail_op : str, optional
        An op whose launch raises ``failure`` instead of running.
    failure : Exception
        What ``fail_op`` raises.
    """

    def __init__(self, op: str | None = "build_tree", *, released: bool = False) -> None:
        self.op = op
        self.entered = threading.Event()
        self.release = threading.Event()
        if released:
            self.release.set()
        self.launches: list[tuple[str, int]] = []
        self.fail_op: str | None = None
        self.failure: Exception = RuntimeError("secret internal detail")

    @property
    def ops(self) -> list[str]:
        """The launched ops' names, in order."""
        return [op for op, _ in self.launches]

    @contextlib.contextmanager
    def time_op(
        self, op: str, device: torch.device, stream: torch.cuda.Stream | None = None
    ) -> Iterator[None]:
        self.launches.append((op, threading.get_ident()))
        if op == self.fail_op:
            raise self.failure
        if self.op is None or op == self.op:
            self.entered.set()
            assert self.release.wait(30), "test never released the gate"
        yield

    def observe_device_time(self, op: str, device: torch.device, seconds: float) -> None:
        return None

    def observe_trees(self, num_nodes: torch.Tensor, *, model: str = "") -> None:
        return None

    def observe_acceptance(
        self, nodes: torch.Tensor, length: torch.Tensor, num_nodes: torch.Tensor, *, model: str = ""
    ) -> None:
        return None
