"""torch's Mega-Cache bytes, read and merged so that nothing in them is lost.

``torch.compiler.save_cache_artifacts()`` appends one ``(type, [artifacts])`` chunk per call to a
process-wide stream and returns the whole stream; ``torch.compiler.load_cache_artifacts()`` reads
the chunks into a dict keyed by type, so of a process that saved twice (after warmup, then after a
shape compiled later) only the last chunk of each type is loaded (torch 2.7-2.13: the first
chunk's graphs are silently recompiled). And a process that loaded an entry and compiled more
saves only what it recorded itself. Here every chunk is read and merged by type and key, and an
entry is written as the union of what it held and what this process added.

Uses torch's serializer (``torch.compiler._cache``); where that is missing, the public calls.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def _internals():
    try:
        from torch.compiler._cache import (CacheArtifactManager, _deserialize_single_cache,
                                           _serialize_single_cache)
        from torch.utils._appending_byte_serializer import AppendingByteSerializer
    except Exception:
        return None
    return CacheArtifactManager, AppendingByteSerializer, _serialize_single_cache, _deserialize_single_cache


def artifacts(data: bytes) -> dict | None:
    """Every artifact in ``data``, by type, each key once (the last one written wins); None when
    this torch's serializer is not there to read it."""
    parts = _internals()
    if parts is None:
        return None
    manager, serializer, _, read_one = parts
    manager._ensure_cache_artifacts_registered()
    merged: dict = {}
    for kind, items in serializer.to_list(data, deserialize_fn=read_one):
        by_key = merged.setdefault(kind, {})
        for a in items:
            by_key[a.key] = a
    return {kind: list(by_key.values()) for kind, by_key in merged.items()}


def count(data: bytes) -> int | None:
    got = artifacts(data)
    return None if got is None else sum(len(v) for v in got.values())


def load(data: bytes) -> None:
    """Hand every artifact in ``data`` to torch's local caches (raises what torch raises)."""
    got = artifacts(data)
    if got is None:
        torch.compiler.load_cache_artifacts(data)
        return
    _internals()[0].populate_caches(got)


def merge(old: bytes | None, new: bytes) -> bytes:
    """One stream holding ``old``'s artifacts and ``new``'s (``new`` wins on a shared key)."""
    parts = _internals()
    if not old or parts is None:
        return new
    try:
        a, b = artifacts(old), artifacts(new)
    except Exception:  # an old entry torch cannot read any more: keep what is new
        log.debug("merging compile cache entries failed", exc_info=True)
        return new
    _, serializer, write_one, _ = parts
    for kind, items in b.items():
        keep = {x.key: x for x in a.get(kind, [])}
        keep.update((x.key, x) for x in items)
        a[kind] = list(keep.values())
    out = serializer(serialize_fn=write_one)
    out.extend(a.items())
    return out.to_bytes()
