"""V3 nodes (ComfyUI >= 0.3.48): the schemas built from nodes/spec.py, and execute."""
from __future__ import annotations

import logging

from comfy_api.latest import ComfyExtension, io, ui

from ..compiler.api import CompileConfig, ShapeError, on_off, validate_shapes_input
from . import feedback, patcher, spec

log = logging.getLogger(__name__)

UnetBackend = io.Custom("UNET_BACKEND")
_TYPES = {"COMBO": io.Combo, "BOOLEAN": io.Boolean, "STRING": io.String, "INT": io.Int, "MODEL": io.Model,
          "UNET_BACKEND": UnetBackend}


def schema(node: spec.Node) -> io.Schema:
    return io.Schema(
        node_id=node.node_id,
        display_name=node.display_name,
        category=spec.CATEGORY,
        description=node.description,
        inputs=[_TYPES[i.type].Input(i.name, optional=i.optional, tooltip=i.tooltip, **i.widget) for i in node.inputs],
        outputs=[_TYPES[t].Output(display_name=name) for t, name in node.outputs],
        hidden=[io.Hidden.unique_id] if node.reports else [],
    )


class SelectBackend(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(spec.SELECT_BACKEND)

    @classmethod
    def execute(cls, backend, precision, dynamic_shapes, cuda_graphs=False) -> io.NodeOutput:
        try:
            config = CompileConfig(backend=backend, precision=precision, dynamic_shapes=bool(dynamic_shapes),
                                   cuda_graphs=bool(cuda_graphs))
        except (TypeError, ValueError) as e:
            # a value linked from another node (a string primitive) is not checked against the list
            raise ValueError(f"Select Backend: {e}. Fix: set that input to one of its listed values") from e
        return io.NodeOutput(config)


class CompileUNet(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(spec.COMPILE_UNET)

    @classmethod
    def validate_inputs(cls, backend=None):
        # ``backend`` alone (one error, against it): a value typed into the prompt instead of a link
        return patcher.backend_input_problem(backend) or True

    @classmethod
    def execute(cls, model, backend=None) -> io.NodeOutput:
        patcher.require_model(model, "Compile UNet")
        problem = patcher.backend_input_problem(backend)
        if problem:
            raise ValueError(problem)
        try:
            m, text = patcher.compile_model(model, backend, node_id=cls.hidden.unique_id)
        except TypeError as e:
            raise RuntimeError(f"Compile UNet: {e}") from e
        return io.NodeOutput(m, ui=ui.PreviewText(text))


class WarmupShapes(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return schema(spec.WARMUP_SHAPES)

    @classmethod
    def validate_inputs(cls, shapes=None):
        # ``shapes`` alone: ComfyUI files a failed check once per input this takes (with **kwargs a bad
        # entry was reported against ``model`` too). None: linked (parsed in execute) or missing
        # (ComfyUI reports it; without the default the call itself raised TypeError)
        return validate_shapes_input(shapes)

    @classmethod
    def execute(cls, model, shapes, context_tokens=77, background=True) -> io.NodeOutput:
        patcher.require_model(model, "Warmup Shapes")
        try:
            text = patcher.warmup_model(model, shapes, context_tokens, node_id=cls.hidden.unique_id,
                                        background=background)
        except ShapeError as e:
            raise ValueError(f"Warmup Shapes: {e}") from e
        return io.NodeOutput(model, text, ui=ui.PreviewText(text))


class UNetCompilerExtension(ComfyExtension):
    async def get_node_list(self):
        # (ComfyUI 0.8.0 calls this as it loads the pack, with its PromptServer made; not on_load)
        server = feedback.server()
        if server is not None and text_booleans not in getattr(server, "on_prompt_handlers", ()):
            server.add_on_prompt_handler(text_booleans)
        return [SelectBackend, CompileUNet, WarmupShapes]


#: {node id: its BOOLEAN inputs}
_BOOLEANS = {n.node_id: frozenset(i.name for i in n.inputs if i.type == "BOOLEAN") for n in spec.NODES}


def text_booleans(json_data: dict) -> dict:
    """ComfyUI's ``/prompt`` handler hook, before validation: a BOOLEAN input of the pack's nodes sent
    as text ("false", "off", "0" in a hand-written API prompt) is read as the word says. ComfyUI's
    own conversion is ``bool(value)``, which turns any text, "false" too, on. Other text is left to
    it, with a log line naming the node, the input and the fix."""
    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    for node_id, node in (prompt.items() if isinstance(prompt, dict) else ()):
        names = _BOOLEANS.get(node.get("class_type")) if isinstance(node, dict) else None
        inputs = node.get("inputs") if names else None
        for name in names if isinstance(inputs, dict) else ():
            value = inputs.get(name)
            if not isinstance(value, str):
                continue
            word = on_off(value)
            if word is not None:
                inputs[name] = word
            else:
                log.warning("UNet Compiler: node %s (%s) input %s is the text %r, which ComfyUI reads as true. "
                            "Fix: send true or false", node_id, node.get("class_type"), name, value[:40])
    return json_data


async def comfy_entrypoint() -> UNetCompilerExtension:
    return UNetCompilerExtension()
