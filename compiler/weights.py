"""Weight provenance, shared by every cache of tensors derived from weights
(prepacked convs, IPEX-optimized region copies).

DESIGN.md rule 3: a derived tensor is a cache keyed on what it was derived
from and re-checked on every call. The per-tensor part of the key is
:func:`signature`; the per-call part is the *epoch* the runtime declares
before each UNet call (ComfyUI's ``current_weight_patches_uuid`` plus hook
applications), because ComfyUI can rewrite weights in place without bumping
anything a tensor can show.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

_epoch: object = None
_listeners: list[Callable[[], None]] = []


def on_epoch_change(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever the declared epoch changes (caches drop themselves)."""
    _listeners.append(fn)


def set_epoch(epoch) -> None:
    global _epoch
    if epoch != _epoch:
        _epoch = epoch
        for fn in _listeners:
            fn()


def epoch():
    return _epoch


def version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter
        return None


def signature(t: torch.Tensor) -> tuple:
    """What a tensor derived from ``t`` depends on: storage, layout, dtype,
    device and in-place writes (version counter)."""
    return (t.data_ptr(), tuple(t.shape), t.dtype, t.device, version(t))


def fingerprint(tensors: Iterable[torch.Tensor]) -> tuple:
    """Signature of a group of tensors (a region's parameters) plus the epoch.
    Identity matters too: a LoRA merge swaps in a new Parameter object."""
    return tuple((id(t),) + signature(t) for t in tensors) + (_epoch,)
