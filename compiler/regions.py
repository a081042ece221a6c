"""The leaf-region bodies the backends accelerate.

Each body is a plain function of (region module, inputs) so that ONE compiled
callable serves every instance of a block (regional compilation: identical
blocks share compiled code; parameters are graph inputs, read live on every
call). Where the model's own method is already a pure leaf (ResBlock bodies,
feed-forwards) we use it as is, so ComfyUI / diffusers code changes flow
through; attention is rewritten onto SDPA because ComfyUI's CPU attention
(sub-quadratic, memory probes) breaks graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .plan import ATTENTION, FEEDFORWARD, NORM_ACT, RESBLOCK


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


def _sdpa(q, k, v, heads):
    b, n, inner = q.shape
    out = F.scaled_dot_product_attention(*split_heads(q, k, v, heads))
    return out.transpose(1, 2).reshape(b, n, inner)


def comfy_resblock(block, x, emb):
    return type(block)._forward(block, x, emb)


def comfy_attention(attn, x, context=None, value=None):
    """ComfyUI CrossAttention.forward (mask=None, no override) on SDPA.

    to_q/to_k/to_v/to_out stay the real modules: LoRA keys and attention
    patches address them by name.
    """
    q = attn.to_q(x)
    ctx = x if context is None else context
    k = attn.to_k(ctx)
    v = attn.to_v(ctx if value is None else value)
    out = _sdpa(q, k, v, attn.heads)
    return attn.to_out(out)


def diffusers_attention(attn, hidden_states, encoder_hidden_states=None):
    """diffusers Attention + AttnProcessor2_0 for the plain SD/SDXL case the
    planner admits (no norms, no residual, rescale 1, 3-D input)."""
    ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    q, k, v = attn.to_q(hidden_states), attn.to_k(ctx), attn.to_v(ctx)
    out = _sdpa(q, k, v, attn.heads).to(q.dtype)
    out = attn.to_out[0](out)
    return attn.to_out[1](out)


def diffusers_resblock(block, input_tensor, temb):
    return type(block).forward(block, input_tensor, temb)


def feedforward(ff, x):
    return type(ff).forward(ff, x)


def sequential(seq, x):
    return torch.nn.Sequential.forward(seq, x)


#: (family, region kind) -> body; every backend accelerates these same functions
BODIES = {
    ("comfy", RESBLOCK): comfy_resblock,
    ("comfy", ATTENTION): comfy_attention,
    ("comfy", FEEDFORWARD): feedforward,
    ("comfy", NORM_ACT): sequential,
    ("diffusers", RESBLOCK): diffusers_resblock,
    ("diffusers", ATTENTION): diffusers_attention,
    ("diffusers", FEEDFORWARD): feedforward,
}
