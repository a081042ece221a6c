"""GroupNorm (+ optional fused SiLU) for NCHW-contiguous and channels_last inputs.

Two launches:
  1. ``_gn_stats_kernel``: grid (N*G, chunks). Each program reduces one chunk of
     one (sample, group) with a per-block two-pass mean/M2 merged by Chan's
     formula (no sum-of-squares cancellation), writing (mean, M2, count).
  2. ``_gn_apply_kernel``: grid over (spatial tiles, channel tiles, N). Each
     program merges the chunk partials of the groups its channels belong to,
     folds rstd/weight/bias into a per-channel scale/shift and writes
     ``x * scale + shift`` (then SiLU), in the input's memory layout.

Weight and bias are read from the tensors passed on every call (live LoRA safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelUnsupported, check_tensor, next_pow2

MAX_CHUNKS = 64
STATS_BLOCK = 1024
APPLY_BLOCK_S = 256


@triton.jit(do_not_specialize=["NUM_CHUNKS"])
def _gn_stats_kernel(X, P_MEAN, P_M2, P_CNT,
                     C, S, G, CPG, CHUNK, NUM_CHUNKS,
                     stride_n, stride_c, stride_s,
                     CH_INNER: tl.constexpr, CONTIG: tl.constexpr, BLOCK: tl.constexpr):
    ng = tl.program_id(0)
    chunk = tl.program_id(1)
    n = ng // G
    g = ng % G
    base = X + n * stride_n + g * CPG * stride_c
    elems = CPG * S
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, elems)
    mean = tl.zeros([], dtype=tl.float32)
    m2 = tl.zeros([], dtype=tl.float32)
    count = tl.zeros([], dtype=tl.float32)
    for off in range(start, end, BLOCK):
        i = off + tl.arange(0, BLOCK)
        mask = i < end
        if CONTIG:  # NCHW-contiguous: the group is one contiguous run
            ptrs = base + i
        elif CH_INNER:  # channels_last: the group's channels vary fastest
            ptrs = base + (i % CPG) * stride_c + (i // CPG) * stride_s
        else:
            ptrs = base + (i // S) * stride_c + (i % S) * stride_s
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        bcnt = tl.sum(mask.to(tl.float32), axis=0)
        bmean = tl.sum(x, axis=0) / bcnt
        d = tl.where(mask, x - bmean, 0.0)
        bm2 = tl.sum(d * d, axis=0)
        tot = count + bcnt
        delta = bmean - mean
        mean = mean + delta * (bcnt / tot)
        m2 = m2 + bm2 + delta * delta * (count * bcnt / tot)
        count = tot
    idx = ng * NUM_CHUNKS + chunk
    tl.store(P_MEAN + idx, mean)
    tl.store(P_M2 + idx, m2)
    tl.store(P_CNT + idx, count)


@triton.jit(do_not_specialize=["NUM_CHUNKS"])
def _gn_apply_kernel(X, Y, W, B, P_MEAN, P_M2, P_CNT,
                     C, S, G, CPG, NUM_CHUNKS, eps,
                     sx_n, sx_c, sx_s, sy_n, sy_c, sy_s,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_CHUNK: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_c = tl.program_id(1)
    n = tl.program_id(2)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cmask = c < C
    smask = s < S

    # merge the chunk partials of each channel's group (Chan's parallel formula)
    g = tl.where(cmask, c // CPG, 0)
    k = tl.arange(0, BLOCK_CHUNK)
    pidx = (n * G + g)[:, None] * NUM_CHUNKS + k[None, :]
    pmask = cmask[:, None] & (k[None, :] < NUM_CHUNKS)
    pm = tl.load(P_MEAN + pidx, mask=pmask, other=0.0)
    pv = tl.load(P_M2 + pidx, mask=pmask, other=0.0)
    pc = tl.load(P_CNT + pidx, mask=pmask, other=0.0)
    cnt = tl.maximum(tl.sum(pc, axis=1), 1.0)
    mean = tl.sum(pc * pm, axis=1) / cnt
    dm = pm - mean[:, None]
    m2 = tl.sum(pv + pc * dm * dm, axis=1)
    rstd = 1.0 / tl.sqrt(m2 / cnt + eps)

    scale = rstd
    if HAS_W:
        scale = scale * tl.load(W + c, mask=cmask, other=1.0).to(tl.float32)
    shift = -mean * scale
    if HAS_B:
        shift = shift + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)

    mask = cmask[:, None] & smask[None, :]
    x = tl.load(X + n * sx_n + c[:, None] * sx_c + s[None, :] * sx_s, mask=mask, other=0.0).to(tl.float32)
    y = x * scale[:, None] + shift[:, None]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(Y + n * sy_n + c[:, None] * sy_c + s[None, :] * sy_s, y.to(Y.dtype.element_ty), mask=mask)


def _chunks_per_group(elems: int, groups_total: int, cuda: bool) -> int:
    """How many stats programs share one (sample, group) of ``elems`` values."""
    if cuda:  # aim for ~1k stats programs, each at least 4 blocks long
        return min(-(-1024 // groups_total), -(-elems // (4 * STATS_BLOCK)))
    return -(-elems // (64 * STATS_BLOCK))  # interpreter: fewer, longer programs are faster


def _as_ncs(t: torch.Tensor) -> torch.Tensor:
    """[N, C, *spatial] -> [N, C, S] as a view when the spatial dims collapse
    (NCHW contiguous, channels_last), else as a copy."""
    n, c = t.shape[0], t.shape[1]
    try:
        return t.view(n, c, -1)
    except RuntimeError:
        return t.reshape(n, c, -1)


def groupnorm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, eps: float = 1e-5, silu: bool = False) -> torch.Tensor:
    """``F.group_norm(x, num_groups, weight, bias, eps)`` (then ``F.silu`` when
    ``silu``) for x of shape [N, C, *spatial], any float dtype, statistics in
    fp32. The output keeps x's memory format (NCHW or channels_last)."""
    name = "groupnorm"
    check_tensor(name, "x", x, _gn_apply_kernel, ndim_min=2)
    if not isinstance(num_groups, int) or num_groups <= 0 or x.shape[1] % num_groups:
        raise KernelUnsupported(f"{name}: {x.shape[1]} channels do not split into num_groups={num_groups!r} groups.")
    C = x.shape[1]
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, arg, t, _gn_apply_kernel, device=x.device)
            if t.shape != (C,):
                raise KernelUnsupported(f"{name}: `{arg}` has shape {tuple(t.shape)}, expected ({C},).")
    if x.numel() == 0:
        return torch.empty_like(x)
    N, G = x.shape[0], num_groups
    cpg = C // G
    x3 = _as_ncs(x)
    S = x3.shape[2]
    y = torch.empty_like(x)  # preserve_format: channels_last stays channels_last
    try:
        y3 = y.view(N, C, S)
    except RuntimeError:  # an exotic permutation: write NCHW-contiguous
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        y3 = y.view(N, C, S)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None

    sx_n, sx_c, sx_s = x3.stride()
    if S == 1:
        sx_s = 1
    ch_inner = sx_c == 1 and C > 1 and S > 1
    elems = cpg * S
    want = max(1, min(MAX_CHUNKS, _chunks_per_group(elems, N * G, x.is_cuda)))
    chunk = -(-elems // want)
    chunk = -(-chunk // STATS_BLOCK) * STATS_BLOCK
    num_chunks = -(-elems // chunk)
    part = torch.empty((3, N * G * num_chunks), device=x.device, dtype=torch.float32)
    p_mean, p_m2, p_cnt = part[0], part[1], part[2]
    _gn_stats_kernel[(N * G, num_chunks)](
        x3, p_mean, p_m2, p_cnt, C, S, G, cpg, chunk, num_chunks,
        sx_n, sx_c, sx_s, CH_INNER=ch_inner, CONTIG=not ch_inner and sx_s == 1 and sx_c == S,
        BLOCK=STATS_BLOCK, num_warps=4)

    # block sizes from the channel count and layout only, never the spatial size: a new
    # resolution must not compile a new kernel variant (zero recompiles inside a warmed box)
    if ch_inner:
        block_c = min(128, next_pow2(C))
        block_s = 4096 // block_c
    else:
        block_s = APPLY_BLOCK_S
        block_c = max(1, min(next_pow2(C), 4096 // block_s))
    grid = (triton.cdiv(S, block_s), triton.cdiv(C, block_c), N)
    if grid[1] > 65535 or grid[2] > 65535:
        raise KernelUnsupported(f"{name}: x of shape {tuple(x.shape)} needs a launch grid beyond 65535 in y/z.")
    sy_n, sy_c, sy_s = y3.stride()
    if S == 1:
        sy_s = 1
    dummy = p_mean
    _gn_apply_kernel[grid](
        x3, y3, weight if weight is not None else dummy, bias if bias is not None else dummy,
        p_mean, p_m2, p_cnt, C, S, G, cpg, num_chunks, float(eps),
        sx_n, sx_c, sx_s, sy_n, sy_c, sy_s,
        HAS_W=weight is not None, HAS_B=bias is not None, SILU=bool(silu),
        BLOCK_C=block_c, BLOCK_S=block_s, BLOCK_CHUNK=next_pow2(MAX_CHUNKS), num_warps=4)
    return y


def groupnorm_reference(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, eps: float = 1e-5, silu: bool = False) -> torch.Tensor:
    """Pure-PyTorch reference (fp32 math, result in x.dtype)."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    y = torch.nn.functional.group_norm(x.float(), num_groups, w, b, eps)
    if silu:
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype)
