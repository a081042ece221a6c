"""compiler/call_graph.py: one CUDA graph per UNet call where nothing in the call needs Python between
its regions, region by region otherwise, with the reason counted.

The graphs run on tests/conftest.py's StrictGraphStandIn (a capture records the aten ops; a replay
re-runs them on the captured tensors, not the model's Python), the regions' own bodies uncompiled:
the graphs are under test, not a compiler."""
from __future__ import annotations

import pytest
import torch

from unet_compiler.compiler.call_graph import CallGraphs
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.compiler.graphs import RegionGraphs

from .test_cuda_graphs import _sample


def _graphed(accel, standin):
    """``accel``'s graphs (per region and per call) on ``standin``, its regions' own bodies."""
    from unet_compiler.compiler import regions as R
    accel.graphs = RegionGraphs(graphs=standin)
    accel.call_graphs = CallGraphs(accel.root, accel.graphs, accel.stats)
    accel._install(R.BODIES)
    return accel


def _diffusers(u, standin):
    from unet_compiler.compiler import compile_unet
    from unet_compiler.compiler.api import accelerator_of
    compile_unet(u, "inductor", prepack_conv=False, prepack_linear=False)
    return _graphed(accelerator_of(u), standin)


def test_a_diffusers_unet_call_is_one_graph(tiny_unet, strict_graph_standin):
    """The diffusers UNet: captured whole on its 2nd call, replayed from the 3rd (its output rebuilt
    as diffusers' output class); == eager on fresh inputs and timesteps; no region graph; a replay
    counts the regions its capture ran; a weight changed in place is read by the next replay, a
    replaced one drops the graph. (Before: 70 region graphs at SD1.5, ComfyUI's dispatch between
    them in Python every call.)"""
    u, ref = tiny_unet(), tiny_unet()
    fake = strict_graph_standin()
    accel = _diffusers(u, fake)
    n = len(accel._shims)
    for s in range(4):
        torch.testing.assert_close(_sample(u, s), _sample(ref, s), rtol=1e-5, atol=1e-5)
        assert len(accel.regions_ran_last) == n
    c = accel.call_graphs.graphs
    assert fake.captures == 1 and c.stats["captured"] == 1 and c.stats["replays"] == 3
    assert accel.graphs.stats["captured"] == 0 and not accel.graphs.skipped
    assert accel.stats["ran_resblock"] == 4 * sum(r.kind == "resblock" for r in accel.plan.regions)
    with torch.no_grad():
        for m in (u, ref):
            m.conv_in.weight.mul_(1.5)                               # in place: the replay reads it
    torch.testing.assert_close(_sample(u, 5), _sample(ref, 5), rtol=1e-5, atol=1e-5)
    assert fake.captures == 1
    for m in (u, ref):
        m.conv_out.weight = torch.nn.Parameter(m.conv_out.weight * 0.5, requires_grad=False)   # replaced
    for s in range(6, 9):
        torch.testing.assert_close(_sample(u, s), _sample(ref, s), rtol=1e-5, atol=1e-5)
    assert c.stats["dropped for new weights"] == 1 and fake.captures == 2
    assert "one graph per UNet call: 2 captured" in accel.text()


def test_a_call_that_needs_python_between_regions_runs_region_by_region(tiny_unet, strict_graph_standin):
    """A forward hook on the model (the call then runs Python between regions): the regions' own
    graphs serve it, the reason counted in the report; once the hook is gone the call is one graph."""
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    hook = u.mid_block.register_forward_hook(lambda m, a, out: None)
    for s in range(3):
        torch.testing.assert_close(_sample(u, s), _sample(ref, s), rtol=1e-5, atol=1e-5)
    assert accel.call_graphs.graphs.stats["captured"] == 0
    assert accel.graphs.stats["captured"] == len(accel._shims)
    assert "UNet calls through the regions' graphs instead: a forward hook runs inside the call x3" in accel.text()
    hook.remove()
    for s in range(3):
        torch.testing.assert_close(_sample(u, s), _sample(ref, s), rtol=1e-5, atol=1e-5)
    assert accel.call_graphs.graphs.stats["captured"] == 1


def test_a_failed_whole_capture_leaves_the_regions_graphs_on(tiny_unet, strict_graph_standin):
    """A UNet call whose capture fails (a host sync inside it, which a CUDA graph cannot hold): the
    whole-call graphs turn off for the model with the reason, every region kind stays compiled, the
    regions' own graphs serve the calls, and every call == eager."""
    u, ref = tiny_unet(), tiny_unet()

    class Synced(type(u.time_embedding)):   # the model's own code, with a host sync (.item()) in it
        def forward(self, sample, condition=None):
            return super().forward(sample, condition) * float(sample.abs().max() > -1)
    u.time_embedding.__class__ = Synced     # (as planned: a class set later runs region by region)
    accel = _diffusers(u, strict_graph_standin())
    for s in range(4):
        torch.testing.assert_close(_sample(u, s), _sample(ref, s), rtol=1e-5, atol=1e-5)
    c = accel.call_graphs.graphs
    assert c.off is not None and "not permitted when stream is capturing" in c.off
    assert not accel.failed and accel.graphs.off is None
    text = accel.text()
    assert "one graph per UNet call: off after a failed capture" in text, text


@pytest.mark.comfy
def test_comfyuis_call_is_one_graph_unless_a_patch_runs(make_comfy_model, strict_graph_standin):
    """ComfyUI's own UNetModel through Compile UNet's patcher: a plain call is one graph; a call with an
    attention patch runs region by region, the reason counted; every call == ComfyUI's eager."""
    from unet_compiler.nodes import patcher

    from ..nodes.test_comfy_patcher import _apply, _close
    base = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(base, CompileConfig(backend="inductor"))
    accel = _graphed(patcher.accelerator_of(cm), strict_graph_standin())
    for _ in range(3):
        got = _apply(cm, "sd15")
        with accel.bypass():
            _close(got, _apply(cm, "sd15", load=False))
    c = accel.call_graphs.graphs
    assert c.stats["captured"] == 1 and c.stats["replays"] == 2 and accel.graphs.stats["captured"] == 0
    patched = cm.clone()
    patched.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
    for _ in range(2):
        got = _apply(patched, "sd15")
        with accel.bypass():
            _close(got, _apply(patched, "sd15", load=False))
    assert accel.call_graphs.skipped["a model patch runs inside the call"] == 2
    text = accel.text()
    assert "a model patch runs inside the call x2" in text, text


@pytest.mark.comfy
def test_a_controlnet_call_is_one_graph(make_comfy_model, strict_graph_standin):
    """A ControlNet's residuals (ComfyUI's ``control`` dict: input and middle lists, a None where a
    block gets none) are tensor inputs of the whole call's graph, which adds each where the capture
    added it: residuals that change every call replay one graph; a call without them (a ControlNet
    outside its step range) is its own graph; every call == ComfyUI's eager. (Before: every call with
    a ControlNet ran region by region, "ControlNet adds its residuals inside the call".)"""
    from unet_compiler.nodes import patcher

    from ..nodes.test_comfy_patcher import _apply, _close
    base = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(base, CompileConfig(backend="inductor"))
    unet = cm.model.diffusion_model
    shapes = {}
    hooks = [b[-1].register_forward_hook(lambda m, i, o, n=n: shapes.__setitem__(n, o.shape))
             for n, b in list(enumerate(unet.input_blocks)) + [("mid", unet.middle_block)]]
    plain = _apply(cm, "sd15")
    for h in hooks:
        h.remove()
    accel = _graphed(patcher.accelerator_of(cm), strict_graph_standin())

    def control(seed):   # a fresh dict per call, as ComfyUI's ControlNet makes (the UNet pops what it adds)
        g = torch.Generator().manual_seed(seed)
        ins = [torch.randn(shapes[i], generator=g) if i % 3 else None for i in range(len(unet.input_blocks))]
        return {"input": list(reversed(ins)), "middle": [torch.randn(shapes["mid"], generator=g)], "output": []}
    c = accel.call_graphs
    for seed in range(4):
        got = _apply(cm, "sd15", control=control(seed))
        with accel.bypass():
            _close(got, _apply(cm, "sd15", control=control(seed), load=False))
        assert (got - plain).abs().max() > 1e-3, "the residuals must have mattered"
    # the first call runs, the second captures (and replays), the others replay
    assert c.graphs.stats["captured"] == 1 and c.graphs.stats["replays"] == 3, accel.text()
    assert not c.skipped and accel.graphs.stats["captured"] == 0, accel.text()
    for _ in range(3):
        got = _apply(cm, "sd15")
        with accel.bypass():
            _close(got, _apply(cm, "sd15", load=False))
    assert c.graphs.stats["captured"] == 2 and c.graphs.stats["replays"] == 5, accel.text()


@pytest.mark.comfy
def test_no_call_graph_while_comfyuis_compiler_keeps_a_recording(make_comfy_model, strict_graph_standin):
    """A model ComfyUI's compiler records (its forward in ``malloc_graph_scope``): between two
    forwards the recording is kept, not active; a graph captured around the forward would hold
    addresses the recorder hands out again, so every call runs region by region, the reason counted;
    == eager."""
    from unet_compiler.nodes import patcher
    from unet_compiler.tests._comfy_compiler import ComfyCompiler

    from ..nodes.test_comfy_patcher import _apply, _close
    base = make_comfy_model("sd15")
    with ComfyCompiler(assert_graph_breaks=True).installed() as compiler:
        ComfyCompiler.opt_in(base.model.diffusion_model)
        cm, _ = patcher.compile_model(base, CompileConfig(backend="inductor"))
        accel = _graphed(patcher.accelerator_of(cm), strict_graph_standin())
        got = [_apply(cm, "sd15") for _ in range(3)]         # one node (a KSampler's steps) ...
        compiler.cleanup()
        with accel.bypass():                                    # ... and another
            want = _apply(cm, "sd15", load=False)
        for g in got:
            _close(g, want)
        assert not compiler.breaks()
    assert accel.call_graphs.graphs.stats["captured"] == 0
    assert accel.call_graphs.skipped["ComfyUI's compiler records the model's allocations"] >= 2, accel.text()


def test_what_in_a_comfyui_call_needs_python_between_regions():
    """A patch or replace patch, a diffusion-model wrapper and an attention override each keep the call
    region by region; empty tables, ComfyUI's sampling entries, a wrapper of another kind and
    ControlNet's residuals do not."""
    from unet_compiler.compiler.call_graph import call_problem
    plain = dict(patches={}, patches_replace={}, wrappers={"outer_sample": {"k": [print]}}, sigmas=torch.ones(1),
                 cond_or_uncond=[0, 1])
    assert call_problem(dict(control=None, transformer_options=plain)) is None
    assert call_problem(dict(control={"middle": [torch.zeros(1)]})) is None   # (tensor inputs: see below)
    assert "patch" in call_problem(dict(transformer_options=dict(plain, patches={"output_block_patch": [print]})))
    assert "patch" in call_problem(dict(transformer_options=dict(plain, patches_replace={"attn1": {("input", 1): print}})))
    assert "wrapper" in call_problem(dict(transformer_options=dict(plain, wrappers={"diffusion_model": {"k": [print]}})))
    assert "override" in call_problem(dict(transformer_options=dict(plain, optimized_attention_override=print)))


def test_a_call_whose_graph_is_not_kept_uses_the_regions_graphs(tiny_unet, strict_graph_standin):
    """A UNet call that gets no whole graph after its first run (here: the whole graph's memory budget
    is spent; likewise a graph backend auto measured no faster) runs its launches through the regions'
    own graphs, not their bare code; == eager."""
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    accel.call_graphs.graphs.budget, accel.call_graphs.graphs._budget_known = 1, True
    for s in range(4):
        torch.testing.assert_close(_sample(u, s), _sample(ref, s), rtol=1e-5, atol=1e-5)
    c = accel.call_graphs.graphs
    assert c.stats["captured"] == 0 and any("budget" in why for why in c.skipped)
    assert accel.graphs.stats["captured"] == len(accel._shims) and accel.graphs.stats["replays"] > 0
    assert "UNet calls through the regions' graphs instead: graph memory at its budget" in accel.text()


def test_warmups_kind_timing_captures_no_whole_call(tiny_unet, strict_graph_standin, monkeypatch):
    """Warmup's timing of each region kind on the model's own code (backend auto on CUDA) runs region
    by region, uncounted: a trial state captured whole would take one of a region's 4 shapes. After
    it, calls are one graph again."""
    import importlib
    from unet_compiler.compiler.shapes import Shape
    warmup = importlib.import_module("unet_compiler.compiler.warmup")
    monkeypatch.setattr(warmup, "FASTER_BY", 1.0)   # no kind is closed (its timing is not under test)
    u = tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    for s in range(3):
        _sample(u, s)
    c = accel.call_graphs
    assert c.graphs.stats["captured"] == 1
    warmup.keep_the_faster(accel, lambda shape: _sample(u, 0), Shape(2, 64, 64), reps=2)
    assert c.graphs.stats["captured"] == 1 and not c.skipped and not c.graphs.skipped and not c.held_back
    replays = c.graphs.stats["replays"]
    _sample(u, 1)
    assert c.graphs.stats["replays"] == replays + 1


class _Motion(torch.nn.Module):   # a module another pack puts into a block (AnimateDiff's motion module)
    def forward(self, x, *a, **k):
        return x * 1.5


@pytest.mark.comfy
@pytest.mark.parametrize("whole", [True, False], ids=["one graph per call", "region graphs"])
def test_graphs_follow_modules_swapped_inserted_or_taken_out(make_comfy_model, strict_graph_standin, whole):
    """Graphs captured before a module of the UNet changed are not replayed after it: a module inserted
    into a block (AnimateDiff injects its motion modules), taken out again, the same one put back,
    and ComfyUI's object patch swapping a submodule for a prompt (``add_object_patch``, set with
    ``setattr``), each checked against ComfyUI's eager after graphs were captured. (Before: the whole
    call's graph replayed over every change, 1.6 to 5.9 off an output of scale 5; the region graphs
    over the swap.)"""
    import copy

    from unet_compiler.compiler import graphs as graphs_module
    from unet_compiler.compiler import regions as R
    from unet_compiler.nodes import patcher

    from ..nodes.test_comfy_patcher import _apply, _close
    base = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(base, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    if whole:
        _graphed(accel, strict_graph_standin())
    else:
        accel.graphs, accel.call_graphs = RegionGraphs(graphs=strict_graph_standin()), None
        accel._install(R.BODIES)
    graphs = accel.call_graphs.graphs if whole else accel.graphs
    block, motion = cm.model.diffusion_model.input_blocks[1], _Motion()

    def calls(mp, n=3):
        for _ in range(n):
            got = _apply(mp, "sd15")
            with accel.bypass():
                _close(got, _apply(mp, "sd15", load=False))

    calls(cm)
    for change in ("insert", "take out", "put back", "swap"):
        before = graphs.stats["replays"]
        mp = cm
        if change in ("insert", "put back"):
            block.append(motion)
        elif change == "take out":
            del block[len(block) - 1]
        else:
            new = copy.deepcopy(cm.model.diffusion_model.out[2])
            with torch.no_grad():
                new.weight.mul_(-1.0)
            mp = cm.clone()
            mp.add_object_patch("diffusion_model.out.2", new)
        calls(mp)
        assert graphs.stats["replays"] > before, f"{change}: the graphs were captured again and replayed"
    moved = graphs_module.STRUCTURE[0]   # (a load moves it: ComfyUI sets its object patches again)
    for _ in range(2):
        _apply(mp, "sd15", load=False)
    assert graphs_module.STRUCTURE[0] == moved, "a call that changed nothing must not make the graphs look again"
    # the whole call's graph at each change; of the regions only the one the swapped module is in (a
    # module inserted between regions runs as it is)
    assert graphs.stats["dropped for changed modules"] == (4 if whole else 1), graphs.stats


def test_the_structure_watch_keeps_precompiled_variants_and_other_modules_working():
    """The graphs' structure watch is a global module-registration hook: it only counts, so precompiled
    region variants (which refuse hooks that could change a module) stay on, and a module class that
    is not hashable still takes submodules. (Before the mark: any variant key read None once a model
    with graphs had run, and every background compile went to the calling thread.)"""
    from unet_compiler.compiler import graphs as graphs_module
    from unet_compiler.compiler.lifecycle import variants

    graphs_module.track([])
    lin = torch.nn.Linear(2, 2)
    assert variants.structure(lin, (torch.zeros(1, 2),)) is not None

    class Unhashable(torch.nn.Module):
        def __eq__(self, other):
            return self is other
    u = Unhashable()
    u.child = torch.nn.Linear(2, 2)      # the hook sees it, and lets it be
    graphs_module.track([u])
    assert isinstance(u.child, torch.nn.Linear)
