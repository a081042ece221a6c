"""Warmup Shapes' ComfyUI side: which calls warmup makes, at which entries, and with what.

``prepare`` reads the model as sampling will run it (its context windows, the whole-video modules
another pack inserted, the memory an entry needs, whether any region runs compiled code at all)
and returns the :class:`Job`: the entries to run and the sampling-style call (``SamplingCall``,
built as KSampler builds its calls), or why none runs. The compiler's ``warmup_runs`` runs it.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass

import torch

from ..compiler.api import (check_frames, check_memory, context_dim, dit_context_width, dit_patch, dit_pooled_width,
                            error_summary, first_level_channels, forget_compiler_recording, frame_count, is_interrupt,
                            is_video, latent_frames, latent_scale, memory_name, unet_inputs)

log = logging.getLogger(__name__)


def fn_name(fn) -> str:
    """A patch function's name as the report shows it (its qualified name, less ``<locals>``)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return name.replace(".<locals>", "")


def sampling_transformer_options(model) -> dict:
    """transformer_options as KSampler builds them (the patcher's wrappers and
    callbacks merged in by ComfyUI's own prepare_model_patcher)."""
    import comfy.model_patcher
    import comfy.sampler_helpers
    options = comfy.model_patcher.create_model_options_clone(model.model_options)
    options.setdefault("transformer_options", {})
    comfy.sampler_helpers.prepare_model_patcher(model, {}, options)
    return options["transformer_options"]


def patch_names(model_options: dict) -> list[str]:
    """The model's sampling-time patches as ``where (function)``, for the report."""
    to = model_options.get("transformer_options", {})
    names = [f"{where} ({fn_name(fn)})" for where, fns in to.get("patches", {}).items() for fn in fns]
    names += [f"{where} replace {key} ({fn_name(fn)})"
              for where, table in to.get("patches_replace", {}).items() for key, fn in table.items()]
    if "model_function_wrapper" in model_options:
        names.append(f"model_function_wrapper ({fn_name(model_options['model_function_wrapper'])})")
    return names


def _fits(unet, x, c) -> bool:
    """Whether extra_conds' conditioning has the widths this UNet takes (a model built with
    non-standard widths, e.g. a test's tiny one, gets random tensors of its own sizes instead)."""
    if not hasattr(unet, "input_blocks"):          # a DiT: its text widths are what extra_conds may miss
        return (c["c_crossattn"].shape[-1] == dit_context_width(unet)
                and ("y" not in c or dit_pooled_width(unet) in (None, c["y"].shape[-1])))
    concat = c.get("c_concat")
    if x.shape[1] + (concat.shape[1] if concat is not None else 0) != unet.in_channels:
        return False
    label = getattr(unet, "label_emb", None)
    if isinstance(label, torch.nn.Sequential) and "y" in c:
        return c["y"].shape[-1] == label[0][0].in_features
    return True


def processed(cond, batch_size: int, device):
    """``cond.process_cond(...).cond`` as this ComfyUI's sampler calls it (``get_area_and_mult``): no
    area, and ``device=`` only where the method names it (older ComfyUIs; newer samplers pass none
    and their conds keep their device)."""
    try:
        named = "device" in inspect.signature(cond.process_cond).parameters
    except (TypeError, ValueError):
        named = False
    return cond.process_cond(batch_size=batch_size, area=None, **({"device": device} if named else {})).cond


def _to(value, device):
    """``value`` (a tensor, a list of them, or anything else a cond holds) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


class SamplingCall:
    """One UNet call at a warmup shape, built the way KSampler builds it
    (comfy.samplers ``_calc_cond_batch``): the patcher's wrappers, callbacks and
    patches in ``transformer_options`` plus the sampling state patches read
    (``sigmas``, ``sample_sigmas``, ``cond_or_uncond``, ``uuids``), the first
    sigma of a 20-step schedule of the model's own ``model_sampling``, cond and
    uncond as two chunks of an even batch, and ``model_function_wrapper`` when
    one is set. A patch that still cannot run outside sampling is dropped for
    the rest of the warmup (``dropped`` says which and why); sampling keeps it."""

    STEPS = 20

    def __init__(self, model, context_tokens: int, device, dtype):
        import comfy.samplers
        self.model, self.tokens, self.device, self.dtype = model, context_tokens, device, dtype
        ms = model.get_model_object("model_sampling")
        self.sample_sigmas = comfy.samplers.calculate_sigmas(ms, "normal", self.STEPS).to(device)
        self.patches = patch_names(model.model_options)
        self.patched = True
        self.dropped: str | None = None
        #: why warmup's conditioning is random tensors of the UNet's input sizes, not the model's own
        #: ``extra_conds`` (a report line; the compiled code is the same, sampling uses the prompt's)
        self.random_conds: str | None = None
        #: what gives the model's modules that take whole videos their frames (the accelerator's
        #: ``videos_of``) and the frames per call sampling gives them (its context windows, or their
        #: video length), which each call gives them too
        self.videos, self.frames = None, None

    def __call__(self, shape):
        # each call records afresh where ComfyUI's compiler records the model (other shapes, compares
        # against the model's own code: no pattern for a replay to follow), as after a node
        forget_compiler_recording()
        try:
            with self.videos.videos_of(self.frames) if self.videos is not None else contextlib.nullcontext():
                return self._patched_or_not(shape)
        finally:
            forget_compiler_recording()

    def _patched_or_not(self, shape):
        if not self.patched:
            return self._call(shape, patched=False)
        try:
            return self._call(shape, patched=True)
        except Exception as e:
            if is_interrupt(e) or not self.patches:
                raise
            self.dropped = (f"warmup ran without the model's patches ({', '.join(self.patches)}): outside "
                            f"sampling they raised {error_summary(e)}"[:400]
                            + ". Sampling applies them as usual; patched regions run the model's own code then.")
            log.warning("UNet Compiler: %s", self.dropped, exc_info=True)
            self.patched = False
            return self._call(shape, patched=False)

    def conds(self, shape):
        """(latent x, apply_model conditioning) at ``shape``: the conditioning the model's own
        ``extra_conds`` builds from a random prompt embedding, as the sampler's process_conds
        does (SDXL's ADM vector, inpainting / pix2pix / upscaler concat channels, the x4
        upscaler's noise level, SVD's frame count = the batch); a model whose extra_conds
        wants more gets random tensors of the UNet's own input sizes instead."""
        base = self.model.model
        unet = base.diffusion_model
        g = torch.Generator(device="cpu").manual_seed(0)
        latent_c = base.latent_format.latent_channels
        scale = latent_scale(base)       # 8, or Flux.2's 16
        lh, lw = shape.height // scale, shape.width // scale
        x = torch.randn(shape.batch, latent_c, *latent_frames(base, shape.frames), lh, lw,
                        generator=g).to(self.device, self.dtype)
        width = dit_context_width(unet) or context_dim(unet)
        ctx = torch.randn(shape.batch, self.tokens, width, generator=g).to(self.device, self.dtype)
        try:
            made = base.extra_conds(noise=x, device=self.device, width=shape.width, height=shape.height,
                                    prompt_type="positive", seed=0, cross_attn=ctx,
                                    pooled_output=torch.randn(1, dit_pooled_width(unet) or 1280,
                                                              generator=g).to(self.device, self.dtype))
            c = {k: _to(processed(v, shape.batch, self.device), self.device) for k, v in made.items()}
            if "c_crossattn" in c and _fits(unet, x, c):
                return x, c
            why = "what it built does not fit the UNet's inputs"
        except Exception as e:
            if is_interrupt(e):
                raise
            why = error_summary(e)
            log.debug("UNet Compiler: warmup conditioning from extra_conds failed", exc_info=True)
        if self.random_conds is None:
            self.random_conds = (f"warmup conditioning: random tensors of the UNet's input sizes, as the model's own "
                                 f"extra_conds could not make it ({why}); the code warmup compiles is the same, "
                                 f"sampling uses the prompt's")
            log.info("UNet Compiler: %s", self.random_conds)
        (xin, _), kw = unet_inputs(unet, "comfy", shape, self.tokens, self.dtype, self.device)
        c = {"c_crossattn": kw["context"], **({"y": kw["y"]} if "y" in kw else {})}
        if xin.shape[1] > latent_c:  # inpainting / pix2pix / upscaler: the extra channels arrive as c_concat
            c["c_concat"] = xin[:, latent_c:]
        return xin[:, :latent_c], c

    def _call(self, shape, patched: bool):
        import uuid
        base = self.model.model
        with torch.inference_mode():
            x, c = self.conds(shape)
            chunks = 2 if shape.batch % 2 == 0 else 1   # cond + uncond, or cfg 1
            cond_or_uncond = [0, 1][:chunks]
            sigma = self.sample_sigmas[0].expand(shape.batch // chunks).clone()
            to = sampling_transformer_options(self.model)
            if not patched:
                to.pop("patches", None)
                to.pop("patches_replace", None)
            to["sample_sigmas"] = self.sample_sigmas
            to["cond_or_uncond"] = cond_or_uncond
            to["uuids"] = [uuid.uuid4() for _ in cond_or_uncond]
            to["sigmas"] = sigma
            c["transformer_options"] = to
            timestep = torch.cat([sigma] * chunks)
            wrapper = self.model.model_options.get("model_function_wrapper") if patched else None

            def call(**more):
                if wrapper is not None:
                    return wrapper(base.apply_model, {"input": x, "timestep": timestep, "c": dict(c, **more),
                                                      "cond_or_uncond": cond_or_uncond})
                return base.apply_model(x, timestep, **c, **more)
            if _per_frame_timesteps(base, x):
                # image-to-video's per-frame timesteps (its denoise mask; Wan 2.2 TI2V): another variant
                # of the blocks, warmed too (the mask's values do not matter, its shape does)
                call(denoise_mask=torch.ones_like(x[:, :1]))
            return call()


def _per_frame_timesteps(base, x) -> bool:
    """Whether the model turns a denoise mask into a timestep per latent frame (its own
    ``process_timestep``, as Wan 2.2's) and ``x`` has several frames."""
    import comfy.model_base
    own = getattr(type(base), "process_timestep", None) is not comfy.model_base.BaseModel.process_timestep
    return own and x.dim() == 5 and x.shape[2] > 1


def context_window(model) -> int | None:
    """The frames per call of sliding context windows over the batch that sampling will use on
    ``model`` (a ModelPatcher): ComfyUI's own (``model_options["context_handler"]`` over dim 0) or
    AnimateDiff-Evolved's (``context_options`` in the patcher's attachments; the first context's
    length, the one sampling starts with); None where none is set. Windows apply to a video longer
    than one window, which warmup takes every video entry to be."""
    handler = model.model_options.get("context_handler")
    if getattr(handler, "dim", None) == 0 and (n := frame_count(getattr(handler, "context_length", None))):
        return n
    for held in getattr(model, "attachments", {}).values():
        if n := frame_count(getattr(getattr(held, "context_options", None), "context_length", None)):
            return n
    return None


@dataclass
class Job:
    """What Warmup Shapes runs: ``shapes`` (the entries), ``frames`` (the frames per call modules
    that take whole videos get; None: the model has none) and ``call`` (one sampling-style UNet call
    at an entry). With ``call`` None no call runs: ``why`` (a Reason) or ``note`` says why, and
    ``shapes`` are the entries as given."""
    shapes: list
    frames: int | None = None
    call: "SamplingCall | None" = None
    why: object = None
    note: str | None = None


def usable_memory(model, device) -> tuple[int, str]:
    """What an entry's activations may take on ``device`` with ``model`` (a ModelPatcher) loaded, and
    how a message names it. The patcher's own count where it has one (newer ComfyUI's
    ``ModelPatcher.get_free_memory``: free memory plus what Dynamic VRAM's VBARs would give back, which
    the module-level ``get_free_memory`` leaves out), else ComfyUI's free memory; on a GPU plus the
    model's weights ComfyUI can offload."""
    import comfy.model_management
    own = getattr(model, "get_free_memory", None)
    room = own(device) if callable(own) else comfy.model_management.get_free_memory(device)
    said = ["free as ComfyUI counts it for sampling"] if callable(own) else []
    if device.type == "cuda":
        room += model.loaded_size()
        said = (said or ["free"]) + ["plus the model's weights ComfyUI can offload"]
    return room, memory_name(device) + (f" ({', '.join(said)})" if said else "")


def prepare(model, accel, shapes, context_tokens: int) -> Job:
    """Warmup's job on ``model`` (a ModelPatcher Compile UNet made, ``accel`` its accelerator) at the
    parsed ``shapes``: checks each entry against what its calls will need (frames for a video model;
    once the model is loaded as sampling loads it, memory and whole videos for inserted modules)
    before anything is allocated for them. A model nothing of which runs compiled gets no call."""
    import comfy.model_management

    if accel.not_a_unet:
        return Job(shapes)     # nothing was compiled: nothing to prime (and no UNet inputs to build)
    base, device = model.model, model.load_device
    unet, dit = base.diffusion_model, accel.arch == "dit"
    dtype = base.manual_cast_dtype or base.get_dtype()
    window, width, call = context_window(model), accel.hidden_width(), SamplingCall(model, context_tokens, device, dtype)
    # what an entry's activations take: a DiT's hidden width per token of its latent grid (and frames)
    grid = dict(cell=latent_scale(base) * dit_patch(unet), frames_of=lambda f: max((1, *latent_frames(base, f))))
    video = is_video(base)
    check_frames(shapes, video)        # (before the load: an entry no model of this kind runs)
    comfy.model_management.load_models_gpu([model])
    # an entry too large for the memory left is the user's input to fix, said before warmup allocates
    # it (on a GPU, ComfyUI offloads weights to make room for activations: those count as room too)
    room, where = usable_memory(model, device)
    check_memory(shapes, width if dit else first_level_channels(unet), dtype.itemsize, room, where,
                 **(grid if dit else {}))
    why = accel.why_all_eager()
    if why is not None:
        # every region's weights are made per call in a way the pack cannot serve (another pack's
        # dequantising ops): probes would only spend eager calls, so none run
        note = f"Warmup Shapes ran no calls: every region runs the model's own code ({why})"
        accel.note(note, once=True)
        return Job(shapes, why=why)
    frames, kept = accel.whole_videos(shapes, window)
    if not kept:
        return Job(shapes, note=f"no entry's batch is a multiple of the {frames} frames the model's inserted "
                                f"modules take per call (see the report's warmup entry lines)")
    call.videos, call.frames = accel, frames
    return Job(kept, frames, call)
