"""The check behind ``_common.bound_launch_problem``: one small kernel launched through triton's JIT
and then directly (``_common.Launch``, handed in), whose results must agree."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _axpb_kernel(X, Y, N, B, A: tl.constexpr, BLOCK: tl.constexpr):
    """Y[i] = A * X[i] + B for i < N."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    tl.store(Y + i, A * tl.load(X + i, mask=mask) + B, mask=mask)


def run(device, Launch) -> str | None:  # noqa: N803 - the class, handed in (_common imports this module)
    """None when a direct launch (``Launch``: ``_common.Launch``) computes what the JIT launch did on
    ``device``, else why not."""
    n = 100
    x = torch.arange(n, dtype=torch.float32, device=device)
    launch = Launch(_axpb_kernel, (2,), (n, 5.0), dict(A=3, BLOCK=64))
    first, second = torch.zeros_like(x), torch.zeros_like(x)
    launch(x, first)                     # through the JIT: binds
    if launch.compiled is None:
        return None if device.type != "cuda" else "the JIT launch returned no compiled kernel"
    launch(x + 1, second)                # direct, new addresses
    want = 3 * (x + 1) + 5.0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not torch.equal(first, 3 * x + 5.0) or not torch.equal(second, want):
        return "a direct launch of a compiled kernel computed a different result than triton's JIT launch"
    return None
