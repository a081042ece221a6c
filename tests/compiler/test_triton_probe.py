"""The triton backend's capability probes on simulated platforms: every
branch gives one sentence with the exact fix, and the model falls back
visibly instead of raising."""
import pytest
import torch

from unet_compiler.compiler.backends import resolve
from unet_compiler.compiler.compat import triton as T


def facts(**kw):
    base = dict(system="Linux", torch_version="2.8.0+cu128", cuda_available=True, triton_dist="triton",
                triton_version="3.4.0", torch_requires_triton="3.4.0", base_prefix="/usr", python_version=(3, 12, 7))
    base.update(kw)
    return T.Facts(**base)


@pytest.mark.parametrize("torch_v, spec", [
    ("2.6.0+cu126", "triton-windows>=3.2,<3.3"),
    ("2.7.1+cu128", "triton-windows>=3.3,<3.4"),
    ("2.8.0+cu128", "triton-windows>=3.4,<3.5"),
    ("2.9.1+cu128", "triton-windows>=3.5,<3.6"),
    ("2.10.0+cu130", "triton-windows>=3.6,<3.7"),
    ("2.11.0+cu130", "triton-windows>=3.6,<3.7"),
    ("2.12.0+cu130", "triton-windows>=3.7,<3.8"),
    ("2.13.0", "triton-windows>=3.7,<3.8"),
    ("2.14.1+cu130", "triton-windows>=3.8,<3.9"),
    ("2.15.0+cu130", "triton-windows>=3.8"),          # newer than the table: at least its last series
])
def test_windows_pip_command_matches_torch(torch_v, spec):
    exe = r"C:\ComfyUI_windows_portable\python_embeded\python.exe"
    assert T.windows_pip_command(torch_v, exe) == f'"{exe}" -m pip install -U "{spec}"'


def test_windows_old_torch_is_told_to_upgrade():
    assert "upgrade torch to 2.6" in T.windows_pip_command("2.5.1")


def test_all_good_linux_and_windows():
    assert T.problem(facts()) is None
    assert T.problem(facts(system="Windows", triton_dist="triton-windows", triton_version="3.4.0.post20")) is None
    assert T.problem(facts(system="Windows", torch_version="2.10.0", triton_dist="triton-windows",
                           triton_version="3.6.0")) is None
    assert T.problem(facts(system="Windows", torch_version="2.13.0", triton_dist="triton-windows",
                           triton_version="3.7.0")) is None, "today's torch with today's triton-windows"


def test_a_torch_newer_than_the_table_keeps_its_triton_and_says_so():
    new = facts(system="Windows", torch_version="2.15.0", triton_dist="triton-windows", triton_version="3.9.0")
    assert T.problem(new) is None
    assert "newer than the pack's triton-windows table" in T.table_note(new)
    assert T.table_note(facts(system="Windows", torch_version="2.13.0")) is None
    old = facts(system="Windows", torch_version="2.15.0", triton_dist="triton-windows", triton_version="3.5.0")
    assert "does not match" in T.problem(old)


def test_no_cuda():
    assert "no CUDA GPU" in T.problem(facts(cuda_available=False))


def test_triton_missing_on_windows_gives_the_matching_pip_line_for_this_python():
    exe = r"C:\ComfyUI_windows_portable\python_embeded\python.exe"
    msg = T.problem(facts(system="Windows", torch_version="2.7.0", triton_dist=None, triton_version=None,
                          python_exe=exe))
    assert "triton-windows" in msg and f'"{exe}" -m pip install -U "triton-windows>=3.3,<3.4"' in msg
    assert " pip install" not in msg.replace(f'"{exe}" -m pip install', ""), "no bare pip: it may be another Python's"


def test_triton_missing_on_linux():
    msg = T.problem(facts(triton_dist=None, triton_version=None, python_exe="/venv/bin/python"))
    assert '"/venv/bin/python" -m pip install triton==3.4.0' in msg


def test_windows_version_mismatch():
    msg = T.problem(facts(system="Windows", torch_version="2.8.0", triton_dist="triton-windows",
                          triton_version="3.2.0.post18"))
    assert "does not match torch 2.8.0" in msg and '"triton-windows>=3.4,<3.5"' in msg
    msg = T.problem(facts(system="Windows", torch_version="2.11.0", triton_dist="triton-windows",
                          triton_version="3.7.1"))
    assert '"triton-windows>=3.6,<3.7"' in msg
    msg = T.problem(facts(system="Windows", torch_version="2.13.0", triton_dist="triton-windows",
                          triton_version="3.5.0"))
    assert "does not match torch 2.13.0" in msg and '"triton-windows>=3.7,<3.8"' in msg, "old 3.5 beside 2.13"


def test_a_leftover_triton_that_hides_triton_windows_is_named_with_its_uninstall():
    both = {"triton": "3.0.0", "triton-windows": "3.7.0"}
    msg = T.problem(facts(system="Windows", torch_version="2.13.0", triton_dist="triton", triton_version="3.0.0",
                          triton_dists=both, python_exe="py.exe"))
    assert "an old 'triton' 3.0.0 is installed beside triton-windows 3.7.0" in msg
    assert '"py.exe" -m pip uninstall -y triton' in msg
    alone = T.problem(facts(system="Windows", torch_version="2.13.0", triton_dist="triton", triton_version="3.0.0",
                            triton_dists={"triton": "3.0.0"}, python_exe="py.exe"))
    assert "is not triton-windows" in alone and "uninstall -y triton then" in alone and "triton-windows>=3.7" in alone


def test_every_windows_problem_is_named_at_once_in_fix_order():
    msg = T.problem(facts(system="Windows", torch_version="2.13.0", triton_dist="triton-windows",
                          triton_version="3.5.0", has_include=False, has_libs=False))
    assert msg.index("does not match") < msg.index("no include and libs folder"), msg
    assert msg.fix.index("triton-windows>=3.7") < msg.fix.index("copy the include and libs"), msg.fix


def test_linux_version_mismatch():
    msg = T.problem(facts(triton_version="3.3.1"))
    assert "triton 3.3.1 does not match torch 2.8.0+cu128" in msg and "-m pip install triton==3.4.0" in msg


def test_windows_portable_python_without_include_and_libs():
    msg = T.problem(facts(system="Windows", triton_dist="triton-windows", triton_version="3.4.0",
                          base_prefix=r"C:\ComfyUI_windows_portable\python_embeded", has_include=False,
                          has_libs=False))
    assert "no include and libs folder" in msg and "portable" in msg
    assert r"into C:\ComfyUI_windows_portable\python_embeded" in msg and "Python 3.12.7" in msg
    msg = T.problem(facts(system="Windows", triton_dist="triton-windows", triton_version="3.4.0", has_libs=False))
    assert "no libs folder" in msg


def test_cuda_malloc_async_and_cuda_graphs():
    assert "--disable-cuda-malloc" in T.cuda_graphs_problem(facts(allocator_backend="cudaMallocAsync"))
    assert T.cuda_graphs_problem(facts(allocator_backend="native")) is None
    # the triton backend's kernels step out of a capture: graphs run there
    assert T.cuda_graphs_problem(facts(allocator_backend="cudaMallocAsync"), kernels_leave_captures=True) is None
    # a capture holds the kernels through direct launches; where their check failed, the torch ops
    assert T.kernels_in_captures_problem(facts(allocator_backend="cudaMallocAsync")) is None
    assert T.kernels_in_captures_problem(facts(allocator_backend="native")) is None


def test_captures_hold_the_kernels_only_through_direct_launches(monkeypatch):
    from unet_compiler.kernels import _common
    monkeypatch.setattr(_common, "BIND", [False])
    monkeypatch.setattr(_common, "_BIND_CHECKED", ["the direct launch check failed (TypeError: x)"])
    why = T.kernels_in_captures_problem(facts(allocator_backend="cudaMallocAsync"))
    assert "--disable-cuda-malloc" in why and "check failed (TypeError: x)" in why
    assert T.kernels_in_captures_problem(facts(allocator_backend="native")) is None
    monkeypatch.setattr(_common, "BIND", [True])
    why = T.kernels_in_captures_problem(facts(allocator_backend="cudaMallocAsync", triton_version="3.3.1"))
    assert "triton 3.3.1 launches only through its JIT" in why and "--disable-cuda-malloc" in why
    assert T.kernels_in_captures_problem(facts(allocator_backend="cudaMallocAsync", triton_version="3.4.0")) is None


@pytest.mark.parametrize("sim", [
    dict(system="Windows", torch_version="2.7.0", triton_dist=None, triton_version=None),
    dict(system="Windows", triton_dist="triton-windows", triton_version="3.4.0", has_include=False),
    dict(triton_version="3.1.0"),
])
def test_requested_triton_falls_back_visibly(monkeypatch, sim):
    """On any simulated failure the registry falls back visibly and the story carries the probe's
    sentence (what the report and the node show). Inductor on CUDA compiles through triton too, so
    the fallback is eager, and inductor's line says why."""
    monkeypatch.setattr(T, "gather", lambda: facts(**sim))
    backend, story = resolve("triton", torch.device("cuda"))
    assert backend.name == "eager"
    assert story[0].startswith("triton: ") and "Fix:" in story[0]
    assert T.problem(facts(**sim)) in story[0]
    assert any(s.startswith("inductor: on CUDA it compiles through triton") for s in story), story


def test_this_machine_probe_runs():
    f = T.gather()
    assert isinstance(f.cuda_available, bool)
    msg = T.problem(f)
    assert msg is None or isinstance(msg, str)



def test_triton_that_fails_to_import_falls_back_visibly(monkeypatch):
    """triton's package metadata matches torch but its import raises (a broken install, a missing
    libcuda): the kernels are what import it, so the probe says so, with the fix, and the registry
    falls back to inductor instead of raising (tests/e2e/test_faults_server.py has the CPU side: a
    server whose triton cannot be imported)."""
    import builtins
    import importlib
    import sys

    kernels = importlib.import_module(T.__name__.rsplit(".", 3)[0] + ".kernels")
    monkeypatch.setattr(T, "gather", lambda: facts())
    for name in [m for m in sys.modules if m.startswith(kernels.__name__ + ".")]:   # imported afresh below
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(kernels, name.rsplit(".", 1)[1], raising=False)
    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("libtriton.so: undefined symbol")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_triton)
    backend, story = resolve("triton", torch.device("cuda"))
    assert backend.name == "inductor"
    assert story[0].startswith("triton: triton 3.4.0 is installed but the kernels failed to load")
    assert "libtriton.so: undefined symbol" in story[0] and "Fix: reinstall the triton that matches torch" in story[0]


def test_auto_on_cuda_without_a_working_triton_picks_no_backend_that_would_fail(monkeypatch):
    """Inductor compiles CUDA code through triton too: on the portable build's default (no
    triton-windows) auto must not pick it and fail every region's first compile; it says why."""
    monkeypatch.setattr(T, "gather", lambda: facts(system="Windows", torch_version="2.13.0", triton_dist=None,
                                                   triton_version=None, python_exe="py.exe"))
    backend, story = resolve("auto", torch.device("cuda"))
    assert backend.name == "eager", story
    inductor = next(s for s in story if s.startswith("inductor: "))
    assert "on CUDA it compiles through triton" in inductor and '"py.exe" -m pip install -U "triton-windows' in inductor
    monkeypatch.setattr(T, "gather", lambda: facts())
    assert resolve("inductor", torch.device("cuda"))[0].name == "inductor", "a working triton: inductor runs"


def test_windows_cpu_compiler_is_msvc_on_path(monkeypatch):
    from unet_compiler.compiler.backends import inductor as I
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(I.shutil, "which", lambda name: "/usr/bin/g++" if name == "g++" else None)
    why = I._cpp_compiler_missing("Windows")
    assert why is not None and "cl.exe" in why and "x64 Native Tools Command Prompt" in why.fix, \
        "g++ on PATH does not help: torch builds with cl on Windows"
    monkeypatch.setattr(I.shutil, "which", lambda name: r"C:\VS\cl.exe" if name == "cl" else None)
    assert I._cpp_compiler_missing("Windows") is None
    monkeypatch.setenv("CXX", "clang-cl")
    monkeypatch.setattr(I.shutil, "which", lambda name: r"C:\LLVM\clang-cl.exe" if name == "clang-cl" else None)
    assert I._cpp_compiler_missing("Windows") is None


def test_a_torch_newer_than_the_table_is_accepted_where_a_test_kernel_builds(monkeypatch):
    """Windows, torch newer than the table: its triton-windows is accepted when one tiny kernel builds
    and runs with it (once per process per torch/triton pair), and refused with the build's own
    error line and the install command when it does not."""
    monkeypatch.setattr(T, "_PROBED", {})
    built = []
    ok = facts(system="Windows", torch_version="2.15.0", triton_dist="triton-windows", triton_version="3.9.0",
               extra={"compile_probe": lambda: built.append(1)})
    assert T.problem(ok) is None and T.problem(ok) is None and built == [1]
    assert "(a test kernel built and ran with it)" in T.table_note(ok)

    import subprocess

    def broken():
        raise subprocess.CalledProcessError(2, ["cl", "/nologo"], output="main.c(1): fatal error C1083: Cannot open "
                                                                        "include file: 'Python.h'")
    bad = facts(system="Windows", torch_version="2.15.0", triton_dist="triton-windows", triton_version="3.9.1",
                python_exe=r"C:\p\python.exe", extra={"compile_probe": broken})
    why = T.problem(bad)
    assert why is not None and "could not build a test kernel beside torch 2.15.0" in why.why
    assert "fatal error C1083" in why.why and "/nologo" not in why.why, why
    assert why.fix == r'"C:\p\python.exe" -m pip install -U "triton-windows>=3.8"', why.fix
    # inside the table no kernel is built: the table's pairing decides
    T.problem(facts(system="Windows", torch_version="2.13.0", triton_dist="triton-windows", triton_version="3.7.0",
                    extra={"compile_probe": broken}))
    assert ("2.13.0", "3.7.0") not in T._PROBED
