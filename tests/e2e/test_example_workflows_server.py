"""The shipped example workflows against a real ComfyUI: the API-format
files validate against the server's node definitions and run (shrunk: the
random checkpoint, 64 px, 1 step, eager backend so nothing compiles), and the
UI-format files reference only node types the server knows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows"
API_FILES = sorted((EXAMPLES / "api").glob("*_api.json"))
UI_FILES = sorted(EXAMPLES.glob("*.json"))
FRONTEND_ONLY = {"MarkdownNote", "Note", "Reroute", "PrimitiveNode"}  # virtual: never sent to the server


def _inputs(info: dict) -> dict:
    spec = info["input"]
    return {**spec.get("required", {}), **spec.get("optional", {})}


def _check_against_object_info(prompt: dict, object_info: dict) -> list[str]:
    """Every class_type known, every required input given, every widget value
    allowed, every link from an output of the type the input wants."""
    problems = []
    for node_id, node in prompt.items():
        info = object_info.get(node["class_type"])
        if info is None:
            problems.append(f"{node_id}: unknown class_type {node['class_type']}")
            continue
        declared = _inputs(info)
        for name in info["input"].get("required", {}):
            if name not in node["inputs"]:
                problems.append(f"{node_id} {node['class_type']}: missing required input {name}")
        for name, value in node["inputs"].items():
            if name not in declared:
                problems.append(f"{node_id} {node['class_type']}: unknown input {name}")
                continue
            kind, opts = declared[name][0], (declared[name][1] if len(declared[name]) > 1 else {})
            if isinstance(value, list):
                src = prompt.get(value[0])
                if src is None:
                    problems.append(f"{node_id}.{name}: link from missing node {value[0]}")
                    continue
                out_types = object_info[src["class_type"]]["output"]
                if value[1] >= len(out_types) or out_types[value[1]] != kind:
                    problems.append(f"{node_id}.{name}: wants {kind}, linked to {src['class_type']} output {value[1]}")
            elif isinstance(kind, list) or kind == "COMBO":
                options = kind if isinstance(kind, list) else opts.get("options", [])
                if value not in options and name != "ckpt_name":  # the model file is the user's
                    problems.append(f"{node_id}.{name}: {value!r} not in {options}")
            elif kind in ("INT", "FLOAT"):
                if not (opts.get("min", float("-inf")) <= value <= opts.get("max", float("inf"))):
                    problems.append(f"{node_id}.{name}: {value} outside [{opts.get('min')}, {opts.get('max')}]")
    return problems


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.name)
def test_api_example_validates_and_runs(comfy_server, sd15_checkpoint, path):
    prompt = json.loads(path.read_text(encoding="utf-8"))
    problems = _check_against_object_info(prompt, comfy_server.object_info())
    assert not problems, f"{path.name} does not fit this ComfyUI's nodes:\n" + "\n".join(problems)

    # what the README's headless example does, shrunk to run here in seconds
    by_type = {n["class_type"]: k for k, n in prompt.items()}
    prompt[by_type["CheckpointLoaderSimple"]]["inputs"]["ckpt_name"] = sd15_checkpoint.name
    prompt[by_type["UNetCompiler_SelectBackend"]]["inputs"]["backend"] = "eager"
    prompt[by_type["EmptyLatentImage"]]["inputs"].update(width=64, height=64)
    prompt[by_type["UNetCompiler_WarmupShapes"]]["inputs"]["shapes"] = "2x64x64"
    prompt[by_type["KSampler"]]["inputs"]["steps"] = 1
    prompt[by_type["SaveImage"]]["inputs"]["filename_prefix"] = "example_" + path.stem
    entry = comfy_server.run_prompt(prompt, timeout=600)

    outputs = entry.get("outputs") or {}
    assert outputs.get(by_type["SaveImage"], {}).get("images"), f"no image saved: {outputs}"
    compile_text = "\n".join(outputs.get(by_type["UNetCompiler_CompileUNet"], {}).get("text") or [])
    warmup_text = "\n".join(outputs.get(by_type["UNetCompiler_WarmupShapes"], {}).get("text") or [])
    # what headless users read in /history: backend, state, and how to change it. Shrunk,
    # the examples share their pack nodes' inputs, so after the first these come from the cache
    cached = {n for name, data in (entry.get("status") or {}).get("messages") or []
              if name == "execution_cached" for n in data.get("nodes", [])}
    if by_type["UNetCompiler_CompileUNet"] not in cached:
        assert "status: eager: chosen in Select Backend" in compile_text and "To accelerate:" in compile_text, (
            compile_text)
    if by_type["UNetCompiler_WarmupShapes"] not in cached:
        assert "warmed 2x64x64" in warmup_text and "status: eager: 1 shape(s) in " in warmup_text, warmup_text


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_ui_example_node_types_are_known(comfy_server, path):
    wf = json.loads(path.read_text(encoding="utf-8"))
    info = comfy_server.object_info()
    unknown = sorted({n["type"] for n in wf["nodes"]} - set(info) - FRONTEND_ONLY)
    assert not unknown, f"{path.name} uses node types this ComfyUI does not have: {unknown}"


def test_template_browser_lists_the_examples(comfy_server):
    """ComfyUI's /workflow_templates lists the UI examples (not the API twins)."""
    listed = comfy_server.get_json("/workflow_templates")
    mine = listed.get(comfy_server.pack_dir.name)
    assert mine is not None, f"the pack's examples are not listed: {listed}"
    assert sorted(mine) == sorted(p.stem for p in UI_FILES), mine
    thumb = comfy_server.get(f"/api/workflow_templates/{comfy_server.pack_dir.name}/{UI_FILES[0].stem}.jpg")
    assert thumb[:3] == b"\xff\xd8\xff", "thumbnail is not served as a JPEG"


def test_bad_shapes_entry_is_reported_once_against_shapes(comfy_server, sd15_checkpoint):
    """ComfyUI runs Warmup Shapes' validate_inputs before anything runs: a bad entry is one error,
    filed against ``shapes`` (not also against ``model``), naming the entry."""
    import urllib.error
    import urllib.request
    prompt = json.loads(API_FILES[0].read_text(encoding="utf-8"))
    by_type = {n["class_type"]: k for k, n in prompt.items()}
    prompt[by_type["CheckpointLoaderSimple"]]["inputs"]["ckpt_name"] = sd15_checkpoint.name
    warm = by_type["UNetCompiler_WarmupShapes"]
    prompt[warm]["inputs"]["shapes"] = "2x64x64, 512x"
    req = urllib.request.Request(comfy_server.url + "/prompt", data=json.dumps({"prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(e.value.read())
    errors = body["node_errors"][warm]["errors"]
    assert [(x["type"], x["extra_info"]["input_name"]) for x in errors] == [("custom_validation_failed", "shapes")], (
        errors)
    assert "'512x'" in errors[0]["details"] and "not BxWxH" in errors[0]["details"], errors
