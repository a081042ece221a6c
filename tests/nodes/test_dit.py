"""Diffusion transformers (issue 32): Flux's double and single stream blocks as regions.

Tiny Flux models built by ComfyUI's own ``supported_models`` classes from the config its
checkpoint detection derives (``bench/families.py``'s DiT section: widths and depths shrunk),
random weights, a real ModelPatcher, driven through ``apply_model`` with the conditioning the
model's own ``extra_conds`` builds. The bodies are checked against the blocks' own forward
uncompiled (every variant the body covers, and those it declines); one module-scoped inductor
compile then carries a warmup over 2 resolutions x 2 batches (0 recompiles after it), a LoRA
after compile with a strength change, a ``patches_replace["dit"]`` block replace and the calls
the shim sends to the block's own code.
"""
from __future__ import annotations

import pytest
import torch

from unet_compiler.bench import families as F  # noqa: N812
from unet_compiler.compiler import plan as P
from unet_compiler.compiler import regions as R
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher

pytestmark = pytest.mark.comfy

TOL = 1e-4
FLUX = "flux_dev"
#: latent (h, w): two resolutions, one of them not square; with batches 1 and 2
CASES = ((1, 8, 8), (2, 8, 8), (1, 12, 16), (2, 12, 16))
WARMUP = "1x64x64, 2x128x96"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _close(a, b, tol=TOL):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_the_tiny_flux_is_what_comfyui_loads(comfy):
    """The tiny model's own weights detect back to its config and to the class ComfyUI's loader
    picks (only widths and depths shrunk), and the plan finds every stream block."""
    import comfy.model_detection as md
    for fam in F.DIT_FAMILIES.values():
        mp = F.build_dit(fam)
        sd = mp.model.diffusion_model.state_dict()
        det = md.detect_unet_config(sd, "")
        tiny = F.dit_tiny_config(fam)
        # detection reads the heads, RoPE axes (and Chroma's approximator widths) as the family's
        # constants, not from the weights
        assert {k: det.get(k) for k in tiny if k not in fam.constants} == \
            {k: v for k, v in tiny.items() if k not in fam.constants}, fam.key
        # (or leaves them to the model's defaults: Qwen-Image's widths)
        assert [det.get(k, fam.config[k]) for k in fam.constants] == [fam.config[k] for k in fam.constants], fam.key
        assert type(md.model_config_from_unet_config(det, sd)).__name__ == fam.cls
        plan = P.build_plan(mp.model.diffusion_model)
        assert plan.arch == "dit" and plan.not_a_unet is None
        kinds = [r.kind for r in plan.regions]
        assert {k: kinds.count(k) for k in set(kinds)} == {kind: tiny[key] for kind, key in fam.blocks}, fam.key
        # a leaf is every module whose weights ComfyUI may cast per call (the QK RMSNorm's scale is the block's own)
        assert all(any(type(m).__name__ == "Linear" for m in r.leaves) for r in plan.regions)


def _block_inputs(block, seed=0, batch=2, n_img=12, n_txt=5):
    g = torch.Generator().manual_seed(seed)
    d = block.hidden_size if hasattr(block, "hidden_size") else block.hidden_dim
    head = d // block.num_heads
    pe = torch.randn(batch, 1, n_txt + n_img, head // 2, 2, 2, generator=g)
    return (torch.randn(batch, n_img, d, generator=g), torch.randn(batch, n_txt, d, generator=g),
            torch.randn(batch, d, generator=g), pe)


@pytest.mark.parametrize("over", [{}, {"mlp_silu_act": True, "qkv_bias": False}, {"yak_mlp": True}],
                         ids=["flux1", "silu_mlp", "yak_mlp"])
def test_bodies_are_the_blocks_own_forward(comfy, over):
    """Each body (uncompiled) gives what the block's own forward gives, both img/txt orders."""
    mp = F.build_dit(F.DIT_FAMILIES[FLUX], **over)
    dm = mp.model.diffusion_model
    double, single = dm.double_blocks[0], dm.single_blocks[0]
    img, txt, vec, pe = _block_inputs(double)
    with torch.inference_mode():
        for flipped in (False, True):
            double.flipped_img_txt = flipped
            want = type(double).forward(double, img=img.clone(), txt=txt.clone(), vec=vec, pe=pe)
            got = R.flux_double_block(double, img, txt, vec, pe)
            _close(got[0], want[0], 1e-5)
            _close(got[1], want[1], 1e-5)
        x = torch.cat((txt, img), 1)
        _close(R.flux_single_block(single, x, vec, pe), type(single).forward(single, x.clone(), vec=vec, pe=pe), 1e-5)


@pytest.mark.parametrize("key", list(F.DIT_FAMILIES))
def test_every_family_through_its_shims_uncompiled(comfy, monkeypatch, key):
    """Each family through ``apply_model`` with the bodies run uncompiled behind the shims: the
    model's own output, every block through its body (Flux.2's and Chroma's blocks are handed their
    modulation: the shim flattens it into the body's inputs)."""
    from unet_compiler.compiler.backends import inductor
    monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)
    mp = F.build_dit(F.DIT_FAMILIES[key])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    for b, h, w in CASES[1:3]:
        out = F.dit_apply(cm, b, h, w, seed=3)
        _close(out, F.dit_apply(mp, b, h, w, seed=3), 1e-5)
    n = sum(F.dit_tiny_config(F.DIT_FAMILIES[key])[k] for _, k in F.DIT_FAMILIES[key].blocks)
    assert accel.stats["region_eager"] == 0 and accel.ran_compiled() == (n, n), accel.stats


@pytest.fixture(scope="module")
def compiled_flux(comfy):
    """One inductor compile of the tiny Flux.1 dev and its warmup over ``WARMUP`` (the slow part)."""
    mp = F.build_dit(F.DIT_FAMILIES[FLUX])
    cm, text = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    warm = patcher.warmup_model(cm, WARMUP, 7)
    return mp, cm, text, warm


def _graphs(accel) -> int:
    return accel.stats["graphs_compiled"]


def test_flux_compiled_is_eager_with_no_recompiles(compiled_flux):
    mp, cm, text, warm = compiled_flux
    accel = patcher.accelerator_of(cm)
    assert "backend inductor" in text and "comfy DiT" in text, text
    assert "accelerated regions: double_block x2, single_block x2" in text, text
    assert "max |compiled - eager|" in warm and "recompiles after warmup: 0" in warm, warm
    g0 = _graphs(accel)
    for b, h, w in CASES:
        ran = accel.stats["ran_double_block"]
        out = F.dit_apply(cm, b, h, w, seed=3)
        assert accel.stats["ran_double_block"] == ran + 2, "every double block ran compiled code"
        with accel.bypass():
            ref = F.dit_apply(cm, b, h, w, seed=3)
        _close(out, ref)
        _close(out, F.dit_apply(mp, b, h, w, seed=3))      # the model without the pack
    assert _graphs(accel) == g0 and accel.stats["recompiles_after_warmup"] == 0, accel.text()
    assert accel.ran_compiled() == (4, 4)


def _flux_lora(comfy, mp, scale=0.3, seed=3):
    """A kohya-format LoRA (rank 4) on every double block's image qkv and every single block's
    linear1, loaded through ComfyUI's own key map and loader."""
    key_map = comfy.lora.model_lora_keys_unet(mp.model, {})
    g = torch.Generator().manual_seed(seed)
    sd_model = mp.model.state_dict()
    sd = {}
    targets = [k for k in key_map if k.startswith("lora_unet_") and ("img_attn_qkv" in k or "linear1" in k)]
    assert targets
    for name in targets:
        w = sd_model[key_map[name] if isinstance(key_map[name], str) else key_map[name][0]]
        sd[f"{name}.lora_down.weight"] = torch.randn(4, w.shape[1], generator=g) * scale
        sd[f"{name}.lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g) * scale
        sd[f"{name}.alpha"] = torch.tensor(4.0)
    return comfy.lora.load_lora(sd, key_map)


def test_flux_lora_after_compile_and_a_strength_change(comfy, compiled_flux):
    mp, cm, _, _ = compiled_flux
    accel = patcher.accelerator_of(cm)
    patches = _flux_lora(comfy, mp)
    plain = F.dit_apply(mp, 2, 8, 8)
    g0 = _graphs(accel)
    for strength in (1.0, 0.25):
        after = cm.clone()
        after.add_patches(patches, strength)
        ref = mp.clone()
        ref.add_patches(patches, strength)
        want = F.dit_apply(ref, 2, 8, 8)
        assert (want - plain).abs().max() > 1e-3, "the LoRA must change the output"
        _close(F.dit_apply(after, 2, 8, 8), want)
    assert _graphs(accel) == g0, "a LoRA or its strength compiles nothing"
    _close(F.dit_apply(cm, 2, 8, 8), plain)           # and the model without it is back


def test_flux_block_replace_and_the_calls_its_body_declines(comfy, compiled_flux):
    """A ``patches_replace["dit"]`` block replace wraps the compiled block (ComfyUI's dispatch calls
    it through ``original_block``); a call with an attention mask or an attention override runs
    the block's own forward."""
    mp, cm, _, _ = compiled_flux
    accel = patcher.accelerator_of(cm)
    seen = []

    def replace(args, extra):
        seen.append(args["transformer_options"]["block_index"])
        out = extra["original_block"](args)
        return {"img": out["img"] * 0.9, "txt": out["txt"]}

    patched, ref = cm.clone(), mp.clone()
    for m in (patched, ref):
        m.set_model_patch_replace(replace, "dit", "double_block", 1)
    ran = accel.stats["ran_double_block"]
    out = F.dit_apply(patched, 2, 8, 8)
    assert seen and accel.stats["ran_double_block"] == ran + 2
    want = F.dit_apply(ref, 2, 8, 8)
    _close(out, want)
    assert (want - F.dit_apply(mp, 2, 8, 8)).abs().max() > 1e-4, "the replace must change the output"

    block = mp.model.diffusion_model.double_blocks[0]
    img, txt, vec, pe = _block_inputs(block)
    n = img.shape[1] + txt.shape[1]
    mask = torch.zeros(img.shape[0], 1, n, n)
    eager0 = accel.stats["region_eager"]
    with torch.inference_mode(), accel.active():
        got = block(img=img.clone(), txt=txt.clone(), vec=vec, pe=pe, attn_mask=mask)
        block(img=img.clone(), txt=txt.clone(), vec=vec, pe=pe,
              transformer_options={"optimized_attention_override": lambda func, *a, **k: func(*a, **k)})
    assert accel.stats["region_eager"] == eager0 + 2
    with torch.inference_mode():
        want = type(block).forward(block, img=img.clone(), txt=txt.clone(), vec=vec, pe=pe, attn_mask=mask)
    _close(got[0], want[0], 1e-5)


@pytest.mark.parametrize("key", ["chroma", "qwen_image"])
def test_the_other_block_calls_compiled(comfy, key):
    """Chroma (modulation handed to each Flux block) and Qwen-Image (its own block, a 5-D latent)
    compiled: the model's own output over 2 sizes x 2 batches after a warmup of that box, nothing
    compiled after it."""
    fam = F.DIT_FAMILIES[key]
    mp = F.build_dit(fam)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    warm = patcher.warmup_model(cm, WARMUP, 7)
    n = sum(F.dit_tiny_config(fam)[k] for _, k in fam.blocks)
    assert "recompiles after warmup: 0" in warm and f"{n} of {n} regions ran compiled code" in warm, warm
    g0 = _graphs(accel)
    for b, h, w in CASES:
        _close(F.dit_apply(cm, b, h, w, seed=3), F.dit_apply(mp, b, h, w, seed=3))
    assert _graphs(accel) == g0 and accel.stats["recompiles_after_warmup"] == 0, accel.text()


def test_flux2_warms_its_own_latent_scale(comfy):
    """Flux.2's latent is the image / 16 (its Empty latent node's): Warmup Shapes ``1x128x128``
    warms the 8x8 latent a 128 px Flux.2 prompt samples (one entry compiles static: any other latent
    would compile again), and a call is named by its pixels the same way."""
    mp = F.build_dit(F.DIT_FAMILIES["flux2_dev"])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    warm = patcher.warmup_model(cm, "1x128x128", 7)
    assert "warmed 1x128x128" in warm, warm
    g0 = _graphs(accel)
    _close(F.dit_apply(cm, 1, 8, 8, seed=3), F.dit_apply(mp, 1, 8, 8, seed=3))
    assert _graphs(accel) == g0 and accel.stats["recompiles_after_warmup"] == 0, accel.text()
    F.dit_apply(cm, 1, 10, 8, seed=3)          # another size: compiled once more, named in pixels
    assert accel.recompiles.events and accel.recompiles.events[-1]["shape"] == "1x128x160", accel.recompiles.events


def test_fp8_flux_runs_compiled_with_comfyuis_cast(comfy):
    """Flux stored in fp8 (Load Diffusion Model's weight_dtype fp8_e4m3fn: ComfyUI casts each weight
    per call): every block runs compiled with ComfyUI's cast outside the graph, also its LayerNorms
    without weights (nothing to cast), and gives the model's own output."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    fam = F.DIT_FAMILIES[FLUX]
    cfg = getattr(sm, fam.cls)(F.dit_tiny_config(fam))
    cfg.set_inference_dtype(torch.float8_e4m3fn, torch.float32)
    with torch.no_grad():
        base = cfg.get_model({})
        ref = F.build_dit(fam).model.diffusion_model.state_dict()
        base.diffusion_model.load_state_dict({k: v.to(torch.float8_e4m3fn) for k, v in ref.items()})
    base.eval()
    cpu = torch.device("cpu")
    mp = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
    assert {p.dtype for p in base.diffusion_model.parameters()} == {torch.float8_e4m3fn}
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    warm = patcher.warmup_model(cm, "2x64x64", 7)
    assert "4 of 4 regions ran compiled code" in warm, warm
    _close(F.dit_apply(cm, 2, 8, 8, seed=3), F.dit_apply(mp, 2, 8, 8, seed=3))
    assert accel.stats["region_cast_compiled"] > 0 and not accel.failed and not accel.cast_eager, accel.text()
    # the compile thread traces a stand-in showing the cast weights (Warmup Shapes' default: background)
    from unet_compiler.compiler import api, background
    failures = len(background.BACKGROUND.failures)
    bg, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    patcher.warmup_model(bg, "2x64x96", 7, background=True)
    assert api.wait_for_background(600)
    assert len(background.BACKGROUND.failures) == failures, background.BACKGROUND.failures
    _close(F.dit_apply(bg, 2, 8, 12, seed=3), F.dit_apply(mp, 2, 8, 12, seed=3))
    assert not patcher.accelerator_of(bg).failed, patcher.accelerator_of(bg).text()
