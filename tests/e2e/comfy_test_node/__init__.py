"""Test-only ComfyUI nodes (the e2e server links this folder into its custom_nodes; the pack
never loads it): an IPAdapter-style attn2 replace, as such packs register with
``set_model_attn2_replace``, so /prompt tests can put one in a workflow (the patch object is
``unet_compiler.tests._patch_compat.IPAdapterAttn2``, the one the in-process patch-node tests use); and
``UNetCompilerTest_InjectFault`` (faults.py), which injects one fault for the prompt it runs in;
``UNetCompilerTest_PartialLoad``, which makes ComfyUI's own loader load a model partially under a
memory budget (as on a GPU too small for it), and ``UNetCompilerTest_Report``, which shows the
accelerator's report after sampling."""
import functools

from unet_compiler.tests._patch_compat import IPAdapterAttn2

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


@functools.lru_cache(maxsize=None)
def _budgeted(cls):
    """A subclass of ModelPatcher class ``cls`` whose loads are ComfyUI's partial load under a budget
    (``fraction`` of the model's size): the modules past it stay offloaded, cast and patched per call."""
    class Budgeted(cls):
        fraction = 1.0

        def clone(self, *args, **kwargs):
            n = super().clone(*args, **kwargs)
            n.fraction = self.fraction
            return n

        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            if not self.model.model_lowvram:   # loaded whole before (another clone): load again under the budget
                self.unpatch_model(self.offload_device)
            return super().partially_load(device_to, extra_memory, force_patch_weights)

        def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
            budget = int(self.model_size() * self.fraction)
            return super().load(device_to, lowvram_model_memory=budget, force_patch_weights=force_patch_weights,
                                full_load=False)
    return Budgeted


class PartialLoad:
    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 - ComfyUI's name
        return {"required": {"model": ("MODEL",),
                             "fraction": ("FLOAT", {"default": 0.5, "min": 0.01, "max": 1.0, "step": 0.01})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing"

    def patch(self, model, fraction):
        m = model.clone()
        m.__class__ = _budgeted(type(model)) if not hasattr(type(model), "fraction") else type(model)
        m.fraction = fraction
        return (m,)


class Report:
    """The accelerator's report of ``model`` after ``samples`` were made (its calls during sampling)."""
    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 - ComfyUI's name
        return {"required": {"model": ("MODEL",), "samples": ("LATENT",)}}

    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    def report(self, model, samples):
        from unet_compiler.nodes import patcher
        accel = patcher.accelerator_of(model)
        return {"ui": {"text": [accel.text() if accel is not None else "no accelerator"]}}


NODE_CLASS_MAPPINGS = {"UNetCompilerTest_Attn2Replace": Attn2Replace, "UNetCompilerTest_InjectFault": InjectFault,
                       "UNetCompilerTest_PartialLoad": PartialLoad, "UNetCompilerTest_Report": Report}
