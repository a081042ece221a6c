"""Every ``openaimodel.UNetModel`` family ComfyUI loads, built at tiny widths
from ComfyUI's own configs, with the conditioning ComfyUI's own model classes
build for it: the tests' tiny-model builders and the compatibility table's source. Used by the
tests (tests/nodes/test_families.py, test_dit.py, ...) and by the bench, which imports it from here
as ``unet_compiler.tests._families`` (every user imports it by that one name); the table alone::

    python -m unet_compiler.bench compat --only families [--backend triton|inductor|eager] [families...]

(``python -m unet_compiler.bench run --compat`` prints it after the bench table, the patch-node
table of tests/_patch_compat.py after it.) It needs a
ComfyUI tree (``COMFYUI_PATH`` or ``~/comfy/ComfyUI``); nothing is downloaded.

Where each config comes from:

- ComfyUI's ``model_detection.unet_config_from_diffusers_unet`` table (the
  full-size configs of SD1.5, SD2.x, unCLIP, SDXL, the refiner, SSD-1B, Vega,
  KOALA, the inpainting / ip2p variants, LotusD), reached through a fake
  diffusers key set that carries only the shapes it reads;
- for the families only ldm checkpoints exist for (SD1.5 ip2p, Stable Zero123,
  the x4 upscaler, SVD, SV3D) the config ``model_detection.detect_unet_config``
  derives from such a checkpoint's keys, written out below.

Either way ``model_detection.model_config_from_unet_config`` must map the
full-size config to the expected ``supported_models`` class (so the test runs
the class ComfyUI's loader picks), and the tiny model's own state dict must
detect back to the same structure (levels, res blocks, transformer depths per
block, linear/conv proj_in, video blocks). Only widths shrink: model_channels
32, context_dim / 16, heads (64-wide heads -> 8, 8 heads -> 4). ADM widths stay
real (the label_emb input is one Linear) so ComfyUI's own ``encode_adm`` /
``extra_conds`` build y, c_concat, time conditioning and frame counts.
"""
from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: structural keys the tiny model must detect back to (ComfyUI's detect_unet_config)
STRUCTURE = ("in_channels", "num_res_blocks", "channel_mult", "transformer_depth", "transformer_depth_output",
             "transformer_depth_middle", "use_linear_in_transformer", "use_temporal_resblock",
             "use_temporal_attention")
TINY_CHANNELS = 32
#: frames per video in the video families' batches
FRAMES = 2


@dataclass(frozen=True)
class Family:
    key: str
    label: str          # the family as the README table names it
    cls: str            # the comfy.supported_models class ComfyUI's loader picks
    #: ("diffusers", in_channels, model_channels, adm, context_dim, embedding key, ((res blocks, depth), ...))
    #: or ("ldm", full-size config as detect_unet_config derives it)
    source: tuple
    #: extra state-dict keys get_model / matching read (v-prediction marker, cc_projection)
    sd_keys: tuple = ()
    video: bool = False
    #: what the conditioning carries (for the table)
    conds: str = ""
    group: str = ""
    extra: dict = field(default_factory=dict)


def _sd15_levels():
    return ((2, 1), (2, 1), (2, 1), (2, 0))


def _ldm(base: dict, **over) -> dict:
    cfg = dict(base)
    cfg.update(over)
    return cfg


#: detect_unet_config's output for an SD1.5-structured ldm checkpoint (the same dict as
#: model_detection's SD15 diffusers entry after convert_config)
_SD15_LDM = {"use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
             "adm_in_channels": None, "in_channels": 4, "out_channels": 4, "model_channels": 320,
             "num_res_blocks": [2, 2, 2, 2], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
             "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], "channel_mult": [1, 2, 4, 4],
             "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768,
             "use_temporal_resblock": False, "use_temporal_attention": False}
#: SVD's UNet: SD2.1 structure with spatio-temporal blocks (the video keys detect_unet_config sets
#: when it finds time_stack weights; time_stack.*.attn2 present -> temporal cross-attention on)
_SVD_LDM = _ldm(_SD15_LDM, in_channels=8, use_linear_in_transformer=True, context_dim=1024, num_classes="sequential",
                adm_in_channels=768, extra_ff_mix_layer=True, use_spatial_context=True,
                merge_strategy="learned_with_images", merge_factor=0.0, video_kernel_size=[3, 1, 1],
                use_temporal_resblock=True, use_temporal_attention=True, disable_temporal_crossattention=False)
#: the SD x4 upscaler checkpoint (x4-upscaling.yaml: channel_mult 1,2,2,4, attention at ds 2,4,8,
#: noise level as a class label; num_classes/heads/disable_self_attentions come from unet_extra_config)
_X4_LDM = _ldm(_SD15_LDM, in_channels=7, model_channels=256, channel_mult=[1, 2, 2, 4],
               transformer_depth=[0, 0, 1, 1, 1, 1, 1, 1],
               transformer_depth_output=[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1],
               use_linear_in_transformer=True, context_dim=1024)

_XL = ((2, 0), (2, 2), (2, 10))
_ADD, _CLASS = "add_embedding.linear_1.weight", "class_embedding.linear_1.weight"
_VPRED_MARK = ("output_blocks.11.1.transformer_blocks.0.norm1.bias",)  # SD20.model_type reads its std

FAMILIES = {f.key: f for f in [
    Family("sd15", "SD1.5", "SD15", ("diffusers", 4, 320, None, 768, None, _sd15_levels()),
           conds="text", group="SD1.5"),
    Family("sd2", "SD2.x (v-pred)", "SD20", ("diffusers", 4, 320, None, 1024, None, _sd15_levels()),
           sd_keys=_VPRED_MARK, conds="text", group="SD2.x"),
    Family("sd21_unclip_h", "SD2.1 unCLIP-H", "SD21UnclipH", ("diffusers", 4, 320, 2048, 1024, _CLASS, _sd15_levels()),
           conds="text + unCLIP adm", group="SD2.1 unCLIP"),
    Family("sd21_unclip_l", "SD2.1 unCLIP-L", "SD21UnclipL", ("diffusers", 4, 320, 1536, 1024, _CLASS, _sd15_levels()),
           conds="text + unCLIP adm", group="SD2.1 unCLIP"),
    Family("sdxl", "SDXL", "SDXL", ("diffusers", 4, 320, 2816, 2048, _ADD, _XL), conds="text + size adm", group="SDXL"),
    Family("sdxl_refiner", "SDXL refiner", "SDXLRefiner",
           ("diffusers", 4, 384, 2560, 1280, _ADD, ((2, 0), (2, 4), (2, 4), (2, 0))),
           conds="text + aesthetic adm", group="SDXL refiner"),
    Family("ssd1b", "SSD-1B", "SSD1B", ("diffusers", 4, 320, 2816, 2048, _ADD, ((2, 0), (2, 2), (2, 4))),
           conds="text + size adm", group="pruned SDXL"),
    Family("vega", "Segmind Vega", "Segmind_Vega", ("diffusers", 4, 320, 2816, 2048, _ADD, ((2, 0), (2, 1), (2, 2))),
           conds="text + size adm", group="pruned SDXL"),
    Family("koala_700m", "KOALA-700M", "KOALA_700M", ("diffusers", 4, 320, 2816, 2048, _ADD, ((1, 0), (1, 2), (1, 5))),
           conds="text + size adm", group="pruned SDXL"),
    Family("koala_1b", "KOALA-1B", "KOALA_1B", ("diffusers", 4, 320, 2816, 2048, _ADD, ((1, 0), (1, 2), (1, 6))),
           conds="text + size adm", group="pruned SDXL"),
    Family("sd15_inpaint", "SD1.5 inpaint (9 ch)", "SD15", ("diffusers", 9, 320, None, 768, None, _sd15_levels()),
           conds="text + mask + masked latent", group="inpaint / ip2p"),
    Family("sdxl_inpaint", "SDXL inpaint (9 ch)", "SDXL", ("diffusers", 9, 320, 2816, 2048, _ADD, _XL),
           conds="text + size adm + mask + masked latent", group="inpaint / ip2p"),
    Family("sd15_ip2p", "SD1.5 instruct-pix2pix (8 ch)", "SD15_instructpix2pix", ("ldm", _ldm(_SD15_LDM, in_channels=8)),
           conds="text + image latent", group="inpaint / ip2p"),
    Family("sdxl_ip2p", "SDXL instruct-pix2pix (8 ch)", "SDXL_instructpix2pix", ("diffusers", 8, 320, 2816, 2048, _ADD, _XL),
           conds="text + size adm + image latent", group="inpaint / ip2p"),
    Family("zero123", "Stable Zero123", "Stable_Zero123", ("ldm", _ldm(_SD15_LDM, in_channels=8)),
           sd_keys=("cc_projection.weight", "cc_projection.bias"), conds="cc_projection(image emb + camera) + latent",
           group="Stable Zero123"),
    Family("x4_upscaler", "SD x4 upscaler", "SD_X4Upscaler", ("ldm", _X4_LDM),
           conds="text + low-res image + noise-level class", group="SD x4 upscaler"),
    Family("svd", "SVD (img2vid)", "SVD_img2vid", ("ldm", _SVD_LDM), video=True,
           conds="clip image emb + latent + fps/motion adm, frames", group="SVD / SV3D"),
    Family("sv3d_u", "SV3D_u", "SV3D_u", ("ldm", _ldm(_SVD_LDM, adm_in_channels=256)), video=True,
           conds="clip image emb + latent + augmentation adm, frames", group="SVD / SV3D"),
    Family("sv3d_p", "SV3D_p", "SV3D_p", ("ldm", _ldm(_SVD_LDM, adm_in_channels=1280)), video=True,
           conds="clip image emb + latent + camera-pose adm, frames", group="SVD / SV3D"),
    Family("lotus_d", "LotusD", "LotusD", ("diffusers", 4, 320, 4, 1024, _CLASS, _sd15_levels()),
           conds="text + task embedding", group="LotusD"),
]}


# ---- ComfyUI ------------------------------------------------------------------
COMFY_NOT_FOUND = "ComfyUI not found: set COMFYUI_PATH or install it at ~/comfy/ComfyUI (see DEVELOPERS.md)"


def comfy_path() -> Path | None:
    for p in (os.environ.get("COMFYUI_PATH"), str(Path.home() / "comfy" / "ComfyUI")):
        if p and (Path(p) / "main.py").is_file():
            return Path(p)
    return None


def comfy_missing(path: Path) -> list[str]:
    """ComfyUI's requirements (its requirements.txt, and requests) not installed in this Python:
    without them it does not import. torchaudio is left out (only its audio nodes need it)."""
    from importlib import metadata
    req = path / "requirements.txt"
    lines = req.read_text().splitlines() if req.is_file() else []
    names = [m.group(0) for m in (re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", ln.strip()) for ln in lines) if m]
    missing = []
    for name in [*names, "requests"]:
        if name.lower() == "torchaudio":
            continue
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def comfy_problem() -> str | None:
    """Why ComfyUI cannot run in this Python, as one line naming the fix; None when it can."""
    path = comfy_path()
    if path is None:
        return COMFY_NOT_FOUND
    missing = comfy_missing(path)
    if not missing:
        return None
    here = Path(__file__).resolve().parents[1]   # the checkout: bin/setup, constraints.txt
    fix = (f"{here / 'bin' / 'setup'} {sys.prefix}" if sys.prefix != sys.base_prefix else
           f"{sys.executable} -m pip install -c {here / 'constraints.txt'} -r {path / 'requirements.txt'} requests")
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return f"ComfyUI at {path} is found but its requirements are not installed here ({shown}): run {fix}"


def import_comfy():
    """Import ComfyUI in-process on CPU (what tests/conftest.py's ``comfy`` fixture does)."""
    problem = comfy_problem()
    if problem:
        raise RuntimeError(problem)
    path = comfy_path()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    from comfy.cli_args import args
    args.cpu = True
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models
    return comfy


# ---- configs --------------------------------------------------------------------
def _diffusers_keys(in_ch, mc, adm, ctx, emb_key, levels) -> dict:
    """The diffusers-format keys (meta tensors: shapes only) that
    unet_config_from_diffusers_unet reads to pick its config."""
    meta = {"device": "meta"}
    sd = {"conv_in.weight": torch.empty(mc, in_ch, 3, 3, **meta)}
    for i, (n_res, depth) in enumerate(levels):
        for r in range(n_res):
            sd[f"down_blocks.{i}.resnets.{r}.conv1.weight"] = torch.empty(1, **meta)
            for d in range(depth):
                sd[f"down_blocks.{i}.attentions.{r}.transformer_blocks.{d}.attn2.to_k.weight"] = torch.empty(1, ctx, **meta)
    if adm is not None:
        sd[emb_key] = torch.empty(1, adm, **meta)
    return sd


def full_config(fam: Family) -> dict:
    """The full-size unet_config ComfyUI uses for this family (before unet_extra_config)."""
    import comfy.model_detection as md
    if fam.source[0] == "diffusers":
        cfg = md.unet_config_from_diffusers_unet(_diffusers_keys(*fam.source[1:]))
        if cfg is None:
            raise AssertionError(f"{fam.key}: ComfyUI's diffusers config table has no entry for {fam.source}")
        cfg = dict(cfg)
        cfg.pop("dtype", None)
        return cfg
    return md.convert_config(dict(fam.source[1]))


def _sd_extra(fam: Family, ctx: int) -> dict:
    g = torch.Generator().manual_seed(11)
    out = {}
    for k in fam.sd_keys:
        if k == "cc_projection.weight":  # image embedding + 4 camera values -> context
            out[k] = torch.randn(ctx, ctx + 4, generator=g) / (ctx + 4) ** 0.5
        elif k == "cc_projection.bias":
            out[k] = 0.1 * torch.randn(ctx, generator=g)
        else:  # SD20's v-prediction marker: a norm bias with std > 0.09
            out[k] = torch.randn(TINY_CHANNELS, generator=g)
    return out


def loader_class(fam: Family):
    """The supported_models class ComfyUI's loader picks for the full-size config."""
    import comfy.model_detection as md
    cfg = full_config(fam)
    picked = md.model_config_from_unet_config(cfg, {k: None for k in fam.sd_keys})
    return type(picked) if picked is not None else None


def tiny_config(fam: Family) -> dict:
    cfg = full_config(fam)
    cfg["model_channels"] = TINY_CHANNELS
    cfg["context_dim"] = cfg["context_dim"] // 16
    return cfg


def _shrink_heads(unet_config: dict):
    if unet_config.get("num_head_channels", -1) not in (-1, None):
        unet_config["num_head_channels"] = 8
    if unet_config.get("num_heads", -1) not in (-1, None):
        unet_config["num_heads"] = 4


def init_random(module: torch.nn.Module, seed: int = 0, scale: float = 1.0):
    """ComfyUI's disable_weight_init / manual_cast ops leave weights uninitialised: matrices
    ``scale * N(0, 1/fan_in)``, norm weights near 1, biases near 0; buffers a checkpoint carries
    (MMDiT's position table, left ``torch.empty``) small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        saved = module.state_dict(keep_vars=True)
        for name, b in module.named_buffers():
            if name in saved and b.is_floating_point():
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(scale * torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif name.endswith(("weight", "scale")):       # (Flux's RMSNorm calls its weight scale)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


def build(fam: Family, seed: int = 0):
    """A random-weight tiny BaseModel of this family, built by the family's own
    supported_models class (``get_model``), in a real ModelPatcher on CPU."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    cls = getattr(sm, fam.cls)
    tiny = tiny_config(fam)
    cfg = cls(tiny)
    _shrink_heads(cfg.unet_config)
    with torch.no_grad():  # as ComfyUI's loader: Stable_Zero123 copies cc_projection into a Parameter
        base = cfg.get_model(_sd_extra(fam, tiny["context_dim"]))
    init_random(base.diffusion_model, seed)
    base.eval()
    dev = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base, load_device=dev, offload_device=dev)


def detected_structure(mp) -> dict:
    """What ComfyUI's checkpoint detection reads back from the tiny model's weights."""
    import comfy.model_detection as md
    sd = mp.model.diffusion_model.state_dict()
    det = md.detect_unet_config(sd, "")
    return {k: det.get(k) for k in STRUCTURE}


# ---- inputs ------------------------------------------------------------------------
def context_width(mp) -> int:
    return mp.model.model_config.unet_config["context_dim"]


def make_inputs(fam: Family, mp, batch: int, h: int, w: int, seed: int = 1, tokens: int = 77):
    """(x, sigma, kwargs for apply_model) at latent size h x w, with the conds
    the family's own BaseModel.extra_conds builds, batched as the sampler does
    (CONDRegular/CONDNoiseShape repeated to the batch). For video families
    ``batch`` counts videos of FRAMES frames each (cond + uncond = 2)."""
    import comfy.latent_formats  # noqa: F401
    base = mp.model
    g = torch.Generator().manual_seed(seed)
    ctx = context_width(mp)
    frames = FRAMES if fam.video else 1
    n = batch * frames

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    with torch.inference_mode():
        x = rnd(n, 4, h, w)
        noise = x[:frames] if fam.video else x
        kw = dict(noise=noise, device=torch.device("cpu"), seed=seed, width=w * 8, height=h * 8)
        if fam.key == "zero123":
            kw["cross_attn"] = rnd(1, 1, ctx + 4)  # image embedding + camera, through cc_projection
        elif fam.video:
            kw["cross_attn"] = rnd(1, 1, ctx)      # one CLIP-vision token
        else:
            kw["cross_attn"] = rnd(n, tokens, ctx)
        kw["pooled_output"] = rnd(n, 1280)
        if fam.key in ("sd15_inpaint", "sdxl_inpaint"):
            kw["concat_latent_image"] = rnd(n, 4, h, w)
            kw["concat_mask"] = (rnd(n, 1, h, w) > 0).float()
        if fam.key in ("sd15_ip2p", "sdxl_ip2p", "zero123") or fam.video:
            kw["concat_latent_image"] = rnd(1, 4, h, w)
        if fam.key == "x4_upscaler":
            kw["concat_image"] = rnd(1, 3, h, w)
            kw["noise_augmentation"] = 0.2
        if fam.key == "sv3d_p":
            kw.update(elevation=10.0, azimuth=30.0)
        conds = base.extra_conds(**kw)
        out = {}
        for name, c in conds.items():
            c = c.process_cond(batch_size=n, device=torch.device("cpu"), area=None)
            out[name] = c.cond
        if fam.key.startswith("sd21_unclip"):
            # without unCLIP conditioning ComfyUI feeds zeros; random rows exercise label_emb's weights
            out["y"] = rnd(*out["y"].shape)
        sigma = torch.full((n,), 2.0)
    return x, sigma, out


def apply(mp, fam: Family, batch: int, h: int, w: int, seed: int = 1):
    """One sampling-style apply_model call (the patcher's wrappers merged in as KSampler does)."""
    from unet_compiler.nodes import warmup as nodes_warmup
    x, sigma, kw = make_inputs(fam, mp, batch, h, w, seed)
    to = nodes_warmup.sampling_transformer_options(mp)
    with torch.inference_mode():
        return mp.model.apply_model(x, sigma, transformer_options=to, **kw)


# ---- the compatibility table ----------------------------------------------------------
@dataclass
class Row:
    family: str
    accelerated: dict
    eager: list            # (kind, count, why)
    ran: dict              # ran_<kind> counters
    max_diff: float
    recompiles: int | None = None
    note: str = ""


def row(fam: Family | DitFamily, accel, max_diff: float) -> Row:
    ran = {k[4:]: v for k, v in accel.stats.items() if k.startswith("ran_")}
    return Row(fam.label, dict(accel.report.regions), list(accel.plan.skipped_summary()), ran, max_diff,
               accel.stats["recompiles_after_warmup"] if accel.warmed else None)


def table(rows: list[Row]) -> str:
    """Markdown: family | accelerated regions by kind | left eager (why) | max |compiled - eager| |
    recompiles after warmup (when the row comes from a warmed run)."""
    lines = ["| family | accelerated regions | left eager (why) | max abs diff | recompiles after warmup |",
             "|---|---|---|---|---|"]
    for r in rows:
        acc = ", ".join(f"{k} {n}" for k, n in r.accelerated.items()) or "none"
        eag = "; ".join(f"{k} {n}: {why}" for k, n, why in r.eager) or "-"
        rec = "-" if r.recompiles is None else str(r.recompiles)
        lines.append(f"| {r.family} | {acc} | {eag} | {r.max_diff:.1e} | {rec} |")
    return "\n".join(lines)


def compat_rows(backend="inductor", latent=(16, 16), batch=2, families=None, log=None) -> list[Row]:
    """Build each family (default all), compile it, warm one shape, run it against the model's
    own code on the same inputs: the table's rows. Needs ComfyUI (``import_comfy``)."""
    import_comfy()
    from unet_compiler.compiler.warmup import warmup_runs
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.compiler.shapes import Shape
    from unet_compiler.nodes import patcher
    h, w = latent
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: dispatch-bound
    rows = []
    try:
        for key in families or FAMILIES:
            fam = FAMILIES[key]
            mp = build(fam)
            cm, _ = patcher.compile_model(mp, CompileConfig(backend=backend))
            accel = patcher.accelerator_of(cm)
            warmup_runs(accel, [Shape(batch, w * 8, h * 8)],
                            lambda s, cm=cm, fam=fam: apply(cm, fam, s.batch, h, w))
            out = apply(cm, fam, batch, h, w, seed=3)
            with accel.bypass():
                ref = apply(cm, fam, batch, h, w, seed=3)
            rows.append(row(fam, accel, float((out - ref).abs().max())))
            if log is not None:
                log(f"{fam.label}: done")
    finally:
        torch.set_num_threads(threads)
    return rows



# ---- diffusion transformers ------------------------------------------------------------
@dataclass(frozen=True)
class DitFamily:
    key: str
    label: str
    cls: str            # the comfy.supported_models class ComfyUI's loader picks
    #: the config ``model_detection.detect_unet_config`` derives from a full-size checkpoint's keys
    config: dict
    conds: str = ""
    #: the tiny build's overrides of ``config`` (widths and depths shrunk, structure kept)
    tiny: dict = field(default_factory=dict)
    #: {region kind: the config key that counts those blocks}
    blocks: tuple = (("double_block", "depth"), ("single_block", "depth_single_blocks"))
    #: config keys detection fills with the family's constants (not read from the weights)
    constants: tuple = ("num_heads", "axes_dim")
    #: a video model: its latent has frames (the table's cases take 2 frame counts)
    video: bool = False
    #: the class ComfyUI's detection picks for the tiny build, where its width is not the family's
    #: (Z-Image is told from Lumina 2 by its 3840 width alone), else ``cls``
    detected_as: str | None = None


#: Flux.1 dev as detect_unet_config derives it from the checkpoint (guidance_in present)
_FLUX_DEV = {"image_model": "flux", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
             "out_channels": 16, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 16, "hidden_size": 3072,
             "context_in_dim": 4096, "patch_size": 2, "vec_in_dim": 768, "depth": 19, "depth_single_blocks": 38,
             "guidance_embed": True}

#: Flux.2 dev as detect_unet_config derives it (global modulation: the model hands each block its own)
_FLUX2_DEV = {"image_model": "flux2", "axes_dim": [32, 32, 32, 32], "num_heads": 48, "mlp_ratio": 3.0, "theta": 2000,
              "out_channels": 128, "global_modulation": True, "mlp_silu_act": True, "qkv_bias": False,
              "ops_bias": False, "default_ref_method": "index", "ref_index_scale": 10.0, "txt_ids_dims": [3],
              "patch_size": 1, "in_channels": 128, "hidden_size": 6144, "context_in_dim": 15360, "vec_in_dim": None,
              "depth": 8, "depth_single_blocks": 48, "guidance_embed": True, "yak_mlp": False, "txt_norm": False}
#: Chroma as detect_unet_config derives it (Flux's blocks, modulation from a distilled approximator)
_CHROMA = {"image_model": "chroma", "axes_dim": [16, 56, 56], "num_heads": 24, "mlp_ratio": 4.0, "theta": 10000,
           "out_channels": 64, "qkv_bias": True, "txt_ids_dims": [], "in_channels": 64, "hidden_size": 3072,
           "context_in_dim": 4096, "patch_size": 2, "vec_in_dim": None, "depth": 19, "depth_single_blocks": 38,
           "in_dim": 64, "out_dim": 3072, "hidden_dim": 5120, "n_layers": 5}

#: the tiny Flux-block DiTs: 2 heads of 16 (RoPE axes 4 + 6 + 6), text width 64, 2 double and 2 single blocks
TINY_FLUX = {"num_heads": 2, "hidden_size": 32, "axes_dim": [4, 6, 6], "context_in_dim": 64, "depth": 2,
             "depth_single_blocks": 2}
#: Qwen-Image as detect_unet_config derives it (in_channels, num_layers) on its model's defaults
_QWEN_IMAGE = {"image_model": "qwen_image", "in_channels": 64, "num_layers": 60, "attention_head_dim": 128,
               "num_attention_heads": 24, "joint_attention_dim": 3584, "axes_dims_rope": (16, 56, 56)}

#: Wan 2.1 14B as detect_unet_config derives it (heads: dim / 128; text-to-video, no image encoder)
_WAN21_T2V = {"image_model": "wan2.1", "dim": 5120, "out_dim": 16, "num_heads": 40, "ffn_dim": 13824, "num_layers": 40,
              "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
              "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "model_type": "t2v"}
#: the tiny Wan blocks: 2 heads of 128 (detection's head width; RoPE axes 44 + 42 + 42), 2 blocks
TINY_WAN = {"dim": 256, "num_heads": 2, "ffn_dim": 256, "num_layers": 2}

#: SD3 Medium as detect_unet_config derives it (MMDiT: width 64 x depth, heads = depth; a T5 + CLIP
#: context of 4096, pooled CLIP-L + G of 2048)
_SD3_MEDIUM = {"in_channels": 16, "patch_size": 2, "out_channels": 16, "depth": 24, "input_size": None,
               "adm_in_channels": 2048, "num_patches": 36864, "pos_embed_max_size": 192,
               "context_embedder_config": {"target": "torch.nn.Linear",
                                           "params": {"in_features": 4096, "out_features": 1536}},
               "pos_embed_scaling_factor": None, "x_block_self_attn_layers": []}
#: the tiny MMDiTs: depth 2 (width 128, 2 heads of 64), a 16 x 16 patch position table
TINY_SD3 = {"depth": 2, "num_patches": 256, "pos_embed_max_size": 16,
            "context_embedder_config": {"target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 128}}}

#: HunyuanVideo (t2v) as detect_unet_config derives it (Flux's stream blocks, 3-D patches)
_HUNYUAN_VIDEO = {"image_model": "hunyuan_video", "in_channels": 16, "patch_size": [1, 2, 2], "out_channels": 16,
                  "vec_in_dim": 768, "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": 4096,
                  "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 20, "depth_single_blocks": 40,
                  "theta": 256, "qkv_bias": True, "byt5": False, "guidance_embed": True,
                  "use_cond_type_embedding": False, "vision_in_dim": None, "meanflow_sum": False}

#: Lumina 2 as detect_unet_config derives it (its constants for width 2304; Gemma 2 2B's 2304-wide text)
_LUMINA2 = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 2304, "cap_feat_dim": 2304,
            "n_layers": 26, "qk_norm": True, "n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32],
            "axes_lens": [300, 512, 512], "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0, "n_refiner_layers": 2}
#: Z-Image as detect_unet_config derives it (width 3840; Qwen3 4B's 2560-wide text; pad tokens)
_Z_IMAGE = dict(_LUMINA2, dim=3840, cap_feat_dim=2560, n_layers=30, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48],
                axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True,
                time_scale=1000.0, pad_tokens_multiple=32)
#: the tiny Lumina blocks: 2 query heads of 128 over 1 key/value head (grouped-query attention), text
#: width 64, 2 layers (and the 2 + 2 refiner blocks every NextDiT has); detection leaves the
#: family's constants to the model's defaults at a width it does not know (the table's config)
TINY_LUMINA = {"dim": 256, "n_heads": 2, "n_kv_heads": 1, "cap_feat_dim": 64, "n_layers": 2,
               "axes_dims": [32, 48, 48]}
_LUMINA_CONSTANTS = ("n_heads", "n_kv_heads", "axes_dims", "axes_lens", "rope_theta", "ffn_dim_multiplier",
                     "n_refiner_layers")
#: a NextDiT's blocks: its layers, then noise and context refiners of n_refiner_layers each
_LUMINA_BLOCKS = (("lumina_block", "n_layers"), ("lumina_block", "n_refiner_layers"),
                  ("lumina_block", "n_refiner_layers"))

DIT_FAMILIES = {f.key: f for f in [
    DitFamily("flux_dev", "Flux.1 dev", "Flux", _FLUX_DEV, conds="T5 text + CLIP pooled + guidance", tiny=TINY_FLUX),
    DitFamily("flux_schnell", "Flux.1 schnell", "FluxSchnell", dict(_FLUX_DEV, guidance_embed=False),
              conds="T5 text + CLIP pooled", tiny=TINY_FLUX),
    DitFamily("flux2_dev", "Flux.2 dev", "Flux2", _FLUX2_DEV, conds="Mistral text + guidance, global modulation",
              tiny=dict(TINY_FLUX, axes_dim=[4, 4, 4, 4])),
    DitFamily("chroma", "Chroma", "Chroma", _CHROMA, conds="T5 text, modulation from its approximator",
              tiny=dict(TINY_FLUX, out_dim=32, hidden_dim=64, n_layers=1),
              constants=("num_heads", "axes_dim", "out_dim", "hidden_dim", "n_layers")),
    DitFamily("qwen_image", "Qwen-Image", "QwenImage", _QWEN_IMAGE, conds="Qwen2.5-VL text",
              tiny={"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 64,
                    "axes_dims_rope": (4, 6, 6)},
              constants=("attention_head_dim", "num_attention_heads", "joint_attention_dim", "axes_dims_rope"),
              blocks=(("qwen_image_block", "num_layers"),)),
    DitFamily("sd3_medium", "SD3 Medium", "SD3", _SD3_MEDIUM, conds="CLIP-L/G + T5 text, pooled CLIP",
              tiny=TINY_SD3, constants=(), blocks=(("joint_block", "depth"),)),
    DitFamily("sd35_large", "SD3.5 Large", "SD3", dict(_SD3_MEDIUM, depth=38, qk_norm="rms", context_embedder_config={
        "target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 2432}}),
              conds="CLIP-L/G + T5 text, pooled CLIP; RMS-normed q and k", tiny=TINY_SD3, constants=(),
              blocks=(("joint_block", "depth"),)),
    DitFamily("sd35_medium", "SD3.5 Medium", "SD3", dict(_SD3_MEDIUM, qk_norm="rms", num_patches=147456,
                                                          pos_embed_max_size=384,
                                                          x_block_self_attn_layers=list(range(13))),
              conds="CLIP-L/G + T5 text, pooled CLIP; a second image self-attention in the first 13 blocks",
              tiny=dict(TINY_SD3, x_block_self_attn_layers=[0]), constants=(), blocks=(("joint_block", "depth"),)),
    DitFamily("lumina2", "Lumina 2", "Lumina2", _LUMINA2, conds="Gemma 2 text", tiny=TINY_LUMINA,
              constants=_LUMINA_CONSTANTS, blocks=_LUMINA_BLOCKS),
    DitFamily("z_image", "Z-Image", "ZImage", _Z_IMAGE, conds="Qwen3 text, pad tokens to 32, its own modulation",
              tiny=TINY_LUMINA, blocks=_LUMINA_BLOCKS,
              constants=(*_LUMINA_CONSTANTS, "z_image_modulation", "time_scale", "pad_tokens_multiple"),
              detected_as="Lumina2"),
    DitFamily("hunyuan_video", "HunyuanVideo", "HunyuanVideo", _HUNYUAN_VIDEO,
              conds="LLaVA-Llama text + CLIP pooled + guidance", video=True, constants=("axes_dim",),
              tiny={"hidden_size": 256, "num_heads": 2, "depth": 2, "depth_single_blocks": 2}),
    DitFamily("wan21_t2v", "Wan 2.1 T2V", "WAN21_T2V", _WAN21_T2V, conds="UMT5 text", tiny=TINY_WAN,
              constants=(), blocks=(("wan_block", "num_layers"),), video=True),
    DitFamily("wan21_i2v", "Wan 2.1 I2V", "WAN21_I2V", dict(_WAN21_T2V, in_dim=36, model_type="i2v"),
              conds="UMT5 text + CLIP vision tokens + image latent", tiny=TINY_WAN, constants=(),
              blocks=(("wan_block", "num_layers"),), video=True),
    DitFamily("wan22_ti2v", "Wan 2.2 TI2V 5B", "WAN22_T2V",
              dict(_WAN21_T2V, dim=3072, num_heads=24, ffn_dim=14336, num_layers=30, in_dim=48, out_dim=48),
              conds="UMT5 text (48-channel latent, 16 px a cell)", tiny=TINY_WAN, constants=(),
              blocks=(("wan_block", "num_layers"),), video=True),
]}


def dit_tiny_config(fam: DitFamily, **over) -> dict:
    return {**fam.config, **fam.tiny, **over}


def build_dit(fam: DitFamily, seed: int = 0, dtype=torch.float32, **over):
    """A random-weight tiny diffusion transformer of this family (``dit_tiny_config``: the full
    config with widths and depths shrunk), built by its supported_models class, in a real
    ModelPatcher on CPU, the way ComfyUI's loader builds it (inference dtype set)."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    cfg = getattr(sm, fam.cls)(dit_tiny_config(fam, **over))
    cfg.set_inference_dtype(dtype, None)
    with torch.no_grad():
        base = cfg.get_model({})
    init_random(base.diffusion_model, seed)
    base.eval()
    dev = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(base, load_device=dev, offload_device=dev)


def dit_inputs(mp, batch: int, h: int, w: int, seed: int = 1, tokens: int = 7, frames: int | None = None,
               reference: bool = False):
    """(x, sigma, kwargs for apply_model) at latent size h x w (and ``frames`` video frames), with the
    conds the model's own ``extra_conds`` builds from a random text embedding, pooled vector and
    CLIP vision tokens (an image-to-video model reads them), batched as the sampler does;
    ``reference``: a reference latent of the same size too (Flux Kontext's, Qwen-Image edit's)."""
    from types import SimpleNamespace

    from unet_compiler.compiler.compat.comfy import dit_context_width, dit_pooled_width, latent_frames
    base = mp.model
    g = torch.Generator().manual_seed(seed)
    width = dit_context_width(base.diffusion_model)
    with torch.inference_mode():
        x = torch.randn(batch, base.latent_format.latent_channels, *latent_frames(base, frames), h, w, generator=g)
        vision = SimpleNamespace(penultimate_hidden_states=torch.randn(batch, 257, 1280, generator=g))
        more = {"reference_latents": [torch.randn(x[:1].shape, generator=g)]} if reference else {}
        conds = base.extra_conds(**more, noise=x, device=torch.device("cpu"), seed=seed, width=w * 8, height=h * 8,
                                 cross_attn=torch.randn(batch, tokens, width, generator=g),
                                 pooled_output=torch.randn(batch, dit_pooled_width(base.diffusion_model) or 768,
                                                           generator=g), clip_vision_output=vision)
        out = {k: c.process_cond(batch_size=batch, device=torch.device("cpu"), area=None).cond for k, c in conds.items()}
    return x, torch.full((batch,), 0.7), out


def dit_apply(mp, batch: int, h: int, w: int, seed: int = 1, frames: int | None = None, tokens: int = 7,
              reference: bool = False, **more):
    """One sampling-style apply_model call of a DiT, loaded as KSampler loads it (its weight patches
    applied) and with the patcher's wrappers merged in as KSampler does; ``more``: further
    conditioning (``denoise_mask=True``: image-to-video's mask of the latent's size, its first frame 0)."""
    import comfy.model_management
    from unet_compiler.nodes import warmup as nodes_warmup
    comfy.model_management.load_models_gpu([mp])
    x, sigma, kw = dit_inputs(mp, batch, h, w, seed, tokens=tokens, frames=frames, reference=reference)
    if more.get("denoise_mask") is True:      # image-to-video's: the first latent frame is the given image
        more["denoise_mask"] = torch.ones_like(x[:, :1])
        more["denoise_mask"][:, :, :1] = 0
    kw.update(more)
    with torch.inference_mode():
        return mp.model.apply_model(x, sigma, transformer_options=nodes_warmup.sampling_transformer_options(mp), **kw)


#: ComfyUI's DiT families whose blocks the pack has no body for yet: the model runs as ComfyUI
#: loaded it (the report says "nothing to compile"), with the reason the table gives
DIT_NOT_YET = (
    ("Chroma Radiance", "comfy.ldm.chroma_radiance", "Chroma's stream blocks are regions (not tested yet: no tiny "
                                                     "build of it here); its pixel-space NeRF head runs as given"),
    ("Wan 2.x VACE, S2V, HuMo, Animate", "comfy.ldm.wan", "their main blocks are Wan's own (regions, untested); "
                                                        "the extra blocks (VACE's, audio ones) override its forward "
                                                        "and run as given"),
    ("HunyuanVideo I2V", "comfy.ldm.hunyuan_video", "the stream blocks are regions (HunyuanVideo's row); "
                                                        "image conditioning per token (modulation_dims) and a "
                                                        "padded prompt's text mask run the block's own code; "
                                                        "untested"),
    ("AuraFlow", "comfy.ldm.aura", "no body for its MMDiT / DiT blocks yet"),
    ("NewBie (Lumina 2 with pooled CLIP)", "comfy.ldm.lumina", "its blocks are regions, untested; a padded "
                                                               "prompt's mask in the context refiner runs its "
                                                               "own code"),
    ("HiDream", "comfy.ldm.hidream", "no body for its blocks yet (mixture-of-experts feed-forward)"),
    ("LTX-Video", "comfy.ldm.lightricks", "no body for its BasicTransformerBlock yet"),
    ("Mochi", "comfy.ldm.genmo", "no body for its AsymmetricJointBlock yet"),
    ("Cosmos, Cosmos Predict 2", "comfy.ldm.cosmos", "no body for its blocks yet"),
    ("PixArt, HunyuanDiT", "comfy.ldm.pixart, comfy.ldm.hydit", "no body for their blocks yet"),
    ("Kandinsky 5", "comfy.ldm.kandinsky5", "no body for its blocks yet"),
    ("Omnigen 2", "comfy.ldm.omnigen", "no body for its blocks yet"),
    ("HunyuanImage 2.1, HunyuanVideo 1.5", "comfy.ldm.hunyuan_video",
     "their stream blocks are regions, untested (byT5 / vision inputs around them)"),
    ("ACE-Step, Stable Audio, Hunyuan3D", "comfy.ldm.ace, comfy.ldm.audio, comfy.ldm.hunyuan3d*",
     "audio and 3-D models: no body for their blocks; Warmup Shapes' BxWxH(xF) entries are image and video shapes"),
)


def dit_compat_rows(backend="inductor", shapes="1x64x64, 2x128x96", cases=((1, 8, 8), (2, 8, 8), (1, 12, 16), (2, 12, 16)),
                    families=None, log=None, video_shapes="1x64x64x1, 2x128x96x9", frames=(1, 9)) -> list[Row]:
    """Build each DiT family (default all of ``DIT_FAMILIES``), compile it, warm ``shapes`` (a box of
    2 resolutions x 2 batches; a video family ``video_shapes``, 2 frame counts too) through Warmup
    Shapes' own path, then run every case (a video family's at each of ``frames``) against the
    model's own code on the same inputs: the DiT table's rows (the largest difference, and the graphs
    compiled after warmup over all cases)."""
    import_comfy()
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.nodes import patcher
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for key in families or DIT_FAMILIES:
            fam = DIT_FAMILIES[key]
            mp = build_dit(fam)
            cm, _ = patcher.compile_model(mp, CompileConfig(backend=backend))
            accel = patcher.accelerator_of(cm)
            patcher.warmup_model(cm, video_shapes if fam.video else shapes, 7)
            diff = 0.0
            for (b, h, w), f in itertools.product(cases, frames if fam.video else (None,)):
                out = dit_apply(cm, b, h, w, seed=3, frames=f)
                with accel.bypass():
                    ref = dit_apply(cm, b, h, w, seed=3, frames=f)
                diff = max(diff, float((out - ref).abs().max()))
            rows.append(row(fam, accel, diff))
            if log is not None:
                log(f"{fam.label}: done")
    finally:
        torch.set_num_threads(threads)
    return rows


def dit_not_yet_table() -> str:
    lines = ["| DiT family | ComfyUI module | what runs as ComfyUI loaded it, and why |", "|---|---|---|"]
    lines += [f"| {label} | `{mod}` | {why} |" for label, mod, why in DIT_NOT_YET]
    return "\n".join(lines)
