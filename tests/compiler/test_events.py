"""The accelerator's event surface (compiler/events.py): listeners by kind and key, a failing
listener never breaks the caller, and the accelerator's report notes and background-done reach it."""
from __future__ import annotations

import pytest

from unet_compiler.compiler.events import Events
from unet_compiler.compiler.lifecycle.recompiles import Recompiles
from unet_compiler.compiler.report import Report


def test_listeners_by_kind_key_replaces_and_a_failing_one_breaks_nothing():
    events, told = Events(), []
    events.subscribe("fallback", lambda kind, why: told.append(("a", kind, why)))
    events.subscribe("fallback", lambda *a: 1 / 0)     # raises: logged, the others are still told
    events.subscribe("fallback", lambda kind, why: told.append(("old", kind)), key="nodes")
    events.subscribe("fallback", lambda kind, why: told.append(("new", kind)), key="nodes")   # replaces "old"
    events.emit("fallback", "attention", "RuntimeError: boom")
    events.emit("recompile", {"text": "x"})            # nobody listens: nothing happens
    assert told == [("a", "attention", "RuntimeError: boom"), ("new", "attention")]
    assert events.listener("fallback", "nodes") is not None and events.listener("note", "nodes") is None
    events.unsubscribe("fallback", "nodes")
    assert events.listener("fallback", "nodes") is None
    with pytest.raises(ValueError, match="unknown event kind 'fallbacks'"):
        events.subscribe("fallbacks", print)


def test_comfyuis_cancel_in_a_listener_is_not_swallowed():
    """ComfyUI checks its Cancel button in a ProgressBar update, which Warmup Shapes' listener of
    ``warmup_shape`` makes: the cancel propagates to the warmup, a listener's other error does not."""
    class InterruptProcessingException(Exception):   # (ComfyUI's, matched by name)
        pass

    def cancelled(*args):
        raise InterruptProcessingException()
    events, told = Events(), []
    events.subscribe("warmup_shape", lambda *a: 1 / 0)
    events.subscribe("warmup_shape", cancelled)
    events.subscribe("warmup_shape", lambda *a: told.append(a))
    with pytest.raises(InterruptProcessingException):
        events.emit("warmup_shape", 0, "2x64x64", 1.0)
    assert told == []


def test_report_notes_and_recompiles_are_told_as_events():
    events, told = Events(), []
    for kind in ("note", "recompile"):
        events.subscribe(kind, lambda *a, kind=kind: told.append((kind, *a)))
    rep = Report(tell_note=lambda text: events.emit("note", text))
    assert rep.note("warmup ran no calls") and not rep.note("warmup ran no calls", once=True)
    assert told == [("note", "warmup ran no calls")]   # a note not added is not told
    Recompiles(tell=lambda e: events.emit("recompile", e)).record(2, "2x64x64", 1.0, None, ["1x64x64"],
                                                                  in_background=True)
    kind, event = told[-1]
    assert kind == "recompile" and event["graphs"] == 2 and event["shape"] == "2x64x64" and event["text"]
