"""Every UNet family ComfyUI loads through openaimodel.UNetModel (issue 14, part 1).

Each family is built by its own ``comfy.supported_models`` class from ComfyUI's
own config (tests/_families.py: the loader's config table / checkpoint
detection, widths shrunk, structure kept), random weights, in a real
ModelPatcher, and driven through ``apply_model`` with the conditioning its own
``extra_conds`` builds (c_concat, y, frames, ...).

Lanes:
- default (CI): per family, the config is ComfyUI's, the plan's region counts
  match the structure, and the compiled model gives the eager output at two
  resolutions and both batch sizes with every region kind firing; the region
  bodies run uncompiled there (torch.compile stubbed: the compile itself is what
  the inductor cases prove). Real inductor with warmup and zero recompiles on
  ONE family (the x4 upscaler: attn1 on the context, class-label y, 7 input
  channels), plus the eager report of a non-UNet ComfyUI model (SD3's MMDiT).
- ``matrix`` (``UNET_COMPILER_TEST_MATRIX=1`` or ``-m matrix``): every family x
  inductor x 2 resolutions x 2 batch sizes after a warmup over that box, 0
  recompiles; ``UNET_COMPILER_TEST_MATRIX_BACKENDS=inductor,triton`` adds the
  triton backend (meant for CUDA: on CPU the interpreter takes minutes per forward).
The compatibility table: ``python -m unet_compiler.bench compat`` (inductor, one warmed shape
per family), or ``-s`` on either lane, which prints the rows of the cases that ran.
Each lane takes ~1.5 min (default) / ~7 min (matrix) on a shared 2-core CPU.
"""
from __future__ import annotations

import os

import pytest
import torch

from unet_compiler.tests import _families as F  # noqa: N812
from unet_compiler.compiler import plan as P
from unet_compiler.compiler.config import CompileConfig
from unet_compiler.compiler.shapes import Shape
from unet_compiler.compiler.warmup import warmup_runs
from unet_compiler.nodes import patcher, warmup as nodes_warmup

pytestmark = pytest.mark.comfy

#: the CI diagonal (uncompiled bodies): two resolutions and both batch sizes (videos of
#: families.FRAMES frames for the video families) in two forwards per family; 8x8 is 1x1 and
#: 12x16 odd (3x4) at a 4-level UNet's deepest level
CI_CASES = ((1, 8, 8), (2, 12, 16))
#: the matrix (compiled): 2 latent resolutions x 2 batch sizes after a warmup over that box
RESOLUTIONS = ((16, 16), (16, 24))
BATCHES = (1, 2)
TOL = 1e-4
MATRIX_ENV = "UNET_COMPILER_TEST_MATRIX"
CI_INDUCTOR_FAMILY = "x4_upscaler"
#: batch >= 2 and >= 2x2 at the deepest level: the symbolic regime tests/nodes/test_comfy_patcher.py
#: already compiles (one probe shape, shared compiled bodies), so CI pays few new compiles
CI_INDUCTOR_CASES = ((2, 16, 16), (3, 16, 24))
_ROWS: list = []


def _matrix_on(config) -> bool:
    expr = config.option.markexpr or ""
    return os.environ.get(MATRIX_ENV) == "1" or ("matrix" in expr and "not matrix" not in expr)


def _matrix_backends() -> list[str]:
    raw = os.environ.get("UNET_COMPILER_TEST_MATRIX_BACKENDS", "inductor")
    return [b.strip() for b in raw.split(",") if b.strip()]


def _close(a, b, tol=TOL):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _pixels(batch, h, w) -> Shape:
    return Shape(batch, w * 8, h * 8)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models are dispatch-bound; on a shared 2-core runner torch's second
    thread only spins (one SDXL forward: 8 s on 2 threads under load, 0.4 s on 1)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=list(F.FAMILIES), ids=list(F.FAMILIES))
def fam(request, comfy):
    return F.FAMILIES[request.param]


@pytest.fixture
def bodies_uncompiled(monkeypatch):
    """The inductor backend with torch.compile stubbed: each region runs the very body
    inductor would compile (regions.BODIES), prepacked convs included, with no compile."""
    from unet_compiler.compiler.backends import inductor
    monkeypatch.setattr(inductor, "compiled_body", lambda body, *a, **k: body)


@pytest.fixture
def triton_here(monkeypatch):
    from unet_compiler.compiler.backends import _kernel_choice as KC, triton as TB
    if not torch.cuda.is_available():
        monkeypatch.setattr(TB.TritonBackend, "available", lambda self, device: (True, "interpreter (test)"))
    monkeypatch.setenv(KC.CHOICE_ENV, "triton")


# ---- what the plan must find, derived from the config alone -------------------------
def expected(unet_config: dict) -> tuple[dict, dict]:
    """(accelerated regions by kind, temporal parts left eager by kind) for a UNet
    built from ``unet_config``, counted from its structure (not from the plan)."""
    nrb, mult = unet_config["num_res_blocks"], unet_config["channel_mult"]
    td, tdo, tdm = unet_config["transformer_depth"], unet_config["transformer_depth_output"], \
        unet_config["transformer_depth_middle"]
    resblocks = sum(nrb) + sum(n + 1 for n in nrb) + (2 if tdm >= 0 else 1 if tdm == -1 else 0)
    blocks = sum(td) + sum(tdo) + max(tdm, 0)
    transformers = sum(1 for d in list(td) + list(tdo) if d > 0) + (1 if tdm >= 0 else 0)
    convs = 1 + 2 * (len(mult) - 1) + (0 if unet_config["use_linear_in_transformer"] else 2 * transformers)
    acc = {P.RESBLOCK: resblocks, P.ATTENTION: 2 * blocks, P.FEEDFORWARD: blocks, P.NORM_ACT: 1,
           P.PROJECTION: convs}
    temporal = {}
    if unet_config.get("use_temporal_resblock"):
        temporal[P.RESBLOCK] = resblocks
    if unet_config.get("use_temporal_attention"):
        cross = not unet_config.get("disable_temporal_crossattention", False)
        temporal[P.ATTENTION] = blocks * (2 if cross else 1)
        temporal[P.FEEDFORWARD] = blocks * (2 if unet_config.get("extra_ff_mix_layer") else 1)
    return {k: v for k, v in acc.items() if v}, temporal


def _check_plan(fam, accel, mp):
    acc, temporal = expected(mp.model.model_config.unet_config)
    assert accel.report.regions == acc, (fam.key, accel.report.regions, acc)
    skipped = {}
    for kind, n, why in accel.plan.skipped_summary():
        assert "is not a 2-D leaf" in why, (fam.key, kind, why)
        skipped[kind] = skipped.get(kind, 0) + n
    assert skipped == temporal, (fam.key, skipped, temporal)
    for r in accel.plan.regions:
        assert "time_stack" not in r.path and "time_mixer" not in r.path, r.path
    hooks = {r.hook for r in accel.plan.regions if r.kind == P.RESBLOCK}
    assert hooks == ({"_forward"} if fam.video else {"forward"})


def _compile(mp, backend, **over):
    cm, text = patcher.compile_model(mp, CompileConfig(backend=backend, **over))
    return cm, patcher.accelerator_of(cm), text


# ---- default lane --------------------------------------------------------------------
def _check_config(fam, mp):
    """The full-size config is the one ComfyUI's loader maps to this family's class, and the
    tiny model detects back to the same structure (widths aside)."""
    import comfy.model_base as mb
    import comfy.supported_models as sm
    assert F.loader_class(fam) is getattr(sm, fam.cls)
    tiny = F.tiny_config(fam)
    assert F.detected_structure(mp) == {k: tiny.get(k) for k in F.STRUCTURE}
    unet = mp.model.diffusion_model
    assert type(unet).__name__ == "UNetModel" and unet.in_channels == tiny["in_channels"]
    want = {"sd2": mb.ModelType.V_PREDICTION, "x4_upscaler": mb.ModelType.V_PREDICTION,
            "svd": mb.ModelType.V_PREDICTION_EDM, "sv3d_u": mb.ModelType.V_PREDICTION_EDM,
            "sv3d_p": mb.ModelType.V_PREDICTION_EDM, "lotus_d": mb.ModelType.IMG_TO_IMG}
    assert mp.model.model_type == want.get(fam.key, mb.ModelType.EPS)


def test_family(fam, bodies_uncompiled):
    """ComfyUI's config and class; compiled == eager through apply_model (both resolutions,
    both batch sizes), every accelerated kind fired, the report's counts are the structure's,
    temporal parts eager with the reason."""
    mp = F.build(fam)
    _check_config(fam, mp)
    refs = [F.apply(mp, fam, *case) for case in CI_CASES]
    cm, accel, text = _compile(mp, "inductor")
    _check_plan(fam, accel, mp)
    diff = 0.0
    for case, ref in zip(CI_CASES, refs, strict=True):
        out = F.apply(cm, fam, *case)
        _close(out, ref)
        diff = max(diff, float((out - ref).abs().max()))
    for kind in accel.report.regions:
        assert accel.stats[f"ran_{kind}"] > 0, (kind, dict(accel.stats))
    assert accel.stats["region_eager"] == 0, accel.text()
    if fam.video:
        assert "left eager: resblock x" in text and "temporal ResBlock" in text
        assert "temporal attention" in text and "temporal feed-forward" in text
    _ROWS.append(F.row(fam, accel, diff))
    # the shared module is left as it was
    assert not any(k in m.__dict__ for m in mp.model.diffusion_model.modules() for k in ("forward", "_forward"))


def test_ci_family_inductor_warmup_zero_recompiles(comfy):
    """Real inductor on one family (the video hook path): warm the box, then every
    in-range shape runs without a recompile and equals eager."""
    fam = F.FAMILIES[CI_INDUCTOR_FAMILY]
    _inductor_family(fam, CI_INDUCTOR_CASES)


def _inductor_family(fam, cases, backend="inductor"):
    mp = F.build(fam)
    cm, accel, _ = _compile(mp, backend)
    _check_plan(fam, accel, mp)
    shapes = sorted({_pixels(b, h, w) for b, h, w in cases}, key=lambda s: (s.batch, s.width * s.height))
    warmup_runs(accel, shapes, lambda s: F.apply(cm, fam, s.batch, s.height // 8, s.width // 8))
    assert accel.warmed and accel.report.max_abs_diff is not None and accel.report.max_abs_diff <= TOL
    diff = 0.0
    for b, h, w in cases:
        out = F.apply(cm, fam, b, h, w, seed=5)
        with accel.bypass():
            ref = F.apply(cm, fam, b, h, w, seed=5)
        _close(out, ref)
        diff = max(diff, float((out - ref).abs().max()))
    assert accel.stats["recompiles_after_warmup"] == 0, accel.text()
    for kind in accel.report.regions:
        assert accel.stats[f"ran_{kind}"] > 0, (kind, dict(accel.stats))
    return F.row(fam, accel, diff)


def test_non_unet_comfy_model_runs_eager_with_reason(comfy):
    """A ComfyUI diffusion model the pack has no body for (here AuraFlow's MMDiT) is no crash: the
    clone runs eager and the report says so and why."""
    import comfy.model_patcher
    import comfy.supported_models as sm
    cfg = sm.AuraFlow({"cond_seq_dim": 32, "max_seq": 64, "n_double_layers": 1, "n_layers": 2, "dim": 64,
                       "n_heads": 2, "global_conddim": 64})
    base = cfg.get_model({})
    F.init_random(base.diffusion_model)
    mp = comfy.model_patcher.ModelPatcher(base, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x, ctx, y = torch.randn(1, 4, 8, 8, generator=g), torch.randn(1, 7, 32, generator=g), None

    def run(m):
        with torch.inference_mode():
            return m.model.apply_model(x, torch.full((1,), 0.5), c_crossattn=ctx, y=y,
                                       transformer_options=nodes_warmup.sampling_transformer_options(m))
    ref = run(mp)
    cm, text = patcher.compile_model(mp, CompileConfig(backend="inductor"))
    _close(run(cm), ref, tol=0)
    assert "accelerated regions: none (everything runs the model's own code)" in text
    assert "comfy.ldm.aura.mmdit." in text
    assert "is neither ComfyUI's openaimodel.UNetModel" in text
    # eager by design, not a fallback: no backend resolved, nothing for the user to fix
    assert "UNet Compiler: backend eager (asked inductor)" in text
    assert "status: eager: nothing to compile, running eager: comfy.ldm." in text
    assert "comfy model (" in text, text   # the header names the class of a family the pack leaves alone
    assert "Fix:" not in text and "fallback" not in text
    # Warmup Shapes has nothing to prime and says so (before: it stopped on "no cross-attention")
    warm = patcher.warmup_model(cm, "2x64x64", 77)
    assert "nothing to warm up (1 shape(s) skipped)" in warm, warm
    assert "warmup stopped" not in warm and "warmed 2x64x64" not in warm
    _close(run(cm), ref, tol=0)


# ---- matrix lane -----------------------------------------------------------------------
@pytest.mark.matrix
@pytest.mark.parametrize("backend", _matrix_backends())
def test_matrix(fam, backend, request):
    if not _matrix_on(request.config):
        pytest.skip(f"the full family matrix runs with {MATRIX_ENV}=1 or -m matrix")
    if backend == "triton":
        request.getfixturevalue("triton_here")
    cases = [(b, h, w) for h, w in RESOLUTIONS for b in BATCHES]
    r = _inductor_family(fam, cases, backend)
    r.family = f"{r.family} [{backend}]"
    _ROWS.append(r)


@pytest.mark.matrix
def test_matrix_table(request):
    """Prints the compatibility table of the cases that ran in this session (run with -s)."""
    if not _ROWS:
        pytest.skip("no family case ran in this session")
    print("\n" + F.table(_ROWS))


def test_warmup_shapes_calls_every_family_as_the_sampler_does(comfy):
    """Warmup Shapes builds each family's conditioning with the model's own extra_conds (SDXL's
    ADM vector, inpaint / pix2pix / upscaler concat channels, the x4 upscaler's noise level,
    SVD's frame count = the batch) and warms up without stopping. The eager backend: this is
    about how warmup calls the model, not the regions."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    stopped = {}
    try:
        for fam in F.FAMILIES.values():
            mp = F.build(fam)
            cm, _ = patcher.compile_model(mp, CompileConfig(backend="eager"))
            text = patcher.warmup_model(cm, "2x64x64", 77)
            if "warmup stopped" in text or "warmed 2x64x64" not in text:
                stopped[fam.key] = text
    finally:
        torch.set_num_threads(n)
    assert not stopped, stopped


def test_qwen_image_21_is_left_to_comfyui_with_its_reason(comfy):
    """A model of ``comfy.ldm.qwen_image21`` (the newest ComfyUI's; a stand-in of its class here:
    ComfyUI 0.8.0 has none) plans as one the pack leaves to ComfyUI, the reason naming the model
    and why, not the generic "neither a UNet nor a DiT" line."""
    from unet_compiler.compiler.plan import build_plan
    cls = type("QwenImage21Transformer2DModel", (torch.nn.Module,), {"__module__": "comfy.ldm.qwen_image21.model"})
    plan = build_plan(cls())
    why = plan.not_a_unet or ""
    assert why.startswith("running eager: Qwen-Image 2.1 (comfy.ldm.qwen_image21.model.QwenImage21Transformer2DModel)")
    assert "comfy-kitchen" in why and "ComfyUI's own compiler" in why and "neither" not in why, why
