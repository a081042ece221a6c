"""Compiles after warmup: each is counted against the running prompt and kept with its shape, the
guards that failed (in plain words) and the sentence the log, the node and ``/history`` show."""
from __future__ import annotations

import logging
from collections import Counter

from . import variants
from .compat import comfy as comfy_compat
from .compat.dynamo import plain_guard, rank
from .report import recompile_sentence

log = logging.getLogger(__name__)


class Recompiles:
    """One accelerator's compiles after warmup (``events``: the last 50; ``by_prompt``: graphs per
    prompt id); ``listener`` (optional ``callable(event)``) is told of each and never breaks a call."""

    def __init__(self):
        self.events: list[dict] = []
        self.by_prompt: Counter = Counter()
        self.listener = None

    def record(self, graphs: int, shape: str | None, seconds: float, marks, warmed_shapes: list[str],
               in_background: bool = False) -> dict:
        """``graphs`` compiled after warmup (for a ``shape`` call, the guards failed since ``marks``)."""
        guards = []
        try:
            for plain in map(plain_guard, sorted(variants.guard_reasons_since(marks or {}), key=rank)):
                if plain not in guards and len(guards) < 3:
                    guards.append(plain)
        except Exception:
            log.debug("guard reasons unavailable", exc_info=True)
        prompt = comfy_compat.current_prompt()
        self.by_prompt[prompt] += graphs
        event = {"prompt": prompt, "shape": shape, "graphs": graphs, "seconds": round(seconds, 2), "guards": guards,
                 "background": in_background}
        self.events = (self.events + [event])[-50:]
        event["text"] = recompile_sentence(event, warmed_shapes)
        log.warning("UNet Compiler: %s", event["text"])
        if self.listener is not None:
            try:
                self.listener(event)
            except Exception:  # a listener must not break sampling
                log.debug("recompile listener failed", exc_info=True)
        return event
