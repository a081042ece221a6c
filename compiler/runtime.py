"""Run a UNet through its accelerated regions, one call at a time.

``Accelerator.active()`` installs each region's shim as an instance
``forward`` for the duration of one UNet call and removes it in ``finally``:
nothing persists on the (possibly shared) module between calls. Each shim
decides per call whether the region may run accelerated; anything it cannot
prove safe runs the model's own code.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import traceback
import weakref
from collections import Counter

import torch

from . import plan as P
from . import precompiled
from . import weights
from .backends import resolve
from .cache import CompileCache
from .compat import comfy as comfy_compat
from .compat.dynamo import guard_marks, guard_reasons_since, plain_guard, rank
from .compat.torch_version import torch_too_old
from .config import DISABLE_ENV, CompileConfig, disabled_by_env
from .report import NOTHING_TO_COMPILE, Reason, Report, error_summary

log = logging.getLogger(__name__)

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _graph_count() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def cache_hits() -> int:
    """Graphs inductor took from its caches (the pack's compile cache fills them) so far."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]) + precompiled.VARIANTS.from_cache


def _release(error: BaseException, args) -> None:
    """Let go of what a failed accelerated call allocated: the locals of its frames (kept alive by
    the error's traceback) and, on CUDA, the cached blocks they leave behind."""
    traceback.clear_frames(error.__traceback__)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def _call_modes(device_type: str, autocast: torch.dtype | None):
    """The dispatch state sampling calls run under (ComfyUI and ``warmup`` run inference mode;
    autocast for fp16 / bf16 precision): what a preloaded variant's guards should keep."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.inference_mode())
    if autocast is not None:
        stack.enter_context(torch.autocast(device_type, dtype=autocast))
    return stack


class Accelerator:
    """The accelerated regions of one UNet and what they did.

    Lifetime: the accelerator holds its UNet weakly and nothing in it refers back to the
    accelerator (its shims call it through a weak method), so it is freed by reference counting
    the moment its owner (ComfyUI's patcher wrappers, or the diffusers module it is attached to)
    is, and with it the UNet, its compiled regions' per-model state and its CUDA-graph buffers:
    never left to Python's cyclic collector, as an unloaded ComfyUI model is not either."""

    def __init__(self, unet: torch.nn.Module, config: CompileConfig | None = None, device=None):
        self._root = weakref.ref(unet)
        # Inference only, and dynamo guards every weight's requires_grad: ComfyUI's weight patches
        # (a LoRA, a new strength, its removal) put each weight they touch back as a new
        # Parameter(requires_grad=False), so a weight still True at warmup compiled every region
        # again at the first LoRA after Warmup Shapes (found by the soak). Set once here what those
        # patches set; nothing that runs without gradients reads it.
        for p in unet.parameters():
            if p.requires_grad:
                p.requires_grad_(False)
        self.config = config or CompileConfig()
        self.plan = P.build_plan(unet)
        self.stats: Counter = Counter()
        #: what the caller's patches did to the regions ("<patch>: <effect>" -> UNet calls), for the report
        self.patches_seen: Counter = Counter()
        self.failed: dict = {}
        #: optional ``callable(kind, reason)`` told when a region kind fails and falls back to eager
        self.on_fallback = None
        #: optional ``callable(event)`` told of every compile after warmup (see ``_recompiled``)
        self.on_recompile = None
        self.warmed = False
        #: the shape labels warmup ran, and every compile after it: {prompt, shape, graphs, seconds, guards}
        self.warmed_shapes: list[str] = []
        self.recompiles: list[dict] = []
        self.recompiles_by_prompt: Counter = Counter()
        self._bypass = False
        if device is None:
            p = next(unet.parameters(), None)
            device = p.device if p is not None else torch.device("cpu")
        self.model_dtype = next((p.dtype for p in unet.parameters()), torch.float32)

        rep = Report(backend_requested=self.config.backend, family=self.plan.family,
                     precision=self.config.precision, dynamic_shapes=self.config.dynamic_shapes)
        self.report = rep
        requested = self.config.backend
        old = torch_too_old()
        if disabled_by_env():
            requested, rep.why = "eager", [Reason(f"{DISABLE_ENV} is set: every rewrite is off")]
        elif old:
            requested, rep.why = "eager", [old]
        elif self.plan.not_a_unet:
            # nothing to compile: no backend is resolved (no compiler probe, no compile cache entry)
            requested, rep.why = "eager", [Reason(NOTHING_TO_COMPILE)]
        if requested == "eager":
            from .backends import lookup_backend
            self.backend = lookup_backend("eager")()
        else:
            self.backend, rep.why = resolve(requested, device)
        rep.backend = self.backend.name
        if rep.backend != self.config.backend and self.config.backend != "auto":
            log.warning("UNet Compiler: backend %s unavailable, using %s (%s)",
                        self.config.backend, rep.backend, "; ".join(rep.why))

        self._autocast = None
        if self.config.precision in ("fp16", "bf16"):
            self._autocast = _DTYPES[self.config.precision]
        elif self.config.precision == "fp32" and self.model_dtype != torch.float32:
            rep.notes.append(f"precision fp32 needs the model loaded in fp32 (it is {self.model_dtype}); "
                             f"kept auto. Fix: start ComfyUI with --force-fp32")

        self.graphs = self._graphs(device)
        #: the persistent compile cache entry of this model and setup (loaded now, before anything compiles)
        self.cache = CompileCache(unet, self.config, device) if self.backend.name != "eager" else None
        if self.cache is not None and self.cache.load():
            # deserialize its variants beside what runs next (warmup's eager reference forward)
            device_type = next(unet.parameters(), torch.empty(0)).device.type
            precompiled.VARIANTS.preload(functools.partial(_call_modes, device_type, self._autocast))
        #: compiled code the compile cache does not hold yet; saves deferred by ``one_cache_save``
        self._cache_dirty = False
        self._defer_save = False
        #: background mode's state (``background_owner``); None: compiles happen in the calling thread
        self.background: dict | None = None
        self._background_lock = threading.Lock()
        #: optional ``callable(report line, state)`` told (from the thread) when that compile is done
        self.on_background_done = None
        self._install(self.backend.impls(self.config), first=True)
        log.info("%s", rep.text().replace("\n", " |"))

    def _install(self, impls: dict, first: bool = False) -> None:
        """One shim per region the backend has an implementation for."""
        self._shims = []
        counts: Counter = Counter()
        for region in self.plan.regions:
            impl = impls.get((region.family, region.kind))
            if impl is None:
                if first and self.backend.name != "eager":
                    self.plan.skipped.append((region.kind, region.path, self._no_impl_reason(region)))
                continue
            counts[region.kind] += 1
            self._shims.append((region.module, self._make_shim(region, impl)))
        self.report.regions = {k: counts[k] for k in P.KINDS if counts[k]}
        self.report.skipped = self.plan.skipped_summary()

    def fix_shape(self, shapes: list) -> bool:
        """Warmup lists one shape: compile exactly that shape (static code: 18 % less to
        compile, about a third of the time to load at a restart, ~10 % faster steps on CPU, measured with
        SD1.5), instead of code for every size. Only with dynamic shapes on and nothing compiled
        yet; a later shape compiles once more and then dynamically (torch's automatic dynamic
        shapes), and is named as a recompile. Returns whether it did."""
        if (len(shapes) != 1 or self.config.dynamic_shapes is not True or self.stats["graphs_compiled"]
                or not self.backend.follows_dynamic_shapes):
            return False
        self.config = self.config.replace(dynamic_shapes=None)
        self.report.dynamic_shapes = None
        self._install(self.backend.impls(self.config))
        self.report.notes.append(f"one warmup shape: compiled for exactly {shapes[0].label}; another shape "
                                 f"compiles once, then for any size. Warm a range: list its smallest and "
                                 f"largest shapes")
        return True

    @property
    def root(self) -> torch.nn.Module | None:
        """The UNet this accelerates (None once it is gone)."""
        return self._root()

    def _graphs(self, device):
        """The region CUDA graphs, when asked for and possible here; else a note why not."""
        if not self.config.cuda_graphs:
            return None
        from .compat import triton as triton_compat
        why = None
        if getattr(device, "type", "cpu") != "cuda":
            why = f"they need CUDA and the model runs on {device}"
        elif not self.backend.uses_cuda_graphs:
            from .backends import lookup_backend, names
            users = " and ".join(n for n in names() if lookup_backend(n).uses_cuda_graphs)
            why = f"the {self.backend.name} backend does not use them ({users} do)"
        else:
            why = triton_compat.cuda_graphs_problem(triton_compat.gather())
        if why:
            self.report.notes.append(f"cuda graphs: not used: {why}")
            log.warning("UNet Compiler: cuda graphs not used: %s", why)
            return None
        from .graphs import RegionGraphs
        return RegionGraphs()

    def _compiled(self) -> int:
        """Dynamo graphs plus the backend's own compiles (Triton kernel variants)."""
        return _graph_count() + self.backend.compile_count()

    def _no_impl_reason(self, region) -> str:
        if region.kind == P.PROJECTION:
            return "free-standing convs: prepacking is off" if not self.config.prepack_conv else "no rewrite"
        return f"{self.backend.name} has no rewrite for this region"

    # ---- per-region shim ------------------------------------------------
    def _make_shim(self, region, impl):
        """The callable installed as ``module.<region.hook>`` for one UNet call (its ``hook``
        attribute names where ``active`` installs it)."""
        shim = self._shim_body(region, impl)
        shim.hook = region.hook
        return shim

    def _shim_body(self, region, impl):
        module, kind, leaves = region.module, region.kind, region.leaves
        original = getattr(type(module), region.hook)
        stats, failed = self.stats, self.failed
        run = weakref.WeakMethod(self._run)   # the accelerator holds its shims: no cycle back to it

        if kind == P.ATTENTION and region.family == "comfy":
            def shim(x, context=None, value=None, mask=None, transformer_options={}):
                if (mask is not None or kind in failed or "optimized_attention_override" in transformer_options
                        or any(comfy_compat.has_cast_weights(m) for m in leaves)):
                    stats["region_eager"] += 1
                    return original(module, x, context=context, value=value, mask=mask,
                                    transformer_options=transformer_options)
                return run()(kind, impl, module, original, (x, context, value),
                                 dict(context=context, value=value, mask=mask, transformer_options=transformer_options))
            return shim
        if kind == P.ATTENTION:
            def shim(hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
                if attention_mask is not None or kw or kind in failed or hidden_states.dim() != 3:
                    stats["region_eager"] += 1
                    return original(module, hidden_states, encoder_hidden_states, attention_mask, **kw)
                return run()(kind, impl, module, original, (hidden_states, encoder_hidden_states),
                                 dict(encoder_hidden_states=encoder_hidden_states))
            return shim

        def shim(*args, **kwargs):
            if kwargs.get("scale", 0) in (None, 1.0):
                # diffusers < 0.26 passes its LoRA scale (resnet(h, temb, scale=1.0)); 1.0 is the default
                kwargs = {k: v for k, v in kwargs.items() if k != "scale"}
            if kwargs or kind in failed or any(comfy_compat.has_cast_weights(m) for m in leaves):
                stats["region_eager"] += 1
                return original(module, *args, **kwargs)
            return run()(kind, impl, module, original, args, None)
        return shim

    def _run(self, kind, impl, module, original, args, eager_kwargs):
        try:
            out = impl(module, *args) if self.graphs is None else self.graphs.run(impl, module, args)
        except Exception as e:
            if comfy_compat.is_cancel(e):
                raise
            error = e
            if comfy_compat.is_oom(e):
                # out of memory in the accelerated code: the model's own code may fit (ComfyUI's
                # attention splits itself on OOM); the failed attempt's frames hold its tensors,
                # so they go first. If the model's code runs out of memory too, that error is the
                # model's and propagates to ComfyUI untouched (below).
                _release(e, args)
        else:
            self.stats[f"ran_{kind}"] += 1
            return out
        # The accelerated path raised. The model's own code runs on the same inputs, outside the
        # except block: if it raises too, the error is the model's (ComfyUI would raise it the same
        # way), so it propagates untouched, nothing of the pack's chained to it, and the kind stays on.
        self.stats["region_eager"] += 1
        out = original(module, *args) if eager_kwargs is None else original(module, args[0], **eager_kwargs)
        self._turn_off(kind, error)
        return out

    def _turn_off(self, kind, error):
        """The backend failed where the model's own code runs: ``kind`` regions run eager from now on."""
        self.failed[kind] = error_summary(error)
        msg = (f"UNet Compiler: {self.backend.name} failed on {kind} regions ({self.failed[kind]}); "
               f"they run eager from now on. Set {DISABLE_ENV}=1 to turn the pack off entirely.")
        log.warning(msg, exc_info=error)
        self.report.notes.append(msg)
        if self.on_fallback is not None:
            try:
                self.on_fallback(kind, self.failed[kind])
            except Exception:  # a listener must not turn a soft fallback into a crash
                log.debug("on_fallback listener failed", exc_info=True)

    @property
    def bypassed(self) -> bool:
        """Whether calls run the model's own code now (inside ``bypass()``: warmup's eager reference)."""
        return self._bypass

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype the regions run in under autocast (precision fp16 / bf16), else None."""
        return self._autocast

    # ---- one UNet call -----------------------------------------------------
    @contextlib.contextmanager
    def bypass(self):
        """Run the model's own code (the eager reference) inside this block."""
        prev, self._bypass = self._bypass, True
        try:
            yield
        finally:
            self._bypass = prev

    @contextlib.contextmanager
    def active(self, weight_epoch=None, shape: str | None = None):
        """One UNet call through the regions. ``shape``: the call's label (``BxWxH`` px), named if it
        compiles after warmup."""
        if self._bypass or not self._shims:
            self.stats["eager_calls"] += 1
            yield
            return
        weights.set_epoch(weight_epoch)
        installed = []
        before, hits_before = self._compiled(), cache_hits()
        bg = precompiled.BACKGROUND
        bg_before = (bg.epoch, bg.active)
        marks = guard_marks() if self.warmed else None
        t0 = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for cm in self.backend.dynamo_config(self.config):
                stack.enter_context(cm)
            if self.background is not None:
                stack.enter_context(precompiled.queueing(self.background["owner"]))
            if self._autocast is not None:
                dev = next(self.root.parameters()).device.type
                # no autocast weight-cast cache under graphs: a cast cached inside one region's capture
                # lives in the graph pool and would be read by other graphs after it is freed
                stack.enter_context(torch.autocast(dev, dtype=self._autocast, cache_enabled=self.graphs is None))
            try:
                for module, shim in self._shims:
                    hook = getattr(shim, "hook", "forward")
                    module.__dict__[hook] = shim
                    installed.append((module, hook))
                yield
            finally:
                for module, hook in installed:
                    module.__dict__.pop(hook, None)
                weights.release_scratch()
                new = self._compiled() - before
                self.stats["calls"] += 1
                if bg_before[1] or bg.active or bg.epoch != bg_before[0]:
                    # the background thread compiled meanwhile: its graphs are counted when it is done
                    # (``background_started``), not as this call's compiles or recompiles
                    new = 0
                if new:
                    self.stats["graphs_compiled"] += new
                    hits = cache_hits() - hits_before
                    self.stats["graphs_from_cache"] += hits
                    self.stats["compile_seconds"] += time.perf_counter() - t0
                    if hits < new:  # something new to keep
                        self._cache_dirty = True
                        if not self._defer_save:
                            self.save_cache()
                    if self.warmed:
                        self._recompiled(new, shape, time.perf_counter() - t0, marks)

    def _recompiled(self, graphs: int, shape: str | None, seconds: float, marks, background: bool = False) -> None:
        """Count a compile after warmup against the running prompt, name its shape and the guard that
        failed, log it and tell the listener (never raises into the UNet call)."""
        self.stats["recompiles_after_warmup"] += graphs
        guards = []
        try:
            for plain in map(plain_guard, sorted(guard_reasons_since(marks or {}), key=rank)):
                if plain not in guards and len(guards) < 3:
                    guards.append(plain)
        except Exception:
            log.debug("guard reasons unavailable", exc_info=True)
        prompt = comfy_compat.current_prompt()
        self.recompiles_by_prompt[prompt] += graphs
        event = {"prompt": prompt, "shape": shape, "graphs": graphs, "seconds": round(seconds, 2), "guards": guards,
                 "background": background}
        self.recompiles = (self.recompiles + [event])[-50:]
        event["text"] = self.recompile_sentence(event)
        log.warning("UNet Compiler: %s", event["text"])
        if self.on_recompile is not None:
            try:
                self.on_recompile(event)
            except Exception:  # a listener must not break sampling
                log.debug("on_recompile listener failed", exc_info=True)

    def recompile_sentence(self, e: dict) -> str:
        where = f"prompt {e['prompt']}: " if e.get("prompt") else ""
        shape = f" for a {e['shape']} call" if e.get("shape") else ""
        if e.get("background"):
            shape += " in the background (the calls ran the model's own code meanwhile)"
        warmed = ", ".join(self.warmed_shapes) or "none"
        inside = bool(e.get("shape")) and bool(self.warmed_shapes) and self._inside_warmed(e["shape"])
        where_shape = ("" if not e.get("shape") or not self.warmed_shapes else
                       " (inside the warmed range: a specialisation or patch warmup did not prime)" if inside
                       else " (outside the warmed range)")
        why = "; ".join(e.get("guards") or []) or "dynamo recorded no failed guard (a new code path)"
        fix = ("none needed: the new code is kept for the next prompts; if it repeats every prompt, report it "
               "with this line" if inside or not e.get("shape") else
               f"add {e['shape']} to Warmup Shapes (its batch is the UNet's: twice the image batch with CFG)")
        return (f"{where}{e['graphs']} graph(s) compiled after warmup{shape}{where_shape}, {e['seconds']:.1f} s; "
                f"warmed shapes: {warmed}; why: {why}. Fix: {fix}")

    def _inside_warmed(self, label: str) -> bool:
        from .shapes import parse_shapes
        try:
            s, box = parse_shapes(label)[0], parse_shapes(", ".join(self.warmed_shapes))
        except Exception:
            return False
        return all(min(getattr(b, f) for b in box) <= getattr(s, f) <= max(getattr(b, f) for b in box)
                   for f in ("batch", "width", "height"))

    def background_owner(self) -> precompiled.Owner:
        """Start background mode (Warmup Shapes' ``background``): from now on this model's region
        calls that no compiled code fits are queued for the compile thread and run the model's own
        code meanwhile; nothing compiles in the sampling thread."""
        if self.background is None:
            self.background = {"owner": precompiled.Owner(), "t0": time.perf_counter(), "done": None,
                               "counted": 0, "seconds": 0.0, "marks": None}
        return self.background["owner"]

    def background_started(self) -> None:
        """Warmup recorded this model's region calls for the compile thread: each time its queue
        empties, what it compiled for this model is counted (the first time as warmup's, later as
        compiles after warmup), saved to the compile cache, and (the first time) told."""
        bg = precompiled.BACKGROUND
        self.background_owner()
        state = self.background
        state["marks"] = guard_marks()
        if state["done"] is not None:      # another warmup (new shapes): its compiles are warmup's again
            state["t0"], state["done"] = time.perf_counter(), None
        if state.get("listener") is None:
            me = weakref.ref(self)

            def done():
                accel = me()
                if accel is None:
                    bg.listeners[:] = [f for f in bg.listeners if f is not done]
                    return
                accel._background_done()
            state["listener"] = done
            bg.listeners.append(done)
        if not bg.active:    # nothing was queued (all from the compile cache), or it finished already
            done()

    def end_background(self) -> None:
        """A warmup in the foreground: this model's misses compile in the calling thread again."""
        state, self.background = self.background, None
        if state is not None and state.get("listener") in precompiled.BACKGROUND.listeners:
            precompiled.BACKGROUND.listeners.remove(state["listener"])

    def _background_done(self) -> None:
        with self._background_lock:
            state = self.background
            if state is None:
                return
            owner = state["owner"]
            new, secs = owner.graphs - state["counted"], owner.seconds - state["seconds"]
            first = state["done"] is None
            if not first and not new:
                return
            state["counted"], state["seconds"] = owner.graphs, owner.seconds
            self.stats["graphs_compiled"] += new
            self.stats["compile_seconds"] += secs
            if first:
                state["done"] = time.perf_counter() - state["t0"]
            else:
                self._recompiled(new, None, secs, state["marks"], background=True)
            state["marks"] = guard_marks()
        if new:   # saved first: "done" is said when nothing is left to do
            self._cache_dirty = True
            self.save_cache()
        line = self.background_line()
        if line is None:       # background mode was ended meanwhile
            return
        log.info("UNet Compiler: %s", line)
        if first and self.on_background_done is not None:
            try:
                self.on_background_done(line, "fallback" if self.failed else "compiled")
            except Exception:   # a listener must not break the thread
                log.debug("on_background_done listener failed", exc_info=True)

    def background_line(self) -> str | None:
        """The report line of background mode (None: warmup compiled in the foreground)."""
        state = self.background
        if state is None:
            return None
        owner = state["owner"]
        failed = f"; failed: {'; '.join(owner.failures[-2:])}" if owner.failures else ""
        if state["done"] is None:
            return (f"background compile: running, {owner.variants} region variant(s) compiled ({owner.graphs} "
                    f"graph(s)), {precompiled.BACKGROUND.queued} to go, {time.perf_counter() - state['t0']:.0f} s "
                    f"so far; region calls not ready run the model's own code ({owner.eager_calls} so far){failed}")
        return (f"background compile: done in {state['done']:.1f} s, {owner.variants} region variant(s) "
                f"({owner.graphs} graph(s)); {owner.eager_calls} region call(s) ran the model's own code "
                f"meanwhile{failed}")

    def save_cache(self):
        """Write what compiled so far to the persistent compile cache, if anything new did (never raises)."""
        if self.cache is not None and self._cache_dirty:
            self._cache_dirty = False
            self.cache.save()

    @contextlib.contextmanager
    def one_cache_save(self):
        """Calls inside save the compile cache once, at the end (warmup: every shape in one entry)."""
        prev, self._defer_save = self._defer_save, True
        try:
            yield
        finally:
            self._defer_save = prev
        if not prev:
            self.save_cache()

    def text(self) -> str:
        extra = self.backend.status_lines() + (self.graphs.status_lines() if self.graphs is not None else [])
        extra += self.cache.lines() if self.cache is not None else []
        extra += [f"  patch {name} (in {n} UNet call(s))" for name, n in sorted(self.patches_seen.items())]
        extra += [f"  recompile: {e['text']}" for e in self.recompiles[-5:]]
        line = self.background_line()
        extra += [f"  {line}"] if line else []
        return self.report.text(self.stats) + ("\n" + "\n".join(extra) if extra else "")
