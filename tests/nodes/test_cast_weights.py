"""Weights ComfyUI casts or patches per call (fp8 / fp16 / bf16 storage, a partial load with a
LoRA, ops that keep their own arithmetic), through Compile UNet on ComfyUI's own UNetModel (CPU).

Compiled == eager at 1e-4 (fp32 compute: only the graphs' fp32 rounding differs; measured ~1e-5),
every region ran compiled code with ComfyUI's cast done outside the graph, and nothing compiles
again when the storage dtype, the LoRA strength or the partial-load split changes."""
from collections import Counter

import pytest
import torch

from unet_compiler.compiler import cast
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher
from unet_compiler.tests._written import as_written

from .test_comfy_patcher import _apply, _close, _lora

pytestmark = pytest.mark.comfy
CFG = CompileConfig(backend="inductor")
STORAGE = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16]


def _regions(accel) -> int:
    return sum(accel.report.regions.values())


def _eager_of(cm, **shape):
    accel = patcher.accelerator_of(cm)
    with accel.bypass():
        return _apply(cm, "sd15", load=False, **shape)


def _compiled_matches_eager(mp):
    """Compile UNet + Warmup Shapes on ``mp``: the status says N of N regions ran compiled code, a
    sampling-style call == eager, no region call ran the model's code, some ran with ComfyUI's cast
    outside the graph. Returns the accelerator."""
    ref = _apply(mp, "sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    n = _regions(accel)
    assert f"status: inductor: compiled, {n} of {n} regions ran compiled code" in text, text
    _close(_apply(cm, "sd15"), ref)
    assert accel.stats["region_eager"] == 0 and accel.stats["region_cast_compiled"] > 0, accel.text()
    assert accel.stats["recompiles_after_warmup"] == 0
    assert "compiled with ComfyUI's cast outside the graph" in accel.text()
    return accel


def test_each_stored_dtype_runs_compiled_with_comfys_cast(make_comfy_model):
    """fp8_e4m3fn / fp8_e5m2 / fp16 / bf16 storage, fp32 compute (ComfyUI's manual_cast ops): every
    region compiled, compiled == eager; after the first storage dtype the others compile nothing
    (the graphs do not see the storage dtype)."""
    for i, dtype in enumerate(STORAGE):
        mp = make_comfy_model("sd15", weight_dtype=dtype)
        assert next(mp.model.diffusion_model.parameters()).dtype == dtype
        accel = _compiled_matches_eager(mp)
        if i:
            assert accel.stats["graphs_compiled"] == 0, f"{dtype}: {accel.text()}"


def test_partial_load_with_lora_and_a_changing_split(comfy, make_comfy_model):
    """ComfyUI's own partial load (``ModelPatcher.load`` with a memory budget): the modules past
    the budget cast per call and apply the LoRA per call (LowVramPatch weight functions). Compiled ==
    eager for three prompts that change the split and the LoRA strength; nothing recompiles."""
    base = make_comfy_model("sd15", weight_dtype=torch.float16)
    cm, _ = patcher.compile_model(base, CFG)
    patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    size = base.model_size()
    seen = []
    for fraction, strength in ((0.5, 1.0), (0.2, 0.5), (0.8, 0.8)):
        lora = cm.clone()
        lora.add_patches(_lora(comfy, base, 0.05), strength)
        lora.unpatch_model(lora.offload_device)
        lora.load(torch.device("cpu"), lowvram_model_memory=int(size * fraction), full_load=False)
        unet = lora.model.diffusion_model
        offloaded = [m for m in unet.modules() if hasattr(m, "prev_comfy_cast_weights")]   # ComfyUI's mark
        functions = sum(len(getattr(m, "weight_function", ())) for m in offloaded)
        assert offloaded and functions, "the budget must offload some modules that carry the LoRA"
        seen.append(len(offloaded))
        before = accel.stats.copy()
        out = _apply(lora, "sd15", load=False)
        ref = _eager_of(lora)
        _close(out, ref)
        assert accel.stats["region_eager"] == before["region_eager"], accel.text()
        assert accel.stats["region_cast_compiled"] > before["region_cast_compiled"]
        lora.unpatch_model(lora.offload_device)
    assert len(set(seen)) == 3, f"the split did not change: {seen}"
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()


def test_ops_with_their_own_arithmetic_stay_eager_and_are_named(comfy, make_comfy_model):
    """A leaf whose per-call weights are not ComfyUI's stock cast (another pack's dequantising ops,
    GGUF-style) keeps the model's own code, and the report names the ops and the region kind; the
    same model with stock ops compiles."""
    mp = make_comfy_model("sd15", weight_dtype=torch.float16)
    unet = mp.model.diffusion_model
    base = comfy.ops.manual_cast.Linear

    class DequantLinear(base):   # another pack's ops: its own per-call weights
        def forward_comfy_cast_weights(self, input):
            w, b = comfy.ops.cast_bias_weight(self, input)
            return torch.nn.functional.linear(input, w * 1.0, b)
    as_written(DequantLinear, "other_pack.ops")
    leaf = unet.input_blocks[1][1].transformer_blocks[0].attn1.to_q
    leaf.__class__ = DequantLinear
    assert cast.why_not(leaf) and "other_pack.ops" in cast.why_not(leaf)
    ref = _apply(mp, "sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    _close(_apply(cm, "sd15"), ref)
    assert accel.cast_eager == {"attention": cast.why_not(leaf)}, accel.cast_eager
    assert accel.stats["region_eager_cast"] > 0 and accel.stats["region_cast_compiled"] > 0
    assert "other_pack.ops" in accel.text() and "attention" in accel.text()
    n = _regions(accel)
    assert f"{n - 1} of {n} regions ran compiled code" in text, text


def test_warmup_spends_no_calls_where_every_region_runs_another_packs_ops(comfy, make_comfy_model):
    """Every leaf that matters another pack's ops (a GGUF-style loader): no region can run compiled
    code, so Warmup Shapes says so at once, with the reason and the ops' name, and makes no call of
    the model (its probes would each be an eager call of the whole UNet: minutes on a GGUF model);
    sampling then runs the model's own code, right."""
    mp = make_comfy_model("sd15", weight_dtype=torch.float16)
    unet = mp.model.diffusion_model

    def other(base):
        class Dequant(base):
            def forward_comfy_cast_weights(self, input, *args, **kwargs):
                return super().forward_comfy_cast_weights(input, *args, **kwargs)
        return as_written(Dequant, "other_pack.ops")
    linear, conv = other(comfy.ops.manual_cast.Linear), other(comfy.ops.manual_cast.Conv2d)
    for m in unet.modules():
        if type(m) is comfy.ops.manual_cast.Linear:
            m.__class__ = linear
        elif type(m) is comfy.ops.manual_cast.Conv2d:
            m.__class__ = conv
    ref = _apply(mp, "sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    calls = []
    hook = unet.register_forward_pre_hook(lambda *a: calls.append(1))
    text = patcher.warmup_model(cm, "1x64x64, 2x64x64, 2x96x96", 77)
    hook.remove()
    assert calls == [], f"warmup called the model {len(calls)} time(s) with nothing to compile"
    assert "nothing to warm up (3 shape(s) skipped)" in text and "other_pack.ops" in text, text
    assert "Warmup Shapes ran no calls: every region runs the model's own code" in text, text
    _close(_apply(cm, "sd15"), ref)
    accel = patcher.accelerator_of(cm)
    assert accel.ran_compiled()[0] == 0 and accel.stats["region_eager_cast"] > 0


def test_fp8_matmul_ops_are_named(comfy, make_comfy_model):
    """ComfyUI's fp8 matmul ops (fp8_e4m3fn_fast on fp8 GPUs) keep their scaled fp8 matmul: named."""
    mp = make_comfy_model("sd15", weight_dtype=torch.float8_e4m3fn)
    leaf = mp.model.diffusion_model.input_blocks[1][1].transformer_blocks[0].ff.net[2]
    leaf.__class__ = comfy.ops.fp8_ops.Linear
    assert "fp8 matmul" in cast.why_not(leaf)
    todo, why = cast.plan([leaf])
    assert todo == () and "fp8_e4m3fn_fast" in why


def test_a_failed_call_puts_the_weights_back(comfy, make_comfy_model):
    """An error inside the compiled call (here: in the body) leaves every leaf as it was: its stored
    weight, its cast flag and its functions."""
    mp = make_comfy_model("sd15", weight_dtype=torch.float8_e4m3fn)
    attn = mp.model.diffusion_model.input_blocks[1][1].transformer_blocks[0].attn1
    leaves = [attn.to_q, attn.to_k]
    attn.to_q.weight_function = [lambda w: w * 2]
    before = [(m.weight, m.bias, dict(m.__dict__)) for m in leaves]
    todo, why = cast.plan(leaves)
    assert why is None and len(todo) == 2
    x = torch.zeros(1, 4, 32)
    with pytest.raises(RuntimeError, match="boom"):
        with cast.applied(attn, todo, (x,), Counter()) as (_, show), show():
            assert attn.to_q.weight.dtype == torch.float32 and not attn.to_q.comfy_cast_weights
            assert attn.to_q.weight_function == [] and cast.busy(attn)
            torch.testing.assert_close(attn.to_q.weight, before[0][0].float() * 2)
            raise RuntimeError("boom")
    for m, (w, b, d) in zip(leaves, before, strict=True):
        assert m.weight is w and m.bias is b and m.__dict__ == d
    assert not cast.busy(attn)


def test_a_stand_in_shows_the_cast_and_leaves_the_model_alone(comfy, make_comfy_model, monkeypatch):
    """The compile thread's copy: its leaves show weights of the cast's shape, dtype and device (zeros:
    the compiled code depends on nothing else) without calling ComfyUI's cast (which pins memory
    and reads the sampling thread's per-call state); the model's own are untouched."""
    mp = make_comfy_model("sd15", weight_dtype=torch.float8_e4m3fn)
    block = mp.model.diffusion_model.input_blocks[1][0]
    stored = {n: p for n, p in block.named_parameters()}

    def no_cast(*args, **kwargs):
        raise AssertionError("the compile thread called ComfyUI's cast")
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", no_cast)
    copy = cast.stand_in(block, (torch.zeros(1, 32, 8, 8), torch.zeros(1, 128)))
    assert copy is not block and not cast.needs_cast(copy) and cast.needs_cast(block)
    for n, p in copy.named_parameters():
        assert p.dtype == torch.float32 and p.shape == stored[n].shape and p.is_contiguous() and not p.any(), n
    # one buffer the size of the largest weight, seen through views: no second copy of the region's weights
    storages = {p.untyped_storage().data_ptr() for p in copy.parameters()}
    largest = max(p.numel() for p in stored.values())
    assert len(storages) == 1 and next(copy.parameters()).untyped_storage().nbytes() == largest * 4
    assert {n: p for n, p in block.named_parameters()} == stored
    assert all(p.dtype == torch.float8_e4m3fn for p in block.parameters())


def _mixed_precision_sd15(comfy, make_comfy_model):
    """A ComfyUI mixed-precision ("scaled fp8") tiny SD1.5: every transformer-block linear stored as
    fp8 with a per-tensor scale and its ``comfy_quant`` metadata, loaded by ComfyUI's
    mixed_precision_ops (no fp8 matmul on a CPU: each dequantizes per call), the rest fp32."""
    import json
    from unet_compiler.tests._patch_compat import TINY
    sd = make_comfy_model("sd15").model.diffusion_model.state_dict()
    spec = TINY["sd15"]
    cfg = getattr(comfy.sm, spec["cls"])(dict(spec["unet"]))
    cfg.unet_config = dict(spec["unet"])
    cfg.quant_config, cfg.manual_cast_dtype = {"mixed_ops": True}, torch.float32
    base = cfg.get_model({})
    quant = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.dim() == 2 and "transformer_blocks" in k:
            layer, scale = k[:-len(".weight")], v.abs().max() / 448
            quant[k] = (v / scale).to(torch.float8_e4m3fn)
            quant[f"{layer}.weight_scale"] = scale.float()
            quant[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                         dtype=torch.uint8)
        else:
            quant[k] = v
    missing, unexpected = base.diffusion_model.load_state_dict(quant, strict=False)
    assert not missing and not unexpected
    base.eval()
    return comfy.mp.ModelPatcher(base, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def test_mixed_precision_checkpoint_runs_compiled(comfy, make_comfy_model):
    """ComfyUI's scaled-fp8 / mixed-precision checkpoints: the quantized linears dequantize per call
    (ComfyUI's own code, outside the graph), every region compiled, compiled == eager."""
    mp = _mixed_precision_sd15(comfy, make_comfy_model)
    leaf = mp.model.diffusion_model.input_blocks[1][1].transformer_blocks[0].attn1.to_q
    assert type(leaf.weight).__name__ == "QuantizedTensor" and cast.per_call(leaf) and cast.why_not(leaf) is None
    _compiled_matches_eager(mp)
    assert type(leaf.weight).__name__ == "QuantizedTensor"   # put back after each call


def test_the_per_call_check_reads_comfyuis_flags_where_its_patcher_sets_them(comfy):
    """``has_cast_weights`` (asked for every leaf of a region at each call) answers as ``getattr``
    would for ComfyUI's op flags: the class's (manual_cast: cast), an instance's set by its patcher
    (a partial load, a LoRA weight function), a class flag changed later; a module that is not
    ComfyUI's (a diffusers UNet's) has none, without the raised miss of nn.Module.__getattr__."""
    from unet_compiler.compiler.compat.comfy import has_cast_weights
    ops = comfy.ops
    plain, stock, cast_op = torch.nn.Linear(2, 2), ops.disable_weight_init.Linear(2, 2), ops.manual_cast.Linear(2, 2)
    assert not has_cast_weights(plain) and not has_cast_weights(stock) and has_cast_weights(cast_op)
    stock.comfy_cast_weights = True                      # what a partial load sets per op
    assert has_cast_weights(stock)
    del stock.comfy_cast_weights
    stock.weight_function = [lambda w: w]                # a LoRA patched per call
    assert has_cast_weights(stock)
    stock.weight_function = []
    assert not has_cast_weights(stock)

    class Flagged(torch.nn.Linear):
        comfy_cast_weights = False
    f = Flagged(2, 2)
    assert not has_cast_weights(f)
    Flagged.comfy_cast_weights = True                    # read live, not remembered per class
    assert has_cast_weights(f)


def test_the_regions_quick_check_finds_what_the_planner_would(comfy, make_comfy_model):
    """``cast.none_per_call`` (each region call's first check, over the leaves ``cast.watch`` took at compile
    time) is True only where ``cast.plan`` finds nothing to cast, and reads every flag live: a
    partial load's flag, a LoRA weight function, a bias function, a class flag changed later, a
    dequantizing or quantized leaf (its instance attributes), all set after the watch."""
    ops = comfy.ops
    plain, stock, cast_op = torch.nn.Linear(2, 2), ops.disable_weight_init.Linear(2, 2), ops.manual_cast.Linear(2, 2)

    def agree(*leaves):
        idle = cast.none_per_call(cast.watch(leaves))
        todo, why = cast.plan(leaves)
        assert not (idle and (todo or why)), (leaves, todo, why)
        assert idle == (not any(cast.per_call(m) or cast.quantized(m) for m in leaves))
        return idle
    assert agree(plain, stock) and not agree(plain, cast_op)
    watched = cast.watch([plain, stock])
    for name, value in (("comfy_cast_weights", True), ("weight_function", [lambda w: w]),
                        ("bias_function", [lambda b: b]), ("_full_precision_mm", True)):
        setattr(stock, name, value)
        assert not cast.none_per_call(watched) and not agree(stock), name
        setattr(stock, name, type(value)())             # what ComfyUI's unpatch leaves: False / []
        assert cast.none_per_call(watched) and agree(stock), name
    stock.layout_type = "TensorCoreFP8Layout"          # a mixed-precision leaf (quantized matmul)
    assert not cast.none_per_call(watched) and not agree(stock)
    del stock.layout_type

    class Flagged(torch.nn.Linear):
        comfy_cast_weights = False
    f = Flagged(2, 2)
    watched = cast.watch([f])
    assert cast.none_per_call(watched)
    Flagged.comfy_cast_weights = True                    # read live, not remembered per class
    assert not cast.none_per_call(watched) and not agree(f)
    Flagged.comfy_cast_weights = False
    # another pack swaps a leaf's class for its own per-call op (what a GGUF-style loader may do)
    fresh = ops.disable_weight_init.Linear(2, 2)
    own = type("Linear", (type(fresh),), {"__module__": "other_pack.ops", "comfy_cast_weights": True})
    watched = cast.watch([plain, fresh])
    fresh.__class__ = own
    assert not cast.none_per_call(watched) and not agree(fresh)
    # a whole model's regions: every region's quick check agrees with the planner, fp8 storage or not
    for dtype in (torch.float32, torch.float8_e4m3fn):
        mp = make_comfy_model("sd15", weight_dtype=dtype)
        from unet_compiler.compiler import plan as P    # noqa: N812
        for region in P.build_plan(mp.model.diffusion_model).regions:
            assert cast.none_per_call(cast.watch(region.leaves)) == (cast.plan(region.leaves) == ((), None)), region.path


def test_a_model_stays_busy_until_its_own_whole_call_ends():
    """Two sampling threads (one per GPU, each its own model copy) whose whole calls overlap: when one
    call ends first, the other's leaves still show their weights, so every region stays busy (the
    priming thread keeps off it) until that call ends too. (Before: one shared token, removed by the
    first call to end.)"""
    region = torch.nn.Linear(2, 2)
    a = cast.slots_resident([], torch.float32, torch.device("cpu"))
    a.__enter__()
    with cast.slots_resident([], torch.float32, torch.device("cpu")):
        a.__exit__(None, None, None)
        assert cast.busy(region), "the other call's leaves still show their weights"
    assert not cast.busy(region)


def test_every_slot_is_unpinned_when_one_unpin_raises(monkeypatch):
    """comfy-aimdo's unpin raising for one slot at the end of a whole call leaves none of the others
    pinned; its error is raised after. (Before: the slots after it stayed pinned.)"""
    leaves = [torch.nn.Linear(2, 2) for _ in range(3)]
    for i, leaf in enumerate(leaves):
        leaf.__dict__["_v"] = i
    monkeypatch.setattr(cast, "per_call", lambda leaf: True)

    def resident_now(leaf, dtype, device, vbar, pinned):
        pinned.append(leaf)
        return leaf.weight, leaf.bias
    monkeypatch.setattr(cast, "_resident_now", resident_now)
    unpinned = []

    class VBAR:
        def vbar_unpin(self, v):
            unpinned.append(v)
            if v == 0:
                raise RuntimeError("vbar_unpin failed")
    monkeypatch.setattr(cast, "_vbar", VBAR)
    with pytest.raises(RuntimeError, match="vbar_unpin"):
        with cast.slots_resident(leaves, torch.float32, torch.device("cpu")) as resident:
            assert resident is not None
    assert unpinned == [0, 1, 2]
