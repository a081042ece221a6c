"""Run a UNet through its accelerated regions, one call at a time.

``Accelerator.active()`` installs each region's shim as an instance ``forward`` for one UNet call
and removes it in ``finally``: nothing persists on the (possibly shared) module between calls.
Each shim asks the accelerator's gate (``shims.Gate``) whether a call runs the region's compiled
code or the model's own code; the accelerator runs it, falls back to the model's own code when
compiled code raises, and counts what ran, what compiled and what recompiled after warmup.

Lifetime: the accelerator holds its UNet weakly and nothing in it refers back to it (its shims
call it through a weak method), so reference counting frees it, its regions' per-model state and
its CUDA-graph buffers the moment its owner (ComfyUI's patcher wrappers, or the diffusers module
it is attached to) is freed.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import Counter

import torch

from . import cast, graphs, settings, shims, weights
from .lifecycle import background, pacing, variants, worker
from .lifecycle.ledger import Ledger
from .lifecycle.scheduler import Scheduler, process_scheduler
from .plan import build_plan, served_processors
from .backends import choose, graphs_for
from .cache import CompileCache
from .call_graph import CallGraphs
from .compat import comfy as comfy_compat
from .config import CompileConfig
from .events import Events
from .inserted import Inserted
from .overrides import OWN, Found, Overrides, own
from .lifecycle.recompiles import Recompiles
from .reasons import Reason, Slower, build_failure, error_summary
from .report import Report, accelerator_text

log = logging.getLogger(__name__)


def _showing(show, impl):
    """``impl(module, *args)`` run inside ``show()`` (the cast weights shown to the region's code)."""
    def run(module, *args):
        with show():
            return impl(module, *args)
    return run


def _call_modes(device_type: str, autocast: torch.dtype | None):
    """The dispatch state sampling calls run under (ComfyUI and ``warmup`` run inference mode;
    autocast for fp16 / bf16 precision): what a preloaded variant's guards should keep."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode())
    if autocast is not None:
        stack.enter_context(torch.autocast(device_type, dtype=autocast))
    return stack


#: why a UNet call went region by region: another node's code set on the modules (``overrides``)
OVERRIDDEN = "another node's code set on the model's modules runs inside the call"
#: the start of the note a warmup of one shape leaves (dropped by a later warmup of a range)
ONE_SHAPE_NOTE = "one warmup shape: "


class Accelerator:
    """The accelerated regions of one UNet: routes each region call to compiled code or the
    model's own code, and counts what ran (``stats``), what fell back (``failed``) and what
    compiled after warmup (``recompiles``). ``text()`` is its report. ``scheduler``: what compiles
    its region variants and when (default the process's), handed on to what it builds."""

    def __init__(self, unet: torch.nn.Module, config: CompileConfig | None = None, device=None, plan=None,
                 scheduler: Scheduler | None = None):
        self._root = weakref.ref(unet)
        self.scheduler = scheduler if scheduler is not None else process_scheduler()
        # Inference only, and dynamo guards every weight's requires_grad: ComfyUI's weight patches
        # (a LoRA, its strength, its removal) put each weight back as a new Parameter(requires_grad=
        # False), so a weight still True at warmup compiled every region again at the first LoRA.
        #: the parameters turned off here, given back by ``api.uncompile_unet`` (a LoRA to train)
        self.froze = [weakref.ref(p) for p in unet.parameters() if p.requires_grad]
        for p in unet.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
        self.config = config or CompileConfig()
        #: the regions (``plan``: the caller's ``build_plan(unet)`` of this model as it stands, if it made one)
        self.plan = plan if plan is not None else build_plan(unet)
        #: modules another pack inserts into the planned model later (named in the report)
        self.inserted = Inserted(unet, self.plan)
        self.stats: Counter = Counter()
        #: what the caller's patches did to the regions ("<patch>: <effect>" -> UNet calls), for the report
        self.patches_seen: Counter = Counter()
        #: ids of the region modules whose accelerated code ran at least once, and in the latest UNet call
        self.regions_ran: set[int] = set()
        self.regions_ran_last: set[int] = set()
        #: inside a UNet call through the regions; its forward reached; the regions' shims in
        self._through = self._root_called = self._shims_in = False
        #: the regions' shims go in at the start of every call (a call went around the model's forward)
        self._shims_first = False
        #: what this accelerator tells its listeners: fallbacks, recompiles, background done, report notes
        self.events = Events()
        #: the dtype region inputs had at the first accelerated call (the activations' dtype)
        self.compute_dtype: torch.dtype | None = None
        self.warmed = False
        #: the shape labels warmup ran, and every compile after it (told as a ``recompile`` event)
        self.warmed_shapes: list[str] = []
        self.recompiles = Recompiles(self.plan.arch, functools.partial(self.events.emit, "recompile"),
                                     self.scheduler.guard_reasons_since)
        #: background mode (Warmup Shapes' ``background``); None: compiles happen in the calling thread
        self.background: background.BackgroundMode | None = None
        if device is None:
            p = next(unet.parameters(), None)
            device = p.device if p is not None else torch.device("cpu")
        # the dtype the model computes in: ComfyUI's UNet says (its weights may be stored in another,
        # as the newest ComfyUI keeps a checkpoint's fp32 tensors under a bf16 model), else its weights'
        declared = unet.__dict__.get("dtype")
        self.model_dtype = declared if isinstance(declared, torch.dtype) else \
            next((p.dtype for p in unet.parameters()), torch.float32)
        #: "cpu", "cuda", ...: where the model runs (a CPU model's background compile waits for idle time)
        self.device_type = torch.device(device).type
        #: the device this copy of the model runs on ("cuda:1"), as a report names it
        self.device_name = str(device)
        #: the accelerators of this model's copies on other devices (ComfyUI's multi-GPU Work Units:
        #: ``nodes.patcher.DeviceCopies``), each reported beside this one; None: one device
        self.copies = None

        rep = self.report = Report(backend_requested=self.config.backend, family=self.plan.family, arch=self.plan.arch,
                                   model=type(unet).__name__,
                                   precision=self.config.precision, dynamic_shapes=self.config.dynamic_shapes,
                                   tell_note=functools.partial(self.events.emit, "note"))
        self.backend, rep.why = choose(self.config.backend, device, self.plan.not_a_unet is not None, self.plan.arch)
        rep.backend = self.backend.name
        if rep.backend != self.config.backend and self.config.backend != "auto":
            log.warning("UNet Compiler: backend %s unavailable, using %s (%s)",
                        self.config.backend, rep.backend, "; ".join(rep.why))
        self.graphs = graphs_for(self.backend, self.config, device, rep.note, self.scheduler.thread)
        #: one graph per UNet call where nothing in it needs Python between regions (UNets only)
        self.call_graphs = CallGraphs(unet, self.graphs, self.stats) \
            if self.graphs is not None and self.plan.arch == "unet" else None
        self._autocast = self.config.autocast_dtype(self.model_dtype, rep.note)
        #: the persistent compile cache entry of this model and setup (loaded now, before anything compiles)
        self.cache = CompileCache(unet, self.config, device, self.scheduler) if self.backend.name != "eager" else None
        #: the precompiled variant keys this model's calls met: its compile cache entry's share of them
        self.variant_keys: set[str] = set()
        if self.cache is not None:
            self.cache.met = self.variant_keys
        #: what compiled for this model, counted into ``stats`` (calls, the compile thread's runs)
        self.ledger = Ledger(self.stats, self.recompiles, self.cache, self.backend.compile_count, self.scheduler)
        if self.cache is not None and self.cache.load() and not pacing.waits_for_idle(self.device_type):
            # deserialize its variants beside what runs next (warmup's eager reference forward); a CPU
            # model's load when nothing samples (background mode) or at each key's first call
            self.scheduler.variants.preload(functools.partial(_call_modes, self.device_type, self._autocast))
        #: compiled code or the model's own code, per UNet call and per region call
        self.gate = shims.Gate(self.stats, self.backend.cast_problem())
        self.gate.on_refused = weakref.WeakMethod(self._refused)
        self.gate.on_first = weakref.WeakMethod(self._classes_checked)
        impls = self.backend.impls(self.config, self.scheduler)
        if self.backend.name != "eager":
            self.plan.skipped += [(r.kind, r.path, self.backend.no_impl_reason(r.kind, self.config))
                                  for r in self.plan.regions if impls.get((r.family, r.kind)) is None]
        self._shims = shims.install(self.plan, impls, weakref.WeakMethod(self._run), self.gate)
        self._watch()
        if self.overrides is not None and (found := self.overrides.check_classes()) is not None:
            # said in the plan's report already: regions another node's code (ComfyUI's attention choice,
            # a method set at import) keeps on the model's own code as things stand
            self._say_overridden(found.regions)
        rep.regions = self.plan.kind_counts(impls)
        rep.skipped = self.plan.skipped_summary()
        log.info("%s", rep.text().replace("\n", " |"))

    @property
    def failed(self) -> dict:
        """Region kind -> why its calls run the model's own code from now on (the gate's)."""
        return self.gate.failed

    @property
    def cast_eager(self) -> dict:
        """Region kind -> why calls whose weights ComfyUI casts per call ran the model's own code."""
        return self.gate.cast_eager

    @property
    def has_regions(self) -> bool:
        """Whether any region runs through a shim (the backend has an implementation for it)."""
        return bool(self._shims)

    @property
    def arch(self) -> str:
        """"unet", or "dit" (a diffusion transformer, whose regions are its blocks)."""
        return self.plan.arch

    @property
    def not_a_unet(self):
        """Why nothing of the model is compiled (a Reason: not a model the pack knows), else None."""
        return self.plan.not_a_unet

    def hidden_width(self) -> int | None:
        """A DiT's hidden width: what its first region's first linear reads (None: no linear)."""
        first = next((m for r in self.plan.regions for m in r.module.modules() if isinstance(m, torch.nn.Linear)),
                     None)
        return getattr(first, "in_features", None)

    def why_all_eager(self):
        """Why every region runs the model's own code whatever the call (a Reason), else None."""
        return self.gate.why_all_eager(self.plan.regions)

    def whole_videos(self, shapes, window: int | None):
        """``(frames, kept)``: the frames per call the modules another pack inserted take whole videos
        of, and the ``shapes`` whose calls give them that (``Inserted.whole_videos``; notes go to
        the report)."""
        return self.inserted.whole_videos(shapes, window, self.report.note)

    def videos_of(self, frames: int | None):
        """A context in which the inserted modules that take whole videos take ``frames`` a video."""
        return self.inserted.videos_of(frames)

    def note(self, text: str, once: bool = False) -> bool:
        """Add ``text`` to the report's notes (:meth:`Report.note`, told as a ``note`` event);
        ``once``: not if it is there already. Returns whether it was added."""
        return self.report.note(text, once=once)

    def passed_by(self, why: str) -> bool:
        """Count a UNet call that ran as given, not through this accelerator's regions (another node
        swapped the diffusion model, ComfyUI samples another copy of it, autograd is on), ``why``
        noted once.
        Returns whether the note is new."""
        self.stats["eager_calls"] += 1
        self.stats["calls_not_ours"] += 1
        return self.note(why, once=True)

    def ran_compiled(self) -> tuple[int, int]:
        """(regions whose accelerated code ran at least once, regions with an accelerated path)."""
        return len(self.regions_ran), len(self._shims)

    def ran_compiled_last(self) -> int:
        """Regions whose accelerated code ran in the latest UNet call through the regions (the others
        ran the model's own code, or a patch's code ran in their place, or they were not called)."""
        return len(self.regions_ran_last)

    def reconfigure(self, config: CompileConfig) -> None:
        """Use ``config`` from now on (before anything compiled: warmup's one-shape policy)."""
        self.config = config
        self.report.dynamic_shapes = config.dynamic_shapes
        self._install(self.backend.impls(config, self.scheduler))

    def _install(self, impls: dict) -> None:
        """Shims for the regions ``impls`` (keyed by (family, kind)) has code for, from the next call."""
        self.report.regions = self.plan.kind_counts(impls)
        self._shims = shims.install(self.plan, impls, weakref.WeakMethod(self._run), self.gate)
        self._watch()

    def _watch(self) -> None:
        """The overrides watch over the shims just installed. One built again keeps what the one it
        replaces saw when planned (a one-shape warmup installs new shims after ComfyUI applied the
        prompt's object patches)."""
        paths = {id(r.module): r.path for r in self.plan.regions}
        root = self.root
        self.overrides = Overrides(root, [(m, shim.hook, paths[id(m)]) for m, shim in self._shims],
                                   served_processors() if self.plan.family != "comfy" else (),
                                   before=getattr(self, "overrides", None)) if root is not None else None
        #: what another node set on the modules at the start of this UNet call (None: nothing)
        self._found = None
        #: reason -> the region paths the report named for it (:meth:`_say_overridden`)
        self._said = getattr(self, "_said", {})

    @property
    def root(self) -> torch.nn.Module | None:
        """The UNet this accelerates (None once it is gone)."""
        return self._root()

    def prompt_ended(self, why: str) -> int:
        """A prompt ended: the CUDA graphs (the regions' and the whole calls') stay for the next prompt
        while the card has room, else they are freed (``why`` in the report). Returns how many graphs
        were freed."""
        return sum(g.prompt_ended(why) for g in self._all_graphs())

    def release_graphs(self, why: str) -> int:
        """Free the CUDA graphs (the regions' and the whole calls') and their static buffers (ComfyUI
        unloaded the model: the memory goes back where ComfyUI's accounting sees it); the next call at
        a shape captures again. Returns how many graphs were freed."""
        return sum(g.release(why) for g in self._all_graphs())

    def _all_graphs(self) -> list:
        return [g for g in (self.call_graphs.graphs if self.call_graphs is not None else None, self.graphs)
                if g is not None]

    def forward(self, module, args: tuple, kwargs: dict):
        """The UNet's own forward on ``module`` (the root) inside a call through the regions: one CUDA
        graph for the whole call where it can be (:mod:`call_graph`), else region by region."""
        forward = type(module).forward
        if self.call_graphs is None or not self._through:
            return forward(module, *args, **kwargs)
        self._root_called = True
        if self.gate.due:
            self.gate.first_call()
        found = self._found
        return self.call_graphs.call(forward, module, args, kwargs, self.gate.failed, self.regions_ran_last,
                                     self._region_shims,
                                     overridden=OVERRIDDEN if found is not None
                                     and (found.regions or found.around or found.classes
                                          or found.around_attention) else None,
                                     hooks_seen_none=found is None and self.overrides is not None)

    # ---- one region call ----------------------------------------------
    def _run(self, kind, impl, module, original, args, eager_kwargs, casts=()):
        if self.compute_dtype is None:
            self.compute_dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
        recording = comfy_compat.compiler_recording()
        if recording is not None:
            # ComfyUI's compiler records this block's allocations: the pack's compiled code, compiles
            # and graph captures run paused, as ComfyUI's own foreign kernels (comfy-kitchen's) do
            self._recording_paused()
            with recording:
                return self._run_here(kind, impl, module, original, args, eager_kwargs, casts)
        return self._run_here(kind, impl, module, original, args, eager_kwargs, casts)

    def _recording_paused(self) -> None:
        first = not self.stats["recording_paused"]
        self.stats["recording_paused"] += 1
        if first:
            self.report.note("ComfyUI's compiler was recording this model's allocations: its recording "
                             "is paused around each accelerated region call (compiles, compiled code, "
                             "CUDA graph captures), which it does not replay")

    def _run_here(self, kind, impl, module, original, args, eager_kwargs, casts):
        streamed = False
        try:
            if casts:
                streamed = cast.streams(casts, args)
                if not streamed:
                    # ComfyUI's per-call cast outside the graph: a CUDA graph where every cast weight is
                    # resident (a VBAR slot or the leaf's own, pinned until the block ends), read in place
                    with cast.applied(module, casts, args, self.stats) as (resident, show):
                        if resident is cast.STREAMED:   # evicted since: op by op after all (below)
                            streamed = True
                        elif self.graphs is None:
                            with show():
                                out = impl(module, *args)
                        elif resident is None:
                            self.graphs.skipped["a weight patched or converted per call (not resident)"] += 1
                            with show():
                                out = impl(module, *args)
                        else:   # (a replay reads the resident weights where they are: nothing shown)
                            out = self.graphs.run(_showing(show, impl), module, args, weights=resident)
                            self.stats["region_cast_resident"] += 1
                if streamed and self.backend.streams_op_by_op:
                    # weights not resident: each op casts its own where it runs, on ComfyUI's offload
                    # streams, as the model's own code does (the body calls each conv and linear)
                    out = impl(module, *args)
                    self.stats["region_streamed"] += 1
                    if self.graphs is not None:
                        self.graphs.skipped["a weight streamed (cast op by op, not resident)"] += 1
                if not streamed or self.backend.streams_op_by_op:
                    self.stats["region_cast_compiled"] += 1
            else:
                out = impl(module, *args) if self.graphs is None else self.graphs.run(impl, module, args)
        except Exception as e:
            if comfy_compat.is_cancel(e) or (self.call_graphs is not None and self.call_graphs.graphs.capturing):
                raise   # inside a whole call's capture: that capture fails, not this region kind
            error = e
            if comfy_compat.is_oom(e):
                # out of memory in the accelerated code: the model's own code may fit (ComfyUI's
                # attention splits itself on OOM); the failed attempt's frames hold its tensors,
                # so they go first. If the model's code runs out of memory too, that error is the
                # model's and propagates to ComfyUI untouched (below).
                comfy_compat.release_failed(e, args)
        else:
            if streamed and not self.backend.streams_op_by_op:
                return self._streamed_eager(kind, module, original, args, eager_kwargs)
            self.stats[f"ran_{kind}"] += 1
            self.regions_ran.add(id(module))
            self.regions_ran_last.add(id(module))
            return out
        # The accelerated path raised. The model's own code runs on the same inputs, outside the
        # except block: if it raises too, the error is the model's (ComfyUI would raise it the same
        # way), so it propagates untouched, nothing of the pack's chained to it, and the kind stays on.
        self.stats["region_eager"] += 1
        out = original(module, *args) if eager_kwargs is None else original(module, args[0], **eager_kwargs)
        if comfy_compat.is_oom(error):
            self._out_of_memory(kind, args)
        else:
            self._turn_off(kind, error)
        return out

    def _streamed_eager(self, kind, module, original, args, eager_kwargs):
        """A region call whose weights stream, on a backend whose compiled body reads a region's
        weights at once (:attr:`Backend.streams_op_by_op` False): the model's own code runs it, each
        op casting where it runs; counted, the reason kept for the report (``cast_eager``)."""
        self.stats["region_streamed_eager"] += 1
        self.stats["region_eager"] += 1
        self.gate.cast_eager.setdefault(kind, Reason(
            f"their weights stream (not resident on the GPU), and the {self.backend.name} backend's compiled "
            f"body reads a region's weights at once where ComfyUI casts each op's as it runs",
            "choose the triton backend (Select Backend: it runs such regions op by op), or leave the model "
            "room to stay resident"))
        return original(module, *args) if eager_kwargs is None else original(module, args[0], **eager_kwargs)

    def _out_of_memory(self, kind, args) -> None:
        """A transient out-of-memory (a hires pass, another model loaded): that call ran the model's
        own code, the kind stays accelerated; counted, and said once per kind."""
        self.stats["oom_calls_eager"] += 1
        first = self.stats[f"oom_{kind}"] == 0
        self.stats[f"oom_{kind}"] += 1
        if first:
            shape = "x".join(map(str, args[0].shape)) if isinstance(args[0], torch.Tensor) else "?"
            msg = (f"out of memory in {kind} accelerated code (input {shape}): those calls ran the model's own "
                   f"code, the regions stay accelerated (counted in the report's oom calls)")
            log.warning("UNet Compiler: %s", msg)
            self.report.note(msg)

    def _turn_off(self, kind, error):
        """The backend failed where the model's own code runs: ``kind`` regions run it from now on;
        every kind when this machine cannot build compiled code at all (one failed compile, not one
        per kind, and the compiler's error line with the fix instead of its command line)."""
        build = build_failure(error)
        why = build or error_summary(error)
        kinds = [kind] if build is None else list(self.report.regions) or [kind]
        self.gate.close(kinds, why)
        if build is not None:
            kind = "all"
        msg = (f"UNet Compiler: {self.backend.name} failed on {kind} regions ({why}); "
               f"they run the model's own code from now on. Set {settings.env('DISABLE')}=1 to turn the pack "
               f"off entirely.")
        log.warning(msg, exc_info=error)
        self.report.note(msg)
        self._tell_fallback(kind, why)

    def _tell_fallback(self, kind: str, why) -> None:
        """Tell the ``fallback`` listeners (the node text and toast) that ``kind`` runs the model's own code now."""
        self.events.emit("fallback", kind, why)

    def _refused(self, kinds, reason: Reason) -> None:
        """The gate refused ``kinds`` (warmup's compare found their compiled result wrong): said in
        the report, the log and to the fallback listener (the toast)."""
        said = f"{', '.join(kinds)} regions run the model's own code from now on: {reason}"
        log.warning("UNet Compiler: %s", said)
        self.report.note(said)
        self._tell_fallback(", ".join(kinds), reason)

    @property
    def bypassed(self) -> bool:
        """Whether calls run the model's own code now (inside ``bypass()``: warmup's eager reference)."""
        return self.gate.bypassed

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the regions run in under autocast (precision fp16 / bf16), else None."""
        return self._autocast

    # ---- one UNet call -----------------------------------------------------
    def bypass(self):
        """Run the model's own code (the eager reference) inside this block."""
        return self.gate.bypass()

    @contextlib.contextmanager
    def active(self, weight_epoch=None, shape: str | None = None):
        """One UNet call through the regions. ``shape``: the call's label (``BxWxH`` px), named if it
        compiles after warmup."""
        self.regions_ran_last.clear()
        with self.scheduler.activity.call():
            if not self.gate.through_regions(bool(self._shims)):
                self.stats["eager_calls"] += 1
                yield
            else:
                with self._through_regions(weight_epoch, shape):
                    yield

    @contextlib.contextmanager
    def _through_regions(self, weight_epoch, shape):
        weights.set_epoch(weight_epoch)
        if self.inserted.check():
            graphs.structure_moved()
        if not self._shims_in:
            self._found = self._overridden()
            self.gate.due = self.overrides is not None   # the classes' check, at the first region call
        for g in self._all_graphs():
            g.begin_call()
        installed = []
        with contextlib.ExitStack() as stack:
            for cm in self.backend.dynamo_config(self.config):
                stack.enter_context(cm)
            if self.background is not None:
                stack.enter_context(worker.queueing(self.background.owner))
            stack.enter_context(variants.meeting(self.variant_keys))
            if self._autocast is not None:
                # the load device's autocast: under Dynamic VRAM the parameters stay on the CPU
                dev = self.device_type
                # no autocast weight-cast cache under graphs: a cast cached inside one region's capture
                # lives in the graph pool and would be read by other graphs after it is freed
                stack.enter_context(torch.autocast(dev, dtype=self._autocast, cache_enabled=self.graphs is None))
            # (innermost: the call's compiles are counted before the compile queue's context ends)
            stack.enter_context(self.ledger.call(shape, self.warmed, self.warmed_shapes))
            try:
                root = self.root
                if self.call_graphs is None or self._shims_first:
                    stack.enter_context(self._region_shims())
                elif root is not None and "forward" not in root.__dict__:
                    # ComfyUI calls the diffusion model itself (a diffusers UNet's forward is the pack's:
                    # api._accelerated_forward calls forward() above); the regions' shims go in there,
                    # unless the call replays one graph
                    root.__dict__["forward"] = own(lambda *a, **k: self.forward(root, a, k))
                    installed.append((root, "forward"))
                self._through, self._root_called = True, False
                yield
                if self.call_graphs is not None and not self._shims_first and not self._root_called:
                    self._shims_first = True   # called around the UNet's forward: shims up front from now on
                    self.report.note("a UNet call went around the model's forward (another node's "
                                     "wrapper): one graph per UNet call is off, the regions run as before")
            finally:
                self._through = self.gate.due = False
                for module, hook in installed:
                    module.__dict__.pop(hook, None)
                if self.graphs is not None:
                    self.graphs.verify = False
                weights.release_scratch()

    def _overridden(self):
        """What another node set on the modules now (``overrides.Found``), said once each in the report;
        the regions' graphs check their weights' addresses before each replay while code set around them
        runs. None: nothing (the usual call)."""
        found = self.overrides.check(self.root) if self.overrides is not None else None
        if self.graphs is not None:
            self.graphs.verify = found is not None and found.moving
        if found is not None:
            self._say_overridden(found.regions)
            if found.around is not None:
                self.report.note(f"{found.around}: it runs as set; one graph per UNet call stands aside while "
                                 f"it is there, and the regions' graphs check their weights before each replay",
                                 once=True)
        return found

    def _say_overridden(self, regions: dict) -> None:
        """One report note per reason another node's code runs (``Found.regions``' values: ``path:
        reason``), naming the first few regions it holds for; a later call that finds it on regions not
        named yet adds a note for those ("also")."""
        by: dict[str, list] = {}
        for why in regions.values():
            path, _, reason = why.partition(": ")
            by.setdefault(reason, []).append(path)
        for reason, paths in by.items():
            said = self._said.setdefault(reason, set())
            new = [p for p in paths if p not in said]
            if not new:
                continue
            also = "also " if said else ""
            said.update(new)
            if len(new) == 1 and not also:
                self.report.note(f"{new[0]}: {reason}: that region runs the model's own code with it (the "
                                 f"pack's code would skip it)", once=True)
                continue
            named = ", ".join(new[:3]) + (f" and {len(new) - 3} more" if len(new) > 3 else "")
            self.report.note(f"{reason}: {also}{len(new)} region{'s' if len(new) > 1 else ''} run"
                             f"{'' if len(new) > 1 else 's'} the model's own code with it (the pack's code "
                             f"would skip it): {named}", once=True)

    def _classes_checked(self) -> frozenset:
        """The modules' classes checked for this UNet call (``Overrides.check_classes``): the regions
        with another node's method on a class of theirs run the model's own code for the rest of the
        call (their shims taken out where in), said once each; one graph per UNet call stands aside.
        Returns those region modules."""
        found = self.overrides.check_classes() if self.overrides is not None else None
        if found is None:
            return frozenset()
        self._say_overridden(found.regions)
        if found.classes is not None:
            self.report.note(f"{found.classes}: it runs as set; one graph per UNet call stands aside while it "
                             f"is there, and the regions' graphs check their weights before each replay", once=True)
            if self.graphs is not None:     # (such code may move a block's weights inside the call)
                self.graphs.verify = True
        if found.around_attention is not None and self.call_graphs is not None:
            self.report.note(f"{found.around_attention}, called around the regions: one graph per UNet call "
                             f"stands aside while it is there", once=True)
        before = self._found
        merged = Found(dict(before.regions) if before is not None else {}, before.around if before else None,
                       before.hooked if before else False, found.classes, found.around_attention)
        new = [m for m in found.regions if m not in merged.regions]
        for m in new:
            merged.regions[m] = found.regions[m]
        self._found = merged
        if self._shims_in:
            hooks = dict((id(m), getattr(s, "hook", "forward")) for m, s in self._shims)
            for m in new:
                if getattr(m.__dict__.get(hooks.get(id(m), "forward")), OWN, False):
                    m.__dict__.pop(hooks[id(m)])
                    self.stats["region_eager"] += 1
                    self.stats["region_eager_overridden"] += 1
        return frozenset(new)

    @contextlib.contextmanager
    def _region_shims(self):
        """The regions' shims installed for the rest of this UNet call (nested: already in)."""
        if self._shims_in:
            yield
            return
        # the classes are checked again at the first region call: the wrappers ComfyUI runs inside the
        # model's forward (a diffusion-model wrapper) have run by then, not at the one-graph decision
        self.gate.due = self.overrides is not None
        installed = []
        overridden = self._found.regions if self._found is not None else {}
        try:
            for module, shim in self._shims:
                if module in overridden:   # another node's code set there runs, as the model's own would
                    self.stats["region_eager"] += 1
                    self.stats["region_eager_overridden"] += 1
                    continue
                hook = getattr(shim, "hook", "forward")
                module.__dict__[hook] = shim
                installed.append((module, hook))
            self._shims_in = True
            yield
        finally:
            self._shims_in = False
            for module, hook in installed:
                module.__dict__.pop(hook, None)

    # ---- warmup and background mode --------------------------------------
    def warmup_mode(self, one_shape: str | None, in_background: bool) -> background.BackgroundMode | None:
        """Set up for a warmup: ``one_shape`` (a shape label): compile exactly that shape (static code,
        before anything compiled); ``in_background``: record the calls for the compile thread (Warmup
        Shapes' ``background``) where this model's code can compile there, else a note says why not
        and the misses compile in the calling thread. Returns the background mode, or None."""
        if one_shape:
            self.reconfigure(self.config.replace(dynamic_shapes=None))
            self.report.note(f"{ONE_SHAPE_NOTE}compiled for exactly {one_shape}; another shape compiles "
                             f"once, then for any size. Warm a range: list its smallest and largest shapes")
        why = background.problem(self) if in_background else None
        if why:
            self.report.note(f"background compile: not used: {why}; warmup compiled before sampling")
        if in_background and not why:
            return self.background_mode()
        self.end_background()
        return None

    def background_mode(self) -> background.BackgroundMode:
        """Enter background mode (Warmup Shapes' ``background``): from now on this model's region
        calls that no compiled code fits are queued for the compile thread and run the model's own
        code meanwhile; nothing compiles in the sampling thread."""
        if self.background is None:
            self.background = background.BackgroundMode(weakref.WeakMethod(self._background_compiled), self.scheduler,
                                                       functools.partial(self.events.emit, "background_done"))
        return self.background

    def end_background(self) -> None:
        """A warmup in the foreground: this model's misses compile in the calling thread again."""
        if self.background is not None:
            self.background.end()
            self.background = None

    def _background_compiled(self, graphs: int, seconds: float, first: bool, marks) -> str:
        """The compile thread's queue emptied for this model: counted in its ledger. Returns the
        model's state."""
        self.ledger.background_compiled(graphs, seconds, first, marks, self.background, self.warmed_shapes)
        return "fallback" if any(not isinstance(why, Slower) for why in self.failed.values()) else "compiled"

    def text(self) -> str:
        return accelerator_text(self)

    def __deepcopy__(self, memo):
        return None     # (a copy of the module it serves gets its own: compile_unet's forward makes it)

    def __reduce__(self):
        return type(None), ()
