"""Background compile: region variants compiled in a daemon thread while calls run the bodies' own code.

Warmup Shapes' ``background`` records every region call that has no variant yet (its module and its
inputs' shapes, strides, dtypes and dispatch state); one daemon thread (the scheduler's, one per
process: scheduler.py, worker.py) compiles those signatures on stand-in tensors. Until a variant is
ready its calls run the model's own code (on CPU with prepacked convs); while a model is in
background mode (``BackgroundMode``, held by its Accelerator) its misses are queued for the thread,
never compiled in the sampling thread. A CPU job waits until nothing samples (the scheduler's
activity): beside sampling it would share the same cores and Python's GIL, slowing every image
while it compiles. This module: one model's mode and its report line; the thread is worker.py's.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref

from . import worker
from .pacing import BESIDE_SHARE

log = logging.getLogger(__name__)


class BackgroundMode:
    """One model in background mode (Warmup Shapes' ``background``): from ``started()`` on, each time
    the thread's queue empties, what it compiled for this model is handed to ``account(graphs,
    seconds, first, marks) -> state`` (the accelerator counts and saves it: the first time as
    warmup's, later as compiles after warmup) and, the first time, ``tell_done(line, state)`` (the
    accelerator's ``background_done`` event) is told. Holds its accelerator only through ``account``
    (a weak method); ``scheduler``: the process's, whose thread compiles for it."""

    def __init__(self, account, scheduler, tell_done=None):
        self.scheduler = scheduler
        self.owner = worker.Owner()
        self.t0 = time.perf_counter()
        self.done: float | None = None       # seconds from start to the first empty queue
        self._tell_done = tell_done          # optional callable(report line, state), told from the thread
        self._account = account
        #: probe and listed shape labels warmup recorded: the compile cache entry holds their code once
        #: the thread compiled everything without a failure (a restart then need not run them)
        self.primes: list[str] = []
        self._counted, self._seconds, self._marks = 0, 0.0, None
        self._listener = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def recording(self):
        """Warmup's calls inside record what they miss for the compile thread, which starts at the
        end; then this mode is :meth:`started` (not settled when the block raised: a model that
        cannot be called outside sampling stays in background mode, and its report's background
        line ends with "done" once the thread compiled what its sampling calls queued)."""
        try:
            with self.scheduler.thread.record(self.owner):
                yield
        except BaseException:
            self.started(settle=False)
            raise
        self.started()

    def started(self, settle: bool = True) -> None:
        """Warmup recorded the model's calls for the thread (again: its compiles are warmup's again).
        ``settle`` False: a warmup that stopped part way; the model stays in background mode and its
        first empty queue after this, once sampling's calls queued what warmup could not, is done."""
        thread = self.scheduler.thread
        self._marks = self.scheduler.guard_marks()
        if self.done is not None:
            self.t0, self.done = time.perf_counter(), None
        if self._listener is None:
            me = weakref.ref(self)

            def listener():
                mode = me()
                if mode is None:
                    thread.listeners[:] = [f for f in thread.listeners if f is not listener]
                    return
                mode._queue_empty()
            self._listener = listener
            thread.listeners.append(listener)
        if settle and not thread.active:   # nothing was queued (all from the compile cache), or done already
            self._queue_empty()

    def end(self) -> None:
        """Leave background mode: the model's misses compile in the calling thread again."""
        if self._listener in self.scheduler.thread.listeners:
            self.scheduler.thread.listeners.remove(self._listener)
        self._listener = None
        self._account = None

    def _queue_empty(self) -> None:
        with self._lock:
            account = self._account() if self._account is not None else None
            if account is None:
                return
            new, secs = self.owner.graphs - self._counted, self.owner.seconds - self._seconds
            first = self.done is None
            if not first and not new:
                return
            self._counted, self._seconds = self.owner.graphs, self.owner.seconds
            if first:
                self.done = time.perf_counter() - self.t0
            marks, self._marks = self._marks, self.scheduler.guard_marks()
        state = account(new, secs, first, marks)   # counted and saved first: "done" means nothing is left
        line = self.line()
        log.info("UNet Compiler: %s", line)
        if first and self._tell_done is not None:
            self._tell_done(line, state)

    def line(self) -> str:
        """The report line of background mode."""
        owner = self.owner
        failed = f"; failed: {'; '.join(owner.failures[-2:])}" if owner.failures else ""
        if owner.unprimed:
            failed = (f"; {sum(owner.unprimed.values())} variant(s) not called before sampling used them ("
                      f"{', '.join(owner.unprimed)}): their first sampling call loads their kernels{failed}")
        if self.done is None:
            thread = self.scheduler.thread
            waiting = ", waiting until no prompt runs (on CPU it would slow sampling)" if thread.waiting else ""
            return (f"background compile: running{waiting}, {owner.variants} region variant(s) compiled "
                    f"({owner.graphs} graph(s)), {thread.queued} to go, {time.perf_counter() - self.t0:.0f} s "
                    f"so far; region calls not ready run the model's own code ({owner.eager_calls} so far){failed}")
        primed = f", {owner.primed} called once on the GPU" if owner.primed else ""
        if owner.paused >= 0.5:
            primed += (f"; it paused {owner.paused:.0f} s between variants to leave sampling "
                       f"{1 - BESIDE_SHARE:.0%} of Python's time")
        loaded = f", {owner.loaded} loaded from the compile cache" if owner.loaded else ""
        return (f"background compile: done in {self.done:.1f} s, {owner.variants} region variant(s) "
                f"({owner.graphs} graph(s){primed}){loaded}; {owner.eager_calls} region call(s) ran the model's "
                f"own code meanwhile{failed}")


def problem(accel) -> str | None:
    """Why this accelerator's code cannot compile in the background (None: it can)."""
    if accel.backend.name == "eager" or not accel.has_regions:
        return "nothing is compiled"
    if accel.graphs is not None and not accel.graphs.measured:
        # (auto's measured graphs are fine: no graph is captured while the thread runs)
        return "CUDA graphs are captured in the sampling thread (turn cuda_graphs off to compile in the background)"
    return accel.backend.background_problem()
