"""CUDA graphs of accelerated regions, one per (region, input signature).

Graphs are per leaf region, never the whole UNet call: ComfyUI's dispatch between
regions stays eager Python. Weights are live: a graph's key holds the addresses of
its region's parameters and buffers, so an in-place update is seen by the next
replay and a replaced parameter drops the region's graphs. At most ``max_shapes``
graphs per region and, on CUDA, static inputs plus the private pool the captures grew (their
outputs and temporaries) within a budget of the card's memory (so the number of shapes follows the
latent size); an out-of-memory capture leaves that shape without a
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
import time
import warnings
import weakref
from collections import Counter

import torch

from .lifecycle import background
from .compat.comfy import is_interrupt, is_oom, reserve_vram

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
        blocks the allocator already held (on an H100 its growth read 0 for 2.9 GiB of outputs)."""
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


def _autocast_state(device_type: str):
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4: CUDA-only autocast queries
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


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


def _served(static_out):
    """What a call gets from a graph: a copy of its static output(s), in the region's own structure
    (a later replay overwrites the buffers)."""
    if isinstance(static_out, torch.Tensor):
        return static_out.clone()
    return type(static_out)(None if o is None else o.clone() for o in static_out)


def _replay(entry, args):
    """One served call of a captured graph: ``args`` copied into its static inputs, a replay, and a
    copy of its static output(s)."""
    graph, static_in, static_out = entry
    for s, a in zip(static_in, args, strict=True):
        if s is not None:
            s.copy_(a)
    graph.replay()
    return _served(static_out)


def _let_go(entries) -> None:
    """Free the static outputs of ``entries`` (graph, static inputs, static output) now. Under
    cudaMallocAsync torch warns on stderr for every captured allocation freed outside a capture (one
    line per output; SDXL's 227 regions: 227 lines at each unload); freed here through ``set_()``, a
    call of torch's own, the warning comes back as a Python warning, which is silenced. A tensor that
    cannot be emptied so (a parameter a region returned as is) is left to its owner."""
    outs = [t for e in entries for t in _outputs(e[2]) if not isinstance(t, torch.nn.Parameter)]
    if not outs:
        return
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.filterwarnings("ignore", message="Attempting uncaptured free of a captured allocation")
        for t in outs:
            try:
                t.set_()
            except RuntimeError:
                pass


def _entry_bytes(entry) -> int:
    _, static_in, static_out = entry
    return sum(t.numel() * t.element_size() for t in static_in if t is not None) + _bytes(_outputs(static_out))


class _Region:
    __slots__ = ("slots", "ptrs", "graphs", "seen", "refused", "kept")

    def __init__(self, module):
        # (parameter or buffer dict of its owner module, name) for every parameter/buffer: read live
        # each call, so a replaced Parameter (ComfyUI's set_attr_param) or moved data is noticed.
        # The dicts, not their modules, are held: a region's entry must not keep its own key (the
        # region module) alive, and one dict lookup per slot is all a replay pays for the check.
        self.slots = [(m._parameters, n) for m in module.modules() for n in m._parameters] + \
                     [(m._buffers, n) for m in module.modules() for n in m._buffers]
        self.ptrs = None
        self.graphs: dict = {}   # signature -> (graph, static inputs, static output)
        self.seen: set = set()
        self.refused: dict = {}  # signature -> why it gets no graph (an out-of-memory capture)
        self.kept: set = set()   # signatures whose graph measured faster (captured again unmeasured)

    def weight_ptrs(self) -> tuple:
        return tuple([None if (t := d.get(n)) is None else t.data_ptr() for d, n in self.slots])


#: a measured graph is kept when its replay takes at most this share of the launches it replaces
KEEP_BELOW = 0.9


class RegionGraphs:
    def __init__(self, max_shapes: int = 4, graphs=None, budget: int | None = None, measured: bool = False):
        self.max_shapes = max_shapes
        self.measured = measured
        self.graphs = graphs if graphs is not None else CudaGraphs()
        #: region module -> its graphs; weak keys: a region module that dies (its model dropped, or
        #: the module replaced) takes its graphs and static buffers with it, and a new module that
        #: happens to get the dead one's id() never finds the dead one's graphs
        self.regions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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
        #: bytes the captures grew the allocator's reservation by (the private pool: static outputs and
        #: every temporary the graphs replay into); None: not measured (a stand-in without ``reserved``)
        self.pool_bytes: int | None = None
        #: the pool's idle part ComfyUI's free-memory count is told about (``_account``); given back
        #: when these graphs go, or with this object
        self.reserved_for_comfy = 0
        weakref.finalize(self, reserve_vram, id(self), 0)

    @property
    def bytes(self) -> int:
        """Static input + output buffers held (the pool's temporaries come on top)."""
        return sum(_entry_bytes(e) for r in self.regions.values() for e in r.graphs.values())

    @property
    def held(self) -> int:
        """Device memory the graphs hold: static inputs plus the pool the captures grew (outputs and
        temporaries), never less than the static buffers themselves (under cudaMallocAsync a capture
        can reuse memory the allocator already reserved, so the growth undercounts); the static
        buffers alone where the pool is not measured."""
        if self.pool_bytes is None:
            return self.bytes
        return max(self.bytes, self.pool_bytes + sum(_bytes(static_in) for r in self.regions.values()
                                                     for _, static_in, _ in r.graphs.values()))

    def run(self, impl, module, args):
        """``impl(module, *args)``, through a captured graph where possible."""
        if self.off is not None:
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
            reg = self.regions[module] = _Region(module)
        ptrs = reg.weight_ptrs()
        if ptrs != reg.ptrs:
            if reg.graphs:
                self.stats["dropped for new weights"] += len(reg.graphs)
                _let_go(reg.graphs.values())
                reg.graphs.clear()
                self._account()
            reg.seen.clear()
            reg.ptrs = ptrs
        device = tensors[0].device
        key = (sig, _autocast_state(device.type), torch.is_inference_mode_enabled())
        entry = reg.graphs.get(key)
        if entry is not None:
            try:
                out = _replay(entry, args)
            except Exception as e:
                if is_interrupt(e):
                    raise
                self._turn_off("replay", e)
                return impl(module, *args)
            self.stats["replays"] += 1
            return out
        why = reg.refused.get(key)
        if why is None and background.BACKGROUND.active:
            why = "a background compile was running"
        if why is not None:
            self.skipped[why] += 1
            return impl(module, *args)
        if key not in reg.seen:
            reg.seen.add(key)
            return self.graphs.first_call(lambda: impl(module, *args), device)
        if len(reg.graphs) >= self.max_shapes:
            self.skipped[f"more than {self.max_shapes} shapes for one region"] += 1
            return impl(module, *args)
        budget = self._budget(device)
        if budget is not None and self.held + _bytes(args) + _bytes(args[:1]) > budget:
            self.skipped[f"graph memory at its budget ({budget / 2**20:.0f} MiB)"] += 1
            return impl(module, *args)
        return self._capture(reg, key, impl, module, args, device)

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

    def release(self, why: str) -> int:
        """Free every graph and its static buffers (``why``: for the report); a region's next call at
        a shape it ran before captures again. Returns how many graphs were freed."""
        n = sum(len(r.graphs) for r in self.regions.values())
        for r in self.regions.values():
            _let_go(r.graphs.values())
            r.graphs.clear()
        if n:
            self.stats["released"] += n
            self.released = why
            self._trim(new_pool=True)
            self.pool_bytes = 0 if self.pool_bytes is not None else None
            self._account()
        return n

    def _account(self) -> None:
        """ComfyUI's free-memory count told what the pool holds idle: the pool less the static outputs
        in it (those are allocated, so ComfyUI counts them as used). Not where the pool is unmeasured
        (under cudaMallocAsync ComfyUI counts graph memory as used; a stand-in holds none)."""
        if self.pool_bytes is None:
            return
        outs = sum(_bytes(_outputs(e[2])) for r in self.regions.values() for e in r.graphs.values())
        self.reserved_for_comfy = reserve_vram(id(self), self.pool_bytes - outs)

    def idle(self, why: str) -> int:
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
        self.off = f"{what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        log.warning("UNet Compiler: CUDA graph %s failed (%s); graphs are off for this model and regions run "
                    "without them", what, self.off, exc_info=True)
        for r in self.regions.values():
            _let_go(r.graphs.values())
        self.regions.clear()
        self._account()
        if self.on_off is not None:
            self.on_off()

    def _capture(self, reg, key, impl, module, args, device):
        self.device = device
        static_in = [_static_copy(a) if isinstance(a, torch.Tensor) else None for a in args]
        call_args = [s if s is not None else a for s, a in zip(static_in, args, strict=True)]
        try:
            # one eager call on the static buffers first: Triton specialises on pointer alignment
            # (the buffers are 512-byte aligned; the signature's first call may have seen less), and a
            # variant first met inside the capture cannot be compiled and loaded there
            measure = self.measured and key not in reg.kept   # measured once per signature
            if measure:
                _, t_launch = self._timed(lambda: impl(module, *call_args), device)
            else:
                self.graphs.first_call(lambda: impl(module, *call_args), device)
            reserved = getattr(self.graphs, "reserved", None)   # a stand-in without it holds no device memory
            before = reserved(device) if reserved is not None else None
            graph, static_out = self.graphs.capture(lambda: impl(module, *call_args), device)
            after = reserved(device) if before is not None else None
            if after is not None:
                self.pool_bytes = (self.pool_bytes or 0) + max(0, after - before)
            _outputs(static_out)
            if measure:
                out, t_graph = self._timed(lambda: _replay((graph, static_in, static_out), args), device)
                if t_graph > KEEP_BELOW * t_launch:   # not launch-bound here: no graph, no buffers
                    reg.refused[key] = "auto: replay not faster than launching its kernels"
                    self.stats["not kept"] += 1
                    _let_go([(graph, static_in, static_out)])
                    self._account()
                    return out
                self.stats["kept"] += 1
                reg.kept.add(key)
                reg.graphs[key] = (graph, static_in, static_out)
                self._account()
                self.stats["captured"] += 1
                self.stats["replays"] += 1
                return out
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
        reg.graphs[key] = (graph, static_in, static_out)
        self._account()
        self.stats["captured"] += 1
        # the capture recorded the work without running it: replay once for this call's result
        graph.replay()
        self.stats["replays"] += 1
        return _served(static_out)

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
        if s["dropped for new weights"]:
            line += f", {s['dropped for new weights']} dropped when weights were replaced"
        if s["kept across prompts"]:
            line += f", kept across {s['kept across prompts']} prompt end(s)"
        if s["released"]:
            line += f", {s['released']} freed ({self.released})"
        lines = [line]
        if self.skipped:
            lines.append("  cuda graphs not used for: " + ", ".join(f"{k} x{n}" for k, n in sorted(self.skipped.items())))
        return lines
