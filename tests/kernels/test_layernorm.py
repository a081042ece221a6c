"""bench/spare_kernels/layernorm.py (no backend uses it; the bench does) against F.layer_norm.

See tests/kernels/_helpers.py for the device, dtypes and tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.tests.kernels._helpers import DEV, DTYPES, TOL, KernelUnsupported, close, load, rand

layernorm = load("layernorm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,affine", [((2, 77, 40), True), ((3, 5, 320), True), ((7, 33), False)],
                         ids=["77tok-d40", "d320", "d33-noaffine"])
def test_layernorm(dtype, shape, affine):
    x = rand(*shape, dtype=dtype, scale=3.0, offset=2.0)
    D = shape[-1]
    w = rand(D, dtype=dtype, scale=0.5, offset=1.0, seed=1) if affine else None
    b = rand(D, dtype=dtype, scale=0.5, seed=2) if affine else None
    y = layernorm.layernorm(x, w, b, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    ref = F.layer_norm(x.float(), (D,), None if w is None else w.float(), None if b is None else b.float(), 1e-5)
    close(y, ref, TOL[dtype])
    close(layernorm.layernorm_reference(x, w, b, 1e-5), ref, TOL[dtype])


def test_layernorm_strided_rows_and_wide_row():
    big = rand(4, 77, 96, offset=50.0)
    x = big[..., :80]  # rows not contiguous with each other
    close(layernorm.layernorm(x), F.layer_norm(x, (80,)), dict(atol=1e-4, rtol=1e-4))
    x = rand(3, 1280)
    w = rand(1280, seed=3)
    close(layernorm.layernorm(x, w, None, 1e-6), F.layer_norm(x, (1280,), w, None, 1e-6), TOL[torch.float32])


def test_layernorm_unsupported():
    with pytest.raises(KernelUnsupported, match="16384"):
        layernorm.layernorm(torch.empty(1, 16385, device=DEV))
    with pytest.raises(KernelUnsupported, match="bias"):
        layernorm.layernorm(rand(2, 8), None, torch.zeros(7, device=DEV))
    with pytest.raises(KernelUnsupported, match="int32"):
        layernorm.layernorm(torch.zeros(2, 8, dtype=torch.int32, device=DEV))
