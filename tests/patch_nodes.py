"""ComfyUI's core patch nodes through real sampling, eager vs Compile UNet (helpers for
tests/test_patch_nodes.py).

Everything is ComfyUI's own code on tiny random-weight models: the UNet from conftest's
``make_comfy_model``, a tiny SD1 CLIP (``comfy.sd.CLIP`` with a 64-wide CLIPTextModel, real
tokenizer) that encodes prompts as CLIPTextEncode does, a ControlNet built from
``comfy.cldm.cldm.ControlNet`` with the tiny UNet's config, a T2I-Adapter from
``comfy.t2i_adapter.adapter.Adapter``, and the core nodes' own classes. Sampling is
``comfy.sample.sample`` (KSampler's path) under ``torch.inference_mode()`` as ComfyUI's
executor runs it. ``format_table`` prints what each case did.
"""
from __future__ import annotations

import dataclasses
import traceback

import torch

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


def init_random(module: torch.nn.Module, seed: int = 0, scale: float = 1.0):
    """ComfyUI's disable_weight_init / manual_cast ops leave weights uninitialised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(scale * torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


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


ROWS: list[Row] = []


def patch_lines(text: str) -> list[str]:
    return [ln.strip()[len("patch "):] for ln in text.splitlines() if ln.strip().startswith("patch ")]


def format_table(rows: list[Row] | None = None) -> str:
    rows = ROWS if rows is None else rows
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
