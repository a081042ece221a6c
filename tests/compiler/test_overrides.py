"""compiler/overrides.py: code another node set on the modules the regions stand in for (a ``forward``
set on one instance, a forward hook) runs as set, checked at the start of every UNet call.

A tiny diffusers UNet through both kinds of graph on tests/conftest.py's StrictGraphStandIn (a replay
re-runs the captured aten ops, not the model's Python), its regions' own bodies uncompiled; the
reference is the same model, unaccelerated, with the same code set on it."""
from __future__ import annotations

import contextlib

import torch

from unet_compiler.compiler.overrides import Overrides

from .test_call_graph import _diffusers
from .test_cuda_graphs import _sample


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _geglu(u):
    return u.down_blocks[0].attentions[0].transformer_blocks[0].ff.net[0]


@contextlib.contextmanager
def _geglu_set(scale: float):
    """Inside: diffusers' ``GEGLU.forward`` is another module's method (the class's own times
    ``scale``), compiled models made inside planned with it. Yields (GEGLU, its own forward, the
    other method); the own one is back after."""
    from diffusers.models.activations import GEGLU
    planned = GEGLU.forward

    def other(self, *a, **k):
        return planned(self, *a, **k) * scale
    GEGLU.forward = other
    try:
        yield GEGLU, planned, other
    finally:
        GEGLU.forward = planned


def test_a_forward_set_inside_a_region_runs_there(tiny_unet, strict_graph_standin):
    """A ``forward`` set on the GEGLU inside a feed-forward region (whose body computes GEGLU itself):
    before, the body skipped it (the output was the unpatched model's). Now that region runs the
    model's own code with it while it is there, said once in the report, and compiled code after."""
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    for m in (u, ref):
        g = _geglu(m)
        g.forward = lambda x, g=g: type(g).forward(g, x) * 0.5
    for s in range(4):
        _close(_sample(u, s), _sample(ref, s))
    assert accel.stats["region_eager_overridden"] == 4
    text = accel.text()
    assert "transformer_blocks.0.ff.net.0: another node set its forward" in text, text
    assert accel.call_graphs.graphs.stats["captured"] == 0
    for m in (u, ref):
        del _geglu(m).forward
    for s in range(4, 8):
        _close(_sample(u, s), _sample(ref, s))
    assert accel.stats["region_eager_overridden"] == 4
    assert accel.call_graphs.graphs.stats["captured"] == 1


def test_code_set_around_the_regions_is_never_frozen_in_one_graph(tiny_unet, strict_graph_standin):
    """A ``forward`` with state set on a block container (a step cache deciding per call, as
    TeaCache's ``forward_orig`` does): before, one graph per UNet call froze its first decision.
    Now the call goes region by region, every call == the reference, the reason counted."""
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    for m in (u, ref):
        mid, calls = m.mid_block, [0]

        def every_other(*a, mid=mid, calls=calls, **k):
            calls[0] += 1
            out = type(mid).forward(mid, *a, **k)
            return out if calls[0] % 2 else out * 0.5
        mid.forward = every_other
    for s in range(6):
        _close(_sample(u, s), _sample(ref, s))
    assert accel.call_graphs.graphs.stats["captured"] == 0
    assert accel.stats["region_eager_overridden"] == 0      # (the regions themselves run compiled)
    text = accel.text()
    assert "another node set mid_block.forward" in text, text
    assert "another node's code set on the model's modules runs inside the call x6" in text, text


def test_a_class_set_on_a_module_after_compiling_runs(tiny_unet, strict_graph_standin):
    """tomesd and HiDiffusion patch a model by setting ``module.__class__`` to a subclass of their own:
    on a region module (a resnet) its body ran the class it was planned with (0.55 off), and on a
    block around the regions one graph per UNet call froze it. Now the region runs the model's own
    code, the call goes region by region, each said; with the classes back, compiled and one graph."""
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    _close(_sample(u, 0), _sample(ref, 0))
    for m in (u, ref):
        for mod, scale in ((m.down_blocks[0].resnets[0], 0.5), (m.down_blocks[0].attentions[0].transformer_blocks[0], 2.0)):
            planned = type(mod)
            mod.__class__ = type("Patched" + planned.__name__, (planned,), {
                "forward": lambda self, *a, planned=planned, scale=scale, **k: planned.forward(self, *a, **k) * scale})
    for s in range(1, 4):
        _close(_sample(u, s), _sample(ref, s))
    text = accel.text()
    assert "down_blocks.0.resnets.0: another node set its class to " in text and "PatchedResnetBlock2D" in text, text
    assert "transformer_blocks.0: another node set its class to " in text, text
    assert accel.stats["region_eager_overridden"] == 3
    captured = accel.call_graphs.graphs.stats["captured"]
    for m in (u, ref):
        for mod in (m.down_blocks[0].resnets[0], m.down_blocks[0].attentions[0].transformer_blocks[0]):
            mod.__class__ = type(mod).__mro__[1]
    for s in range(4, 8):
        _close(_sample(u, s), _sample(ref, s))
    assert accel.stats["region_eager_overridden"] == 3
    assert accel.call_graphs.graphs.stats["captured"] >= captured


def test_a_hook_inside_a_region_runs(tiny_unet, strict_graph_standin):
    """A forward hook on a module inside a region (its body does not call that module): it runs, and
    changes the output as it does on the model's own code."""
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    seen = []
    for m in (u, ref):
        _geglu(m).register_forward_hook(lambda mod, a, out: (seen.append(1), out * 2)[1])
    for s in range(3):
        _close(_sample(u, s), _sample(ref, s))
    assert len(seen) == 6 and accel.stats["region_eager_overridden"] == 3
    assert "transformer_blocks.0.ff.net.0: a forward hook" in accel.text()


def test_a_call_with_nothing_set_finds_nothing_and_the_check_is_cheap(tiny_unet, strict_graph_standin):
    """Nothing set: ``check`` finds nothing, on the model as compiled and on the stock model; the
    pack's own forward on the root is not another node's."""
    import time
    u = tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    assert accel.overrides.check(u) is None
    watch = Overrides(u, [(m, shim.hook, "r") for m, shim in accel._shims])
    t0 = time.perf_counter()
    for _ in range(200):
        assert watch.check(u) is None
    per_call = (time.perf_counter() - t0) / 200
    assert per_call < 200e-6, per_call          # 26 µs for SD1.5's 843 modules here (docs/internals.md)


def test_an_attention_processor_set_after_compiling_runs(tiny_unet, strict_graph_standin):
    """diffusers' ``set_attn_processor`` after compiling (a processor that scales its result, as
    attention-control processors change it; PAG's, IP-Adapter's): before, the attention regions kept
    serving the processor they were compiled with (0.14 off). Now a region whose processor is another
    kind runs the model's own code, said once; back to the planned kind, compiled again."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    class Scaled(AttnProcessor2_0):
        def __call__(self, attn, hidden_states, *a, **k):
            return 0.5 * super().__call__(attn, hidden_states, *a, **k)
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    for m in (u, ref):
        m.set_attn_processor(Scaled())
    for s in range(3):
        _close(_sample(u, s), _sample(ref, s))
    attention = sum(r.kind == "attention" for r in accel.plan.regions)
    assert attention and accel.stats["region_eager_overridden"] == 3 * attention
    assert "attention processor Scaled, not the AttnProcessor2_0 it was compiled with" in accel.text()
    for m in (u, ref):
        m.set_attn_processor(AttnProcessor2_0())
    for s in range(3, 6):
        _close(_sample(u, s), _sample(ref, s))
    assert accel.stats["region_eager_overridden"] == 3 * attention


def test_what_an_unpatch_leaves_is_the_models_own(tiny_unet, strict_graph_standin):
    """ComfyUI's unpatch writes back what its ``set_attr`` saved with ``getattr``: the class's method
    bound to the module, now in the instance dict. That is the model's own code: found nothing (and
    removed, so the module reads its class's method again). Before, it counted as another node's
    forward for the rest of the session (a region on the model's own code every call)."""
    u = tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    g = _geglu(u)
    g.__dict__["forward"] = g.forward                 # what unpatch_model leaves
    u.mid_block.__dict__["forward"] = u.mid_block.forward
    assert accel.overrides.check(u) is None
    assert "forward" not in g.__dict__ and "forward" not in u.mid_block.__dict__
    assert accel.overrides.check(u) is None


def test_a_watch_built_again_keeps_what_the_model_held_when_planned(tiny_unet, strict_graph_standin):
    """New shims (a one-shape warmup reconfigures after ComfyUI applied the prompt's patches): the
    watch built with them still finds a processor changed since planning. And processors the body
    serves (``set_default_attn_processor``) are the model's own; a processor that is a module (an
    IP-Adapter's), then the plain one back: found, then nothing."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
    from unet_compiler.compiler import regions as R

    class Scaled(AttnProcessor2_0):
        def __call__(self, attn, hidden_states, *a, **k):
            return 0.5 * super().__call__(attn, hidden_states, *a, **k)

    class ModuleProcessor(torch.nn.Module):
        def __call__(self, attn, hidden_states, *a, **k):
            return AttnProcessor2_0()(attn, hidden_states, *a, **k)
    u = tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    u.set_attn_processor(Scaled())
    accel._install(R.BODIES)
    assert accel.overrides.check(u) is not None
    u.set_attn_processor(AttnProcessor())
    assert accel.overrides.check(u) is None
    u.set_attn_processor(ModuleProcessor())
    assert accel.overrides.check(u).regions
    u.set_attn_processor(AttnProcessor2_0())
    assert accel.overrides.check(u) is None


def test_a_global_forward_hook_sends_every_region_to_the_models_own_code(tiny_unet, strict_graph_standin):
    u = tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
    try:
        found = accel.overrides.check(u)
        assert found is not None and len(found.regions) == len(accel._shims)
    finally:
        handle.remove()
    assert accel.overrides.check(u) is None


def test_a_watch_built_again_sees_code_added_beside_a_key_gone(tiny_unet, strict_graph_standin):
    """Between two watches a container lost one key and got a step cache's method: the key count is
    the planned one, and the new watch still finds the method."""
    from unet_compiler.compiler import regions as R
    u = tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    mid = u.mid_block
    mid.__dict__["state"] = 1
    assert accel.overrides.check(u) is None          # (state that is no code: the new normal)
    del mid.__dict__["state"]
    mid.__dict__["forward_orig"] = lambda *a, **k: None
    accel._install(R.BODIES)
    found = accel.overrides.check(u)
    assert found is not None and "mid_block.forward_orig" in found.around


def test_a_method_set_on_a_class_inside_the_call_runs_there(tiny_unet, strict_graph_standin):
    """A ``forward`` set on diffusers' GEGLU class (whose module a feed-forward body computes itself)
    by code that runs inside the call, before the first region (as AnimateDiff-Evolved sets
    ``torch.nn.GroupNorm.forward`` in a diffusion-model wrapper): before, the bodies and their graphs
    skipped it (the output was the unpatched model's). Now the regions with a GEGLU run the model's own
    code with it while it is set, said once, one graph per call aside; restored, compiled again."""
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    cls = type(_geglu(u))
    planned = cls.forward

    def half(self, *a, **k):
        return planned(self, *a, **k) * 0.5

    def setting(module, args):      # (a forward pre-hook on the root: it runs inside the call)
        cls.forward = half
    for s in range(3):
        _close(_sample(u, s), _sample(ref, s))
    feedforward = sum(r.kind == "feedforward" for r in accel.plan.regions)
    captured = accel.call_graphs.graphs.stats["captured"]
    hooks = [m.register_forward_pre_hook(setting) for m in (u, ref)]
    try:
        for s in range(3, 7):
            _close(_sample(u, s), _sample(ref, s))
    finally:
        cls.forward = planned
        for h in hooks:
            h.remove()
    assert feedforward and accel.stats["region_eager_overridden"] == 4 * feedforward, accel.stats
    text = accel.text()
    assert f"another node set {cls.__module__}.GEGLU.forward: {feedforward} regions run the model's own code" \
        in text, text      # (one line for them all)
    for s in range(7, 10):
        _close(_sample(u, s), _sample(ref, s))
    assert accel.stats["region_eager_overridden"] == 4 * feedforward
    assert accel.call_graphs.graphs.stats["replays"] > 0 and accel.call_graphs.graphs.stats["captured"] == captured


def test_a_method_set_on_a_class_around_the_regions_is_never_frozen_in_one_graph(tiny_unet, strict_graph_standin):
    """A method set on the class of a module around the regions (diffusers' ``TimestepEmbedding``)
    after one graph per call was captured: before, the replay froze the planned code. Now the call
    goes region by region while it is set, == the reference; restored, the graph replays again."""
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    cls = type(u.time_embedding)
    planned = cls.forward
    for s in range(3):
        _close(_sample(u, s), _sample(ref, s))
    replays = accel.call_graphs.graphs.stats["replays"]
    cls.forward = lambda self, *a, **k: planned(self, *a, **k) * 0.5
    try:
        for s in range(3, 6):
            _close(_sample(u, s), _sample(ref, s))
    finally:
        cls.forward = planned
    assert accel.call_graphs.graphs.stats["replays"] == replays
    assert "another node set diffusers.models.embeddings.TimestepEmbedding.forward: it runs as set" in accel.text()
    for s in range(6, 8):
        _close(_sample(u, s), _sample(ref, s))
    assert accel.call_graphs.graphs.stats["replays"] == replays + 2


def test_a_method_set_on_a_class_before_compiling_is_seen(tiny_unet, strict_graph_standin):
    """A method another pack set on a class at import, before the model was compiled (not written in
    the class's body): the regions with a module of that class run the model's own code every call,
    == the reference; a decorated method written in its class is the model's (a decorator is unwrapped:
    a patch made with ``functools.wraps`` of the method it replaces reads as written there)."""
    with _geglu_set(0.5) as (GEGLU, _, half):
        u, ref = tiny_unet(), tiny_unet()
        accel = _diffusers(u, strict_graph_standin())
        for s in range(3):
            _close(_sample(u, s), _sample(ref, s))
        feedforward = sum(r.kind == "feedforward" for r in accel.plan.regions)
        assert feedforward and accel.stats["region_eager_overridden"] == 3 * feedforward

    class Own(torch.nn.Module):
        @property
        def scale(self):
            return 1

        @torch.no_grad()   # (a decorator from elsewhere: what it wraps was written here)
        def forward(self, x):
            return x
    from unet_compiler.compiler.overrides import written_in
    assert written_in(Own, vars(Own)["forward"]) and written_in(Own, vars(Own)["scale"])
    assert not written_in(GEGLU, half)


def test_the_real_models_classes_hold_their_own_methods(tiny_unet, strict_graph_standin):
    """No method of a diffusers UNet's classes counts as set by another node (nothing found)."""
    u = tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    assert accel.overrides.check_classes() is None
    assert len(accel.overrides._cls_slots) > 20


def test_a_method_set_on_the_attention_processors_class_runs(tiny_unet, strict_graph_standin):
    """``AttnProcessor2_0.__call__`` set on its class after compiling (the processor an attention body
    stands in for): before, the bodies kept computing the planned processor. Now the attention regions
    run the model's own code with it while it is set."""
    from diffusers.models.attention_processor import AttnProcessor2_0
    u, ref = tiny_unet(), tiny_unet()
    accel = _diffusers(u, strict_graph_standin())
    for s in range(2):
        _close(_sample(u, s), _sample(ref, s))
    planned = AttnProcessor2_0.__call__
    AttnProcessor2_0.__call__ = lambda self, *a, **k: planned(self, *a, **k) * 0.5
    try:
        for s in range(2, 5):
            _close(_sample(u, s), _sample(ref, s))
    finally:
        AttnProcessor2_0.__call__ = planned
    attention = sum(r.kind == "attention" for r in accel.plan.regions)
    assert attention and accel.stats["region_eager_overridden"] == 3 * attention


def test_a_method_set_when_planned_then_restored_is_the_models_own(tiny_unet, strict_graph_standin):
    """Planned while another module's ``GEGLU.forward`` was set (a compile inside another pack's
    wrapper): found while it is set; the class's own method back, it is the model's own again and
    the other module's function is let go. Before, the restored method was found for good (the
    regions on the model's own code every call). A method set for many calls is judged once."""
    import weakref

    from unet_compiler.compiler.overrides import Found, Overrides
    with _geglu_set(0.5) as (GEGLU, planned, half):
        u, ref = tiny_unet(), tiny_unet()
        accel = _diffusers(u, strict_graph_standin())
        assert accel.overrides.check_classes() is not None
    gone = weakref.ref(half)
    del half
    assert accel.overrides.check_classes() is None and accel.overrides.check_classes() is None
    assert gone() is None, "the other module's function is let go"
    for s in range(2):
        _close(_sample(u, s), _sample(ref, s))
    assert accel.stats["region_eager_overridden"] == 0
    judged = []
    real = Overrides._find_classes

    def counting(self):
        judged.append(1)
        return real(self)
    GEGLU.forward = lambda self, *a, **k: planned(self, *a, **k)
    try:
        Overrides._find_classes = counting
        assert accel.overrides.check_classes() is accel.overrides.check_classes() is not None
    finally:
        Overrides._find_classes = real
        GEGLU.forward = planned
    assert judged == [1]
    assert Found(classes="a class method").moving      # (the regions' graphs check their weights)


def test_reachable_ends_on_a_wrapped_chain_that_loops():
    """A function whose ``__wrapped__`` chain loops (a mock, a careless decorator): the names its
    code reaches are found and the walk ends. Before, it never ended (a hang inside the UNet call)."""
    import threading

    from unet_compiler.compiler.overrides import reachable

    def forward(self, x):
        return self.norm(x)
    forward.__wrapped__ = forward
    out = []
    t = threading.Thread(target=lambda: out.append(reachable([{"forward": forward}], {"forward"})), daemon=True)
    t.start()
    t.join(10)
    assert out and "norm" in out[0]


def test_only_the_classs_own_method_is_planned_again(tiny_unet, strict_graph_standin):
    """Planned while another module's ``GEGLU.forward`` was set: a later patch made with
    ``functools.wraps`` of the class's method (which reads as written in the class) is still another
    node's, the regions on the model's own code with it (a review found it taken for the class's
    own: 0.34-0.42 off); the class's own method back, with another method added beside it in the
    same step and then removed, is planned again (before: found for good)."""
    import functools
    with _geglu_set(0.5) as (GEGLU, planned, _):
        @functools.wraps(planned)
        def third(self, *a, **k):
            return planned(self, *a, **k) * 3.0
        u, ref = tiny_unet(), tiny_unet()
        accel = _diffusers(u, strict_graph_standin())
        o = accel.overrides
        GEGLU.forward = third
        assert o.check_classes() is not None
        for s in range(2):
            _close(_sample(u, s), _sample(ref, s))
        feedforward = sum(r.kind == "feedforward" for r in accel.plan.regions)
        assert accel.stats["region_eager_overridden"] == 2 * feedforward
        GEGLU.forward = planned
        GEGLU.chunk = lambda self, *a: None      # (a code key in reach: GEGLU's forward calls chunk)
        try:
            assert o.check_classes() is not None
        finally:
            del GEGLU.chunk
        assert o.check_classes() is None and o.check_classes() is None


def test_a_method_set_for_a_while_is_let_go_when_restored(tiny_unet, strict_graph_standin):
    """A method another node set at run time, then restored: nothing of it is kept (its closure,
    AnimateDiff-Evolved's parameters, freed). Before, the last finding held it."""
    import gc
    import weakref

    from diffusers.models.activations import GEGLU
    planned = GEGLU.forward
    u = tiny_unet()
    accel = _diffusers(u, strict_graph_standin())

    class State:
        pass
    state = State()

    def make(held):
        def hack(self, *a, **k):
            assert held is not None
            return planned(self, *a, **k)
        return hack
    GEGLU.forward = make(state)
    try:
        assert accel.overrides.check_classes() is not None
    finally:
        GEGLU.forward = planned
    assert accel.overrides.check_classes() is None
    gone = weakref.ref(state)
    del state
    gc.collect()
    assert gone() is None


def test_a_method_planned_again_brings_what_its_code_reaches(tiny_unet, strict_graph_standin):
    """Planned while another module's ``GEGLU.forward`` was set (whose code reaches none of GEGLU's
    other methods), then the class's own back: what its code reaches is watched from then on, so
    ``GEGLU.gelu`` set after is found, == the reference (a review: 0.34 off, the reach kept from the
    other module's method)."""
    import torch.nn.functional as F  # noqa: N812
    with _geglu_set(0.5) as (GEGLU, planned, _):
        u, ref = tiny_unet(), tiny_unet()
        accel = _diffusers(u, strict_graph_standin())
    assert accel.overrides.check_classes() is None
    own = GEGLU.gelu
    GEGLU.gelu = lambda self, gate: F.gelu(gate) * 3
    try:
        assert accel.overrides.check_classes() is not None
        for s in range(2):
            _close(_sample(u, s), _sample(ref, s))
    finally:
        GEGLU.gelu = own


def test_a_decorated_own_method_back_is_planned_again(tiny_unet, strict_graph_standin):
    """diffusers' ``UNet2DConditionModel.forward`` is wrapped by its own decorator (``apply_lora_scale``,
    with ``functools.wraps``): planned while another pack's forward was set, then restored, it is the
    model's own again and one graph per UNet call captures (a review: found for good, no graph)."""
    from diffusers import UNet2DConditionModel
    planned = UNet2DConditionModel.forward

    def other(self, *a, **k):
        return planned(self, *a, **k)
    UNet2DConditionModel.forward = other
    try:
        u = tiny_unet()
        accel = _diffusers(u, strict_graph_standin())
        assert accel.overrides.check_classes() is not None
    finally:
        UNet2DConditionModel.forward = planned
    assert accel.overrides.check_classes() is None and accel.overrides.check_classes() is None
    for s in range(3):
        _sample(u, s)
    assert accel.call_graphs.graphs.stats["captured"] == 1


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = torch.nn.GroupNorm(2, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.norm(x))


class _Root(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = _Block()

    def forward(self, x):
        return self.b(x)


def test_wrappers_that_run_code_around_a_method_are_anothers():
    """Where another module's method was when planned: ``torch.autocast(...)`` or a node's context
    decorator over the class's own method is still another node's code (a review: taken for the
    class's own, the compiled regions left the autocast out); the plain own method back is the
    model's. A patch object that compares equal to the method it wraps (wrapt's proxies) is found."""
    import contextlib

    class Node(contextlib.ContextDecorator):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Proxy:   # (what wrapt.wrap_function_wrapper sets: == the function it wraps)
        __hash__ = None

        def __init__(self, f):
            self.__wrapped__ = f

        def __eq__(self, other):
            return self.__wrapped__ == other

        def __call__(self, *a, **k):
            return self.__wrapped__(*a, **k) * 3
    for cls, wrap in ((torch.nn.GroupNorm, torch.autocast("cpu", dtype=torch.bfloat16)), (torch.nn.Linear, Node())):
        own = cls.forward

        def other(self, x, own=own):
            return own(self, x)
        cls.forward = other
        try:
            r = _Root()
            watch = Overrides(r, [(r.b, "forward", "b")])
            assert watch.check_classes() is not None
            cls.forward = wrap(own)
            assert watch.check_classes() is not None, cls
            cls.forward = own
            assert watch.check_classes() is None
        finally:
            cls.forward = own
    r = _Root()
    watch = Overrides(r, [(r.b, "forward", "b")])
    own = _Block.forward
    _Block.forward = Proxy(own)
    try:
        assert watch.check_classes() is not None
    finally:
        _Block.forward = own
