"""kernels/_common.py and the package: what every launcher relies on (import without triton,
the 32-bit offset margin, the TF32 choice, autograd refusal, the block-config fallback).

See tests/kernels/_helpers.py for the device, dtypes and tolerances."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.tests.kernels._helpers import DEV, TOL, KernelUnsupported, _common, close, load, rand, triton

groupnorm = load("groupnorm")
layernorm = load("layernorm")
epilogue = load("epilogue")


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
    x = rand(1, 64, 2, 2)
    with pytest.raises(KernelUnsupported, match="forward-only"):
        groupnorm.groupnorm(x, 32, w)
    with torch.no_grad():
        close(groupnorm.groupnorm(x, 32, w), F.group_norm(x, 32), TOL[torch.float32])


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


def test_each_launcher_checks_a_signature_once(monkeypatch):
    """groupnorm, bias_residual, geglu and attention run their checks and launch arithmetic once
    per input signature (kernels/_common.Plans): the next call with the same shapes, strides, dtypes
    and grad state skips them and gives the same result; a new layout, a tensor that now needs
    grad, or torch's TF32 switch turned makes a new plan (and its checks raise where they must)."""
    attention, geglu = load("attention"), load("geglu")
    calls = []
    real = _common.check_tensor

    def counted(*a, **k):
        calls.append(a[1])
        return real(*a, **k)
    for mod in (groupnorm, epilogue, geglu, attention):
        monkeypatch.setattr(mod, "check_tensor", counted)
        monkeypatch.setattr(mod, "_PLANS", _common.Plans())
    # planning, not the fp32 choice, is under test: on a GPU fp32 attention is declined (SDPA runs it)
    monkeypatch.setattr(attention, "fp32_declined", lambda *a: False)
    x, w = rand(2, 64, 4, 4), rand(64)
    h, q = rand(2, 16, 64), rand(2, 2, 16, 32)
    cases = [(groupnorm, lambda t: groupnorm.groupnorm(t, 32, w, w, 1e-5, silu=True), x),
             (epilogue, lambda t: epilogue.bias_residual(t, w, t, dim=1), x),
             (geglu, lambda t: geglu.geglu(t), h),
             (attention, lambda t: attention.attention(t, t, t), q)]
    with torch.no_grad():
        for mod, fn, t in cases:
            calls.clear()
            first = fn(t)
            n = len(calls)
            assert n > 0 and len(mod._PLANS) == 1
            torch.testing.assert_close(fn(t.clone()), first, rtol=0, atol=0)
            assert len(calls) == n, f"{mod.__name__}: checks ran again at a signature met before"
            if t.dim() == 4:
                fn(t.contiguous(memory_format=torch.channels_last) if mod is not attention else t.transpose(1, 2))
                assert len(calls) > n and len(mod._PLANS) == 2
    grad_x = x.clone().requires_grad_()
    with pytest.raises(KernelUnsupported, match="forward-only"):   # same shape, now needs grad: checked again
        groupnorm.groupnorm(grad_x, 32, w, w, 1e-5, silu=True)
    with torch.no_grad():
        n = len(attention._PLANS)
        monkeypatch.setattr(_common, "tf32_matmuls_allowed", lambda: True)
        attention.attention(q, q, q)
        assert len(attention._PLANS) == n + 1
        assert {p[3][4]["PREC"] for p in attention._PLANS.values() if p[3] is not None} == {"ieee", "tf32"}


def _fake_cuda(monkeypatch, allocator="cudaMallocAsync"):
    if CUDA_HERE:
        pytest.skip("the fake CUDA runs the kernels under the Triton interpreter (a machine without a GPU); "
                    "on a GPU the allocator probe (bench gpu) launches them for real")
    from unet_compiler.tests._fake_cuda import fake_cuda
    monkeypatch.setattr(_common, "_BIND_CHECKED", [None])   # checked (below, on its own)
    return fake_cuda(monkeypatch, allocator=allocator)


CUDA_HERE = torch.cuda.is_available()


def test_a_planned_launch_goes_direct_and_is_captured_under_cudamallocasync(monkeypatch):
    """kernels/_common.Launch under the fake CUDA (tests/_fake_cuda.py, whose JIT launch returns a
    compiled kernel as triton's does on a GPU): the first call at a signature launches through the JIT,
    later calls launch the compiled kernel with integer pointers. Inside a capture under
    cudaMallocAsync, where a JIT launch given the capture's own memory is refused and the process
    aborts, groupnorm's three launches and bias_residual's are captured, nothing aborts, and a replay
    after the inputs changed == the reference on the new inputs."""
    groupnorm = load("groupnorm")
    x, w, b = rand(2, 64, 4, 4, seed=1), rand(64, seed=2), rand(64, seed=3)
    with _fake_cuda(monkeypatch) as cuda, torch.inference_mode():
        close(groupnorm.groupnorm(x, 32, w, b, silu=True), groupnorm.groupnorm_reference(x, 32, w, b, silu=True),
              TOL[torch.float32])
        assert cuda.jit_launches == 3
        y = epilogue.bias_residual(x, w.clone(), x)      # planned and bound outside the capture
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        h = groupnorm.groupnorm(x, 32, w, b, silu=True)  # scratch and output: the capture's own memory
        y = epilogue.bias_residual(h, w, h.clone())
        graph.capture_end()
        assert cuda.aborted is None and cuda.jit_launches == 4 and cuda.log["kernel_captured"] == 4
        x.copy_(rand(2, 64, 4, 4, seed=4))
        graph.replay()
        want = groupnorm.groupnorm_reference(x, 32, w, b, silu=True)
        close(y, epilogue.bias_residual_reference(want, w, want), TOL[torch.float32])
        assert cuda.log["kernel_replayed"] == 4 and cuda.jit_launches == 4


def test_a_launch_the_compiled_kernel_cannot_take_goes_through_the_jit(monkeypatch):
    """A pointer that breaks the 16-byte alignment the compiled kernel was specialised for, or a
    launch hook (a profiler's) registered with triton: the call goes through the JIT, which
    specialises again or calls the hooks. Inside a capture such a call launches nothing and raises
    NotBound (a JIT launch there may abort the process); a signature never launched before does too,
    attention's first launch (the config that fits the GPU is found through the JIT) included."""
    import triton
    attention = load("attention")
    x = rand(4 * 64 + 1, seed=5)
    with _fake_cuda(monkeypatch) as cuda, torch.inference_mode():
        epilogue.bias_residual(x[:-1].view(4, 64), residual=x[:-1].view(4, 64), dim=1)   # aligned: binds
        n = cuda.jit_launches
        shifted = x[1:].view(4, 64)                                            # 4 bytes off: not aligned
        close(epilogue.bias_residual(shifted, residual=shifted, dim=1), 2 * shifted, TOL[torch.float32])
        assert cuda.jit_launches == n + 1
        epilogue.bias_residual(x[:-1].view(4, 64), residual=x[:-1].view(4, 64), dim=1)
        assert cuda.jit_launches == n + 1                                      # aligned again: direct
        hook = triton.knobs.runtime.launch_enter_hook

        def seen(metadata):
            pass
        if hasattr(hook, "add"):
            hook.add(seen)
            try:
                epilogue.bias_residual(x[:-1].view(4, 64), residual=x[:-1].view(4, 64), dim=1)
            finally:
                hook.remove(seen)
            assert cuda.jit_launches == n + 2
        n, new, q = cuda.jit_launches, rand(3, 32, seed=6), rand(1, 2, 16, 16, seed=7).half()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin()
        try:
            with pytest.raises(_common.NotBound):
                epilogue.bias_residual(shifted, residual=shifted, dim=1)
            with pytest.raises(_common.NotBound):
                epilogue.bias_residual(new, dim=1)                               # never planned
            with pytest.raises(_common.NotBound):
                attention.attention(q, q, q)                                     # never planned either
        finally:
            graph.capture_end()
        assert cuda.jit_launches == n and cuda.aborted is None and cuda.log["kernel_captured"] == 0


def test_direct_launches_are_checked_once_and_turned_off_when_wrong(monkeypatch):
    """The first compiled kernel bound in a process is checked (kernels/_launch_check.py: a small
    kernel launched through the JIT and directly must agree); a triton whose launcher computes
    something else turns direct launches off for the process, every launch then goes through the
    JIT, and the reason is kept for the report."""
    from unet_compiler.compiler.compat import triton as triton_compat
    from unet_compiler.tests._fake_cuda import Compiled
    monkeypatch.setattr(_common, "BIND", [True])
    with _fake_cuda(monkeypatch):
        monkeypatch.setattr(_common, "_BIND_CHECKED", [])
        assert _common.bound_launch_problem(DEV) is None and _common.BIND[0]
    monkeypatch.setattr(Compiled, "run", lambda self, *a: None)   # launches nothing
    x = rand(4, 64, seed=7)
    with _fake_cuda(monkeypatch) as cuda, torch.inference_mode():
        monkeypatch.setattr(_common, "_BIND_CHECKED", [])
        for _ in range(3):
            close(epilogue.bias_residual(x, residual=x, dim=1), 2 * x, TOL[torch.float32])
        assert not _common.BIND[0] and "different result" in _common._BIND_CHECKED[0]
        assert cuda.jit_launches == 3 + 1   # the check's own JIT launch, then the kernel's three
        why = triton_compat.kernels_in_captures_problem(triton_compat.Facts(allocator_backend="cudaMallocAsync"))
        assert "different result" in why and "--disable-cuda-malloc" in why


def test_a_thread_asking_while_the_launch_check_runs_waits_for_its_answer(monkeypatch):
    """The direct-launch check runs once per process; a second thread asking while it runs (a device's
    pool thread binding its first kernel) waits for the check's answer instead of taking the
    placeholder the check's own launches bind with, so it never launches directly through a launcher
    the check is about to turn off."""
    import threading

    from unet_compiler.kernels import _launch_check
    started, go = threading.Event(), threading.Event()

    def slow_check(device, launch):
        started.set()
        go.wait(10)
        return "the launcher computed a different result"
    monkeypatch.setattr(_launch_check, "run", slow_check)
    monkeypatch.setattr(_common, "_BIND_CHECKED", [])
    monkeypatch.setattr(_common, "BIND", [True])
    answers = {}

    def ask(name):
        answers[name] = _common.bound_launch_problem(DEV)
    first = threading.Thread(target=ask, args=("first",))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    second.join(0.3)
    assert "second" not in answers, "a thread took the check's placeholder while the check ran"
    go.set()
    first.join(10)
    second.join(10)
    assert answers == {"first": "the launcher computed a different result",
                       "second": "the launcher computed a different result"} and not _common.BIND[0]


def test_a_kernel_is_bound_only_for_the_current_device(monkeypatch):
    """triton's JIT compiles and loads a kernel for the current device: a first launch whose tensors
    are on another GPU is not bound (later calls go through the JIT as before), one on the current
    device is."""
    from types import SimpleNamespace

    class OnDevice:   # a tensor's address on cuda:<index> (this machine has no GPU)
        def __init__(self, index):
            self.device, self.t = torch.device("cuda", index), torch.empty(4)

        def data_ptr(self):
            return self.t.data_ptr()
    kernel = SimpleNamespace(arg_names=["x"], __name__="k")
    compiled = SimpleNamespace(run=lambda *a: None, function=0, packed_metadata=0)
    with _fake_cuda(monkeypatch):
        torch.cuda.set_device(0)
        other, here = _common.Launch(kernel, (1,)), _common.Launch(kernel, (1,))
        other.bind(compiled, (OnDevice(1),))
        here.bind(compiled, (OnDevice(0),))
        assert other.compiled is None and here.compiled is compiled and here.device == 0


def test_a_triton_newer_than_the_launchers_read_launches_through_its_jit(monkeypatch):
    """Direct launches pass the arguments triton 3.4-3.9's launchers take; a newer triton's may differ,
    and there a wrong argument count reads past the end (a crash, not an error): direct launches are
    off without running a kernel, and the reason names the version."""
    from unet_compiler.kernels import _launch_check
    ran = []
    monkeypatch.setattr(_launch_check, "run", lambda device, launch: ran.append(1))
    monkeypatch.setattr(_common, "_BIND_CHECKED", [])
    monkeypatch.setattr(_common, "BIND", [True])
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    why = _common.bound_launch_problem(DEV)
    assert "triton 3.10.0" in why and not _common.BIND[0] and not ran
    monkeypatch.setattr(_common, "_BIND_CHECKED", [])
    monkeypatch.setattr(_common, "BIND", [True])
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    assert _common.bound_launch_problem(DEV) is None and _common.BIND[0] and ran
