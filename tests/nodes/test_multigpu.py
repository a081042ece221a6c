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
    """Compile UNet and Warmup Shapes (one shape), with MultiGPU Work Units after Compile UNet (its
    copy made from the compiled patcher: ComfyUI's deep-clone callback) or before it (the copy there
    when Compile UNet runs), then two prompts of two steps: each step's two conds run on the two
    devices' pool threads under ``torch.no_grad`` only, each through its own copy of the model.
    Every device's copy runs all its regions compiled (its own accelerator, built on the prompt
    thread; a device's first call at a shape runs alone, as it may compile), every output == eager,
    no call of a copy counted as another model's; the report names each device. (Before: only the
    first copy was accelerated, the other ran its own code, reported as "a separate copy of the
    model"; with both accelerated and no turns, a copy's call while the other compiled failed:
    torch's FX tracing flag is process-wide.)"""
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
    before = accel.stats.copy()
    for _ in range(2):
        with torch.inference_mode():                       # (ComfyUI's executor runs prompts so)
            steps = multigpu.sample(model, conds, x, t, steps=2)
        for outputs in steps:
            for got, w in zip(outputs, want, strict=True):
                _close(got, w)
    devices = _per_device(accel)
    text = accel.text()
    assert [a.device_name for a in devices] == ["cpu:0", "cpu:1"], text
    for a in devices:
        ran, total = a.ran_compiled()
        calls = a.stats["calls"] - (before["calls"] if a is accel else 0)
        assert ran == total > 0 and calls == 4 and not a.failed, (a.device_name, a.text())
    assert accel.stats["eager_calls"] == before["eager_calls"] and accel.stats["calls_not_ours"] == 0, text
    assert "separate copy" not in text, text
    assert f"cpu:0: compiled {total}/{total}" in text and f"cpu:1: compiled {total}/{total}" in text, text
    print("\n" + text.splitlines()[-1])
