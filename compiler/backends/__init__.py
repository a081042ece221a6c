"""A tiny backend registry, resolved lazily by name.

A backend module decorates its class with ``@register_backend(name)``; its
optional dependencies are imported inside it, so choosing ``inductor`` never
imports triton or IPEX.
"""
from __future__ import annotations

import importlib
import logging

log = logging.getLogger(__name__)

_MODULES = {"eager": ".eager", "inductor": ".inductor", "triton": ".triton", "ipex": ".ipex"}
_REGISTRY: dict[str, type] = {}


def register_backend(name: str):
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def lookup_backend(name: str):
    """The backend class registered under ``name`` (imports its module on first use)."""
    if name not in _REGISTRY:
        if name not in _MODULES:
            raise KeyError(f"unknown backend {name!r}; registered: {', '.join(sorted(_MODULES))}")
        importlib.import_module(_MODULES[name], __name__)
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(_MODULES)


class Backend:
    """Interface. ``available(device)`` -> (ok, one-sentence reason);
    ``impls(config)`` -> {region kind: callable(region_module, *inputs)}."""

    name = "?"
    #: whether code is specialised per shape (dynamo graphs, Triton kernel variants), so
    #: warmup's probe shapes (batch 1, 64 px) are worth running
    specialises_on_shapes = True

    def available(self, device) -> tuple[bool, str]:
        return True, ""

    def auto_ok(self, device) -> tuple[bool, str]:
        """Whether ``auto`` may pick this backend here (it may be usable but
        not the right default, e.g. IPEX on a non-Intel CPU)."""
        return True, ""

    def impls(self, config) -> dict:
        return {}

    def status_lines(self) -> list[str]:
        """Extra report lines about what the backend did so far."""
        return []

    def extra_probes(self, shapes, levels: int) -> list:
        """Shapes warmup runs besides the dynamo probes, to compile the backend's other
        per-shape variants up front."""
        return []

    def compile_count(self) -> int:
        """Compiles this backend did outside dynamo so far (e.g. Triton kernel
        variants); the runtime counts them with dynamo's graphs."""
        return 0

    def dynamo_config(self, config):
        """Context managers entered around each accelerated UNet call."""
        return ()


def resolve(requested: str, device) -> tuple[Backend, list[str]]:
    """Pick the backend to run. Returns it plus the story of how it was chosen
    (each unavailable candidate with its reason) for the report."""
    story: list[str] = []
    if requested == "auto":
        order = (["triton"] if getattr(device, "type", "cpu") == "cuda" else []) + ["ipex", "inductor", "eager"]
    else:
        order = [requested] + [n for n in ("inductor", "eager") if n != requested]
    for name in order:
        try:
            backend = lookup_backend(name)()
            ok, why = backend.available(device)
            if ok and requested == "auto":
                ok, not_auto = backend.auto_ok(device)
                why = why if ok else not_auto
        except Exception as e:  # a probe must never take ComfyUI down
            log.warning("probing backend %s failed", name, exc_info=True)
            ok, why = False, f"probe failed: {e}"
        if ok:
            if story or requested == "auto":
                story.append(f"{name}: chosen" + (f" ({why})" if why else ""))
            return backend, story
        story.append(f"{name}: {why}")
    raise AssertionError("the eager backend is always available")
