"""torch.compile (inductor) of leaf regions.

One compiled callable per region body is shared by every block instance;
dims are symbolic (batch, H, W, tokens, and channel counts) so a new batch
size or resolution reuses the compiled code. On CPU, convolutions inside the
compiled graphs and the free-standing ones both go through the prepacked
oneDNN conv (passes/prepack_conv.py), which keeps weights live.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
import shutil

import torch

from .. import settings
from ..lifecycle import precompiled, variants
from .. import regions
from ..compat.torch_version import torch_too_old
from ..plan import PROJECTION
from ..reasons import Reason
from . import Backend, register_backend

log = logging.getLogger(__name__)



def _make_dynamo_backend(prepack: bool, prepack_lin: bool = False):
    def unet_compiler_inductor(gm, example_inputs):
        if prepack:
            from ..passes import prepack_conv
            prepack_conv.rewrite_graph(gm)
        if prepack_lin:
            from ..passes import prepack_linear
            prepack_linear.rewrite_graph(gm)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)
    return unet_compiler_inductor


@functools.lru_cache(maxsize=None)
def compiled_body(body, dynamic: bool | None, prepack: bool, prepack_lin: bool = False):
    """One torch.compile wrapper per (body, options), shared process-wide so
    every clone / Compile UNet node reuses the same compiled code. ``dynamic`` None: the first
    shape static, dynamic after a change (torch's automatic dynamic shapes)."""
    return torch.compile(body, backend=_make_dynamo_backend(prepack, prepack_lin), dynamic=dynamic)


@functools.lru_cache(maxsize=None)
def _backend(prepack: bool, prepack_lin: bool):
    return _make_dynamo_backend(prepack, prepack_lin)


def region_body(body, dynamic: bool | None, prepack: bool, prepack_lin: bool, scheduler):
    """What runs a region body: its precompiled variants (in ``scheduler``'s registry, kept by the
    compile cache, loaded at a restart without tracing; ``precompiled.py``), else plain torch.compile."""
    plain = compiled_body(body, dynamic, prepack, prepack_lin)
    if not variants.enabled():
        return plain
    return precompiled.body(body, _backend(prepack, prepack_lin), dynamic, plain, (prepack, prepack_lin), scheduler)


def _cpp_compiler_missing(system: str | None = None) -> Reason | None:
    """Why inductor's CPU code cannot be built here (None: a C++ compiler it uses is found). On
    Windows torch builds with MSVC's ``cl`` (or ``CXX``), which is installed but not on PATH
    unless ComfyUI starts from a developer prompt; elsewhere with ``cpp.cxx`` (default g++)."""
    if (system or platform.system()) == "Windows":
        cxx = os.environ.get("CXX")
        if (cxx and shutil.which(cxx)) or shutil.which("cl"):
            return None
        why = "no C++ compiler on PATH for inductor's CPU code (torch builds it with MSVC's cl.exe on Windows)"
        fix = ("install Visual Studio Build Tools with the C++ workload, then start ComfyUI from the 'x64 Native "
               "Tools Command Prompt for VS' (or run vcvars64.bat first), or choose eager")
        return Reason(why, fix, text=f"{why}; {fix}")
    try:
        from torch._inductor import config as ic
        cxx = ic.cpp.cxx[-1] if isinstance(ic.cpp.cxx, tuple) else ic.cpp.cxx
        if cxx and shutil.which(cxx) is None and shutil.which("g++") is None and shutil.which("cl") is None:
            why = f"no C++ compiler ({cxx}) found for inductor's CPU code"
            install = "install gcc (Linux) or MSVC Build Tools (Windows)"
            return Reason(why, f"{install}, then restart ComfyUI", text=f"{why}; {install}")
    except Exception:
        return None
    return None


def _triton_missing() -> Reason | None:
    """Inductor compiles CUDA code with triton: without a working one every region's first compile
    fails ("Cannot find a working triton installation"), so it is said up front, with the fix."""
    from ..compat import triton as triton_compat
    facts = triton_compat.gather()
    why = triton_compat.problem(facts)
    if why is None:
        return None
    return Reason(f"on CUDA it compiles through triton, and {why.why}", why.fix)


@register_backend("inductor")
class InductorBackend(Backend):
    auto_rank, fallback, uses_cuda_graphs = 2, True, True
    summary = "regional torch.compile (CUDA or CPU)"
    follows_dynamic_shapes = True
    dit_blocks = True
    #: where the model runs (set by ``available``): free-standing conv regions are CPU-only
    device_type = "cpu"

    def available(self, device):
        old = torch_too_old()
        if old:
            return False, old
        kind = getattr(device, "type", "cpu")
        missing = _cpp_compiler_missing() if kind == "cpu" else _triton_missing() if kind == "cuda" else None
        if missing:
            return False, missing
        self.device_type = kind
        return True, "regional torch.compile"

    def impls(self, config, scheduler) -> dict:
        prepack = config.prepack_conv
        lin = config.prepack_linear
        out = {key: region_body(body, config.dynamic_shapes, prepack, lin, scheduler)
               for key, body in regions.BODIES.items()}
        self._bodies = [b for b in out.values() if isinstance(b, precompiled.Precompiled)]
        # the custom ops the passes put into graphs are registered when their modules load: a variant
        # loaded from the compile cache calls them with no compile (which imports them) in this process
        if lin:
            from ..passes import prepack_linear  # noqa: F401
        if prepack and self.device_type == "cpu":   # oneDNN's packed weights: CPU convs only
            from ..passes import prepack_conv
            out[("comfy", PROJECTION)] = out[("diffusers", PROJECTION)] = prepack_conv.conv_module_forward
        return out

    def status_lines(self, modules=()) -> list[str]:
        missed = {b.__name__: why for b in getattr(self, "_bodies", ()) if (why := b.missed_for(modules))}
        if not missed:
            return []
        return ["  not precompiled (plain torch.compile serves these bodies: compiled at their calls, again after "
                "a restart): " + "; ".join(f"{name} ({why})" for name, why in sorted(missed.items()))]

    def no_impl_reason(self, kind: str, config) -> str:
        if kind == PROJECTION and config.prepack_conv and self.device_type != "cpu":
            return "free-standing convs: prepacking is for CPU convs (cuDNN runs them here)"
        return super().no_impl_reason(kind, config)

    def background_problem(self) -> str | None:
        if not variants.enabled():
            return (f"precompiled regions are off ({settings.env('PRECOMPILE')}=off, or this torch cannot "
                    f"precompile: torch.compile(...).aot_compile is missing in torch 2.11, there in 2.13)")
        return None

    def compile_count(self, scheduler) -> int:
        # a variant compiled here is a dynamo graph already; one loaded from the cache is not traced
        return scheduler.variants.from_cache

    def dynamo_config(self, config):
        if config.dynamic_shapes is not True:   # False: static; None: static first (warmup.one_shape)
            return (torch._dynamo.config.patch(recompile_limit=64),)
        return (
            # channel counts symbolic too: blocks that differ only in width share one graph.
            # Size-1 dims (batch 1, a 1x1 deepest level at 64 px) still specialise in plain
            # dynamo; warmup primes each such class with a small probe shape (warmup.probe_shapes).
            # Precompiled variants trace size-obliviously where they can (precompiled._trace; in
            # plain dynamo the fake matmul raised on context width vs to_k.in_features).
            torch._dynamo.config.patch(force_parameter_static_shapes=False,
                                       force_nn_module_property_static_shapes=False,
                                       recompile_limit=64),
        )


