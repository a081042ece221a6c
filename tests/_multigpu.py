"""A CPU stand-in of the newest ComfyUI's multi-GPU Work Units over ComfyUI 0.8.0, which has none.
Each behaviour is read from the newest ComfyUI's files and rewritten, not copied:
``comfy/multigpu.py`` @00d34d92 (comfyanonymous/ComfyUI: ``create_multigpu_deepclones``,
``MultiGPUThreadPool``), ``comfy/model_patcher.py`` @08d0e510 (``deepclone_multigpu``,
``match_multigpu_clones``, ``clone``'s multigpu fields), ``comfy/samplers.py`` @311c0140
(``_calc_cond_batch_multigpu``'s ``_handle_batch``, ``CFGGuider.outer_sample``),
``comfy/sampler_helpers.py`` @53757775 (``_prepare_sampling``,
``prepare_model_patcher_multigpu_clones``), ``comfy/patcher_extension.py`` (the callbacks
``ON_DEEPCLONE_MULTIGPU`` / ``ON_MATCH_MULTIGPU_CLONES``, each called with (main patcher, clone)).

- ``deepclone_multigpu(device)``: a fresh model from the loader (``cached_patcher_init``), cloned
  from the main patcher with that model (its wrappers and callbacks copied, its ``multigpu``
  additional models removed), ``load_device`` the new device; ``ON_DEEPCLONE_MULTIGPU`` fires.
- ``match_multigpu_clones()`` (every sampling's ``_prepare_sampling``): each device's copy is
  cloned again from the main patcher over the copy's own model; ``ON_MATCH_MULTIGPU_CLONES`` fires.
- Sampling (``sample``): the copies loaded beside the main model, a pool of one daemon thread per
  device (the main one included) that sets its current device first, and per step each device's
  share of the conds (``ceil(conds / devices)`` each) run on its thread under ``torch.no_grad()``
  only (a pool thread does not inherit the prompt thread's inference mode) through
  ``model_options["multigpu_clones"][device].model.apply_model`` with the main patcher's
  transformer_options (its wrappers) and ``multigpu_thread_device``; the outputs gathered on the
  prompt thread; then the pool shut down and ``cleanup()`` on the main patcher and every copy.

The devices are CPU devices with distinct indices (``cpu:0``, ``cpu:1``: distinct keys, the same
memory); ``set_torch_device`` records the thread's device (and sets a faked torch.cuda's).
Left out: load balancing by relative speed, hooks and ControlNet copies per device, the
``model_function_wrapper`` path, Dynamic VRAM per device.
"""
from __future__ import annotations

import math
import queue
import threading
import uuid

import torch

from ._fake_cuda import FakeCUDA

DEVICES = (torch.device("cpu", 0), torch.device("cpu", 1))
ON_DEEPCLONE = "on_deepclone_multigpu"
ON_MATCH = "on_match_multigpu_clones"

_CURRENT = threading.local()


def set_torch_device(device: torch.device) -> None:
    """A pool thread's ``torch.cuda.set_device(device)``: recorded, and passed on to a faked
    torch.cuda (tests/_fake_cuda.py) as the thread's current device."""
    _CURRENT.device = device
    if isinstance(getattr(torch.cuda.set_device, "__self__", None), FakeCUDA):
        torch.cuda.set_device(device)


def install(comfy, monkeypatch) -> None:
    """The newest ComfyUI's callback names on this ComfyUI's ``CallbacksMP``."""
    import comfy.patcher_extension as pe
    monkeypatch.setattr(pe.CallbacksMP, "ON_DEEPCLONE_MULTIGPU", ON_DEEPCLONE, raising=False)
    monkeypatch.setattr(pe.CallbacksMP, "ON_MATCH_MULTIGPU_CLONES", ON_MATCH, raising=False)


def patcher_class(comfy):
    """The newest ``ModelPatcher``'s multi-GPU surface as a subclass of this ComfyUI's."""
    import comfy.model_patcher as mp

    class MultiGPUPatcher(mp.ModelPatcher):
        is_multigpu_base_clone = False
        cached_patcher_init = None

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.clone_base_uuid = uuid.uuid4()

        def clone(self, model_override=None):
            n = super().clone()
            if model_override is not None:
                n.model = model_override[0]
                n.backup, n.object_patches_backup, n.pinned = model_override[1]
            n.cached_patcher_init = self.cached_patcher_init
            n.is_multigpu_base_clone = self.is_multigpu_base_clone
            n.clone_base_uuid = self.clone_base_uuid
            return n

        def deepclone_multigpu(self, new_load_device=None):
            if self.cached_patcher_init is None:
                raise RuntimeError("Cannot create multigpu deepclone: cached_patcher_init is not initialized")
            fresh = self.cached_patcher_init()
            n = self.clone(model_override=(fresh.model, ({}, {}, set())))
            n.hook_backup = {}
            if new_load_device is not None:
                n.load_device = new_load_device
            n.remove_additional_models("multigpu")
            for callback in self.get_all_callbacks(ON_DEEPCLONE):
                callback(self, n)
            return n

        def match_multigpu_clones(self):
            copies = self.get_additional_models_with_key("multigpu")
            if not copies:
                return
            matched = []
            for mm in copies:
                n = self.clone(model_override=(mm.model, (mm.backup, mm.object_patches_backup, mm.pinned)))
                n.load_device = mm.load_device
                n.hook_backup = mm.hook_backup
                n.is_multigpu_base_clone = mm.is_multigpu_base_clone
                n.remove_additional_models("multigpu")
                for callback in self.get_all_callbacks(ON_MATCH):
                    callback(self, n)
                matched.append(n)
            self.set_additional_models("multigpu", matched)

    return MultiGPUPatcher


def make(comfy, mp, reload):
    """A multi-GPU capable patcher over ``mp``'s model; ``reload()`` loads the checkpoint again."""
    cls = patcher_class(comfy)
    p = cls(mp.model, DEVICES[0], mp.offload_device, mp.model_size())
    p.cached_patcher_init = reload
    return p


def create_multigpu_deepclones(model, max_gpus: int = len(DEVICES)):
    """The MultiGPU Work Units node: a clone of ``model`` with a deep copy per extra device."""
    model = model.clone()
    have = {m.load_device for m in model.get_additional_models_with_key("multigpu")}
    extra = [d for d in DEVICES if d != model.load_device][:max_gpus - 1]
    for device in extra:
        if device in have:
            continue
        copy = model.deepclone_multigpu(new_load_device=device)
        copy.is_multigpu_base_clone = True
        copies = model.get_additional_models_with_key("multigpu")
        copies.append(copy)
        model.set_additional_models("multigpu", copies)
    model.match_multigpu_clones()
    return model


class ThreadPool:
    """``MultiGPUThreadPool``: one daemon thread per device, each setting its device first."""

    def __init__(self, devices):
        self.work = {d: queue.Queue() for d in devices}
        self.results = {d: queue.Queue() for d in devices}
        self.threads = [threading.Thread(target=self._loop, args=(d,), daemon=True) for d in devices]
        for t in self.threads:
            t.start()

    def _loop(self, device):
        set_torch_device(device)
        while True:
            item = self.work[device].get()
            if item is None:
                return
            fn, args = item
            try:
                self.results[device].put((fn(*args), None))
            except Exception as e:
                self.results[device].put((None, e))

    def submit(self, device, fn, *args):
        self.work[device].put((fn, args))

    def get_result(self, device):
        return self.results[device].get()

    def shutdown(self):
        for q in self.work.values():
            q.put(None)
        for t in self.threads:
            t.join(timeout=5.0)


def sample(model, conds: list, x: torch.Tensor, t: torch.Tensor, steps: int = 1, grad_mode=torch.no_grad) -> list:
    """``steps`` steps of the multi-GPU sampling path: ``conds`` (each a cross-attention context of
    batch ``x``'s) spread over the devices, each device's share run on its pool thread under
    ``grad_mode`` (ComfyUI's: ``torch.no_grad``). Returns per step the outputs in ``conds``' order."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sampler_helpers
    model.match_multigpu_clones()                                          # _prepare_sampling
    loaded = model.get_nested_additional_models()
    mm.load_models_gpu([model] + loaded)
    clones = {model.load_device: model}                                    # prepare_model_patcher_multigpu_clones
    clones.update({p.load_device: p for p in loaded if p.is_multigpu_base_clone})
    options = comfy.model_patcher.create_model_options_clone(model.model_options)
    options.setdefault("transformer_options", {})
    comfy.sampler_helpers.prepare_model_patcher(model, {}, options)        # (the main patcher's wrappers)
    devices = list(clones)
    pool = ThreadPool(devices) if len(devices) > 1 else None
    out = []
    try:
        for p in clones.values():
            p.pre_run()
        per_device = max(1, math.ceil(len(conds) / len(devices)))

        def handle(device, share):
            set_torch_device(device)
            base = clones[device].model
            results = []
            with grad_mode():
                for i in share:
                    to = comfy.model_patcher.create_model_options_clone(options)["transformer_options"]
                    to["multigpu_thread_device"] = device
                    results.append((i, base.apply_model(x.to(device), t.to(device), c_crossattn=conds[i].to(device),
                                                        transformer_options=to)))
            return results
        shares = {d: list(range(len(conds)))[k * per_device:(k + 1) * per_device] for k, d in enumerate(devices)}
        for _ in range(steps):
            got = {}
            if pool is None:
                got.update(handle(devices[0], shares[devices[0]]))
            else:
                for device, share in shares.items():
                    pool.submit(device, handle, device, share)
                for device in shares:
                    results, error = pool.get_result(device)
                    if error is not None:
                        raise error
                    got.update(results)
            out.append([got[i] for i in range(len(conds))])
    finally:
        if pool is not None:
            pool.shutdown()
        for p in clones.values():
            p.cleanup()
    return out
