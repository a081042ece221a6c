"""Compiled code or the model's own code: the one place that decides, per UNet call and per region
call (:class:`Gate`), and the shims that ask it, installed per region for one UNet call.

What a compiled call does after the gate let it through (a precompiled variant, a compile now or in
the background thread, a CUDA graph replay) is the compile lifecycle's and the graphs'; a compiled
call that raises runs the model's own code through the accelerator's fallback."""
from __future__ import annotations

import contextlib
import inspect

import torch

from . import cast
from .compat import comfy as comfy_compat
from .overrides import own
from .plan import ATTENTION, DOUBLE_BLOCK, JOINT_BLOCK, LUMINA_BLOCK, QWEN_IMAGE_BLOCK, SINGLE_BLOCK, WAN_BLOCK
from .reasons import Reason

#: the inputs of a DiT block body, in order (the rest of the block's call must be at its defaults)
DIT_INPUTS = {DOUBLE_BLOCK: ("img", "txt", "vec", "pe"), SINGLE_BLOCK: ("x", "vec", "pe"),
              QWEN_IMAGE_BLOCK: ("hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb"),
              WAN_BLOCK: ("x", "e", "freqs", "context"),
              JOINT_BLOCK: ("context", "x", "c"),
              LUMINA_BLOCK: ("x", "freqs_cis", "adaln_input")}
#: arguments a block takes that its computation does not read (Qwen-Image's attention ignores the
#: text mask ComfyUI hands the block): any value is served
DIT_UNREAD = {QWEN_IMAGE_BLOCK: ("encoder_hidden_states_mask",), JOINT_BLOCK: ("use_checkpoint",)}


#: the largest max |compiled - eager| warmup's compare accepts, as a fraction of max(1, max |eager|), by
#: the dtype the regions compute in: kernels and graphs round differently (measured ~1e-5 in fp32 on a
#: CPU; TF32 matmuls and fp16 / bf16 autocast leave more), while wrong weights or a wrong kernel are off
#: by the output's own size
TOLERANCE = {torch.float32: 1e-2, torch.float16: 5e-2, torch.bfloat16: 1e-1}
#: ... for a model with leaves that multiply quantized (ComfyUI's fp8 / int8 / nvfp4 matmuls quantize
#: their input too: an upstream rounding difference flips a value by a step of the format, 1/8 for fp8)
QUANTIZED_TOLERANCE = 0.25


def max_diff(out, ref) -> float:
    """max |out - ref| (warmup's compare of a compiled output with the model's own)."""
    return float((out.float() - ref.float()).abs().max())


class Gate:
    """Whether a call runs compiled code or the model's own code. A UNet call goes through the
    regions unless ``bypassed`` (warmup's eager reference) or no region has compiled code; a region
    call reaches its compiled code unless its kind is in ``failed`` (kind -> why: it failed,
    warmup's compare refused it, or a search holds it off), its call form is not one the code
    serves (the shims check that), or ComfyUI casts or patches its weights this call in a way the
    pack cannot serve outside the graph (``cast_refused``: the backend's reason for refusing every
    such call; the reasons kept per kind in ``cast_eager``). Region calls sent to the model's own
    code are counted in ``stats["region_eager"]``."""

    def __init__(self, stats, cast_refused=None):
        self.stats = stats
        self.failed: dict = {}
        self.cast_eager: dict = {}
        self.cast_refused = cast_refused
        self.bypassed = False
        #: a weak method told ``(kinds, why)`` when the compare refuses kinds (None: nobody)
        self.on_refused = None
        #: set at a UNet call's start: its first region call has ``on_first`` (a weak method) check
        #: the modules' classes (:meth:`first_call`)
        self.due = False
        self.on_first = None

    def first_call(self) -> frozenset:
        """The UNet call's one-graph decision, or its first region call (the wrappers inside the
        model's forward have run): the region modules that run the model's own code for the rest of
        the call (another node's method on a class of theirs)."""
        self.due = False
        check = self.on_first() if self.on_first is not None else None
        return check() if check is not None else frozenset()

    def through_regions(self, has_shims: bool) -> bool:
        """Whether this UNet call goes through the regions' shims."""
        return has_shims and not self.bypassed

    def casts(self, kind, leaves, watched, args):
        """The leaves whose weights ComfyUI (or another pack's ops, by their own cast) casts or
        patches this call on ``args`` (fp8 or another storage dtype, a partial load, weight
        functions, GGUF's dequantisation), or None when the region must run the model's own code
        for them: counted, with the reason kept per kind for the report. ``watched``:
        ``cast.watch(leaves)``, the per-call check that finds none (most calls) without planning."""
        if cast.none_per_call(watched):
            return ()
        todo, why = cast.plan(leaves, args)
        if todo and self.cast_refused:
            why = self.cast_refused
        if why is None:
            return todo
        self.stats["region_eager_cast"] += 1
        self.cast_eager.setdefault(kind, why)
        return None

    def eager(self, original, module, *args, **kwargs):
        """One region call sent to the model's own code: counted, and paused where ComfyUI's compiler
        records, as the compiled calls are: the pattern it replays is the same whichever runs."""
        self.stats["region_eager"] += 1
        recording = comfy_compat.compiler_recording()
        if recording is None:
            return original(module, *args, **kwargs)
        with recording:
            return original(module, *args, **kwargs)

    def why_eager(self, region) -> Reason | None:
        """Why ``region``'s next call would run the model's own code as its loaded weights stand
        (its kind is off, or its per-call weights are ones the pack cannot serve); None: compiled."""
        failed = self.failed.get(region.kind)
        return cast.plan(region.leaves)[1] or (Reason.of(failed) if failed is not None else None)

    def why_all_eager(self, regions) -> Reason | None:
        """Why every one of ``regions`` would run the model's own code at its next call as its loaded
        weights stand (the first region's reason: e.g. another pack's ops on every leaf); None when
        any would run compiled code."""
        first = None
        for region in regions:
            why = self.why_eager(region)
            if why is None:
                return None
            first = why if first is None else first
        return first

    def close(self, kinds, why) -> None:
        """``kinds`` run the model's own code from now on (``why``: the report's reason)."""
        for k in kinds:
            self.failed[k] = why

    def refuse(self, kinds, why) -> None:
        """Close ``kinds`` because their compiled result was wrong (warmup's compare), and tell
        ``on_refused`` (a weak method: the accelerator's report, log and toast)."""
        self.close(kinds, why)
        told = self.on_refused() if self.on_refused is not None else None
        if told is not None:
            told(kinds, why)

    @staticmethod
    def tolerance(dtype, regions, ref, attention_overrides=()) -> tuple[float, str]:
        """(the largest max |compiled - eager| the compare accepts against the model's own output
        ``ref``, why it is not ``dtype``'s: "" when it is). ``dtype``: what the regions compute in.
        Where an attention override ran its own code in the calls compared (``attention_overrides``:
        their names; a sage-style override that casts q, k and v to fp16), that code's rounding, fed
        by compiled neighbours whose own rounding differs slightly, sets the difference: fp16's
        tolerance then. Quantized matmuls among the ``regions``' leaves: ``QUANTIZED_TOLERANCE``."""
        scale = 1.0 if ref is None else max(1.0, float(ref.float().abs().max()))
        if any(cast.quantized(leaf) for region in regions for leaf in region.leaves):
            return QUANTIZED_TOLERANCE * scale, "quantized matmuls"
        tol = TOLERANCE.get(dtype, max(TOLERANCE.values()))
        if attention_overrides and tol < TOLERANCE[torch.float16]:
            return TOLERANCE[torch.float16] * scale, (f"fp16's, as an attention patch runs its own code "
                                                      f"({', '.join(attention_overrides)}), which may compute in fp16")
        return tol * scale, ""

    def compared(self, kinds, run_one, shape, diff: float, ref, tol: float, at: str) -> list:
        """Warmup's compare at ``shape`` found max |compiled - eager| ``diff`` (against the model's own
        output ``ref``; None: a compare recorded earlier): over ``tol``, the kinds (of ``kinds``) whose
        compiled code alone makes a difference over it (one forward each, ``run_one(shape)``, the
        others on the model's own code; with no eager output to compare, or none alone: every kind)
        run the model's own code from now on (:meth:`refuse`, the reason naming ``at``). Returns the
        kinds refused."""
        from .reasons import wrong_result
        if diff <= tol:
            return []
        kinds, bad = list(kinds), []
        if ref is not None and len(kinds) > 1:
            for k in kinds:
                with self.own_code([o for o in kinds if o != k]):
                    if max_diff(run_one(shape), ref) > tol:
                        bad.append(k)
            if bad and set(bad) != set(kinds):
                # the others together, without the bad ones: an interaction refuses every kind
                with self.own_code(bad):
                    rest_ok = max_diff(run_one(shape), ref) <= tol
                bad = bad if rest_ok else kinds
        bad = bad or kinds
        self.refuse(bad, wrong_result(diff, tol, at))
        return bad

    @contextlib.contextmanager
    def own_code(self, kinds):
        """Inside: ``kinds`` run the model's own code (warmup's search for the kinds that made a
        difference); a kind that really fails inside keeps its failure after."""
        added = [k for k in kinds if k not in self.failed]
        self.failed.update({k: "off" for k in added})
        try:
            yield
        finally:
            for k in added:
                if self.failed.get(k) == "off":
                    del self.failed[k]

    @contextlib.contextmanager
    def bypass(self):
        """Whole UNet calls run the model's own code inside this block (the eager reference)."""
        prev, self.bypassed = self.bypassed, True
        try:
            yield
        finally:
            self.bypassed = prev


def install(plan, impls: dict, run, gate: Gate) -> list:
    """(region module, shim) for every planned region ``impls`` has code for (keyed by (family,
    kind)); each shim's ``hook`` names the method it stands in for during a UNet call."""
    out = []
    for region in plan.regions:
        impl = impls.get((region.family, region.kind))
        if impl is not None:
            shim = make_shim(region, impl, run, gate)
            shim.hook = region.hook
            out.append((region.module, own(shim)))   # (marked: told apart from another node's override)
    return out


def make_shim(region, impl, run, gate: Gate):
    """The callable installed as ``module.<region.hook>`` for one UNet call: a call the region's
    compiled code can serve (:class:`Gate`) goes to ``run()(kind, impl, module, original, args,
    eager_kwargs, casts)`` (``run``: a weak method, so the shim holds no accelerator; ``casts``: the
    leaves whose weights ComfyUI casts or patches this call, :mod:`cast`). A call with a mask, extra
    arguments or an attention override runs the model's own code."""
    module, kind, leaves, hook = region.module, region.kind, region.leaves, region.hook
    watched = cast.watch(leaves)
    original = getattr(type(module), hook)
    failed = gate.failed

    if kind == ATTENTION and region.family == "comfy":
        def shim(x, context=None, value=None, mask=None, transformer_options={}):
            if gate.due and module in gate.first_call():
                return getattr(type(module), hook)(module, x, context=context, value=value, mask=mask,
                                                   transformer_options=transformer_options)
            if (mask is not None or kind in failed or "optimized_attention_override" in transformer_options
                    or (casts := gate.casts(kind, leaves, watched, (x,))) is None):
                return gate.eager(original, module, x, context=context, value=value, mask=mask,
                                  transformer_options=transformer_options)
            return run()(kind, impl, module, original, (x, context, value),
                         dict(context=context, value=value, mask=mask, transformer_options=transformer_options), casts)
        return shim
    if kind in DIT_INPUTS:
        return _dit_shim(module, kind, hook, original, leaves, watched, impl, run, gate)
    if kind == ATTENTION:
        def shim(hidden_states, encoder_hidden_states=None, attention_mask=None, **kw):
            if gate.due and module in gate.first_call():
                return getattr(type(module), hook)(module, hidden_states, encoder_hidden_states, attention_mask, **kw)
            if attention_mask is not None or kw or kind in failed or hidden_states.dim() != 3:
                return gate.eager(original, module, hidden_states, encoder_hidden_states, attention_mask, **kw)
            return run()(kind, impl, module, original, (hidden_states, encoder_hidden_states),
                             dict(encoder_hidden_states=encoder_hidden_states))
        return shim

    def shim(*args, **kwargs):
        if gate.due and module in gate.first_call():
            return getattr(type(module), hook)(module, *args, **kwargs)
        if kwargs.get("scale", 0) in (None, 1.0):
            # diffusers < 0.26 passes its LoRA scale (resnet(h, temb, scale=1.0)); 1.0 is the default
            kwargs = {k: v for k, v in kwargs.items() if k != "scale"}
        if kwargs or kind in failed or (casts := gate.casts(kind, leaves, watched, args)) is None:
            return gate.eager(original, module, *args, **kwargs)
        return run()(kind, impl, module, original, args, None, casts)
    return shim


def _dit_shim(module, kind, hook, original, leaves, watched, impl, run, gate):
    """A DiT block's gate. ComfyUI calls these blocks by keyword; the body serves the calls
    ``_dit_inputs`` turns into its inputs, whose other arguments are at their defaults (no attention
    mask, no per-token modulation dims); ``transformer_options`` may hold anything but an attention
    override. Any other call runs the block's own forward."""
    sig = inspect.signature(original)
    self_name = next(iter(sig.parameters))
    first = DIT_INPUTS[kind][0]
    failed = gate.failed

    def shim(*args, **kwargs):
        if gate.due and module in gate.first_call():
            return getattr(type(module), hook)(module, *args, **kwargs)
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
        if inputs is None or (casts := gate.casts(kind, leaves, watched, inputs)) is None:
            return gate.eager(original, module, *args, **kwargs)
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
    if kind == WAN_BLOCK:
        return _wan_inputs(module, given, *inputs)
    if kind == JOINT_BLOCK:
        return inputs if all(isinstance(t, torch.Tensor) for t in inputs) else None
    if kind == LUMINA_BLOCK:       # no mask (a padded prompt's, in the context refiner: its own code)
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
    if kind not in (DOUBLE_BLOCK, SINGLE_BLOCK):
        return None
    try:
        mods = [parts(vec)] if kind == SINGLE_BLOCK else [parts(m) for pair in vec for m in pair]
    except TypeError:
        return None
    if (kind == DOUBLE_BLOCK and len(mods) != 4) or any(m is None for m in mods):
        return None
    return tuple(t for m in mods for t in m)
