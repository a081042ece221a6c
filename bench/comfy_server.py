"""A headless ComfyUI server with this pack installed, driven through its HTTP API, and the
random-weight SD1.5 checkpoint it loads (no downloads). Used by the end-to-end tests
(tests/e2e) and the starts and soak benches (``python -m unet_compiler.bench starts`` / ``soak``).

Nothing here imports ComfyUI into the calling process: the checkpoint is built by a subprocess
that imports ComfyUI's own model classes, and the server is a second subprocess
(``main.py --cpu`` unless a GPU is asked for) that loads this checkout as a custom-node pack,
listening on loopback only. It loads no other pack (``only_these_custom_nodes``): whatever the
ComfyUI tree's own custom_nodes folder holds (this pack installed from the Manager, say) changes
no result.
"""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path


PACK_ROOT = Path(__file__).resolve().parents[1]   # the pack's checkout, linked into a server's custom_nodes
CHECKPOINT_NAME = "unet_compiler_random_sd15.safetensors"
# Bump when the builder below changes, so a cached file is not reused.
CHECKPOINT_FORMAT_VERSION = "1"
SERVER_READY_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------
# Random-weight SD1.5 checkpoint
# --------------------------------------------------------------------------

# Runs in a subprocess with cwd = the ComfyUI tree. argv[1] = output path.
# Builds the three models from ComfyUI's own classes, random-initialises them
# (ComfyUI's ops skip init, leaving torch.empty garbage), saves them with the
# key prefixes of an original SD1.5 checkpoint, and then checks that ComfyUI's
# model detection calls the result SD15.
# Pasted into the builder scripts (the checkpoint's, the patch assets') (after their imports): the random init and SD1.5's UNet
# config, as comfy/model_detection.py spells it.
SD15_HELPERS = r'''
NORMS = (torch.nn.GroupNorm, torch.nn.LayerNorm)

@torch.no_grad()
def random_init(root, scale=0.02, generator=None):
    # ComfyUI's ops skip init, leaving torch.empty garbage: norms to identity, biases to zero
    for mod in root.modules():
        for name, p in mod.named_parameters(recurse=False):
            if isinstance(mod, NORMS):
                p.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias":
                p.zero_()
            else:
                p.normal_(0.0, scale, generator=generator)
    for name, b in root.named_buffers():
        if b.is_floating_point() and not torch.isfinite(b).all():
            raise RuntimeError("non-finite buffer after init: " + name)

SD15_UNET_CONFIG = dict(
    image_size=32, in_channels=4, out_channels=4, model_channels=320,
    num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
    transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0], transformer_depth_middle=1,
    transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    use_spatial_transformer=True, use_linear_in_transformer=False,
    context_dim=768, num_heads=8, num_head_channels=-1, legacy=False,
    adm_in_channels=None, use_checkpoint=False,
    use_temporal_attention=False, use_temporal_resblock=False,
)
'''

_BUILD_CHECKPOINT_SCRIPT = r'''
import os, sys, time
sys.path.insert(0, os.getcwd())
out_path = sys.argv[1]
t0 = time.time()

from comfy.cli_args import args
args.cpu = True
import torch
import comfy.model_management
import comfy.ops
import comfy.sd1_clip
import comfy.utils
import comfy.model_detection
from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
from comfy.ldm.models.autoencoder import AutoencoderKL

torch.manual_seed(0)
''' + SD15_HELPERS + r'''
# UNet: stored in fp16 (ComfyUI on CPU upcasts to fp32 at load) to halve file size and I/O.
unet_config = SD15_UNET_CONFIG
unet = UNetModel(**unet_config, dtype=torch.float16, device="cpu",
                 operations=comfy.ops.disable_weight_init)
random_init(unet)

# CLIP-L text model from comfy/sd1_clip_config.json. Only text_model.* is
# saved, like an original SD1.5 file (SD15.process_clip_state_dict would
# misplace a top-level text_projection key).
clip = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32)
random_init(clip)

# SD1.x KL VAE, the config comfy/sd.py VAE uses for these keys.
ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256,
            "in_channels": 3, "out_ch": 3, "ch": 128, "ch_mult": [1, 2, 4, 4],
            "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
vae = AutoencoderKL(ddconfig=ddconfig, embed_dim=4)
random_init(vae)

sd = {}
for k, v in unet.state_dict().items():
    sd["model.diffusion_model." + k] = v
for k, v in clip.state_dict().items():
    if k.startswith("transformer.text_model."):
        sd["cond_stage_model." + k] = v
for k, v in vae.state_dict().items():
    sd["first_stage_model." + k] = v
sd = {k: v.detach().contiguous() for k, v in sd.items()}
for k, v in sd.items():
    if v.is_floating_point() and not torch.isfinite(v).all():
        raise RuntimeError("non-finite tensor: " + k)

# The file must be detected as SD1.5 by the same code CheckpointLoaderSimple runs.
import comfy.supported_models
prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
model_config = comfy.model_detection.model_config_from_unet(sd, prefix)
if type(model_config) is not comfy.supported_models.SD15:
    raise RuntimeError("model detection says %r, not SD15" % (type(model_config),))

tmp = "%s.%d.partial" % (out_path, os.getpid())
comfy.utils.save_torch_file(sd, tmp, metadata={"unet_compiler_test": "random-sd15"})
os.replace(tmp, out_path)
n_unet = sum(v.numel() for k, v in sd.items() if k.startswith("model.diffusion_model."))
print("built %s: %d tensors, %.0fM UNet params, %s detected, %.1f s"
      % (out_path, len(sd), n_unet / 1e6, type(model_config).__name__, time.time() - t0))
'''


def subprocess_env() -> dict:
    """The environment of a process run in the ComfyUI tree (its server, a script there): ours, with
    ComfyUI's stdout unbuffered (complete logs on a failure) and without ``PYTHONSAFEPATH``, which the
    developers' commands set (bin/dev.py) and which would keep ``main.py``'s own folder, ComfyUI's
    tree, off its ``sys.path``. The pack's checkout is not on it: ComfyUI loads it from custom_nodes."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONSAFEPATH", None)
    return env


def checkpoint_path(folder: Path) -> Path:
    """The random SD1.5 checkpoint kept in ``folder`` (``<folder>/checkpoints-v<format>/``),
    built there first when missing (about a minute, 2 GB)."""
    ckpt_dir = Path(folder).expanduser() / ("checkpoints-v" + CHECKPOINT_FORMAT_VERSION)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir / CHECKPOINT_NAME
    if not ckpt.is_file():
        build_checkpoint(comfyui_or_fail(), ckpt)
    return ckpt


def comfyui_or_fail() -> Path:
    from ..tests._families import comfy_path
    path = comfy_path()
    if path is None:
        raise RuntimeError("ComfyUI not found: set COMFYUI_PATH or install it at ~/comfy/ComfyUI")
    return path.resolve()


def build_checkpoint(comfyui_path: Path, ckpt: Path):
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_CHECKPOINT_SCRIPT, str(ckpt)],
        cwd=str(comfyui_path),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0 or not ckpt.is_file():
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise RuntimeError(
            f"building the random SD1.5 checkpoint failed (rc={proc.returncode}):\n{tail}"
        )
    summary = proc.stdout.strip().splitlines()
    print(f"\n[e2e] {summary[-1] if summary else 'checkpoint built'} "
          f"(wall {time.time() - t0:.1f} s)")


# --------------------------------------------------------------------------
# Random-weight LoRA, ControlNet and T2I-Adapter for that checkpoint
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

''' + SD15_HELPERS + r'''
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


def patch_assets(ckpt: Path, log=print) -> dict:
    """A random LoRA, ControlNet and T2I-Adapter for the checkpoint ``ckpt``, built beside it
    (once: reused while present). Returns {"lora" | "controlnet" | "t2i": path}."""
    folder = Path(ckpt).parent
    paths = {k: folder / v for k, v in PATCH_ASSETS.items()}
    if not all(p.is_file() for p in paths.values()):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", _BUILD_PATCH_ASSETS_SCRIPT, str(ckpt), str(folder),
                               PATCH_ASSETS["lora"], PATCH_ASSETS["controlnet"], PATCH_ASSETS["t2i"]],
                              cwd=str(comfyui_or_fail()), env=subprocess_env(), capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"building the LoRA/ControlNet/T2I files failed (rc={proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-6000:]}")
        log(f"{proc.stdout.strip().splitlines()[-1]} (wall {time.time() - t0:.1f} s)")
    return paths



# --------------------------------------------------------------------------
# A Flux-architecture diffusion model (real width, one block of each kind) and a LoRA for it
# --------------------------------------------------------------------------
FLUX_FILES = {"flux": "unet_compiler_flux_width3072_depth1.safetensors",
              "lora": "unet_compiler_flux_lora_rank4.safetensors"}

# Runs in a subprocess with cwd = the ComfyUI tree: argv[1] = the folder, argv[2:4] = the file names.
_BUILD_FLUX_SCRIPT = r'''
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


def flux_files(folder: Path, log=print) -> dict:
    """Flux.1 dev at its real width (hidden 3072, 24 heads, the RoPE axes its detection fixes) with one
    double and one single stream block, random weights, text and pooled widths 768 (the random SD1.5
    checkpoint's CLIP conditions it), which ``UNETLoader`` must load as Flux; and a rank-4 LoRA on
    both blocks. Built in ``folder`` once (about 1 GB, fp16), reused while present.
    Returns {"flux" | "lora": path}."""
    paths = {k: Path(folder) / v for k, v in FLUX_FILES.items()}
    if not all(p.is_file() for p in paths.values()):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", _BUILD_FLUX_SCRIPT, str(folder), FLUX_FILES["flux"],
                               FLUX_FILES["lora"]], cwd=str(comfyui_or_fail()), env=subprocess_env(),
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"building the Flux files failed (rc={proc.returncode}):\n"
                               f"{(proc.stdout + proc.stderr)[-6000:]}")
        log(f"{proc.stdout.strip().splitlines()[-1]} (wall {time.time() - t0:.1f} s)")
    return paths


def flux_txt2latent(ckpt: str, size: int, batch: int, steps: int, seed: int, model=("20", 0)) -> dict:
    """The Flux prompt: UNETLoader(the Flux file, node "20") -> KSampler (cfg 1, as Flux dev runs:
    one model batch per image; euler, simple; the SD1.5 checkpoint's CLIP conditions it) ->
    SaveLatent (node "8"; the SD1.5 VAE does not decode 16 channels). ``model``: KSampler's model link."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox in the snow", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": batch}},
        "20": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILES["flux"], "weight_dtype": "default"}},
        "5": {"class_type": "KSampler",
              "inputs": {"model": list(model), "seed": seed, "steps": steps, "cfg": 1.0, "sampler_name": "euler",
                         "scheduler": "simple", "denoise": 1.0, "positive": ["2", 0], "negative": ["3", 0],
                         "latent_image": ["4", 0]}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"flux_{seed}"}},
    }


# --------------------------------------------------------------------------
# Headless ComfyUI server
# --------------------------------------------------------------------------


def link(at: Path, target: Path) -> Path:
    """Make ``at`` show ``target`` (a folder or a file) without copying it: a symlink; where the OS
    refuses one (Windows without Developer Mode or admin rights), a directory junction for a folder
    and a hard link for a file (same volume), else a copy of the file. Returns ``at``."""
    at, target = Path(at), Path(target)
    try:
        at.symlink_to(target, target_is_directory=target.is_dir())
        return at
    except OSError:
        if os.name != "nt" and not _SIMULATE_WINDOWS:
            raise
    if target.is_dir():
        import _winapi   # Windows' CPython: junctions need no privilege
        _winapi.CreateJunction(str(target.resolve()), str(at))
        return at
    try:
        os.link(target, at)
    except OSError:
        import shutil
        shutil.copy2(target, at)
    return at


_SIMULATE_WINDOWS = False   # tests: take the Windows fallbacks on this OS


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n_chars: int = 8000) -> str:
    try:
        data = path.read_text(errors="replace")
    except OSError as e:
        return f"<could not read {path}: {e}>"
    return data[-n_chars:]


@dataclass
class ComfyServer:
    url: str
    process: subprocess.Popen
    log_path: Path
    output_dir: Path
    comfyui_path: Path
    pack_dir: Path  # the symlink in the server's custom_nodes folder
    model_dirs: dict = field(default_factory=dict)  # "loras" / "controlnet" / "diffusion_models" -> its folder
    root: Path | None = None  # the folder start_server made for it
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ready_s: float = 0.0      # seconds from start until it answered
    _object_info: dict | None = None

    # -- HTTP helpers ----------------------------------------------------
    def get(self, route: str, timeout: float = 30.0) -> bytes:
        with urllib.request.urlopen(self.url + route, timeout=timeout) as r:
            return r.read()

    def get_json(self, route: str, timeout: float = 30.0):
        return json.loads(self.get(route, timeout))

    def post_json(self, route: str, payload: dict, timeout: float = 30.0):
        req = urllib.request.Request(
            self.url + route,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
                return json.loads(body) if body.strip() else None   # /free, /interrupt answer with no body
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            raise AssertionError(f"POST {route} -> HTTP {e.code}: {body}") from None

    def object_info(self) -> dict:
        if self._object_info is None:
            self._object_info = self.get_json("/object_info", timeout=120)
        return self._object_info

    def log_tail(self, n_chars: int = 8000) -> str:
        return _tail(self.log_path, n_chars)

    def pack_import_report(self) -> str:
        """What the server log says about importing this pack (its traceback included)."""
        lines = _tail(self.log_path, 2_000_000).splitlines()
        key = str(self.pack_dir)
        mentions = [i for i, line in enumerate(lines) if key in line]
        if not mentions:
            return f"(the server log never mentions {key})"
        failed = [i for i in mentions if lines[i].startswith("Cannot import")]
        if not failed:
            return "\n".join(lines[i] for i in mentions)
        end = failed[-1]
        start = end
        while start > 0 and end - start < 80 and not lines[start].startswith("Traceback"):
            start -= 1
        if not lines[start].startswith("Traceback"):
            start = end
        return "\n".join(lines[start:end + 1])

    # -- prompt helpers (the module-level functions below) ---------------
    def run_prompt(self, prompt: dict, timeout: float = 300.0) -> dict:
        return run_prompt(self, prompt, timeout)

    def fetch_image(self, image: dict):
        return fetch_image(self, image)

    def stop(self):
        _stop(self.process)

    def free_memory(self, timeout: float = 90.0) -> float:
        """POST /free (unload the models, drop the cached node outputs: what ComfyUI's own "free
        memory" does) and wait until the server's resident memory stops falling. Returns the MiB it
        gave back. The compiled code stays (dynamo's, in the process); the next prompt loads the
        checkpoint again."""
        import psutil   # ComfyUI's own requirement
        proc = psutil.Process(self.process.pid)
        before = last = proc.memory_info().rss
        self.post_json("/free", {"unload_models": True, "free_memory": True})
        deadline, steady = time.time() + timeout, 0
        while time.time() < deadline and steady < 4:   # 4 s without a change of 32 MiB
            time.sleep(1.0)
            now = proc.memory_info().rss
            steady = steady + 1 if abs(now - last) < 32 * 2**20 else 0
            last = now
        return (before - last) / 2**20

    def check_alive(self):
        if self.process.poll() is not None:
            raise AssertionError(
                f"ComfyUI exited with rc={self.process.returncode}; log tail:\n"
                + self.log_tail()
            )


def _stop(proc: subprocess.Popen):
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


# --------------------------------------------------------------------------
# Prompt helpers
# --------------------------------------------------------------------------


class PromptFailed(AssertionError):
    pass


def run_prompt(server: ComfyServer, prompt: dict, timeout: float = 300.0) -> dict:
    """Queue an API-format prompt, wait for it, and return its /history entry.

    Raises PromptFailed with ComfyUI's validation or execution error (and the
    server log tail) if the prompt is rejected or fails.
    """
    return wait_prompt(server, queue_prompt(server, prompt), timeout)


def queue_prompt(server: ComfyServer, prompt: dict) -> str:
    """Queue an API-format prompt (behind any already queued) and return its id; PromptFailed when
    ComfyUI rejects it."""
    server.check_alive()
    resp = server.post_json("/prompt", {"prompt": prompt, "client_id": server.client_id})
    if resp.get("error") or resp.get("node_errors"):
        raise PromptFailed(f"prompt rejected: {json.dumps(resp, indent=1)}")
    return resp["prompt_id"]


def wait_prompt(server: ComfyServer, prompt_id: str, timeout: float = 300.0) -> dict:
    """Wait for a queued prompt and return its /history entry (PromptFailed when it fails)."""
    deadline = time.time() + timeout
    while True:
        history = server.get_json(f"/history/{prompt_id}")
        entry = history.get(prompt_id)
        if entry is not None:
            status = entry.get("status") or {}
            if status.get("completed") or status.get("status_str") in ("success", "error"):
                break
        server.check_alive()
        if time.time() > deadline:
            raise PromptFailed(
                f"prompt {prompt_id} did not finish in {timeout:.0f} s; log tail:\n"
                + server.log_tail()
            )
        time.sleep(0.5)

    status = entry.get("status") or {}
    if status.get("status_str") != "success":
        raise PromptFailed(_describe_failure(prompt_id, status) + "\nlog tail:\n"
                           + server.log_tail(4000))
    return entry


def _describe_failure(prompt_id: str, status: dict) -> str:
    for name, data in status.get("messages") or []:
        if name == "execution_error":
            tb = "".join(data.get("traceback") or [])
            return (
                f"prompt {prompt_id} failed in node {data.get('node_id')} "
                f"({data.get('node_type')}): {data.get('exception_type')}: "
                f"{data.get('exception_message')}\n{tb}"
            )
        if name == "execution_interrupted":
            return f"prompt {prompt_id} was interrupted: {data}"
    return f"prompt {prompt_id} did not succeed: {json.dumps(status)}"


def fetch_image(server: ComfyServer, image: dict):
    """Download an output image via GET /view and return it as a uint8 HxWxC array."""
    import numpy as np
    from PIL import Image

    query = urllib.parse.urlencode({
        "filename": image["filename"],
        "subfolder": image.get("subfolder", ""),
        "type": image.get("type", "output"),
    })
    data = server.get(f"/view?{query}")
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))



def txt2img(ckpt: str, width: int, height: int, batch: int, steps: int, cfg: float, seed: int,
            latent_prefix: str | None = None) -> dict:
    """The txt2img API prompt the CLIs run: CheckpointLoaderSimple (1) -> CLIPTextEncode x2 (2, 3) ->
    EmptyLatentImage (4) -> KSampler (5, euler / normal, its model the loader's: rewire
    ``p["5"]["inputs"]["model"]`` to put nodes between) -> VAEDecode (6) -> PreviewImage (7), and with a
    ``latent_prefix`` SaveLatent (8) of KSampler's latent (read back with ``saved_latent``)."""
    p = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red fox in the snow", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": width, "height": height, "batch_size": batch}},
        "5": {"class_type": "KSampler", "inputs": {
            "model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
            "scheduler": "normal", "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
            "denoise": 1.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "PreviewImage", "inputs": {"images": ["6", 0]}},
    }
    if latent_prefix is not None:
        p["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": latent_prefix}}
    return p


def saved_latent(server: ComfyServer, entry: dict, node: str = "8"):
    """The latent a prompt's SaveLatent ``node`` wrote, as a float32 numpy array [B, C, h, w]."""
    from safetensors.numpy import load_file

    latents = (entry.get("outputs") or {}).get(node, {}).get("latents") or []
    if len(latents) != 1:
        raise AssertionError(f"expected one saved latent from node {node}, history outputs: {entry.get('outputs')}")
    return load_file(str(server.output_dir / latents[0].get("subfolder", "") / latents[0]["filename"]))["latent_tensor"]


def relative_l2(a, b) -> float:
    """||a - b|| / ||b|| of two arrays (the parity measure of the e2e tests, the soak and the benches)."""
    import numpy as np
    return float(np.linalg.norm((a - b).ravel()) / max(float(np.linalg.norm(b.ravel())), 1e-30))


#: the servers this process started that may still run (``start_server`` frees their memory first)
_LIVE: list = []


def _make_room(log) -> None:
    """Before another server starts: every live one this process started drops its models (each
    holds SD1.5 in fp32 and the pack's prepacked copies, ~8-12 GB: two of them fill a 24 GB machine)."""
    for ref in list(_LIVE):
        server = ref()
        if server is None or server.process.poll() is not None:
            _LIVE.remove(ref)
            continue
        try:
            freed = server.free_memory()
        except Exception as e:   # a busy or dying server: the new one starts anyway
            freed = None
            if log is not None:
                log(f"could not free {server.url}'s memory: {e}")
        if log is not None and freed is not None:
            log(f"{server.url} freed {freed:.0f} MiB before another server starts")


def only_these_custom_nodes(comfyui_path: Path, base: Path, names) -> list[str]:
    """ComfyUI's own flags that make a server load the custom nodes ``names`` (folders in
    ``base``/custom_nodes) and nothing else: ``--base-directory base`` puts its custom_nodes (and
    models) folder in place of the tree's own, and ``--disable-all-custom-nodes`` with
    ``--whitelist-custom-nodes`` skips any other folder, also one a user's extra_model_paths.yaml in
    the tree adds, and their prestartup scripts. A ComfyUI without a flag gets the others."""
    known = (Path(comfyui_path) / "comfy" / "cli_args.py").read_text(encoding="utf-8")
    flags = []
    if "--base-directory" in known:
        flags += ["--base-directory", str(base)]
    if "--whitelist-custom-nodes" in known:
        flags += ["--disable-all-custom-nodes", "--whitelist-custom-nodes", *names]
    return flags


def start_server(root: Path, checkpoint_dir: Path, extra_nodes: dict | None = None, env: dict | None = None,
                 comfyui_path: Path | None = None, log=print, cpu: bool = True,
                 extra_args: tuple = (), folders: tuple = ()) -> ComfyServer:
    """Start ComfyUI (``main.py``, with ``--cpu`` unless ``cpu`` is False, and ``extra_args``, on loopback, a free port, its user / output / temp folders
    under ``root``) with this checkout in its custom_nodes, ``extra_nodes`` (name -> folder) beside
    it and no other custom node (``only_these_custom_nodes``), and ``checkpoint_dir`` as a
    checkpoints folder (``folders``: more model folders by ComfyUI's folder name, another pack's such as
    ``animatediff_models``, each under ``root`` and in ``model_dirs``); wait until it answers. ``env`` overrides the
    server's environment (a None value unsets the variable); unless ours or it sets
    ``TORCHINDUCTOR_CACHE_DIR`` the server compiles into ``root/inductor_cache``, so a stale cache
    cannot hide a compile (or a cold start)."""
    comfyui_path = comfyui_path or comfyui_or_fail()
    root = Path(root).absolute()
    custom_nodes = root / "custom_nodes"
    custom_nodes.mkdir(parents=True)
    # The folder name is the module name ComfyUI derives; any name works.
    link(custom_nodes / PACK_ROOT.name, PACK_ROOT)
    for name, folder in (extra_nodes or {}).items():
        link(custom_nodes / name, folder)
    models = ("loras", "controlnet", "diffusion_models", *folders)
    dirs = {name: root / name for name in ("output", "input", "temp", "user", *models)}
    for d in dirs.values():
        d.mkdir()

    yaml_path = root / "extra_model_paths.yaml"
    # JSON strings are valid YAML scalars, so paths with odd characters are safe.
    yaml_path.write_text(
        "unet_compiler_e2e:\n"
        f"    base_path: {json.dumps(str(root))}\n"
        f"    checkpoints: {json.dumps(str(checkpoint_dir))}\n"
        f"    loras: {json.dumps(str(dirs['loras']))}\n"
        f"    controlnet: {json.dumps(str(dirs['controlnet']))}\n"
        f"    diffusion_models: {json.dumps(str(dirs['diffusion_models']))}\n"
        + "".join(f"    {name}: {json.dumps(str(dirs[name]))}\n" for name in folders)
        + f"    custom_nodes: {json.dumps(str(custom_nodes))}\n"
    )

    _make_room(log)
    port = _free_port()
    log_path = root / "comfyui.log"
    cmd = [
        sys.executable, "main.py",
        *(["--cpu"] if cpu else []),
        "--listen", "127.0.0.1",
        "--port", str(port),
        "--database-url", "sqlite:///:memory:",
        "--use-pytorch-cross-attention",
        "--extra-model-paths-config", str(yaml_path),
        *only_these_custom_nodes(comfyui_path, root, [PACK_ROOT.name, *(extra_nodes or {})]),
        "--output-directory", str(dirs["output"]),
        "--input-directory", str(dirs["input"]),
        "--temp-directory", str(dirs["temp"]),
        "--user-directory", str(dirs["user"]),
        "--disable-api-nodes",
        "--disable-auto-launch",
        *extra_args,
        "--log-stdout",
    ]
    full_env = subprocess_env()
    full_env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor_cache"))
    for k, v in (env or {}).items():   # None: unset it in the server
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    log_file = open(log_path, "wb")
    proc = subprocess.Popen(
        cmd,
        cwd=str(comfyui_path),
        env=full_env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log_file.close()   # the child holds its own descriptor
    server = ComfyServer(
        url=f"http://127.0.0.1:{port}",
        process=proc,
        log_path=log_path,
        output_dir=dirs["output"],
        comfyui_path=comfyui_path,
        pack_dir=custom_nodes / PACK_ROOT.name,
        model_dirs={k: dirs[k] for k in models},
        root=root,
    )
    try:
        t0 = time.time()
        deadline = t0 + SERVER_READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"ComfyUI exited during startup (rc={proc.returncode}); "
                    f"command: {' '.join(cmd)}\nlog tail ({log_path}):\n{_tail(log_path)}"
                )
            try:
                server.get_json("/system_stats", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.time() > deadline:
                raise RuntimeError(
                    f"ComfyUI was not ready after {SERVER_READY_TIMEOUT_S:.0f} s; "
                    f"log tail ({log_path}):\n{_tail(log_path)}"
                )
            time.sleep(0.5)
    except BaseException:
        _stop(proc)
        raise
    server.ready_s = time.time() - t0
    _LIVE.append(weakref.ref(server))
    if log is not None:
        log(f"ComfyUI ready at {server.url} in {server.ready_s:.1f} s (log: {log_path})")
    return server
