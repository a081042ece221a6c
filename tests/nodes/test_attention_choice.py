"""The attention ComfyUI was told to use runs (compiler/overrides.py, ``exact_attention``).

ComfyUI's model code calls the attention function its modules hold as ``optimized_attention`` /
``optimized_attention_masked``: ``--use-sage-attention`` (``--use-flash-attention``,
``--use-ck-attention``) sets it at import, other packs set it later, and the newest ComfyUI also lets a
checkpoint choose per attention module (``CrossAttention.comfy_attention.function``). The pack's bodies
compute exact attention (SDPA), which ComfyUI's own exact functions match and sage or int8 attention
do not: before, every compiled region ignored the choice (the SD1.5 stand-in 1.2 off, Flux's 0.65).
Now the regions whose code calls another choice run the model's own code with it, said in one line.

The stand-in for another attention: ComfyUI's own ``attention_pytorch`` at half the softmax
temperature, continuous (a quantizing one would turn the compiled regions' rounding into jumps).
Tiny models of ComfyUI's own classes in a real ModelPatcher."""
from __future__ import annotations

import types

import pytest
import torch

from unet_compiler.compiler.config import CompileConfig
from unet_compiler.nodes import patcher
from unet_compiler.tests import _families as F  # noqa: N812
from unet_compiler.tests._written import as_written, written_as

from .test_comfy_patcher import _apply, _close

pytestmark = pytest.mark.comfy
CFG = CompileConfig(backend="inductor")
ONE_LINE = "ComfyUI's attention is"


def _other(attention):
    """Another attention function, as a pack or ``--use-sage-attention`` sets it."""
    def other_attention(q, k, v, heads, *a, **kw):
        return attention.attention_pytorch(q * 0.5, k, v, heads, *a, **kw)
    return other_attention


@pytest.fixture
def uncompiled(monkeypatch):
    from unet_compiler.compiler.backends import inductor
    monkeypatch.setattr(inductor, "region_body", lambda body, *a, **k: body)


def _lines(accel) -> list:
    return [line for line in accel.text().splitlines() if ONE_LINE in line]


def test_the_attention_set_before_compiling_runs(make_comfy_model, comfy, monkeypatch):
    """Set at import (``--use-sage-attention``): every attention region runs ComfyUI's code with it,
    == the model without the pack; the other regions run compiled; one report line says so, in
    Compile UNet's report already."""
    A = comfy.attention
    mp = make_comfy_model("sd15")
    plain = _apply(mp, "sd15")
    other = _other(A)
    monkeypatch.setattr(A, "optimized_attention", other)
    monkeypatch.setattr(A, "optimized_attention_masked", other)      # (as the flag sets both)
    ref = _apply(mp, "sd15")
    assert (ref - plain).abs().max() > 0.1, "the choice must matter"
    cm, plan_text = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    assert "ComfyUI's attention is" in plan_text, plan_text          # (said by Compile UNet already)
    _close(_apply(cm, "sd15"), ref)
    _close(_apply(cm, "sd15"), ref)
    attention = sum(r.kind == "attention" for r in accel.plan.regions)
    assert accel.stats["region_eager_overridden"] == 2 * attention and accel.stats["ran_resblock"] > 0, accel.stats
    assert accel.stats["ran_attention"] == 0, accel.stats
    lines = _lines(accel)       # (one line, naming the first of the two globals: the same each run)
    assert len(lines) == 1 and "other_attention (comfy.ldm.modules.attention.optimized_attention):" in lines[0] \
        and f"{attention} regions run the model's own code" in lines[0], accel.text()


def test_another_exact_attention_stays_compiled(make_comfy_model, comfy, monkeypatch):
    """ComfyUI's own exact functions (split, basic: what ``--use-split-cross-attention`` or a CPU picks)
    compute what the pack's bodies compute: the attention regions stay compiled, nothing said."""
    A = comfy.attention
    mp = make_comfy_model("sd15")
    ref = _apply(mp, "sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    for fn in (A.attention_split, A.attention_basic):
        monkeypatch.setattr(A, "optimized_attention", fn)
        _close(_apply(cm, "sd15"), ref)
    assert accel.stats["ran_attention"] > 0 and accel.stats["region_eager_overridden"] == 0, accel.stats
    assert not _lines(accel), accel.text()


def test_an_attention_set_between_calls_runs_over_graphs(make_comfy_model, comfy, monkeypatch, strict_graph_standin):
    """Set after the regions' graphs and one graph per UNet call were captured (a replay re-runs the
    recorded ops, no Python), then taken back: each call == the model without the pack with what is
    set then; with it set the attention regions run ComfyUI's code, after it the graphs replay."""
    from unet_compiler.compiler.call_graph import CallGraphs
    from unet_compiler.compiler.graphs import RegionGraphs
    A = comfy.attention
    mp = make_comfy_model("sd15")
    plain = _apply(mp, "sd15")
    planned = A.optimized_attention
    monkeypatch.setattr(A, "optimized_attention", _other(A))
    ref = _apply(mp, "sd15")
    monkeypatch.setattr(A, "optimized_attention", planned)
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    accel.graphs = RegionGraphs(graphs=strict_graph_standin())
    accel.call_graphs = CallGraphs(accel.root, accel.graphs, accel.stats)
    for _ in range(3):
        _close(_apply(cm, "sd15"), plain)
    assert accel.call_graphs.graphs.stats["replays"] + accel.graphs.stats["replays"] > 0, accel.text()
    monkeypatch.setattr(A, "optimized_attention", _other(A))
    for _ in range(2):
        _close(_apply(cm, "sd15"), ref)
    assert accel.stats["region_eager_overridden"] > 0
    monkeypatch.setattr(A, "optimized_attention", planned)
    before = accel.stats["region_eager_overridden"]
    for _ in range(2):
        _close(_apply(cm, "sd15"), plain)
    assert accel.stats["region_eager_overridden"] == before


#: each DiT family and the ComfyUI module whose attention global its blocks call
DIT_ATTENTION = [("flux_dev", "comfy.ldm.flux.math", None), ("wan21_t2v", "comfy.ldm.wan.model", 5),
                 ("sd3_medium", "comfy.ldm.modules.diffusionmodules.mmdit", None),
                 ("lumina2", "comfy.ldm.lumina.model", None), ("qwen_image", "comfy.ldm.qwen_image.model", None)]


@pytest.mark.parametrize("key,module,frames", DIT_ATTENTION, ids=[k for k, _, _ in DIT_ATTENTION])
def test_the_attention_a_dit_module_calls_runs(comfy, uncompiled, monkeypatch, key, module, frames):
    """A pack sets the attention global of the one module a DiT's blocks call (Flux's ``math``, Wan's
    ``model``, ...): the blocks run ComfyUI's code with it, == the model without the pack; the same
    global in a module the model never calls changes nothing."""
    import importlib
    mod = importlib.import_module(module)
    fam = F.DIT_FAMILIES[key]
    mp = F.build_dit(fam)
    plain = F.dit_apply(mp, 1, 8, 8, seed=3, frames=frames)
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    elsewhere = importlib.import_module("comfy.ldm.hunyuan_video.model")
    monkeypatch.setattr(elsewhere, "optimized_attention", _other(comfy.attention), raising=False)
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3, frames=frames), plain, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] == 0 and not _lines(accel), accel.text()
    for name in ("optimized_attention", "optimized_attention_masked"):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, _other(comfy.attention))
    with accel.bypass():
        ref = F.dit_apply(cm, 1, 8, 8, seed=3, frames=frames)
    assert (ref - plain).abs().max() > 1e-3, "the choice must matter"
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3, frames=frames), ref, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] > 0 and len(_lines(accel)) >= 1, accel.text()


# ---- the newest ComfyUI: a checkpoint's choice per attention module --------------------------------
# Read at Comfy-Org/ComfyUI 05080f60 (comfy/ldm/modules/attention.py): ``CrossAttention.__init__``
# makes ``self.comfy_attention = ComfyAttention()``; ``ComfyAttention._load_from_state_dict`` sets its
# ``function`` from the checkpoint's config (comfy-kitchen int8 attention); ``CrossAttention.forward``
# passes ``preferred_attention=self.comfy_attention`` to ``optimized_attention``, whose ``wrap_attn`` calls
# an ``optimized_attention_override`` first, else ``preferred_attention.function`` where set, else the
# function. The double: that class, and that forward with ``wrap_attn``'s choice written out (0.8.0's
# ``wrap_attn`` takes no ``preferred_attention``; the newest's tensor containers left out), its
# globals the attention module's as the real one's are.

class ComfyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = None
        self.function = None


def _newest_forward(self, x, context=None, value=None, mask=None, transformer_options={}):  # noqa: B006
    q = self.to_q(x)
    context = default(context, x)  # noqa: F821 (the attention module's, below)
    k = self.to_k(context)
    if value is not None:
        v = self.to_v(value)
        del value
    else:
        v = self.to_v(context)
    preferred = self.comfy_attention.function
    if preferred is not None and "optimized_attention_override" not in transformer_options:
        out = preferred(q, k, v, self.heads, mask, attn_precision=self.attn_precision,
                        transformer_options=transformer_options)
    elif mask is None:
        out = optimized_attention(q, k, v, self.heads, attn_precision=self.attn_precision,  # noqa: F821
                                  transformer_options=transformer_options)
    else:
        out = optimized_attention_masked(q, k, v, self.heads, mask, attn_precision=self.attn_precision,  # noqa: F821
                                         transformer_options=transformer_options)
    return self.to_out(out)


@pytest.fixture
def newest_attention(comfy, monkeypatch):
    """ComfyUI 0.8.0's CrossAttention made the newest's (above); returns a function that gives each
    CrossAttention of a model its ``comfy_attention``, as the newest's ``__init__`` does."""
    A = comfy.attention
    cls = as_written(type("ComfyAttention", (ComfyAttention,), {}), A.__name__)
    monkeypatch.setattr(A, "ComfyAttention", cls, raising=False)
    # (its globals the attention module's, as the real one's)
    forward = types.FunctionType(_newest_forward.__code__, vars(A), "forward", _newest_forward.__defaults__)
    monkeypatch.setattr(A.CrossAttention, "forward", written_as(forward, A.CrossAttention, "forward"))

    def give(mp):
        for m in mp.model.diffusion_model.modules():
            if type(m) is A.CrossAttention:
                m.comfy_attention = cls()
        return mp
    return give


def test_a_checkpoints_attention_per_module_runs(make_comfy_model, comfy, newest_attention):
    """The newest ComfyUI: one attention module's ``comfy_attention.function`` set at load (as a
    checkpoint's int8 config sets it), another's later by an object patch: those regions run ComfyUI's
    code with it, == the model without the pack; every other attention region stays compiled."""
    A = comfy.attention
    mp = newest_attention(make_comfy_model("sd15"))
    plain = _apply(mp, "sd15")
    first = mp.model.diffusion_model.input_blocks[1][1].transformer_blocks[0].attn1
    first.comfy_attention.function = _other(A)
    at_load = _apply(mp, "sd15")
    assert (at_load - plain).abs().max() > 0.1
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    _close(_apply(cm, "sd15"), at_load)
    assert accel.stats["region_eager_overridden"] == 1 and accel.stats["ran_attention"] > 0, accel.stats
    assert "input_blocks.1.1.transformer_blocks.0.attn1: ComfyUI's attention is" in accel.text()
    assert "other_attention (comfy_attention.function): that region runs" in accel.text()
    patched = cm.clone()
    patched.add_object_patch("diffusion_model.middle_block.1.transformer_blocks.0.attn2.comfy_attention.function",
                             _other(A))
    with accel.bypass():
        ref = _apply(patched, "sd15")
    assert (ref - at_load).abs().max() > 0.1
    _close(_apply(patched, "sd15"), ref)
    assert "other_attention (comfy_attention.function): also 1 region runs the model's own code with it (the " \
           "pack's code would skip it): middle_block.1.transformer_blocks.0.attn2" in accel.text(), accel.text()
    _close(_apply(cm, "sd15"), at_load)      # (ComfyUI's unpatch: the load's choice again)


def test_a_checkpoints_choice_on_every_module_is_one_line(make_comfy_model, comfy, newest_attention):
    """Every attention module's choice set alike (an int8 checkpoint): each region runs ComfyUI's code
    with it, said in one line; a choice that another took the place of and that is gone is no longer
    taken for the current one (the watch's memo holds what it judged weakly)."""
    import gc
    A = comfy.attention
    mp = newest_attention(make_comfy_model("sd15"))
    modules = [m.comfy_attention for m in mp.model.diffusion_model.modules() if hasattr(m, "comfy_attention")]
    first = _other(A)
    for m in modules:
        m.function = first
    ref = _apply(mp, "sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    _close(_apply(cm, "sd15"), ref)
    lines = _lines(accel)
    assert len(lines) == 1 and f"{len(modules)} regions run the model's own code" in lines[0], accel.text()
    modules[0].function = _other(A)        # another choice, for one call
    _apply(cm, "sd15")
    modules[0].function = None             # ... then none, the other one gone
    gc.collect()
    before = accel.stats["region_eager_overridden"]
    with accel.bypass():
        own = _apply(cm, "sd15")
    _close(_apply(cm, "sd15"), own)
    assert accel.stats["region_eager_overridden"] - before == len(modules) - 1, accel.stats


def _halving(planned):
    """Flux's attention function ``planned`` at half the softmax temperature (another pack's handler)."""
    def halved(q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006
        return planned(q * 0.5, k, v, pe, mask=mask, transformer_options=transformer_options)
    return halved


def test_a_function_on_the_way_to_the_attention_set_runs(comfy, uncompiled, monkeypatch):
    """A pack sets the function Flux's blocks call on the way to ComfyUI's attention
    (``comfy.ldm.flux.layers.attention``), after compiling: the blocks run ComfyUI's code with it,
    == the model without the pack, the report naming it, also once the watch was built again (a module
    tree change); taken back, they run compiled."""
    import comfy.ldm.flux.layers as layers

    from unet_compiler.compiler import graphs
    mp = F.build_dit(F.DIT_FAMILIES["flux_dev"])
    plain = F.dit_apply(mp, 1, 8, 8, seed=3)
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), plain, rtol=1e-4, atol=1e-4)
    planned = layers.attention

    other = _halving(planned)
    monkeypatch.setattr(layers, "attention", other)
    with accel.bypass():
        ref = F.dit_apply(cm, 1, 8, 8, seed=3)
    assert (ref - plain).abs().max() > 1e-3, "the function must matter"
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), ref, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] > 0
    assert "another node set comfy.ldm.flux.layers.attention:" in accel.text(), accel.text()
    graphs.structure_moved()    # (the watch built again, in place and anew as a one-shape warmup's new
    accel._watch()              # shims make it: what was planned stays the model's)
    before = accel.stats["region_eager_overridden"]
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), ref, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] > before
    monkeypatch.setattr(layers, "attention", planned)
    before = accel.stats["region_eager_overridden"]
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), plain, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] == before


def test_a_checkpoints_exact_choice_stays_compiled(make_comfy_model, comfy, newest_attention):
    """A module's choice that is one of ComfyUI's exact functions: compiled, nothing said."""
    A = comfy.attention
    mp = newest_attention(make_comfy_model("sd15"))
    ref = _apply(mp, "sd15")
    for m in mp.model.diffusion_model.modules():
        if hasattr(m, "comfy_attention"):
            m.comfy_attention.function = A.attention_pytorch
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    _close(_apply(cm, "sd15"), ref)
    assert accel.stats["region_eager_overridden"] == 0 and accel.stats["ran_attention"] > 0, accel.stats


def test_exact_attention_judges_the_function_not_its_name(comfy):
    """ComfyUI's own exact functions, as its module wrote them; sage, a copy named like one of them, a
    wrapper made elsewhere, a container function set on one, a partial: not."""
    import functools

    from unet_compiler.compiler.overrides import attention_name, exact_attention
    A = comfy.attention
    assert all(exact_attention(getattr(A, n)) for n in ("attention_pytorch", "attention_basic", "attention_split",
                                                         "attention_sub_quad", "attention_xformers"))
    assert exact_attention(None)
    assert not exact_attention(A.attention_sage)
    lookalike = types.FunctionType((lambda *a, **k: None).__code__, {"__name__": A.__name__}, "attention_pytorch")
    lookalike.__qualname__ = "attention_pytorch"
    assert not exact_attention(lookalike)
    assert not exact_attention(functools.wraps(A.attention_pytorch)(lambda *a, **k: A.attention_pytorch(*a, **k)))
    assert not exact_attention(functools.partial(A.attention_pytorch))
    wrapper = A.attention_pytorch          # (a copy of ComfyUI's own wrapper, judged exact until one is set)
    copy = functools.update_wrapper(types.FunctionType(wrapper.__code__, wrapper.__globals__, "wrapper", None,
                                                       wrapper.__closure__), wrapper.__wrapped__)
    assert exact_attention(copy)
    copy.container_function = lambda *a, **k: None
    assert not exact_attention(copy)

    class Dispatcher:      # (a callable whose attribute lookup raises what its dict raises)
        table: dict = {}

        def __call__(self, *a, **k):
            return A.attention_pytorch(*a, **k)

        def __getattr__(self, name):
            return self.table[name]
    assert not exact_attention(Dispatcher())
    assert attention_name(Dispatcher()).endswith("Dispatcher")


def _another_packs(fn, name: str, **module_globals):
    """``fn`` as another pack's module would hold it: its globals that module's (``module_globals``)."""
    out = types.FunctionType(fn.__code__, {"__name__": "another_pack.nodes", **module_globals}, name,
                             fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _handler(q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006
    """Another pack's Flux attention handler (its module imports ComfyUI's ``optimized_attention``)."""
    q, k = apply_rope(q * 0.5, k, pe)  # noqa: F821 (the handler's module's)
    heads = q.shape[1]
    return optimized_attention(q, k, v, heads, skip_reshape=True, mask=mask,  # noqa: F821
                               transformer_options=transformer_options)


def _handler_by_attribute(q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006
    """Another pack's handler that reads ComfyUI's choice live, as its attention module's attribute."""
    q, k = apply_rope(q * 0.5, k, pe)  # noqa: F821 (the handler's module's)
    return comfy_attention.optimized_attention(q, k, v, q.shape[1], skip_reshape=True, mask=mask,  # noqa: F821
                                               transformer_options=transformer_options)


@pytest.mark.parametrize("how", ["own_handler", "by_attribute", "wraps", "partial", "callable_object"])
def test_a_function_set_on_the_way_before_compiling_runs(comfy, uncompiled, monkeypatch, how):
    """Another pack sets Flux's ``attention`` in ``layers`` and ``math`` at its import, before
    compiling: its own handler calling ComfyUI's attention (by its imported name, or as the attention
    module's attribute), a ``functools.wraps`` wrapper of ComfyUI's, a partial, a callable object.
    Before, the walk followed only ComfyUI's own functions: the blocks ran the pack's attention (0.65
    off) and even the attention global behind went unwatched. Now they run their own code with it,
    == the model without the pack."""
    import functools

    import comfy.ldm.flux.layers as layers
    import comfy.ldm.flux.math as fmath
    mp = F.build_dit(F.DIT_FAMILIES["flux_dev"])
    plain = F.dit_apply(mp, 1, 8, 8, seed=3)
    planned = layers.attention
    halved = _halving(planned)
    if how == "own_handler":
        handler = _another_packs(_handler, "_handler", apply_rope=fmath.apply_rope,
                                 optimized_attention=comfy.attention.optimized_attention)
    elif how == "by_attribute":
        handler = _another_packs(_handler_by_attribute, "_handler_by_attribute", apply_rope=fmath.apply_rope,
                                 comfy_attention=comfy.attention)
    elif how == "wraps":
        handler = functools.wraps(planned)(_another_packs(halved, "halved", planned=planned))
    elif how == "partial":
        handler = functools.partial(_another_packs(halved, "halved", planned=planned))
    else:
        def call(self, q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006
            return original(q * 0.5, k, v, pe, mask=mask, transformer_options=transformer_options)  # noqa: F821
        handler = type("Handler", (), {"__call__": _another_packs(call, "__call__", original=planned)})()
    monkeypatch.setattr(layers, "attention", handler)
    monkeypatch.setattr(fmath, "attention", handler)
    ref = F.dit_apply(mp, 1, 8, 8, seed=3)
    assert (ref - plain).abs().max() > 1e-3, "the handler must matter"
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), ref, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] > 0
    assert "another node set comfy.ldm.flux.layers.attention:" in accel.text(), accel.text()
    monkeypatch.setattr(layers, "attention", planned)       # (the pack takes it back: ComfyUI's own)
    monkeypatch.setattr(fmath, "attention", planned)
    before = accel.stats["region_eager_overridden"]
    for _ in range(2):
        torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), plain, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] == before and accel.overrides.check_classes() is None


def test_another_packs_module_calling_comfyuis_attention_is_no_patch(comfy, uncompiled):
    """A module of another pack inside a block whose code calls ComfyUI's Flux attention by a name it
    imported: that import is the pack's own, not a patch; the block runs compiled."""
    import comfy.ldm.flux.math as fmath

    def probe(self, x):
        return x + 0 * flux_attention  # noqa: F821 (the pack's module's)
    cls = type("Probe", (torch.nn.Module,), {"__module__": "another_pack.nodes"})
    cls.forward = written_as(_another_packs(probe, "forward", flux_attention=fmath.attention), cls, "forward")
    mp = F.build_dit(F.DIT_FAMILIES["flux_dev"])
    mp.model.diffusion_model.double_blocks[0].probe = cls()
    plain = F.dit_apply(mp, 1, 8, 8, seed=3)
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), plain, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] == 0 and "another node set" not in accel.text(), accel.text()


def test_an_attention_only_the_code_around_the_regions_calls_keeps_everything(comfy, uncompiled, monkeypatch):
    """HunyuanVideo's token refiner (around the blocks) calls its module's attention global: another
    function set there before compiling leaves every block compiled and nothing found (that code runs
    as it is); set after, the finding is for the code around the regions alone (one graph per UNet
    call, where a model has one, would replay the function it captured)."""
    import comfy.ldm.hunyuan_video.model as hv
    mp = F.build_dit(F.DIT_FAMILIES["hunyuan_video"])
    monkeypatch.setattr(hv, "optimized_attention", _other(comfy.attention))
    ref = F.dit_apply(mp, 1, 8, 8, seed=3, frames=1)
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3, frames=1), ref, rtol=1e-4, atol=1e-4)
    assert accel.stats["region_eager_overridden"] == 0 and not _lines(accel), accel.text()
    assert accel.overrides.check_classes() is None
    monkeypatch.setattr(hv, "optimized_attention", _other(comfy.attention))
    found = accel.overrides.check_classes()     # (an attention moves no weights: no weight checks)
    assert found is not None and not found.regions and found.around_attention and not found.moving, found
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3, frames=1), ref, rtol=1e-4, atol=1e-4)
    assert not _lines(accel) and "stands aside" not in accel.text(), accel.text()   # (a DiT has no such graph)


def test_a_reason_found_on_more_regions_later_names_only_those(make_comfy_model):
    """The report says a reason once for the regions it names, and for regions found with it later
    only those ("also"), never the same regions again."""
    mp = make_comfy_model("sd15")
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    a, b, c = (torch.nn.Module() for _ in range(3))
    why = "another node set x.y"
    for found in ({a: f"p.a: {why}", b: f"p.b: {why}"}, {a: f"p.a: {why}", b: f"p.b: {why}", c: f"p.c: {why}"},
                  {a: f"p.a: {why}"}, {b: f"p.b: {why}", a: f"p.a: {why}"}):
        accel._say_overridden(found)
    notes = [n for n in accel.report.notes if why in n]
    assert notes == [f"{why}: 2 regions run the model's own code with it (the pack's code would skip it): p.a, p.b",
                     f"{why}: also 1 region runs the model's own code with it (the pack's code would skip it): p.c"], notes


class _Lazy:
    """A lazy proxy: callable (it calls ``target``), its class lookup raises."""

    def __init__(self, target):
        self.target = target

    def __call__(self, *a, **k):
        return self.target(*a, **k)

    @property
    def __class__(self):
        raise RuntimeError("not loaded")


def test_an_object_that_raises_when_looked_at_is_judged_not_raised(comfy, uncompiled, monkeypatch):
    """Objects whose class lookup raises (lazy proxies): one under an unrelated name the blocks' code
    reads (``img_mod``) leaves the watch whole (the global behind it set after compiling is seen), one
    set on the way at a call after another pack's handler is judged, not raised: each call == the
    model without the pack."""
    import comfy.ldm.flux.layers as layers
    import comfy.ldm.flux.math as fmath
    mp = F.build_dit(F.DIT_FAMILIES["flux_dev"])
    plain = F.dit_apply(mp, 1, 8, 8, seed=3)
    monkeypatch.setattr(layers, "img_mod", _Lazy(None), raising=False)
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    monkeypatch.setattr(fmath, "optimized_attention", _other(comfy.attention))
    with accel.bypass():
        ref = F.dit_apply(cm, 1, 8, 8, seed=3)
    assert (ref - plain).abs().max() > 1e-3
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), ref, rtol=1e-4, atol=1e-4)
    monkeypatch.undo()
    planned = layers.attention

    halved = _halving(planned)
    monkeypatch.setattr(layers, "attention", _another_packs(halved, "halved", planned=planned))
    mp = F.build_dit(F.DIT_FAMILIES["flux_dev"])
    cm, _ = patcher.compile_model(mp, CFG)
    accel = patcher.accelerator_of(cm)
    with accel.bypass():
        ref = F.dit_apply(cm, 1, 8, 8, seed=3)
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), ref, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(layers, "attention", _Lazy(planned))
    torch.testing.assert_close(F.dit_apply(cm, 1, 8, 8, seed=3), plain, rtol=1e-4, atol=1e-4)
