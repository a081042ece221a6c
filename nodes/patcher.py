"""ComfyUI ModelPatcher glue behind the V3 nodes (nodes/v3.py).

The shared model is never mutated: Compile UNet clones the patcher and
adds one keyed APPLY_MODEL wrapper (plus ON_APPLY_HOOKS, ON_DETACH and ON_CLEANUP callbacks); the
wrapper swaps region forwards in for one apply_model call and restores them
in ``finally`` (runtime.Accelerator.active).
"""
from __future__ import annotations

import logging
import weakref

import torch

from ..compiler import cast
from ..compiler.config import CompileConfig
from ..compiler.compat.comfy import (dit_context_width, dit_patch, dit_pooled_width, is_interrupt, is_video, latent_frames,
                                     latent_scale, latent_time_scale)
from ..compiler.inserted import frame_count
from ..compiler.reasons import Reason
from ..compiler.runtime import Accelerator
from ..compiler.shapes import (Shape, check_context_tokens, check_frames, check_memory, context_dim,
                               first_level_channels, label_of, memory_name, parse_shapes, unet_inputs)
from ..compiler.warmup import warmup_runs
from . import feedback

log = logging.getLogger(__name__)

KEY = "unet_compiler"


def _apply_model_wrapper(accel: Accelerator, hooks_epoch: list):
    def unet_compiler_apply_model(executor, *args, **kwargs):
        base = executor.class_obj
        model = getattr(base, "diffusion_model", None)
        if model is not accel.root:
            # another node swapped the diffusion model, or ComfyUI samples another copy of it: as given
            accel.stats["eager_calls"] += 1
            accel.stats["calls_not_ours"] += 1
            why = not_ours(model, accel.root)
            if why not in accel.report.notes:
                accel.report.notes.append(why)
                log.warning("UNet Compiler: %s", why)
            return executor(*args, **kwargs)
        # apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kw)
        to = args[5] if len(args) > 5 else kwargs.get("transformer_options") or {}
        for name in patch_effects(to):
            accel.patches_seen[name] += 1
        epoch = (getattr(base, "current_weight_patches_uuid", None), hooks_epoch[0])
        x = args[0] if args else kwargs.get("x")
        with accel.active(weight_epoch=epoch, shape=label_of(x, latent_scale(base), latent_time_scale(base))):
            return executor(*args, **kwargs)
    unet_compiler_apply_model.accelerator = accel
    return unet_compiler_apply_model


def not_ours(model, root) -> str:
    """Why a sampling call reached the pack's wrapper with ``model`` as the diffusion model instead of
    the one it compiled (``root``): said once in the report and the log."""
    if getattr(model, "_orig_mod", None) is root or type(model).__name__ == "OptimizedModule":
        return ("sampling ran another node's torch.compile of the whole diffusion model (TorchCompileModel), "
                "not the pack's regions. Fix: use one of Compile UNet and TorchCompileModel")
    if root is not None and type(model) is type(root):
        return ("sampling ran a separate copy of the model, which runs its own code: ComfyUI made a plain "
                "ModelPatcher from the Dynamic VRAM one (clone(disable_dynamic=True): TorchCompileModel placed "
                "after Compile UNet, or conditioning with hooks, which ComfyUI samples through "
                "get_non_dynamic_delegate). Fix: none needed for the image; for speed, drop TorchCompileModel "
                "(hooks need the plain patcher)")
    return (f"sampling ran another diffusion model ({type(model).__module__}.{type(model).__qualname__}) that a "
            f"node put in this one's place: it runs as given")


def _described(value) -> str:
    """A value typed into a prompt, as a message names it (cut short)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the text {value[:60] + '…' if len(value) > 60 else value!r}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '…' if len(text) > 60 else text}"


def require_model(model, node: str) -> None:
    """Raise the user's error when ``model`` is not a ComfyUI MODEL. ComfyUI checks the type of a
    link, not a value typed into the prompt in its place (``"model": "v1-5.safetensors"``)."""
    if all(hasattr(model, a) for a in ("clone", "get_model_object", "model_options")):
        return
    raise ValueError(f"{node}: model: got {_described(model)}, not a MODEL. Fix: link a MODEL output to it, "
                     f"e.g. [\"<id of a CheckpointLoaderSimple or UNETLoader node>\", 0] (a file name is not a "
                     f"model: load it with one of those nodes)")


def backend_input_problem(backend) -> str | None:
    """Compile UNet's optional ``backend``: absent, linked (None while ComfyUI validates) or a
    CompileConfig from Select Backend. Anything else is a value typed into the prompt: the message
    says what to link instead."""
    if backend is None or isinstance(backend, CompileConfig):
        return None
    return (f"Compile UNet: backend: got {_described(backend)}, not the output of Select Backend. Fix: link "
            f"[\"<id of a UNetCompiler_SelectBackend node>\", 0] (its backend input takes the name), or leave "
            f"backend out for auto")


def compile_model(model, config: CompileConfig | None, node_id=None):
    """Clone ``model`` and attach the accelerator. Returns (clone, report text).
    The backend and state go to the node's UI (``node_id``) and the log."""
    from comfy.patcher_extension import CallbacksMP, WrappersMP

    config = config or CompileConfig()
    m = model.clone()
    unet = m.get_model_object("diffusion_model")
    accel = Accelerator(unet, config, device=m.load_device)
    hooks_epoch = [0]

    def on_apply_hooks(patcher, hooks):
        # scheduled LoRA hooks rewrite weights in place between steps
        hooks_epoch[0] += 1

    m.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, KEY)
    m.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, _apply_model_wrapper(accel, hooks_epoch))
    for event, callback in ((CallbacksMP.ON_APPLY_HOOKS, on_apply_hooks), *_graph_release(accel)):
        m.remove_callbacks_with_key(event, KEY)
        m.add_callback_with_key(event, KEY, callback)
    facts = feedback.compiled(accel, node_id)
    return m, accel.text() + f"\n  status: {facts['text']}"


def _graph_release(accel) -> list:
    """ComfyUI's callbacks that free the regions' CUDA graph buffers, which its memory accounting
    does not see: when it unloads the model (ON_DETACH with its weights unpatched to the offload
    device; every load_models_gpu also detaches a loaded model with ``unpatch_all=False`` and loads
    it again, weights in place: that keeps the graphs) and, when a prompt's sampling ends
    (ON_CLEANUP, before the VAE decode), only if the card is short of room: otherwise the next
    prompt of this model replays them instead of capturing again. The accelerator is held weakly."""
    from comfy.patcher_extension import CallbacksMP
    ref = weakref.ref(accel)

    def on_detach(patcher, unpatch_all=True):
        a = ref()
        if a is not None and unpatch_all:
            a.release_graphs("ComfyUI unloaded the model")

    def on_cleanup(patcher):
        a = ref()
        if a is not None:
            a.idle_graphs("freed at the end of a prompt")
    return [(CallbacksMP.ON_DETACH, on_detach), (CallbacksMP.ON_CLEANUP, on_cleanup)]


def sampling_transformer_options(model) -> dict:
    """transformer_options as KSampler builds them (the patcher's wrappers and
    callbacks merged in by ComfyUI's own prepare_model_patcher)."""
    import comfy.model_patcher
    import comfy.sampler_helpers
    options = comfy.model_patcher.create_model_options_clone(model.model_options)
    options.setdefault("transformer_options", {})
    comfy.sampler_helpers.prepare_model_patcher(model, {}, options)
    return options["transformer_options"]


def accelerator_of(model) -> Accelerator | None:
    """The accelerator the model's keyed wrapper runs (clones share it: the
    wrapper list is copied, the wrapper function is not)."""
    from comfy.patcher_extension import WrappersMP
    for w in model.get_wrappers(WrappersMP.APPLY_MODEL, KEY):
        accel = getattr(w, "accelerator", None)
        if accel is not None:
            return accel
    return None


def _fn_name(fn) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return name.replace(".<locals>", "")


def patch_effects(transformer_options: dict) -> list[str]:
    """What each patch in this call's transformer_options does to the regions, for the report:
    an attention replace patch runs its own code instead of that attention region; the other
    patches run in ComfyUI's dispatch between regions, which stay accelerated."""
    out = [f"{where} ({_fn_name(fn)}): runs between regions"
           for where, fns in transformer_options.get("patches", {}).items() for fn in fns]
    out += [f"{where} replace ({_fn_name(fn)}): attention at {key} runs the patch's code instead"
            for where, table in transformer_options.get("patches_replace", {}).items() for key, fn in table.items()]
    if "optimized_attention_override" in transformer_options:
        out.append(f"optimized_attention_override ({_fn_name(transformer_options['optimized_attention_override'])}): "
                   f"every attention region runs eager")
    return out


def patch_names(model_options: dict) -> list[str]:
    """The model's sampling-time patches as ``where (function)``, for the report."""
    to = model_options.get("transformer_options", {})
    names = [f"{where} ({_fn_name(fn)})" for where, fns in to.get("patches", {}).items() for fn in fns]
    names += [f"{where} replace {key} ({_fn_name(fn)})"
              for where, table in to.get("patches_replace", {}).items() for key, fn in table.items()]
    if "model_function_wrapper" in model_options:
        names.append(f"model_function_wrapper ({_fn_name(model_options['model_function_wrapper'])})")
    return names


def dit_width(plan) -> int | None:
    """A DiT's hidden width: what its first block's first linear reads."""
    first = next((m for r in plan.regions for m in r.module.modules() if isinstance(m, torch.nn.Linear)), None)
    return getattr(first, "in_features", None)


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

    def __call__(self, shape):
        if not self.patched:
            return self._call(shape, patched=False)
        try:
            return self._call(shape, patched=True)
        except Exception as e:
            if is_interrupt(e) or not self.patches:
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            self.dropped = (f"warmup ran without the model's patches ({', '.join(self.patches)}): outside "
                            f"sampling they raised {type(e).__name__}: {first}"[:400]
                            + ". Sampling applies them as usual; patched regions run eager then.")
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
            c = {k: v.process_cond(batch_size=shape.batch, device=self.device, area=None).cond for k, v in made.items()}
            if "c_crossattn" in c and _fits(unet, x, c):
                return x, c
        except Exception as e:
            if is_interrupt(e):
                raise
            log.debug("UNet Compiler: warmup conditioning from extra_conds failed", exc_info=True)
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


def nothing_runs_compiled(accel):
    """The reason (a Reason) every region of ``accel``'s plan would run the model's own code at its
    next call, as its loaded weights stand (each region has leaves whose per-call weights the pack
    cannot serve: another pack's ops); None when any region would run compiled code."""
    reasons = []
    for region in accel.plan.regions:
        failed = accel.failed.get(region.kind)
        why = cast.plan(region.leaves)[1] or (Reason.of(failed) if failed is not None else None)
        if why is None:
            return None
        reasons.append(why)
    return reasons[0] if reasons else None


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


def whole_videos(accel, shapes, window: int | None = None):
    """(the frames per call warmup gives modules that take whole videos, ``shapes`` less the entries
    they cannot take). Such modules (AnimateDiff's motion modules) need a batch that is a multiple of
    the frames they take per call: ``window`` (sliding context windows, :func:`context_window`) where
    set, else their ``video_length`` as their pack last set it. Each entry left out is said in the
    report with the entry to give instead; (None, shapes) when the model has no such module."""
    accel.inserted.check()
    n = accel.inserted.video_length
    if not n:
        return None, shapes
    n, why = (window, "its context windows") if window else (n, "their video length, as that pack last set it")
    kept = [s for s in shapes if s.batch % n == 0]
    for s in shapes:
        if s.batch % n:
            fix = Shape(2 * n, s.width, s.height, s.frames)
            accel.report.notes.append(
                f"warmup entry {s.label} left out: modules another pack inserted take whole videos of {n} frames "
                f"per call ({why}), so a call's batch is a multiple of {n}. Fix: give {fix.label} (one video, "
                f"cond and uncond) or {n}x{s.width}x{s.height}")
    return n, kept


def warmup_model(model, shapes_text: str, context_tokens: int, node_id=None, background: bool = False):
    """Run the model's real apply_model (wrappers, patches and the sampling
    state they read) for each shape under inference_mode with a cancellable
    ProgressBar. Returns report text. Warmup is a cache primer: a model it
    cannot call outside sampling is reported and passed on, never a failed prompt."""
    import comfy.model_management
    import comfy.utils

    shapes = parse_shapes(shapes_text)   # every size bounded before anything is allocated
    context_tokens = check_context_tokens(context_tokens)
    accel = accelerator_of(model)
    if accel is None:
        raise ValueError("Warmup Shapes: the model was not compiled. Fix: connect the MODEL output of "
                         "Compile UNet to this node's model input.")
    if accel.plan.not_a_unet:
        # nothing was compiled, so there is nothing to prime (and no UNet inputs to build for it)
        done = feedback.WarmupFeedback(accel, shapes, node_id).skipped()
        return accel.text() + f"\n  status: {done['text']}"
    check_frames(shapes, is_video(model.model))
    comfy.model_management.load_models_gpu([model])
    why = nothing_runs_compiled(accel)
    if why is not None:
        # every region's weights are made per call in a way the pack cannot serve (another pack's
        # dequantising ops): probes would only spend eager calls, so none run
        note = f"Warmup Shapes ran no calls: every region runs the model's own code ({why})"
        if note not in accel.report.notes:
            accel.report.notes.append(note)
        done = feedback.WarmupFeedback(accel, shapes, node_id).skipped(why)
        return accel.text() + f"\n  status: {done['text']}"
    frames, kept = whole_videos(accel, shapes, context_window(model))
    if not kept:
        note = (f"no entry's batch is a multiple of the {frames} frames the model's inserted "
                f"modules take per call (see the report's warmup entry lines)")
        done = feedback.WarmupFeedback(accel, shapes, node_id).skipped(note=note)
        return accel.text() + f"\n  status: {done['text']}"
    shapes = kept
    base = model.model
    device = model.load_device
    dtype = base.manual_cast_dtype or base.get_dtype()
    # a shape no setting can run is the user's input to fix, said before the warmup allocates it
    # (on a GPU, ComfyUI offloads weights to make room for activations: those count as room too)
    room, where = comfy.model_management.get_free_memory(device), memory_name(device)
    if device.type == "cuda":
        room += model.loaded_size()
        where += " (free, plus the model's weights ComfyUI can offload)"
    if accel.plan.arch == "dit":
        check_memory(shapes, dit_width(accel.plan), dtype.itemsize, room, where,
                     cell=latent_scale(base) * dit_patch(base.diffusion_model),
                     frames_of=lambda frames: max((1, *latent_frames(base, frames))))
    else:
        check_memory(shapes, first_level_channels(base.diffusion_model), dtype.itemsize, room, where)
    total = len(shapes) + 1
    pbar = comfy.utils.ProgressBar(total, node_id=node_id)
    fb = feedback.WarmupFeedback(accel, shapes, node_id)
    call = SamplingCall(model, context_tokens, device, dtype)

    def tick(i, shape, secs):
        pbar.update_absolute(i + 1, total)
        fb.shape_done(i, shape, secs)

    if background:
        feedback.watch_the_queue()
    fb.start()
    stopped = None
    try:
        with accel.inserted.videos_of(frames):   # the frames per call sampling will give them
            warmup_runs(accel, shapes, fb.wrap(call), on_shape=tick, background=background)
    except Exception as e:
        if is_interrupt(e):
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        note = (f"warmup stopped: this model could not be called outside sampling ({type(e).__name__}: "
                f"{first})"[:400] + "; it compiles on its first KSampler step instead")
        log.warning("UNet Compiler: %s", note, exc_info=True)
        accel.report.notes.append(note)
        stopped = note
    finally:
        fb.close()
        if call.dropped and call.dropped not in accel.report.notes:
            accel.report.notes.append(call.dropped)
    pbar.update_absolute(total, total)
    done = fb.finished(problem=stopped or call.dropped)
    return accel.text() + f"\n  status: {done['text']}"
