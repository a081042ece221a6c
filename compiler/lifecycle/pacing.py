"""When the compile thread works: whether anything samples now (:class:`Activity`, the scheduler's),
how a job beside a GPU's sampling pauses to leave it most of Python's time (``pace``), and whether a
CPU job waits until nothing samples (``waits_for_idle``)."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

from .. import settings

log = logging.getLogger(__name__)


#: seconds with no model call and no prompt pending before a CPU compile job starts
QUIET_SECONDS = 1.0


class Activity:
    """Whether anything samples now: model calls in flight (the runtime enters ``call()`` around
    each) and the ``signals`` a host registers (ComfyUI: prompts queued or running), each a callable
    returning True while busy. ``idle()``: none of them for ``QUIET_SECONDS``."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = 0
        self.busy_until = 0.0            # monotonic time the last busy moment was seen
        self.signals: list = []

    @contextlib.contextmanager
    def call(self):
        with self.lock:
            self.calls += 1
        try:
            yield
        finally:
            with self.lock:
                self.calls -= 1
                self.busy_until = time.monotonic()

    def watch(self, signal) -> None:
        """Count ``signal`` (a callable, True while the host is busy) as activity from now on (once)."""
        with self.lock:
            if signal not in self.signals:
                self.signals.append(signal)

    def _signalled(self) -> bool:
        for signal in list(self.signals):
            try:
                if signal():
                    return True
            except Exception:   # a host signal that fails says nothing
                log.debug("activity signal failed", exc_info=True)
        return False

    def idle(self) -> bool:
        now = time.monotonic()
        busy = self.calls > 0 or self._signalled()
        with self.lock:
            if busy:
                self.busy_until = now
            return not busy and now - self.busy_until >= QUIET_SECONDS


#: the share of the Python interpreter (the GIL) the compile thread takes while it compiles beside
#: sampling (a GPU's, whose host side is Python launching kernels): after each job it pauses for
#: its CPU time x (1 - share) / share, or until sampling stops
BESIDE_SHARE = 0.25


def sampling_now(activity: Activity) -> bool:
    """A model call is in flight or ended less than ``QUIET_SECONDS`` ago (host signals not asked)."""
    return activity.calls > 0 or time.monotonic() - activity.busy_until < QUIET_SECONDS


def pace(cpu_seconds: float, activity: Activity) -> float:
    """After a job that took ``cpu_seconds`` of the thread's CPU beside sampling, with more queued:
    pause so the thread holds at most ``BESIDE_SHARE`` of the interpreter while sampling runs (a
    compile is Python through and through, and sampling beside it gets the GIL in turns, waiting for
    it each time it comes back from the GPU: ``bench beside``). Returns the seconds paused."""
    left = cpu_seconds * (1 - BESIDE_SHARE) / BESIDE_SHARE
    t0 = time.perf_counter()
    while left > 0 and sampling_now(activity):
        step = min(0.05, left)
        time.sleep(step)
        left -= step
    return time.perf_counter() - t0


def paces(device_type: str) -> bool:
    """Whether the thread paces itself (``pace``) after a job for a model on ``device_type``: on a GPU,
    whose sampling is Python launching kernels beside it. Not on CPU, where a job waits until nothing
    samples, or, set to compile beside sampling (``UNET_COMPILER_BACKGROUND_CPU=beside``), was asked to
    compile at once."""
    return device_type != "cpu"


def waits_for_idle(device_type: str) -> bool:
    """Whether a compile job for a model on ``device_type`` waits until nothing samples: on CPU
    (``UNET_COMPILER_BACKGROUND_CPU``: idle, the default), where the compile and sampling share the
    cores; not on a GPU, whose sampling leaves the CPU to the compile."""
    return device_type == "cpu" and settings.choice("BACKGROUND_CPU") == "idle"
