"""Diffusion transformers (issue 32): Flux's double and single stream blocks, SD3's joint blocks,
Qwen-Image's, Wan's and Lumina 2's (Z-Image's) blocks as regions.

Tiny models built by ComfyUI's own ``supported_models`` classes from the config its
checkpoint detection derives (``tests/_families.py``'s DiT section: widths and depths shrunk),
random weights, a real ModelPatcher, driven through ``apply_model`` with the conditioning the
model's own ``extra_conds`` builds. The bodies are checked against the blocks' own forward
uncompiled (every variant the body covers, and those it declines); one module-scoped inductor
compile of Flux then carries a warmup over 2 resolutions x 2 batches (0 recompiles after it), LoRA
before and after compile with a strength change, a ``patches_replace["dit"]`` block replace, the
calls the shim sends to the block's own code, and what workflows put around the blocks (ControlNet
residuals, a post_input patch, reference latents, step caches). Other families compile once each:
Z-Image, Qwen-Image, SD3.5 Medium, Flux.2 (its latent scale), Wan 2.1 I2V (frames), Wan 2.2 TI2V
(per-frame timesteps).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from unet_compiler.tests import _families as F  # noqa: N812
from unet_compiler.compiler import plan as P
from unet_compiler.compiler import regions as R
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher, warmup as nodes_warmup
from unet_compiler.compiler.lifecycle.scheduler import process_scheduler

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
        assert type(md.model_config_from_unet_config(det, sd)).__name__ == (fam.detected_as or fam.cls)
        plan = P.build_plan(mp.model.diffusion_model)
        assert plan.arch == "dit" and plan.not_a_unet is None
        assert Counter(r.kind for r in plan.regions) == _blocks(fam), fam.key
        # a leaf is every module whose weights ComfyUI may cast per call (the QK RMSNorm's scale is the block's own)
        assert all(any(type(m).__name__ == "Linear" for m in r.leaves) for r in plan.regions)


def _blocks(fam) -> Counter:
    """The regions a tiny build of ``fam`` has, by kind (its config's block counts)."""
    tiny = F.dit_tiny_config(fam)
    return sum((Counter({kind: tiny[key]}) for kind, key in fam.blocks), Counter())


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
    frames = 9 if F.DIT_FAMILIES[key].video else None      # a video: 3 latent frames
    for b, h, w in CASES[1:3]:
        out = F.dit_apply(cm, b, h, w, seed=3, frames=frames)
        _close(out, F.dit_apply(mp, b, h, w, seed=3, frames=frames), 1e-5)
    n = sum(_blocks(F.DIT_FAMILIES[key]).values())
    assert accel.stats["region_eager"] == 0 and accel.ran_compiled() == (n, n), accel.stats


@pytest.mark.parametrize("key", ["flux_dev", "sd35_medium", "qwen_image"])
def test_blocks_that_return_two_streams_are_captured(comfy, monkeypatch, key, strict_graph_standin):
    """CUDA graphs on a DiT (the stand-in's buffer contract, conftest.GraphStandIn): Flux's double
    stream blocks, SD3's joint blocks and Qwen-Image's blocks return (img, txt); each is captured at
    its second call and replayed, both streams copied out, and the model's own output comes back.
    (Before: a tuple output turned graphs off for the whole model at the first capture.)"""
    from unet_compiler.compiler.backends import inductor
    from unet_compiler.compiler.graphs import RegionGraphs
    monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)
    mp = F.build_dit(F.DIT_FAMILIES[key])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    fake = strict_graph_standin()   # replays recorded ops: the bodies' Python does not run again
    accel.graphs = RegionGraphs(graphs=fake)
    with torch.inference_mode():
        for seed in (3, 4, 5):    # call 1 runs eager, call 2 captures, call 3 replays
            _close(F.dit_apply(cm, 2, 8, 8, seed=seed), F.dit_apply(mp, 2, 8, 8, seed=seed), 1e-5)
    n = sum(_blocks(F.DIT_FAMILIES[key]).values())
    assert accel.graphs.off is None, accel.graphs.off
    assert fake.captures == n and accel.graphs.stats["replays"] == 2 * n, (fake.captures, n, accel.graphs.stats)


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
    # prompts of another length than the warmup's 7 tokens (Flux.1's T5 prompts: 256 and more)
    for tokens in (77, 300):
        _close(F.dit_apply(cm, 2, 12, 16, seed=3, tokens=tokens), F.dit_apply(mp, 2, 12, 16, seed=3, tokens=tokens))
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
    before = mp.clone()                               # a LoRA before Compile UNet
    before.add_patches(patches, 0.5)
    compiled_after, _ = patcher.compile_model(before, CompileConfig(backend="inductor"))
    ref = mp.clone()
    ref.add_patches(patches, 0.5)
    _close(F.dit_apply(compiled_after, 2, 8, 8), F.dit_apply(ref, 2, 8, 8))
    assert patcher.accelerator_of(compiled_after).ran_compiled() == (4, 4)


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


# SD3.5's joint blocks are long (CI: SD3's through the server, tests/e2e/test_api_bad_input.py)
@pytest.mark.parametrize("key", ["z_image", "qwen_image", pytest.param("sd35_medium", marks=pytest.mark.long)])
def test_the_other_block_calls_compiled(comfy, key):
    """Z-Image (Lumina 2's blocks: grouped-query attention, refiners with and without modulation,
    tokens padded to 32), Qwen-Image (its own block, a 5-D latent) and SD3.5 Medium (joint blocks
    called positionally: one with a second image self-attention, the last one's context half only
    feeding the attention) compiled: the model's own output over 2 sizes x 2 batches after a warmup
    of that box, nothing compiled after it. (Chroma's handed modulation: Flux.2's test and the
    table.)"""
    fam = F.DIT_FAMILIES[key]
    mp = F.build_dit(fam)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    warm = patcher.warmup_model(cm, WARMUP, 7)
    n = sum(_blocks(fam).values())
    assert "recompiles after warmup: 0" in warm and f"{n} of {n} regions ran compiled code" in warm, warm
    g0 = _graphs(accel)
    for b, h, w in CASES:
        _close(F.dit_apply(cm, b, h, w, seed=3), F.dit_apply(mp, b, h, w, seed=3))
    if key == "qwen_image":        # Qwen-Image edit: a reference latent's tokens join the image's
        want = F.dit_apply(mp, 2, 8, 8, seed=3, reference=True)
        assert (want - F.dit_apply(mp, 2, 8, 8, seed=3)).abs().max() > 1e-3
        _close(F.dit_apply(cm, 2, 8, 8, seed=3, reference=True), want)
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
    from unet_compiler.compiler import api
    failures = len(process_scheduler().thread.failures)
    bg, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    patcher.warmup_model(bg, "2x64x96", 7, background=True)
    assert api.wait_for_background(600)
    assert len(process_scheduler().thread.failures) == failures, process_scheduler().thread.failures
    _close(F.dit_apply(bg, 2, 8, 12, seed=3), F.dit_apply(mp, 2, 8, 12, seed=3))
    assert not patcher.accelerator_of(bg).failed, patcher.accelerator_of(bg).text()


def test_a_comfyui_function_another_node_sets_is_traced_anew(comfy, monkeypatch):
    """A node that sets a ComfyUI function of its own (``comfy.ldm.common_dit.rms_norm``, which
    Flux's q/k norms call inside the double blocks) after the blocks compiled: the precompiled
    variants that traced ComfyUI's keep no guard on it, so they are not served while it is there
    (compiled again, == the model's own code), and serve again once ComfyUI's is back. Before, the
    variants kept computing ComfyUI's (0.2 off). The same at a restart: a variant from the compile
    cache that traced a function its module no longer binds is compiled again."""
    import comfy.ldm.common_dit as common_dit
    from unet_compiler.compiler.lifecycle import variants as V
    store = V.Variants()
    monkeypatch.setattr(process_scheduler(), "variants", store)
    mp = F.build_dit(F.DIT_FAMILIES[FLUX])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor", dynamic_shapes=False))
    accel = patcher.accelerator_of(cm)

    def both():
        out = F.dit_apply(cm, 1, 8, 8, seed=3)
        with accel.bypass():
            own = F.dit_apply(cm, 1, 8, 8, seed=3)
        return out, own
    before, own = both()
    _close(before, own)
    compiled = store.compiled
    blobs = store.serialized()
    comfys = common_dit.rms_norm
    monkeypatch.setattr(common_dit, "rms_norm", lambda x, weight=None, eps=1e-6: comfys(x, weight, eps=0.5))
    out, own = both()
    _close(out, own)
    assert (own - before).abs().max() > 1e-2, "the node's function changes the image"
    assert store.compiled > compiled, "the variants that traced ComfyUI's rms_norm were compiled again"
    assert any("common_dit.rms_norm: another function is there now" in f for f in store.failures), store.failures
    restarted = V.Variants()        # a restart with the node's function set at import
    for key, items in blobs.items():
        for b in items:
            restarted.add_serialized(key, b)
    monkeypatch.setattr(process_scheduler(), "variants", restarted)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor", dynamic_shapes=False))
    accel = patcher.accelerator_of(cm)
    _close(*both())
    assert restarted.unusable > 0 and restarted.compiled == restarted.unusable, vars(restarted)
    # (kept in the entry: the install without that node, or with it off, uses them)
    assert not restarted.rejected
    monkeypatch.setattr(common_dit, "rms_norm", comfys)     # ComfyUI's back: the first variants serve again
    monkeypatch.setattr(process_scheduler(), "variants", store)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor", dynamic_shapes=False))
    accel = patcher.accelerator_of(cm)
    again = store.compiled
    _close(*both())
    assert store.compiled == again


def test_an_image_model_refuses_video_frames_before_work(compiled_flux):
    from unet_compiler.compiler.shapes import ShapeError
    _, cm, _, _ = compiled_flux
    with pytest.raises(ShapeError, match="1x64x64x9 gives 9 video frames, but this model makes images"):
        patcher.warmup_model(cm, "1x64x64, 1x64x64x9", 7)


def _wan_block_inputs(block, seed=0, batch=2, n=24, n_txt=7, e_dims=4):
    g = torch.Generator().manual_seed(seed)
    d, head = block.dim, block.self_attn.head_dim
    e = torch.randn(batch, *(1,) * (e_dims - 3), 6, d, generator=g)
    freqs = torch.randn(1, n, 1, head // 2, 2, 2, generator=g)
    return torch.randn(batch, n, d, generator=g), e, freqs, torch.randn(batch, 257 + n_txt, d, generator=g)


@pytest.mark.parametrize("key", ["wan21_t2v", "wan21_i2v"])
def test_wan_body_is_the_blocks_own_forward(comfy, key):
    """Wan's body (uncompiled, behind its shim's split of an image-to-video block's context) gives the
    block's own forward: modulation of one step as (b, 6, dim) and as (b, 1, 6, dim), per token, and
    per frame (Wan 2.2 TI2V's image-to-video: each frame's over its tokens)."""
    from unet_compiler.compiler import shims
    block = F.build_dit(F.DIT_FAMILIES[key]).model.diffusion_model.blocks[0]
    x, e, freqs, context = _wan_block_inputs(block)
    per_token = torch.randn(x.shape[0], x.shape[1], 6, block.dim)
    per_frame = torch.randn(x.shape[0], 3, 6, block.dim)          # 3 frames of 8 tokens
    with torch.inference_mode():
        for mod in (e, e[:, 0], per_token, per_frame):
            want = type(block).forward(block, x.clone(), e=mod, freqs=freqs, context=context, context_img_len=257)
            given = {"x": x, "e": mod, "freqs": freqs, "context": context, "context_img_len": 257}
            inputs = shims._dit_inputs(P.WAN_BLOCK, block, given)
            assert not given and (inputs[-1] is None) == (key == "wan21_t2v")
            _close(R.wan_block(block, *inputs), want, 1e-5)


def test_wan22_per_frame_timesteps_compiled_and_warmed(comfy):
    """Wan 2.2 TI2V with a start image samples with a denoise mask: a timestep per latent frame, so
    each block gets one modulation per frame. Warmup Shapes warms that call too (a video model whose
    timesteps follow the mask): both kinds of call give the model's own output with nothing compiled
    after warmup. Modulation rows that do not divide the tokens run the block's own code, counted."""
    mp = F.build_dit(F.DIT_FAMILIES["wan22_ti2v"])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    warm = patcher.warmup_model(cm, "1x128x128x5, 2x256x192x9", 7)
    assert "recompiles after warmup: 0" in warm and "2 of 2 regions ran compiled code" in warm, warm
    g0, ran = _graphs(accel), accel.stats["ran_wan_block"]
    for b, frames in ((1, 5), (2, 9)):
        for mask in (False, True):
            extra = {"denoise_mask": True} if mask else {}
            want = F.dit_apply(mp, b, 8, 12, seed=3, frames=frames, **extra)
            _close(F.dit_apply(cm, b, 8, 12, seed=3, frames=frames, **extra), want)
    assert (want - F.dit_apply(mp, 2, 8, 12, seed=3, frames=9)).abs().max() > 1e-4, "the mask must matter"
    assert _graphs(accel) == g0 and accel.stats["recompiles_after_warmup"] == 0, accel.text()
    assert accel.stats["ran_wan_block"] == ran + 8 and accel.stats["region_eager"] == 0, accel.stats

    block = mp.model.diffusion_model.blocks[0]
    x, _, freqs, context = _wan_block_inputs(block)
    e = torch.randn(x.shape[0], 5, 6, block.dim)          # 5 rows for 24 tokens: not whole frames
    eager0 = accel.stats["region_eager"]
    with torch.inference_mode(), accel.active():
        got = block(x.clone(), e=e, freqs=freqs, context=context[:, 257:], context_img_len=None)
    assert accel.stats["region_eager"] == eager0 + 1
    with torch.inference_mode():
        want = type(block).forward(block, x.clone(), e=e, freqs=freqs, context=context[:, 257:], context_img_len=None)
    _close(got, want, 1e-6)


def test_wan_compiled_over_frames_sizes_and_batches(comfy):
    """Wan 2.1 image-to-video (text and image cross-attention) compiled, Warmup Shapes over
    ``1x64x64x1, 2x128x96x9`` (a video box: 1 to 9 frames): the model's own output at 2 sizes x 2
    batches x 3 frame counts inside it, nothing compiled after the warmup, calls named in frames."""
    fam = F.DIT_FAMILIES["wan21_i2v"]
    mp = F.build_dit(fam)
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    accel = patcher.accelerator_of(cm)
    warm = patcher.warmup_model(cm, "1x64x64x1, 2x128x96x9", 7)
    assert "warmed 1x64x64:" in warm and "warmed 2x128x96x9:" in warm and "recompiles after warmup: 0" in warm, warm
    g0 = _graphs(accel)
    for (b, h, w), frames in [(c, f) for c in CASES for f in (None, 5, 9)]:
        _close(F.dit_apply(cm, b, h, w, seed=3, frames=frames), F.dit_apply(mp, b, h, w, seed=3, frames=frames))
    # ComfyUI's ScaleROPE node (RoPE positions scaled / shifted: other freqs, same shapes) and a
    # patches_replace["dit"] block replace around the compiled block
    from comfy_extras.nodes_rope import ScaleROPE

    def replace(args, extra):
        return {"img": extra["original_block"](args)["img"] * 0.9}
    plain = F.dit_apply(mp, 2, 8, 8, seed=3, frames=9)
    for patch in (lambda m: ScaleROPE.execute(m, 1.5, 2.0, 1.0, 0.0, 0.5, 1.0).result[0],
                  lambda m: _replaced(m, replace, block=0)):   # (Wan's head norms the last block's scale away)
        patched, ref = patch(cm), patch(mp)
        want = F.dit_apply(ref, 2, 8, 8, seed=3, frames=9)
        assert (want - plain).abs().max() > 1e-4, "the patch must change the output"
        _close(F.dit_apply(patched, 2, 8, 8, seed=3, frames=9), want)
    assert _graphs(accel) == g0 and accel.stats["recompiles_after_warmup"] == 0, accel.text()
    assert accel.ran_compiled() == (2, 2) and accel.stats["region_eager"] == 0, accel.stats


def _replaced(model, replace, block=1):
    m = model.clone()
    m.set_model_patch_replace(replace, "dit", "double_block", block)
    return m


@pytest.mark.parametrize("key", ["sd3_medium", "sd35_medium"])
def test_joint_body_is_the_blocks_own_forward(comfy, key):
    """SD3's joint-block body (uncompiled) gives the block's own forward for every block of the model:
    the plain one, the second image self-attention (SD3.5 Medium's first), the last (no context out)."""
    dm = F.build_dit(F.DIT_FAMILIES[key]).model.diffusion_model
    g = torch.Generator().manual_seed(0)
    width = dm.joint_blocks[0].x_block.attn.qkv.in_features
    ctx, x, c = (torch.randn(2, 7, width, generator=g), torch.randn(2, 16, width, generator=g),
                 torch.randn(2, width, generator=g))
    kinds = set()
    with torch.inference_mode():
        for block in dm.joint_blocks:
            kinds.add((block.context_block.pre_only, block.x_block.x_block_self_attn))
            want = type(block).forward(block, ctx, x, c=c)
            got = R.mmdit_joint_block(block, ctx, x, c)
            assert (got[0] is None) == (want[0] is None)
            if want[0] is not None:
                _close(got[0], want[0], 1e-5)
            _close(got[1], want[1], 1e-5)
    assert (True, False) in kinds and ((False, True) in kinds) == (key == "sd35_medium")


def _flux_sample(model, steps=8, seed=5, reference=False):
    """KSampler's path (``comfy.sample.sample``, euler / simple, cfg 1: Flux dev's) on an 8x8 latent
    with a random text embedding, pooled vector and guidance; ``reference``: a Flux Kontext-style
    reference latent in the conditioning (its tokens join the image's in every block)."""
    import comfy.sample
    g = torch.Generator().manual_seed(seed)
    extra = {"pooled_output": torch.randn(1, 768, generator=g), "guidance": 3.5}
    if reference:
        extra["reference_latents"] = [torch.randn(1, 16, 8, 8, generator=g)]
    pos = [[torch.randn(1, 7, 64, generator=g), extra]]
    latent = torch.zeros(1, 16, 8, 8)
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        return comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", pos, pos, latent, seed=seed,
                                   disable_pbar=True)


def test_flux_controlnet_residuals_reference_latents_and_step_caches(comfy, compiled_flux):
    """What Flux workflows put around the blocks keeps working on the compiled model, inside the warmed
    range with nothing compiled: ControlNet residuals (ComfyUI's block loop adds them to the compiled
    blocks' outputs), a Kontext reference latent (longer image token sequences), a "post_input"
    patch (a shorter text) and the step caches EasyCache and LazyCache (ComfyUI's own nodes; they
    skip some steps' blocks: fewer block calls)."""
    from comfy_extras import nodes_easycache as ec
    mp, cm, _, _ = compiled_flux
    accel = patcher.accelerator_of(cm)
    g0 = _graphs(accel)
    x, sigma, kw = F.dit_inputs(cm, 2, 8, 8, seed=3)
    g = torch.Generator().manual_seed(4)
    control = {"input": [torch.randn(2, 16, 32, generator=g), None],
               "output": [torch.randn(2, 16, 32, generator=g)] * 2}
    outs = []
    for m in (cm, mp):
        F.dit_apply(m, 2, 8, 8)                      # loaded as KSampler loads it
        with torch.inference_mode():
            outs.append(m.model.apply_model(x, sigma, control=control,
                                            transformer_options=nodes_warmup.sampling_transformer_options(m), **kw))
    _close(*outs)
    with torch.inference_mode():
        plain = mp.model.apply_model(x, sigma, transformer_options=nodes_warmup.sampling_transformer_options(mp), **kw)
    assert (outs[1] - plain).abs().max() > 1e-3, "the residuals must change the output"
    _close(_flux_sample(cm, reference=True), _flux_sample(mp, reference=True))
    # a transformer_options patch Flux's loop runs before its blocks (PuLID-style "post_input")

    def post_input(args):
        return dict(args, img=args["img"] * 1.1, txt=args["txt"][:, :5], txt_ids=args["txt_ids"][:, :5])
    patched = []
    for m in (cm, mp):
        m = m.clone()
        m.set_model_patch(post_input, "post_input")
        patched.append(F.dit_apply(m, 2, 8, 8, seed=3))
    assert (patched[1] - F.dit_apply(mp, 2, 8, 8, seed=3)).abs().max() > 1e-3
    _close(*patched)
    for node in (ec.EasyCacheNode, ec.LazyCacheNode):
        cached, ref = (node.execute(m, 3.0, 0.15, 0.95, False).result[0] for m in (cm, mp))   # (random weights: reuse a lot)
        ran = accel.stats["ran_double_block"]
        _close(_flux_sample(cached), _flux_sample(ref))
        assert accel.stats["ran_double_block"] - ran < 8 * 2, f"{node.__name__} skipped no step"
        assert accel.stats["ran_double_block"] > ran, "the steps it ran went through the compiled blocks"
    assert _graphs(accel) == g0 and accel.stats["recompiles_after_warmup"] == 0, accel.text()


def test_a_video_entry_no_memory_holds_is_refused_before_work(comfy, monkeypatch):
    """Warmup Shapes' memory floor for a DiT: 3 x its hidden width over the entry's tokens (Wan: 4
    frames a latent frame, 8 px a cell, 2x2 cells a token), naming the entry, before anything runs."""
    import comfy.model_management
    from unet_compiler.compiler.shapes import ShapeError
    mp = F.build_dit(F.DIT_FAMILIES["wan21_t2v"])
    cm, _ = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    monkeypatch.setattr(comfy.model_management, "get_free_memory", lambda *a, **k: 64 * 2**20)
    # 81 frames of 1280x720: 21 latent frames x 45 x 80 tokens x 256 wide x 3 x fp32 = 221 MiB
    with pytest.raises(ShapeError, match=r"entry 1x1280x720x81 needs at least 221 MiB of activations"):
        patcher.warmup_model(cm, "1x64x64, 1x1280x720x81", 7)
    assert patcher.accelerator_of(cm).stats["graphs_compiled"] == 0


def test_rope_cuts_longer_freqs_as_comfyuis_does(comfy):
    """Ops.rope gives ComfyUI's ``apply_rope1``, also where freqs hold more positions than x (cut)."""
    from comfy.ldm.flux.math import apply_rope1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 10, 16, generator=g)
    for n in (10, 14):
        freqs = torch.randn(2, 1, n, 8, 2, 2, generator=g)
        if n > 10 and not getattr(apply_rope1, "__module__", "").startswith("comfy_kitchen"):
            continue        # (ComfyUI's own fallback raises there)
        _close(R.TORCH_OPS.rope(x, freqs), apply_rope1(x, freqs), 1e-6)


def test_the_library_refuses_a_bare_dit_at_compile_with_the_fix(comfy):
    """``unet_compiler.compile_unet`` builds a UNet's warmup inputs only; on a bare ComfyUI DiT module
    (no ModelPatcher, whose model builds the conditioning) it refuses before any work, naming the
    ModelPatcher path that compiles and warms one; the module is left as it was."""
    from unet_compiler.compiler import api
    mp = F.build_dit(F.DIT_FAMILIES[FLUX])
    module = mp.model.diffusion_model
    with pytest.raises(ValueError, match="is a ComfyUI diffusion transformer.*Compile UNet and Warmup Shapes"):
        api.compile_unet(module, "inductor")
    assert "forward" not in module.__dict__ and api._ATTR not in module.__dict__
    with pytest.raises(ValueError, match="not compiled"):
        api.accelerator_of(module)
