"""The ComfyUI server on CUDA (GPU machines only): txt2img at two resolutions through Compile UNet
with CUDA graphs on, against the same prompts eager, in one server started as a GPU user starts
it (no --cpu, --disable-cuda-malloc so graphs can be captured).

Tolerance: ComfyUI runs SD1.5 in fp16 on a GPU, so compiled and eager differ by fp16 rounding of
other kernels' sums, not fp32's: the fp32 latent from SaveLatent within 2e-2 relative L2 (a wrong
op gives O(1)), the 8-bit image within 4/255 mean. The sampling report (read by the test node
after KSampler) must show graphs captured and replayed, freed at the prompt's end, and no region
call falling back.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from unet_compiler.bench import comfy_server as S

from .conftest import TEST_NODE
from .test_comfyui_server import the_image, the_latent, txt2img_prompt, ui_text

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU: the ComfyUI server on CUDA (graphs on, two resolutions) runs on GPU machines only")]

SIZES = (512, 768)
MAX_LATENT_REL_L2 = 2e-2
MAX_MEAN_ABS_DIFF = 4.0


@pytest.fixture(scope="module")
def gpu_server(comfyui_path, sd15_checkpoint, tmp_path_factory):
    server = S.start_server(tmp_path_factory.mktemp("comfy_gpu_server"), sd15_checkpoint.parent,
                            extra_nodes={"unet_compiler_test_node": TEST_NODE}, comfyui_path=comfyui_path,
                            cpu=False, extra_args=("--disable-cuda-malloc",), log=lambda m: print("\n[gpu] " + m))
    try:
        yield server
    finally:
        server.stop()


def _compiled(prompt: dict) -> dict:
    prompt["10"] = {"class_type": "UNetCompiler_SelectBackend",
                    "inputs": {"backend": "auto", "precision": "auto", "dynamic_shapes": True, "cuda_graphs": True}}
    prompt["11"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": ["1", 0], "backend": ["10", 0]}}
    prompt["5"]["inputs"]["model"] = ["11", 0]
    prompt["62"] = {"class_type": "UNetCompilerTest_Report", "inputs": {"model": ["11", 0], "samples": ["5", 0]}}
    return prompt


@pytest.mark.parametrize("size", SIZES)
def test_txt2img_on_cuda_with_graphs_matches_eager(gpu_server, sd15_checkpoint, size):
    eager = gpu_server.run_prompt(txt2img_prompt(sd15_checkpoint.name, f"gpu_eager_{size}", size=size), timeout=300)
    entry = gpu_server.run_prompt(_compiled(txt2img_prompt(sd15_checkpoint.name, f"gpu_compiled_{size}", size=size)),
                                  timeout=600)
    report, after = ui_text(entry, "11"), ui_text(entry, "62")
    rel = S.relative_l2(the_latent(gpu_server, entry), the_latent(gpu_server, eager))
    diff = np.abs(the_image(gpu_server, entry).astype(np.int16) - the_image(gpu_server, eager).astype(np.int16))
    print(f"\n[gpu] {size} px: latent relative L2 {rel:.2e}, image mean abs {diff.mean():.2f}/255; {after}")
    assert "backend triton" in report or "backend inductor" in report, report
    assert rel <= MAX_LATENT_REL_L2 and diff.mean() <= MAX_MEAN_ABS_DIFF, (rel, diff.mean(), after)
    captured = re.search(r"cuda graphs: (\d+) captured for (\d+) region", after)
    assert captured and int(captured.group(1)) > 0, after
    assert re.search(r"(\d+) replays", after) and "kept across 1 prompt end(s)" in after, after
    assert "failed on" not in after and "off after a failed" not in after, after
