"""What compiles a process's region variants, and when, as one object handed to whoever needs it:
the variant registry (``variants``: the region bodies are process-wide, so are their variants), the
compile thread (``thread``) and whether anything samples now (``activity``). A process has one
(:func:`process_scheduler`, made at its first use); an accelerator takes it and hands it on to its
region bodies, ledger, compile cache entry, CUDA graphs and background mode. A test makes its own
(or gives one a fresh registry) to stand for a fresh process."""
from __future__ import annotations

import threading

from ..compat import dynamo
from .pacing import Activity
from .variants import Variants
from .worker import Background


class Scheduler:
    """The registry, the compile thread and the sampling activity of one process (module docstring)."""

    def __init__(self):
        self.variants = Variants()
        self.activity = Activity()
        self.thread = Background(self)

    def __reduce__(self):
        # a region's compiled body holds its scheduler, and dynamo pickles what a traced call can
        # reach (its guard state, kept with each variant): a scheduler is the process's, not data
        return process_scheduler, ()

    def guard_marks(self) -> dict:
        """A bookmark in the guard-failure records: dynamo's and the precompiled regions' misses."""
        return dynamo.guard_marks(self.variants.failures)

    def guard_reasons_since(self, marks: dict) -> list[str]:
        """The raw guard failures recorded after ``marks`` (:meth:`guard_marks`), oldest first, each once."""
        return dynamo.guard_reasons_since(marks, self.variants.failures)


_PROCESS: Scheduler | None = None
_MADE = threading.Lock()


def process_scheduler() -> Scheduler:
    """This process's scheduler (made at the first call)."""
    global _PROCESS
    with _MADE:
        if _PROCESS is None:
            _PROCESS = Scheduler()
        return _PROCESS
