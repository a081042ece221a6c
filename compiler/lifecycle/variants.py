"""Precompiled region variants by key, in this process: compiled here or loaded from the compile cache.

A variant is one ``aot_compile``d body for one input signature, with the guards that can be
written to a file (values, not object identity). ``structure`` says what else a call's variant
depends on (the key); ``serialize`` / ``_deserialize`` turn a variant into the bytes the compile
cache keeps and back. ``enabled()``: torch has the precompile API and ``UNET_COMPILER_PRECOMPILE``
is on. How keys, guards and the dynamic policy work: DEVELOPERS.md, "Precompiled regions".
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import re
import sys
import threading
import time
import types
from collections import defaultdict

import torch

from .. import settings
from ..overrides import is_code
from ..reasons import error_summary

log = logging.getLogger(__name__)

#: this pack's top-level module name; inside ComfyUI it is the install path (``nodes.load_custom_node``)
PACKAGE = __name__.rsplit(".compiler.lifecycle.variants", 1)[0]
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
#: what ComfyUI's model patcher sets on its ops per load (partial loads, patches; Dynamic VRAM's slot,
#: pins, per-call prefetch and LoRA), read by no compiled code: inside a compiled call a leaf's cast
#: flag is off and its weight functions are empty, because ``cast.applied`` shows leaves that cast per
#: call as plain ones, so a load's split, and what comes and goes between calls, is not a key. Also
#: what the newest ComfyUI sets on blocks as they run: its compiler's allocation recording
#: (``_comfy_malloc_graph``), its block graphs (``_comfy_graph``), a block's buffers kept across
#: steps (``_comfy_cross_step_state``) and a resident weight bank (``_resident_bank``)
_COMFY_LOAD_STATE = frozenset({"comfy_cast_weights", "prev_comfy_cast_weights", "comfy_patched_weights",
                               "weight_function", "bias_function", "weight_lowvram_function",
                               "bias_lowvram_function", "seed_key", "_pin_state", "_pins", "_v", "_v_signature",
                               "_v_weight", "_v_bias", "_prefetch", "_v_block", "_v_block_faulted",
                               "_comfy_graph", "comfy_force_cast_weights", "comfy_need_lazy_init_bias",
                               "weight_comfy_model_dtype", "bias_comfy_model_dtype", "_comfy_malloc_graph",
                               "_comfy_cross_step_state", "_resident_bank"})



def enabled() -> bool:
    """Regions compile to precompiled variants (torch >= 2.10, ``UNET_COMPILER_PRECOMPILE`` on)."""
    return settings.flag("PRECOMPILE") and _api_present()


def size_oblivious() -> bool:
    """Whether dynamic variants are traced size-obliviously: a size-1 dim (a 64 px side at an SD
    UNet's deepest level) is one more value of its symbol, not a graph of its own
    (``UNET_COMPILER_SIZE_OBLIVIOUS``)."""
    return settings.flag("SIZE_OBLIVIOUS") and enabled() and hasattr(fx_config(), "backed_size_oblivious")


def fx_config():
    import torch.fx.experimental._config as fx_config
    return fx_config


@functools.lru_cache(maxsize=1)
def _api_present() -> bool:
    """What precompiling calls: ``torch.compile(fn).aot_compile`` and ``torch.compiler.
    load_compiled_function``. torch 2.11 has ``torch._dynamo.aot_compile`` but no ``aot_compile`` on a
    compiled function: there every region would fall back."""
    try:
        from torch._dynamo import aot_compile  # noqa: F401 - torch >= 2.10
        return hasattr(torch.compiler, "load_compiled_function") and \
            hasattr(torch.compile(_probe_body), "aot_compile")
    except Exception:
        return False


def _probe_body(x):   # compiled by nothing: torch.compile only wraps it
    return x


def guard_filter(entries):
    """Which of a trace's guards a variant keeps (those that check values); the functions it found
    at module globals, whose guards check identity and are dropped, go to :func:`collecting`'s list."""
    found = getattr(_COLLECTING, "found", None)
    for e in entries if found is not None else ():
        if (e.is_global and e.guard_type in ("CLOSURE_MATCH", "FUNCTION_MATCH") and e.has_value
                and isinstance(e.value, types.FunctionType) and (got := (e.name, _plain(e.value))) not in found):
            found.append(got)
    return [e.guard_type in _KEEP and not e.is_global and "__mro__" not in e.name and "type(" not in e.name
            for e in entries]


_COLLECTING = threading.local()
#: the variant keys the running UNet call's regions met (its accelerator's set: :func:`meeting`)
_MEETING: contextvars.ContextVar = contextvars.ContextVar("unet_compiler_variant_keys", default=None)


@contextlib.contextmanager
def meeting(keys: set):
    """Inside the block (one model's UNet call) each variant key its regions look up goes to ``keys``:
    what that model's compile cache entry saves of the process's variants."""
    token = _MEETING.set(keys)
    try:
        yield
    finally:
        _MEETING.reset(token)


def met(key: str) -> None:
    keys = _MEETING.get()
    if keys is not None:
        keys.add(key)


@contextlib.contextmanager
def collecting():
    """Inside the block this thread's traces record the functions they found at module globals
    (guard name, :func:`_plain` of the function) into the list it yields."""
    prev, _COLLECTING.found = getattr(_COLLECTING, "found", None), []
    try:
        yield _COLLECTING.found
    finally:
        _COLLECTING.found = prev


#: a trace's guard source: ``G['name']`` then attributes (``.attr``) or items (``['key']``, ``[0]``)
_ROOT = re.compile(r"^G\['([^']+)'\]")
_STEP = re.compile(r"^(?:\.(\w+)|\['([^']+)'\]|\[(\d+)\])")
_IMPORT = "__import_"


def _resolve(name: str, g: dict):
    """(container, attribute) where guard source ``name`` reads its value now, or None where it does
    not resolve to an attribute: ``G['__import_a_dot_b']`` is module ``a.b``, other ``G`` names
    are the variant's globals ``g``."""
    m = _ROOT.match(name)
    if m is None:
        return None
    root, rest = m.group(1), name[m.end():]
    if root.startswith(_IMPORT):
        obj = sys.modules.get(root[len(_IMPORT):].replace("_dot_", "."))
    else:
        obj = g.get(root, _MISSING)
    if obj is None or obj is _MISSING:
        return None
    if not rest:
        return None if root.startswith(_IMPORT) else (_Globals(g), root)
    steps = []
    while rest:
        m = _STEP.match(rest)
        if m is None or not m.group(1):     # (an item: not a binding another package sets)
            return None
        steps.append(m.group(1))
        rest = rest[m.end():]
    for attr in steps[:-1]:
        obj = getattr(obj, attr, _MISSING)
        if obj is _MISSING:
            return None
    return obj, steps[-1]


_MISSING = object()


class _Globals:
    """A globals dict read as attributes (what ``getattr`` checks of a binding need)."""
    __slots__ = ("_g",)

    def __init__(self, g: dict):
        self._g = g

    def __getattr__(self, name):
        try:
            return self._g[name]
        except KeyError:
            raise AttributeError(name) from None


def _bound(fn) -> bool:
    """Whether each function ``fn`` found at a module global is still the one there (:func:`bind`)."""
    return _unbound(fn) is None


def _unbound(fn) -> str | None:
    """The guard name of the first function ``fn`` found at a module global that is another now."""
    for d, o, k, v, name in getattr(fn, "bindings", ()):
        if (d.get(k, _MISSING) if d is not None else getattr(o, k, _MISSING)) is not v:
            return name
    return None


def bind(fn, check: bool = False) -> tuple[list, str | None]:
    """Where a variant's functions at module globals (``fn.global_functions``) are bound now:
    (the module's dict or None, container, attribute, the function, its guard name) each, which a
    call compares by identity (:func:`_bound`); and, ``check`` (a variant from the compile cache),
    the first whose function there now is not the one it traced (another package set its own at
    that name, or it is gone), or None."""
    module = sys.modules.get(getattr(fn, "globals_module", None) or "")
    g = vars(module) if module is not None else {}
    out = []
    for name, traced in getattr(fn, "global_functions", ()):
        where = _resolve(name, g)
        now = getattr(where[0], where[1], _MISSING) if where is not None else _MISSING
        if check and (now is _MISSING or _plain(now) != traced):
            return out, f"the function at {name}"
        if now is not _MISSING:
            o = where[0]
            d = o._g if isinstance(o, _Globals) else vars(o) if isinstance(o, types.ModuleType) else None
            out.append((d, o, where[1], now, name))
    return out, None


def _type_name(t: type) -> str:
    return f"{t.__module__}.{t.__qualname__}"


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _plain(v) -> str:
    """A value a class or a closure holds, as its key reads it: plain values (and tuples of them) by
    repr, a class by name, a function by its code, anything else by its type's name."""
    if isinstance(v, _PLAIN) or (isinstance(v, (tuple, frozenset)) and all(isinstance(x, _PLAIN) for x in v)):
        return repr(v)
    if isinstance(v, type):
        return _type_name(v)
    if isinstance(v, (staticmethod, classmethod)):
        v = v.__func__
    code = getattr(v, "__code__", None)
    if code is not None:
        cells = [_cell(c, v) for c in (getattr(v, "__closure__", None) or ())]
        return f"{v.__qualname__}:{_code(code)}:{cells}"
    return f"<{_type_name(type(v))}>"


def _cell(cell, fn) -> str:
    """A closure cell of ``fn`` as :func:`_plain` reads it (``fn`` itself: "self")."""
    try:
        value = cell.cell_contents
    except ValueError:   # an empty cell
        return "<empty>"
    return "self" if value is fn else _plain(value)


@functools.lru_cache(maxsize=None)
def _code(code) -> str:
    """A code object by what it runs (its bytecode and constants, nested code alike), never by address."""
    consts = [_code(c) if hasattr(c, "co_code") else repr(c) if isinstance(c, _PLAIN) or c is Ellipsis
              else f"<{type(c).__name__}>" for c in code.co_consts]
    return hashlib.sha256(code.co_code + repr((code.co_names, consts)).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def type_key(t: type) -> str:
    """A module class as a variant key names it: module and qualname; for a class made inside a
    function (several classes then share one name: ComfyUI's ``mixed_precision_ops`` and
    ``scaled_fp8_ops`` make one per setting), also a digest of what its methods compute with: their
    code, their closures' values and the class's plain attributes, over every such class of its MRO.
    (The variants' guards keep no identity of the class: the key tells such classes apart.)"""
    local = [c for c in t.__mro__ if "<locals>" in c.__qualname__]
    if not local:
        return _type_name(t)
    h = hashlib.sha256()
    for c in local:
        for k, v in sorted(vars(c).items()):
            if k not in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"):
                h.update(f"{k}={_plain(v)}\n".encode())
    return f"{_type_name(t)}#{h.hexdigest()[:16]}"


def _attribute(name: str, value) -> str:
    """An instance attribute as a variant key reads it: its name, and for code set on the instance (a
    function, a method, a callable object that is no module) what that code is."""
    if is_code(value):
        return f"{name}={_plain(getattr(value, '__func__', value))}"
    return name


def structure(module: torch.nn.Module, args, widths: bool = True) -> tuple | None:
    """What a call's variant depends on besides its guards, or None when only dynamo can follow the
    region (hooks, or a submodule whose ``forward`` an instance attribute replaces). ``widths``: the
    weights' shapes too (static code: a block of other widths is another key, not a miss that
    would make the first key's code dynamic)."""
    from torch.nn.modules import module as nn_module
    # (a registration hook that only counts, the graphs' structure watch, changes no module)
    registration = nn_module._global_module_registration_hooks.values()
    if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
            or any(not getattr(h, "counts_only", False) for h in registration)):
        return None
    parts = []
    for name, m in module.named_modules():
        d = m.__dict__
        if d["_forward_hooks"] or d["_forward_pre_hooks"] or (m is not module and "forward" in d):
            return None
        shapes = tuple(tuple(p.shape) for p in d["_parameters"].values() if p is not None) if widths else ()
        parts.append((name, type(m), tuple(_attribute(k, d[k]) for k in d if k not in _STD and k not in _COMFY_LOAD_STATE),
                      shapes))
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
        #: the digests of variants from the compile cache that no process of this install can use (torch
        #: could not load them, or code they traced has changed since): left out of later saves. One
        #: another function bound here rejects stays (another setup of the install may use it)
        self.rejected: set[str] = set()
        self.failures: list[str] = []   # why a call matched no variant (guard parts), oldest first
        #: key -> (why it could not be precompiled, a WeakSet of the region modules whose calls met it):
        #: here, not on the region body, which dynamo pickles into later variants' guard state
        self.misses: dict[str, tuple] = {}
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
            text = repr((getattr(body, "__qualname__", "body"), [(n, type_key(t), keys, shapes)
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

    def waiting(self, key: str) -> int:
        """How many of ``key``'s variants from the compile cache are not loaded yet (a key loading now:
        at least 1)."""
        with self.lock:
            return len(self.pending.get(key, ())) or int(key in self.loading)

    def candidates(self, key: str) -> list:
        with self.lock:
            while key in self.loading:       # the preload thread has it in hand: wait, never a miss
                self._loaded.wait()
            waiting = self.pending.pop(key, None)
            if waiting:
                self._adopt(key, [(digest, _deserialize(blob, self.rejected)) for digest, blob in waiting])
            if key in self._unchecked:
                self._unchecked.discard(key)
                self._reload_if_other_state(key)
            # (a variant runs the module-level functions it traced as they were: not while another is
            # bound at one's name, as a node that patches a ComfyUI function leaves it)
            live = self.live[key]
            return live if all(map(_bound, live)) else [fn for fn in live if _bound(fn)]

    def unbound_reason(self, key: str) -> str | None:
        """Why ``key``'s variants are not served now: a function one traced is another now (a node
        set its own at that name), said as a recompile's guard; None when none is so."""
        with self.lock:
            name = next(filter(None, map(_unbound, self.live.get(key, ()))), None)
        return None if name is None else f"{name}: another function is there now than the code traced"

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
        now = dispatch_state()
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
                tls = dispatch_state()
                while True:
                    with self.lock:
                        key = next(iter(self.pending), None)
                        if key is None:
                            return
                        waiting = self.pending.pop(key)
                        self.loading.add(key)
                    loaded = []
                    try:
                        loaded = [(digest, _deserialize(blob, self.rejected)) for digest, blob in waiting]
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
            fn.from_cache, fn.bindings = False, bind(fn)[0]
            self.live[key].append(fn)
            self.compiled += 1
            if blob is not None:
                self.blobs[key][hashlib.sha256(blob).hexdigest()] = blob

    def serialized(self, keys: set | None = None) -> dict[str, list[bytes]]:
        """{key: [variant bytes]} of everything this process compiled or loaded (what a save writes),
        of ``keys`` only where given (the variants one model met: another model's are not its entry's)."""
        with self.lock:
            return {k: list(v.values()) for k, v in self.blobs.items() if v and (keys is None or k in keys)}


def serialize(fn) -> bytes:
    """A variant's bytes: the pack's module name it was pickled under, a newline, the functions it
    found at module globals and the module whose globals its code reads, as JSON (:func:`collecting`),
    a newline, torch's bytes."""
    from torch._dynamo.aot_compile import AOTCompiledFunction
    header = {"module": getattr(fn, "globals_module", None), "functions": getattr(fn, "global_functions", [])}
    return (PACKAGE.encode() + b"\n" + json.dumps(header).encode() + b"\n"
            + AOTCompiledFunction.serialize(fn).serialized_data)


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


def dispatch_state() -> tuple:
    """This thread's dispatch-key state, which a deserialized variant's tensor guards keep."""
    return (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


_DESERIALIZING = threading.Lock()    # one at a time: ``_aliases`` edits sys.modules meanwhile


def _deserialize(blob: bytes, reject: set | None = None):
    """A variant from its bytes, or None (logged): torch could not load it, code it traced has
    changed since (:func:`changed_source`), or a function it traced is not the one bound now
    (:func:`bind`). ``reject``: where the digests of the first two kinds go (no process of this
    install can use them: the entry's next save leaves them out)."""
    changed = bound = None
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
        saved, _, rest = blob.partition(b"\n")
        functions, _, data = rest.partition(b"\n")
        with _DESERIALIZING, _aliases(saved.decode()):
            fn = AOTCompiledFunction.deserialize(data)
            changed = changed_source(fn)
            if not changed:
                header = json.loads(functions)
                fn.globals_module, fn.global_functions = header["module"], header["functions"]
                fn.bindings, bound = bind(fn, check=True)
    except Exception as e:
        log.warning("UNet Compiler: a precompiled region from the compile cache could not be loaded (%s); "
                    "not used, and left out of the entry's next save", error_summary(e))
        changed = "unloadable"
    if changed and reject is not None:
        reject.add(hashlib.sha256(blob).hexdigest())
    if changed and changed != "unloadable":
        log.warning("UNet Compiler: a precompiled region from the compile cache was compiled from other code "
                    "than this process runs (%s changed: ComfyUI or a package updated between its releases); "
                    "not used, and left out of the entry's next save", changed)
    elif bound:
        log.info("UNet Compiler: a precompiled region from the compile cache traced another function than "
                 "the one bound now (%s: another package set its own there); not used here", bound)
    return None if changed or bound else fn


def changed_source(fn) -> str | None:
    """The first function a variant traced whose source differs now from when it was compiled
    ("module lines a-b"), or None. The variant runs that code as compiled, and its key names
    ComfyUI by version alone (a git update between releases keeps it), so a change must be found
    here. Checked with the torch's own record of what each variant inlined (its source info)."""
    info = getattr(getattr(fn, "_artifacts", None), "source_info", None)
    for src in sorted(getattr(info, "inlined_sources", ()) or (), key=lambda s: (s.module, s.firstlineno)):
        where = f"{src.module} lines {src.firstlineno}-{src.lastlineno}"
        module = sys.modules.get(src.module)
        if module is None:
            return f"{where} (not imported)"
        try:
            lines = inspect.getsourcelines(module)[0][src.firstlineno - 1:src.lastlineno - 1]
        except (OSError, TypeError):
            return f"{where} (no source)"
        if hashlib.sha256("".join(lines).encode()).hexdigest() != src.checksum:
            return where
    return None


def failed_parts(fn, f_locals) -> list[str]:
    """The guard of ``fn`` a call failed, worded by dynamo's own helper (for the recompile report)."""
    try:
        from torch._dynamo.guards import get_guard_fail_reason_helper
        text = get_guard_fail_reason_helper(fn._artifacts.guard_manager, f_locals, None, None)
    except Exception:
        return []
    text = text.split("\nUser stack trace:", 1)[0]
    return [text[len("None: "):] if text.startswith("None: ") else text]

