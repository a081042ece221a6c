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
import sysconfig
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from ..reasons import Reason

#: torch minor -> the triton-windows series built for it, and the release that says so
#: (woct0rdho/triton-windows: each series pairs with the torch that upstream triton pairs with)
WINDOWS_SERIES = {
    (2, 6): "3.2",    # triton-windows 3.2.0.post11+: torch 2.6
    (2, 7): "3.3",    # triton-windows 3.3: torch 2.7
    (2, 8): "3.4",    # triton-windows 3.4: torch 2.8
    (2, 9): "3.5",    # triton-windows 3.5: torch 2.9
    (2, 10): "3.6",   # triton-windows 3.6: torch 2.10 and 2.11 ("triton-windows<3.7")
    (2, 11): "3.6",
    (2, 12): "3.7",   # triton-windows 3.7 (May 2026): torch 2.12 and 2.13
    (2, 13): "3.7",
    (2, 14): "3.8",   # triton-windows 3.8: torch 2.14 (September 2026)
}


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
    has_include: bool = True               # Python.h under include/ where triton looks for it
    has_libs: bool = True                  # libs/pythonXY.lib (Windows) where triton looks for it
    allocator_backend: str = "native"      # torch.cuda.memory.get_allocator_backend()
    python_exe: str = "python"             # sys.executable: the interpreter every fix line names
    triton_dists: dict = field(default_factory=dict)   # every triton distribution installed: {name: version}
    extra: dict = field(default_factory=dict)


def _mm(v: str) -> tuple[int, int]:
    nums = [int(p) for p in re.findall(r"\d+", v.split("+")[0])[:2]]
    return (nums + [0, 0])[0], (nums + [0, 0])[1]


_DISTS = ("triton-windows", "triton", "pytorch-triton")


def _installed_tritons() -> dict[str, str]:
    out = {}
    for dist in _DISTS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def _torch_requires_triton() -> str | None:
    try:
        for req in metadata.requires("torch") or []:
            m = re.match(r"^(?:pytorch-)?triton\s*==\s*([\w.+]+)", req)
            if m:
                return m.group(1)
    except metadata.PackageNotFoundError:
        pass
    return None


def _python_dirs() -> list[Path]:
    """Where triton looks for Python's include/ and libs/: the base prefix, the exec prefix and the
    interpreter's own folder (a portable or embedded Python has only the last)."""
    out = []
    for p in (sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)):
        if p and Path(p) not in out:
            out.append(Path(p))
    return out


def gather() -> Facts:
    dists = _installed_tritons()
    dist = next(iter(dists), None)
    pyver = sys.version_info[:3]
    # a free-threaded build links pythonXYt.lib
    lib = f"python{pyver[0]}{pyver[1]}{'t' if sysconfig.get_config_var('Py_GIL_DISABLED') else ''}.lib"
    backend = "native"
    try:
        if torch.cuda.is_available():
            backend = torch.cuda.memory.get_allocator_backend()
    except Exception:
        pass
    dirs = _python_dirs()
    return Facts(
        system=platform.system(), torch_version=torch.__version__, cuda_available=torch.cuda.is_available(),
        triton_dist=dist, triton_version=dists.get(dist), torch_requires_triton=_torch_requires_triton(),
        base_prefix=str(sys.base_prefix), python_version=pyver,
        has_include=any((d / "include" / "Python.h").is_file() for d in dirs),
        has_libs=any((d / "libs" / lib).is_file() for d in dirs) if os.name == "nt" else True,
        allocator_backend=backend, python_exe=sys.executable, triton_dists=dists,
        extra={"compile_probe": _tiny_kernel})


def pip(f: Facts, args: str) -> str:
    """The exact pip command for the interpreter that runs ComfyUI (the portable build's
    python_embeded\\python.exe, a venv's python): a bare ``pip`` on PATH may belong to another Python."""
    return f'"{f.python_exe}" -m pip {args}'


def windows_series(torch_version: str) -> tuple[str | None, bool]:
    """(the triton-windows series for this torch, whether the table is older than this torch)."""
    mm = _mm(torch_version)
    if mm in WINDOWS_SERIES:
        return WINDOWS_SERIES[mm], False
    newest = max(WINDOWS_SERIES)
    return (WINDOWS_SERIES[newest], True) if mm > newest else (None, False)


def windows_pip_command(torch_version: str, python_exe: str = "python") -> str:
    """The exact triton-windows install for this torch (never a torch install: on Windows
    ``pip install -U torch`` replaces the CUDA build with a CPU wheel)."""
    series, newer = windows_series(torch_version)
    if series is None:
        return (f"upgrade torch to 2.6 or newer (its CUDA build, from https://download.pytorch.org/whl/), then "
                f"install the matching triton-windows (torch {torch_version} has none)")
    major, minor = series.split(".")
    spec = f"triton-windows>={series}" if newer else f"triton-windows>={series},<{major}.{int(minor) + 1}"
    return f'"{python_exe}" -m pip install -U "{spec}"'


def problem(f: Facts) -> Reason | None:
    """None when the triton backend can run, else why not, with the fix. On Windows every problem
    found is named at once, in the order to fix them."""
    if not f.cuda_available:
        return Reason("no CUDA GPU: the triton backend needs one (CPU runs use inductor or ipex)")
    if f.system == "Windows":
        return _windows_problem(f)
    if f.triton_version is None:
        return Reason("triton is not installed (CUDA builds of torch on Linux ship it; a CPU build or a custom "
                      "install does not)",
                      pip(f, "install triton" + (f"=={f.torch_requires_triton}" if f.torch_requires_triton else "")))
    if f.torch_requires_triton and f.triton_version.split("+")[0] != f.torch_requires_triton.split("+")[0]:
        return Reason(f"triton {f.triton_version} does not match torch {f.torch_version}, which was built "
                      f"against triton {f.torch_requires_triton}", pip(f, f"install triton=={f.torch_requires_triton}"))
    return None


def _windows_problem(f: Facts) -> Reason | None:
    want = windows_pip_command(f.torch_version, f.python_exe)
    series, newer = windows_series(f.torch_version)
    found: list[tuple[str, str]] = []   # (why, fix), in the order to fix them
    dists = f.triton_dists or ({f.triton_dist: f.triton_version} if f.triton_dist else {})
    windows = dists.get("triton-windows")
    for other in ("triton", "pytorch-triton"):
        if other in dists and windows is not None:
            found.append((f"an old '{other}' {dists[other]} is installed beside triton-windows {windows} and hides "
                          f"it", pip(f, f"uninstall -y {other}")))
    version = windows or (f.triton_version if f.triton_dist == "triton-windows" else None)
    if version is None and not found:
        installed = f"{f.triton_dist} {f.triton_version} is not triton-windows; " if f.triton_dist else ""
        fix = (pip(f, f"uninstall -y {f.triton_dist}") + " then " if f.triton_dist else "") + want
        found.append((f"{installed}triton is not installed for Windows (it needs the triton-windows package)", fix))
    elif version is not None:
        v = _mm(version)
        ok = series is not None and ("%d.%d" % v == series or (newer and v >= _mm(series)))
        if not ok:
            found.append((f"triton-windows {version} does not match torch {f.torch_version}", want))
    if not (f.has_include and f.has_libs):
        missing = " and ".join(n for n, ok_ in (("include", f.has_include), ("libs", f.has_libs)) if not ok_)
        v = ".".join(str(p) for p in f.python_version)
        found.append((f"this Python ({f.base_prefix}) has no {missing} folder, which triton needs to build its "
                      f"launcher (ComfyUI's portable build ships an embedded Python without them)",
                      f"copy the include and libs folders of a full Python {v} install into {f.base_prefix}"))
    if not found and newer and f.extra.get("compile_probe") is not None:
        # the table is older than this torch: its triton is accepted if a kernel builds with it here
        failed = probe_compile(f)
        if failed:
            found.append((f"triton-windows {version} could not build a test kernel beside torch "
                          f"{f.torch_version}, which is newer than the pack's table ({failed})", want))
    if not found:
        return None
    return Reason("; ".join(w for w, _ in found), "; then ".join(x for _, x in found))


_PROBED: dict = {}


def probe_compile(f: Facts) -> str | None:
    """Build and run one tiny Triton kernel with this torch and triton (``f.extra["compile_probe"]``,
    :func:`_tiny_kernel` in :func:`gather`'s facts): None when it works, else the error's summary.
    Once per process per (torch, triton) pair; triton keeps the built kernel in its own cache."""
    key = (f.torch_version, f.triton_version)
    if key not in _PROBED:
        try:
            f.extra["compile_probe"]()
            _PROBED[key] = None
        except Exception as e:
            from ..reasons import build_failure, error_summary
            build = build_failure(e, f.system)
            _PROBED[key] = build.why if build is not None else error_summary(e)
    return _PROBED[key]


def _tiny_kernel() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)
    x = torch.zeros(1, device="cuda")
    _add_one[(1,)](x)
    torch.cuda.synchronize()
    if x.item() != 1:
        raise RuntimeError(f"the test kernel computed {x.item()}, not 1")


def table_note(f: Facts) -> str | None:
    """A line for the report when this torch is newer than the triton-windows table (its triton is
    accepted where a test kernel built with it)."""
    if f.system == "Windows" and windows_series(f.torch_version)[1]:
        proved = f.extra.get("compile_probe") is not None and _PROBED.get((f.torch_version, f.triton_version),
                                                                           "") is None
        return (f"torch {f.torch_version} is newer than the pack's triton-windows table (last: torch "
                f"{'.'.join(map(str, max(WINDOWS_SERIES)))}): triton-windows {f.triton_version} is accepted"
                + (" (a test kernel built and ran with it)" if proved else "; a failed first compile turns the "
                   "regions to the model's own code"))
    return None


def cuda_graphs_problem(f: Facts, kernels_leave_captures: bool = False) -> Reason | None:
    """Why region CUDA graphs are off for a backend here (None: they can run). Under the
    cudaMallocAsync allocator ComfyUI enables by default, memory a capture allocates is a graph
    allocation that Triton's launcher refuses, and the process then aborts (docs/gpu.md): graphs run
    there only for a backend whose Triton kernels can step out of a capture
    (``kernels_leave_captures``: the torch ops they replace are captured instead)."""
    if f.allocator_backend == "cudaMallocAsync" and not kernels_leave_captures:
        return Reason("CUDA graphs are off: ComfyUI runs torch's cudaMallocAsync allocator, under which a Triton "
                      "kernel inside a graph capture fails and aborts the process",
                      "start ComfyUI with --disable-cuda-malloc, or choose the triton backend")
    return None


def kernels_in_captures_problem(f: Facts) -> str | None:
    """Why Triton kernels must stay out of CUDA graph captures here (None: a capture may hold them).
    Under cudaMallocAsync a capture holds a kernel only through a direct launch of its compiled
    kernel with integer pointers (``kernels._common.Launch``); where the check of direct launches
    failed, the captures hold the torch ops instead."""
    from ...kernels import _common
    old = f.triton_version is not None and _mm(f.triton_version) < (3, 4)
    if f.allocator_backend == "cudaMallocAsync" and (old or not _common.BIND[0]):
        why = (f"triton {f.triton_version} launches only through its JIT (direct launches need triton 3.4+)"
               if old else _common._BIND_CHECKED[0] if _common._BIND_CHECKED else "direct launches are off")
        return ("captured regions run torch's ops, the kernels only outside captures: under ComfyUI's "
                f"cudaMallocAsync allocator Triton cannot take memory a capture allocates, and {why} (start "
                "ComfyUI with --disable-cuda-malloc to capture the kernels too)")
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
