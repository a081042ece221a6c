"""One model's compile ledger: the graphs each of its calls compiled (in this process, or loaded from
the compile cache), their seconds, the compiles after warmup (recompiles, named per prompt) and
what the compile thread compiled for it; new code is handed to the compile cache entry to keep."""
from __future__ import annotations

import contextlib
import time


def _graph_count() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def cache_hits(registry) -> int:
    """Graphs inductor took from its caches (the pack's compile cache fills them) so far, with the
    variants ``registry`` (a ``Variants``) loaded from the compile cache."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"]) + registry.from_cache


class Ledger:
    """Counts into ``stats`` (the accelerator's: ``graphs_compiled``, ``graphs_from_cache``,
    ``compile_seconds``, ``recompiles_after_warmup``), tells ``recompiles`` what compiled after
    warmup and ``cache`` (a CompileCache, or None) that something new is there to keep.
    ``compile_count(scheduler)``: the backend's own compiles so far (Triton kernel variants);
    ``scheduler``: the accelerator's (its variants and compile thread)."""

    def __init__(self, stats, recompiles, cache, compile_count, scheduler):
        self.stats, self.recompiles, self.cache, self.scheduler = stats, recompiles, cache, scheduler
        self._compile_count = compile_count

    def compiled(self) -> int:
        """Dynamo graphs plus the backend's own compiles, in this process so far."""
        return _graph_count() + self._compile_count(self.scheduler)

    @contextlib.contextmanager
    def call(self, shape: str | None, warmed: bool, warmed_shapes: list):
        """One model call: what compiled inside it is counted when it ends (``shape``: its label,
        named in a recompile line; ``warmed``: compiles now are recompiles)."""
        registry, bg = self.scheduler.variants, self.scheduler.thread
        before, hits_before, loads_before = self.compiled(), cache_hits(registry), registry.from_cache
        bg_before = (bg.epoch, bg.active)
        marks = self.scheduler.guard_marks() if warmed else None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            new = self.compiled() - before
            hits = cache_hits(registry) - hits_before
            self.stats["calls"] += 1
            if bg_before[1] or bg.active or bg.epoch != bg_before[0]:
                # the background thread compiled meanwhile: its graphs are counted when it is done
                # (``background_compiled``), not as this call's compiles or recompiles; what this
                # call took from the compile cache is its own (the thread loads nothing from it)
                new = hits
            if new:
                self.stats["graphs_compiled"] += new
                self.stats["graphs_from_cache"] += hits
                self.stats["compile_seconds"] += time.perf_counter() - t0
                if hits < new and self.cache is not None:  # something new to keep
                    self.cache.compiled_new()
                # precompiled variants loaded from the compile cache entry are no recompile (a
                # restart's warmup leaves the other listed shapes' variants to their first call);
                # a graph dynamo traced again is one, even where inductor's cache had its code
                loads = registry.from_cache - loads_before
                if warmed and new > loads:
                    self.stats["recompiles_after_warmup"] += new - loads
                    self.recompiles.record(new - loads, shape, time.perf_counter() - t0, marks, warmed_shapes)

    def background_compiled(self, graphs: int, seconds: float, first: bool, marks, mode, warmed_shapes) -> None:
        """The compile thread's queue emptied: count what it compiled for this model (the first time
        as warmup's, later as compiles after warmup) and keep it; ``mode``: the model's background
        mode (its probe labels go to the compile cache entry after a first run without failures)."""
        self.stats["graphs_compiled"] += graphs
        self.stats["compile_seconds"] += seconds
        if first and mode is not None and not mode.owner.failures and self.cache is not None:
            for label in mode.primes:
                self.cache.record_probe(label)
        if not first:
            self.stats["recompiles_after_warmup"] += graphs
            self.recompiles.record(graphs, None, seconds, marks, warmed_shapes, in_background=True)
        if graphs and self.cache is not None:
            self.cache.compiled_new()
