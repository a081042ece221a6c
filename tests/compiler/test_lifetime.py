"""Memory and lifetime: a model that is dropped takes everything the pack made for it along.

A UNet the caller (a diffusers script) or ComfyUI (its patcher and every clone) lets go of is
freed at once, by reference counting, as an uncompiled model is, never left to Python's cyclic
collector: with it go its accelerator, the prepacked copies of its weights (the DerivedCaches of
passes/prepack_conv.py and prepack_linear.py) and its CUDA-graph buffers. What the pack keeps per
process, the compiled region bodies (dynamo's caches, shared by every model), does not pin it, and
compiling, running and dropping ten clones leaves every count of the pack's objects where it was.

By default the regions are traced by dynamo with the pack's own graph passes (the prepacked
conv / linear custom ops, so the prepack caches fill as in production), and the traced graph runs
as is instead of going through inductor's code generation (seconds instead of a minute here); the
``inductor`` case runs the real backend."""
from __future__ import annotations

import contextlib
import gc
import types
import weakref
from collections import Counter

import pytest
import torch

from unet_compiler.compiler import api
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.compiler.graphs import RegionGraphs
from unet_compiler.compiler.passes import prepack_conv, prepack_linear
from unet_compiler.compiler.runtime import Accelerator
from unet_compiler.compiler.lifecycle.scheduler import process_scheduler

#: static shapes: tracing symbolic shapes costs ~25 s here, and lifetime does not depend on them
CFG = CompileConfig(backend="inductor", dynamic_shapes=False)
CACHES = {"prepack_conv": prepack_conv._cache, "prepack_linear": prepack_linear._cache}


# ---- helpers ----------------------------------------------------------------------------------
@pytest.fixture
def traced_regions(monkeypatch):
    """The inductor backend's region bodies compiled by dynamo with the pack's graph passes, the
    traced graph run as is (no inductor codegen). Fresh copies of the bodies (their own code
    objects, so their dynamo caches are this test's), kept for the whole test as the process-wide
    compiled bodies are kept: returns {(body, options): compiled}."""
    from unet_compiler.compiler.backends import inductor

    # the precompiled path compiles with inductor itself; here every body goes through the stand-in
    monkeypatch.setenv("UNET_COMPILER_PRECOMPILE", "off")
    made = {}

    def backend_for(prepack, lin):
        def unet_compiler_traced(gm, example_inputs):
            if prepack:
                prepack_conv.rewrite_graph(gm)
            if lin:
                prepack_linear.rewrite_graph(gm)
            return gm.forward
        return unet_compiler_traced

    def compiled_body(body, dynamic, prepack, prepack_lin=False):
        key = (body, dynamic, prepack, prepack_lin)
        if key not in made:
            fresh = types.FunctionType(body.__code__.replace(), body.__globals__, body.__name__,
                                       body.__defaults__, body.__closure__)
            fresh.__kwdefaults__ = body.__kwdefaults__   # the bodies' keyword-only ops=TORCH_OPS
            made[key] = torch.compile(fresh, backend=backend_for(prepack, prepack_lin), dynamic=dynamic)
        return made[key]
    monkeypatch.setattr(inductor, "compiled_body", compiled_body)
    return made


@pytest.fixture(params=["traced", pytest.param("inductor", marks=pytest.mark.slow)])
def regions(request):
    """How the regions compile: ``traced`` (see ``traced_regions``) or the real inductor backend
    (~1 min on 2 CPU cores when nothing compiled the tiny UNet's bodies earlier in the process)."""
    if request.param == "traced":
        request.getfixturevalue("traced_regions")
    return request.param


def dynamo_entries(compiled_fns) -> int:
    """Compiled graphs dynamo holds for these torch.compile'd functions (and the process's
    precompiled region variants, where they are precompiled bodies)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from unet_compiler.compiler.lifecycle import precompiled
    n = sum(len(_debug_get_cache_entry_list(f._torchdynamo_orig_callable.__code__))
            for f in compiled_fns if hasattr(f, "_torchdynamo_orig_callable"))
    if any(isinstance(f, precompiled.Precompiled) for f in compiled_fns):
        n += sum(len(v) for v in process_scheduler().variants.live.values())
    return n


@contextlib.contextmanager
def no_cyclic_gc():
    """Inside: only reference counting frees objects (what a cycle keeps stays until the end)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def cache_keys() -> dict:
    return {name: set(c._cache) for name, c in CACHES.items()}


def pack_objects() -> Counter:
    """Live objects of the pack's own classes, and the pack's live closures (region shims,
    apply_model wrappers, hooks), by name."""
    out: Counter = Counter()
    for o in gc.get_objects():
        t = type(o)
        module = getattr(t, "__module__", None)
        if isinstance(module, str) and module.startswith("unet_compiler"):
            out[t.__qualname__] += 1
        elif t is types.FunctionType and o.__closure__ and (o.__module__ or "").startswith("unet_compiler"):
            out[o.__qualname__] += 1
    return out


def rss_mib() -> float:
    psutil = pytest.importorskip("psutil")
    return psutil.Process().memory_info().rss / 2**20


# ---- (a) the diffusers API -----------------------------------------------------------------
def test_a_dropped_unet_is_freed_with_its_prepacked_weights(tiny_unet, regions):
    """compile_unet + warmup + a forward, then the caller drops the UNet: it is freed at once (no
    cyclic collection needed), with its accelerator and every prepacked copy of its weights, while
    dynamo still holds the compiled region code (that code is process-wide, not the model's)."""
    before = cache_keys()
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", dynamic_shapes=False, prepack_linear=True)
    api.warmup(unet, "1x64x64", context_tokens=6)
    with torch.no_grad():
        unet(torch.randn(1, 4, 8, 8), torch.tensor([10.0]), torch.randn(1, 6, 32))
    accel = api.accelerator_of(unet)
    assert accel.stats["ran_resblock"] > 0 and accel.stats["ran_attention"] > 0, accel.stats
    weights = {id(p) for p in unet.parameters()}
    held = {name: keys & weights for name, keys in cache_keys().items()}
    assert held["prepack_conv"] and held["prepack_linear"], "the passes prepacked this UNet's weights"
    from unet_compiler.compiler import weights as W
    assert W.SCRATCH._buf is None, "the packing scratch buffer outlived the UNet call"
    bodies = list(accel.backend.impls(accel.config, accel.scheduler).values())   # the compiled region bodies it ran
    graphs = dynamo_entries(bodies)
    assert graphs > 0
    unet_ref, accel_ref = weakref.ref(unet), weakref.ref(accel)

    with no_cyclic_gc():
        del unet, accel
        assert unet_ref() is None, "the UNet outlived its last reference (a reference cycle through the pack)"
        assert accel_ref() is None, "the accelerator outlived its UNet"
    gc.collect()
    for name, keys in cache_keys().items():
        assert keys <= before[name], f"{name} still holds packed copies of a dropped UNet's weights"
    assert dynamo_entries(bodies) == graphs, "dynamo's compiled code stays (and did not pin it)"


def test_uncompile_then_drop_frees_it(tiny_unet, traced_regions):
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", dynamic_shapes=False)
    with torch.no_grad():
        unet(torch.randn(1, 4, 8, 8), torch.tensor([10.0]), torch.randn(1, 6, 32))
    api.uncompile_unet(unet)
    ref = weakref.ref(unet)
    with no_cyclic_gc():
        del unet
        assert ref() is None


# ---- (b) ComfyUI: a compiled patcher and its clones -------------------------------------------
def _apply(mp, b=2, tokens=77):
    import comfy.model_management as mm
    from unet_compiler.nodes import warmup as nodes_warmup
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        x, ctx = torch.randn(b, 4, 8, 8, generator=g), torch.randn(b, tokens, 64, generator=g)
    mm.load_models_gpu([mp])
    to = nodes_warmup.sampling_transformer_options(mp)
    with torch.inference_mode():
        return mp.model.apply_model(x, torch.full((b,), 2.0), c_crossattn=ctx, transformer_options=to)


def _drop_from_comfy():
    """What ComfyUI does with models nothing uses any more (model_management's cleanup)."""
    import comfy.model_management as mm
    mm.cleanup_models_gc()
    mm.cleanup_models()
    assert all(m.model is not None for m in mm.current_loaded_models)


@pytest.mark.comfy
def test_an_unloaded_comfy_model_is_freed_with_its_clones(make_comfy_model, traced_regions):
    """Compile UNet (the node's function, with its node feedback), Warmup Shapes, a sampling call,
    a clone of the compiled model run too; then ComfyUI drops the patchers: the diffusion model
    is freed at once, as an uncompiled one is, and ComfyUI's own leak check stays quiet."""
    from unet_compiler.nodes import patcher

    plain = make_comfy_model("sd15", seed=3)
    _apply(plain)
    plain_ref = weakref.ref(plain.model.diffusion_model)
    with no_cyclic_gc():
        del plain
        assert plain_ref() is None, "control: ComfyUI frees an uncompiled model by reference counting"

    before = cache_keys()
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, CFG, node_id="5")
    patcher.warmup_model(cm, "2x64x64", 77, node_id="6")
    _apply(cm)
    clone = cm.clone()
    _apply(clone)
    accel = patcher.accelerator_of(clone)
    assert accel is patcher.accelerator_of(cm) and accel.stats["ran_resblock"] > 0, accel.stats
    unet_ref, base_ref, accel_ref = weakref.ref(mp.model.diffusion_model), weakref.ref(mp.model), weakref.ref(accel)
    del accel
    with no_cyclic_gc():
        del mp, cm, clone
        assert base_ref() is None
        assert unet_ref() is None, "the diffusion model outlived its patchers (a reference cycle through the pack)"
        assert accel_ref() is None
    _drop_from_comfy()
    for name, keys in cache_keys().items():
        assert keys <= before[name], f"{name} still holds packed copies of a dropped model's weights"


# ---- (c) ten clones: no growth ---------------------------------------------------------------
@pytest.mark.comfy
def test_ten_compiled_clones_leave_nothing_behind(make_comfy_model, traced_regions):
    """One loaded model, Compile UNet ten times (a clone each), each run and cloned once more, then
    dropped: after the 3rd and the 10th nothing of the pack's has grown (its objects and closures,
    prepack cache entries, pending finalizers, dynamo's compiled graphs, ComfyUI's loaded models),
    no accelerator is alive, and resident memory grew by less than a generous bound."""
    import comfy.model_management as mm
    from unet_compiler.nodes import patcher

    base = make_comfy_model("sd15")
    _apply(base)

    def counts():
        gc.collect()
        return {"pack objects": pack_objects(), "accelerators": sum(type(o) is Accelerator for o in gc.get_objects()),
                **{f"{n} entries": len(c._cache) for n, c in CACHES.items()},
                "finalizers": len(weakref.finalize._registry), "dynamo graphs": dynamo_entries(traced_regions.values()),
                "loaded models": len(mm.current_loaded_models)}

    seen, rss = {}, {}
    for i in range(1, 11):
        cm, _ = patcher.compile_model(base, CFG, node_id=str(i))
        _apply(cm)
        clone = cm.clone()
        _apply(clone)
        assert patcher.accelerator_of(clone).stats["ran_resblock"] > 0
        del cm, clone
        _drop_from_comfy()
        if i in (3, 10):
            seen[i], rss[i] = counts(), rss_mib()
    assert seen[3]["accelerators"] == 0, seen[3]
    assert seen[10] == seen[3], {k: (seen[3][k], seen[10][k]) for k in seen[3] if seen[3][k] != seen[10][k]}
    assert rss[10] - rss[3] < 64, f"resident memory grew {rss[10] - rss[3]:.0f} MiB over 7 compiled clones"


# ---- CUDA-graph buffers ----------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


def _body(block, x):
    return type(block).forward(block, x)


class _Capture:
    """A capture that, like torch.cuda.CUDAGraph, keeps no Python reference to what it captured."""

    def usable(self, tensors):
        return None

    def first_call(self, fn, device):
        return fn()

    def capture(self, fn, device):
        return types.SimpleNamespace(replay=lambda: None), fn()


def test_cuda_graph_buffers_go_with_their_region():
    """RegionGraphs' per-region graphs and static buffers are keyed weakly: a region module that
    dies (its model dropped, or the module replaced) takes them along, and a new module that gets
    the dead one's id() does not find its graphs."""
    graphs = RegionGraphs(graphs=_Capture())
    blocks = [_Block() for _ in range(3)]
    x = torch.randn(2, 8)
    with torch.inference_mode():     # graphs need autograd off
        for i in range(len(blocks)):
            for _ in range(2):       # the 2nd call at a shape captures
                graphs.run(_body, blocks[i], (x,))
    assert graphs.stats["captured"] == 3 and len(graphs.regions) == 3 and graphs.bytes > 0
    per_region = graphs.bytes // 3
    ref = weakref.ref(blocks[0])
    with no_cyclic_gc():
        del blocks[0]
        assert ref() is None, "the graphs' bookkeeping kept their region module alive"
        assert len(graphs.regions) == 2 and graphs.bytes == 2 * per_region
    blocks.clear()
    assert len(graphs.regions) == 0 and graphs.bytes == 0


def test_an_accelerators_cuda_graphs_go_with_its_unet(tiny_unet, graph_standin):
    """The runtime path: a tiny UNet's regions through RegionGraphs (the GPU-free stand-in), then
    the UNet dropped: the accelerator and its RegionGraphs are freed at once."""
    from unet_compiler.compiler import regions as R
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", prepack_conv=False, prepack_linear=False)
    accel = api.accelerator_of(unet)
    accel.graphs = RegionGraphs(graphs=graph_standin())
    accel._install(R.BODIES)
    with torch.inference_mode():
        for _ in range(2):
            unet(torch.randn(2, 4, 8, 8), torch.full((2,), 10.0), torch.randn(2, 6, 32))
    assert accel.graphs.stats["captured"] == len(accel._shims) > 0 and accel.graphs.bytes > 0
    graphs_ref = weakref.ref(accel.graphs)
    del accel
    with no_cyclic_gc():
        del unet
        assert graphs_ref() is None, "CUDA-graph buffers outlived their UNet"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: real CUDA-graph buffers are checked on GPU machines")
def test_real_cuda_graph_memory_is_returned(tiny_unet):
    unet = tiny_unet().cuda()
    api.compile_unet(unet, "inductor", cuda_graphs=True)
    accel = api.accelerator_of(unet)
    if accel.graphs is None:
        pytest.skip("cuda graphs refused here: " + accel.text())
    torch.cuda.synchronize()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)
    clear_workspaces()   # cuBLAS keeps a workspace per stream for the process: not the graphs' memory
    floor = torch.cuda.memory_allocated()
    with torch.inference_mode():
        for _ in range(3):
            unet(torch.randn(2, 4, 8, 8, device="cuda"), torch.full((2,), 10.0, device="cuda"),
                 torch.randn(2, 6, 32, device="cuda"))
    assert accel.graphs.stats["captured"] > 0 and accel.graphs.bytes > 0
    graphs_ref = weakref.ref(accel.graphs)
    del accel
    unet.cpu()
    del unet
    gc.collect()
    torch.cuda.synchronize()
    assert graphs_ref() is None
    clear_workspaces()
    assert torch.cuda.memory_allocated() <= floor, "static buffers (or the graph pool) were not returned"
