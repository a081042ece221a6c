"""kernels/attention.py (flash attention forward) against SDPA.

See tests/kernels/_helpers.py for the device, dtypes and tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.tests.kernels._helpers import CUDA, DTYPES, TOL_MM, KernelUnsupported, close, load, rand

attention = load("attention")


def _sdpa(q, k, v, scale=None):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale)


def _attention(q, k, v, **kw):
    """attention(); on CUDA, fp32 is declined (SDPA runs those regions): check that, then skip."""
    if CUDA and q.dtype == torch.float32:
        with pytest.raises(KernelUnsupported, match="SDPA runs it"):
            attention.attention(q, k, v, **kw)
        pytest.skip("fp32 attention is declined on CUDA (SDPA runs it)")
    return attention.attention(q, k, v, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [40, 64, 80, 160])
def test_attention_cross(dtype, head_dim):
    """Cross-attention on a 154-token (2*77) context; queries strided like
    ComfyUI's ``view(B, N, H, d).transpose(1, 2)``."""
    B, H, NQ, NK = 2, 2, 50, 154
    q = rand(B, NQ, H, head_dim, dtype=dtype).transpose(1, 2)
    k = rand(B, H, NK, head_dim, dtype=dtype, seed=1)
    v = rand(B, H, NK, head_dim, dtype=dtype, seed=2)
    out = _attention(q, k, v)
    assert out.shape == (B, H, NQ, head_dim) and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # [B, Nq, H, d] memory: free reshape to [B, Nq, H*d]
    close(out, _sdpa(q, k, v), TOL_MM[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_self_77_tokens(dtype):
    B, H, N, D = 1, 3, 77, 64
    qkv_ = rand(B, N, 3, H, D, dtype=dtype).permute(2, 0, 3, 1, 4)  # packed, all strided
    q, k, v = qkv_[0], qkv_[1], qkv_[2]
    close(_attention(q, k, v), _sdpa(q, k, v), TOL_MM[dtype])


def test_attention_scale_3d_and_small_head_dim():
    q = rand(4, 33, 8)
    k = rand(4, 77, 8, seed=1)
    v = rand(4, 77, 8, seed=2)
    out = _attention(q, k, v, scale=0.3)
    assert out.shape == (4, 33, 8)
    close(out, _sdpa(q, k, v, scale=0.3), TOL_MM[torch.float32])
    with pytest.raises(AssertionError):  # a wrong scale is caught
        close(out, _sdpa(q, k, v), TOL_MM[torch.float32])


def test_attention_large_logits_stay_finite():
    """Online softmax must subtract the running max: logits ~ 1e3 overflow exp."""
    q = rand(1, 1, 20, 40, scale=30.0)
    k = rand(1, 1, 154, 40, scale=30.0, seed=1)
    v = rand(1, 1, 154, 40, seed=2)
    out = _attention(q, k, v)
    assert torch.isfinite(out).all()
    close(out, _sdpa(q, k, v), dict(atol=1e-3, rtol=1e-3))


def test_attention_reference_matches_sdpa():
    q, k, v = rand(2, 2, 10, 40), rand(2, 2, 77, 40, seed=1), rand(2, 2, 77, 40, seed=2)
    close(attention.attention_reference(q, k, v), _sdpa(q, k, v), TOL_MM[torch.float32])


def test_attention_head_dim_40_unaligned_strides():
    """Head dim 40 (SD1.5's first level): the kernel is told its strides are 16-byte
    multiples only when the launcher checked them; views with odd strides (and an
    odd storage offset) run with no claim under the interpreter and match SDPA. On a
    GPU they are declined (SDPA runs them): an H100 gave wrong head-dim tails."""
    dt = torch.float16
    big = rand(2, 60, 8 * 40 + 3, dtype=dt)
    q = big[..., 1:321].view(2, 60, 8, 40).transpose(1, 2)  # row stride 323, offset 1 element
    k = rand(2, 77, 8, 40, dtype=dt, seed=1).transpose(1, 2)
    v = rand(2, 77, 8, 40, dtype=dt, seed=2).transpose(1, 2)
    assert attention._alignment((q, k, v), 40) == 1
    assert attention._alignment((k, k, v), 40) == 8
    assert attention._alignment((k.float(), k.float(), v.float()), 40) == 4
    if CUDA:
        with pytest.raises(KernelUnsupported, match="not 16-byte multiples"):
            attention.attention(q, k, v)
        close(attention.attention(k, k, v), _sdpa(k, k, v), TOL_MM[dt])   # aligned views still run the kernel
        return
    close(attention.attention(q, k, v), _sdpa(q, k, v), TOL_MM[dt])


def test_attention_head_dim_blocks_and_configs():
    hopper, ada = (9, 0), (8, 9)
    assert attention.head_dim_blocks(40, None) == (32, 16)
    assert attention.head_dim_blocks(80, ada) == (64, 16)
    assert attention.head_dim_blocks(64, hopper) == (64, 0)
    assert attention.head_dim_blocks(8, None) == (16, 0)
    assert attention.head_dim_blocks(100, hopper) == (128, 0)  # 64 + 64 pads as much as 128
    assert attention.head_dim_blocks(160, hopper) == (128, 32)
    assert attention.head_dim_blocks(160, ada) == (256, 0)  # mma.sync: one block uses fewer registers
    first = attention._configs(48, hopper)[0]
    assert (first["BLOCK_M"], first["num_warps"]) == (128, 8)
    assert attention._configs(48, ada)[0]["BLOCK_M"] == 64
    assert attention._configs(160, hopper)[0]["BLOCK_M"] == 64


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.values[0] != torch.float32])
def test_attention_as_on_hopper(monkeypatch, dtype):
    """The Hopper path (head dim 160 as 128 + 32, 128-row tiles first) under the interpreter."""
    monkeypatch.setattr(attention, "gpu_capability", lambda device: (9, 0))
    q = rand(1, 2, 130, 160, dtype=dtype)
    k, v = rand(1, 2, 77, 160, dtype=dtype, seed=1), rand(1, 2, 77, 160, dtype=dtype, seed=2)
    close(attention.attention(q, k, v), _sdpa(q, k, v), TOL_MM[dtype])


def test_attention_declines_fp32_on_cuda(monkeypatch):
    """Compiled fp32 attention spills registers in its key loop on every target: on CUDA
    the launcher declines it (the region runs SDPA); the interpreter keeps running it."""
    assert attention.fp32_declined(torch.float32, (8, 6))
    assert not attention.fp32_declined(torch.float16, (9, 0))
    assert not attention.fp32_declined(torch.float32, None)
    q = rand(1, 2, 8, 40)
    monkeypatch.setattr(attention, "gpu_capability", lambda device: (8, 9))
    with pytest.raises(KernelUnsupported, match="SDPA runs it"):
        attention.attention(q, q, q)


def test_attention_unsupported():
    h = torch.float16
    q = rand(1, 2, 8, 320, dtype=h)
    with pytest.raises(KernelUnsupported, match="head dim 320"):
        attention.attention(q, q, q)
    q = rand(1, 2, 8, 40, dtype=h)
    with pytest.raises(KernelUnsupported, match="one dtype"):
        attention.attention(q, q.float(), q.float())
    with pytest.raises(KernelUnsupported, match="no keys"):
        attention.attention(q, q[:, :, :0], q[:, :, :0])
    with pytest.raises(KernelUnsupported, match="line up"):
        attention.attention(q, rand(1, 3, 8, 40, dtype=h), rand(1, 3, 8, 40, dtype=h))
