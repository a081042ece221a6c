"""compiler/plan.py: which leaf regions of a UNet are accelerated, which are left eager and why."""
import pytest
import torch

from unet_compiler.compiler.plan import ATTENTION, FEEDFORWARD, PROJECTION, RESBLOCK, build_plan


def _paths(plan, kind):
    return {r.path for r in plan.regions if r.kind == kind}


def test_diffusers_unet_regions(tiny_unet):
    """Every ResnetBlock2D, Attention and FeedForward is a region; the free-standing convs
    (conv_in, conv_out, down/up samplers) are projections; nothing inside a region is one too."""
    u = tiny_unet()
    plan = build_plan(u)
    assert plan.family == "diffusers" and not plan.skipped
    types = {kind: {type(r.module).__name__ for r in plan.regions if r.kind == kind} for kind in
             (RESBLOCK, ATTENTION, FEEDFORWARD, PROJECTION)}
    assert types == {RESBLOCK: {"ResnetBlock2D"}, ATTENTION: {"Attention"}, FEEDFORWARD: {"FeedForward"},
                     PROJECTION: {"Conv2d"}}
    n_resnets = sum(1 for m in u.modules() if type(m).__name__ == "ResnetBlock2D")
    assert len(_paths(plan, RESBLOCK)) == n_resnets
    assert {"conv_in", "conv_out"} <= _paths(plan, PROJECTION)
    inside = {id(m) for r in plan.regions if r.kind != PROJECTION for m in r.module.modules()}
    assert not any(id(r.module) in inside for r in plan.regions if r.kind == PROJECTION)
    assert all(r.hook == "forward" and r.leaves for r in plan.regions if r.kind != PROJECTION)


def test_diffusers_variants_are_left_eager_with_the_reason(tiny_unet):
    u = tiny_unet(resnet_time_scale_shift="scale_shift")
    attn = next(m for m in u.modules() if type(m).__name__ == "Attention")

    class CustomProcessor:  # e.g. an IP-Adapter processor
        def __call__(self, attn, hidden_states, *args, **kwargs):
            return hidden_states
    attn.set_processor(CustomProcessor())
    plan = build_plan(u)
    assert not _paths(plan, RESBLOCK)
    why = {(k, reason) for k, _, reason in plan.skipped}
    assert (RESBLOCK, "ResnetBlock2D variant (scale-shift / up-down) not admitted") in why
    assert (ATTENTION, "custom attention processor CustomProcessor (e.g. IP-Adapter) runs as given") in why
    assert len(_paths(plan, ATTENTION)) == sum(1 for m in u.modules() if type(m).__name__ == "Attention") - 1
    summary = plan.skipped_summary()
    assert (ATTENTION, 1, "custom attention processor CustomProcessor (e.g. IP-Adapter) runs as given") in summary


def test_not_a_unet_is_refused_by_name():
    with pytest.raises(TypeError, match="torch.nn.modules.linear.Linear is not a supported UNet"):
        build_plan(torch.nn.Linear(2, 2))
