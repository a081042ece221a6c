"""The compiler's one surface. For a plain PyTorch / diffusers user: ``compile_unet``, ``warmup``,
``report``, ``uncompile_unet`` (the package's top level). For the ComfyUI nodes (nodes/), which
import from the compiler only through here: the names below the functions' own imports (the
accelerator they wrap a model with, its config and reports, shape checks, ComfyUI's facts the
compiler reads)."""
from __future__ import annotations

import logging
import threading
import types
import weakref

import torch

from . import graphs
from .backends import tooltip as backend_tooltip
from .compat.comfy import (current_prompt, dit_context_width, dit_patch, dit_pooled_width, forget_compiler_recording,
                           is_interrupt, is_video, latent_frames, latent_scale, latent_time_scale)
from .config import BACKENDS, PRECISIONS, CompileConfig
from .inserted import frame_count
from .overrides import own
from .plan import build_plan
from .reasons import GRAD_ON, error_summary, runtime_fallback
from .report import compile_facts, status_line
from .runtime import Accelerator
from .settings import on_off
from .shapes import (MAX_CONTEXT_TOKENS, ShapeError, as_shapes, check_context_tokens, check_frames, check_memory,
                     context_dim, device_free_bytes, first_level_channels, label_of, memory_name, parse_shapes,
                     unet_inputs, validate_shapes_input)
from .warmup import warmup_runs

__all__ = [
    # a plain PyTorch / diffusers user's (the package's top level)
    "compile_unet", "uncompile_unet", "accelerator_of", "report", "warmup", "wait_for_background",
    "weights_changed",
    # the ComfyUI nodes' (nodes/)
    "Accelerator", "BACKENDS", "CompileConfig", "GRAD_ON", "MAX_CONTEXT_TOKENS", "PRECISIONS", "ShapeError", "backend_tooltip",
    "check_context_tokens", "check_frames", "check_memory", "compile_facts", "context_dim",
    "current_prompt", "dit_context_width", "dit_patch", "dit_pooled_width", "error_summary", "first_level_channels",
    "forget_compiler_recording", "frame_count", "is_interrupt", "is_video", "label_of", "latent_frames",
    "latent_scale", "latent_time_scale", "memory_name", "on_off", "parse_shapes", "runtime_fallback", "status_line",
    "unet_inputs", "validate_shapes_input", "warmup_runs",
]

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


def _dtype_now(module, compiled) -> torch.dtype:
    """The dtype of the module's weights now (``.to(dtype)`` after compiling moves it), else ``compiled``."""
    p = next(module.parameters(), None)
    return p.dtype if p is not None else compiled


def _needs_grad(module, args, kwargs) -> bool:
    """Whether a call made with autograd on has something to differentiate: an input tensor or a
    parameter that requires grad (compile_unet turned the parameters' off; a trainer turns them on)."""
    found = []
    torch.utils._pytree.tree_map(lambda v: found.append(v) if isinstance(v, torch.Tensor) and v.requires_grad
                                 else None, (args, kwargs))
    return bool(found) or any(p.requires_grad for p in module.parameters())


class _LibraryEpoch:
    """The weight epoch of a diffusers UNet's calls (``weights.set_epoch``): what rewrites weights in
    place where no version counter moves (a write through ``.data``), so the caches derived from
    them (prepacked convs) are made again: :func:`weights_changed` calls, and the adapters PEFT has
    merged into the weights (diffusers' ``fuse_lora`` / ``unfuse_lora``: PEFT's ``merge`` adds to
    ``weight.data``). PEFT's layers are found again when the module tree changed."""

    def __init__(self):
        self.changed = 0
        self._structure = None
        self._tuners: list = []

    def __call__(self, root) -> tuple:
        if self._structure != graphs.STRUCTURE[0]:
            self._structure = graphs.STRUCTURE[0]
            self._tuners = [m for m in root.modules() if isinstance(m.__dict__.get("merged_adapters"), list)]
        return self.changed, tuple(tuple(m.merged_adapters) for m in self._tuners)


def _library_epoch(accel) -> _LibraryEpoch:
    """``accel``'s library epoch, held by it (it holds PEFT's layers, never the UNet: no cycle)."""
    epoch = accel.__dict__.get("_library_epoch")
    if epoch is None:
        epoch = accel.__dict__["_library_epoch"] = _LibraryEpoch()
    return epoch


def weights_changed(module: torch.nn.Module) -> None:
    """Tell the compiled ``module`` that its weights were rewritten in place in a way no version
    counter shows (a write through ``param.data``, as some LoRA fusers do): what the pack derived
    from them (CPU prepacked convs and linears) is made again at the next call. A new Parameter, an
    in-place op on the parameter itself and PEFT's ``fuse_lora`` / ``unfuse_lora`` are seen without it."""
    _library_epoch(accelerator_of(module)).changed += 1


def _accelerated_forward(accel: Accelerator, module, *args, **kwargs):
    # fp16/bf16 precision runs the regions under autocast; the caller gets the model's dtype back
    # (ComfyUI casts apply_model's output itself; a diffusers scheduler would get bf16 otherwise)
    dtype = _dtype_now(module, accel.model_dtype) if accel.autocast_dtype is not None else None

    def in_model_dtype(t):
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    shape = label_of(args[0] if args else kwargs.get("sample"))
    if torch.is_grad_enabled() and _needs_grad(module, args, kwargs):
        # training or guidance by gradients: the compiled code is for inference (its ops have no backward)
        accel.passed_by(GRAD_ON)
        return type(module).forward(module, *args, **kwargs)
    epoch = _library_epoch(accel)(module)
    # no_grad (diffusers pipelines), inference_mode, or autograd on with nothing to differentiate: run
    # the way ComfyUI and warmup() do, on inference tensors under inference_mode, so the graphs warmup
    # compiled are the ones that run (dynamo guards on inference-ness)
    outer = torch.is_inference_mode_enabled()
    with torch.inference_mode():
        args, kwargs = _as_inference(args), _as_inference(kwargs)
        with accel.active(weight_epoch=epoch, shape=shape):
            out = _map_out(accel.forward(module, args, kwargs), in_model_dtype)
    if outer:
        return out
    # back outside inference_mode: hand out normal tensors the caller may modify in place
    return _map_out(out, torch.Tensor.clone)


class _Forward:
    """The pack's forward on a compiled diffusers UNet (its instance ``forward``, or accelerate's
    ``_old_forward``). It holds the accelerator and the module weakly (dropping the module frees both
    at once). A deep copy or a pickle of the module carries the compile settings, not the accelerator:
    the copy is compiled the same way (its own accelerator) at its first call or ``accelerator_of``."""

    # (slots: what a wrapper made with functools.update_wrapper copies of it is the OWN mark alone)
    __slots__ = ("_module", "config", "accel", "__dict__", "__weakref__")
    __name__ = "forward"

    def __init__(self, module: torch.nn.Module, config: CompileConfig, accel: Accelerator | None = None):
        self._module, self.config, self.accel = weakref.ref(module), config, accel
        own(self)     # (overrides.OWN: the pack's, not another node's)

    def __call__(self, *args, **kwargs):
        module = self._module()
        accel = self.accel if self.accel is not None else accelerator_of(module)
        return _accelerated_forward(accel, module, *args, **kwargs)

    def __deepcopy__(self, memo):
        module = self._module()
        copy = memo.get(id(module)) if module is not None else None   # (the module's copy, made first)
        return _Forward(copy, self.config) if copy is not None else self

    def __reduce__(self):
        return _Forward, (self._module(), self.config)


def _pending(module) -> _Forward | None:
    """The forward a deep copy or an unpickled compiled UNet holds until it is compiled (None: none)."""
    d = module.__dict__
    f = d.get("forward") if isinstance(d.get("forward"), _Forward) else d.get("_old_forward")
    return f if isinstance(f, _Forward) and f.accel is None and d.get(_ATTR) is None else None


def compile_unet(module: torch.nn.Module, backend: str = "auto", **options) -> torch.nn.Module:
    """Accelerate a diffusers ``UNet2DConditionModel`` (or ComfyUI ``UNetModel``)
    in place and return it. Options are :class:`CompileConfig` fields
    (``precision``, ``dynamic_shapes``, ``prepack_conv``). Nothing compiles
    until the first call (or :func:`warmup`). Inference only: the parameters'
    ``requires_grad`` is off while compiled. Undo with :func:`uncompile_unet`.
    A ComfyUI diffusion transformer is refused (ValueError, before any work): its conditioning
    is its ComfyUI model's to build, so it compiles and warms through its ModelPatcher.
    """
    return _compile(module, CompileConfig.from_options(backend, **options))


def _compile(module: torch.nn.Module, config: CompileConfig) -> torch.nn.Module:
    uncompile_unet(module)
    d = module.__dict__
    hooked = "_hf_hook" in d and "_old_forward" in d   # accelerate's hooks (enable_model_cpu_offload, device_map)
    if "forward" in d and not hooked:
        raise ValueError(f"compile_unet: this {type(module).__name__}'s forward was replaced on the instance "
                         f"({getattr(d['forward'], '__qualname__', type(d['forward']).__name__)}), which the pack "
                         f"would have to drop. Fix: call compile_unet before the code that wraps forward (wrappers "
                         f"added after it run around the compiled UNet), or remove that wrapper first")
    plan = build_plan(module)
    if plan.arch == "dit":
        raise ValueError(f"compile_unet: {type(module).__name__} is a ComfyUI diffusion transformer, whose "
                         f"conditioning (text tokens, pooled vectors, guidance, positions) its ComfyUI model builds; "
                         f"this API builds a UNet's only, so it could not warm it. Fix: compile it through its "
                         f"ModelPatcher: the Compile UNet and Warmup Shapes nodes, or "
                         f"unet_compiler.nodes.patcher.compile_model(patcher, config) and then warmup_model(...)")
    accel = Accelerator(module, config, plan=plan)
    d[_ATTR] = accel
    forward = _Forward(module, config, accel)
    if hooked:   # accelerate's forward runs its hook, then calls _old_forward: the pack's, from now on
        # (in a tuple: no code on the module the overrides watch would take for another node's;
        # accelerate's hook holds the module in a cycle already)
        d[_BEFORE] = (d["_old_forward"],)
        d["_old_forward"] = forward
    else:        # (a hook accelerate adds later keeps this as its _old_forward)
        d["forward"] = forward
    return module


#: the module's key for the accelerate ``_old_forward`` the pack's forward took the place of
_BEFORE = "_unet_compiler_old_forward"


def uncompile_unet(module: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`compile_unet`: the module's own forward again, an accelerate hook added before or
    after compiling kept (it calls the module's own forward), and ``requires_grad`` back on the
    parameters compiling turned it off for (they are inference-only while compiled)."""
    d = module.__dict__
    accel = d.pop(_ATTR, None)
    for ref in getattr(accel, "froze", ()):
        p = ref()
        if p is not None:
            p.requires_grad_(True)
    before = d.pop(_BEFORE, None)
    if isinstance(d.get("forward"), _Forward):
        del d["forward"]
    if isinstance(d.get("_old_forward"), _Forward):
        d["_old_forward"] = before[0] if before is not None else types.MethodType(type(module).forward, module)
    return module


#: held while a copy compiles (two threads calling a fresh copy: one compiles, the other waits for it)
_COPY_LOCK = threading.RLock()


def accelerator_of(module) -> Accelerator:
    accel = module.__dict__.get(_ATTR)
    if accel is None:
        with _COPY_LOCK:
            accel = module.__dict__.get(_ATTR)
            if accel is None and (pending := _pending(module)) is not None:   # a copy: compiled as its original was
                _compile(module, pending.config)
                accel = module.__dict__.get(_ATTR)
    if accel is None:
        raise ValueError("module was not compiled: call compile_unet(module) first")
    return accel


def report(module) -> str:
    return accelerator_of(module).text()


def warmup(module, shapes, context_tokens: int = 77, compare: bool = True, background: bool = False) -> str:
    """Compile and prime caches for ``shapes`` (``"1x512x512, 2x768x768"`` or
    (batch, width, height) tuples) under ``torch.inference_mode``. After this,
    batch / resolution changes inside the warmed range do not recompile.
    ``background=True``: return at once and compile in a background thread (calls run the model's
    own code in each region until its code is ready; on a CPU the thread compiles once no call ran
    for a second; ``wait_for_background()`` waits).
    Returns the report text."""
    for name, flag in (("background", background), ("compare", compare)):
        if not isinstance(flag, bool):
            raise TypeError(f"warmup: {name} must be True or False, got {flag!r}")
    context_tokens = check_context_tokens(context_tokens)
    accel = accelerator_of(module)
    p = next(module.parameters())
    shapes = as_shapes(shapes)
    check_frames(shapes, video=False)           # a diffusers UNet2DConditionModel makes images
    unet_inputs(module, accel.plan.family, shapes[0], context_tokens, p.dtype, p.device)   # (ShapeError: before work)
    check_memory(shapes, first_level_channels(module), p.element_size(), device_free_bytes(p.device),
                 memory_name(p.device))

    def run_one(shape):
        with torch.inference_mode():  # as ComfyUI runs: inference tensors guard differently
            args, kwargs = unet_inputs(module, accel.plan.family, shape, context_tokens, p.dtype, p.device)
            out = module(*args, **kwargs)
        return out.sample if hasattr(out, "sample") else out

    warmup_runs(accel, shapes, run_one, compare=compare, background=background)
    return accel.text()


def wait_for_background(timeout: float | None = None) -> bool:
    """Wait until the background compile (``warmup(..., background=True)``) has nothing left to do;
    returns whether it finished within ``timeout`` seconds."""
    from .lifecycle.scheduler import process_scheduler
    return process_scheduler().thread.wait(timeout)
