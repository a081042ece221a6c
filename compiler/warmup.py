"""Warmup: compile and prime a model's code for a list of shapes before sampling needs them.

``plan_warmup`` decides what a warmup runs (:class:`WarmupPlan`: probe shapes, listed shapes,
compare, background mode); ``run_plan`` drives any caller's one-forward ``run_one(shape)`` (the
diffusers API's inputs, ComfyUI's sampling-style call) through it, timing each call, counting the
graphs it compiled (and those the compile cache supplied), comparing the first shape with the
model's own code, and telling each call's :class:`Step` on the accelerator's events before it runs;
``warmup_runs`` does both and tells how the warmup ended (an :class:`Outcome`).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import torch

from . import shims
from .compat.comfy import is_interrupt
from .lifecycle import pacing, variants
from .lifecycle.background import BackgroundMode
from .reasons import Slower
from .report import Report, compiled_and_loaded, warmup_facts
from .runtime import ONE_SHAPE_NOTE, Accelerator
from .shapes import LATENT_SCALE, MIN_SIDE, Shape

#: backend auto keeps a region kind compiled unless the model's own code in its place made a forward at
#: least this share faster (under it: the timing's noise)
FASTER_BY = 0.03

#: the first shape traced when shapes are dynamic: batch 2, non-square, and at
#: least 2x2 at the deepest level of an SD UNet (latent / 8)
PROBE = Shape(2, 128, 192)


def probe_shapes(shapes: list[Shape], size_one_sides: bool = True, levels: int = 4, batch_unit: int = 1) -> list[Shape]:
    """Small shapes that prime every size specialisation inside the warmed box: one per
    size-1 class present (batch 1 vs >= 2; a side that is 1 at the UNet's deepest level vs
    larger), the generic one first, so every shape inside the box is a cache hit. On a video
    model the probes have the fewest frames of the entries that give frames. ``batch_unit``: every
    call's batch is a multiple of it (modules another pack inserted that take whole videos of that
    many frames): the probes' batches are 1 and 2 of it.
    ``size_one_sides`` False (code traced size-obliviously): only both sides at 1 is a class,
    so the one-side-small probes are left out."""
    small = LATENT_SCALE * 2 ** (levels - 1)   # px: a side up to this is 1 at the deepest level
    gen_w, gen_h = max(PROBE.width, 2 * small), max(PROBE.height, 3 * small)
    b_lo, b_hi = min(s.batch for s in shapes) // batch_unit, max(s.batch for s in shapes) // batch_unit
    w_lo, w_hi = min(s.width for s in shapes), max(s.width for s in shapes)
    h_lo, h_hi = min(s.height for s in shapes), max(s.height for s in shapes)
    bs = [2] * (b_hi >= 2) + [1] * (b_lo == 1)
    ws = [gen_w] * (w_hi > small) + [MIN_SIDE] * (w_lo <= small)
    hs = [gen_h] * (h_hi > small) + [MIN_SIDE] * (h_lo <= small)
    sides = [(w, h) for w in ws for h in hs]
    if not size_one_sides:
        sides = [(w, h) for w, h in sides if (w == MIN_SIDE) == (h == MIN_SIDE)]
        if not sides:          # (one side always small: its class is the only one in the box)
            sides = [(ws[-1], hs[-1])]
    # a video's frames need no probe class (a DiT block sees frames x patches as one token axis):
    # the probes take the fewest frames the video entries give, and say so in their label
    frames = min((s.frames for s in shapes if s.frames), default=None)
    return [Shape(b * batch_unit, w, h, frames) for b in bs for w, h in sides]



def _levels(unet) -> int:
    """Resolution levels of the UNet (SD1.5: 4, SDXL: 3)."""
    blocks = getattr(unet, "down_blocks", None) or getattr(unet, "channel_mult", None)
    return len(blocks) if blocks else 4


def one_shape(accel: Accelerator, shapes: list[Shape]) -> bool:
    """Whether warmup compiles exactly its one listed shape (static code) instead of code for every
    size: one shape, dynamic shapes on, nothing compiled yet, a backend that follows the setting.
    A later shape then compiles once more and then dynamically, and is named as a recompile."""
    return (len(shapes) == 1 and accel.config.dynamic_shapes is True and not accel.stats["graphs_compiled"]
            and accel.backend.follows_dynamic_shapes)


@dataclass(frozen=True)
class Step:
    """One UNet call warmup makes, told (the ``warmup_step`` event) before it runs: ``kind`` is
    "reference" (the model's own code, for the compare), "probe" (``index`` of ``of`` probe shapes,
    compiling what every listed shape inside the box then reuses), "shape" (``index`` of ``of``
    listed shapes), "capture" (a listed shape's second call, which captures its CUDA graphs),
    "check" (the compare's calls with one region kind on the model's own code) or "measure" (timing
    each region kind against the model's own code); ``shape`` the call's; ``compiles``: a listed
    shape's call compiles its code (no probe compiled it first). ``text`` says it in words."""
    kind: str
    shape: Shape
    index: int | None = None
    of: int | None = None
    compiles: bool = False

    @property
    def text(self) -> str:
        shape = self.shape.label
        if self.kind == "reference":
            return f"eager reference, {shape}: running"
        if self.kind == "probe":
            return f"priming {self.index + 1}/{self.of}, {shape}: compiling"
        if self.kind in ("shape", "capture"):
            verb = ("capturing CUDA graphs" if self.kind == "capture" else
                    "compiling" if self.compiles else "running")
            return f"shape {self.index + 1}/{self.of}, {shape}: {verb}"
        if self.kind == "check":
            return f"{shape}: checking which region kinds make the difference"
        return f"{shape}: timing each region kind against the model's own code"


def _probes(accel: Accelerator, shapes: list[Shape]) -> list[Shape]:
    """The probe shapes warmup runs first: only where code is specialised per shape (dynamo graphs,
    Triton kernel variants) and shapes are dynamic (those whose precompiled variants the compile
    cache holds already, ``primed_probes``, are then left out)."""
    if accel.config.dynamic_shapes and accel.backend.name != "eager" and accel.backend.specialises_on_shapes:
        # a DiT has no levels: its token grid is the latent / patch (no side reaches 1 by halving)
        levels = 1 if accel.plan.arch == "dit" else _levels(accel.root)
        probes = probe_shapes(shapes, size_one_sides=not (accel.backend.name == "inductor"
                                                          and variants.size_oblivious()), levels=levels,
                              batch_unit=accel.inserted.video_length or 1)
        return probes + [p for p in accel.backend.extra_probes(shapes, levels) if p not in probes]
    return []


def primed_probes(accel: Accelerator) -> set:
    """Probe shapes an earlier warmup ran into this model's compile cache entry (this process or
    one before it): the variants they made are in the entry, so a restart runs only the listed
    shapes (each probe costs a forward and a repack of every conv weight for its size: about half
    a range's restart, docs/starts.md). Only for precompiled regions, whose variants are what a probe
    makes; the Triton backend's kernel variants and plain dynamo graphs are not in the entry."""
    cache = getattr(accel, "cache", None)
    if cache is None or accel.backend.name != "inductor" or not variants.enabled():
        return set()
    return cache.primed_probes()


def measures_kinds(accel: Accelerator) -> bool:
    """Whether warmup times each region kind against the model's own code: backend ``auto`` on CUDA,
    the default, which must never lose to the model's own code (a backend chosen by name runs as
    asked; on a CPU a forward's timing is too noisy and too dear to repeat per kind)."""
    return accel.config.backend == "auto" and accel.device_type == "cuda"


def _timed_forward(run_one, shape):
    """(``run_one(shape)``, its seconds): on a GPU the GPU's, not the launch queue's."""
    t0 = time.perf_counter()
    out = run_one(shape)
    if isinstance(out, torch.Tensor) and out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out, time.perf_counter() - t0


def keep_the_faster(accel: Accelerator, run_one, shape: Shape, reps: int = 3) -> list[str]:
    """Time one forward at ``shape`` with every region kind compiled against the same with one kind at
    a time on the model's own code (interleaved, the median of ``reps`` each, after one settling
    forward); a kind whose own code makes the forward at least :data:`FASTER_BY` faster runs the
    model's own code from now on (a :class:`Slower` reason: a report line, not a fallback). Returns
    those kinds."""
    kinds = [k for k in accel.report.regions if k not in accel.failed]
    if not kinds:
        return []
    calls = accel.call_graphs
    if calls is not None:   # timed region by region: a state captured whole would take a shape's graph
        calls.held_back = True
    try:
        _timed_forward(run_one, shape)
        times: dict = {None: [], **{k: [] for k in kinds}}
        for _ in range(reps):
            times[None].append(_timed_forward(run_one, shape)[1])
            for k in kinds:
                with accel.gate.own_code([k]):
                    times[k].append(_timed_forward(run_one, shape)[1])
    finally:
        if calls is not None:
            calls.held_back = False
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    slower = [k for k in kinds if median[k] < median[None] * (1 - FASTER_BY)]
    for k in slower:
        why = Slower(f"measured faster on the model's own code at {shape.label} (a forward: "
                     f"{median[None] * 1e3:.1f} ms with them compiled, {median[k] * 1e3:.1f} ms without); "
                     f"backend auto keeps the faster",
                     "none needed; to compile them anyway, choose triton or inductor in Select Backend",
                     what=f"{k} regions")
        accel.gate.close([k], why)
        accel.report.note(str(why))
    return slower


def recorded_compare(accel: Accelerator, shape: Shape) -> dict | None:
    """The compare (max |compiled - eager|) an earlier warmup recorded for ``shape`` in the compile
    cache entry this model loaded, or None. Warmup shows it instead of running the eager reference
    again when all the code it runs came from that entry (checked after the run: anything compiled
    anew runs the reference then)."""
    return accel.cache.recorded_compare(shape.label) if accel.cache is not None else None


@dataclass
class WarmupPlan:
    """What one warmup runs, decided before its first call (:func:`plan_warmup`): the listed
    ``shapes``; the ``probes`` to run first (``primed``: the probe labels not run, their code in the
    compile cache entry, which holds that of the shape labels ``in_entry``); ``fixed``: exactly the
    one listed shape compiles (static code); ``compare`` the first shape against the model's own code
    (``kept``: the compare the entry recorded, shown unless code compiles anew); ``mode``: background
    mode (the runs record what the compile thread compiles) or None; ``measure``: auto's timing of
    each region kind after the shapes; ``captures``: each listed shape's second call captures its
    CUDA graphs; ``compiles``: the listed shapes' calls compile (no probe runs first).
    :meth:`steps` lists the calls it plans; the compare's checks and a reference after code compiled
    anew are decided as it runs, and a restart skips listed shapes the entry holds."""
    shapes: list[Shape]
    probes: list[Shape]
    primed: list[str]
    in_entry: frozenset
    fixed: bool
    compare: bool
    kept: dict | None
    mode: BackgroundMode | None
    measure: bool
    captures: bool
    compiles: bool

    def steps(self) -> list[Step]:
        """The UNet calls planned, in order, each as the ``warmup_step`` event tells it."""
        out = [Step("reference", self.shapes[0])] if self.compare and self.kept is None else []
        out += [self.probe(k) for k in range(len(self.probes))]
        for i in range(len(self.shapes)):
            out += [self.shape(i), self.capture(i)] if self.captures else [self.shape(i)]
        return out + ([Step("measure", self.shapes[0])] if self.measure else [])

    def probe(self, k: int) -> Step:
        """The step of probe shape ``k``."""
        return Step("probe", self.probes[k], k, len(self.probes))

    def shape(self, i: int) -> Step:
        """The step of listed shape ``i``'s first call."""
        return Step("shape", self.shapes[i], i, len(self.shapes), self.compiles)

    def capture(self, i: int) -> Step:
        """The step of listed shape ``i``'s second call, which captures its CUDA graphs."""
        return Step("capture", self.shapes[i], i, len(self.shapes))


def plan_warmup(accel: Accelerator, shapes: list[Shape], compare: bool = True,
                background: bool = False) -> WarmupPlan:
    """Decide what warming ``shapes`` runs (and set the accelerator up for it: one listed shape
    compiles exactly that shape, ``background`` records the calls for the compile thread where this
    model's code can compile there, else a note says why not). Nothing runs yet."""
    fixed = one_shape(accel, shapes)
    if len(shapes) > 1 and accel.config.dynamic_shapes is None:   # a range after a one-shape warmup
        accel.report.drop_notes(ONE_SHAPE_NOTE)
    compare = compare and bool(shapes)
    in_entry = frozenset(primed_probes(accel))
    kept = recorded_compare(accel, shapes[0]) if compare else None
    every = [] if fixed else _probes(accel, shapes)
    mode = accel.warmup_mode(shapes[0].label if fixed else None, background)
    compare = compare and mode is None      # (background: nothing compiled to compare yet)
    probes = [p for p in every if p.label not in in_entry]
    return WarmupPlan(shapes=list(shapes), probes=probes, primed=[p.label for p in every if p.label in in_entry],
                      in_entry=in_entry, fixed=fixed, compare=compare, kept=kept if compare else None, mode=mode,
                      measure=mode is None and bool(shapes) and measures_kinds(accel),
                      captures=accel.graphs is not None, compiles=accel.backend.name != "eager" and not probes)


def run_plan(accel: Accelerator, plan: WarmupPlan, run_one) -> Report:
    """Run ``plan``: ``run_one(shape)`` (one UNet forward, returns its output) for the probe shapes
    and then each shape, timing it and counting the graphs each one compiled; compare the first
    shape against the model's own code (the gate: a region kind that makes the difference runs the
    model's own code). Tells ``warmup_step`` (a :class:`Step`) before each call and
    ``warmup_shape`` (index, shape, seconds) after each listed shape, on ``accel.events``. Marks the
    accelerator warmed (later compiles are counted as recompiles; a warmup's own never are, also
    when an earlier warmup ran on the model). Returns the report."""
    was_warmed, accel.warmed = accel.warmed, False
    try:
        _run_plan(accel, plan, run_one)
    except BaseException:
        accel.warmed = was_warmed
        raise
    accel.warmed = True
    accel.warmed_shapes += [s.label for s in plan.shapes if s.label not in accel.warmed_shapes]
    return accel.report


def _run_plan(accel: Accelerator, plan: WarmupPlan, run_one) -> None:
    rep, shapes, mode = accel.report, plan.shapes, plan.mode
    background, compare, kept = mode is not None, plan.compare, plan.kept

    def told(step: Step):
        """``run_one``, each call told first as ``step`` (its shape the call's)."""
        def call(shape):
            accel.events.emit("warmup_step", replace(step, shape=shape))
            return run_one(shape)
        return call

    def timed(shape, label, step):
        g0, c0 = accel.stats["graphs_compiled"], accel.stats["graphs_from_cache"]
        out, secs = _timed_forward(step, shape)
        rep.warmup.append((label, secs, accel.stats["graphs_compiled"] - g0))
        rep.from_cache[label] = accel.stats["graphs_from_cache"] - c0
        return out, secs

    recorded = " (recorded for the background compile)" if background else ""
    if plan.primed:
        rep.note(f"probe shape(s) {', '.join(plan.primed)} not run: an earlier warmup ran them into the "
                 f"compile cache entry, which holds their code")
    ref = None
    patches0 = accel.patches_seen.copy()
    fresh0 = accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"]
    if compare and kept is None:
        # the model's own code first: at a restart the compile cache's variants load beside it
        # (``Variants.preload``) instead of before the first compiled call
        with accel.gate.bypass():
            ref = told(Step("reference", shapes[0]))(shapes[0])
    with (mode.recording() if background else contextlib.nullcontext(),
          accel.cache.one_save() if accel.cache is not None else contextlib.nullcontext()):
        served_from_entry = False
        for k, probe in enumerate(plan.probes):
            timed(probe, f"{probe.label} (probe){recorded}", told(plan.probe(k)))
            if background:       # compiled later, maybe: recorded once the thread compiled it all
                mode.primes.append(probe.label)
            elif accel.cache is not None and accel.ran_compiled_last():   # (no compiled code ran: none to keep)
                accel.cache.record_probe(probe.label)
        owner = mode.owner if background else None

        def missed():     # (graphs compiled anew, calls queued for the thread that their code had to compile)
            return (accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"],
                    owner.eager_calls - owner.deferred if owner is not None else 0)
        for i, shape in enumerate(shapes):
            if i and served_from_entry:
                rep.warmup.append((f"{shape.label} (not run: its code is in the compile cache entry)", 0.0, 0))
                accel.events.emit("warmup_shape", i, shape, 0.0)
                continue
            new0 = missed()
            out, secs = timed(shape, shape.label + recorded, told(plan.shape(i)))
            if plan.captures:  # a region is captured on its second call at a shape
                out, _ = timed(shape, f"{shape.label} (cuda graph capture)", told(plan.capture(i)))
            ran_compiled = accel.ran_compiled_last()     # (no compiled code ran: nothing of it to keep)
            if background:
                mode.primes.append(shape.label)
            elif accel.cache is not None and ran_compiled:
                accel.cache.record_probe(shape.label)
            # a restart: the first shape ran on code all from the entry (or, a CPU model in background
            # mode, left it to load once nothing samples), which an earlier warmup ran the other listed
            # shapes into: they are not run (each is a forward and a repack of the conv weights for its
            # size; a range's largest shape was most of its restart)
            served_from_entry = (i == 0 and not plan.captures and len(shapes) > 1
                                 and all(s.label in plan.in_entry for s in shapes[1:]) and new0 == missed())
            if served_from_entry:
                rep.note(f"shape(s) {', '.join(s.label for s in shapes[1:])} not run: the compile cache "
                         f"entry holds their code (an earlier warmup ran them into it); the first step at "
                         f"each loads it")
            if i == 0 and compare:
                fresh = accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"] - fresh0
                if ref is None and fresh:   # code compiled here: the recorded compare is not of it
                    with accel.gate.bypass():
                        ref = told(Step("reference", shape))(shape)
                if ref is not None:
                    rep.max_abs_diff, rep.diff_recorded = shims.max_diff(out, ref), None
                    if accel.cache is not None and ran_compiled:
                        accel.cache.record_compare(shape.label, rep.max_abs_diff)
                else:
                    rep.max_abs_diff, rep.diff_recorded = kept["max_abs_diff"], kept["measured"]
                # (an override replaces the attention function itself, as sage patches do; a replace patch,
                # as IPAdapter's, runs beside the model's own attention precision and keeps its dtype's)
                overrides = [name.split(":")[0] for name in accel.patches_seen - patches0
                             if "optimized_attention_override" in name]
                rep.diff_tolerance, rep.diff_tolerance_why = accel.gate.tolerance(
                    accel.autocast_dtype or accel.compute_dtype or torch.float32, accel.plan.regions,
                    ref if ref is not None else out, overrides)
                # the gate: never serve a wrong result
                accel.gate.compared(list(rep.regions), told(Step("check", shape)), shape, rep.max_abs_diff, ref,
                                    rep.diff_tolerance, f"at {shape.label}")
                ref = None
                rep.diff_label = f"at {shape.label}" + (f", {accel.config.precision} vs model dtype"
                                                         if accel.config.precision in ("fp16", "bf16") else "")
            accel.events.emit("warmup_shape", i, shape, secs)
        if plan.measure:
            keep_the_faster(accel, told(Step("measure", shapes[0])), shapes[0])


@dataclass(frozen=True)
class Outcome:
    """How a warmup of ``shapes`` listed shapes ended, told (the ``warmup_done`` event) when it
    ran to the end or a call of it raised: ``state`` "compiled", "fallback" (``reason``, ``fix``),
    "eager" (nothing compiles: ``reason``) or "compiling" (a background compile not done yet;
    ``waits_for_idle``: it waits until no prompt runs); ``ran`` of ``regions`` regions ran compiled
    code; ``graphs`` compiled in this process and ``loaded`` from the compile cache in ``seconds``;
    the compare's ``max_abs_diff`` (``diff_recorded``: when an earlier warmup measured it) against
    ``tolerance``. ``text`` says it in words."""
    backend: str
    shapes: int
    seconds: float
    state: str
    reason: str = ""
    fix: str = ""
    ran: int = 0
    regions: int = 0
    graphs: int = 0
    loaded: int = 0
    max_abs_diff: float | None = None
    diff_recorded: str | None = None
    tolerance: float | None = None
    waits_for_idle: bool = False

    @property
    def text(self) -> str:
        n = f"{self.shapes} shape(s)"
        if self.state == "eager":
            return f"eager: {n} in {self.seconds:.1f} s, no rewrites: {self.reason}."
        if self.state == "compiling":
            when = " once no prompt runs (on CPU, compiling beside sampling slows it)" if self.waits_for_idle else ""
            return (f"{self.backend}: compiling in the background{when}, {n} recorded in {self.seconds:.1f} s; "
                    f"until each region's code is ready it runs the model's own code")
        diff = self.max_abs_diff
        text = (f"{self.backend}: {self.state}, {self.ran} of {self.regions} regions ran compiled code, {n} in "
                f"{self.seconds:.1f} s, {compiled_and_loaded(self.graphs, self.loaded)}"
                + (f", max |compiled - eager| {diff:.2g}" if diff is not None else "")
                + (f" (as compiled, {self.diff_recorded})" if diff is not None and self.diff_recorded else ""))
        return text + (f": {self.reason}. Fix: {self.fix}." if self.state == "fallback" else "")


@dataclass(frozen=True)
class Counts:
    """Where a warmup started: ``t0`` (perf_counter), graphs compiled and loaded by then."""
    t0: float
    graphs: int
    loaded: int

    @classmethod
    def now(cls, accel: Accelerator) -> Counts:
        return cls(time.perf_counter(), accel.stats["graphs_compiled"], accel.stats["graphs_from_cache"])


def outcome(accel: Accelerator, shapes: int, since: Counts) -> Outcome:
    """How the warmup of ``shapes`` listed shapes that started at ``since`` ended, from the
    accelerator's report and counts now."""
    loaded = accel.stats["graphs_from_cache"] - since.loaded
    ran, regions = accel.ran_compiled()
    facts = warmup_facts(accel.report, accel.backend.name, accel.failed, (ran, regions), accel.cast_eager)
    state = facts["state"]
    if state == "compiled" and accel.background is not None and accel.background.done is None:
        state = "compiling"
    rep = accel.report
    return Outcome(backend=accel.backend.name, shapes=shapes, seconds=time.perf_counter() - since.t0, state=state,
                   reason=facts["reason"], fix=facts["fix"], ran=ran, regions=regions,
                   graphs=accel.stats["graphs_compiled"] - since.graphs - loaded, loaded=loaded,
                   max_abs_diff=rep.max_abs_diff, diff_recorded=rep.diff_recorded, tolerance=rep.diff_tolerance,
                   waits_for_idle=state == "compiling" and pacing.waits_for_idle(accel.device_type))


def warmup_runs(accel: Accelerator, shapes: list[Shape], run_one, compare: bool = True,
                background: bool = False) -> Report:
    """Plan the warmup of ``shapes`` and run it with ``run_one`` (:func:`plan_warmup`,
    :func:`run_plan`), then tell its :class:`Outcome` (``warmup_done`` on ``accel.events``), also
    when a call raised (a cancel or out of memory excepted: nothing is told). Returns the report."""
    since = Counts.now(accel)
    # the dtype the regions compute in, as this warmup's calls find it (the model may have moved to
    # another dtype since its first call: its tolerance is that dtype's)
    accel.compute_dtype = None
    try:
        rep = run_plan(accel, plan_warmup(accel, shapes, compare, background), run_one)
    except BaseException as e:
        if not is_interrupt(e):
            accel.events.emit("warmup_done", outcome(accel, len(shapes), since))
        raise
    accel.events.emit("warmup_done", outcome(accel, len(shapes), since))
    return rep
