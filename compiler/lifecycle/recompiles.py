"""Compiles after warmup: each is counted against the running prompt and kept with its shape, the
guards that failed (in plain words) and the sentence the log, the node and ``/history`` show."""
from __future__ import annotations

import logging
from collections import Counter

import torch

from ..compat import comfy as comfy_compat
from ..compat.dynamo import guard_reasons_since, plain_guard, rank
from ..shapes import parse_shapes

log = logging.getLogger(__name__)


class Recompiles:
    """One accelerator's compiles after warmup (``events``: the last 50; ``by_prompt``: graphs per
    prompt id); ``tell`` (optional ``callable(event)``: the accelerator's ``recompile`` event) is told
    of each; ``reasons(marks)``: the guard failures since ``marks`` (the scheduler's
    ``guard_reasons_since``; default dynamo's records alone)."""

    def __init__(self, arch: str = "unet", tell=None, reasons=None):
        self.events: list[dict] = []
        self._reasons = reasons or (lambda marks: guard_reasons_since(marks, []))
        self.by_prompt: Counter = Counter()
        self._tell = tell
        #: the model's kind ("unet" or "dit"): the guard words name its dims
        self.arch = arch

    def record(self, graphs: int, shape: str | None, seconds: float, marks, warmed_shapes: list[str],
               in_background: bool = False) -> dict:
        """``graphs`` compiled after warmup (for a ``shape`` call, the guards failed since ``marks``)."""
        guards = []
        outside = not in_background and not torch.is_inference_mode_enabled()
        if outside:   # warmup compiles under inference mode: a call outside it cannot use that code
            guards.append("this call ran outside torch.inference_mode, unlike warmup's")
        try:
            for plain in (plain_guard(r, self.arch) for r in sorted(self._reasons(marks or {}), key=rank)):
                if plain not in guards and len(guards) < 3:
                    guards.append(plain)
        except Exception:
            log.debug("guard reasons unavailable", exc_info=True)
        prompt = comfy_compat.current_prompt()
        self.by_prompt[prompt] += graphs
        event = {"prompt": prompt, "shape": shape, "graphs": graphs, "seconds": round(seconds, 2), "guards": guards,
                 "background": in_background, "outside_inference": outside}
        self.events = (self.events + [event])[-50:]
        event["text"] = recompile_sentence(event, warmed_shapes)
        log.warning("UNet Compiler: %s", event["text"])
        if self._tell is not None:
            self._tell(event)
        return event


# ---- recompiles after warmup, in words ------------------------------------------------
def recompile_sentence(e: dict, warmed_shapes: list[str]) -> str:
    """One recompile event ({prompt, shape, graphs, seconds, guards, background}) as the sentence the
    log, the node and ``/history`` show: where, why (the failed guards) and the fix."""
    where = f"prompt {e['prompt']}: " if e.get("prompt") else ""
    shape = f" for a {e['shape']} call" if e.get("shape") else ""
    if e.get("background"):
        shape += " in the background (the calls ran the model's own code meanwhile)"
    warmed = ", ".join(warmed_shapes) or "none"
    inside = bool(e.get("shape")) and bool(warmed_shapes) and _inside(e["shape"], warmed_shapes)
    where_shape = ("" if not e.get("shape") or not warmed_shapes else
                   " (inside the warmed range: a specialisation or patch warmup did not prime)" if inside
                   else " (outside the warmed range)")
    why = "; ".join(e.get("guards") or []) or "dynamo recorded no failed guard (a new code path)"
    fix = ("call the model under torch.inference_mode() as ComfyUI's sampling does (the code warmup compiled "
           "serves only such calls)" if e.get("outside_inference") else
           "none needed: the new code is kept for the next prompts; if it repeats every prompt, report it "
           "with this line" if inside or not e.get("shape") else
           f"add {e['shape']} to Warmup Shapes (its batch is the UNet's: twice the image batch with CFG"
           + ("; this call is half a warmed batch: ComfyUI calls cond and uncond apart when their hooks differ "
              "(hook LoRA), at cfg 1 and with some area conditioning" if _half_batch(e["shape"], warmed_shapes)
              else "") + ")")
    return (f"{where}{e['graphs']} graph(s) compiled after warmup{shape}{where_shape}, {e['seconds']:.1f} s; "
            f"warmed shapes: {warmed}; why: {why}. Fix: {fix}")


def _half_batch(label: str, warmed_shapes: list[str]) -> bool:
    """Whether ``label`` is a warmed shape with half its batch (cond and uncond called apart)."""
    try:
        s, box = parse_shapes(label)[0], parse_shapes(", ".join(warmed_shapes))
    except Exception:
        return False
    return any(b.batch == 2 * s.batch and (b.width, b.height, b.frames) == (s.width, s.height, s.frames) for b in box)


def _inside(label: str, warmed_shapes: list[str]) -> bool:
    try:
        s, box = parse_shapes(label)[0], parse_shapes(", ".join(warmed_shapes))
    except Exception:
        return False
    def frames(x):
        return x.frames or 1
    return (all(min(getattr(b, f) for b in box) <= getattr(s, f) <= max(getattr(b, f) for b in box)
                for f in ("batch", "width", "height"))
            and min(map(frames, box)) <= frames(s) <= max(map(frames, box)))
