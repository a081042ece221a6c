"""What an accelerator tells the rest of the pack as it works: one publish/subscribe surface
(``Accelerator.events``), so a caller (the nodes' feedback) listens instead of setting attributes on
the accelerator.

Kinds, and what a listener of each is called with:

- ``fallback(kind, reason)``: a region kind runs the model's own code from now on
- ``recompile(event)``: code compiled after warmup (the event ``lifecycle.recompiles`` records)
- ``background_done(line, state)``: the compile thread compiled what the model's background warmup
  queued (the report's line and the state it counted), told from that thread, once per warmup
- ``note(text)``: a note was added to the model's report
- ``warmup_step(step)``: warmup is about to make a UNet call (a ``warmup.Step``: its kind, shape and
  words)
- ``warmup_shape(index, shape, seconds)``: warmup ran listed shape ``index`` (0 seconds: not run, the
  compile cache entry holds its code)
- ``warmup_done(outcome)``: a warmup ended (a ``warmup.Outcome``: its state, counts and words), also
  when one of its calls raised
"""
from __future__ import annotations

import logging
from typing import Callable

from .compat.comfy import is_interrupt

log = logging.getLogger(__name__)

KINDS = ("fallback", "recompile", "background_done", "note", "warmup_step", "warmup_shape", "warmup_done")


class Events:
    """One accelerator's listeners by kind. A listener that raises is logged (debug) and the others
    are still told: no listener breaks a call, a warmup or the compile thread. ComfyUI's cancel (or
    an out-of-memory error) raised in a listener propagates: a ProgressBar update is where ComfyUI
    checks the Cancel button."""

    def __init__(self):
        self._listeners: dict[str, dict] = {kind: {} for kind in KINDS}

    def subscribe(self, kind: str, listener: Callable, key=None) -> Callable:
        """Tell ``listener`` of each ``kind`` event. One listener a ``key``: a later one with the same
        key replaces it (None: a key of its own). Returns ``listener``."""
        self._listeners[self._known(kind)][object() if key is None else key] = listener
        return listener

    def unsubscribe(self, kind: str, key) -> None:
        """Stop telling the listener subscribed under ``key``."""
        self._listeners[self._known(kind)].pop(key, None)

    def listener(self, kind: str, key) -> Callable | None:
        """The listener subscribed to ``kind`` under ``key``, if any."""
        return self._listeners[self._known(kind)].get(key)

    def emit(self, kind: str, *args) -> None:
        """Tell every ``kind`` listener ``args``, in the order they subscribed."""
        for listener in list(self._listeners[self._known(kind)].values()):
            try:
                listener(*args)
            except Exception as e:   # a listener must not turn what it is told of into a failure
                if is_interrupt(e):
                    raise
                log.debug("UNet Compiler: a %s listener failed", kind, exc_info=True)

    @staticmethod
    def _known(kind: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; the kinds are {', '.join(KINDS)}")
        return kind
