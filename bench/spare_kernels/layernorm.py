"""LayerNorm over the last dimension (optional weight/bias), fp32 statistics.

One launch: each program normalises BLOCK_M rows held in registers
(two-pass mean/variance over the row, no sum-of-squares cancellation).
Weight and bias are read from the tensors passed on every call.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kernels._common import KernelUnsupported, cdiv, check_row_block, check_tensor, next_pow2

MAX_D = 16384  # a row must fit in one program's registers


@triton.jit
def _ln_kernel(X, Y, W, B, M, D, eps, stride_xm, stride_ym,
               HAS_W: tl.constexpr, HAS_B: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < M
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cmask, other=1.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def layernorm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm(x, (D,), weight, bias, eps)`` over the last dim D of x
    (any leading shape, any float dtype; D <= 16384). Returns a contiguous
    tensor of x's shape and dtype."""
    name = "layernorm"
    check_tensor(name, "x", x, _ln_kernel, ndim_min=1)
    D = x.shape[-1]
    if D > MAX_D:
        raise KernelUnsupported(f"{name}: last dim of x is {D}; the kernel keeps a row in registers (at most {MAX_D}).")
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_tensor(name, arg, t, _ln_kernel, device=x.device)
            if t.shape != (D,):
                raise KernelUnsupported(f"{name}: `{arg}` has shape {tuple(t.shape)}, expected ({D},).")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    x2 = x.reshape(-1, D)
    if D > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    block_d = max(16, next_pow2(D))
    block_m = max(1, min(next_pow2(M), 4096 // block_d))
    num_warps = 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16
    check_row_block(name, "x", block_m, x2.stride(0))
    dummy = y
    _ln_kernel[(cdiv(M, block_m),)](
        x2, y, weight if weight is not None else dummy, bias if bias is not None else dummy,
        M, D, float(eps), x2.stride(0), D,
        HAS_W=weight is not None, HAS_B=bias is not None,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
    return y


def layernorm_reference(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                        eps: float = 1e-5) -> torch.Tensor:
    """Pure-PyTorch reference (fp32 math, result in x.dtype)."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)
