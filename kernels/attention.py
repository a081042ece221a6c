"""Flash-style attention forward (online softmax, fp32 accumulation).

Layout: q [B, H, Nq, d], k and v [B, H, Nk, d] with ANY strides, so the
strided views ComfyUI/diffusers make (``t.view(B, N, H, d).transpose(1, 2)``)
go in without a copy. The output is returned as [B, H, Nq, d] whose memory is
[B, Nq, H, d] contiguous: ``out.transpose(1, 2).reshape(B, Nq, H * d)`` is free.

Head dims up to 256 are padded to the next power of two (at least 16) with
masks; key/query lengths of any size (77*k context) are masked per tile.
Matches ``F.scaled_dot_product_attention(q, k, v, scale=scale)`` (no mask,
not causal, no dropout).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelUnsupported, check_dot_dtype, check_tensor, dot_upcast, launch_first_fitting, matmul_precision, next_pow2

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["NQ", "NK", "NUM_M"])
def _attn_fwd_kernel(Q, K, V, Out, qk_scale, H, NQ, NK, D, NUM_M,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd,
                     svb, svh, svn, svd, sob, soh, som, sod,
                     PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid % NUM_M
    bh = pid // NUM_M  # programs of one (b, h) are adjacent: K/V stay in L2
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < NQ
    dmask = offs_d < D

    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, NK, BLOCK_N):
        n = start_n + offs_n
        nmask = n < NK
        kt = tl.load(k_base + n[None, :] * skn + offs_d[:, None] * skd,
                     mask=dmask[:, None] & nmask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        if UPCAST:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PREC)
        qk = tl.where(nmask[None, :], qk * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: every tile has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + n[:, None] * svn + offs_d[None, :] * svd,
                    mask=nmask[:, None] & dmask[None, :], other=0.0)
        p = p.to(V.dtype.element_ty)  # the PV product runs in the input dtype (fp32 accumulate)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             acc.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _configs(d_pad: int, fp32: bool) -> list[dict]:
    """Block configs, biggest first; later ones fit GPUs with ~99 KB of shared
    memory per block (RTX 30xx/40xx) and, last, ~64 KB (Turing)."""
    if not fp32:
        if d_pad <= 64:
            cfgs = [(64, 64, 4, 3), (64, 32, 4, 1)]
        elif d_pad <= 128:
            cfgs = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 1)]
        else:
            cfgs = [(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 1)]
    else:
        if d_pad <= 64:
            cfgs = [(64, 64, 4, 2), (64, 32, 4, 1)]
        elif d_pad <= 128:
            cfgs = [(64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 1)]
        else:
            cfgs = [(64, 32, 8, 2), (64, 32, 8, 1)]
    cfgs.append((32, 32, 4, 1))
    # tiles never depend on the token counts: a new resolution compiles no new variant
    return [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st) for bm, bn, w, st in cfgs]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q @ k^T * scale) @ v for q [B, H, Nq, d], k/v [B, H, Nk, d]
    (3-D [BH, N, d] also accepted), one float dtype for all three, d <= 256,
    Nk >= 1. ``scale`` defaults to d**-0.5. Returns [B, H, Nq, d] in q's dtype
    (memory laid out as [B, Nq, H, d])."""
    name = "attention"
    for arg, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, arg, t, _attn_fwd_kernel, device=q.device if arg != "q" else None)
        if t.dim() not in (3, 4):
            raise KernelUnsupported(f"{name}: `{arg}` has {t.dim()} dims; expected [B, heads, N, d] or [BH, N, d].")
        if t.dtype != q.dtype:
            raise KernelUnsupported(f"{name}: `{arg}` is {t.dtype} but q is {q.dtype}; one dtype for q, k, v.")
    if not (q.dim() == k.dim() == v.dim()):
        raise KernelUnsupported(f"{name}: q, k, v have {q.dim()}, {k.dim()}, {v.dim()} dims; they must match.")
    check_dot_dtype(name, q.dtype, q.device)
    squeeze = q.dim() == 3
    if squeeze:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    B, H, NQ, D = q.shape
    if k.shape[:2] != (B, H) or v.shape[:2] != (B, H) or k.shape[2] != v.shape[2]:
        raise KernelUnsupported(f"{name}: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do "
                                f"not line up (no broadcasting of batch or heads).")
    if k.shape[3] != D or v.shape[3] != D:
        raise KernelUnsupported(f"{name}: head dims q {D}, k {k.shape[3]}, v {v.shape[3]} differ.")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise KernelUnsupported(f"{name}: head dim {D} is outside 1..{MAX_HEAD_DIM}.")
    NK = k.shape[2]
    if NK == 0:
        raise KernelUnsupported(f"{name}: k and v have no keys (length 0).")
    out = torch.empty((B, NQ, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    if out.numel() == 0:
        return out.squeeze(0) if squeeze else out
    if scale is None:
        scale = D ** -0.5
    d_pad = max(16, next_pow2(D))
    fp32 = q.dtype == torch.float32
    BH = B * H

    def grid(cfg):
        return (triton.cdiv(NQ, cfg["BLOCK_M"]) * BH,)

    if triton.cdiv(NQ, 16) * BH > 2**31 - 1:
        raise KernelUnsupported(f"{name}: q of shape {tuple(q.shape)} needs more than 2**31 programs.")
    configs = _configs(d_pad, fp32)
    for cfg in configs:  # the kernel's NUM_M depends on the config's BLOCK_M
        cfg["NUM_M"] = triton.cdiv(NQ, cfg["BLOCK_M"])
    launch_first_fitting(
        _attn_fwd_kernel, (d_pad, q.dtype, configs[0]["BLOCK_M"]), configs, grid,
        (q, k, v, out, float(scale) * LOG2E, H, NQ, NK, D),
        dict(sqb=q.stride(0), sqh=q.stride(1), sqm=q.stride(2), sqd=q.stride(3),
             skb=k.stride(0), skh=k.stride(1), skn=k.stride(2), skd=k.stride(3),
             svb=v.stride(0), svh=v.stride(1), svn=v.stride(2), svd=v.stride(3),
             sob=out.stride(0), soh=out.stride(1), som=out.stride(2), sod=out.stride(3),
             PREC=matmul_precision(q.dtype), UPCAST=dot_upcast(_attn_fwd_kernel, q.dtype), BLOCK_D=d_pad),
        name, q.device)
    return out.squeeze(0) if squeeze else out


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Pure-PyTorch reference: explicit fp32 softmax attention, result in q's dtype."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)

