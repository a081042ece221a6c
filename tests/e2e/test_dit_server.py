"""End-to-end: a Flux-architecture diffusion transformer through the real ComfyUI server (issue 32).

The model is Flux.1 dev at its real width (hidden 3072, 24 heads, the RoPE axes its checkpoint
detection fixes) with one double and one single stream block, random weights, text and pooled
widths of 768 so the random SD1.5 checkpoint's CLIP conditions it. It is saved as a
``.safetensors`` file and loaded by ComfyUI's own ``UNETLoader`` (which must detect it as Flux),
with a rank-4 LoRA file on both blocks for ``LoraLoaderModelOnly``. Built once, beside the random
checkpoint (about 1 GB in fp16).

Each prompt: UNETLoader [-> Compile UNet -> Warmup Shapes] -> LoraLoaderModelOnly -> KSampler
(cfg 1, as Flux dev runs: one model batch per image) -> SaveLatent. The pack's prompts (the LoRA
after Compile UNet, then a resolution change) give plain ComfyUI's latents with the same nodes,
and sampling compiles nothing after the warmup (no recompile event in either prompt's /history).
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from unet_compiler.bench import comfy_server as S
from unet_compiler.bench import starts

#: long: a real-width Flux through two servers, minutes (in-process: tests/nodes/test_dit.py)
pytestmark = [pytest.mark.e2e, pytest.mark.long]

FLUX_NAME, LORA_NAME = S.FLUX_FILES["flux"], S.FLUX_FILES["lora"]
#: the warmed box (cfg 1: the model batch is the image batch) and the two prompt sizes inside it
WARMUP = "1x64x64, 1x128x128"
SIZES = (64, 128)
#: compiled vs plain ComfyUI, relative L2 of the latent after 2 euler steps (fp32 on CPU)
MAX_REL_L2 = 1e-4


@pytest.fixture(scope="module")
def flux_files(sd15_checkpoint, comfy_server):
    """The Flux file in the server's diffusion_models folder and its LoRA in loras (built beside the
    checkpoint, kept where it is kept); the links are removed afterwards."""
    paths = S.flux_files(sd15_checkpoint.parent, log=lambda m: print("\n[e2e] " + m))
    links = [comfy_server.model_dirs["diffusion_models"] / FLUX_NAME, comfy_server.model_dirs["loras"] / LORA_NAME]
    for link, target in zip(links, (paths["flux"], paths["lora"]), strict=True):
        if not link.exists():
            S.link(link, target)
    yield paths
    for link in links:
        link.unlink(missing_ok=True)
    if not os.environ.get("UNET_COMPILER_TEST_CACHE"):
        for path in paths.values():
            path.unlink(missing_ok=True)


def flux_prompt(ckpt: str, prefix: str, size: int, pack: bool) -> dict:
    """UNETLoader(Flux) [-> Compile UNet -> Warmup Shapes] -> LoraLoaderModelOnly -> KSampler (cfg 1,
    2 euler steps) -> SaveLatent."""
    p = S.flux_txt2latent(ckpt, size, 1, 2, 5, model=("21", 0))
    p["8"]["inputs"]["filename_prefix"] = prefix
    p["21"] = {"class_type": "LoraLoaderModelOnly",
               "inputs": {"model": ["20", 0], "lora_name": LORA_NAME, "strength_model": 1.0}}
    if pack:
        p["11"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": ["20", 0]}}
        p["12"] = {"class_type": "UNetCompiler_WarmupShapes",
                   "inputs": {"model": ["11", 0], "shapes": WARMUP, "context_tokens": 77, "background": False}}
        p["21"]["inputs"]["model"] = ["12", 0]
    return p


def _text(entry, node) -> str:
    return "\n".join(map(str, (entry.get("outputs") or {}).get(node, {}).get("text") or []))


def test_flux_through_the_server_lora_after_compile_and_a_resolution_change(comfy_server, sd15_checkpoint,
                                                                            flux_files):
    ckpt = sd15_checkpoint.name
    results = {}
    for pack in (False, True):         # the pack's prompts back to back: the second reuses its nodes' outputs
        for size in SIZES:
            t0 = time.time()
            entry = comfy_server.run_prompt(flux_prompt(ckpt, f"flux_{size}_{'pack' if pack else 'plain'}", size, pack),
                                            timeout=1800)
            results[size, pack] = entry, S.saved_latent(comfy_server, entry), time.time() - t0
            print(f"\n[e2e] Flux {size} px, {'Compile UNet' if pack else 'plain ComfyUI'}: {time.time() - t0:.1f} s")
    first = results[SIZES[0], True][0]
    compiled, warmed = _text(first, "11"), _text(first, "12")
    assert "backend inductor (asked auto)" in compiled and "comfy DiT" in compiled, compiled
    assert "accelerated regions: double_block x1, single_block x1" in compiled, compiled
    assert "2 of 2 regions ran compiled code" in warmed and "max |compiled - eager|" in warmed, warmed
    assert "recompiles after warmup: 0" in warmed, warmed
    for size in SIZES:
        entry, latent, _ = results[size, True]
        plain = results[size, False][1]
        assert latent.shape == plain.shape == (1, 16, size // 8, size // 8), (latent.shape, plain.shape)
        rel = S.relative_l2(latent, plain)
        print(f"[e2e] Flux {size} px: compiled vs plain ComfyUI latent, relative L2 {rel:.2e}")
        assert rel <= MAX_REL_L2, rel
        messages = (entry.get("status") or {}).get("messages") or []
        assert not [d for n, d in messages if n == "unet_compiler.recompile"], messages
    # the second size reused the compiled model: the pack's nodes were cached, nothing compiled
    messages = (results[SIZES[1], True][0].get("status") or {}).get("messages") or []
    cached = next((d for n, d in messages if n == "execution_cached"), {})
    assert "12" in cached.get("nodes", []), messages


def test_a_restart_of_the_flux_row_compiles_nothing(sd15_checkpoint, tmp_path):
    """Two ComfyUI processes on one pack folder, through the starts bench's own rows: the first
    compiles Flux cold (Warmup Shapes in the foreground), the second (Warmup Shapes at its defaults:
    background on) takes every graph from the compile cache, and neither compiles after warmup."""
    args = SimpleNamespace(px=64, batch=1, steps=1, model="flux")
    shape = "1x64x64"
    cold = tmp_path / "cold"
    env = starts.pack_env(cold)
    first = starts.run_row("cold", cold, sd15_checkpoint, "pack", args, env, shape, background=False)
    assert first.graphs and first.from_cache == 0 and "compile cache: saved" in first.report, first.report
    again = starts.run_row("restart", tmp_path / "restart", sd15_checkpoint, "pack", args, env, shape)
    print(f"\nFlux cold: first prompt {first.first_s:.1f} s, {first.graphs} graphs; restart: {again.first_s:.1f} s, "
          f"{again.graphs} graphs ({again.from_cache} from the compile cache)")
    assert "compile cache: hit" in again.report, again.report
    assert again.graphs == again.from_cache == first.graphs, again.report
    for root in (cold, tmp_path / "restart"):
        assert "compiled after warmup" not in (root / "comfyui.log").read_text(errors="replace")
