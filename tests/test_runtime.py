"""compiler/runtime.py: what a region does when its accelerated code raises.

Two causes look alike from inside a region and must be told apart: the backend failing where the
model's own code runs (fall back, turn that region kind off, say so) and the model's own code
raising on these inputs (ComfyUI would raise the same error: let it through untouched, turn
nothing off)."""
from __future__ import annotations

import pytest
import torch

from unet_compiler.compiler import api
from unet_compiler.compiler.backends import lookup_backend


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, 8, 8, generator=g), torch.tensor([10.0]), torch.randn(1, 6, 32, generator=g)


@pytest.fixture
def failing_resblocks(monkeypatch):
    """The inductor backend with a resblock body that raises, counting its calls."""
    calls = []

    def impl(block, *args):
        calls.append(type(block).__name__)
        raise RuntimeError("backend: cannot lower this")
    monkeypatch.setattr(lookup_backend("inductor"), "impls",
                        lambda self, config: {("diffusers", "resblock"): impl})
    return calls


def test_backend_failure_falls_back_once_and_turns_the_kind_off(tiny_unet, failing_resblocks):
    unet = tiny_unet()
    x, t, ctx = _inputs()
    with torch.no_grad():
        ref = unet(x, t, ctx).sample
    api.compile_unet(unet, "inductor")
    accel = api.accelerator_of(unet)
    told = []
    accel.on_fallback = lambda kind, why: told.append((kind, why))
    with torch.no_grad():
        out = unet(x, t, ctx).sample
        assert torch.equal(out, ref), "the failed region must answer with the model's own code"
        n = len(failing_resblocks)
        assert n == 1, "the kind is turned off at the first failure"
        assert torch.equal(unet(x, t, ctx).sample, ref)
    assert len(failing_resblocks) == n, "a turned-off kind is not tried again"
    assert set(accel.failed) == {"resblock"} and "cannot lower this" in accel.failed["resblock"]
    assert told == [("resblock", accel.failed["resblock"])]
    assert any("inductor failed on resblock regions" in note for note in accel.report.notes)
    assert accel.stats["region_eager"] > 0


def test_the_models_own_error_propagates_untouched(tiny_unet, failing_resblocks, monkeypatch):
    from diffusers.models.resnet import ResnetBlock2D

    def model_raises(self, *a, **k):
        raise ValueError("Expected more than 1 spatial element when training")
    monkeypatch.setattr(ResnetBlock2D, "forward", model_raises)
    unet = tiny_unet()
    x, t, ctx = _inputs()
    with pytest.raises(ValueError) as plain:
        unet(x, t, ctx)
    api.compile_unet(unet, "inductor")
    accel = api.accelerator_of(unet)
    with torch.no_grad(), pytest.raises(ValueError) as compiled:
        unet(x, t, ctx)
    assert str(compiled.value) == str(plain.value)
    assert compiled.value.__cause__ is None and compiled.value.__context__ is None, \
        "nothing of the pack's (the backend's error, dynamo's trace) may be chained to the model's error"
    assert failing_resblocks, "the accelerated body was tried first"
    assert accel.failed == {} and not any("failed on" in n for n in accel.report.notes), \
        "the model's error is not the backend's: no region kind is turned off"


def test_interrupt_is_not_a_fallback(tiny_unet, monkeypatch):
    """ComfyUI's cancel raised inside a region propagates as is; nothing is turned off."""
    class InterruptProcessingException(Exception):
        pass

    def impl(block, *args):
        raise InterruptProcessingException()
    monkeypatch.setattr(lookup_backend("inductor"), "impls",
                        lambda self, config: {("diffusers", "resblock"): impl})
    unet = api.compile_unet(tiny_unet(), "inductor")
    with torch.no_grad(), pytest.raises(InterruptProcessingException):
        unet(*_inputs())
    assert api.accelerator_of(unet).failed == {}
