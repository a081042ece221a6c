"""compiler/regions.py: the attention bodies view q, k and v as ComfyUI's attention does."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet_compiler.compiler import regions


def _comfy_reference(q, k, v, heads):
    # comfy.ldm.modules.attention.attention_pytorch without a mask: k and v take q's batch
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, heads * d)


@pytest.mark.parametrize("qb,kb,n,m", [(2, 2, 16, 7),     # self/cross attention: shared batch
                                       (8, 2, 4, 16),     # HyperTile: tiles folded into q's batch only
                                       (4, 1, 9, 12)])    # a patch broadcasting one context to a batch
def test_sdpa_matches_comfyui_views(qb, kb, n, m):
    heads, d = 2, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(qb, n, heads * d, generator=g)
    k, v = (torch.randn(kb, m, heads * d, generator=g) for _ in range(2))
    torch.testing.assert_close(regions._sdpa(q, k, v, heads), _comfy_reference(q, k, v, heads))


def test_sdpa_compiles_for_a_hypertile_batch():
    """The compiled body (dynamic shapes, as the inductor backend runs it) takes HyperTile's views too."""
    heads, d = 2, 8
    q, k, v = torch.randn(8, 4, heads * d), torch.randn(2, 16, heads * d), torch.randn(2, 16, heads * d)
    fn = torch.compile(regions._sdpa, dynamic=True, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, heads), _comfy_reference(q, k, v, heads))
