"""Triton kernels against their PyTorch references (and SDPA / F.group_norm).

On CUDA the kernels run compiled; without CUDA they run on CPU tensors under
the triton interpreter (TRITON_INTERPRET=1, set here before triton is imported).
Sizes are small on purpose: the interpreter runs each program in numpy.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`

triton = pytest.importorskip("triton", reason="triton not installed: pip install 'triton>=3.2' to run the kernel tests")


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())


if not CUDA and _version(triton.__version__) < (3, 2):
    pytest.skip(f"triton {triton.__version__}'s interpreter gives wrong results with numpy 2; need triton>=3.2",
                allow_module_level=True)

from unet_compiler.kernels import _common  # noqa: E402
from unet_compiler.kernels._common import KernelUnsupported  # noqa: E402


def _load(name: str):
    """Import a kernel module; re-import it if an earlier import (before
    TRITON_INTERPRET was set) built compiled kernels that cannot run on CPU."""
    mod = importlib.import_module(f"unet_compiler.kernels.{name}")
    if not CUDA and not any(_common.is_interpreted(v) for v in vars(mod).values()):
        mod = importlib.reload(mod)
    return mod


groupnorm = _load("groupnorm")
layernorm = _load("layernorm")
geglu = _load("geglu")
attention = _load("attention")
epilogue = _load("epilogue")
qkv = _load("qkv")

DEV = torch.device("cuda" if CUDA else "cpu")


def _dtype_params():
    out = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        marks = []
        if dt == torch.bfloat16 and CUDA and torch.cuda.get_device_capability() < (8, 0):
            marks.append(pytest.mark.skip(reason="bf16 kernels need a compute capability 8.0+ GPU"))
        out.append(pytest.param(dt, id=str(dt).replace("torch.", ""), marks=marks))
    return out


DTYPES = _dtype_params()

# elementwise / normalisation: kernel and reference both compute in fp32 and round
# once, so they differ by ~1 ulp of the output dtype (the interpreter's fp32->bf16
# cast truncates instead of rounding: up to 1 bf16 ulp, 2**-8 relative)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5),
       torch.float16: dict(atol=1e-3, rtol=1e-3),
       torch.bfloat16: dict(atol=8e-3, rtol=1.6e-2)}
# matmuls and attention: fp32 accumulation order, and FA rounds P to the input dtype
TOL_MM = {torch.float32: dict(atol=1e-4, rtol=1e-4),
          torch.float16: dict(atol=2e-3, rtol=2e-3),
          torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(device=DEV, dtype=dtype)


def _close(actual, expected, tol):
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


# ----------------------------------------------------------------------------- package


def test_package_import_does_not_import_triton():
    code = ("import sys, unet_compiler.kernels, unet_compiler.kernels._common as c; "
            "assert 'triton' not in sys.modules, 'importing the kernels package imported triton'; "
            "assert issubclass(c.KernelUnsupported, ValueError)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_unsupported_device_and_size_raise():
    x = torch.empty(2, 64, 4, 4, device="meta")
    with pytest.raises(KernelUnsupported, match="meta"):
        groupnorm.groupnorm(x, 32)
    huge = torch.empty(1, device="meta").as_strided((2, 8), (2**31, 1))  # offsets past 32 bits
    with pytest.raises(KernelUnsupported, match="32-bit"):
        layernorm.layernorm(huge)


def test_max_numel_leaves_room_for_the_last_block():
    """The masked lanes of a last block compute offsets up to a block past the end:
    a tensor just under 2**31 elements would overflow them, so it is declined."""
    assert _common.MAX_NUMEL + 4096 < 2**31 - 1
    near = torch.empty(1, device="meta").as_strided((2**31 - 2**20,), (1,))
    with pytest.raises(KernelUnsupported, match="32-bit"):
        epilogue.bias_residual(near)
    with pytest.raises(KernelUnsupported, match="row stride"):
        _common.check_row_block("geglu", "h", 256, 2**17)


class _Matmul:
    """A stand-in for torch.backends.cuda.matmul: the new API's value, or an AttributeError
    (torch < 2.9); the legacy flag, or the RuntimeError torch >= 2.9 raises once the new
    API was used."""

    def __init__(self, new, legacy):
        self.new, self.legacy = new, legacy

    def __getattr__(self, name):
        value = {"fp32_precision": self.new, "allow_tf32": self.legacy}[name]
        if isinstance(value, Exception):
            raise value
        return value


@pytest.mark.parametrize("new,legacy,expected", [
    ("tf32", RuntimeError("mix of the legacy and new APIs"), "tf32"),
    ("ieee", RuntimeError("mix of the legacy and new APIs"), "ieee"),
    ("none", False, "ieee"),
    (AttributeError("Unknown attribute fp32_precision"), True, "tf32"),
    (AttributeError("Unknown attribute fp32_precision"), False, "ieee"),
], ids=["new-tf32", "new-ieee", "default", "legacy-tf32", "legacy-ieee"])
def test_matmul_precision_reads_the_fp32_precision_api(monkeypatch, new, legacy, expected):
    monkeypatch.setattr(torch.backends.cuda, "matmul", _Matmul(new, legacy))
    assert _common.matmul_precision(torch.float32) == expected
    assert _common.matmul_precision(torch.float16) == "ieee"


@pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="torch < 2.9: no fp32_precision API")
def test_matmul_precision_after_the_new_api_was_used():
    """In a fresh process (the setting is global): once ``fp32_precision`` is set, torch's
    legacy ``allow_tf32`` read raises; the launchers' read must not."""
    code = ("import torch; from unet_compiler.kernels._common import matmul_precision as p; "
            "m = torch.backends.cuda.matmul; m.fp32_precision = 'tf32'; assert p(torch.float32) == 'tf32'; "
            "m.fp32_precision = 'ieee'; assert p(torch.float32) == 'ieee'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_autograd_inputs_raise_and_no_grad_runs():
    w = torch.ones(64, device=DEV, requires_grad=True)  # an nn.Parameter-like weight
    x = _rand(1, 64, 2, 2)
    with pytest.raises(KernelUnsupported, match="forward-only"):
        groupnorm.groupnorm(x, 32, w)
    with torch.no_grad():
        _close(groupnorm.groupnorm(x, 32, w), F.group_norm(x, 32), TOL[torch.float32])


def test_launch_first_fitting_falls_back_and_remembers(monkeypatch):
    from triton.runtime.errors import OutOfResources

    calls = []

    class FakeKernel:
        __name__ = "fake_kernel"

        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append(kw["BLOCK"])
                if kw["BLOCK"] > 32:
                    raise OutOfResources(200000, 101376, "shared memory")
            return run

    monkeypatch.setattr(_common, "_CONFIG_CHOICE", {})
    configs = [dict(BLOCK=128), dict(BLOCK=64), dict(BLOCK=32)]
    for _ in range(2):
        _common.launch_first_fitting(FakeKernel(), ("k",), configs, lambda c: (1,), (), {}, "fake", DEV)
    assert calls == [128, 64, 32, 32]  # the probe runs once, then the fitting config is reused
    with pytest.raises(KernelUnsupported, match="no block configuration fits"):
        _common.launch_first_fitting(FakeKernel(), ("other",), configs[:2], lambda c: (1,), (), {}, "fake", DEV)


# ----------------------------------------------------------------------------- groupnorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("shape,groups,eps,silu", [
    ((2, 96, 6, 5), 32, 1e-6, True),    # 3 channels per group, odd spatial size
    ((1, 40, 7, 9), 8, 1e-5, False),    # 5 channels per group
])
def test_groupnorm(dtype, channels_last, shape, groups, eps, silu):
    x = _rand(*shape, dtype=dtype, scale=2.0, offset=0.5)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = _rand(shape[1], scale=0.5, offset=1.0, seed=1)
    b = _rand(shape[1], scale=0.5, seed=2)
    y = groupnorm.groupnorm(x, groups, w, b, eps, silu=silu)
    assert y.dtype == dtype and y.shape == x.shape and y.stride() == x.stride()
    ref = F.group_norm(x.float(), groups, w, b, eps)
    if silu:
        ref = F.silu(ref)
    _close(y, ref, TOL[dtype])
    _close(groupnorm.groupnorm_reference(x, groups, w, b, eps, silu), ref, TOL[dtype])


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_groupnorm_sd_channels(channels_last):
    """320 channels / 32 groups (SD's first stage), fp16, fused SiLU."""
    x = _rand(1, 320, 8, 8, dtype=torch.float16, scale=3.0, offset=-1.0)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = _rand(320, dtype=torch.float16, scale=0.3, offset=1.0, seed=1)
    b = _rand(320, dtype=torch.float16, scale=0.3, seed=2)
    y = groupnorm.groupnorm(x, 32, w, b, 1e-5, silu=True)
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    _close(y, F.silu(F.group_norm(x.float(), 32, w.float(), b.float(), 1e-5)), TOL[torch.float16])


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
    x = _rand(1, 64, 40, 41, scale=1.0, offset=100.0) + ramp
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    y = groupnorm.groupnorm(x, 32, None, None, 1e-6)
    ref = F.group_norm(x.double(), 32, None, None, 1e-6)
    _close(y, ref, dict(atol=1e-4, rtol=1e-4))


def test_groupnorm_3d_and_no_affine():
    x = _rand(2, 64, 77, scale=2.0)
    _close(groupnorm.groupnorm(x, 32), F.group_norm(x, 32), TOL[torch.float32])


def test_groupnorm_strided_views():
    """Views the backend may pass: a spatially strided NCHW view (stride 2
    along S) and a channel slice of a channels_last tensor (stride C along S)."""
    big = _rand(2, 64, 6, 10, scale=2.0, offset=1.0)
    x = big[..., ::2]
    _close(groupnorm.groupnorm(x, 32, None, None, 1e-6, silu=True), F.silu(F.group_norm(x, 32, eps=1e-6)),
           TOL[torch.float32])
    x = _rand(2, 96, 5, 5, scale=2.0).to(memory_format=torch.channels_last)[:, 16:80]
    _close(groupnorm.groupnorm(x, 32), F.group_norm(x, 32), TOL[torch.float32])


def test_groupnorm_reads_live_weights():
    x = _rand(1, 64, 4, 4)
    w = torch.ones(64, device=DEV)
    b = torch.zeros(64, device=DEV)
    y1 = groupnorm.groupnorm(x, 32, w, b)
    w.mul_(2.0)  # e.g. a LoRA patch applied in place
    b.add_(0.5)
    y2 = groupnorm.groupnorm(x, 32, w, b)
    _close(y2, y1 * 2.0 + 0.5, TOL[torch.float32])


def test_groupnorm_unsupported():
    with pytest.raises(KernelUnsupported, match="num_groups"):
        groupnorm.groupnorm(_rand(1, 30, 4, 4), 32)
    with pytest.raises(KernelUnsupported, match="int64"):
        groupnorm.groupnorm(torch.zeros(1, 64, 4, 4, dtype=torch.int64, device=DEV), 32)
    with pytest.raises(KernelUnsupported, match="weight"):
        groupnorm.groupnorm(_rand(1, 64, 4, 4), 32, weight=torch.ones(32, device=DEV))


# ----------------------------------------------------------------------------- layernorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,affine", [((2, 77, 40), True), ((3, 5, 320), True), ((7, 33), False)],
                         ids=["77tok-d40", "d320", "d33-noaffine"])
def test_layernorm(dtype, shape, affine):
    x = _rand(*shape, dtype=dtype, scale=3.0, offset=2.0)
    D = shape[-1]
    w = _rand(D, dtype=dtype, scale=0.5, offset=1.0, seed=1) if affine else None
    b = _rand(D, dtype=dtype, scale=0.5, seed=2) if affine else None
    y = layernorm.layernorm(x, w, b, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    ref = F.layer_norm(x.float(), (D,), None if w is None else w.float(), None if b is None else b.float(), 1e-5)
    _close(y, ref, TOL[dtype])
    _close(layernorm.layernorm_reference(x, w, b, 1e-5), ref, TOL[dtype])


def test_layernorm_strided_rows_and_wide_row():
    big = _rand(4, 77, 96, offset=50.0)
    x = big[..., :80]  # rows not contiguous with each other
    _close(layernorm.layernorm(x), F.layer_norm(x, (80,)), dict(atol=1e-4, rtol=1e-4))
    x = _rand(3, 1280)
    w = _rand(1280, seed=3)
    _close(layernorm.layernorm(x, w, None, 1e-6), F.layer_norm(x, (1280,), w, None, 1e-6), TOL[torch.float32])


def test_layernorm_unsupported():
    with pytest.raises(KernelUnsupported, match="16384"):
        layernorm.layernorm(torch.empty(1, 16385, device=DEV))
    with pytest.raises(KernelUnsupported, match="bias"):
        layernorm.layernorm(_rand(2, 8), None, torch.zeros(7, device=DEV))
    with pytest.raises(KernelUnsupported, match="int32"):
        layernorm.layernorm(torch.zeros(2, 8, dtype=torch.int32, device=DEV))


# ----------------------------------------------------------------------------- geglu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(2, 77, 90), (3, 2560)], ids=["77tok-D45", "D1280"])
def test_geglu(dtype, approximate, shape):
    h = _rand(*shape, dtype=dtype, scale=2.0)
    y = geglu.geglu(h, approximate)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    x, gate = h.float().chunk(2, dim=-1)
    ref = x * F.gelu(gate, approximate=approximate)
    _close(y, ref, TOL[dtype])
    _close(geglu.geglu_reference(h, approximate), ref, TOL[dtype])


def test_geglu_strided_input_and_catches_swapped_halves():
    big = _rand(2, 77, 100)
    h = big[..., 3:83]  # strided rows
    y = geglu.geglu(h)
    x, gate = h.chunk(2, dim=-1)
    _close(y, x * F.gelu(gate), TOL[torch.float32])
    with pytest.raises(AssertionError):  # the tolerance is tight enough to see a wrong kernel
        _close(y, gate * F.gelu(x), TOL[torch.float32])


def test_geglu_unsupported():
    with pytest.raises(KernelUnsupported, match="two halves"):
        geglu.geglu(_rand(2, 7))
    with pytest.raises(KernelUnsupported, match="approximate"):
        geglu.geglu(_rand(2, 8), approximate="sigmoid")


# ----------------------------------------------------------------------------- attention


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
    q = _rand(B, NQ, H, head_dim, dtype=dtype).transpose(1, 2)
    k = _rand(B, H, NK, head_dim, dtype=dtype, seed=1)
    v = _rand(B, H, NK, head_dim, dtype=dtype, seed=2)
    out = _attention(q, k, v)
    assert out.shape == (B, H, NQ, head_dim) and out.dtype == dtype
    assert out.transpose(1, 2).is_contiguous()  # [B, Nq, H, d] memory: free reshape to [B, Nq, H*d]
    _close(out, _sdpa(q, k, v), TOL_MM[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_self_77_tokens(dtype):
    B, H, N, D = 1, 3, 77, 64
    qkv_ = _rand(B, N, 3, H, D, dtype=dtype).permute(2, 0, 3, 1, 4)  # packed, all strided
    q, k, v = qkv_[0], qkv_[1], qkv_[2]
    _close(_attention(q, k, v), _sdpa(q, k, v), TOL_MM[dtype])


def test_attention_scale_3d_and_small_head_dim():
    q = _rand(4, 33, 8)
    k = _rand(4, 77, 8, seed=1)
    v = _rand(4, 77, 8, seed=2)
    out = _attention(q, k, v, scale=0.3)
    assert out.shape == (4, 33, 8)
    _close(out, _sdpa(q, k, v, scale=0.3), TOL_MM[torch.float32])
    with pytest.raises(AssertionError):  # a wrong scale is caught
        _close(out, _sdpa(q, k, v), TOL_MM[torch.float32])


def test_attention_large_logits_stay_finite():
    """Online softmax must subtract the running max: logits ~ 1e3 overflow exp."""
    q = _rand(1, 1, 20, 40, scale=30.0)
    k = _rand(1, 1, 154, 40, scale=30.0, seed=1)
    v = _rand(1, 1, 154, 40, seed=2)
    out = _attention(q, k, v)
    assert torch.isfinite(out).all()
    _close(out, _sdpa(q, k, v), dict(atol=1e-3, rtol=1e-3))


def test_attention_reference_matches_sdpa():
    q, k, v = _rand(2, 2, 10, 40), _rand(2, 2, 77, 40, seed=1), _rand(2, 2, 77, 40, seed=2)
    _close(attention.attention_reference(q, k, v), _sdpa(q, k, v), TOL_MM[torch.float32])


def test_attention_head_dim_40_unaligned_strides():
    """Head dim 40 (SD1.5's first level): the kernel is told its strides are 16-byte
    multiples only when the launcher checked them; views with odd strides (and an
    odd storage offset) still run, with no claim, and match SDPA."""
    dt = torch.float16
    big = _rand(2, 60, 8 * 40 + 3, dtype=dt)
    q = big[..., 1:321].view(2, 60, 8, 40).transpose(1, 2)  # row stride 323, offset 1 element
    k = _rand(2, 77, 8, 40, dtype=dt, seed=1).transpose(1, 2)
    v = _rand(2, 77, 8, 40, dtype=dt, seed=2).transpose(1, 2)
    assert attention._alignment((q, k, v), 40) == 1
    assert attention._alignment((k, k, v), 40) == 8
    assert attention._alignment((k.float(), k.float(), v.float()), 40) == 4
    _close(attention.attention(q, k, v), _sdpa(q, k, v), TOL_MM[dt])


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
    q = _rand(1, 2, 130, 160, dtype=dtype)
    k, v = _rand(1, 2, 77, 160, dtype=dtype, seed=1), _rand(1, 2, 77, 160, dtype=dtype, seed=2)
    _close(attention.attention(q, k, v), _sdpa(q, k, v), TOL_MM[dtype])


def test_attention_declines_fp32_on_cuda(monkeypatch):
    """Compiled fp32 attention spills registers in its key loop on every target: on CUDA
    the launcher declines it (the region runs SDPA); the interpreter keeps running it."""
    assert attention.fp32_declined(torch.float32, (8, 6))
    assert not attention.fp32_declined(torch.float16, (9, 0))
    assert not attention.fp32_declined(torch.float32, None)
    q = _rand(1, 2, 8, 40)
    monkeypatch.setattr(attention, "gpu_capability", lambda device: (8, 9))
    with pytest.raises(KernelUnsupported, match="SDPA runs it"):
        attention.attention(q, q, q)


def test_attention_unsupported():
    h = torch.float16
    q = _rand(1, 2, 8, 320, dtype=h)
    with pytest.raises(KernelUnsupported, match="head dim 320"):
        attention.attention(q, q, q)
    q = _rand(1, 2, 8, 40, dtype=h)
    with pytest.raises(KernelUnsupported, match="one dtype"):
        attention.attention(q, q.float(), q.float())
    with pytest.raises(KernelUnsupported, match="no keys"):
        attention.attention(q, q[:, :, :0], q[:, :, :0])
    with pytest.raises(KernelUnsupported, match="line up"):
        attention.attention(q, _rand(1, 3, 8, 40, dtype=h), _rand(1, 3, 8, 40, dtype=h))


# ----------------------------------------------------------------------------- epilogue


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "linear"])
def test_bias_residual(dtype, layout):
    if layout == "linear":
        x = _rand(2, 77, 40, dtype=dtype)
        dim = -1
    else:
        x = _rand(2, 20, 5, 7, dtype=dtype)
        dim = 1
        if layout == "channels_last":
            x = x.to(memory_format=torch.channels_last)
    C = x.shape[dim]
    res = torch.empty_like(x).copy_(_rand(*x.shape, dtype=dtype, seed=1))
    bias = _rand(C, seed=2)  # fp32 bias on a half tensor is fine
    y = epilogue.bias_residual(x, bias, res, dim=dim)
    shape = [1] * x.dim()
    shape[dim] = C
    ref = x.float() + bias.view(shape) + res.float()
    assert y.stride() == x.stride() and y.dtype == dtype
    _close(y, ref, TOL[dtype])
    _close(epilogue.bias_residual_reference(x, bias, res, dim=dim), ref, TOL[dtype])


def test_bias_residual_partial_and_in_place():
    x = _rand(2, 12, 3, 3)
    bias = _rand(12, seed=1)
    res = _rand(2, 12, 3, 3, seed=2)
    _close(epilogue.bias_residual(x, bias), x + bias.view(1, -1, 1, 1), TOL[torch.float32])
    _close(epilogue.bias_residual(x, None, res), x + res, TOL[torch.float32])
    expected = x + bias.view(1, -1, 1, 1) + res
    out = epilogue.bias_residual(x, bias, res, out=x)
    assert out is x
    _close(x, expected, TOL[torch.float32])


def test_bias_residual_unsupported():
    x = _rand(2, 12, 4, 4)
    with pytest.raises(KernelUnsupported, match="layout"):
        epilogue.bias_residual(x, None, x.to(memory_format=torch.channels_last))
    with pytest.raises(KernelUnsupported, match="bias"):
        epilogue.bias_residual(x, torch.zeros(4, device=DEV))
    with pytest.raises(KernelUnsupported, match="dense"):
        epilogue.bias_residual(x[:, :, ::2])
    with pytest.raises(KernelUnsupported, match="dim"):
        epilogue.bias_residual(x, None, None, dim=4)


# ----------------------------------------------------------------------------- qkv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_qkv_projection(dtype, cross):
    x = _rand(2, 77, 40, dtype=dtype)
    ctx = _rand(2, 154, 24, dtype=dtype, seed=1) if cross else None
    kc = 24 if cross else 40
    w_q = _rand(48, 40, dtype=dtype, scale=40 ** -0.5, seed=2)
    w_k = _rand(48, kc, dtype=dtype, scale=kc ** -0.5, seed=3)
    w_v = _rand(40, kc, dtype=dtype, scale=kc ** -0.5, seed=4)
    b_v = _rand(40, seed=5) if cross else None
    q, k, v = qkv.qkv_projection(x, w_q, w_k, w_v, ctx, b_v=b_v)
    src = ctx if cross else x
    assert q.shape == (2, 77, 48) and k.shape == (*src.shape[:-1], 48) and v.shape == (*src.shape[:-1], 40)
    refs = (F.linear(x.float(), w_q.float()), F.linear(src.float(), w_k.float()),
            F.linear(src.float(), w_v.float(), None if b_v is None else b_v.float()))
    for got, ref in zip((q, k, v), refs, strict=True):
        assert got.dtype == dtype
        _close(got, ref, TOL_MM[dtype])
    for got, ref in zip(qkv.qkv_projection_reference(x, w_q, w_k, w_v, ctx, b_v=b_v), refs, strict=True):
        _close(got, ref, TOL_MM[dtype])


def test_qkv_sd_sizes_fp16():
    """SD1.5 first-stage cross-attention widths: 320 inner, 768 context."""
    dt = torch.float16
    x = _rand(1, 64, 320, dtype=dt)
    ctx = _rand(1, 77, 768, dtype=dt, seed=1)
    w_q = _rand(320, 320, dtype=dt, scale=320 ** -0.5, seed=2)
    w_k = _rand(320, 768, dtype=dt, scale=768 ** -0.5, seed=3)
    w_v = _rand(320, 768, dtype=dt, scale=768 ** -0.5, seed=4)
    for got, ref in zip(qkv.qkv_projection(x, w_q, w_k, w_v, ctx),
                        (F.linear(x.float(), w_q.float()), F.linear(ctx.float(), w_k.float()),
                         F.linear(ctx.float(), w_v.float())), strict=True):
        _close(got, ref, TOL_MM[dt])


def test_qkv_reads_live_and_strided_weights():
    x = _rand(1, 20, 24)
    base = _rand(24, 40, scale=0.2, seed=1)
    w_q = base.t()  # a transposed view: [40, 24] with strides (1, 40)
    w_k = _rand(40, 24, scale=0.2, seed=2)
    w_v = _rand(40, 24, scale=0.2, seed=3)
    q1, k1, _ = qkv.qkv_projection(x, w_q, w_k, w_v)
    _close(q1, F.linear(x, w_q), TOL_MM[torch.float32])
    delta = _rand(40, 24, scale=0.1, seed=4)
    w_k.add_(delta)  # an in-place LoRA patch: the next call must see it
    _, k2, _ = qkv.qkv_projection(x, w_q, w_k, w_v)
    _close(k2, F.linear(x, w_k), TOL_MM[torch.float32])
    _close(k2 - k1, F.linear(x, delta), TOL_MM[torch.float32])


def test_qkv_unsupported():
    x = _rand(2, 8, 16, dtype=torch.float16)
    w = _rand(16, 16)
    with pytest.raises(KernelUnsupported, match="cast path"):
        qkv.qkv_projection(x, w, w, w)  # fp16 activations, fp32 weights
    w = _rand(16, 12, dtype=torch.float16)
    with pytest.raises(KernelUnsupported, match="w_q"):
        qkv.qkv_projection(x, w, w, w)
    with pytest.raises(KernelUnsupported, match="nn.Linear weight"):
        qkv.qkv_projection(x, _rand(16, dtype=torch.float16), w, w)
