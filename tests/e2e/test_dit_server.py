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
import subprocess
import sys
import time

import pytest

from unet_compiler.bench import comfy_server as S

pytestmark = pytest.mark.e2e

FLUX_NAME = "unet_compiler_flux_width3072_depth1.safetensors"
LORA_NAME = "unet_compiler_flux_lora_rank4.safetensors"
#: the warmed box (cfg 1: the model batch is the image batch) and the two prompt sizes inside it
WARMUP = "1x64x64, 1x128x128"
SIZES = (64, 128)
#: compiled vs plain ComfyUI, relative L2 of the latent after 2 euler steps (fp32 on CPU)
MAX_REL_L2 = 1e-4

# Runs in a subprocess with cwd = the ComfyUI tree: argv[1] = the folder, argv[2:4] = the file names.
_BUILD_SCRIPT = r'''
import os, sys, time
sys.path.insert(0, os.getcwd())
out_dir, flux_name, lora_name = sys.argv[1:4]
t0 = time.time()
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.lora, comfy.model_base, comfy.sd, comfy.supported_models as sm, comfy.utils
g = torch.Generator().manual_seed(11)
cfg = sm.Flux({"image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
               "out_channels": 16, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 16, "hidden_size": 3072,
               "context_in_dim": 768, "patch_size": 2, "vec_in_dim": 768, "depth": 1, "depth_single_blocks": 1,
               "guidance_embed": True})
cfg.set_inference_dtype(torch.float16, None)
model = cfg.get_model({})
dm = model.diffusion_model
with torch.no_grad():
    for name, p in dm.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
        elif name.endswith(("weight", "scale")):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
sd = {k: v.detach().to(torch.float16).contiguous() for k, v in dm.state_dict().items()}
path = os.path.join(out_dir, flux_name)
tmp = path + ".%d.partial.safetensors" % os.getpid()
comfy.utils.save_torch_file(sd, tmp)
loaded = comfy.sd.load_diffusion_model(tmp)
if type(loaded.model) is not comfy.model_base.Flux:
    raise RuntimeError("%s loads as %r, not Flux" % (flux_name, type(loaded.model)))
key_map = comfy.lora.model_lora_keys_unet(loaded.model, {})
lora = {}
for name in ("lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"):
    if name not in key_map:
        raise RuntimeError("ComfyUI maps no %s for Flux" % name)
    w = sd[(key_map[name] if isinstance(key_map[name], str) else key_map[name][0]).removeprefix("diffusion_model.")]
    lora[name + ".lora_down.weight"] = (0.3 * torch.randn(4, w.shape[1], generator=g)).to(torch.float16)
    lora[name + ".lora_up.weight"] = (0.3 * torch.randn(w.shape[0], 4, generator=g)).to(torch.float16)
    lora[name + ".alpha"] = torch.tensor(4.0)
comfy.utils.save_torch_file(lora, os.path.join(out_dir, lora_name))
os.replace(tmp, path)
print("built %s and %s in %.1f s" % (flux_name, lora_name, time.time() - t0))
'''


@pytest.fixture(scope="module")
def flux_files(comfyui_path, sd15_checkpoint, comfy_server):
    """The Flux file in the server's diffusion_models folder and its LoRA in loras (built beside the
    checkpoint, kept where it is kept); the links are removed afterwards."""
    folder = sd15_checkpoint.parent
    names = (FLUX_NAME, LORA_NAME)
    if not all((folder / n).is_file() for n in names):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, str(folder), *names], cwd=str(comfyui_path),
                              env=S.subprocess_env(), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"building the Flux files failed (rc={proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-6000:]}")
        print(f"\n[e2e] {proc.stdout.strip().splitlines()[-1]} (wall {time.time() - t0:.1f} s)")
    links = [comfy_server.model_dirs["diffusion_models"] / FLUX_NAME, comfy_server.model_dirs["loras"] / LORA_NAME]
    for link, n in zip(links, names, strict=True):
        if not link.exists():
            S.link(link, folder / n)
    yield
    for link in links:
        link.unlink(missing_ok=True)
    if not os.environ.get("UNET_COMPILER_TEST_CACHE"):
        for n in names:
            (folder / n).unlink(missing_ok=True)


def flux_prompt(ckpt: str, prefix: str, size: int, pack: bool) -> dict:
    """UNETLoader(Flux) [-> Compile UNet -> Warmup Shapes] -> LoraLoaderModelOnly -> KSampler (cfg 1,
    2 euler steps; the SD1.5 checkpoint's CLIP conditions it) -> SaveLatent."""
    p = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox in the snow", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "20": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_NAME, "weight_dtype": "default"}},
        "21": {"class_type": "LoraLoaderModelOnly",
               "inputs": {"model": ["20", 0], "lora_name": LORA_NAME, "strength_model": 1.0}},
        "5": {"class_type": "KSampler",
              "inputs": {"model": ["21", 0], "seed": 5, "steps": 2, "cfg": 1.0, "sampler_name": "euler",
                         "scheduler": "simple", "denoise": 1.0, "positive": ["2", 0], "negative": ["3", 0],
                         "latent_image": ["4", 0]}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": prefix}},
    }
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
