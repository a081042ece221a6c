"""Kernel or torch, measured: ops whose members run a Triton kernel or the torch ops it replaces.

Kernel choice is measured, not assumed: the first time a kernel meets an input signature on a
GPU, the kernel and the torch ops it replaces are each timed a few times and the faster one
serves that signature from then on (remembered per process; the report counts both). What is
timed is what the user pays: without CUDA graphs, wall time per call of back-to-back calls (host
launches, checks and allocations included: at launch-bound sizes a kernel that is faster on the
device can still make the step slower); under CUDA graphs, where a replay pays no host time,
device time (CUDA events). So the backend is never slower than eager at a signature.
UNET_COMPILER_KERNEL_CHOICE=triton always runs the kernels (kernel tests, A/B).

(A private module: every public module of this package is a backend.)
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from .. import settings
from ..regions import Ops

log = logging.getLogger(__name__)

CHOICE_ENV = settings.env("KERNEL_CHOICE")
#: (kernel, device, input signature) -> "triton" | "torch" (measured once per process) | "declined"
_CHOICE: dict = {}
_DECLINED: dict = {}   # (kernel, device, input signature) -> why the kernel refused it


def _measurable(device) -> bool:
    """Whether kernel-vs-torch timing is meaningful here (a real GPU, not the interpreter)."""
    return device.type == "cuda" and settings.choice("KERNEL_CHOICE") != "triton"


#: timed calls per candidate (after one untimed first call): 2 x (1 + REPS) runs per signature
REPS = 5


def _measure_ms(fn, reps: int = REPS, timing: str = "wall") -> float:
    """Milliseconds per call of ``fn``. ``wall``: back-to-back calls between two synchronizations,
    host time included (what a step pays without graphs: the larger of launch and device time);
    ``device``: median device time per call, the launches queued behind a GPU-side sleep so host
    gaps do not count (what a graph replay pays)."""
    fn()  # first call: compile / config probe, untimed
    torch.cuda.synchronize()
    if timing == "wall":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000 / reps
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


def decide(kernel, reference, timing: str) -> tuple[str, float, float]:
    """(``"triton"`` or ``"torch"``, kernel ms, torch ms): the kernel where it measured no slower than
    the torch ops it replaces, each timed by :func:`_measure_ms` with ``timing``. The backend's
    choice per signature and the bench's kernel table both come from here."""
    t_kernel = _measure_ms(kernel, timing=timing)
    t_torch = _measure_ms(reference, timing=timing)
    return ("triton" if t_kernel <= t_torch else "torch"), t_kernel, t_torch


#: the report's name for kernel calls a capture ran as torch ops (``KernelChoice.in_captures``)
OUT_OF_CAPTURES = "kept out of CUDA graph captures (cudaMallocAsync)"


class KernelChoice(Ops):
    """Ops whose members go through :meth:`pick`. ``fired`` counts kernel launches per kernel
    (``fired_in``: per kernel and region kind), ``torch_faster`` the calls served by torch
    because it measured faster, ``declined`` what a kernel or a body did not take, by reason."""

    def __init__(self, timing: str = "wall"):
        #: how a kernel and its torch ops are timed against each other: "wall" (no CUDA graphs) or
        #: "device" (under CUDA graphs); see _measure_ms
        self.timing = timing
        #: False where a CUDA graph capture must not hold a kernel (cudaMallocAsync): inside one,
        #: the torch ops it replaces run
        self.in_captures = True
        self.fired: Counter = Counter()
        self.fired_in: Counter = Counter()   # (kernel, region kind) -> launches
        self.where = "?"                     # the region kind being run (set per call by the backend)
        self.declined: Counter = Counter()
        self.torch_faster: Counter = Counter()
        from ...kernels._common import KernelUnsupported, NotBound
        self.Unsupported, self.NotBound = KernelUnsupported, NotBound

    def decline(self, why: str) -> None:
        self.declined[why] += 1

    def pick(self, name, tensors, kernel, reference):
        """Run ``kernel()`` or ``reference()`` (same result), whichever measured faster for this signature."""
        dev = tensors[0].device
        if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):  # triton launches on the current device and its stream
                return self._pick(name, tensors, dev, kernel, reference)
        return self._pick(name, tensors, dev, kernel, reference)

    def _pick(self, name, tensors, dev, kernel, reference):
        # grad mode too: a kernel refuses inputs that need grad under autograd, not the same inputs later
        sig = tuple((t.shape, t.stride(), t.dtype) for t in tensors) + (torch.is_grad_enabled(),)
        key = (name, dev, sig, self.timing)
        choice = _CHOICE.get(key, "triton")
        if not self.in_captures and torch.cuda.is_current_stream_capturing():
            self.declined[OUT_OF_CAPTURES] += 1
            return reference()
        if choice == "declined":   # the kernel refused this signature before: no raise-and-catch per call
            self.declined[_DECLINED[key]] += 1
            return reference()
        if _measurable(dev):
            choice = _CHOICE.get(key)
            if choice is None and dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
                choice = "triton"  # no timing inside a capture (a graph captures on a signature's 2nd call)
            elif choice is None:
                try:
                    choice, t_kernel, t_torch = decide(kernel, reference, self.timing)
                except self.Unsupported as e:   # the kernel refuses these inputs: nothing to measure
                    return self._declined(e, reference, key)
                _CHOICE[key] = choice
                log.debug("%s %s: triton %.3f ms, torch %.3f ms (%s time) -> %s", name, sig, t_kernel, t_torch,
                          self.timing, choice)
        if choice == "torch":
            self.torch_faster[name] += 1
            return reference()
        try:
            out = kernel()
        except self.NotBound as e:   # inside a capture, nothing launched: the capture takes the torch ops
            self.declined[str(e).split(": ", 1)[1]] += 1
            return reference()
        except self.Unsupported as e:
            return self._declined(e, reference, key)
        self.fired[name] += 1
        self.fired_in[(name, self.where)] += 1
        return out

    def _declined(self, e, reference, key):
        """A kernel that cannot take these inputs (dtype, size, GPU): the torch ops it replaces run
        on the same inputs, so the rest of the region stays on the kernels and nothing re-runs; the
        signature is remembered, so later calls go to the torch ops without trying the kernel."""
        why = str(e).split(":")[0]
        _CHOICE[key], _DECLINED[key] = "declined", why
        self.declined[why] += 1
        log.debug("triton kernel declined: %s", e)
        return reference()
