"""The pack's fused Triton kernels on the leaf regions (CUDA).

Region bodies below mirror ComfyUI's / diffusers' own code for the plain
SD1.5/SDXL case and swap in kernels where they remove memory round trips:
GroupNorm+SiLU in one pass, the GEGLU epilogue, flash attention, conv bias +
residual add in one pass. Every weight is read from the live module at call
time; to_q/to_k/to_v/to_out and the convs/linears stay module calls (LoRA
and attention patches address them by name; cuBLAS/cuDNN do the GEMMs).
A variant a body does not cover (scale-shift norm, up/down ResBlocks,
non-GEGLU feed-forwards) runs the model's own code; a kernel that cannot take
its inputs raises KernelUnsupported and that call runs the model's own code.

Kernel choice is measured, not assumed: the first time a kernel meets an
input signature on a GPU, the kernel and the torch ops it replaces are each
timed a few times (CUDA events) and the faster one serves that signature from
then on (remembered per process; the report counts both). So on a GPU where
cuDNN's attention or a fused torch op beats a kernel at some size, the
backend is never slower there than eager. UNET_COMPILER_KERNEL_CHOICE=triton
always runs the kernels (kernel tests, A/B).
"""
from __future__ import annotations

import logging
import os
from collections import Counter

import torch
import torch.nn.functional as F

from .. import regions as R
from ..compat import comfy as comfy_compat
from ..compat import triton as triton_compat
from ..plan import ATTENTION, FEEDFORWARD, NORM_ACT, RESBLOCK
from . import Backend, register_backend

log = logging.getLogger(__name__)


def _kernels():
    from ...kernels import attention, epilogue, geglu, groupnorm
    return attention, epilogue, geglu, groupnorm


def _is(m, name):
    return type(m).__name__ == name or any(c.__name__ == name for c in type(m).__mro__)


CHOICE_ENV = "UNET_COMPILER_KERNEL_CHOICE"
#: (kernel, device, input signature) -> "triton" | "torch", measured once per process
_CHOICE: dict = {}


#: Triton compiles of the pack's kernels in this process (each new specialisation of a kernel:
#: dtype, block config, an int argument becoming divisible by 16 or equal to 1)
_KERNEL_COMPILES = [0]
_COUNTING: list = []   # [True] once the hook is installed, [False] when this triton has no hook


def kernel_compiles() -> int:
    return _KERNEL_COMPILES[0]


def count_kernel_compiles() -> bool:
    """Install (once) a chained ``triton.knobs.runtime.jit_post_compile_hook``
    that counts compiles of this pack's kernels. False where triton has no
    such hook (before 3.4): compiles then go uncounted and the report says so."""
    if _COUNTING:
        return _COUNTING[0]
    try:
        from triton import knobs
        runtime = knobs.runtime
        previous = runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        _COUNTING.append(False)
        return False
    from ... import kernels
    prefix = kernels.__name__ + "."

    def unet_compiler_count_compiles(*args, **kwargs):
        fn = kwargs.get("fn")
        if str(getattr(fn, "module", "")).startswith(prefix):
            _KERNEL_COMPILES[0] += 1
        return previous(*args, **kwargs) if previous is not None else None
    runtime.jit_post_compile_hook = unet_compiler_count_compiles
    _COUNTING.append(True)
    return True


def _measurable(device) -> bool:
    """Whether kernel-vs-torch timing is meaningful here (a real GPU, not the interpreter)."""
    return device.type == "cuda" and os.environ.get(CHOICE_ENV, "measure").strip().lower() != "triton"


def _measure_ms(fn, reps: int = 10) -> float:
    """Median device time of ``fn`` in ms. Both candidates are measured the same
    way: from an idle GPU, with a GPU-side sleep queued first so every launch is
    queued before the first timed one runs (device time, not Python gaps)."""
    fn()  # first call: compile / config probe, untimed
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(2_000_000)
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))[reps // 2]


def _epilogue_mismatch(h: torch.Tensor, residual: torch.Tensor) -> str | None:
    """Why conv(h) and ``residual`` cannot share the bias+residual pass, known before the conv
    runs: the conv's output dtype (autocast's, under fp16/bf16 precision) must be the
    residual's, and its memory layout (h's: NCHW or channels_last) the residual's."""
    out_dtype = h.dtype
    if torch.is_autocast_enabled(h.device.type) if _AUTOCAST_BY_DEVICE else torch.is_autocast_enabled():
        out_dtype = (torch.get_autocast_dtype(h.device.type) if _AUTOCAST_BY_DEVICE
                     else torch.get_autocast_gpu_dtype())
    if out_dtype != residual.dtype:
        return f"conv output {str(out_dtype).replace('torch.', '')}, skip {str(residual.dtype).replace('torch.', '')}"
    for fmt in (torch.contiguous_format, torch.channels_last):
        if h.is_contiguous(memory_format=fmt):
            return None if residual.is_contiguous(memory_format=fmt) else "skip in another memory layout"
    return "input neither NCHW nor channels_last"


try:  # torch >= 2.4: per-device autocast queries
    torch.get_autocast_dtype("cpu")
    _AUTOCAST_BY_DEVICE = True
except (AttributeError, TypeError):
    _AUTOCAST_BY_DEVICE = False


class Bodies:
    """Kernel-backed region bodies; ``fired`` counts kernel launches per kernel,
    ``torch_faster`` the calls served by torch because it measured faster."""

    def __init__(self):
        self.fired: Counter = Counter()
        self.fired_in: Counter = Counter()   # (kernel, region kind) -> launches
        self.where = "?"                     # the region kind being run (set per call by the backend)
        self.declined: Counter = Counter()
        self.torch_faster: Counter = Counter()
        self.KA, self.KE, self.KG, self.KN = _kernels()
        from ...kernels._common import KernelUnsupported
        self.Unsupported = KernelUnsupported

    def pick(self, name, tensors, kernel, reference):
        """Run ``kernel()`` or ``reference()`` (same result), whichever measured faster for this signature."""
        dev = tensors[0].device
        if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):  # triton launches on the current device and its stream
                return self._pick(name, tensors, dev, kernel, reference)
        return self._pick(name, tensors, dev, kernel, reference)

    def _pick(self, name, tensors, dev, kernel, reference):
        choice = "triton"
        if _measurable(dev):
            sig = tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)
            key = (name, str(dev), sig)
            choice = _CHOICE.get(key)
            if choice is None and dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                choice = "triton"  # no timing inside a capture (a graph captures on a signature's 2nd call)
            elif choice is None:
                try:
                    t_kernel = _measure_ms(kernel)
                except self.Unsupported as e:   # the kernel refuses these inputs: nothing to measure
                    return self._declined(e, reference)
                t_torch = _measure_ms(reference)
                choice = _CHOICE[key] = "triton" if t_kernel <= t_torch else "torch"
                log.debug("%s %s: triton %.3f ms, torch %.3f ms -> %s", name, sig, t_kernel, t_torch, choice)
        if choice == "torch":
            self.torch_faster[name] += 1
            return reference()
        try:
            out = kernel()
        except self.Unsupported as e:
            return self._declined(e, reference)
        self.fired[name] += 1
        self.fired_in[(name, self.where)] += 1
        return out

    def _declined(self, e, reference):
        """A kernel that cannot take these inputs (dtype, size, GPU): the torch ops it replaces run
        on the same inputs, so the rest of the region stays on the kernels and nothing re-runs."""
        self.declined[str(e).split(":")[0]] += 1
        log.debug("triton kernel declined: %s", e)
        return reference()

    # -- pieces --
    def gn(self, norm, x, silu):
        def reference():
            y = F.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
            return F.silu(y) if silu else y
        return self.pick("groupnorm_silu" if silu else "groupnorm", (x,),
                         lambda: self.KN.groupnorm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, silu=silu),
                         reference)

    def conv_residual(self, conv, h, residual):
        """conv(h) + residual with the conv bias folded into the add (one pass)."""
        if (not isinstance(conv, torch.nn.Conv2d) or conv.padding_mode != "zeros" or isinstance(conv.padding, str)
                or conv._forward_hooks or conv._forward_pre_hooks or comfy_compat.has_cast_weights(conv)):
            return conv(h) + residual
        why = _epilogue_mismatch(h, residual)
        if why:  # decided before the conv runs: no wasted conv, no measurement, no region re-run
            self.declined[f"bias_residual ({why})"] += 1
            return conv(h) + residual

        def kernel():
            y = F.conv2d(h, conv.weight, None, conv.stride, conv.padding, conv.dilation, conv.groups)
            return self.KE.bias_residual(y, conv.bias, residual, dim=1, out=y)
        return self.pick("bias_residual", (h, residual), kernel, lambda: conv(h) + residual)

    def attend(self, q, k, v, heads):
        b, n, inner = q.shape
        qh, kh, vh = R.split_heads(q, k, v, heads)
        out = self.pick("attention", (qh, kh, vh), lambda: self.KA.attention(qh, kh, vh),
                        lambda: F.scaled_dot_product_attention(qh, kh, vh))
        return out.transpose(1, 2).reshape(b, n, inner)

    # -- region bodies (same signatures as regions.BODIES) --
    def comfy_resblock(self, block, x, emb):
        if (block.updown or block.use_scale_shift_norm or block.skip_t_emb
                or getattr(block, "exchange_temb_dims", False) or len(block.in_layers) != 3
                or not isinstance(block.in_layers[0], torch.nn.GroupNorm)
                or not isinstance(block.in_layers[1], torch.nn.SiLU)
                or len(block.out_layers) != 4 or not isinstance(block.out_layers[1], torch.nn.SiLU)):
            self.declined["resblock variant"] += 1
            return type(block)._forward(block, x, emb)
        h = block.in_layers[2](self.gn(block.in_layers[0], x, True))
        emb_out = block.emb_layers(emb).type(h.dtype)
        h = h + emb_out[:, :, None, None]
        h = block.out_layers[2](self.gn(block.out_layers[0], h, True))  # [2] is Dropout (identity in eval)
        return self.conv_residual(block.out_layers[3], h, block.skip_connection(x))

    def diffusers_resblock(self, block, x, temb):
        if (block.upsample is not None or block.downsample is not None or block.time_embedding_norm != "default"
                or not isinstance(block.nonlinearity, torch.nn.SiLU) or block.output_scale_factor != 1.0
                or temb is None or block.time_emb_proj is None):
            self.declined["resblock variant"] += 1
            return type(block).forward(block, x, temb)
        h = block.conv1(self.gn(block.norm1, x, True))
        t = block.time_emb_proj(temb if block.skip_time_act else F.silu(temb))[:, :, None, None]
        h = self.gn(block.norm2, h + t, True)
        h = block.dropout(h)
        skip = block.conv_shortcut(x) if block.conv_shortcut is not None else x
        return self.conv_residual(block.conv2, h, skip)

    def comfy_attention(self, attn, x, context=None, value=None):
        q = attn.to_q(x)
        ctx = x if context is None else context
        k = attn.to_k(ctx)
        v = attn.to_v(ctx if value is None else value)
        return attn.to_out(self.attend(q, k, v, attn.heads))

    def diffusers_attention(self, attn, hidden_states, encoder_hidden_states=None):
        ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(ctx), attn.to_v(ctx)
        out = self.attend(q, k, v, attn.heads)
        return attn.to_out[1](attn.to_out[0](out))

    def feedforward(self, ff, x):
        glu = ff.net[0]
        proj = getattr(glu, "proj", None)
        approximate = getattr(glu, "approximate", "none")
        if not _is(glu, "GEGLU") or proj is None or approximate not in ("none", "tanh"):
            self.declined["feed-forward without GEGLU"] += 1
            return type(ff).forward(ff, x)
        hidden = proj(x)

        def reference():
            a, gate = hidden.chunk(2, dim=-1)
            return a * F.gelu(gate, approximate=approximate)
        h = self.pick("geglu", (hidden,), lambda: self.KG.geglu(hidden, approximate=approximate), reference)
        for m in list(ff.net)[1:]:
            h = m(h)
        return h

    def norm_act(self, seq, x):
        return seq[2](self.gn(seq[0], x, True))

    def table(self) -> dict:
        return {("comfy", RESBLOCK): self.comfy_resblock, ("diffusers", RESBLOCK): self.diffusers_resblock,
                ("comfy", ATTENTION): self.comfy_attention, ("diffusers", ATTENTION): self.diffusers_attention,
                ("comfy", FEEDFORWARD): self.feedforward, ("diffusers", FEEDFORWARD): self.feedforward,
                ("comfy", NORM_ACT): self.norm_act}


@register_backend("triton")
class TritonBackend(Backend):
    auto_rank, auto_devices, uses_cuda_graphs = 0, ("cuda",), True
    summary = "the pack's fused Triton kernels (CUDA), CUDA graphs optional"
    def __init__(self):
        self.bodies: Bodies | None = None
        self.counting = True

    def available(self, device):
        facts = triton_compat.gather()
        if getattr(device, "type", "cpu") != "cuda" and facts.cuda_available:
            return False, f"the model is on {device}; the Triton kernels run on CUDA"
        why = triton_compat.problem(facts)
        if why:
            return False, why
        try:
            _kernels()
        except Exception as e:
            return False, f"triton {facts.triton_version} is installed but the kernels failed to load ({e})"
        return True, f"fused Triton kernels (triton {facts.triton_version})"

    def compile_count(self) -> int:
        return kernel_compiles()

    def extra_probes(self, shapes, levels: int) -> list:
        """Triton specialises integer kernel arguments on divisibility by 16 (and == 1); the
        kernels' block sizes never depend on spatial or token sizes, and the size arguments
        that only bound loops are not specialised, so what is left varies with whether a
        level's spatial size is a multiple of 16. The smallest shape where it is at every
        level (sides a multiple of 4 at the deepest: 256 px for SD1.5, 128 px for SDXL) and
        one where it is at none (80 px) compile both up front; the dynamo probes already
        cover size 1 (64 px)."""
        from ..shapes import Shape
        b = min(s.batch for s in shapes)
        side = 8 * 4 * 2 ** (levels - 1)
        return [Shape(b, side, side), Shape(b, 80, 80)]

    def impls(self, config) -> dict:
        self.counting = count_kernel_compiles()
        self.bodies = Bodies()
        own = R.BODIES
        unsupported = self.bodies.Unsupported

        def guarded(key, body):
            def run(module, *args):
                self.bodies.where = key[1]
                try:
                    return body(module, *args)
                except unsupported as e:  # a size the kernels cannot do: this call runs the model's code
                    self.bodies.declined[str(e).split(":")[0]] += 1
                    log.debug("triton region fallback: %s", e)
                    return own[key](module, *args)
            return run
        return {key: guarded(key, body) for key, body in self.bodies.table().items()}

    def status_lines(self) -> list[str]:
        b = self.bodies
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
        if self.counting and kernel_compiles():
            lines.append(f"  triton kernel variants compiled in this process: {kernel_compiles()} "
                         f"(counted in 'graphs compiled' and, after warmup, as recompiles)")
        if not self.counting:
            lines.append("  triton kernel compiles are not counted with this triton (no compile hook before 3.4): "
                         "'graphs compiled' covers dynamo only")
        if b.declined:
            lines.append("  triton kernels not used (the torch ops they replace, or the model's own code, ran): "
                         + ", ".join(f"{k} x{n}" for k, n in sorted(b.declined.items())))
        return lines
