"""Find the leaf regions of a UNet and decide, per region, what runs there.

A Plan never touches the model: it is a list of (path, module, kind) plus the
regions deliberately left eager and why. ComfyUI's dispatch (UNetModel._forward,
forward_timestep_embed, BasicTransformerBlock.forward, SpatialTransformer.forward)
is never a region: it carries ControlNet control, patches and patches_replace.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from .compat import comfy as comfy_compat
from .compat import diffusers as diffusers_compat

# region kinds, in report order
RESBLOCK = "resblock"
ATTENTION = "attention"
FEEDFORWARD = "feedforward"
NORM_ACT = "groupnorm_silu"
PROJECTION = "projection"
KINDS = (RESBLOCK, ATTENTION, FEEDFORWARD, NORM_ACT, PROJECTION)


@dataclass
class Region:
    path: str
    module: torch.nn.Module
    kind: str
    family: str  # "comfy" | "diffusers"
    #: submodules whose weights ComfyUI may cast/patch per call (checked each call)
    leaves: tuple = ()


@dataclass
class Plan:
    family: str
    regions: list = field(default_factory=list)
    #: (kind, path, reason) for leaf regions left eager at plan time
    skipped: list = field(default_factory=list)

    def skipped_summary(self) -> list[tuple[str, int, str]]:
        c = Counter((k, why) for k, _, why in self.skipped)
        return [(k, n, why) for (k, why), n in sorted(c.items())]


def _leaves(module):
    return tuple(m for m in module.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d,
                                                              torch.nn.GroupNorm, torch.nn.LayerNorm)))


def family_of(module) -> str | None:
    if comfy_compat.is_comfy_unet(module):
        return "comfy"
    if diffusers_compat.is_diffusers_unet(module):
        return "diffusers"
    return None


def build_plan(unet: torch.nn.Module) -> Plan:
    fam = family_of(unet)
    if fam is None:
        raise TypeError(
            f"{type(unet).__module__}.{type(unet).__name__} is not a supported UNet: pass ComfyUI's "
            f"openaimodel.UNetModel (model.model.diffusion_model) or a diffusers UNet2DConditionModel")
    plan = Plan(family=fam)
    covered: set[int] = set()

    def add(path, module, kind):
        plan.regions.append(Region(path, module, kind, fam, _leaves(module)))
        covered.update(id(m) for m in module.modules())

    if fam == "comfy":
        c = comfy_compat.classes()
        for path, m in unet.named_modules():
            t = type(m)
            if t is c["ResBlock"]:
                add(path, m, RESBLOCK)
            elif isinstance(m, c["VideoResBlock"]):
                plan.skipped.append((RESBLOCK, path, "video ResBlock (temporal mixing) is not a 2-D leaf"))
                covered.update(id(x) for x in m.modules())
            elif t is c["CrossAttention"]:
                add(path, m, ATTENTION)
            elif t is c["FeedForward"]:
                add(path, m, FEEDFORWARD)
        out = getattr(unet, "out", None)
        if (isinstance(out, torch.nn.Sequential) and len(out) == 3 and isinstance(out[0], torch.nn.GroupNorm)
                and isinstance(out[1], torch.nn.SiLU)):
            add("out", out, NORM_ACT)
    else:
        c = diffusers_compat.classes()
        procs = tuple(c[k] for k in ("AttnProcessor2_0", "AttnProcessor") if k in c)
        for path, m in unet.named_modules():
            if "ResnetBlock2D" in c and type(m) is c["ResnetBlock2D"]:
                if m.time_emb_proj is None or m.time_embedding_norm != "default" or m.upsample or m.downsample:
                    plan.skipped.append((RESBLOCK, path, "ResnetBlock2D variant (scale-shift / up-down) not admitted"))
                else:
                    add(path, m, RESBLOCK)
            elif "Attention" in c and type(m) is c["Attention"]:
                why = _diffusers_attention_unsupported(m, procs)
                if why:
                    plan.skipped.append((ATTENTION, path, why))
                else:
                    add(path, m, ATTENTION)
            elif "FeedForward" in c and type(m) is c["FeedForward"]:
                add(path, m, FEEDFORWARD)

    for path, m in unet.named_modules():
        if type(m) in (torch.nn.Conv2d,) or (isinstance(m, torch.nn.Conv2d) and type(m).__module__.startswith("comfy.ops")):
            if id(m) not in covered:
                add(path, m, PROJECTION)
    return plan


def _diffusers_attention_unsupported(attn, procs) -> str | None:
    if not procs or type(attn.processor) not in procs:
        return f"custom attention processor {type(attn.processor).__name__} (e.g. IP-Adapter) runs as given"
    if (attn.spatial_norm is not None or attn.group_norm is not None or attn.norm_cross is not None
            or getattr(attn, "norm_q", None) is not None or attn.residual_connection
            or attn.rescale_output_factor != 1.0):
        return "attention with extra norms / residual / rescale runs as given"
    return None
