"""CPU linear layers with an MKL-prepacked weight, kept live.

Pattern: ``torch._C._nn.linear`` / ``F.linear`` in a dynamo graph on CPU fp32 tensors.
Replacement: ``unet_compiler::linear_prepacked``, which packs the weight into MKL's GEMM
layout once (the layout does not depend on the row count: one copy serves every shape).
Off by default (``CompileConfig.prepack_linear``): recent torch's plain linear is as fast.
Weights are live: as in prepack_conv, the packed copy is a cache keyed on the weight and
the weight epoch, re-packed before the GEMM when either changed.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

from .. import weights
from . import example_value, replace_calls

#: how often each part of this pass fired (tests read it)
stats: Counter = Counter()

_cache = weights.DerivedCache(stats)


def available() -> bool:
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def _packed(w: torch.Tensor):
    return _cache.get(w, lambda t: torch.ops.mkl._mkl_reorder_linear_weight(t, 1))  # layout independent of rows


@torch.library.custom_op("unet_compiler::linear_prepacked", mutates_args=())
def linear_prepacked(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return torch.nn.functional.linear(x, weight, bias)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = torch.ops.mkl._mkl_linear(x2, _packed(weight), weight, bias, x2.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


@linear_prepacked.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def check(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """False (never raises) when the packed path does not apply."""
    return (available() and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2
            and x.dim() >= 2 and (bias is None or (bias.dtype == torch.float32 and bias.dim() == 1)))


_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)


def _replacement(node):
    args = dict(zip(("input", "weight", "bias"), node.args, strict=False))
    args.update(node.kwargs)
    args.setdefault("bias", None)
    x, w = example_value(args.get("input")), example_value(args.get("weight"))
    b = example_value(args["bias"])
    if x is None or w is None or not check(x, w, b):
        return None
    return torch.ops.unet_compiler.linear_prepacked.default, (args["input"], args["weight"], args["bias"])


def rewrite_graph(gm: torch.fx.GraphModule) -> int:
    """Replace every eligible linear call in a dynamo graph; returns how many."""
    return replace_calls(gm, _TARGETS, _replacement, stats)
