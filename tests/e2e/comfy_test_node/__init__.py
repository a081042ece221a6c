"""Test-only ComfyUI nodes (the e2e server links this folder into its custom_nodes; the pack
never loads it): an IPAdapter-style attn2 replace, as such packs register with
``set_model_attn2_replace``, so /prompt tests can put one in a workflow (the patch object is
``unet_compiler.bench.patch_compat.IPAdapterAttn2``, the one the in-process patch-node tests use); and
``UNetCompilerTest_InjectFault`` (faults.py), which injects one fault for the prompt it runs in."""
from unet_compiler.bench.patch_compat import IPAdapterAttn2

from .faults import InjectFault

#: SD1.5 blocks with cross-attention: input_blocks 1 (first level) and output_blocks 3 (third level)
BLOCKS = (("input", 1), ("output", 3))


class Attn2Replace:
    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 - ComfyUI's name
        return {"required": {"model": ("MODEL",),
                             "weight": ("FLOAT", {"default": 0.7, "min": -4.0, "max": 4.0, "step": 0.01})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing"

    def patch(self, model, weight):
        m = model.clone()
        ip = IPAdapterAttn2(weight=weight)
        for block in BLOCKS:
            m.set_model_attn2_replace(ip, *block)
        return (m,)


NODE_CLASS_MAPPINGS = {"UNetCompilerTest_Attn2Replace": Attn2Replace, "UNetCompilerTest_InjectFault": InjectFault}
