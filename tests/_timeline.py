"""A timeline stand-in for a GPU running ComfyUI's Dynamic VRAM casts: what the calls issue, recorded
on this CPU, and the makespan a GPU would take for it at stated rates.

Recorded in issue order (the host runs ahead of the device, as it does on a GPU):
- ``copy(stream, bytes)``: a weight copied host-to-device on an offload stream (the double's
  ``cast_modules``: into a VBAR slot or a stream's cast buffer);
- ``wait(waiter, on)``: ``waiter`` waits for everything queued on ``on`` so far (``wait_stream``:
  ``get_offload_stream``'s wait of the stream it rotates past, ``sync_stream``'s compute wait
  after a cast, ``uncast_bias_weight``'s wait of a filled slot's stream);
- ``compute(flops, bytes)``: every other aten op on the compute stream (recorded by a dispatch mode;
  views cost nothing; FLOPs from torch's flop counter, attention's own);
- ``pin(bytes)`` / ``unpin(bytes)``: VBAR ranges pinned and released;
- ``replay``: a CUDA graph launched (the stand-in's replay, ``tests/_fake_cuda.REPLAY_HOOKS``): the
  ops it re-runs are the graph's, issued by that one launch.

:meth:`Timeline.makespan` schedules them: the host issues each copy and op at ``host`` seconds
apiece (Python, the dispatcher and the launch), a graph at ``launch`` seconds for all its ops;
copies share one host-to-device link at ``bandwidth`` (bytes/s); each op of the compute stream takes
``max(flops / throughput, bytes / memory)``; every copy and op starts when the host issued it and
its stream, the link (copies) and what its stream waits on are done.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

COMPUTE = "compute"


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(map(_bytes, x))
    return 0


def _attention_flops(q, k, v) -> int:
    """QK^T and PV: 2 multiply-adds each per (query, key, channel)."""
    return 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]


class _Ops(TorchDispatchMode):
    def __init__(self, timeline):
        super().__init__()
        self.timeline = timeline

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        t = self.timeline
        if t.copying or func.is_view or func._overloadpacket in (torch.ops.aten.detach, torch.ops.aten.alias):
            return out
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        elif "scaled_dot_product" in packet.__name__:
            flops = _attention_flops(*args[:3])
        else:
            flops = 0
        t.events.append(("compute", COMPUTE, flops, _bytes(args) + _bytes(out), packet.__name__))
        return out


class Timeline:
    """The recorder (installed on the Dynamic VRAM double as its ``timeline``) and the schedule."""

    def __init__(self):
        self.events: list = []
        self.copying = False

    # -- what the double reports ----------------------------------------------------------
    @contextlib.contextmanager
    def copy(self, stream: int, nbytes: int):
        self.events.append(("copy", stream, nbytes))
        self.copying = True
        try:
            yield
        finally:
            self.copying = False

    def wait(self, waiter, on) -> None:
        if on is not None:
            self.events.append(("wait", waiter, on))

    def pin(self, nbytes: int) -> None:
        self.events.append(("pin", nbytes))

    def unpin(self, nbytes: int) -> None:
        self.events.append(("pin", -nbytes))

    def replay(self, begins: bool) -> None:
        self.events.append(("replay", begins))

    @contextlib.contextmanager
    def recording(self):
        """Record the compute stream's ops and the graph launches of what runs inside."""
        from . import _fake_cuda
        _fake_cuda.REPLAY_HOOKS.append(self.replay)
        try:
            with _Ops(self):
                yield self
        finally:
            _fake_cuda.REPLAY_HOOKS.remove(self.replay)

    # -- the schedule ---------------------------------------------------------------------
    def makespan(self, bandwidth: float, throughput: float, memory: float, host: float = 0.0,
                 launch: float = 0.0) -> float:
        """Seconds from the first event to the last op's end at these rates (bytes/s host to device,
        FLOP/s, bytes/s device memory; seconds of host time per op issued from Python, per graph)."""
        ready: dict = {COMPUTE: 0.0, 0: 0.0, 1: 0.0}
        after: dict = {COMPUTE: 0.0, 0: 0.0, 1: 0.0}   # what each stream waits for before its next op
        link = clock = 0.0
        in_graph = False
        for e in self.events:
            if e[0] == "replay":
                in_graph = e[1]
                clock += launch if in_graph else 0.0
            elif e[0] == "copy":
                _, s, n = e
                clock += host
                start = max(ready[s], after[s], link, clock)
                link = ready[s] = start + n / bandwidth
            elif e[0] == "compute":
                _, s, flops, n, _ = e
                clock += 0.0 if in_graph else host
                start = max(ready[s], after[s], clock)
                ready[s] = start + max(flops / throughput, n / memory)
            elif e[0] == "wait":
                _, waiter, on = e
                after[waiter] = max(after[waiter], ready[on])
        return max(ready.values())

    def copied(self) -> int:
        return sum(e[2] for e in self.events if e[0] == "copy")

    def flops(self) -> int:
        return sum(e[2] for e in self.events if e[0] == "compute")

    def peak_pinned(self) -> int:
        now = peak = 0
        for e in self.events:
            if e[0] == "pin":
                now += e[1]
                peak = max(peak, now)
        return peak
