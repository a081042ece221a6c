"""Can the triton backend run here? One clear sentence with the exact fix when not.

Everything is read from a :class:`Facts` snapshot (gathered without importing
triton unless it is installed) so the Windows / mismatch branches are unit
tested on any machine by handing in simulated facts.
"""
from __future__ import annotations

import os
import platform
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from ..report import Reason

#: torch minor -> the triton-windows series built for it (woct0rdho/triton-windows)
WINDOWS_SERIES = {(2, 6): "3.2", (2, 7): "3.3", (2, 8): "3.4", (2, 9): "3.5"}


@dataclass
class Facts:
    system: str = "Linux"                   # platform.system()
    torch_version: str = "2.8.0"
    cuda_available: bool = False
    triton_dist: str | None = None          # "triton" | "triton-windows" | "pytorch-triton" | None
    triton_version: str | None = None
    torch_requires_triton: str | None = None  # e.g. "3.4.0" from torch's own metadata
    base_prefix: str = ""
    python_version: tuple = (3, 12, 7)
    has_include: bool = True               # <base_prefix>/include/Python.h
    has_libs: bool = True                  # <base_prefix>/libs/pythonXY.lib (Windows)
    allocator_backend: str = "native"      # torch.cuda.memory.get_allocator_backend()
    extra: dict = field(default_factory=dict)


def _mm(v: str) -> tuple[int, int]:
    nums = [int(p) for p in re.findall(r"\d+", v.split("+")[0])[:2]]
    return (nums + [0, 0])[0], (nums + [0, 0])[1]


def _installed_triton() -> tuple[str | None, str | None]:
    for dist in ("triton", "triton-windows", "pytorch-triton"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None, None


def _torch_requires_triton() -> str | None:
    try:
        for req in metadata.requires("torch") or []:
            m = re.match(r"^(?:pytorch-)?triton\s*==\s*([\w.+]+)", req)
            if m:
                return m.group(1)
    except metadata.PackageNotFoundError:
        pass
    return None


def gather() -> Facts:
    dist, ver = _installed_triton()
    base = Path(sys.base_prefix)
    pyver = sys.version_info[:3]
    backend = "native"
    try:
        if torch.cuda.is_available():
            backend = torch.cuda.memory.get_allocator_backend()
    except Exception:
        pass
    return Facts(
        system=platform.system(), torch_version=torch.__version__, cuda_available=torch.cuda.is_available(),
        triton_dist=dist, triton_version=ver, torch_requires_triton=_torch_requires_triton(),
        base_prefix=str(base), python_version=pyver,
        has_include=(base / "include" / "Python.h").is_file(),
        has_libs=(base / "libs" / f"python{pyver[0]}{pyver[1]}.lib").is_file() if os.name == "nt" else True,
        allocator_backend=backend)


def windows_pip_command(torch_version: str) -> str:
    """The exact triton-windows install for this torch."""
    mm = _mm(torch_version)
    if mm >= (2, 10):
        return 'pip install -U "triton-windows<3.7"'
    series = WINDOWS_SERIES.get(mm)
    if series is None:
        return f"upgrade torch to 2.6 or newer, then install the matching triton-windows (torch {torch_version} has none)"
    major, minor = series.split(".")
    return f'pip install -U "triton-windows>={series},<{major}.{int(minor) + 1}"'


def problem(f: Facts) -> Reason | None:
    """None when the triton backend can run, else why not, with the fix."""
    if not f.cuda_available:
        return Reason("no CUDA GPU: the triton backend needs one (CPU runs use inductor or ipex)")
    pip_line = windows_pip_command(f.torch_version) if f.system == "Windows" else "pip install triton"
    if f.triton_version is None:
        if f.system == "Windows":
            return Reason("triton is not installed (Windows needs the triton-windows package)", pip_line)
        return Reason("triton is not installed (CUDA builds of torch on Linux ship it; a CPU build or a custom "
                      "install does not)",
                      pip_line + (f"=={f.torch_requires_triton}" if f.torch_requires_triton else ""))
    if f.system == "Windows":
        want = windows_pip_command(f.torch_version)
        series = WINDOWS_SERIES.get(_mm(f.torch_version))
        ok = (_mm(f.triton_version) < (3, 7)) if _mm(f.torch_version) >= (2, 10) else (
            series is not None and "%d.%d" % _mm(f.triton_version) == series)
        if not ok:
            return Reason(f"{f.triton_dist} {f.triton_version} does not match torch {f.torch_version}", want)
        if not (f.has_include and f.has_libs):
            missing = " and ".join(n for n, ok_ in (("include", f.has_include), ("libs", f.has_libs)) if not ok_)
            v = ".".join(str(p) for p in f.python_version)
            return Reason(f"this Python ({f.base_prefix}) has no {missing} folder, which triton needs to build "
                          f"its launcher (ComfyUI's portable build ships an embedded Python without them)",
                          f"copy the include and libs folders of a full Python {v} install into {f.base_prefix}")
    elif f.torch_requires_triton and f.triton_version.split("+")[0] != f.torch_requires_triton.split("+")[0]:
        return Reason(f"triton {f.triton_version} does not match torch {f.torch_version}, which was built "
                      f"against triton {f.torch_requires_triton}", f"pip install triton=={f.torch_requires_triton}")
    return None


def cuda_graphs_problem(f: Facts) -> Reason | None:
    """CUDA graphs cannot capture with the cudaMallocAsync allocator ComfyUI enables by default."""
    if f.allocator_backend == "cudaMallocAsync":
        return Reason("CUDA graphs are off: ComfyUI runs torch's cudaMallocAsync allocator, which graph capture "
                      "does not support", "start ComfyUI with --disable-cuda-malloc")
    return None


#: Triton compiles of the pack's kernels in this process (each new specialisation of a kernel:
#: dtype, block config, an int argument becoming divisible by 16 or equal to 1)
_KERNEL_COMPILES = [0]
_COUNTING: list = []   # [True] once the hook is installed, [False] when this triton has no hook


def kernel_compiles() -> int:
    return _KERNEL_COMPILES[0]


def count_kernel_compiles() -> bool:
    """Install (once) a chained ``triton.knobs.runtime.jit_post_compile_hook``
    that counts compiles of this pack's kernels. False where triton has no
    such hook (before 3.4): compiles then go uncounted and the report says so."""
    if _COUNTING:
        return _COUNTING[0]
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        _COUNTING.append(False)
        return False
    from ... import kernels
    prefix = kernels.__name__ + "."

    def unet_compiler_count_compiles(*args, **kwargs):
        fn = kwargs.get("fn")
        if str(getattr(fn, "module", "")).startswith(prefix):
            _KERNEL_COMPILES[0] += 1
        return previous(*args, **kwargs) if previous is not None else None
    runtime.jit_post_compile_hook = unet_compiler_count_compiles
    _COUNTING.append(True)
    return True
