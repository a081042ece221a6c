"""Modules another pack inserts into the UNet: AnimateDiff-Evolved's real motion modules
(``VanillaTemporalModule``, its own ``_inject``) put into ComfyUI's tiny SD1.5 through ComfyUI's
patcher injections (inserted at load, as its loaders do), before and after Compile UNet.

They are no regions: they run as they are, the report names them, and the result is the same
model's without the pack; Warmup Shapes calls them only with whole videos (batches a multiple of
their video length) and says which entry to give for one it leaves out."""
import pytest

from tests import _ade
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher

from .test_comfy_patcher import _apply, _close

pytestmark = pytest.mark.comfy
CFG = CompileConfig(backend="inductor")
FRAMES = 4


@pytest.fixture(scope="module")
def mm(comfy):
    why = _ade.problem(comfy.path)
    if why:
        pytest.skip(why)
    return _ade.load(comfy.path)


def _with_motion(mm, mp):
    """A clone of ``mp`` with motion modules injected at load (what AnimateDiff's loader returns)."""
    ade = mp.clone()
    injection, modules = _ade.motion_injection(mm, mp.model.diffusion_model, FRAMES)
    ade.set_injections(_ade.KEY, [injection])
    return ade, modules


def _named(accel):
    text = accel.text()
    assert "inserted into the model after it was planned run as they are" in text, text
    assert "VanillaTemporalModule" in text, text


@pytest.mark.parametrize("order", ["compile_then_motion", "motion_then_compile"])
def test_motion_modules_run_as_they_are_and_are_named(make_comfy_model, mm, order):
    """Both orders: a call of 2 videos x FRAMES frames == the same model without the pack, the motion
    modules mattered, every UNet region ran compiled code, and the report names the modules."""
    mp = make_comfy_model("sd15")
    plain = _apply(mp, "sd15", b=2 * FRAMES)
    ref_model, _ = _with_motion(mm, mp)
    ref = _apply(ref_model, "sd15", b=2 * FRAMES)
    assert (ref - plain).abs().max() > 1e-3, "the motion modules must matter"
    ref_model.detach()        # (its modules out of the shared UNet again)
    if order == "compile_then_motion":
        cm, _ = patcher.compile_model(mp, CFG)
        model, _ = _with_motion(mm, cm)
    else:
        ade, _ = _with_motion(mm, mp)
        model, _ = patcher.compile_model(ade, CFG)
    out = _apply(model, "sd15", b=2 * FRAMES)
    _close(out, ref)
    accel = patcher.accelerator_of(model)
    ran, total = accel.ran_compiled()
    assert ran == total > 0 and accel.stats["region_eager"] == 0, accel.text()
    _named(accel)
    assert accel.inserted.found and sum(accel.inserted.found.values()) == 7, accel.inserted.found
    model.detach()


def test_warmup_calls_whole_videos_and_names_the_entry_to_give(make_comfy_model, mm):
    """Warmup Shapes on a model with motion modules of video length FRAMES: an entry whose batch is
    no multiple of FRAMES is left out, with the entry to give; the others warm (probes at whole
    videos too) and sampling-style calls then compile nothing; no "could not be called" stop."""
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    model, _ = _with_motion(mm, cm)
    text = patcher.warmup_model(model, "2x64x64, 8x64x64, 8x96x64", 77)
    accel = patcher.accelerator_of(model)
    assert "warmup stopped" not in text, text
    assert "warmup entry 2x64x64 left out" in text and f"give {2 * FRAMES}x64x64" in text, text
    assert "warmed 8x64x64" in text and "warmed 8x96x64" in text, text
    compiled = accel.stats["graphs_compiled"]
    for b, h, w in ((2 * FRAMES, 8, 8), (FRAMES, 12, 8)):
        with accel.bypass():
            ref = _apply(model, "sd15", load=False, b=b, h=h, w=w)
        _close(_apply(model, "sd15", load=False, b=b, h=h, w=w), ref)
    assert accel.stats["graphs_compiled"] == compiled and accel.stats["recompiles_after_warmup"] == 0, accel.text()
    _named(accel)
    model.detach()


def test_every_entry_left_out_says_so_without_a_call(make_comfy_model, mm):
    """No entry of whole videos: nothing is called, the status says why and each entry's fix."""
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    model, _ = _with_motion(mm, cm)
    calls = []
    hook = mp.model.diffusion_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        text = patcher.warmup_model(model, "1x64x64, 2x64x64", 77)
    finally:
        hook.remove()
    assert calls == [], f"{len(calls)} call(s) made"
    assert f"no entry's batch is a multiple of the {FRAMES} frames" in text, text
    assert f"give {2 * FRAMES}x64x64" in text, text
    model.detach()


def _with_context_windows(mm, model, frames: int):
    """``model`` with AnimateDiff-Evolved's own injection params set as its loader sets them: context
    options of ``frames``-frame windows (its Standard Uniform node's options), in the attachment its
    sampling reads."""
    from tests import _ade
    context = _ade.load(module="context")
    injection = _ade.load(module="model_injection")
    group = context.ContextOptionsGroup()
    group.add(context.ContextOptions(context_length=frames, context_stride=1, context_overlap=1,
                                     context_schedule=context.ContextSchedules.UNIFORM_STANDARD))
    params = injection.InjectionParams()
    params.set_context(group)
    injection.ModelPatcherHelper(model).set_params(params)


def test_warmup_calls_whole_videos_of_the_context_windows(make_comfy_model, mm):
    """With AnimateDiff-Evolved's context windows of 2 frames on a model whose motion modules last
    held 4: sampling calls them one window (2 frames) at a time, so warmup does too: 6x64x64 (3
    windows) warms, the modules take 2 frames in its calls and hold 4 again after; an odd batch is
    left out naming the window."""
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    model, modules = _with_motion(mm, cm)
    _with_context_windows(mm, model, 2)
    seen = []
    hook = modules[0].register_forward_pre_hook(lambda m, a: seen.append(m.video_length))
    try:
        text = patcher.warmup_model(model, "6x64x64, 3x64x64", 77)
    finally:
        hook.remove()
    assert "warmup stopped" not in text and "warmed 6x64x64" in text, text
    assert "warmup entry 3x64x64 left out" in text and "its context windows" in text and "give 4x64x64" in text, text
    assert seen and set(seen) == {2}, seen
    assert {m.video_length for m in modules} == {FRAMES} and {m.full_length for m in modules} == {FRAMES}
    model.detach()


def test_motion_modules_in_the_model_when_planned_take_whole_videos_too(make_comfy_model, mm):
    """Compile UNet after the motion modules are in the loaded model (they are planned with it):
    warmup still gives them whole videos and names the entry to give for one it leaves out."""
    mp = make_comfy_model("sd15")
    ade, _ = _with_motion(mm, mp)
    import comfy.model_management
    comfy.model_management.load_models_gpu([ade])      # injected at load: in the model when planned
    model, _ = patcher.compile_model(ade, CFG)
    text = patcher.warmup_model(model, "2x64x64, 8x64x64", 77)
    assert "warmup stopped" not in text and "warmed 8x64x64" in text, text
    assert "warmup entry 2x64x64 left out" in text and f"give {2 * FRAMES}x64x64" in text, text
    model.detach()


def test_the_groupnorm_hack_of_v1_motion_models_runs(make_comfy_model, mm, comfy):
    """AnimateDiff-Evolved's GroupNorm hack (v1 motion models, PIA): its diffusion-model wrapper sets
    ``torch.nn.GroupNorm.forward`` (groups normalised over all of a video's frames) for the call, its
    own ``groupnorm_mm_factory`` and ``GroupnormInjectHelper``. Compiled before the hack was set: before,
    the compiled regions kept the plain GroupNorm they traced (off by the hack's whole effect). Now the
    regions with a GroupNorm run the model's own code with it, == the same model without the pack, and
    the report names the method; the class's own method is back after the call."""
    import types

    import torch
    sampling = _ade.load(comfy.path, module="sampling")
    planned = torch.nn.GroupNorm.forward
    params = types.SimpleNamespace(is_using_sliding_context=lambda: False, full_length=FRAMES)
    holder = types.SimpleNamespace(
        inject_groupnorm_forward=sampling.groupnorm_mm_factory(params),
        inject_groupnorm_forward_comfy_cast_weights=sampling.groupnorm_mm_factory(params, manual_cast=True))

    def hacked(mp):
        out = mp.clone()
        sampling.create_diffusion_model_groupnormed_wrapper(out.model_options, sampling.GroupnormInjectHelper(holder))
        return out
    mp = make_comfy_model("sd15")
    plain = _apply(mp, "sd15", b=2 * FRAMES)
    ref = _apply(hacked(mp), "sd15", b=2 * FRAMES)
    assert (ref - plain).abs().max() > 1e-3, "the hack must matter"
    cm, _ = patcher.compile_model(mp, CFG)
    _close(_apply(cm, "sd15", b=2 * FRAMES), plain)
    model = hacked(cm)
    _close(_apply(model, "sd15", b=2 * FRAMES), ref)
    assert torch.nn.GroupNorm.forward is planned
    accel = patcher.accelerator_of(model)
    text = accel.text()
    norms = sum(any(isinstance(m, torch.nn.GroupNorm) for m in r.module.modules()) for r in accel.plan.regions)
    assert "another node set comfy.ops.disable_weight_init.GroupNorm.forward_comfy_cast_weights: " \
           f"{norms} regions run the model's own code" in text, text   # (the first of the two, one line)
    assert accel.stats["region_eager_overridden"] > 0 and accel.stats["ran_attention"] > 0, accel.stats
    _close(_apply(cm, "sd15", b=2 * FRAMES), plain)
    model.detach()


def test_the_groupnorm_hack_runs_with_graphs_captured_before_it(make_comfy_model, mm, comfy, strict_graph_standin):
    """The same hack with CUDA graphs (the stand-in: a replay re-runs the recorded ops, no Python) and
    one graph per UNet call, as on a GPU: the regions' graphs were captured without it (earlier
    calls with another diffusion-model wrapper went region by region). Before, the classes were
    checked at the one-graph decision, before ComfyUI ran the wrappers inside the model's forward:
    the graphs replayed the plain GroupNorm (0.96-2.14 off). Now they are checked again at the first
    region call: every call == the reference, each region with a GroupNorm on the model's own code."""
    import types

    from unet_compiler.compiler.call_graph import CallGraphs
    from unet_compiler.compiler.graphs import RegionGraphs
    sampling = _ade.load(comfy.path, module="sampling")
    params = types.SimpleNamespace(is_using_sliding_context=lambda: False, full_length=FRAMES)
    holder = types.SimpleNamespace(
        inject_groupnorm_forward=sampling.groupnorm_mm_factory(params),
        inject_groupnorm_forward_comfy_cast_weights=sampling.groupnorm_mm_factory(params, manual_cast=True))

    def wrapped(mp, hack):
        out = mp.clone()
        if hack:
            sampling.create_diffusion_model_groupnormed_wrapper(out.model_options, sampling.GroupnormInjectHelper(holder))
        else:
            comfy.ext.add_wrapper_with_key(comfy.ext.WrappersMP.DIFFUSION_MODEL, "plain", lambda ex, *a, **k: ex(*a, **k),
                                           out.model_options, is_model_options=True)
        return out
    mp = make_comfy_model("sd15")
    plain = _apply(mp, "sd15", b=2 * FRAMES)
    ref = _apply(wrapped(mp, True), "sd15", b=2 * FRAMES)
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    accel.graphs = RegionGraphs(graphs=strict_graph_standin())
    accel.call_graphs = CallGraphs(accel.root, accel.graphs, accel.stats)
    for _ in range(3):
        _close(_apply(wrapped(cm, False), "sd15", b=2 * FRAMES), plain)
    assert accel.graphs.stats["replays"] > 0 and accel.stats["region_eager_overridden"] == 0
    model = wrapped(cm, True)
    for _ in range(3):
        _close(_apply(model, "sd15", b=2 * FRAMES), ref)
    with_norm = accel.stats["region_eager_overridden"]
    assert with_norm and with_norm % 3 == 0, accel.stats
    model.detach()
