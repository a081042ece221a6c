"""One CUDA graph per UNet call, where nothing inside the call needs Python between its regions.

A UNet call whose body is the same launches every time (no ComfyUI patch, wrapper or attention
override in the call, no forward hook on the model, every weight ComfyUI casts per call resident: a
Dynamic VRAM slot, pinned for the call, or the leaf's own, every input a tensor, None, a flag or a
name; a ControlNet's residuals are tensor inputs, added where the capture added them, the graph
keyed by which are given) is captured whole on its second call at an input
signature and replayed from the third: the regions' compiled code and ComfyUI's dispatch between
them in one graph (as stable-fast does), where per-region graphs leave that dispatch to Python. Any
other call runs as before, through the per-region graphs, and the report counts why. A replay
serves a copy of the output (a sampler may hold one call's result while it makes the next), and
counts for each region what its capture counted. The graph is keyed by the inputs' signature, the
fixed values and which region kinds run the model's own code; a moved or replaced weight or a
changed module tree drops it (``RegionGraphs.begin_call``); a failed capture turns these graphs off
for the model and leaves the per-region graphs on. UNets only: a DiT's call builds positions and masks in Python per call.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import Counter

import torch

from . import cast, graphs
from .compat import comfy as comfy_compat
from .graphs import RegionGraphs


#: why a call runs region by region after its whole call ran out of memory with every slot pinned
OUT_OF_MEMORY_PINNED = ("out of memory with every weight pinned for one graph (ComfyUI's own casts pin one "
                        "op's weights at a time)")


def _flatten(value, path, tensors: list, fixed: list) -> str | None:
    """``value``'s tensors appended to ``tensors`` and its other parts to ``fixed`` (with ``path``);
    why the graph cannot hold it, or None."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        fixed.append((path, "tensor"))
    elif value is None or isinstance(value, (bool, str)):
        fixed.append((path, value))
    elif isinstance(value, (int, float)):
        return "a number input (a Python number may change every call)"
    elif isinstance(value, (tuple, list)):
        fixed.append((path, type(value).__name__, len(value)))
        for i, v in enumerate(value):
            why = _flatten(v, (*path, i), tensors, fixed)
            if why:
                return why
    elif isinstance(value, dict):
        fixed.append((path, "dict", tuple(value)))
        for k, v in value.items():
            why = _flatten(v, (*path, k), tensors, fixed)
            if why:
                return why
    else:
        return f"an input the graph cannot hold ({type(value).__name__})"
    return None


def _rebuild(value, it):
    """``value``'s structure with its tensors taken in order from ``it``."""
    if isinstance(value, torch.Tensor):
        return next(it)
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuild(v, it) for v in value)
    if isinstance(value, dict):
        return {k: _rebuild(v, it) for k, v in value.items()}
    return value


def call_problem(kwargs: dict) -> str | None:
    """Why this ComfyUI UNet call's keyword arguments need Python between its regions (None: they
    do not): a patch, a diffusion-model wrapper or an attention override. (A ControlNet's residuals,
    ``control``, are inputs: the UNet adds each at a fixed place, which the capture records.)"""
    to = kwargs.get("transformer_options") or {}
    if any(to.get("patches", {}).values()) or any(to.get("patches_replace", {}).values()):
        return "a model patch runs inside the call"
    if any((to.get("wrappers") or {}).get("diffusion_model", {}).values()):
        return "a diffusion-model wrapper runs around the call"
    if "optimized_attention_override" in to:
        return "an attention override runs inside the call"
    return None


def cast_leaves(root: torch.nn.Module) -> list:
    """The leaves of ``root`` ComfyUI can make cast or patch per call: those of classes with its cast
    flags (what a whole call's slots are checked over, ``cast.slots_resident``)."""
    return [m for m in root.modules() if next(m.children(), None) is None and comfy_compat.cast_flags_of(type(m))]


class CallGraphs:
    """The whole-call graphs of one UNet (``root``) beside its per-region graphs (``regions``, which
    step aside while a whole call runs). ``stats``: the accelerator's, whose region counts a replay
    repeats; ``skipped``: why calls ran without their graph."""

    def __init__(self, root: torch.nn.Module, regions: RegionGraphs, stats: Counter):
        self.regions, self.stats = regions, stats
        self.graphs = RegionGraphs(max_shapes=regions.max_shapes, graphs=regions.graphs, measured=regions.measured,
                                   copies=True, thread=regions.thread)
        self.skipped: Counter = Counter()
        self._root = weakref.ref(root)
        self._pinned_oom: set = set()   # (signature, fixed inputs) whose whole call ran out of memory
        self._survey(root)
        #: set while warmup times region kinds against each other: calls go region by region, uncounted
        #: (a trial state captured whole would take a shape's place)
        self.held_back = False
        self._counted: dict = {}   # graph key -> (region counts, region ids) its capture counted
        self._wrap: dict = {}      # graph key -> (output class, field names): a diffusers output, rebuilt

    def _survey(self, root) -> None:
        """What a call checks of the UNet's modules: the leaves ComfyUI casts, their cast flags and every
        module's hooks; read again when the module tree changed (:data:`graphs.STRUCTURE`)."""
        self._structure, self._tree = graphs.STRUCTURE[0], graphs.tree(root)
        self._leaves = cast_leaves(root)
        self._watched = cast.watch(self._leaves)
        self._hooks = [d for m in root.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        graphs.track(root.modules())

    def problem(self, kwargs: dict, hooks_seen_none: bool = False) -> str | None:
        """Why this call runs through the per-region graphs (None: it can be one graph).
        ``hooks_seen_none``: the overrides watch found no hook on any module this call."""
        if self.graphs.off is not None:
            return None   # said by the graphs' own status line
        if self._structure != graphs.STRUCTURE[0]:
            root = self._root()
            if root is not None and graphs.tree(root) != self._tree:
                self._survey(root)   # (the whole call's graphs went in begin_call)
            self._structure = graphs.STRUCTURE[0]
        why = call_problem(kwargs)
        if why:
            return why
        if not hooks_seen_none and (any(self._hooks) or torch.nn.modules.module._global_forward_hooks
                                    or torch.nn.modules.module._global_forward_pre_hooks):
            return "a forward hook runs inside the call"
        if comfy_compat.compiler_records():
            return "ComfyUI's compiler records the model's allocations"
        return None

    def call(self, forward, root, args: tuple, kwargs: dict, failed: dict, ran_last: set, shims,
             overridden: str | None = None, hooks_seen_none: bool = False):
        """``forward(root, *args, **kwargs)``, one graph where it can be (``failed``: the region
        kinds running the model's own code, part of the key; ``ran_last``: the regions that ran
        compiled code this call, which a replay fills as its capture did; ``shims()``: the regions'
        shims installed around the forward, which a replay does without; ``overridden``: why the
        call goes region by region, another node's code being set on the modules;
        ``hooks_seen_none``: the overrides watch found no hook this call, so none is looked for)."""
        if self.held_back:
            with shims():
                return forward(root, *args, **kwargs)
        plain = {k: v for k, v in kwargs.items() if k != "transformer_options"}
        tensors, fixed = [], []
        why = overridden or self.problem(kwargs, hooks_seen_none) or _flatten((args, plain), (), tensors, fixed)
        if why is None and self.graphs.off is None and not cast.none_per_call(self._watched):
            # ComfyUI casts per call (Dynamic VRAM flags every op): one graph where every cast weight is
            # resident, its slots pinned for the call, as ComfyUI's own block graphs replay
            dtype, device = cast.compute_of(tensors) or (None, None)
            oom = self._pinned_oom and (graphs._sig(tensors), tuple(fixed)) in self._pinned_oom
            why = OUT_OF_MEMORY_PINNED if oom else None
            try:
                if why is None:
                    with cast.slots_resident(self._leaves, dtype, device) as resident:
                        if resident is not None:
                            return self._whole(forward, root, args, plain, kwargs, tensors, fixed, failed,
                                               ran_last, shims, *resident)
                    why = "a weight ComfyUI casts per call is not resident (streamed, converted or patched per call)"
            except Exception as e:
                if not comfy_compat.is_oom(e):
                    raise
                # the call's first run or capture needs room its pinned slots keep aimdo from making (the
                # model's own code pins one op's): region by region from now on at this signature, where
                # ComfyUI casts each op; an out of memory there too is the model's (it propagates)
                comfy_compat.release_failed(e, tensors)
                self._pinned_oom.add((graphs._sig(tensors), tuple(fixed)))
                why = OUT_OF_MEMORY_PINNED
        if why is not None or self.graphs.off is not None:
            if why is not None:
                self.skipped[why] += 1
            with shims():
                return forward(root, *args, **kwargs)
        return self._whole(forward, root, args, plain, kwargs, tensors, fixed, failed, ran_last, shims)

    def _whole(self, forward, root, args, plain, kwargs, tensors, fixed, failed, ran_last, shims, weights=None,
               show=contextlib.nullcontext):
        """The call through its whole-call graph (``weights``: the resident cast weights' addresses,
        which the graph is captured with and must find again; ``show()``: the context in which the
        model's code sees them, where the call runs it rather than replaying)."""
        extra = (tuple(fixed), tuple(sorted(failed)))
        options = {"transformer_options": kwargs["transformer_options"]} if "transformer_options" in kwargs else {}
        ran = []

        def whole(module, *flat):
            a, k = _rebuild((args, plain), iter(flat))
            before, earlier = Counter(self.stats), set(ran_last)
            ran_last.clear()
            # inside the whole call's first run and capture the regions run as they are; where it runs
            # its launches instead (not kept, over budget), they use their own graphs
            self.regions.aside = self.graphs.recording
            try:
                with show(), shims():
                    out = forward(module, *a, **k, **options)
            finally:
                self.regions.aside = False
            counted = Counter(self.stats)
            counted.subtract(before)
            self._counted[extra] = (+counted, set(ran_last))
            ran_last.update(earlier)
            if self.graphs.capturing:   # the capture records this call, its replay counts it
                self.stats.subtract(counted)
            ran.append(True)
            if hasattr(out, "to_tuple") and hasattr(out, "keys"):   # diffusers' output dataclass
                self._wrap[extra] = (type(out), list(out.keys()))
                return out.to_tuple()
            return out
        out = self.graphs.run(whole, root, tensors, weights=weights, extra=extra)
        if not ran and extra in self._counted:   # a replay: the regions' counts as its capture made them
            counted, ids = self._counted[extra]
            self.stats.update(counted)
            ran_last |= ids
        wrap = self._wrap.get(extra)
        return wrap[0](**dict(zip(wrap[1], out, strict=True))) if wrap is not None else out

    def status_lines(self) -> list[str]:
        g = self.graphs
        if g.off is not None:
            return [f"  one graph per UNet call: off after a failed {g.off}; the regions' graphs run"]
        s = g.stats
        if not (s or self.skipped or g.skipped):
            return []
        lines = [f"  one graph per UNet call: {s['captured']} captured, {s['replays']} replays, "
                 f"{g.bytes / 2**20:.0f} MiB of static buffers" + g.history()]
        why = Counter(self.skipped)
        why.update(g.skipped)
        if why:
            lines.append("  UNet calls through the regions' graphs instead: "
                         + ", ".join(f"{k} x{n}" for k, n in sorted(why.items())))
        return lines
