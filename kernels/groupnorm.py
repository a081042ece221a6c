"""GroupNorm (+ optional fused SiLU) for NCHW-contiguous and channels_last inputs.

Three launches: fp32 statistics partials merged by Chan's formula (no sum-of-squares
cancellation), a finalize to (mean, rstd) per group, and an apply that writes
``x * scale + shift`` (then SiLU) in the input's memory layout. Weight and bias are read
from the tensors passed on every call (live LoRA safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelUnsupported, Launch, Plans, cdiv, check_tensor, gpu_capability, next_pow2, tensor_key

MAX_CHUNKS = 64
STATS_BLOCK = 1024      # values per step of _gn_stats_kernel
CL_TILE = 4096          # values per [rows, channels] tile of _gn_stats_cl_kernel (8 warps)
CL_BLOCK_C = 64         # its channels per tile: 128 B rows in 16-bit; SD's channel counts are multiples of 64
APPLY_BLOCK_S = 256
FINAL_BLOCK = 64


@triton.jit
def _chan_merge(mean, m2, count, bmean, bm2, bcnt):
    """Chan's parallel formula: (mean, M2, count) of two disjoint sets merged."""
    tot = count + bcnt
    delta = bmean - mean
    frac = tl.where(tot > 0, bcnt / tl.maximum(tot, 1.0), 0.0)
    return mean + delta * frac, m2 + bm2 + delta * delta * count * frac, tot


@triton.jit(do_not_specialize=["OFF", "NUM_CHUNKS"])
def _gn_stats_kernel(X, WORK, OFF,
                     S, G, CPG, CHUNK, NUM_CHUNKS,
                     stride_n, stride_c, stride_s,
                     CONTIG: tl.constexpr, BLOCK: tl.constexpr):
    """Reads one chunk of one (sample, group); writes its (mean, M2, count), a triple of the
    partials at WORK + OFF."""
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
        else:
            ptrs = base + (i // S) * stride_c + (i % S) * stride_s
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        bcnt = tl.sum(mask.to(tl.float32), axis=0)
        bmean = tl.sum(x, axis=0) / bcnt
        d = tl.where(mask, x - bmean, 0.0)
        mean, m2, count = _chan_merge(mean, m2, count, bmean, tl.sum(d * d, axis=0), bcnt)
    p = WORK + OFF + 3 * (ng * NUM_CHUNKS + chunk)
    tl.store(p, mean)
    tl.store(p + 1, m2)
    tl.store(p + 2, count)


@triton.jit(do_not_specialize=["OFF", "S", "CHUNK", "NUM_CHUNKS"])
def _gn_stats_cl_kernel(X, WORK, OFF,
                        C, S, CHUNK, NUM_CHUNKS, stride_n, stride_s,
                        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Reads rows [chunk*CHUNK, +CHUNK) x BLOCK_C channels of one sample (each row
    a contiguous run of channels); writes each channel's (mean, M2, count)."""
    chunk = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    n = tl.program_id(2)
    cmask = c < C
    base = X + n.to(tl.int64) * stride_n
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, S)
    mean = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    count = tl.zeros([BLOCK_C], dtype=tl.float32)
    for off in range(start, end, BLOCK_S):
        r = off + tl.arange(0, BLOCK_S)
        mask = (r < end)[:, None] & cmask[None, :]
        x = tl.load(base + r[:, None] * stride_s + c[None, :], mask=mask, other=0.0).to(tl.float32)
        bcnt = tl.sum(mask.to(tl.float32), axis=0)
        bmean = tl.sum(x, axis=0) / tl.maximum(bcnt, 1.0)
        d = tl.where(mask, x - bmean[None, :], 0.0)
        mean, m2, count = _chan_merge(mean, m2, count, bmean, tl.sum(d * d, axis=0), bcnt)
    p = WORK + OFF + 3 * ((n * C + c) * NUM_CHUNKS + chunk)
    tl.store(p, mean, mask=cmask)
    tl.store(p + 1, m2, mask=cmask)
    tl.store(p + 2, count, mask=cmask)


@triton.jit(do_not_specialize=["OFF", "K"])
def _gn_finalize_kernel(WORK, OFF, K, eps, BLOCK: tl.constexpr):
    """Reads the K contiguous partial triples of one (sample, group) at WORK + OFF; writes its
    (mean, rstd) at WORK + 2 * group."""
    ng = tl.program_id(0)
    base = WORK + OFF + 3 * ng.to(tl.int64) * K
    mean = tl.zeros([], dtype=tl.float32)
    m2 = tl.zeros([], dtype=tl.float32)
    count = tl.zeros([], dtype=tl.float32)
    for off in range(0, K, BLOCK):
        k = off + tl.arange(0, BLOCK)
        mask = k < K
        pm = tl.load(base + 3 * k, mask=mask, other=0.0)
        pv = tl.load(base + 3 * k + 1, mask=mask, other=0.0)
        pc = tl.load(base + 3 * k + 2, mask=mask, other=0.0)
        bcnt = tl.sum(pc, axis=0)
        bmean = tl.sum(pc * pm, axis=0) / tl.maximum(bcnt, 1.0)
        dm = pm - bmean
        mean, m2, count = _chan_merge(mean, m2, count, bmean, tl.sum(pv + pc * dm * dm, axis=0), bcnt)
    tl.store(WORK + 2 * ng, mean)
    tl.store(WORK + 2 * ng + 1, 1.0 / tl.sqrt(m2 / tl.maximum(count, 1.0) + eps))


@triton.jit
def _gn_apply_kernel(X, Y, W, B, STATS,
                     C, S, G, CPG,
                     sx_n, sx_c, sx_s, sy_n, sy_c, sy_s,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, SILU: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Reads a [BLOCK_C, BLOCK_S] tile of x and its channels' group (mean, rstd) (STATS, a pair
    per group), weight and bias; writes the tile of y."""
    pid_s = tl.program_id(0)
    pid_c = tl.program_id(1)
    n = tl.program_id(2)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cmask = c < C
    smask = s < S

    ng = n * G + tl.where(cmask, c // CPG, 0)
    scale = tl.load(STATS + 2 * ng + 1)
    if HAS_W:
        scale = scale * tl.load(W + c, mask=cmask, other=1.0).to(tl.float32)
    shift = -tl.load(STATS + 2 * ng) * scale
    if HAS_B:
        shift = shift + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)

    mask = cmask[:, None] & smask[None, :]
    x = tl.load(X + n * sx_n + c[:, None] * sx_c + s[None, :] * sx_s, mask=mask, other=0.0).to(tl.float32)
    y = x * scale[:, None] + shift[:, None]
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(Y + n * sy_n + c[:, None] * sy_c + s[None, :] * sy_s, y.to(Y.dtype.element_ty), mask=mask)


def _chunks(blocks: int, reductions: int, cuda: bool) -> int:
    """How many stats programs share one reduction of ``blocks`` blocks when
    ``reductions`` such reductions run side by side (1..min(MAX_CHUNKS, blocks))."""
    if cuda:  # aim for ~1k stats programs, each at least 4 blocks long
        want = min(-(-1024 // reductions), -(-blocks // 4))
    else:  # interpreter: fewer, longer programs are faster
        want = -(-blocks // 64)
    return max(1, min(MAX_CHUNKS, blocks, want))


def _as_ncs(t: torch.Tensor) -> torch.Tensor:
    """[N, C, *spatial] -> [N, C, S] as a view when the spatial dims collapse
    (NCHW contiguous, channels_last), else as a copy."""
    n, c = t.shape[0], t.shape[1]
    try:
        return t.view(n, c, -1)
    except RuntimeError:
        return t.reshape(n, c, -1)


class _Plan:
    """One input signature's launches: grids, scalar arguments and block sizes (see :func:`_plan`)."""
    __slots__ = ("empty", "N", "C", "S", "y_nchw", "work_n", "stats", "fin", "apply")


_PLANS = Plans()


def groupnorm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, eps: float = 1e-5, silu: bool = False) -> torch.Tensor:
    """``F.group_norm(x, num_groups, weight, bias, eps)`` (then ``F.silu`` when
    ``silu``) for x of shape [N, C, *spatial], any float dtype, statistics in
    fp32. The output keeps x's memory format (NCHW or channels_last). The checks
    and launch arithmetic run once per input signature (``_PLANS``)."""
    key = _PLANS.key(tensor_key(x), num_groups, eps, silu, tensor_key(weight), tensor_key(bias))
    plan = _PLANS.find(key)
    if plan is None:
        plan = _PLANS.put(key, _plan(x, num_groups, weight, bias, eps, silu))
    if plan.empty:
        return torch.empty_like(x)
    N, C, S = plan.N, plan.C, plan.S
    x3 = _as_ncs(x)
    if plan.y_nchw:   # an exotic permutation: write NCHW-contiguous
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty_like(x)  # preserve_format: channels_last stays channels_last
    y3 = y.view(N, C, S)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    # one fp32 scratch: (mean, rstd) per group, then the statistics partials, (mean, M2, count) each
    work = torch.empty(plan.work_n, device=x.device, dtype=torch.float32)
    plan.stats(x3, work)
    plan.fin(work)
    plan.apply(x3, y3, weight if weight is not None else work, bias if bias is not None else work, work)
    return y


def _plan(x, num_groups, weight, bias, eps, silu) -> _Plan:
    """The checks (KernelUnsupported for inputs the kernels cannot take) and the launches' grids,
    scalar arguments and block sizes, from the inputs' shapes, strides and device only."""
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
    p = _Plan()
    p.empty = x.numel() == 0
    if p.empty:
        return p
    N, G = x.shape[0], num_groups
    cpg = C // G
    x3 = _as_ncs(x)
    S = x3.shape[2]
    p.N, p.C, p.S = N, C, S
    try:   # the output's layout, found on the meta device (nothing allocated)
        y3 = torch.empty_like(x, device="meta").view(N, C, S)
        p.y_nchw = False
    except RuntimeError:
        y3 = torch.empty(x.shape, dtype=x.dtype, device="meta").view(N, C, S)
        p.y_nchw = True

    sx_n, sx_c, sx_s = x3.stride()
    if S == 1:
        sx_s = 1
    cuda = gpu_capability(x.device) is not None
    ch_inner = sx_c == 1 and C > 1 and S > 1  # channels_last: channels vary fastest
    if ch_inner:  # reduce whole rows, per channel
        block_c = min(CL_BLOCK_C, next_pow2(C))
        block_s = CL_TILE // block_c
        rows = cdiv(S, block_s)
        num_chunks = _chunks(rows, N * cdiv(C, block_c), cuda)
        chunk = cdiv(rows, num_chunks) * block_s
        num_chunks = cdiv(S, chunk)
        part_n = N * C * num_chunks
        per_group = cpg * num_chunks
        stats_grid = (num_chunks, cdiv(C, block_c), N)
        if stats_grid[1] > 65535 or N > 65535:
            raise KernelUnsupported(f"{name}: x of shape {tuple(x.shape)} needs a launch grid beyond 65535 in y/z.")
        p.stats = Launch(_gn_stats_cl_kernel, stats_grid, (2 * N * G, C, S, chunk, num_chunks, sx_n, sx_s),
                         dict(BLOCK_S=block_s, BLOCK_C=block_c, num_warps=8))
    else:
        elems = cpg * S
        num_chunks = _chunks(cdiv(elems, STATS_BLOCK), N * G, cuda)
        chunk = cdiv(cdiv(elems, num_chunks), STATS_BLOCK) * STATS_BLOCK
        num_chunks = cdiv(elems, chunk)
        part_n = N * G * num_chunks
        per_group = num_chunks
        p.stats = Launch(_gn_stats_kernel, (N * G, num_chunks),
                         (2 * N * G, S, G, cpg, chunk, num_chunks, sx_n, sx_c, sx_s),
                         dict(CONTIG=sx_s == 1 and sx_c == S, BLOCK=STATS_BLOCK, num_warps=4))
    p.work_n = 2 * N * G + 3 * part_n
    p.fin = Launch(_gn_finalize_kernel, (N * G,), (2 * N * G, per_group, float(eps)),
                   dict(BLOCK=FINAL_BLOCK, num_warps=1))

    # block sizes from the channel count and layout only, never the spatial size: a new
    # resolution must not compile a new kernel variant (zero recompiles inside a warmed box)
    if ch_inner:
        block_c = min(128, next_pow2(C))
        block_s = 4096 // block_c
    else:
        block_s = APPLY_BLOCK_S
        block_c = max(1, min(next_pow2(C), 4096 // block_s))
    grid = (cdiv(S, block_s), cdiv(C, block_c), N)
    if grid[1] > 65535 or grid[2] > 65535:
        raise KernelUnsupported(f"{name}: x of shape {tuple(x.shape)} needs a launch grid beyond 65535 in y/z.")
    sy_n, sy_c, sy_s = y3.stride()
    if S == 1:
        sy_s = 1
    p.apply = Launch(_gn_apply_kernel, grid, (C, S, G, cpg, sx_n, sx_c, sx_s, sy_n, sy_c, sy_s),
                     dict(HAS_W=weight is not None, HAS_B=bias is not None, SILU=bool(silu),
                          BLOCK_C=block_c, BLOCK_S=block_s, num_warps=4))
    return p


def groupnorm_reference(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, eps: float = 1e-5, silu: bool = False) -> torch.Tensor:
    """Pure-PyTorch reference (fp32 math, result in x.dtype)."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    y = torch.nn.functional.group_norm(x.float(), num_groups, w, b, eps)
    if silu:
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype)
