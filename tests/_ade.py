"""Kosinkadink/ComfyUI-AnimateDiff-Evolved's real motion modules beside the pack, for tests: its
``VanillaTemporalModule`` (temporal attention over a video's frames, ``(b f) d c -> (b d) f c``)
inserted into a tiny UNet by its own ``AnimateDiffModel._inject`` / ``_eject``, through ComfyUI's
patcher injections (``ModelPatcher.set_injections``: inserted when ComfyUI loads the model, taken
out when it unloads it), as its loaders do.

The pack is found at ``COMFYUI_ADE_PATH``, else ``~/comfy/ComfyUI-AnimateDiff-Evolved``, else in the
ComfyUI tree's custom_nodes; without it the tests that use it skip with one line.
"""
from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

PACKAGE = "comfyui_ade_under_test"
KEY = "ADE"     # the injection key its loaders use


def where(comfy_path: Path | None = None) -> Path | None:
    given = os.environ.get("COMFYUI_ADE_PATH")
    places = [Path(given)] if given else [Path.home() / "comfy" / "ComfyUI-AnimateDiff-Evolved"]
    if comfy_path is not None and not given:
        places += [comfy_path / "custom_nodes" / n for n in ("ComfyUI-AnimateDiff-Evolved", "comfyui-animatediff-evolved")]
    return next((p for p in places if (p / "animatediff" / "motion_module_ad.py").is_file()), None)


def problem(comfy_path: Path | None = None) -> str | None:
    if where(comfy_path) is None:
        return ("ComfyUI-AnimateDiff-Evolved not found: set COMFYUI_ADE_PATH to a checkout of "
                "Kosinkadink/ComfyUI-AnimateDiff-Evolved (or put one at ~/comfy/ComfyUI-AnimateDiff-Evolved)")
    return None


def load(comfy_path: Path | None = None, module: str = "motion_module_ad"):
    """Its ``animatediff.<module>`` module (``motion_module_ad`` by default), imported without the
    pack's ``__init__`` (which registers its nodes); ComfyUI must be importable."""
    path = where(comfy_path)
    for name, folder in ((PACKAGE, path), (f"{PACKAGE}.animatediff", path / "animatediff")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(folder)]
            sys.modules[name] = pkg
    return importlib.import_module(f"{PACKAGE}.animatediff.{module}")


def motion_injection(mm, unet, frames: int, seed: int = 7):
    """A ComfyUI ``PatcherInjection`` that inserts AnimateDiff motion modules sized for ``unet`` (a
    tiny ComfyUI UNetModel: one module per res block of each level, one in the middle) by the pack's
    own ``_inject``, their video length ``frames``, random weights (its zero-initialised output
    projection would make them do nothing); ``_eject`` takes them out. Returns (injection, modules)."""
    import comfy.ops
    import torch
    from comfy.patcher_extension import PatcherInjection

    from unet_compiler.tests._families import init_random

    def block(c, kind, idx, n):
        return types.SimpleNamespace(motion_modules=[
            mm.VanillaTemporalModule(c, block_type=kind, block_idx=idx, module_idx=i, num_attention_heads=8,
                                     temporal_pe=True, temporal_pe_max_len=32, ops=comfy.ops.disable_weight_init)
            for i in range(n)])
    base = unet.model_channels
    widths = [base * m for m in unet.channel_mult]
    per_level = unet.num_res_blocks[0]
    down = [block(c, "down", i, per_level) for i, c in enumerate(widths)]
    up = [block(c, "up", i, per_level + 1) for i, c in enumerate(reversed(widths))]
    mid = block(widths[-1], "mid", 0, 1)
    modules = [m for b in (*down, *up, mid) for m in b.motion_modules]
    holder = torch.nn.ModuleList(modules)
    init_random(holder, seed, scale=0.5)
    holder.eval()
    for m in modules:
        m.set_video_length(frames, frames)

    def inject(patcher):
        u = patcher.model.diffusion_model
        mm.AnimateDiffModel._inject(None, u.input_blocks, down)
        mm.AnimateDiffModel._inject(None, u.output_blocks, up)
        mm.AnimateDiffModel._inject(None, [u.middle_block], [mid])

    def eject(patcher):
        u = patcher.model.diffusion_model
        for blocks in (u.input_blocks, u.output_blocks, [u.middle_block]):
            mm.AnimateDiffModel._eject(None, blocks)
    return PatcherInjection(inject=inject, eject=eject), modules
