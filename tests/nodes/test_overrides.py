"""What other nodes set on a compiled DiT's modules through ComfyUI runs as they set it
(compiler/overrides.py): an object patch of a forward inside a block (KJNodes' WanVideoNAG patches
``diffusion_model.blocks.{i}.cross_attn.forward``) or of a block's own forward, and a block swap that
moves a block's weights inside the call (forward hooks), under the regions' CUDA graphs.

Tiny DiTs of ComfyUI's own classes (``tests/_families.py``), a real ModelPatcher, the regions' bodies
uncompiled (the overrides are under test, not a compiler)."""
from __future__ import annotations

import types

import pytest
import torch

from unet_compiler.tests import _families as F  # noqa: N812
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.compiler.graphs import MOVES, RegionGraphs
from unet_compiler.nodes import patcher

pytestmark = pytest.mark.comfy


@pytest.fixture
def uncompiled(monkeypatch):
    from unet_compiler.compiler.backends import inductor
    monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)


def test_an_object_patch_inside_a_block_runs(comfy, uncompiled):
    """Every Wan block's cross-attention object-patched (NAG's way): before, the block's body skipped
    the patch (its output was the unpatched model's, 1.3 off). Now those blocks run their own code
    with it, == the model's own, the report naming the patch."""
    mp = F.build_dit(F.DIT_FAMILIES["wan21_t2v"])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    plain = F.dit_apply(cm, 1, 8, 8, seed=3, frames=5)
    p = cm.clone()
    for i, block in enumerate(mp.model.diffusion_model.blocks):
        ca = block.cross_attn

        def nag_like(self, x, context, **kw):
            return 0.25 * type(self).forward(self, x, context, **kw)
        p.add_object_patch(f"diffusion_model.blocks.{i}.cross_attn.forward", types.MethodType(nag_like, ca))
    out = F.dit_apply(p, 1, 8, 8, seed=3, frames=5)
    with accel.bypass():
        own = F.dit_apply(p, 1, 8, 8, seed=3, frames=5)
    assert float((own - plain).abs().max()) > 0.1           # the patch matters
    torch.testing.assert_close(out, own, rtol=1e-4, atol=1e-4)
    n = accel.stats["region_eager_overridden"]
    assert n and n % len(mp.model.diffusion_model.blocks) == 0       # every block, in each call
    assert (f"another node set its forward: {len(mp.model.diffusion_model.blocks)} regions run the model's own "
            f"code with it (the pack's code would skip it): blocks.0.cross_attn, blocks.1.cross_attn") in accel.text()


def test_an_object_patch_of_a_blocks_forward_runs_and_stays(comfy, uncompiled):
    """A Flux double block's own forward object-patched: before, the pack's shim overwrote it for the
    call and then deleted it (the patch lost for good, 1.08 off). Now it runs, == the model's own, and
    is still there after the call for ComfyUI to unpatch."""
    import comfy.model_management as mm
    mp = F.build_dit(F.DIT_FAMILIES["flux_dev"])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    block = mp.model.diffusion_model.double_blocks[0]

    def halved(self, *a, **kw):
        img, txt = type(self).forward(self, *a, **kw)
        return img * 0.5, txt
    p = cm.clone()
    patched = types.MethodType(halved, block)
    p.add_object_patch("diffusion_model.double_blocks.0.forward", patched)
    mm.load_models_gpu([p])
    out = F.dit_apply(p, 1, 8, 8, seed=3)
    assert block.__dict__.get("forward") is patched
    with accel.bypass():
        own = F.dit_apply(p, 1, 8, 8, seed=3)
    torch.testing.assert_close(out, own, rtol=1e-4, atol=1e-4)
    assert "double_blocks.0: another node set its forward" in accel.text()


def _swap(block):
    """A block swap by forward hooks: the block's weights replaced by copies just before it runs (to
    the GPU) and put back after (to the CPU), the copies then overwritten (freed memory, reused)."""
    home = {}

    def pre(mod, args):
        for n, m in mod.named_modules():
            for k, p in list(m._parameters.items()):
                if p is not None:
                    home[(n, k)] = p
                    m._parameters[k] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)

    def post(mod, args, out):
        for n, m in mod.named_modules():
            for k, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[k] = home[(n, k)]
                    with torch.inference_mode(False), torch.no_grad():
                        p.data.fill_(float("nan"))
    block.register_forward_pre_hook(pre)
    block.register_forward_hook(post)


def test_a_block_whose_weights_move_inside_the_call_gets_no_graph(comfy, uncompiled, strict_graph_standin):
    """Flux with one double block swapped in and out by hooks, under the regions' graphs: before, the
    4th call replayed the graph captured over the last call's copies (NaN). Now the region compares its
    weights before each replay, finds them moved and runs without graphs; every call == the model's own."""
    mp = F.build_dit(F.DIT_FAMILIES["flux_dev"])
    _swap(mp.model.diffusion_model.double_blocks[1])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    accel.graphs = RegionGraphs(graphs=strict_graph_standin())
    with torch.inference_mode():
        for seed in range(3, 8):
            out = F.dit_apply(cm, 2, 8, 8, seed=seed)
            with accel.bypass():
                own = F.dit_apply(cm, 2, 8, 8, seed=seed)
            torch.testing.assert_close(out, own, rtol=1e-4, atol=1e-4)
    assert accel.graphs.skipped[MOVES] > 0 and accel.graphs.stats["replays"] > 0


def test_after_comfyuis_unpatch_the_regions_are_compiled_again(comfy):
    """An object patch of a forward inside a region and of the UNet's ``_forward``, then ComfyUI's
    ``unpatch_model``: its ``set_attr`` had saved the class's bound method, which unpatch writes back
    into the instance dict. After it the regions run compiled code and nothing is found. Before, the
    leftovers counted as other nodes' code for the rest of the session."""
    import comfy.model_management as mm
    fam = F.FAMILIES["sd15"]
    mp = F.build(fam)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="eager"))
    accel = patcher.accelerator_of(cm)
    from unet_compiler.compiler import regions as R
    accel._install(R.BODIES)
    root = cm.model.diffusion_model
    target = next(r for r in accel.plan.regions if r.kind != "resblock")
    inner = next(n for n, m in target.module.named_modules() if n and next(m.children(), None) is None)
    mod = root.get_submodule(f"{target.path}.{inner}")
    p = cm.clone()
    p.add_object_patch(f"diffusion_model.{target.path}.{inner}.forward",
                       lambda *a, **k: type(mod).forward(mod, *a, **k))
    p.add_object_patch("diffusion_model._forward", lambda *a, **k: type(root)._forward(root, *a, **k))
    mm.load_models_gpu([p])
    F.apply(p, fam, 1, 8, 8)
    assert accel._found is not None and accel._found.regions and accel._found.around
    p.unpatch_model()
    mm.load_models_gpu([cm])
    n = accel.stats["region_eager_overridden"]
    for _ in range(2):
        F.apply(cm, fam, 1, 8, 8)
        assert accel._found is None
    assert accel.stats["region_eager_overridden"] == n
