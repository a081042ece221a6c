"""V3 node schemas (ComfyUI >= 0.3.48). Thin: schema + execute."""
from __future__ import annotations

from comfy_api.latest import ComfyExtension, io, ui

from ..compiler.backends import tooltip as backend_tooltip
from ..compiler.config import BACKENDS, PRECISIONS, CompileConfig
from ..compiler.shapes import ShapeError, validate_shapes_input
from . import patcher

UnetBackend = io.Custom("UNET_BACKEND")


class SelectBackend(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="UNetCompiler_SelectBackend",
            display_name="Select Backend",
            category="UNet Compiler",
            description="Choose how Compile UNet accelerates the model.",
            inputs=[
                io.Combo.Input("backend", options=list(BACKENDS), default="auto", tooltip=backend_tooltip()),
                io.Combo.Input("precision", options=list(PRECISIONS), default="auto",
                               tooltip="auto keeps the dtype ComfyUI chose (same math as eager). fp16/bf16 run under "
                                       "autocast: faster on hardware with those units; Warmup Shapes reports the error."),
                io.Boolean.Input("dynamic_shapes", default=True,
                                 tooltip="On: new batch sizes / resolutions inside the warmed range reuse compiled "
                                         "code (no recompiles). Off: each new shape compiles again."),
                io.Boolean.Input("cuda_graphs", default=False, optional=True,
                                 tooltip="CUDA only (triton, inductor): replay each region as a CUDA graph from its "
                                         "2nd call at a shape; fewer launches, the SD1.5 win. Costs GPU memory per "
                                         "shape. Needs ComfyUI started with --disable-cuda-malloc."),
            ],
            outputs=[UnetBackend.Output(display_name="backend")],
        )

    @classmethod
    def execute(cls, backend, precision, dynamic_shapes, cuda_graphs=False) -> io.NodeOutput:
        return io.NodeOutput(CompileConfig(backend=backend, precision=precision, dynamic_shapes=dynamic_shapes,
                                           cuda_graphs=bool(cuda_graphs)))


class CompileUNet(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="UNetCompiler_CompileUNet",
            display_name="Compile UNet",
            category="UNet Compiler",
            description="Accelerate the UNet's leaf regions; ComfyUI's patches, ControlNet and LoRA keep working.",
            inputs=[
                io.Model.Input("model", tooltip="The MODEL to accelerate (SD1.5 / SDXL UNet). It is cloned, never modified."),
                UnetBackend.Input("backend", optional=True,
                                  tooltip="From Select Backend. Absent = auto, fp as loaded, dynamic shapes on."),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, backend=None) -> io.NodeOutput:
        try:
            m, text = patcher.compile_model(model, backend, node_id=cls.hidden.unique_id)
        except TypeError as e:
            raise RuntimeError(f"Compile UNet: {e}") from e
        return io.NodeOutput(m, ui=ui.PreviewText(text))


class WarmupShapes(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="UNetCompiler_WarmupShapes",
            display_name="Warmup Shapes",
            category="UNet Compiler",
            description="Compile ahead of sampling for the listed shapes so KSampler never waits or recompiles.",
            inputs=[
                io.Model.Input("model", tooltip="The MODEL from Compile UNet."),
                io.String.Input("shapes", multiline=True, default="1x512x512\n2x512x512",
                                tooltip="Entries BxWxH in pixels (batch x width x height), one per line or comma "
                                        "separated. Batch and resolution anywhere inside the listed range then run "
                                        "without recompiling. Remember CFG doubles the UNet batch."),
                io.Int.Input("context_tokens", default=77, min=1, max=77 * 16, optional=True,
                             tooltip="Prompt length in tokens used for warmup (77 per CLIP chunk)."),
            ],
            outputs=[io.Model.Output(), io.String.Output(display_name="report")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, shapes, **kwargs):
        return validate_shapes_input(shapes)

    @classmethod
    def execute(cls, model, shapes, context_tokens=77) -> io.NodeOutput:
        try:
            text = patcher.warmup_model(model, shapes, context_tokens, node_id=cls.hidden.unique_id)
        except ShapeError as e:
            raise ValueError(f"Warmup Shapes: {e}") from e
        return io.NodeOutput(model, text, ui=ui.PreviewText(text))


class UNetCompilerExtension(ComfyExtension):
    async def get_node_list(self):
        return [SelectBackend, CompileUNet, WarmupShapes]


async def comfy_entrypoint() -> UNetCompilerExtension:
    return UNetCompilerExtension()
