"""The compile thread's first call of a variant it compiled or loaded, for the modules it serves: it
loads and tunes the variant's kernels (once, on the thread's own stream, on CUDA) and packs CPU conv
weights, so sampling's first call of it does not."""
from __future__ import annotations

import torch

from .. import cast
from ..compat.compile_thread import THREAD


#: the compile thread's own CUDA stream per device: its first calls' kernels (and the autotuning
#: their first launch does) are queued and timed there, not behind sampling's work
_PRIME_STREAMS: dict = {}

#: a first call on CUDA runs where the card has this many times its inputs' bytes free (a region's
#: activations beside sampling's); else sampling's own first call of the variant does that work
PRIME_ROOM = 8


def _short_of_room(device, args) -> str | None:
    need = PRIME_ROOM * sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    free, _ = torch.cuda.mem_get_info(device)
    if free < need:
        return "the card was short of memory for a call beside sampling"
    return None


def _first_call_on_cuda(fn, modules, args, device) -> str | None:
    """One call of ``fn`` on the thread's own stream (a variant's kernels load and tune once for every
    module it serves; nothing is packed per module on CUDA). Returns why it did not run (None: it ran)."""
    module = next((m for m in modules if not (cast.busy(m) or cast.needs_cast(m)) and fn.guard_check(m, *args)),
                  None)
    if module is None:
        return "its modules' weights are cast per call"
    why = _short_of_room(device, args)
    if why is not None:
        return why
    stream = _PRIME_STREAMS.get(device)
    if stream is None:
        stream = _PRIME_STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))   # the stand-ins' zeroing first
    with torch.no_grad(), torch.cuda.stream(stream):
        fn.fn(module, *args)
    stream.synchronize()   # the stand-ins (allocated on the thread's stream) outlive the call's work
    return None


def first_calls(fn, modules, args) -> None:
    """Call ``fn`` once for each of ``modules`` its guards accept (the compile thread's priming: a
    first call loads the variant's kernels, tunes their launch configs, and packs CPU conv weights).
    A module whose weights are cast per call is skipped (the sampling thread may be showing them). On
    CUDA one call, on the thread's own stream, where the card has room for it beside sampling
    (``PRIME_ROOM``); the job's owner counts it, or why not (``Owner.primed`` / ``unprimed``: the
    variant's first sampling call then does that work). A conv weight sampling already packed keeps
    its copy (``prepack_conv.keeping_packed``)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    if device is not None:
        why = _first_call_on_cuda(fn, modules, args, device)
        owner = getattr(THREAD, "owner", None)
        if owner is not None:
            if why is None:
                owner.primed += 1
            else:
                owner.unprimed[why] += 1
        return
    from ..passes.prepack_conv import keeping_packed
    with torch.no_grad(), keeping_packed():
        for m in modules:
            # a module whose weights are cast per call: the sampling thread may be showing them now
            if cast.busy(m) or cast.needs_cast(m):
                continue
            if fn.guard_check(m, *args):
                fn.fn(m, *args)
