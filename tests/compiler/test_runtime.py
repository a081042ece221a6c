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
from unet_compiler.compiler.lifecycle.scheduler import process_scheduler
from unet_compiler.tests._written import written_as


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
                        lambda self, config, scheduler: {("diffusers", "resblock"): impl})
    return calls


def test_backend_failure_falls_back_once_and_turns_the_kind_off(tiny_unet, failing_resblocks):
    unet = tiny_unet()
    x, t, ctx = _inputs()
    with torch.no_grad():
        ref = unet(x, t, ctx).sample
    api.compile_unet(unet, "inductor")
    accel = api.accelerator_of(unet)
    told = []
    accel.events.subscribe("fallback", lambda kind, why: told.append((kind, why)))
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


def test_a_compile_error_names_the_compilers_own_error(tiny_unet, monkeypatch):
    """dynamo's BackendCompilerFailed says ``backend='...' raised:`` on its first line and the
    compiler's error on the next: the report keeps both (it once kept only ``raised:``)."""
    def failing_compiler(gm, example_inputs):
        raise RuntimeError("g++ exited with status 1")
    body = torch.compile(lambda x: x * 2, backend=failing_compiler)

    def impl(block, *args):
        return body(args[0])
    monkeypatch.setattr(lookup_backend("inductor"), "impls",
                        lambda self, config, scheduler: {("diffusers", "resblock"): impl})
    unet = api.compile_unet(tiny_unet(), "inductor")
    with torch.no_grad():
        unet(*_inputs())
    why = api.accelerator_of(unet).failed["resblock"]
    assert why.startswith("BackendCompilerFailed: backend='failing_compiler' raised:"), why
    assert "RuntimeError: g++ exited with status 1" in why, why


def test_the_models_own_error_propagates_untouched(tiny_unet, failing_resblocks, monkeypatch):
    from diffusers.models.resnet import ResnetBlock2D

    def model_raises(self, *a, **k):
        raise ValueError("Expected more than 1 spatial element when training")
    monkeypatch.setattr(ResnetBlock2D, "forward", written_as(model_raises, ResnetBlock2D, "forward"))
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
                        lambda self, config, scheduler: {("diffusers", "resblock"): impl})
    unet = api.compile_unet(tiny_unet(), "inductor")
    with torch.no_grad(), pytest.raises(InterruptProcessingException):
        unet(*_inputs())
    assert api.accelerator_of(unet).failed == {}


def test_out_of_memory_in_a_region_falls_back_after_freeing_the_attempt(tiny_unet, monkeypatch):
    """The accelerated code runs out of memory: the model's own code runs instead (it may fit, and
    ComfyUI's attention splits itself on OOM), what the failed attempt allocated is let go before
    the model's code runs, and the kind stays accelerated: a transient OOM (a hires pass on a small
    card) costs those calls, not the rest of the session. The report says what happened, once."""
    import weakref

    from diffusers.models.resnet import ResnetBlock2D
    held = []

    def impl(block, *args):
        workspace = torch.empty(1024, 1024)   # the attempt's allocation, alive in this frame
        held.append(weakref.ref(workspace))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(lookup_backend("inductor"), "impls",
                        lambda self, config, scheduler: {("diffusers", "resblock"): impl})
    original = ResnetBlock2D.forward
    alive_when_eager_ran = []

    def forward(self, *a, **k):
        alive_when_eager_ran.extend(r() is not None for r in held)
        return original(self, *a, **k)
    monkeypatch.setattr(ResnetBlock2D, "forward", written_as(forward, ResnetBlock2D, "forward"))
    unet = tiny_unet()
    x, t, ctx = _inputs()
    with torch.no_grad():
        ref = unet(x, t, ctx).sample
    alive_when_eager_ran.clear()
    api.compile_unet(unet, "inductor")
    accel = api.accelerator_of(unet)
    with torch.no_grad():
        assert torch.equal(unet(x, t, ctx).sample, ref)
    assert held and alive_when_eager_ran and not any(alive_when_eager_ran), \
        "the failed attempt's tensors must be freed before the model's own code runs"
    assert accel.failed == {} and accel.stats["oom_calls_eager"] == accel.stats["oom_resblock"] > 0
    assert sum("out of memory in resblock" in n for n in accel.report.notes) == 1, accel.report.notes
    calls = len(held)
    with torch.no_grad():
        assert torch.equal(unet(x, t, ctx).sample, ref)
    assert len(held) > calls, "the next call tried the accelerated code again"
    assert "oom calls on the model's own code:" in accel.text()


def test_out_of_memory_in_the_models_own_code_propagates(tiny_unet, failing_resblocks, monkeypatch):
    """Out of memory in the model's own code too: ComfyUI's error (it unloads models and says so),
    nothing turned off."""
    from diffusers.models.resnet import ResnetBlock2D

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(ResnetBlock2D, "forward", written_as(oom, ResnetBlock2D, "forward"))
    unet = api.compile_unet(tiny_unet(), "inductor")
    with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
        unet(*_inputs())
    assert api.accelerator_of(unet).failed == {}


# ---- compiles after warmup: counted per prompt, named by shape and guard -------------------
def test_a_recompile_names_its_prompt_shape_and_guard(tiny_unet, monkeypatch):
    """Warm 1x64x64 with static shapes, then run batch 2: the compile is counted against the
    running prompt, and the report, the log and the listener name the shape (outside the warmed
    range) and the failed guard in plain words. Region bodies traced by dynamo's eager backend:
    the guards are dynamo's own, without inductor's compile time."""
    from unet_compiler.compiler import regions as R
    from unet_compiler.compiler.compat import comfy as comfy_compat

    monkeypatch.setattr(lookup_backend("inductor"), "impls", lambda self, config, scheduler: {
        key: torch.compile(body, backend="eager", dynamic=False) for key, body in R.BODIES.items()})
    monkeypatch.setattr(comfy_compat, "current_prompt", lambda: "prompt-7")
    unet = api.compile_unet(tiny_unet(), "inductor", dynamic_shapes=False)
    accel = api.accelerator_of(unet)
    told = []
    accel.events.subscribe("recompile", told.append)
    api.warmup(unet, "1x64x64", context_tokens=6)
    assert accel.warmed_shapes == ["1x64x64"] and accel.stats["recompiles_after_warmup"] == 0
    with torch.no_grad():
        unet(*_inputs())                                         # warmed: nothing compiles
        assert accel.recompiles.events == [] and told == []
        x, t, ctx = _inputs()
        unet(x.repeat(2, 1, 1, 1), t, ctx.repeat(2, 1, 1))       # batch 2: compiles
    graphs = accel.stats["recompiles_after_warmup"]
    assert graphs > 0 and accel.recompiles.by_prompt == {"prompt-7": graphs}
    (event,) = accel.recompiles.events
    assert told == [event] and event["prompt"] == "prompt-7" and event["shape"] == "2x64x64"
    assert event["graphs"] == graphs
    assert any("batch (dim 0) is 2, the code was compiled for exactly 1" in g for g in event["guards"]), event
    assert len(event["guards"]) == len(set(event["guards"])) <= 3
    text = accel.text()
    assert "recompile: prompt prompt-7: " in text and "for a 2x64x64 call (outside the warmed range)" in text, text
    assert "warmed shapes: 1x64x64" in text and "Fix: add 2x64x64 to Warmup Shapes" in text, text


def test_warmup_run_again_counts_no_recompiles(tiny_unet, monkeypatch):
    """Warmup Shapes run again on the same compiled model (its shapes edited: ComfyUI keeps Compile
    UNet's output) compiles as a warmup: nothing counted or named as a recompile after warmup, the
    first warmup's one-shape note goes once a range is warmed, and later calls count again."""
    from unet_compiler.compiler import regions as R
    monkeypatch.setattr(lookup_backend("inductor"), "impls", lambda self, config, scheduler: {
        key: torch.compile(body, backend="eager", dynamic=False) for key, body in R.BODIES.items()})
    unet = api.compile_unet(tiny_unet(), "inductor")
    accel = api.accelerator_of(unet)
    api.warmup(unet, "1x64x64", context_tokens=6)
    assert accel.config.dynamic_shapes is None and any(n.startswith("one warmup shape") for n in accel.report.notes)
    text = api.warmup(unet, "1x64x64, 2x128x128", context_tokens=6)
    assert accel.stats["recompiles_after_warmup"] == 0 and accel.recompiles.events == [], text
    assert "recompile:" not in text and "one warmup shape" not in text, text
    assert accel.warmed and accel.warmed_shapes == ["1x64x64", "2x128x128"]
    x, t, ctx = _inputs()
    with torch.inference_mode():
        unet(x.repeat(3, 1, 1, 1), t, ctx.repeat(3, 1, 1))      # batch 3: compiles after warmup
    assert accel.stats["recompiles_after_warmup"] > 0 and len(accel.recompiles.events) == 1


def test_guards_in_plain_words():
    from unet_compiler.compiler.compat.dynamo import plain_guard
    assert plain_guard("0/1: tensor 'L['hidden_states']' size mismatch at index 0. expected 1, actual 2") == (
        "region input hidden_states: batch (dim 0) is 2, the code was compiled for exactly 1")
    assert plain_guard("3/2: tensor 'L['x']' dtype mismatch. expected Float, actual Half") == (
        "region input x: dtype Half, compiled for Float")
    sym = plain_guard("1/4: L['hidden_states'].size()[2] <= 16")
    assert sym.startswith("region input hidden_states: height (dim 2) outside the range the code was compiled for")
    assert "L['hidden_states'].size()[2] <= 16" in sym
    # torch >= 2.9 names locals bare and appends the source line: kept out of the text
    bare = plain_guard("2 <= input_tensor.size()[0] <= 15  # return F.silu(input, inplace=self.inplace)")
    assert bare == ("region input input_tensor: batch (dim 0) outside the range the code was compiled for "
                    "(guard: 2 <= input_tensor.size()[0] <= 15)")
    assert plain_guard("0/0: ___check_obj_id(L['self'], 1403)").startswith("an object the code depends on")
    assert plain_guard("2/1: something new " + "y" * 300).startswith("guard: something new y")
    assert len(plain_guard("2/1: " + "z" * 300)) < 200
    # a weight ComfyUI's patching replaced: named first, whatever shape guards other entries failed
    from unet_compiler.compiler.compat.dynamo import rank
    flag = ("0/1: tensor 'block._modules['in_layers']._modules['2']._parameters['weight']' requires_grad mismatch. "
            "expected requires_grad=1. Guard failed on a parameter")
    assert plain_guard(flag).startswith("weight block._modules['in_layers']._modules['2']._parameters['weight']: "
                                        "its requires_grad changed since warmup (a weight patch such as a LoRA")
    shape = "0/0: tensor 'L['x']' size mismatch at index 0. expected 1, actual 4"
    assert sorted([shape, flag], key=rank) == [flag, shape]


def test_guards_speak_the_models_language():
    """A DiT's block input is [batch, tokens, width]: a token count (60 image + 64 text tokens, or
    frames x patches) is never called channels; a guard that raised on a None input is said in words,
    not as Python's error; a call outside inference mode says so, with its own fix."""
    from unet_compiler.compiler.compat.dynamo import plain_guard
    from unet_compiler.compiler.lifecycle.recompiles import Recompiles, recompile_sentence
    size = "0/1: tensor 'L['x']' size mismatch at index 1. expected 60, actual 124"
    assert plain_guard(size, "dit") == "region input x: tokens (dim 1) is 124, the code was compiled for exactly 60"
    assert "channels (dim 1)" not in plain_guard(size, "unet")
    raised = plain_guard("2/3: 'NoneType' object has no attribute 'size'")
    assert "NoneType" not in raised and raised.startswith("an input is not what the code was compiled for"), raised
    rc = Recompiles()
    with torch.no_grad():   # not inference mode: warmup's code does not serve the call
        event = rc.record(1, "2x64x64", 0.5, {}, ["2x64x64"])
    assert event["guards"][0] == "this call ran outside torch.inference_mode, unlike warmup's", event
    assert "Fix: call the model under torch.inference_mode()" in event["text"], event["text"]
    with torch.inference_mode():
        event = rc.record(1, "2x64x64", 0.5, {}, ["2x64x64"])
    assert "inference_mode" not in event["text"] and "Fix: none needed" in event["text"], event["text"]
    assert recompile_sentence(dict(event, outside_inference=True), ["2x64x64"]).count("inference_mode") == 1


def test_the_cache_preloads_for_the_device_the_model_runs_on(tiny_unet, monkeypatch):
    """ComfyUI compiles while the weights are still on the CPU and loads them on the GPU later: the
    preloaded variants' dispatch state (autocast) must be the load device's, else every fp16/bf16
    variant is deserialized twice."""
    import functools

    from unet_compiler.compiler import runtime
    from unet_compiler.compiler.cache import CompileCache
    monkeypatch.setattr(lookup_backend("inductor"), "available", lambda self, device: (True, "test"))
    monkeypatch.setattr(CompileCache, "load", lambda self: True)
    seen = []
    monkeypatch.setattr(process_scheduler().variants, "preload", lambda modes: seen.append(modes))
    runtime.Accelerator(tiny_unet(), api.CompileConfig(backend="inductor", precision="bf16"),
                        device=torch.device("cuda", 0))
    (modes,) = seen
    assert isinstance(modes, functools.partial) and modes.args == ("cuda", torch.bfloat16), modes


def test_a_machine_that_cannot_build_turns_every_kind_off_at_once(tiny_unet, monkeypatch):
    """triton-windows / inductor without a working C compiler (no MSVC, no Python.h): the first
    failed compile turns every region kind off at once (not one failed compile per kind), and what
    the user reads is the compiler's error line and the Windows fix, not the 300-character command."""
    import platform
    import subprocess
    from unet_compiler.compiler.reasons import runtime_fallback
    cmd = ["cl", "/nologo", "/O2", "/LD", "C:\\Users\\someone\\AppData\\Local\\Temp\\tmpabc\\cuda_utils.c",
           *[f"/IC:\\ComfyUI_windows_portable\\python_embeded\\Lib\\site-packages\\triton\\include{i}"
             for i in range(8)]]
    calls = []

    def impl(block, *args):
        calls.append(1)
        try:
            raise subprocess.CalledProcessError(2, cmd, output="cuda_utils.c\nC:\\...\\cuda_utils.c(1): fatal error "
                                                               "C1083: Cannot open include file: 'Python.h': No such "
                                                               "file or directory\n")
        except subprocess.CalledProcessError as e:
            raise RuntimeError("backend='inductor' raised:") from e
    monkeypatch.setattr(lookup_backend("inductor"), "impls",
                        lambda self, config, scheduler: {("diffusers", "resblock"): impl,
                                                         ("diffusers", "attention"): impl})
    unet = api.compile_unet(tiny_unet(), "inductor")
    accel = api.accelerator_of(unet)
    told = []
    accel.events.subscribe("fallback", lambda kind, why: told.append((kind, why)))
    monkeypatch.setattr(platform, "system", lambda: "Windows")   # after the backend was chosen here
    with torch.no_grad():
        unet(*_inputs())
        unet(*_inputs())
    assert len(calls) == 1, "one failed compile turns every kind off"
    assert set(accel.failed) == set(accel.report.regions) and len(told) == 1 and told[0][0] == "all", told
    why = told[0][1]
    assert "fatal error C1083: Cannot open include file: 'Python.h'" in why.why and "/nologo" not in why, why
    assert "Visual Studio Build Tools" in why.fix and "python_embeded" in why.fix, why.fix
    said = runtime_fallback("inductor", "all", why)
    assert said.fix == why.fix and "Fix:" not in said.why, said
    from unet_compiler.compiler.report import warmup_facts
    facts = warmup_facts(accel.report, "inductor", accel.failed, (0, 3))
    assert facts["reason"].count("Python.h") == 1 and facts["fix"] == why.fix, facts
