"""End-to-end: the pack inside a real, headless ComfyUI, driven over its HTTP API.

All tests run the same txt2img graph on a random-weight SD1.5 checkpoint
(64x64, 2 euler steps, cfg 7, seed 0). The compiled variant inserts the pack's
nodes before KSampler and must give the same image and latent as plain
ComfyUI; afterwards plain ComfyUI must still give exactly its old result.

Run: pytest tests/e2e -q --import-mode=importlib   (select/deselect with -m e2e)
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from unet_compiler.bench.comfy_server import relative_l2, saved_latent  # noqa: F401 (relative_l2: the helpers' import)

pytestmark = pytest.mark.e2e

SEED = 0
SIZE = 64
PACK_NODES = (
    "UNetCompiler_SelectBackend",
    "UNetCompiler_CompileUNet",
    "UNetCompiler_WarmupShapes",
)
# Compiled vs eager. precision="auto" keeps ComfyUI's dtype (fp32 on CPU), so
# only fp32 rounding may differ. Measured here with stand-ins for the compiled
# path: the 8-bit image barely sees UNet errors (eps off by 3%: mean 1.3/255,
# max 10; whole UNet under bf16 autocast: mean 2.9/255, max 28), so the gate
# that catches wrong numerics is the fp32 latent from SaveLatent (relative L2
# error: eps off by 1% -> ~1e-2). The image bounds catch gross breakage.
MAX_MEAN_ABS_DIFF = 2.0  # uint8 levels, i.e. 2/255 of full scale
MAX_ABS_DIFF = 24
MAX_LATENT_REL_L2 = 1e-3  # eps scaled by 1.001 gives 2e-3 here
# The same eager graph run again after compiling: nothing may have changed.
MAX_EAGER_RERUN_REL_L2 = 1e-6
# WarmupShapes entries are UNet batch x width x height; with cfg > 1 ComfyUI
# runs cond and uncond as one batch of 2, so that is the shape KSampler needs.
WARMUP_SHAPES = f"2x{SIZE}x{SIZE}"


def txt2img_prompt(ckpt_name: str, filename_prefix: str, model_ref=("1", 0), size: int = SIZE) -> dict:
    """API-format CheckpointLoaderSimple -> CLIPTextEncode x2 -> KSampler -> VAEDecode -> SaveImage."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt_name}},
        "2": {"class_type": "CLIPTextEncode",
              "inputs": {"text": "a photograph of a red fox in the snow", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode",
              "inputs": {"text": "blurry, low quality", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage",
              "inputs": {"width": size, "height": size, "batch_size": 1}},
        "5": {"class_type": "KSampler",
              "inputs": {"model": list(model_ref), "seed": SEED, "steps": 2, "cfg": 7.0,
                         "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
                         "positive": ["2", 0], "negative": ["3", 0],
                         "latent_image": ["4", 0]}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage",
              "inputs": {"images": ["6", 0], "filename_prefix": filename_prefix}},
        "8": {"class_type": "SaveLatent",
              "inputs": {"samples": ["5", 0], "filename_prefix": filename_prefix + "_latent"}},
    }


def output_images(entry: dict) -> list[dict]:
    """The {filename, subfolder, type} records of every image in a history entry."""
    images = []
    for node_out in (entry.get("outputs") or {}).values():
        images.extend(node_out.get("images") or [])
    return images


def the_image(server, entry) -> np.ndarray:
    images = output_images(entry)
    assert len(images) == 1, f"expected one output image, history outputs: {entry.get('outputs')}"
    img = server.fetch_image(images[0])
    assert (server.output_dir / images[0].get("subfolder", "") / images[0]["filename"]).is_file()
    return img


def the_latent(server, entry) -> np.ndarray:
    """KSampler's output latent as float32 [B, 4, H/8, W/8], read from SaveLatent's file."""
    return saved_latent(server, entry)


def ui_text(entry: dict, node_id: str) -> str:
    """The UI text a node returned (V1 {"ui": {"text": ...}} / V3 ui.PreviewText)."""
    out = (entry.get("outputs") or {}).get(node_id) or {}
    text = out.get("text")
    if text is None:
        return ""
    if isinstance(text, (list, tuple)):
        return "\n".join(str(t) for t in text)
    return str(text)


@pytest.fixture(scope="session")
def eager_result(comfy_server, sd15_checkpoint):
    t0 = time.time()
    entry = comfy_server.run_prompt(txt2img_prompt(sd15_checkpoint.name, "e2e_eager"),
                                   timeout=300)
    img = the_image(comfy_server, entry)
    latent = the_latent(comfy_server, entry)
    print(f"\n[e2e] eager txt2img prompt: {time.time() - t0:.1f} s")
    return img, latent


def test_eager_txt2img(eager_result):
    img, latent = eager_result
    assert latent.shape == (1, 4, SIZE // 8, SIZE // 8), latent.shape
    assert np.isfinite(latent).all(), "eager latent has NaN/inf"
    assert latent.std() > 1e-3, f"eager latent is (nearly) constant: std {latent.std()}"
    assert img.shape == (SIZE, SIZE, 3), img.shape
    assert img.dtype == np.uint8
    f = img.astype(np.float64)
    assert f.std() > 1.0, f"image is (nearly) constant: mean {f.mean():.1f}, std {f.std():.2f}"
    assert len(np.unique(img)) > 16, "image has too few distinct values"


# Tests request this with request.getfixturevalue() from their body, so that a
# missing node or a failing prompt is reported as a test FAILURE, not a setup error.
@pytest.fixture(scope="session")
def compiled_result(comfy_server, sd15_checkpoint, request):
    """Run the graph with the pack's nodes before KSampler; return (history entry, image, latent)."""
    info = comfy_server.object_info()
    missing = [n for n in PACK_NODES if n not in info]
    if missing:
        pytest.fail(
            f"UNet Compiler nodes missing from /object_info: {missing}. ComfyUI loaded "
            f"the pack from {comfy_server.pack_dir} -> {comfy_server.pack_dir.resolve()}; "
            "what its log says about that import:\n" + comfy_server.pack_import_report(),
            pytrace=False,
        )
    # The eager reference runs first, so compiling cannot influence it.
    request.getfixturevalue("eager_result")

    prompt = txt2img_prompt(sd15_checkpoint.name, "e2e_compiled", model_ref=("12", 0))
    prompt["10"] = {"class_type": "UNetCompiler_SelectBackend",
                    "inputs": {"backend": "inductor", "precision": "auto",
                               "dynamic_shapes": True, "cuda_graphs": True}}
    prompt["11"] = {"class_type": "UNetCompiler_CompileUNet",
                    "inputs": {"model": ["1", 0], "backend": ["10", 0]}}
    prompt["12"] = {"class_type": "UNetCompiler_WarmupShapes",
                    "inputs": {"model": ["11", 0], "shapes": WARMUP_SHAPES,
                               "context_tokens": 77, "background": False}}

    t0 = time.time()
    entry = comfy_server.run_prompt(prompt, timeout=900)
    print(f"\n[e2e] compiled txt2img prompt (compile + warmup + sample): {time.time() - t0:.1f} s")
    return entry, the_image(comfy_server, entry), the_latent(comfy_server, entry)


def torch_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def test_compiled_matches_eager(eager_result, request):
    entry, compiled, compiled_latent = request.getfixturevalue("compiled_result")
    eager, eager_latent = eager_result

    report = ui_text(entry, "11")
    assert report, (
        "CompileUNet returned no UI text in /history "
        f"(outputs: {entry.get('outputs', {}).get('11')})"
    )
    assert "inductor" in report.lower(), f"CompileUNet report does not name the backend: {report!r}"
    if not torch_cuda():  # the optional input went through /prompt; on CPU the report says why it is unused
        assert "cuda graphs: not used: they need CUDA" in report, report

    assert compiled_latent.shape == eager_latent.shape
    assert np.isfinite(compiled_latent).all(), "compiled latent has NaN/inf"
    rel_l2 = relative_l2(compiled_latent, eager_latent)
    print(f"[e2e] compiled vs eager latent: relative L2 error {rel_l2:.2e}")

    assert compiled.shape == eager.shape
    diff = np.abs(compiled.astype(np.int16) - eager.astype(np.int16))
    print(f"[e2e] compiled vs eager image: mean abs diff {diff.mean():.4f}/255, max {diff.max()}/255")
    reports = f"CompileUNet report: {report!r}; WarmupShapes report: {ui_text(entry, '12')!r}"
    assert diff.mean() <= MAX_MEAN_ABS_DIFF and diff.max() <= MAX_ABS_DIFF, (
        f"compiled image differs from eager: mean abs {diff.mean():.3f}/255, "
        f"max abs {diff.max()}/255; {reports}"
    )
    assert rel_l2 <= MAX_LATENT_REL_L2, (
        f"compiled latent differs from eager: relative L2 error {rel_l2:.2e} > "
        f"{MAX_LATENT_REL_L2:.0e} (image: mean abs {diff.mean():.3f}/255, max {diff.max()}); {reports}"
    )


@pytest.mark.long   # a recompile through the server (CI: tests/compiler/test_runtime.py names it in process)
def test_recompile_during_sampling_reaches_that_prompts_history(comfy_server, sd15_checkpoint, request):
    """The compiled graph again with a batch of 2 images (UNet batch 4, outside the one warmed shape):
    ComfyUI reuses the cached Compile UNet / Warmup Shapes outputs, so none of the pack's nodes runs,
    and the recompile during KSampler is told in this prompt's /history (status messages), not only
    in the browser and the log."""
    request.getfixturevalue("compiled_result")
    prompt = txt2img_prompt(sd15_checkpoint.name, "e2e_compiled_batch2", model_ref=("12", 0))
    prompt["4"]["inputs"]["batch_size"] = 2
    prompt["10"] = {"class_type": "UNetCompiler_SelectBackend",
                    "inputs": {"backend": "inductor", "precision": "auto",
                               "dynamic_shapes": True, "cuda_graphs": True}}
    prompt["11"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": ["1", 0], "backend": ["10", 0]}}
    prompt["12"] = {"class_type": "UNetCompiler_WarmupShapes",
                    "inputs": {"model": ["11", 0], "shapes": WARMUP_SHAPES, "context_tokens": 77,
                               "background": False}}
    entry = comfy_server.run_prompt(prompt, timeout=900)
    messages = (entry.get("status") or {}).get("messages") or []
    names = [name for name, _ in messages]
    assert "execution_cached" in names, names   # the pack's nodes did not run again
    cached = next(d for n, d in messages if n == "execution_cached")
    assert "12" in cached.get("nodes", []), cached
    recompiles = [d for n, d in messages if n == "unet_compiler.recompile"]
    assert recompiles, f"no recompile event in /history: {names}"
    assert recompiles[0]["shape"] == f"4x{SIZE}x{SIZE}" and recompiles[0]["graphs"] > 0, recompiles[0]
    assert "4x64x64" in recompiles[0]["text"] and "Warmup Shapes" in recompiles[0]["text"], recompiles[0]["text"]


def test_shared_model_still_eager_after_compile(comfy_server, sd15_checkpoint,
                                                eager_result, request):
    """Compiling a clone must leave the loader's MODEL untouched (the shared model is never mutated).

    ComfyUI caches CheckpointLoaderSimple's output, so this prompt gets the very
    ModelPatcher the compiled prompt cloned. A no-op ModelSamplingDiscrete (eps,
    SD1.5's own schedule) makes KSampler run again instead of hitting the cache.
    """
    request.getfixturevalue("compiled_result")
    _, eager_latent = eager_result
    prompt = txt2img_prompt(sd15_checkpoint.name, "e2e_eager_again", model_ref=("13", 0))
    prompt["13"] = {"class_type": "ModelSamplingDiscrete",
                    "inputs": {"model": ["1", 0], "sampling": "eps", "zsnr": False}}
    entry = comfy_server.run_prompt(prompt, timeout=300)
    rel_l2 = relative_l2(the_latent(comfy_server, entry), eager_latent)
    print(f"\n[e2e] eager-after-compile vs eager latent: relative L2 error {rel_l2:.2e}")
    assert rel_l2 <= MAX_EAGER_RERUN_REL_L2, (
        f"plain KSampler on the loader's MODEL changed after the compiled prompt: relative L2 "
        f"error {rel_l2:.2e}; the pack altered the shared model or global state"
    )


def test_warmup_after_deep_shrink_through_the_api(comfy_server, sd15_checkpoint, request):
    """The reported failure: Compile UNet + Warmup Shapes placed after a core patch node (Kohya
    Deep Shrink reads transformer_options['sigmas']) failed the whole prompt. Through /prompt
    it now completes, gives plain ComfyUI's Deep Shrink image, and /history says what the patch
    did. Runs after the compiled prompt, whose inductor graphs this server process reuses."""
    request.getfixturevalue("compiled_result")

    def deep_shrink(prompt, model_ref):
        prompt["20"] = {"class_type": "PatchModelAddDownscale",
                        "inputs": {"model": list(model_ref), "block_number": 3, "downscale_factor": 2.0,
                                   "start_percent": 0.0, "end_percent": 0.35, "downscale_after_skip": True,
                                   "downscale_method": "bicubic", "upscale_method": "bicubic"}}
        return prompt
    eager = comfy_server.run_prompt(deep_shrink(txt2img_prompt(sd15_checkpoint.name, "e2e_ds_eager",
                                                               model_ref=("20", 0)), ("1", 0)), timeout=300)
    prompt = deep_shrink(txt2img_prompt(sd15_checkpoint.name, "e2e_ds_compiled", model_ref=("22", 0)), ("1", 0))
    prompt["21"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": ["20", 0]}}
    prompt["22"] = {"class_type": "UNetCompiler_WarmupShapes",
                    "inputs": {"model": ["21", 0], "shapes": WARMUP_SHAPES, "context_tokens": 77,
                               "background": False}}
    entry = comfy_server.run_prompt(prompt, timeout=900)
    report = ui_text(entry, "22")
    assert f"warmed {WARMUP_SHAPES}" in report and "without the model's patches" not in report, report
    assert "patch input_block_patch_after_skip (PatchModelAddDownscale" in report, report
    rel_l2 = relative_l2(the_latent(comfy_server, entry), the_latent(comfy_server, eager))
    print(f"\n[e2e] Deep Shrink compiled vs eager latent: relative L2 error {rel_l2:.2e}")
    assert rel_l2 <= MAX_LATENT_REL_L2, f"relative L2 {rel_l2:.2e}; report: {report}"


# ---- core patch nodes through /prompt (issue: every core patch node, compiled == eager) --------
FULL_ENV = "UNET_COMPILER_FULL_MATRIX"


def _model_node(class_type, **inputs):
    return lambda model_ref: {"class_type": class_type, "inputs": {"model": list(model_ref), **inputs}}


#: name -> (MODEL patch nodes in order, conditioning patch, what the report must name)
MODEL_PATCHES = {
    "FreeU": _model_node("FreeU", b1=1.1, b2=1.2, s1=0.9, s2=0.2),
    "FreeU_V2": _model_node("FreeU_V2", b1=1.3, b2=1.4, s1=0.9, s2=0.2),
    "PerturbedAttentionGuidance": _model_node("PerturbedAttentionGuidance", scale=3.0),
    "SelfAttentionGuidance": _model_node("SelfAttentionGuidance", scale=0.5, blur_sigma=2.0),
    # 32 px tiles: at 64 px the first level's 8x8 latent is cut into 2x2 tiles
    "HyperTile": _model_node("HyperTile", tile_size=32, swap_size=1, max_depth=1, scale_depth=False),
    "PatchModelAddDownscale": _model_node("PatchModelAddDownscale", block_number=3, downscale_factor=2.0,
                                          start_percent=0.0, end_percent=0.35, downscale_after_skip=True,
                                          downscale_method="bicubic", upscale_method="bicubic"),
    "RescaleCFG": _model_node("RescaleCFG", multiplier=0.7),
    "ModelSamplingDiscrete": _model_node("ModelSamplingDiscrete", sampling="v_prediction", zsnr=True),
    "TomePatchModel": _model_node("TomePatchModel", ratio=0.5),
    "IPAdapter-style attn2 replace": _model_node("UNetCompilerTest_Attn2Replace", weight=0.7),
}
#: what Warmup Shapes' report names for each MODEL patch (the patch's own function or class). PAG and
#: SAG install their attn1 replace only inside sampling (post-CFG), after that report; the
#: in-process tests check what the report says of them after sampling
REPORTED = {"FreeU": "(FreeU.", "FreeU_V2": "(FreeU_V2.", "HyperTile": "(HyperTile.",
            "PatchModelAddDownscale": "(PatchModelAddDownscale.", "TomePatchModel": "(TomePatchModel.",
            "IPAdapter-style attn2 replace": "attn2 replace (IPAdapterAttn2)"}
CONDITIONING = ("hook LoRA", "ControlNet", "T2I-Adapter")


def _hook_lora(prompt, assets):
    """CreateHookLora -> keyframes (1.0, then 0.25 from 50%) -> SetClipHooks -> the positive CLIPTextEncode."""
    prompt["40"] = {"class_type": "CreateHookLora",
                    "inputs": {"lora_name": assets["lora"], "strength_model": 1.0, "strength_clip": 1.0}}
    prompt["41"] = {"class_type": "CreateHookKeyframe", "inputs": {"strength_mult": 1.0, "start_percent": 0.0}}
    prompt["42"] = {"class_type": "CreateHookKeyframe",
                    "inputs": {"strength_mult": 0.25, "start_percent": 0.5, "prev_hook_kf": ["41", 0]}}
    prompt["43"] = {"class_type": "SetHookKeyframes", "inputs": {"hooks": ["40", 0], "hook_kf": ["42", 0]}}
    prompt["44"] = {"class_type": "SetClipHooks",
                    "inputs": {"clip": ["1", 1], "apply_to_conds": True, "schedule_clip": False, "hooks": ["43", 0]}}
    prompt["2"]["inputs"]["clip"] = ["44", 0]


def _control(prompt, assets, which, node_id, size):
    """ControlNetLoader + ControlNetApplyAdvanced on both conditionings (a grey hint image)."""
    pos, neg = prompt["5"]["inputs"]["positive"], prompt["5"]["inputs"]["negative"]
    prompt["50"] = {"class_type": "EmptyImage", "inputs": {"width": size, "height": size, "batch_size": 1,
                                                           "color": 0x9a6040}}
    prompt[node_id] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": assets[which]}}
    apply_id = str(int(node_id) + 1)
    prompt[apply_id] = {"class_type": "ControlNetApplyAdvanced",
                        "inputs": {"positive": pos, "negative": neg, "control_net": [node_id, 0],
                                   "image": ["50", 0], "strength": 0.8, "start_percent": 0.0, "end_percent": 1.0}}
    prompt["5"]["inputs"]["positive"], prompt["5"]["inputs"]["negative"] = [apply_id, 0], [apply_id, 1]


def patched_prompt(ckpt, prefix, names, assets, compiled, size=SIZE):
    """txt2img with the named patch nodes in order on the MODEL (and conditioning), then, when
    ``compiled``, Compile UNet + Warmup Shapes right before KSampler."""
    prompt = txt2img_prompt(ckpt, prefix, size=size)
    model = ("1", 0)
    for i, name in enumerate(n for n in names if n in MODEL_PATCHES):
        prompt[str(30 + i)] = MODEL_PATCHES[name](model)
        model = (str(30 + i), 0)
    if "hook LoRA" in names:
        _hook_lora(prompt, assets)
    if "ControlNet" in names:
        _control(prompt, assets, "controlnet", "52", size)
    if "T2I-Adapter" in names:
        _control(prompt, assets, "t2i", "54", size)
    if compiled:
        prompt["60"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": list(model)}}
        prompt["61"] = {"class_type": "UNetCompiler_WarmupShapes",
                        "inputs": {"model": ["60", 0], "shapes": f"2x{size}x{size}", "context_tokens": 77,
                                   "background": False}}
        model = ("61", 0)
    prompt["5"]["inputs"]["model"] = list(model)
    return prompt


#: At 64 px SD1.5's middle block is 1x1. FreeU_V2 normalises each skip by its (max - min) over
#: space: 0/0, plain ComfyUI's image is NaN. SAG's blur map cannot be cut from one token: plain
#: ComfyUI raises. PAG replaces self-attention over one token with its value: the identity, no
#: change. Alone they run at 128 px (middle 2x2); the stack has FreeU and PAG changes nothing there.
SIZES = {"FreeU_V2": 128, "SelfAttentionGuidance": 128, "PerturbedAttentionGuidance": 128}
STACK = ("FreeU", "PerturbedAttentionGuidance", "HyperTile", "RescaleCFG", "ModelSamplingDiscrete",
         "IPAdapter-style attn2 replace", "hook LoRA", "ControlNet", "T2I-Adapter")
#: in CI: the stack of nine (every kind of patch at once); each node alone with UNET_COMPILER_FULL_MATRIX=1
SERVER_CASES = [pytest.param(STACK, id="stack-of-9")] + [
    pytest.param((name,), id=name.replace(" ", "_"),
                 marks=pytest.mark.skipif(os.environ.get(FULL_ENV) != "1",
                                          reason=f"each patch node alone through /prompt runs with {FULL_ENV}=1"))
    for name in (*MODEL_PATCHES, *CONDITIONING)]


@pytest.mark.parametrize("names", SERVER_CASES)
def test_patch_nodes_through_the_api(comfy_server, sd15_checkpoint, patch_assets, eager_result, request, names):
    """Core patch nodes (and an IPAdapter-style attn2 replace from a custom node) placed before
    Compile UNet + Warmup Shapes, through /prompt: the compiled latent equals plain ComfyUI's with
    the same nodes, the nodes changed the image, and the report names every UNet patch and what
    it did to the regions. Runs after the compiled prompt, whose graphs the server reuses."""
    request.getfixturevalue("compiled_result")
    tag = request.node.callspec.id
    size = max(SIZES.get(n, SIZE) for n in names)
    t0 = time.time()
    eager = comfy_server.run_prompt(patched_prompt(sd15_checkpoint.name, f"e2e_{tag}_eager", names,
                                                   patch_assets, False, size), timeout=600)
    t1 = time.time()
    entry = comfy_server.run_prompt(patched_prompt(sd15_checkpoint.name, f"e2e_{tag}_compiled", names,
                                                   patch_assets, True, size), timeout=1200)
    t2 = time.time()
    report = ui_text(entry, "61")
    ref = the_latent(comfy_server, eager)
    rel_l2 = relative_l2(the_latent(comfy_server, entry), ref)
    assert np.isfinite(ref).all(), f"plain ComfyUI's latent with {names} is not finite: pick other settings"
    if size == SIZE:
        changed = relative_l2(ref, eager_result[1])
    else:  # the plain image at this size
        changed = relative_l2(ref, the_latent(comfy_server, comfy_server.run_prompt(
            txt2img_prompt(sd15_checkpoint.name, f"e2e_{tag}_plain", size=size), timeout=600)))
    print(f"\n[e2e] {' + '.join(names)}: compiled vs eager latent relative L2 {rel_l2:.2e}; the nodes moved the "
          f"latent by {changed:.2e}; eager prompt {t1 - t0:.1f} s, compiled {t2 - t1:.1f} s")
    assert f"warmed 2x{size}x{size}" in report and "without the model's patches" not in report, report
    assert rel_l2 <= MAX_LATENT_REL_L2, f"relative L2 {rel_l2:.2e}; report: {report}"
    assert changed > 1e-3, f"{names} did not change the image (relative L2 {changed:.2e} from plain)"
    for name in names:
        if name in REPORTED:
            assert "patch " in report and REPORTED[name] in report, f"report does not name {name}:\n{report}"
