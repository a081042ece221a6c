"""kernels/geglu.py (the GEGLU epilogue) against a * gelu(gate).

See tests/kernels/_helpers.py for the device, dtypes and tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.tests.kernels._helpers import DTYPES, TOL, KernelUnsupported, close, load, rand

geglu = load("geglu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(2, 77, 90), (3, 2560)], ids=["77tok-D45", "D1280"])
def test_geglu(dtype, approximate, shape):
    h = rand(*shape, dtype=dtype, scale=2.0)
    y = geglu.geglu(h, approximate)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    x, gate = h.float().chunk(2, dim=-1)
    ref = x * F.gelu(gate, approximate=approximate)
    close(y, ref, TOL[dtype])
    close(geglu.geglu_reference(h, approximate), ref, TOL[dtype])


def test_geglu_strided_input_and_catches_swapped_halves():
    big = rand(2, 77, 100)
    h = big[..., 3:83]  # strided rows
    y = geglu.geglu(h)
    x, gate = h.chunk(2, dim=-1)
    close(y, x * F.gelu(gate), TOL[torch.float32])
    with pytest.raises(AssertionError):  # the tolerance is tight enough to see a wrong kernel
        close(y, gate * F.gelu(x), TOL[torch.float32])


def test_geglu_unsupported():
    with pytest.raises(KernelUnsupported, match="two halves"):
        geglu.geglu(rand(2, 7))
    with pytest.raises(KernelUnsupported, match="approximate"):
        geglu.geglu(rand(2, 8), approximate="sigmoid")
