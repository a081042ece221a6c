"""Warmup: compile and prime a model's code for a list of shapes before sampling needs them.

``warmup_runs`` drives any caller's one-forward ``run_one(shape)`` (the diffusers API's inputs,
ComfyUI's sampling-style call) over the probe shapes and then each shape, timing each, counting
the graphs it compiled (and those the compile cache supplied), and comparing the first shape with
the model's own code. ``warmup_probes`` says which probe shapes a backend needs.
"""
from __future__ import annotations

import contextlib
import time

import torch

from . import cast
from .lifecycle import background as bg
from .lifecycle import variants
from .reasons import wrong_result
from .runtime import Accelerator
from .shapes import Shape, probe_shapes

#: the largest max |compiled - eager| warmup accepts, as a fraction of max(1, max |eager|), by the dtype
#: the regions compute in: kernels and graphs round differently (measured ~1e-5 in fp32 on a CPU;
#: TF32 matmuls and fp16 / bf16 autocast leave more), while wrong weights or a wrong kernel are off
#: by the output's own size
TOLERANCE = {torch.float32: 1e-2, torch.float16: 5e-2, torch.bfloat16: 1e-1}
#: ... for a model with leaves that multiply quantized (ComfyUI's fp8 / int8 / nvfp4 matmuls quantize
#: their input too: an upstream rounding difference flips a value by a step of the format, 1/8 for fp8)
QUANTIZED_TOLERANCE = 0.25


def tolerance(accel: Accelerator, ref: torch.Tensor | None) -> float:
    """The gate's tolerance for ``accel``'s compare against the eager output ``ref``."""
    return tolerance_and_why(accel, ref)[0]


def tolerance_and_why(accel: Accelerator, ref: torch.Tensor | None, since=None) -> tuple[float, str]:
    """(the gate's tolerance, why it is not the model dtype's: "" when it is). Where an attention
    override runs its own code in the calls compared (a sage-style override that casts q, k and v to
    fp16), that code's rounding, fed by compiled neighbours whose own rounding differs slightly, sets
    the difference: fp16's tolerance then, and the report names the override. ``since``: the
    accelerator's ``patches_seen`` before the compared calls (only the patches they ran count)."""
    dtype = accel.autocast_dtype or accel.compute_dtype or torch.float32
    scale = 1.0 if ref is None else max(1.0, float(ref.float().abs().max()))
    if any(cast.quantized(leaf) for region in accel.plan.regions for leaf in region.leaves):
        return QUANTIZED_TOLERANCE * scale, "quantized matmuls"
    tol = TOLERANCE.get(dtype, max(TOLERANCE.values()))
    seen = accel.patches_seen - since if since is not None else accel.patches_seen
    # (an override replaces the attention function itself, as sage patches do; a replace patch, as
    # IPAdapter's, runs beside the model's own attention precision and keeps the model dtype's)
    patches = [name.split(":")[0] for name in seen if "optimized_attention_override" in name]
    if patches and tol < TOLERANCE[torch.float16]:
        return TOLERANCE[torch.float16] * scale, (f"fp16's, as an attention patch runs its own code "
                                                  f"({', '.join(patches)}), which may compute in fp16")
    return tol * scale, ""


def _diff(out, ref) -> float:
    return float((out.float() - ref.float()).abs().max())


def gate(accel: Accelerator, run_one, shape: Shape, ref, diff: float, tol: float) -> list[str]:
    """The compare found ``diff`` over ``tol``: find the region kinds whose compiled code alone makes
    a difference over it (one forward each, the others on the model's own code; with no eager
    output to compare, or none alone: every kind) and turn them to the model's own code for good.
    Returns the kinds refused."""
    kinds = list(accel.report.regions)
    bad = []
    if ref is not None and len(kinds) > 1:
        for k in kinds:
            with accel.own_code([o for o in kinds if o != k]):
                if _diff(run_one(shape), ref) > tol:
                    bad.append(k)
        if bad and set(bad) != set(kinds):
            # the others together, without the bad ones: an interaction refuses every kind
            with accel.own_code(bad):
                rest_ok = _diff(run_one(shape), ref) <= tol
            bad = bad if rest_ok else kinds
    bad = bad or kinds
    accel.refuse(bad, wrong_result(diff, tol, f"at {shape.label}"))
    return bad


def _levels(unet) -> int:
    """Resolution levels of the UNet (SD1.5: 4, SDXL: 3)."""
    blocks = getattr(unet, "down_blocks", None) or getattr(unet, "channel_mult", None)
    return len(blocks) if blocks else 4


def fix_shape(accel: Accelerator, shapes: list[Shape]) -> bool:
    """Warmup lists one shape: compile exactly that shape (static code) instead of code for every
    size. Only with dynamic shapes on and nothing compiled yet; a later shape compiles once more and
    then dynamically, and is named as a recompile. Returns whether it did."""
    if (len(shapes) != 1 or accel.config.dynamic_shapes is not True or accel.stats["graphs_compiled"]
            or not accel.backend.follows_dynamic_shapes):
        return False
    accel.reconfigure(accel.config.replace(dynamic_shapes=None))
    accel.report.notes.append(f"one warmup shape: compiled for exactly {shapes[0].label}; another shape "
                              f"compiles once, then for any size. Warm a range: list its smallest and "
                              f"largest shapes")
    return True


def warmup_probes(accel: Accelerator, shapes: list[Shape]) -> list[Shape]:
    """The probe shapes warmup runs first: only where code is specialised per shape
    (dynamo graphs, Triton kernel variants) and shapes are dynamic; not those whose precompiled
    variants the compile cache holds already (``primed_probes``)."""
    primed = primed_probes(accel)
    return [p for p in _probes(accel, shapes) if p.label not in primed]


def _probes(accel: Accelerator, shapes: list[Shape]) -> list[Shape]:
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
    shapes (each probe costs a forward and a repack of every conv weight for its size: 8.7 s of the
    range row's 16.8 s restart). Only for precompiled regions, whose variants are what a probe
    makes; the Triton backend's kernel variants and plain dynamo graphs are not in the entry."""
    cache = getattr(accel, "cache", None)
    if cache is None or accel.backend.name != "inductor" or not variants.enabled():
        return set()
    return cache.primed_probes()


def recorded_compare(accel: Accelerator, shape: Shape) -> dict | None:
    """The compare (max |compiled - eager|) an earlier warmup recorded for ``shape`` in the compile
    cache entry this model loaded, or None. Warmup shows it instead of running the eager reference
    again when all the code it runs came from that entry (checked after the run: anything compiled
    anew runs the reference then)."""
    return accel.cache.recorded_compare(shape.label) if accel.cache is not None else None


@contextlib.contextmanager
def _done_line_if_stopped(accel, background: bool):
    """A background warmup that raises (a model that cannot be called outside sampling) leaves the model
    in background mode: its sampling calls queue the compiles, and the report's background line ends
    with "done" once the thread has compiled them."""
    try:
        yield
    except BaseException:
        if background and accel.background is not None:
            accel.background.started(settle=False)
        raise


def warmup_runs(accel: Accelerator, shapes: list[Shape], run_one, on_shape=None, compare=True,
                background: bool = False):
    """Run ``run_one(shape)`` (one UNet forward, returns its output) for the
    probe shapes and then each shape, timing it and counting the graphs each
    one compiled; compare the first shape against the eager reference. Marks
    the accelerator warmed (later compiles are counted as recompiles).

    ``background``: the runs only record what to compile and run the model's own code; a daemon
    thread compiles it (``background.BACKGROUND``) while sampling goes on with the model's own code
    in every region not ready yet. Where that is impossible a note says why and warmup compiles first."""
    rep = accel.report
    fix_shape(accel, shapes)
    why = bg.problem(accel) if background else None
    if why:
        rep.notes.append(f"background compile: not used: {why}; warmup compiled before sampling")
        background = False
    if not background:
        accel.end_background()

    def timed(shape, label):
        g0, c0 = accel.stats["graphs_compiled"], accel.stats["graphs_from_cache"]
        t0 = time.perf_counter()
        out = run_one(shape)
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize(out.device)  # the seconds are the GPU's, not the launch queue's
        secs = time.perf_counter() - t0
        rep.warmup.append((label, secs, accel.stats["graphs_compiled"] - g0))
        rep.from_cache[label] = accel.stats["graphs_from_cache"] - c0
        return out, secs

    recorded = " (recorded for the background compile)" if background else ""
    primed = primed_probes(accel)
    every = _probes(accel, shapes)
    probes = [p for p in every if p.label not in primed]      # (``warmup_probes``, computed once)
    known = [p.label for p in every if p.label in primed]
    if known:
        rep.notes.append(f"probe shape(s) {', '.join(known)} not run: an earlier warmup ran them into the "
                         f"compile cache entry, which holds their code")
    ref = None
    patches0 = accel.patches_seen.copy()
    compare = compare and not background and bool(shapes)   # (background: nothing compiled to compare yet)
    kept = recorded_compare(accel, shapes[0]) if compare else None
    fresh0 = accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"]
    if compare and kept is None:
        # the model's own code first: at a restart the compile cache's variants load beside it
        # (``Variants.preload``) instead of before the first compiled call
        with accel.bypass():
            ref = run_one(shapes[0])
    with _done_line_if_stopped(accel, background), \
            (accel.cache.one_save() if accel.cache is not None else contextlib.nullcontext()), \
            (bg.BACKGROUND.record(accel.background_mode().owner) if background else contextlib.nullcontext()):
        served_from_entry = False
        for probe in probes:
            timed(probe, f"{probe.label} (probe){recorded}")
            if background:       # compiled later, maybe: recorded once the thread compiled it all
                accel.background.primes.append(probe.label)
            elif accel.cache is not None and accel.ran_compiled_last():   # (no compiled code ran: none to keep)
                accel.cache.record_probe(probe.label)
        owner = accel.background.owner if background else None
        for i, shape in enumerate(shapes):
            if i and served_from_entry:
                rep.warmup.append((f"{shape.label} (not run: its code is in the compile cache entry)", 0.0, 0))
                if on_shape is not None:
                    on_shape(i, shape, 0.0)
                continue
            new0 = (accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"],
                    owner.eager_calls if owner is not None else 0)
            out, secs = timed(shape, shape.label + recorded)
            if accel.graphs is not None:  # a region is captured on its second call at a shape
                out, _ = timed(shape, f"{shape.label} (cuda graph capture)")
            ran_compiled = accel.ran_compiled_last()     # (no compiled code ran: nothing of it to keep)
            if background:
                accel.background.primes.append(shape.label)
            elif accel.cache is not None and ran_compiled:
                accel.cache.record_probe(shape.label)
            # a restart: the first shape ran on code all from the entry, which an earlier warmup ran
            # the other listed shapes into: they are not run (each is a forward and a repack of the
            # conv weights for its size; a range's largest shape was most of its restart)
            served_from_entry = (i == 0 and accel.graphs is None and len(shapes) > 1
                                 and all(s.label in primed for s in shapes[1:])
                                 and new0 == (accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"],
                                              owner.eager_calls if owner is not None else 0))
            if served_from_entry:
                rep.notes.append(f"shape(s) {', '.join(s.label for s in shapes[1:])} not run: the compile cache "
                                 f"entry holds their code (an earlier warmup ran them into it); the first step at "
                                 f"each loads it")
            if i == 0 and compare:
                fresh = accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"] - fresh0
                if ref is None and fresh:   # code compiled here: the recorded compare is not of it
                    with accel.bypass():
                        ref = run_one(shape)
                if ref is not None:
                    rep.max_abs_diff, rep.diff_recorded = _diff(out, ref), None
                    if accel.cache is not None and ran_compiled:
                        accel.cache.record_compare(shape.label, rep.max_abs_diff)
                else:
                    rep.max_abs_diff, rep.diff_recorded = kept["max_abs_diff"], kept["measured"]
                rep.diff_tolerance, rep.diff_tolerance_why = tolerance_and_why(accel, ref if ref is not None else out,
                                                                               patches0)
                if rep.max_abs_diff > rep.diff_tolerance:       # the gate: never serve a wrong result
                    gate(accel, run_one, shape, ref, rep.max_abs_diff, rep.diff_tolerance)
                ref = None
                rep.diff_label = f"at {shape.label}" + (f", {accel.config.precision} vs model dtype"
                                                         if accel.config.precision in ("fp16", "bf16") else "")
            if on_shape is not None:
                on_shape(i, shape, secs)
    if background:
        accel.background.started()
    accel.warmed = True
    accel.warmed_shapes += [s.label for s in shapes if s.label not in accel.warmed_shapes]
    return rep
