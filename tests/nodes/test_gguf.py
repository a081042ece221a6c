"""ComfyUI-GGUF models (city96/ComfyUI-GGUF's real ops and model patcher: weights dequantized per
call, LoRA applied after the dequantisation) through Compile UNet + Warmup Shapes on ComfyUI's own
UNetModel (CPU, fp32 compute).

Each region runs compiled code with the pack's own cast (``GGMLLayer.cast_bias_weight``: its
dequantisation, its patches) outside the graph; compiled == the pack's own eager result at 1e-4 for
Q8_0, Q4_K, Q5_K and F16 (the same dequantized weights; only the graphs' fp32 rounding differs),
and nothing compiles again across quant types, prompts and LoRA strengths."""
import pytest
import torch

from unet_compiler.compiler import cast
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher
from unet_compiler.tests._written import as_written

from tests import _gguf
from .test_comfy_patcher import _apply, _close

pytestmark = pytest.mark.comfy
CFG = CompileConfig(backend="inductor")
#: compiled vs the GGUF pack's own eager result, per quant type (fp32 compute here)
TOLERANCE = {"Q8_0": 1e-4, "Q4_K": 1e-4, "Q5_K": 1e-4, "F16": 1e-4}


@pytest.fixture(scope="module")
def gg(comfy):
    why = _gguf.problem(comfy.path)
    if why:
        pytest.skip(why)
    return _gguf.load(comfy.path)


def _regions(accel) -> int:
    return sum(accel.report.regions.values())


def _lora(comfy, mp, seed=3):
    """A kohya-format LoRA (rank 4) on every attn2 to_k and one conv per ResBlock, through ComfyUI's
    own key map and loader; its shapes are the model's logical ones (GGUF weights report them)."""
    key_map = comfy.lora.model_lora_keys_unet(mp.model, {})
    g = torch.Generator().manual_seed(seed)
    sd, done = {}, set()
    for name, key in key_map.items():
        key = key if isinstance(key, str) else key[0]
        if not name.startswith("lora_unet_") or key in done or not ("in_layers_2" in name or "attn2_to_k" in name):
            continue
        done.add(key)
        shape = comfy.utils.get_attr(mp.model, key).shape
        extra = tuple(shape[2:])
        sd[f"{name}.lora_down.weight"] = torch.randn((4, shape[1]) + extra, generator=g) * 0.2
        sd[f"{name}.lora_up.weight"] = torch.randn((shape[0], 4) + (1,) * len(extra), generator=g) * 0.2
        sd[f"{name}.alpha"] = torch.tensor(4.0)
    patches = comfy.lora.load_lora(sd, key_map)
    assert len(patches) == len(done) > 0
    return patches


def test_each_quant_type_runs_compiled_with_its_own_dequantisation(gg):
    """Q8_0, Q4_K, Q5_K, F16: Warmup Shapes compiles every region ("N of N regions ran compiled
    code"), a sampling call == the pack's own eager one, no region call ran the model's code. The
    graphs see the dequantized weights only: Q5_K after Q4_K (the same leaves quantized) compiles
    nothing. (A leaf a file keeps unquantized is a plain parameter that requires grad, a dequantized
    one does not: dynamo guards that, so such a region compiles once per kind of file.)"""
    for q in _gguf.TYPES:
        mp = _gguf.tiny_unet(gg, "sd15", q)
        leaf = mp.model.diffusion_model.input_blocks[1][1].transformer_blocks[0].attn1.to_q
        assert cast.own_cast(type(leaf)) and getattr(leaf.weight, "tensor_type", None) is not None
        ref = _apply(mp, "sd15")
        cm, _ = patcher.compile_model(mp, CFG)
        text = patcher.warmup_model(cm, "2x64x64", 77)
        accel = patcher.accelerator_of(cm)
        n = _regions(accel)
        assert f"status: inductor: compiled, {n} of {n} regions ran compiled code" in text, f"{q}: {text}"
        assert accel.report.regions.get("projection"), f"{q}: its convs are regions too: {accel.text()}"
        out = _apply(cm, "sd15")
        _close(out, ref, tol=TOLERANCE[q])
        assert accel.stats["region_eager"] == 0 and accel.stats["region_cast_compiled"] > 0, f"{q}: {accel.text()}"
        assert accel.stats["recompiles_after_warmup"] == 0, f"{q}: {accel.text()}"
        assert "GGMLOps.Linear" in accel.text() and "own cast outside the graph" in accel.text(), accel.text()
        if q == "Q5_K":
            assert accel.stats["graphs_compiled"] == 0, f"{q}: {accel.text()}"


def test_lora_on_a_gguf_model_changes_strength_without_compiling(comfy, gg):
    """A LoRA on a Q4_K model (GGUFModelPatcher: applied after dequantisation on every call, through
    the weight's ``patches``) at two strengths and removed: compiled == eager each time, the LoRA
    mattered, and nothing compiles after warmup."""
    mp = _gguf.tiny_unet(gg, "sd15", "Q4_K")
    plain = _apply(mp, "sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    patches = _lora(comfy, mp)
    outs = []
    for strength in (1.0, 0.5):
        lora = cm.clone()
        lora.add_patches(patches, strength)
        ref = _apply(lora, "sd15")            # loads the patched weights: eager below reads the same
        with accel.bypass():
            eager = _apply(lora, "sd15", load=False)
        out = _apply(lora, "sd15", load=False)
        _close(out, eager, tol=TOLERANCE["Q4_K"])
        _close(ref, eager, tol=TOLERANCE["Q4_K"])
        outs.append(out)
        lora.unpatch_model(lora.offload_device)
    assert (outs[0] - plain).abs().max() > 1e-3 and (outs[0] - outs[1]).abs().max() > 1e-4, "the LoRA must matter"
    _close(_apply(cm, "sd15"), plain)
    assert accel.stats["region_eager"] == 0, accel.text()
    assert accel.stats["recompiles_after_warmup"] == 0 and accel.stats["graphs_compiled_after_warmup"] == 0, \
        accel.text()


def test_a_gguf_style_leaf_whose_forward_is_not_its_cast_runs_its_own_code(gg):
    """Ops with GGUF's shape (a cast method of their own) whose forward does more than the plain op
    on that cast (here: a scale): the check on the first call finds it, that region kind runs the
    ops' own code, right, and the report names the ops; the other regions compile."""
    mp = _gguf.tiny_unet(gg, "sd15", "Q8_0")
    base = type(mp.model.diffusion_model.input_blocks[1][1].transformer_blocks[0].attn1.to_q)

    class Scaled(base):
        def forward_ggml_cast_weights(self, input):
            weight, bias = self.cast_bias_weight(input)
            return torch.nn.functional.linear(input, weight * 1.01, bias)
    as_written(Scaled, "other_pack.ops")
    leaf = mp.model.diffusion_model.input_blocks[1][1].transformer_blocks[0].ff.net[2]
    leaf.__class__ = Scaled
    assert cast.own_cast(Scaled) and cast.why_not(leaf) is None
    ref = _apply(mp, "sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    text = patcher.warmup_model(cm, "2x64x64", 77)
    accel = patcher.accelerator_of(cm)
    _close(_apply(cm, "sd15"), ref)
    assert "not the plain op on its own cast" in str(cast.why_not(leaf)) and "weights Q8_0" in str(cast.why_not(leaf))
    assert set(accel.cast_eager) == {"feedforward"}, accel.cast_eager
    assert "other_pack.ops." in accel.text() and "Scaled" in accel.text(), accel.text()
    n = _regions(accel)
    assert accel.stats["region_cast_compiled"] > 0 and f"of {n} regions ran compiled code" in text, text


def test_the_own_cast_check_allows_another_summation_order_not_another_result(gg):
    """The check of a GGUF-style leaf compares its forward with the plain op on its cast to a few ulps
    of the sums the op adds up, so the same products summed in another order pass (oneDNN picks its
    conv algorithm per call: through a server 7-8 of SD1.5's wide convs differed from the plain op by
    up to 3.6e-5 with a tolerance of 8 ulps of their result, and ran the pack's own code) while a
    result 1e-3 off is refused. A Q8_0 conv of SD1.5's widest shape, 1280 x 1280 x 3 x 3."""
    ops = gg.ops.GGMLOps()
    g = torch.Generator().manual_seed(0)

    def conv(cls):
        leaf = cls(1280, 1280, 3, padding=1)
        leaf.weight = torch.nn.Parameter(_gguf.quantize(gg, torch.randn(1280, 1280, 3, 3, generator=g) * 0.02,
                                                        "Q8_0"), requires_grad=False)
        leaf.bias = torch.nn.Parameter(torch.randn(1280, generator=g) * 0.1, requires_grad=False)
        return leaf

    class Halves(ops.Conv2d):       # the same products, summed per half of the input channels
        def forward_ggml_cast_weights(self, input):
            w, b = self.cast_bias_weight(input)
            return (torch.nn.functional.conv2d(input[:, :640], w[:, :640], b, padding=1)
                    + torch.nn.functional.conv2d(input[:, 640:], w[:, 640:], None, padding=1))

    class Off(ops.Conv2d):          # another result: 1e-3 of it
        def forward_ggml_cast_weights(self, input):
            w, b = self.cast_bias_weight(input)
            return torch.nn.functional.conv2d(input, w, b, padding=1) * (1 + 1e-3)
    for cls in (Halves, Off):
        as_written(cls, "other_pack.ops")
    halves, off = conv(Halves), conv(Off)
    with torch.inference_mode():
        x = cast._probe(halves, torch.float32, torch.device("cpu"))
        w, b, _ = cast._cast(halves, torch.float32, torch.device("cpu"))
        reordered = float((halves.forward_comfy_cast_weights(x) - torch.nn.functional.conv2d(x, w, b, padding=1)).abs().max())
    assert reordered > 0, "the halves must sum in another order for this test to mean anything"
    assert cast._check_own(halves, torch.float32, torch.device("cpu")) is None
    why = cast._check_own(off, torch.float32, torch.device("cpu"))
    assert why is not None and "not the plain op on its own cast" in str(why)


def test_a_gguf_model_compiles_in_the_background(gg, monkeypatch):
    """Warmup Shapes in the background on a Q4_K model: the compile thread traces a stand-in whose
    weights have the dequantized shapes (GGUF's packed bytes are smaller) and never calls the pack's
    cast; afterwards every region serves sampling calls, == eager."""
    import functools
    import threading

    from unet_compiler.compiler import api
    mp = _gguf.tiny_unet(gg, "sd15", "Q4_K")
    ref = _apply(mp, "sd15")
    calls = []
    real = gg.ops.GGMLLayer.cast_bias_weight

    @functools.wraps(real)
    def counted(*args, **kwargs):
        calls.append(threading.get_ident())
        return real(*args, **kwargs)
    monkeypatch.setattr(gg.ops.GGMLLayer, "cast_bias_weight", counted)
    cm, _ = patcher.compile_model(mp, CFG)
    patcher.warmup_model(cm, "2x64x64", 77, background=True)
    assert api.wait_for_background(600)
    accel = patcher.accelerator_of(cm)
    _close(_apply(cm, "sd15"), ref, tol=TOLERANCE["Q4_K"])
    n = _regions(accel)
    assert accel.ran_compiled() == (n, n) and not accel.failed, accel.text()
    done = next(line for line in accel.text().splitlines() if "background compile:" in line)
    assert "done" in done and "failed" not in done, done
    assert calls and set(calls) == {threading.get_ident()}, "the compile thread called the pack's cast"
