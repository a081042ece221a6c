"""GEGLU epilogue: ``x, gate = h.chunk(2, dim=-1); out = x * gelu(gate)``.

h is the output of the GEGLU projection (width 2*D, as in ComfyUI's and
diffusers' GEGLU); the kernel reads both halves once and writes [.., D],
removing the two intermediate [.., D] tensors of the eager version.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import KernelUnsupported, Launch, Plans, cdiv, check_row_block, check_tensor, next_pow2, tensor_key


@triton.jit(do_not_specialize=["M"])
def _geglu_kernel(H, Y, M, D, stride_hm, stride_ym,
                  TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    hp = H + rows[:, None] * stride_hm + cols[None, :]
    x = tl.load(hp, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(hp + D, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        # 0.5 * g * (1 + tanh(u)) == g * sigmoid(2u)
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        gelu = g / (1.0 + tl.exp(-2.0 * u))
    else:
        gelu = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], (x * gelu).to(Y.dtype.element_ty), mask=mask)


_PLANS = Plans()


def geglu(h: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``x * F.gelu(gate, approximate=approximate)`` with ``x, gate = h.chunk(2, -1)``.
    h: [..., 2*D], any float dtype; returns a contiguous [..., D] in h's dtype. The checks and
    launch arithmetic run once per input signature (``_PLANS``)."""
    key = _PLANS.key(tensor_key(h), approximate)
    plan = _PLANS.find(key)
    if plan is None:
        plan = _PLANS.put(key, _plan(h, approximate))
    y_shape, two_d, copy, launch = plan
    y = torch.empty(y_shape, dtype=h.dtype, device=h.device)
    if launch is None:
        return y
    h2 = h.reshape(-1, two_d)
    if copy:
        h2 = h2.contiguous()
    launch(h2, y)
    return y


def _plan(h, approximate) -> tuple:
    """The checks (KernelUnsupported for inputs the kernel cannot take), then (output shape, 2*D,
    whether h's rows need a copy, the launch); launch None: nothing to launch."""
    name = "geglu"
    check_tensor(name, "h", h, _geglu_kernel, ndim_min=1)
    if approximate not in ("none", "tanh"):
        raise KernelUnsupported(f"{name}: approximate={approximate!r}; the kernel does 'none' (erf) and 'tanh'.")
    two_d = h.shape[-1]
    if two_d % 2:
        raise KernelUnsupported(f"{name}: last dim of h is {two_d}, which does not split into two halves.")
    D = two_d // 2
    y_shape = (*h.shape[:-1], D)
    if h.numel() == 0:
        return y_shape, two_d, False, None
    h2 = h.reshape(-1, two_d)
    copy = h2.stride(1) != 1
    row_stride = two_d if copy else h2.stride(0)
    M = h2.shape[0]
    block_d = min(1024, max(16, next_pow2(D)))
    block_m = max(1, 4096 // block_d)  # from D only: a new token count compiles no new variant
    check_row_block(name, "h", block_m, row_stride)
    grid = (cdiv(M, block_m), cdiv(D, block_d))
    if grid[1] > 65535:
        raise KernelUnsupported(f"{name}: last dim of h is {two_d}, beyond the launch grid.")
    return y_shape, two_d, copy, Launch(_geglu_kernel, grid, (M, D, row_stride, D),
                                        dict(TANH=approximate == "tanh", BLOCK_M=block_m, BLOCK_D=block_d,
                                             num_warps=4))


def geglu_reference(h: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Pure-PyTorch reference (fp32 math, result in h's dtype)."""
    x, gate = h.float().chunk(2, dim=-1)
    return (x * torch.nn.functional.gelu(gate, approximate=approximate)).to(h.dtype)
