"""kernels/groupnorm.py (GroupNorm, optional fused SiLU) against F.group_norm.

See tests/kernels/_helpers.py for the device, dtypes and tolerances."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.tests.kernels._helpers import DEV, DTYPES, TOL, KernelUnsupported, close, load, rand

groupnorm = load("groupnorm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("shape,groups,eps,silu", [
    ((2, 96, 6, 5), 32, 1e-6, True),    # 3 channels per group, odd spatial size
    ((1, 40, 7, 9), 8, 1e-5, False),    # 5 channels per group
])
def test_groupnorm(dtype, channels_last, shape, groups, eps, silu):
    x = rand(*shape, dtype=dtype, scale=2.0, offset=0.5)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = rand(shape[1], scale=0.5, offset=1.0, seed=1)
    b = rand(shape[1], scale=0.5, seed=2)
    y = groupnorm.groupnorm(x, groups, w, b, eps, silu=silu)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride()
    ref = F.group_norm(x.float(), groups, w, b, eps)
    if silu:
        ref = F.silu(ref)
    close(y, ref, TOL[dtype])
    close(groupnorm.groupnorm_reference(x, groups, w, b, eps, silu), ref, TOL[dtype])


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_groupnorm_sd_channels(channels_last):
    """320 channels / 32 groups (SD's first stage), fp16, fused SiLU."""
    x = rand(1, 320, 8, 8, dtype=torch.float16, scale=3.0, offset=-1.0)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = rand(320, dtype=torch.float16, scale=0.3, offset=1.0, seed=1)
    b = rand(320, dtype=torch.float16, scale=0.3, seed=2)
    y = groupnorm.groupnorm(x, 32, w, b, 1e-5, silu=True)
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    close(y, F.silu(F.group_norm(x.float(), 32, w.float(), b.float(), 1e-5)), TOL[torch.float16])


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("split", ["one_program", "one_block_per_program"])
def test_groupnorm_many_blocks_large_mean(monkeypatch, channels_last, split):
    """Groups of 3280 values: reduced as several blocks inside one program, or
    as one-block programs merged by the finalize kernel (channels_last: per
    channel, then the group's channels); every merge uses Chan's formula. The
    mean (~100, ramping along H) dwarfs the std, and block means differ: a
    merge missing its between-block term fails here."""
    monkeypatch.setattr(groupnorm, "_chunks",
                        lambda blocks, reductions, cuda: 1 if split == "one_program" else blocks)
    ramp = torch.linspace(0.0, 8.0, 40, device=DEV).view(1, 1, 40, 1)
    x = rand(1, 64, 40, 41, scale=1.0, offset=100.0) + ramp
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    y = groupnorm.groupnorm(x, 32, None, None, 1e-6)
    ref = F.group_norm(x.double(), 32, None, None, 1e-6)
    close(y, ref, dict(atol=1e-4, rtol=1e-4))


def test_groupnorm_3d_and_no_affine():
    x = rand(2, 64, 77, scale=2.0)
    close(groupnorm.groupnorm(x, 32), F.group_norm(x, 32), TOL[torch.float32])


def test_groupnorm_strided_views():
    """Views the backend may pass: a spatially strided NCHW view (stride 2
    along S) and a channel slice of a channels_last tensor (stride C along S)."""
    big = rand(2, 64, 6, 10, scale=2.0, offset=1.0)
    x = big[..., ::2]
    close(groupnorm.groupnorm(x, 32, None, None, 1e-6, silu=True), F.silu(F.group_norm(x, 32, eps=1e-6)),
           TOL[torch.float32])
    x = rand(2, 96, 5, 5, scale=2.0).to(memory_format=torch.channels_last)[:, 16:80]
    close(groupnorm.groupnorm(x, 32), F.group_norm(x, 32), TOL[torch.float32])


def test_groupnorm_reads_live_weights():
    x = rand(1, 64, 4, 4)
    w = torch.ones(64, device=DEV)
    b = torch.zeros(64, device=DEV)
    y1 = groupnorm.groupnorm(x, 32, w, b)
    w.mul_(2.0)  # e.g. a LoRA patch applied in place
    b.add_(0.5)
    y2 = groupnorm.groupnorm(x, 32, w, b)
    close(y2, y1 * 2.0 + 0.5, TOL[torch.float32])


def test_groupnorm_unsupported():
    with pytest.raises(KernelUnsupported, match="num_groups"):
        groupnorm.groupnorm(rand(1, 30, 4, 4), 32)
    with pytest.raises(KernelUnsupported, match="int64"):
        groupnorm.groupnorm(torch.zeros(1, 64, 4, 4, dtype=torch.int64, device=DEV), 32)
    with pytest.raises(KernelUnsupported, match="weight"):
        groupnorm.groupnorm(rand(1, 64, 4, 4), 32, weight=torch.ones(32, device=DEV))
