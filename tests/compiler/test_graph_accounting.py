"""CUDA-graph accounting at full size, on the meta device: the real SD1.5 and SDXL UNet architectures
(diffusers, bf16, CFG batch 2 at 512² / 1024²) with every region the triton backend accelerates routed
through RegionGraphs and the buffer stand-in (conftest.GraphStandIn). Meta tensors carry shapes, no
data, so this counts what a GPU would hold and copy: regions, captures per prompt, static buffer bytes
and bytes copied per step. The SDXL figure is checked against the H100's own measurement
(docs/gpu.md: 227 regions, 2932 MiB of static buffers)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from unet_compiler.compiler import compile_unet
from unet_compiler.compiler import graphs as G  # noqa: N812
from unet_compiler.compiler import plan as P  # noqa: N812
from unet_compiler.compiler import regions as R  # noqa: N812
from unet_compiler.compiler.api import accelerator_of

pytest.importorskip("diffusers", reason="diffusers not installed")


def _graphed_on_meta(size: str, latent: int, monkeypatch, standin):
    from unet_compiler.bench.run import _inputs, _unet
    monkeypatch.setattr(G, "_autocast_state", lambda device_type: None)   # no autocast on meta
    u = _unet(size, "meta").to(torch.bfloat16)
    args, kw = _inputs(u, 2, latent, torch.device("meta"), torch.bfloat16)
    compile_unet(u, "inductor", prepack_conv=False, prepack_linear=False)
    accel = accelerator_of(u)
    fake = standin()
    accel.graphs = G.RegionGraphs(graphs=fake)
    # the regions' own bodies (nothing compiles on meta), the triton backend's kinds (no free-standing convs)
    accel._install({k: body for k, body in R.BODIES.items() if k[1] != P.PROJECTION})

    def step():
        with torch.inference_mode():
            u(*args, **kw)
    return accel, fake, step


class _HostCopies(TorchDispatchMode):
    """Bytes and ops of the copies a step's host issues outside graph replays (``paused`` inside one)."""

    def __init__(self):
        super().__init__()
        self.bytes = self.ops = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten.clone):
            t = args[0] if func.overloadpacket is torch.ops.aten.copy_ else out
            self.bytes += t.numel() * t.element_size()
            self.ops += 1
        return out


@pytest.mark.parametrize("size, latent, regions", [("sd15", 64, 70), ("sdxl", 128, 227)])
def test_graph_memory_copies_and_captures_per_prompt_at_full_size(size, latent, regions, monkeypatch,
                                                                  graph_standin):
    counter = _HostCopies()

    class Standin(graph_standin):
        def capture(self, fn, device):
            graph, out = super().capture(fn, device)

            class Paused:      # what a replay does on the device is not the host's copy
                def replay(self):
                    counter.paused = True
                    try:
                        graph.replay()
                    finally:
                        counter.paused = False
            return Paused(), out
    accel, fake, step = _graphed_on_meta(size, latent, monkeypatch, Standin)
    assert len(accel._shims) == regions
    for _ in range(3):   # a prompt: the first call runs eager, the second captures, then replays
        step()
    g = accel.graphs
    assert fake.captures == regions and g.stats["replays"] == 2 * regions and g.off is None
    static = g.bytes
    with counter:
        step()
    assert g.stats["replays"] == 3 * regions and not g.skipped, g.skipped
    inputs = sum(G._bytes(e.static_in) for r in g.regions.values() for e in r.graphs.values())
    chained = sum(G._bytes(e.chained[i].tensor for i in e.chained) for r in g.regions.values()
                  for e in r.graphs.values())
    # a replay copies in the inputs that are not the previous region's output buffer, and serves its
    # outputs uncopied (before: every input copied in, every output cloned out, the static bytes)
    assert counter.bytes == inputs - chained and chained > 0, (counter.bytes, inputs, chained)
    print(f"\n[graphs] {size} 2x{latent * 8}²: {regions} regions, {static / 2**20:.0f} MiB static, "
          f"{counter.bytes / 2**20:.0f} MiB copied per step in {counter.ops} copies "
          f"({chained / 2**20:.0f} MiB of inputs read in place)")
    if size == "sdxl":   # the H100 held 2932 MiB for this shape (its two probe shapes add < 1 MiB)
        assert abs(static / 2**20 - 2932) <= 0.01 * 2932, static / 2**20
    # the prompt ends with room on the card (a stand-in holds no device memory): the next prompt replays
    g.prompt_ended("end of prompt")
    step()
    step()
    assert fake.captures == regions and g.stats["kept across prompts"] == 1
