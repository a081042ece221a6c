"""Warmup Shapes on a patched model (issue: Compile UNet + Warmup Shapes after core
patch nodes failed the whole prompt). Warmup calls the model the way KSampler does
(sigmas, sample_sigmas, cond_or_uncond, uuids, model_function_wrapper), so core
patches run during warmup; a third-party patch that still cannot run outside
sampling is left out of warmup and named in the report; a model warmup cannot
call at all is reported and passed on. Never a failed prompt."""
import pytest
import torch

from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher
from unet_compiler.nodes import warmup as nodes_warmup

pytestmark = pytest.mark.comfy


@pytest.fixture
def backend(monkeypatch):
    """The triton backend under the interpreter on CPU (compiles nothing: fast), else inductor."""
    try:
        from unet_compiler.compiler.backends import _kernel_choice as KC, triton as TB
    except ImportError:
        return CompileConfig(backend="inductor")
    if not torch.cuda.is_available():
        monkeypatch.setattr(TB.TritonBackend, "available", lambda self, device: (True, "interpreter (test)"))
    monkeypatch.setenv(KC.CHOICE_ENV, "triton")
    return CompileConfig(backend="triton")


def _deep_shrink(model, block=1):
    from comfy_extras.nodes_model_downscale import PatchModelAddDownscale
    out = PatchModelAddDownscale.execute(model, block, 2.0, 0.0, 0.35, True, "bicubic", "bicubic")
    return out.result[0] if hasattr(out, "result") else out[0]


def _sample_call(mp, sigma_index=0, b=2, side=64):
    """One UNet call as KSampler makes it (nodes/warmup.py's SamplingCall is what warmup uses)."""
    import comfy.model_management as mm
    from unet_compiler.compiler.shapes import Shape
    mm.load_models_gpu([mp])
    call = nodes_warmup.SamplingCall(mp, 77, mp.load_device, torch.float32)
    call.sample_sigmas = call.sample_sigmas[sigma_index:]
    return call(Shape(b, side, side))


def test_sampling_call_carries_the_state_patches_read(make_comfy_model):
    mp = make_comfy_model("sd15")
    seen = {}

    def record(h, transformer_options):
        seen.update({k: transformer_options.get(k) for k in ("sigmas", "sample_sigmas", "cond_or_uncond", "uuids")})
        return h
    m = mp.clone()
    m.set_model_input_block_patch(record)
    _sample_call(m, b=2)
    assert seen["cond_or_uncond"] == [0, 1] and len(seen["uuids"]) == 2
    assert seen["sigmas"].shape == (1,) and len(seen["sample_sigmas"]) == nodes_warmup.SamplingCall.STEPS + 1
    ms = m.get_model_object("model_sampling")
    assert float(seen["sigmas"][0]) == pytest.approx(float(ms.sigma_max), rel=1e-4)  # the first step
    _sample_call(m, b=1)
    assert seen["cond_or_uncond"] == [0]   # an odd batch: cfg 1


def _compiled(mp, config, order):
    """Compile UNet placed after the patch node, or before it (ComfyUI clones and re-patches
    in both orders)."""
    if order == "patch_then_compile":
        return patcher.compile_model(_deep_shrink(mp), config)[0]
    return _deep_shrink(patcher.compile_model(mp, config)[0])


# the eager backend where what is tested is how warmup calls the model, not the regions (fast)
EAGER = CompileConfig(backend="eager")
ORDERS = ["patch_then_compile", "compile_then_patch"]


@pytest.mark.parametrize("order", ORDERS)
def test_deep_shrink_warms_up_with_the_patch(make_comfy_model, order):
    """Kohya Deep Shrink reads transformer_options['sigmas'] (KeyError before the fix): Warmup
    Shapes placed after it, in either node order, warms up with the patch applied."""
    mp = make_comfy_model("sd15")
    cm = _compiled(mp, EAGER, order)
    shrunk = []

    def after_deep_shrink(h, transformer_options):   # runs after Deep Shrink's own patch at each input block
        if transformer_options["block"][1] == 1:
            shrunk.append(h.shape[-1] < 64 // 8)
        return h
    cm.set_model_input_block_patch_after_skip(after_deep_shrink)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    assert "warmed 2x64x64" in text, text
    assert "without the model's patches" not in text and "warmup stopped" not in text, text
    assert any(shrunk), "the first step's sigma is inside the shrink window: the UNet ran downscaled"
    # the report names the patch and what it did to the regions
    assert "patch input_block_patch_after_skip (PatchModelAddDownscale.execute.input_block_patch): runs between " \
           "regions" in text, text


def test_report_names_attention_replace_patches(make_comfy_model):
    """An IPAdapter-style attn2 replace patch takes over that attention call: the report says which."""
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, EAGER)

    def ip_adapter_like(q, k, v, extra_options):
        return torch.nn.functional.scaled_dot_product_attention(
            *(t.view(t.shape[0], -1, extra_options["n_heads"], extra_options["dim_head"]).transpose(1, 2)
              for t in (q, k, v))).transpose(1, 2).reshape(q.shape)
    cm.set_model_attn2_replace(ip_adapter_like, "input", 1)
    text = patcher.warmup_model(cm, "1x64x64", 77)
    assert "patch attn2 replace (test_report_names_attention_replace_patches.ip_adapter_like): attention at " \
           "('input', 1) runs the patch's code instead" in text, text


def test_deep_shrink_compiled_matches_eager(make_comfy_model, backend):
    """Compiled == eager with Deep Shrink patched onto the compiled model (a clone of it), at the
    first step, inside the shrink window: the resolution changes inside the UNet. (The Triton
    interpreter makes each call slow on CPU: one call here; the order is covered above.)"""
    mp = make_comfy_model("sd15")
    eager, cm = _deep_shrink(mp), _compiled(mp, backend, "compile_then_patch")
    torch.testing.assert_close(_sample_call(cm, 0), _sample_call(eager, 0), rtol=2e-4, atol=2e-4)
    accel = patcher.accelerator_of(cm)
    assert accel.stats["ran_resblock"] > 0 and accel.stats["ran_attention"] > 0


def test_a_patch_that_cannot_run_outside_sampling_is_left_out_and_named(make_comfy_model):
    from unet_compiler.compiler.shapes import Shape
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, EAGER)

    def third_party_patch(h, transformer_options):
        return h * transformer_options["some_pack_state"]   # set only by that pack's sampler
    cm.set_model_input_block_patch(third_party_patch)
    text = patcher.warmup_model(cm, "1x64x64", 77)
    assert "warmed 1x64x64" in text, text
    assert "warmup ran without the model's patches (input_block_patch (" in text, text
    assert "third_party_patch" in text and "KeyError" in text, text
    status = text.splitlines()[-1]
    assert status.startswith("  status:") and "without the model's patches" in status, status
    # the model still carries the patch for sampling: a patched call without its state fails as in plain ComfyUI
    assert any("third_party_patch" in n for n in nodes_warmup.patch_names(cm.model_options))
    with pytest.raises(KeyError, match="some_pack_state"):
        nodes_warmup.SamplingCall(cm, 77, cm.load_device, torch.float32)._call(Shape(1, 64, 64), patched=True)


def test_a_model_warmup_cannot_call_is_reported_not_failed(make_comfy_model, monkeypatch):
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, EAGER)

    def broken(*a, **k):
        raise RuntimeError("needs conditioning only a sampler provides")
    monkeypatch.setattr(cm.model, "apply_model", broken)
    text = patcher.warmup_model(cm, "1x64x64", 77)
    assert "warmup stopped: this model could not be called outside sampling (RuntimeError: needs " in text, text
    assert "compiles on its first KSampler step instead" in text.splitlines()[-1], text
    assert not patcher.accelerator_of(cm).warmed


def test_warmup_conditioning_is_processed_as_this_comfys_sampler_does(make_comfy_model, monkeypatch):
    """Warmup's conditioning is the model's own ``extra_conds``, each cond's ``process_cond`` called as
    this ComfyUI's sampler calls it: without ``device=`` where the method names none (0.8.0's and newer
    samplers pass none; a method without ``**kwargs`` would raise on it), with it where the method
    names it (older ComfyUIs); the result on the model's device. No random stand-in, so no note."""
    import comfy.conds
    from unet_compiler.compiler.shapes import Shape
    own = comfy.conds.CONDRegular.process_cond
    seen = []

    def newest(self, batch_size, area=None):           # no device, no **kwargs
        seen.append("newest")
        return own(self, batch_size, area=area)
    monkeypatch.setattr(comfy.conds.CONDRegular, "process_cond", newest)
    call = nodes_warmup.SamplingCall(make_comfy_model("sd15"), 77, torch.device("cpu"), torch.float32)
    _, c = call.conds(Shape(2, 64, 64))
    assert seen and call.random_conds is None and c["c_crossattn"].shape[0] == 2, (seen, call.random_conds)

    def older(self, batch_size, device, area=None, **kwargs):
        seen.append(device)
        return own(self, batch_size, area=area)
    monkeypatch.setattr(comfy.conds.CONDRegular, "process_cond", older)
    call = nodes_warmup.SamplingCall(make_comfy_model("sd15"), 77, torch.device("cpu"), torch.float32)
    call.conds(Shape(2, 64, 64))
    assert torch.device("cpu") in seen and call.random_conds is None


def test_random_warmup_conditioning_is_a_report_line(make_comfy_model, monkeypatch):
    """Where the model's own conditioning cannot be made (here a ``process_cond`` that raises), warmup
    runs on random tensors of the UNet's input sizes and the report says so, once, with the error."""
    import comfy.conds

    def broken(self, *a, **k):
        raise RuntimeError("cond from the future")
    monkeypatch.setattr(comfy.conds.CONDRegular, "process_cond", broken)
    cm, _ = patcher.compile_model(make_comfy_model("sd15"), EAGER)
    text = patcher.warmup_model(cm, "2x64x64, 1x64x64", 77)
    line = ("warmup conditioning: random tensors of the UNet's input sizes, as the model's own extra_conds could "
            "not make it (RuntimeError: cond from the future)")
    assert text.count(line) == 1, text
