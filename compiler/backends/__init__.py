"""A tiny backend registry, resolved lazily by name.

A backend is one module of this package, named as the backend, whose class is decorated with
``@register_backend(name)`` and says where ``auto`` ranks it, whether an explicit request that
cannot run falls back to it, whether it uses CUDA graphs, and one line for the menu's tooltip.
Its optional dependencies are imported inside it, so choosing ``inductor`` never imports triton
or IPEX. Adding a backend is adding its file; the node menus, ``config.BACKENDS`` and ``auto``
read this registry.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil

log = logging.getLogger(__name__)

_REGISTRY: dict[str, type] = {}


def register_backend(name: str):
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def _module_names() -> list[str]:
    return [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]


def lookup_backend(name: str):
    """The backend class registered under ``name`` (imports its module, ``.<name>``, on first use)."""
    if name not in _REGISTRY:
        if name not in _module_names():
            raise KeyError(f"unknown backend {name!r}; registered: {', '.join(names())}")
        importlib.import_module("." + name, __name__)
    return _REGISTRY[name]


def _ranked() -> list[type]:
    classes = [lookup_backend(n) for n in _module_names()]   # each module is cheap: no optional imports
    return sorted(classes, key=lambda c: (c.auto_rank is None, c.auto_rank or 0, c.name))


def names() -> tuple[str, ...]:
    """Every backend, in ``auto``'s order (the order the menus show)."""
    return tuple(c.name for c in _ranked())


def tooltip() -> str:
    """The backend menu's tooltip: ``auto`` and one line per backend."""
    order = ", then ".join(c.name for c in _ranked() if c.auto_rank is not None and c.name != "eager")
    lines = [f"auto: the first that works here of {order}; eager if none does"]
    return ". ".join(lines + [f"{c.name}: {c.summary}" for c in _ranked()]) + ". Never changes which LoRA or patch applies."


class Backend:
    """Interface. ``available(device)`` -> (ok, one-sentence reason);
    ``impls(config)`` -> {region kind: callable(region_module, *inputs)}."""

    name = "?"
    #: where ``auto`` tries it (lower first); None: only when asked for by name
    auto_rank: int | None = None
    #: device types ``auto`` tries it on (None: any)
    auto_devices: tuple | None = None
    #: an explicitly requested backend that cannot run here falls back to these, in rank order
    fallback = False
    #: whether Select Backend's ``cuda_graphs`` applies to it
    uses_cuda_graphs = False
    #: whether its Triton kernels can step out of a CUDA graph capture (the torch ops they replace
    #: are captured instead), which graphs need under cudaMallocAsync
    kernels_leave_captures = False
    #: set by the runtime before ``impls``: False where captures must not hold its Triton kernels
    kernels_in_captures = True
    #: set by the runtime before ``impls``: whether this model's regions replay CUDA graphs (asked
    #: for and possible here), so what a call costs is device time, not its launches
    graphs_replay = False
    #: whether its region bodies call each conv and linear as a module (regions.py's bodies, run as
    #: Python), so a region whose weights stream runs its compiled body op by op, each op casting its
    #: own weights where it runs; a body compiled as one graph reads them all at once, so such a
    #: region call runs the model's own code instead
    streams_op_by_op = False
    #: one line for the menu's tooltip: what it does, where
    summary = ""
    #: whether code is specialised per shape (dynamo graphs, Triton kernel variants), so
    #: warmup's probe shapes (batch 1, 64 px) are worth running
    specialises_on_shapes = True
    #: whether its code follows ``config.dynamic_shapes`` (dynamo-compiled bodies), so one warmup
    #: shape can be compiled static (``warmup.one_shape``)
    follows_dynamic_shapes = False
    #: whether it compiles a diffusion transformer's blocks (``plan.DIT_KINDS``); a DiT model skips
    #: the others (``auto``) or falls back from them (asked by name)
    dit_blocks = False

    def background_problem(self) -> str | None:
        """Why Warmup Shapes' ``background`` cannot compile this backend's code in a background
        thread (None: it can; only serializable precompiled bodies can be compiled from a record)."""
        return f"the {self.name} backend compiles no region bodies"

    def available(self, device) -> tuple[bool, str]:
        """(True, what it does here) or (False, why not: a ``reasons.Reason`` with the fix, or a
        plain sentence)."""
        return True, ""

    def auto_ok(self, device) -> tuple[bool, str]:
        """Whether ``auto`` may pick this backend here (it may be usable but
        not the right default, e.g. IPEX on a non-Intel CPU)."""
        return True, ""

    def impls(self, config, scheduler) -> dict:
        """{(layout, region kind): what runs that kind's region calls} under ``config``; ``scheduler``
        (the accelerator's) keeps and compiles what is precompiled."""
        return {}

    def cast_problem(self):
        """Why (a ``reasons.Reason``) regions whose weights ComfyUI casts or patches per call cannot run
        this backend's code with ComfyUI's cast done outside it (None: they can; the cast weights
        are new tensors each call)."""
        return None

    def no_impl_reason(self, kind: str, config) -> str:
        """Why a region of ``kind`` has no implementation here (the report's "left eager" line)."""
        if kind == "projection":
            return "free-standing convs: prepacking is off" if not config.prepack_conv else "no rewrite"
        return f"{self.name} has no rewrite for this region"

    def status_lines(self, modules=()) -> list[str]:
        """Extra report lines about what the backend did so far for the model whose region modules are
        ``modules``."""
        return []

    def extra_probes(self, shapes, levels: int) -> list:
        """Shapes warmup runs besides the dynamo probes, to compile the backend's other
        per-shape variants up front."""
        return []

    def compile_count(self, scheduler) -> int:
        """Compiles this backend did outside dynamo so far (e.g. Triton kernel variants, precompiled
        variants ``scheduler``'s registry loaded); the runtime counts them with dynamo's graphs."""
        return 0

    def dynamo_config(self, config):
        """Context managers entered around each accelerated UNet call."""
        return ()


def resolve(requested: str, device, arch: str = "unet") -> tuple[Backend, list[str]]:
    """Pick the backend to run for a model of ``arch`` ("unet" or "dit"). Returns it plus the story
    of how it was chosen (each unavailable candidate with its reason) for the report."""
    from ..reasons import Reason
    story: list[Reason] = []
    ranked = _ranked()
    if requested == "auto":
        dev = getattr(device, "type", "cpu")
        order = [c.name for c in ranked if c.auto_rank is not None and (c.auto_devices is None or dev in c.auto_devices)]
    else:
        order = [requested] + [c.name for c in ranked if c.fallback and c.name != requested]
    for name in order:
        try:
            backend = lookup_backend(name)()
            ok, why = backend.available(device)
            if ok and requested == "auto":
                ok, not_auto = backend.auto_ok(device)
                why = why if ok else not_auto
            if ok and arch == "dit" and not backend.dit_blocks:
                ok, why = False, Reason("it has no code for a diffusion transformer's blocks (inductor compiles them)",
                                        "choose inductor (auto does)")
        except Exception as e:  # a probe must never take ComfyUI down
            log.warning("probing backend %s failed", name, exc_info=True)
            ok, why = False, Reason(f"probe failed: {e}")
        if ok:
            if story or requested == "auto":
                story.append(Reason("chosen" + (f" ({why})" if why else ""), what=name))
            return backend, story
        story.append(Reason.of(why, what=name))
    raise AssertionError("the eager backend is always available")


def graphs_problem(backend: Backend, device) -> str | None:
    """Why region CUDA graphs cannot be used with ``backend`` on ``device`` (None: they can)."""
    if getattr(device, "type", "cpu") != "cuda":
        return f"they need CUDA and the model runs on {device}"
    if not backend.uses_cuda_graphs:
        users = " and ".join(n for n in names() if lookup_backend(n).uses_cuda_graphs)
        return f"the {backend.name} backend does not use them ({users} do)"
    from ..compat import triton as triton_compat
    return triton_compat.cuda_graphs_problem(triton_compat.gather(), backend.kernels_leave_captures)


def kernels_in_captures_problem(backend: Backend) -> str | None:
    """Why ``backend``'s kernels must stay out of its CUDA graph captures here (None: captures hold them)."""
    from ..compat import triton as triton_compat
    return triton_compat.kernels_in_captures_problem(triton_compat.gather()) if backend.kernels_leave_captures else None


def choose(requested: str, device, nothing_to_compile: bool = False, arch: str = "unet") -> tuple[Backend, list]:
    """The backend to run and the story of the choice: ``resolve(requested, device, arch)``, or
    eager with the reason when the pack is switched off, torch is too old, or the model has nothing
    to compile (``nothing_to_compile``)."""
    from .. import settings
    from ..compat.torch_version import torch_too_old
    from ..reasons import NOTHING_TO_COMPILE, Reason
    if settings.disabled():
        off = Reason(f"{settings.env('DISABLE')} is set: every rewrite is off")
    else:
        off = torch_too_old() or (Reason(NOTHING_TO_COMPILE) if nothing_to_compile else None)
    if off is not None or requested == "eager":
        return lookup_backend("eager")(), ([off] if off is not None else [])
    return resolve(requested, device, arch)


def graphs_for(backend: Backend, config, device, note, thread=None):
    """The region CUDA graphs ``backend`` runs under ``config`` on ``device`` (a ``RegionGraphs``, which
    captures nothing while the compile ``thread`` is busy), or None with a note why not (``note(text)``:
    the report's); sets ``backend.kernels_in_captures`` (whether captures may hold its
    kernels: also without graphs of its own, a capture another party runs must not take one there)
    and ``backend.graphs_replay``. Backend ``auto`` on CUDA with ``cuda_graphs`` off keeps a
    region's graph at a shape only where its replay measured faster than launching its kernels
    (launch-bound sizes), and says so."""
    from ..graphs import RegionGraphs
    graphs = None
    if not config.cuda_graphs:
        if (config.backend == "auto" and backend.uses_cuda_graphs and getattr(device, "type", device) == "cuda"
                and not graphs_problem(backend, device)):
            note("cuda graphs: auto (backend auto on CUDA): a region keeps its graph at a shape only "
                 "where a replay measured faster than launching its kernels; Select Backend's "
                 "cuda_graphs on keeps every graph")
            graphs = RegionGraphs(measured=True, thread=thread)
    elif why := graphs_problem(backend, device):
        note(f"cuda graphs: not used: {why}")
        log.warning("UNet Compiler: cuda graphs not used: %s", why)
    else:
        graphs = RegionGraphs(thread=thread)
    out_of_captures = kernels_in_captures_problem(backend)
    if out_of_captures and graphs is not None:
        note(f"cuda graphs: {out_of_captures}")
    backend.kernels_in_captures = out_of_captures is None
    # a kernel serves only calls that pay their launches where captures cannot hold it
    backend.graphs_replay = graphs is not None and out_of_captures is None
    stopped = getattr(backend, "graphs_stopped", None)
    if graphs is not None and stopped is not None:
        graphs.on_off = stopped
    return graphs
