"""End-to-end: weights ComfyUI casts or patches per call, through a real headless ComfyUI's /prompt.

The session's random SD1.5 checkpoint loaded with ComfyUI's own "Load Diffusion Model"
(UNETLoader) at each fp8 ``weight_dtype``, then partially loaded under a memory budget
(ComfyUI's own partial load, forced by the test node ``UNetCompilerTest_PartialLoad``) with a LoRA
and a hook LoRA with keyframes; warmed at 2x64x64 (with the hook also 1x64x64). Each compiled prompt is compared with the same prompt without the
pack: the latent's relative L2 error within 1e-3 (the e2e gate; fp32 compute), every region ran
compiled code during warmup and sampling, no region call ran the model's code, and nothing
compiled again over three prompts that change the LoRA strength, the keyframes and the split.
fp8_e5m2, fp8_e4m3fn_fast and the hook LoRA run with UNET_COMPILER_FULL_MATRIX=1 (each costs
minutes of eager CPU time here; fp8_e5m2 storage is in the default run in-process,
tests/nodes/test_cast_weights.py, and the hook LoRA in the default stack test).
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from unet_compiler.bench.comfy_server import link as link_to, relative_l2

from .test_comfyui_server import FULL_ENV, MAX_LATENT_REL_L2, _hook_lora, the_latent, txt2img_prompt, ui_text

pytestmark = pytest.mark.e2e
UNET_LINK = "unet_compiler_sd15_as_diffusion_model.safetensors"


@pytest.fixture(scope="module")
def unet_name(comfy_server, sd15_checkpoint):
    """The checkpoint in the server's diffusion_models folder (UNETLoader takes a whole checkpoint's
    UNet by its key prefix)."""
    link = comfy_server.model_dirs["diffusion_models"] / UNET_LINK
    if not link.exists():
        link_to(link, sd15_checkpoint)
    yield UNET_LINK
    link.unlink(missing_ok=True)


def cast_prompt(ckpt, unet, prefix, weight_dtype, compiled, fraction=None, lora=None, strength=1.0,
                hook=None, keyframe=0.25) -> dict:
    """txt2img with the model from UNETLoader(``weight_dtype``) [-> LoraLoaderModelOnly(``lora``,
    ``strength``)] [-> PartialLoad(``fraction``)] [-> Compile UNet -> Warmup Shapes -> KSampler ->
    the accelerator's report after sampling]; ``hook``: the LoRA as a hook on the positive prompt,
    its second keyframe at strength ``keyframe`` (ComfyUI then calls cond and uncond apart: Warmup
    Shapes lists the half batch too)."""
    p = txt2img_prompt(ckpt, prefix)
    del p["6"], p["7"]               # the latent is the result
    p["5"]["inputs"]["steps"] = 1    # every weight cast per call costs eager and compiled alike: 1 step
    p["20"] = {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": weight_dtype}}
    model = ["20", 0]
    if lora:
        p["21"] = {"class_type": "LoraLoaderModelOnly",
                   "inputs": {"model": model, "lora_name": lora, "strength_model": strength}}
        model = ["21", 0]
    if fraction is not None:
        p["22"] = {"class_type": "UNetCompilerTest_PartialLoad", "inputs": {"model": model, "fraction": fraction}}
        model = ["22", 0]
    if hook:
        _hook_lora(p, {"lora": hook})
        p["42"]["inputs"]["strength_mult"] = keyframe
    if compiled:
        p["60"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": model}}
        p["61"] = {"class_type": "UNetCompiler_WarmupShapes",
                   "inputs": {"model": ["60", 0], "shapes": "1x64x64, 2x64x64" if hook else "2x64x64",
                              "context_tokens": 77, "background": False}}
        model = ["61", 0]
        p["62"] = {"class_type": "UNetCompilerTest_Report", "inputs": {"model": model, "samples": ["5", 0]}}
    p["5"]["inputs"]["model"] = model
    return p


def _count(text: str, pattern: str) -> int:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in the report:\n{text}"
    return int(m.group(1))


def _run_pair(server, ckpt, unet, tag, **kw):
    """The prompt without and with the pack: (relative L2 of the latents, warmup report, sampling report,
    /history status messages of the compiled prompt)."""
    eager = server.run_prompt(cast_prompt(ckpt, unet, f"cast_{tag}_eager", compiled=False, **kw), timeout=900)
    entry = server.run_prompt(cast_prompt(ckpt, unet, f"cast_{tag}_compiled", compiled=True, **kw), timeout=1800)
    ref = the_latent(server, eager)
    assert np.isfinite(ref).all()
    rel = relative_l2(the_latent(server, entry), ref)
    messages = (entry.get("status") or {}).get("messages") or []
    return rel, ui_text(entry, "61"), ui_text(entry, "62"), messages


def _check(tag, rel, warm, after, messages):
    n = _count(warm, r"regions that ran compiled code: (\d+) of \1\b")
    assert f"status: inductor: compiled, {n} of {n} regions ran compiled code" in warm, warm
    assert "compiled with ComfyUI's cast outside the graph" in after, after
    assert _count(after, r"regions that ran compiled code: (\d+) of") == n, after
    eager = _count(after, r"region calls on the model's own code for patches/lowvram: (\d+)")
    assert eager == 0, f"{tag}: region calls ran the model's code during sampling:\n{after}"
    assert _count(after, r"recompiles after warmup: (\d+)") == 0, after
    assert not [d for name, d in messages if name == "unet_compiler.recompile"], messages
    assert rel <= MAX_LATENT_REL_L2, f"{tag}: relative L2 {rel:.2e}\n{after}"
    print(f"\n[e2e] {tag}: {n} of {n} regions compiled, relative L2 vs eager {rel:.2e}")


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn"] + [
    pytest.param(d, marks=pytest.mark.skipif(os.environ.get(FULL_ENV) != "1",
                                             reason=f"the other fp8 weight_dtypes through /prompt run with {FULL_ENV}=1"))
    for d in ("fp8_e5m2", "fp8_e4m3fn_fast")])
@pytest.mark.long   # in-process: tests/nodes/test_cast_weights.py (every stored dtype)
def test_fp8_storage_runs_compiled(comfy_server, sd15_checkpoint, unet_name, weight_dtype):
    """Load Diffusion Model at an fp8 weight_dtype (ComfyUI casts every weight to fp32 per call; with
    no fp8 matmul on this machine fp8_e4m3fn_fast stores fp8 the same way): compiled == eager, every
    region compiled, no region call eager, no recompile."""
    rel, warm, after, messages = _run_pair(comfy_server, sd15_checkpoint.name, unet_name, weight_dtype,
                                           weight_dtype=weight_dtype)
    _check(weight_dtype, rel, warm, after, messages)


@pytest.mark.parametrize("hook", [False, pytest.param(True, marks=pytest.mark.skipif(
    os.environ.get(FULL_ENV) != "1", reason=f"the hook LoRA with keyframes on top runs with {FULL_ENV}=1"))],
    ids=["lora", "lora+hook-keyframes"])
@pytest.mark.long   # three prompts through the server; in-process: tests/nodes/test_cast_weights.py
def test_partial_load_and_lora_over_three_prompts(comfy_server, sd15_checkpoint, unet_name, patch_assets, hook):
    """fp8 storage, a LoRA and a partial load (the offloaded modules apply the LoRA per call), and with
    ``hook`` a hook LoRA with keyframes on the positive prompt too (ComfyUI patches those weights in
    place per hook group and calls cond and uncond apart: the warmed 1x64x64 serves them): three
    prompts that change the LoRA strength, the budget (and the second keyframe's strength), each ==
    eager, with every region compiled and nothing compiled after warmup."""
    for i, (fraction, strength, keyframe) in enumerate(((0.5, 1.0, 0.25), (0.3, 0.5, 0.5), (0.7, 0.8, 0.75))):
        rel, warm, after, messages = _run_pair(
            comfy_server, sd15_checkpoint.name, unet_name, f"partial{i}{'_hook' if hook else ''}",
            weight_dtype="fp8_e4m3fn", fraction=fraction, lora=patch_assets["lora"], strength=strength,
            hook=patch_assets["lora"] if hook else None, keyframe=keyframe)
        _check(f"partial load {fraction}, LoRA {strength}" + (f", hook keyframe {keyframe}" if hook else ""),
               rel, warm, after, messages)


@pytest.fixture(scope="module")
def bf16_server(comfyui_path, sd15_checkpoint, tmp_path_factory):
    """A second server started with ``--bf16-unet``: the UNet stored in bf16, computed in fp32 on a
    CPU (ComfyUI's manual_cast), as ``--fp16-unet`` / ``--bf16-unet`` users run it."""
    from unet_compiler.bench import comfy_server as S
    from .conftest import TEST_NODE
    server = S.start_server(tmp_path_factory.mktemp("comfy_server_bf16"), sd15_checkpoint.parent,
                            extra_nodes={"unet_compiler_test_node": TEST_NODE}, comfyui_path=comfyui_path,
                            log=lambda m: print("\n[e2e] " + m), extra_args=("--bf16-unet",))
    link_to(server.model_dirs["diffusion_models"] / UNET_LINK, sd15_checkpoint)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.skipif(os.environ.get(FULL_ENV) != "1", reason=f"bf16 storage through /prompt runs with {FULL_ENV}=1 "
                    "(a server of its own; in-process in the default run)")
def test_bf16_storage_runs_compiled(bf16_server, sd15_checkpoint):
    """``--bf16-unet``: every weight stored in bf16 and cast to fp32 per call."""
    rel, warm, after, messages = _run_pair(bf16_server, sd15_checkpoint.name, UNET_LINK, "bf16",
                                           weight_dtype="default")
    _check("--bf16-unet", rel, warm, after, messages)
