"""CUDA graphs of accelerated regions, one per (region, input signature).

At SD1.5 sizes a UNet step is a few hundred small kernels and the GPU waits on
Python between them; replaying a captured graph launches a region's kernels in
one call. The graphs are per leaf region, never the whole UNet call: ComfyUI's
dispatch between regions (ControlNet residuals, patches, transformer_options)
stays eager Python (DESIGN.md rule 2), so nothing it decides per step is baked
into a graph.

How a region call is served when graphs are on:

* The key is the region instance, each input's shape/stride/dtype/device, the
  autocast state and the addresses of the region's live parameters and
  buffers. A graph reads its weights from those addresses at every replay, so
  in-place weight updates (ComfyUI's LoRA patching into the same storage,
  hooks) are seen by the next replay; a parameter *replaced* by a new tensor
  changes the key, and the region's old graphs are dropped (rule 3).
* The first call with a key runs normally (it compiles / picks kernel configs,
  which cannot happen inside a capture); the second captures; later calls copy
  their inputs into the graph's static inputs, replay, and return a copy of
  the static output (a later replay of the same graph would overwrite it:
  ComfyUI may run cond and uncond as two calls of the same shape).
* At most ``max_shapes`` graphs per region (memory: each holds its output
  buffer); beyond that, calls run without a graph and the report says so.
* Graphs need CUDA inputs, inference (no autograd) and torch's native caching
  allocator: ComfyUI's default cudaMallocAsync cannot capture, which is
  probed up front (compat.triton.cuda_graphs_problem) with the fix. A capture
  that fails turns graphs off for this model, with the reason in the report;
  the region call then runs normally.

All captures share one memory pool: regions replay one at a time on one
stream and every static output stays referenced, so a graph's temporaries may
reuse another's without corrupting anything that is still read.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

log = logging.getLogger(__name__)


class CudaGraphs:
    """torch.cuda.CUDAGraph capture/replay (the one production implementation;
    tests on machines without a GPU hand :class:`RegionGraphs` a stand-in with
    the same two methods)."""

    def __init__(self):
        self.pool = None

    def usable(self, tensors) -> str | None:
        if not tensors or not all(t.is_cuda for t in tensors):
            return "inputs not on CUDA"
        if torch.cuda.is_current_stream_capturing():
            return "another capture is in progress"
        return None

    def capture(self, fn):
        g = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # thread_local: CUDA work on ComfyUI's other threads (previews) does not abort the capture
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return g, out


def _sig(args) -> tuple | None:
    sig = []
    for a in args:
        if a is None:
            sig.append(None)
        elif isinstance(a, torch.Tensor):
            sig.append((tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad))
        else:
            return None  # a non-tensor input: not graphable
    return tuple(sig)


def _autocast_state(device_type: str):
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


class _Region:
    __slots__ = ("slots", "ptrs", "graphs", "seen")

    def __init__(self, module):
        # (owner module, attribute name) for every parameter/buffer: read live each call,
        # so a replaced Parameter (ComfyUI's set_attr_param) is noticed
        self.slots = [(m, "_parameters", n) for m in module.modules() for n in m._parameters] + \
                     [(m, "_buffers", n) for m in module.modules() for n in m._buffers]
        self.ptrs = None
        self.graphs: dict = {}   # signature -> (graph, static inputs, static output)
        self.seen: set = set()

    def weight_ptrs(self) -> tuple:
        out = []
        for m, where, n in self.slots:
            t = getattr(m, where).get(n)
            out.append(None if t is None else t.data_ptr())
        return tuple(out)


class RegionGraphs:
    def __init__(self, max_shapes: int = 8, graphs=None):
        self.max_shapes = max_shapes
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.regions: dict[int, _Region] = {}
        self.stats: Counter = Counter()
        self.skipped: Counter = Counter()
        self.off: str | None = None

    def run(self, impl, module, args):
        """``impl(module, *args)``, through a captured graph where possible."""
        if self.off is not None:
            return impl(module, *args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        why = None
        if torch.is_grad_enabled():
            why = "autograd on"
        else:
            why = self.graphs.usable(tensors)
        sig = _sig(args) if why is None else None
        if why is None and sig is None:
            why = "non-tensor input"
        if why is not None:
            self.skipped[why] += 1
            return impl(module, *args)
        reg = self.regions.get(id(module))
        if reg is None:
            reg = self.regions[id(module)] = _Region(module)
        ptrs = reg.weight_ptrs()
        if ptrs != reg.ptrs:
            if reg.graphs:
                self.stats["dropped for new weights"] += len(reg.graphs)
            reg.graphs.clear()
            reg.seen.clear()
            reg.ptrs = ptrs
        key = (sig, _autocast_state(tensors[0].device.type if tensors else "cuda"))
        entry = reg.graphs.get(key)
        if entry is not None:
            graph, static_in, static_out = entry
            for s, a in zip(static_in, args, strict=True):
                if s is not None:
                    s.copy_(a)
            graph.replay()
            self.stats["replays"] += 1
            return static_out.clone()
        if key not in reg.seen or len(reg.graphs) >= self.max_shapes:
            if key in reg.seen:
                self.skipped[f"more than {self.max_shapes} shapes for one region"] += 1
            reg.seen.add(key)
            return impl(module, *args)
        return self._capture(reg, key, impl, module, args)

    def _capture(self, reg, key, impl, module, args):
        static_in = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
        call_args = [s if s is not None else a for s, a in zip(static_in, args, strict=True)]
        try:
            graph, static_out = self.graphs.capture(lambda: impl(module, *call_args))
            if not isinstance(static_out, torch.Tensor):
                raise TypeError(f"region returned {type(static_out).__name__}, not a tensor")
        except Exception as e:
            self.off = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            log.warning("UNet Compiler: CUDA graph capture failed (%s); graphs are off for this model and "
                        "regions run without them", self.off, exc_info=True)
            self.regions.clear()
            return impl(module, *args)
        reg.graphs[key] = (graph, static_in, static_out)
        self.stats["captured"] += 1
        # the capture recorded the work without running it: replay once for this call's result
        graph.replay()
        self.stats["replays"] += 1
        return static_out.clone()

    def status_lines(self) -> list[str]:
        if self.off is not None:
            return [f"  cuda graphs: off after a failed capture ({self.off})"]
        s = self.stats
        if not (s or self.skipped):
            return ["  cuda graphs: on, nothing captured yet (a region is captured on its 2nd call at a shape)"]
        regions = sum(1 for r in self.regions.values() if r.graphs)
        line = f"  cuda graphs: {s['captured']} captured for {regions} region(s), {s['replays']} replays"
        if s["dropped for new weights"]:
            line += f", {s['dropped for new weights']} dropped when weights were replaced"
        lines = [line]
        if self.skipped:
            lines.append("  cuda graphs not used for: " + ", ".join(f"{k} x{n}" for k, n in sorted(self.skipped.items())))
        return lines
