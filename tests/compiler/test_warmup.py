"""compiler/warmup.py: the step it tells before each call, and its measured choice: with backend
``auto`` on CUDA (the default), warmup times a forward with every region kind compiled against each
kind on the model's own code, and a kind whose own code is faster runs it from now on, said in the
report; a backend chosen by name runs as asked.
The region bodies run uncompiled here (the measurement is under test, not inductor) and one kind is
slowed by a sleep, so the timing's verdict is certain on a shared CPU."""
from __future__ import annotations

import importlib
import time

import pytest
import torch

from unet_compiler.compiler import api
from unet_compiler.compiler.backends import inductor
from unet_compiler.compiler.reasons import Slower
from unet_compiler.compiler.report import warmup_facts
from unet_compiler.compiler.runtime import Accelerator
from unet_compiler.compiler.shapes import as_shapes

W = importlib.import_module("unet_compiler.compiler.warmup")   # (the package's ``warmup`` is api.warmup)


@pytest.fixture
def slowed(monkeypatch):
    """Region bodies as written (no compile), the resblock regions' compiled path 20 ms a call slower,
    and warmup measuring on this CPU as it does on CUDA."""
    monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)
    run = Accelerator._run_here

    def slow(self, kind, *a):
        if kind == "resblock":
            time.sleep(0.02)
        return run(self, kind, *a)
    monkeypatch.setattr(Accelerator, "_run_here", slow)
    monkeypatch.setattr(W, "measures_kinds", lambda accel: accel.config.backend == "auto")


def _forward(unet, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, ctx = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 6, 32, generator=g)
    with torch.inference_mode():
        return unet(x, torch.tensor([10.0]), ctx).sample


def test_auto_runs_a_kind_measured_slower_on_the_models_own_code(tiny_unet, slowed):
    unet = tiny_unet()
    api.compile_unet(unet, "auto")
    text = api.warmup(unet, "1x64x64", context_tokens=6)
    accel = api.accelerator_of(unet)
    why = accel.failed.get("resblock")
    assert isinstance(why, Slower) and "measured faster on the model's own code at 1x64x64" in why, accel.failed
    assert "resblock regions: measured faster" in text, text
    facts = warmup_facts(accel.report, accel.backend.name, accel.failed, accel.ran_compiled(), accel.cast_eager)
    assert facts["state"] == "compiled", facts          # a choice, not a fallback
    ran = accel.stats["ran_resblock"]
    out = _forward(unet)
    with accel.bypass():
        ref = _forward(unet)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert accel.stats["ran_resblock"] == ran, "resblock regions run the model's own code now"
    assert sum(v for k, v in accel.stats.items() if k.startswith("ran_") and k != "ran_resblock"), accel.stats


def test_a_backend_chosen_by_name_is_not_second_guessed(tiny_unet, slowed):
    unet = tiny_unet()
    api.compile_unet(unet, "inductor")
    api.warmup(unet, "1x64x64", context_tokens=6)
    assert not api.accelerator_of(unet).failed


def test_warmup_measures_kinds_only_for_auto_on_cuda(tiny_unet):
    unet = tiny_unet()
    api.compile_unet(unet, "auto")
    accel = api.accelerator_of(unet)
    assert not W.measures_kinds(accel)            # a CPU: too noisy and too dear per kind
    accel.device_type = "cuda"
    assert W.measures_kinds(accel)
    accel.config = accel.config.replace(backend="inductor")
    assert not W.measures_kinds(accel)


def _as_planned(steps: list) -> list:
    """The steps warmup told, auto's repeated timing calls as the one step a plan lists."""
    out = []
    for s in steps:
        if not (out and s.kind == "measure" and out[-1] == s):
            out.append(s)
    return out


def test_warmup_tells_each_call_as_a_step_before_it_runs(tiny_unet, slowed, monkeypatch):
    """Warmup tells every UNet call it makes as a Step on the accelerator's events (what Warmup
    Shapes' node text shows), the calls its plan listed before the first ran: a one-shape warmup
    compiles that shape exactly and tells no probe; a range tells its probes, numbered, then each
    listed shape; the reference, and auto's timing of each kind, are told as such."""
    steps, plans = [], []
    planned = W.plan_warmup
    monkeypatch.setattr(W, "plan_warmup", lambda *a, **k: plans.append(planned(*a, **k)) or plans[-1])
    unet = tiny_unet()
    api.compile_unet(unet, "auto")
    api.accelerator_of(unet).events.subscribe("warmup_step", steps.append)
    api.warmup(unet, "1x64x64", context_tokens=6)
    kinds = [s.kind for s in steps]
    assert kinds[:2] == ["reference", "shape"] and "probe" not in kinds and set(kinds[2:]) == {"measure"}, kinds
    assert (steps[1].index, steps[1].of) == (0, 1) and {s.shape.label for s in steps} == {"1x64x64"}
    assert plans[-1].fixed and _as_planned(steps) == plans[-1].steps(), (steps, plans[-1].steps())
    assert steps[1].text == "shape 1/1, 1x64x64: compiling"
    steps.clear()
    unet = tiny_unet()
    api.compile_unet(unet, "inductor")
    api.accelerator_of(unet).events.subscribe("warmup_step", steps.append)
    api.warmup(unet, "1x64x64, 2x96x96", context_tokens=6)
    probes = [s for s in steps if s.kind == "probe"]
    assert probes and [(s.index, s.of) for s in probes] == [(k, len(probes)) for k in range(len(probes))], steps
    listed = [(s.shape.label, s.index, s.of) for s in steps if s.kind == "shape"]
    assert listed == [("1x64x64", 0, 2), ("2x96x96", 1, 2)], steps
    assert [s.kind for s in steps].index("probe") < [s.kind for s in steps].index("shape")
    assert not plans[-1].fixed and _as_planned(steps) == plans[-1].steps(), (steps, plans[-1].steps())
    assert [s.text for s in steps if s.kind == "shape"] == ["shape 1/2, 1x64x64: running",
                                                            "shape 2/2, 2x96x96: running"]


def test_warmup_tells_how_it_ended(tiny_unet, slowed):
    """Warmup tells its outcome once (``warmup_done``: what Warmup Shapes' end status renders): the
    state, the regions that ran compiled code and the compare, in words; a warmup whose call raised
    tells it too before the error goes on; ComfyUI's cancel is told nothing (it ends the prompt)."""
    unet = tiny_unet()
    api.compile_unet(unet, "inductor")
    accel = api.accelerator_of(unet)
    ended = []
    accel.events.subscribe("warmup_done", ended.append)
    api.warmup(unet, "1x64x64", context_tokens=6)
    (done,) = ended
    assert isinstance(done, W.Outcome) and (done.backend, done.state, done.shapes) == ("inductor", "compiled", 1)
    assert done.ran == done.regions > 0 and done.max_abs_diff is not None and done.seconds > 0, done
    assert done.text.startswith(f"inductor: compiled, {done.ran} of {done.regions} regions ran compiled code, "
                                "1 shape(s) in "), done.text

    def broken(shape):
        raise RuntimeError("this model cannot be called outside sampling")
    ended.clear()
    with pytest.raises(RuntimeError, match="outside sampling"):
        W.warmup_runs(accel, as_shapes("2x64x64"), broken, compare=False)
    assert len(ended) == 1 and ended[0].shapes == 1 and ended[0].state == "compiled", ended

    class InterruptProcessingException(Exception):   # (ComfyUI's cancel, by its name)
        pass

    def cancelled(shape):
        raise InterruptProcessingException()
    ended.clear()
    with pytest.raises(InterruptProcessingException):
        W.warmup_runs(accel, as_shapes("2x64x64"), cancelled, compare=False)
    assert ended == []
