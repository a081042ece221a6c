"""UNet Compiler core: framework-agnostic planning, backends and runtime.

Public API::

    from unet_compiler.compiler import compile_unet, warmup
    unet = compile_unet(unet, backend="auto")
    print(warmup(unet, "1x512x512, 2x512x512"))
"""
from .api import accelerator_of, compile_unet, report, uncompile_unet, wait_for_background, warmup, weights_changed
from .config import DISABLE_ENV, CompileConfig

__all__ = ["compile_unet", "warmup", "wait_for_background", "uncompile_unet", "report", "accelerator_of", "CompileConfig", "DISABLE_ENV",
           "weights_changed"]
