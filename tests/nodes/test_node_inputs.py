"""The nodes' checks of values typed into an API prompt where a link belongs (nodes/patcher.py).
ComfyUI type-checks links, not such values: ``"model": "v1-5.safetensors"`` or ``"backend": "triton"``
reached Compile UNet and died on an AttributeError. Through a real server:
tests/e2e/test_api_bad_input.py."""
import pytest

from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher

TYPED = [("v1-5.safetensors", "the text 'v1-5.safetensors'"), (5, "int 5"), (None, "null"),
         ({"a": 1}, "dict {'a': 1}"), ("x" * 500, "the text 'xxxx")]


@pytest.mark.parametrize("value,shown", TYPED, ids=["text", "number", "null", "object", "long_text"])
def test_a_typed_in_model_is_refused_naming_the_input_and_the_fix(value, shown):
    with pytest.raises(ValueError) as e:
        patcher.require_model(value, "Compile UNet")
    msg = str(e.value)
    assert msg.startswith("Compile UNet: model: got " + shown), msg
    assert "not a MODEL. Fix: link a MODEL output" in msg and "CheckpointLoaderSimple" in msg
    assert len(msg) < 400, "the message echoes the input"


@pytest.mark.parametrize("value,shown", [("triton", "the text 'triton'"), (3, "int 3"), (["10", 0, 1], "list")],
                         ids=["name", "number", "list"])
def test_a_typed_in_backend_is_refused_naming_the_input_and_the_fix(value, shown):
    msg = patcher.backend_input_problem(value)
    assert msg.startswith("Compile UNet: backend: got " + shown), msg
    assert "Fix: link" in msg and "UNetCompiler_SelectBackend" in msg and "leave backend out for auto" in msg


def test_absent_linked_or_selected_backend_passes():
    # None: absent, or linked (ComfyUI validates a link's value as None)
    assert patcher.backend_input_problem(None) is None
    assert patcher.backend_input_problem(CompileConfig(backend="eager")) is None


@pytest.mark.comfy
@pytest.mark.parametrize("field,value", [("backend", "tensorrt"), ("precision", "fp8")])
def test_select_backend_names_itself_and_the_fix_for_a_linked_value_off_its_list(comfy, field, value):
    """A value linked into Select Backend from another node (a string primitive) reaches the node
    unchecked against its list: the error names the node, the input and the fix. (Before:
    CompileConfig's bare ``backend='tensorrt' is not one of ...``.)"""
    from unet_compiler.nodes.v3 import SelectBackend
    inputs = dict(backend="auto", precision="auto", dynamic_shapes=True, cuda_graphs=False)
    inputs[field] = value
    with pytest.raises(ValueError) as e:
        SelectBackend.execute(**inputs)
    msg = str(e.value)
    assert msg.startswith(f"Select Backend: {field}='{value}' is not one of") and "Fix: set that input" in msg, msg


@pytest.mark.comfy
def test_text_booleans_in_an_api_prompt_read_as_the_word_says(comfy, monkeypatch, caplog):
    """ComfyUI converts a BOOLEAN input with ``bool(value)``: ``"cuda_graphs": "off"`` in a hand-written
    API prompt turned CUDA graphs on, ``"background": "false"`` a background compile. The pack's
    /prompt handler (registered on ComfyUI's PromptServer as the pack loads, once) reads the
    pack's BOOLEAN inputs sent as text as the word says, before ComfyUI converts them; other text is
    left to ComfyUI with a log line naming the node, the input and the fix."""
    import asyncio

    from unet_compiler.nodes import feedback, v3
    from unet_compiler.tests._families import comfy_path
    source = (comfy_path() / "server.py").read_text(encoding="utf-8")   # (importing it starts a web app)
    assert "def add_on_prompt_handler(self, handler):" in source and "json_data = self.trigger_on_prompt(json_data)" in source

    class Server:     # ComfyUI's PromptServer as its /prompt route uses the handlers (server.py)
        def __init__(self):
            self.on_prompt_handlers = []

        def add_on_prompt_handler(self, handler):
            self.on_prompt_handlers.append(handler)

        def trigger_on_prompt(self, json_data):
            for handler in self.on_prompt_handlers:
                json_data = handler(json_data)
            return json_data
    server = Server()
    monkeypatch.setattr(feedback, "server", lambda: server)
    for _ in range(2):
        asyncio.run(v3.UNetCompilerExtension().get_node_list())
    assert server.on_prompt_handlers == [v3.text_booleans]
    prompt = {"1": {"class_type": "UNetCompiler_SelectBackend",
                    "inputs": {"backend": "auto", "precision": "auto", "dynamic_shapes": "False", "cuda_graphs": "off"}},
              "2": {"class_type": "UNetCompiler_WarmupShapes",
                    "inputs": {"model": ["3", 0], "shapes": "2x64x64", "background": " 0 "}},
              "4": {"class_type": "KSampler", "inputs": {"add_noise": "false"}},     # not the pack's: left
              "5": {"class_type": "UNetCompiler_SelectBackend", "inputs": {"dynamic_shapes": "Yes",
                                                                          "cuda_graphs": "maybe"}}}
    out = server.trigger_on_prompt({"prompt": prompt, "client_id": "c"})["prompt"]
    assert [bool(v) for v in (out["1"]["inputs"]["dynamic_shapes"], out["1"]["inputs"]["cuda_graphs"],
                              out["2"]["inputs"]["background"])] == [False, False, False]
    assert out["4"]["inputs"]["add_noise"] == "false" and out["5"]["inputs"]["dynamic_shapes"] is True
    assert out["5"]["inputs"]["cuda_graphs"] == "maybe"
    assert "node 5 (UNetCompiler_SelectBackend) input cuda_graphs is the text 'maybe'" in caplog.text
    assert "Fix: send true or false" in caplog.text
