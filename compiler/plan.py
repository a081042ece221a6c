"""Find the leaf regions of a diffusion model and decide, per region, what runs there.

A Plan never touches the model: it is a list of (path, module, kind) plus the
regions deliberately left eager and why. ComfyUI's dispatch (UNetModel._forward,
forward_timestep_embed, BasicTransformerBlock.forward, SpatialTransformer.forward; a DiT's
forward_orig with its block loop) is never a region: it carries ControlNet control, patches
and patches_replace. A DiT's regions are its transformer blocks (``DIT_KINDS``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from . import cast
from .compat import comfy as comfy_compat
from .compat import diffusers as diffusers_compat

# region kinds, in report order
RESBLOCK = "resblock"
ATTENTION = "attention"
FEEDFORWARD = "feedforward"
NORM_ACT = "groupnorm_silu"
PROJECTION = "projection"
#: DiT blocks, named as ComfyUI's ``patches_replace["dit"]`` keys name them (Flux's stream blocks)
DOUBLE_BLOCK = "double_block"
SINGLE_BLOCK = "single_block"
#: Qwen-Image's transformer block (ComfyUI's patches_replace key for it is "double_block" too)
QWEN_IMAGE_BLOCK = "qwen_image_block"
#: Wan 2.x's WanAttentionBlock (its patches_replace key is "double_block" too)
WAN_BLOCK = "wan_block"
#: SD3.x's MMDiT JointBlock (its patches_replace key is "double_block" too)
JOINT_BLOCK = "joint_block"
#: Lumina 2's / Z-Image's JointTransformerBlock (its main layers, noise and context refiners)
LUMINA_BLOCK = "lumina_block"
DIT_KINDS = (DOUBLE_BLOCK, SINGLE_BLOCK, QWEN_IMAGE_BLOCK, WAN_BLOCK, JOINT_BLOCK, LUMINA_BLOCK)
KINDS = (RESBLOCK, ATTENTION, FEEDFORWARD, NORM_ACT, PROJECTION, *DIT_KINDS)
#: the skipped "region" of a model that is no UNet at all (the whole diffusion model)
NOT_A_UNET = "model"


@dataclass
class Region:
    path: str
    module: torch.nn.Module
    kind: str
    family: str  # "comfy" | "diffusers"
    #: submodules whose weights ComfyUI may cast/patch per call (checked each call)
    leaves: tuple = ()
    #: the method the runtime swaps for one call: ``forward``, or ``_forward`` for a
    #: VideoResBlock, whose own forward wraps ResBlock's 2-D body in the temporal mixing
    hook: str = "forward"


@dataclass
class Plan:
    family: str
    regions: list = field(default_factory=list)
    #: "unet" or "dit" (a diffusion transformer: its regions are whole blocks)
    arch: str = "unet"
    #: (kind, path, reason) for leaf regions left eager at plan time
    skipped: list = field(default_factory=list)

    @property
    def not_a_unet(self) -> str | None:
        """Why nothing of this model can be accelerated (another ComfyUI model family), or None."""
        return next((why for kind, _, why in self.skipped if kind == NOT_A_UNET), None)

    def kind_counts(self, impls) -> dict:
        """Region kind -> how many of this plan's regions ``impls`` (keyed by (family, kind)) has code
        for, in ``KINDS`` order."""
        counts = Counter(r.kind for r in self.regions if impls.get((r.family, r.kind)) is not None)
        return {k: counts[k] for k in KINDS if counts[k]}

    def skipped_summary(self) -> list[tuple[str, int, str]]:
        c = Counter((k, why) for k, _, why in self.skipped)
        return [(k, n, why) for (k, why), n in sorted(c.items())]


def _leaves(module):
    """The submodules whose weights ComfyUI may cast or patch per call: linears, convs and norms, and
    every other ComfyUI op (Qwen-Image's RMSNorm; a mixed-precision Linear, which is no
    ``nn.Linear``: left out, its cast ran inside the graph)."""
    return tuple(m for m in module.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d,
                                                              torch.nn.GroupNorm, torch.nn.LayerNorm))
                 or hasattr(type(m), "comfy_cast_weights"))


def family_of(module) -> str | None:
    if comfy_compat.is_comfy_unet(module):
        return "comfy"
    if diffusers_compat.is_diffusers_unet(module):
        return "diffusers"
    return None


def build_plan(unet: torch.nn.Module) -> Plan:
    fam = family_of(unet)
    if fam is None and comfy_compat.is_comfy_model(unet):
        dit = _dit_plan(unet)
        if dit is not None:
            return dit
        # another ComfyUI diffusion model (Cascade, a DiT without a body here): nothing to accelerate, not an error
        return Plan(family="comfy", skipped=[(NOT_A_UNET, "diffusion_model", comfy_compat.not_a_unet_reason(unet))])
    if fam is None:
        raise TypeError(
            f"{type(unet).__module__}.{type(unet).__name__} is not a supported UNet: pass ComfyUI's "
            f"openaimodel.UNetModel (model.model.diffusion_model) or a diffusers UNet2DConditionModel")
    plan = Plan(family=fam)
    covered: set[int] = set()

    def add(path, module, kind, leaves=None, hook="forward"):
        plan.regions.append(Region(path, module, kind, fam, _leaves(module) if leaves is None else leaves, hook))
        covered.update(id(m) for m in module.modules())

    if fam == "comfy":
        c = comfy_compat.classes()
        temporal: set[int] = set()  # modules inside a temporal (across-frames) part: never a region
        for path, m in unet.named_modules():
            if id(m) in temporal:
                continue
            t = type(m)
            if t is c["ResBlock"]:
                add(path, m, RESBLOCK)
            elif isinstance(m, c["VideoResBlock"]):
                _plan_video_resblock(plan, add, temporal, c, path, m)
            elif isinstance(m, c["SpatialVideoTransformer"]):
                _plan_video_transformer(plan, temporal, c, path, m)
            elif t is c["CrossAttention"]:
                add(path, m, ATTENTION)
            elif t is c["FeedForward"]:
                add(path, m, FEEDFORWARD)
        covered.update(temporal)
        out = getattr(unet, "out", None)
        if (isinstance(out, torch.nn.Sequential) and len(out) == 3 and isinstance(out[0], torch.nn.GroupNorm)
                and isinstance(out[1], torch.nn.SiLU)):
            add("out", out, NORM_ACT)
    else:
        c = diffusers_compat.classes()
        procs = served_processors()
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
        # a plain conv, ComfyUI's, or another pack's whose per-call weights its own cast makes (GGUF's)
        if type(m) in (torch.nn.Conv2d,) or (isinstance(m, torch.nn.Conv2d) and (
                type(m).__module__.startswith("comfy.ops") or cast.own_cast(type(m)))):
            if id(m) not in covered:
                add(path, m, PROJECTION)
    return plan


def _dit_plan(model) -> Plan | None:
    """The regions of a ComfyUI diffusion transformer: each block of a class the pack has a body for
    (``compat.comfy.dit_classes``), exactly that class (a subclass may change its forward). None when
    the model has none."""
    classes = comfy_compat.dit_classes()
    if not classes:
        return None
    plan = Plan(family="comfy", arch="dit")
    for path, m in model.named_modules():
        for kind, cls in classes.items():
            if type(m) is cls:
                why = _dit_block_unsupported(kind, m)
                if why is None:
                    plan.regions.append(Region(path, m, kind, "comfy", _leaves(m)))
                else:
                    plan.skipped.append((kind, path, why))
            elif isinstance(m, cls):
                plan.skipped.append((kind, path, f"{type(m).__name__} overrides {cls.__name__} (runs as given)"))
    return plan if plan.regions else None


def _dit_block_unsupported(kind, block) -> str | None:
    """Why a block of a body's exact class still runs as given (a part the body reads is of another
    class), or None."""
    if kind == WAN_BLOCK:
        parts = comfy_compat.wan_parts()
        if type(block.self_attn) is not parts.get("self") or type(block.cross_attn) not in parts.get("cross", ()):
            return (f"its attention ({type(block.self_attn).__name__}, {type(block.cross_attn).__name__}) is not "
                    f"Wan's own self / text or image cross-attention (runs as given)")
    if kind == JOINT_BLOCK:
        halves = (block.context_block, block.x_block)
        if any(getattr(h, "scale_mod_only", False) for h in halves):
            return "scale-only modulation (MMDiT's scale_mod_only) has no body (runs as given)"
        if type(block.context_block) is not type(block.x_block) or type(block.x_block).__name__ != "DismantledBlock":
            return f"its halves ({type(block.context_block).__name__}) are not MMDiT's DismantledBlock (runs as given)"
    return None


#: why the temporal parts of ComfyUI's video UNet (SVD, SV3D) run as ComfyUI's own code: they mix
#: frames (their shapes follow the frame count, which warmup's batch/size probes do not cover)
TEMPORAL_RESBLOCK = ("temporal ResBlock (VideoResBlock.time_stack: 3-D conv across frames, blended by time_mixer) "
                     "is not a 2-D leaf")
TEMPORAL_ATTENTION = ("temporal attention (SpatialVideoTransformer.time_stack: attends across frames, blended by "
                      "time_mixer) is not a 2-D leaf")
TEMPORAL_FEEDFORWARD = ("temporal feed-forward (SpatialVideoTransformer.time_stack, on frame sequences) "
                        "is not a 2-D leaf")
VIDEO_RESBLOCK_OVERRIDDEN = ("video ResBlock whose 2-D body is not ResBlock._forward (this ComfyUI overrides it) "
                             "runs as given")


def _plan_video_resblock(plan, add, temporal, c, path, block):
    """VideoResBlock = ResBlock's 2-D body on (b t) c h w, then a 3-D ResBlock across frames
    (``time_stack``) blended by ``time_mixer``. The 2-D body is a region (hooked at
    ``_forward``, which ResBlock.forward calls) only while it is ResBlock's own; the temporal
    half never is."""
    temporal.update(id(x) for part in (block.time_stack, block.time_mixer) for x in part.modules())
    plan.skipped.append((RESBLOCK, f"{path}.time_stack", TEMPORAL_RESBLOCK))
    if type(block)._forward is not c["ResBlock"]._forward:
        plan.skipped.append((RESBLOCK, path, VIDEO_RESBLOCK_OVERRIDDEN))
        temporal.update(id(x) for x in block.modules())
        return
    spatial = [block.in_layers, block.out_layers, block.skip_connection, block.h_upd, block.x_upd]
    if block.emb_layers is not None:
        spatial.append(block.emb_layers)
    add(path, block, RESBLOCK, leaves=tuple(x for part in spatial for x in _leaves(part)), hook="_forward")


def _plan_video_transformer(plan, temporal, c, path, st):
    """SpatialVideoTransformer: its spatial ``transformer_blocks`` are plain SD blocks (regions,
    visited by the caller's walk); its ``time_stack`` blocks attend across frames on
    (b h w) t c sequences and are left to ComfyUI, with ``time_pos_embed`` and ``time_mixer``."""
    for i, blk in enumerate(st.time_stack):
        for sub_path, sub in blk.named_modules():
            where = f"{path}.time_stack.{i}" + (f".{sub_path}" if sub_path else "")
            if type(sub) is c["CrossAttention"]:
                plan.skipped.append((ATTENTION, where, TEMPORAL_ATTENTION))
            elif type(sub) is c["FeedForward"]:
                plan.skipped.append((FEEDFORWARD, where, TEMPORAL_FEEDFORWARD))
    temporal.update(id(x) for part in (st.time_stack, st.time_pos_embed, st.time_mixer) for x in part.modules())


def served_processors() -> tuple:
    """The diffusers attention processors whose computation the attention body serves (SDPA or plain
    softmax attention, no extras); () without diffusers."""
    c = diffusers_compat.classes()
    return tuple(c[k] for k in ("AttnProcessor2_0", "AttnProcessor") if k in c)


def _diffusers_attention_unsupported(attn, procs) -> str | None:
    if not procs or type(attn.processor) not in procs:
        return f"custom attention processor {type(attn.processor).__name__} (e.g. IP-Adapter) runs as given"
    if (attn.spatial_norm is not None or attn.group_norm is not None or attn.norm_cross is not None
            or getattr(attn, "norm_q", None) is not None or attn.residual_connection
            or attn.rescale_output_factor != 1.0):
        return "attention with extra norms / residual / rescale runs as given"
    return None
