"""Weight provenance, shared by every cache of tensors derived from weights
(prepacked convs, IPEX-optimized region copies).

Weights are live: a derived tensor is a cache keyed on what it was derived from
(:func:`signature`) and on the weight *epoch* the runtime declares before each
UNet call, and is re-checked on every call. The epoch covers in-place rewrites
that nothing a tensor shows would reveal.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Iterable

import torch

#: the weight epoch of the UNet call running on this thread (each GPU's copy samples on its own
#: thread); a thread that runs no UNet call (the background compile) reads the latest set anywhere
_calls = threading.local()
_latest: object = None


def set_epoch(epoch) -> None:
    global _latest
    _calls.epoch = _latest = epoch


def epoch():
    return getattr(_calls, "epoch", _latest)


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
    """Signature of a group of tensors (a region's parameters). Identity
    matters too: a LoRA merge swaps in a new Parameter object."""
    return tuple((id(t),) + signature(t) for t in tensors)


class DerivedCache:
    """``id(owner) -> (signature + epoch, derived)``: something derived from a
    weight (a prepacked copy) or from a module's weights (an optimized region
    copy), re-derived before use whenever what it came from or the epoch
    changed (the epoch is part of the key, so nothing needs dropping when it
    moves), and dropped when the owner itself dies (a LoRA swap replaces the
    Parameter), so memory stays one derived copy per live owner.
    ``stats`` counts packs (every derivation), rederived (a replacement of a
    stale copy) and cache_hits."""

    def __init__(self, stats):
        self.stats = stats
        self._cache: dict[int, tuple] = {}

    def derived(self, owner, sig: tuple, make: Callable[[], object]):
        key = id(owner)
        sig = sig + (epoch(),)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == sig:
            self.stats["cache_hits"] += 1
            return hit[1]
        self.stats["packs"] += 1
        if hit is None:
            weakref.finalize(owner, self._cache.pop, key, None)
        else:
            self.stats["rederived"] += 1
        value = make()
        self._cache[key] = (sig, value)
        return value

    def get(self, w: torch.Tensor, derive: Callable[[torch.Tensor], torch.Tensor], key: tuple = ()):
        """The copy of ``w`` that ``derive(w.detach())`` makes, current for ``w`` now (and for
        ``key``: what else the copy depends on; a new key re-derives the one copy)."""
        return self.derived(w, signature(w) + key, lambda: derive(w.detach()))

    def held(self, w: torch.Tensor):
        """The copy derived from ``w`` as it is now, whatever else it was keyed on (None: none)."""
        hit = self._cache.get(id(w))
        sig = signature(w)
        if hit is None or hit[0][:len(sig)] != sig or hit[0][-1] != epoch():
            return None
        return hit[1]

    def values(self) -> list:
        return [v for _, v in self._cache.values()]


class Scratch:
    """One reusable buffer for the temporary copy a derivation needs on the way (a conv weight in
    channels-last order before oneDNN packs it), so its pages fault in once, not once per weight.
    Held only while a UNet call runs: ``release()`` (the runtime, when the call ends) frees it.
    ``use(numel, dtype)`` is a context manager holding the lock, so two threads never share it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None

    @contextlib.contextmanager
    def use(self, numel: int, dtype: torch.dtype):
        with self._lock:
            buf = self._buf
            if buf is None or buf.dtype != dtype or buf.numel() < numel:
                self._buf = None   # (the old one goes before the new one is touched)
                self._buf = buf = torch.empty(numel, dtype=dtype)
            yield buf

    def release(self) -> None:
        with self._lock:
            self._buf = None


#: the scratch every derivation shares (``release_scratch`` at the end of a UNet call)
SCRATCH = Scratch()


def release_scratch() -> None:
    SCRATCH.release()
