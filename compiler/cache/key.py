"""What a compile cache entry depends on, and its key: the UNet's architecture, device, torch,
triton, the CPU code's target (its vector ISA), the CompileConfig, the pack's version and compiled
code, and the versions of ComfyUI, diffusers and PEFT."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import torch

from . import cpu_isa

FORMAT = "unet-compiler-mega-cache-2"
PACK_VERSION = "0.1.0"   # pyproject's version; a new release is a new key
#: the pack's code that compiled variants carry (their bytecode): a change is a new key
_COMPILED_CODE = ("regions.py", "lifecycle/precompiled.py", "lifecycle/variants.py", "passes/*.py", "backends/*.py")


def architecture(unet: torch.nn.Module) -> str:
    """A fingerprint of the UNet's structure (not its weights: parameters are graph inputs)."""
    h = hashlib.sha256(f"{type(unet).__module__}.{type(unet).__qualname__}".encode())
    for name, t in list(unet.named_parameters()) + list(unet.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return h.hexdigest()


def key_facts(unet, config, device) -> dict:
    """What an entry depends on, as written into its .json."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    capability = None
    if dev.type == "cuda" and torch.cuda.is_available():
        capability = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {"format": FORMAT, "architecture": architecture(unet), "device": dev.type, "capability": capability,
            "torch": torch.__version__, "triton": triton_version, "config": dataclasses.asdict(config),
            "pack": PACK_VERSION, "code": code_digest(), "comfyui": _comfyui_version(), "traced": traced_libraries(),
            "cpu": cpu_isa.build_facts()}   # (any entry may hold CPU code: a GPU model's CPU-side variants)


@functools.lru_cache(maxsize=1)
def traced_libraries() -> dict:
    """The versions of the libraries whose module code the variants trace besides ComfyUI's (a diffusers
    UNet's blocks, PEFT's LoRA layers called inside a region), where installed: an upgrade is a new key."""
    from importlib import metadata
    out = {}
    for name in ("diffusers", "peft"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """The pack's compiled code (region bodies, graph passes, backends): precompiled variants carry
    its bytecode, so a changed body is a new entry even without a version bump."""
    h = hashlib.sha256()
    for p in compiled_files():
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def compiled_files() -> list[Path]:
    """The files :func:`code_digest` reads (each pattern of ``_COMPILED_CODE`` matched)."""
    root = Path(__file__).resolve().parents[1]
    return sorted(p for pattern in _COMPILED_CODE for p in root.glob(pattern))


def _comfyui_version() -> str | None:
    """ComfyUI's version when inside it: its module classes' defaults are code the variants were traced over."""
    try:
        import comfyui_version
        return str(comfyui_version.__version__)
    except Exception:
        return None


def key_of(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]
