"""Weights ComfyUI casts or patches per call, served by compiled regions.

ComfyUI's ops (``comfy.ops``) cast a leaf's weight on every call when its storage dtype or device
is not the compute one (fp8 or fp16/bf16 storage, a partial load, a mixed-precision linear that
dequantizes) and patch it per call through ``weight_function`` / ``bias_function`` (a LoRA on the
weights a partial load left offloaded, weight wrappers). A region whose leaves do that runs
its compiled code this way: ComfyUI's own ``cast_bias_weight`` runs for each such leaf outside the
graph (its arithmetic, its functions, its offload stream), and the leaf shows the result as a plain
weight for the call (:func:`applied`). The compiled graph is then the one a plain model runs: no
variant per storage dtype, LoRA strength, keyframe or partial-load split.

Another pack's ops whose per-call weights come from a cast method of their own (``cast_bias_weight``
on the leaf, as ComfyUI-GGUF's dequantising ops: its dequantisation and its LoRA patches) are
served the same way, with that method as the cast: once per leaf, compute dtype and patch state,
the leaf's own per-call forward on a small probe is checked against the plain op on its own cast
(:func:`plan` with the call's inputs) and a leaf that differs runs its own code. Any other per-call
weights (fp8 matmul ops, quantized matmuls, ops with arithmetic of their own) are :func:`plan`'s
reason: the region runs the model's own code and the report names it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
import threading
import weakref
from collections import Counter

import torch

from .compat import comfy as comfy_compat
from .overrides import OWN
from .reasons import Reason, error_summary

#: the leaf attributes that make ComfyUI's forward take its cast path, and the values that don't
_PLAIN = (("comfy_cast_weights", False), ("_full_precision_mm", False), ("layout_type", None))
_MISSING = object()
#: region modules whose leaves show cast weights now (a sampling thread), by id, with how many calls
#: show them (several sampling threads, one per GPU, may at once)
_BUSY: Counter = Counter()
_ALL = -1                        # in _BUSY: every leaf of a model shows them (a whole call's resident slots)
_BUSY_LOCK = threading.Lock()


def _busy_add(key: int) -> None:
    with _BUSY_LOCK:
        _BUSY[key] += 1


def _busy_end(key: int) -> None:
    with _BUSY_LOCK:
        _BUSY[key] -= 1
        if _BUSY[key] <= 0:
            del _BUSY[key]
#: per own-cast leaf: {(dtype, device, weight functions?, bias functions?): None (checked) or the Reason it failed}
_OWN_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ops():
    return sys.modules.get("comfy.ops")


def _stock(fn, ops) -> bool:
    """``fn`` (a leaf class's ``forward_comfy_cast_weights``) is ComfyUI's: cast, then the plain op."""
    qual = getattr(fn, "__qualname__", "")
    return (getattr(fn, "__module__", None) == ops.__name__
            and (qual.startswith("disable_weight_init.") or qual.startswith("mixed_precision_ops.")))


def per_call(leaf) -> bool:
    """Whether ComfyUI makes ``leaf``'s weights per call: cast or patched (``has_cast_weights``), or a
    mixed-precision leaf that dequantizes them (``_full_precision_mm``: no quantized matmul here)."""
    # instance attributes (MixedPrecisionOps sets them per leaf): read from __dict__, no __getattr__ miss
    return comfy_compat.has_cast_weights(leaf) or bool(leaf.__dict__.get("_full_precision_mm", False))


def _has_weights(leaf) -> bool:
    return getattr(leaf, "weight", None) is not None or getattr(leaf, "bias", None) is not None


def quantized(leaf) -> bool:
    """A ComfyUI mixed-precision leaf that multiplies in its quantized format: its weights are not
    dequantized per call (``_full_precision_mm``), not patched per call (weight functions, a forced
    cast) and, where its forward still honours it (ComfyUI 0.8.0: a partial load), not flagged
    ``comfy_cast_weights``. Forwards since Dynamic VRAM (February 2026), which sets it on every op,
    ignore that flag."""
    d = leaf.__dict__
    if d.get("layout_type") is None or getattr(leaf, "_full_precision_mm", False):
        return False
    if getattr(leaf, "weight_function", None) or getattr(leaf, "bias_function", None):
        return False
    if getattr(leaf, "comfy_force_cast_weights", False):
        return False
    return not (getattr(leaf, "comfy_cast_weights", False) and _honours_cast_flag(type(leaf).forward))


@functools.lru_cache(maxsize=None)
def _honours_cast_flag(forward) -> bool:
    """Whether a mixed-precision ``forward`` reads ``comfy_cast_weights`` (ComfyUI 0.8.0 dequantizes
    then; the newer ``_use_quantized`` reads only ``comfy_force_cast_weights``)."""
    code = getattr(forward, "__code__", None)
    return code is None or "comfy_cast_weights" in code.co_names or "comfy_cast_weights" in code.co_consts


def _other_ops(name: str) -> Reason:
    return Reason(f"weights made per call by another pack's ops ({name}), whose arithmetic is its own",
                  "none needed for correctness; to compile them, load the model with ComfyUI's own loaders")


def why_not(leaf) -> Reason | None:
    """Why ``leaf``'s per-call weights cannot be served by casting outside the graph (None: they can):
    what its class decides (once per class, :func:`_op_kind`), and a forward set on the leaf itself."""
    ops = _ops()
    cls = type(leaf)
    d = leaf.__dict__
    own = d.get("forward")
    if "forward_comfy_cast_weights" in d or (own is not None and not getattr(own, OWN, False)):
        # a forward set on the op itself, not its class's (a region's shim, the pack's own, aside)
        return Reason(f"a forward another pack set on one op ({comfy_compat.class_name(cls)}), which the cast "
                      f"weights shown to the region would bypass", "none needed: the model's own code runs that region")
    fn = getattr(cls, "forward_comfy_cast_weights", None)
    kind = _op_kind(cls, ops, cls.forward, fn)
    if kind == "foreign":
        return _other_ops(comfy_compat.class_name(cls))
    if quantized(leaf):
        return Reason(f"quantized matmul ({getattr(leaf, 'quant_format', None) or leaf.layout_type}): ComfyUI's "
                      f"own kernel runs it", "none needed: that matmul is ComfyUI's fast path")
    if kind == "fp8":
        return Reason("fp8 matmul (weight_dtype fp8_e4m3fn_fast): ComfyUI's scaled fp8 matmul runs it",
                      "to compile these regions, load with weight_dtype fp8_e4m3fn (same storage, cast per call)")
    if kind == "own":
        return next((why for why in _OWN_CHECKED.get(leaf, {}).values() if why is not None), None)
    return _other_ops(comfy_compat.class_name(cls)) if kind == "other" else None


@functools.lru_cache(maxsize=None)
def _op_kind(cls, ops, forward, fn) -> str:
    """What :func:`why_not` knows of a leaf from its class alone (and ComfyUI's ``ops`` module, the
    class's ``forward`` and ``forward_comfy_cast_weights`` ``fn``, so a method patched later is a new
    entry): "foreign" (not a ComfyUI cast op), "fp8" (the scaled fp8 matmul), "own" (a cast method of
    its own: :func:`own_cast`), "other" (another pack's forward) or "stock" (ComfyUI's cast, then the
    plain op)."""
    if ops is None or not isinstance(cls, type) or not issubclass(cls, getattr(ops, "CastWeightBiasOp", ())):
        return "foreign"
    if getattr(ops, "fp8_ops", None) is not None and fn is getattr(ops.fp8_ops.Linear, "forward_comfy_cast_weights", 0):
        return "fp8"
    if fn is not None and own_cast(cls):
        return "own"
    if fn is None or not _stock(fn, ops) or getattr(forward, "__module__", None) != ops.__name__:
        return "other"
    return "stock"


@functools.lru_cache(maxsize=None)
def own_cast(cls) -> bool:
    """Whether ``cls`` (a ComfyUI op class: its ``forward``) takes its per-call weights from a cast
    method of its own, ``cls.cast_bias_weight(leaf, input, dtype=, device=, bias_dtype=) -> (weight,
    bias)`` (ComfyUI-GGUF's ``GGMLLayer``: dequantisation and LoRA patches), in its own
    ``forward_comfy_cast_weights``; a leaf kind :func:`_probe` can check (linear, conv, norms)."""
    ops = _ops()
    fn = getattr(cls, "cast_bias_weight", None)
    if (ops is None or not callable(fn) or getattr(fn, "__module__", None) == ops.__name__
            or getattr(cls.forward, "__module__", None) != ops.__name__
            or _stock(getattr(cls, "forward_comfy_cast_weights", None), ops)):
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return ({"input", "dtype", "device", "bias_dtype"} <= set(params)
            and issubclass(cls, (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.GroupNorm,
                                 torch.nn.LayerNorm)))


def own_cast_ops(leaves) -> list[str]:
    """The op classes (module.qualname) among ``leaves`` whose per-call weights come from their own
    cast (:func:`own_cast`) and passed its check: what the report names."""
    names = {comfy_compat.class_name(type(m)) for m in leaves
             if per_call(m) and own_cast(type(m)) and _OWN_CHECKED.get(m)
             and all(why is None for why in _OWN_CHECKED[m].values())}
    return sorted(names)


def _probe(leaf, dtype, device) -> torch.Tensor | None:
    """A small input ``leaf`` (linear, conv, group or layer norm) takes: one row, one kernel window."""
    if isinstance(leaf, torch.nn.Linear):
        shape = (2, leaf.in_features)
    elif isinstance(leaf, torch.nn.modules.conv._ConvNd):
        shape = (1, leaf.in_channels, *(d * (k - 1) + 1 for k, d in zip(leaf.kernel_size, leaf.dilation, strict=True)))
    elif isinstance(leaf, torch.nn.GroupNorm):
        shape = (1, leaf.num_channels, 2, 2)
    elif isinstance(leaf, torch.nn.LayerNorm):
        shape = (2, *leaf.normalized_shape)
    else:
        return None
    g = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


#: how many ulps of :func:`_scale` an own forward may differ from the plain op: oneDNN's conv
#: algorithms (Winograd among them) round differently; the same products of a 1280-wide 3x3 conv
#: summed per half of the channels differed by 12 ulps of their sum (1.4e-6 of it)
OWN_ULPS = 32


def _scale(leaf, x, w, b, out) -> float:
    """The size rounding is relative to in ``leaf``'s result on ``x``: per output, the sum of the
    absolute products a linear or conv adds up; a norm's result itself."""
    b_abs = None if b is None else b.abs()
    if isinstance(leaf, torch.nn.Linear):
        return float(torch.nn.functional.linear(x.abs(), w.abs(), b_abs).max()) + 1.0
    if isinstance(leaf, torch.nn.modules.conv._ConvNd) and not leaf.transposed and hasattr(leaf, "_conv_forward"):
        return float(leaf._conv_forward(x.abs(), w.abs(), b_abs).max()) + 1.0
    return float(out.abs().max()) + 1.0


def _check_own(leaf, dtype, device) -> Reason | None:
    """Whether ``leaf``'s own per-call forward is the plain op on its own cast (for this compute dtype
    and device, with or without weight functions), checked once on a probe: its forward's result
    against the plain forward's on its cast weights (the same arithmetic: equal to ``OWN_ULPS`` ulps of
    the sums it adds up, :func:`_scale`)."""
    key = (dtype, device, bool(getattr(leaf, "weight_function", None)), bool(getattr(leaf, "bias_function", None)))
    seen = _OWN_CHECKED.setdefault(leaf, {})
    if key in seen:
        return seen[key]
    cls = type(leaf)
    stored = getattr(getattr(leaf, "weight", None), "tensor_type", None)     # GGUF's quant type, where it says
    name = comfy_compat.class_name(cls) + (f", weights {getattr(stored, 'name', stored)}" if stored else "")
    why = None
    try:
        with torch.inference_mode():
            x = _probe(leaf, dtype, device)
            own = torch.Tensor(leaf.forward_comfy_cast_weights(x))
            w, b, _ = _cast(leaf, dtype, device)
            saved = _show(leaf, w, b)
            try:
                plain = leaf(x)
            finally:
                _restore(saved)
            scale = _scale(leaf, x, w, b, own)
        if own.shape != plain.shape or not float((own.float() - plain.float()).abs().max()) <= (
                OWN_ULPS * torch.finfo(dtype).eps * scale):
            why = Reason(f"weights made per call by another pack's ops ({name}): its forward is not the plain "
                         f"op on its own cast", "none needed for correctness: its regions run its own code")
    except Exception as e:    # a cast or forward this check cannot call: the leaf's own code runs
        why = Reason(f"weights made per call by another pack's ops ({name}), whose cast could not be "
                     f"checked on a probe ({error_summary(e)})",
                     "none needed for correctness: its regions run its own code")
    seen[key] = why
    return why


def watch(leaves) -> tuple:
    """What :func:`none_per_call` reads per call for ``leaves``: each leaf, its class and the cast flags that
    class defines (the flags' values, the leaf's class and its instance attributes are read live)."""
    return tuple((leaf, type(leaf), comfy_compat.cast_flags_of(type(leaf))) for leaf in leaves)


def none_per_call(watched) -> bool:
    """True when no watched leaf's weights are made per call now (no cast flag, weight or bias
    function, dequantizing or quantized leaf) and each leaf keeps the class it was watched with:
    :func:`plan` would find nothing to cast. A few dict reads a leaf, for every call of a region;
    False sends the call to :func:`plan` (a leaf whose class another pack swapped, too)."""
    for leaf, cls, on_class in watched:
        if leaf.__class__ is not cls:
            return False
        d = leaf.__dict__
        if d.get("layout_type") is not None or d.get("_full_precision_mm"):
            return False
        for name in comfy_compat.CAST_FLAGS:
            if (d[name] if name in d else name in on_class and getattr(cls, name)):
                return False
    return True


def plan(leaves, args=None) -> tuple[tuple, Reason | None]:
    """The leaves of a region whose weights ComfyUI casts or patches this call, and the reason the
    region must run the model's own code instead (None: casting them outside serves it). With the
    call's ``args``, leaves whose ops cast by a method of their own are checked for this call's
    compute dtype first (:func:`own_cast`; once per leaf and patch state)."""
    todo, compute = [], None if args is None else compute_of(args)
    for m in leaves:
        if per_call(m) and not _has_weights(m):
            continue        # nothing to cast (a LayerNorm without affine weights: Flux's, fp8 or not)
        if per_call(m):
            why = why_not(m)
            if why is None and compute is not None and own_cast(type(m)):
                why = _check_own(m, *compute)
            if why:
                return (), why
            todo.append(m)
        elif quantized(m):
            return (), why_not(m)
    return tuple(todo), None


def compute_of(args) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device a region's weights are cast to: its first tensor input's (ComfyUI casts
    to each op's input, which in the plain UNet blocks is the block input's dtype and device)."""
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return None if t is None else (t.dtype, t.device)


def _cast(leaf, dtype, device):
    """ComfyUI's cast of ``leaf``'s weight and bias: (weight, bias, offload handle or None). On
    ComfyUI's offload stream where it has one (the handle goes to ``uncast_bias_weight`` once the
    work reading them is queued: a Dynamic VRAM slot stays pinned till then). A weight may be a
    view of a buffer the next cast reuses (Dynamic VRAM's per-stream cast buffer, newer ComfyUI's
    offload cast buffers): read it before another cast, or hold it (:func:`_held`)."""
    ops = _ops()
    if own_cast(type(leaf)):
        # another pack's own cast (its dequantisation and patches): a plain tensor of the compute dtype
        w, b = leaf.cast_bias_weight(None, dtype=dtype, device=device, bias_dtype=dtype)
        return _plain(w), _plain(b), None
    if _takes_offloadable(ops.cast_bias_weight):
        w, b, handle = ops.cast_bias_weight(leaf, None, dtype=dtype, device=device, bias_dtype=dtype, offloadable=True)
    else:
        (w, b), handle = ops.cast_bias_weight(leaf, None, dtype=dtype, device=device, bias_dtype=dtype), None
    if type(w).__name__ == "QuantizedTensor":
        # a mixed-precision leaf that dequantizes per call gets its QuantizedTensor back from the cast;
        # its forward multiplies by the dequantized weight (newer ComfyUI dequantizes it there)
        w = w.dequantize()
    return w, b, handle


def _streams(leaf, device) -> bool:
    """Whether ``leaf``'s weights come from memory off the compute ``device`` for its next cast, as
    they stand: a Dynamic VRAM leaf whose VBAR slot held no room at its last fault (ComfyUI leaves
    its ``_v_signature`` None then, and after a patch change), or a leaf whose stored weight is on
    another device (a classic partial load)."""
    d = leaf.__dict__
    if "_v" in d:
        return d.get("_v_signature") is None
    w = leaf._parameters.get("weight")
    return w is not None and w.device != device


def streams(leaves, args) -> bool:
    """Whether any of ``leaves`` (a region's, from :func:`plan`) streams its weights this call on
    ``args`` (:func:`_streams`, read before any cast: a few dict reads a leaf). Such a region is
    run op by op, each op casting its own weights where it runs (ComfyUI's order, on its offload
    streams), never all of them up front (:func:`applied`)."""
    device = compute_of(args)[1]
    return any(_streams(leaf, device) for leaf in leaves)


def _resident(leaf, t, name) -> bool:
    """``t`` (a cast weight of ``leaf``) is the leaf's own parameter or its VBAR slot's view (``_v_weight`` /
    ``_v_bias``): memory that stays where it is between calls (absent counts)."""
    return t is None or t is leaf.__dict__.get(f"_v_{name}") or t is leaf._parameters.get(name)


def _plain(t):
    """``t`` as a plain tensor (another pack's tensor subclass, as GGUF's, stays out of the graph)."""
    return t if t is None or type(t) in (torch.Tensor, torch.nn.Parameter) else t.as_subclass(torch.Tensor)


def _held(leaf, t, name, fresh_views: bool, stats: Counter):
    """``t`` (a cast weight of ``leaf``) or a copy of it that no later cast overwrites: the leaf's own
    parameter, its VBAR slot (pinned until uncast) and a tensor that owns its memory are kept as
    they are; a view is copied (a cast buffer the next cast reuses may be exactly one weight's
    size), unless ``fresh_views``: another pack's own cast, whose dequantized weight is a new
    tensor each call, often a reshape of one (kept when it covers its whole storage). A copy is
    counted in ``stats["cast_views_copied"]``."""
    if _resident(leaf, t, name):
        return t
    if (t._base is None or fresh_views) and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    stats["cast_views_copied"] += 1
    return t.clone()


@functools.lru_cache(maxsize=None)
def _takes_offloadable(fn) -> bool:
    """Whether this ComfyUI's ``cast_bias_weight`` takes ``offloadable`` (newer ones do)."""
    try:
        return "offloadable" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


#: id(cast tensor) -> (a weak reference to it, {(grad asked, inference mode): the Parameter shown for
#: it}), kept while the tensor lives: a resident slot's view is handed out again every call, so its
#: Parameter is made once (docs/bench.md, host time of the casts)
_SHOWN: dict = {}


def _forget(key, ref) -> None:
    if _SHOWN.get(key, (None,))[0] is ref:
        del _SHOWN[key]


def _param(t, like):
    if t is None:
        return None
    grad = bool(getattr(like, "requires_grad", False)) and t.is_floating_point()
    key = (grad, torch.is_inference_mode_enabled())
    entry = _SHOWN.get(id(t))
    if entry is not None and entry[0]() is t:
        made = entry[1]
        if key in made:
            return made[key]
    else:
        made = {}
        _SHOWN[id(t)] = (weakref.ref(t, functools.partial(_forget, id(t))), made)
    try:
        p = torch.nn.Parameter(t, requires_grad=grad)
    except RuntimeError:   # an inference tensor outside inference mode cannot require grad
        p = torch.nn.Parameter(t, requires_grad=False)
    made[key] = p
    return p


def _show(leaf, weight, bias) -> list:
    """Make ``leaf`` show ``weight``/``bias`` as plain parameters and take its plain forward; returns
    what to put back."""
    saved = []
    d, cls = leaf.__dict__, type(leaf)
    # (flags live in the instance's or its class's dict: read there, not through nn.Module.__getattr__,
    # whose miss costs more than the rest of this per-leaf, per-call step)
    for name, plain in _PLAIN:
        value = d[name] if name in d else getattr(cls, name, _MISSING)
        if value is not _MISSING and value != plain:
            saved.append((d, name, d.get(name, _MISSING)))
            d[name] = plain
    for name in ("weight_function", "bias_function"):
        if d[name] if name in d else getattr(cls, name, None):
            saved.append((d, name, d.get(name, _MISSING)))
            d[name] = []
    params = leaf._parameters
    for name, value in (("weight", weight), ("bias", bias)):
        if params.get(name) is not None:
            saved.append((params, name, params[name]))
            params[name] = _param(value, params[name])
    return saved


def _restore(saved) -> None:
    for d, name, value in reversed(saved):
        if value is _MISSING:
            d.pop(name, None)
        else:
            d[name] = value


#: what :func:`applied` yields when a leaf's cast streamed after all (nothing is shown then)
STREAMED = "streamed"


@contextlib.contextmanager
def applied(module, leaves, args, stats: Counter):
    """Inside: each of ``leaves`` (the region ``module``'s, from :func:`plan`) has ComfyUI's cast of its
    weights for this call (to the dtype and device of ``args``' first tensor). Yields ``(resident,
    show)``: ``resident`` the cast weights' addresses (``(data_ptr, dtype)`` each) when every one is
    resident (:func:`_resident`: what a CUDA graph may read in place, pinned until this block ends),
    else None, or :data:`STREAMED` when a leaf's weights streamed after all (evicted since
    :func:`streams` read them: the caller runs the region op by op, and what was cast is released
    here, counted in ``stats["cast_stopped_at_stream"]``); ``show()`` a context in which the leaves
    show the cast weights as plain parameters and take their plain forward (what the region's code
    reads; a graph's replay reads the addresses only), put back after, also on an error. For the
    thread that runs the model (the compile thread builds a :func:`stand_in` instead)."""
    dtype, device = compute_of(args)
    casts = []
    resident = True
    _busy_add(id(module))
    try:
        for leaf in leaves:
            w, b, handle = _cast(leaf, dtype, device)
            casts.append((leaf, w, b, handle))
            if _streams(leaf, device):
                stats["cast_stopped_at_stream"] += 1
                break
            # the region reads every leaf at once, after all of them were cast: views of reused buffers
            # are held (another pack's own cast hands out a new tensor each call, often a reshape of one)
            fresh = own_cast(type(leaf))
            w, b = _held(leaf, w, "weight", fresh, stats), _held(leaf, b, "bias", fresh, stats)
            casts[-1] = (leaf, w, b, handle)
            resident = resident and _resident(leaf, w, "weight") and _resident(leaf, b, "bias")
        else:
            yield ((tuple((t.data_ptr(), t.dtype) for _, w, b, _ in casts for t in (w, b) if t is not None)
                    if resident else None), functools.partial(_shown, [(leaf, w, b) for leaf, w, b, _ in casts]))
            return
        yield STREAMED, contextlib.nullcontext
    finally:
        _busy_end(id(module))
        ops = _ops()
        for leaf, w, b, handle in casts:
            if handle is not None:
                ops.uncast_bias_weight(leaf, w, b, handle)


def _vbar():
    """comfy-aimdo's VBAR functions, where the newest ComfyUI imported them (None elsewhere)."""
    return sys.modules.get("comfy_aimdo.model_vbar")


def _resident_now(leaf, dtype, device, vbar, pinned: list):
    """(weight, bias) ComfyUI's cast would hand ``leaf`` this call without a copy or an op of its
    own: a Dynamic VRAM slot still resident (faulted in and pinned here, appended to ``pinned``;
    its views ``_v_weight`` / ``_v_bias``) or the leaf's own weights on ``device``, stored in
    ``dtype``, with no weight functions; None otherwise."""
    d = leaf.__dict__
    if d.get("weight_function") or d.get("bias_function") or why_not(leaf) is not None:
        return None
    if "_v" in d:
        if vbar is None:
            return None
        try:
            signature = vbar.vbar_fault(d["_v"])
        except Exception:    # aimdo's VBAR_FAULT_ERROR: ComfyUI's own cast meets it, in its own code
            return None
        if signature is None:
            return None
        pinned.append(leaf)
        if not vbar.vbar_signature_compare(signature, d.get("_v_signature")):
            return None
        w, b = d.get("_v_weight"), d.get("_v_bias")
    else:
        w, b = leaf._parameters.get("weight"), leaf._parameters.get("bias")
        if w is not None and w.device != device:
            return None
    if any(t is not None and t.dtype != dtype for t in (w, b)):
        return None
    return w, b


@contextlib.contextmanager
def slots_resident(leaves, dtype, device):
    """Inside: each of ``leaves`` (a model's leaves whose weights ComfyUI casts per call) has what
    ComfyUI's cast would hand it checked to be resident memory (:func:`_resident_now`: a Dynamic VRAM
    slot faulted in and pinned until the block ends, as ComfyUI's own cast of a resident slot does,
    or the leaf's own weights), so a whole UNet call can replay one CUDA graph reading them in place.
    Yields ``(addresses, show)`` when every one is: their ``(data_ptr, dtype)`` each, and ``show()``,
    a context in which the leaves show them as plain parameters and take their plain forward (for a
    call that runs the model's code, a capture or its launches; a replay reads the addresses only);
    else None (no room, refilled, converted or patched per call: that call casts region by region)."""
    vbar, pinned, resident = _vbar(), [], []
    _busy_add(_ALL)
    try:
        for leaf in leaves:
            if not per_call(leaf) or not _has_weights(leaf):
                continue
            got = _resident_now(leaf, dtype, device, vbar, pinned)
            if got is None:
                break
            resident.append((leaf, *got))
        else:
            yield (tuple((t.data_ptr(), t.dtype) for _, w, b in resident for t in (w, b) if t is not None),
                   functools.partial(_shown, resident))
            return
        yield None
    finally:
        _busy_end(_ALL)
        failed = None
        for leaf in pinned:   # every one, even when one raises (the first error raised after)
            try:
                vbar.vbar_unpin(leaf.__dict__["_v"])
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed


@contextlib.contextmanager
def _shown(resident):
    """Inside: each ``(leaf, weight, bias)`` of ``resident`` shows them as plain parameters
    (:func:`_show`); put back after, also on an error."""
    saved = []
    try:
        for leaf, w, b in resident:
            saved += _show(leaf, w, b)
        yield
    finally:
        _restore(saved)


@contextlib.contextmanager
def for_op(leaf, x):
    """ComfyUI's cast of ``leaf``'s weights for one op on ``x``, where the op runs (a region run op by
    op, as the leaf's own forward casts): yields (weight, bias), released (unpinned, its offload
    stream's buffer free again) after the block, once the op is queued."""
    w, b, handle = _cast(leaf, x.dtype, x.device)
    try:
        yield w, b
    finally:
        if handle is not None:
            _ops().uncast_bias_weight(leaf, w, b, handle)


def busy(module) -> bool:
    """Whether ``module``'s leaves show per-call cast weights right now (another thread must not run it)."""
    return id(module) in _BUSY or _ALL in _BUSY


def needs_cast(module) -> bool:
    """Whether any leaf under ``module`` has weights ComfyUI casts or patches per call."""
    return any(per_call(m) for m in module.modules())


def stand_in(module, args):
    """A copy of ``module`` whose cast leaves show zeros of the weights :func:`applied` shows for a call
    on ``args`` (their shape, the compute dtype and device, contiguous, ``args``' inference mode;
    shallow: untouched submodules and tensors are shared), for a thread that must not change the
    model another thread runs. ComfyUI's cast is not called: it pins memory, reads the per-call
    state the sampling thread's casts use (Dynamic VRAM's ``_prefetch``, ``_v_signature``) and
    allocates a second copy of the weights; the compiled code depends on the weights' shape, dtype,
    device and strides only. So the zeros are views of one buffer the size of the largest weight,
    not a copy of each: beside sampling the thread holds one weight's worth, not the region's."""
    todo = {id(m) for m in module.modules() if per_call(m) and _has_weights(m)}
    if not todo:
        return module
    dtype, device = compute_of(args)
    inference = next(a for a in args if isinstance(a, torch.Tensor)).is_inference()
    keep, largest = set(), 1
    for name, m in module.named_modules():
        if id(m) in todo:
            parts = name.split(".") if name else []
            keep.update(".".join(parts[:i]) for i in range(len(parts) + 1))
            # (the shape a cast shows: another pack's packed weights report it, their bytes differ)
            largest = max([largest] + [math.prod(t.shape) for t in (getattr(m, "weight", None),
                                                                     getattr(m, "bias", None)) if t is not None])
    with torch.inference_mode(inference):
        zeros = torch.zeros(largest, dtype=dtype, device=device)

    def copy(m, name):
        new = object.__new__(type(m))
        new.__dict__.update(m.__dict__)
        new._parameters = dict(m._parameters)
        new._modules = {k: (copy(c, f"{name}.{k}" if name else k) if (f"{name}.{k}" if name else k) in keep else c)
                        for k, c in m._modules.items()}
        if id(m) in todo:
            _show(new, *(None if t is None else zeros[:math.prod(t.shape)].view(tuple(t.shape))
                         for t in (getattr(m, "weight", None), getattr(m, "bias", None))))
        return new
    with torch.inference_mode(inference):
        return copy(module, "")
