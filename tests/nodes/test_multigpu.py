"""Compile UNet under ComfyUI's multi-GPU Work Units (the newest ComfyUI's, as ``tests/_multigpu.py``
stands it in over ComfyUI 0.8.0): every device's copy of the model accelerated on its own thread."""
from __future__ import annotations

import pytest
import torch

from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher, warmup as nodes_warmup

from .test_comfy_patcher import _close, _inputs

pytestmark = pytest.mark.comfy
CFG = CompileConfig(backend="inductor")


@pytest.fixture
def multigpu(comfy, monkeypatch):
    from unet_compiler.tests import _multigpu
    _multigpu.install(comfy, monkeypatch)
    yield _multigpu
    comfy.mm.unload_all_models()


def _two_devices(comfy, make_comfy_model, multigpu):
    """A tiny SD1.5 loaded by a loader ComfyUI can run again (``cached_patcher_init``): (patcher, eager
    outputs for the two conds, the sampling inputs)."""
    base = multigpu.make(comfy, make_comfy_model("sd15"), reload=lambda: make_comfy_model("sd15"))
    x, t, ctx, _ = _inputs("sd15", b=1)
    conds = [ctx, ctx.flip(1)]
    with torch.inference_mode():
        to = nodes_warmup.sampling_transformer_options(base)
        want = [base.model.apply_model(x, t, c_crossattn=c, transformer_options=to) for c in conds]
    return base, want, (conds, x, t)


def _per_device(accel) -> list:
    copies = getattr(accel, "copies", None)
    return [accel, *(copies.accelerators() if copies is not None else [])]


@pytest.mark.parametrize("order", ["compile_then_multigpu", "multigpu_then_compile"])
def test_every_devices_copy_runs_its_own_compiled_regions(comfy, make_comfy_model, multigpu, order):
    """Compile UNet and Warmup Shapes (one shape), with MultiGPU Work Units after Warmup Shapes (its
    copy made from the compiled patcher: ComfyUI's deep-clone callback) or before Compile UNet (the
    copy there when Compile UNet runs), then two prompts of two steps: each step's two conds run on
    the two devices' pool threads, under ``torch.no_grad`` only (ComfyUI's) and then under inference
    mode, each through its own copy of the model. Every device's copy runs all its regions compiled
    (its own accelerator, built on the prompt thread; a device's first call at a shape runs alone,
    as it may compile), every output == eager, no call of a copy counted as another model's; the
    report names each device. Warmup Shapes warms every copy there when it runs, on its own device:
    no warmed copy compiles anything while sampling (0 recompiles). (Before: only the first copy
    was accelerated, the other ran its own code, reported as "a separate copy of the model"; with
    both accelerated and no turns, a copy's call while the other compiled failed: torch's FX tracing
    flag is process-wide; Warmup Shapes warmed the first copy only; a no_grad call's inputs, normal
    tensors where warmup had inference tensors, compiled the regions again.)"""
    base, want, (conds, x, t) = _two_devices(comfy, make_comfy_model, multigpu)
    if order == "compile_then_multigpu":
        cm, _ = patcher.compile_model(base, CFG)
        patcher.warmup_model(cm, "1x64x64", 77)
        model = multigpu.create_multigpu_deepclones(cm)
    else:
        cm, _ = patcher.compile_model(multigpu.create_multigpu_deepclones(base), CFG)
        patcher.warmup_model(cm, "1x64x64", 77)
        model = cm
    accel = patcher.accelerator_of(model)
    warmed = [a for a in _per_device(accel) if a.warmed]
    assert [a.device_name for a in warmed] == (["cpu:0"] if order == "compile_then_multigpu" else ["cpu:0", "cpu:1"])
    before = {id(a): a.stats.copy() for a in warmed}
    for grad_mode in (torch.no_grad, torch.inference_mode):   # (ComfyUI's pool: no_grad; a pack's: either)
        with torch.inference_mode():                       # (ComfyUI's executor runs prompts so)
            steps = multigpu.sample(model, conds, x, t, steps=2, grad_mode=grad_mode)
        for outputs in steps:
            for got, w in zip(outputs, want, strict=True):
                _close(got, w)
    devices = _per_device(accel)
    text = accel.text()
    assert [a.device_name for a in devices] == ["cpu:0", "cpu:1"], text
    for a in devices:
        ran, total = a.ran_compiled()
        was = before.get(id(a), {})
        calls = a.stats["calls"] - was.get("calls", 0)
        assert ran == total > 0 and calls == 4 and not a.failed, (a.device_name, a.text())
        if id(a) in before:       # warmed by Warmup Shapes on its own device: sampling compiles nothing
            assert a.stats["graphs_compiled"] == was["graphs_compiled"], (a.device_name, a.text())
            assert a.stats["recompiles_after_warmup"] == 0, (a.device_name, a.text())
    assert accel.stats["eager_calls"] == before[id(accel)]["eager_calls"] and accel.stats["calls_not_ours"] == 0, text
    assert "separate copy" not in text, text
    assert f"cpu:0: compiled {total}/{total}" in text and f"cpu:1: compiled {total}/{total}" in text, text
    print("\n" + text.splitlines()[-1])


def test_each_devices_graphs_are_its_own_and_unloading_one_copy_keeps_the_others(comfy, make_comfy_model,
                                                                                  multigpu, monkeypatch):
    """CUDA graphs on two devices (the production ``CudaGraphs`` over tests/_fake_cuda.py, whose
    current device, streams and captures are each thread's own; the region bodies uncompiled): each
    device's accelerator captures and replays only with its own device current (a copy's warmup on
    the prompt thread too), the two pool threads capture and replay at once, outputs == eager. Then
    ComfyUI unloads the second device's copy (its patcher's ON_DETACH): that copy's graphs are freed,
    the first device's stay and the next prompt replays them. (Before: every copy's patcher carried
    callbacks pointing at the first accelerator, so unloading a copy freed the first GPU's graphs.)"""
    from unet_compiler.compiler import graphs as G  # noqa: N812
    from unet_compiler.compiler import regions as R  # noqa: N812
    from unet_compiler.compiler.graphs import RegionGraphs
    from unet_compiler.tests._fake_cuda import fake_cuda

    class OnDevice(G.CudaGraphs):
        """The production graphs of the accelerator serving device ``index``: its inputs are on that
        device (CPU tensors stand for them), usable only while it is the thread's current device."""

        def __init__(self, index: int):
            super().__init__()
            self.index, self.refused = index, 0

        def usable(self, tensors):
            if torch.cuda.current_device() != self.index:
                self.refused += 1
                return "inputs not on the current CUDA device"
            return None

    base, want, (conds, x, t) = _two_devices(comfy, make_comfy_model, multigpu)
    with fake_cuda(monkeypatch) as cuda:
        monkeypatch.setattr(G, "_SIDE_STREAMS", {})
        # (the stand-in's devices are cpu:0 / cpu:1: made current as CUDA's would be)
        monkeypatch.setattr(patcher, "current_device", lambda device: torch.cuda.device(device.index))
        cm, _ = patcher.compile_model(multigpu.create_multigpu_deepclones(base),
                                      CompileConfig(backend="inductor", prepack_conv=False, prepack_linear=False))
        accel = patcher.accelerator_of(cm)
        devices = _per_device(accel)
        for i, a in enumerate(devices):
            a.graphs = RegionGraphs(graphs=OnDevice(i))
            a._install(R.BODIES)
        patcher.warmup_model(cm, "1x64x64, 1x128x128", 77)   # (a range: the bodies stay uncompiled)
        captured = [a.graphs.stats["captured"] for a in devices]
        replayed = [a.graphs.stats["replays"] for a in devices]
        assert all(n == 2 * len(a._shims) > 0 for a, n in zip(devices, captured, strict=True)), \
            [(a.device_name, dict(a.graphs.stats), dict(a.graphs.skipped)) for a in devices]
        for _ in range(2):
            with torch.inference_mode():
                steps = multigpu.sample(cm, conds, x, t, steps=2)
            for outputs in steps:
                for got, w in zip(outputs, want, strict=True):
                    _close(got, w)
        for a, n, r in zip(devices, captured, replayed, strict=True):   # 4 calls, every region replayed
            assert a.graphs.stats["captured"] == n and a.graphs.stats["replays"] - r == 4 * len(a._shims), \
                (a.device_name, dict(a.graphs.stats), dict(a.graphs.skipped))
            assert a.graphs.graphs.refused == 0 and a.graphs.off is None, (a.device_name, a.graphs.skipped)
        main, copy = devices
        held = main.graphs.bytes
        copy_patcher = cm.get_additional_models_with_key("multigpu")[0]
        copy_patcher.detach(unpatch_all=True)                      # ComfyUI unloads the second GPU's copy
        assert copy.graphs.bytes == 0 and copy.graphs.released == "ComfyUI unloaded the model", copy.text()
        assert main.graphs.bytes == held > 0 and main.graphs.released is None, main.text()
        replays = main.graphs.stats["replays"]
        with torch.inference_mode():
            _close(multigpu.sample(cm, conds[:1], x, t, steps=1)[0][0], want[0])
        assert main.graphs.stats["captured"] == captured[0] and main.graphs.stats["replays"] > replays, main.text()
        assert cuda.aborted is None


def test_a_copy_whose_warmup_fails_is_named_and_the_prompt_goes_on(comfy, make_comfy_model, multigpu, monkeypatch):
    """Warmup Shapes on a model with a copy on a second device whose warmup raises (a failure of that
    card's; out of memory propagates, as from any warmup): the report names the device and the error
    and says the copy compiles at its first step; the model's own warmup and status stand, and
    sampling still runs both copies == eager."""
    from unet_compiler.compiler import regions

    base, want, (conds, x, t) = _two_devices(comfy, make_comfy_model, multigpu)
    cm, _ = patcher.compile_model(multigpu.create_multigpu_deepclones(base),
                                  CompileConfig(backend="inductor", prepack_conv=False, prepack_linear=False))
    accel = patcher.accelerator_of(cm)
    for a in _per_device(accel):
        a._install(regions.BODIES)                  # (the regions' own bodies: nothing to compile here)
    prepare = nodes_warmup.prepare

    def failing(model, here, *a):
        if here is not accel:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return prepare(model, here, *a)
    monkeypatch.setattr(nodes_warmup, "prepare", failing)
    text = patcher.warmup_model(cm, "1x64x64, 1x128x128", 77)
    assert "warmup of the copy on cpu:1 stopped (RuntimeError: CUDA error: unspecified launch failure)" in text, text
    assert "it compiles at its first step instead" in text and "status: inductor: compiled" in text, text
    with torch.inference_mode():
        for outputs in multigpu.sample(cm, conds, x, t, steps=1):
            for got, w in zip(outputs, want, strict=True):
                _close(got, w)
