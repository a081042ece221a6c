"""End-to-end fixtures: a random-weight SD1.5 checkpoint and a headless ComfyUI.

Nothing here imports ComfyUI into the pytest process: the server and the checkpoint builder
are the package's ``comfy_server`` (subprocesses running ComfyUI's own code), shared with the
starts benchmark.

Environment:

- ``COMFYUI_PATH``: a ComfyUI source tree (the folder holding ``main.py``).
  Falls back to ``~/comfy/ComfyUI``. If neither exists every e2e test skips.
- ``UNET_COMPILER_TEST_CACHE``: a folder in which the random checkpoint is
  kept between sessions (built once, reused while present). Without it the
  checkpoint lives in the session's temp dir and is rebuilt every session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unet_compiler import comfy_server as S
from unet_compiler.comfy_server import CHECKPOINT_NAME, PromptFailed, fetch_image, run_prompt  # noqa: F401 - the tests' helpers

TEST_NODE = Path(__file__).resolve().parent / "comfy_test_node"


def pytest_configure(config):
    # pyproject.toml may register it too; add it only where nobody has.
    if not any(str(line).split(":", 1)[0].strip() == "e2e" for line in config.getini("markers")):
        config.addinivalue_line(
            "markers",
            "e2e: end-to-end test that starts a headless ComfyUI server "
            "(slow; deselect with -m 'not e2e')",
        )


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)


def pytest_pycollect_makemodule(module_path, parent):
    # Without ComfyUI (or its requirements in this env), skip each e2e module at collection: one
    # "SKIPPED" line for the lot instead of one per test, and no fixture ever runs.
    problem = comfy_problem()
    if problem:
        raise pytest.skip.Exception(problem, allow_module_level=True)
    return None


def comfy_problem() -> str | None:
    """Why there is no ComfyUI to test against here (one line), or None."""
    from unet_compiler.families import comfy_problem
    return comfy_problem()


def find_comfyui() -> Path | None:
    """The ComfyUI tree to test against, or None when there is none (or it cannot run here)."""
    from unet_compiler.families import comfy_path
    path = comfy_path()
    return path.resolve() if path and comfy_problem() is None else None


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    path = find_comfyui()
    if path is None:
        pytest.skip(comfy_problem())
    return path


# --------------------------------------------------------------------------
# Random-weight SD1.5 checkpoint and the server
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sd15_checkpoint(comfyui_path, tmp_path_factory):
    """Path to a random-weight SD1.5 .safetensors that CheckpointLoaderSimple loads."""
    cache = os.environ.get("UNET_COMPILER_TEST_CACHE")
    if cache:
        yield S.checkpoint_path(Path(cache))
        return
    ckpt = tmp_path_factory.mktemp("checkpoints") / CHECKPOINT_NAME
    S.build_checkpoint(comfyui_path, ckpt)
    yield ckpt
    # pytest keeps the last few temp dirs; do not leave 2.5 GB in each.
    ckpt.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def comfy_server(comfyui_path, sd15_checkpoint, tmp_path_factory):
    """A headless ComfyUI with this checkout as a custom node, the test-only node that registers
    an IPAdapter-style attn2 replace (tests/e2e/comfy_test_node) and the random checkpoint."""
    server = S.start_server(tmp_path_factory.mktemp("comfy_server"), sd15_checkpoint.parent,
                            extra_nodes={"unet_compiler_test_node": TEST_NODE}, comfyui_path=comfyui_path,
                            log=lambda m: print("\n[e2e] " + m))
    try:
        yield server
    finally:
        server.stop()


# --------------------------------------------------------------------------
# Random-weight LoRA, ControlNet and T2I-Adapter for the SD1.5 checkpoint
# --------------------------------------------------------------------------

PATCH_ASSETS = {"lora": "unet_compiler_random_sd15_lora.safetensors",
                "controlnet": "unet_compiler_random_sd15_controlnet.safetensors",
                "t2i": "unet_compiler_random_sd15_t2i_adapter.safetensors"}

# Runs in a subprocess with cwd = the ComfyUI tree. argv[1] = the checkpoint, argv[2] = the output
# folder. A generic-format LoRA (rank 4) on every attention to_k/to_v and ResBlock in_layers conv
# of the checkpoint's UNet; a ControlNet from comfy.cldm with SD1.5's UNet config (the layout of
# the original control_v11 .pth files: "control_model." prefix); a T2I-Adapter (SD1.5 full
# adapter: 8x pixel unshuffle, 320-1280 channels). Each is loaded back by ComfyUI's own loader.
_BUILD_PATCH_ASSETS_SCRIPT = r'''
import os, sys, time
sys.path.insert(0, os.getcwd())
ckpt, out_dir = sys.argv[1], sys.argv[2]
t0 = time.time()
from comfy.cli_args import args
args.cpu = True
import torch
import comfy.cldm.cldm, comfy.controlnet, comfy.ops, comfy.utils
from comfy.t2i_adapter.adapter import Adapter
from safetensors import safe_open
g = torch.Generator().manual_seed(5)

def save(sd, name):
    tmp = os.path.join(out_dir, name + ".%d.partial" % os.getpid())
    comfy.utils.save_torch_file({k: v.contiguous() for k, v in sd.items()}, tmp)
    os.replace(tmp, os.path.join(out_dir, name))

lora = {}
with safe_open(ckpt, "pt") as f:
    for k in f.keys():
        if k.startswith("model.diffusion_model.") and k.endswith(".weight") and (
                k.endswith(("attn1.to_k.weight", "attn2.to_k.weight", "attn2.to_v.weight", "in_layers.2.weight"))):
            w = f.get_slice(k)
            shape = w.get_shape()
            name = k[len("model."):-len(".weight")]
            extra = tuple(shape[2:])
            lora[name + ".lora_down.weight"] = (torch.randn((4, shape[1]) + extra, generator=g) * 0.05).half()
            lora[name + ".lora_up.weight"] = (torch.randn((shape[0], 4) + (1,) * len(extra), generator=g) * 0.05).half()
            lora[name + ".alpha"] = torch.tensor(4.0)
save(lora, sys.argv[3])

''' + S.SD15_HELPERS + r'''
# the ControlNet takes the UNet's config (as load_controlnet passes the detected one) without its output
cfg = {k: v for k, v in SD15_UNET_CONFIG.items() if k != "out_channels"}
cfg["hint_channels"] = 3
cn = comfy.cldm.cldm.ControlNet(**cfg, dtype=torch.float16, device="cpu", operations=comfy.ops.disable_weight_init)
random_init(cn, 0.02, g)
save({"control_model." + k: v for k, v in cn.state_dict().items()}, sys.argv[4])

ad = Adapter(cin=3 * 64, channels=[320, 640, 1280, 1280], nums_rb=2, ksize=1, sk=True, use_conv=False, xl=False)
random_init(ad, 0.02, g)
save({k: v.half() for k, v in ad.state_dict().items()}, sys.argv[5])

for name, kind in ((sys.argv[4], comfy.controlnet.ControlNet), (sys.argv[5], comfy.controlnet.T2IAdapter)):
    net = comfy.controlnet.load_controlnet(os.path.join(out_dir, name))
    if not isinstance(net, kind):
        raise RuntimeError("%s loads as %r, not %s" % (name, type(net), kind.__name__))
print("built LoRA (%d tensors), ControlNet, T2I-Adapter in %.1f s" % (len(lora), time.time() - t0))
'''


@pytest.fixture(scope="session")
def patch_asset_files(comfyui_path, sd15_checkpoint):
    """{"lora" / "controlnet" / "t2i": path} of a random LoRA, ControlNet and T2I-Adapter for the
    SD1.5 checkpoint (built beside the checkpoint, kept where it is kept). ``link_patch_assets``
    puts them in a server's folders."""
    folder = sd15_checkpoint.parent
    paths = {k: folder / v for k, v in PATCH_ASSETS.items()}
    if not all(p.is_file() for p in paths.values()):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", _BUILD_PATCH_ASSETS_SCRIPT, str(sd15_checkpoint), str(folder),
                               PATCH_ASSETS["lora"], PATCH_ASSETS["controlnet"], PATCH_ASSETS["t2i"]],
                              cwd=str(comfyui_path), env=S.subprocess_env(), capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"building the LoRA/ControlNet/T2I files failed (rc={proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-6000:]}")
        print(f"\n[e2e] {proc.stdout.strip().splitlines()[-1]} (wall {time.time() - t0:.1f} s)")
    yield paths
    if not os.environ.get("UNET_COMPILER_TEST_CACHE"):
        for p in paths.values():
            p.unlink(missing_ok=True)


def link_patch_assets(server, paths: dict) -> dict:
    """Link ``patch_asset_files`` into ``server``'s loras / controlnet folders; returns their names."""
    for kind, path in paths.items():
        link = server.model_dirs["loras" if kind == "lora" else "controlnet"] / path.name
        if not link.exists():
            link.symlink_to(path)
    return {k: p.name for k, p in paths.items()}


@pytest.fixture(scope="session")
def patch_assets(patch_asset_files, comfy_server):
    """The random LoRA, ControlNet and T2I-Adapter in the session server's loras / controlnet
    folders: {"lora" / "controlnet" / "t2i": file name}."""
    return link_patch_assets(comfy_server, patch_asset_files)
