"""The one documented knob set of the compiler.

Every field maps 1:1 onto a widget of the Select Backend node (or is a
standalone-API option), and says what it costs in speed, memory, quality and
LoRA/patch compatibility.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .backends import names as _backend_names
from .reasons import DISABLE_ENV  # noqa: F401 - public here too

#: "auto" and every registered backend, in auto's order (compiler/backends)
BACKENDS = ("auto",) + _backend_names()
PRECISIONS = ("auto", "fp32", "fp16", "bf16")


@dataclass(frozen=True)
class CompileConfig:
    """How a UNet is accelerated.

    backend:
        ``auto`` picks the fastest backend that works here (triton on CUDA once
        it lands, ipex on an Intel CPU with a matching IPEX, inductor
        otherwise, eager if nothing works). ``inductor`` is torch.compile of
        leaf regions; ``ipex`` runs each leaf region on an ipex.optimize'd
        copy (prepacked weights, rebuilt when weights change; one extra copy
        of the weights in memory); ``eager`` turns every rewrite off for this
        model (A/B and debugging). Speed only: no backend changes which LoRA,
        ControlNet or attention patch applies.
    precision:
        ``auto`` keeps the dtype ComfyUI / the caller chose for the model:
        bit-for-bit the same math as eager up to kernel rounding. ``fp16`` /
        ``bf16`` run the accelerated regions under autocast in that dtype:
        faster where the hardware has the units, at a quality cost that
        Warmup Shapes measures and reports (max abs diff vs the model's own
        dtype). ``fp32`` is honoured only when the model is already fp32.
    dynamic_shapes:
        True (default): batch, height, width and context length are symbolic,
        so a new batch size or resolution reuses the compiled code (zero
        recompiles inside the warmed range). A warmup of one shape compiles that
        shape static (``warmup.one_shape``): another shape recompiles once,
        then runs dynamic code. False: every new shape compiles
        its own specialised code (slightly faster kernels, a compile per
        shape: only for workflows with one fixed shape).
    prepack_conv:
        On CPU, convolutions use oneDNN weights reordered once into its
        blocked layout instead of on every call (the largest CPU win: 2-7x
        per conv). Costs one extra copy of the conv weights in memory. The
        packed copy is a cache keyed on the live weight (identity, storage,
        version counter, ComfyUI's weight-patch uuid), so LoRA and strength
        changes are honoured.
    prepack_linear:
        On CPU, linear layers inside compiled regions use MKL weights packed
        once. Off by default: with torch 2.13 it measured no faster than the
        plain linear (docs/internals.md, prepack_linear), while the packed copy
        costs memory and start time. On: the same live-weight cache key as
        prepack_conv; one extra copy of those weights.
    cuda_graphs:
        On CUDA (triton and inductor backends): each accelerated region is
        captured as a CUDA graph on its second call at a shape and replayed
        after that, so its kernels launch in one call instead of one Python
        dispatch each (the win at SD1.5 sizes, where launches dominate).
        Costs GPU memory: one input and one output buffer per region per
        shape (at most 4 shapes per region, within 1/8 of the card, freed
        when a prompt ends or ComfyUI unloads the model). Off with backend
        auto on CUDA: a region keeps a graph at a shape only where its
        replay measured faster. ComfyUI's dispatch between
        regions stays eager, so ControlNet, patches and LoRA behave as without
        graphs; weights updated in place are read at every replay, replaced
        weights drop the region's graphs. Under cudaMallocAsync (ComfyUI's
        default) the triton backend's captures hold the torch ops its kernels
        replace, and inductor gets no graphs (--disable-cuda-malloc lifts
        both); the report says which. Ignored on CPU and on ipex/eager.
    """

    backend: str = "auto"
    precision: str = "auto"
    dynamic_shapes: bool = True
    prepack_conv: bool = True
    prepack_linear: bool = False
    cuda_graphs: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for name in ("dynamic_shapes", "prepack_conv", "prepack_linear", "cuda_graphs"):
            value = getattr(self, name)
            # (dynamic_shapes None is the runtime's own "one warmup shape, static first")
            if not isinstance(value, bool) and not (name == "dynamic_shapes" and value is None):
                raise TypeError(f"{name}={value!r} must be True or False (a string such as 'false' would read as "
                                f"True)")

    def autocast_dtype(self, model_dtype, note):
        """The dtype regions run in under autocast (precision fp16 / bf16), else None (fp32 is kept
        only for a model loaded in fp32: ``note(text)`` says so otherwise)."""
        import torch
        if self.precision in ("fp16", "bf16"):
            return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.precision]
        if self.precision == "fp32" and model_dtype != torch.float32:
            note(f"precision fp32 needs the model loaded in fp32 (it is {model_dtype}); kept auto. "
                 f"Fix: start ComfyUI with --force-fp32")
        return None

    def replace(self, **changes) -> "CompileConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, backend: str = "auto", **options) -> "CompileConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; valid options: {sorted(names - {'backend'})}")
        return cls(backend=backend, **options)
