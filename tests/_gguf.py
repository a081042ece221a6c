"""city96/ComfyUI-GGUF's real code beside the pack, for tests: its ops (GGMLOps: dequantisation per
call), its model patcher (LoRA applied after dequantisation per call) and random-weight tiny UNets
in its quant types, built the way its UnetLoaderGGUF builds a model (ComfyUI's model with
``custom_operations=GGMLOps()``, a state dict of GGMLTensors).

The pack is found at ``COMFYUI_GGUF_PATH``, else ``~/comfy/ComfyUI-GGUF``, else in the ComfyUI tree's
custom_nodes; without it (or without the ``gguf`` package) the tests that use it skip with one line.
"""
from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

PACKAGE = "comfyui_gguf_under_test"
#: the quant types the tests build, and how: gguf-py's own quantizer, or random blocks (gguf-py has
#: no K-quant quantizer: a K block's bytes are random, its fp16 scales set to give weights ~0.05)
TYPES = ("Q8_0", "Q4_K", "Q5_K", "F16")


def where(comfy_path: Path | None = None) -> Path | None:
    """The ComfyUI-GGUF checkout the tests use, or None."""
    given = os.environ.get("COMFYUI_GGUF_PATH")
    places = [Path(given)] if given else [Path.home() / "comfy" / "ComfyUI-GGUF"]
    if comfy_path is not None and not given:
        places += [comfy_path / "custom_nodes" / n for n in ("ComfyUI-GGUF", "comfyui-gguf")]
    return next((p for p in places if (p / "ops.py").is_file() and (p / "dequant.py").is_file()), None)


def problem(comfy_path: Path | None = None) -> str | None:
    """Why the GGUF tests cannot run here (one line naming the fix), or None."""
    if where(comfy_path) is None:
        return ("ComfyUI-GGUF not found: set COMFYUI_GGUF_PATH to a checkout of city96/ComfyUI-GGUF "
                "(or put one at ~/comfy/ComfyUI-GGUF)")
    try:
        import gguf  # noqa: F401
    except ImportError:
        return "the gguf package is missing: bin/setup installs it (pip install gguf)"
    return None


def load(comfy_path: Path | None = None) -> types.SimpleNamespace:
    """ComfyUI-GGUF's modules (ops, dequant, nodes), imported as a package without its ``__init__``
    (which registers its nodes); ComfyUI must be importable."""
    path = where(comfy_path)
    if PACKAGE not in sys.modules:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = [str(path)]
        sys.modules[PACKAGE] = pkg
    mods = {n: importlib.import_module(f"{PACKAGE}.{n}") for n in ("ops", "dequant", "nodes")}
    return types.SimpleNamespace(**mods, path=path)


def _blocks_k(numel: int, qtype, rng) -> np.ndarray:
    """Random K-quant blocks (Q4_K, Q5_K, Q6_K) of ``numel`` values with small fp16 scales."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(numel // block, size), dtype=np.uint8)
    name = qtype.name
    d = np.full(len(raw), 2e-4, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    if name == "Q6_K":            # ql, qh, scales, d
        raw[:, -2:] = d
    else:                         # d, dmin, scales, ...: w = d * sc * q - dmin * m
        raw[:, 0:2] = d
        raw[:, 2:4] = np.full(len(raw), 2e-4 * (8 if name == "Q4_K" else 16),
                              dtype=np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def quantize(gg, t: torch.Tensor, qtype_name: str, seed: int = 0):
    """``t`` stored the way a GGUF file holds it, as ComfyUI-GGUF's loader hands it: a GGMLTensor of
    the packed bytes (``tensor_type``, ``tensor_shape`` the logical shape). 1-D tensors and tensors
    whose size is not a whole number of blocks stay F32, as the pack's converter keeps them."""
    import gguf
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if t.dim() < 2 or t.numel() % block:
        qtype, data = gguf.GGMLQuantizationType.F32, t.detach().float().contiguous()
    elif qtype_name == "F16":
        data = t.detach().to(torch.float16).contiguous()
    elif qtype_name.endswith("_K"):
        data = torch.from_numpy(_blocks_k(t.numel(), qtype, np.random.default_rng(seed)))
    else:
        data = torch.from_numpy(gguf.quants.quantize(t.detach().float().reshape(-1, block).numpy(), qtype))
    return gg.ops.GGMLTensor(data, tensor_type=qtype, tensor_shape=t.shape)


def tiny_unet(gg, kind: str, qtype_name: str, seed: int = 0):
    """A random-weight tiny ``kind`` UNet (the tests' TINY configs) on ComfyUI-GGUF's ops, its weights
    in ``qtype_name``, in ComfyUI-GGUF's model patcher: what its UnetLoaderGGUF returns for such a
    file (fp32 compute on this CPU)."""
    import comfy.model_patcher
    import comfy.supported_models as sm

    from unet_compiler.tests._patch_compat import TINY, init_random
    spec = TINY[kind]
    plain = getattr(sm, spec["cls"])(dict(spec["unet"]))
    plain.unet_config = dict(spec["unet"])
    ref = plain.get_model({})
    init_random(ref.diffusion_model, seed)
    sd = {k: quantize(gg, v, qtype_name, seed + i) for i, (k, v) in enumerate(ref.diffusion_model.state_dict().items())}
    cfg = getattr(sm, spec["cls"])(dict(spec["unet"]))
    cfg.unet_config = dict(spec["unet"])
    cfg.custom_operations = gg.ops.GGMLOps()
    base = cfg.get_model({})
    missing, unexpected = base.diffusion_model.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("temp.weight")], (missing, unexpected)
    base.eval()
    mp = comfy.model_patcher.ModelPatcher(base, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    return gg.nodes.GGUFModelPatcher.clone(mp)
