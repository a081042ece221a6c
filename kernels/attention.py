"""Flash-style attention forward (online softmax, fp32 accumulation).

Matches ``F.scaled_dot_product_attention(q, k, v, scale=scale)`` (no mask, not causal, no
dropout). q [B, H, Nq, d], k and v [B, H, Nk, d] with any strides (ComfyUI's and diffusers'
transposed views go in without a copy); the output is [B, H, Nq, d] over [B, Nq, H, d]
memory, so ``out.transpose(1, 2).reshape(B, Nq, H * d)`` is free. Head dims up to 256, any
key/query length. fp32, and views whose strides or head dim are not 16-byte multiples, run
under the interpreter only: on CUDA the launcher declines them (SDPA runs them; an unaligned
view gave wrong tails on an H100, docs/gpu.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (KernelUnsupported, Launch, NotBound, Plans, _capturing, cdiv, check_dot_dtype, check_row_block,
                      check_tensor, dot_upcast, gpu_capability, launch_first_fitting, matmul_precision, next_pow2,
                      tensor_key)

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["NQ", "NK", "NUM_M"])
def _attn_fwd_kernel(Q, K, V, Out, qk_scale, H, NQ, NK, NUM_M,
                     sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                     D: tl.constexpr, ALIGN: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr):
    """Reads one BLOCK_M-row tile of q, every key/value row of its (b, h); writes
    that tile of the output. The head dim is held as BLOCK_D columns plus, when
    BLOCK_DT > 0, a tail of BLOCK_DT columns (160 = 128 + 32, 80 = 64 + 16), so
    no power-of-two padding is multiplied."""
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
    if BLOCK_DT > 0:
        offs_t = BLOCK_D + tl.arange(0, BLOCK_DT)  # the tail's columns
        tmask = offs_t < D
    q_off, k_off, v_off, q_row = b * sqb + h * sqh, b * skb + h * skh, b * svb + h * svh, offs_m * sqm
    if ALIGN > 1:  # the launcher checked: these strides are multiples of ALIGN elements (16 bytes)
        q_off, k_off, v_off = tl.multiple_of(q_off, ALIGN), tl.multiple_of(k_off, ALIGN), tl.multiple_of(v_off, ALIGN)
        q_row = tl.multiple_of(q_row, ALIGN)
    q_rows = Q + q_off + q_row[:, None]
    q = tl.load(q_rows + offs_d[None, :] * sqd, mask=mmask[:, None] & dmask[None, :], other=0.0)
    if BLOCK_DT > 0:
        q_t = tl.load(q_rows + offs_t[None, :] * sqd, mask=mmask[:, None] & tmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        if BLOCK_DT > 0:
            q_t = q_t.to(tl.float32)
    k_base = K + k_off
    v_base = V + v_off

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if BLOCK_DT > 0:
        acc_t = tl.zeros([BLOCK_M, BLOCK_DT], dtype=tl.float32)
    for start_n in range(0, NK, BLOCK_N):
        n = start_n + offs_n
        nmask = n < NK
        k_row, v_row = n * skn, n * svn
        if ALIGN > 1:
            k_row, v_row = tl.multiple_of(k_row, ALIGN), tl.multiple_of(v_row, ALIGN)
        k_rows = k_base + k_row[None, :]
        kt = tl.load(k_rows + offs_d[:, None] * skd,
                     mask=dmask[:, None] & nmask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        if UPCAST:
            kt = kt.to(tl.float32)
        qk = tl.dot(q, kt, input_precision=PREC)
        if BLOCK_DT > 0:
            kt_t = tl.load(k_rows + offs_t[:, None] * skd,
                           mask=tmask[:, None] & nmask[None, :], other=0.0)
            if UPCAST:
                kt_t = kt_t.to(tl.float32)
            qk = tl.dot(q_t, kt_t, qk, input_precision=PREC)
        qk = tl.where(nmask[None, :], qk * qk_scale, float("-inf"))  # log2 domain
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # finite: every tile has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(V.dtype.element_ty)  # the PV product runs in the input dtype (fp32 accumulate)
        if UPCAST:
            p = p.to(tl.float32)
        v_rows = v_base + v_row[:, None]
        v = tl.load(v_rows + offs_d[None, :] * svd, mask=nmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PREC)
        if BLOCK_DT > 0:
            v_t = tl.load(v_rows + offs_t[None, :] * svd, mask=nmask[:, None] & tmask[None, :], other=0.0)
            if UPCAST:
                v_t = v_t.to(tl.float32)
            acc_t = tl.dot(p, v_t, acc_t * alpha[:, None], input_precision=PREC)
        m_i = m_new
    # out is [B, NQ, H, D] contiguous (made by the launcher): row (b, m, h) starts at ((b*NQ + m)*H + h)*D
    o_rows = Out + ((b * NQ + offs_m[:, None]) * H + h) * D
    omask = mmask[:, None]
    tl.store(o_rows + offs_d[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=omask & dmask[None, :])
    if BLOCK_DT > 0:
        tl.store(o_rows + offs_t[None, :], (acc_t / l_i[:, None]).to(Out.dtype.element_ty),
                 mask=omask & tmask[None, :])


def head_dim_blocks(d: int, capability: tuple[int, int] | None) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DT): head dim ``d`` held as a power-of-two block plus a
    power-of-two tail (0: none) when that pads less than the next power of two:
    40 -> 32 + 16, 80 -> 64 + 16, 160 -> 128 + 32 (Hopper only: with mma.sync a
    128-wide block beside a tail needs more registers than one 256-wide block),
    64 -> 64. tl.dot needs >= 16."""
    whole = max(16, next_pow2(d))
    lead = max(16, 1 << (d.bit_length() - 1))  # the largest power of two <= d
    if d <= lead or (lead > 64 and not (capability is not None and capability[0] == 9)):
        return whole, 0
    tail = max(16, next_pow2(d - lead))
    return (lead, tail) if lead + tail < whole else (whole, 0)


def _configs(d_held: int, capability: tuple[int, int] | None) -> list[dict]:
    """Block configs (BLOCK_M, BLOCK_N, warps, stages), biggest first; later ones fit
    GPUs with ~99 KB of shared memory per block (RTX 30xx/40xx/50xx) and, last, ~64 KB
    (Turing). Hopper (sm_90) gets 128-row tiles on 8 warps (two warpgroups) first."""
    if d_held <= 64:
        cfgs = [(64, 64, 4, 3), (64, 32, 4, 1)]
    elif d_held <= 128:
        cfgs = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 1)]
    else:
        cfgs = [(64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 1)]
    if capability is not None and capability[0] == 9 and d_held <= 128:
        cfgs.insert(0, (128, 64, 8, 3))
    cfgs.append((32, 32, 4, 1))
    # tiles never depend on the token counts: a new resolution compiles no new variant
    return [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st) for bm, bn, w, st in cfgs]


def fp32_declined(dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """fp32 attention runs only under the interpreter. Compiled for a GPU, its IEEE
    fp32 tiles spill 14-19 KB per thread in the key loop (sm_90a); tf32x3 with 64x32
    tiles still spills there (d 80 on sm_89, d 160 on sm_90a) and d 160 fits no
    99 KB GPU (bench/targets.py measured both). On CUDA the region runs SDPA."""
    return dtype == torch.float32 and capability is not None


def _alignment(tensors, D: int) -> int:
    """ALIGN for the kernel: the elements in 16 bytes when every q/k/v stride but the
    head dim's (which is 1) and D itself are multiples of it, else 1 (no claim)."""
    align = 16 // tensors[0].element_size()
    ok = D % align == 0 and all(t.stride(3) == 1 and all(st % align == 0 for st in t.stride()[:3]) for t in tensors)
    return align if ok else 1


_PLANS = Plans()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q @ k^T * scale) @ v for q [B, H, Nq, d], k/v [B, H, Nk, d]
    (3-D [BH, N, d] also accepted), one float dtype for all three, d <= 256,
    Nk >= 1. ``scale`` defaults to d**-0.5. Returns [B, H, Nq, d] in q's dtype
    (memory laid out as [B, Nq, H, d]). fp32 runs under the interpreter only. The checks and
    launch arithmetic run once per input signature (``_PLANS``)."""
    prec = matmul_precision(q.dtype) if isinstance(q, torch.Tensor) else None   # torch's TF32 switch, read per call
    key = _PLANS.key(tensor_key(q), tensor_key(k), tensor_key(v), scale, prec)
    plan = _PLANS.find(key)
    if plan is None:
        plan = _PLANS.put(key, _plan(q, k, v, scale, prec))
    squeeze, out_size, out_stride, launch = plan
    if squeeze:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    out = torch.empty_strided(out_size, out_stride, dtype=q.dtype, device=q.device)
    if launch is not None:
        lkey, configs, grid, args, kw, fit = launch
        if fit:   # the config that fitted this GPU at this signature before: launched as is
            fit[0](q, k, v, out)
        else:
            if _capturing():   # the fitting config is found through triton's JIT, refused in such a capture
                raise NotBound("attention: its first launch at this signature inside a CUDA graph capture")
            i, compiled = launch_first_fitting(_attn_fwd_kernel, lkey, configs, grid, (q, k, v, out, *args), kw,
                                               "attention", q.device)
            fit.append(Launch(_attn_fwd_kernel, grid(configs[i]), args, {**kw, **configs[i]}))
            fit[0].bind(compiled, (q, k, v, out))
    return out.squeeze(0) if squeeze else out


def _plan(q, k, v, scale, prec) -> tuple:
    """The checks (KernelUnsupported for inputs the kernel cannot take), then (whether 3-D inputs
    get a batch dim, the output's [B, H, Nq, d] size and the strides that lay it out as [B, Nq, H, d]
    (one allocation, no transposed view made per call), the launch: None when there is nothing to
    compute, else (config key, configs, grid of a config, scalar arguments, strides and constexprs,
    [the launch of the config that fitted], filled at the first launch))."""
    name = "attention"
    for arg, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, arg, t, _attn_fwd_kernel, device=q.device if arg != "q" else None)
        if t.dim() not in (3, 4):
            raise KernelUnsupported(f"{name}: `{arg}` has {t.dim()} dims; expected [B, heads, N, d] or [BH, N, d].")
        if t.dtype != q.dtype:
            raise KernelUnsupported(f"{name}: `{arg}` is {t.dtype} but q is {q.dtype}; one dtype for q, k, v.")
    if not (q.dim() == k.dim() == v.dim()):
        raise KernelUnsupported(f"{name}: q, k, v have {q.dim()}, {k.dim()}, {v.dim()} dims; they must match.")
    capability = gpu_capability(q.device)
    if fp32_declined(q.dtype, capability):
        raise KernelUnsupported(f"{name}: fp32 attention is not compiled for the GPU (its fp32 tiles spill "
                                f"registers); SDPA runs it (fp16/bf16 models use the kernel).")
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
    for arg, t in (("q", q), ("k", k), ("v", v)):
        check_row_block(name, arg, 128, t.stride(2))  # BLOCK_M / BLOCK_N <= 128
    align = _alignment((q, k, v), D)
    if align == 1 and capability is not None:
        raise KernelUnsupported(f"{name}: q/k/v strides or head dim {D} are not 16-byte multiples; the kernel "
                                f"runs such views under the interpreter only, SDPA runs it on the GPU.")
    out_size, out_stride = (B, H, NQ, D), (NQ * H * D, D, H * D, 1)
    if B * NQ * H * D == 0:
        return squeeze, out_size, out_stride, None
    if scale is None:
        scale = D ** -0.5
    block_d, block_dt = head_dim_blocks(D, capability)
    BH = B * H

    def grid(cfg):
        return (cdiv(NQ, cfg["BLOCK_M"]) * BH,)

    if cdiv(NQ, 16) * BH > 2**31 - 1:
        raise KernelUnsupported(f"{name}: q of shape {tuple(q.shape)} needs more than 2**31 programs.")
    configs = _configs(block_d + block_dt, capability)
    for cfg in configs:  # the kernel's NUM_M depends on the config's BLOCK_M
        cfg["NUM_M"] = cdiv(NQ, cfg["BLOCK_M"])
    kw = dict(sqb=q.stride(0), sqh=q.stride(1), sqm=q.stride(2), sqd=q.stride(3),
              skb=k.stride(0), skh=k.stride(1), skn=k.stride(2), skd=k.stride(3),
              svb=v.stride(0), svh=v.stride(1), svn=v.stride(2), svd=v.stride(3),
              D=D, ALIGN=align, PREC=prec, UPCAST=dot_upcast(_attn_fwd_kernel, q.dtype), BLOCK_D=block_d,
              BLOCK_DT=block_dt)
    return squeeze, out_size, out_stride, ((D, q.dtype, configs[0]["BLOCK_M"]), configs, grid,
                                (float(scale) * LOG2E, H, NQ, NK), kw, [])


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Pure-PyTorch reference: explicit fp32 softmax attention, result in q's dtype."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)

