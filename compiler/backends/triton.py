"""The pack's fused Triton kernels on the leaf regions (CUDA).

The region bodies are regions.py's; this backend supplies their ops (:class:`TritonOps`),
each a kernel or the torch ops it replaces, whichever measured faster for that input
signature (_kernel_choice.py). Weights are read from the live module at call time, and
to_q/to_k/to_v/to_out and the convs/linears stay module calls. A kernel that cannot take
its inputs raises KernelUnsupported and the torch ops it replaces run instead; one that
escapes a body makes that call run the body on the torch ops.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from .. import cast
from .. import regions
from ..compat import comfy as comfy_compat
from ..compat import triton as triton_compat
from ..compat.torch_version import autocast_dtype
from ..reasons import Reason
from . import Backend, register_backend
from ._kernel_choice import KernelChoice

log = logging.getLogger(__name__)


def _kernels():
    from ...kernels import attention, epilogue, geglu, groupnorm
    return attention, epilogue, geglu, groupnorm


def _epilogue_mismatch(h: torch.Tensor, residual: torch.Tensor) -> str | None:
    """Why conv(h) and ``residual`` cannot share the bias+residual pass, known before the conv
    runs: the conv's output dtype (autocast's, under fp16/bf16 precision) must be the
    residual's, and its memory layout (h's: NCHW or channels_last) the residual's."""
    out_dtype = autocast_dtype(h.device.type) or h.dtype
    if out_dtype != residual.dtype:
        return f"conv output {str(out_dtype).replace('torch.', '')}, skip {str(residual.dtype).replace('torch.', '')}"
    for fmt in (torch.contiguous_format, torch.channels_last):
        if h.is_contiguous(memory_format=fmt):
            return None if residual.is_contiguous(memory_format=fmt) else "skip in another memory layout"
    return "input neither NCHW nor channels_last"


class TritonOps(KernelChoice):
    """The triton backend's op table: each op of regions.Ops as a Triton kernel or the torch ops
    it replaces, whichever measured faster (:meth:`KernelChoice.pick`). A new kernel is one
    member here, named as the op it speeds up."""

    def __init__(self, timing: str = "wall"):
        super().__init__(timing)
        self.attention_kernel, self.epilogue_kernel, self.geglu_kernel, self.groupnorm_kernel = _kernels()

    def group_norm_silu(self, norm, x):
        if comfy_compat.has_cast_weights(norm):
            # a region run op by op (its weights stream): the norm's cast where it runs, as its own forward's
            with cast.for_op(norm, x) as (weight, bias):
                return self._group_norm_silu(norm, x, weight, bias)
        return self._group_norm_silu(norm, x, norm.weight, norm.bias)

    def _group_norm_silu(self, norm, x, weight, bias):
        def reference():
            return F.silu(F.group_norm(x, norm.num_groups, weight, bias, norm.eps))
        return self.pick("groupnorm_silu", (x,),
                         lambda: self.groupnorm_kernel.groupnorm(x, norm.num_groups, weight, bias, norm.eps, silu=True),
                         reference)

    def conv_residual(self, conv, h, residual):
        """conv(h) + residual with the conv bias folded into the add (one pass)."""
        reference = functools.partial(super().conv_residual, conv, h, residual)
        if (not isinstance(conv, torch.nn.Conv2d) or conv.padding_mode != "zeros" or isinstance(conv.padding, str)
                or conv._forward_hooks or conv._forward_pre_hooks or comfy_compat.has_cast_weights(conv)):
            return reference()
        why = _epilogue_mismatch(h, residual)
        if why:  # decided before the conv runs: no wasted conv, no measurement, no region re-run
            self.declined[f"bias_residual ({why})"] += 1
            return reference()

        def kernel():
            y = F.conv2d(h, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
            return self.epilogue_kernel.bias_residual(y, conv.bias, residual, dim=1, out=y)
        return self.pick("bias_residual", (h, residual), kernel, reference)

    def attention(self, q, k, v):
        return self.pick("attention", (q, k, v), lambda: self.attention_kernel.attention(q, k, v),
                         functools.partial(super().attention, q, k, v))

    def geglu(self, hidden, approximate):
        return self.pick("geglu", (hidden,), lambda: self.geglu_kernel.geglu(hidden, approximate=approximate),
                         functools.partial(super().geglu, hidden, approximate))


@register_backend("triton")
class TritonBackend(Backend):
    auto_rank, auto_devices, uses_cuda_graphs, kernels_leave_captures = 0, ("cuda",), True, True
    streams_op_by_op = True
    summary = "the pack's fused Triton kernels (CUDA), CUDA graphs optional"
    def __init__(self):
        self.ops: TritonOps | None = None
        self.counting = True

    def available(self, device):
        facts = triton_compat.gather()
        if getattr(device, "type", "cpu") != "cuda" and facts.cuda_available:
            return False, Reason(f"the model is on {device}; the Triton kernels run on CUDA",
                                 "load the model on the GPU (ComfyUI without --cpu), or choose inductor")
        why = triton_compat.problem(facts)
        if why:
            return False, why
        try:
            _kernels()
        except Exception as e:
            return False, Reason(f"triton {facts.triton_version} is installed but the kernels failed to load ({e})",
                                 "reinstall the triton that matches torch, or choose inductor")
        note = triton_compat.table_note(facts)
        return True, f"fused Triton kernels (triton {facts.triton_version})" + (f"; {note}" if note else "")

    def compile_count(self, scheduler) -> int:
        return triton_compat.kernel_compiles()

    def graphs_stopped(self) -> None:
        """The model's CUDA graphs turned off (a failed capture or replay): calls pay their launches
        from now on, so signatures met from now on are timed by wall time."""
        self.graphs_replay = False
        if self.ops is not None:
            self.ops.timing = "wall"

    def extra_probes(self, shapes, levels: int) -> list:
        """Two shapes that compile both of Triton's divisibility-by-16 specialisations up front:
        the smallest where every level's spatial size is a multiple of 16, and 80 px, where none
        is (the dynamo probes already cover size 1)."""
        from ..shapes import Shape
        b = min(s.batch for s in shapes)
        side = 8 * 4 * 2 ** (levels - 1)
        return [Shape(b, side, side), Shape(b, 80, 80)]

    def impls(self, config, scheduler) -> dict:
        self.counting = triton_compat.count_kernel_compiles()
        # where graphs replay, a call pays device time only; otherwise it pays its launches too
        self.ops = ops = TritonOps("device" if self.graphs_replay else "wall")
        ops.in_captures = self.kernels_in_captures
        own = regions.BODIES

        def guarded(key, body):
            def run(module, *args):
                ops.where = key[1]
                try:
                    return body(module, *args)
                except ops.Unsupported as e:  # a size the kernels cannot do: this call runs on the torch ops
                    ops.declined[str(e).split(":")[0]] += 1
                    log.debug("triton region fallback: %s", e)
                    return own[key](module, *args)
            return run
        return {key: guarded(key, body) for key, body in regions.bodies(ops).items()}

    def status_lines(self, modules=()) -> list[str]:
        b = self.ops
        if b is None or not (b.fired or b.declined or b.torch_faster):
            return []
        def where(kernel):
            places = sorted((w, n) for (k, w), n in b.fired_in.items() if k == kernel)
            return " (" + ", ".join(f"{w} {n}" for w, n in places) + ")" if places else ""
        lines = ["  triton kernels fired: "
                 + (", ".join(f"{k} x{n}{where(k)}" for k, n in sorted(b.fired.items())) or "none")]
        if b.torch_faster:
            lines.append("  torch measured faster on this GPU, ran instead: "
                         + ", ".join(f"{k} x{n}" for k, n in sorted(b.torch_faster.items())))
        compiles = triton_compat.kernel_compiles()
        if self.counting and compiles:
            lines.append(f"  triton kernel variants compiled in this process: {compiles} "
                         f"(counted in 'graphs compiled' and, after warmup, as recompiles)")
        if not self.counting:
            lines.append("  triton kernel compiles are not counted with this triton (no compile hook before 3.4): "
                         "'graphs compiled' covers dynamo only")
        if b.declined:
            lines.append("  triton kernels not used (the torch ops they replace, or the model's own code, ran): "
                         + ", ".join(f"{k} x{n}" for k, n in sorted(b.declined.items())))
        return lines
