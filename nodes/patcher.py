"""ComfyUI ModelPatcher glue shared by the V3 and V1 nodes.

Rule 1: never mutate the shared model. Compile UNet clones the patcher and
adds one keyed APPLY_MODEL wrapper (plus an ON_APPLY_HOOKS callback); the
wrapper swaps region forwards in for one apply_model call and restores them
in ``finally`` (runtime.Accelerator.active).
"""
from __future__ import annotations

import logging

import torch

from ..compiler.config import CompileConfig
from ..compiler.runtime import Accelerator
from ..compiler.shapes import parse_shapes, unet_inputs
from ..compiler.api import warmup_runs
from . import feedback

log = logging.getLogger(__name__)

KEY = "unet_compiler"


def _apply_model_wrapper(accel: Accelerator, hooks_epoch: list):
    def unet_compiler_apply_model(executor, *args, **kwargs):
        base = executor.class_obj
        if getattr(base, "diffusion_model", None) is not accel.root:
            # another node swapped the diffusion model (e.g. TorchCompileModel): run it as given
            accel.stats["eager_calls"] += 1
            return executor(*args, **kwargs)
        epoch = (getattr(base, "current_weight_patches_uuid", None), hooks_epoch[0])
        with accel.active(weight_epoch=epoch):
            return executor(*args, **kwargs)
    unet_compiler_apply_model.accelerator = accel
    return unet_compiler_apply_model


def compile_model(model, config: CompileConfig | None, node_id=None):
    """Clone ``model`` and attach the accelerator. Returns (clone, report text).
    The backend and state go to the node's UI (``node_id``) and the log."""
    import comfy.model_management
    from comfy.patcher_extension import CallbacksMP, WrappersMP

    config = config or CompileConfig()
    m = model.clone()
    unet = m.get_model_object("diffusion_model")
    accel = Accelerator(unet, config, device=comfy.model_management.get_torch_device())
    hooks_epoch = [0]

    def on_apply_hooks(patcher, hooks):
        # scheduled LoRA hooks rewrite weights in place between steps
        hooks_epoch[0] += 1

    m.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, KEY)
    m.remove_callbacks_with_key(CallbacksMP.ON_APPLY_HOOKS, KEY)
    m.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, _apply_model_wrapper(accel, hooks_epoch))
    m.add_callback_with_key(CallbacksMP.ON_APPLY_HOOKS, KEY, on_apply_hooks)
    facts = feedback.compiled(accel, node_id)
    return m, accel.text() + f"\n  status: {facts['text']}"


def sampling_transformer_options(model) -> dict:
    """transformer_options as KSampler builds them (the patcher's wrappers and
    callbacks merged in by ComfyUI's own prepare_model_patcher)."""
    import comfy.model_patcher
    import comfy.sampler_helpers
    options = comfy.model_patcher.create_model_options_clone(model.model_options)
    options.setdefault("transformer_options", {})
    comfy.sampler_helpers.prepare_model_patcher(model, {}, options)
    return options["transformer_options"]


def accelerator_of(model) -> Accelerator | None:
    """The accelerator the model's keyed wrapper runs (clones share it: the
    wrapper list is copied, the wrapper function is not)."""
    from comfy.patcher_extension import WrappersMP
    for w in model.get_wrappers(WrappersMP.APPLY_MODEL, KEY):
        accel = getattr(w, "accelerator", None)
        if accel is not None:
            return accel
    return None


def warmup_model(model, shapes_text: str, context_tokens: int, node_id=None):
    """Run the model's real apply_model (wrappers and all) for each shape
    under inference_mode with a cancellable ProgressBar. Returns report text."""
    import comfy.model_management
    import comfy.utils

    shapes = parse_shapes(shapes_text)
    accel = accelerator_of(model)
    if accel is None:
        raise ValueError("Warmup Shapes: the model was not compiled. Fix: connect the MODEL output of "
                         "Compile UNet to this node's model input.")
    comfy.model_management.load_models_gpu([model])
    base = model.model
    device = comfy.model_management.get_torch_device()
    dtype = base.manual_cast_dtype or base.get_dtype()
    unet = base.diffusion_model
    total = len(shapes) + 1
    pbar = comfy.utils.ProgressBar(total, node_id=node_id)
    fb = feedback.WarmupFeedback(accel, shapes, node_id)

    def run_one(shape):
        with torch.inference_mode():
            (x, _), kw = unet_inputs(unet, "comfy", shape, context_tokens, dtype, device)
            sigma = torch.full((shape.batch,), 1.0, device=device)
            to = sampling_transformer_options(model)
            extra = {"y": kw["y"]} if "y" in kw else {}
            return base.apply_model(x, sigma, c_crossattn=kw["context"], transformer_options=to, **extra)

    def tick(i, shape, secs):
        pbar.update_absolute(i + 1, total)
        fb.shape_done(i, shape, secs)

    fb.start()
    try:
        warmup_runs(accel, shapes, fb.wrap(run_one), on_shape=tick)
    finally:
        fb.close()
    pbar.update_absolute(total, total)
    done = fb.finished()
    return accel.text() + f"\n  status: {done['text']}"
