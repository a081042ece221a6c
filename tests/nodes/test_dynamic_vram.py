"""The newest ComfyUI's Dynamic VRAM, on this CPU: ComfyUI's real SD1.5 / SDXL / Flux classes under
the double of ``tests/_dynamic_vram.py`` (every op cast per call, weights handed out as views of
VBAR slots or of two shared per-stream buffers that the next casts reuse, LoRA per call through
``weight_lowvram_function``, the aimdo attributes coming and going, demotion by
``clone(disable_dynamic=True)``).

Compiled == ComfyUI's own eager result under the double at 1e-4 (fp32: the graphs' rounding only,
measured ~1e-6 relative L2), every region ran compiled code, nothing compiles again across
prompts that change the LoRA strength and the resident set."""
from collections import Counter

import pytest
import torch

from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher, warmup as nodes_warmup
from unet_compiler.compiler.lifecycle.scheduler import process_scheduler

from .test_comfy_patcher import _apply, _close, _lora

pytestmark = pytest.mark.comfy
CFG = CompileConfig(backend="inductor")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _regions(accel) -> int:
    return sum(accel.report.regions.values())


def test_the_double_serves_comfys_own_code_exactly(make_comfy_model, dynamic_vram):
    """ComfyUI's own forward under the double == the plain model, bit for bit, while half the slotted
    weights came through the shared buffers; every pin is released after the call."""
    plain = make_comfy_model("sd15")
    ref = _apply(plain, "sd15")
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=0.5)
    out = _apply(dyn, "sd15")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    vbar = dyn.vbar()
    assert dynamic_vram.shared_casts > 0 and vbar.resident, "both paths must be exercised"
    assert vbar.pinned() == 0
    unet = dyn.model.diffusion_model
    assert all(m.comfy_cast_weights for m in unet.modules() if hasattr(m, "comfy_cast_weights"))
    assert dyn.partially_load(dyn.load_device) is None


@pytest.mark.parametrize("body", ["inductor", "op by op"])
def test_sd15_with_every_weight_streamed(make_comfy_model, dynamic_vram, monkeypatch, body):
    """Compile UNet + Warmup Shapes under Dynamic VRAM with no VBAR room (every slotted weight comes
    through the two shared buffers): each op's weights are cast where the op runs, never all of a
    region's up front, never copied. A body that calls each conv and linear as a module (the triton
    backend's, regions.py's run as Python) runs every region compiled, op by op; inductor's compiled
    body reads a region's weights at once, so its regions run the model's own code, counted, and the
    status says why and what to choose. == eager, no pin left. (Before: every region's weights were
    cast up front and the shared buffers' views copied, ``cast_views_copied`` in its stats.)"""
    from unet_compiler.compiler.backends import inductor
    if body == "op by op":
        monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=0.0)
    ref = _apply(dyn, "sd15")
    cm, _ = patcher.compile_model(dyn, CFG)
    accel = patcher.accelerator_of(cm)
    accel.backend.streams_op_by_op = body == "op by op"
    text = patcher.warmup_model(cm, "2x64x64", 77)
    out = _apply(cm, "sd15")
    assert _rel(out, ref) < 1e-5, f"rel L2 {_rel(out, ref):.3g}\n{text}"
    _close(out, ref)
    n = _regions(accel)
    calls = accel.stats["region_streamed"] + accel.stats["region_streamed_eager"]
    assert calls >= 2 * n and accel.stats["cast_views_copied"] == 0, dict(accel.stats)
    if body == "op by op":
        assert f"{n} of {n} regions ran compiled code" in text, text
        assert accel.stats["region_streamed"] == calls and accel.stats["region_eager"] == 0, accel.text()
        assert f"{calls} op by op, their weights streamed" in accel.text()
    else:
        assert accel.stats["region_streamed_eager"] == calls == accel.stats["region_eager"], accel.text()
        assert f"0 of {n} regions ran compiled code: ComfyUI casts their weights on every call, and their " \
               f"weights stream" in text and "choose the triton backend" in text, text
    assert cm.model.diffusion_model is dyn.model.diffusion_model
    assert dyn.vbar().pinned() == 0


def _prompts(comfy, cm, base, kind, apply, lora):
    """Three prompts on clones of the compiled ``cm``: a LoRA at three strengths, each with another
    resident set (the VBAR's room: another model took some, then gave it back, then took all), each
    two steps (the first refills every slot: ComfyUI resets their signatures on a patch change).
    Returns [(rel L2 compiled vs eager, pins left)] per step."""
    accel = patcher.accelerator_of(cm)
    patches = lora(comfy, base)
    out = []
    for strength, budget in ((1.0, 0.3), (0.5, 0.8), (0.8, 0.0)):
        p = cm.clone()
        p.add_patches(patches, strength)
        p.budget = budget
        steps = [(apply(p, load=True), p.vbar().pinned()) for _ in range(2)]
        with accel.bypass():
            want = apply(p, load=False)
        assert (want - apply(base, load=True)).abs().max() > 1e-3, "the LoRA must change the output"
        for got, pins in steps:
            out.append((_rel(got, want), pins))
            _close(got, want)
    return out


def _only_streamed_ran_eager(accel, before) -> None:
    """Every region call since ``before`` (a copy of the stats) that ran the model's own code was one
    whose weights streamed (inductor's body reads a region's weights at once), and some compiled."""
    stats = accel.stats
    eager = stats["region_eager"] - before["region_eager"]
    assert eager == stats["region_streamed_eager"] - before["region_streamed_eager"], accel.text()
    assert stats["region_cast_compiled"] > before["region_cast_compiled"], accel.text()


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_unets_over_prompts_with_lora_and_resident_set_changes(comfy, make_comfy_model, dynamic_vram, kind):
    """SD1.5 and SDXL: Compile UNet + Warmup Shapes (room for every weight), then three prompts changing
    the LoRA strength and the resident set: compiled == eager each time, every region call compiled
    but those whose weights streamed (the model's own code, op by op: inductor's body reads a
    region's weights at once), 0 recompiles, no pin held after a call, no weight copied."""
    base = dynamic_vram.patcher(make_comfy_model(kind), budget=1.0)
    cm, _ = patcher.compile_model(base, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    n = _regions(accel)
    assert f"{n} of {n} regions ran compiled code" in text, text
    before = Counter(accel.stats)

    def apply(p, load):
        return _apply(p, kind, load=load)
    seen = _prompts(comfy, cm, base, kind, apply, lambda c, m: _lora(c, m, 0.05))
    assert all(rel < 1e-5 and pins == 0 for rel, pins in seen), seen
    _only_streamed_ran_eager(accel, before)
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()
    assert accel.stats["cast_views_copied"] == before["cast_views_copied"], dict(accel.stats)
    print(f"\n{kind}: rel L2 per prompt {[f'{r:.1e}' for r, _ in seen]}, regions {n}/{n}, recompiles 0")


def test_flux_over_prompts_with_lora_and_resident_set_changes(comfy, dynamic_vram):
    """The tiny Flux.1 dev (ComfyUI's own classes): the same three prompts, its 4 stream blocks compiled."""
    from unet_compiler.tests import _families as F  # noqa: N812
    from .test_dit import _flux_lora
    base = dynamic_vram.patcher(F.build_dit(F.DIT_FAMILIES["flux_dev"]), budget=1.0)
    cm, _ = patcher.compile_model(base, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 7)
    accel = patcher.accelerator_of(cm)
    assert "4 of 4 regions ran compiled code" in text, text
    before = Counter(accel.stats)

    def apply(p, load):
        if not load:
            x, sigma, kw = F.dit_inputs(p, 2, 8, 8, 3, tokens=7)
            with torch.inference_mode():
                return p.model.apply_model(x, sigma, transformer_options=nodes_warmup.sampling_transformer_options(p), **kw)
        return F.dit_apply(p, 2, 8, 8, seed=3)
    seen = _prompts(comfy, cm, base, "flux", apply, _flux_lora)
    assert all(rel < 1e-5 and pins == 0 for rel, pins in seen), seen
    _only_streamed_ran_eager(accel, before)
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()
    print(f"\nflux: rel L2 per prompt {[f'{r:.1e}' for r, _ in seen]}, regions 4/4, recompiles 0")


def test_warmup_gate_refuses_a_wrong_kernel_and_names_it(make_comfy_model, monkeypatch):
    """An injected wrong op (GEGLU scaled by 1.5, in the feed-forward body only): Warmup Shapes'
    compare is over the tolerance, the feed-forward regions turn to the model's own code (found by
    running each kind alone), the status says fallback with the difference and the tolerance, never
    "compiled", and the next call gives the model's own result."""
    from unet_compiler.compiler import regions
    from unet_compiler.compiler.lifecycle import variants
    real = regions.Ops.geglu
    monkeypatch.setattr(regions.Ops, "geglu", lambda self, h, approximate: real(self, h, approximate) * 1.5)
    # a fresh variant store: a variant an earlier test compiled for this structure would serve the
    # right feed-forward and hide the injected op (what the full lane's order showed)
    monkeypatch.setattr(process_scheduler(), "variants", variants.Variants())
    mp = make_comfy_model("sd15")
    ref = _apply(mp, "sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    assert set(accel.failed) == {"feedforward"}, accel.failed
    assert "status: inductor: fallback" in text and "feedforward regions run the model's own code from now on" in text, text
    assert "tolerance" in text and "over it: refused" in text, text
    _close(_apply(cm, "sd15"), ref)
    assert accel.stats["ran_resblock"] > 0


def test_warmup_gate_catches_overwritten_weights(make_comfy_model, dynamic_vram, monkeypatch):
    """An older cast (every weight of a region cast up front, views of the shared buffers held across
    casts) under the double: the gate turns every kind it reads wrong weights in to the model's own
    code, and the result is ComfyUI's."""
    from unet_compiler.compiler import cast
    monkeypatch.setattr(cast, "_held", lambda leaf, t, name, fresh_views, stats: t)
    monkeypatch.setattr(cast, "_streams", lambda leaf, device: False)
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=0.0)
    ref = _apply(dyn, "sd15")
    cm, _ = patcher.compile_model(dyn, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    assert accel.failed and "status: inductor: fallback" in text and "over it: refused" in text, text
    _close(_apply(cm, "sd15"), ref)


def test_a_demoted_model_runs_its_own_code_and_says_why(comfy, make_comfy_model, dynamic_vram):
    """``clone(disable_dynamic=True)`` (TorchCompileModel after Compile UNet) and
    ``get_non_dynamic_delegate`` (conditioning with hooks) sample another copy of the model: it runs
    its own code, equal to the dynamic model's, and the report says why, once."""
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=0.5, reload=lambda: make_comfy_model("sd15"))
    ref = _apply(dyn, "sd15")
    cm, _ = patcher.compile_model(dyn, CFG)
    accel = patcher.accelerator_of(cm)
    for demoted in (cm.clone(disable_dynamic=True), cm.get_non_dynamic_delegate()):
        assert type(demoted) is comfy.mp.ModelPatcher and demoted.model is not cm.model
        assert patcher.accelerator_of(demoted) is accel         # the wrapper came along
        _close(_apply(demoted, "sd15"), ref)
    assert accel.stats["calls_not_ours"] == 2 and accel.stats["calls"] == 0
    lines = [n for n in accel.report.notes if "separate copy of the model" in n]
    assert len(lines) == 1 and "get_non_dynamic_delegate" in lines[0], accel.text()
    assert "separate copy of the model" in accel.text()
    # core's TorchCompileModel after Compile UNet, as the newest one does it: clone(disable_dynamic=True),
    # then its torch.compile wrapper (backend "eager" here: dynamo only, no inductor compile)
    from comfy_api.torch_helpers.torch_compile import set_torch_compile_wrapper
    tc = cm.clone(disable_dynamic=True)
    set_torch_compile_wrapper(model=tc, backend="eager")
    _close(_apply(tc, "sd15"), ref)
    assert accel.stats["calls_not_ours"] == 3 and accel.stats["calls"] == 0
    assert any("TorchCompileModel" in n for n in accel.report.notes), accel.text()


def test_comfys_compiler_recording_is_paused_around_the_pack(make_comfy_model, dynamic_vram):
    """ComfyUI's own compiler records the model's calls (tests/_comfy_compiler.py, with
    ``--assert-graph-breaks``): Warmup Shapes and three prompts inside recording scopes run with no
    graph break, compiled == eager, and the report says the recording was paused. The double is
    shown to fail a replay that allocates what its recording did not."""
    from unet_compiler.tests._comfy_compiler import ComfyCompiler
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=1.0)
    ref = _apply(dyn, "sd15")
    with ComfyCompiler(assert_graph_breaks=True).installed() as compiler:
        with compiler.scope():
            torch.ones(3) * 2
        with pytest.raises(RuntimeError, match="aimdo memory compile error"), compiler.scope():
            torch.ones(5) * 2                   # the replay expects 3 floats, not 5
        deliberate = compiler.breaks()
        assert deliberate == ["an allocation the replay does not expect (20 bytes)"], deliberate
        cm, _ = patcher.compile_model(dyn, CFG)
        with compiler.scope():
            text = patcher.warmup_model(cm, "2x64x64", 77)
        for _ in range(3):
            with compiler.scope():
                _close(_apply(cm, "sd15"), ref)
        accel = patcher.accelerator_of(cm)
        assert compiler.breaks() == deliberate, compiler.breaks()      # the deliberate one only
    n = _regions(accel)
    assert f"{n} of {n} regions ran compiled code" in text, text
    assert accel.stats["recording_paused"] > 0 and "recording is paused" in accel.text()


def test_quantized_leaves_keep_comfys_quantized_matmul(comfy, make_comfy_model, dynamic_vram):
    """A mixed-precision (scaled fp8) SD1.5 whose fp8 linears multiply quantized, as on an fp8 GPU
    with the newest forward rule (``comfy_cast_weights`` not read): under Dynamic VRAM every op is
    flagged, yet those regions keep ComfyUI's quantized matmul (they run the model's own code, and
    the report counts them with the reason); the others compile; compiled == eager. The quantized
    weights are paged as their raw bytes, resident or streamed."""
    from unet_compiler.tests._dynamic_vram import newest_mixed_precision
    from unet_compiler.compiler import cast
    from .test_cast_weights import _mixed_precision_sd15
    mp = _mixed_precision_sd15(comfy, make_comfy_model)
    leaves = [m for m in mp.model.diffusion_model.modules() if m.__dict__.get("layout_type") is not None]
    assert leaves
    for leaf in leaves:
        newest_mixed_precision(leaf)
    dyn = dynamic_vram.patcher(mp, budget=1.0)     # (resident: regions that stream run eager on inductor)
    ref = _apply(dyn, "sd15")
    assert all(leaf.comfy_cast_weights and cast.quantized(leaf) for leaf in leaves)
    cm, _ = patcher.compile_model(dyn, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    # fp8 matmuls quantize their input: the compiled regions' float rounding (~1e-6) upstream flips
    # some of those roundings by a step of fp8 (the plain model's own result moves as much)
    rel = _rel(_apply(cm, "sd15"), ref)
    assert rel < 5e-2, rel
    print(f"\nquantized sd15: rel L2 {rel:.2g}")
    assert set(accel.cast_eager) == {"attention", "feedforward"}, accel.cast_eager
    assert all("quantized matmul" in why for why in accel.cast_eager.values())
    assert accel.stats["region_eager_cast"] > 0 and accel.stats["ran_resblock"] > 0 and not accel.failed
    assert "quantized matmul" in accel.text() and "status: inductor: compiled" in text, text
    # their weights are paged as raw bytes: each quantized op's slot hands out a QuantizedTensor
    paged = [leaf for leaf in leaves if "_v" in leaf.__dict__]
    assert paged and all(type(leaf._v_weight).__name__ == "QuantizedTensor" for leaf in paged)
    # and with no room they stream through the shared buffers, == ComfyUI's own result then
    p = cm.clone()
    p.budget = 0.0
    got = _apply(p, "sd15")
    with accel.bypass():
        assert _rel(got, _apply(p, "sd15", load=False)) < 5e-2


def test_the_compile_thread_never_casts_or_pins(make_comfy_model, dynamic_vram):
    """Warmup Shapes in the background under Dynamic VRAM: the compile thread traces stand-ins and
    never calls ComfyUI's cast (every cast came from the sampling thread), no pin is left, and
    the compiled code then serves the model: compiled == eager."""
    import threading
    from unet_compiler.compiler import api
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=0.5)
    ref = _apply(dyn, "sd15")
    cm, _ = patcher.compile_model(dyn, CFG)
    patcher.warmup_model(cm, "2x64x64", 77, background=True)
    assert api.wait_for_background(600)
    _close(_apply(cm, "sd15"), ref)
    accel = patcher.accelerator_of(cm)
    assert accel.ran_compiled()[0] > 0 and not accel.failed, accel.text()
    assert {tid for tid, _ in dynamic_vram.casts} == {threading.get_ident()}
    assert dyn.vbar().pinned() == 0


def test_autocast_runs_on_the_load_device(make_comfy_model, dynamic_vram, monkeypatch):
    """precision bf16 under Dynamic VRAM: the parameters stay on the CPU, the regions' autocast is the
    load device's (here the load device is set to CUDA, as ComfyUI's is on a GPU)."""
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=0.5)
    cm, _ = patcher.compile_model(dyn, CompileConfig(backend="inductor", precision="bf16"))
    accel = patcher.accelerator_of(cm)
    assert next(accel.root.parameters()).device.type == "cpu"
    accel.device_type = "cuda"
    seen = []
    real = torch.autocast

    def autocast(device_type, *args, **kwargs):
        seen.append(device_type)
        return real("cpu", *args, **kwargs)
    monkeypatch.setattr(torch, "autocast", autocast)
    with accel.active():
        pass
    assert seen == ["cuda"]


def _graphed(make_comfy_model, dynamic_vram, monkeypatch, standin, room, weight_dtype=None):
    """A Dynamic VRAM SD1.5 at VBAR ``room`` compiled with region graphs on ``standin`` (the bodies
    uncompiled: the graphs are under test, not inductor), its weights stored in ``weight_dtype``:
    (compiled patcher, base patcher, accelerator)."""
    from unet_compiler.compiler.backends import inductor
    from unet_compiler.compiler.graphs import RegionGraphs
    monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)
    base = dynamic_vram.patcher(make_comfy_model("sd15", weight_dtype=weight_dtype), budget=room)
    cm, _ = patcher.compile_model(base, CFG)
    accel = patcher.accelerator_of(cm)
    accel.graphs = RegionGraphs(graphs=standin)
    # the bodies run as Python, each conv and linear a module call: a region whose weights stream
    # runs them op by op, as the triton backend's bodies do
    accel.backend.streams_op_by_op = True
    return cm, base, accel


def _graphed_call(accel, p) -> tuple[int, int]:
    """One call of ``p`` == ComfyUI's eager with no pin left after: (regions that replayed a graph,
    regions whose every slot was resident)."""
    before = accel.graphs.stats["replays"]
    got = _apply(p, "sd15", load=True)
    replayed, resident = accel.graphs.stats["replays"] - before, _fully_resident(accel, p.vbar())
    with accel.bypass():
        want = _apply(p, "sd15", load=False)
    _close(got, want)
    assert p.vbar().pinned() == 0
    return replayed, resident


def _fully_resident(accel, vbar) -> int:
    """Regions whose every slotted leaf's VBAR range is resident now (the loaded leaves stay where they are)."""
    n = 0
    for r in accel.plan.regions:
        slots = [m._v for m in r.module.modules() if "_v" in m.__dict__]
        n += all(address in vbar.resident for _, address, _ in slots)
    return n


@pytest.mark.parametrize("room", [1.0, 0.8, 0.3, 0.0])
def test_resident_regions_replay_their_graphs(comfy, make_comfy_model, dynamic_vram, monkeypatch,
                                              strict_graph_standin, room):
    """CUDA graphs under Dynamic VRAM at VBAR room 100 / 80 / 30 / 0 % of the slotted weights: a region
    whose cast weights are all resident (VBAR slot views at the addresses it was captured with, or
    loaded weights) replays its graph, its slots faulted in and pinned around the replay; a region
    with a weight that streams runs op by op, each op casting where it runs, counted, and nothing
    reading a shared cast buffer is captured. The stand-in replays the recorded ops on the captured
    tensors (a slot evicted and not faulted back would read NaN). Three prompts of three calls: no
    LoRA, then strength 1.0, then 0.5: a prompt's first call refills every slot (ComfyUI resets their
    signatures when the patches change), so it streams op by op; its later calls replay the graphs
    captured in the first prompt (the slots refilled in place, at the addresses captured). Compiled
    == ComfyUI's eager on every call; no pin left. A replay reads the resident weights in place: no
    leaf is shown them (host time per region call). (Before: every region under Dynamic VRAM took
    the cast path, which never replayed.)"""
    from unet_compiler.compiler import cast
    show, shown = cast._show, Counter()
    monkeypatch.setattr(cast, "_show", lambda leaf, w, b: shown.update(["leaves"]) or show(leaf, w, b))
    fake = strict_graph_standin()
    cm, base, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, room)
    n = _regions(accel)
    patches = _lora(comfy, base, 0.05)
    per_call, resident, streamed, shows = [], [], [], []
    for strength in (None, 1.0, 0.5):
        p = cm.clone()
        if strength is not None:
            p.add_patches(patches, strength)
        p.budget = room
        for _ in range(3):
            before, leaves = accel.stats["region_streamed"], shown["leaves"]
            replayed, here = _graphed_call(accel, p)
            shows.append(shown["leaves"] - leaves)
            per_call.append(replayed)
            resident.append(here)
            streamed.append(accel.stats["region_streamed"] - before)
        if strength is None:
            captures = fake.captures
    assert accel.stats["region_eager"] == 0, accel.text()
    # each prompt's first call: every slot refilled, each op cast where it runs, nothing replayed
    assert [per_call[i] for i in (0, 3, 6)] == [0, 0, 0] and [streamed[i] for i in (0, 3, 6)] == [n] * 3, \
        (per_call, streamed)
    # later calls replay exactly the resident regions (from the first prompt's third call on), with
    # no capture after the first prompt; the others stream op by op
    assert [per_call[i] for i in (2, 4, 5, 7, 8)] == [resident[i] for i in (2, 4, 5, 7, 8)], (per_call, resident)
    assert all(streamed[i] == n - resident[i] for i in (4, 5, 7, 8)), (streamed, resident)
    assert fake.captures == captures, (fake.captures, captures)
    # those calls show no leaf its weights; the first prompt's, which record and capture, do
    assert [shows[i] for i in (4, 5, 7, 8)] == [0] * 4 and (shows[1] + shows[2] > 0) == (room > 0), shows
    if room == 1.0:
        assert resident[2] == n and per_call[-1] == n, (per_call, resident, n)
        assert f"{accel.stats['region_cast_resident']} of them with every weight resident" in accel.text()
        assert accel.stats["region_cast_resident"] == 6 * n, accel.stats   # all but each prompt's first call
    elif room == 0.0:
        assert resident[2] == 0 and sum(per_call) == 0 and fake.captures == 0, (per_call, fake.captures)
        assert accel.graphs.skipped["a weight streamed (cast op by op, not resident)"] == 9 * n
    else:
        assert 0 < resident[2] < n and per_call[-1] == resident[-1], (per_call, resident, n)
    print(f"\nroom {room:.0%}: regions replayed per call {per_call} of {n} (fully resident {resident}, "
          f"op by op {streamed}), captures {fake.captures}, skipped {dict(accel.graphs.skipped)}")


def test_graphs_follow_the_resident_set(comfy, make_comfy_model, dynamic_vram, monkeypatch, strict_graph_standin):
    """Another model takes VBAR room and gives it back between prompts (evicted ranges read NaN in the
    double): once the resident set settles, each call replays exactly the regions whose slots are
    resident (faulted back in at the addresses captured: no capture again) and runs the others op by
    op; a call where it changes runs op by op the regions whose slots it refills or finds evicted
    (an evicted slot found on the up-front fault stops the region's cast there). == ComfyUI's eager."""
    fake = strict_graph_standin()
    cm, _, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, 1.0)
    n = _regions(accel)
    per_call, resident, streamed = [], [], []
    stops = accel.stats["cast_stopped_at_stream"]
    rooms = (1.0, 1.0, 1.0, 0.3, 0.3, 1.0, 1.0, 0.0, 1.0, 1.0)
    for room in rooms:
        p = cm.clone()
        p.budget = room
        before = accel.stats["region_streamed"]
        replayed, here = _graphed_call(accel, p)
        per_call.append(replayed)
        resident.append(here)
        streamed.append(accel.stats["region_streamed"] - before)
    settled = (2, 4, 6, 9)
    assert [per_call[i] for i in settled] == [resident[i] for i in settled], (per_call, resident)
    assert resident[2] == n and 0 < resident[4] < n and resident[7] == 0, resident
    assert all(per_call[i] + streamed[i] == n for i in range(2, len(rooms))), (per_call, streamed)
    assert accel.stats["cast_stopped_at_stream"] > stops and accel.stats["region_eager"] == 0
    assert fake.captures == n and p.vbar().evictions > 0, (fake.captures, n)
    print(f"\nrooms {rooms}: replayed {per_call}, op by op {streamed}, fully resident after {resident}")


def test_warmups_memory_check_counts_what_dynamic_vram_gives_back(comfy, make_comfy_model, dynamic_vram,
                                                                   monkeypatch):
    """Warmup Shapes' memory floor takes the patcher's own count where it has one (the newest
    ``ModelPatcher.get_free_memory``: free memory plus the VBAR ranges Dynamic VRAM would evict, which
    ComfyUI's module-level ``get_free_memory`` leaves out and marks wrong for this), else the module's;
    an entry is refused only beyond that."""
    from unet_compiler.nodes.warmup import usable_memory
    dyn = dynamic_vram.patcher(make_comfy_model("sd15"), budget=1.0)
    _apply(dyn, "sd15")                                     # its slots faulted in, resident, unpinned
    monkeypatch.setattr(comfy.mm, "get_free_memory", lambda *a, **k: 2**20)
    resident = sum(size for size, _ in dyn.vbar().resident.values())
    room, where = usable_memory(dyn, torch.device("cpu"))
    assert resident > 0 and room == 2**20 + resident and "as ComfyUI counts it for sampling" in where, (room, where)
    plain = make_comfy_model("sd15")
    assert usable_memory(plain, torch.device("cpu"))[0] == 2**20     # 0.8.0's patcher: the module's count


def test_weights_converted_per_call_are_never_captured(make_comfy_model, dynamic_vram, monkeypatch,
                                                      strict_graph_standin):
    """Weights stored in fp16 and computed in fp32 (ComfyUI converts each slot's weight per call, a new
    tensor each time): every slot is resident, yet no region reads a weight that stays put, so none is
    captured or replayed; each call runs its launches, counted, == ComfyUI's eager."""
    fake = strict_graph_standin()
    cm, _, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, 1.0, weight_dtype=torch.float16)
    n = _regions(accel)
    for _ in range(3):
        replayed, resident = _graphed_call(accel, cm.clone())
        assert replayed == 0 and resident == n, (replayed, resident, n)
    assert fake.captures == 0 and accel.stats["region_cast_resident"] == 0, accel.stats
    assert accel.graphs.skipped["a weight patched or converted per call (not resident)"] > 0


#: the timeline's rates: a PCIe 4.0 x16 link, an H100's bf16 dense throughput and memory bandwidth;
#: host seconds per op or copy issued from Python (module call, dispatcher, launch), per graph launch
LINK, FLOPS, MEMORY, HOST, LAUNCH = 25e9, 400e12, 3e12, 5e-6, 10e-6


def _timed_call(dynamic_vram, p, calls: int = 4):
    """``calls`` calls of ``p`` (the resident set and the graphs settle), the last one recorded on a
    ``tests/_timeline.Timeline``: (its output, the timeline)."""
    from unet_compiler.tests._timeline import Timeline
    for _ in range(calls - 1):
        _apply(p, "sd15", load=True)
    timeline = dynamic_vram.timeline = Timeline()
    try:
        with timeline.recording():
            out = _apply(p, "sd15", load=True)
    finally:
        dynamic_vram.timeline = None
    return out, timeline


@pytest.mark.parametrize("room", [1.0, 0.8, 0.3, 0.0])
def test_streaming_as_comfyui_streams(make_comfy_model, dynamic_vram, monkeypatch, strict_graph_standin, room):
    """The timeline stand-in (tests/_timeline.py): one settled SD1.5 call at VBAR room 100 / 80 / 30 /
    0 %, its copies, stream waits, compute ops, graph launches and pins recorded under the double in
    the order ComfyUI issues them, scheduled at an H100's rates behind a PCIe 4.0 x16 link, with the
    host issuing each op from Python, and again with the compute slowed to last as long as eager's
    copies (where overlapping them matters most). Three ways: ComfyUI's own code; the pack as it was
    (every cast weight of a region cast up front, the shared buffers' views copied); the pack now
    (a region whose weights stream runs op by op, each op cast where it runs; resident regions
    replay their graphs). Now: no more bytes copied than eager, a makespan no longer than eager's at
    either rate, and no more pinned at once than eager plus the largest region's slots (what a
    replay pins). Before: at the slowed rate, longer than now wherever weights stream (and than
    eager at 30 and 0 %: the copies of a streaming region all ahead of its compute)."""
    from unet_compiler.compiler import cast
    fake = strict_graph_standin()
    cm, base, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, room)
    rows = {}
    for way in ("eager", "before", "now"):
        p = cm.clone()
        p.budget = room
        with monkeypatch.context() as m:
            if way == "before":
                m.setattr(cast, "_streams", lambda leaf, device: False, raising=False)
            if way == "eager":
                m.setattr(accel.gate, "bypassed", True)
            out, t = _timed_call(dynamic_vram, p)
        with accel.bypass():
            _close(out, _apply(p, "sd15", load=False))
        rows[way] = t
    eager = rows["eager"]
    slow = FLOPS * eager.copied() / LINK / eager.flops() if eager.copied() else 1.0
    spans = {way: (t.makespan(LINK, FLOPS, MEMORY, HOST, LAUNCH),
                   t.makespan(LINK, FLOPS / slow, MEMORY / slow, HOST, LAUNCH)) for way, t in rows.items()}
    largest = max(sum(m._v[2] for m in r.module.modules() if "_v" in m.__dict__) for r in accel.plan.regions)
    print(f"\nroom {room:.0%}: " + "; ".join(
        f"{way} {spans[way][0] * 1e6:.0f} / {spans[way][1] * 1e6:.0f} us, copied {t.copied() >> 10} KiB, "
        f"pinned peak {t.peak_pinned() >> 10} KiB" for way, t in rows.items()))
    now = rows["now"]
    assert now.copied() <= eager.copied(), (now.copied(), eager.copied())
    assert all(now_ <= eager_ for now_, eager_ in zip(spans["now"], spans["eager"], strict=True)), spans
    assert now.peak_pinned() <= eager.peak_pinned() + largest, (now.peak_pinned(), eager.peak_pinned(), largest)
    if room < 1:
        assert spans["before"][1] > spans["now"][1], spans


def test_a_resident_call_is_one_graph(comfy, make_comfy_model, dynamic_vram, monkeypatch, strict_graph_standin):
    """One CUDA graph per UNet call under Dynamic VRAM: once every slot is resident (a load's first call
    fills them, op by op), a call is captured whole and replayed, each slot faulted in and pinned
    around the replay (comfy-aimdo's ``vbar_fault`` / ``vbar_unpin``, as ComfyUI's cast of a resident
    slot does) and read in place. A LoRA strength change refills the slots in place: that call goes
    region by region, the next replays the same graph. Room taken by another model sends calls
    region by region, counted, until the slots are back. == ComfyUI's eager every call, no pin left.
    A replay reads the slots' addresses only: no leaf is shown its weights (host time per call).
    (Before: every call under Dynamic VRAM went region by region, "ComfyUI casts or patches weights
    per call".)"""
    from unet_compiler.compiler import cast
    from unet_compiler.compiler.call_graph import CallGraphs
    show, shown = cast._show, Counter()
    monkeypatch.setattr(cast, "_show", lambda leaf, w, b: shown.update(["leaves"]) or show(leaf, w, b))
    fake = strict_graph_standin()
    cm, base, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, 1.0)
    accel.call_graphs = c = CallGraphs(accel.root, accel.graphs, accel.stats)
    patches = _lora(comfy, base, 0.05)
    seen, shows = [], []
    for strength, room, calls in ((None, 1.0, 4), (1.0, 1.0, 2), (0.5, 1.0, 2), (0.5, 0.3, 2), (0.5, 1.0, 3)):
        p = cm.clone()
        if strength is not None:
            p.add_patches(patches, strength)
        p.budget = room
        for _ in range(calls):
            before, skipped, leaves = Counter(c.graphs.stats), sum(c.skipped.values()), shown["leaves"]
            _graphed_call(accel, p)
            shows.append(shown["leaves"] - leaves)
            after = Counter(c.graphs.stats)
            after.subtract(before)
            seen.append("regions" if sum(c.skipped.values()) > skipped else "capture" if after["captured"] else
                        "replay" if after["replays"] else "whole")
    print(f"\nper call: {seen}\n{accel.text()}")
    # a load's first call fills the slots; the next runs whole, the third captures, then replays
    assert seen[:4] == ["regions", "whole", "capture", "replay"], seen
    # each strength change: the call that refills the slots goes region by region, the next replays
    assert seen[4:8] == ["regions", "replay"] * 2, seen
    # room for 30 %: region by region; room back: refilled, then replays again, never captured again
    assert seen[8:] == ["regions"] * 3 + ["replay"] * 2, seen
    assert c.graphs.stats["captured"] == 1 and accel.stats["region_eager"] == 0, accel.text()
    assert c.skipped["a weight ComfyUI casts per call is not resident (streamed, converted or patched per "
                     "call)"] == seen.count("regions")
    assert "one graph per UNet call: 1 captured, 6 replays" in accel.text()
    # the model's code sees the slots as parameters where a whole call runs it (its first run, capture)
    assert all(n == 0 for kind, n in zip(seen, shows, strict=True) if kind == "replay"), (seen, shows)
    assert all(n > 0 for kind, n in zip(seen, shows, strict=True) if kind in ("whole", "capture")), (seen, shows)
    # while a whole call holds the slots, every region counts as busy (the priming thread keeps off)
    region = accel.plan.regions[0].module
    with cast.slots_resident(c._leaves, torch.float32, torch.device("cpu")) as resident:
        assert resident and cast.busy(region) and p.vbar().pinned() > 0
    assert not cast.busy(region) and p.vbar().pinned() == 0


def test_copies_land_only_at_the_compute_streams_wait(comfy, make_comfy_model, dynamic_vram, monkeypatch,
                                                      strict_graph_standin):
    """Stand-in streams (``dynamic_vram.late``): a weight copied on an offload stream lands only when the
    compute stream waits for that stream, its bytes NaN until then, as a read that skipped the wait may
    see on a GPU. ComfyUI's own code is unchanged by it (bit for bit); the pack at room 50 % (regions
    op by op where their weights stream, resident ones through their graphs, calls whole once every
    slot is resident) stays == eager over prompts. A deliberately broken ordering (the compute stream
    never waits: every streamed weight read before it lands) gives NaN, so the check can fail."""
    from unet_compiler.compiler.call_graph import CallGraphs
    base = make_comfy_model("sd15")
    ref = _apply(base, "sd15")
    fake = strict_graph_standin()
    cm, dyn, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, 0.5)
    accel.call_graphs = CallGraphs(accel.root, accel.graphs, accel.stats)
    dynamic_vram.late = True
    torch.testing.assert_close(_apply(dyn, "sd15"), ref, rtol=0, atol=0)
    for room in (0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0):
        p = cm.clone()
        p.budget = room
        _graphed_call(accel, p)
    assert accel.stats["region_streamed"] > 0 and accel.graphs.stats["replays"] > 0, accel.stats
    assert accel.call_graphs.graphs.stats["replays"] > 0 and accel.stats["region_eager"] == 0
    p = cm.clone()
    p.budget = 0.5
    monkeypatch.setattr(dynamic_vram, "_wait", lambda waiter, on: None)
    assert not torch.isfinite(_apply(p, "sd15")).all()


def test_aimdos_eviction_from_the_top_and_a_pack_that_skips_the_fault(comfy, make_comfy_model, dynamic_vram,
                                                                        monkeypatch, strict_graph_standin):
    """The double's VBAR evicts as comfy-aimdo does: room taken by another model evicts from the top of
    the VBAR down, the watermark following, so the lowest slots stay resident and a fault above the
    watermark streams until the model is loaded again. After the room shrinks under whole-call graphs,
    the pack faults every slot before a replay (``cast.slots_resident``): that call goes region by
    region, == eager. A pack that trusted the slots it saw last call (no fault, no signature check)
    replays over evicted ranges (NaN in the double) and gives NaN."""
    from unet_compiler.compiler import cast
    from unet_compiler.compiler.call_graph import CallGraphs
    fake = strict_graph_standin()
    cm, _, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, 1.0)
    accel.call_graphs = c = CallGraphs(accel.root, accel.graphs, accel.stats)
    p = cm.clone()
    for _ in range(4):
        _graphed_call(accel, p)
    vbar = p.vbar()
    assert c.graphs.stats["replays"] >= 1 and vbar.watermark == vbar.max_size
    top = max(vbar.resident)
    vbar.set_budget(vbar.used() // 3)                    # another model takes two thirds of the room
    assert top not in vbar.resident and vbar.watermark <= top and min(vbar.resident) == 0
    replays = c.graphs.stats["replays"]
    got = _apply(p, "sd15", load=False)                 # (no load: the watermark stays down)
    with accel.bypass():
        _close(got, _apply(p, "sd15", load=False))
    assert c.graphs.stats["replays"] == replays and accel.stats["region_streamed"] > 0
    assert vbar.pinned() == 0 and top not in vbar.resident
    monkeypatch.setattr(cast, "_resident_now",
                        lambda leaf, dtype, device, vbar, pinned: (leaf.__dict__.get("_v_weight"),
                                                                   leaf.__dict__.get("_v_bias"))
                        if "_v" in leaf.__dict__ else (leaf.weight, leaf.bias))
    out = _apply(p, "sd15", load=False)
    assert c.graphs.stats["replays"] == replays + 1
    assert not torch.isfinite(out).all()


def test_weights_stored_in_fp32_with_bf16_slots(comfy, dynamic_vram, monkeypatch, strict_graph_standin):
    """The newest ComfyUI keeps a checkpoint's fp32 tensors on the CPU under a bf16 model; each VBAR
    slot holds bf16 (``_comfy_model_dtype``), converted into at each fill, so a resident call reads
    the slot's bf16 views as they are. A bf16 SD1.5 stored in fp32 under the double: ComfyUI's eager
    == the plain bf16 model bit for bit; the pack (regions op by op while the slots fill, then one
    graph per call reading the bf16 views in place) == eager, and it takes the model's dtype as
    bf16, not the stored fp32 (its precision note). (Before: the report took fp32 from the stored
    weights.)"""
    from unet_compiler.compiler.backends import inductor
    from unet_compiler.compiler.call_graph import CallGraphs
    from unet_compiler.compiler.graphs import RegionGraphs
    from unet_compiler.compiler.shims import TOLERANCE
    from unet_compiler.tests._patch_compat import build_tiny

    def bf16_sd15():   # built and computing in bf16 (ComfyUI's set_inference_dtype(bf16, None))
        return build_tiny("sd15", weight_dtype=torch.bfloat16, manual_cast=None)
    ref = _apply(bf16_sd15(), "sd15")
    dyn = dynamic_vram.patcher(bf16_sd15(), budget=1.0, stored=torch.float32)
    torch.testing.assert_close(_apply(dyn, "sd15"), ref, rtol=0, atol=0)
    slotted = [m for m in dyn.model.diffusion_model.modules() if "_v" in m.__dict__]
    assert slotted and all(m.weight.dtype == torch.float32 and m._v_weight.dtype == torch.bfloat16 for m in slotted)
    monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)
    cm, _ = patcher.compile_model(dyn, CompileConfig(backend="inductor", precision="fp32"))
    accel = patcher.accelerator_of(cm)
    accel.graphs = RegionGraphs(graphs=strict_graph_standin())
    accel.backend.streams_op_by_op = True
    accel.call_graphs = c = CallGraphs(accel.root, accel.graphs, accel.stats)
    assert accel.model_dtype == torch.bfloat16 and "precision fp32 needs the model loaded in fp32 (it is " \
        "torch.bfloat16)" in accel.text(), accel.text()
    p = cm.clone()
    for _ in range(4):
        got = _apply(p, "sd15")
        with accel.bypass():
            want = _apply(p, "sd15", load=False)
        # bf16: the pack's compare tolerance for it, and a relative L2 a wrong weight would not meet
        # (bf16 rounding through the tiny UNet, SDPA against ComfyUI's attention: 1.6e-2 measured)
        scale = max(1.0, float(want.float().abs().max()))
        assert float((got.float() - want.float()).abs().max()) <= TOLERANCE[torch.bfloat16] * scale
        assert _rel(got, want) < 3e-2, _rel(got, want)
    assert c.graphs.stats["replays"] >= 1 and accel.stats["region_eager"] == 0, accel.text()
    assert p.vbar().pinned() == 0


def test_a_fault_error_before_a_whole_call_leaves_it_to_comfyuis_cast(comfy, make_comfy_model, dynamic_vram,
                                                                      monkeypatch, strict_graph_standin):
    """comfy-aimdo's fault can raise (VBAR_FAULT_ERROR). The pack's own fault before a whole call never
    lets that out: the call goes region by region, where ComfyUI's cast meets whatever the VBAR does
    next (here it works again), == eager, no pin left."""
    import comfy_aimdo.model_vbar as model_vbar

    from unet_compiler.compiler.call_graph import CallGraphs
    cm, _, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, strict_graph_standin(), 1.0)
    accel.call_graphs = c = CallGraphs(accel.root, accel.graphs, accel.stats)
    p = cm.clone()
    for _ in range(3):
        _graphed_call(accel, p)
    real, failed = model_vbar.vbar_fault, []

    def once(alloc):
        if not failed:
            failed.append(alloc)
            raise RuntimeError("Fault failed: 2")
        return real(alloc)
    monkeypatch.setattr(model_vbar, "vbar_fault", once)
    skipped = sum(c.skipped.values())
    _graphed_call(accel, p)
    assert failed and sum(c.skipped.values()) == skipped + 1 and accel.stats["region_eager"] == 0



def _counted_call(accel, p, card) -> torch.Tensor:
    """One compiled call of ``p`` with its allocations on ``card``, == ComfyUI's eager on the same card."""
    with card.counting():
        got = _apply(p, "sd15", load=True)
        with accel.bypass():
            want = _apply(p, "sd15", load=False)
    _close(got, want)
    assert p.vbar().pinned() == 0
    return got


def _on_card(cm, base, accel):
    """(card, slotted bytes, ComfyUI's eager call's peak on the card) with ``base``'s VBAR attached,
    every slot faulted in."""
    from unet_compiler.tests._dynamic_vram import Card
    p = cm.clone()
    _apply(p, "sd15")
    card = Card(1 << 40).attach(p.vbar())
    with card.counting(), accel.bypass():
        _apply(p, "sd15", load=True)
    slotted = sum(m._v[2] for m in base.model.modules() if "_v" in m.__dict__)
    return card, slotted, card.peak


def test_allocations_take_the_weights_room(comfy, make_comfy_model, dynamic_vram, monkeypatch, strict_graph_standin):
    """The card shared as comfy-aimdo shares it (``tests/_dynamic_vram.Card``): each allocation first
    evicts the VBAR ranges it lacks room for. SD1.5 with region graphs, its slots all resident, on a
    card that holds the weights and ComfyUI's eager activations only by evicting some: two prompts of
    two calls, compiled == eager on the same card, the regions found evicted stream op by op, no pin
    left, nothing runs out of memory. (The graphs' static buffers and pool hold memory aimdo cannot
    evict, so the pack leaves fewer weights resident than ComfyUI alone: printed.)"""
    fake = strict_graph_standin()
    cm, base, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, 1.0)
    card, slotted, activations = _on_card(cm, base, accel)
    card.size = slotted + activations * 3 // 4
    card.peak = 0
    for _ in range(2):
        p = cm.clone()
        for _ in range(2):
            _counted_call(accel, p, card)
    assert card.evicted > 0 and card.ooms == 0, (card.evicted, card.ooms)
    assert accel.stats["region_streamed"] > 0 and accel.stats["region_eager"] == 0, accel.stats
    print(f"\ncard {card.size} bytes ({slotted} slotted, eager's activations {activations}): evicted "
          f"{card.evicted} bytes, held {card.held()} after (graph pool {card.pool}), peak {card.peak}, "
          f"replays {accel.graphs.stats['replays']}, regions streamed {accel.stats['region_streamed']}")


@pytest.mark.parametrize("whole", [False, True], ids=["region graphs", "one graph per call"])
def test_a_forward_set_on_one_op_runs(comfy, make_comfy_model, dynamic_vram, monkeypatch, strict_graph_standin,
                                      whole):
    """Another pack's forward set on one op instance (its ``forward_comfy_cast_weights``, here adding 1),
    under Dynamic VRAM: showing the region its cast weights takes the op's plain forward, which would
    skip it, so the regions holding it run the model's own code: compiled == eager, the override
    called in every call. (Before: the class's kind was read, the override never ran: 1.9 off.)"""
    import types

    from unet_compiler.compiler import call_graph
    cm, base, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, strict_graph_standin(), 1.0)
    if whole:
        accel.call_graphs = call_graph.CallGraphs(accel.root, accel.graphs, accel.stats)
    leaf = cm.model.diffusion_model.input_blocks[1][0].out_layers[3]   # a ResBlock's last conv
    own, calls = type(leaf).forward_comfy_cast_weights, []

    def plus_one(self, x):
        calls.append(1)
        return own(self, x) + 1.0
    leaf.forward_comfy_cast_weights = types.MethodType(plus_one, leaf)
    for i in range(3):
        p = cm.clone()
        n = len(calls)
        got = _apply(p, "sd15")
        assert len(calls) == n + 1, f"call {i}: the op's own forward did not run"
        with accel.bypass():
            _close(got, _apply(p, "sd15", load=False))
        assert p.vbar().pinned() == 0


def test_a_whole_call_out_of_memory_with_its_slots_pinned_runs_region_by_region(
        comfy, make_comfy_model, dynamic_vram, monkeypatch, strict_graph_standin):
    """One graph per UNet call pins every slot for the call; its first run and capture allocate, and on
    a card where ComfyUI's eager fits only by evicting weights (the card above) that runs out of memory
    where ComfyUI's own casts, one op's slot pinned at a time, do not. That call runs region by region
    (ComfyUI casting each op), == eager on the same card, no pin left, and so does every later call at
    that signature without trying again; the report says why. (Before: the error reached ComfyUI.)"""
    from unet_compiler.compiler import call_graph
    fake = strict_graph_standin()
    cm, base, accel = _graphed(make_comfy_model, dynamic_vram, monkeypatch, fake, 1.0)
    accel.call_graphs = call_graph.CallGraphs(accel.root, accel.graphs, accel.stats)
    card, slotted, activations = _on_card(cm, base, accel)
    card.size = slotted + activations * 3 // 4
    p = cm.clone()
    _counted_call(accel, p, card)
    first = card.ooms
    assert first > 0, "the card must be too small for a call with every slot pinned"
    for _ in range(3):
        _counted_call(accel, p, card)
    assert card.ooms == first, "a later call at that signature tried one graph again"
    assert accel.call_graphs.skipped[call_graph.OUT_OF_MEMORY_PINNED] == 4, accel.call_graphs.skipped
    assert accel.call_graphs.graphs.stats["captured"] == 0
    assert "out of memory with every weight pinned" in accel.text(), accel.text()


def test_accelerated_code_out_of_memory_runs_the_models_own(comfy, make_comfy_model, dynamic_vram, monkeypatch):
    """Compiled region bodies that need more memory than the card has (a scratch as large as the
    card): each region call runs out of memory in the accelerated code and runs the model's own code
    instead, == ComfyUI's eager on the same card, no pin left; the regions stay accelerated, counted
    per call and said once per kind in the report. A card too small for the model's own code: that
    out of memory reaches ComfyUI as its own error (``torch.OutOfMemoryError``, which its executor
    handles), nothing of the pack's chained, the regions still on."""
    from unet_compiler.compiler.backends import inductor
    card = None

    def hungry(body, *a, **k):
        def run(*args, **kwargs):
            if card is not None:
                torch.empty(card.size, dtype=torch.uint8)  # a workspace the card cannot hold
            return body(*args, **kwargs)
        return run
    monkeypatch.setattr(inductor, "region_body", hungry)
    base = dynamic_vram.patcher(make_comfy_model("sd15"), budget=1.0)
    cm, _ = patcher.compile_model(base, CFG)
    accel = patcher.accelerator_of(cm)
    accel.backend.streams_op_by_op = True
    card, slotted, activations = _on_card(cm, base, accel)
    card.size = slotted + 2 * activations
    kinds = dict(accel.report.regions)
    for _ in range(2):
        _counted_call(accel, cm.clone(), card)
    # (this CPU's projection regions run oneDNN's prepacked conv, not a region body: no workspace)
    bodies = {kind: n for kind, n in kinds.items() if kind != "projection"}
    assert accel.stats["oom_calls_eager"] == card.ooms == 2 * sum(bodies.values()) > 0, (accel.stats, card.ooms)
    assert not accel.gate.failed and dict(accel.report.regions) == kinds, accel.text()
    text = accel.text()
    assert all(text.count(f"out of memory in {kind} accelerated code") == 1 for kind in bodies), text

    card.size = slotted // 4                              # not even the model's own code fits
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory") as e, card.counting():
        _apply(cm.clone(), "sd15", load=True)
    assert e.value.__cause__ is None and e.value.__context__ is None, e.value
    assert base.vbar().pinned() == 0 and not accel.gate.failed, accel.text()
