"""kernels/epilogue.py (bias + residual in one pass) against the eager adds.

See tests/kernels/_helpers.py for the device, dtypes and tolerances."""
from __future__ import annotations

import pytest
import torch

from unet_compiler.tests.kernels._helpers import DEV, DTYPES, TOL, KernelUnsupported, close, load, rand

epilogue = load("epilogue")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "linear"])
def test_bias_residual(dtype, layout):
    if layout == "linear":
        x = rand(2, 77, 40, dtype=dtype)
        dim = -1
    else:
        x = rand(2, 20, 5, 7, dtype=dtype)
        dim = 1
        if layout == "channels_last":
            x = x.to(memory_format=torch.channels_last)
    C = x.shape[dim]
    res = torch.empty_like(x).copy_(rand(*x.shape, dtype=dtype, seed=1))
    bias = rand(C, seed=2)  # fp32 bias on a half tensor is fine
    y = epilogue.bias_residual(x, bias, res, dim=dim)
    shape = [1] * x.dim()
    shape[dim] = C
    ref = x.float() + bias.view(shape) + res.float()
    assert y.stride() == x.stride() and y.dtype == dtype
    close(y, ref, TOL[dtype])
    close(epilogue.bias_residual_reference(x, bias, res, dim=dim), ref, TOL[dtype])


def test_bias_residual_partial_and_in_place():
    x = rand(2, 12, 3, 3)
    bias = rand(12, seed=1)
    res = rand(2, 12, 3, 3, seed=2)
    close(epilogue.bias_residual(x, bias), x + bias.view(1, -1, 1, 1), TOL[torch.float32])
    close(epilogue.bias_residual(x, None, res), x + res, TOL[torch.float32])
    expected = x + bias.view(1, -1, 1, 1) + res
    out = epilogue.bias_residual(x, bias, res, out=x)
    assert out is x
    close(x, expected, TOL[torch.float32])


def test_bias_residual_unsupported():
    x = rand(2, 12, 4, 4)
    with pytest.raises(KernelUnsupported, match="layout"):
        epilogue.bias_residual(x, None, x.to(memory_format=torch.channels_last))
    with pytest.raises(KernelUnsupported, match="bias"):
        epilogue.bias_residual(x, torch.zeros(4, device=DEV))
    with pytest.raises(KernelUnsupported, match="dense"):
        epilogue.bias_residual(x[:, :, ::2])
    with pytest.raises(KernelUnsupported, match="dim"):
        epilogue.bias_residual(x, None, None, dim=4)
