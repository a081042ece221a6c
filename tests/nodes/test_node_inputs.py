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
