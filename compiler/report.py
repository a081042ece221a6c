"""The short human report every Compile / Warmup run returns, and the facts behind it.

A backend or probe that cannot run says why as a ``reasons.Reason`` (``what``, ``why``, ``fix``);
this module only draws them. :func:`compile_facts` and :func:`warmup_facts` turn a run into a state (``compiled`` /
``fallback`` / ``eager``), a reason and a fix; :func:`status_line` draws the ``status:`` sentence.
The node layer (nodes/feedback.py) only sends and draws these.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import cast, settings
from .reasons import DISABLE_ENV, NOTHING_TO_COMPILE, Reason, Slower

_DYNAMIC = {True: "on", False: "off",
            None: "on, static first (a warmup of one shape): a size that changes compiles once more, then for any"}


@dataclass
class Report:
    backend_requested: str = "auto"
    backend: str = "eager"
    why: list = field(default_factory=list)
    family: str = ""
    #: "unet", or "dit" (a diffusion transformer, whose regions are its blocks)
    arch: str = "unet"
    #: the model's class (``UNetModel``, ``Flux``, ``UNet2DConditionModel``, ...); "" when unknown
    model: str = ""
    precision: str = "auto"
    dynamic_shapes: bool | None = True   # None: one warmup shape compiled static (warmup.one_shape)
    regions: dict = field(default_factory=dict)       # kind -> count
    skipped: list = field(default_factory=list)       # (kind, count, reason)
    notes: list = field(default_factory=list)
    warmup: list = field(default_factory=list)        # (shape label, seconds, graphs compiled)
    from_cache: dict = field(default_factory=dict)    # shape label -> graphs of those taken from the compile cache
    max_abs_diff: float | None = None
    diff_label: str = ""
    #: the largest ``max_abs_diff`` warmup's compare accepts (``shims.Gate.tolerance``); over it the regions
    #: whose code made the difference run the model's own code
    diff_tolerance: float | None = None
    #: why the tolerance is not the model dtype's ("" when it is): e.g. an attention patch's own code
    diff_tolerance_why: str = ""
    #: when ``max_abs_diff`` was measured, if not in this warmup: an earlier one (in this process or
    #: before a restart) recorded it in the compile cache entry whose code this one ran whole
    #: (``warmup.recorded_compare``)
    diff_recorded: str | None = None
    #: optional ``callable(text)`` told of each note added (the report's accelerator's ``note`` event)
    tell_note: object = field(default=None, repr=False, compare=False)

    def note(self, text: str, once: bool = False) -> bool:
        """Add ``text`` to the report's notes (the one way notes are added); ``once``: not if it is
        there already. Returns whether it was added."""
        if once and text in self.notes:
            return False
        self.notes.append(text)
        if self.tell_note is not None:
            self.tell_note(text)
        return True

    def drop_notes(self, prefix: str) -> None:
        """Remove the notes that start with ``prefix`` (advice a later run has followed)."""
        self.notes = [n for n in self.notes if not n.startswith(prefix)]

    def _kind(self) -> str:
        """``UNet (UNetModel)``, ``DiT (Flux)``, ``model (AuraFlow)``: what the pack took it for, and its class."""
        other = any(k == "model" for k, _, _ in self.skipped)   # a family the pack does not accelerate
        kind = "model" if other else "DiT" if self.arch == "dit" else "UNet"
        return f"{kind} ({self.model})" if self.model and self.model != kind else kind

    def text(self, stats=None) -> str:
        lines = [f"UNet Compiler: backend {self.backend}"
                 + (f" (asked {self.backend_requested})" if self.backend_requested != self.backend else "")
                 + f", {self.family} {self._kind()}, precision {self.precision}, dynamic shapes {_DYNAMIC[self.dynamic_shapes]}"]
        lines += [f"  backend choice: {w}" for w in self.why]
        if self.regions:
            lines.append("  accelerated regions: " + ", ".join(f"{k} x{n}" for k, n in self.regions.items()))
        else:
            lines.append("  accelerated regions: none (everything runs the model's own code)")
        lines += [f"  left eager: {k} x{n}: {why}" for k, n, why in self.skipped]
        lines += [f"  note: {n}" for n in self.notes]
        for label, secs, graphs in self.warmup:
            loaded = min(self.from_cache.get(label, 0), graphs)
            lines.append(f"  warmed {label}: {secs:.1f} s, {compiled_and_loaded(graphs - loaded, loaded)}")
        if self.max_abs_diff is not None:
            lines.append(f"  max |compiled - eager| {self.diff_label}: {self.max_abs_diff:.3g}"
                         + (f" (tolerance {self.diff_tolerance:.2g}"
                            + (f": {self.diff_tolerance_why}" if self.diff_tolerance_why else "")
                            + (", over it: refused" if self.max_abs_diff > self.diff_tolerance else "") + ")"
                            if self.diff_tolerance is not None else "")
                         + (f" (measured by an earlier warmup of the same code, {self.diff_recorded}; this one "
                            f"compiled nothing anew for it, so the eager reference did not run again: "
                            f"UNET_COMPILER_COMPARE=always runs it)" if self.diff_recorded else ""))
        if stats is not None:
            lines.append(
                f"  calls: {stats.get('calls', 0)} accelerated, {stats.get('eager_calls', 0)} eager; "
                f"graphs compiled: {stats.get('graphs_compiled', 0) - stats.get('graphs_from_cache', 0)}"
                + (f"; loaded from the compile cache: {stats['graphs_from_cache']}" if stats.get("graphs_from_cache")
                   else "")
                + "; recompiles after warmup: "
                f"{stats.get('recompiles_after_warmup', 0)}; region calls on the model's own code for "
                f"patches/lowvram: {stats.get('region_eager', 0)}"
                + (f" ({stats['region_eager_cast']} for weights ComfyUI casts per call)"
                   if stats.get("region_eager_cast") else "")
                + (f"; oom calls on the model's own code: {stats['oom_calls_eager']}"
                   if stats.get("oom_calls_eager") else ""))
            if stats.get("compile_seconds"):
                lines.append(f"  seconds in calls that compiled: {stats['compile_seconds']:.1f}")
        return "\n".join(lines)


# ---- the facts the UI, /history and the log get -------------------------------------
def compiled_and_loaded(compiled: int, loaded: int) -> str:
    """``3 graph(s) compiled`` (in this process), then ``, 2 loaded from the compile cache`` when any were."""
    return f"{compiled} graph(s) compiled" + (f", {loaded} loaded from the compile cache" if loaded else "")


def compile_facts(rep: Report) -> dict:
    """What Compile UNet did: the backend that runs, its state (``planned``: regions will run
    compiled code once Warmup Shapes or the first step compiled it; ``fallback`` / ``eager``) and,
    unless planned, the reason and the fix (one sentence each)."""
    requested, backend = rep.backend_requested, rep.backend
    reason = fix = ""
    whole = [why for kind, _, why in rep.skipped if kind == "model"]
    if whole:
        # another model family (DiT, Cascade, ...): eager by design, not a fallback
        state = "eager"
        reason = NOTHING_TO_COMPILE + ": " + whole[0].removeprefix("running eager: ")
        fix = ("none: the pack accelerates SD1.x / SD2.x / SDXL / SVD UNets, Flux-family and Qwen-Image DiTs; "
               "this model runs as ComfyUI loaded it")
    elif settings.disabled():
        state = "eager"
        reason, fix = f"{DISABLE_ENV} is set: every rewrite is off", f"unset {DISABLE_ENV} and restart ComfyUI"
    elif requested == "eager":
        state = "eager"
        reason, fix = "chosen in Select Backend (no rewrites)", "choose auto in Select Backend"
    elif backend == "eager" or (requested != "auto" and backend != requested):
        state = "fallback"
        why = [Reason.of(w) for w in rep.why]
        mine = [w for w in why if w.what == requested] if requested != "auto" else []
        story = mine or [w for w in why if not w.why.startswith("chosen")] or [Reason("no backend works here")]
        reason = "; ".join(w.cause for w in story)
        # where a candidate names its own fix, that is the one to give; else the generic one
        named = [w.fix for w in story if w.fix]
        fix = "; or ".join(dict.fromkeys(named)) if named else _generic_fix(backend)
    elif not rep.regions:
        state = "fallback"
        reason = "no region of this UNet matched a rewrite" + (
            f" ({'; '.join(f'{k} x{n}: {why}' for k, n, why in rep.skipped)})" if rep.skipped else "")
        fix = "none needed for correctness; the model runs as loaded"
    else:
        state = "planned"   # nothing has run yet: Warmup Shapes and the run report say what compiled
    return {"backend": backend, "requested": requested, "state": state, "reason": reason, "fix": fix,
            "family": rep.family, "regions": dict(rep.regions), "notes": list(rep.notes)}


def _generic_fix(backend: str) -> str:
    if backend == "eager":
        return "install what the backend above needs, or choose eager in Select Backend to run without the pack"
    return f"choose {backend} or auto in Select Backend (this is what runs now)"


def status_line(facts: dict) -> str:
    """One sentence: what runs, in which state, and for a fallback why and the fix."""
    backend, state = facts["backend"], facts["state"]
    if state == "planned":
        n = sum(facts.get("regions", {}).values())
        return f"{backend}: planned, {n} regions; compiled code runs after Warmup Shapes or the first step"
    if state == "eager" and facts["reason"].startswith(NOTHING_TO_COMPILE):
        return f"eager: {facts['reason']}."
    if state == "eager":
        return f"eager: {facts['reason']}. To accelerate: {facts['fix']}."
    asked = f" (asked {facts['requested']})" if facts.get("requested") not in (None, "auto", backend) else ""
    return f"{backend}: {state}{asked}: {facts['reason']}. Fix: {facts['fix']}."


def warmup_facts(rep: Report, backend: str, failed: dict, ran: tuple[int, int] | None = None,
                 cast_eager: dict | None = None) -> dict:
    """A warmup's state (``compiled`` / ``fallback`` / ``eager``), reason and fix: region kinds
    that failed at run time (``failed``: {kind: error}) make it a fallback, and so does a warmup in
    which no region's accelerated code ran (``ran``: (regions that ran it, regions that have it);
    ``cast_eager``: {kind: Reason} for region calls that ran the model's code because ComfyUI casts
    their weights in a way compiled code cannot serve). A kind that runs the model's own code because
    that measured faster (a :class:`~.reasons.Slower` reason) is a choice: no fallback."""
    failed = {k: why for k, why in failed.items() if not isinstance(why, Slower)}
    if failed:
        by_why: dict = {}
        for k, why in failed.items():
            by_why.setdefault(why, []).append(k)
        fixes = [w.fix for w in by_why if getattr(w, "fix", "")]
        return {"state": "fallback", "fix": "; ".join(fixes) or "none needed for correctness; see the log for the error",
                "reason": "; ".join(f"{', '.join(ks)} regions failed ({getattr(why, 'why', why)}) and run the model's "
                                    f"own code" for why, ks in by_why.items())}
    if backend == "eager":
        facts = compile_facts(rep)
        return {k: facts[k] for k in ("state", "reason", "fix")}
    if ran is not None and ran[1] and not ran[0]:
        if cast_eager:
            whys = list(dict.fromkeys(getattr(r, "why", str(r)) for r in cast_eager.values()))
            fixes = list(dict.fromkeys(getattr(r, "fix", "") for r in cast_eager.values()))
            return {"state": "fallback", "reason": f"0 of {ran[1]} regions ran compiled code: ComfyUI casts their "
                    f"weights on every call, and " + "; ".join(whys),
                    "fix": "; ".join(f for f in fixes if f) or "none needed for correctness"}
        return {"state": "fallback", "reason": f"0 of {ran[1]} regions ran compiled code: every call needed the "
                f"model's own code (masks, attention overrides or patches on the regions)",
                "fix": "none needed for correctness; the patches named in the report decide it"}
    return {"state": "compiled", "reason": "", "fix": ""}


def accelerator_text(accel) -> str:
    """The whole report of one accelerator: the Report's text, then what its backend, CUDA graphs,
    compile cache, patches, recompiles and background compile add."""
    extra = (accel.backend.status_lines([r.module for r in accel.plan.regions])
             + (accel.graphs.status_lines() if accel.graphs is not None else [])
             + (accel.call_graphs.status_lines() if accel.call_graphs is not None else []))
    ran, total = accel.ran_compiled()
    if total and accel.stats.get("calls"):
        last = accel.ran_compiled_last()
        extra.append(f"  regions that ran compiled code: {ran} of {total}"
                     + (f"; in the latest UNet call {last} of {total} (the others ran the model's own code or a "
                        f"patch's code in their place: the patch lines below)" if last < ran else ""))
    if accel.stats.get("region_cast_compiled"):
        streamed = accel.stats.get("region_streamed", 0)
        extra.append(f"  weights ComfyUI casts or patches per call (fp8 or other storage dtypes, partial loads, "
                     f"weight functions): {accel.stats['region_cast_compiled']} region call(s) compiled with "
                     f"ComfyUI's cast outside the graph" + (
                         f", {accel.stats['region_cast_resident']} of them with every weight resident (a "
                         f"Dynamic VRAM slot or its own: through CUDA graphs), the rest without"
                         if accel.graphs is not None else "") + (
                         f"; {streamed} op by op, their weights streamed (each op's cast where it runs, on "
                         f"ComfyUI's offload streams)" if streamed else ""))
        own = cast.own_cast_ops(leaf for region in accel.plan.regions for leaf in region.leaves)
        if own:
            extra.append(f"  weights another pack's ops make per call ({', '.join(own)}): dequantized or patched "
                         f"by those ops' own cast outside the graph, checked once per leaf against their forward")
    extra += [f"  left eager per call: {kind} regions whose weights ComfyUI casts per call: {why}"
              for kind, why in accel.cast_eager.items()]
    inserted = accel.inserted.line()
    extra += [f"  {inserted}"] if inserted else []
    extra += accel.cache.lines() if accel.cache is not None else []
    extra += [f"  patch {name} (in {n} UNet call(s))" for name, n in sorted(accel.patches_seen.items())]
    extra += [f"  recompile: {e['text']}" for e in accel.recompiles.events[-5:]]
    extra += [f"  {accel.background.line()}"] if accel.background is not None else []
    extra += devices_lines(accel)
    return accel.report.text(accel.stats) + ("\n" + "\n".join(extra) if extra else "")


def device_summary(accel) -> str:
    """One device's copy in a word: its regions that ran compiled code, the graphs it compiled (each
    device compiles its own), its calls, what fell back, recompiles."""
    ran, total = accel.ran_compiled()
    failed = f", {len(accel.failed)} kind(s) on the model's own code" if accel.failed else ""
    graphs = accel.stats.get("graphs_compiled", 0)
    made = f" ({graphs} graph(s) in {accel.stats.get('compile_seconds', 0.0):.1f} s)" if graphs else ""
    return (f"{accel.device_name}: compiled {ran}/{total}{made}, {accel.stats.get('calls', 0)} call(s){failed}, "
            f"{accel.stats.get('recompiles_after_warmup', 0)} recompile(s) after warmup")


def devices_lines(accel) -> list[str]:
    """Where ComfyUI samples copies of the model on other devices: each device's copy, this one first."""
    others = accel.copies.accelerators() if accel.copies is not None else []
    if not others:
        return []
    return ["  devices (ComfyUI's multi-GPU copies, each accelerated on its own device): "
            + "; ".join(device_summary(a) for a in [accel, *others])]
