"""UNet Compiler: ComfyUI entry point.

Registers the nodes as V3 (``comfy_entrypoint``) when ``comfy_api.latest``
exists, V1 ``NODE_CLASS_MAPPINGS`` otherwise, never both. Imports cleanly
with no ComfyUI, triton, IPEX or diffusers installed.
"""
import logging

log = logging.getLogger(__name__)

WEB_DIRECTORY = "./web"

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

    __all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
else:
    from .nodes.v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: F401

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
