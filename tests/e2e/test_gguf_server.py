"""End-to-end: city96/ComfyUI-GGUF beside this pack in a real ComfyUI server. The random SD1.5
checkpoint's UNet as GGUF files loaded by its own ``Unet Loader (GGUF)``: F16 made by the pack's own
converter (``tools/convert.py``), Q8_0 written with gguf-py's quantizer under the converter's rules
(1-D and small tensors unquantized, rows not a whole number of blocks regrouped with their shape
kept in ``comfy.gguf.orig_shape``). A LoRA in both orders: Compile UNet + Warmup Shapes before
``LoraLoaderModelOnly`` and after it. Each == the same prompt without this pack; every region ran
compiled code; nothing compiled after the warmup.

The pack is found at ``COMFYUI_GGUF_PATH``, else ``~/comfy/ComfyUI-GGUF``; without it (or gguf-py)
the test skips with one line. Long: a full-size SD1.5 in two quant types through the server.
"""
from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from unet_compiler.bench import comfy_server as S

from .. import _gguf
from .conftest import TEST_NODE, link_patch_assets, with_the_pack
from .test_comfyui_server import ui_text

pytestmark = [pytest.mark.e2e, pytest.mark.long]

#: compiled vs plain ComfyUI, relative L2 of the latent (fp32 compute on CPU, the pack's dequantisation
#: in both)
MAX_REL_L2 = 1e-4

# Runs with cwd = the ComfyUI tree: argv[1] = the GGUF checkout, argv[2] = the checkpoint, argv[3] =
# the folder, argv[4:] = quant types.
_BUILD_GGUF_SCRIPT = r'''
import importlib.util, os, sys, time
sys.path.insert(0, os.getcwd())
pack, ckpt, folder, *qtypes = sys.argv[1:]
import gguf, numpy as np, torch
spec = importlib.util.spec_from_file_location("gguf_convert_under_test", os.path.join(pack, "tools", "convert.py"))
conv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conv)
for qname in qtypes:
    t0 = time.time()
    dst = os.path.join(folder, "unet_compiler_random_sd15-%s.gguf" % qname)
    if qname == "F16":
        conv.convert_file(ckpt, dst, interact=False, overwrite=True)     # the pack's own converter
    else:
        sd = conv.load_state_dict(ckpt)
        arch = conv.detect_arch(sd)
        qtype = getattr(gguf.GGMLQuantizationType, qname)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        writer = gguf.GGUFWriter(path=None, arch=arch.arch)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, t in sd.items():
            data = t.to(torch.float32).numpy()
            q = qtype
            if data.ndim == 1 or data.size <= conv.QUANTIZATION_THRESHOLD:
                q = gguf.GGMLQuantizationType.F32
            elif data.shape[-1] % block:
                if data.size % 256 == 0:
                    writer.add_array("comfy.gguf.orig_shape." + key, tuple(int(d) for d in data.shape))
                    data = data.reshape(data.size // 256, 256)
                else:
                    q = gguf.GGMLQuantizationType.F16
            writer.add_tensor(key, gguf.quants.quantize(data, q), raw_dtype=q)
        writer.write_header_to_file(path=dst)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    print("built %s in %.1f s" % (os.path.basename(dst), time.time() - t0))
'''

QTYPES = ("Q8_0", "F16")


@pytest.fixture(scope="module")
def gguf_server(comfyui_path, sd15_checkpoint, patch_asset_files, tmp_path_factory):
    """A server with ComfyUI-GGUF and the test node beside this pack, the GGUF files in its
    diffusion_models folder and the SD1.5 LoRA in its loras."""
    if (why := _gguf.problem()) is not None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("gguf_server")
    server = S.start_server(root / "server", sd15_checkpoint.parent,
                            extra_nodes={"ComfyUI-GGUF": _gguf.where(), "unet_compiler_test_node": TEST_NODE},
                            log=lambda m: print("\n[e2e] " + m))
    try:
        proc = subprocess.run([sys.executable, "-c", _BUILD_GGUF_SCRIPT, str(_gguf.where()), str(sd15_checkpoint),
                               str(server.model_dirs["diffusion_models"]), *QTYPES],
                              cwd=str(comfyui_path), env=S.subprocess_env(), capture_output=True, text=True,
                              timeout=1200)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        print("\n[e2e] " + "; ".join(line for line in proc.stdout.splitlines() if line.startswith("built")))
        yield SimpleNamespace(server=server, lora=link_patch_assets(server, {"lora": patch_asset_files["lora"]})["lora"])
    finally:
        server.stop()


def gguf_prompt(ckpt: str, qtype: str, lora: str, prefix: str, order: str | None) -> dict:
    """txt2img at 64 px, 2 euler steps, its model UnetLoaderGGUF(``qtype``) and a LoRA at 0.8;
    ``order``: None (plain ComfyUI), "before" (Compile UNet + Warmup Shapes, then the LoRA) or "after"
    (the LoRA, then Compile UNet + Warmup Shapes); with the pack, the test node's report after
    sampling (node 62)."""
    p = S.txt2img(ckpt, 64, 64, 1, 2, 5.0, 3, latent_prefix=prefix)
    del p["6"], p["7"]
    p["20"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": f"unet_compiler_random_sd15-{qtype}.gguf"}}

    def lora_(m):
        p["21"] = {"class_type": "LoraLoaderModelOnly", "inputs": {"model": m, "lora_name": lora, "strength_model": 0.8}}
        return ["21", 0]

    with_the_pack(p, ["20", 0], lora_, order, "2x64x64")
    return p


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_through_the_server_with_a_lora_in_both_orders(gguf_server, sd15_checkpoint, qtype):
    """Per quant type: plain ComfyUI, then Compile UNet before and after the LoRA: each latent ==
    plain's, every region ran compiled code (the pack's dequantisation and the LoRA per call, outside
    the graph), no recompile after the warmup, no region call ran the model's own code (before the
    own-cast check allowed a conv algorithm's rounding, 7-8 wide convs did here: not in-process)."""
    ckpt, lora, server = sd15_checkpoint.name, gguf_server.lora, gguf_server.server
    plain = server.run_prompt(gguf_prompt(ckpt, qtype, lora, f"gguf_{qtype}_plain", None), timeout=900)
    ref = S.saved_latent(server, plain)
    for order in ("before", "after"):
        entry = server.run_prompt(gguf_prompt(ckpt, qtype, lora, f"gguf_{qtype}_{order}", order), timeout=1800)
        rel = S.relative_l2(S.saved_latent(server, entry), ref)
        warm, after = ui_text(entry, "61"), ui_text(entry, "62")
        print(f"\n[e2e] GGUF {qtype}, Compile UNet {order} the LoRA: relative L2 {rel:.2e}\n--- warmup\n{warm}"
              f"\n--- after sampling\n{after}")
        assert rel <= MAX_REL_L2, f"{qtype} {order}: relative L2 {rel:.2e}\n{after}"
        ran = re.search(r"regions that ran compiled code: (\d+) of (\d+)", after)
        assert ran and ran.group(1) == ran.group(2), after
        assert re.search(r"recompiles after warmup: 0\b", after), after
        assert re.search(r"region calls on the model's own code for patches/lowvram: 0\b", after), after

