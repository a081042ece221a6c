"""CPU convolution with a oneDNN-prepacked weight, kept live.

Pattern: a 2-D convolution (``torch.conv2d`` in a dynamo graph, or an ``nn.Conv2d`` called
eagerly) on CPU fp32 tensors. Replacement: ``unet_compiler::conv2d_prepacked``, which reorders
the weight into oneDNN's blocked layout once and reuses it. Weights are live: the packed copy
is a cache keyed on the weight (identity, storage, shape, dtype, version counter) and the
weight epoch, re-packed before the conv when any changed. The op is opaque to inductor, so
the weight stays a graph input (never a constant).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from typing import Optional

import torch

from .. import weights
from . import example_value, replace_calls
from ..compat import comfy as comfy_compat
from ..compat.torch_version import autocast_dtype, mkldnn_conv_available

log = logging.getLogger(__name__)

#: how often each part of this pass fired (tests read it)
stats: Counter = Counter()

_cache = weights.DerivedCache(stats)


_PRIMING = threading.local()


@contextlib.contextmanager
def keeping_packed():
    """Inside (this thread only), a weight already packed for another input size runs with that
    copy: a priming call (the compile thread's first call of a variant), whose output nobody
    uses, must not re-pack the copy sampling packed for its own size (a range's recorded sizes
    did: the first compiled prompt packed every weight again)."""
    prev, _PRIMING.on = getattr(_PRIMING, "on", False), True
    try:
        yield
    finally:
        _PRIMING.on = prev


def _packed(w: torch.Tensor, padding, stride, dilation, groups, x_shape):
    """The weight in the blocked layout oneDNN picks for this input size. The input shape is part
    of the key: a copy packed for another size can run slower than plain aten. One copy per
    weight is kept: a shape change re-packs it once (not inside ``keeping_packed``)."""
    if getattr(_PRIMING, "on", False):
        held = _cache.held(w)
        if held is not None:
            stats["priming_kept"] += 1
            return held
    shape = [int(s) for s in x_shape]
    return _cache.get(w, lambda t: _reorder(t, list(padding), list(stride), list(dilation), groups, shape),
                      key=(tuple(shape),))


def _reorder(t: torch.Tensor, padding, stride, dilation, groups, shape) -> torch.Tensor:
    """oneDNN's packed copy of ``t`` for input size ``shape``: one new allocation, the result.
    Given an input size, oneDNN reads the weight in channels-last order and makes a copy in that
    order first unless it already is (a 1x1 conv's is); that copy goes to the shared scratch buffer,
    so its pages fault in once, not once per weight (same bytes packed: the layout comes from the
    dims and the input size only)."""
    reorder = torch.ops.mkldnn._reorder_convolution_weight
    if t.is_contiguous(memory_format=torch.channels_last):
        return reorder(t, padding, stride, dilation, groups, shape)
    with weights.SCRATCH.use(t.numel(), t.dtype) as buf:
        o, i, kh, kw = t.shape
        cl = buf[:t.numel()].as_strided(t.shape, (i * kh * kw, 1, kw * i, i))
        cl.copy_(t)
        return reorder(cl, padding, stride, dilation, groups, shape)


@torch.library.custom_op("unet_compiler::conv2d_prepacked", mutates_args=())
def conv2d_prepacked(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     stride: list[int], padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    packed = _packed(weight, padding, stride, dilation, groups, x.shape)
    out = torch.ops.mkldnn._convolution_pointwise(
        x.contiguous(), packed, bias, padding, stride, dilation, groups, "none", [], "")
    return out.contiguous()


@conv2d_prepacked.register_fake
def _(x, weight, bias, stride, padding, dilation, groups):
    n, _, h, w = x.shape
    kh, kw = weight.shape[2], weight.shape[3]
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return x.new_empty((n, weight.shape[0], oh, ow))


def _pair(v) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(i) for i in v]


def check(x: torch.Tensor, weight: torch.Tensor, padding) -> bool:
    """False (never raises) when the packed path does not apply: also under CPU autocast, where the
    conv runs in autocast's dtype (the packed op has no autocast rule: it would compute in fp32)."""
    return (mkldnn_conv_available() and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 4 and x.dim() == 4 and not isinstance(padding, str) and autocast_dtype("cpu") is None)


# ---- eager replacement for an nn.Conv2d outside any compiled region ---------

def conv_module_forward(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` on the packed copy of its weight; the conv's own forward where ComfyUI casts or
    patches its weight this call (it streams: that cast is the weight) or the packed path does not apply."""
    if comfy_compat.has_cast_weights(conv) or not check(x, conv.weight, conv.padding):
        stats["eager_declined"] += 1
        return type(conv).forward(conv, x)
    stats["eager_fired"] += 1
    return torch.ops.unet_compiler.conv2d_prepacked(
        x, conv.weight, conv.bias, _pair(conv.stride), _pair(conv.padding), _pair(conv.dilation), conv.groups)


class PackedConvs(torch.overrides.TorchFunctionMode):
    """Inside this mode each ``conv2d`` on a module's own weight (a Parameter: not a copy cast for
    the call) that ``check`` accepts runs ``conv2d_prepacked``, the op compiled regions call, with
    the same packed copy; everything else runs as called. What a region's uncompiled code runs on
    CPU while its variant compiles in the background (most of what compiling buys there: docs/internals.md)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.conv2d:
            call = _named(args, kwargs)
            if isinstance(call["weight"], torch.nn.Parameter) and check(call["input"], call["weight"], call["padding"]):
                stats["packed_mode_fired"] += 1
                return torch.ops.unet_compiler.conv2d_prepacked(*_op_args(call))
        return func(*args, **kwargs)


# ---- FX rewrite inside a dynamo graph ---------------------------------------

_CONV_TARGETS = (torch.conv2d, torch.nn.functional.conv2d)
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _named(args, kwargs) -> dict:
    """A ``conv2d`` call's arguments by name, its defaults filled in (trailing args may be left out)."""
    call = dict(_CONV_DEFAULTS)
    call.update(zip(_CONV_ARGS, args, strict=False))
    call.update(kwargs)
    return call


def _op_args(call: dict) -> tuple:
    """``conv2d_prepacked``'s arguments for a named ``conv2d`` call."""
    return (call["input"], call["weight"], call["bias"], _pair(call["stride"]), _pair(call["padding"]),
            _pair(call["dilation"]), int(call["groups"]))


def _replacement(node):
    args = _named(node.args, node.kwargs)
    x, w = example_value(args["input"]), example_value(args["weight"])
    if x is None or w is None or not check(x, w, args["padding"]):
        return None
    if not all(isinstance(args[k], (int, tuple, list)) for k in ("stride", "padding", "dilation", "groups")):
        return None
    return torch.ops.unet_compiler.conv2d_prepacked.default, _op_args(args)


def rewrite_graph(gm: torch.fx.GraphModule) -> int:
    """Replace every eligible conv2d call in a dynamo graph; returns how many."""
    return replace_calls(gm, _CONV_TARGETS, _replacement, stats)
