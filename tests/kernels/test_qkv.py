"""bench/spare_kernels/qkv.py (no backend uses it; the bench does: q/k/v projections in one launch) against F.linear.

See tests/kernels/_helpers.py for the device, dtypes and tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.tests.kernels._helpers import DTYPES, TOL_MM, KernelUnsupported, close, load, rand

qkv = load("qkv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_qkv_projection(dtype, cross):
    x = rand(2, 77, 40, dtype=dtype)
    ctx = rand(2, 154, 24, dtype=dtype, seed=1) if cross else None
    kc = 24 if cross else 40
    w_q = rand(48, 40, dtype=dtype, scale=40 ** -0.5, seed=2)
    w_k = rand(48, kc, dtype=dtype, scale=kc ** -0.5, seed=3)
    w_v = rand(40, kc, dtype=dtype, scale=kc ** -0.5, seed=4)
    b_v = rand(40, seed=5) if cross else None
    q, k, v = qkv.qkv_projection(x, w_q, w_k, w_v, ctx, b_v=b_v)
    src = ctx if cross else x
    assert q.shape == (2, 77, 48) and k.shape == (*src.shape[:-1], 48) and v.shape == (*src.shape[:-1], 40)
    refs = (F.linear(x.float(), w_q.float()), F.linear(src.float(), w_k.float()),
            F.linear(src.float(), w_v.float(), None if b_v is None else b_v.float()))
    for got, ref in zip((q, k, v), refs, strict=True):
        assert got.dtype == dtype
        close(got, ref, TOL_MM[dtype])
    for got, ref in zip(qkv.qkv_projection_reference(x, w_q, w_k, w_v, ctx, b_v=b_v), refs, strict=True):
        close(got, ref, TOL_MM[dtype])


def test_qkv_sd_sizes_fp16():
    """SD1.5 first-stage cross-attention widths: 320 inner, 768 context."""
    dt = torch.float16
    x = rand(1, 64, 320, dtype=dt)
    ctx = rand(1, 77, 768, dtype=dt, seed=1)
    w_q = rand(320, 320, dtype=dt, scale=320 ** -0.5, seed=2)
    w_k = rand(320, 768, dtype=dt, scale=768 ** -0.5, seed=3)
    w_v = rand(320, 768, dtype=dt, scale=768 ** -0.5, seed=4)
    for got, ref in zip(qkv.qkv_projection(x, w_q, w_k, w_v, ctx),
                        (F.linear(x.float(), w_q.float()), F.linear(ctx.float(), w_k.float()),
                         F.linear(ctx.float(), w_v.float())), strict=True):
        close(got, ref, TOL_MM[dt])


def test_qkv_reads_live_and_strided_weights():
    x = rand(1, 20, 24)
    base = rand(24, 40, scale=0.2, seed=1)
    w_q = base.t()  # a transposed view: [40, 24] with strides (1, 40)
    w_k = rand(40, 24, scale=0.2, seed=2)
    w_v = rand(40, 24, scale=0.2, seed=3)
    q1, k1, _ = qkv.qkv_projection(x, w_q, w_k, w_v)
    close(q1, F.linear(x, w_q), TOL_MM[torch.float32])
    delta = rand(40, 24, scale=0.1, seed=4)
    w_k.add_(delta)  # an in-place LoRA patch: the next call must see it
    _, k2, _ = qkv.qkv_projection(x, w_q, w_k, w_v)
    close(k2, F.linear(x, w_k), TOL_MM[torch.float32])
    close(k2 - k1, F.linear(x, delta), TOL_MM[torch.float32])


def test_qkv_unsupported():
    x = rand(2, 8, 16, dtype=torch.float16)
    w = rand(16, 16)
    with pytest.raises(KernelUnsupported, match="cast path"):
        qkv.qkv_projection(x, w, w, w)  # fp16 activations, fp32 weights
    w = rand(16, 12, dtype=torch.float16)
    with pytest.raises(KernelUnsupported, match="w_q"):
        qkv.qkv_projection(x, w, w, w)
    with pytest.raises(KernelUnsupported, match="nn.Linear weight"):
        qkv.qkv_projection(x, rand(16, dtype=torch.float16), w, w)
