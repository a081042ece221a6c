"""Compiles after warmup: each is counted against the running prompt and kept with its shape, the
guards that failed (in plain words) and the sentence the log, the node and ``/history`` show."""
from __future__ import annotations

import logging
from collections import Counter

import torch

from ..compat import comfy as comfy_compat
from ..compat.dynamo import guard_reasons_since, plain_guard, prompt_tokens, rank
from ..shapes import MAX_CONTEXT_TOKENS, ShapeError, parse_shapes

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
        guards, tokens = [], None
        outside = not in_background and not torch.is_inference_mode_enabled()
        if outside:   # warmup compiles under inference mode: a call outside it cannot use that code
            guards.append("this call ran outside torch.inference_mode, unlike warmup's")
        try:
            reasons = sorted(self._reasons(marks or {}), key=rank)
            tokens = prompt_tokens(reasons)
            for plain in (plain_guard(r, self.arch) for r in reasons):
                if plain not in guards and len(guards) < 3:
                    guards.append(plain)
        except Exception:
            log.debug("guard reasons unavailable", exc_info=True)
        prompt = comfy_compat.current_prompt()
        self.by_prompt[prompt] += graphs
        event = {"prompt": prompt, "shape": shape, "graphs": graphs, "seconds": round(seconds, 2), "guards": guards,
                 "background": in_background, "outside_inference": outside, "tokens": tokens}
        self.events = (self.events + [event])[-50:]
        event["text"] = recompile_sentence(event, warmed_shapes)
        log.warning("UNet Compiler: %s", event["text"])
        if self._tell is not None:
            self._tell(event)
        return event


# ---- recompiles after warmup, in words ------------------------------------------------
#: warmed shapes a recompile line names (the list grows with each Warmup Shapes run on the model)
_NAMED = 8
KEPT = "the new code is kept for the next prompts"


def recompile_sentence(e: dict, warmed_shapes: list[str]) -> str:
    """One recompile event ({prompt, shape, graphs, seconds, guards, background, tokens}) as the
    sentence the log, the node and ``/history`` show: where, why (the failed guards) and the fix (one
    Warmup Shapes takes: an entry, or ``context_tokens`` for a prompt length)."""
    where = f"prompt {e['prompt']}: " if e.get("prompt") else ""
    shape = f" for a {e['shape']} call" if e.get("shape") else ""
    if e.get("background"):
        shape += " in the background (the calls ran the model's own code meanwhile)"
    warmed = (", ".join(warmed_shapes[:_NAMED]) + (f" and {len(warmed_shapes) - _NAMED} more"
                                                    if len(warmed_shapes) > _NAMED else "")) or "none"
    tokens = e.get("tokens")
    unwarmable = _not_an_entry(e["shape"]) if e.get("shape") else None
    inside = bool(e.get("shape")) and bool(warmed_shapes) and _inside(e["shape"], warmed_shapes)
    where_shape = ("" if not e.get("shape") or not warmed_shapes else
                   f" (a {tokens}-token prompt, a length the code was not compiled for)" if tokens else
                   " (inside the warmed range: a specialisation or patch warmup did not prime)" if inside
                   else " (outside the warmed range)")
    why = "; ".join(e.get("guards") or []) or "dynamo recorded no failed guard (a new code path)"
    if e.get("outside_inference"):
        fix = ("call the model under torch.inference_mode() as ComfyUI's sampling does (the code warmup compiled "
               "serves only such calls)")
    elif tokens and tokens <= MAX_CONTEXT_TOKENS:
        fix = (f"set Warmup Shapes' context_tokens to {tokens}" + (", or list two shapes there (a range compiles "
               "for any prompt length)" if len(warmed_shapes) < 2 else "") + f"; {KEPT}")
    elif inside or not e.get("shape") or tokens:
        fix = f"none needed: {KEPT}; if it repeats every prompt, report it with this line"
    elif unwarmable:
        fix = (f"none needed: {KEPT}; Warmup Shapes cannot warm a {e['shape']} call ({unwarmable}"
               + ("; area or mask conditioning runs the model on a crop of the latent" if "px" in unwarmable
                  else "") + ")")
    else:
        fix = (f"add {e['shape']} to Warmup Shapes (its batch is the UNet's: twice the image batch with CFG"
               + ("; this call is half a warmed batch: ComfyUI calls cond and uncond apart when their hooks "
                  "differ (hook LoRA), at cfg 1 and with some area conditioning"
                  if _half_batch(e["shape"], warmed_shapes) else "") + ")")
    return (f"{where}{e['graphs']} graph(s) compiled after warmup{shape}{where_shape}, {e['seconds']:.1f} s; "
            f"warmed shapes: {warmed}; why: {why}. Fix: {fix}")


def _not_an_entry(label: str) -> str | None:
    """Why Warmup Shapes would refuse ``label`` as an entry (its sides or batch out of the node's
    bounds), or None."""
    try:
        parse_shapes(label)
    except ShapeError as e:
        return str(e).split(": ", 2)[-1]
    return None


def _shapes(labels: list[str]) -> list:
    """``labels`` (each a Warmup Shapes entry) as shapes, each parsed alone (their list is not one
    entry text: it may hold more entries than one warmup takes)."""
    return [parse_shapes(label)[0] for label in labels]


def _half_batch(label: str, warmed_shapes: list[str]) -> bool:
    """Whether ``label`` is a warmed shape with half its batch (cond and uncond called apart)."""
    try:
        s, box = _shapes([label])[0], _shapes(warmed_shapes)
    except Exception:
        return False
    return any(b.batch == 2 * s.batch and (b.width, b.height, b.frames) == (s.width, s.height, s.frames) for b in box)


def _inside(label: str, warmed_shapes: list[str]) -> bool:
    try:
        s, box = _shapes([label])[0], _shapes(warmed_shapes)
    except Exception:
        return False
    def frames(x):
        return x.frames or 1
    return (all(min(getattr(b, f) for b in box) <= getattr(s, f) <= max(getattr(b, f) for b in box)
                for f in ("batch", "width", "height"))
            and min(map(frames, box)) <= frames(s) <= max(map(frames, box)))
