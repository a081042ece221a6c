"""The per-call gate of each region kind: which calls may run the region's compiled code."""
from __future__ import annotations

import inspect

import torch

from . import cast
from . import plan as P

#: the inputs of a DiT block body, in order (the rest of the block's call must be at its defaults)
DIT_INPUTS = {P.DOUBLE_BLOCK: ("img", "txt", "vec", "pe"), P.SINGLE_BLOCK: ("x", "vec", "pe"),
              P.QWEN_IMAGE_BLOCK: ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb"),
              P.WAN_BLOCK: ("x", "e", "freqs", "context"),
              P.JOINT_BLOCK: ("context", "x", "c"),
              P.LUMINA_BLOCK: ("x", "freqs_cis", "adaln_input")}
#: arguments a block takes that its computation does not read (Qwen-Image's attention ignores the
#: text mask ComfyUI hands the block): any value is served
DIT_UNREAD = {P.QWEN_IMAGE_BLOCK: ("encoder_hidden_states_mask",), P.JOINT_BLOCK: ("use_checkpoint",)}


def make_shim(region, impl, run, stats, failed, cast_eager, cast_refused=None):
    """The callable installed as ``module.<region.hook>`` for one UNet call: a call the region's
    compiled code can serve goes to ``run()(kind, impl, module, original, args, eager_kwargs,
    casts)`` (``run``: a weak method, so the shim holds no accelerator; ``casts``: the leaves whose
    weights ComfyUI casts or patches this call, :mod:`cast`). A call with a mask, extra arguments,
    an attention override, per-call weights that cannot be cast outside the graph (or any, with
    ``cast_refused``: the backend's reason), or a kind in ``failed`` runs the model's own code
    (counted in ``stats["region_eager"]``; those for cast weights in ``stats["region_eager_cast"]``
    too, their reason in ``cast_eager[kind]``)."""
    module, kind, leaves = region.module, region.kind, region.leaves
    watched = cast.watch(leaves)
    original = getattr(type(module), region.hook)

    if kind == P.ATTENTION and region.family == "comfy":
        def shim(x, context=None, value=None, mask=None, transformer_options={}):
            if (mask is not None or kind in failed or "optimized_attention_override" in transformer_options
                    or (casts := _casts(kind, leaves, watched, stats, cast_eager, cast_refused, (x,))) is None):
                stats["region_eager"] += 1
                return original(module, x, context=context, value=value, mask=mask,
                                transformer_options=transformer_options)
            return run()(kind, impl, module, original, (x, context, value),
                         dict(context=context, value=value, mask=mask, transformer_options=transformer_options), casts)
        return shim
    if kind in DIT_INPUTS:
        return _dit_shim(module, kind, original, leaves, watched, impl, run, stats, failed, cast_eager, cast_refused)
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
        if kwargs or kind in failed or (casts := _casts(kind, leaves, watched, stats, cast_eager, cast_refused, args)) is None:
            stats["region_eager"] += 1
            return original(module, *args, **kwargs)
        return run()(kind, impl, module, original, args, None, casts)
    return shim


def _dit_shim(module, kind, original, leaves, watched, impl, run, stats, failed, cast_eager, cast_refused):
    """A DiT block's gate. ComfyUI calls these blocks by keyword; the body serves the calls
    ``_dit_inputs`` turns into its inputs, whose other arguments are at their defaults (no attention
    mask, no per-token modulation dims); ``transformer_options`` may hold anything but an attention
    override. Any other call runs the block's own forward."""
    sig = inspect.signature(original)
    self_name = next(iter(sig.parameters))
    first = DIT_INPUTS[kind][0]

    def shim(*args, **kwargs):
        try:
            bound = _explicit(sig.bind(module, *args, **kwargs).arguments, self_name, DIT_INPUTS[kind])
        except TypeError:
            bound = None
        inputs = None
        if bound is not None and kind not in failed:      # (bound: the explicit arguments by name)
            given = dict(bound)
            opts = given.pop("transformer_options", None) or {}
            for n in DIT_UNREAD.get(kind, ()):
                given.pop(n, None)
            inputs = _dit_inputs(kind, module, given)
            if (given.pop("attn_mask", None) is not None or any(v is not None for v in given.values())
                    or "optimized_attention_override" in opts):
                inputs = None
        if inputs is None or (casts := _casts(kind, leaves, watched, stats, cast_eager, cast_refused, inputs)) is None:
            stats["region_eager"] += 1
            return original(module, *args, **kwargs)
        rest = {k: v for k, v in bound.items() if k != first}      # the own forward's call, less its first input
        # contiguous copies of strided views (Wan's first block gets its tokens transposed, a patch may
        # hand a slice): their strides would be guards, another stride another variant to compile
        inputs = tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs)
        return run()(kind, impl, module, original, inputs, rest, casts)
    return shim


def _explicit(arguments: dict, self_name: str, names: tuple) -> dict | None:
    """A bound call's explicit arguments by name, less ``self``; a forward of ``*args, **kwargs``
    (MMDiT's JointBlock) has its positional ones named by ``names``, in order (None: more of them)."""
    out = {k: v for k, v in arguments.items() if k != self_name}
    if "args" in out and isinstance(out["args"], tuple) and isinstance(out.get("kwargs", {}), dict):
        positional, named = out.pop("args"), out.pop("kwargs", {})
        if len(positional) > len(names) or set(names[:len(positional)]) & set(named):
            return None
        out.update(zip(names, positional, strict=False), **named)      # (fewer positional than names)
    return out


def _dit_inputs(kind, module, given) -> tuple | None:
    """The body's inputs from a block call's explicit arguments ``given`` (what they read is popped
    from it), or None when the body does not serve this call."""
    names = DIT_INPUTS[kind]
    inputs = tuple(given.pop(n, None) for n in names)
    if kind == P.WAN_BLOCK:
        return _wan_inputs(module, given, *inputs)
    if kind == P.JOINT_BLOCK:
        return inputs if all(isinstance(t, torch.Tensor) for t in inputs) else None
    if kind == P.LUMINA_BLOCK:       # no mask (a padded prompt's, in the context refiner: its own code)
        x, freqs, adaln = inputs
        ok = (given.pop("x_mask", None) is None and isinstance(x, torch.Tensor) and isinstance(freqs, torch.Tensor)
              and (adaln is None) == (not module.modulation) and (adaln is None or isinstance(adaln, torch.Tensor)))
        return inputs if ok else None
    handed = None if isinstance(inputs[-2], torch.Tensor) else _handed(kind, inputs[-2])
    if handed is not None:          # modulation handed to the block: vec None, its tensors after pe
        inputs = (*inputs[:-2], None, inputs[-1], *handed)
    if (not all(isinstance(t, torch.Tensor) for t in inputs[:len(names) - 2])
            or (inputs[len(names) - 2] is None and handed is None)
            or not (inputs[len(names) - 1] is None or isinstance(inputs[len(names) - 1], torch.Tensor))):
        return None
    return inputs


def _wan_inputs(module, given, x, e, freqs, context) -> tuple | None:
    """A Wan block's inputs (x, e, freqs, context, context_img): an image-to-video block's context
    split at ``context_img_len`` as its cross-attention splits it. None for modulation rows that do
    not divide the tokens (``repeat_e`` then cuts its last frame short: the block's own code)."""
    n_img = given.pop("context_img_len", 257)
    if not all(isinstance(t, torch.Tensor) for t in (x, e, freqs, context)) or x.dim() != 3:
        return None
    if e.ndim >= 4 and x.shape[1] % e.shape[1]:
        return None
    if hasattr(module.cross_attn, "k_img"):           # WanI2VCrossAttention (the planner checked the class)
        return x, e, freqs, context[:, n_img:], context[:, :n_img]
    return x, e, freqs, context, None


def _handed(kind, vec) -> tuple | None:
    """The tensors of modulation handed to a DiT block instead of its ``vec`` (Flux.2's global
    modulation, Chroma's distilled one): a double block's ((img1, img2), (txt1, txt2)), a single
    block's one, each with ``shift``, ``scale`` and ``gate``; flattened in that order. None when
    ``vec`` is not that."""
    def parts(m):
        out = tuple(getattr(m, a, None) for a in ("shift", "scale", "gate"))
        return out if all(isinstance(t, torch.Tensor) for t in out) else None
    if kind not in (P.DOUBLE_BLOCK, P.SINGLE_BLOCK):
        return None
    try:
        mods = [parts(vec)] if kind == P.SINGLE_BLOCK else [parts(m) for pair in vec for m in pair]
    except TypeError:
        return None
    if (kind == P.DOUBLE_BLOCK and len(mods) != 4) or any(m is None for m in mods):
        return None
    return tuple(t for m in mods for t in m)


def _casts(kind, leaves, watched, stats, cast_eager, refused, args):
    """The leaves whose weights ComfyUI (or another pack's ops, by their own cast) casts or patches
    this call on ``args`` (fp8 or another storage dtype, a partial load, weight functions, GGUF's
    dequantisation), or None when the region must run the model's own code for them: counted, with
    the reason kept per kind for the report. ``watched``: ``cast.watch(leaves)``, the per-call check
    that finds none (most calls) without planning."""
    if cast.idle(watched):
        return ()
    todo, why = cast.plan(leaves, args)
    if todo and refused:
        why = refused
    if why is None:
        return todo
    stats["region_eager_cast"] += 1
    cast_eager.setdefault(kind, why)
    return None
