"""diffusers class resolution for both package layouts.

diffusers moved its UNet blocks from ``diffusers.models.unet_2d_blocks``
(<=0.28, removed in 0.29) to ``diffusers.models.unets.unet_2d_blocks``
(0.26+). Everything else in the pack asks this module, never diffusers
directly. Nothing here imports diffusers unless the caller hands us a module
that already came from it, so a missing or broken diffusers never blocks
node registration.
"""
from __future__ import annotations

import importlib
import logging
import sys
from functools import lru_cache

log = logging.getLogger(__name__)

_BLOCK_MODULES = ("diffusers.models.unets.unet_2d_blocks", "diffusers.models.unet_2d_blocks")
_UNET_MODULES = ("diffusers.models.unets.unet_2d_condition", "diffusers.models.unet_2d_condition")


def _first_attr(modules, name):
    for mod in modules:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
        except Exception:  # a half-installed diffusers raises all sorts at import
            log.debug("importing %s failed", mod, exc_info=True)
            continue
    return None


@lru_cache(maxsize=None)
def classes() -> dict:
    """The diffusers classes the planner matches, or {} when diffusers is absent.

    Keys: ResnetBlock2D, Attention, FeedForward, BasicTransformerBlock,
    UNet2DConditionModel, CrossAttnDownBlock2D (from the blocks module, which
    proves which layout is installed), AttnProcessor2_0, AttnProcessor.
    """
    if "diffusers" not in sys.modules:
        try:
            importlib.import_module("diffusers")
        except Exception:
            return {}
    out = {
        "UNet2DConditionModel": _first_attr(_UNET_MODULES, "UNet2DConditionModel"),
        "CrossAttnDownBlock2D": _first_attr(_BLOCK_MODULES, "CrossAttnDownBlock2D"),
        "ResnetBlock2D": _first_attr(("diffusers.models.resnet",), "ResnetBlock2D"),
        "Attention": _first_attr(("diffusers.models.attention_processor",), "Attention"),
        "AttnProcessor2_0": _first_attr(("diffusers.models.attention_processor",), "AttnProcessor2_0"),
        "AttnProcessor": _first_attr(("diffusers.models.attention_processor",), "AttnProcessor"),
        "FeedForward": _first_attr(("diffusers.models.attention",), "FeedForward"),
        "BasicTransformerBlock": _first_attr(("diffusers.models.attention",), "BasicTransformerBlock"),
    }
    return {k: v for k, v in out.items() if v is not None}


def is_diffusers_unet(module) -> bool:
    cls = classes().get("UNet2DConditionModel") if type(module).__module__.startswith("diffusers") else None
    return cls is not None and isinstance(module, cls)
