"""Region bodies compiled ahead of time, kept as files: a restart loads them instead of tracing.

Dynamo traces a region body again in every new process, even when inductor's caches hold its
code (at a restart that tracing was half the time left: 9.5 s of 18.8 s for SD1.5 at one shape).
Here each body is compiled with torch's precompile API (``torch.compile(fullgraph=True)
.aot_compile``, torch >= 2.10): one *variant* per distinct input signature, each a serializable
function with its own guards. The compile cache stores the variants (``cache.py``); a restart
deserializes them and calls them directly, with nothing traced.

Which variant runs: a call's key is the body, the region module's structure (every submodule's
class and the names in its instance ``__dict__``) and which inputs are None or the same tensor. Among the variants of
that key, the first whose guards pass runs. The guards kept are those about the values the code
was specialised on: input and weight tensors (shape, dtype, device, strides, requires_grad),
symbolic-shape relations, module attributes (``heads``, ``eps``, a conv's stride), empty hook
dicts and the global state (grad mode, autocast). Guards that name Python objects by identity
(a class, a function, a module) cannot be written to a file; the key carries what they checked
instead. A region with hooks or an instance ``forward`` override inside it, which only identity
guards would follow, runs the plain dynamo-compiled body (``fallback``), as do bodies that do not
trace into one graph.

Policy per key: the first variant is static, unless the config asks for dynamic shapes (then
every dim, channel counts included, is symbolic); a key that misses after its first variant
compiles a dynamic one (torch's own automatic-dynamic rule). ``UNET_COMPILER_PRECOMPILE=off``
turns this off (plain dynamo compiles, as before). Dynamic variants are traced with torch's
``backed_size_oblivious``: size 1 is not a case of its own (``size_oblivious``), so a range that
reaches a 1x1 deepest level needs no graphs per size-1 class (measured, SD1.5 diffusers UNet, range
2x64x64-4x128x128, 2 cores: 8 graphs in 43.8 s, against 18 in 59.1 s; guards still hold what the
code assumed, such as one attention token vs more).

Background compile (``BACKGROUND``, Warmup Shapes' ``background`` input): warmup runs each shape
with the bodies' own code, recording every call that has no variant yet (its module, and its
inputs' shapes, strides, dtypes and the grad / inference / autocast state), and a daemon thread
compiles those signatures with ``aot_compile`` on stand-in tensors (nothing has to run to compile
one). Until a variant is ready its calls keep running the body's own code; a call with no variant
while the thread works is queued for it rather than compiled in the caller's thread, so sampling
never waits on a compile.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import sys
import threading
import time
import weakref
from collections import defaultdict

import torch

from .compat import comfy as comfy_compat
from .report import error_summary

log = logging.getLogger(__name__)

ENV = "UNET_COMPILER_PRECOMPILE"
SIZE_ONE_ENV = "UNET_COMPILER_SIZE_OBLIVIOUS"
#: this pack's top-level module name; inside ComfyUI it is the install path (``nodes.load_custom_node``)
PACKAGE = __name__.rsplit(".compiler.precompiled", 1)[0]
#: guard kinds that serialize and check values (not object identity)
_KEEP = frozenset({"TENSOR_MATCH", "SHAPE_ENV", "GRAD_MODE", "GLOBAL_STATE", "DETERMINISTIC_ALGORITHMS",
                   "TORCH_FUNCTION_STATE", "DEFAULT_DEVICE", "AUTOGRAD_SAVED_TENSORS_HOOKS", "CONSTANT_MATCH",
                   "EQUALS_MATCH", "SEQUENCE_LENGTH", "DICT_KEYS_MATCH", "EMPTY_NN_MODULE_HOOKS_DICT"})
#: ``nn.Module.__dict__`` entries every module has (the key names the others)
_STD = frozenset({"training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_backward_pre_hooks",
                  "_backward_hooks", "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs",
                  "_forward_hooks_always_called", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                  "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                  "_load_state_dict_post_hooks", "_modules"})


def enabled() -> bool:
    if os.environ.get(ENV, "on").strip().lower() in ("0", "off", "false", "no"):
        return False
    return _api_present()


def size_oblivious() -> bool:
    """Whether dynamic variants are traced size-obliviously (``_aot``): a size-1 dim (a 64 px side
    at an SD UNet's deepest level, one token) is one more value of its symbol, not a specialisation
    that needs a graph of its own. Off: ``UNET_COMPILER_SIZE_OBLIVIOUS=off``."""
    if os.environ.get(SIZE_ONE_ENV, "on").strip().lower() in ("0", "off", "false", "no"):
        return False
    return enabled() and hasattr(_fx_config(), "backed_size_oblivious")


def _fx_config():
    import torch.fx.experimental._config as fx_config
    return fx_config


@functools.lru_cache(maxsize=1)
def _api_present() -> bool:
    try:
        from torch._dynamo import aot_compile  # noqa: F401 - torch >= 2.10
        return hasattr(torch.compiler, "load_compiled_function")
    except Exception:
        return False


def _guard_filter(entries):
    return [e.guard_type in _KEEP and not e.is_global and "__mro__" not in e.name and "type(" not in e.name
            for e in entries]


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


def structure(module: torch.nn.Module, args, widths: bool = True) -> tuple | None:
    """What a call's variant depends on besides its guards, or None when only dynamo can follow the
    region (hooks, or a submodule whose ``forward`` an instance attribute replaces). ``widths``: the
    weights' shapes too (static code: a block of other widths is another key, not a miss that
    would make the first key's code dynamic)."""
    from torch.nn.modules import module as nn_module
    if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
            or nn_module._global_module_registration_hooks):
        return None
    parts = []
    for name, m in module.named_modules():
        d = m.__dict__
        if d["_forward_hooks"] or d["_forward_pre_hooks"] or (m is not module and "forward" in d):
            return None
        shapes = tuple(tuple(p.shape) for p in d["_parameters"].values() if p is not None) if widths else ()
        parts.append((name, type(m), tuple(k for k in d if k not in _STD), shapes))
    # which inputs are the same tensor: dynamo passes an aliased input to the graph once (and only
    # an identity guard, not kept, would tell a later call with two different tensors apart)
    ids = [id(a) for a in args]
    return tuple(parts), tuple(-1 if a is None else ids.index(id(a)) for a in args)


class Variants:
    """Every precompiled variant of this process, by key: compiled here, or loaded from the compile
    cache (deserialized at first use)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.live: dict[str, list] = defaultdict(list)        # key -> [AOTCompiledFunction]
        self.pending: dict[str, list[tuple[str, bytes]]] = defaultdict(list)  # key -> (sha256, serialized), not loaded yet
        self.blobs: dict[str, dict[str, bytes]] = defaultdict(dict)  # key -> {sha256: serialized}: what a save writes
        self.compiled = 0          # variants compiled in this process
        self.from_cache = 0        # variants loaded from the compile cache and used
        self.unusable = 0          # cached variants torch could not load (compiled again)
        self.failures: list[str] = []   # why a call matched no variant (guard parts), oldest first
        self._names: dict = {}     # structure -> its stable text digest
        self.loading: set[str] = set()       # keys the preload thread is deserializing now
        self._loaded = threading.Condition(self.lock)
        self._unchecked: set[str] = set()    # keys preloaded under a guessed dispatch state, not called yet
        self.preload_seconds = 0.0           # the preload thread's time (deserializing, beside the caller)

    def key(self, body, struct, options) -> str:
        memo = (body, struct, options)
        name = self._names.get(memo)
        if name is None:
            parts, inputs = struct
            # the body by name only: inside ComfyUI the pack's module names carry its install path
            # (the entry's key carries the code's digest instead)
            text = repr((getattr(body, "__qualname__", "body"), [(n, _type_name(t), keys, shapes)
                                                                 for n, t, keys, shapes in parts], inputs, options))
            name = self._names[memo] = hashlib.sha256(text.encode()).hexdigest()[:24]
        return name

    def add_serialized(self, key: str, blob: bytes) -> None:
        """A variant from the compile cache (its bytes were checked against the pack's own .json)."""
        with self.lock:
            digest = hashlib.sha256(blob).hexdigest()
            if digest not in self.blobs[key]:
                self.blobs[key][digest] = blob
                self.pending[key].append((digest, blob))

    def candidates(self, key: str) -> list:
        with self.lock:
            while key in self.loading:       # the preload thread has it in hand: wait, never a miss
                self._loaded.wait()
            waiting = self.pending.pop(key, None)
            if waiting:
                self._adopt(key, [(digest, _deserialize(blob)) for digest, blob in waiting])
            if key in self._unchecked:
                self._unchecked.discard(key)
                self._reload_if_other_state(key)
            return self.live[key]

    def _adopt(self, key: str, loaded: list, tls=None) -> None:
        for digest, fn in loaded:
            if fn is None:
                self.unusable += 1
                self.blobs[key].pop(digest, None)
                continue
            fn.from_cache, fn.digest, fn.tls = True, digest, tls
            self.live[key].append(fn)

    def _reload_if_other_state(self, key: str) -> None:
        """A deserialized variant's tensor guards keep the dispatch state (inference mode, autocast)
        of the thread that loaded it. The preload thread guessed the sampling state; where this
        first call runs under another, its unused variants are loaded again here, in the caller's."""
        now = _dispatch_state()
        live = self.live[key]
        for i, fn in enumerate(live):
            if getattr(fn, "tls", None) not in (None, now) and not getattr(fn, "used", False):
                again = _deserialize(self.blobs[key].get(fn.digest, b""))
                if again is not None:
                    again.from_cache, again.digest, again.tls = True, fn.digest, None
                    live[i] = again

    def preload(self, modes) -> None:
        """Deserialize every variant still waiting, in a daemon thread, under ``modes()`` (a context
        manager: the dispatch state the calls will run under). The caller goes on (warmup's eager
        reference forward runs meanwhile); a call whose key is being loaded waits for it, one whose
        key is not reached yet loads it itself. Measured at a restart (SD1.5, 2 cores): deserializing
        27 variants, and inductor's one-time CPU ISA probe inside the first, took 2-3 s of warmup."""
        with self.lock:
            if not self.pending:
                return
        threading.Thread(target=self._preload, args=(modes,), name="unet-compiler-cache-load", daemon=True).start()

    def _preload(self, modes) -> None:
        t0 = time.perf_counter()
        try:
            with modes():
                tls = _dispatch_state()
                while True:
                    with self.lock:
                        key = next(iter(self.pending), None)
                        if key is None:
                            return
                        waiting = self.pending.pop(key)
                        self.loading.add(key)
                    loaded = []
                    try:
                        loaded = [(digest, _deserialize(blob)) for digest, blob in waiting]
                    finally:
                        with self.lock:
                            if len(loaded) < len(waiting):     # interrupted: the caller loads the rest
                                self.pending[key].extend(waiting[len(loaded):])
                            self._adopt(key, loaded, tls)
                            self._unchecked.add(key)
                            self.loading.discard(key)
                            self._loaded.notify_all()
        except BaseException:   # never into the interpreter's thread hook: the callers load what is left
            log.debug("UNet Compiler: preloading the compile cache's variants stopped", exc_info=True)
        finally:
            self.preload_seconds += time.perf_counter() - t0

    def add_compiled(self, key: str, fn, blob: bytes | None) -> None:
        with self.lock:
            fn.from_cache = False
            self.live[key].append(fn)
            self.compiled += 1
            if blob is not None:
                self.blobs[key][hashlib.sha256(blob).hexdigest()] = blob

    def serialized(self) -> dict[str, list[bytes]]:
        """{key: [variant bytes]} of everything this process compiled or loaded (what a save writes)."""
        with self.lock:
            return {k: list(v.values()) for k, v in self.blobs.items() if v}


VARIANTS = Variants()


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
    another thread that rewinds every number the sampling thread drew meanwhile (measured: 1414 of
    1422 draws differed), so samplers and nodes that draw from torch's global generator made other
    images. The compile itself draws none of them (tests/test_background.py checks the sequence)."""
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
        self.graphs = 0            # dynamo graphs they were (torch's unique_graphs)
        self.seconds = 0.0         # the thread's time on them
        self.eager_calls = 0       # region calls that ran the body's own code while theirs compiled
        self.failures: list[str] = []


_OWNER: contextvars.ContextVar = contextvars.ContextVar("unet_compiler_background_owner", default=None)


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
    module docstring). Process-wide, like ``VARIANTS``; ``listeners`` are told when the queue empties."""

    def __init__(self):
        self.lock = threading.Lock()
        self.recording = False
        self.running = False
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

    def add(self, pre: Precompiled, key: str, module, args, struct_inputs, owner: Owner | None) -> None:
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
            dyn = pre.dynamic if pre.dynamic is not None else (key in self._keys or bool(VARIANTS.live.get(key)))
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
                if not self.queue:
                    self.running = False
                    self.epoch += 1
                    self._seen.clear()       # what was compiled is in VARIANTS now
                    self._keys.clear()
                    self._instances.clear()
                    listeners = list(self.listeners)
                    break
                job = self.queue.pop(0)
                self.epoch += 1
            owner = job[0] or Owner()
            t0 = time.perf_counter()
            try:
                self._compile(owner, *job[1:])
            except BaseException as e:   # never into the interpreter's thread hook
                owner.failures.append(error_summary(e))
                self.failures.append(error_summary(e))
                log.warning("UNet Compiler: background compile failed (%s)", error_summary(e), exc_info=True)
            owner.seconds += time.perf_counter() - t0
            with self.lock:
                self.epoch += 1
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
            serving = next((fn for fn in VARIANTS.candidates(key) if fn.guard_check(module, *args)), None)
            if serving is not None:      # an earlier job's (dynamic) variant serves it: prime its modules
                _first_calls(serving, [module, *others], args)
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


def _serialize(fn) -> bytes:
    """A variant's bytes: the pack's module name it was pickled under, a newline, torch's bytes."""
    from torch._dynamo.aot_compile import AOTCompiledFunction
    return PACKAGE.encode() + b"\n" + AOTCompiledFunction.serialize(fn).serialized_data


@contextlib.contextmanager
def _aliases(saved: str):
    """While loading a variant pickled under another module name of this pack (another ComfyUI
    install path), that name resolves to this pack's modules."""
    added = []
    if saved and saved != PACKAGE:
        for name, module in list(sys.modules.items()):
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                alias = saved + name[len(PACKAGE):]
                if alias not in sys.modules:
                    sys.modules[alias] = module
                    added.append(alias)
    try:
        yield
    finally:
        for alias in added:
            sys.modules.pop(alias, None)


def _dispatch_state() -> tuple:
    """This thread's dispatch-key state, which a deserialized variant's tensor guards keep."""
    return (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


_DESERIALIZING = threading.Lock()    # one at a time: ``_aliases`` edits sys.modules meanwhile


def _deserialize(blob: bytes):
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
        saved, _, data = blob.partition(b"\n")
        with _DESERIALIZING, _aliases(saved.decode()):
            return AOTCompiledFunction.deserialize(data)
    except Exception as e:
        log.warning("UNet Compiler: a precompiled region from the compile cache could not be loaded (%s); "
                    "it compiles again", error_summary(e))
        return None


def _failed_parts(fn, f_locals) -> list[str]:
    """The guard of ``fn`` a call failed, worded by dynamo's own helper (for the recompile report)."""
    try:
        from torch._dynamo.guards import get_guard_fail_reason_helper
        text = get_guard_fail_reason_helper(fn._artifacts.guard_manager, f_locals, None, None)
    except Exception:
        return []
    text = text.split("\nUser stack trace:", 1)[0]
    return [text[len("None: "):] if text.startswith("None: ") else text]


def _first_calls(fn, modules, args) -> None:
    """Call ``fn`` once for each of ``modules`` its guards accept (the compile thread's priming)."""
    with torch.no_grad():
        for m in modules:
            if fn.guard_check(m, *args):
                fn.fn(m, *args)


def _canonical(args: tuple) -> tuple:
    """``args`` with each contiguous tensor that has a size-1 dim given the standard strides (a view,
    no copy). A size-1 dim's stride is arbitrary, and differs with the code that made the tensor:
    the model's own code (what a background warmup records) and compiled regions (what sampling
    then passes) hand the next region the same values with other strides there, which a variant's
    guards tell apart (found at 64 px: a 1x1 deepest level, "stride mismatch at index 3")."""
    out, changed, seen = [], False, {}
    for a in args:
        if isinstance(a, torch.Tensor) and 1 in a.shape and a.dim() > 1:
            if id(a) not in seen:
                seen[id(a)] = a
                if a.is_contiguous():
                    standard, step = [], 1
                    for size in reversed(a.shape):
                        standard.append(step)
                        step *= max(size, 1)
                    standard.reverse()
                    if list(a.stride()) != standard:
                        seen[id(a)] = a.as_strided(a.shape, standard, a.storage_offset())
            changed |= seen[id(a)] is not a
            a = seen[id(a)]
        out.append(a)
    return tuple(out) if changed else args


class Precompiled:
    """One region body as precompiled variants (see the module docstring); ``fallback`` is the
    same body under plain torch.compile, for regions this cannot serve."""

    def __init__(self, body, backend, dynamic: bool | None, fallback, options: tuple):
        self.body, self.backend, self.dynamic, self.fallback, self.options = body, backend, dynamic, fallback, options
        self.__name__ = getattr(body, "__name__", "body")
        self._no_aot: set[str] = set()
        self._compilers: dict = {}

    def _compiler(self, dynamic: bool):
        if dynamic not in self._compilers:
            self._compilers[dynamic] = torch.compile(self.body, backend=self.backend, fullgraph=True, dynamic=dynamic,
                                                     options={"guard_filter_fn": _guard_filter})
        return self._compilers[dynamic]

    def __call__(self, module, *args):
        args = _canonical(args)
        struct = structure(module, args, widths=self.dynamic is not True)
        if struct is None or (key := VARIANTS.key(self.body, struct, self.options)) in self._no_aot:
            if BACKGROUND.running:
                # plain torch.compile would compile here, beside the thread (and a dynamo-compiled
                # function called while the thread traces raises: FX's tracing flag is process-wide)
                return self.body(module, *args)
            return self.fallback(module, *args)
        variants = VARIANTS.candidates(key)
        for fn in variants:
            if fn.guard_check(module, *args):
                if fn.from_cache and not getattr(fn, "used", False):
                    return self._first_use(key, fn, module, args)
                return fn.fn(module, *args)
        if variants:
            f_locals = variants[-1].prepare_f_locals(module, *args)
            VARIANTS.failures.extend(_failed_parts(variants[-1], f_locals) or ["no precompiled variant matched"])
        owner = _OWNER.get()
        if owner is not None or BACKGROUND.active:
            # the daemon thread compiles it (never two compiling threads); this call runs the body's
            # own code meanwhile
            BACKGROUND.add(self, key, module, args, struct[1], owner)
            if owner is not None:
                owner.eager_calls += 1
            return self.body(module, *args)
        # dynamic shapes on: symbolic from the start; off: static always; one warmup shape (None):
        # static first, then symbolic once a key misses (torch's automatic-dynamic rule)
        dynamic = self.dynamic if self.dynamic is not None else bool(variants)
        return self._compile(key, module, args, dynamic=dynamic)

    def _first_use(self, key, fn, module, args):
        """A variant from the compile cache, called the first time: if it raises (something it calls
        is missing here), it is dropped and the region compiles, rather than the region kind
        falling back to eager for good."""
        try:
            out = fn.fn(module, *args)
        except Exception as e:
            if comfy_compat.is_cancel(e):
                raise
            with VARIANTS.lock:
                if fn in VARIANTS.live[key]:
                    VARIANTS.live[key].remove(fn)
                VARIANTS.blobs[key].pop(getattr(fn, "digest", ""), None)   # not saved again
                VARIANTS.unusable += 1
            log.warning("UNet Compiler: a precompiled %s from the compile cache failed at its first call (%s); "
                        "it compiles again", self.__name__, error_summary(e))
            return self._compile(key, module, args, dynamic=bool(self.dynamic))
        fn.used = True
        VARIANTS.from_cache += 1
        return out

    def _compile(self, key, module, args, dynamic: bool):
        fn = self._aot(key, module, args, dynamic)
        if fn is None:
            return self.fallback(module, *args)
        return fn.fn(module, *args)

    def _trace(self, module, args, dynamic: bool):
        """``aot_compile`` of this body on these inputs; a dynamic one size-obliviously where that
        traces (where a fake op raises instead of guarding under it, traced as torch does by default).
        Not where an input already has a size-1 dim past the batch: a size-oblivious symbol whose
        example value is 1 fails inductor's lowering of CPU flash attention (one token, the 64 px
        deepest level: a stride-order assertion, ~5 s of tracing lost); those variants specialise
        on 1 as before (and warmup's both-sides-small probe makes them)."""
        compiler = self._compiler(dynamic)
        with torch._dynamo.config.patch(specialize_float=True):
            if dynamic and size_oblivious() and not any(isinstance(a, torch.Tensor) and 1 in a.shape[1:]
                                                        for a in args):
                try:
                    with _fx_config().patch(backed_size_oblivious=True):
                        return compiler.aot_compile(((module, *args), {}))
                except Exception as e:
                    if comfy_compat.is_cancel(e):
                        raise
                    log.info("UNet Compiler: %s does not trace size-obliviously (%s); size 1 specialised",
                             self.__name__, error_summary(e))
            return compiler.aot_compile(((module, *args), {}))

    def _aot(self, key, module, args, dynamic: bool, first_call: bool = False, others=()):
        """Compile, keep and return a variant for these inputs (None: this key is left to the fallback).
        ``first_call``: call it once on ``args`` before it is kept (the compile thread: what a first
        call does, loading its kernels and packing the weights its convs use, is done there, not by
        the sampling thread's first call: 7 s of the bench's first compiled prompt), and for the
        ``others`` modules it serves too (their weights are packed per module)."""
        try:
            fn = self._trace(module, args, dynamic)
        except Exception as e:
            if comfy_compat.is_cancel(e):
                raise
            # a body that does not trace into one graph (a graph break) or a torch without the API:
            # this key runs under plain torch.compile from now on
            log.info("UNet Compiler: %s is not precompiled for this region (%s); plain torch.compile",
                     self.__name__, error_summary(e))
            self._no_aot.add(key)
            return None
        blob = None
        try:
            blob = _serialize(fn)
        except Exception as e:   # runs; not kept across restarts
            log.info("UNet Compiler: a precompiled %s cannot be saved (%s)", self.__name__, error_summary(e))
        if first_call:
            try:
                _first_calls(fn, [module, *others], args)
            except Exception as e:
                log.info("UNet Compiler: a precompiled %s failed its first call (%s); plain torch.compile",
                         self.__name__, error_summary(e))
                self._no_aot.add(key)
                return None
        VARIANTS.add_compiled(key, fn, blob)
        return fn


@functools.lru_cache(maxsize=None)
def body(raw_body, backend, dynamic: bool | None, fallback, options: tuple) -> Precompiled:
    """The process-wide precompiled form of ``raw_body`` for these options (every clone shares it)."""
    return Precompiled(raw_body, backend, dynamic, fallback, options)
