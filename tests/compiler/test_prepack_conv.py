"""compiler/passes/prepack_conv.py: the oneDNN-prepacked CPU convolution."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.compiler.compat.torch_version import mkldnn_conv_available
from unet_compiler.compiler.passes import prepack_conv as PC

pytestmark = pytest.mark.skipif(not mkldnn_conv_available(), reason="no oneDNN convolution in this torch")


def test_a_weight_is_packed_for_the_input_size_it_runs_at():
    """oneDNN's blocked layout depends on the input size; a copy packed for another size is 3-7x
    slower at some SD sizes. A new size re-packs once, the same size reuses, results stay exact."""
    torch.manual_seed(0)
    w, b = torch.randn(16, 8, 3, 3), torch.randn(16)
    for shape, packs in (((2, 8, 8, 8), 1), ((2, 8, 8, 8), 0), ((2, 8, 16, 24), 1), ((2, 8, 8, 8), 1)):
        x = torch.randn(shape)
        before = PC.stats["packs"]
        out = torch.ops.unet_compiler.conv2d_prepacked(x, w, b, [1, 1], [1, 1], [1, 1], 1)
        assert PC.stats["packs"] - before == packs, shape
        torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), rtol=1e-4, atol=1e-4)


def test_a_changed_weight_is_packed_again():
    w, b = torch.randn(16, 8, 3, 3), torch.randn(16)
    x = torch.randn(1, 8, 8, 8)
    torch.ops.unet_compiler.conv2d_prepacked(x, w, b, [1, 1], [1, 1], [1, 1], 1)
    with torch.no_grad():
        w.mul_(2)     # a LoRA applied in place
    out = torch.ops.unet_compiler.conv2d_prepacked(x, w, b, [1, 1], [1, 1], [1, 1], 1)
    torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cin,cout,k,stride,groups", [(8, 16, 3, 1, 1), (16, 16, 3, 2, 1), (8, 16, 1, 1, 1),
                                                      (16, 16, 3, 1, 4)])
def test_packing_through_the_scratch_buffer_gives_the_layout_of_a_private_copy(cin, cout, k, stride, groups):
    """The channels-last copy oneDNN reads goes to one shared buffer (pages faulted once, not once per
    weight); what is packed must be the very layout a private copy gives: the conv's output is
    bit-identical to one run on a weight packed the plain way (``to_mkldnn`` + reorder)."""
    torch.manual_seed(0)
    w, b = torch.randn(cout, cin // groups, k, k), torch.randn(cout)
    x = torch.randn(2, cin, 8, 8)
    pad = [k // 2] * 2
    args = (pad, [stride] * 2, [1, 1], groups, list(x.shape))
    plain = torch._C._nn.mkldnn_reorder_conv2d_weight(w.to_mkldnn(), *args)
    ours = PC._reorder(w, *args)

    def conv(p):
        return torch.ops.mkldnn._convolution_pointwise(x, p, b, pad, [stride] * 2, [1, 1], groups, "none", [], "")
    assert torch.equal(conv(ours), conv(plain))
    torch.testing.assert_close(conv(ours), F.conv2d(x, w, b, stride=stride, padding=pad[0], groups=groups),
                               rtol=1e-4, atol=1e-4)


def test_one_scratch_buffer_serves_every_weight_and_goes_when_released():
    from unet_compiler.compiler import weights
    weights.release_scratch()
    w1, w2 = torch.randn(32, 16, 3, 3), torch.randn(16, 8, 3, 3)
    PC._reorder(w1, [1, 1], [1, 1], [1, 1], 1, [1, 16, 8, 8])
    buf = weights.SCRATCH._buf
    assert buf is not None and buf.numel() == w1.numel()
    PC._reorder(w2, [1, 1], [1, 1], [1, 1], 1, [1, 8, 8, 8])    # smaller: the same buffer
    assert weights.SCRATCH._buf.data_ptr() == buf.data_ptr()
    PC._reorder(torch.randn(16, 8, 1, 1), [0, 0], [1, 1], [1, 1], 1, [1, 8, 8, 8])  # 1x1: needs none
    weights.release_scratch()
    assert weights.SCRATCH._buf is None


def test_packed_convs_mode_runs_module_weights_packed_and_leaves_cast_copies():
    """``PackedConvs`` (what a region's uncompiled code runs under on CPU): a conv on a module's own
    weight runs the packed op, the same numbers as the plain conv and re-packed after an in-place
    change (a LoRA); a weight that is a per-call copy (not a Parameter: ComfyUI's cast) runs as called."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        ref = conv(x)
        fired = PC.stats["packed_mode_fired"]
        with PC.PackedConvs():
            out = conv(x)
        assert PC.stats["packed_mode_fired"] == fired + 1
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        conv.weight.mul_(2)
        with PC.PackedConvs():
            out = conv(x)
        torch.testing.assert_close(out, F.conv2d(x, conv.weight, conv.bias, padding=1), rtol=1e-4, atol=1e-4)
        with PC.PackedConvs():
            copy = F.conv2d(x, conv.weight.clone(), conv.bias, padding=1)
            same = F.conv2d(x, conv.weight, conv.bias, padding="same")     # a str padding: not packed
        assert PC.stats["packed_mode_fired"] == fired + 2
        torch.testing.assert_close(copy, out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(same, out, rtol=1e-4, atol=1e-4)


def test_a_priming_call_keeps_the_copy_packed_for_another_size():
    """The compile thread's first call of a variant (``keeping_packed``, its thread only) runs with
    a copy already packed for another input size rather than re-packing the one sampling uses;
    outside it a new size re-packs. The numbers stay the conv's either way."""
    import threading
    torch.manual_seed(0)
    w, b = torch.randn(16, 8, 3, 3), torch.randn(16)
    small, large = torch.randn(2, 8, 8, 8), torch.randn(4, 8, 16, 16)

    def conv(x):
        return torch.ops.unet_compiler.conv2d_prepacked(x, w, b, [1, 1], [1, 1], [1, 1], 1)
    conv(small)                                   # sampling packed it for its size
    packs = PC.stats["packs"]
    with PC.keeping_packed():
        out = conv(large)
        seen = []
        t = threading.Thread(target=lambda: seen.append(getattr(PC._PRIMING, "on", False)))
        t.start()
        t.join()
    assert PC.stats["packs"] == packs and seen == [False]
    torch.testing.assert_close(out, F.conv2d(large, w, b, padding=1), rtol=1e-4, atol=1e-4)
    conv(small)
    assert PC.stats["packs"] == packs             # still the copy for sampling's size
    conv(large)
    assert PC.stats["packs"] == packs + 1         # outside priming a new size re-packs
    with PC.keeping_packed(), torch.no_grad():
        w.mul_(2)                                 # a changed weight is never kept
        out = conv(small)
    assert PC.stats["packs"] == packs + 2
    torch.testing.assert_close(out, F.conv2d(small, w, b, padding=1), rtol=1e-4, atol=1e-4)


def test_under_cpu_autocast_a_conv_runs_in_autocasts_dtype():
    """Under ``torch.autocast("cpu", bfloat16)`` (the pack's own bf16/fp16 precision, or the caller's)
    a conv runs as the model's own does, in bf16: the packed op has no autocast rule and computed in
    fp32 (a compiled UNet came back fp32, its resblocks 2e-2 off the model's own)."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        own = conv(x)
        assert not PC.check(x, conv.weight, conv.padding)
        assert torch.equal(PC.conv_module_forward(conv, x), own)
        with PC.PackedConvs():
            assert torch.equal(conv(x), own)
    assert own.dtype == torch.bfloat16


def test_a_compiled_unet_under_cpu_autocast_is_the_models_own(tiny_unet):
    """The same through a compiled UNet: its convs (packed in the FX graph, or eager) in bf16."""
    from unet_compiler.compiler import api
    unet = tiny_unet()
    api.compile_unet(unet, "inductor", dynamic_shapes=False)
    g = torch.Generator().manual_seed(1)
    args = torch.randn(1, 4, 8, 8, generator=g), torch.tensor([10.0]), torch.randn(1, 6, 32, generator=g)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = unet(*args).sample
        with api.accelerator_of(unet).bypass():
            own = unet(*args).sample
    assert out.dtype == own.dtype == torch.bfloat16
    # (bf16 rounding in another order: 1.6 % of the largest value, the gate's bf16 tolerance is 10 %)
    torch.testing.assert_close(out, own, rtol=0, atol=0.025 * own.abs().max().item())
