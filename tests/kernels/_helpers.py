"""What the kernel tests share: the triton skip, the kernel modules (re-imported for the
interpreter where needed), the device, dtypes, tolerances and random inputs.

On CUDA the kernels run compiled; without CUDA they run on CPU tensors under
the triton interpreter (TRITON_INTERPRET=1, set here before triton is imported).
Sizes are small on purpose: the interpreter runs each program in numpy.
Imported by the test files as ``unet_compiler.tests.kernels._helpers`` (the checkout is never on
``sys.path``: its ``kernels/`` would hide Hugging Face's ``kernels`` package).
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

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
from unet_compiler.kernels._common import KernelUnsupported  # noqa: E402,F401 - the tests' import


#: kernels no backend uses, kept beside the bench (bench/spare_kernels), out of the wheel
SPARE = ("layernorm", "qkv")


def load(name: str):
    """Import a kernel module; re-import it if an earlier import (before
    TRITON_INTERPRET was set) built compiled kernels that cannot run on CPU."""
    package = "unet_compiler.bench.spare_kernels" if name in SPARE else "unet_compiler.kernels"
    mod = importlib.import_module(f"{package}.{name}")
    if not CUDA and not any(_common.is_interpreted(v) for v in vars(mod).values()):
        mod = importlib.reload(mod)
    return mod


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


def rand(*shape, dtype=torch.float32, scale=1.0, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + offset).to(device=DEV, dtype=dtype)


def close(actual, expected, tol):
    torch.testing.assert_close(actual.float(), expected.float(), **tol)
