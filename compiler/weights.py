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

import weakref
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


class DerivedCache:
    """``id(weight) -> (signature + epoch, derived tensor)``: a tensor derived
    from a weight (a prepacked copy), re-derived before use whenever the weight
    or the epoch changed, and dropped when the weight itself dies (a LoRA swap
    replaces the Parameter), so memory stays one derived copy per live weight.
    ``stats`` counts packs, cache_hits and epoch_invalidations."""

    def __init__(self, stats):
        self.stats = stats
        self._cache: dict[int, tuple] = {}
        on_epoch_change(self.clear)

    def clear(self) -> None:
        if self._cache:
            self.stats["epoch_invalidations"] += 1
        self._cache.clear()

    def get(self, w: torch.Tensor, derive: Callable[[torch.Tensor], torch.Tensor]):
        key = id(w)
        sig = signature(w) + (_epoch,)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == sig:
            self.stats["cache_hits"] += 1
            return hit[1]
        self.stats["packs"] += 1
        derived = derive(w.detach())
        if hit is None:
            weakref.finalize(w, self._cache.pop, key, None)
        self._cache[key] = (sig, derived)
        return derived
