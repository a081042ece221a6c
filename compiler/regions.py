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

from .plan import ATTENTION, FEEDFORWARD, NORM_ACT, RESBLOCK


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


#: (family, region kind) -> body; every backend accelerates these same functions
BODIES = {
    ("comfy", RESBLOCK): comfy_resblock,
    ("comfy", ATTENTION): comfy_attention,
    ("comfy", FEEDFORWARD): feedforward,
    ("comfy", NORM_ACT): norm_act,
    ("diffusers", RESBLOCK): diffusers_resblock,
    ("diffusers", ATTENTION): diffusers_attention,
    ("diffusers", FEEDFORWARD): feedforward,
}


def bodies(ops: Ops) -> dict:
    """BODIES on a backend's ops: {(family, region kind): callable(region module, *inputs)}."""
    return {key: functools.partial(body, ops=ops) for key, body in BODIES.items()}
