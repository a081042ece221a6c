"""End-to-end: bad input sent straight to ComfyUI's /prompt (issue 11 item 1), bypassing the UI's widgets.

Each case ends one of three ways, the earliest that can know:

- ``reject``: /prompt answers 400 and ``node_errors`` names the node, the input and what is wrong
  (ComfyUI's own checks: combo values, INT conversion and range, missing inputs, link shape; the
  pack's ``validate_inputs``: shapes, a backend typed in where Select Backend's link belongs);
- ``fail``: the prompt runs and fails in the pack's node with a message naming the input and the fix
  (values ComfyUI does not check: a link's value, a value typed where a link belongs), before any
  tensor is allocated;
- ``eager``: the prompt runs and the model runs as loaded (an SD UNet of unusual shape on the eager
  backend), with the same latent as without the pack; the tiny SD3 the cases load runs compiled
  (Compile UNet at its defaults), with the latent of plain ComfyUI.

After them the server is alive and a plain eager txt2img gives the latent it gave before them.
Executing cases use tiny models (a depth-1 SD3 MMDiT and a one-level SD1.5 UNet, built once with
ComfyUI's own classes and cached beside the random checkpoint), 64 px and 1 step.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from unet_compiler.bench import comfy_server as S
from unet_compiler.bench.comfy_server import PromptFailed
from unet_compiler.compiler.shapes import MAX_ENTRIES, MAX_TEXT

pytestmark = pytest.mark.e2e

_spec = importlib.util.spec_from_file_location("_e2e_server_helpers", Path(__file__).with_name("test_comfyui_server.py"))
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
txt2img_prompt, the_latent, relative_l2 = _helpers.txt2img_prompt, _helpers.the_latent, _helpers.relative_l2
MAX_EAGER_RERUN_REL_L2 = _helpers.MAX_EAGER_RERUN_REL_L2   # 1e-6
#: compiled vs plain ComfyUI's latent (fp16 weights, fp32 compute on CPU; one sampler step)
MAX_COMPILED_REL_L2 = 1e-4

SD3_NAME = "unet_compiler_tiny_sd3_mmdit.safetensors"
ONE_LEVEL_NAME = "unet_compiler_tiny_sd15_one_level.safetensors"

# Runs in a subprocess with cwd = the ComfyUI tree: argv[1] = the folder, argv[2:4] = the file names.
# Each file is loaded back with comfy.sd.load_diffusion_model (what UNETLoader runs) and must detect
# as the intended class.
_BUILD_SCRIPT = r'''
import os, sys, time
sys.path.insert(0, os.getcwd())
out_dir, sd3_name, one_level_name = sys.argv[1:4]
t0 = time.time()
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_base, comfy.ops, comfy.sd, comfy.utils
import comfy.supported_models as sm
from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
g = torch.Generator().manual_seed(7)
''' + S.SD15_HELPERS + r'''
def save(sd, name, cls):
    path = os.path.join(out_dir, name)
    tmp = path + ".%d.partial.safetensors" % os.getpid()
    comfy.utils.save_torch_file({k: v.detach().contiguous() for k, v in sd.items()}, tmp)
    loaded = comfy.sd.load_diffusion_model(tmp)
    if type(loaded.model) is not cls:
        raise RuntimeError("%s loads as %r, not %s" % (name, type(loaded.model), cls.__name__))
    os.replace(tmp, path)
    return loaded

# SD3's MMDiT at depth 1 (hidden 64, one head) with SD1.5 CLIP's widths (768-wide tokens and pooled
# vector), so the random SD1.5 checkpoint's CLIP conditions it
cfg = sm.SD3({"in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 1, "num_patches": 256,
              "pos_embed_max_size": 16, "adm_in_channels": 768, "pos_embed_scaling_factor": None,
              "context_embedder_config": {"target": "torch.nn.Linear",
                                          "params": {"in_features": 768, "out_features": 64}}})
mmdit = cfg.get_model({}).diffusion_model
with torch.no_grad():
    mmdit.pos_embed.copy_(0.1 * torch.randn(mmdit.pos_embed.shape, generator=g))   # a buffer, left empty
random_init(mmdit, 0.02, g)
save(mmdit.state_dict(), sd3_name, comfy.model_base.SD3)

# a UNet ComfyUI detects as SD1.5 (320 model channels, 768 context) with one level: no 640 / 1280
# channel levels, no downsampling, one ResBlock + attention per block
one = dict(SD15_UNET_CONFIG, channel_mult=[1], num_res_blocks=[1], transformer_depth=[1],
           transformer_depth_output=[1, 1], transformer_depth_middle=1)
unet = UNetModel(**one, dtype=torch.float16, device="cpu", operations=comfy.ops.disable_weight_init)
random_init(unet, 0.02, g)
m = save(unet.state_dict(), one_level_name, comfy.model_base.BaseModel)
got = m.model.diffusion_model
if type(m.model.model_config) is not sm.SD15 or (len(got.input_blocks), len(got.output_blocks)) != (2, 2):
    raise RuntimeError("the one-level UNet loads as %r with %d/%d blocks"
                       % (m.model.model_config, len(got.input_blocks), len(got.output_blocks)))
print("built %s and %s in %.1f s" % (sd3_name, one_level_name, time.time() - t0))
'''


@pytest.fixture(scope="module")
def tiny_models(comfyui_path, sd15_checkpoint, comfy_server):
    """The two tiny diffusion models in the server's diffusion_models folder (built beside the
    checkpoint, kept where it is kept); the links are removed afterwards."""
    folder = sd15_checkpoint.parent
    names = (SD3_NAME, ONE_LEVEL_NAME)
    if not all((folder / n).is_file() for n in names):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, str(folder), *names], cwd=str(comfyui_path),
                              env=S.subprocess_env(), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"building the tiny models failed (rc={proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-6000:]}")
        print(f"\n[e2e] {proc.stdout.strip().splitlines()[-1]} (wall {time.time() - t0:.1f} s)")
    links = [comfy_server.model_dirs["diffusion_models"] / n for n in names]
    for link, n in zip(links, names, strict=True):
        if not link.exists():
            S.link(link, folder / n)
    yield {"sd3": SD3_NAME, "one_level": ONE_LEVEL_NAME}
    for link in links:
        link.unlink(missing_ok=True)
    if not os.environ.get("UNET_COMPILER_TEST_CACHE"):
        for n in names:
            (folder / n).unlink(missing_ok=True)


# ---- prompts ---------------------------------------------------------------------------------
def eager_txt2img(ckpt: str, prefix: str) -> dict:
    """The plain txt2img graph (no pack node) at 64 px, 1 step."""
    p = txt2img_prompt(ckpt, prefix)
    p["5"]["inputs"]["steps"] = 1
    return p


def pack_prompt(ckpt: str) -> dict:
    """CheckpointLoaderSimple -> Select Backend (eager) -> Compile UNet -> Warmup Shapes -> its report
    shown by PreviewAny: the graph the validation cases break (none of them runs)."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "10": {"class_type": "UNetCompiler_SelectBackend",
               "inputs": {"backend": "eager", "precision": "auto", "dynamic_shapes": True, "cuda_graphs": False}},
        "11": {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": ["1", 0], "backend": ["10", 0]}},
        "12": {"class_type": "UNetCompiler_WarmupShapes",
               "inputs": {"model": ["11", 0], "shapes": "2x64x64", "context_tokens": 77, "background": False}},
        "13": {"class_type": "PreviewAny", "inputs": {"source": ["12", 1]}},
    }


def tiny_prompt(ckpt: str, unet: str, prefix: str, pack: bool, backend: str | None = "eager",
                shapes="2x64x64", context_tokens=77) -> dict:
    """UNETLoader(unet) [-> Select Backend -> Compile UNet -> Warmup Shapes] -> KSampler (64 px,
    1 step; the SD1.5 checkpoint's CLIP conditions it) -> SaveLatent."""
    p = eager_txt2img(ckpt, prefix)
    del p["6"], p["7"]                 # the latent is the result (SD3's has 16 channels: no SD1.5 VAE)
    p["20"] = {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}}
    model = ["20", 0]
    if pack:
        p["11"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": model}}
        if backend is not None:
            p["10"] = {"class_type": "UNetCompiler_SelectBackend",
                       "inputs": {"backend": backend, "precision": "auto", "dynamic_shapes": True}}
            p["11"]["inputs"]["backend"] = ["10", 0]
        p["12"] = {"class_type": "UNetCompiler_WarmupShapes",
                   "inputs": {"model": ["11", 0], "shapes": shapes, "context_tokens": context_tokens,
                              "background": False}}
        model = ["12", 0]
    p["5"]["inputs"]["model"] = model
    return p


def post_prompt(server, prompt: dict) -> tuple[int, dict, int]:
    """POST /prompt: (HTTP status, JSON body, body size in bytes)."""
    req = urllib.request.Request(server.url + "/prompt", data=json.dumps({"prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw), len(raw)
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw), len(raw)


# ---- the cases -------------------------------------------------------------------------------
def _set(node, name, value):
    return lambda p: p[node]["inputs"].__setitem__(name, value)


def _drop(node, name):
    return lambda p: p[node]["inputs"].pop(name)


SELECT, COMPILE, WARMUP = "10", "11", "12"

#: id -> (change to pack_prompt, node, input, ComfyUI error type, text the error's details must hold).
#: Every one is answered 400 before anything runs.
REJECTED = {
    # shapes: malformed entries
    "shapes-not-BxWxH": (_set(WARMUP, "shapes", "2x64x64, 512x"), WARMUP, "shapes", "custom_validation_failed",
                         "entry '512x' is not BxWxH"),
    "shapes-empty": (_set(WARMUP, "shapes", " \n, "), WARMUP, "shapes", "custom_validation_failed",
                     "shapes is empty: give at least one entry like 1x512x512"),
    "shapes-side-not-multiple-of-8": (_set(WARMUP, "shapes", "1x100x64"), WARMUP, "shapes",
                                      "custom_validation_failed", "width 100 is not divisible by 8"),
    "shapes-negative": (_set(WARMUP, "shapes", "-1x64x64"), WARMUP, "shapes", "custom_validation_failed",
                        "entry '-1x64x64' is not BxWxH"),
    # sizes: refused by the parser, before any tensor exists
    "size-batch-1e6": (_set(WARMUP, "shapes", "1000000x64x64"), WARMUP, "shapes", "custom_validation_failed",
                       "batch 1000000 must be between 1 and 64"),
    "size-0px": (_set(WARMUP, "shapes", "1x0x0"), WARMUP, "shapes", "custom_validation_failed",
                 "width 0 must be between 64 and 8192 px"),
    "size-1e5px": (_set(WARMUP, "shapes", "1x100000x100000"), WARMUP, "shapes", "custom_validation_failed",
                   "width 100000 must be between 64 and 8192 px"),
    "size-5000-digit-batch": (_set(WARMUP, "shapes", "1" * 5000 + "x64x64"), WARMUP, "shapes",
                              "custom_validation_failed", f"5006 characters long, at most {MAX_TEXT}"),
    "size-4000-digit-batch": (_set(WARMUP, "shapes", "1" * 4000 + "x64x64"), WARMUP, "shapes",
                              "custom_validation_failed", "batch '111111111111…' must be between 1 and 64"),
    "size-too-many-entries": (_set(WARMUP, "shapes", "1x64x64," * (MAX_ENTRIES + 1)), WARMUP, "shapes",
                              "custom_validation_failed", f"{MAX_ENTRIES + 1} entries, at most {MAX_ENTRIES}"),
    "size-1MB-string": (_set(WARMUP, "shapes", "9x" * 500_000), WARMUP, "shapes", "custom_validation_failed",
                        f"1000000 characters long, at most {MAX_TEXT}"),
    "size-context-tokens-1e9": (_set(WARMUP, "context_tokens", 10 ** 9), WARMUP, "context_tokens",
                                "value_bigger_than_max", "context_tokens"),
    "size-context-tokens-0": (_set(WARMUP, "context_tokens", 0), WARMUP, "context_tokens",
                              "value_smaller_than_min", "context_tokens"),
    # types: what ComfyUI converts (STRING: str(), INT: int()) or refuses
    "type-shapes-null": (_set(WARMUP, "shapes", None), WARMUP, "shapes", "custom_validation_failed",
                         "entry 'None' is not BxWxH"),
    "type-shapes-number": (_set(WARMUP, "shapes", 512), WARMUP, "shapes", "custom_validation_failed",
                           "entry '512' is not BxWxH"),
    "type-shapes-list": (_set(WARMUP, "shapes", ["1x64x64", "2x64x64", "4x64x64"]), WARMUP, "shapes",
                         "bad_linked_input", "shapes"),
    "type-shapes-wrapped-list": (_set(WARMUP, "shapes", {"__value__": ["2x64x64"]}), WARMUP, "shapes",
                                 "custom_validation_failed", "entry \"['2x64x64']\" is not BxWxH"),
    "type-context-tokens-text": (_set(WARMUP, "context_tokens", "seventy-seven"), WARMUP, "context_tokens",
                                 "invalid_input_type", "context_tokens, seventy-seven"),
    "type-context-tokens-null": (_set(WARMUP, "context_tokens", None), WARMUP, "context_tokens",
                                 "invalid_input_type", "context_tokens, None"),
    "type-backend-number": (_set(SELECT, "backend", 3), SELECT, "backend", "value_not_in_list",
                            "backend: '3' not in ['auto'"),
    "type-backend-link-to-a-model": (_set(COMPILE, "backend", ["1", 0]), COMPILE, "backend",
                                     "return_type_mismatch", "received_type(MODEL) mismatch input_type(UNET_BACKEND)"),
    "type-backend-name-typed-into-compile": (_set(COMPILE, "backend", "triton"), COMPILE, "backend",
                                             "custom_validation_failed",
                                             "Compile UNet: backend: got the text 'triton', not the output of "
                                             "Select Backend. Fix: link [\"<id of a UNetCompiler_SelectBackend"),
    # names
    "name-unknown-backend": (_set(SELECT, "backend", "tensorrt"), SELECT, "backend", "value_not_in_list",
                             "backend: 'tensorrt' not in ['auto', "),
    "name-backend-wrong-case": (_set(SELECT, "backend", "Triton"), SELECT, "backend", "value_not_in_list",
                                "backend: 'Triton' not in"),
    "name-unknown-precision": (_set(SELECT, "precision", "fp8"), SELECT, "precision", "value_not_in_list",
                               "precision: 'fp8' not in ['auto', 'fp32', 'fp16', 'bf16']"),
    # missing required inputs
    "missing-shapes": (_drop(WARMUP, "shapes"), WARMUP, "shapes", "required_input_missing", "shapes"),
    "missing-warmup-model": (_drop(WARMUP, "model"), WARMUP, "model", "required_input_missing", "model"),
    "missing-compile-model": (_drop(COMPILE, "model"), COMPILE, "model", "required_input_missing", "model"),
    "missing-backend": (_drop(SELECT, "backend"), SELECT, "backend", "required_input_missing", "backend"),
    "missing-precision": (_drop(SELECT, "precision"), SELECT, "precision", "required_input_missing", "precision"),
}


@pytest.fixture(scope="module")
def eager_before(comfy_server, sd15_checkpoint):
    """The plain eager latent, taken before the bad cases (the first test asks for it)."""
    entry = comfy_server.run_prompt(eager_txt2img(sd15_checkpoint.name, "bad_input_eager_before"), timeout=300)
    return the_latent(comfy_server, entry)


@pytest.mark.parametrize("case", list(REJECTED))
def test_rejected_before_anything_runs(comfy_server, sd15_checkpoint, eager_before, case):
    change, node, name, kind, text = REJECTED[case]
    prompt = pack_prompt(sd15_checkpoint.name)
    change(prompt)
    status, body, size = post_prompt(comfy_server, prompt)
    assert status == 400, f"{case}: HTTP {status}: {json.dumps(body)[:2000]}"
    assert "prompt_id" not in body
    errors = body["node_errors"].get(node, {}).get("errors", [])
    assert errors, f"{case}: no error on node {node}: {json.dumps(body)[:2000]}"
    # the first error is the one for this input (type-shapes-list also gets the pack's "got list")
    first = errors[0]
    assert (first["type"], first["extra_info"]["input_name"]) == (kind, name), errors
    assert text in first["details"], first["details"]
    assert {e["extra_info"].get("input_name") for e in errors} == {name}, f"errors filed on other inputs: {errors}"
    assert set(body["node_errors"]) == {node}, f"errors on other nodes: {list(body['node_errors'])}"
    assert size < 16_000, f"the 400 answer is {size} bytes: it echoes the input"


def _wait_for_error(server, prompt: dict, timeout: float = 240.0) -> str:
    """Queue ``prompt`` (it must pass validation) and return its execution error's description."""
    with pytest.raises(PromptFailed) as e:
        server.run_prompt(prompt, timeout=timeout)
    msg = str(e.value)
    assert "prompt rejected" not in msg, f"rejected at validation, not run: {msg[:3000]}"
    return msg


#: id -> (prompt from tiny_prompt's arguments, the node type that fails, the text its error must hold).
#: ComfyUI checks none of these values: they arrive at the pack's execute, which refuses them first thing.
FAILED = {
    # a link's value is not seen by validation (ComfyUI passes None): a linked shapes used to be rejected
    # as "got NoneType" even when good; now execute bounds it, before any tensor
    "shapes-linked-batch-1e6": (dict(shapes=["30", 0]), "1000000x64x64", "UNetCompiler_WarmupShapes",
                                "ValueError: Warmup Shapes: shapes: entry '1000000x64x64': batch 1000000 must be "
                                "between 1 and 64"),
    "size-context-tokens-linked-1e6": (dict(context_tokens=["31", 0]), 10 ** 6, "UNetCompiler_WarmupShapes",
                                       "Warmup Shapes: context_tokens: 1000000 must be between 1 and 1232"),
    # inside every bound, but no machine has the memory: refused with the model loaded, before the warmup
    # allocates it (the floor alone is 120-240 GiB for this 320-channel UNet)
    "size-64x8192x8192-needs-more-memory-than-free": (dict(shapes=["30", 0]), "64x8192x8192",
                                                      "UNetCompiler_WarmupShapes",
                                                      "Warmup Shapes: shapes: entry 64x8192x8192 needs at least"),
    # a value typed where a link belongs: ComfyUI type-checks links only
    "type-model-typed-as-a-file-name": (dict(model="v1-5-pruned-emaonly.safetensors"), None,
                                        "UNetCompiler_CompileUNet",
                                        "Compile UNet: model: got the text 'v1-5-pruned-emaonly.safetensors', not "
                                        "a MODEL. Fix: link a MODEL output to it"),
    # Warmup Shapes fed the loader's MODEL, not Compile UNet's
    "model-not-compiled": (dict(skip_compile=True), None, "UNetCompiler_WarmupShapes",
                           "Warmup Shapes: the model was not compiled. Fix: connect the MODEL output of Compile UNet"),
}


@pytest.mark.parametrize("case", list(FAILED))
def test_fails_in_the_node_naming_the_input_and_the_fix(comfy_server, sd15_checkpoint, tiny_models, case):
    how, value, node_type, text = FAILED[case]
    p = tiny_prompt(sd15_checkpoint.name, tiny_models["one_level"], f"bad_{case}", pack=True)
    if "shapes" in how:
        p["30"] = {"class_type": "PrimitiveStringMultiline", "inputs": {"value": value}}
        p[WARMUP]["inputs"]["shapes"] = how["shapes"]
    if "context_tokens" in how:
        p["31"] = {"class_type": "PrimitiveInt", "inputs": {"value": value}}
        p[WARMUP]["inputs"]["context_tokens"] = how["context_tokens"]
    if "model" in how:
        p[COMPILE]["inputs"]["model"] = how["model"]
    if how.get("skip_compile"):
        p[WARMUP]["inputs"]["model"] = ["20", 0]
    msg = _wait_for_error(comfy_server, p)
    assert f"({node_type})" in msg.splitlines()[0], msg[:3000]
    assert text in msg, msg[:3000]


# ---- models the pack does not accelerate -------------------------------------------------------
def _ran(server, prompt) -> tuple[dict, object]:
    entry = server.run_prompt(prompt, timeout=240)
    return entry, the_latent(server, entry)


def _text(entry, node) -> str:
    return "\n".join(map(str, (entry.get("outputs") or {}).get(node, {}).get("text") or []))


def test_sd3_from_unetloader_runs_compiled(comfy_server, sd15_checkpoint, tiny_models):
    """SD3's MMDiT (UNETLoader, one joint block): Compile UNet (auto) picks inductor for the DiT,
    Warmup Shapes compiles its block, and KSampler gives the latent it gives without the pack.
    (A family the pack has no body for runs eager, saying so: tests/nodes/test_families.py.)"""
    ckpt, unet = sd15_checkpoint.name, tiny_models["sd3"]
    _, plain = _ran(comfy_server, tiny_prompt(ckpt, unet, "sd3_plain", pack=False))
    entry, packed = _ran(comfy_server, tiny_prompt(ckpt, unet, "sd3_pack", pack=True, backend=None))
    compiled, warmed = _text(entry, COMPILE), _text(entry, WARMUP)
    assert compiled.startswith("UNet Compiler: backend inductor (asked auto)") and "comfy DiT" in compiled, compiled
    assert "accelerated regions: joint_block x1" in compiled, compiled
    assert "1 of 1 regions ran compiled code" in warmed and "recompiles after warmup: 0" in warmed, warmed
    assert plain.shape == packed.shape == (1, 16, 8, 8), (plain.shape, packed.shape)
    assert relative_l2(packed, plain) <= MAX_COMPILED_REL_L2, relative_l2(packed, plain)


def test_an_sd_unet_of_unusual_shape_runs(comfy_server, sd15_checkpoint, tiny_models):
    """A UNet ComfyUI detects as SD1.5 but with one 320-channel level (no 640/1280 levels, no
    downsampling), on the eager backend: Compile UNet plans it, Warmup Shapes builds its inputs and
    runs it (numbers typed as text, as ComfyUI converts them), KSampler gives the plain latent."""
    ckpt, unet = sd15_checkpoint.name, tiny_models["one_level"]
    _, plain = _ran(comfy_server, tiny_prompt(ckpt, unet, "one_level_plain", pack=False))
    p = tiny_prompt(ckpt, unet, "one_level_pack", pack=True, context_tokens="77")
    p["5"]["inputs"]["steps"] = "1"
    entry, packed = _ran(comfy_server, p)
    warmed = _text(entry, WARMUP)
    assert "warmed 2x64x64" in warmed and "warmup stopped" not in warmed, warmed
    assert "status: eager: chosen in Select Backend" in _text(entry, COMPILE)
    assert plain.shape == packed.shape == (1, 4, 8, 8), (plain.shape, packed.shape)
    assert relative_l2(packed, plain) <= MAX_EAGER_RERUN_REL_L2


# ---- and after all that ------------------------------------------------------------------------
def test_server_alive_and_the_next_valid_prompt_gives_the_eager_latent(comfy_server, sd15_checkpoint, eager_before):
    comfy_server.check_alive()
    assert comfy_server.get_json("/system_stats")["system"], "the server does not answer"
    # another seed first, so KSampler cannot come from ComfyUI's cache whatever ran before this test
    other = eager_txt2img(sd15_checkpoint.name, "bad_input_other_seed")
    other["5"]["inputs"]["seed"] += 1
    comfy_server.run_prompt(other, timeout=300)
    entry = comfy_server.run_prompt(eager_txt2img(sd15_checkpoint.name, "bad_input_eager_after"), timeout=300)
    cached = [d.get("nodes") for name, d in (entry.get("status") or {}).get("messages") or []
              if name == "execution_cached"]
    assert not any("5" in (nodes or []) for nodes in cached), f"KSampler was not run again: {cached}"
    after = the_latent(comfy_server, entry)
    assert after.shape == (1, 4, 8, 8)
    assert relative_l2(after, eager_before) <= MAX_EAGER_RERUN_REL_L2


def test_a_boolean_sent_as_text_reads_as_the_word_says(comfy_server, sd15_checkpoint, tiny_models):
    """``"dynamic_shapes": "false"`` in a hand-written API prompt: ComfyUI's own conversion (``bool``)
    reads any text as true; the pack's /prompt handler, registered as the pack loads, reads it false."""
    p = tiny_prompt(sd15_checkpoint.name, tiny_models["one_level"], "text_boolean", pack=True)
    p[SELECT]["inputs"]["dynamic_shapes"] = "false"
    entry, _ = _ran(comfy_server, p)
    compiled = _text(entry, COMPILE)
    assert "dynamic shapes off" in compiled, compiled
