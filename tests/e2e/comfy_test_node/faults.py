"""Faults injected into the running ComfyUI server by a test-only node (tests/e2e/test_faults_server.py).

``UNetCompilerTest_InjectFault`` takes a MODEL and a fault name and returns a clone. Placed before
Compile UNet, the fault reaches the model that Compile UNet builds; it patches the pack's modules
(found through the registered Compile UNet node, so the copy ComfyUI loaded) only while the prompt
that ran it executes: every patch is undone when that prompt ends and again before the next starts
(``PromptExecutor.execute_async`` is wrapped at import), so no fault outlives its prompt. What the
faulty accelerator took into itself (a region implementation) stays with that model, which only
prompts holding the same fault node (ComfyUI caches by inputs) ever get.

The pack has no test hook for any of this: the node replaces what the pack's code calls.
"""
from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

KEY = "unet_compiler_test_fault"
#: fault -> what it does (the node's combo, and the tooltip)
FAULTS = {
    "none": "nothing (a fresh clone: makes the nodes after it run again)",
    "compile_error": "the region kind's compile raises inside dynamo (its compiler backend fails), at its first call",
    "kernel_error": "the region kind's compiled code raises a RuntimeError at run time, during sampling only",
    "oom": "the region kind raises torch.OutOfMemoryError at run time, during sampling only",
    "slow_sampling": "during sampling each call of the region kind waits 0.1 s, then checks ComfyUI's cancel "
                     "there (as ComfyUI's eager ops do); the first call writes the marker file",
    "cache_corrupt": "the compile cache entry this model reads holds garbage its .json does not vouch for",
    "cache_vouched_garbage": "the compile cache entry holds garbage with a .json vouching for it (reaches torch's loader)",
    "lowvram": "ComfyUI loads the model partially (a --lowvram / --novram offload): most weights are cast per call",
}
REGIONS = ("resblock", "attention", "feedforward")

_undo: list = []


def undo_all() -> None:
    while _undo:
        fn = _undo.pop()
        try:
            fn()
        except Exception:
            log.exception("unet_compiler_test_node: undoing a fault failed")


def _patch(obj, name, value) -> None:
    old = obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name, _MISSING)
    setattr(obj, name, value)

    def restore():
        if old is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, old)
    _undo.append(restore)


_MISSING = object()


def _install_prompt_scope() -> None:
    """Undo every fault when a prompt ends (and before one starts, should one have leaked)."""
    try:
        import execution
    except Exception:  # not inside a ComfyUI server
        return
    cls = execution.PromptExecutor
    if getattr(cls.execute_async, "unet_compiler_test_scope", False):
        return
    original = cls.execute_async

    @functools.wraps(original)
    async def execute_async(self, *args, **kwargs):
        undo_all()
        try:
            return await original(self, *args, **kwargs)
        finally:
            undo_all()
    execute_async.unet_compiler_test_scope = True
    cls.execute_async = execute_async


_install_prompt_scope()


def pack(module: str):
    """``<the pack as ComfyUI loaded it>.<module>`` (its own copy, not ``unet_compiler`` on sys.path)."""
    import nodes
    cls = nodes.NODE_CLASS_MAPPINGS["UNetCompiler_CompileUNet"]
    root = cls.__module__.rsplit(".nodes.", 1)[0]
    return importlib.import_module(f"{root}.{module}")


# ---- region implementations ---------------------------------------------------------------
def _wrap_impls(wrap) -> None:
    """For this prompt, every backend's ``impls`` hands ``wrap(key, impl)`` out instead of each impl."""
    backends = pack("compiler.backends")
    for name in backends.names():
        cls = backends.lookup_backend(name)
        if "impls" not in cls.__dict__:
            continue
        original = cls.__dict__["impls"]

        def impls(self, config, scheduler, _original=original):
            return {key: wrap(key, impl) for key, impl in _original(self, config, scheduler).items()}
        _patch(cls, "impls", impls)


def _failing_compiler_backend(gm, example_inputs):
    raise RuntimeError("injected compile error: the C++ compiler exited with status 1 on this region's kernel")


def _region_fault(fault: str, region: str, sampling: dict, marker: str):
    import torch
    regions = pack("compiler.regions")

    def wrap(key, impl):
        if key[1] != region:
            return impl
        if fault == "compile_error":
            body = regions.BODIES.get(key)
            if body is None:
                return impl

            def injected_region(module, *args):
                return body(module, *args)
            return torch.compile(injected_region, backend=_failing_compiler_backend)

        def faulty(module, *args):
            if sampling["on"]:
                if fault == "kernel_error":
                    raise RuntimeError("injected kernel error: an illegal memory access was encountered")
                if fault == "oom":
                    raise torch.OutOfMemoryError("injected: CPU out of memory. Tried to allocate 2.00 GiB")
                if fault == "slow_sampling":
                    import comfy.model_management
                    if marker and not os.path.exists(marker):
                        Path(marker).write_text(str(time.time()))
                    time.sleep(0.1)
                    comfy.model_management.throw_exception_if_processing_interrupted()
            return impl(module, *args)
        return faulty
    _wrap_impls(wrap)


# ---- compile cache ----------------------------------------------------------------------------
def _cache_fault(fault: str, folder: str) -> None:
    """The entry this model's cache reads, in ``folder``, written just before the pack reads it:
    garbage, with a .json of another content (corrupt) or one that vouches for it (reaches torch's
    loader)."""
    import hashlib
    cache = pack("compiler.cache")
    original = cache.CompileCache.__dict__["load"]

    def load(self):
        if self.enabled:
            self.folder = Path(folder)
            garbage = os.urandom(4096)
            bin_path, meta_path = self.paths
            self.folder.mkdir(parents=True, exist_ok=True)
            bin_path.write_bytes(garbage)
            vouched = hashlib.sha256(garbage).hexdigest() if fault == "cache_vouched_garbage" else "0" * 64
            meta_path.write_text(json.dumps({**self.facts, "key": self.key, "size": len(garbage), "sha256": vouched}))
            # as a fresh process would: the entry is read from disk, not taken as loaded already
            pack("compiler.cache.entry")._loaded.discard(self.key)
        return original(self)
    _patch(cache.CompileCache, "load", load)


# ---- model loading ----------------------------------------------------------------------------
def _lowvram() -> None:
    """ComfyUI loads models partially (64 MiB on the device, the rest cast per call), as it does with
    --lowvram / --novram on a GPU (on --cpu those flags change nothing: model_management loads a CPU
    model fully). Models loaded before are unloaded first and again when the prompt ends."""
    import comfy.model_management as mm
    mm.unload_all_models()
    original = mm.LoadedModel.__dict__["model_load"]

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        return original(self, 64 * 2**20, force_patch_weights=force_patch_weights)
    _patch(mm.LoadedModel, "model_load", model_load)
    _undo.insert(0, mm.unload_all_models)   # runs last, after model_load is restored


class InjectFault:
    @classmethod
    def INPUT_TYPES(cls):  # noqa: N802 - ComfyUI's name
        return {"required": {
            "model": ("MODEL",),
            "fault": (list(FAULTS), {"tooltip": "; ".join(f"{k}: {v}" for k, v in FAULTS.items())}),
            "region": (list(REGIONS), {"tooltip": "the region kind a region fault hits"}),
        }, "optional": {
            "marker": ("STRING", {"default": "", "tooltip": "slow_sampling: the file written at the first slowed "
                                                            "call; cache faults: the compile cache folder"}),
            "nonce": ("STRING", {"default": "", "tooltip": "ignored: a new value makes this node and those after it run"}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "inject"
    CATEGORY = "testing"

    def inject(self, model, fault, region, marker="", nonce=""):
        from comfy.patcher_extension import WrappersMP
        m = model.clone()
        sampling = {"on": False}

        def outer_sample(executor, *args, **kwargs):
            sampling["on"] = True
            try:
                return executor(*args, **kwargs)
            finally:
                sampling["on"] = False
        m.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, KEY)
        m.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, KEY, outer_sample)
        if fault in ("compile_error", "kernel_error", "oom", "slow_sampling"):
            _region_fault(fault, region, sampling, marker)
        elif fault in ("cache_corrupt", "cache_vouched_garbage"):
            _cache_fault(fault, marker)
        elif fault == "lowvram":
            _lowvram()
        log.info("unet_compiler_test_node: fault %s (%s) injected for this prompt", fault, region)
        return (m,)

