"""UNet Compiler: ComfyUI entry point, and the library's top level.

In ComfyUI (>= 0.3.48, where ``comfy_api.latest`` exists) it registers the V3 nodes
(``comfy_entrypoint``) and ``WEB_DIRECTORY``. An older ComfyUI gets one log line and no nodes:
pyproject's ``requires-comfyui`` is that floor, and no older one is tested. Imports cleanly with
no ComfyUI, triton, IPEX or diffusers installed.

As a library: ``from unet_compiler import compile_unet, warmup, report`` (imported on first use,
so ComfyUI's node loading imports nothing more for them).
"""
import logging
import sys

log = logging.getLogger(__name__)

WEB_DIRECTORY = "./web"
MIN_COMFYUI = "0.3.48"
#: the library API, imported from compiler/api.py on first use
_API = ("compile_unet", "warmup", "wait_for_background", "report", "uncompile_unet", "weights_changed")

try:
    from comfy_api.latest import ComfyExtension, io  # noqa: F401
    _V3 = True
except Exception:
    _V3 = False

if not __package__:
    # Imported as a bare file, not as a package (pytest collecting the checkout root when its
    # folder name is not an identifier, e.g. "ci-clone"): nothing to register from here.
    __all__ = ["WEB_DIRECTORY"]
elif _V3:
    from .nodes.v3 import comfy_entrypoint  # noqa: F401

    __all__ = ["comfy_entrypoint", "WEB_DIRECTORY", *_API]
else:
    if "comfy" in sys.modules:  # loaded by a ComfyUI without the V3 node API; standalone use says nothing
        log.warning("ComfyUI too old: UNet Compiler needs >= %s", MIN_COMFYUI)
    __all__ = ["WEB_DIRECTORY", *_API]


def __getattr__(name):
    if name in _API and __package__:
        from .compiler import api
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
