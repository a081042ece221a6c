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
