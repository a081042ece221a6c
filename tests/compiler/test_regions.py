"""compiler/regions.py: the attention bodies view q, k and v as ComfyUI's attention does."""
from __future__ import annotations

import types

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
    torch.testing.assert_close(regions.attend(q, k, v, heads), _comfy_reference(q, k, v, heads))


def test_sdpa_compiles_for_a_hypertile_batch():
    """The compiled body (dynamic shapes, as the inductor backend runs it) takes HyperTile's views too."""
    heads, d = 2, 8
    q, k, v = torch.randn(8, 4, heads * d), torch.randn(2, 16, heads * d), torch.randn(2, 16, heads * d)
    # (a copy of its code: what earlier tests in this process compiled of ``attend`` itself, under a
    # graph stand-in's dispatch mode, may have left its frame marked to skip)
    attend = types.FunctionType(regions.attend.__code__.replace(), regions.attend.__globals__, "attend",
                                regions.attend.__defaults__, regions.attend.__closure__)
    attend.__kwdefaults__ = regions.attend.__kwdefaults__
    fn = torch.compile(attend, dynamic=True, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, heads), _comfy_reference(q, k, v, heads))


def _record_region_calls(unet, run, kinds):
    """Run ``run()`` once and record, per planned region of ``kinds``, its module, positional
    inputs and output (the model's own code ran)."""
    from unet_compiler.compiler.plan import build_plan
    calls, handles = [], []
    for r in build_plan(unet).regions:
        if r.kind in kinds:
            handles.append(r.module.register_forward_hook(
                lambda m, args, out, r=r: calls.append((r, args, out))))
    try:
        with torch.inference_mode():
            run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _assert_bodies_match(calls):
    seen = set()
    for r, args, out in calls:
        body = regions.BODIES[(r.family, r.kind)]
        with torch.inference_mode():
            mine = body(r.module, *args)
        assert torch.equal(mine, out), f"{r.kind} at {r.path}: the torch-op body differs from the model's code"
        seen.add(r.kind)
    return seen


def test_torch_op_bodies_compute_what_the_diffusers_model_computes(tiny_unet):
    """With the default ops (torch), every body gives the model's own result bit for bit: inductor and
    IPEX run these bodies, and the triton backend falls back to them."""
    from unet_compiler.compiler.plan import FEEDFORWARD, RESBLOCK
    u = tiny_unet()
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 32, generator=g)
    calls = _record_region_calls(u, lambda: u(x, torch.full((2,), 500.0), c), (RESBLOCK, FEEDFORWARD))
    assert _assert_bodies_match(calls) == {RESBLOCK, FEEDFORWARD}


@pytest.mark.comfy
def test_torch_op_bodies_compute_what_the_comfy_model_computes(make_comfy_model):
    from unet_compiler.compiler.plan import FEEDFORWARD, NORM_ACT, RESBLOCK
    unet = make_comfy_model("sd15").model.diffusion_model
    g = torch.Generator().manual_seed(1)
    x, c = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 64, generator=g)
    calls = _record_region_calls(unet, lambda: unet(x, torch.full((2,), 500.0), context=c),
                                 (RESBLOCK, FEEDFORWARD, NORM_ACT))
    assert _assert_bodies_match(calls) == {RESBLOCK, FEEDFORWARD, NORM_ACT}
