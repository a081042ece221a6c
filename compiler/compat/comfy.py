"""ComfyUI class resolution. Imports nothing from ComfyUI unless ComfyUI is
already loaded (a ComfyUI model can only exist if it is)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import threading


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


def _loaded(load) -> dict:
    """``load()`` (a dict of ComfyUI classes, imported by literal names), or {} where this ComfyUI lacks
    them or cannot import them here."""
    if "comfy" not in sys.modules:
        return {}
    try:
        return load()
    except Exception:
        return {}


def dit_classes() -> dict:
    """ComfyUI's DiT block classes whose forward the pack has a body for, by region kind:
    {kind: class}. Empty when ComfyUI is not loaded (or this ComfyUI lacks them)."""
    def flux():
        m = importlib.import_module("comfy.ldm.flux.layers")
        return {"double_block": m.DoubleStreamBlock, "single_block": m.SingleStreamBlock}
    return {**_loaded(flux),
            **_loaded(lambda: {"qwen_image_block": importlib.import_module(
                "comfy.ldm.qwen_image.model").QwenImageTransformerBlock}),
            **_loaded(lambda: {"wan_block": importlib.import_module("comfy.ldm.wan.model").WanAttentionBlock}),
            **_loaded(lambda: {"joint_block": importlib.import_module(
                "comfy.ldm.modules.diffusionmodules.mmdit").JointBlock}),
            **_loaded(lambda: {"lumina_block": importlib.import_module(
                "comfy.ldm.lumina.model").JointTransformerBlock})}


def wan_parts() -> dict:
    """The attention classes of a Wan block the pack's body reads: {"self": WanSelfAttention,
    "cross": (WanT2VCrossAttention, WanI2VCrossAttention)}. Empty when ComfyUI lacks them."""
    def load():
        wan = importlib.import_module("comfy.ldm.wan.model")
        return {"self": wan.WanSelfAttention, "cross": (wan.WanT2VCrossAttention, wan.WanI2VCrossAttention)}
    return _loaded(load)


#: pixels per latent cell of the ComfyUI latent formats whose VAE is not SD's 8 (by class name:
#: this ComfyUI's formats do not say it themselves; its Empty*Latent nodes divide by these)
LATENT_SCALES = {"Flux2": 16, "HunyuanImage21": 32, "HunyuanImage21Refiner": 16, "ChromaRadiance": 1, "Wan22": 16,
                 "LTXV": 32}
#: video frames per latent frame after the first, by latent format class name (ComfyUI's empty video
#: latent nodes: ``((length - 1) // n) + 1`` latent frames for ``length`` frames)
LATENT_TIME_SCALES = {"Wan21": 4, "Wan22": 4, "HunyuanVideo": 4, "HunyuanVideo15": 4, "Mochi": 6, "LTXV": 8,
                      "Cosmos1CV8x8x8": 8}


def latent_scale(base_model) -> int:
    """Pixels per latent cell of a ComfyUI BaseModel's latent (8 unless ``LATENT_SCALES`` says else)."""
    fmt = getattr(base_model, "latent_format", None)
    return LATENT_SCALES.get(type(fmt).__name__, 8)


def latent_frames(base_model, frames: int | None = None) -> tuple:
    """The dims between channels and height of a ComfyUI BaseModel's latent: ``()`` for a 2-D format;
    for a video format ``(t,)``, the latent frames of ``frames`` video frames (None: one image, t = 1;
    Qwen-Image's Wan 2.1 format is ``(b, c, 1, h, w)`` as the sampler gives it)."""
    fmt = getattr(base_model, "latent_format", None)
    extra = getattr(fmt, "latent_dimensions", 2) - 2
    if extra <= 0:
        return ()
    return ((frames - 1) // latent_time_scale(base_model) + 1 if frames else 1,) * extra


def latent_time_scale(base_model) -> int:
    """Video frames per latent frame of a ComfyUI BaseModel's latent (4 for Wan; 1 for an image format)."""
    return LATENT_TIME_SCALES.get(type(getattr(base_model, "latent_format", None)).__name__, 1)


def is_video(base_model) -> bool:
    """Whether the model samples videos (its latent format has a time axis that takes several frames)."""
    return latent_time_scale(base_model) > 1


def dit_context_width(model) -> int | None:
    """The width of a DiT's text conditioning (``c_crossattn``'s last dim), or None when unknown."""
    txt_in = getattr(model, "txt_in", None) or getattr(model, "context_embedder", None)    # Flux's, SD3's
    txt_in = getattr(txt_in, "input_embedder", txt_in)     # HunyuanVideo: a token refiner
    if txt_in is None:                              # Wan: text_embedding = Sequential(Linear, GELU, Linear)
        txt_in = next(iter(getattr(model, "text_embedding", None) or ()), None)
    if txt_in is None:                              # Lumina 2: cap_embedder = Sequential(RMSNorm, Linear)
        txt_in = next((m for m in getattr(model, "cap_embedder", None) or () if hasattr(m, "in_features")), None)
    width = getattr(txt_in, "in_features", None)
    return width if isinstance(width, int) else None


def dit_patch(model) -> int:
    """Latent cells per token side of a DiT (its ``patch_size``: Flux 2, Flux.2 1, Wan (1, 2, 2))."""
    p = getattr(model, "patch_size", None)
    p = p[-1] if isinstance(p, (tuple, list)) and p else p
    return p if isinstance(p, int) and p > 0 else 1


def dit_pooled_width(model) -> int | None:
    """The width of a DiT's pooled text vector (the ``y`` its model's ``encode_adm`` hands it: SD3's
    2048, Flux's 768), or None when it takes none."""
    y = getattr(model, "y_embedder", None)          # SD3: y_embedder.mlp = Sequential(Linear, SiLU, Linear)
    first = y.mlp[0] if hasattr(y, "mlp") else getattr(getattr(model, "vector_in", None), "in_layer", None)
    width = getattr(first, "in_features", None)
    return width if isinstance(width, int) else None


def is_comfy_unet(module) -> bool:
    c = classes()
    return bool(c) and isinstance(module, c["UNetModel"])


def is_comfy_model(module) -> bool:
    """A ComfyUI diffusion model of any architecture (its class lives under comfy.ldm)."""
    return "comfy" in sys.modules and type(module).__module__.startswith("comfy.ldm.")


#: ComfyUI diffusion models left to ComfyUI by design (their module's prefix): the name and why
LEFT_TO_COMFYUI = {
    "comfy.ldm.qwen_image21.": (
        "Qwen-Image 2.1", "its blocks already run comfy-kitchen's fused kernels (adaln, rms_rope, the SwiGLU "
        "folded into the down projection's input) and opt into ComfyUI's own compiler (a prefetch queue per "
        "block, its allocations recorded); the pack has no body for them, so they run as ComfyUI runs them"),
}


def not_a_unet_reason(module) -> str:
    t = type(module)
    for prefix, (name, why) in LEFT_TO_COMFYUI.items():
        if t.__module__.startswith(prefix):
            return f"running eager: {name} ({t.__module__}.{t.__name__}): {why}"
    return (f"running eager: {t.__module__}.{t.__name__} is neither ComfyUI's openaimodel.UNetModel (the SD1.x / "
            f"SD2.x / SDXL / SVD family UNet whose ResBlocks, attention and feed-forwards the compiler "
            f"accelerates) nor a diffusion transformer with blocks it has a body for (Flux's double and single "
            f"stream blocks, SD3's joint blocks, Qwen-Image's, Wan's and Lumina 2's blocks); nothing in it is rewritten")


def current_prompt() -> str | None:
    """The id of the prompt ComfyUI is executing now (its executing-node context), else None."""
    mod = sys.modules.get("comfy_execution.utils")
    get = getattr(mod, "get_executing_context", None)
    try:
        ctx = get() if get is not None else None
    except Exception:
        return None
    return getattr(ctx, "prompt_id", None)


def class_name(cls) -> str:
    """``cls``'s dotted name as a user reads it. ComfyUI imports a custom node pack as a module named by
    its folder's path (``/.../custom_nodes/ComfyUI-GGUF``), so the classes of another pack carry that
    path in ``__module__``: it is cut to the pack's folder name (``ComfyUI-GGUF.ops.GGMLOps.Linear``)."""
    module = cls.__module__ or ""
    if "/" in module or "\\" in module:
        module = module.replace("\\", "/").rstrip("/").rpartition("/")[2]
    return f"{module}.{cls.__qualname__}"


#: the op attributes (class defaults, set per instance by ComfyUI's patcher) that make an op cast or
#: patch its weights per call
CAST_FLAGS = ("comfy_cast_weights", "weight_function", "bias_function")


def has_cast_weights(module) -> bool:
    """True when ComfyUI casts or patches this module's weights per call
    (lowvram partial load, manual_cast, weight_function LoRA patches)."""
    # ComfyUI's op flags are class attributes its patcher sets per instance: read from the instance's
    # __dict__, else the class's (kept per class), never through nn.Module.__getattr__, whose miss
    # (a raised AttributeError) on a module without them costs more than the rest of this check
    d, cls = module.__dict__, type(module)
    on_class = cast_flags_of(cls)
    for name in CAST_FLAGS:
        if d[name] if name in d else name in on_class and getattr(cls, name):
            return True
    return False


@functools.lru_cache(maxsize=None)
def cast_flags_of(cls) -> frozenset:
    """The names in :data:`CAST_FLAGS` that ``cls`` defines (kept per class; their values are read
    live by the caller: a class attribute may change)."""
    return frozenset(name for name in CAST_FLAGS if hasattr(cls, name))


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


def release_failed(error: BaseException, args) -> None:
    """Let go of what a failed accelerated call allocated: the locals of its frames (kept alive by
    the error's traceback) and, on CUDA, the cached blocks they leave behind."""
    import traceback

    import torch
    traceback.clear_frames(error.__traceback__)
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def _compiler_graphs():
    """(``comfy.model_prefetch`` or None, its per-thread recordings or None): ``MALLOC_GRAPHS``, or an
    older build's ``ACTIVE_MALLOC_GRAPHS``."""
    mod = sys.modules.get("comfy.model_prefetch")
    if mod is None:
        return None, None
    graphs = getattr(mod, "MALLOC_GRAPHS", None)
    if not isinstance(graphs, dict):
        graphs = getattr(mod, "ACTIVE_MALLOC_GRAPHS", None)
    return mod, graphs if isinstance(graphs, dict) else None


def compiler_recording():
    """A context pausing ComfyUI's own compiler for this thread (since August 2026: comfy-aimdo records
    a block's allocations and replays them; an allocation the replay does not expect, as a block
    switching between compiled code and the model's own makes, is a "graph break", an error under
    ``--assert-graph-breaks``), or None when this ComfyUI has none or it is not recording now. Probed
    by name (:func:`_compiler_graphs`): ``pause_malloc_graph``, or an older build's graph, which
    pauses itself."""
    mod, graphs = _compiler_graphs()
    graph = graphs.get(threading.get_ident()) if graphs is not None else None
    if graph is None or not getattr(graph, "_comfy_active", True):
        return None
    pause = getattr(mod, "pause_malloc_graph", None)
    return pause() if pause is not None else _paused(graph)


@contextlib.contextmanager
def _paused(graph):
    graph.pause()
    try:
        yield
    finally:
        graph.resume()


def compiler_records() -> bool:
    """Whether ComfyUI's compiler keeps a recording on this thread (active or between two forwards of
    a model that opts in): its allocations are replayed at recorded addresses, which a CUDA graph
    captured around the model's forward would hold and replay behind its back."""
    _, graphs = _compiler_graphs()
    return graphs is not None and threading.get_ident() in graphs


def forget_compiler_recording() -> bool:
    """Drop this thread's recording of ComfyUI's compiler (its own ``cleanup_malloc_graph``, which
    ComfyUI runs between nodes), so the next forward records afresh. Warmup Shapes calls this around
    each of its calls: other shapes and compares against the model's own code are no pattern a
    replay could follow (each would be a graph break, fatal under ``--assert-graph-breaks``). True
    when there was one."""
    mod, graphs = _compiler_graphs()
    cleanup = getattr(mod, "cleanup_malloc_graph", None)
    if graphs is None or threading.get_ident() not in graphs or cleanup is None:
        return False
    cleanup()
    return True


#: bytes each holder (a key: its id) asked a loaded ComfyUI to keep free beside its models
_RESERVED: dict[int, int] = {}
_RESERVED_LOCK = threading.Lock()


def reserve_vram(key: int, nbytes: int) -> int:
    """Tell a loaded ComfyUI that ``nbytes`` of torch's reserved but idle device memory are held by
    ``key``'s owner (a CUDA graph pool's temporaries, which only its replays use): ComfyUI's free
    memory count (``model_management.get_free_memory``: the card's free memory plus torch's reserved
    minus active) counts them as free. They are added to ``model_management.EXTRA_RESERVED_VRAM``,
    what its loader keeps free beside the models it loads (``--reserve-vram``'s figure), in place of
    ``key``'s previous figure; 0 takes it back. Returns the bytes now held for ``key`` (0 where no
    ComfyUI is loaded)."""
    mm = sys.modules.get("comfy.model_management")
    with _RESERVED_LOCK:
        old = _RESERVED.pop(key, 0)
        extra = getattr(mm, "EXTRA_RESERVED_VRAM", None) if mm is not None else None
        if not isinstance(extra, (int, float)):
            return 0
        nbytes = max(0, int(nbytes))
        if nbytes:
            _RESERVED[key] = nbytes
        mm.EXTRA_RESERVED_VRAM = extra + nbytes - old
        return nbytes
