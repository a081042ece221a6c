"""ComfyUI's core patch nodes, alone and stacked, through real KSampler sampling: eager vs
Compile UNet on the same nodes (the patch-node half of the compatibility table; the other half,
model families, is tests/_families.py). Used by tests/nodes/test_patch_nodes.py, which asserts on every
case, and by the bench (both import it as ``unet_compiler.tests._patch_compat``); the table alone::

    python -m unet_compiler.bench compat --only patches [--full]

(``python -m unet_compiler.bench run --compat`` prints it after the family table.) It needs a
ComfyUI tree (``COMFYUI_PATH`` or ``~/comfy/ComfyUI``); nothing is downloaded.

Everything is ComfyUI's own code on tiny random-weight models: an SD1.5- or SDXL-shaped UNet
built by ComfyUI's ``supported_models`` class (``build_tiny``), a tiny SD1 / SDXL CLIP
(``comfy.sd.CLIP`` with a narrow CLIPTextModel, real tokenizer) that encodes prompts as
CLIPTextEncode does, a ControlNet built from ``comfy.cldm.cldm.ControlNet`` with the tiny
UNet's config, a T2I-Adapter from ``comfy.t2i_adapter.adapter.Adapter``, a kohya LoRA file for
the hook nodes, and the core nodes' own classes. Sampling is ``comfy.sample.sample``
(KSampler's path: euler / normal, 3 steps, cfg 5, 64 px) under ``torch.inference_mode()`` as
ComfyUI's executor runs it.
"""
from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import torch

from unet_compiler.tests._families import import_comfy, init_random

PACK_ROOT = Path(__file__).resolve().parents[1]   # the checkout

STEPS = 3
CFG = 5.0
SEED = 42
PROMPT, NEGATIVE = "a photo of a cat", "blurry"
# tiny text encoders for CLIPTextEncode: SD1.5's CLIP-L 64 wide (the UNets' context_dim); SDXL's
# CLIP-L 16 + CLIP-G 48 wide (context 64), whose pooled output (48) plus the SDXL size embedding
# (6 x Timestep(8) = 48) fills the tiny SDXL's 96-wide ADM input
_LAYER = {"num_attention_heads": 2, "num_hidden_layers": 3}   # SDXL reads the penultimate layer
CLIP_CONFIGS = {
    "sd15": {"clip_l_model_config": dict(_LAYER, hidden_size=64, intermediate_size=128)},
    "sdxl": {"clip_l_model_config": dict(_LAYER, hidden_size=16, intermediate_size=32),
             "clip_g_model_config": dict(_LAYER, hidden_size=48, intermediate_size=96)},
}
SDXL_EMBED_DIM = 8
#: latent side of every case (x8 pixels) unless SIZES says otherwise
LATENT = 8
#: compiled vs eager of the same nodes: max |diff| <= REL * max(1, max |eager|). The compiled regions
#: differ from eager by float rounding (SDPA vs ComfyUI's attention, inductor's fused reductions);
#: 3 sampler steps at cfg 5 carry that into a latent whose values reach a few hundred
REL = 1e-4

#: the tiny UNets, one per ComfyUI model class (also tests/conftest.py's ``make_comfy_model``)
TINY = {
    # SD1.5-shaped: conv proj_in/out, 4-head cross-attention on a CLIP-like context
    "sd15": dict(cls="SD15", unet=dict(context_dim=64, model_channels=32, use_linear_in_transformer=False,
                                       adm_in_channels=None, use_temporal_attention=False, in_channels=4,
                                       out_channels=4, num_res_blocks=[1, 1], channel_mult=[1, 2],
                                       transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                                       transformer_depth_middle=1, num_heads=4, num_head_channels=-1,
                                       use_spatial_transformer=True, legacy=False, image_size=32)),
    # SDXL-shaped: linear proj_in/out, head dim 8, label_emb on an ADM vector, deeper middle
    "sdxl": dict(cls="SDXL", unet=dict(context_dim=64, model_channels=32, use_linear_in_transformer=True,
                                       adm_in_channels=96, use_temporal_attention=False, in_channels=4,
                                       out_channels=4, num_res_blocks=[1, 1], channel_mult=[1, 2],
                                       transformer_depth=[0, 2], transformer_depth_output=[0, 0, 2, 2],
                                       transformer_depth_middle=2, num_head_channels=8, num_heads=-1,
                                       use_spatial_transformer=True, legacy=False, image_size=32,
                                       num_classes="sequential")),
}


def build_tiny(kind="sd15", seed=0, device="cpu", weight_dtype=None, manual_cast=torch.float32):
    """A random-weight tiny SD1.5/SDXL-shaped BaseModel from ComfyUI's own classes, in a real
    ModelPatcher that loads on ``device`` and offloads to the CPU. ``weight_dtype``: a storage
    dtype (fp8, fp16, ...) ComfyUI casts to ``manual_cast`` per call (its manual_cast ops; None:
    the model computes in ``weight_dtype`` itself)."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    spec = TINY[kind]
    cfg = getattr(sm, spec["cls"])(dict(spec["unet"]))
    cfg.unet_config = dict(spec["unet"])
    if weight_dtype is not None:
        cfg.set_inference_dtype(weight_dtype, manual_cast)
    base = cfg.get_model({})
    init_random(base.diffusion_model, seed)
    base.eval()
    return comfy.model_patcher.ModelPatcher(base, load_device=torch.device(device), offload_device=torch.device("cpu"))


def node(cls, *args, **kwargs):
    """Run a ComfyUI node class the way the executor does and return its first output
    (V3 ``execute`` -> NodeOutput, V1 ``FUNCTION`` -> tuple)."""
    if hasattr(cls, "define_schema"):
        out = cls.execute(*args, **kwargs)
    else:
        out = getattr(cls(), cls.FUNCTION)(*args, **kwargs)
    return out.result[0] if hasattr(out, "result") else out[0]


# ---- models and conditioning --------------------------------------------------------------
def tiny_clip(kind: str, seed: int = 5):
    """The text encoder ComfyUI loads for an SD1.5 / SDXL checkpoint (SD1ClipModel /
    SDXLClipModel, real tokenizers), narrowed through ComfyUI's own ``<clip>_model_config``
    model options."""
    import comfy.sd
    import comfy.sd1_clip
    import comfy.sdxl_clip
    from comfy.supported_models_base import ClipTarget
    target = (ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel) if kind == "sd15"
              else ClipTarget(comfy.sdxl_clip.SDXLTokenizer, comfy.sdxl_clip.SDXLClipModel))
    options = {k: dict(v) for k, v in CLIP_CONFIGS[kind].items()}
    clip = comfy.sd.CLIP(target, model_options=dict(options, dtype=torch.float32))
    init_random(clip.cond_stage_model, seed)
    return clip


def encode(clip, text):
    """CLIPTextEncode."""
    import nodes
    return node(nodes.CLIPTextEncode, clip=clip, text=text)


def fit_sdxl_adm(mp):
    """The tiny SDXL's ADM input is 96 wide: ComfyUI's own SDXL.encode_adm (pooled output +
    Timestep embeddings of height, width, crops, target size) with a narrower embedder."""
    base = mp.model
    if type(base).__name__ == "SDXL":
        base.embedder = type(base.embedder)(SDXL_EMBED_DIM)
    return mp


def tiny_controlnet(mp, seed: int = 11):
    """A ControlNet of the tiny UNet's shape from comfy.cldm, wrapped as load_controlnet does."""
    import comfy.cldm.cldm
    import comfy.controlnet
    import comfy.ops
    cfg = dict(mp.model.model_config.unet_config)
    cfg.pop("out_channels", None)
    cfg.update(hint_channels=3, operations=comfy.ops.disable_weight_init, dtype=torch.float32, device="cpu")
    control_model = init_random(comfy.cldm.cldm.ControlNet(**cfg), seed, scale=0.5)
    return comfy.controlnet.ControlNet(control_model, load_device=mp.load_device, manual_cast_dtype=None)


def tiny_t2i_adapter(seed: int = 12):
    """An SDXL-layout T2I-Adapter (pixel-unshuffle 16, cin 3*256 as load_t2i_adapter detects
    it) whose two 64-channel levels land on the tiny UNet's input block 3 and middle block."""
    import comfy.controlnet
    from comfy.t2i_adapter.adapter import Adapter
    torch.manual_seed(seed)
    ad = Adapter(cin=3 * 16 * 16, channels=[64, 64], nums_rb=2, ksize=1, sk=True, use_conv=False, xl=True)
    return comfy.controlnet.T2IAdapter(ad, ad.input_channels, 8, "nearest-exact")


def hint_image(side: int, seed: int = 13):
    return torch.rand((1, side, side, 3), generator=torch.Generator().manual_seed(seed))


def apply_control(pos, neg, control, side, strength=0.8):
    """ControlNetApplyAdvanced (ControlNet or T2I-Adapter object, both conditionings)."""
    import nodes
    out = nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, control, hint_image(side), strength, 0.0, 1.0)
    return out[0], out[1]


def kohya_lora(mp, scale=0.3, seed=3, te_keys=()):
    """A kohya-format LoRA (rank 4) on every ResBlock's first conv and every attention to_k/to_v."""
    import comfy.lora
    key_map = comfy.lora.model_lora_keys_unet(mp.model, {})
    sd_model = mp.model.state_dict()
    g = torch.Generator().manual_seed(seed)
    by_model_key = {}
    for k, v in key_map.items():
        if k.startswith("lora_unet_") and any(s in k for s in ("in_layers_2", "to_k", "to_v")):
            by_model_key.setdefault(v if isinstance(v, str) else v[0], k)
    sd = {}
    for model_key, name in by_model_key.items():
        w = sd_model[model_key]
        extra = tuple(w.shape[2:])
        sd[f"{name}.lora_down.weight"] = torch.randn((4, w.shape[1]) + extra, generator=g) * scale
        sd[f"{name}.lora_up.weight"] = torch.randn((w.shape[0], 4) + (1,) * len(extra), generator=g) * scale
        sd[f"{name}.alpha"] = torch.tensor(4.0)
    return sd


class IPAdapterAttn2:
    """What IPAdapter-style packs register with ``set_model_attn2_replace``: a callable
    object holding extra to_k_ip / to_v_ip projections and image tokens; it runs the text
    attention plus a weighted image attention."""

    calls = 0   # class-wide: ModelPatcher.clone deep-copies model_options, patch objects included

    def __init__(self, weight=0.7, tokens=4, seed=21):
        self.weight, self.tokens, self.seed = weight, tokens, seed
        self.layers = {}

    def _ip(self, dim):
        if dim not in self.layers:
            g = torch.Generator().manual_seed(self.seed + dim)
            emb = torch.randn(1, self.tokens, 64, generator=g)
            wk, wv = (torch.randn(dim, 64, generator=g) / 8 for _ in range(2))
            self.layers[dim] = (emb @ wk.T, emb @ wv.T)
        return self.layers[dim]

    def __call__(self, q, k, v, extra_options):
        from comfy.ldm.modules.attention import optimized_attention
        type(self).calls += 1
        heads = extra_options["n_heads"]
        out = optimized_attention(q, k, v, heads)
        ip_k, ip_v = (t.to(q).expand(q.shape[0], -1, -1) for t in self._ip(q.shape[-1]))
        return out + self.weight * optimized_attention(q, ip_k, ip_v, heads)


# ---- sampling --------------------------------------------------------------------------
def sample(model, pos, neg, size=(8, 8), steps=STEPS, cfg=CFG, seed=SEED):
    """KSampler (euler / normal, denoise 1) on an empty latent of size (h, w) (x8 pixels)."""
    import comfy.sample
    latent = torch.zeros((1, 4) + tuple(size))
    noise = comfy.sample.prepare_noise(latent, seed)
    torch.manual_seed(seed)   # patches that draw from torch's RNG (ToMe) draw the same on both sides
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, cfg, "euler", "normal", pos, neg, latent,
                                   seed=seed, disable_pbar=True)


def run(model, pos, neg, size=(8, 8)):
    """The sample, or the exception ComfyUI raised (with its formatted traceback)."""
    try:
        return sample(model, pos, neg, size), None
    except Exception as e:  # noqa: BLE001 - compared between eager and compiled
        return None, (e, traceback.format_exc())


# ---- the report table ---------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    case: str
    family: str
    order: str
    regions: dict           # region kind -> accelerated region calls
    region_eager: int       # region calls the shims ran eager
    effects: list           # the report's patch lines
    max_diff: float | None  # max |compiled - eager| of the sampled latent
    outcome: str = "match"
    graphs: int = 0         # dynamo graphs this case compiled (0: reused what earlier cases compiled)
    compile_s: float = 0.0  # seconds spent in UNet calls that compiled
    notes: list = dataclasses.field(default_factory=list)   # region kinds the backend failed on

    def effect_text(self) -> str:
        text = "; ".join(self.effects) or "(no UNet patch: nothing named)"
        if self.notes:
            text += " -- note: " + "; ".join(self.notes)
        return text


def patch_lines(text: str) -> list[str]:
    return [ln.strip()[len("patch "):] for ln in text.splitlines() if ln.strip().startswith("patch ")]


def format_table(rows: list[Row]) -> str:
    """Markdown: node / stack | family | model and order | accelerated region calls | region calls
    run eager | the report's patch lines | max |compiled - eager| (and the outcome) | graphs compiled."""
    head = ["node / stack", "family", "order", "accelerated region calls", "region calls run eager",
            "what the report says each patch did", "max |compiled - eager|", "new graphs (s)"]
    body = []
    for r in rows:
        acc = ", ".join(f"{k} {n}" for k, n in r.regions.items() if n) or "none"
        diff = "-" if r.max_diff is None else f"{r.max_diff:.2e}"
        body.append([r.case, r.family, r.order, acc, str(r.region_eager), r.effect_text(),
                     diff if r.outcome == "match" else f"{diff} ({r.outcome})" if r.max_diff is not None
                     else r.outcome, f"{r.graphs} ({r.compile_s:.0f})"])
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(b) for b in body]
    return "\n".join(out)


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def scaled_tol(ref: torch.Tensor, rel: float) -> float:
    return rel * max(1.0, float(ref.abs().max()))


# ---- the patch nodes, as a user wires them ---------------------------------------------------
def freeu(ctx, m):
    from comfy_extras.nodes_freelunch import FreeU
    return node(FreeU, m, 1.1, 1.2, 0.9, 0.2)


def freeu_v2(ctx, m):
    from comfy_extras.nodes_freelunch import FreeU_V2
    return node(FreeU_V2, m, 1.3, 1.4, 0.9, 0.2)


def pag(ctx, m):
    from comfy_extras.nodes_pag import PerturbedAttentionGuidance
    return node(PerturbedAttentionGuidance, m, 3.0)


def sag(ctx, m):
    from comfy_extras.nodes_sag import SelfAttentionGuidance
    return node(SelfAttentionGuidance, m, 0.5, 2.0)


def hypertile(ctx, m):
    # 32 px (4 latent) tiles, two levels deep (SDXL has no attention at full resolution): 2x2 tiles
    # at SD1.5's 8x8 level and SDXL's 8x8 second level (a 16x16 latent); swap_size 1 draws no
    # random divisor
    from comfy_extras.nodes_hypertile import HyperTile
    return node(HyperTile, m, 32, 1, 1, False)


def deep_shrink(ctx, m, factor=2.0):
    # Kohya Deep Shrink: block 1 scaled down for the first 35% of the schedule, then full size
    from comfy_extras.nodes_model_downscale import PatchModelAddDownscale
    return node(PatchModelAddDownscale, m, 1, factor, 0.0, 0.35, True, "bicubic", "bicubic")


def deep_shrink_x4(ctx, m):
    # at 64 px the tiny SD1.5's middle block becomes 1x1: its GroupNorm (32 channels, 32 groups)
    # has one value per group and raises in plain ComfyUI
    return deep_shrink(ctx, m, 4.0)


def rescale_cfg(ctx, m):
    from comfy_extras.nodes_model_advanced import RescaleCFG
    return node(RescaleCFG, m, 0.7)


def vpred_zsnr(ctx, m):
    from comfy_extras.nodes_model_advanced import ModelSamplingDiscrete
    return node(ModelSamplingDiscrete, m, "v_prediction", True)


def tome(ctx, m):
    from comfy_extras.nodes_tomesd import TomePatchModel
    return node(TomePatchModel, m, 0.5)


#: one input and one output block with cross-attention (the tiny SDXL, like SDXL, has none at full resolution)
IPA_BLOCKS = {"sd15": (("input", 1), ("output", 2)), "sdxl": (("input", 3), ("output", 1))}


def ipadapter_attn2(ctx, m):
    m = m.clone()
    ip = IPAdapterAttn2()
    for block in IPA_BLOCKS[ctx.kind]:
        m.set_model_attn2_replace(ip, *block)
    return m


def attn1_reference(ctx, m):
    """A custom attn1 replace (reference-only style: self-attention over damped keys), keyed
    by (block, id, transformer index) as some packs register it."""
    def damped_self_attention(q, k, v, extra_options):
        from comfy.ldm.modules.attention import optimized_attention
        return optimized_attention(q, k * 0.5, v, extra_options["n_heads"])
    m = m.clone()
    m.set_model_attn1_replace(damped_self_attention, "output", 1, 0)
    return m


LORA_NAME = "tiny_lora.safetensors"


def _lora_file(ctx, mp):
    import folder_paths
    from safetensors.torch import save_file
    d = ctx.tmp / "loras"
    d.mkdir(parents=True, exist_ok=True)
    save_file(kohya_lora(mp), str(d / LORA_NAME))
    folder_paths.add_model_folder_path("loras", str(d))
    return LORA_NAME


def hook_lora_conds(ctx, mp):
    """CreateHookLora -> two HookKeyframes (strength 1.0, then 0.25 from 50%) -> SetHookKeyframes
    -> SetClipHooks(apply_to_conds) -> CLIPTextEncode: the positive prompt carries a scheduled
    LoRA, the negative none, so cond and uncond run under different weights in every step."""
    from comfy_extras import nodes_hooks as NH
    hooks = node(NH.CreateHookLora, lora_name=_lora_file(ctx, mp), strength_model=1.0, strength_clip=1.0)
    kf = node(NH.CreateHookKeyframe, strength_mult=1.0, start_percent=0.0)
    kf = node(NH.CreateHookKeyframe, strength_mult=0.25, start_percent=0.5, prev_hook_kf=kf)
    hooks = node(NH.SetHookKeyframes, hooks=hooks, hook_kf=kf)
    clip = node(NH.SetClipHooks, clip=ctx.clip, apply_to_conds=True, schedule_clip=False, hooks=hooks)
    return encode(clip, PROMPT), ctx.neg


def controlnet_conds(ctx, mp):
    return apply_control(ctx.pos, ctx.neg, tiny_controlnet(mp), 64)


def t2i_conds(ctx, mp):
    return apply_control(ctx.pos, ctx.neg, tiny_t2i_adapter(), 64)


def stack(*fns):
    def apply(ctx, m):
        for fn in fns:
            m = fn(ctx, m)
        return m
    return apply


# ---- cases: what the report must say about each patch ---------------------------------------
BETWEEN = "runs between regions"


def _instead(at):
    return f"attention at {at} runs the patch's code instead"


FREEU = f"output_block_patch (FreeU.execute.output_block_patch): {BETWEEN}"
FREEU2 = f"output_block_patch (FreeU_V2.execute.output_block_patch): {BETWEEN}"
PAG = f"attn1 replace (PerturbedAttentionGuidance.execute.perturbed_attention): {_instead(('middle', 0))}"
SAG = f"attn1 replace (SelfAttentionGuidance.execute.attn_and_record): {_instead(('middle', 0, 0))}"
SHRINK = [f"input_block_patch_after_skip (PatchModelAddDownscale.execute.input_block_patch): {BETWEEN}",
          f"output_block_patch (PatchModelAddDownscale.execute.output_block_patch): {BETWEEN}"]
HYPERTILE = [f"attn1_patch (HyperTile.execute.hypertile_in): {BETWEEN}",
             f"attn1_output_patch (HyperTile.execute.hypertile_out): {BETWEEN}"]
TOME = [f"attn1_patch (TomePatchModel.execute.tomesd_m): {BETWEEN}",
        f"attn1_output_patch (TomePatchModel.execute.tomesd_u): {BETWEEN}"]
REF = [f"attn1 replace (attn1_reference.damped_self_attention): {_instead(('output', 1, 0))}"]


def IPA(kind):  # noqa: N802 - reads like the other expectations
    return [f"attn2 replace (IPAdapterAttn2): {_instead(b)}" for b in IPA_BLOCKS[kind]]


#: name -> (family, patch nodes on the MODEL, conditioning nodes, what the report must say)
CASES = {
    "FreeU": ("model patch", freeu, None, [FREEU]),
    "FreeU_V2": ("model patch", freeu_v2, None, [FREEU2]),
    "PerturbedAttentionGuidance": ("post-cfg + attn1 replace", pag, None, [PAG]),
    "SelfAttentionGuidance": ("post-cfg + attn1 replace", sag, None, [SAG]),
    "HyperTile": ("attn1 patch", hypertile, None, HYPERTILE),
    "PatchModelAddDownscale (Deep Shrink)": ("input/output block patch", deep_shrink, None, SHRINK),
    "RescaleCFG": ("cfg function", rescale_cfg, None, []),
    "ModelSamplingDiscrete v_prediction zsnr": ("model_sampling object patch", vpred_zsnr, None, []),
    "TomePatchModel": ("attn1 patch", tome, None, TOME),
    "IPAdapter-style attn2 replace": ("attn2 replace", ipadapter_attn2, None, IPA),  # per kind
    "custom attn1 replace": ("attn1 replace", attn1_reference, None, REF),
    "hook LoRA (CreateHookLora + keyframes + SetClipHooks)": ("scheduled weight hooks", None, hook_lora_conds, []),
    "ControlNet": ("control residuals", None, controlnet_conds, []),
    "T2I-Adapter": ("control residuals", None, t2i_conds, []),
    # stacks
    "FreeU_V2 + PAG + Deep Shrink": ("stack", stack(freeu_v2, pag, deep_shrink), None, [FREEU2, PAG] + SHRINK),
    "FreeU_V2 + PAG + Deep Shrink + SAG": ("stack (the issue's)", stack(freeu_v2, pag, deep_shrink, sag), None,
                                           [FREEU2, PAG, SAG] + SHRINK),
    "FreeU_V2 + PAG + Deep Shrink x4 + SAG (fails in plain ComfyUI)": (
        "stack (the issue's, failing)", stack(freeu_v2, pag, deep_shrink_x4, sag), None, []),
    "HyperTile + RescaleCFG + IPAdapter attn2 + ControlNet + hook LoRA": (
        "stack", stack(hypertile, rescale_cfg, ipadapter_attn2),
        lambda ctx, mp: apply_control(*hook_lora_conds(ctx, mp), tiny_controlnet(mp), 64),
        lambda kind: HYPERTILE + IPA(kind)),
}
AFTER, BEFORE = "patch -> Compile UNet", "Compile UNet -> patch"
TWO_ORDERS = {"PatchModelAddDownscale (Deep Shrink)", "PerturbedAttentionGuidance", "IPAdapter-style attn2 replace"}
SDXL_DEFAULT = {"FreeU_V2 + PAG + Deep Shrink"}
FAILS_IN_COMFYUI = "FreeU_V2 + PAG + Deep Shrink x4 + SAG (fails in plain ComfyUI)"
#: (case-name substring, kind) -> latent (h, w) where the 8x8 default shows the node nothing to do
SIZES = {("HyperTile", "sdxl"): (16, 16)}
#: (case, kind) a no-op in plain ComfyUI too: ToMe merges tokens only at full resolution, where SDXL has
#: no attention; compiled must still equal eager (and the plain image)
NOOPS = {("TomePatchModel", "sdxl")}


def all_cases():
    """Every (name, kind, order): both model kinds, both node orders for model patches (a
    conditioning-only case has no order)."""
    return [(name, kind, order) for name in CASES for kind in ("sd15", "sdxl")
            for order in ((AFTER, BEFORE) if CASES[name][1] is not None else (AFTER,))]


def in_default(name, kind, order) -> bool:
    """The default set (CI, the bench): every case once on SD1.5 (Compile UNet after the patch
    node), both orders for TWO_ORDERS, one stack on SDXL."""
    if kind == "sdxl":
        return name in SDXL_DEFAULT and order == AFTER
    return order == AFTER or name in TWO_ORDERS


def size_of(name, kind):
    return next((v for (key, k), v in SIZES.items() if key in name and k == kind), (LATENT, LATENT))


def expectations(name, kind) -> list[str]:
    expect = CASES[name][3]
    return expect(kind) if callable(expect) else expect


# ---- the runner ----------------------------------------------------------------------------
class Ctx:
    """One per model kind: the tiny text encoder and the prompts' conditioning, built once;
    ``tmp``: where the hook LoRA's file goes."""

    def __init__(self, kind, tmp):
        self.kind, self.tmp = kind, tmp
        self.clip = tiny_clip(kind)
        self.pos, self.neg = encode(self.clip, PROMPT), encode(self.clip, NEGATIVE)
        self.plain = {}     # latent size -> the unpatched eager sample (same weights every case: seed 0)

    def plain_at(self, mp, size):
        if size not in self.plain:
            self.plain[size] = sample(mp, self.pos, self.neg, size)
        return self.plain[size]


@dataclasses.dataclass
class CaseRun:
    """One case sampled eager and compiled: the row, both results (or errors) and the report."""
    name: str
    kind: str
    row: Row
    ref: torch.Tensor | None
    ref_err: tuple | None
    out: torch.Tensor | None
    err: tuple | None
    plain: torch.Tensor
    accel: object
    text: str
    attn2_calls: int        # IPAdapterAttn2 calls during the compiled sample


def _compiled(ctx, mp, patch, order, config):
    from unet_compiler.nodes import patcher
    if patch is None:
        return patcher.compile_model(mp, config)[0]
    if order == AFTER:
        return patcher.compile_model(patch(ctx, mp), config)[0]
    return patch(ctx, patcher.compile_model(mp, config)[0])


def run_case(ctx, mp, name, order, config=None) -> CaseRun:
    """The case's nodes on ``mp`` sampled eager, then with Compile UNet in ``order``."""
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.nodes import patcher
    config = config or CompileConfig(backend="inductor")
    family, patch, conds, _ = CASES[name]
    size = size_of(name, ctx.kind)
    plain = ctx.plain_at(mp, size)
    pos, neg = (ctx.pos, ctx.neg) if conds is None else conds(ctx, mp)
    ref, ref_err = run(patch(ctx, mp) if patch else mp, pos, neg, size)

    cm = _compiled(ctx, mp, patch, order, config)
    accel = patcher.accelerator_of(cm)
    calls_before = IPAdapterAttn2.calls
    out, err = run(cm, pos, neg, size)
    text = accel.text()
    regions = {k[len("ran_"):]: n for k, n in sorted(accel.stats.items()) if k.startswith("ran_")}
    row = Row(name, family, f"{ctx.kind} {size[0] * 8}x{size[1] * 8}: {order}", regions,
              accel.stats["region_eager"], patch_lines(text), None, graphs=accel.stats["graphs_compiled"],
              compile_s=accel.stats["compile_seconds"], notes=[n for n in accel.report.notes if "failed on" in n])
    return CaseRun(name, ctx.kind, row, ref, ref_err, out, err, plain, accel, text,
                   IPAdapterAttn2.calls - calls_before)


#: pack frames the model's own exception may pass through: the apply_model wrapper and the
#: context manager around the call, and a region shim handing the call to the model's own code
PASS_THROUGH = {"patcher.py:unet_compiler_apply_model", "runtime.py:active", "shims.py:shim", "runtime.py:_run",
                "runtime.py:_run_here"}


def is_pack_file(filename) -> bool:
    """``filename`` (a traceback frame's) is the pack's: a .py file in the checkout, not under bench/,
    bin/, tests/ or docs/ nor in a hidden or virtual-env folder (tests/_pack.py has the same rule)."""
    path = Path(filename).resolve()
    return (path.suffix == ".py" and path.is_relative_to(PACK_ROOT)
            and (parts := path.relative_to(PACK_ROOT).parts)[0] not in ("bench", "bin", "tests", "docs")
            and not any(p.startswith(".") or p == "site-packages" for p in parts))


def _pack_frames(exc: BaseException) -> list[str]:
    """The pack's frames in an exception's traceback (not this harness's, not the tests')."""
    return [f"{Path(f.filename).name}:{f.name}" for f in traceback.extract_tb(exc.__traceback__)
            if is_pack_file(f.filename)]


def what_the_pack_added(e: BaseException, accel) -> list[str]:
    """What a compiled run's error carries that plain ComfyUI's does not."""
    added = []
    extra = [f for f in _pack_frames(e) if f not in PASS_THROUGH]
    if extra:
        added.append(f"the pack's own frames: {extra}")
    seen, chained = set(), e.__cause__ or e.__context__
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        if type(chained).__module__.startswith("torch._") or _pack_frames(chained):
            added.append(f"chained to {type(chained).__module__}.{type(chained).__name__}: "
                         f"{str(chained).splitlines()[0] if str(chained) else ''}")
        chained = chained.__cause__ or chained.__context__
    if accel.failed:
        added.append(f"region kinds turned off for this model: {accel.failed}")
    return added


#: the checks ``check`` reports, by name
PACK_ADDS_NOTHING, ATTENTION_RAN = "the pack adds nothing to the model's error", "accelerated attention ran"


def check(c: CaseRun) -> list[tuple[str, str]]:
    """Every check the case must pass: (check, what went wrong) for each that failed, empty when
    all pass. Sets the row's outcome and max |compiled - eager|.

    Fails in plain ComfyUI -> compiled fails with the same exception type and message, and
    nothing of the pack's in it beyond the wrapper and shims handing the call on. Samples in
    plain ComfyUI -> compiled samples, equal within ``REL``, finite; the nodes changed the image
    (else parity proves nothing) or are a no-op in plain ComfyUI too (``NOOPS``); the report
    names what each patch did and counts the regions a patch kept from their compiled code in the
    latest call; a patch-free case sends nothing to eager; the IPAdapter-style
    patch ran inside the compiled model; accelerated ResBlock, feed-forward and attention ran."""
    r, fails = c.row, []
    if c.ref_err is not None:
        e_ref, tb_ref = c.ref_err
        if c.err is None:
            r.outcome = f"eager raises {type(e_ref).__name__}; compiled samples"
            return [("same error", f"eager raised {type(e_ref).__name__}: {e_ref}; compiled did not\n{tb_ref}")]
        e, tb = c.err
        r.outcome = f"both raise {type(e_ref).__name__}: {str(e_ref).splitlines()[0]}"
        if type(e) is not type(e_ref) or str(e) != str(e_ref):
            r.outcome = f"eager raises {type(e_ref).__name__}; compiled raises {type(e).__name__}"
            return [("same error", f"eager:\n{tb_ref}\ncompiled:\n{tb}")]
        added = what_the_pack_added(e, c.accel)
        if added:
            r.outcome += " | the pack adds: " + "; ".join(added)
            return [(PACK_ADDS_NOTHING, "\n".join(added) + "\n" + tb)]
        return []
    if c.err is not None:
        r.outcome = f"compiled raises {type(c.err[0]).__name__} (eager samples)"
        return [("compiled samples", f"eager sampled; compiled raised:\n{c.err[1]}")]
    if c.name == FAILS_IN_COMFYUI:
        fails.append(("fails in plain ComfyUI", "this stack fails in plain ComfyUI on the tiny UNets"))
    diff = r.max_diff = max_diff(c.out, c.ref)
    if diff > scaled_tol(c.ref, REL):
        fails.append(("parity", f"max diff {diff:.3g} (|eager| max {float(c.ref.abs().max()):.3g})\n{c.text}"))
    if not torch.isfinite(c.out).all():
        fails.append(("finite", "the compiled latent has inf/nan"))
    if (c.name, c.kind) in NOOPS:
        if max_diff(c.ref, c.plain) > scaled_tol(c.plain, REL):
            fails.append(("no-op", f"{c.name} changed the image on {c.kind}"))
        r.outcome = "match (a no-op here in plain ComfyUI too)"
    elif max_diff(c.ref, c.plain) <= 1e-3:
        fails.append(("the nodes mattered", f"{c.name} did not change the image"))
    for line in expectations(c.name, c.kind):
        if line not in c.text:
            fails.append(("report", f"report lacks {line!r}:\n{c.text}"))
    if "IPAdapter" in c.name and not c.attn2_calls:
        fails.append(("patch ran", "the attn2 replace patch must run inside the compiled model"))
    if not expectations(c.name, c.kind) and (r.effects or r.region_eager):
        fails.append(("nothing to eager", f"no UNet patch, yet regions ran eager or a patch was named:\n{c.text}"))
    counted = next((line for line in c.text.splitlines() if "regions that ran compiled code" in line), "")
    last, (ran, total) = c.accel.ran_compiled_last(), c.accel.ran_compiled()
    if last < ran and f"in the latest UNet call {last} of {total}" not in counted:
        fails.append(("regions counted", f"{ran - last} region(s) that ran compiled code before ran the model's "
                                         f"own code or a patch's in the latest call; the count does not say so:"
                                         f"\n{c.text}"))
    if not (r.regions.get("resblock", 0) > 0 and r.regions.get("feedforward", 0) > 0):
        fails.append(("regions ran", c.text))
    if not r.regions.get("attention", 0) or r.notes:
        fails.append((ATTENTION_RAN, c.text))
    if fails:
        r.outcome = "FAILED: " + ", ".join(dict.fromkeys(f for f, _ in fails))
    return fails


def patch_rows(backend="inductor", cases=None, log=None) -> list[Row]:
    """Run each (name, kind, order) case (default: ``in_default``'s set) and check it: the
    table's rows, each with its outcome. Needs ComfyUI (``import_comfy``)."""
    import tempfile
    from unet_compiler.compiler.config import CompileConfig
    import_comfy()
    cases = [c for c in all_cases() if in_default(*c)] if cases is None else cases
    config = CompileConfig(backend=backend)
    tmp = Path(tempfile.mkdtemp(prefix="unet_compiler_patch_nodes_"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: dispatch-bound (see tests/nodes/test_patch_nodes.py)
    ctxs, rows = {}, []
    try:
        for name, kind, order in cases:
            ctx = ctxs.get(kind) or ctxs.setdefault(kind, Ctx(kind, tmp))
            c = run_case(ctx, fit_sdxl_adm(build_tiny(kind)), name, order, config)
            check(c)
            rows.append(c.row)
            if log is not None:
                log(f"{name} ({kind}, {order}): {c.row.outcome}")
    finally:
        torch.set_num_threads(threads)
    return rows
