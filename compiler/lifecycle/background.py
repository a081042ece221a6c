"""Background compile: region variants compiled in a daemon thread while calls run the bodies' own code.

Warmup Shapes' ``background`` records every region call that has no variant yet (its module and its
inputs' shapes, strides, dtypes and dispatch state); one daemon thread (``BACKGROUND``, one per
process) compiles those signatures on stand-in tensors. Until a variant is ready its calls run the
model's own code (on CPU with prepacked convs); while a model is in background mode
(``BackgroundMode``, held by its Accelerator) its misses are queued for the thread, never compiled
in the sampling thread. A CPU job waits until nothing samples (``ACTIVITY``): beside sampling it
would share the same cores and Python's GIL, slowing every image while it compiles.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
import time
import weakref
from collections import Counter

import torch

from .. import cast, settings
from . import variants
from .variants import guard_marks
from ..reasons import error_summary

log = logging.getLogger(__name__)


def _spec(a):
    """What a stand-in for input ``a`` needs (values are not guarded: zeros will do)."""
    if isinstance(a, torch.Tensor):
        return ("t", tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.is_inference(), a.requires_grad)
    return ("v", a)


def _stand_ins(specs, struct_inputs) -> list:
    args = []
    for i, s in enumerate(specs):
        if struct_inputs[i] not in (-1, i):       # the same tensor as an earlier input
            args.append(args[struct_inputs[i]])
        elif s[0] == "t":
            _, shape, stride, dtype, device, inference, grad = s
            with torch.inference_mode(inference):
                # zeros, not uninitialised memory: the compile thread calls the variant once on them
                # (denormal garbage would make that call slow)
                t = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
            args.append(t.requires_grad_() if grad else t)
        else:
            args.append(s[1])
    return args


#: dynamo settings the backends patch around a call (``Backend.dynamo_config``); patches are per thread
_DYNAMO_KEYS = ("force_parameter_static_shapes", "force_nn_module_property_static_shapes",
                "assume_static_by_default", "automatic_dynamic_shapes")


def _modes_now(device_type: str) -> tuple:
    """The caller thread's grad / inference / autocast state (variants guard it) and its dynamo
    settings (how it traces): all per thread, so the compile thread takes them over."""
    dynamo = {k: getattr(torch._dynamo.config, k) for k in _DYNAMO_KEYS if hasattr(torch._dynamo.config, k)}
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), device_type,
            torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type), tuple(dynamo.items()))


@contextlib.contextmanager
def _modes(state):
    grad, inference, device_type, autocast, dtype, dynamo = state
    with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
            torch.autocast(device_type, dtype=dtype, enabled=autocast), torch._dynamo.config.patch(**dict(dynamo)):
        yield


_THREAD = threading.local()


def _not_in_the_thread(set_state):
    """``set_state`` (torch's ``set_rng_state``), except in the compile thread. Dynamo restores the
    global RNG state it saw when a compile began (``convert_frame.preserve_global_state``); from
    another thread that rewinds every number the sampling thread drew meanwhile (docs/lab-starts.md),
    so samplers and nodes that draw from torch's global generator made other images. The compile
    itself draws none of them (tests/compiler/test_background.py checks the sequence)."""
    @functools.wraps(set_state)
    def set_rng_state(*args, **kwargs):
        if getattr(_THREAD, "compiling", False):
            return None
        return set_state(*args, **kwargs)
    set_rng_state._unet_compiler = True
    return set_rng_state


def _before_the_thread() -> None:
    """What the compile thread must not do while other threads run modules, done in the caller's
    thread first. Once per process, inductor traces a dummy function with a plain FX ``Tracer``
    (``loop_body.InterpreterShim._dummy_gm``), which patches ``nn.Module.__call__`` process-wide
    meanwhile: a module called in the sampling thread in that window raised ``NameError: module is
    not installed as a submodule`` (found by the starts bench). The other traces a compile makes
    (make_fx's ``PythonKeyTracer``) pass module calls straight through. And torch's
    ``set_rng_state`` is made a no-op in the compile thread (``_not_in_the_thread``)."""
    try:
        from torch._inductor.loop_body import InterpreterShim
        InterpreterShim._dummy_gm()
    except Exception:   # another torch: nothing of this kind to do first
        log.debug("no inductor loop-body tracer to prime", exc_info=True)
    for module in (torch.random, torch.cuda):
        if not getattr(module.set_rng_state, "_unet_compiler", False):
            module.set_rng_state = _not_in_the_thread(module.set_rng_state)


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


ACTIVITY = Activity()


#: the share of the Python interpreter (the GIL) the compile thread takes while it compiles beside
#: sampling (a GPU's, whose host side is Python launching kernels): after each job it pauses for
#: its CPU time x (1 - share) / share, or until sampling stops
BESIDE_SHARE = 0.25


def sampling_now() -> bool:
    """A model call is in flight or ended less than ``QUIET_SECONDS`` ago (host signals not asked)."""
    return ACTIVITY.calls > 0 or time.monotonic() - ACTIVITY.busy_until < QUIET_SECONDS


def pace(cpu_seconds: float) -> float:
    """After a job that took ``cpu_seconds`` of the thread's CPU beside sampling, with more queued:
    pause so the thread holds at most ``BESIDE_SHARE`` of the interpreter while sampling runs (a
    compile is Python through and through, and sampling beside it gets the GIL in turns, waiting for
    it each time it comes back from the GPU: ``bench beside``). Returns the seconds paused."""
    left = cpu_seconds * (1 - BESIDE_SHARE) / BESIDE_SHARE
    t0 = time.perf_counter()
    while left > 0 and sampling_now():
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


class Background:
    """Region variants compiled in a daemon thread while calls run the bodies' own code (see the
    module docstring). Process-wide, like ``VARIANTS``; ``listeners`` are told when the queue empties."""

    def __init__(self):
        self.lock = threading.Lock()
        self.recording = False
        self.running = False
        self.waiting = False             # a CPU job waits for sampling to stop (``ACTIVITY``)
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
        return self.recording or self.running

    @property
    def queued(self) -> int:
        return len(self.queue) + (1 if self.running else 0)

    @contextlib.contextmanager
    def record(self, owner: Owner):
        """Calls inside run the bodies' own code and queue what they miss for ``owner``; the thread
        starts at the end."""
        with self.lock:
            prev, self.recording = self.recording, True
        try:
            with queueing(owner):
                yield
        finally:
            with self.lock:
                self.recording = prev
            self._start()

    def add(self, pre, key: str, module, args, struct_inputs, owner: Owner | None) -> None:
        specs = tuple(_spec(a) for a in args)
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
            dyn = pre.dynamic if pre.dynamic is not None else (key in self._keys or bool(variants.VARIANTS.live.get(key)))
            self._keys.add(key)
            self.queue.append((owner, pre, key, weakref.ref(module), specs, struct_inputs, dyn,
                               _modes_now(device.type), sig))
        if not self.recording:
            self._start()

    def _start(self) -> None:
        _before_the_thread()
        with self.lock:
            if self.running or self.recording or not self.queue:
                return
            self.running = True
        threading.Thread(target=self._work, name="unet-compiler-background", daemon=True).start()

    def _work(self) -> None:
        _THREAD.compiling = True
        while True:
            with self.lock:
                wait = bool(self.queue) and waits_for_idle(self.queue[0][7][2])
            if wait and not ACTIVITY.idle():
                self.waiting = True
                time.sleep(0.2)
                continue
            self.waiting = False
            with self.lock:
                if not self.queue:
                    # still running until the listeners have counted and saved what it compiled:
                    # ``wait()`` returning means that is done too
                    self.epoch += 1
                    self._seen.clear()       # what was compiled is in VARIANTS now
                    self._keys.clear()
                    self._instances.clear()
                    listeners = list(self.listeners)
                    break
                job = self.queue.pop(0)
                self.epoch += 1
            owner = job[0] or Owner()
            t0, cpu0 = time.perf_counter(), time.thread_time()
            _THREAD.owner = owner
            try:
                self._compile(owner, *job[1:])
            except BaseException as e:   # never into the interpreter's thread hook
                owner.failures.append(error_summary(e))
                self.failures.append(error_summary(e))
                log.warning("UNet Compiler: background compile failed (%s)", error_summary(e), exc_info=True)
            owner.seconds += time.perf_counter() - t0
            if self.queue and paces(job[7][2]):
                owner.paused += pace(time.thread_time() - cpu0)
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

    def _compile(self, owner, pre, key, module_ref, specs, struct_inputs, dynamic, modes, sig) -> None:
        from torch._dynamo.utils import counters
        module = module_ref()
        if module is None:
            return
        with self.lock:
            others = [m for m in (r() for r in self._instances.pop(sig, [])) if m is not None]
        with _modes(modes):
            args = _stand_ins(specs, struct_inputs)
            if cast.needs_cast(module):
                # its leaves show ComfyUI's per-call cast only inside the sampling thread's call: this
                # thread traces a copy that shows it (the variant serves the real module then)
                module, others = cast.stand_in(module, args), []
            loading = variants.VARIANTS.waiting(key)
            serving = next((fn for fn in variants.VARIANTS.candidates(key) if fn.guard_check(module, *args)), None)
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


BACKGROUND = Background()

#: the compile thread's own CUDA stream per device: its first calls' kernels (and the autotuning
#: their first launch does) are queued and timed there, not behind sampling's work
_PRIME_STREAMS: dict = {}

#: a first call on CUDA runs where the card has this many times its inputs' bytes free (a region's
#: activations beside sampling's); else sampling's own first call of the variant does that work
PRIME_ROOM = 8


def _short_of_room(device, args) -> str | None:
    need = PRIME_ROOM * sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    free, _ = torch.cuda.mem_get_info(device)
    if free < need:
        return "the card was short of memory for a call beside sampling"
    return None


def _first_call_on_cuda(fn, modules, args, device) -> str | None:
    """One call of ``fn`` on the thread's own stream (a variant's kernels load and tune once for every
    module it serves; nothing is packed per module on CUDA). Returns why it did not run (None: it ran)."""
    module = next((m for m in modules if not (cast.busy(m) or cast.needs_cast(m)) and fn.guard_check(m, *args)),
                  None)
    if module is None:
        return "its modules' weights are cast per call"
    why = _short_of_room(device, args)
    if why is not None:
        return why
    stream = _PRIME_STREAMS.get(device)
    if stream is None:
        stream = _PRIME_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))   # the stand-ins' zeroing first
    with torch.no_grad(), torch.cuda.stream(stream):
        fn.fn(module, *args)
    stream.synchronize()   # the stand-ins (allocated on the thread's stream) outlive the call's work
    return None


def first_calls(fn, modules, args) -> None:
    """Call ``fn`` once for each of ``modules`` its guards accept (the compile thread's priming: a
    first call loads the variant's kernels, tunes their launch configs, and packs CPU conv weights).
    A module whose weights are cast per call is skipped (the sampling thread may be showing them). On
    CUDA one call, on the thread's own stream, where the card has room for it beside sampling
    (``PRIME_ROOM``); the job's owner counts it, or why not (``Owner.primed`` / ``unprimed``: the
    variant's first sampling call then does that work). A conv weight sampling already packed keeps
    its copy (``prepack_conv.keeping_packed``)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    if device is not None:
        why = _first_call_on_cuda(fn, modules, args, device)
        owner = getattr(_THREAD, "owner", None)
        if owner is not None:
            if why is None:
                owner.primed += 1
            else:
                owner.unprimed[why] += 1
        return
    from ..passes.prepack_conv import keeping_packed
    with torch.no_grad(), keeping_packed():
        for m in modules:
            # a module whose weights are cast per call: the sampling thread may be showing them now
            if cast.busy(m) or cast.needs_cast(m):
                continue
            if fn.guard_check(m, *args):
                fn.fn(m, *args)



class BackgroundMode:
    """One model in background mode (Warmup Shapes' ``background``): from ``started()`` on, each time
    the thread's queue empties, what it compiled for this model is handed to ``account(graphs,
    seconds, first, marks) -> state`` (the accelerator counts and saves it: the first time as
    warmup's, later as compiles after warmup) and, the first time, ``on_done(line, state)`` is told.
    Holds its accelerator only through ``account`` (a weak method)."""

    def __init__(self, account):
        self.owner = Owner()
        self.t0 = time.perf_counter()
        self.done: float | None = None       # seconds from start to the first empty queue
        self.on_done = None                  # optional callable(report line, state), told from the thread
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
            with BACKGROUND.record(self.owner):
                yield
        except BaseException:
            self.started(settle=False)
            raise
        self.started()

    def started(self, settle: bool = True) -> None:
        """Warmup recorded the model's calls for the thread (again: its compiles are warmup's again).
        ``settle`` False: a warmup that stopped part way; the model stays in background mode and its
        first empty queue after this, once sampling's calls queued what warmup could not, is done."""
        self._marks = guard_marks()
        if self.done is not None:
            self.t0, self.done = time.perf_counter(), None
        if self._listener is None:
            me = weakref.ref(self)

            def listener():
                mode = me()
                if mode is None:
                    BACKGROUND.listeners[:] = [f for f in BACKGROUND.listeners if f is not listener]
                    return
                mode._queue_empty()
            self._listener = listener
            BACKGROUND.listeners.append(listener)
        if settle and not BACKGROUND.active:   # nothing was queued (all from the compile cache), or done already
            self._queue_empty()

    def end(self) -> None:
        """Leave background mode: the model's misses compile in the calling thread again."""
        if self._listener in BACKGROUND.listeners:
            BACKGROUND.listeners.remove(self._listener)
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
            marks, self._marks = self._marks, guard_marks()
        state = account(new, secs, first, marks)   # counted and saved first: "done" means nothing is left
        line = self.line()
        log.info("UNet Compiler: %s", line)
        if first and self.on_done is not None:
            try:
                self.on_done(line, state)
            except Exception:   # a listener must not break the thread
                log.debug("background on_done listener failed", exc_info=True)

    def line(self) -> str:
        """The report line of background mode."""
        owner = self.owner
        failed = f"; failed: {'; '.join(owner.failures[-2:])}" if owner.failures else ""
        if owner.unprimed:
            failed = (f"; {sum(owner.unprimed.values())} variant(s) not called before sampling used them ("
                      f"{', '.join(owner.unprimed)}): their first sampling call loads their kernels{failed}")
        if self.done is None:
            waiting = (", waiting until no prompt runs (on CPU it would slow sampling)" if BACKGROUND.waiting
                       else "")
            return (f"background compile: running{waiting}, {owner.variants} region variant(s) compiled "
                    f"({owner.graphs} graph(s)), {BACKGROUND.queued} to go, {time.perf_counter() - self.t0:.0f} s "
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
