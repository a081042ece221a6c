"""compile_unet on a plain diffusers UNet2DConditionModel (no ComfyUI).

Runs in the default env (newest diffusers, ``diffusers.models.unets.*``), in
the old-diffusers lane (0.25.1, ``diffusers.models.unet_2d_blocks``) and in
the IPEX lane, where UNET_COMPILER_TEST_BACKENDS adds ``ipex``."""
import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers not installed: the diffusers UNet tests skip")

from unet_compiler.compiler import compile_unet, report, warmup  # noqa: E402
from unet_compiler.compiler.api import accelerator_of  # noqa: E402
from unet_compiler.compiler.compat import diffusers as dcompat  # noqa: E402

BACKENDS = [b.strip() for b in os.environ.get("UNET_COMPILER_TEST_BACKENDS", "inductor").split(",") if b.strip()]

#: tiny_unet overrides per kind (sd15: the fixture's own SD1.5-shaped config)
TINY = {
    "sd15": {},
    # SDXL-shaped: linear projections, head dim 8 (attention_head_dim is per-head width there),
    # text_time added conditioning, 2-deep transformer at the lowest level
    "sdxl": dict(down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(4, 8),
                 transformer_layers_per_block=(1, 2), use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=32 + 6 * 8),
}


@pytest.fixture
def make_unet(tiny_unet):
    def make(kind, seed=0):
        u = tiny_unet(seed, **TINY[kind])
        with torch.no_grad():  # diffusers zero-inits some outputs: make every weight matter
            for p in u.parameters():
                p.add_(0.02 * torch.randn_like(p))
        return u
    return make


def _inputs(u, b=2, side=8, tokens=77, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 4, side, side, generator=g)
    c = torch.randn(b, tokens, u.config.cross_attention_dim, generator=g)
    kw = {}
    if u.config.addition_embed_type == "text_time":
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(b, 32, generator=g),
                                   "time_ids": torch.randn(b, 6, generator=g)}
    return x, torch.full((b,), 500.0), c, kw


def _run(u, inputs):
    x, t, c, kw = inputs
    with torch.inference_mode():
        return u(x, t, c, **kw).sample


def _close(a, b, tol=2e-4):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.fixture(params=["sd15", "sdxl"])
def kind(request):
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def test_layout_resolved_from_the_installed_diffusers():
    cls = dcompat.classes()
    assert {"UNet2DConditionModel", "ResnetBlock2D", "Attention", "FeedForward", "CrossAttnDownBlock2D"} <= set(cls)
    new_layout = cls["CrossAttnDownBlock2D"].__module__.startswith("diffusers.models.unets.")
    major, minor = (int(v) for v in diffusers.__version__.split(".")[:2])
    if (major, minor) >= (0, 29):
        assert new_layout  # the old path is gone from 0.29
    if (major, minor) < (0, 26):
        assert not new_layout  # the new path does not exist yet
    print(f"diffusers {diffusers.__version__}: blocks from {cls['CrossAttnDownBlock2D'].__module__}")


def test_parity_and_regions_fired(kind, backend, make_unet):
    u = make_unet(kind)
    inputs = _inputs(u)
    ref = _run(u, inputs)
    compile_unet(u, backend)
    from unet_compiler.compiler.passes import prepack_conv, prepack_linear
    used = lambda st: st["packs"] + st["cache_hits"]  # noqa: E731
    conv0, lin0 = used(prepack_conv.stats), used(prepack_linear.stats)
    out = _run(u, inputs)
    _close(out, ref)
    if backend == "inductor":  # the prepacked CPU convs actually ran (linears: off by default)
        assert used(prepack_conv.stats) > conv0 and used(prepack_linear.stats) == lin0
    accel = accelerator_of(u)
    assert accel.backend.name == backend, report(u)
    assert accel.stats["ran_resblock"] > 0 and accel.stats["ran_attention"] > 0, dict(accel.stats)
    assert accel.stats["ran_feedforward"] > 0
    text = report(u)
    assert f"backend {backend}" in text and "resblock x" in text and "attention x" in text


def test_weight_changes_after_compile_are_seen(backend, make_unet):
    """A LoRA merged after compiling (a new Parameter, as ComfyUI writes it) and
    an in-place strength change (copy_ into the same storage) both show up."""
    u = make_unet("sd15")
    inputs = _inputs(u)
    compile_unet(u, backend)
    _run(u, inputs)  # compiled + packed with the original weights
    g = torch.Generator().manual_seed(7)
    targets = [m for m in u.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    with torch.no_grad():
        for m in targets[::3]:  # 1: replace the Parameter (LoRA merged by a patcher)
            m.weight = torch.nn.Parameter(m.weight + 0.05 * torch.randn(m.weight.shape, generator=g),
                                          requires_grad=False)
    with accelerator_of(u).bypass():
        ref1 = _run(u, inputs)
    _close(_run(u, inputs), ref1)
    with torch.no_grad():
        for m in targets[1::3]:  # 2: in place (strength change written into the same storage)
            m.weight.mul_(1.5)
    with accelerator_of(u).bypass():
        ref2 = _run(u, inputs)
    assert (ref2 - ref1).abs().max() > 1e-3  # the change matters
    _close(_run(u, inputs), ref2)


def test_weights_written_through_data_are_seen(backend, make_unet):
    """What writes weights through ``.data`` (no version counter moves): PEFT's ``merge`` (diffusers'
    ``fuse_lora``: ``base_layer.weight.data += delta``, recorded in the layer's ``merged_adapters``,
    stood in for here on the convs) is seen by itself; any other such write once the caller says so
    (``weights_changed``). Before, the prepacked convs kept the old weights (2.9 off)."""
    from unet_compiler.compiler import weights_changed
    u = make_unet("sd15")
    inputs = _inputs(u)
    convs = [m for m in u.modules() if isinstance(m, torch.nn.Conv2d)]
    for m in convs:
        m.merged_adapters = []          # a PEFT layer's record of what it merged
    compile_unet(u, backend)
    before = _run(u, inputs)
    g = torch.Generator().manual_seed(7)
    for m in convs:                     # fuse_lora
        m.weight.data += 0.05 * torch.randn(m.weight.shape, generator=g)
        m.merged_adapters.append("a")
    with accelerator_of(u).bypass():
        ref = _run(u, inputs)
    assert (ref - before).abs().max() > 1e-2   # the change matters
    _close(_run(u, inputs), ref)
    for m in convs[::2]:                # another writer, then the caller tells
        m.weight.data *= 1.5
    weights_changed(u)
    with accelerator_of(u).bypass():
        ref = _run(u, inputs)
    _close(_run(u, inputs), ref)


@pytest.mark.parametrize("kind_", ["sd15", "sdxl"])
def test_zero_recompiles_after_warmup(kind_, make_unet):
    u = make_unet(kind_)
    compile_unet(u, "inductor")
    warmup(u, "1x64x64, 4x128x128", context_tokens=77)
    accel = accelerator_of(u)
    # compiled code is shared process-wide, so a second model may compile nothing new: check it ran accelerated
    assert accel.stats["ran_resblock"] > 0 and accel.stats["ran_attention"] > 0
    for b, side, tokens in ((1, 8, 77), (2, 8, 77), (2, 12, 77), (3, 16, 154), (4, 10, 77)):
        _run(u, _inputs(u, b=b, side=side, tokens=tokens))
        x, t, c, kw = _inputs(u, b=b, side=side, tokens=tokens)
        with torch.no_grad():  # how diffusers pipelines call the UNet: normal tensors, no inference_mode
            out = u(x, t, c, **kw).sample
        out.add_(1.0)  # the caller may modify the output in place (it is not an inference tensor)
    assert accel.stats["recompiles_after_warmup"] == 0, report(u)
    assert "recompiles after warmup: 0" in report(u)


def test_one_warmup_shape_compiles_that_shape_static(make_unet):
    """One warmup shape: static code for exactly it (cheaper to compile, load and run); a new
    shape is one named recompile, after which sizes are dynamic; a range keeps dynamic code."""
    u = make_unet("sd15")
    compile_unet(u, "inductor")
    text = warmup(u, "1x64x64", context_tokens=77)
    accel = accelerator_of(u)
    assert accel.config.dynamic_shapes is None and "compiled for exactly 1x64x64" in text
    assert "(probe)" not in text   # static code needs no probe shapes
    _run(u, _inputs(u, b=1, side=8, tokens=77))
    assert accel.stats["recompiles_after_warmup"] == 0, report(u)
    for b in (2, 3):
        out = _run(u, _inputs(u, b=b, side=8, tokens=77))
        with accel.bypass():
            _close(out, _run(u, _inputs(u, b=b, side=8, tokens=77)))
        if b == 2:
            after_change = accel.stats["recompiles_after_warmup"]
            assert after_change > 0 and len(accel.recompiles.events) == 1, report(u)
    assert accel.stats["recompiles_after_warmup"] == after_change, "batch 3 should reuse the dynamic code"

    r = make_unet("sd15")
    compile_unet(r, "inductor")
    warmup(r, "1x64x64, 2x64x64", context_tokens=77)
    assert accelerator_of(r).config.dynamic_shapes is True


@pytest.mark.parametrize("cls", ["FluxTransformer2DModel", "SD3Transformer2DModel"])
def test_diffusers_transformers_are_refused_at_compile_with_what_it_takes(cls):
    """diffusers' DiTs are no supported UNet: ``compile_unet`` refuses them at once (TypeError naming
    the class and what it takes), so ``warmup`` is never reached on a model it cannot warm."""
    import diffusers
    model_cls = getattr(diffusers, cls, None)
    if model_cls is None:
        pytest.skip(f"this diffusers has no {cls}")
    kw = dict(patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
              joint_attention_dim=16, pooled_projection_dim=8)
    kw.update(num_single_layers=1, axes_dims_rope=(2, 2, 4)) if cls.startswith("Flux") else kw.update(
        sample_size=8, caption_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    model = model_cls(**kw)
    with pytest.raises(TypeError, match=f"{cls} is not a supported UNet"):
        compile_unet(model)
    assert "forward" not in model.__dict__


def test_a_call_with_autograd_runs_the_models_own_code(make_unet):
    """Gradients through the UNet (guidance by gradients: d loss / d latents): the call runs the
    model's own code, said once, and its gradient is the model's; the compiled regions stay on, and
    a later call under autograd with nothing to differentiate runs compiled code and compiles
    nothing new. Before, the forward failed the resblocks for good (no autograd formula for the
    prepacked conv) and the backward raised."""
    from unet_compiler.compiler.api import GRAD_ON
    u, ref = make_unet("sd15"), make_unet("sd15")
    inputs = _inputs(u, side=9)       # (last in this file, a size no other test warms: dynamo marks the
    # sizes a region body saw change dynamic for every model, which a one-shape test above counts on)
    compile_unet(u, "inductor")
    warmup(u, "2x72x72")
    x, t, c, kw = inputs

    def grad_of(m):
        xl = x.clone().requires_grad_(True)
        m(xl, t, c).sample.float().pow(2).mean().backward()
        return xl.grad
    ref.requires_grad_(False)
    torch.testing.assert_close(grad_of(u), grad_of(ref), rtol=1e-4, atol=1e-4)
    accel = accelerator_of(u)
    assert not accel.failed and GRAD_ON in accel.text()
    compiled = accel.stats["calls"]
    out = u(x, t, c).sample                    # autograd on, nothing requires grad
    assert not out.requires_grad and not out.is_inference()
    _close(out, _run(ref, inputs))
    assert accel.stats["calls"] == compiled + 1 and accel.stats["recompiles_after_warmup"] == 0, report(u)


class _Hooks:
    """accelerate's ``add_hook_to_module`` / ``remove_hook_from_module`` (accelerate 1.16.0
    ``hooks.py``, rewritten: what ``enable_model_cpu_offload`` and ``device_map`` put on the UNet):
    the module's forward becomes a partial that runs the hook's ``pre_forward`` and then calls
    ``module._old_forward`` (its forward when hooked first); removing puts ``_old_forward`` back
    as ``forward``. This hook counts its calls."""

    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs

    def add(self, module):
        import functools
        if not (hasattr(module, "_hf_hook") and hasattr(module, "_old_forward")):
            module._old_forward = module.forward
        module._hf_hook = self

        def new_forward(module, *args, **kwargs):
            args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
            return module._old_forward(*args, **kwargs)
        module.forward = functools.update_wrapper(functools.partial(new_forward, module), module._old_forward)

    @staticmethod
    def remove(module):
        del module._hf_hook
        module.forward = module._old_forward
        del module._old_forward


@pytest.mark.parametrize("when", ["before", "after"])
def test_accelerates_offload_hook_runs_around_the_compiled_unet(make_unet, when):
    """An accelerate hook (model CPU offload) put on before or after compile_unet: each call runs the
    hook, then the compiled regions; uncompile_unet leaves the hook calling the model's own forward.
    Before, compile_unet dropped a hook put on before it and uncompile_unet deleted one put on after."""
    u = make_unet("sd15")
    inputs = _inputs(u)
    ref = _run(u, inputs)
    hook = _Hooks()
    if when == "before":
        hook.add(u)
    compile_unet(u, "eager")
    if when == "after":
        hook.add(u)
    _close(_run(u, inputs), ref)
    stats = accelerator_of(u).stats
    assert hook.calls == 1 and stats["calls"] + stats["eager_calls"] == 1     # the pack's forward ran
    from unet_compiler.compiler import uncompile_unet
    uncompile_unet(u)
    _close(_run(u, inputs), ref)
    assert hook.calls == 2 and "_unet_compiler" not in u.__dict__
    _Hooks.remove(u)
    assert "forward" not in u.__dict__ or getattr(u.forward, "__func__", None) is type(u).forward
    _close(_run(u, inputs), ref)


def test_compile_unet_refuses_a_forward_it_would_drop(make_unet):
    """A forward another library set on the instance (not accelerate's hook): compile_unet says so,
    with the fix, before any work, and leaves the module as it was."""
    u = make_unet("sd15")
    wrapper = lambda *a, **k: type(u).forward(u, *a, **k)  # noqa: E731
    u.forward = wrapper
    with pytest.raises(ValueError, match="forward was replaced on the instance .*Fix: call compile_unet before"):
        compile_unet(u, "eager")
    assert u.__dict__["forward"] is wrapper and "_unet_compiler" not in u.__dict__


def test_a_model_moved_to_bf16_after_a_call_is_warmed_at_bf16s_tolerance(make_unet):
    """compile, one fp32 call, ``.to(torch.bfloat16)``, warmup: the compare uses bf16's tolerance (the
    dtype the warmup's calls compute in). Before, it kept fp32's from the first call and refused
    correct code as wrong (0.0195 over 0.012)."""
    u = make_unet("sd15")
    compile_unet(u, "inductor")
    _run(u, _inputs(u))
    u.to(torch.bfloat16)
    text = warmup(u, "2x64x64")
    accel = accelerator_of(u)
    assert accel.compute_dtype == torch.bfloat16 and not accel.failed, text
    x, t, c, kw = _inputs(u)
    out = _run(u, (x.bfloat16(), t, c.bfloat16(), kw))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("over", [dict(in_channels=7, num_class_embeds=1000), dict(encoder_hid_dim=48),
                                  dict(time_cond_proj_dim=16)], ids=["class labels", "encoder_hid_dim", "LCM"])
def test_warmup_makes_the_conditioning_the_config_asks_for(tiny_unet, over):
    """The x4 upscaler's class labels, a context projected from another width, LCM's timestep_cond:
    warmup makes each up and compiles. Before, the first two raised diffusers' errors (no fix named)."""
    u = tiny_unet(**over)
    compile_unet(u, "eager")
    text = warmup(u, "1x64x64")
    assert "warmed 1x64x64" in text, text


def test_warmup_names_what_it_cannot_make_and_bad_arguments(tiny_unet):
    u = tiny_unet(addition_embed_type="image", encoder_hid_dim=32, encoder_hid_dim_type="image_proj")
    compile_unet(u, "eager")
    with pytest.raises(ValueError, match="added conditioning of type 'image'.*Fix: warm it by calling"):
        warmup(u, "1x64x64")
    v = tiny_unet()
    compile_unet(v, "eager")
    for bad in ("77", 2.5, -5, 0):
        with pytest.raises(ValueError, match="context_tokens"):
            warmup(v, "1x64x64", context_tokens=bad)
    with pytest.raises(TypeError, match="compare must be True or False"):
        warmup(v, "1x64x64", compare="yes")


def test_an_offload_hook_put_on_before_compiling_is_no_override(make_unet):
    u = make_unet("sd15")
    _Hooks().add(u)
    compile_unet(u, "eager")
    assert accelerator_of(u).overrides.check(u) is None


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_compiled_unet_is_compiled_the_same_way(make_unet, how, monkeypatch):
    """``copy.deepcopy`` or ``torch.save`` / ``torch.load`` of a compiled UNet: before, both raised
    (cannot pickle 'WeakMethod'). Now the copy carries the compile settings, not the accelerator: it
    gets its own at its first call, its regions run compiled code on its own weights (a change to
    the copy's weights is the copy's alone), == its own code; the original is untouched.
    ``uncompile_unet`` on a copy never called leaves a plain UNet."""
    import copy
    import io

    from unet_compiler.compiler import uncompile_unet
    from unet_compiler.compiler.backends import inductor
    monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)   # (the bodies uncompiled: quick)
    u = make_unet("sd15")
    compile_unet(u, "inductor", prepack_conv=False, prepack_linear=False)
    inputs = _inputs(u)
    ref = _run(u, inputs)

    def copied():
        if how == "deepcopy":
            return copy.deepcopy(u)
        buf = io.BytesIO()
        torch.save(u, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    c = copied()
    with torch.no_grad():
        c.conv_in.weight.mul_(1.5)
    got = _run(c, inputs)
    accel = accelerator_of(c)
    assert accel is not accelerator_of(u) and accel.config == accelerator_of(u).config
    ran, total = accel.ran_compiled()
    assert ran == total > 0, accel.text()
    with accel.bypass():
        _close(got, _run(c, inputs))
    assert (got - ref).abs().max() > 1e-3, "the copy's weights are its own"
    _close(_run(u, inputs), ref)
    plain = uncompile_unet(copied())
    assert "forward" not in plain.__dict__ and "_unet_compiler" not in plain.__dict__
    _close(_run(plain, inputs), ref)


def test_two_threads_on_a_fresh_copy_share_one_compile(make_unet, monkeypatch):
    """Two threads reaching a fresh copy at once (its plan slowed down): one compiles it, the other
    waits and gets the same accelerator. Before, the second found neither an accelerator nor the
    copy's pending forward and raised 'module was not compiled'."""
    import copy
    import threading
    import time

    from unet_compiler.compiler import api
    u = make_unet("sd15")
    compile_unet(u, "eager")
    c = copy.deepcopy(u)
    real = api.build_plan

    def slow(module):
        time.sleep(0.3)
        return real(module)
    monkeypatch.setattr(api, "build_plan", slow)
    got, errors = [], []

    def reach(delay):
        time.sleep(delay)
        try:
            got.append(accelerator_of(c))
        except Exception as e:   # noqa: BLE001 - what a thread met is the finding
            errors.append(repr(e))
    threads = [threading.Thread(target=reach, args=(d,)) for d in (0, 0.1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 2 and got[0] is got[1] is c.__dict__["_unet_compiler"]


def test_uncompile_gives_requires_grad_back(tiny_unet):
    """Compiling turns ``requires_grad`` off (inference only: dynamo guards it, and ComfyUI's weight
    patches put weights back without it); ``uncompile_unet`` turns it on again where it was on, so a
    LoRA added to train, then compiled and uncompiled, trains (before: every parameter stayed off)."""
    from unet_compiler.compiler import uncompile_unet
    u = tiny_unet()
    frozen = u.conv_in.weight
    frozen.requires_grad_(False)
    before = {n for n, p in u.named_parameters() if p.requires_grad}
    compile_unet(u, "inductor")
    assert not any(p.requires_grad for p in u.parameters())
    uncompile_unet(u)
    assert {n for n, p in u.named_parameters() if p.requires_grad} == before and not frozen.requires_grad
