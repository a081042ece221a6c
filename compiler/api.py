"""Public API for non-ComfyUI users: ``compile_unet`` and ``warmup``."""
from __future__ import annotations

import logging
import time

import torch

from .config import CompileConfig
from .runtime import Accelerator
from .shapes import Shape, as_shapes, probe_shapes, unet_inputs

log = logging.getLogger(__name__)
_ATTR = "_unet_compiler"


def _as_inference(v):
    if isinstance(v, torch.Tensor) and not v.is_inference():
        return v.clone()  # inside inference_mode: an inference tensor
    if isinstance(v, dict):
        return {k: _as_inference(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_as_inference(x) for x in v)
    return v


def _map_out(out, fn):
    """Apply ``fn`` to the tensor(s) a UNet forward returns (diffusers output, tuple or tensor)."""
    if hasattr(out, "sample"):
        out.sample = fn(out.sample)
        return out
    if isinstance(out, tuple):
        return tuple(fn(o) if isinstance(o, torch.Tensor) else o for o in out)
    return fn(out) if isinstance(out, torch.Tensor) else out


def _accelerated_forward(accel: Accelerator, module, *args, **kwargs):
    # fp16/bf16 precision runs the regions under autocast; the caller gets the model's dtype back
    # (ComfyUI casts apply_model's output itself; a diffusers scheduler would get bf16 otherwise)
    dtype = accel.model_dtype if accel._autocast is not None else None

    def in_model_dtype(t):
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    if torch.is_grad_enabled():
        with accel.active():
            return _map_out(type(module).forward(module, *args, **kwargs), in_model_dtype)
    # no_grad (diffusers pipelines) or inference_mode: run the way ComfyUI and
    # warmup() do, on inference tensors under inference_mode, so the graphs
    # warmup compiled are the ones that run (dynamo guards on inference-ness).
    outer = torch.is_inference_mode_enabled()
    with torch.inference_mode():
        args, kwargs = _as_inference(args), _as_inference(kwargs)
        with accel.active():
            out = _map_out(type(module).forward(module, *args, **kwargs), in_model_dtype)
    if outer:
        return out
    # back outside inference_mode: hand out normal tensors the caller may modify in place
    return _map_out(out, torch.Tensor.clone)


def compile_unet(module: torch.nn.Module, backend: str = "auto", **options) -> torch.nn.Module:
    """Accelerate a diffusers ``UNet2DConditionModel`` (or ComfyUI ``UNetModel``)
    in place and return it. Options are :class:`CompileConfig` fields
    (``precision``, ``dynamic_shapes``, ``prepack_conv``). Nothing compiles
    until the first call (or :func:`warmup`). Undo with :func:`uncompile_unet`.
    """
    config = CompileConfig.from_options(backend, **options)
    uncompile_unet(module)
    accel = Accelerator(module, config)
    module.__dict__[_ATTR] = accel
    module.__dict__["forward"] = lambda *a, **k: _accelerated_forward(accel, module, *a, **k)
    return module


def uncompile_unet(module: torch.nn.Module) -> torch.nn.Module:
    if module.__dict__.pop(_ATTR, None) is not None:
        module.__dict__.pop("forward", None)
    return module


def accelerator_of(module) -> Accelerator:
    accel = module.__dict__.get(_ATTR)
    if accel is None:
        raise ValueError("module was not compiled: call compile_unet(module) first")
    return accel


def report(module) -> str:
    return accelerator_of(module).text()


def _levels(unet) -> int:
    """Resolution levels of the UNet (SD1.5: 4, SDXL: 3)."""
    blocks = getattr(unet, "down_blocks", None) or getattr(unet, "channel_mult", None)
    return len(blocks) if blocks else 4


def warmup_probes(accel: Accelerator, shapes: list[Shape]) -> list[Shape]:
    """The probe shapes warmup runs first: only where code is specialised per shape
    (dynamo graphs, Triton kernel variants) and shapes are dynamic."""
    if accel.config.dynamic_shapes and accel.backend.name != "eager" and accel.backend.specialises_on_shapes:
        probes = probe_shapes(shapes)
        return probes + [p for p in accel.backend.extra_probes(shapes, _levels(accel.root)) if p not in probes]
    return []


def warmup_runs(accel: Accelerator, shapes: list[Shape], run_one, on_shape=None, compare=True):
    """Run ``run_one(shape)`` (one UNet forward, returns its output) for the
    probe shapes and then each shape, timing it and counting the graphs each
    one compiled; compare the first shape against the eager reference. Marks
    the accelerator warmed (later compiles are counted as recompiles)."""
    rep = accel.report

    compiled_before = accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"]

    def timed(shape, label):
        g0, c0 = accel.stats["graphs_compiled"], accel.stats["graphs_from_cache"]
        t0 = time.perf_counter()
        out = run_one(shape)
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize(out.device)  # the seconds are the GPU's, not the launch queue's
        secs = time.perf_counter() - t0
        rep.warmup.append((label, secs, accel.stats["graphs_compiled"] - g0))
        rep.from_cache[label] = accel.stats["graphs_from_cache"] - c0
        return out, secs

    accel.defer_cache_save = True
    try:
        _warm(accel, shapes, timed, run_one, on_shape, compare)
    finally:
        accel.defer_cache_save = False
    if accel.stats["graphs_compiled"] - accel.stats["graphs_from_cache"] > compiled_before:
        accel.save_cache()  # once, with every shape's code new to the cache
    accel.warmed = True
    return rep


def _warm(accel, shapes, timed, run_one, on_shape, compare):
    rep = accel.report
    for probe in warmup_probes(accel, shapes):
        timed(probe, f"{probe.label} (probe)")
    for i, shape in enumerate(shapes):
        out, secs = timed(shape, shape.label)
        if accel.graphs is not None:  # a region is captured on its second call at a shape
            out, _ = timed(shape, f"{shape.label} (cuda graph capture)")
        if i == 0 and compare:
            with accel.bypass():
                ref = run_one(shape)
            rep.max_abs_diff = float((out.float() - ref.float()).abs().max())
            rep.diff_label = f"at {shape.label}" + (f", {accel.config.precision} vs model dtype"
                                                     if accel.config.precision in ("fp16", "bf16") else "")
        if on_shape is not None:
            on_shape(i, shape, secs)


def warmup(module, shapes, context_tokens: int = 77, compare: bool = True) -> str:
    """Compile and prime caches for ``shapes`` (``"1x512x512, 2x768x768"`` or
    (batch, width, height) tuples) under ``torch.inference_mode``. After this,
    batch / resolution changes inside the warmed range do not recompile.
    Returns the report text."""
    accel = accelerator_of(module)
    p = next(module.parameters())

    def run_one(shape):
        with torch.inference_mode():  # as ComfyUI runs: inference tensors guard differently
            args, kwargs = unet_inputs(module, accel.plan.family, shape, context_tokens, p.dtype, p.device)
            out = module(*args, **kwargs)
        return out.sample if hasattr(out, "sample") else out

    warmup_runs(accel, as_shapes(shapes), run_one, compare=compare)
    return accel.text()
