"""example_workflows/: what ComfyUI's template browser lists and what the
README's headless example posts. Static checks, no ComfyUI needed (the e2e
tests post them to a real server and load them in the real frontend).

ComfyUI (app/custom_node_manager.py) lists ``<pack>/example_workflows/*.json``
as templates and serves the folder, so only UI-format workflows may sit at
its top level; each gets a ``<name>.jpg`` thumbnail (the frontend asks for
it), and the API-format twins live in ``example_workflows/api/``.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from unet_compiler.nodes.spec import NODES

EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows"
UI_FILES = sorted(EXAMPLES.glob("*.json"))
API_FILES = sorted((EXAMPLES / "api").glob("*.json"))
# the core nodes the examples use, and frontend-only (virtual) nodes
CORE = {"CheckpointLoaderSimple", "CLIPTextEncode", "EmptyLatentImage", "KSampler", "VAEDecode", "SaveImage"}
FRONTEND_ONLY = {"MarkdownNote", "Note"}
PACK = {n.node_id for n in NODES}
CHAIN = ["CheckpointLoaderSimple", "UNetCompiler_SelectBackend", "UNetCompiler_CompileUNet",
         "UNetCompiler_WarmupShapes", "KSampler", "VAEDecode", "SaveImage"]


def test_examples_exist():
    assert {p.stem for p in UI_FILES} == {"sd15_compile_unet", "sdxl_compile_unet"}
    assert {p.stem for p in API_FILES} == {"sd15_compile_unet_api", "sdxl_compile_unet_api"}


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_ui_workflow(path):
    wf = json.loads(path.read_text(encoding="utf-8"))
    assert "nodes" in wf and "links" in wf and wf.get("version") == 0.4, f"{path.name} is not a UI-format workflow"
    assert (EXAMPLES / "api" / f"{path.stem}_api.json").is_file(), "every UI example has its API twin"
    assert (EXAMPLES / f"{path.stem}.jpg").is_file(), "the template browser shows <name>.jpg as the thumbnail"
    nodes = {n["id"]: n for n in wf["nodes"]}
    unknown = {n["type"] for n in nodes.values()} - CORE - FRONTEND_ONLY - PACK
    assert not unknown, f"{path.name}: unknown node types {unknown}"
    assert set(CHAIN) <= {n["type"] for n in nodes.values()}
    # links: [id, from node, from slot, to node, to slot, type], mirrored in the nodes' slots
    for link_id, src, src_slot, dst, dst_slot, typ in wf["links"]:
        assert link_id in nodes[src]["outputs"][src_slot]["links"], (path.name, link_id)
        assert nodes[dst]["inputs"][dst_slot]["link"] == link_id, (path.name, link_id)
        assert nodes[src]["outputs"][src_slot]["type"] == typ, (path.name, link_id)
    # no nulls where the frontend's schema wants a value (its loader alerts on them);
    # an unconnected slot is the one place it writes null itself
    text = path.read_text(encoding="utf-8")
    unlinked = text.count('"link": null') + text.count('"links": null')
    assert text.count("null") == unlinked, f"{path.name}: null outside an unlinked slot"


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.name)
def test_api_workflow(path):
    prompt = json.loads(path.read_text(encoding="utf-8"))
    assert all("class_type" in n and "inputs" in n for n in prompt.values()), f"{path.name} is not API format"
    types = {k: n["class_type"] for k, n in prompt.items()}
    assert set(types.values()) <= CORE | PACK, set(types.values()) - CORE - PACK
    for node_id, node in prompt.items():
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                src, slot = value
                assert src in prompt and isinstance(slot, int), (path.name, node_id, name, value)
        spec = next((n for n in NODES if n.node_id == node["class_type"]), None)
        if spec is not None:  # the pack's own nodes: exactly their declared inputs
            declared = set(spec.required) | set(spec.optional)
            assert set(node["inputs"]) <= declared and set(spec.required) <= set(node["inputs"]), (
                path.name, node["class_type"], sorted(node["inputs"]), sorted(declared))
    # the chain the README describes, each fed by the one before
    by_type = {t: k for k, t in types.items()}
    assert prompt[by_type["UNetCompiler_CompileUNet"]]["inputs"]["model"][0] == by_type["CheckpointLoaderSimple"]
    assert prompt[by_type["UNetCompiler_CompileUNet"]]["inputs"]["backend"][0] == by_type["UNetCompiler_SelectBackend"]
    assert prompt[by_type["UNetCompiler_WarmupShapes"]]["inputs"]["model"][0] == by_type["UNetCompiler_CompileUNet"]
    assert prompt[by_type["KSampler"]]["inputs"]["model"][0] == by_type["UNetCompiler_WarmupShapes"]
    # warmup covers what KSampler runs: CFG > 1 puts cond + uncond in one batch of 2
    latent = prompt[by_type["EmptyLatentImage"]]["inputs"]
    batch = latent["batch_size"] * (2 if prompt[by_type["KSampler"]]["inputs"]["cfg"] != 1.0 else 1)
    shapes = prompt[by_type["UNetCompiler_WarmupShapes"]]["inputs"]["shapes"]
    assert f"{batch}x{latent['width']}x{latent['height']}" in shapes, shapes
