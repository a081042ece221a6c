"""torch patched for a compile thread beside sampling threads: what such a thread must not do to
the others (rewind their RNG; trace with a tracer that patches ``nn.Module.__call__`` process-wide),
prevented or done first in the caller's thread."""
from __future__ import annotations

import functools
import logging
import threading

import torch

log = logging.getLogger(__name__)


#: the compile thread's own state: ``compiling`` (set in it), ``owner`` (the job's, priming counts into it)
THREAD = threading.local()


def not_in_the_thread(set_state):
    """``set_state`` (torch's ``set_rng_state``), except in the compile thread. Dynamo restores the
    global RNG state it saw when a compile began (``convert_frame.preserve_global_state``); from
    another thread that rewinds every number the sampling thread drew meanwhile (1414 of 1422 draws
    differed before this), so samplers and nodes that draw from torch's global generator made other
    images. The compile itself draws none of them (tests/compiler/test_background.py checks the
    sequence)."""
    @functools.wraps(set_state)
    def set_rng_state(*args, **kwargs):
        if getattr(THREAD, "compiling", False):
            return None
        return set_state(*args, **kwargs)
    set_rng_state._unet_compiler = True
    return set_rng_state


def before_the_thread() -> None:
    """What the compile thread must not do while other threads run modules, done in the caller's
    thread first. Once per process, inductor traces a dummy function with a plain FX ``Tracer``
    (``loop_body.InterpreterShim._dummy_gm``), which patches ``nn.Module.__call__`` process-wide
    meanwhile: a module called in the sampling thread in that window raised ``NameError: module is
    not installed as a submodule`` (found by the starts bench). The other traces a compile makes
    (make_fx's ``PythonKeyTracer``) pass module calls straight through. And torch's
    ``set_rng_state`` is made a no-op in the compile thread (``not_in_the_thread``). FX's tracing
    flag is process-wide: while the thread traces, a function another node torch.compile'd
    (TorchCompileModel on another model, a compiled VAE) called in this thread raised "Detected that
    you are using FX to symbolically trace a dynamo-optimized function"; here it runs its own code
    for that call instead (dynamo's ``error_on_nested_fx_trace``, a per-thread setting)."""
    try:
        from torch._inductor.loop_body import InterpreterShim
        InterpreterShim._dummy_gm()
    except Exception:   # another torch: nothing of this kind to do first
        log.debug("no inductor loop-body tracer to prime", exc_info=True)
    for module in (torch.random, torch.cuda):
        if not getattr(module.set_rng_state, "_unet_compiler", False):
            module.set_rng_state = not_in_the_thread(module.set_rng_state)
    try:
        torch._dynamo.config.error_on_nested_fx_trace = False
    except AttributeError:   # a torch without the setting
        log.debug("no error_on_nested_fx_trace in this torch", exc_info=True)
