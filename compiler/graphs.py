"""CUDA graphs of accelerated regions, one per (region, input signature).

Graphs here are per leaf region: ComfyUI's dispatch between regions stays eager Python (a whole
UNet call captured as one graph is call_graph.py's, on this class with the UNet as its region).
Weights are live: each UNet call starts by reading the addresses of
every region's parameters and buffers (``begin_call``), so an in-place update is seen by the next
replay and a moved or replaced parameter drops the region's graphs, as does a change of its module
tree (a submodule swapped, inserted or taken out); the region calls themselves read no weights. A
graph copies its result into output buffers allocated outside any capture and serves aliases of
them, not copies; a replay that would write a buffer a caller still holds (an
earlier result kept, or a view of it) runs the region's own launches instead. An input that is
exactly another graph's output buffer (the previous region's result) is read in place, not copied.
At most ``max_shapes`` graphs per region and, on CUDA, static buffers plus the private pool the
captures grew (their temporaries) within a budget of the card's memory (so the number of shapes
follows the latent size); an out-of-memory capture leaves that shape without a
graph, any other failed capture turns graphs off for the model, and its calls run without them.
``release()`` frees every graph (ComfyUI's unload callback calls it); ``idle()``, at a prompt's end,
keeps them for the next prompt while the card has room. ``measured``
(backend auto on CUDA): a graph is kept only where its replay measured faster than the region's
own launches (launch-bound sizes); elsewhere that shape runs without one. No capture
while the background compile thread runs: a call then may run a region's own code in place of a
variant still compiling, and a graph would keep that. The serving rules: docs/internals.md.
"""
from __future__ import annotations

import logging
import operator
import time
import weakref
from collections import Counter

import torch

from torch.multiprocessing.reductions import StorageWeakRef

from .compat.comfy import is_interrupt, is_oom, reserve_vram
# (a name of its own here: the host-time bench stands it in on the meta device)
from .compat.torch_version import autocast_dtype as _autocast_state
from .reasons import error_summary

log = logging.getLogger(__name__)


#: one side stream per device for the whole process: torch keeps a cuBLAS workspace per (handle,
#: stream) and never frees it, so a stream per accelerator cost ~32 MiB each time a model compiled
_SIDE_STREAMS: dict = {}

#: the share of a card's memory one model's static graph buffers may hold (SDXL at 2x1024x1024 holds
#: roughly 3 GB per shape: one shape on a 24 GB card, none at that size on an 8 GB one)
BUDGET_SHARE = 1 / 8


class CudaGraphs:
    """torch.cuda.CUDAGraph capture/replay (the one production implementation;
    tests on machines without a GPU hand :class:`RegionGraphs` a stand-in with
    the same methods). First calls and captures run on the process's side stream
    for the device; the caller's stream is restored even when a capture fails."""

    def __init__(self):
        self.pool = None
        self.streams: dict = _SIDE_STREAMS

    def usable(self, tensors) -> str | None:
        if not tensors or not all(t.is_cuda for t in tensors):
            return "inputs not on CUDA"
        dev = tensors[0].device
        if any(t.device != dev for t in tensors) or (dev.index is not None and dev.index != torch.cuda.current_device()):
            return "inputs not on the current CUDA device"
        if torch.cuda.is_current_stream_capturing():
            return "another capture is in progress"
        return None

    def _on_side_stream(self, device, fn):
        side = self.streams.get(device)
        if side is None:
            side = self.streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = fn()
        current.wait_stream(side)
        return out

    def first_call(self, fn, device):
        return self._on_side_stream(device, fn)

    def budget(self, device) -> int | None:
        """Bytes of static buffers one model's graphs may hold on ``device``: BUDGET_SHARE of the card."""
        return int(torch.cuda.get_device_properties(device).total_memory * BUDGET_SHARE)

    def timed(self, fn, device, reps: int = 3):
        """(``fn()``'s last result, its fastest wall time in seconds): each call on the side stream
        between two synchronizations, so host launches and device time both count."""
        best, out = float("inf"), None
        for _ in range(reps):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = self._on_side_stream(device, fn)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return out, best

    def reserved(self, device) -> int | None:
        """Bytes torch's allocator holds on ``device`` (a capture's growth of it is its pool's); None
        under cudaMallocAsync, where a capture takes graph memory torch does not count there and reuses
        blocks the allocator already held (its growth can read 0 for GiBs of outputs: docs/gpu.md)."""
        if torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync":
            return None
        return torch.cuda.memory_reserved(device)

    def short_of_room(self, device) -> str | None:
        """Why graphs should not outlive a prompt on ``device``: the card (outside torch's cache) has
        less than BUDGET_SHARE of its memory free; None when it has room."""
        free, total = torch.cuda.mem_get_info(device)
        if free < total * BUDGET_SHARE:
            return f"{free / 2**20:.0f} MiB free on the card, under {BUDGET_SHARE:.1%} of it"
        return None

    def trim(self, new_pool: bool = False) -> None:
        """Cached blocks that freed graphs or a failed capture left go back to the driver (where
        ComfyUI's memory accounting sees them); ``new_pool``: every graph is gone, the next capture
        starts a new pool."""
        if new_pool:
            self.pool = None
        torch.cuda.empty_cache()

    def capture(self, fn, device):
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()

        def record():
            # thread_local: CUDA work on ComfyUI's other threads (previews) does not abort the capture
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                return fn()
            finally:
                g.capture_end()
        return g, self._on_side_stream(device, record)


def _static_copy(a: torch.Tensor) -> torch.Tensor:
    """A buffer with ``a``'s exact strides (clone() would make non-dense inputs contiguous)."""
    return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device).copy_(a)


def _sig(args) -> tuple | None:
    sig = []
    for a in args:
        if a is None:
            sig.append(None)
        elif not isinstance(a, torch.Tensor):
            return None  # a non-tensor input: not graphable
        elif 0 in a.stride() and a.numel() > 1:
            return None  # a broadcast (stride-0) input: no static buffer can alias it
        else:
            sig.append((a.shape, a.stride(), a.dtype, a.device))   # (never under autograd: run() checks)
    return tuple(sig)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _outputs(out) -> tuple:
    """The tensors a region returned: one tensor, or a tuple or list of tensors and Nones (a DiT
    block's ``(img, txt)``; SD3's last joint block gives ``(None, x)``); anything else cannot live
    in a static buffer (TypeError)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if type(out) in (tuple, list) and all(o is None or isinstance(o, torch.Tensor) for o in out) and \
            any(o is not None for o in out):
        return tuple(o for o in out if o is not None)
    raise TypeError(f"region returned {type(out).__name__}, not a tensor or a tuple of tensors")


def _structured(out, tensors):
    """``tensors`` (one per tensor of ``out``) in ``out``'s structure."""
    if isinstance(out, torch.Tensor):
        return tensors[0]
    it = iter(tensors)
    return type(out)(None if o is None else next(it) for o in out)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _same_memory(a: torch.Tensor, s: torch.Tensor) -> bool:
    """``a`` is ``s``'s memory (their shapes, strides and dtypes are equal: one signature)."""
    return a.data_ptr() == s.data_ptr() and (not a.is_meta or _storage(a) == _storage(s))


class _Buffer:
    """A static output buffer: allocated outside any capture (a graph copies its region's result into
    it as its last op), so no other graph's temporaries in the shared pool can overwrite it, and served
    to callers as an alias, not a copy. ``held()``: a tensor outside the graphs still refers to its
    memory (a call's result not yet dropped, or a view of it): the next replay writing it must wait.
    ``pin(view)``: a later graph reads its input in place through ``view``, which is the graphs' own."""
    __slots__ = ("tensor", "_ref", "_base", "_pins")

    def __init__(self, like: torch.Tensor):
        self.tensor = torch.empty_like(like)   # its strides where dense, else contiguous (no overlaps)
        self._ref = StorageWeakRef(self.tensor.untyped_storage())
        self._base = 1 << 62
        self._pins: weakref.WeakSet | None = None

    def settle(self) -> None:
        """The graphs' own references are all taken (after the capture): any more is a caller's."""
        self._base = torch._C._storage_Use_Count(self._ref.cdata)

    def pin(self, view: torch.Tensor) -> None:
        if self._pins is None:
            self._pins = weakref.WeakSet()
        self._pins.add(view)

    def held(self) -> bool:
        base = self._base + len(self._pins) if self._pins else self._base
        return torch._C._storage_Use_Count(self._ref.cdata) > base


class _Graph:
    """One captured graph of a region at one input signature: its static inputs (None for a
    non-tensor argument; an input that was another region's output at capture reads that region's
    output buffer in place, ``chained``), its output buffers and the output structure it serves;
    ``weights``: the addresses of the cast weights it was captured with (Dynamic VRAM's slots)."""
    __slots__ = ("graph", "static_in", "outs", "static_out", "chained", "weights")

    def __init__(self, graph, static_in, outs, static_out, chained, weights=None):
        self.graph, self.static_in, self.outs, self.static_out, self.chained = \
            graph, static_in, outs, static_out, chained
        #: the per-call cast weights' addresses it reads in place (None: the region's own parameters)
        self.weights = weights

    def copy_in(self, args, checked: bool = True) -> bool:
        """``args`` into the static inputs; False (nothing written) where a buffer the replay writes
        is held by a caller: this graph's outputs, or the buffer of a chained input that ``args`` do
        not already hold."""
        if checked:
            for b in self.outs:
                if b.held():
                    return False
        for i, s in enumerate(self.static_in):
            if s is None:
                continue
            a = args[i]
            b = self.chained.get(i)
            if b is not None:
                if _same_memory(a, s):
                    continue
                if checked and b.held():
                    return False
            s.copy_(a)
        return True

    def served(self, copies: bool = False):
        """What a call gets: aliases of the output buffers, in the region's own structure (no copy;
        the buffers' ``held`` keeps a later replay from writing them while a caller holds one), or
        copies of them (``copies``)."""
        take = torch.Tensor.clone if copies else torch.Tensor.detach
        if isinstance(self.static_out, torch.Tensor):
            return take(self.static_out)
        return type(self.static_out)(None if o is None else take(o) for o in self.static_out)

    def tensors(self) -> list:
        return [t for t in self.static_in if t is not None] + [b.tensor for b in self.outs]


class _Region:
    __slots__ = ("slots", "ptrs", "graphs", "seen", "refused", "kept", "_dicts", "_names", "_none", "tree", "moves")

    def __init__(self, module, cast: bool = False):
        # the module tree as captured: a submodule swapped in (an object patch), inserted or removed makes
        # the graphs stale, however the weights stand (``begin_call`` compares it after STRUCTURE moved)
        mods = list(module.modules())
        self.tree = tuple(map(id, mods))
        track(mods)
        # (parameter or buffer dict of its owner module, name) for every parameter/buffer: read live
        # at each UNet call, so a replaced Parameter (ComfyUI's set_attr_param) or moved data is noticed.
        # The dicts, not their modules, are held: a region's entry must not keep its own key (the
        # region module) alive. Made during a cast call (its leaves show the call's cast weights): read
        # at the next UNet call, outside the casts (the cast weights are checked per call).
        self.slots = [(m._parameters, n) for m in mods for n in m._parameters] + \
                     [(m._buffers, n) for m in mods for n in m._buffers]
        # read in C (map) where a tensor is: the slots holding None (a bias=False) apart
        held = [(d, n) for d, n in self.slots if d.get(n) is not None]
        self._dicts, self._names = [d for d, _ in held], [n for _, n in held]
        # the slots holding None, read in C where each is a dict (as torch makes them)
        none = [(d, n) for d, n in self.slots if d.get(n) is None]
        self._none = ([d for d, _ in none], [n for _, n in none]) if all(type(d) is dict for d, _ in none) else none
        self.ptrs = None if cast else self.weight_ptrs()
        self.graphs: dict = {}   # signature -> _Graph
        self.seen: set = set()
        self.refused: dict = {}  # signature -> why it gets no graph (an out-of-memory capture)
        self.kept: set = set()   # signatures whose graph measured faster (captured again unmeasured)
        self.moves = False       # its weights moved inside a UNet call (block swap): no graphs from then on

    def weight_ptrs(self) -> tuple:
        """The address of every parameter and buffer (None where a slot holds none), the slots that held
        a tensor at the start first: one value for one state of the weights."""
        try:
            ptrs = tuple(map(_DATA_PTR, map(operator.getitem, self._dicts, self._names)))
        except (KeyError, TypeError):   # a slot gone or set to None
            ptrs = tuple([None if (t := d.get(n)) is None else t.data_ptr() for d, n in zip(self._dicts, self._names, strict=True)])
        now = list(map(dict.get, *self._none)) if type(self._none) is tuple else [d.get(n) for d, n in self._none]
        if now.count(None) == len(now):
            return ptrs
        return ptrs + tuple(None if t is None else t.data_ptr() for t in now)


_DATA_PTR = torch.Tensor.data_ptr


#: moves when a module a region holds registers a submodule (torch's global registration hook:
#: ComfyUI's object patches set through ``setattr``, another pack's ``append``) or a region container
#: holds other children (:func:`structure_moved`); graphs compare their regions' module trees, and
#: a call graph its leaves, only after it moved
STRUCTURE = [0]
_TRACKED: weakref.WeakSet = weakref.WeakSet()
_HOOK: list = []


def structure_moved() -> None:
    """A module tree the graphs may hold changed (a region container found longer or shorter)."""
    STRUCTURE[0] += 1


def _registered(module, name, submodule):
    try:
        if module in _TRACKED:
            STRUCTURE[0] += 1
    except TypeError:   # a module class that is not hashable: never tracked
        pass


_registered.counts_only = True   # (it changes no module: precompiled variants stay on, lifecycle/variants.py)


def track(modules) -> None:
    """Watch ``modules`` for a submodule set on them (once per process: the registration hook)."""
    if not _HOOK:
        hook = getattr(torch.nn.modules.module, "register_module_module_registration_hook", None)
        _HOOK.append(hook(_registered) if hook is not None else None)
    for m in modules:
        try:
            _TRACKED.add(m)
        except TypeError:   # not hashable (its class defines __eq__ alone): a change there is not seen
            pass


def tree(module) -> tuple:
    """What a region's graphs captured of its module tree: every module in it, by identity."""
    return tuple(map(id, module.modules()))


#: why a region runs without graphs: its weights moved inside a UNet call
MOVES = "its weights moved inside a UNet call (code set around the blocks: block swap)"

#: a measured graph is kept when its replay takes at most this share of the launches it replaces
KEEP_BELOW = 0.9


class RegionGraphs:
    def __init__(self, max_shapes: int = 4, graphs=None, budget: int | None = None, measured: bool = False,
                 copies: bool = False, thread=None):
        self.max_shapes = max_shapes
        #: the compile thread (a ``worker.Background``, or None): while it runs nothing is captured
        self.thread = thread
        self.measured = measured
        #: a replay serves copies of its output buffers, not aliases (whole UNet calls: a sampler may
        #: keep one call's result while it makes the next call)
        self.copies = copies
        #: set while another graph of the model captures or runs a UNet call whole: region calls then
        #: run their code as it is, inside that one graph
        self.aside = False
        #: set for a UNet call in which code another node set around the regions runs (``overrides``):
        #: a region's weights are compared with those its graphs hold before each replay or capture
        self.verify = False
        #: set while one of these graphs captures; while a call's first run or capture is being made
        self.capturing = self.recording = False
        self.graphs = graphs if graphs is not None else CudaGraphs()
        #: region module -> its graphs; weak keys: a region module that dies (its model dropped, or
        #: the module replaced) takes its graphs and static buffers with it, and a new module that
        #: happens to get the dead one's id() never finds the dead one's graphs
        self.regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._structure = STRUCTURE[0]
        #: storage -> the live graphs' output buffer in it: a later capture whose input is exactly that
        #: buffer reads it in place (no copy in)
        self._buffers: dict = {}
        self.stats: Counter = Counter()
        self.skipped: Counter = Counter()
        self.off: str | None = None
        #: static buffer bytes the graphs may hold (None: no limit; set from the card at the first capture)
        self.budget = budget
        self._budget_known = False
        #: why the graphs were last freed, for the report
        self.released: str | None = None
        #: the device of the captures (None before the first)
        self.device = None
        #: called once if graphs turn off for this model (the backend then times calls as launched)
        self.on_off = None
        #: bytes the captures grew the allocator's reservation by (the private pool: the temporaries the
        #: graphs replay into); None: not measured (a stand-in without ``reserved``, cudaMallocAsync)
        self.pool_bytes: int | None = None
        #: the pool's part ComfyUI's free-memory count is told about (``_account``); given back when
        #: these graphs go, or with this object
        self.reserved_for_comfy = 0
        weakref.finalize(self, reserve_vram, id(self), 0)

    def _entries(self):
        return [e for r in self.regions.values() for e in r.graphs.values()]

    @property
    def bytes(self) -> int:
        """Static input and output buffers held (each once: a chained input is another graph's output)."""
        seen = {id(t): t for e in self._entries() for t in e.tensors()}
        return _bytes(seen.values())

    @property
    def held(self) -> int:
        """Device memory the graphs hold: their static buffers (allocated outside the captures) plus the
        pool the captures grew (the temporaries), where measured."""
        return self.bytes + (self.pool_bytes or 0)

    def begin_call(self) -> None:
        """A UNet call starts (``Accelerator.active``; region calls happen only inside one): each region
        whose parameters or buffers moved or were replaced since its graphs were captured loses them,
        so the region calls of this UNet call read no weights; so does each region whose module tree
        changed (a submodule swapped, inserted or removed), which is planned again."""
        moved, self._structure = STRUCTURE[0] != self._structure, STRUCTURE[0]
        for module, reg in list(self.regions.items()):
            if moved and tree(module) != reg.tree:
                if reg.graphs:
                    self.stats["dropped for changed modules"] += len(reg.graphs)
                    self._drop(reg.graphs.values())
                    reg.graphs.clear()
                    self._account()
                self.regions[module] = _Region(module)   # between calls: its weights as they stand
                continue
            ptrs = reg.weight_ptrs()
            if reg.ptrs is None:   # made during a cast call: its addresses as they stand between calls
                reg.ptrs = ptrs
            elif ptrs != reg.ptrs:
                if reg.graphs:
                    self.stats["dropped for new weights"] += len(reg.graphs)
                    self._drop(reg.graphs.values())
                    reg.graphs.clear()
                    self._account()
                reg.seen.clear()
                reg.ptrs = ptrs

    def run(self, impl, module, args, weights=None, extra=None):
        """``impl(module, *args)``, through a captured graph where possible (inside a UNet call that
        :meth:`begin_call` opened). ``weights``: the addresses of the weights ComfyUI cast for this
        call (resident, pinned while it runs: ``cast.applied``); a graph captured with others is
        dropped and the call runs its launches (the next one captures again). ``extra``: what else
        the call's graph is keyed by (hashable)."""
        if self.off is not None or self.aside:
            return impl(module, *args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        why = "autograd on" if torch.is_grad_enabled() else self.graphs.usable(tensors)
        sig = _sig(args) if why is None else None
        if why is None and sig is None:
            why = "non-tensor or broadcast input"
        if why is not None:
            self.skipped[why] += 1
            return impl(module, *args)
        reg = self.regions.get(module)
        if reg is None:
            reg = self.regions[module] = _Region(module, cast=weights is not None)
        elif self.verify and weights is None and not reg.moves and reg.ptrs is not None \
                and reg.weight_ptrs() != reg.ptrs:
            # code another node set around the blocks moved this one's weights inside the call
            reg.moves = True
            if reg.graphs:
                self.stats["dropped for weights moved inside a call"] += len(reg.graphs)
                self._drop(reg.graphs.values())
                reg.graphs.clear()
                self._account()
        if reg.moves:
            self.skipped[MOVES] += 1
            return impl(module, *args)
        device = tensors[0].device
        key = (sig, _autocast_state(device.type), torch.is_inference_mode_enabled(), extra)
        entry = reg.graphs.get(key)
        if entry is not None and entry.weights != weights:
            self.stats["dropped for moved cast weights"] += 1
            self._drop([entry])
            del reg.graphs[key]
            reg.seen.discard(key)
            self._account()
            entry = None
        if entry is not None:
            try:
                if not entry.copy_in(args):
                    self.skipped["a buffer its replay writes was still held by an earlier call's result"] += 1
                    return impl(module, *args)
                entry.graph.replay()
            except Exception as e:
                if is_interrupt(e):
                    raise
                self._turn_off("replay", e)
                return impl(module, *args)
            self.stats["replays"] += 1
            return entry.served(self.copies)
        why = reg.refused.get(key)
        if why is None and self.thread is not None and self.thread.active:
            why = "a background compile was running"
        if why is not None:
            self.skipped[why] += 1
            return impl(module, *args)
        if key not in reg.seen:
            reg.seen.add(key)
            self.recording = True
            try:
                return self.graphs.first_call(lambda: impl(module, *args), device)
            finally:
                self.recording = False
        if len(reg.graphs) >= self.max_shapes:
            self.skipped[f"more than {self.max_shapes} shapes for one region"] += 1
            return impl(module, *args)
        budget = self._budget(device)
        if budget is not None and self.held + _bytes(args) + _bytes(args[:1]) > budget:
            self.skipped[f"graph memory at its budget ({budget / 2**20:.0f} MiB)"] += 1
            return impl(module, *args)
        return self._capture(reg, key, impl, module, args, device, weights)

    def _timed(self, fn, device):
        timed = getattr(self.graphs, "timed", None)
        if timed is not None:
            return timed(fn, device)
        t0 = time.perf_counter()   # a stand-in: its calls run at once
        return fn(), time.perf_counter() - t0

    def _budget(self, device) -> int | None:
        if self.budget is None and not self._budget_known:
            of_card = getattr(self.graphs, "budget", None)   # a stand-in without one: no limit
            self.budget = of_card(device) if of_card is not None else None
        self._budget_known = True
        return self.budget

    def _drop(self, entries) -> None:
        """``entries`` leave: their output buffers are no longer offered to later captures (a graph that
        reads one in place keeps it alive, and copies into it once it is not the region's output)."""
        for e in entries:
            for b in e.outs:
                self._buffers.pop(_storage(b.tensor), None)

    def release(self, why: str) -> int:
        """Free every graph and its static buffers (``why``: for the report); a region's next call at
        a shape it ran before captures again. Returns how many graphs were freed."""
        n = sum(len(r.graphs) for r in self.regions.values())
        for r in self.regions.values():
            r.graphs.clear()
        self._buffers.clear()
        if n:
            self.stats["released"] += n
            self.released = why
            self._trim(new_pool=True)
            self.pool_bytes = 0 if self.pool_bytes is not None else None
            self._account()
        return n

    def _account(self) -> None:
        """ComfyUI's free-memory count told what the pool holds: the captures' temporaries, idle between
        replays (the static buffers are allocated outside it, so ComfyUI counts them as used). Not where
        the pool is unmeasured (under cudaMallocAsync ComfyUI counts graph memory as used; a stand-in
        holds none)."""
        if self.pool_bytes is None:
            return
        self.reserved_for_comfy = reserve_vram(id(self), self.pool_bytes if self._entries() else 0)

    def prompt_ended(self, why: str) -> int:
        """The end of a prompt (ComfyUI's ON_CLEANUP): the graphs stay for the next prompt of this
        model and shapes while the card has room (the graphs object's ``short_of_room``; a stand-in
        without it holds no device memory); else they are freed like :meth:`release`, ``why`` and the
        shortage in the report. Returns how many graphs were freed."""
        n = sum(len(r.graphs) for r in self.regions.values())
        if not n:
            return 0
        short = getattr(self.graphs, "short_of_room", None)
        reason = short(self.device) if short is not None and self.device is not None else None
        if reason is not None:
            return self.release(f"{why}: {reason}")
        self.stats["kept across prompts"] += 1
        return 0

    def _trim(self, new_pool: bool = False) -> None:
        trim = getattr(self.graphs, "trim", None)   # a stand-in holds no device memory
        if trim is not None:
            trim(new_pool)

    def _turn_off(self, what, e):
        self.off = f"{what}: {error_summary(e)}"[:300]
        log.warning("UNet Compiler: CUDA graph %s failed (%s); graphs are off for this model and regions run "
                    "without them", what, self.off, exc_info=True)
        self.regions.clear()
        self._buffers.clear()
        self._account()
        if self.on_off is not None:
            self.on_off()

    def _static_inputs(self, args):
        """(static inputs, chained): a copy of each tensor argument, except one that is a live graph's
        output buffer or a view of it (the previous region's result, passed on), read in place."""
        static_in, chained = [], {}
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                static_in.append(None)
                continue
            b = self._buffers.get(_storage(a))
            if b is None or a.dtype != b.tensor.dtype:
                static_in.append(_static_copy(a))
                continue
            t = b.tensor
            if a.shape != t.shape or a.stride() != t.stride() or a.storage_offset() != t.storage_offset():
                t = t.as_strided(a.shape, a.stride(), a.storage_offset())
                b.pin(t)
            static_in.append(t)
            chained[i] = b
        return static_in, chained

    def _capture(self, reg, key, impl, module, args, device, weights=None):
        self.recording = True
        try:
            return self._capture_now(reg, key, impl, module, args, device, weights)
        finally:
            self.recording = False

    def _capture_now(self, reg, key, impl, module, args, device, weights=None):
        self.device = device
        static_in, chained = self._static_inputs(args)
        call_args = [s if s is not None else a for s, a in zip(static_in, args, strict=True)]
        try:
            # one eager call on the static buffers first: Triton specialises on pointer alignment
            # (the buffers are 512-byte aligned; the signature's first call may have seen less), and a
            # variant first met inside the capture cannot be compiled and loaded there; its result
            # gives the output buffers' shapes, allocated here, outside the capture
            measure = self.measured and key not in reg.kept   # measured once per signature
            if measure:
                first, t_launch = self._timed(lambda: impl(module, *call_args), device)
            else:
                first = self.graphs.first_call(lambda: impl(module, *call_args), device)
            outs = [_Buffer(t) for t in _outputs(first)]
            static_out = _structured(first, [b.tensor for b in outs])
            del first

            def body():
                # the region's result copied into the output buffers: the capture's last op
                for b, t in zip(outs, _outputs(impl(module, *call_args)), strict=True):
                    b.tensor.copy_(t)
                return static_out
            reserved = getattr(self.graphs, "reserved", None)   # a stand-in without it holds no device memory
            before = reserved(device) if reserved is not None else None
            self.capturing = True
            try:
                graph, _ = self.graphs.capture(body, device)
            finally:
                self.capturing = False
            after = reserved(device) if before is not None else None
            if after is not None:
                self.pool_bytes = (self.pool_bytes or 0) + max(0, after - before)
            for b in outs:
                b.settle()
            entry = _Graph(graph, static_in, outs, static_out, chained, weights)
            if measure:
                def replay():
                    entry.copy_in(args, checked=False)
                    graph.replay()
                _, t_graph = self._timed(replay, device)
                if t_graph > KEEP_BELOW * t_launch:   # not launch-bound here: no graph, no buffers
                    reg.refused[key] = "auto: replay not faster than launching its kernels"
                    self.stats["not kept"] += 1
                    self._account()
                    return entry.served(self.copies)   # (nothing replays into these buffers again)
                self.stats["kept"] += 1
                reg.kept.add(key)
            else:
                # the capture recorded the work without running it: replay once for this call's result
                graph.replay()
        except Exception as e:
            if is_oom(e):
                # this shape's buffers do not fit beside the model: no graph for it from now on (the
                # kind and the other shapes keep theirs); the call runs without one, and an
                # out-of-memory there too is the accelerated code's (Accelerator._run handles it)
                shape = "x".join(map(str, args[0].shape)) if isinstance(args[0], torch.Tensor) else "?"
                reg.refused[key] = f"out of memory at capture ({shape})"
                self.skipped[reg.refused[key]] += 1
                del static_in, call_args
                e.__traceback__ = None
                self._trim()
                return impl(module, *args)
            if is_interrupt(e):
                raise  # a cancel: graphs are not the problem
            self._turn_off("capture", e)
            return impl(module, *args)
        reg.graphs[key] = entry
        for b in outs:
            self._buffers[_storage(b.tensor)] = b
        self._account()
        self.stats["captured"] += 1
        self.stats["replays"] += 1
        return entry.served(self.copies)

    def history(self) -> str:
        """What became of the graphs, for a status line: dropped, kept across prompts, freed."""
        s, out = self.stats, ""
        if s["dropped for new weights"]:
            out += f", {s['dropped for new weights']} dropped when weights were replaced"
        if s["kept across prompts"]:
            out += f", kept across {s['kept across prompts']} prompt end(s)"
        if s["released"]:
            out += f", {s['released']} freed ({self.released})"
        return out

    def status_lines(self) -> list[str]:
        if self.off is not None:
            return [f"  cuda graphs: off after a failed {self.off}"]
        s = self.stats
        if not (s or self.skipped):
            auto = " (auto: kept where a replay measures faster)" if self.measured else ""
            return [f"  cuda graphs: on{auto}, nothing captured yet (a region is captured on its 2nd call at a shape)"]
        regions = sum(1 for r in self.regions.values() if r.graphs)
        budget = f" (budget {self.budget / 2**20:.0f} MiB)" if self.budget is not None else ""
        pool = f", {self.pool_bytes / 2**20:.0f} MiB graph pool" if self.pool_bytes is not None else ""
        if self.reserved_for_comfy:
            pool += f" ({self.reserved_for_comfy / 2**20:.0f} MiB of it idle, kept out of ComfyUI's free-memory count)"
        if self.measured:
            line = (f"  cuda graphs (auto): {s['kept']} kept where a replay measured faster than launching "
                    f"the region's kernels, {s['not kept']} not kept; "
                    f"{regions} region(s), {s['replays']} replays, {self.bytes / 2**20:.0f} MiB of static "
                    f"buffers held{pool}{budget}")
        else:
            line = (f"  cuda graphs: {s['captured']} captured for {regions} region(s), {s['replays']} replays, "
                    f"{self.bytes / 2**20:.0f} MiB of static buffers held{pool}{budget}")
        lines = [line + self.history()]
        if self.skipped:
            lines.append("  cuda graphs not used for: " + ", ".join(f"{k} x{n}" for k, n in sorted(self.skipped.items())))
        return lines
