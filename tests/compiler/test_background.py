"""Warmup Shapes' ``background`` (compiler/lifecycle/background.py): warmup returns having
compiled nothing, calls meanwhile run the model's own code and match eager, a daemon thread
compiles what warmup recorded, after which the same calls run the compiled variants with nothing
traced in the caller; its graphs count once, never as recompiles; a call no variant fits while
the thread works is queued for it, not compiled in the caller's thread. Through ComfyUI's own
UNetModel and ModelPatcher too."""
from __future__ import annotations

import os
import sys
import threading
import time
import types

import pytest
import torch

from unet_compiler.compiler import api
from unet_compiler.compiler.compat import compile_thread
from unet_compiler.compiler.lifecycle import background as B
from unet_compiler.compiler.lifecycle import pacing, priming, worker
from unet_compiler.compiler.lifecycle import precompiled as P
from unet_compiler.compiler.lifecycle import variants as V
from unet_compiler.compiler.lifecycle.scheduler import process_scheduler

pytestmark = pytest.mark.skipif(not V.enabled(), reason="this torch has no precompile API (torch >= 2.10)")


@pytest.fixture
def fresh(monkeypatch):
    """A fresh variant store and background queue (what a new process has), whose thread starts only
    at ``fresh.gate.set()`` (so a test sees the running state)."""
    monkeypatch.setattr(process_scheduler(), "variants", V.Variants())
    monkeypatch.setattr(pacing, "QUIET_SECONDS", 0.2)     # (a CPU job waits this long after the last call)
    bg = worker.Background(process_scheduler())
    bg.gate = threading.Event()
    work = bg._work
    bg._work = lambda: (bg.gate.wait(120), work())
    monkeypatch.setattr(process_scheduler(), "thread", bg)
    yield bg
    bg.gate.set()
    bg.wait(300)


def _inputs(batch=2, latent=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        return (torch.randn(batch, 4, latent, latent, generator=g), torch.tensor([10.0] * batch),
                torch.randn(batch, 77, 32, generator=g))


def _traced() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _check(unet, args):
    with torch.inference_mode():
        out = unet(*args).sample
        with api.accelerator_of(unet).bypass():
            ref = unet(*args).sample
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _compiled(tiny_unet, monkeypatch, backend="inductor"):
    """A tiny diffusers UNet compiled with ``backend`` (compile cache off) and its accelerator."""
    monkeypatch.setenv("UNET_COMPILER_CACHE", "off")
    unet = tiny_unet()
    api.compile_unet(unet, backend)
    return unet, api.accelerator_of(unet)


def _done(fresh, unet, shapes="2x64x64", timeout=300):
    """``unet`` warmed in the background, the thread let go and waited for."""
    api.warmup(unet, shapes, background=True)
    fresh.gate.set()
    assert api.wait_for_background(timeout) and not fresh.failures


def test_background_warmup_returns_first_and_compiles_behind(tiny_unet, fresh, monkeypatch):
    from unet_compiler.compiler.passes import prepack_conv
    unet, accel = _compiled(tiny_unet, monkeypatch)
    seen = _traced()
    packed = prepack_conv.stats["packed_mode_fired"]
    text = api.warmup(unet, "2x64x64", background=True)
    assert "recorded for the background compile" in text and "background compile: running" in text, text
    assert accel.stats["graphs_compiled"] == 0 and fresh.active
    # recording packs nothing (a copy is for one input size: a range's probes would each re-pack)
    assert prepack_conv.stats["packed_mode_fired"] == packed
    _check(unet, _inputs())                       # meanwhile: the model's own code, same numbers
    owner = accel.background.owner
    assert owner.eager_calls > 0
    # on CPU with the regions' convs packed (what compiled code runs them with too)
    assert prepack_conv.stats["packed_mode_fired"] > packed
    # a CPU job waits while anything samples (here: a host's signal, as ComfyUI's queue with a prompt)
    busy = [True]
    monkeypatch.setattr(process_scheduler().activity, "signals", [lambda: busy[0]])
    fresh.gate.set()
    time.sleep(pacing.QUIET_SECONDS + 0.5)
    assert fresh.waiting and fresh.compiled == 0 and fresh.queue, "a CPU job must not start while sampling goes on"
    assert "waiting until no prompt runs" in accel.text(), accel.text()
    busy[0] = False
    assert api.wait_for_background(300)
    assert not fresh.waiting
    assert owner.variants == fresh.compiled > 0 and owner.graphs >= owner.variants and not fresh.failures
    assert accel.stats["graphs_compiled"] == owner.graphs, accel.text()
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()
    assert "background compile: done" in accel.text()
    traced = _traced()
    assert traced - seen == owner.graphs
    _check(unet, _inputs(seed=1))                 # now the variants: nothing traced in this thread
    assert _traced() == traced and process_scheduler().variants.compiled == fresh.compiled
    assert accel.stats["recompiles_after_warmup"] == 0


def test_a_new_shape_while_it_runs_is_queued_not_compiled_here(tiny_unet, fresh, monkeypatch):
    unet, accel = _compiled(tiny_unet, monkeypatch)
    api.warmup(unet, "2x64x64", background=True)
    queued = len(fresh.queue)
    before = _traced()
    _check(unet, _inputs(batch=1, latent=12))     # not warmed: queued, runs the model's code
    assert _traced() == before, "nothing may compile in the sampling thread while the thread works"
    assert len(fresh.queue) > queued
    fresh.gate.set()
    assert api.wait_for_background(300)
    after = _traced()
    _check(unet, _inputs(batch=1, latent=12))
    _check(unet, _inputs())
    assert _traced() == after, "both shapes must be served by what the thread compiled"
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()


def test_after_it_is_done_a_new_shape_still_compiles_in_the_background(tiny_unet, fresh, monkeypatch):
    """Background is the model's mode, not only its warmup's: a later miss (a new shape, or the
    input layouts compiled code produces, which the eager warmup pass could not see) is queued too,
    never compiled in the sampling thread, and counted and named as a compile after warmup."""
    unet, accel = _compiled(tiny_unet, monkeypatch)
    _done(fresh, unet)
    done_graphs = accel.stats["graphs_compiled"]
    fresh.gate = threading.Event()                # the next thread run waits for this test again
    before = _traced()
    _check(unet, _inputs(batch=1, latent=12))
    assert _traced() == before and fresh.queue, "the miss must be queued, not compiled in this thread"
    fresh.gate.set()
    assert api.wait_for_background(300)
    assert _traced() > before and accel.stats["graphs_compiled"] > done_graphs
    assert accel.stats["recompiles_after_warmup"] == accel.stats["graphs_compiled"] - done_graphs, accel.text()
    assert "in the background (the calls ran the model's own code meanwhile)" in accel.text(), accel.text()
    traced = _traced()
    _check(unet, _inputs(batch=1, latent=12))
    assert _traced() == traced


def test_where_it_cannot_warmup_compiles_first_and_says_why(tiny_unet, fresh, monkeypatch):
    unet, _ = _compiled(tiny_unet, monkeypatch, "eager")
    text = api.warmup(unet, "1x64x64", background=True)
    assert "background compile: not used: nothing is compiled" in text and not fresh.active
    with pytest.raises(TypeError, match="background must be True or False"):
        api.warmup(unet, "1x64x64", background="false")


def _apply(mp, seed=1):
    """One sampling-style SD1.5 UNet call through ComfyUI's apply_model (as tests/nodes/test_comfy_patcher.py)."""
    import comfy.model_management as mm

    from unet_compiler.nodes import warmup as nodes_warmup
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        x, ctx = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g)
    mm.load_models_gpu([mp])
    with torch.inference_mode():
        return mp.model.apply_model(x, torch.full((2,), 2.0), c_crossattn=ctx,
                                    transformer_options=nodes_warmup.sampling_transformer_options(mp))


@pytest.mark.comfy
def test_warmup_shapes_node_in_the_background(make_comfy_model, fresh, monkeypatch, tmp_path):
    """ComfyUI's UNetModel in a real ModelPatcher, Warmup Shapes' own code path: the status says it is
    compiling in the background, sampling-style calls match eager meanwhile and after, and the
    compile cache entry is saved when the thread is done."""
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.nodes import patcher
    events = []
    srv = types.SimpleNamespace(client_id=None, send_sync=lambda e, d, sid=None: events.append((e, d)),
                                send_progress_text=lambda text, node_id, sid=None: None)
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=srv)))
    from unet_compiler.compiler import cache as C
    monkeypatch.setenv(C.DIR_ENV, str(tmp_path))
    monkeypatch.delenv(C.MODE_ENV, raising=False)
    monkeypatch.setattr(C.entry, "_loaded", set())
    for env in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):   # the cache points torch's there: put back after
        monkeypatch.setenv(env, os.environ[env]) if env in os.environ else monkeypatch.delenv(env, raising=False)
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    text = patcher.warmup_model(cm, "2x64x64", 77, node_id="7", background=True)
    assert "status: inductor: compiling in the background" in text, text
    ends = [d for e, d in events if e.endswith("warmup") and d["phase"] == "end"]
    assert [d["state"] for d in ends] == ["compiling"]
    accel = patcher.accelerator_of(cm)
    out = _apply(cm)
    with accel.bypass():
        ref = _apply(cm)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    fresh.gate.set()
    assert fresh.wait(300) and fresh.compiled > 0 and not fresh.failures
    traced = _traced()
    out = _apply(cm, seed=2)
    with accel.bypass():
        ref = _apply(cm, seed=2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert _traced() == traced and accel.stats["recompiles_after_warmup"] == 0, accel.text()
    assert "background compile: done" in accel.text()
    ends = [d for e, d in events if e.endswith("warmup") and d["phase"] == "end"]
    assert [d["state"] for d in ends] == ["compiling", "compiled"] and ends[-1]["node_id"] == "7"
    assert "background compile: done" in ends[-1]["text"], ends[-1]
    ends = [d for e, d in events if e.endswith("warmup") and d["phase"] == "end"]
    assert [d["state"] for d in ends] == ["compiling", "compiled"] and ends[-1]["node_id"] == "7"
    assert "background compile: done" in ends[-1]["text"], ends[-1]
    # what the thread compiled was saved to the compile cache when it was done
    assert [f for f in tmp_path.rglob("*") if f.is_file() and f.stat().st_size > 10_000], accel.text()
    assert "compile cache: saved" in accel.text(), accel.text()


def test_a_range_in_the_background_traces_as_the_sampling_thread_would(tiny_unet, fresh, monkeypatch):
    """Dynamic shapes: the backend's dynamo settings (symbolic weight shapes) are patched per thread,
    so the compile thread takes over the caller's; a shape inside the range then traces nothing."""
    unet, accel = _compiled(tiny_unet, monkeypatch)
    _done(fresh, unet, "1x64x64, 2x128x128", timeout=600)
    traced = _traced()
    for batch, latent in ((2, 12), (1, 16), (2, 8)):
        _check(unet, _inputs(batch=batch, latent=latent))
    assert _traced() == traced, "a shape inside the warmed range must not compile"
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()


_SPY = r'''
import os, sys, tempfile, threading
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["UNET_COMPILER_CACHE"] = "off"
import torch, diffusers
import torch.fx._symbolic_trace as st
plain = []
orig = st.Tracer.trace
def trace(self, *a, **k):
    # a tracer whose call_module is FX's own resolves every module called meanwhile, in any thread,
    # against its root: a sampling thread's module call then raises NameError
    if type(self).call_module is st.Tracer.call_module:
        plain.append(threading.current_thread().name)
    return orig(self, *a, **k)
st.Tracer.trace = trace
from unet_compiler.compiler import api
torch.manual_seed(0)
unet = diffusers.UNet2DConditionModel(**CONFIG).eval()
api.compile_unet(unet, "inductor")
api.warmup(unet, "2x64x64", background=True)
assert api.wait_for_background(600)
print("PLAIN", [n for n in plain if n == "unet-compiler-background"])
'''


def test_the_compile_thread_makes_no_tracer_patch_the_sampling_thread_can_meet(tiny_unet):
    """A fresh process (torch's once-per-process tracing not done yet): no plain FX trace, which
    patches nn.Module.__call__ for every thread, runs in the compile thread (the starts bench's
    KSampler died of one: 'module is not installed as a submodule')."""
    import subprocess
    code = _SPY.replace("CONFIG", repr(tiny_unet.config()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert "PLAIN []" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_the_sampling_threads_random_numbers_are_not_rewound(tiny_unet, fresh, monkeypatch):
    """Dynamo restores torch's global RNG state after each compile; from the compile thread that
    rewound what the sampling thread drew meanwhile (samplers drawing from the global generator
    made other images). The draws made while the thread compiles are the seed's own sequence."""
    unet, _ = _compiled(tiny_unet, monkeypatch)
    api.warmup(unet, "2x64x64", background=True)
    torch.manual_seed(123)
    fresh.gate.set()
    draws = []
    while fresh.active:
        draws.append(float(torch.randn(())))
        time.sleep(0.005)
    assert fresh.compiled > 0 and len(draws) > 20
    torch.manual_seed(123)
    assert draws == [float(torch.randn(())) for _ in draws]


def test_size_one_dims_get_standard_strides_so_recorded_and_compiled_inputs_agree():
    """A size-1 dim's stride is arbitrary: the model's own code and compiled regions give the same
    values other strides there. Region inputs are viewed with the standard strides (no copy), so a
    variant compiled from a recorded call fits the compiled pipeline's call."""
    x = torch.randn(2, 8, 1, 1).to(memory_format=torch.channels_last)      # strides (8, 1, 8, 8)
    assert x.stride() != (8, 1, 1, 1)
    y = torch.randn(2, 3, 4, 4)
    out = P._canonical((x, y, x, None))
    assert out[0].stride() == (8, 1, 1, 1) and out[0].data_ptr() == x.data_ptr() and torch.equal(out[0], x)
    assert out[1] is y and out[2] is out[0] and out[3] is None        # untouched, and aliases stay aliases
    t = torch.randn(4, 6).t()                                          # not contiguous: left alone
    assert P._canonical((t,))[0] is t
    assert P._canonical((y,)) == (y,)


def test_the_first_compiled_call_finds_every_block_packed(tiny_unet, fresh, monkeypatch):
    """A variant serves every block of its structure; the compile thread calls it once for each
    (packing their weights, or keeping a copy sampling's uncompiled calls packed: the same copies),
    so the sampling thread's first compiled call packs only the free-standing convs no region body
    holds (the projection regions, which run in that thread)."""
    from unet_compiler.compiler import plan, weights
    packed = []
    derived = weights.DerivedCache.derived

    def spy(self, owner, sig, make):
        def made():
            packed.append((threading.current_thread().name, id(owner)))
            return make()
        return derived(self, owner, sig, made)
    monkeypatch.setattr(weights.DerivedCache, "derived", spy)
    unet, accel = _compiled(tiny_unet, monkeypatch)
    _done(fresh, unet)
    before = {o for _, o in packed}
    packed.clear()
    _check(unet, _inputs(seed=3))
    projections = {id(p) for r in accel.plan.regions if r.kind == plan.PROJECTION for p in r.module.parameters()}
    in_sampling = {o for name, o in packed if name == "MainThread"}
    assert before and in_sampling <= projections, (len(in_sampling - projections), len(before))


def test_a_foreground_warmup_ends_background_mode(tiny_unet, fresh, monkeypatch):
    """Warmup Shapes run again with ``background`` off (ComfyUI reruns it on the same compiled
    model when the input changes): the model compiles in the calling thread again."""
    unet, accel = _compiled(tiny_unet, monkeypatch)
    _done(fresh, unet)
    assert accel.background is not None
    text = api.warmup(unet, "2x64x64")
    assert accel.background is None and "background compile: " not in text
    fresh.gate = threading.Event()          # a queued miss would wait; a foreground one compiles now
    before = _traced()
    _check(unet, _inputs(batch=1, latent=12))
    assert _traced() > before and not fresh.queue
    fresh.gate.set()


@pytest.mark.comfy
def test_weights_cast_per_call_compile_in_the_background(make_comfy_model, fresh, monkeypatch):
    """An fp8-stored model (ComfyUI casts its weights per call): the thread traces a copy that shows
    the cast weights, never the model the sampling thread runs; afterwards every region runs the
    compiled code with the cast, matching eager, with nothing traced in the caller."""
    from unet_compiler.compiler.config import CompileConfig
    from unet_compiler.nodes import patcher
    monkeypatch.setenv("UNET_COMPILER_CACHE", "off")
    mp = make_comfy_model("sd15", weight_dtype=torch.float8_e4m3fn)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    patcher.warmup_model(cm, "2x64x64", 77, background=True)
    accel = patcher.accelerator_of(cm)
    fresh.gate.set()
    assert fresh.wait(300) and fresh.compiled > 0 and not fresh.failures, fresh.failures
    assert all(p.dtype == torch.float8_e4m3fn for p in mp.model.diffusion_model.parameters())
    traced, eager = _traced(), accel.stats["region_eager"]
    out = _apply(cm, seed=2)
    with accel.bypass():
        ref = _apply(cm, seed=2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert _traced() == traced and accel.stats["region_eager"] == eager, accel.text()
    n = sum(accel.report.regions.values())
    assert accel.ran_compiled() == (n, n) and accel.stats["region_cast_compiled"] >= n, accel.text()


def test_out_of_memory_while_compiling_is_never_for_good(monkeypatch):
    """An out-of-memory error while a variant compiles (beside sampling, on a small card) is not the
    body's fault: nothing is marked for plain torch.compile for good. In the compile thread the job
    is dropped and the next miss compiles it; an out-of-memory first call keeps the variant; in the
    sampling thread the error is the call's (the runtime runs the model's own code for it)."""
    from unet_compiler.compiler.lifecycle import variants
    from unet_compiler.compiler.lifecycle.precompiled import Precompiled
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    p = Precompiled(lambda m, x: x, "inductor", False, lambda m, x: x, (), process_scheduler())
    traced, added = [], []

    class Variant:
        def guard_check(self, *a):
            return True

        def fn(self, *a):
            raise oom

    def trace(module, args, dynamic):
        traced.append(1)
        if len(traced) == 1:
            raise oom
        return Variant()
    monkeypatch.setattr(p, "_trace", trace)
    monkeypatch.setattr(variants, "serialize", lambda fn: b"")
    monkeypatch.setattr(process_scheduler().variants, "add_compiled", lambda key, fn, blob: added.append(key))
    m, x = torch.nn.Identity(), torch.zeros(2)
    assert p._aot("oom-key", m, (x,), False, first_call=True) is None and "oom-key" not in p._no_aot
    assert p._aot("oom-key", m, (x,), False, first_call=True) is not None   # its first call ran out: kept
    assert added == ["oom-key"] and not p._no_aot
    traced.clear()
    with pytest.raises(torch.OutOfMemoryError):
        p._aot("oom-key-2", m, (x,), False)
    assert not p._no_aot


def test_the_threads_first_call_on_cpu_keeps_the_convs_sampling_packed():
    """On CPU the thread's first call keeps conv copies sampling packed (``keeping_packed``)."""
    from unet_compiler.compiler.passes import prepack_conv
    called = []

    class Variant:
        def guard_check(self, *a):
            return True

        def fn(self, *a):
            called.append(getattr(prepack_conv._PRIMING, "on", False))
    x = torch.zeros(2)
    priming.first_calls(Variant(), [torch.nn.Identity()], (x,))
    assert called == [True] and not getattr(prepack_conv._PRIMING, "on", False)


def test_a_background_warmup_names_its_shapes_in_the_entry_once_all_compiled(tiny_unet, fresh, monkeypatch,
                                                                              tmp_path):
    """Once the thread compiled everything a background warmup recorded, without a failure, the
    compile cache entry names the probe and listed shapes it holds the code of: a restart's warmup
    then runs neither the probes nor any listed shape past the first."""
    import json

    from unet_compiler.compiler import cache as C
    monkeypatch.setenv(C.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(C.MODE_ENV, raising=False)
    monkeypatch.setattr(C.entry, "_loaded", set())
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", dynamic_shapes=True)
    accel = api.accelerator_of(unet)
    api.warmup(unet, "2x64x64, 2x96x96", background=True)
    probes = [label.split(" ")[0] for label, _, _ in accel.report.warmup if "(probe)" in label]
    assert not accel.cache.primed_probes()            # nothing compiled yet: nothing named
    fresh.gate.set()
    assert api.wait_for_background(300) and not fresh.failures
    meta = json.loads(next((tmp_path / "cache").glob("*.json")).read_text(encoding="utf-8"))
    assert sorted(meta["primed"]) == sorted(probes + ["2x64x64", "2x96x96"]), meta["primed"]


def test_a_background_restart_loads_the_compile_cache_when_idle_and_counts_it(tiny_unet, fresh, monkeypatch,
                                                                              tmp_path):
    """A CPU restart in background mode (the node's default): the recording and the calls until the
    process is idle run the model's own code (packed convs), as a cold start's do, and the compile
    thread then loads every variant from the compile cache (compiling none): the report says how
    many, and the next call runs them, counted as graphs from the cache (before: the recording
    waited for every variant to load, ahead of the first image)."""
    from unet_compiler.compiler import cache as C
    monkeypatch.setenv(C.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(C.MODE_ENV, raising=False)
    monkeypatch.setattr(C.entry, "_loaded", set())
    unet = tiny_unet()
    api.compile_unet(unet, "inductor")
    _done(fresh, unet)
    compiled = api.accelerator_of(unet).stats["graphs_compiled"]
    assert compiled > 0
    monkeypatch.setattr(C.entry, "_loaded", set())          # a new process: nothing loaded, nothing live
    monkeypatch.setattr(process_scheduler(), "variants", V.Variants())
    again = tiny_unet(seed=3)
    api.compile_unet(again, "inductor")
    fresh.gate.clear()
    text = api.warmup(again, "2x64x64", background=True)
    accel = api.accelerator_of(again)
    assert accel.stats["graphs_compiled"] == 0 and accel.background.owner.deferred > 0, text
    args = _inputs()
    _check(again, args)                          # before the thread ran: the model's own code, == eager
    assert accel.stats["graphs_from_cache"] == 0
    traced = _traced()
    fresh.gate.set()
    assert api.wait_for_background(300) and not fresh.failures
    assert _traced() == traced, "nothing compiled: every variant came from the compile cache"
    owner = accel.background.owner
    assert owner.variants == 0 and owner.loaded > 0, accel.text()
    assert f"{owner.loaded} loaded from the compile cache" in accel.text(), accel.text()
    _check(again, args)
    assert accel.stats["graphs_from_cache"] == accel.stats["graphs_compiled"] == compiled, accel.text()


def test_activity_is_idle_after_a_quiet_second_and_only_cpu_jobs_wait_for_it(monkeypatch):
    """``Activity.idle()``: no model call in flight, no host signal busy, for ``QUIET_SECONDS``.
    Only a CPU model's jobs wait for it, unless ``UNET_COMPILER_BACKGROUND_CPU=beside``."""
    act = pacing.Activity()
    monkeypatch.setattr(pacing, "QUIET_SECONDS", 0.2)
    assert act.idle()
    with act.call():
        assert not act.idle()
    assert not act.idle()                       # a call just ended: not yet quiet long enough
    time.sleep(0.3)
    assert act.idle()
    busy = [True]
    act.signals.append(lambda: busy[0])
    assert not act.idle()
    busy[0] = False
    assert not act.idle()
    time.sleep(0.3)
    assert act.idle()
    act.signals.append(lambda: 1 / 0)           # a failing signal says nothing
    assert act.idle()
    assert pacing.waits_for_idle("cpu") and not pacing.waits_for_idle("cuda")
    monkeypatch.setenv("UNET_COMPILER_BACKGROUND_CPU", "beside")
    assert not pacing.waits_for_idle("cpu")


def test_a_warmup_that_stops_still_ends_with_a_done_line(tiny_unet, fresh, monkeypatch):
    """A background warmup whose model cannot be called outside sampling (AnimateDiff's motion
    modules raised there) stops; the model stays in background mode, its sampling calls queue the
    compiles, and once the thread has compiled them the report says done (before: "running ... 0 to
    go" for good)."""
    unet, accel = _compiled(tiny_unet, monkeypatch)
    outside = [True]

    def refuse(module, args):
        if outside[0]:
            raise RuntimeError("this model cannot be called outside sampling")
    hook = unet.conv_in.register_forward_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="outside sampling"):
        api.warmup(unet, "2x64x64", background=True)
    outside[0] = False
    _check(unet, _inputs())                       # sampling: queued for the thread, the model's code runs
    assert fresh.queue, "sampling's misses go to the thread"
    fresh.gate.set()
    assert api.wait_for_background(300) and not fresh.failures
    deadline = time.monotonic() + 10
    while "background compile: done" not in accel.text() and time.monotonic() < deadline:
        time.sleep(0.1)                           # (the listener runs in the thread, after the queue empties)
    assert "background compile: done" in accel.text(), accel.text()
    assert accel.background.owner.variants > 0
    hook.remove()
    _check(unet, _inputs(seed=1))


def test_the_compile_thread_calls_a_cuda_variant_once_on_its_own_stream(monkeypatch):
    """On CUDA the compile thread calls a variant it compiled once (its kernels load and tune their
    launch configs there, not in sampling's first call), on a stream of its own, where the card has
    room for one call's activations beside sampling; else the variant's first sampling call does it
    and the background line says so. A module whose weights are cast per call is never called.
    (Before: never on CUDA.)"""
    from unet_compiler.tests._fake_cuda import fake_cuda
    args = (torch.zeros(2, 4, 8, 8), torch.zeros(2, 4))
    dev = args[0].device    # (CPU tensors stand for CUDA's: ``is_cuda`` is answered below)
    mods = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    calls = []
    variant = types.SimpleNamespace(guard_check=lambda m, *a: True,
                                    fn=lambda m, *a: calls.append((m, torch.cuda.current_stream(dev))))
    with fake_cuda(monkeypatch, total=24 << 30, free=20 << 30) as cuda:
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
        monkeypatch.setattr(priming, "_PRIME_STREAMS", {}, raising=False)
        owner = worker.Owner()
        monkeypatch.setattr(compile_thread.THREAD, "owner", owner, raising=False)
        priming.first_calls(variant, mods, args)
        assert len(calls) == 1 and calls[0][0] is mods[0], calls     # one call serves every module
        assert calls[0][1] is priming._PRIME_STREAMS[dev] and calls[0][1] is not cuda.current_stream()
        assert owner.primed == 1 and not owner.unprimed
        cuda.free = 2 * sum(a.numel() * a.element_size() for a in args)   # under PRIME_ROOM x the inputs
        priming.first_calls(variant, mods, args)
        assert len(calls) == 1 and owner.unprimed == {"the card was short of memory for a call beside sampling": 1}
        cuda.free = 20 << 30
        monkeypatch.setattr(priming.cast, "needs_cast", lambda m: True)
        priming.first_calls(variant, mods, args)
        assert len(calls) == 1 and owner.unprimed["its modules' weights are cast per call"] == 1
    mode = B.BackgroundMode(lambda *a: None, process_scheduler())
    mode.owner, mode.done = owner, 1.0
    line = mode.line()
    assert "1 called once on the GPU" in line and "2 variant(s) not called before sampling used them" in line


def test_beside_sampling_the_thread_pauses_after_each_job_for_its_share(monkeypatch):
    """Beside a GPU's sampling (not on CPU, where a job waits for idle or was asked to run at once)
    the compile thread pauses after a job for its CPU time x (1 - share) / share while a model call is in flight
    or just ended, so it holds at most ``BESIDE_SHARE`` of the interpreter; it does not pause when
    nothing samples, and stops pausing when sampling stops. (``bench beside`` measures the effect on
    a Python-bound sampling loop: docs/bench.md.)"""
    assert pacing.paces("cuda") and not pacing.paces("cpu")
    slept = []
    monkeypatch.setattr(pacing.time, "sleep", lambda s: slept.append(s))
    activity = pacing.Activity()
    assert pacing.pace(1.0, activity) < 0.05 and not slept             # nothing samples: no pause
    with activity.call():
        pacing.pace(0.1, activity)
    assert abs(sum(slept) - 0.1 * (1 - pacing.BESIDE_SHARE) / pacing.BESIDE_SHARE) < 1e-9 and max(slept) <= 0.05
    slept.clear()
    calls = []

    def sampling_until_three_sleeps(activity):
        calls.append(1)
        return len(slept) < 3
    monkeypatch.setattr(pacing, "sampling_now", sampling_until_three_sleeps)
    pacing.pace(10.0, activity)
    assert len(slept) == 3, slept                                 # sampling stopped: the pause ends


def test_another_nodes_compiled_code_runs_while_the_thread_traces():
    """FX's tracing flag is process-wide: while the compile thread traces, a function another node
    torch.compile'd (TorchCompileModel on a second model, a compiled VAE), called in the thread that
    queued the background compile, runs its own code for that call instead of raising "using FX to
    symbolically trace a dynamo-optimized function". (The flag is set here as the compile thread
    sets it; the prompt thread runs in its own thread: dynamo's settings are per thread.)"""
    import torch.fx._symbolic_trace as fx_trace
    other = torch.compile(lambda x: torch.sin(x) + 1, backend="eager")
    x = torch.randn(8)
    other(x)
    got, errors = [], []

    def prompt_thread():
        compile_thread.before_the_thread()
        fx_trace._is_fx_tracing_flag = True   # the compile thread is tracing
        try:
            got.append(other(x))
        except RuntimeError as e:
            errors.append(str(e))
        finally:
            fx_trace._is_fx_tracing_flag = False
    t = threading.Thread(target=prompt_thread)
    t.start()
    t.join(60)
    assert not errors and len(got) == 1, errors
    torch.testing.assert_close(got[0], torch.sin(x) + 1)


def test_two_warmups_recording_at_once_leave_the_thread_free(monkeypatch):
    """Two warmups record on two threads, their ends crossed (A in, B in, A out, B out): the compile
    thread is recording while either is, and free after both. Before, one saved-and-restored flag
    left it recording for good (every later miss ran the model's own code, ``wait`` never returned)."""
    bg = worker.Background(process_scheduler())
    monkeypatch.setattr(bg, "_start", lambda: None)
    a, b = bg.record(None), bg.record(None)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert bg.active
    b.__exit__(None, None, None)
    assert not bg.active and bg.recording == 0
