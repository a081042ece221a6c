"""Precompiled region variants (compiler/lifecycle/variants.py and precompiled.py): they match
eager, a new store fed only their bytes serves a UNet with nothing traced (what a restart does), a
region dynamo alone can follow (a hook inside it) runs plain torch.compile and honours the hook, and a call no variant
fits compiles one more and names the input that did not fit. The two-process restart is in
tests/compiler/test_cache.py."""
from __future__ import annotations

import hashlib

import pytest
import torch

from unet_compiler.compiler import api
from unet_compiler.compiler.lifecycle import variants as V
from unet_compiler.compiler.lifecycle.scheduler import process_scheduler

pytestmark = pytest.mark.skipif(not V.enabled(), reason="this torch has no precompile API (torch >= 2.10)")


@pytest.fixture
def store(monkeypatch):
    fresh = V.Variants()
    monkeypatch.setattr(process_scheduler(), "variants", fresh)
    return fresh


def _inputs(seed=0, latent=8, batch=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 4, latent, latent, generator=g), torch.tensor([10.0] * batch),
            torch.randn(batch, 6, 32, generator=g))


def _both(unet, args):
    """(compiled output, eager output) of one call."""
    with torch.inference_mode():
        out = unet(*args).sample
        with api.accelerator_of(unet).bypass():
            ref = unet(*args).sample
    return out, ref


def _fed(blobs: dict, change=lambda b: b) -> V.Variants:
    """A store holding only these variants' bytes (``change``d), as a restart's after loading its entry."""
    fed = V.Variants()
    for key, items in blobs.items():
        for b in items:
            fed.add_serialized(key, change(b))
    return fed


def _traced() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def test_a_new_store_fed_only_bytes_serves_another_unet_without_tracing(tiny_unet, store, monkeypatch):
    first = tiny_unet(seed=0)
    api.compile_unet(first, "inductor", dynamic_shapes=False)
    out, ref = _both(first, _inputs())
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    assert store.compiled > 0 and store.from_cache == 0
    blobs = store.serialized()
    assert sum(map(len, blobs.values())) == store.compiled, "every variant compiled here can be saved"

    restarted = _fed(blobs)   # what a restart holds after loading the cache entry
    monkeypatch.setattr(process_scheduler(), "variants", restarted)
    second = tiny_unet(seed=3)   # other weights: they are inputs of the variants, read live
    api.compile_unet(second, "inductor", dynamic_shapes=False)
    traced = _traced()
    out, ref = _both(second, _inputs(seed=1))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    assert restarted.compiled == 0 and restarted.from_cache == store.compiled, vars(restarted)
    assert _traced() == traced, "nothing was traced: the variants came from their bytes"
    assert api.accelerator_of(second).stats["graphs_from_cache"] == store.compiled


def test_a_region_with_a_hook_runs_plain_torch_compile_and_honours_it(tiny_unet, store):
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", dynamic_shapes=False)
    conv = unet.down_blocks[0].resnets[0].conv2   # its output joins the residual (no norm after it)
    assert V.structure(unet.down_blocks[0].resnets[0], (None,)) is not None
    conv.register_forward_hook(lambda m, i, o: o * 2.0)
    assert V.structure(unet.down_blocks[0].resnets[0], (None,)) is None, "a hook only dynamo's guards follow"
    out, ref = _both(unet, _inputs())
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), "the hook ran in the compiled UNet too"
    with torch.inference_mode(), api.accelerator_of(unet).bypass():
        conv._forward_hooks.clear()
        unhooked = unet(*_inputs()).sample
    assert not torch.allclose(unhooked, ref, atol=1e-3), "the hook changes the output (the check means something)"


def test_structure_tells_blocks_and_missing_inputs_apart(tiny_unet):
    unet = tiny_unet()
    a, b = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1, \
        unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2
    x = torch.zeros(1)
    assert V.structure(a, (x, None)) == V.structure(a, (x, None))
    assert V.structure(a, (x, None)) != V.structure(a, (x, x)), "a None input is another variant"
    assert V.structure(a, (x, x)) != V.structure(a, (x, torch.zeros(1))), \
        "the same tensor twice is another variant (dynamo passes it to the graph once)"
    b.to_q.forward = lambda t: t   # an instance override: only an identity guard would see it
    assert V.structure(b, (x, x)) is None


def test_the_newest_comfys_per_module_state_is_no_variant(tiny_unet):
    """What the newest ComfyUI sets on blocks and ops as they run, and no compiled code of the pack
    reads: its compiler's allocation recording (``_comfy_malloc_graph``, set by ``malloc_graph_begin``
    on the first call), its block graph and VBAR block (``_comfy_graph``, ``_v_block``,
    ``_v_block_faulted``), a block's buffers kept across steps (``_comfy_cross_step_state``) and a
    resident weight bank (``_resident_bank``). Set or not, a region's variant key is the same:
    otherwise each one appearing after warmup compiles the region again."""
    block = tiny_unet().down_blocks[0].attentions[0].transformer_blocks[0]
    x = torch.zeros(1)
    plain = V.structure(block, (x, None))
    for name in ("_comfy_malloc_graph", "_comfy_cross_step_state", "_resident_bank", "_comfy_graph", "_v_block",
                 "_v_block_faulted"):
        setattr(block, name, object())
        setattr(block.attn1.to_q, name, object())
    assert V.structure(block, (x, None)) == plain
    block.something_else = 1
    assert V.structure(block, (x, None)) != plain, "another instance attribute is still part of the key"


def test_a_call_no_variant_fits_compiles_one_more_and_names_the_input(tiny_unet, store):
    unet = tiny_unet()
    api.compile_unet(unet, "inductor")
    api.warmup(unet, "1x64x64", context_tokens=6, compare=False)
    accel = api.accelerator_of(unet)
    before = store.compiled
    out, ref = _both(unet, _inputs(latent=12))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert store.compiled > before and accel.recompiles.events, "the new size compiled (after warmup: named)"
    guards = " ".join(g for e in accel.recompiles.events for g in e["guards"])
    assert "region input" in guards and "12" in guards, guards
    again = store.compiled
    out, ref = _both(unet, _inputs(seed=2, latent=10))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert store.compiled == again, "the variant after a miss is dynamic (torch's automatic-dynamic rule): " + \
        accel.recompiles.events[-1]["text"]


def test_a_variant_pickled_under_another_install_path_loads(tiny_unet, store, monkeypatch):
    """Inside ComfyUI the pack's modules are named by its install path, and a variant's bytes name
    them (its signature's default ops). A second ComfyUI root (a fleet worker) loads it anyway."""
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", dynamic_shapes=False)
    _both(unet, _inputs())
    blobs = store.serialized()
    saved, _, data = next(iter(blobs.values()))[0].partition(b"\n")
    assert saved.decode() == V.PACKAGE and V.PACKAGE.encode() in data, "the bytes name the pack's modules"
    other = "x" * len(V.PACKAGE)   # same length: pickle's strings are length-prefixed
    moved = _fed(blobs, lambda b: other.encode() + b"\n" + b.partition(b"\n")[2].replace(
        V.PACKAGE.encode(), other.encode()))
    monkeypatch.setattr(process_scheduler(), "variants", moved)
    second = tiny_unet(seed=5)
    api.compile_unet(second, "inductor", dynamic_shapes=False)
    out, ref = _both(second, _inputs(seed=4))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert moved.unusable == 0 and moved.compiled == 0 and moved.from_cache == store.compiled, vars(moved)
    assert other not in __import__("sys").modules, "the aliases are gone after loading"


def test_a_cached_variant_whose_traced_code_changed_is_compiled_again(tiny_unet, store, monkeypatch):
    """The compile cache's key names ComfyUI and the other packages by version, which a git update
    between releases keeps: a variant whose traced functions' source differs now (here: saved with
    another checksum for one function it inlined, as a variant compiled before an update records it)
    is not served; its region compiles again, == eager. Unchanged variants still load."""
    import dataclasses
    first = tiny_unet()
    api.compile_unet(first, "inductor", dynamic_shapes=False)
    _both(first, _inputs())
    src = min((s for fns in store.live.values() for fn in fns for s in fn._artifacts.source_info.inlined_sources
               if not s.module.startswith(V.PACKAGE)), key=lambda s: (s.module, s.firstlineno))
    before_update = dataclasses.replace(src, checksum="0" * 64)
    blobs, stale = {}, 0
    for key, fns in store.live.items():
        for fn in fns:
            info = fn._artifacts.source_info
            if src in info.inlined_sources:
                info.inlined_sources = (info.inlined_sources - {src}) | {before_update}
                stale += 1
            blobs.setdefault(key, []).append(V.serialize(fn))
    assert 0 < stale < store.compiled, (stale, store.compiled)
    restarted = _fed(blobs)
    monkeypatch.setattr(process_scheduler(), "variants", restarted)
    second = tiny_unet(seed=2)
    api.compile_unet(second, "inductor", dynamic_shapes=False)
    out, ref = _both(second, _inputs(seed=6))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert restarted.unusable == stale and restarted.compiled == stale, vars(restarted)
    assert restarted.from_cache == store.compiled - stale


def test_a_cached_variant_that_fails_at_its_first_call_is_dropped_and_compiled_again(tiny_unet, store, monkeypatch):
    """(The starts bench met one: a custom op the variants call was not registered in the new
    process.) The region compiles instead of its kind falling back to eager for good."""
    first = tiny_unet()
    api.compile_unet(first, "inductor", dynamic_shapes=False)
    _both(first, _inputs())
    restarted = _fed(store.serialized())
    monkeypatch.setattr(process_scheduler(), "variants", restarted)
    key = next(iter(restarted.pending))
    with torch.inference_mode():   # where the UNet calls load it: guards keep the loading thread's dispatch state
        (broken,) = restarted.candidates(key)[:1]

    def missing(*args):
        raise AttributeError("'_OpNamespace' 'unet_compiler' object has no attribute 'linear_prepacked'")
    monkeypatch.setattr(broken, "fn", missing)
    second = tiny_unet(seed=2)
    api.compile_unet(second, "inductor", dynamic_shapes=False)
    out, ref = _both(second, _inputs(seed=6))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    accel = api.accelerator_of(second)
    assert not accel.failed, f"no region kind fell back to eager: {accel.failed}"
    assert restarted.unusable == 1 and restarted.compiled >= 1 and broken not in restarted.live[key]
    assert all(hashlib.sha256(b).hexdigest() != broken.digest for b in restarted.serialized().get(key, []))


def test_a_dynamic_variant_serves_a_size_one_side_without_a_graph_of_its_own(tiny_unet, store):
    """Dynamic variants trace size-obliviously: a 1-wide deepest level (a 64 px side of an SD
    UNet) is one more value of the width, not a class that compiles again."""
    if not V.size_oblivious():
        pytest.skip("this torch traces no backed size-oblivious symbols")
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", dynamic_shapes=True)
    g = torch.Generator().manual_seed(0)
    context = torch.randn(2, 6, 32, generator=g)
    _both(unet, (torch.randn(2, 4, 12, 16, generator=g), torch.tensor([10.0, 10.0]), context))
    traced = _traced()
    # (the tiny UNet's deepest level is latent / 2: 1 x 8 here)
    out, ref = _both(unet, (torch.randn(2, 4, 2, 16, generator=g), torch.tensor([10.0, 10.0]), context))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    assert _traced() == traced, f"{_traced() - traced} graph(s) traced for a 1-high deepest level: {store.failures}"


def _preloaded(blobs, modes=torch.inference_mode) -> V.Variants:
    fed = _fed(blobs)
    fed.preload(modes)
    return fed


def _wait_loaded(store, seconds=60.0):
    import time
    end = time.monotonic() + seconds
    while (store.pending or store.loading) and time.monotonic() < end:
        time.sleep(0.01)
    assert not store.pending and not store.loading, "the preload thread finished"


def test_a_restart_deserializes_its_variants_beside_the_caller_and_calls_trace_nothing(tiny_unet, store,
                                                                                       monkeypatch):
    first = tiny_unet()
    api.compile_unet(first, "inductor", dynamic_shapes=False)
    _both(first, _inputs())
    restarted = _preloaded(store.serialized())
    monkeypatch.setattr(process_scheduler(), "variants", restarted)
    _wait_loaded(restarted)
    assert sum(map(len, restarted.live.values())) == store.compiled, "every variant loaded before any call"
    second = tiny_unet(seed=1)
    api.compile_unet(second, "inductor", dynamic_shapes=False)
    traced = _traced()
    out, ref = _both(second, _inputs(seed=2))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    assert _traced() == traced and restarted.compiled == 0 and restarted.from_cache == store.compiled


def test_a_call_whose_variant_is_being_loaded_waits_for_it_rather_than_compiling(tiny_unet, store, monkeypatch):
    import threading
    first = tiny_unet()
    api.compile_unet(first, "inductor", dynamic_shapes=False)
    _both(first, _inputs())
    real, started, release = V._deserialize, threading.Event(), threading.Event()

    def slow(blob, reject=None):
        if threading.current_thread().name == "unet-compiler-cache-load":
            started.set()
            release.wait(30)
        return real(blob, reject)
    monkeypatch.setattr(V, "_deserialize", slow)
    restarted = _fed(store.serialized())
    monkeypatch.setattr(process_scheduler(), "variants", restarted)
    key = next(iter(restarted.pending))
    restarted.preload(torch.inference_mode)
    assert started.wait(30) and key in restarted.loading
    threading.Timer(0.3, release.set).start()
    with torch.inference_mode():
        got = restarted.candidates(key)
    assert got and key not in restarted.loading, "the call got the thread's variant, not an empty list (a miss)"


def test_a_variant_preloaded_under_another_dispatch_state_is_loaded_again_for_the_call(tiny_unet, store,
                                                                                      monkeypatch):
    """Guards keep the loading thread's dispatch state: the preload guessed inference mode; a call
    with grad on (the API outside inference mode) still finds its variants, nothing traced."""
    first = tiny_unet()
    api.compile_unet(first, "inductor", dynamic_shapes=False)
    first(*_inputs())          # grad on: the regions run outside inference mode
    restarted = _preloaded(store.serialized(), modes=torch.inference_mode)
    monkeypatch.setattr(process_scheduler(), "variants", restarted)
    _wait_loaded(restarted)
    second = tiny_unet(seed=1)
    api.compile_unet(second, "inductor", dynamic_shapes=False)
    traced = _traced()
    second(*_inputs(seed=3))
    assert _traced() == traced and restarted.compiled == 0, (restarted.failures, vars(restarted))


def test_a_torch_without_the_precompile_api_is_seen_before_any_region_tries(monkeypatch):
    """torch 2.11 has torch._dynamo.aot_compile but its compiled functions have no ``aot_compile``
    (an H100 run: every region tried, failed and fell back with a log line): precompiling is off
    there from the start, and the inductor backend's background problem says why."""
    from unet_compiler.compiler.backends import inductor
    real = torch.compile

    def compile_without_aot(fn=None, **kw):   # what torch 2.11's torch.compile hands back: no aot_compile
        wrapped = real(fn, **kw)
        return lambda *a, **k: wrapped(*a, **k)
    V._api_present.cache_clear()
    monkeypatch.setattr(torch, "compile", compile_without_aot)
    try:
        assert not V.enabled()
        assert "aot_compile is missing in torch 2.11" in inductor.InductorBackend().background_problem()
    finally:
        V._api_present.cache_clear()


def _linear_body(module, x):
    return module(x)


def _linear_fallback(module, *args):
    return _linear_body(module, *args)


def test_a_body_that_cannot_be_precompiled_is_a_report_line(monkeypatch):
    """A body whose precompile fails (a graph break, a torch without the API, a first call that
    raises) is served by plain torch.compile, and the report names it with the reason: never a
    log line alone; only in the report of a model whose regions met it (the bodies are the
    process's: another model's report says nothing of it). The body still pickles (dynamo pickles it
    into later variants' guard state): what it met is kept in the scheduler's registry."""
    import pickle
    from unet_compiler.compiler.lifecycle import precompiled
    from unet_compiler.compiler.backends import inductor
    from unet_compiler.compiler.config import CompileConfig

    p = precompiled.Precompiled(_linear_body, "eager", False, _linear_fallback, (), process_scheduler())
    monkeypatch.setattr(precompiled.Precompiled, "_trace",
                        lambda self, module, args, dynamic: (_ for _ in ()).throw(
                            AttributeError("'function' object has no attribute 'aot_compile'")))
    lin = torch.nn.Linear(4, 4)
    with torch.inference_mode():
        torch.testing.assert_close(p(lin, torch.ones(2, 4)), lin(torch.ones(2, 4)))
    assert p.missed_for([lin]) == "AttributeError: 'function' object has no attribute 'aot_compile'"
    other = torch.nn.Linear(4, 4)   # another model's region: none of its calls met the key
    assert p.missed_for([other]) is None
    assert pickle.loads(pickle.dumps(p)).missed_for([lin]) == p.missed_for([lin])   # (the process's registry)
    b = inductor.InductorBackend()
    b.device_type = "cpu"
    b.impls(CompileConfig(backend="inductor"), process_scheduler())
    assert b.status_lines([lin]) == []
    b._bodies.append(p)
    assert b.status_lines([other]) == []
    with torch.inference_mode():
        p(other, torch.ones(2, 4))   # its call meets the key that could not be precompiled: now its line too
    for modules in ([lin], [other]):
        assert b.status_lines(modules) == [
            "  not precompiled (plain torch.compile serves these bodies: compiled at their calls, again after a "
            "restart): _linear_body (AttributeError: 'function' object has no attribute 'aot_compile')"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: precompiled variants on CUDA are checked on "
                    "GPU machines")
def test_precompiled_variants_serve_a_bf16_unet_on_cuda(tiny_unet, store):
    """What an NVIDIA user's inductor regions are: precompiled variants (not plain torch.compile, not
    the model's own code), in bf16, within the gate's bf16 tolerance of eager; the report names no
    body left unprecompiled."""
    from unet_compiler.compiler.shims import TOLERANCE
    u = tiny_unet().to("cuda", torch.bfloat16)
    api.compile_unet(u, "inductor", dynamic_shapes=False)
    args = tuple(a.to("cuda", torch.bfloat16) if a.is_floating_point() and a.dim() > 1 else a.to("cuda")
                 for a in _inputs(batch=2))
    out, ref = _both(u, args)
    accel = api.accelerator_of(u)
    assert store.compiled > 0 and sum(len(v) for v in store.live.values()) > 0, api.report(u)
    assert accel.stats["region_eager"] == 0 and "not precompiled" not in api.report(u), api.report(u)
    tol = TOLERANCE[torch.bfloat16] * max(1.0, ref.float().abs().max().item())
    assert (out.float() - ref.float()).abs().max().item() <= tol, api.report(u)


def test_an_accelerator_keeps_its_variants_with_the_scheduler_it_was_handed(tiny_unet, monkeypatch):
    """The scheduler is handed on, not read from module singletons: an accelerator made with a
    scheduler of its own compiles its region variants into that one's registry (its region bodies
    are that scheduler's), and the process's registry is left as it was."""
    import functools

    from unet_compiler.compiler.lifecycle.scheduler import Scheduler
    own = Scheduler()
    monkeypatch.setattr(api, "Accelerator", functools.partial(api.Accelerator, scheduler=own))
    process = process_scheduler().variants
    compiled, live = process.compiled, sum(map(len, process.live.values()))
    unet = tiny_unet(seed=7)
    api.compile_unet(unet, "inductor", dynamic_shapes=False)
    out, ref = _both(unet, _inputs(seed=7))
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    assert api.accelerator_of(unet).scheduler is own and own.variants.compiled > 0
    assert (process.compiled, sum(map(len, process.live.values()))) == (compiled, live)


def _made_in(setting):
    """A module class made inside a function, as ComfyUI's ``mixed_precision_ops`` / ``scaled_fp8_ops``
    make one per setting: every such class has the same qualname."""
    class Scaled(torch.nn.Linear):
        factor = setting

        def forward(self, x):
            return super().forward(x) * self.factor
    return Scaled


def test_classes_made_per_setting_are_other_variants():
    """Two classes of one qualname that compute differently (a class attribute, a closure value), and
    a function set on an instance: each is another variant key. Before, the key named classes by
    qualname and attributes by name only, and the variants' guards keep no class identity: one
    class's compiled code served the other (0.888 off in a review's repro)."""
    x = torch.zeros(1)
    a, b, a2 = _made_in(2.0)(4, 4), _made_in(3.0)(4, 4), _made_in(2.0)(4, 4)
    registry = V.Variants()

    def key(m):
        return registry.key(_made_in, V.structure(m, (x,)), ())
    assert key(a) != key(b)
    assert key(a) == key(a2), "the same setting: one variant (stable, also across processes)"
    gelu, silu = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    gelu.act, silu.act = torch.nn.functional.gelu, torch.nn.functional.silu
    assert key(gelu) != key(silu)
    assert V.type_key(torch.nn.Linear) == "torch.nn.modules.linear.Linear"
