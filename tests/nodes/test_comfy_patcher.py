"""Compile UNet on ComfyUI's own UNetModel inside a real ModelPatcher (CPU).

Every test compares against eager on the same module instance, asserts the
accelerated path actually ran, and where relevant that it stood aside."""
import pytest
import torch

from unet_compiler.compiler.config import CompileConfig
from unet_compiler.compiler.passes import prepack_conv
from unet_compiler.nodes import patcher, warmup as nodes_warmup
from unet_compiler.tests._written import as_written

pytestmark = pytest.mark.comfy
CFG = CompileConfig(backend="inductor")


def _inputs(kind, b=2, h=8, w=8, tokens=77, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        x = torch.randn(b, 4, h, w, generator=g)
        ctx = torch.randn(b, tokens, 64, generator=g)
        kw = {"y": torch.randn(b, 96, generator=g)} if kind == "sdxl" else {}
        return x, torch.full((b,), 2.0), ctx, kw


def _apply(mp, kind, control=None, load=True, **shape):
    x, t, ctx, kw = _inputs(kind, **shape)
    import comfy.model_management as mm
    if load:  # a (re)load resets ComfyUI's per-module cast state
        mm.load_models_gpu([mp])
    to = nodes_warmup.sampling_transformer_options(mp)
    with torch.inference_mode():
        return mp.model.apply_model(x, t, c_crossattn=ctx, control=control, transformer_options=to, **kw)


def _close(a, b, tol=1e-4):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.fixture(params=["sd15", "sdxl"])
def kind(request):
    return request.param


def test_parity_and_regions_fired(make_comfy_model, kind):
    mp = make_comfy_model(kind)
    ref = _apply(mp, kind)
    cm, text = patcher.compile_model(mp, CFG)
    out = _apply(cm, kind)
    _close(out, ref)
    accel = patcher.accelerator_of(cm)
    assert accel.stats["ran_resblock"] > 0 and accel.stats["ran_attention"] > 0 and accel.stats["ran_feedforward"] > 0
    assert "backend inductor" in text and "resblock x" in text and "attention x" in text
    # the shared module was never left modified, and the source patcher has no wrapper
    assert not any("forward" in m.__dict__ for m in mp.model.diffusion_model.modules())
    assert patcher.accelerator_of(mp) is None
    assert not mp.get_wrappers("apply_model", patcher.KEY) and cm.get_wrappers("apply_model", patcher.KEY)
    # eager model next to the compiled clone still gives the reference
    _close(_apply(mp, kind), ref, tol=0)


def _lora(comfy, mp, scale, seed=3):
    """A kohya-format LoRA (rank 4) on one ResBlock conv and every attn2 to_k,
    loaded through ComfyUI's own key map and loader."""
    key_map = comfy.lora.model_lora_keys_unet(mp.model, {})
    g = torch.Generator().manual_seed(seed)
    sd = {}
    sd_model = mp.model.state_dict()
    by_model_key = {}
    for k, v in key_map.items():  # the map holds several aliases per model key: keep one
        if k.startswith("lora_unet_") and ("in_layers_2" in k or "attn2_to_k" in k):
            by_model_key.setdefault(v if isinstance(v, str) else v[0], k)
    targets = list(by_model_key.values())
    assert targets
    for name in targets:
        w = sd_model[key_map[name] if isinstance(key_map[name], str) else key_map[name][0]]
        out_c, in_c = w.shape[0], w.shape[1]
        extra = tuple(w.shape[2:])
        sd[f"{name}.lora_down.weight"] = torch.randn((4, in_c) + extra, generator=g) * scale
        sd[f"{name}.lora_up.weight"] = torch.randn((out_c, 4) + (1,) * len(extra), generator=g) * scale
        sd[f"{name}.alpha"] = torch.tensor(4.0)
    patches = comfy.lora.load_lora(sd, key_map)
    assert len(patches) == len(targets)
    return patches


def test_lora_before_after_and_strength_change(comfy, make_comfy_model):
    kind = "sd15"
    mp = make_comfy_model(kind)
    patches = _lora(comfy, mp, 0.3)

    before = mp.clone()
    before.add_patches(patches, 1.0)
    ref_before = _apply(before, kind)
    plain = _apply(mp, kind)
    assert (ref_before - plain).abs().max() > 1e-3, "the LoRA must change the output"

    # LoRA applied BEFORE Compile UNet
    c1, _ = patcher.compile_model(before, CFG)
    _close(_apply(c1, kind), ref_before)
    packs = prepack_conv.stats["packs"]

    # LoRA applied AFTER Compile UNet, then a strength change
    c0, _ = patcher.compile_model(mp, CFG)
    _close(_apply(c0, kind), plain)
    for strength in (1.0, 0.25):
        after = c0.clone()
        after.add_patches(patches, strength)
        ref = before.clone()
        ref.patches = {}
        ref.add_patches(patches, strength)
        expected = _apply(ref, kind)
        _close(_apply(after, kind), expected)
    assert prepack_conv.stats["packs"] > packs, "changed weights must be re-packed"
    assert patcher.accelerator_of(c0).stats["ran_resblock"] > 0


def test_inplace_weight_update_is_seen(make_comfy_model):
    """ComfyUI's in-place path (copy_to_param, scheduled hooks) keeps data_ptr and
    version: the weight epoch (patch uuid / ON_APPLY_HOOKS) must invalidate."""
    kind = "sd15"
    mp = make_comfy_model(kind)
    cm, _ = patcher.compile_model(mp, CFG)
    _apply(cm, kind)
    conv = mp.model.diffusion_model.input_blocks[1][0].in_layers[2]
    import comfy.utils
    with torch.inference_mode():
        comfy.utils.copy_to_param(conv, "weight", conv.weight * 1.5)
    # what ComfyUI does after an in-place hook write: fire ON_APPLY_HOOKS
    for cb in cm.get_all_callbacks("on_apply_hooks"):
        cb(cm, None)
    ref_mp = cm.clone()
    out = _apply(cm, kind)
    with patcher.accelerator_of(cm).bypass():
        ref = _apply(ref_mp, kind)
    _close(out, ref)


def test_a_prompts_cleanup_without_hooks_keeps_the_packed_weights(comfy, make_comfy_model):
    """ComfyUI cleans the model up after every prompt's sampling (``ModelPatcher.cleanup``): where the
    prompt applied no hooks nothing moved, and the next prompt's calls use the packed convs as they
    are (before: every prompt re-packed every conv weight, 3-5 s for SD1.5 on a CPU)."""
    from unet_compiler.compiler.passes import prepack_conv
    kind = "sd15"
    mp = make_comfy_model(kind)
    cm, _ = patcher.compile_model(mp, CFG)
    first = _apply(cm, kind)
    packs = prepack_conv.stats["packs"]
    assert packs > 0
    cm.cleanup()
    _close(_apply(cm, kind), first)
    assert prepack_conv.stats["packs"] == packs, "nothing moved: nothing packed again"


@pytest.mark.parametrize("how", ["a prompt's cleanup", "a keyframe change"])
def test_hook_weights_put_back_without_a_callback_are_seen(comfy, make_comfy_model, how):
    """A LoRA hook (scheduled LoRA) applied through ComfyUI's own hooks, then its weights put back in
    place (copy_to_param: no version counter, no ON_APPLY_HOOKS): by the prompt's cleanup
    (``ModelPatcher.cleanup``) before the next prompt, or by a keyframe change
    (``patch_hooks(None)``, then a cond group without hooks whose ``apply_hooks(None)`` returns
    early). The next call == the model's own code (before: the packed convs of the hooked weights,
    3.9 off)."""
    import comfy.hooks
    import comfy.model_management as mm
    kind = "sd15"
    mp = make_comfy_model(kind)
    plain = _apply(mp, kind)
    patches = _lora(comfy, mp, 0.3)
    cm, _ = patcher.compile_model(mp, CFG)
    hooks = comfy.hooks.create_hook_lora(None, 1.0, 1.0)
    hooks.hooks[0].weights, hooks.hooks[0].need_weight_init = patches, False
    cm.register_all_hook_patches(hooks, comfy.hooks.create_target_dict(comfy.hooks.EnumWeightTarget.Model),
                                 {"transformer_options": {}})
    mm.load_models_gpu([cm])
    cm.pre_run()                              # sampling: the model's current patcher
    cm.apply_hooks(hooks=hooks)
    assert (_apply(cm, kind, load=False) - plain).abs().max() > 1e-3
    if how == "a prompt's cleanup":
        cm.cleanup()
        cm.restore_hook_patches()
        mm.load_models_gpu([cm])
        cm.pre_run()
    else:
        cm.patch_hooks(None)
    cm.apply_hooks(hooks=None)
    out = _apply(cm, kind, load=False)
    with patcher.accelerator_of(cm).bypass():
        ref = _apply(cm, kind, load=False)
    _close(ref, plain)
    _close(out, ref)


def test_attn2_replace_patch_and_attention_override(comfy, make_comfy_model):
    kind = "sd15"
    mp = make_comfy_model(kind)
    calls = {"replace": 0, "override": 0}

    def replace(q, k, v, extra_options):
        calls["replace"] += 1
        return comfy.attention.attention_pytorch(q, k * 0.5, v, extra_options["n_heads"])

    patched = mp.clone()
    for block in [("input", i) for i in range(6)] + [("middle", 0)] + [("output", i) for i in range(6)]:
        patched.set_model_attn2_replace(replace, *block)
    ref = _apply(patched, kind)
    n_ref = calls["replace"]
    assert n_ref > 0
    cm, _ = patcher.compile_model(patched, CFG)
    out = _apply(cm, kind)
    _close(out, ref)
    assert calls["replace"] == 2 * n_ref, "the replace patch must run inside the compiled model"
    assert patcher.accelerator_of(cm).stats["ran_attention"] > 0  # attn1 still accelerated

    def override(func, *args, **kwargs):
        calls["override"] += 1
        return func(*args, **kwargs)

    ov = cm.clone()
    ov.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = override
    accel = patcher.accelerator_of(ov)
    eager_before = accel.stats["region_eager"]
    _close(_apply(ov, kind), ref)
    assert calls["override"] > 0 and accel.stats["region_eager"] > eager_before


def test_controlnet_control_dict(make_comfy_model):
    kind = "sd15"
    mp = make_comfy_model(kind)
    unet = mp.model.diffusion_model
    shapes = {}
    # forward_timestep_embed iterates a block's layers itself: hook each block's last layer
    hooks = [b[-1].register_forward_hook(lambda m, i, o, n=n: shapes.__setitem__(n, o.shape))
             for n, b in list(enumerate(unet.input_blocks)) + [("mid", unet.middle_block)]]
    base = _apply(mp, kind)
    for h in hooks:
        h.remove()

    def control():
        g = torch.Generator().manual_seed(7)
        ins = [torch.randn(shapes[i], generator=g) for i in range(len(unet.input_blocks))]
        return {"input": list(reversed(ins)), "middle": [torch.randn(shapes["mid"], generator=g)]}

    ref = _apply(mp, kind, control=control())
    assert (ref - base).abs().max() > 1e-3
    cm, _ = patcher.compile_model(mp, CFG)
    _close(_apply(cm, kind, control=control()), ref)


def test_lowvram_weight_functions_run_compiled_and_correct(make_comfy_model):
    """Modules ComfyUI casts/patches per call (partial load: comfy_cast_weights +
    weight_function) run compiled code on ComfyUI's own cast of their weights."""
    kind = "sd15"
    mp = make_comfy_model(kind)
    unet = mp.model.diffusion_model
    lowvram = [m for m in unet.input_blocks[1].modules() if hasattr(m, "comfy_cast_weights")]
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    plain = _apply(cm, kind)
    try:
        for m in lowvram:
            m.comfy_cast_weights = True
            m.weight_function = [lambda w: w * 0.9]
        ref = _apply(mp, kind, load=False)
        before = accel.stats.copy()   # a Counter: a key not counted yet reads 0
        out = _apply(cm, kind, load=False)
    finally:
        for m in lowvram:
            del m.comfy_cast_weights, m.weight_function
    _close(out, ref)
    assert accel.stats["region_eager"] == before["region_eager"], accel.text()
    assert accel.stats["region_cast_compiled"] > before["region_cast_compiled"] and accel.stats["ran_resblock"] > 0
    assert (ref - plain).abs().max() > 1e-4, "the weight_function must have mattered"


def _other_packs_ops(module):
    """Give every ComfyUI op under ``module`` a class from "another pack" with its own per-call
    weights (GGUF-style dequantising ops): what compiled code cannot serve. Returns a restore."""
    saved = []
    for m in module.modules():
        if hasattr(m, "forward_comfy_cast_weights"):
            cls = type(m)
            def own_cast(self, *args, _stock=cls.forward_comfy_cast_weights):   # its own function
                return _stock(self, *args)
            own = as_written(type(cls.__name__, (cls,), {"__module__": "other_pack.ops", "comfy_cast_weights": True,
                                                          "forward_comfy_cast_weights": own_cast}))
            saved.append((m, cls))
            m.__class__ = own

    def restore():
        for m, cls in saved:
            m.__class__ = cls
    return restore


def test_warmup_status_counts_regions_that_ran_compiled(make_comfy_model):
    """Every leaf's weights made per call by ops compiled code cannot serve: nothing can run compiled,
    so Warmup Shapes runs nothing and its status says eager, why and the fix, never "compiled"; the
    calls that follow run the model's own code and are counted so ("0 of N"); a plain model says N
    of N."""
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    restore = _other_packs_ops(mp.model.diffusion_model)
    try:
        text = patcher.warmup_model(cm, "1x64x64", 77)
        total = sum(accel.report.regions.values())
        assert "status: eager: every region runs the model's own code" in text and "compiled," not in text, text
        assert "other_pack.ops" in text and "ComfyUI's own loaders" in text, text
        _apply(cm, "sd15")
    finally:
        restore()
    assert accel.ran_compiled() == (0, total) and accel.stats["region_eager_cast"] > 0, accel.text()
    from unet_compiler.compiler.report import warmup_facts
    facts = warmup_facts(accel.report, accel.backend.name, accel.failed, accel.ran_compiled(), accel.cast_eager)
    assert facts["state"] == "fallback" and f"0 of {total} regions ran compiled code" in facts["reason"], facts

    plain, _ = patcher.compile_model(make_comfy_model("sd15"), CFG)
    text = patcher.warmup_model(plain, "1x64x64", 77)
    assert f"status: inductor: compiled, {total} of {total} regions ran compiled code" in text, text


def test_zero_recompiles_after_warmup(make_comfy_model, kind):
    mp = make_comfy_model(kind)
    cm, _ = patcher.compile_model(mp, CFG)
    text = patcher.warmup_model(cm, "1x64x64, 4x128x128", 77)
    accel = patcher.accelerator_of(cm)
    assert "warmed 1x64x64" in text and "warmed 4x128x128" in text
    assert accel.stats["recompiles_after_warmup"] == 0
    for b, h, w in [(1, 8, 8), (2, 8, 8), (4, 16, 16), (3, 12, 8), (2, 16, 10), (1, 10, 14)]:
        out = _apply(cm, kind, b=b, h=h, w=w)
        with accel.bypass():
            ref = _apply(cm, kind, b=b, h=h, w=w)
        _close(out, ref)
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()
    assert "recompiles after warmup: 0" in accel.text()


def test_lora_after_warmup_does_not_recompile(comfy, make_comfy_model):
    """A LoRA added after Warmup Shapes (the soak's workflow: Compile UNet -> Warmup Shapes ->
    LoraLoaderModelOnly -> KSampler), its strength changed, then removed: ComfyUI patches and
    restores weights as new ``requires_grad=False`` Parameters inside the prompt's inference mode,
    which dynamo's guards see. Nothing compiles again inside the warmed range, and each result is
    eager's."""
    import comfy.model_management as mm
    kind = "sd15"
    with torch.inference_mode():   # ComfyUI runs the whole prompt in inference mode: its loader too
        mp = make_comfy_model(kind)
    patches = _lora(comfy, mp, 0.3)
    cm, _ = patcher.compile_model(mp, CFG)
    with torch.inference_mode():
        patcher.warmup_model(cm, "1x64x64, 4x128x128", 77)
    accel = patcher.accelerator_of(cm)
    for strength, shape in ((0.5, dict(b=4, h=16, w=16)), (-0.8, dict(b=3, h=16, w=8)), (0.0, dict(b=1, h=8, w=8)),
                            (1.0, dict(b=2, h=8, w=16))):
        m = cm.clone()
        if strength:
            m.add_patches(patches, strength)
        with torch.inference_mode():
            mm.load_models_gpu([m])
        out = _apply(m, kind, load=False, **shape)
        with accel.bypass():
            ref = _apply(m, kind, load=False, **shape)
        _close(out, ref)
        assert accel.stats["recompiles_after_warmup"] == 0, (strength, shape, accel.recompiles.events)
    assert accel.stats["calls"] >= 4


def test_eager_backend_is_a_noop(make_comfy_model):
    mp = make_comfy_model("sd15")
    cm, text = patcher.compile_model(mp, CompileConfig(backend="eager"))
    _close(_apply(cm, "sd15"), _apply(mp, "sd15"), tol=0)
    assert "backend eager" in text and "none (everything runs the model's own code)" in text


def test_region_graphs_under_comfyui_dispatch(make_comfy_model, kind, graph_standin):
    """ComfyUI's UNetModel through Warmup Shapes and sampling-style calls with every
    region routed through RegionGraphs (conftest's CUDA-graph stand-in: same
    buffer contract, runs on CPU). Uncompiled region bodies,
    so this checks the graph routing of ComfyUI's region inputs (emb, context,
    value=None, transformer_options kept outside), a ControlNet residual that changes
    every call, and that warmup captured what sampling replays."""
    from unet_compiler.compiler import regions as R
    from unet_compiler.compiler.graphs import RegionGraphs
    mp = make_comfy_model(kind)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor", prepack_conv=False, prepack_linear=False))
    accel = patcher.accelerator_of(cm)
    fake = graph_standin()
    accel.graphs = RegionGraphs(graphs=fake)
    accel._install(R.BODIES)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    captured = fake.captures
    assert captured > 0 and "(cuda graph capture)" in text
    unet = cm.model.diffusion_model
    mid = {}
    hook = unet.middle_block[-1].register_forward_hook(lambda m, i, o: mid.__setitem__("shape", o.shape))
    plain = _apply(cm, kind, seed=3)
    hook.remove()
    for seed in (3, 4):
        def control(seed=seed):  # ComfyUI pops the residuals it applies: a fresh dict per call
            return {"middle": [torch.randn(mid["shape"], generator=torch.Generator().manual_seed(seed))]}
        out = _apply(cm, kind, control=control(), seed=seed)
        with accel.bypass():
            ref = _apply(cm, kind, control=control(), seed=seed)
        _close(out, ref)
        if seed == 3:
            assert (out - plain).abs().max() > 1e-3, "the control residual must have mattered"
    assert fake.captures == captured, "sampling at a warmed shape must replay, not capture"
    assert accel.graphs.stats["replays"] > 0 and accel.graphs.off is None


def test_graphs_outlive_a_prompt_and_are_freed_on_unload_or_short_room(make_comfy_model, graph_standin):
    """CUDA graph static buffers are memory ComfyUI's accounting does not see: Compile UNet frees them
    through ComfyUI's own callbacks, on a clone made later too (a LoRA loader's): ON_DETACH when
    ComfyUI unloads the model, and ON_CLEANUP at the end of a prompt's sampling only when the card is
    short of room; otherwise the next prompt replays them (before: every prompt's first step captured
    every region again, 0.27-0.38 s for SDXL on an H100)."""
    from unet_compiler.compiler.graphs import RegionGraphs
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    block = torch.nn.Linear(4, 4).eval()

    def capture():
        with torch.inference_mode():
            for _ in range(2):
                accel.graphs.run(lambda m, x: m(x), block, (torch.randn(2, 4),))
        return accel.graphs.bytes
    fake = graph_standin()
    accel.graphs = RegionGraphs(graphs=fake)
    assert capture() > 0 and fake.captures == 1
    later = cm.clone()   # what a LoRA loader or another patch node hands KSampler
    later.cleanup()      # KSampler's finally, after sampling: room on the card, the graphs stay
    held = accel.graphs.bytes
    assert held > 0 and accel.graphs.released is None
    assert capture() == held and fake.captures == 1          # the next prompt replays
    assert "kept across 1 prompt end(s)" in accel.text()
    fake.short_of_room = lambda device: "300 MiB free on the card, under 12.5% of it"
    later.cleanup()      # a prompt ends with the card short of room
    assert accel.graphs.bytes == 0
    assert accel.graphs.released == "freed at the end of a prompt: 300 MiB free on the card, under 12.5% of it"
    del fake.short_of_room
    assert capture() > 0
    later.detach(unpatch_all=False)   # what every load_models_gpu does to a loaded model: weights stay
    assert accel.graphs.bytes > 0
    later.detach()       # ComfyUI's unload of the model
    assert accel.graphs.bytes == 0 and accel.graphs.released == "ComfyUI unloaded the model"
    assert "freed (ComfyUI unloaded the model)" in accel.text()
    assert not mp.get_all_callbacks("on_cleanup")   # the source patcher got nothing


def test_an_attention_patch_that_casts_gets_fp16s_tolerance_named(make_comfy_model):
    """An attention override that computes in fp16 (KJNodes' sage patch casts q, k and v): its own
    rounding, fed by compiled neighbours, sets warmup's compare, so the gate takes fp16's tolerance
    and the report says which patch made it so; without a patch, the model dtype's and no reason."""
    mp = make_comfy_model("sd15")

    def sage_like(func, q, k, v, *args, **kwargs):
        return func(q.half().float(), k.half().float(), v.half().float(), *args, **kwargs)

    patched = mp.clone()
    patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = sage_like
    cm, _ = patcher.compile_model(patched, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    rep = patcher.accelerator_of(cm).report
    assert rep.diff_tolerance is not None and rep.diff_tolerance >= 5e-2, text
    assert "as an attention patch runs its own code (optimized_attention_override (" in text and "sage_like" in text
    assert "over it: refused" not in text, text
    plain, _ = patcher.compile_model(mp.clone(), CFG)
    text = patcher.warmup_model(plain, "2x64x64", 77)
    rep = patcher.accelerator_of(plain).report
    assert rep.diff_tolerance_why == "" and "attention patch" not in text, text


def test_a_call_with_autograd_on_runs_the_models_own_code(make_comfy_model):
    """ComfyUI's Train LoRA on a clone of a compiled model runs apply_model with autograd on and
    trainable weight wrappers: the call runs the model's own code (the compiled code is for
    inference: its custom ops have no backward), the loss and the adapters' gradients == eager's, and
    the report says why once. (Before: backward raised "no autograd formula was registered".)"""
    import comfy.model_management as mm

    class Delta(torch.nn.Module):
        def __init__(self, shape, seed):
            super().__init__()
            self.d = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.05)

        def forward(self, w):
            return w + self.d.to(w.dtype)

    mp = make_comfy_model("sd15")
    keys = [k for k, _ in mp.model.named_parameters() if k.endswith(".weight") and ("in_layers.2" in k or "ff.net.2" in k)][:4]

    def train_step(m):
        t = m.clone()
        t.model.requires_grad_(False)
        adapters = [Delta(dict(t.model.named_parameters())[k].shape, i) for i, k in enumerate(keys)]
        for k, a in zip(keys, adapters, strict=True):
            t.add_weight_wrapper(k, a)
        x, ts, ctx, kw = _inputs("sd15")
        with torch.inference_mode(False), torch.enable_grad():
            mm.load_models_gpu([t], force_full_load=True)
            out = t.model.apply_model(x.clone(), ts.clone(), c_crossattn=ctx.clone(),
                                      transformer_options=nodes_warmup.sampling_transformer_options(t), **kw)
            loss = (out ** 2).mean()
            loss.backward()
        return loss.detach(), [a.d.grad for a in adapters]

    want_loss, want_grads = train_step(mp)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor", dynamic_shapes=False))
    loss, grads = train_step(cm)
    _close(loss, want_loss)
    for g, w in zip(grads, want_grads, strict=True):
        _close(g, w)
    text = patcher.accelerator_of(cm).text()
    assert "autograd on" in text, text
