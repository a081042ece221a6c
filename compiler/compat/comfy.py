"""ComfyUI class resolution. Imports nothing from ComfyUI unless ComfyUI is
already loaded (a ComfyUI model can only exist if it is)."""
from __future__ import annotations

import importlib
import sys


def classes() -> dict:
    if "comfy" not in sys.modules:
        return {}
    try:
        oai = importlib.import_module("comfy.ldm.modules.diffusionmodules.openaimodel")
        attn = importlib.import_module("comfy.ldm.modules.attention")
    except Exception:
        return {}
    return {
        "UNetModel": oai.UNetModel,
        "ResBlock": oai.ResBlock,
        "VideoResBlock": oai.VideoResBlock,
        "CrossAttention": attn.CrossAttention,
        "FeedForward": attn.FeedForward,
        "SpatialTransformer": attn.SpatialTransformer,
        "SpatialVideoTransformer": attn.SpatialVideoTransformer,
    }


def dit_classes() -> dict:
    """ComfyUI's DiT block classes whose forward the pack has a body for, by region kind:
    {kind: class}. Empty when ComfyUI is not loaded (or this ComfyUI lacks them)."""
    if "comfy" not in sys.modules:
        return {}
    out = {}
    try:
        flux = importlib.import_module("comfy.ldm.flux.layers")
        out.update(double_block=flux.DoubleStreamBlock, single_block=flux.SingleStreamBlock)
    except Exception:      # this ComfyUI lacks it, or cannot import it here
        pass
    try:
        qwen = importlib.import_module("comfy.ldm.qwen_image.model")
        out.update(qwen_image_block=qwen.QwenImageTransformerBlock)
    except Exception:
        pass
    return out


#: pixels per latent cell of the ComfyUI latent formats whose VAE is not SD's 8 (by class name:
#: this ComfyUI's formats do not say it themselves; its Empty*Latent nodes divide by these)
LATENT_SCALES = {"Flux2": 16, "HunyuanImage21": 32, "HunyuanImage21Refiner": 16, "ChromaRadiance": 1}


def latent_scale(base_model) -> int:
    """Pixels per latent cell of a ComfyUI BaseModel's latent (8 unless ``LATENT_SCALES`` says else)."""
    fmt = getattr(base_model, "latent_format", None)
    return LATENT_SCALES.get(type(fmt).__name__, 8)


def latent_frames(base_model) -> tuple:
    """The size-1 time axis a ComfyUI BaseModel's latent has where its format has one (Qwen-Image's
    Wan 2.1 format: ``(b, c, 1, h, w)``, as the sampler gives it), else ``()``: the dims between
    channels and height for one image."""
    fmt = getattr(base_model, "latent_format", None)
    return (1,) * (getattr(fmt, "latent_dimensions", 2) - 2)


def dit_context_width(model) -> int | None:
    """The width of a DiT's text conditioning (``c_crossattn``'s last dim), or None when unknown."""
    txt_in = getattr(model, "txt_in", None)
    width = getattr(txt_in, "in_features", None)
    return width if isinstance(width, int) else None


def is_comfy_unet(module) -> bool:
    c = classes()
    return bool(c) and isinstance(module, c["UNetModel"])


def is_comfy_model(module) -> bool:
    """A ComfyUI diffusion model of any architecture (its class lives under comfy.ldm)."""
    return "comfy" in sys.modules and type(module).__module__.startswith("comfy.ldm.")


def not_a_unet_reason(module) -> str:
    t = type(module)
    return (f"running eager: {t.__module__}.{t.__name__} is neither ComfyUI's openaimodel.UNetModel (the SD1.x / "
            f"SD2.x / SDXL / SVD family UNet whose ResBlocks, attention and feed-forwards the compiler "
            f"accelerates) nor a diffusion transformer with blocks it has a body for (Flux's double and single "
            f"stream blocks, Qwen-Image's blocks); nothing in it is rewritten")


def current_prompt() -> str | None:
    """The id of the prompt ComfyUI is executing now (its executing-node context), else None."""
    mod = sys.modules.get("comfy_execution.utils")
    get = getattr(mod, "get_executing_context", None)
    try:
        ctx = get() if get is not None else None
    except Exception:
        return None
    return getattr(ctx, "prompt_id", None)


def has_cast_weights(module) -> bool:
    """True when ComfyUI casts or patches this module's weights per call
    (lowvram partial load, manual_cast, weight_function LoRA patches)."""
    return bool(getattr(module, "comfy_cast_weights", False)
                or getattr(module, "weight_function", None)
                or getattr(module, "bias_function", None))


def is_interrupt(e: BaseException) -> bool:
    """ComfyUI's cancel (InterruptProcessingException) or an out-of-memory error: both propagate
    untouched out of warmup and CUDA-graph capture, never become a fallback there. A region's
    accelerated code that runs out of memory is the exception (``runtime.Accelerator._run``): the
    model's own code, which has its own out-of-memory paths, runs instead."""
    return is_cancel(e) or is_oom(e)


def is_cancel(e: BaseException) -> bool:
    """ComfyUI's cancel (``InterruptProcessingException``, raised where it checks the Cancel button)."""
    return type(e).__name__ == "InterruptProcessingException"


def is_oom(e: BaseException) -> bool:
    import torch
    return isinstance(e, torch.OutOfMemoryError)
