"""compiler/passes/prepack_linear.py: the MKL-prepacked CPU linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.compiler.passes import prepack_linear as PL

pytestmark = pytest.mark.skipif(not PL.available(), reason="no MKL prepacked linear in this torch")


def test_one_packed_weight_serves_every_row_count():
    """The packed layout does not depend on the row count: one pack, reused at every batch and
    token count (3-D inputs, a non-contiguous one, no rows), results as F.linear."""
    torch.manual_seed(0)
    w, b = torch.randn(24, 16), torch.randn(24)
    before = PL.stats["packs"]
    for x in (torch.randn(2, 77, 16), torch.randn(1, 5, 16), torch.randn(3, 16, 7).transpose(1, 2),
              torch.randn(0, 4, 16)):
        out = torch.ops.unet_compiler.linear_prepacked(x, w, b)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert PL.stats["packs"] - before == 1


def test_a_changed_weight_is_packed_again():
    w = torch.randn(8, 16)
    x = torch.randn(2, 3, 16)
    torch.ops.unet_compiler.linear_prepacked(x, w, None)
    with torch.no_grad():
        w.mul_(2)     # a LoRA applied in place
    torch.testing.assert_close(torch.ops.unet_compiler.linear_prepacked(x, w, None), F.linear(x, w),
                               rtol=1e-4, atol=1e-4)


def test_check_declines_what_the_packed_path_cannot_take():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert PL.check(x, w, None) and PL.check(x, w, torch.randn(8))
    assert not PL.check(x.double(), w.double(), None)
    assert not PL.check(x.to(torch.bfloat16), w.to(torch.bfloat16), None)
    assert not PL.check(torch.randn(16), w, None)        # a 1-D input
    assert not PL.check(x, w, torch.randn(8).double())
