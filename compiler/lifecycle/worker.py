"""The compile thread: one daemon thread per process (its scheduler's ``thread``) that compiles the
region calls models in background mode recorded (their modules and inputs' specs), on stand-in
inputs, while those calls run the bodies' own code; ``Owner`` counts what it did for one model. See
background.py for the mode a model is in."""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
import weakref
from collections import Counter

import torch

from .. import cast
from ..compat.compile_thread import THREAD, before_the_thread
from ..reasons import error_summary
from . import pacing
from .priming import first_calls
from .stand_ins import modes, modes_now, spec, stand_ins

log = logging.getLogger(__name__)


class Owner:
    """What one model's background compiles did (an accelerator keeps one; jobs count into it).
    While ``queueing(owner)`` is entered, that model's misses go to the thread, never compiled in
    the calling thread: background compile is a mode of the model, not only of its warmup."""

    def __init__(self):
        self.variants = 0          # variants the thread compiled for it
        self.loaded = 0            # variants the thread loaded from the compile cache for it
        self.graphs = 0            # dynamo graphs they were (torch's unique_graphs)
        self.seconds = 0.0         # the thread's time on them
        self.eager_calls = 0       # region calls that ran the body's own code while theirs compiled
        self.deferred = 0          # of them, calls whose code was in the compile cache, left to load
        self.failures: list[str] = []
        self.primed = 0            # CUDA variants the thread called once (their kernels loaded and tuned)
        self.paused = 0.0          # seconds the thread paused after its jobs to leave sampling the GIL
        self.unprimed: Counter = Counter()   # why a CUDA variant was left to sampling's first call


_OWNER: contextvars.ContextVar = contextvars.ContextVar("unet_compiler_background_owner", default=None)


def current_owner() -> Owner | None:
    """The owner whose misses this context queues (inside ``queueing``), else None."""
    return _OWNER.get()


@contextlib.contextmanager
def queueing(owner: Owner):
    """Calls inside queue their misses for the background thread (and run the body's own code)."""
    token = _OWNER.set(owner)
    try:
        yield
    finally:
        _OWNER.reset(token)


class Background:
    """Region variants compiled in a daemon thread while calls run the bodies' own code (see the
    module docstring), into ``scheduler``'s variants, pacing itself by its activity; ``listeners`` are
    told when the queue empties."""

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self.lock = threading.Lock()
        self.recording = 0          # warmups recording now (each inside ``record``)
        self.running = False
        self.waiting = False             # a CPU job waits for sampling to stop (the scheduler's activity)
        self.queue: list[tuple] = []
        self._seen: set = set()
        self._keys: set = set()          # keys with a job: a second signature of one compiles dynamic
        self._instances: dict = {}       # signature -> weakrefs to the other modules that called it
        self.epoch = 0                   # bumped as each job starts and ends (runtime's recompile count)
        self.compiled = 0                # variants the thread compiled, for every owner
        self.failures: list[str] = []
        self.listeners: list = []        # callable(): told (in the thread) when the queue is empty

    @property
    def active(self) -> bool:
        return self.recording > 0 or self.running

    @property
    def queued(self) -> int:
        return len(self.queue) + (1 if self.running else 0)

    @contextlib.contextmanager
    def record(self, owner: Owner):
        """Calls inside run the bodies' own code and queue what they miss for ``owner``; the thread
        starts at the end."""
        with self.lock:
            self.recording += 1     # (a count: two warmups on two threads may overlap)
        try:
            with queueing(owner):
                yield
        finally:
            with self.lock:
                self.recording -= 1
            self._start()

    def add(self, pre, key: str, module, args, struct_inputs, owner: Owner | None) -> None:
        specs = tuple(spec(a) for a in args)
        device = next((s[4] for s in specs if s[0] == "t"), torch.device("cpu"))
        try:
            sig = (key, specs)
            hash(sig)
        except TypeError:            # an unhashable constant input: not something to queue
            return
        with self.lock:
            if sig in self._seen:
                # another module of the same structure (a block repeated in the UNet): one variant
                # serves both, and the thread's first call primes each (its packed weights)
                others = self._instances.setdefault(sig, [])
                if not any(r() is module for r in others):
                    others.append(weakref.ref(module))
                return
            self._seen.add(sig)
            dyn = pre.dynamic if pre.dynamic is not None else \
                (key in self._keys or bool(self._scheduler.variants.live.get(key)))
            self._keys.add(key)
            self.queue.append((owner, pre, key, weakref.ref(module), specs, struct_inputs, dyn,
                               modes_now(device.type), sig))
        if not self.recording:
            self._start()

    def _start(self) -> None:
        before_the_thread()
        with self.lock:
            if self.running or self.recording or not self.queue:
                return
            self.running = True
        threading.Thread(target=self._work, name="unet-compiler-background", daemon=True).start()

    def _work(self) -> None:
        THREAD.compiling = True
        while True:
            with self.lock:
                wait = bool(self.queue) and pacing.waits_for_idle(self.queue[0][7][2])
            if wait and not self._scheduler.activity.idle():
                self.waiting = True
                time.sleep(0.2)
                continue
            self.waiting = False
            with self.lock:
                if not self.queue:
                    # still running until the listeners have counted and saved what it compiled:
                    # ``wait()`` returning means that is done too
                    self.epoch += 1
                    self._seen.clear()       # what was compiled is in the variants now
                    self._keys.clear()
                    self._instances.clear()
                    listeners = list(self.listeners)
                    break
                job = self.queue.pop(0)
                self.epoch += 1
            owner = job[0] or Owner()
            t0, cpu0 = time.perf_counter(), time.thread_time()
            THREAD.owner = owner
            try:
                self._compile(owner, *job[1:])
            except BaseException as e:   # never into the interpreter's thread hook
                owner.failures.append(error_summary(e))
                self.failures.append(error_summary(e))
                log.warning("UNet Compiler: background compile failed (%s)", error_summary(e), exc_info=True)
            owner.seconds += time.perf_counter() - t0
            if self.queue and pacing.paces(job[7][2]):
                owner.paused += pacing.pace(time.thread_time() - cpu0, self._scheduler.activity)
            with self.lock:
                self.epoch += 1
        self._tell(listeners)
        with self.lock:
            self.running = False
            more = bool(self.queue)      # queued while the listeners ran: another pass
            late = [f for f in self.listeners if f not in listeners]   # a model that started meanwhile
        if more:
            self._start()
        else:
            self._tell(late)

    @staticmethod
    def _tell(listeners) -> None:
        for listener in listeners:
            try:
                listener()
            except Exception:
                log.debug("background listener failed", exc_info=True)

    def _compile(self, owner, pre, key, module_ref, specs, struct_inputs, dynamic, job_modes, sig) -> None:
        from torch._dynamo.utils import counters
        module = module_ref()
        if module is None:
            return
        with self.lock:
            others = [m for m in (r() for r in self._instances.pop(sig, [])) if m is not None]
        with modes(job_modes):
            args = stand_ins(specs, struct_inputs)
            if cast.needs_cast(module):
                # its leaves show ComfyUI's per-call cast only inside the sampling thread's call: this
                # thread traces a copy that shows it (the variant serves the real module then)
                module, others = cast.stand_in(module, args), []
            registry = self._scheduler.variants
            loading = registry.waiting(key)
            serving = next((fn for fn in registry.candidates(key) if fn.guard_check(module, *args)), None)
            if serving is not None:      # an earlier job's (dynamic) variant, or the compile cache's: prime its modules
                first_calls(serving, [module, *others], args)
                owner.loaded += loading if getattr(serving, "from_cache", False) else 0
                return
            g0 = int(counters["stats"]["unique_graphs"])
            fn = pre._aot(key, module, args, dynamic, first_call=True, others=others)
            owner.graphs += int(counters["stats"]["unique_graphs"]) - g0
        if fn is not None:
            owner.variants += 1
            self.compiled += 1

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or compiling (True), or ``timeout`` seconds pass (False)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.active:
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(0.05)
        return True
