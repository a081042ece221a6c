"""End-to-end: AnimateDiff-Evolved (Kosinkadink/ComfyUI-AnimateDiff-Evolved) beside this pack in a
real ComfyUI server, a motion model file loaded by its own ``AnimateDiff Loader`` node, in both
orders: Compile UNet + Warmup Shapes before the loader (the motion modules are inserted into the
compiled model when ComfyUI loads it) and after it. Each == the same prompt without this pack; the
report names the inserted modules where they run as they are.

The motion model is an AnimateDiff v2 file for SD1.5 (down, up and middle motion modules, position
encodings of 32 frames) of random weights, made by the pack's own ``AnimateDiffModel`` from a
skeleton of the keys its loader reads, saved where its loader looks (``animatediff_models``).
The pack is found at ``COMFYUI_ADE_PATH``, else ``~/comfy/ComfyUI-AnimateDiff-Evolved``; without it
the test skips with one line. Long: three prompts of 8 frames through the full random SD1.5.
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from unet_compiler.bench import comfy_server as S

from .. import _ade
from .conftest import TEST_NODE, with_the_pack
from .test_comfyui_server import ui_text

pytestmark = [pytest.mark.e2e, pytest.mark.long]

MOTION_NAME = "unet_compiler_random_mm_sd15_v2.safetensors"
FRAMES = 8
#: the regions of SD1.5's own UNet (the plan of ComfyUI's UNetModel): the motion modules add theirs
SD15_REGIONS = 110
#: compiled vs plain ComfyUI, relative L2 of the latent (fp32 on CPU)
MAX_REL_L2 = 1e-4

# Runs with cwd = the ComfyUI tree: argv[1] = the AnimateDiff-Evolved checkout, argv[2] = the file.
_BUILD_MOTION_SCRIPT = r'''
import importlib, os, sys, types
sys.path.insert(0, os.getcwd())
ade, out = sys.argv[1:3]
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.utils
for name, folder in (("ade_under_test", ade), ("ade_under_test.animatediff", os.path.join(ade, "animatediff"))):
    pkg = types.ModuleType(name)
    pkg.__path__ = [folder]
    sys.modules[name] = pkg
mm = importlib.import_module("ade_under_test.animatediff.motion_module_ad")
pe = "motion_modules.0.temporal_transformer.transformer_blocks.0.attention_blocks.1.pos_encoder.pe"
skeleton = {f"{blocks}.{i}.{pe}": torch.zeros(1, 32, c)
            for blocks, widths in (("down_blocks", (320, 640, 1280, 1280)), ("up_blocks", (1280, 1280, 640, 320)))
            for i, c in enumerate(widths)}
skeleton["mid_block." + pe] = torch.zeros(1, 32, 1280)
sd, info = mm.normalize_ad_state_dict(skeleton, "skeleton")
model = mm.AnimateDiffModel(sd, info)
g = torch.Generator().manual_seed(9)
with torch.no_grad():   # random weights everywhere (its zero-initialised output projections would do nothing)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(0.5 * torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
        elif name.endswith("weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
again, info2 = mm.normalize_ad_state_dict(dict(state), "check")
if (info2.sd_type, info2.mm_version) != (info.sd_type, info.mm_version) or len(again) != len(state):
    raise RuntimeError("the saved motion model does not read back as %r (%r)" % (info, info2))
comfy.utils.save_torch_file(state, out)
print("built %s: %d tensors, %s, %s" % (os.path.basename(out), len(state), info.sd_type, info.mm_version))
'''


@pytest.fixture(scope="module")
def ade_server(comfyui_path, sd15_checkpoint, tmp_path_factory):
    """A server with AnimateDiff-Evolved and the test node beside this pack, and the motion model file
    in its ``animatediff_models`` folder."""
    if (why := _ade.problem()) is not None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("ade_server")
    server = S.start_server(root / "server", sd15_checkpoint.parent, folders=("animatediff_models",),
                            extra_nodes={"ComfyUI-AnimateDiff-Evolved": _ade.where(),
                                         "unet_compiler_test_node": TEST_NODE},
                            log=lambda m: print("\n[e2e] " + m))
    try:
        proc = subprocess.run([sys.executable, "-c", _BUILD_MOTION_SCRIPT, str(_ade.where()),
                               str(server.model_dirs["animatediff_models"] / MOTION_NAME)],
                              cwd=str(comfyui_path), env=S.subprocess_env(), capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        print("\n[e2e] " + proc.stdout.strip().splitlines()[-1])
        yield server
    finally:
        server.stop()


def video_prompt(ckpt: str, prefix: str, order: str | None, window: int | None = None) -> dict:
    """txt2img of ``FRAMES`` frames at 64 px, 2 euler steps, through AnimateDiff Loader (its motion
    model, beta schedule autoselect; with ``window``, its Standard Uniform context options of that
    many frames, overlap 1); ``order``: None (plain ComfyUI), "before" (Compile UNet + Warmup
    Shapes, then the loader) or "after" (the loader, then Compile UNet + Warmup Shapes of one video
    of the frames sampling calls it with, cond and uncond); with the pack, the test node's report
    after sampling (node 62)."""
    p = S.txt2img(ckpt, 64, 64, FRAMES, 2, 5.0, 3, latent_prefix=prefix)
    del p["6"], p["7"]
    p["5"]["inputs"]["steps"] = 2
    entry = f"{2 * (window or FRAMES)}x64x64"

    def ade(m):
        p["30"] = {"class_type": "ADE_AnimateDiffLoaderGen1",
                   "inputs": {"model": m, "model_name": MOTION_NAME, "beta_schedule": "autoselect"}}
        if window:
            p["31"] = {"class_type": "ADE_StandardUniformContextOptions",
                       "inputs": {"context_length": window, "context_stride": 1, "context_overlap": 1,
                                  "closed_loop": False}}
            p["30"]["inputs"]["context_options"] = ["31", 0]
        return ["30", 0]

    with_the_pack(p, ["1", 0], ade, order, entry)
    return p


@pytest.mark.parametrize("order", ["before", "after"])
def test_animatediff_through_the_server_in_both_orders(ade_server, sd15_checkpoint, order):
    """Compile UNet + Warmup Shapes before / after AnimateDiff Loader: the latent == plain ComfyUI's
    with the same nodes; the report names the motion modules it did not compile (inserted after the
    plan) or counts them among its regions; no prompt fails."""
    ckpt = sd15_checkpoint.name
    plain = ade_server.run_prompt(video_prompt(ckpt, f"ade_plain_{order}", None), timeout=900)
    entry = ade_server.run_prompt(video_prompt(ckpt, f"ade_{order}", order), timeout=1800)
    ref = S.saved_latent(ade_server, plain)
    rel = S.relative_l2(S.saved_latent(ade_server, entry), ref)
    warm, after = ui_text(entry, "61"), ui_text(entry, "62")
    print(f"\n[e2e] AnimateDiff {order} Compile UNet: relative L2 {rel:.2e}\n--- warmup\n{warm}\n--- after sampling\n{after}")
    assert rel <= MAX_REL_L2, f"{order}: relative L2 {rel:.2e}\n{warm}\n{after}"
    ran = re.search(r"regions that ran compiled code: (\d+) of (\d+)", after)
    assert ran and ran.group(1) == ran.group(2), after
    assert re.search(r"recompiles after warmup: 0\b", after), after
    inserted = "ComfyUI-AnimateDiff-Evolved.animatediff.motion_module_ad.VanillaTemporalModule"
    if order == "before":    # inserted into the compiled model at load: run as they are, named by their pack
        assert "modules inserted into the model after it was planned" in after and inserted in after, after
    else:                    # in the model when Compile UNet planned it: regions like the UNet's own
        assert "modules inserted" not in after and int(ran.group(2)) > SD15_REGIONS, (warm, after)



def test_animatediff_context_windows_warmed_as_sampling_calls_them(ade_server, sd15_checkpoint):
    """AnimateDiff Loader with context windows of 4 frames (8 frames sampled a window at a time),
    then Compile UNet + Warmup Shapes of one window (8x64x64): warmup calls the motion modules with
    the window's frames (a freshly loaded motion model holds 16), nothing compiles at sampling, and
    the latent == plain ComfyUI's with the same nodes. The prompt with the pack runs first, so its
    motion model is the fresh one."""
    ckpt = sd15_checkpoint.name
    entry = ade_server.run_prompt(video_prompt(ckpt, "ade_windows", "after", window=4), timeout=1800)
    plain = ade_server.run_prompt(video_prompt(ckpt, "ade_windows_plain", None, window=4), timeout=900)
    rel = S.relative_l2(S.saved_latent(ade_server, entry), S.saved_latent(ade_server, plain))
    warm, after = ui_text(entry, "61"), ui_text(entry, "62")
    print(f"\n[e2e] AnimateDiff context windows: relative L2 {rel:.2e}\n--- warmup\n{warm}\n--- after sampling\n{after}")
    assert rel <= MAX_REL_L2, f"relative L2 {rel:.2e}\n{warm}\n{after}"
    assert "warmup stopped" not in warm and "warmed 8x64x64" in warm, warm
    ran = re.search(r"regions that ran compiled code: (\d+) of (\d+)", after)
    assert ran and ran.group(1) == ran.group(2), after
    assert re.search(r"recompiles after warmup: 0\b", after), after
