"""Warmup shapes: parse and validate ``BxWxH`` pixel entries (``BxWxHxF`` with video frames), and
build dummy UNet inputs for them."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

MAX_BATCH = 64
MIN_SIDE, MAX_SIDE = 64, 8192
#: video frames of one entry (``BxWxHxF``; ComfyUI's video latent nodes default to 81, step 4): the
#: bound keeps one entry's warmup within reach of any machine's memory checks
MAX_FRAMES = 4096
LATENT_SCALE = 8
#: each entry is one warmed UNet run (plus probes): more is a mistake, not a workflow (the box the
#: entries span is covered anyway); the text bound keeps a pasted blob out of the parser and messages
MAX_ENTRIES = 32
MAX_TEXT = 4096
#: Warmup Shapes' context_tokens: 77 per CLIP chunk, at most 16 chunks (the widget's max)
MAX_CONTEXT_TOKENS = 77 * 16
_ENTRY = re.compile(r"^(\d+)\s*[xX×]\s*(\d+)\s*[xX×]\s*(\d+)(?:\s*[xX×]\s*(\d+))?$")
_MAX_DIGITS = 9  # longer numbers are out of range whatever they are (and int() of >4300 digits raises)


@dataclass(frozen=True)
class Shape:
    batch: int
    width: int
    height: int
    #: video frames (a video model's ``length``); None: one image (a one-frame video)
    frames: int | None = None

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.width}x{self.height}" + (f"x{self.frames}" if self.frames else "")


def label_of(latent, scale: int = LATENT_SCALE, time_scale: int = 1) -> str | None:
    """A model call's input latent ``[B, C, (t,) h, w]`` named as Warmup Shapes names it (``BxWxH``
    px, ``BxWxHxF`` for t > 1 latent frames of a video model; ``scale``: pixels per latent cell, 8
    for SD's VAE, 16 for Flux.2's; ``time_scale``: video frames per latent frame, 4 for Wan's)."""
    size = getattr(latent, "shape", None)
    if size is None or len(size) < 3:
        return None
    t = int(size[2]) if len(size) == 5 else 1
    frames = (t - 1) * time_scale + 1 if t > 1 and time_scale > 1 else None
    return Shape(int(size[0]), int(size[-1]) * scale, int(size[-2]) * scale, frames).label


class ShapeError(ValueError):
    pass


def _show(text: str, limit: int = 40) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters (a message never echoes a blob)."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _number(digits: str) -> int | None:
    """The entry's number, or None when it has too many digits to be in any range."""
    return int(digits) if len(digits) <= _MAX_DIGITS else None


def parse_shapes(text: str, name: str = "shapes") -> list[Shape]:
    """Entries ``BxWxH`` (batch x width x height, in pixels), or ``BxWxHxF`` with F video frames
    (a video model's length; 1 frame is an image), separated by newlines or commas. Raises
    ShapeError naming the first bad entry. Every size is bounded (batch 1..MAX_BATCH, sides
    MIN_SIDE..MAX_SIDE px, frames 1..MAX_FRAMES, MAX_ENTRIES entries, MAX_TEXT characters) here,
    before anything is allocated."""
    if not isinstance(text, str):
        raise ShapeError(f"{name}: expected text like '1x512x512', got {type(text).__name__}")
    if len(text) > MAX_TEXT:
        raise ShapeError(f"{name} is {len(text)} characters long, at most {MAX_TEXT}: give a few entries like "
                         f"1x512x512 (batch x width x height in pixels), one per line or comma separated")
    entries = [e.strip() for e in re.split(r"[,\n;]", text) if e.strip()]
    if not entries:
        raise ShapeError(f"{name} is empty: give at least one entry like 1x512x512 (batch x width x height in pixels)")
    if len(entries) > MAX_ENTRIES:
        raise ShapeError(f"{name}: {len(entries)} entries, at most {MAX_ENTRIES}: list the smallest and the largest "
                         f"shape you sample at (every batch and size between them is covered)")
    out = []
    for e in entries:
        m = _ENTRY.match(e)
        if not m:
            raise ShapeError(f"{name}: entry {_show(e)} is not BxWxH (batch x width x height in pixels, "
                             f"e.g. 1x512x512) or BxWxHxF (a video's frames too, e.g. 1x832x480x33)")
        b, w, h = (_number(g) for g in m.groups()[:3])
        f = None if m.group(4) is None else _number(m.group(4))
        if m.group(4) is not None and (f is None or not 1 <= f <= MAX_FRAMES):
            raise ShapeError(f"{name}: entry {_show(e)}: frames {f if f is not None else _show(m.group(4), 12)} "
                             f"must be between 1 and {MAX_FRAMES}")
        if b is None or not 1 <= b <= MAX_BATCH:
            raise ShapeError(f"{name}: entry {_show(e)}: batch {b if b is not None else _show(m.group(1), 12)} "
                             f"must be between 1 and {MAX_BATCH}")
        for side, v, g in (("width", w, m.group(2)), ("height", h, m.group(3))):
            if v is None or not MIN_SIDE <= v <= MAX_SIDE:
                raise ShapeError(f"{name}: entry {_show(e)}: {side} {v if v is not None else _show(g, 12)} must be "
                                 f"between {MIN_SIDE} and {MAX_SIDE} px")
            if v % LATENT_SCALE:
                raise ShapeError(f"{name}: entry {_show(e)}: {side} {v} is not divisible by {LATENT_SCALE} "
                                 f"(the VAE works on 8x8 pixel blocks); use {v - v % 8} or {v - v % 8 + 8}")
        out.append(Shape(b, w, h, f if f and f > 1 else None))
    return out


def first_level_channels(unet) -> int | None:
    """The width of the UNet's first level (320 for SD1.5 and SDXL), or None when it is not an SD UNet."""
    c = getattr(unet, "model_channels", None)                      # ComfyUI's UNetModel
    if c is None:
        c = (getattr(getattr(unet, "config", None), "block_out_channels", None) or [None])[0]   # diffusers
    return c if isinstance(c, int) and c > 0 else None


def activation_floor(shape: Shape, channels: int, itemsize: int, cell: int = LATENT_SCALE,
                     frames_of=lambda frames: 1) -> int:
    """Bytes one forward at ``shape`` needs at the least, beyond its weights: 3 tensors of batch x
    ``channels`` x its grid at once (a UNet's first-level ResBlock: input, hidden state, output; a
    DiT block's hidden width over its tokens). ``cell``: pixels per grid side (8 for a UNet's latent,
    the VAE's scale x the patch for a DiT); ``frames_of(frames)``: the grid's frames (a video DiT's
    latent frames). A floor, not an estimate (attention and feed-forward need several times more),
    so only a shape that cannot run on any setting is refused."""
    return (3 * shape.batch * channels * frames_of(shape.frames) * -(-shape.height // cell) * -(-shape.width // cell)
            * itemsize)


def device_free_bytes(device) -> int | None:
    """Free memory of ``device`` (a GPU's, or the machine's for CPU), None when it cannot be read.
    On a GPU that is the driver's free memory plus what torch's allocator holds reserved but unused
    (ComfyUI's ``get_free_memory`` counts it the same way): torch hands that out first."""
    try:
        if device.type == "cuda":
            free = int(torch.cuda.mem_get_info(device)[0])
            return free + max(0, int(torch.cuda.memory_reserved(device)) - int(torch.cuda.memory_allocated(device)))
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def memory_name(device) -> str:
    """How a message names ``device``'s memory."""
    return "the GPU" if device.type == "cuda" else "this machine"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check_memory(shapes: list[Shape], channels: int | None, itemsize: int, free_bytes: int | None,
                 where: str, name: str = "shapes", **grid) -> None:
    """ShapeError naming the first entry whose ``activation_floor`` (``grid``: its ``cell`` and
    ``frames_of``) exceeds ``free_bytes`` (what the device has for activations with the model
    loaded), before anything is allocated for it. Unknown width or free memory: nothing to check."""
    if channels is None or not free_bytes or free_bytes <= 0:
        return
    for s in shapes:
        need = activation_floor(s, channels, itemsize, **grid)
        if need > free_bytes:
            raise ShapeError(
                f"{name}: entry {s.label} needs at least {_size(need)} of activations, {where} has "
                f"{_size(free_bytes)} for them: warm the batch and size you sample "
                f"at (a smaller batch, or tile the image with an upscaler), or free memory")


def check_frames(shapes: list[Shape], video: bool, name: str = "shapes") -> None:
    """ShapeError naming the first entry with video frames when the model makes images."""
    if video:
        return
    for s in shapes:
        if s.frames:
            raise ShapeError(f"{name}: entry {s.label} gives {s.frames} video frames, but this model makes images "
                             f"(its latent has no time axis): write it as {s.batch}x{s.width}x{s.height}")


def validate_shapes_input(text, node: str = "Warmup Shapes"):
    """ComfyUI validate hook result: True, or the message naming the bad entry. None is True: ComfyUI
    passes None for an input linked from another node (its value exists only when the prompt runs,
    and Warmup Shapes parses it then) and for a missing one (ComfyUI reports that itself)."""
    if text is None:
        return True
    try:
        parse_shapes(text)
    except ShapeError as e:
        return f"{node}: {e}"
    return True


def check_context_tokens(tokens, name: str = "context_tokens") -> int:
    """``tokens`` as the warmup's prompt length, or ShapeError. ComfyUI checks the widget's range only
    for a typed-in value: one linked from another node (a PrimitiveInt) arrives unchecked."""
    if isinstance(tokens, bool) or not isinstance(tokens, int):
        raise ShapeError(f"{name}: expected a whole number of tokens (77 per CLIP chunk), got "
                         f"{type(tokens).__name__} {_show(str(tokens), 20)}")
    if not 1 <= tokens <= MAX_CONTEXT_TOKENS:
        raise ShapeError(f"{name}: {tokens} must be between 1 and {MAX_CONTEXT_TOKENS} (77 per CLIP chunk, "
                         f"at most 16 chunks)")
    return tokens


def as_shapes(shapes) -> list[Shape]:
    """Accept a string, Shape objects or (batch, width, height[, frames]) tuples."""
    if isinstance(shapes, str):
        return parse_shapes(shapes)
    out = []
    for s in shapes:
        out.append(s if isinstance(s, Shape) else parse_shapes("x".join(str(int(v)) for v in s))[0])
    return out


def unet_inputs(unet, family: str, shape: Shape, tokens: int, dtype, device) -> tuple[tuple, dict]:
    """Random (args, kwargs) for one forward of ``unet`` at ``shape``."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    b, lh, lw = shape.batch, shape.height // LATENT_SCALE, shape.width // LATENT_SCALE
    t = torch.full((b,), 500.0, device=device)
    if family == "comfy":
        kwargs = {"context": rnd(b, tokens, context_dim(unet))}
        if isinstance(getattr(unet, "label_emb", None), torch.nn.Embedding):  # class labels (x4 upscaler's noise level)
            kwargs["y"] = torch.randint(0, unet.label_emb.num_embeddings, (b,), generator=g).to(device)
        elif unet.num_classes is not None:
            kwargs["y"] = rnd(b, unet.label_emb[0][0].in_features)  # SDXL: ADM vector (2816)
        return (rnd(b, unet.in_channels, lh, lw), t), kwargs
    cfg = unet.config
    unserved = _diffusers_inputs_unserved(cfg)
    if unserved:
        raise ShapeError(f"warmup: this UNet2DConditionModel takes {unserved}, which warmup does not make up. Fix: "
                         f"warm it by calling the compiled UNet yourself once per shape, with your pipeline's "
                         f"inputs (each first call compiles), then sample")
    width = cfg.cross_attention_dim if getattr(cfg, "encoder_hid_dim", None) is None else cfg.encoder_hid_dim
    kwargs = {"encoder_hidden_states": rnd(b, tokens, width)}
    if getattr(cfg, "addition_embed_type", None) == "text_time":
        n_time = 6
        text_dim = cfg.projection_class_embeddings_input_dim - n_time * cfg.addition_time_embed_dim
        kwargs["added_cond_kwargs"] = {"text_embeds": rnd(b, text_dim), "time_ids": rnd(b, n_time)}
    if getattr(cfg, "num_class_embeds", None) is not None:        # class-conditioned (the x4 upscaler's noise level)
        kwargs["class_labels"] = torch.randint(0, cfg.num_class_embeds, (b,), generator=g).to(device)
    elif getattr(cfg, "class_embed_type", None) == "timestep":
        kwargs["class_labels"] = torch.full((b,), 20.0, device=device)
    if getattr(cfg, "time_cond_proj_dim", None) is not None:      # LCM's guidance embedding
        kwargs["timestep_cond"] = rnd(b, cfg.time_cond_proj_dim)
    return (rnd(b, cfg.in_channels, lh, lw), t), kwargs


def _diffusers_inputs_unserved(cfg) -> str | None:
    """The conditioning a diffusers UNet's config asks for that :func:`unet_inputs` cannot make up."""
    if getattr(cfg, "addition_embed_type", None) not in (None, "text_time", "text"):   # ("text": from the context)
        return f"added conditioning of type {cfg.addition_embed_type!r} (image or text embeddings)"
    if getattr(cfg, "class_embed_type", None) not in (None, "timestep"):
        return f"class labels of type {cfg.class_embed_type!r}"
    if getattr(cfg, "encoder_hid_dim", None) is not None and getattr(cfg, "encoder_hid_dim_type", None) not in (
            None, "text_proj"):
        return f"an encoder projection of type {cfg.encoder_hid_dim_type!r} (image embeddings)"
    return None


def context_dim(unet) -> int:
    """Width of the cross-attention context (768 SD1.5, 2048 SDXL): attn2's to_k input."""
    for m in unet.modules():
        attn2 = getattr(m, "attn2", None)
        if attn2 is not None and hasattr(attn2, "to_k"):
            return attn2.to_k.in_features
    raise ValueError("no cross-attention (attn2) found: cannot size the warmup context")
