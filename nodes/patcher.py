"""ComfyUI ModelPatcher glue behind the V3 nodes (nodes/v3.py).

The shared model is never mutated: Compile UNet clones the patcher and
adds one keyed APPLY_MODEL wrapper (plus ON_APPLY_HOOKS, ON_DETACH and ON_CLEANUP callbacks); the
wrapper swaps region forwards in for one apply_model call and restores them
in ``finally`` (runtime.Accelerator.active).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref

import torch

from ..compiler.api import (GRAD_ON, Accelerator, CompileConfig, check_context_tokens, error_summary, is_interrupt,
                            label_of,
                            latent_scale, latent_time_scale, parse_shapes, warmup_runs)
from . import feedback, warmup
from .warmup import fn_name

log = logging.getLogger(__name__)

KEY = "unet_compiler"


class DeviceCopies:
    """The accelerators of the copies of a compiled model that ComfyUI's multi-GPU Work Units sample
    on other devices (each a deep copy of the diffusion model with its own load device), one per
    copy, found by the module it serves. Each is built with the compiled model's settings on its
    copy's device when ComfyUI makes or matches the copy (``ON_DEEPCLONE_MULTIGPU`` /
    ``ON_MATCH_MULTIGPU_CLONES``, on the prompt thread), or at the copy's first call where those
    callbacks did not run; under a lock, once per module. Compiles run one at a time (dynamo's own
    lock); each copy keeps its own CUDA graphs, stats and report."""

    def __init__(self, main: Accelerator):
        self._main = weakref.ref(main)
        #: copy module -> weakref to its accelerator, which the module holds (``_Held``): a copy
        #: ComfyUI drops goes with its accelerator, nothing here keeping either
        self._by_module: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._turns = threading.Condition()
        self._sharing, self._alone = 0, False
        #: (accelerator id, shape label) calls that completed: later ones compile nothing
        self._done: set = set()
        main.copies = self

    def adopt(self, patcher) -> Accelerator | None:
        """The accelerator of ``patcher``'s diffusion model: the compiled model's own, or its copy's
        (built now if new); None when the compiled model is gone or the patcher has no model."""
        main, unet = self._main(), _unet_of(patcher)
        if main is None or unet is None:
            return None
        if unet is main.root:
            return main
        with self._lock:
            ref = self._by_module.get(unet)
            accel = ref() if ref is not None else None
            if accel is None:
                # (not warmed: its first call at each shape compiles, or reuses the compiled model's
                # code where dynamo's guards pass, and runs alone: ``turn``)
                accel = Accelerator(unet, main.config, device=patcher.load_device, scheduler=main.scheduler)
                unet.__dict__[_HELD] = _Held(accel)
                self._by_module[unet] = weakref.ref(accel)
                log.info("UNet Compiler: accelerating the copy of the model on %s (ComfyUI's multi-GPU)",
                         patcher.load_device)
        return accel

    def of(self, unet) -> Accelerator | None:
        with self._lock:
            ref = self._by_module.get(unet) if unet is not None else None
        return ref() if ref is not None else None

    @contextlib.contextmanager
    def turn(self, accel: Accelerator, shape: str):
        """Where copies sample on several threads: a device's first call at a shape (which may
        compile) runs alone, the others together. torch's FX tracing flag is process-wide, so a
        compiled call on one thread while another compiles would fail ("using FX to symbolically
        trace a dynamo-optimized function")."""
        key = (id(accel), shape)
        alone = key not in self._done
        with self._turns:
            while self._alone or (alone and self._sharing):
                self._turns.wait()
            if alone:
                self._alone = True
            else:
                self._sharing += 1
        try:
            yield
            if alone:
                self._done.add(key)
        finally:
            with self._turns:
                if alone:
                    self._alone = False
                else:
                    self._sharing -= 1
                self._turns.notify_all()

    def serving(self, unet) -> Accelerator | None:
        """The accelerator already serving the diffusion model ``unet`` (the compiled model's or a
        copy's), else None."""
        main = self._main()
        if main is None or unet is None:
            return None
        return main if unet is main.root else self.of(unet)

    def find(self, patcher) -> Accelerator | None:
        """:meth:`serving` ``patcher``'s diffusion model."""
        return self.serving(_unet_of(patcher))

    def several(self) -> bool:
        """Whether any copy on another device has an accelerator (several threads may sample)."""
        return len(self._by_module) > 0

    def accelerators(self) -> list[Accelerator]:
        with self._lock:
            refs = list(self._by_module.values())
        return [a for a in (r() for r in refs) if a is not None]


_HELD = "_unet_compiler_copy"


def _unet_of(patcher):
    return getattr(getattr(patcher, "model", None), "diffusion_model", None)


class _Held:
    """A copy's accelerator, held by the copy's module (gone with it); a deep copy of the module
    (another node's) gets none."""

    def __init__(self, accel: Accelerator):
        self.accel = accel

    def __deepcopy__(self, memo):
        return None


def _multigpu_copy(base):
    """The patcher sampling ``base`` (a BaseModel) when it is one of ComfyUI's multi-GPU copies."""
    patcher = getattr(base, "current_patcher", None)
    return patcher if getattr(patcher, "is_multigpu_base_clone", False) else None




def _apply_model_wrapper(accel: Accelerator, hooks_epoch: list, copies: DeviceCopies):
    def unet_compiler_apply_model(executor, *args, **kwargs):
        if torch.is_grad_enabled():
            # training (ComfyUI's Train LoRA on a clone of this model) or gradient guidance: the
            # compiled code is for inference (its custom ops have no backward)
            accel.passed_by(GRAD_ON)
            return executor(*args, **kwargs)
        base = executor.class_obj
        model = getattr(base, "diffusion_model", None)
        here = copies.serving(model)
        if here is None and model is not None:
            copy = _multigpu_copy(base)
            if copy is not None:
                here = copies.adopt(copy)                  # a copy made where the callbacks did not run
        if here is None:
            # another node swapped the diffusion model, or ComfyUI samples another copy of it: as given
            why = not_ours(model, accel.root)
            if accel.passed_by(why):
                log.warning("UNet Compiler: %s", why)
            return executor(*args, **kwargs)
        # apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kw)
        to = args[5] if len(args) > 5 else kwargs.get("transformer_options") or {}
        for name in patch_effects(to):
            here.patches_seen[name] += 1
        # what the weights are now: the LoRA patches, the hooks applied (a callback) and the sampling
        # patcher's current hooks (ComfyUI puts hook weights back in place without a callback: at a
        # keyframe change, and at each prompt's cleanup, below)
        sampling = getattr(base, "current_patcher", None)
        epoch = (getattr(base, "current_weight_patches_uuid", None), hooks_epoch[0],
                 id(getattr(sampling, "current_hooks", None)))
        x = args[0] if args else kwargs.get("x")
        shape = label_of(x, latent_scale(base), latent_time_scale(base))
        # a call under plain no_grad (a multi-GPU pool thread does not inherit the prompt's inference
        # mode) runs as warmup compiled for: in inference mode, on inference tensors (the inputs that
        # thread made, copied), its outputs handed back as normal tensors
        plain = not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        with (copies.turn(here, shape) if copies.several() else contextlib.nullcontext(),
              torch.inference_mode() if plain else contextlib.nullcontext(),
              here.active(weight_epoch=epoch, shape=shape)):
            if plain:
                args, kwargs = _as_inference(args, kwargs)
            out = executor(*args, **kwargs)
        return (torch.utils._pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, out)
                if plain else out)
    unet_compiler_apply_model.accelerator = accel
    unet_compiler_apply_model.copies = copies
    return unet_compiler_apply_model


def _as_inference(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """apply_model's inputs with each tensor that is not an inference tensor copied as one (inside
    inference mode); transformer_options as it is. The compiled code's guards tell the two apart:
    a normal tensor where warmup had an inference tensor would compile the regions again."""
    def inference(v):
        return v.clone() if isinstance(v, torch.Tensor) and not v.is_inference() else v
    tree_map = torch.utils._pytree.tree_map
    return (tuple(a if i == 5 else tree_map(inference, a) for i, a in enumerate(args)),
            {k: v if k == "transformer_options" else tree_map(inference, v) for k, v in kwargs.items()})


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


def compile_model(model, config: CompileConfig | None, node_id=None) -> tuple:
    """Clone ``model`` and attach the accelerator. Returns (clone, report text).
    The backend and state go to the node's UI (``node_id``) and the log."""
    from comfy.patcher_extension import CallbacksMP, WrappersMP

    config = config or CompileConfig()
    m = model.clone()
    unet = m.get_model_object("diffusion_model")
    accel = Accelerator(unet, config, device=m.load_device)
    hooks_epoch, hooked = [0], [False]

    def on_apply_hooks(patcher, hooks=None):
        # scheduled LoRA hooks rewrite weights in place between steps (copy_to_param: no version
        # counter moves)
        hooks_epoch[0] += 1
        hooked[0] = True

    def on_cleanup(patcher):
        # a prompt's cleanup puts hooked weights back in place without applying hooks; a prompt that
        # applied none leaves them (every prompt's cleanup re-packed every conv weight: 3-5 s for SD1.5
        # on a CPU)
        if hooked[0]:
            hooks_epoch[0] += 1
            hooked[0] = False

    copies = DeviceCopies(accel)
    m.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, KEY)
    m.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, _apply_model_wrapper(accel, hooks_epoch, copies))
    callbacks = [(CallbacksMP.ON_APPLY_HOOKS, on_apply_hooks), (CallbacksMP.ON_CLEANUP, on_cleanup),
                 *_graph_release(copies), *_copy_callbacks(CallbacksMP, copies)]
    for event in {event for event, _ in callbacks}:       # (an event may take several)
        m.remove_callbacks_with_key(event, KEY)
    for event, callback in callbacks:
        m.add_callback_with_key(event, KEY, callback)
    for copy in _existing_copies(m):                       # MultiGPU Work Units placed before Compile UNet
        copies.adopt(copy)
    facts = feedback.compiled(accel, node_id)
    return m, accel.text() + f"\n  status: {facts['text']}"


def _graph_release(copies: DeviceCopies) -> list:
    """ComfyUI's callbacks that free the regions' CUDA graph buffers, which its memory accounting
    does not see: when it unloads the model (ON_DETACH with its weights unpatched to the offload
    device; every load_models_gpu also detaches a loaded model with ``unpatch_all=False`` and loads
    it again, weights in place: that keeps the graphs) and, when a prompt's sampling ends
    (ON_CLEANUP, before the VAE decode), only if the card is short of room: otherwise the next
    prompt of this model replays them instead of capturing again. Each acts on the accelerator of
    the patcher it is called with (a multi-GPU copy's patcher carries the same callbacks)."""
    from comfy.patcher_extension import CallbacksMP

    def on_detach(patcher, unpatch_all=True):
        a = copies.find(patcher)
        if a is not None and unpatch_all:
            a.release_graphs("ComfyUI unloaded the model")

    def on_cleanup(patcher):
        a = copies.find(patcher)
        if a is not None:
            a.prompt_ended("freed at the end of a prompt")
    return [(CallbacksMP.ON_DETACH, on_detach), (CallbacksMP.ON_CLEANUP, on_cleanup)]


def _copy_callbacks(callbacks_mp, copies: DeviceCopies) -> list:
    """The newest ComfyUI's callbacks for a multi-GPU copy made or matched (none on an older one)."""
    def on_copy(main, copy):
        copies.adopt(copy)
    return [(getattr(callbacks_mp, name), on_copy) for name in ("ON_DEEPCLONE_MULTIGPU", "ON_MATCH_MULTIGPU_CLONES")
            if hasattr(callbacks_mp, name)]


def _existing_copies(patcher) -> list:
    get = getattr(patcher, "get_additional_models_with_key", None)
    return list(get("multigpu")) if get is not None else []


def accelerator_of(model) -> Accelerator | None:
    """The accelerator the model's keyed wrapper runs (clones share it: the
    wrapper list is copied, the wrapper function is not)."""
    from comfy.patcher_extension import WrappersMP
    for w in model.get_wrappers(WrappersMP.APPLY_MODEL, KEY):
        accel = getattr(w, "accelerator", None)
        if accel is not None:
            return accel
    return None


def patch_effects(transformer_options: dict) -> list[str]:
    """What each patch in this call's transformer_options does to the regions, for the report:
    an attention replace patch runs its own code instead of that attention region; the other
    patches run in ComfyUI's dispatch between regions, which stay accelerated."""
    out = [f"{where} ({fn_name(fn)}): runs between regions"
           for where, fns in transformer_options.get("patches", {}).items() for fn in fns]
    out += [f"{where} replace ({fn_name(fn)}): attention at {key} runs the patch's code instead"
            for where, table in transformer_options.get("patches_replace", {}).items() for key, fn in table.items()]
    if "optimized_attention_override" in transformer_options:
        out.append(f"optimized_attention_override ({fn_name(transformer_options['optimized_attention_override'])}): "
                   f"every attention region runs the model's own code")
    return out


def warmup_model(model, shapes_text: str, context_tokens: int, node_id=None, background: bool = False) -> str:
    """Run the model's real apply_model (wrappers, patches and the sampling
    state they read) for each shape under inference_mode with a cancellable
    ProgressBar. Returns report text. Warmup is a cache primer: a model it
    cannot call outside sampling is reported and passed on, never a failed prompt."""
    shapes = parse_shapes(shapes_text)   # every size bounded before anything is allocated
    background = bool(background)        # (a prompt sent to /prompt may give 0 / 1)
    context_tokens = check_context_tokens(context_tokens)
    accel = accelerator_of(model)
    if accel is None:
        raise ValueError("Warmup Shapes: the model was not compiled. Fix: connect the MODEL output of "
                         "Compile UNet to this node's model input.")
    job = warmup.prepare(model, accel, shapes, context_tokens)
    fb = feedback.WarmupFeedback(accel, job.shapes, node_id)
    if job.call is None:
        done = fb.skipped(job.why, note=job.note)
        return accel.text() + f"\n  status: {done['text']}"
    with fb.running(job.call, background) as run_one:
        try:
            warmup_runs(accel, job.shapes, run_one, background=background)
            _warm_copies(model, accel, shapes, context_tokens, background)
        except Exception as e:
            if is_interrupt(e):
                raise
            fb.problem = (f"warmup stopped: this model could not be called outside sampling ({error_summary(e)})"[:400]
                          + "; it compiles on its first KSampler step instead")
            log.warning("UNet Compiler: %s", fb.problem, exc_info=True)
            accel.note(fb.problem)
    return accel.text() + f"\n  status: {fb.done['text']}"


def _warm_copies(model, accel, shapes, context_tokens: int, background: bool) -> None:
    """Warmup Shapes on each multi-GPU copy ComfyUI holds of ``model`` now, matched to ``model`` as
    sampling matches them: the copy's own calls at the same shapes with its device current (its
    graphs and kernels take that device's streams), compared against the copy's own code as the
    model's are. A copy made later, or any copy under a background warmup, compiles at its first
    call of each shape (alone: ``DeviceCopies.turn``). A copy whose warmup fails is said in the
    report and compiles at its first step instead; the others and the prompt go on (a cancel or out
    of memory propagates, as from the model's own warmup)."""
    if not _existing_copies(model):
        return
    if background:
        accel.note("the multi-GPU copies on other devices compile at their first call of each "
                          "shape: a background warmup warms this device's model only")
        return
    match = getattr(model, "match_multigpu_clones", None)
    if match is not None:             # (as sampling does first: each copy's patcher carries this one's wrappers)
        match()
    for copy in [c for c in _existing_copies(model) if c.model is not None]:
        here = accel.copies.adopt(copy)
        if here is None or here is accel:
            continue
        try:
            job = warmup.prepare(copy, here, shapes, context_tokens)
            if job.call is not None:
                with current_device(copy.load_device):
                    warmup_runs(here, job.shapes, job.call)
        except Exception as e:
            if is_interrupt(e):
                raise
            note = (f"warmup of the copy on {copy.load_device} stopped ({error_summary(e)})"[:300]
                    + ": it compiles at its first step instead")
            log.warning("UNet Compiler: %s", note, exc_info=True)
            accel.note(note)


def current_device(device: torch.device):
    """``device`` the thread's current CUDA device for the block (a no-op for another kind)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
