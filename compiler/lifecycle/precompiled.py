"""A region body as precompiled variants (``variants.py``), compiled on a miss in the calling thread
or queued for the background thread (``background.py``); ``fallback`` (plain torch.compile of the
same body) serves what cannot be precompiled. ``body`` gives the one process-wide instance per body
and options. Policy and measurements: DEVELOPERS.md, "Precompiled regions".
"""
from __future__ import annotations

import functools
import logging
import weakref

import torch

from . import pacing, priming, variants, worker
from ..compat import comfy as comfy_compat
from ..reasons import error_summary
from .variants import structure

log = logging.getLogger(__name__)


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


def _device_type(args: tuple) -> str:
    return next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")


class Precompiled:
    """One region body as precompiled variants (see the module docstring), kept in ``scheduler``'s
    registry and compiled by its thread in background mode; ``fallback`` is the same body under plain
    torch.compile, for regions this cannot serve."""

    def __init__(self, body, backend, dynamic: bool | None, fallback, options: tuple, scheduler):
        self.body, self.backend, self.dynamic, self.fallback, self.options = body, backend, dynamic, fallback, options
        self.scheduler = scheduler
        self.__name__ = getattr(body, "__name__", "body")
        self._no_aot: set[str] = set()
        self._compilers: dict = {}

    def _missed(self, key, module, why: str | None = None) -> None:
        """``module``'s call met ``key``, which is not precompiled (``why``: the reason, the first time);
        kept in the scheduler's registry (``Variants.misses``) for the report's line."""
        registry = self.scheduler.variants
        entry = registry.misses.get(key)
        if entry is not None and module in entry[1]:
            return   # (every later call of a region on a key left to plain torch.compile: no lock)
        with registry.lock:
            entry = registry.misses.get(key)
            if entry is None and why is not None:
                entry = registry.misses[key] = (why, weakref.WeakSet())
            if entry is not None:
                entry[1].add(module)

    def missed_for(self, modules) -> str | None:
        """Why a variant of this body that a call of one of ``modules`` (a model's region modules) met
        could not be precompiled (the first such reason), or None: one model's miss is not another's."""
        ids = {id(m) for m in modules}
        registry = self.scheduler.variants
        with registry.lock:
            met = [registry.misses[k] for k in list(self._no_aot) if k in registry.misses]
            return next((why for why, seen in met if any(id(m) in ids for m in list(seen))), None)

    def _compiler(self, dynamic: bool):
        if dynamic not in self._compilers:
            self._compilers[dynamic] = torch.compile(self.body, backend=self.backend, fullgraph=True, dynamic=dynamic,
                                                     options={"guard_filter_fn": variants.guard_filter})
        return self._compilers[dynamic]

    def __call__(self, module, *args):
        args = _canonical(args)
        registry, thread = self.scheduler.variants, self.scheduler.thread
        struct = structure(module, args, widths=self.dynamic is not True)
        if struct is None or (key := registry.key(self.body, struct, self.options)) in self._no_aot:
            if struct is not None:
                self._missed(key, module)
            if thread.running:
                # plain torch.compile would compile here, beside the thread (and a dynamo-compiled
                # function called while the thread traces raises: FX's tracing flag is process-wide)
                return self.uncompiled(module, *args)
            return self.fallback(module, *args)
        variants.met(key)       # (this model's entry saves the variants its calls met)
        owner = worker.current_owner()
        if (owner is not None or thread.active) and pacing.waits_for_idle(_device_type(args)) \
                and registry.waiting(key):
            # a CPU model's code from the compile cache loads once nothing samples, as its compile would:
            # a restart's first image runs the body's own code (packed convs: near compiled speed on CPU)
            if owner is not None:
                owner.deferred += 1
            return self._queued(key, module, args, struct[1], owner)
        found = registry.candidates(key)
        for fn in found:
            if fn.guard_check(module, *args):
                if fn.from_cache and not getattr(fn, "used", False):
                    return self._first_use(key, fn, module, args)
                return fn.fn(module, *args)
        if found:
            f_locals = found[-1].prepare_f_locals(module, *args)
            registry.failures.extend(variants.failed_parts(found[-1], f_locals) or ["no precompiled variant matched"])
        elif (why := registry.unbound_reason(key)) is not None:
            registry.failures.append(why)
        if owner is not None or thread.active:
            # the daemon thread compiles it (never two compiling threads); this call runs the body's
            # own code meanwhile
            return self._queued(key, module, args, struct[1], owner)
        # dynamic shapes on: symbolic from the start; off: static always; one warmup shape (None):
        # static first, then symbolic once a key misses (torch's automatic-dynamic rule)
        dynamic = self.dynamic if self.dynamic is not None else bool(found)
        return self._compile(key, module, args, dynamic=dynamic)

    def _queued(self, key, module, args, struct_inputs, owner):
        self.scheduler.thread.add(self, key, module, args, struct_inputs, owner)
        if owner is not None:
            owner.eager_calls += 1
        return self.uncompiled(module, *args)

    def uncompiled(self, module, *args):
        """The body's own code, for a call no variant serves yet: on CPU with the options' prepacked
        convs (``passes.prepack_conv.PackedConvs``), the packed copies compiled code uses too. Not
        while a warmup records for the thread: a copy is packed for one input size, and a range's
        probe sizes would each re-pack every weight that sampling packs again (docs/internals.md)."""
        if self.options and self.options[0] and not self.scheduler.thread.recording and \
                any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args):
            from ..passes import prepack_conv
            with prepack_conv.PackedConvs():
                return self.body(module, *args)
        return self.body(module, *args)

    def _first_use(self, key, fn, module, args):
        """A variant from the compile cache, called the first time: if it raises (something it calls
        is missing here), it is dropped and the region compiles, rather than the region kind
        falling back to eager for good."""
        try:
            out = fn.fn(module, *args)
        except Exception as e:
            if comfy_compat.is_cancel(e):
                raise
            registry = self.scheduler.variants
            with registry.lock:
                if fn in registry.live[key]:
                    registry.live[key].remove(fn)
                registry.blobs[key].pop(getattr(fn, "digest", ""), None)   # not saved again
                registry.unusable += 1
            log.warning("UNet Compiler: a precompiled %s from the compile cache failed at its first call (%s); "
                        "it compiles again", self.__name__, error_summary(e))
            return self._compile(key, module, args, dynamic=bool(self.dynamic))
        fn.used = True
        self.scheduler.variants.from_cache += 1
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
        with variants.collecting() as functions:
            fn = self._traced(module, args, dynamic)
        # (bound as traced: checked by identity at each call; the names read the body's module globals)
        fn.global_functions = functions
        fn.globals_module = (getattr(self.body, "__globals__", None) or {}).get("__name__")
        return fn

    def _traced(self, module, args, dynamic: bool):
        compiler = self._compiler(dynamic)
        # no duck sizing: sizes that only happen to be equal in the traced call (a weight's width and a
        # token count, RoPE's pair dim and the batch) would be one symbol and a guard of the variant
        with torch._dynamo.config.patch(specialize_float=True), variants.fx_config().patch(use_duck_shape=False):
            if dynamic and variants.size_oblivious() and not any(isinstance(a, torch.Tensor) and 1 in a.shape[1:]
                                                        for a in args):
                try:
                    with variants.fx_config().patch(backed_size_oblivious=True):
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
            if comfy_compat.is_oom(e):
                # memory was short while it compiled (beside sampling, a hires pass): not the body's
                # fault, so nothing is marked; in the sampling thread the call's error (the runtime
                # runs the model's own code for it), in the compile thread the job is dropped and a
                # later miss queues it again
                if not first_call:
                    raise
                log.info("UNet Compiler: out of memory compiling %s in the background; tried again at its next "
                         "miss", self.__name__)
                return None
            # a body that does not trace into one graph (a graph break) or a torch without the API:
            # this key runs under plain torch.compile from now on
            log.info("UNet Compiler: %s is not precompiled for this region (%s); plain torch.compile",
                     self.__name__, error_summary(e))
            self._missed(key, module, error_summary(e))
            self._no_aot.add(key)
            return None
        blob = None
        try:
            blob = variants.serialize(fn)
        except Exception as e:   # runs; not kept across restarts
            log.info("UNet Compiler: a precompiled %s cannot be saved (%s)", self.__name__, error_summary(e))
        if first_call:
            try:
                priming.first_calls(fn, [module, *others], args)
            except Exception as e:
                if comfy_compat.is_cancel(e):
                    raise
                if comfy_compat.is_oom(e):   # the variant is fine; its first call waits for the sampling thread
                    self.scheduler.variants.add_compiled(key, fn, blob)
                    return fn
                log.info("UNet Compiler: a precompiled %s failed its first call (%s); plain torch.compile",
                         self.__name__, error_summary(e))
                self._missed(key, module, f"its first call failed: {error_summary(e)}")
                self._no_aot.add(key)
                return None
        self.scheduler.variants.add_compiled(key, fn, blob)
        return fn


@functools.lru_cache(maxsize=None)
def body(raw_body, backend, dynamic: bool | None, fallback, options: tuple, scheduler) -> Precompiled:
    """The precompiled form of ``raw_body`` for these options under ``scheduler`` (the process's:
    every clone shares it)."""
    return Precompiled(raw_body, backend, dynamic, fallback, options, scheduler)
