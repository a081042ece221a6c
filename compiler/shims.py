"""The per-call gate of each region kind: which calls may run the region's compiled code."""
from __future__ import annotations

from . import plan as P
from .compat import comfy as comfy_compat


def make_shim(region, impl, run, stats, failed):
    """The callable installed as ``module.<region.hook>`` for one UNet call: a call the region's
    compiled code can serve goes to ``run()(kind, impl, module, original, args, eager_kwargs)``
    (``run``: a weak method, so the shim holds no accelerator); a call with a mask, extra
    arguments, an attention override, weights ComfyUI casts or patches per call, or a kind in
    ``failed`` runs the model's own code (counted in ``stats["region_eager"]``; those for cast
    weights in ``stats["region_eager_cast"]`` too)."""
    module, kind, leaves = region.module, region.kind, region.leaves
    original = getattr(type(module), region.hook)

    if kind == P.ATTENTION and region.family == "comfy":
        def shim(x, context=None, value=None, mask=None, transformer_options={}):
            if (mask is not None or kind in failed or "optimized_attention_override" in transformer_options
                    or _cast_per_call(leaves, stats)):
                stats["region_eager"] += 1
                return original(module, x, context=context, value=value, mask=mask,
                                transformer_options=transformer_options)
            return run()(kind, impl, module, original, (x, context, value),
                             dict(context=context, value=value, mask=mask, transformer_options=transformer_options))
        return shim
    if kind == P.ATTENTION:
        def shim(hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
            if attention_mask is not None or kw or kind in failed or hidden_states.dim() != 3:
                stats["region_eager"] += 1
                return original(module, hidden_states, encoder_hidden_states, attention_mask, **kw)
            return run()(kind, impl, module, original, (hidden_states, encoder_hidden_states),
                             dict(encoder_hidden_states=encoder_hidden_states))
        return shim

    def shim(*args, **kwargs):
        if kwargs.get("scale", 0) in (None, 1.0):
            # diffusers < 0.26 passes its LoRA scale (resnet(h, temb, scale=1.0)); 1.0 is the default
            kwargs = {k: v for k, v in kwargs.items() if k != "scale"}
        if kwargs or kind in failed or _cast_per_call(leaves, stats):
            stats["region_eager"] += 1
            return original(module, *args, **kwargs)
        return run()(kind, impl, module, original, args, None)
    return shim


def _cast_per_call(leaves, stats) -> bool:
    """Whether ComfyUI casts or patches a leaf's weights per call (fp8 or another storage dtype, a
    partial load, hook patches): counted, so the report can name why the region ran eager."""
    if any(comfy_compat.has_cast_weights(m) for m in leaves):
        stats["region_eager_cast"] += 1
        return True
    return False
