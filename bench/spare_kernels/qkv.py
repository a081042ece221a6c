"""Q/K/V projection in one launch, reading the live to_q/to_k/to_v weights.

``q = x @ w_q.T (+ b_q)``, ``k = ctx @ w_k.T (+ b_k)``, ``v = ctx @ w_v.T (+ b_v)``
with ``ctx = context if context is not None else x`` (self- or cross-attention).
The three weight tensors are passed on every call and read where they are:
no concatenated or prepacked copy is kept, so LoRA patches and weight moves
are always seen. Grid axis 2 picks the projection; programs of a projection
whose rows/cols end early (cross-attention: 77*k context rows) do no work.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels._common import (KernelUnsupported, cdiv, check_dot_dtype, check_row_block, check_tensor, dot_upcast,
                      launch_first_fitting, matmul_precision)


@triton.jit
def _mm_tile(A, W, BIAS, Out, M, N, K, sam, sak, swn, swk, som, pid_m, pid_n,
             HAS_BIAS: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of O = A @ W.T (+ BIAS), fp32 accumulation."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    # tiles past this projection's M or N skip the K loop (their stores are masked off)
    k_end = tl.where((pid_m * BLOCK_M < M) & (pid_n * BLOCK_N < N), K, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + rk
        kmask = kk < K
        a = tl.load(A + rm[:, None] * sam + kk[None, :] * sak, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + rn[None, :] * swn + kk[:, None] * swk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rm[:, None] * som + rn[None, :], acc.to(Out.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _qkv_kernel(X, CTX, WQ, WK, WV, BQ, BK, BV, OQ, OK, OV,
                MX, MC, KX, KC, NQ, NK, NV,
                sxm, sxk, scm, sck,
                swq_n, swq_k, swk_n, swk_k, swv_n, swv_k,
                soq, sok, sov,
                HAS_BQ: tl.constexpr, HAS_BK: tl.constexpr, HAS_BV: tl.constexpr,
                PREC: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    which = tl.program_id(2)
    # one inlined tile per branch: each keeps its own pointer types and stride specialisations
    if which == 0:
        _mm_tile(X, WQ, BQ, OQ, MX, NQ, KX, sxm, sxk, swq_n, swq_k, soq, pid_m, pid_n,
                 HAS_BQ, PREC, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    elif which == 1:
        _mm_tile(CTX, WK, BK, OK, MC, NK, KC, scm, sck, swk_n, swk_k, sok, pid_m, pid_n,
                 HAS_BK, PREC, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        _mm_tile(CTX, WV, BV, OV, MC, NV, KC, scm, sck, swv_n, swv_k, sov, pid_m, pid_n,
                 HAS_BV, PREC, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)


def _configs(dtype: torch.dtype) -> list[dict]:
    """Biggest first; the later ones fit ~99 KB (RTX 30xx/40xx/50xx) and ~64 KB of shared
    memory. fp32 (FMA, no tensor cores) takes 64x32 tiles: its 64x64 ones spill in the K
    loop on some targets (bench/targets.py)."""
    bn = 32 if dtype == torch.float32 else 64
    tiles = ((64, bn, 3), (64, bn, 2), (32, 32, 1))
    return [dict(BLOCK_M=bm, BLOCK_N=n, BLOCK_K=32, num_warps=4, num_stages=st) for bm, n, st in tiles]


def qkv_projection(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                   context: torch.Tensor | None = None, b_q: torch.Tensor | None = None,
                   b_k: torch.Tensor | None = None, b_v: torch.Tensor | None = None):
    """Return ``(F.linear(x, w_q, b_q), F.linear(ctx, w_k, b_k), F.linear(ctx, w_v, b_v))``,
    ctx = context or x. x: [..., Kx], context: [..., Kc], w_q: [Nq, Kx],
    w_k: [Nk, Kc], w_v: [Nv, Kc] (nn.Linear layout, any strides). x, context and
    the weights share one float dtype (mixed dtypes belong to ComfyUI's cast
    path); biases may be any float dtype. Outputs are contiguous, in x's dtype."""
    name = "qkv_projection"
    ctx = x if context is None else context
    check_tensor(name, "x", x, _qkv_kernel, ndim_min=1)
    dev, dt = x.device, x.dtype
    check_tensor(name, "context", ctx, _qkv_kernel, device=dev, ndim_min=1)
    for arg, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v)):
        check_tensor(name, arg, w, _qkv_kernel, device=dev)
        if w.dim() != 2:
            raise KernelUnsupported(f"{name}: `{arg}` has shape {tuple(w.shape)}; expected an nn.Linear weight [out, in].")
    for arg, t in (("context", ctx), ("w_q", w_q), ("w_k", w_k), ("w_v", w_v)):
        if t.dtype != dt:
            raise KernelUnsupported(f"{name}: `{arg}` is {t.dtype} but x is {dt}; mixed dtypes run eager "
                                    f"(ComfyUI's cast path).")
    check_dot_dtype(name, dt, dev)
    if w_q.shape[1] != x.shape[-1]:
        raise KernelUnsupported(f"{name}: w_q {tuple(w_q.shape)} does not take x's last dim {x.shape[-1]}.")
    for arg, w in (("w_k", w_k), ("w_v", w_v)):
        if w.shape[1] != ctx.shape[-1]:
            raise KernelUnsupported(f"{name}: {arg} {tuple(w.shape)} does not take the context's last dim "
                                    f"{ctx.shape[-1]}.")
    biases = []
    for arg, b, w in (("b_q", b_q, w_q), ("b_k", b_k, w_k), ("b_v", b_v, w_v)):
        if b is not None:
            check_tensor(name, arg, b, _qkv_kernel, device=dev)
            if b.shape != (w.shape[0],):
                raise KernelUnsupported(f"{name}: `{arg}` has shape {tuple(b.shape)}, expected ({w.shape[0]},).")
            b = b.contiguous()
        biases.append(b)

    KX, KC = x.shape[-1], ctx.shape[-1]
    NQ, NK, NV = w_q.shape[0], w_k.shape[0], w_v.shape[0]
    x2 = x.reshape(-1, KX)
    c2 = ctx.reshape(-1, KC)
    MX, MC = x2.shape[0], c2.shape[0]
    q = torch.empty((*x.shape[:-1], NQ), dtype=dt, device=dev)
    k = torch.empty((*ctx.shape[:-1], NK), dtype=dt, device=dev)
    v = torch.empty((*ctx.shape[:-1], NV), dtype=dt, device=dev)
    if q.numel() == 0 and k.numel() == 0 and v.numel() == 0:
        return q, k, v
    if min(KX, KC) == 0:
        raise KernelUnsupported(f"{name}: inner dim is 0 (x {tuple(x.shape)}, context {tuple(ctx.shape)}).")

    for arg, t in (("x", x2), ("context", c2), ("w_q", w_q), ("w_k", w_k), ("w_v", w_v)):
        check_row_block(name, arg, 64, t.stride(0))  # BLOCK_M / BLOCK_N <= 64
    n_max, m_max = max(NQ, NK, NV), max(MX, MC)
    if cdiv(n_max, 32) > 65535:
        raise KernelUnsupported(f"{name}: output width {n_max} is beyond the launch grid.")

    def grid(cfg):
        return (cdiv(m_max, cfg["BLOCK_M"]), cdiv(n_max, cfg["BLOCK_N"]), 3)

    configs = _configs(dt)
    dummy = w_q  # never read: HAS_B* are constexpr (bias loads are upcast to fp32, any float dtype)
    bq, bk, bv = (b if b is not None else dummy for b in biases)
    launch_first_fitting(
        _qkv_kernel, (dt,), configs, grid,
        (x2, c2, w_q, w_k, w_v, bq, bk, bv, q, k, v,
         MX, MC, KX, KC, NQ, NK, NV,
         x2.stride(0), x2.stride(1), c2.stride(0), c2.stride(1),
         w_q.stride(0), w_q.stride(1), w_k.stride(0), w_k.stride(1), w_v.stride(0), w_v.stride(1),
         NQ, NK, NV),
        dict(HAS_BQ=biases[0] is not None, HAS_BK=biases[1] is not None, HAS_BV=biases[2] is not None,
             PREC=matmul_precision(dt), UPCAST=dot_upcast(_qkv_kernel, dt)),
        name, dev)
    return q, k, v


def qkv_projection_reference(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                             context: torch.Tensor | None = None, b_q: torch.Tensor | None = None,
                             b_k: torch.Tensor | None = None, b_v: torch.Tensor | None = None):
    """Pure-PyTorch reference (fp32 math, results in x's dtype)."""
    ctx = x if context is None else context
    lin = torch.nn.functional.linear

    def f(t, w, b):
        return lin(t.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    return f(x, w_q, b_q), f(ctx, w_k, b_k), f(ctx, w_v, b_v)
