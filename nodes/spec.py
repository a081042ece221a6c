"""The pack's nodes, declared once: id, display name, description, inputs (name, ComfyUI type,
widget options, tooltip), outputs. ``nodes/v3.py`` builds the V3 schemas from this; the tests read
it without ComfyUI. Ids, input names and outputs are a public API: never rename one once published.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..compiler.api import BACKENDS, MAX_CONTEXT_TOKENS, PRECISIONS, backend_tooltip

CATEGORY = "UNet Compiler"


@dataclass(frozen=True)
class Input:
    name: str
    #: ComfyUI type: COMBO, BOOLEAN, STRING, INT, MODEL, or the pack's UNET_BACKEND
    type: str
    tooltip: str
    optional: bool = False
    #: the widget's options (``default``, ``options``, ``multiline``, ``min``, ``max``)
    widget: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Node:
    node_id: str
    display_name: str
    description: str
    inputs: tuple[Input, ...]
    #: (ComfyUI type, display name or None) per output
    outputs: tuple[tuple[str, str | None], ...]
    #: the node writes text to its own UI (gets its unique id)
    reports: bool = False

    @property
    def required(self) -> list[str]:
        return [i.name for i in self.inputs if not i.optional]

    @property
    def optional(self) -> list[str]:
        return [i.name for i in self.inputs if i.optional]


SELECT_BACKEND = Node(
    "UNetCompiler_SelectBackend", "Select Backend", "Choose how Compile UNet accelerates the model.",
    inputs=(
        Input("backend", "COMBO", backend_tooltip(), widget={"options": list(BACKENDS), "default": "auto"}),
        Input("precision", "COMBO",
              "auto keeps the dtype ComfyUI chose (same math as eager). fp16/bf16 run under autocast: faster on "
              "hardware with those units; Warmup Shapes reports the error.",
              widget={"options": list(PRECISIONS), "default": "auto"}),
        Input("dynamic_shapes", "BOOLEAN",
              "On: new batch sizes / resolutions inside the warmed range reuse compiled code (no recompiles). "
              "Off: each new shape compiles again.", widget={"default": True}),
        Input("cuda_graphs", "BOOLEAN",
              "CUDA only (triton, inductor): replay each region as a CUDA graph from its 2nd call at a shape; fewer "
              "launches, the SD1.5 win. Costs GPU memory per shape (within 1/8 of the card, freed when a prompt "
              "ends). Off with backend auto: graphs only where a replay measures faster. Under ComfyUI's default "
              "allocator (cudaMallocAsync) the captures hold torch's ops, the kernels run outside them; inductor "
              "needs --disable-cuda-malloc.", optional=True, widget={"default": False}),
    ),
    outputs=(("UNET_BACKEND", "backend"),),
)

COMPILE_UNET = Node(
    "UNetCompiler_CompileUNet", "Compile UNet",
    "Accelerate the diffusion model's leaf regions (a UNet's blocks; a Flux, SD3, Z-Image, Qwen-Image or Wan "
    "DiT's blocks); ComfyUI's patches, ControlNet and LoRA keep working.",
    inputs=(
        Input("model", "MODEL", "The MODEL to accelerate (an SD1.5 / SDXL-family UNet, or a Flux-family, "
              "SD3.x, Lumina 2 / Z-Image, Qwen-Image or Wan 2.x diffusion transformer). It is cloned, never modified."),
        Input("backend", "UNET_BACKEND", "From Select Backend. Absent = auto, fp as loaded, dynamic shapes on.",
              optional=True),
    ),
    outputs=(("MODEL", None),),
    reports=True,
)

WARMUP_SHAPES = Node(
    "UNetCompiler_WarmupShapes", "Warmup Shapes",
    "Compile ahead of sampling for the listed shapes so KSampler never waits or recompiles.",
    inputs=(
        Input("model", "MODEL", "The MODEL from Compile UNet."),
        Input("shapes", "STRING",
              "Entries BxWxH in pixels (batch x width x height), one per line or comma separated; a video model "
              "(Wan) takes BxWxHxF, F its frames (length), e.g. 1x832x480x81. Batch, resolution and frames "
              "anywhere inside the listed range then run without recompiling. Remember CFG doubles the "
              "model batch.", widget={"multiline": True, "default": "1x512x512\n2x512x512"}),
        Input("context_tokens", "INT", "Prompt length in tokens used for warmup (77 per CLIP chunk; Flux.1's T5 "
              "prompts are at least 256 tokens: warm 256).", optional=True,
              widget={"default": 77, "min": 1, "max": MAX_CONTEXT_TOKENS}),
        Input("background", "BOOLEAN",
              "On (default; the inductor backend, ComfyUI's on a CPU): return at once and compile in a background "
              "thread; until each region is ready it runs the model's own code (on a CPU with its convs "
              "prepacked, nearly as fast as compiled there), so the first image comes sooner and a session of "
              "images never waits on a compile. On a CPU the thread compiles while no prompt runs (beside "
              "sampling it would slow every image on the same cores); on a GPU it compiles beside sampling. The "
              "triton and ipex backends (a GPU's and an Intel CPU's default) compile in seconds at first use: "
              "they warm up in the foreground and the report says so. Off: compile now, sampling starts compiled.",
              optional=True, widget={"default": True}),
    ),
    outputs=(("MODEL", None), ("STRING", "report")),
    reports=True,
)

NODES = (SELECT_BACKEND, COMPILE_UNET, WARMUP_SHAPES)
