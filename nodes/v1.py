"""V1 node classes, used only when comfy_api.latest is absent (ComfyUI < 0.3.48).
Same ids, inputs and outputs as nodes/v3.py."""
from __future__ import annotations

from ..compiler.config import BACKENDS, PRECISIONS, CompileConfig
from ..compiler.shapes import validate_shapes_input

CATEGORY = "UNet Compiler"


class SelectBackend:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("UNET_BACKEND",)
    RETURN_NAMES = ("backend",)
    FUNCTION = "execute"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"backend": (list(BACKENDS), {"default": "auto"}),
                             "precision": (list(PRECISIONS), {"default": "auto"}),
                             "dynamic_shapes": ("BOOLEAN", {"default": True})},
                "optional": {"cuda_graphs": ("BOOLEAN", {"default": False})}}

    def execute(self, backend, precision, dynamic_shapes, cuda_graphs=False):
        return (CompileConfig(backend=backend, precision=precision, dynamic_shapes=dynamic_shapes,
                              cuda_graphs=bool(cuda_graphs)),)


class CompileUNet:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "execute"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}, "optional": {"backend": ("UNET_BACKEND",)},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    def execute(self, model, backend=None, unique_id=None):
        from . import patcher
        m, text = patcher.compile_model(model, backend, node_id=unique_id)
        return {"ui": {"text": [text]}, "result": (m,)}


class WarmupShapes:
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    FUNCTION = "execute"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "shapes": ("STRING", {"multiline": True, "default": "1x512x512\n2x512x512"})},
                "optional": {"context_tokens": ("INT", {"default": 77, "min": 1, "max": 77 * 16})},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def VALIDATE_INPUTS(cls, shapes, **kwargs):
        return validate_shapes_input(shapes)

    def execute(self, model, shapes, context_tokens=77, unique_id=None):
        from . import patcher
        text = patcher.warmup_model(model, shapes, context_tokens, node_id=unique_id)
        return {"ui": {"text": [text]}, "result": (model, text)}


NODE_CLASS_MAPPINGS = {
    "UNetCompiler_SelectBackend": SelectBackend,
    "UNetCompiler_CompileUNet": CompileUNet,
    "UNetCompiler_WarmupShapes": WarmupShapes,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "UNetCompiler_SelectBackend": "Select Backend",
    "UNetCompiler_CompileUNet": "Compile UNet",
    "UNetCompiler_WarmupShapes": "Warmup Shapes",
}
