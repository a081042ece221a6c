"""Bias + residual epilogue: ``out = x + bias (broadcast along one dim) + residual``.

For the output of a conv / matmul run without its bias (or with it): one read of x and
residual, one write. x, residual and out must share one dense memory layout (all
NCHW-contiguous, or all channels_last, ...): the kernel walks x's storage linearly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelUnsupported, Launch, Plans, cdiv, check_tensor, is_dense, tensor_key

BLOCK = 1024


@triton.jit(do_not_specialize=["stride_c"])
def _bias_residual_kernel(X, BIAS, R, Y, numel, C, stride_c,
                          HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    y = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        c = (offs // stride_c) % C
        y += tl.load(BIAS + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same strides on every dim that has more than one element."""
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if n > 1)


_PLANS = Plans()


def bias_residual(x: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  dim: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x + bias.view(shape broadcasting along dim) + residual`` in x's dtype,
    fp32 math. ``dim`` is the channel dim: 1 after a conv (NCHW or
    channels_last), -1 after a linear. ``out`` may be x or residual (in place).
    x, residual and out must have the same shape and the same dense strides.
    The checks and launch arithmetic run once per input signature (``_PLANS``)."""
    key = _PLANS.key(tensor_key(x), tensor_key(bias), tensor_key(residual), dim, tensor_key(out))
    plan = _PLANS.find(key)
    if plan is None:
        plan = _PLANS.put(key, _plan(x, bias, residual, dim, out))
    if out is None:
        out = torch.empty_like(x)  # dense x: same strides
    if plan is _EMPTY:
        return out
    plan(x, bias.contiguous() if bias is not None else x, residual if residual is not None else x, out)
    return out


_EMPTY = "empty"


def _plan(x, bias, residual, dim, out) -> tuple:
    """The checks (KernelUnsupported for inputs the kernel cannot take), then the launch."""
    name = "bias_residual"
    check_tensor(name, "x", x, _bias_residual_kernel, ndim_min=1)
    if not is_dense(x):
        raise KernelUnsupported(f"{name}: `x` (shape {tuple(x.shape)}, strides {tuple(x.stride())}) is not a dense "
                                f"tensor; the kernel walks storage linearly.")
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise KernelUnsupported(f"{name}: dim={dim!r} is not a dim of x with shape {tuple(x.shape)}.")
    d = dim % x.dim()
    C = x.shape[d]
    if bias is not None:
        check_tensor(name, "bias", bias, _bias_residual_kernel, device=x.device)
        if bias.numel() != C or bias.dim() != 1:
            raise KernelUnsupported(f"{name}: `bias` has shape {tuple(bias.shape)}, expected ({C},) for dim {dim} "
                                    f"of x with shape {tuple(x.shape)}.")
    for arg, t in (("residual", residual), ("out", out)):
        if t is None:
            continue
        check_tensor(name, arg, t, _bias_residual_kernel, device=x.device)
        if t.shape != x.shape or not _same_layout(t, x):
            raise KernelUnsupported(f"{name}: `{arg}` (shape {tuple(t.shape)}, strides {tuple(t.stride())}) does not "
                                    f"match x's layout (shape {tuple(x.shape)}, strides {tuple(x.stride())}).")
    if residual is not None and residual.dtype != x.dtype:
        raise KernelUnsupported(f"{name}: `residual` is {residual.dtype} but x is {x.dtype}.")
    if x.numel() == 0:
        return _EMPTY
    stride_c = x.stride(d) if C > 1 else 1
    return Launch(_bias_residual_kernel, (cdiv(x.numel(), BLOCK),), (x.numel(), C, stride_c),
                  dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=4))


def bias_residual_reference(x: torch.Tensor, bias: torch.Tensor | None = None,
                            residual: torch.Tensor | None = None, dim: int = 1) -> torch.Tensor:
    """Pure-PyTorch reference (fp32 math, result in x's dtype)."""
    y = x.float()
    if bias is not None:
        shape = [1] * x.dim()
        shape[dim % x.dim()] = -1
        y = y + bias.float().view(shape)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
