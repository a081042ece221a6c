"""The leaf-region bodies every backend accelerates, written once over the ops they are made of.

Each body is a plain function of (region module, inputs), so one compiled callable serves
every instance of a block; parameters are read live on every call. Its ops come from
``ops``: :class:`Ops` (the torch ops: what inductor compiles and IPEX runs) or a backend's
subclass. With the torch ops a body computes what the model's own code computes, attention
on SDPA; a variant a body does not cover runs the model's own code. to_q/to_k/to_v/to_out,
the convs and the linears stay module calls (LoRA and attention patches address them by name).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .plan import (ATTENTION, DOUBLE_BLOCK, FEEDFORWARD, JOINT_BLOCK, LUMINA_BLOCK, NORM_ACT, QWEN_IMAGE_BLOCK,
                   RESBLOCK, SINGLE_BLOCK, WAN_BLOCK)


class Ops:
    """The ops a region body is made of, each as the torch ops it stands for. A backend with
    faster versions subclasses this and overrides members; the bodies stay as they are."""

    def decline(self, why: str) -> None:
        """A body met a variant it does not cover and runs the model's own code (``why``: the
        reason a backend reports). Nothing to do for the torch ops."""

    def group_norm_silu(self, norm, x):
        """``SiLU(norm(x))`` for a GroupNorm module ``norm``."""
        return F.silu(norm(x))

    def attention(self, q, k, v):
        """Attention on (b, heads, n, d) views of q, k and v: no mask, not causal."""
        return F.scaled_dot_product_attention(q, k, v)

    def geglu(self, hidden, approximate: str):
        """GEGLU's epilogue on the projection's output: ``a * gelu(gate)`` of its two halves."""
        a, gate = hidden.chunk(2, dim=-1)
        return a * F.gelu(gate, approximate=approximate)

    def conv_residual(self, conv, h, residual):
        """``conv(h) + residual`` (the bias+residual epilogue of a ResBlock's last conv)."""
        return conv(h) + residual

    def rope(self, x, freqs):
        """Rotary embedding of ``x`` (..., d) by Flux-style ``freqs`` (..., d/2, 2, 2) broadcast to it
        (Flux: x (b, heads, n, d), freqs (b or 1, 1, n, d/2, 2, 2); Wan: x (b, n, heads, d), freqs
        (1, n, 1, d/2, 2, 2)): each pair (x0, x1) becomes ``freqs[..., 0] * x0 + freqs[..., 1] * x1``
        in freqs' dtype. Freqs longer than x's tokens on dim 2 are cut to them, as ComfyUI's
        ``apply_rope1`` (comfy-kitchen) does."""
        if x.ndim > 2 and freqs.ndim > 2 and x.shape[2] != 1 and freqs.shape[2] > x.shape[2]:
            freqs = freqs[:, :, :x.shape[2]]
        x_ = x.to(dtype=freqs.dtype).reshape(*x.shape[:-1], -1, 1, 2)
        out = freqs[..., 0] * x_[..., 0] + freqs[..., 1] * x_[..., 1]
        return out.reshape(*x.shape).type_as(x)


TORCH_OPS = Ops()


def _is(m, name):
    return type(m).__name__ == name or any(c.__name__ == name for c in type(m).__mro__)


def split_heads(q, k, v, heads):
    """(b, n, heads*d) -> (b, heads, n, d) for q, k and v, the way ComfyUI's attention views them:
    k and v take q's batch (its ``t.view(b, -1, heads, d)``). A patch that folds tiles into q's batch
    only (HyperTile's attn1 patch) thereby folds k/v's tokens the same way; that is the reference."""
    # explicit sizes, no -1: a view(b, -1, ...) makes dynamo guard on a divisibility expression of
    # the sequence length, which later shapes fail; the common case (k, v share q's batch) keeps that
    b, n, inner = q.shape
    d = inner // heads

    def tokens(t):
        return t.shape[1] if t.shape[0] == b else t.shape[0] * t.shape[1] // b
    return (q.view(b, n, heads, d).transpose(1, 2), k.view(b, tokens(k), heads, d).transpose(1, 2),
            v.view(b, tokens(v), heads, d).transpose(1, 2))


def attend(q, k, v, heads, *, ops: Ops = TORCH_OPS):
    """Multi-head attention on (b, n, heads*d) q, k, v (k and v viewed as ComfyUI does)."""
    b, n, inner = q.shape
    out = ops.attention(*split_heads(q, k, v, heads))
    return out.transpose(1, 2).reshape(b, n, inner)


def comfy_resblock(block, x, emb, *, ops: Ops = TORCH_OPS):
    """ComfyUI ResBlock._forward for the plain SD block (no up/down, no scale-shift norm)."""
    if (block.updown or block.use_scale_shift_norm or block.skip_t_emb
            or getattr(block, "exchange_temb_dims", False) or len(block.in_layers) != 3
            or not isinstance(block.in_layers[0], torch.nn.GroupNorm)
            or not isinstance(block.in_layers[1], torch.nn.SiLU)
            or len(block.out_layers) != 4 or not isinstance(block.out_layers[1], torch.nn.SiLU)):
        ops.decline("resblock variant")
        return type(block)._forward(block, x, emb)
    h = block.in_layers[2](ops.group_norm_silu(block.in_layers[0], x))
    emb_out = block.emb_layers(emb).type(h.dtype)
    while emb_out.dim() < h.dim():
        emb_out = emb_out[..., None]
    h = h + emb_out
    h = block.out_layers[2](ops.group_norm_silu(block.out_layers[0], h))  # [2] is Dropout (identity in eval)
    return ops.conv_residual(block.out_layers[3], h, block.skip_connection(x))


def diffusers_resblock(block, input_tensor, temb, *, ops: Ops = TORCH_OPS):
    """diffusers ResnetBlock2D.forward for the plain SD block (default time-embedding norm, SiLU,
    no up/down, output scale 1)."""
    if (block.upsample is not None or block.downsample is not None or block.time_embedding_norm != "default"
            or not isinstance(block.nonlinearity, torch.nn.SiLU) or block.output_scale_factor != 1.0
            or temb is None or block.time_emb_proj is None):
        ops.decline("resblock variant")
        return type(block).forward(block, input_tensor, temb)
    h = block.conv1(ops.group_norm_silu(block.norm1, input_tensor))
    t = block.time_emb_proj(temb if block.skip_time_act else F.silu(temb))[:, :, None, None]
    h = block.dropout(ops.group_norm_silu(block.norm2, h + t))
    skip = block.conv_shortcut(input_tensor) if block.conv_shortcut is not None else input_tensor
    return ops.conv_residual(block.conv2, h, skip)


def comfy_attention(attn, x, context=None, value=None, *, ops: Ops = TORCH_OPS):
    """ComfyUI CrossAttention.forward (mask=None, no override) on SDPA.

    to_q/to_k/to_v/to_out stay the real modules: LoRA keys and attention
    patches address them by name.
    """
    q = attn.to_q(x)
    ctx = x if context is None else context
    k = attn.to_k(ctx)
    v = attn.to_v(ctx if value is None else value)
    return attn.to_out(attend(q, k, v, attn.heads, ops=ops))


def diffusers_attention(attn, hidden_states, encoder_hidden_states=None, *, ops: Ops = TORCH_OPS):
    """diffusers Attention + AttnProcessor2_0 for the plain SD/SDXL case the
    planner admits (no norms, no residual, rescale 1, 3-D input)."""
    ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    q, k, v = attn.to_q(hidden_states), attn.to_k(ctx), attn.to_v(ctx)
    out = attend(q, k, v, attn.heads, ops=ops).to(q.dtype)
    out = attn.to_out[0](out)
    return attn.to_out[1](out)


def feedforward(ff, x, *, ops: Ops = TORCH_OPS):
    """A GEGLU feed-forward (ComfyUI's and diffusers' FeedForward: GEGLU, dropout, linear)."""
    glu = ff.net[0]
    proj = getattr(glu, "proj", None)
    approximate = getattr(glu, "approximate", "none")
    if not _is(glu, "GEGLU") or proj is None or approximate not in ("none", "tanh"):
        ops.decline("feed-forward without GEGLU")
        return type(ff).forward(ff, x)
    h = ops.geglu(proj(x), approximate)
    for m in list(ff.net)[1:]:
        h = m(h)
    return h


def norm_act(seq, x, *, ops: Ops = TORCH_OPS):
    """ComfyUI's output head ``Sequential(GroupNorm, SiLU, conv)`` (the planner checks that shape)."""
    return seq[2](ops.group_norm_silu(seq[0], x))


def _mod(x, scale, shift):
    """Flux's ``apply_mod`` without modulation_dims: ``x * (1 + scale) + shift``."""
    return torch.addcmul(shift, x, 1 + scale)


def _qkv(attn, x, heads):
    """Flux's SelfAttention projection: (q, k, v) as (b, heads, n, d), q and k RMS-normed."""
    qkv = attn.qkv(x)
    q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, heads, -1).permute(2, 0, 3, 1, 4)
    q, k = attn.norm(q, k, v)
    return q, k, v


def _flux_attention(q, k, v, pe, ops):
    """comfy.ldm.flux.math.attention without a mask: RoPE, then attention, heads merged."""
    if pe is not None:
        q, k = ops.rope(q, pe), ops.rope(k, pe)
    b, heads, n, d = q.shape
    return ops.attention(q, k, v).transpose(1, 2).reshape(b, n, heads * d)


def _fp16_clamp(x):
    return torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504) if x.dtype == torch.float16 else x


def _given(given, i):
    """The ``i``-th (shift, scale, gate) of modulation handed to a block (Flux.2's global modulation,
    Chroma's distilled one), which the shim flattened into tensors."""
    return given[3 * i], given[3 * i + 1], given[3 * i + 2]


def flux_double_block(block, img, txt, vec, pe, *given, ops: Ops = TORCH_OPS):
    """ComfyUI's Flux DoubleStreamBlock.forward (no mask, no modulation_dims: the shim sends other
    calls to the block's own forward). Its modulation from ``vec`` through the block's own
    modulation layers, or (``vec`` None) handed to it: ``given`` = 4 x (shift, scale, gate), img's
    two then txt's two. Returns (img, txt)."""
    if vec is not None:
        (i1, i2), (t1, t2) = block.img_mod(vec), block.txt_mod(vec)
        i1, i2, t1, t2 = ((m.shift, m.scale, m.gate) for m in (i1, i2, t1, t2))
    else:
        i1, i2, t1, t2 = (_given(given, i) for i in range(4))
    img_q, img_k, img_v = _qkv(block.img_attn, _mod(block.img_norm1(img), i1[1], i1[0]), block.num_heads)
    txt_q, txt_k, txt_v = _qkv(block.txt_attn, _mod(block.txt_norm1(txt), t1[1], t1[0]), block.num_heads)
    first, second = ((img_q, img_k, img_v), (txt_q, txt_k, txt_v)) if block.flipped_img_txt else \
        ((txt_q, txt_k, txt_v), (img_q, img_k, img_v))
    q, k, v = (torch.cat((first[i], second[i]), dim=2) for i in range(3))
    attn = _flux_attention(q, k, v, pe, ops)
    n_first = first[0].shape[2]
    if block.flipped_img_txt:
        img_attn, txt_attn = attn[:, :n_first], attn[:, n_first:]
    else:
        txt_attn, img_attn = attn[:, :n_first], attn[:, n_first:]
    img = img + block.img_attn.proj(img_attn) * i1[2]
    img = img + block.img_mlp(_mod(block.img_norm2(img), i2[1], i2[0])) * i2[2]
    txt = txt + block.txt_attn.proj(txt_attn) * t1[2]
    txt = txt + block.txt_mlp(_mod(block.txt_norm2(txt), t2[1], t2[0])) * t2[2]
    return img, _fp16_clamp(txt)


def flux_single_block(block, x, vec, pe, *given, ops: Ops = TORCH_OPS):
    """ComfyUI's Flux SingleStreamBlock.forward (no mask, no modulation_dims); its modulation from
    ``vec``, or (``vec`` None) handed to it as ``given`` = (shift, scale, gate)."""
    if vec is not None:
        mod, _ = block.modulation(vec)
        shift, scale, gate = mod.shift, mod.scale, mod.gate
    else:
        shift, scale, gate = _given(given, 0)
    qkv, mlp = torch.split(block.linear1(_mod(block.pre_norm(x), scale, shift)),
                           [3 * block.hidden_size, block.mlp_hidden_dim_first], dim=-1)
    q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, block.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = block.norm(q, k, v)
    attn = _flux_attention(q, k, v, pe, ops)
    if block.yak_mlp:
        half = block.mlp_hidden_dim_first // 2
        mlp = block.mlp_act(mlp[..., half:]) * mlp[..., :half]
    else:
        mlp = block.mlp_act(mlp)
    x = x + block.linear2(torch.cat((attn, mlp), 2)) * gate
    return _fp16_clamp(x)


def _qwen_modulate(x, params):
    """Qwen-Image's ``_modulate`` without a timestep-zero split: (modulated x, gate)."""
    shift, scale, gate = params.chunk(3, dim=-1)
    return torch.addcmul(shift.unsqueeze(1), x, 1 + scale.unsqueeze(1)), gate.unsqueeze(1)


def qwen_image_block(block, img, txt, temb, pe, *, ops: Ops = TORCH_OPS):
    """ComfyUI's QwenImageTransformerBlock.forward without ``timestep_zero_index`` (its attention
    takes no mask: the text mask ComfyUI passes is not used by it). Returns (txt, img), as it does."""
    img_mod1, img_mod2 = block.img_mod(temb).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)
    img_m, img_gate1 = _qwen_modulate(block.img_norm1(img), img_mod1)
    txt_m, txt_gate1 = _qwen_modulate(block.txt_norm1(txt), txt_mod1)
    attn = block.attn
    b, n_img, n_txt = img.shape[0], img.shape[1], txt.shape[1]

    def heads(t, n):
        return t.view(b, n, attn.heads, -1).transpose(1, 2)
    q = torch.cat((attn.norm_added_q(heads(attn.add_q_proj(txt_m), n_txt)),
                   attn.norm_q(heads(attn.to_q(img_m), n_img))), dim=2)
    k = torch.cat((attn.norm_added_k(heads(attn.add_k_proj(txt_m), n_txt)),
                   attn.norm_k(heads(attn.to_k(img_m), n_img))), dim=2)
    v = torch.cat((heads(attn.add_v_proj(txt_m), n_txt), heads(attn.to_v(img_m), n_img)), dim=2)
    out = _flux_attention(q, k, v, pe, ops)
    img = torch.addcmul(img, img_gate1, attn.to_out[1](attn.to_out[0](out[:, n_txt:])))
    txt = txt + txt_gate1 * attn.to_add_out(out[:, :n_txt])
    img_m2, img_gate2 = _qwen_modulate(block.img_norm2(img), img_mod2)
    img = torch.addcmul(img, img_gate2, block.img_mlp(img_m2))
    txt_m2, txt_gate2 = _qwen_modulate(block.txt_norm2(txt), txt_mod2)
    txt = torch.addcmul(txt, txt_gate2, block.txt_mlp(txt_m2))
    return txt, img


def wan_block(block, x, e, freqs, context, context_img, *, ops: Ops = TORCH_OPS):
    """ComfyUI's WanAttentionBlock.forward with Wan's own attention classes (the planner checks them)
    and a modulation ``e`` of one step for all tokens ((b, 6, dim), or (b, 1 or n, 6, dim)) or one
    per frame ((b, frames, 6, dim): Wan 2.2 TI2V with a start image; frames divide the tokens).
    ``context_img``: the image tokens an image-to-video block's cross-attention reads (the shim
    splits them off ``context``), None for text-to-video. The block's ``modulation`` parameter is
    cast to x as ComfyUI's ``cast_to`` does."""
    mod = block.modulation.to(device=x.device, dtype=x.dtype)
    e = (mod + e).chunk(6, dim=1) if e.ndim < 4 else (mod.unsqueeze(0) + e).unbind(2)
    x = x.contiguous()
    sa = block.self_attn
    b, n, heads, d = x.shape[0], x.shape[1], sa.num_heads, sa.head_dim
    frames, tokens = _wan_frames(e[0].shape[1], b, n)
    if frames is not None:           # one modulation per frame: each over its frame's tokens
        e = [t.unsqueeze(2) for t in e]
    else:
        frames = tokens = _same
    h = tokens(torch.addcmul(e[0], frames(block.norm1(x)), 1 + e[1]))
    q = ops.rope(sa.norm_q(sa.q(h)).view(b, n, heads, d), freqs)
    k = ops.rope(sa.norm_k(sa.k(h)).view(b, n, heads, d), freqs)
    v = sa.v(h).view(b, n, heads, d)
    y = _heads_attention([(q, k, v)], ops)
    x = tokens(torch.addcmul(frames(x), frames(sa.o(y)), e[2]))
    ca = block.cross_attn
    q = ca.norm_q(ca.q(block.norm3(x)))
    y = attend(q, ca.norm_k(ca.k(context)), ca.v(context), ca.num_heads, ops=ops)
    if context_img is not None:
        y = y + attend(q, ca.norm_k_img(ca.k_img(context_img)), ca.v_img(context_img), ca.num_heads, ops=ops)
    x = x + ca.o(y)
    y = block.ffn(tokens(torch.addcmul(e[3], frames(block.norm2(x)), 1 + e[4])))
    return tokens(torch.addcmul(frames(x), frames(y), e[5]))


def _same(t):
    return t


def _wan_frames(m, b, n):
    """For a Wan modulation of ``m`` rows over ``n`` tokens: (None, None) when it is one row or one per
    token; else m frames of n / m tokens each (the shim checks m divides n; ComfyUI's ``repeat_e``
    repeats each row over its frame's tokens): views (b, n, c) -> (b, m, n / m, c) and back."""
    if m == 1 or m == n:
        return None, None
    return (lambda t: t.view(b, m, n // m, t.shape[-1])), (lambda t: t.reshape(b, n, t.shape[-1]))


def _mmdit_qkv(attn, x):
    """MMDiT's SelfAttention.pre_attention: q, k, v as (b, n, heads, d), q and k normed per head."""
    qkv = attn.qkv(x)
    q, k, v = qkv.reshape(qkv.shape[0], qkv.shape[1], 3, -1, attn.head_dim).movedim(2, 0)
    return attn.ln_q(q), attn.ln_k(k), v


def _mmdit_mod(x, shift, scale):
    """MMDiT's ``modulate``: ``x * (1 + scale) + shift`` per sample."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def _heads_attention(qkvs, ops):
    """Attention over (b, n, heads, d) q, k, v given as [(q, k, v), ...] joined along the tokens;
    the result (b, n, heads * d)."""
    q, k, v = (torch.cat(p, dim=1).transpose(1, 2) if len(p) > 1 else p[0].transpose(1, 2)
               for p in zip(*qkvs, strict=True))
    out = ops.attention(q, k, v).transpose(1, 2)
    b, n, heads, d = out.shape             # explicit sizes (see split_heads)
    return out.reshape(b, n, heads * d)


def mmdit_joint_block(block, context, x, c, *, ops: Ops = TORCH_OPS):
    """ComfyUI's MMDiT JointBlock.forward (``_block_mixing``; SD3 / SD3.5): the context and image
    blocks' joint attention, SD3.5 Medium's second image self-attention, a last block whose context
    half only feeds the attention (context None out). Blocks with scale-only modulation are not
    the body's (the planner leaves them). Returns (context, x)."""
    cb, xb = block.context_block, block.x_block
    cm = cb.adaLN_modulation(c).chunk(2 if cb.pre_only else 6, dim=1)
    ctx_qkv = _mmdit_qkv(cb.attn, _mmdit_mod(cb.norm1(context), cm[0], cm[1]))
    xm = xb.adaLN_modulation(c).chunk(9 if xb.x_block_self_attn else 6, dim=1)
    x_norm = xb.norm1(x)
    attn = _heads_attention([ctx_qkv, _mmdit_qkv(xb.attn, _mmdit_mod(x_norm, xm[0], xm[1]))], ops)
    n_ctx = context.shape[1]
    ctx_attn, x_attn = attn[:, :n_ctx], attn[:, n_ctx:]
    if cb.pre_only:
        context = None
    else:
        context = context + cm[2].unsqueeze(1) * cb.attn.proj(ctx_attn)
        context = context + cm[5].unsqueeze(1) * cb.mlp(_mmdit_mod(cb.norm2(context), cm[3], cm[4]))
    if xb.x_block_self_attn:
        attn2 = _heads_attention([_mmdit_qkv(xb.attn2, _mmdit_mod(x_norm, xm[6], xm[7]))], ops)
        x = torch.stack([x, xm[2].unsqueeze(1) * xb.attn.proj(x_attn),
                         xm[8].unsqueeze(1) * xb.attn2.proj(attn2)], dim=0).sum(dim=0)
    else:
        x = x + xm[2].unsqueeze(1) * xb.attn.proj(x_attn)
    x = x + xm[5].unsqueeze(1) * xb.mlp(_mmdit_mod(xb.norm2(x), xm[3], xm[4]))
    return context, x


def lumina_block(block, x, freqs, adaln, *, ops: Ops = TORCH_OPS):
    """ComfyUI's Lumina 2 / Z-Image JointTransformerBlock.forward without a mask (the shim sends a
    masked call to the block's own forward): grouped-query attention with per-head RMS-normed q and
    k and RoPE, a SwiGLU feed-forward; modulated by ``adaln`` (tanh gates), or not (None: the
    context refiner's blocks)."""
    attn = block.attention
    b, n = x.shape[0], x.shape[1]
    heads, kv, d = attn.n_local_heads, attn.n_local_kv_heads, attn.head_dim

    def attention(h):
        q, k, v = torch.split(attn.qkv(h), [heads * d, kv * d, kv * d], dim=-1)
        q = ops.rope(attn.q_norm(q.view(b, n, heads, d)), freqs)
        k = ops.rope(attn.k_norm(k.view(b, n, kv, d)), freqs)
        v = v.view(b, n, kv, d)
        if heads > kv:         # (ComfyUI's n_rep >= 1 repeats by 1 too: the same values, copied)
            k, v = (t.unsqueeze(3).repeat(1, 1, 1, heads // kv, 1).flatten(2, 3) for t in (k, v))
        return attn.out(_heads_attention([(q, k, v)], ops))
    if block.modulation:
        scale_msa, gate_msa, scale_mlp, gate_mlp = block.adaLN_modulation(adaln).chunk(4, dim=1)
        x = x + gate_msa.unsqueeze(1).tanh() * block.attention_norm2(
            _fp16_clamp(attention(block.attention_norm1(x) * (1 + scale_msa.unsqueeze(1)))))
        return x + gate_mlp.unsqueeze(1).tanh() * block.ffn_norm2(
            _fp16_clamp(block.feed_forward(block.ffn_norm1(x) * (1 + scale_mlp.unsqueeze(1)))))
    x = x + block.attention_norm2(_fp16_clamp(attention(block.attention_norm1(x))))
    return x + block.ffn_norm2(block.feed_forward(block.ffn_norm1(x)))


#: (family, region kind) -> body; every backend accelerates these same functions
BODIES = {
    ("comfy", RESBLOCK): comfy_resblock,
    ("comfy", ATTENTION): comfy_attention,
    ("comfy", FEEDFORWARD): feedforward,
    ("comfy", NORM_ACT): norm_act,
    ("comfy", DOUBLE_BLOCK): flux_double_block,
    ("comfy", SINGLE_BLOCK): flux_single_block,
    ("comfy", QWEN_IMAGE_BLOCK): qwen_image_block,
    ("comfy", WAN_BLOCK): wan_block,
    ("comfy", JOINT_BLOCK): mmdit_joint_block,
    ("comfy", LUMINA_BLOCK): lumina_block,
    ("diffusers", RESBLOCK): diffusers_resblock,
    ("diffusers", ATTENTION): diffusers_attention,
    ("diffusers", FEEDFORWARD): feedforward,
}


def bodies(ops: Ops) -> dict:
    """BODIES on a backend's ops: {(family, region kind): callable(region module, *inputs)}."""
    return {key: functools.partial(body, ops=ops) for key, body in BODIES.items()}
