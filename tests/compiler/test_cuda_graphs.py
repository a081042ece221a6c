"""Region CUDA graphs (compiler/graphs.py).

Without a GPU, RegionGraphs gets a stand-in (conftest.GraphStandIn) with the CUDA graph buffer
contract: capture records without producing a result (its output is filled
with NaN until a replay), replay recomputes from the static inputs into the
static output. So the bookkeeping the real graphs depend on is checked
here: inputs copied in before every replay (or read in place where they are the previous
region's output buffer), outputs served uncopied and never overwritten while a caller holds
one, one graph per shape, a cap per region, weights read once per UNet call and moved or
replaced weights drop graphs, autograd never graphed, a failed capture turns
graphs off and the call still returns the right answer. With a GPU the last
tests capture real graphs through the triton and inductor backends.
"""

import pytest
import torch

from unet_compiler.compiler import CompileConfig
from unet_compiler.compiler.compat import triton as triton_compat
from unet_compiler.compiler.graphs import RegionGraphs
from unet_compiler.compiler.runtime import Accelerator
from unet_compiler.compiler.lifecycle.scheduler import Scheduler

CUDA = torch.cuda.is_available()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.GroupNorm(2, 4)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x, emb):
        return self.conv(torch.nn.functional.silu(self.norm(x))) + emb[:, :, None, None] + x


def body(block, x, emb):
    return type(block).forward(block, x, emb)


def _inputs(b=2, side=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, side, side, generator=g), torch.randn(b, 4, generator=g)


@torch.inference_mode()
def test_capture_on_second_call_then_replay_with_fresh_inputs(graph_standin):
    blk, fake = Block().eval(), graph_standin()
    rg = RegionGraphs(graphs=fake)
    for seed in range(4):
        x, e = _inputs(seed=seed)
        out = rg.run(body, blk, (x, e))
        torch.testing.assert_close(out, body(blk, x, e))  # fresh inputs reach the graph every call
        del out   # (a result still held keeps the next call from replaying: the next test)
    assert fake.captures == 1
    assert rg.stats["captured"] == 1 and rg.stats["replays"] == 3  # the capture call replays once too
    assert "cuda graphs: 1 captured for 1 region(s), 3 replays" in "\n".join(rg.status_lines())


@torch.inference_mode()
def test_a_result_still_held_is_never_overwritten(graph_standin):
    """A replay serves its output buffer itself (an alias, no copy): while a caller holds an earlier
    result, or a view of it, the region's next call runs its own launches instead of replaying into
    it; once the result is dropped, calls replay again. (Before: every result was a copy of the
    buffer: a launch and the output's bytes each call.)"""
    from unet_compiler.compiler import graphs as G  # noqa: N812
    blk, fake = Block().eval(), graph_standin()
    rg = RegionGraphs(graphs=fake)
    held = []
    for seed in range(4):
        x, e = _inputs(seed=seed)
        out = rg.run(body, blk, (x, e))
        held.append((out[:, :2], body(blk, x, e)[:, :2]))   # a view of each result, kept
        del out
    for out, ref in held:  # later calls did not overwrite results still held
        torch.testing.assert_close(out, ref)
    entry = next(iter(rg.regions[blk].graphs.values()))
    assert held[1][0].data_ptr() == entry.outs[0].tensor.data_ptr()   # the capture call's: the buffer
    assert rg.stats["replays"] == 1 and rg.skipped[
        "a buffer its replay writes was still held by an earlier call's result"] == 2
    held.clear()
    x, e = _inputs(seed=9)
    out = rg.run(body, blk, (x, e))
    torch.testing.assert_close(out, body(blk, x, e))
    assert rg.stats["replays"] == 2 and out.data_ptr() == entry.outs[0].tensor.data_ptr()
    assert isinstance(entry, G._Graph)


@torch.inference_mode()
def test_capture_inputs_were_first_run_eager(graph_standin):
    """Triton specialises a kernel on its pointers' alignment, and a variant first met inside a
    capture cannot be compiled there: the capture's own static buffers get one eager call first."""
    blk = Block().eval()
    calls = []

    class Recording(graph_standin):
        capturing = False

        def capture(self, fn, device):
            Recording.capturing = True
            try:
                return super().capture(fn, device)
            finally:
                Recording.capturing = False

    def recording_body(block, x, emb):
        calls.append((x.data_ptr(), Recording.capturing))
        return body(block, x, emb)
    rg = RegionGraphs(graphs=Recording())
    x, e = _inputs()
    for _ in range(3):
        torch.testing.assert_close(rg.run(recording_body, blk, (x, e)), body(blk, x, e))
    captured = [ptr for ptr, capturing in calls if capturing]
    assert len(captured) == 1, calls
    eager_before = [ptr for ptr, capturing in calls[:calls.index((captured[0], True))] if not capturing]
    assert captured[0] in eager_before, calls


@torch.inference_mode()
def test_one_graph_per_shape_and_a_cap_per_region(graph_standin):
    blk, fake = Block().eval(), graph_standin()
    rg = RegionGraphs(max_shapes=2, graphs=fake)
    for side in (8, 8, 12, 12, 16, 16, 16):
        x, e = _inputs(side=side)
        torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert fake.captures == 2
    assert rg.skipped["more than 2 shapes for one region"] == 2
    assert "more than 2 shapes for one region x2" in "\n".join(rg.status_lines())


@torch.inference_mode()
def test_an_input_that_is_the_previous_regions_result_is_read_in_place(graph_standin):
    """A region whose input is exactly the previous region's result (a DiT's blocks in a row) reads
    that region's output buffer in place: no copy in. Given anything else at that input, it copies
    into the buffer, unless a caller still holds the buffer's contents, when it runs its own
    launches; results stay right throughout."""
    from unet_compiler.compiler import graphs as G  # noqa: N812
    a, b = Block().eval(), Block().eval()
    copies, replaying = [], []

    class Standin(graph_standin):     # copies a replay makes are the device's, not the caller's
        def capture(self, fn, device):
            graph, out = super().capture(fn, device)

            class Replay:
                def replay(self):
                    replaying.append(1)
                    try:
                        graph.replay()
                    finally:
                        replaying.pop()
            return Replay(), out
    rg = RegionGraphs(graphs=Standin())
    real = torch.Tensor.copy_

    def two(x, e):
        h = rg.run(body, a, (x, e))
        return rg.run(body, b, (h, e))

    def ref(x, e):
        return body(b, body(a, x, e), e)
    for seed in range(3):
        x, e = _inputs(seed=seed)
        torch.testing.assert_close(two(x, e), ref(x, e))
    entry = next(iter(rg.regions[b].graphs.values()))
    assert list(entry.chained) == [0] and entry.static_in[0] is rg.regions[a].graphs[next(iter(
        rg.regions[a].graphs))].outs[0].tensor
    def counted(self, src, *k):
        if not replaying:
            copies.append(self.shape)
        return real(self, src, *k)
    try:
        torch.Tensor.copy_ = counted
        x, e = _inputs(seed=5)
        torch.testing.assert_close(two(x, e), ref(x, e))
    finally:
        torch.Tensor.copy_ = real
    assert len(copies) == 3, copies   # x and e into a's static inputs, e into b's: not a's result
    # b called on something else: copied into a's buffer (nobody holds it), then replayed
    x, e = _inputs(seed=6)
    other = torch.randn_like(x)
    replays = rg.stats["replays"]
    torch.testing.assert_close(rg.run(body, b, (other, e)), body(b, other, e))
    assert rg.stats["replays"] == replays + 1
    # a's result held by a caller: b on something else must not write a's buffer
    held = rg.run(body, a, (x, e))
    want = body(a, x, e)
    torch.testing.assert_close(rg.run(body, b, (other, e)), body(b, other, e))
    torch.testing.assert_close(held, want)
    assert rg.skipped["a buffer its replay writes was still held by an earlier call's result"] == 1
    assert isinstance(entry, G._Graph)


@torch.inference_mode()
def test_replaced_weight_drops_the_region_graphs(graph_standin):
    blk, fake = Block().eval(), graph_standin()
    rg = RegionGraphs(graphs=fake)
    x, e = _inputs()
    for _ in range(3):
        rg.begin_call()       # each UNet call starts so (Accelerator.active)
        rg.run(body, blk, (x, e))
    # ComfyUI's set_attr_param: a new Parameter object in place of the old one
    blk.conv.weight = torch.nn.Parameter(blk.conv.weight * 2, requires_grad=False)
    rg.begin_call()
    out = rg.run(body, blk, (x, e))
    torch.testing.assert_close(out, body(blk, x, e))
    assert rg.stats["dropped for new weights"] == 1
    rg.begin_call()
    rg.run(body, blk, (x, e))
    assert fake.captures == 2
    # module.to(): the same Parameters, their data moved (a copy of the weights here)
    blk.norm.weight.data = blk.norm.weight.data.clone() * 3
    rg.begin_call()
    torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert rg.stats["dropped for new weights"] == 2
    assert "2 dropped when weights were replaced" in "\n".join(rg.status_lines())


@torch.inference_mode()
def test_region_calls_read_no_weights(graph_standin, monkeypatch):
    """A region call, replaying, reads none of its parameters: their addresses are read once per UNet
    call, by ``begin_call``, for every region. (Before: each region call walked its parameters.)"""
    from unet_compiler.compiler import graphs as G  # noqa: N812
    blk = Block().eval()
    rg = RegionGraphs(graphs=graph_standin())
    x, e = _inputs()
    for _ in range(3):
        rg.begin_call()
        rg.run(body, blk, (x, e))
    reads = []
    real = G._Region.weight_ptrs
    monkeypatch.setattr(G._Region, "weight_ptrs", lambda self: reads.append(1) or real(self))
    rg.begin_call()
    assert len(reads) == 1
    for _ in range(5):
        rg.run(body, blk, (x, e))
    assert len(reads) == 1 and rg.stats["replays"] == 7


def test_autograd_calls_are_never_graphed(graph_standin):
    blk, fake = Block(), graph_standin()
    rg = RegionGraphs(graphs=fake)
    x, e = _inputs()
    for _ in range(3):
        out = rg.run(body, blk, (x, e))
    assert out.requires_grad and fake.captures == 0 and rg.skipped["autograd on"] == 3


@torch.inference_mode()
def test_failed_capture_turns_graphs_off_and_answers_anyway(graph_standin):
    blk = Block().eval()
    rg = RegionGraphs(graphs=graph_standin(fail="operation not permitted when stream is capturing"))
    x, e = _inputs()
    for _ in range(3):
        torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert rg.off and "not permitted" in rg.off
    assert "cuda graphs: off after a failed capture" in "\n".join(rg.status_lines())


def test_broadcast_inputs_and_failed_replays_are_safe(graph_standin):
    blk = Block().eval()

    class BadReplay(graph_standin):
        def capture(self, fn, device):
            g, out = super().capture(fn, device)

            class Broken:
                calls = 0

                def replay(self):
                    Broken.calls += 1
                    if Broken.calls > 1:  # the capture call's replay works, a later one fails
                        raise RuntimeError("CUDA error: an illegal memory access")
                    g.replay()
            return Broken(), out
    rg = RegionGraphs(graphs=BadReplay())
    x, e = _inputs()
    with torch.inference_mode():
        # an expanded (stride-0) emb cannot get a static buffer: never graphed
        wide = e[:1].expand(2, 4)
        for _ in range(3):
            torch.testing.assert_close(rg.run(body, blk, (x, wide)), body(blk, x, wide))
        assert rg.skipped["non-tensor or broadcast input"] == 3 and rg.stats["captured"] == 0
        for _ in range(4):
            torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert rg.off.startswith("replay: RuntimeError: CUDA error"), rg.off
    assert rg.bytes == 0 and not rg.regions


@torch.inference_mode()
def test_static_buffers_are_counted(graph_standin):
    blk = Block().eval()
    rg = RegionGraphs(graphs=graph_standin())
    x, e = _inputs()
    rg.run(body, blk, (x, e))
    rg.run(body, blk, (x, e))
    assert rg.bytes == (2 * x.numel() + e.numel()) * 4  # x and emb in, one x-sized output
    assert "MiB of static buffers" in "\n".join(rg.status_lines())


def test_cuda_graphs_refused_with_the_reason(monkeypatch, tiny_unet):
    u = tiny_unet()
    a = Accelerator(u, CompileConfig(backend="inductor", cuda_graphs=True),
                    device=torch.device("cpu"))
    assert a.graphs is None
    assert "cuda graphs: not used: they need CUDA and the model runs on cpu" in a.text()
    a = Accelerator(u, CompileConfig(backend="eager", cuda_graphs=True),
                    device=torch.device("cuda"))
    assert a.graphs is None and "the eager backend does not use them" in a.text()
    # ComfyUI's default allocator: the exact fix in the report
    monkeypatch.setattr(triton_compat, "gather", lambda: triton_compat.Facts(allocator_backend="cudaMallocAsync"))
    from unet_compiler.compiler import backends, runtime
    monkeypatch.setattr(runtime, "choose", lambda req, dev, off=None, arch="unet": (backends.lookup_backend("inductor")(), []))
    a = Accelerator(u, CompileConfig(backend="inductor", cuda_graphs=True),
                    device=torch.device("cuda"))
    assert a.graphs is None and "--disable-cuda-malloc" in a.text()
    # off by default: no line at all
    a = Accelerator(u, CompileConfig(backend="inductor"), device=torch.device("cpu"))
    assert "cuda graphs" not in a.text()


def _sample(u, seed, b=2):
    """One call of a tiny diffusers UNet on inputs and a timestep that change with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x, c = torch.randn(b, 4, 8, 8, generator=g), torch.randn(b, 77, 32, generator=g)
    with torch.inference_mode():
        return u(x, torch.full((b,), 500.0 + seed), c).sample


def _production_graphs(u, monkeypatch):
    """``u`` accelerated through the production CudaGraphs (inside ``fake_cuda``), its side streams
    fresh and its CPU tensors taken for CUDA's; returns the accelerator."""
    from unet_compiler.compiler import graphs as G  # noqa: N812
    monkeypatch.setattr(G, "_SIDE_STREAMS", {})
    monkeypatch.setattr(G.CudaGraphs, "usable", lambda self, tensors: None)   # CPU tensors stand for CUDA's
    return _graphed_uncompiled(u, G.CudaGraphs)[0]


def _graphed_uncompiled(u, standin):
    """Accelerate ``u`` with the regions' own (uncompiled) bodies routed through
    RegionGraphs on the stand-in: the runtime's path without a compile."""
    from unet_compiler.compiler import compile_unet
    from unet_compiler.compiler import regions as R
    from unet_compiler.compiler.api import accelerator_of
    compile_unet(u, "inductor", prepack_conv=False, prepack_linear=False)
    accel = accelerator_of(u)
    fake = standin()
    accel.graphs = RegionGraphs(graphs=fake)
    accel._install(R.BODIES)
    return accel, fake


def test_warmup_captures_each_warmed_shape(tiny_unet, graph_standin):
    from unet_compiler.compiler import warmup
    u = tiny_unet()
    accel, fake = _graphed_uncompiled(u, graph_standin)
    text = warmup(u, "2x64x64, 1x64x64", context_tokens=77, compare=False)
    n = len(accel._shims)
    assert fake.captures == 2 * n, (fake.captures, n)
    assert "2x64x64 (cuda graph capture)" in text and "1x64x64 (cuda graph capture)" in text
    with torch.inference_mode():
        u(torch.randn(2, 4, 8, 8), torch.full((2,), 10.0), torch.randn(2, 77, 32))
    assert fake.captures == 2 * n  # sampling at a warmed shape only replays


def test_tiny_unet_through_region_graphs_matches_eager(tiny_unet, graph_standin):
    """Every region of a real (tiny) diffusers UNet through RegionGraphs: the
    runtime's routing, static inputs and output copies, per-region keys."""
    u = tiny_unet()

    def run(seed, b=2):
        g = torch.Generator().manual_seed(seed)
        x, c = torch.randn(b, 4, 8, 8, generator=g), torch.randn(b, 77, 32, generator=g)
        with torch.inference_mode():
            return u(x, torch.full((b,), 500.0), c).sample
    refs = [run(s) for s in range(3)] + [run(9, b=1)]
    accel, fake = _graphed_uncompiled(u, graph_standin)
    outs = [run(s) for s in range(3)] + [run(9, b=1)]
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    n = len(accel._shims)
    assert fake.captures == n, (fake.captures, n)          # every region captured at batch 2 on call 2
    assert accel.graphs.stats["replays"] == 2 * n          # capture call + call 3
    assert "cuda graphs: %d captured" % n in accel.text()


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU: real CUDA graph capture is tested on GPU machines only")
@pytest.mark.parametrize("backend", ["triton", "inductor"])
def test_real_cuda_graphs_on_gpu(backend, tiny_unet):
    if backend == "triton":
        pytest.importorskip("triton")
    from unet_compiler.compiler import compile_unet, report
    from unet_compiler.compiler.api import accelerator_of
    u = tiny_unet().cuda()

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        x, c = torch.randn(2, 4, 8, 8, generator=g).cuda(), torch.randn(2, 77, 32, generator=g).cuda()
        with torch.inference_mode():
            return u(x, torch.full((2,), 500.0, device="cuda"), c).sample
    refs = [run(s) for s in range(3)]
    compile_unet(u, backend, cuda_graphs=True)
    accel = accelerator_of(u)
    if accel.graphs is None:
        pytest.skip("cuda graphs refused here: " + report(u))
    outs = [run(s) for s in range(3)]
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    assert accel.graphs.stats["captured"] > 0 and accel.graphs.stats["replays"] > 0, report(u)
    # in place (same storage): the next replay reads the new values
    with torch.no_grad():
        u.down_blocks[0].resnets[0].conv1.weight.mul_(1.5)
    out = run(7)
    from unet_compiler.compiler.api import uncompile_unet
    uncompile_unet(u)
    torch.testing.assert_close(out, run(7), rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU: real CUDA graph capture is tested on GPU machines only")
def test_real_cuda_graphs_under_cuda_malloc_async():
    """ComfyUI's default allocator on a real GPU, in its own process (an abort there kills only it):
    the triton backend's graphs capture and replay a tiny bf16 UNet with the kernels kept out of the
    captures, within the bf16 gate, and the process exits cleanly (on the H100 the kernels inside a
    capture aborted it)."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
    p = subprocess.run([sys.executable, "-m", "unet_compiler.bench.gpu_probes", "stage", "pack"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(next(ln[7:] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")))
    assert res["graphs"] and "captured" in res["graphs"][0] and " 0 captured" not in res["graphs"][0], res
    assert any("kept out of CUDA graph captures" in ln for ln in res["kernels"]), res
    assert res["max_abs_diff"] <= 0.1, res


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU: real CUDA graph capture is tested on GPU machines only")
def test_real_cuda_graphs_capture_the_kernels_in_bf16(tiny_unet, monkeypatch):
    """What a GPU user runs: a bf16 model, the triton backend with graphs on. Every region is captured
    with the pack's kernels inside (attention included: bf16 is not declined), replays answer within
    the bf16 gate (Warmup Shapes' tolerance: 0.1 of max(1, max |eager|)). (The fp32 test above has
    attention declined on CUDA, so it cannot show the kernels ran inside a graph.)"""
    pytest.importorskip("triton")
    from unet_compiler.compiler import compile_unet, report
    from unet_compiler.compiler.api import accelerator_of
    from unet_compiler.compiler.backends import _kernel_choice as KC
    monkeypatch.setenv(KC.CHOICE_ENV, "triton")   # the kernels, not whichever measured faster
    u = tiny_unet().to("cuda", torch.bfloat16)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        x, c = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 77, 32, generator=g)
        with torch.inference_mode():
            return u(x.to("cuda", torch.bfloat16), torch.full((2,), 500.0, device="cuda"),
                     c.to("cuda", torch.bfloat16)).sample.float()
    refs = [run(s) for s in range(4)]
    compile_unet(u, "triton", cuda_graphs=True)
    accel = accelerator_of(u)
    if accel.graphs is None:
        pytest.skip("cuda graphs refused here: " + report(u))
    outs = [run(s) for s in range(4)]      # call 1 eager-first, call 2 captures, calls 3-4 replay
    for out, ref in zip(outs, refs, strict=True):
        assert float((out - ref).abs().max()) <= 0.1 * max(1.0, float(ref.abs().max())), report(u)
    n = len(accel._shims)
    assert accel.graphs.off is None and accel.graphs.stats["captured"] == n, report(u)
    assert accel.graphs.stats["replays"] >= 3 * n, report(u)
    fired = accel.backend.ops.fired
    assert fired["attention"] > 0 and fired["groupnorm_silu"] > 0 and fired["geglu"] > 0, report(u)


def test_probe_shapes_only_for_backends_that_specialise(monkeypatch, tiny_unet):
    """Warmup primes batch-1 / 64 px probe shapes only where code is specialised per
    shape (inductor graphs, Triton kernel variants), not for ipex's shape-free copies. (A range:
    one warmup shape is compiled static for exactly itself, with no probes.)"""
    from unet_compiler.compiler.warmup import warmup_runs
    from unet_compiler.compiler.shapes import as_shapes
    u = tiny_unet()
    accel = Accelerator(u, CompileConfig(backend="inductor"), device=torch.device("cpu"))
    ran = []
    warmup_runs(accel, as_shapes("2x64x64, 2x128x128"), lambda s: ran.append(s.label) or torch.zeros(1), compare=False)
    assert len(ran) > 1 and any("probe" in label for label, _, _ in accel.report.warmup)
    monkeypatch.setattr(type(accel.backend), "specialises_on_shapes", False)
    accel.cache.primed.clear()   # (the first run named its shapes in the entry: they would not run again)
    ran.clear()
    accel.report.warmup.clear()
    warmup_runs(accel, as_shapes("2x64x64, 2x128x128"), lambda s: ran.append(s.label) or torch.zeros(1), compare=False)
    assert ran == ["2x64x64", "2x128x128"], ran


def test_every_accelerator_shares_one_side_stream_per_device(monkeypatch):
    """torch keeps a cuBLAS workspace per (handle, stream) and never frees it: a side stream per
    accelerator grew memory with every Compile UNet run. Two graph layers, one stream."""
    import contextlib

    from unet_compiler.compiler import graphs as G
    made = []

    class FakeStream:
        def __init__(self, device):
            made.append(device)

        def wait_stream(self, other):
            pass
    monkeypatch.setattr(G, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream("current"))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    a, b = G.CudaGraphs(), G.CudaGraphs()
    assert a.first_call(lambda: 1, "cuda:0") == 1 and b.first_call(lambda: 2, "cuda:0") == 2
    assert [d for d in made if d != "current"] == ["cuda:0"], made


@torch.inference_mode()
def test_out_of_memory_at_capture_costs_that_shape_its_graph_only(graph_standin):
    """An out-of-memory capture (a hires pass on an 8 GB card) leaves that shape without a graph, once:
    the call answers, later calls at that shape do not try again, other shapes keep theirs and the
    report says which shape and why (before: the error left the graph layer, every later call at the
    shape tried and failed to capture again)."""
    class OomAt12(graph_standin):
        side, attempts = None, 0   # the side of this call's input; captures tried

        def capture(self, fn, device):
            self.attempts += 1
            if self.side == 12:   # its static buffers do not fit
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")
            return super().capture(fn, device)
    blk, fake = Block().eval(), OomAt12()
    rg = RegionGraphs(graphs=fake)
    for side in (8, 8, 12, 12, 12, 12, 8):
        fake.side = side
        x, e = _inputs(side=side)
        torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert rg.off is None and fake.captures == 1 and fake.attempts == 2   # one try at 12 px, never again
    assert rg.skipped["out of memory at capture (2x4x12x12)"] == 3 and rg.stats["replays"] == 2
    assert "out of memory at capture (2x4x12x12) x3" in "\n".join(rg.status_lines())


@torch.inference_mode()
def test_static_buffers_stay_within_their_budget(graph_standin):
    """The number of shapes follows the latent size: a capture that would take the static buffers
    past the budget (a share of the card) is not made, and the report names the budget."""
    blk = Block().eval()
    x8, e8 = _inputs(side=8)
    one_shape = (2 * x8.numel() + e8.numel()) * 4
    fake = graph_standin()
    rg = RegionGraphs(graphs=fake, budget=int(one_shape * 1.5))
    for side in (8, 8, 12, 12, 8):
        x, e = _inputs(side=side)
        torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert fake.captures == 1 and rg.bytes == one_shape
    budget_mib = int(one_shape * 1.5) / 2**20
    assert rg.skipped[f"graph memory at its budget ({budget_mib:.0f} MiB)"] == 1
    assert "budget 0 MiB" in "\n".join(rg.status_lines())
    # a small latent fits many shapes within the same budget
    rg = RegionGraphs(graphs=graph_standin(), budget=one_shape * 4)
    for side in (4, 4, 5, 5, 6, 6):
        x, e = _inputs(side=side)
        rg.run(body, blk, (x, e))
    assert rg.stats["captured"] == 3


def test_the_card_sets_the_budget():
    from unet_compiler.compiler import graphs as G
    assert G.BUDGET_SHARE == 1 / 8

    class Card:
        def budget(self, device):
            return 8 * 2**30 // 8
    rg = RegionGraphs(graphs=Card())
    assert rg._budget("cuda:0") == 2**30 and rg.budget == 2**30


@torch.inference_mode()
def test_release_frees_every_graph_and_the_next_call_captures_again(graph_standin):
    blk, fake = Block().eval(), graph_standin()
    trims = []
    fake.trim = lambda new_pool=False: trims.append(new_pool)
    rg = RegionGraphs(graphs=fake)
    x, e = _inputs()
    for _ in range(3):
        rg.run(body, blk, (x, e))
    assert rg.bytes > 0 and fake.captures == 1
    assert rg.release("ComfyUI unloaded the model") == 1
    assert rg.bytes == 0 and trims == [True]
    assert "1 freed (ComfyUI unloaded the model)" in "\n".join(rg.status_lines())
    torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert fake.captures == 2   # the shape was run before: captured at once, no eager first call again
    assert rg.release("again") == 1 and rg.release("nothing left") == 0


@torch.inference_mode()
def test_no_capture_while_a_background_compile_runs(graph_standin, monkeypatch):
    """While the compile thread runs (another model's background compile), a region call may run
    its body's own code in place of a variant still compiling: a graph would keep that for good."""
    blk, fake = Block().eval(), graph_standin()
    thread = Scheduler().thread
    rg = RegionGraphs(graphs=fake, thread=thread)
    x, e = _inputs()
    monkeypatch.setattr(thread, "running", True)
    for _ in range(3):
        torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert fake.captures == 0 and rg.skipped["a background compile was running"] == 3
    monkeypatch.setattr(thread, "running", False)
    for _ in range(2):
        rg.run(body, blk, (x, e))
    assert fake.captures == 1


@torch.inference_mode()
def test_auto_keeps_a_graph_only_where_a_replay_is_faster(graph_standin):
    """Backend auto's measured graphs: at a launch-bound shape (small latent) the replay beats the
    region's launches and the graph is kept; at a compute-bound one it does not, so that shape runs
    without a graph and holds no buffers; every answer is right, and the report says which."""
    class Timed(graph_standin):
        side, calls = None, 0

        def timed(self, fn, device):
            self.calls += 1
            launch = self.calls % 2 == 1            # first the launches, then the replay
            ms = {8: (1.0, 0.2), 32: (1.0, 0.97)}[self.side][0 if launch else 1]
            return fn(), ms / 1000
    blk, fake = Block().eval(), Timed()
    rg = RegionGraphs(graphs=fake, measured=True)
    for side in (8, 8, 8, 32, 32, 32, 32):
        fake.side = side
        x, e = _inputs(side=side)
        torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    x8, e8 = _inputs(side=8)
    assert rg.stats["kept"] == 1 and rg.stats["not kept"] == 1 and rg.bytes == (2 * x8.numel() + e8.numel()) * 4
    assert rg.skipped["auto: replay not faster than launching its kernels"] == 2
    text = "\n".join(rg.status_lines())
    assert "cuda graphs (auto): 1 kept where a replay measured faster" in text and "1 not kept" in text, text
    # freed at a prompt's end: the next prompt captures the kept shape again without measuring it again
    timed = fake.calls
    rg.release("freed at the end of each prompt")
    fake.side = 8
    x, e = _inputs(side=8)
    torch.testing.assert_close(rg.run(body, blk, (x, e)), body(blk, x, e))
    assert fake.calls == timed and fake.captures == 3 and rg.stats["kept"] == 1 and rg.bytes > 0


def test_backend_auto_on_cuda_measures_its_graphs(monkeypatch, tiny_unet):
    """Backend auto on CUDA with cuda_graphs off: graphs where they win, said in the report; a backend
    named outright with cuda_graphs off: none; cuda_graphs on: every graph (not measured). Measured
    graphs do not stop background compile (no capture while the thread runs)."""
    from unet_compiler.compiler import backends, runtime
    from unet_compiler.compiler.lifecycle import background
    u = tiny_unet()
    monkeypatch.setattr(backends, "graphs_problem", lambda backend, device: None)
    monkeypatch.setattr(runtime, "choose", lambda req, dev, off=None, arch="unet": (backends.lookup_backend("inductor")(), []))
    a = Accelerator(u, CompileConfig(backend="auto"), device=torch.device("cuda"))
    assert a.graphs is not None and a.graphs.measured
    assert "cuda graphs: auto (backend auto on CUDA)" in a.text()
    assert background.problem(a) != background.problem(Accelerator(u, CompileConfig(backend="auto", cuda_graphs=True),
                                                                   device=torch.device("cuda")))
    assert Accelerator(u, CompileConfig(backend="inductor"), device=torch.device("cuda")).graphs is None
    forced = Accelerator(u, CompileConfig(backend="auto", cuda_graphs=True), device=torch.device("cuda"))
    assert forced.graphs is not None and not forced.graphs.measured
    assert Accelerator(u, CompileConfig(backend="auto"), device=torch.device("cpu")).graphs is None


def test_graphs_outlive_a_prompt_while_the_card_has_room(monkeypatch):
    """CudaGraphs.short_of_room (the production object; torch's free-memory query faked): graphs stay
    past a prompt's end while the card has at least BUDGET_SHARE of its memory free outside torch's
    cache, and say why not otherwise."""
    from unet_compiler.compiler.graphs import CudaGraphs
    cg = CudaGraphs()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 << 30, 80 << 30))
    assert cg.short_of_room(torch.device("cuda", 0)) is None
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 24 << 30))
    assert cg.short_of_room(torch.device("cuda", 0)) == "1024 MiB free on the card, under 12.5% of it"


def test_kernels_are_timed_as_the_calls_will_run(monkeypatch, tiny_unet):
    """The triton backend's kernel-vs-torch choice times device time only where graphs will replay
    the kernels: graphs asked for under ComfyUI's cudaMallocAsync, whose captures hold the kernels
    through direct launches -> device time; the same where direct launches are off (their check
    failed), so the captures run the torch ops -> wall time, each launch paid; graphs refused -> wall
    time; backend auto on CUDA (measured graphs) -> device time; graphs turned off by a failed capture
    -> wall time for what is timed from then on. (Before: device time whenever cuda_graphs was asked
    for, wall time under auto's graphs.)"""
    from unet_compiler.compiler import backends, runtime
    from unet_compiler.compiler.backends import triton as TB
    from unet_compiler.kernels import _common
    u = tiny_unet()
    monkeypatch.setattr(runtime, "choose", lambda req, dev, off=None, arch="unet": (TB.TritonBackend(), []))
    monkeypatch.setattr(triton_compat, "gather", lambda: triton_compat.Facts(allocator_backend="cudaMallocAsync"))
    a = Accelerator(u, CompileConfig(backend="triton", cuda_graphs=True), device=torch.device("cuda"))
    assert a.graphs is not None and a.backend.ops.in_captures and a.backend.ops.timing == "device"
    monkeypatch.setattr(_common, "BIND", [False])
    a = Accelerator(u, CompileConfig(backend="triton", cuda_graphs=True), device=torch.device("cuda"))
    assert a.graphs is not None and not a.backend.ops.in_captures and a.backend.ops.timing == "wall"
    monkeypatch.setattr(backends, "graphs_problem", lambda backend, device: "refused")
    a = Accelerator(u, CompileConfig(backend="triton", cuda_graphs=True), device=torch.device("cuda"))
    assert a.graphs is None and a.backend.ops.timing == "wall"
    assert not a.backend.ops.in_captures   # no graphs of its own, but another party's capture: still out
    monkeypatch.setattr(triton_compat, "gather", lambda: triton_compat.Facts(allocator_backend="native"))
    monkeypatch.setattr(backends, "graphs_problem", lambda backend, device: None)
    a = Accelerator(u, CompileConfig(backend="auto"), device=torch.device("cuda"))
    assert a.graphs is not None and a.graphs.measured and a.backend.ops.timing == "device"
    a.graphs._turn_off("capture", RuntimeError("operation not permitted when stream is capturing"))
    assert a.backend.ops.timing == "wall"


def test_the_strict_stand_in_replays_ops_not_python(strict_graph_standin):
    """The strict stand-in (tests/conftest.py) behaves as a CUDA graph where the loose one cannot:
    a replay does not re-run the body's Python (a Python value read at capture stays), and a host
    sync inside a capture is refused."""
    blk = Block().eval()
    state = {"scale": 1.0}

    def scaled(block, x, emb):
        return body(block, x, emb) * state["scale"]
    rg = RegionGraphs(graphs=strict_graph_standin())
    x, e = _inputs()
    with torch.inference_mode():
        for _ in range(2):
            rg.run(scaled, blk, (x, e))
        state["scale"] = 2.0               # Python state after the capture: a graph never sees it
        x2, e2 = _inputs(seed=5)
        torch.testing.assert_close(rg.run(scaled, blk, (x2, e2)), body(blk, x2, e2))   # fresh inputs, old scale
    assert rg.stats["replays"] == 2

    def syncs(block, x, emb):
        return body(block, x, emb) * float(x.abs().max())   # .item(): a host sync
    rg = RegionGraphs(graphs=strict_graph_standin())
    with torch.inference_mode():
        for _ in range(3):
            torch.testing.assert_close(rg.run(syncs, blk, (x, e)), syncs(blk, x, e))   # answered anyway
    assert rg.off is not None and "not permitted when stream is capturing" in rg.off


def test_tiny_unet_under_strict_graphs_matches_eager(tiny_unet, strict_graph_standin):
    """Every region of the tiny diffusers UNet captured by the strict stand-in and replayed as
    recorded ops: no region's body reads a device value or depends on Python state per call."""
    u = tiny_unet()

    refs = [_sample(u, s) for s in range(4)]
    accel, fake = _graphed_uncompiled(u, strict_graph_standin)
    outs = [_sample(u, s) for s in range(4)]
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    n = len(accel._shims)
    assert accel.graphs.off is None, accel.graphs.off
    assert fake.captures == n and accel.graphs.stats["replays"] == 3 * n


def test_the_production_cuda_graphs_over_a_faked_torch_cuda(tiny_unet, monkeypatch):
    """compiler/graphs.py's own CudaGraphs (no stand-in) over tests/_fake_cuda.py's torch.cuda: the tiny
    UNet's regions captured on the side stream in one private pool and replayed as recorded ops ==
    eager; the budget from the card; a prompt end keeps the graphs with room, and frees them (the
    cache emptied, a new pool next time) when the card is short; a host sync in a capture turns
    graphs off and the call still answers."""
    from unet_compiler.tests._fake_cuda import fake_cuda
    from unet_compiler.compiler import graphs as G  # noqa: N812
    u = tiny_unet()

    refs = [_sample(u, s) for s in range(4)]
    with fake_cuda(monkeypatch, total=24 << 30, free=20 << 30) as cuda:
        accel = _production_graphs(u, monkeypatch)
        outs = [_sample(u, s) for s in range(4)]
        for out, ref in zip(outs, refs, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        g, n = accel.graphs, len(accel._shims)
        assert cuda.log["capture_begin"] == cuda.log["capture_end"] == n == g.stats["captured"]
        assert cuda.log["replay"] == 3 * n and cuda.pools == 1 and len(G._SIDE_STREAMS) == 1
        assert g.budget == int((24 << 30) * G.BUDGET_SHARE)
        assert g.prompt_ended("end of prompt") == 0 and g.bytes > 0            # room: kept
        cuda.free = 1 << 30
        assert g.prompt_ended("end of prompt") == n and g.bytes == 0           # short: freed
        assert cuda.log["empty_cache"] == 1 and g.graphs.pool is None
        torch.testing.assert_close(_sample(u, 0), refs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_sample(u, 1), refs[1], rtol=1e-5, atol=1e-5)
        assert cuda.pools == 2 and g.stats["captured"] == 2 * n        # captured again, in a new pool

        def syncs(block, x, emb):
            return body(block, x, emb) * float(x.abs().max())
        rg, blk = G.RegionGraphs(graphs=G.CudaGraphs()), Block().eval()
        x, e = _inputs()
        with torch.inference_mode():
            for _ in range(3):
                torch.testing.assert_close(rg.run(syncs, blk, (x, e)), syncs(blk, x, e))
        assert rg.off is not None and "not permitted when stream is capturing" in rg.off and not cuda.capturing


#: a one-level tiny UNet: every region kind, half the interpreted kernel launches
ONE_LEVEL = dict(block_out_channels=(32,), down_block_types=("CrossAttnDownBlock2D",),
                 up_block_types=("CrossAttnUpBlock2D",))


def _triton_on_fake_cuda(u, monkeypatch, **config):
    """``u`` accelerated by the triton backend as on a CUDA device (the interpreter's kernels on CPU
    tensors; run inside tests/_fake_cuda.py's fake_cuda), its allocator read from the fake."""
    from unet_compiler.compiler import api, runtime
    from unet_compiler.compiler.overrides import own
    from unet_compiler.compiler import graphs as G  # noqa: N812
    from unet_compiler.compiler.backends import triton as TB  # noqa: N812
    monkeypatch.setattr(runtime, "choose", lambda req, dev, off=None, arch="unet": (TB.TritonBackend(), []))
    monkeypatch.setattr(triton_compat, "gather",
                        lambda: triton_compat.Facts(allocator_backend=torch.cuda.memory.get_allocator_backend()))
    monkeypatch.setattr(G, "_SIDE_STREAMS", {})
    monkeypatch.setattr(G.CudaGraphs, "usable", lambda self, tensors: None)   # CPU tensors stand for CUDA's
    accel = Accelerator(u, CompileConfig(backend="triton", **config), device=torch.device("cuda"))
    u.__dict__[api._ATTR] = accel
    u.__dict__["forward"] = own(lambda *a, **k: api._accelerated_forward(accel, u, *a, **k))   # as compile_unet
    return accel


@pytest.mark.skipif(CUDA, reason="the fake CUDA runs the kernels under the Triton interpreter (a machine "
                    "without a GPU); on a GPU the allocator probe (bench gpu) runs the real capture")
@pytest.mark.parametrize("whole", [True, False], ids=["one graph per call", "per region"])
def test_graphs_under_comfyuis_allocator_hold_the_kernels(tiny_unet, monkeypatch, whole):
    """ComfyUI's default allocator, cudaMallocAsync, as the H100 run met it (tests/_fake_cuda.py: a
    Triton launch given a tensor the capture allocated is refused, and the process aborts): the
    triton backend's graphs are captured with the pack's kernels inside, each launched by its
    compiled kernel with integer pointers (kernels/_common.Launch); the replays launch them again,
    every call == eager, nothing aborts, no kernel call is left to the torch ops, and the kernels are
    timed by device time, as graphs replay them. Both ways: one graph per UNet call, and region by
    region where the call cannot be one graph (a forward hook on the model). (Before: the captures
    held the torch ops the kernels replace, the kernels ran only outside captures, timed by wall
    time; and every call was region by region.)"""
    from unet_compiler.tests._fake_cuda import fake_cuda
    u = tiny_unet(**ONE_LEVEL)
    refs = [_sample(u, s) for s in range(3)]
    with fake_cuda(monkeypatch, allocator="cudaMallocAsync") as cuda:
        accel = _triton_on_fake_cuda(u, monkeypatch, cuda_graphs=True)
        assert accel.graphs is not None and accel.call_graphs is not None, accel.text()
        hook = None if whole else u.conv_in.register_forward_hook(lambda m, a, out: None)
        outs = [_sample(u, s) for s in range(3)]
        if hook is not None:
            hook.remove()
        assert cuda.aborted is None, cuda.aborted
        g, c, ops = accel.graphs, accel.call_graphs.graphs, accel.backend.ops
        n = len(accel._shims)
        if whole:
            assert c.off is None and c.stats["captured"] == 1 and c.stats["replays"] == 2
            assert g.stats["captured"] == 0 and not g.skipped, (dict(g.stats), dict(g.skipped))
            assert accel.regions_ran_last and len(accel.regions_ran_last) == n   # a replay counts its regions
        else:
            assert g.off is None and g.stats["captured"] == n > 0 and g.stats["replays"] == 2 * n
            assert c.stats["captured"] == 0 and accel.call_graphs.skipped["a forward hook runs inside the call"] == 3
            # what a capture grows torch's reservation by says nothing under cudaMallocAsync (the H100
            # read 0 MiB for 2.9 GiB of outputs): the pool is not claimed, the static buffers are held
            assert g.pool_bytes is None and g.held == g.bytes > 0
            assert "graph pool" not in "\n".join(g.status_lines())
        assert ops.in_captures and not ops.declined, dict(ops.declined)
        captured = cuda.log["kernel_captured"]
        assert captured > 0 and cuda.log["kernel_replayed"] == 2 * captured
        assert ops.timing == "device"                # a replay pays device time only
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    text = accel.text()
    assert "--disable-cuda-malloc" not in text
    assert ("one graph per UNet call: 1 captured, 2 replays" in text) == whole, text
    assert ("a forward hook runs inside the call x3" in text) != whole, text


@pytest.mark.skipif(CUDA, reason="the fake CUDA runs the kernels under the Triton interpreter (a machine "
                    "without a GPU); on a GPU the allocator probe (bench gpu) runs the real capture")
def test_the_fake_allocator_aborts_where_the_h100_did(tiny_unet, monkeypatch):
    """The stand-in's fidelity: the pack's kernels launched through triton's JIT inside a capture
    under cudaMallocAsync (what the H100 run did with the refusal lifted: direct launches off, the
    JIT let into captures) meet triton's pointer refusal, and the fake records the abort that
    followed; under the native allocator the same capture holds the kernels, and its replays launch
    them again (== eager)."""
    from unet_compiler.kernels import _common
    from unet_compiler.tests._fake_cuda import fake_cuda
    u = tiny_unet(**ONE_LEVEL)
    with fake_cuda(monkeypatch, allocator="cudaMallocAsync") as cuda:
        monkeypatch.setattr(_common, "BIND", [False])
        monkeypatch.setattr(_common, "_capturing", lambda: False)
        accel = _triton_on_fake_cuda(u, monkeypatch, cuda_graphs=True)
        accel.call_graphs = None                  # region by region, as then
        accel.backend.ops.in_captures = True      # the kernels inside the captures, as before
        for s in range(2):
            _sample(u, s)
        assert cuda.aborted is not None and "Pointer argument" in (accel.graphs.off or "")
    monkeypatch.undo()
    refs = [_sample(u, s) for s in range(3)]
    with fake_cuda(monkeypatch, allocator="native") as cuda:
        accel = _triton_on_fake_cuda(u, monkeypatch, cuda_graphs=True)
        accel.call_graphs = None
        outs = [_sample(u, s) for s in range(3)]   # the third call replays the kernels the graphs hold
        assert cuda.aborted is None and accel.graphs.off is None and accel.graphs.stats["captured"] > 0
        assert accel.graphs.stats["replays"] == 2 * accel.graphs.stats["captured"]
        for out, ref in zip(outs, refs, strict=True):
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        assert accel.backend.ops.in_captures and not accel.backend.ops.declined


class _BlockGraph:
    """A block called as ComfyUI's graph-capturing callers call theirs (the LLM decoders and audio
    decoders of ``comfy/model_prefetch.py``'s users): its inputs copied into buffers of its own,
    then ``prefetch_queue_pop(queue, device, block, core=..., enable_graph=True,
    malloc_scope=...)``, whose ``core`` runs the block on them; the outputs are the last ``core``'s
    (a replay rewrites them in place)."""

    def __init__(self, block, queue, scope):
        self.__dict__.update(block=block, queue=queue, scope=scope)

    def __getattr__(self, name):
        return getattr(self.block, name)

    def __call__(self, *args, **kwargs):
        import comfy
        from torch.utils._pytree import tree_flatten, tree_unflatten
        leaves, spec = tree_flatten((args, kwargs))
        held = self.block.__dict__.get("_test_inputs")
        if held is None or held[0] != spec:         # (allocated once, unrecorded: the callers' buffers)
            with comfy.model_prefetch.pause_malloc_graph():
                held = self.block.__dict__["_test_inputs"] = (
                    spec, [t.clone() if isinstance(t, torch.Tensor) else t for t in leaves])
        for mine, given in zip(held[1], leaves, strict=True):
            if isinstance(mine, torch.Tensor):
                mine.copy_(given)
        a, k = tree_unflatten(held[1], spec)
        block = self.block

        def core():
            block.__dict__["_test_out"] = block(*a, **k)
        comfy.model_prefetch.prefetch_queue_pop(self.queue, None, block, core=core, enable_graph=True,
                                                malloc_scope=self.scope)
        return block.__dict__["_test_out"]


def _captured_blocks(blocks, scope):
    """``blocks`` (a ModuleList) iterated as such a caller's loop: a prefetch queue, each block
    through :class:`_BlockGraph`, the queue's last pop after it."""
    import comfy

    class Captured(torch.nn.ModuleList):
        def __iter__(self):
            mp = comfy.model_prefetch
            queue = mp.make_prefetch_queue(list(super().__iter__()), None, {"prefetch_dynamic_vbars": True})
            for block in super().__iter__():
                yield _BlockGraph(block, queue, scope)
            mp.prefetch_queue_pop(queue, None, None, malloc_scope=scope)
    blocks.__class__ = Captured


@pytest.mark.comfy
@pytest.mark.skipif(CUDA, reason="the fake CUDA runs the kernels under the Triton interpreter (a machine "
                    "without a GPU)")
def test_comfyuis_block_graphs_hold_the_packs_kernels(comfy, tiny_unet, monkeypatch):
    """ComfyUI's own block CUDA graphs (tests/_comfy_compiler.py's ``prefetch_queue_pop``: a warmed
    block captured whole, then replayed while its slots stay resident) around the triton backend's
    regions, under cudaMallocAsync and ``--assert-graph-breaks``: the pack's kernels are launched
    inside ComfyUI's captures (direct launches, integer pointers: nothing aborts) and replayed by
    them; the pack captures no graph of its own inside another; no graph break; == eager. The same
    kernels launched through triton's JIT there are caught, as the H100 run met it."""
    from unet_compiler.compiler import graphs as G  # noqa: N812
    from unet_compiler.kernels import _common
    from unet_compiler.tests._comfy_compiler import ComfyCompiler
    from unet_compiler.tests._fake_cuda import fake_cuda
    u = tiny_unet(**ONE_LEVEL)
    refs = [_sample(u, s) for s in range(4)]
    with fake_cuda(monkeypatch, allocator="cudaMallocAsync") as cuda, \
            ComfyCompiler(assert_graph_breaks=True, block_graphs=True).installed() as compiler:
        accel = _triton_on_fake_cuda(u, monkeypatch, cuda_graphs=True)
        monkeypatch.setattr(G.CudaGraphs, "usable", lambda self, tensors: "another capture is in progress"
                            if torch.cuda.is_current_stream_capturing() else None)
        _captured_blocks(u.down_blocks, "down")
        _captured_blocks(u.up_blocks, "up")
        forward = u.__dict__["forward"]

        def recorded(*a, **k):
            with compiler.scope():
                return forward(*a, **k)
        u.__dict__["forward"] = recorded
        outs = [_sample(u, s) for s in range(4)]
        assert cuda.aborted is None, cuda.aborted
        assert not compiler.breaks() and compiler.module.MALLOC_GRAPH_BREAKS == 0, compiler.breaks()
        # each block: a warm call, a capture (replayed at once, as ComfyUI does), two replays; the
        # pack's kernels inside the captures, launched again by each replay
        assert compiler.captures == 2 and compiler.block_replays == 4, (compiler.captures, compiler.block_replays)
        assert cuda.log["kernel_captured"] > 0 and cuda.log["kernel_replayed"] == 3 * cuda.log["kernel_captured"]
        # the pack's own graphs: only the mid block's regions (no block graph of ComfyUI's around them)
        mid = set(u.mid_block.modules())
        assert 0 < accel.graphs.stats["captured"] <= sum(r.module in mid for r in accel.plan.regions), \
            (dict(accel.graphs.stats), dict(accel.graphs.skipped))
        assert accel.graphs.skipped["another capture is in progress"] > 0, dict(accel.graphs.skipped)
        assert accel.call_graphs.graphs.stats["captured"] == 0
        assert accel.backend.ops.in_captures and not accel.backend.ops.declined, dict(accel.backend.ops.declined)
        # the double's detection: a next node whose kernels go through triton's JIT (tensor arguments)
        # meets triton's pointer refusal inside ComfyUI's capture, and the abort is recorded
        compiler.cleanup()
        monkeypatch.setattr(_common, "BIND", [False])
        monkeypatch.setattr(_common, "_capturing", lambda: False)
        for s in range(2):                           # a warm call, then the captures
            _sample(u, s)
        assert cuda.aborted is not None and "capture-allocated memory" in cuda.aborted, cuda.aborted
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_the_graph_pool_counts_against_the_budget(tiny_unet, monkeypatch):
    """What the captures allocate (static outputs and every temporary a replay writes, in the private
    pool: the fake's memory_reserved grows by it) is held memory: counted in the report and against
    the budget, so a budget the static buffers alone would fit stops capturing where the pool does
    not. (Before: only static inputs and outputs were counted, the pool came on top unseen.)"""
    from unet_compiler.tests._fake_cuda import fake_cuda
    from unet_compiler.compiler import graphs as G  # noqa: N812
    u = tiny_unet()
    ref = _sample(u, 0)
    with fake_cuda(monkeypatch) as cuda:
        accel = _production_graphs(u, monkeypatch)
        g = accel.graphs
        for _ in range(3):
            torch.testing.assert_close(_sample(u, 0), ref, rtol=1e-5, atol=1e-5)
        n = len(accel._shims)
        assert g.stats["captured"] == n and g.pool_bytes == cuda.reserved > 0
        assert g.held > 2 * g.bytes, (g.held, g.bytes)   # the temporaries outweigh the static buffers here
        assert "MiB graph pool" in "\n".join(g.status_lines())
        # room for the next shape's static buffers (half the batch: half the bytes) twice over, not
        # for what is held with the pool: the next shape captures nothing
        g.budget = 2 * g.bytes
        before = g.stats["captured"]
        for _ in range(3):
            _sample(u, 1, b=1)
        assert g.stats["captured"] == before, "captured past the budget once the pool is counted"
        assert any("budget" in why for why in g.skipped)
        assert g.release("unload") == n and g.pool_bytes == 0
        # a capture that grew no reservation (cudaMallocAsync reusing memory it already held, as on
        # the H100): what is held is never less than the static buffers the graphs keep
        monkeypatch.setattr(G.CudaGraphs, "reserved", lambda self, device: 0)
        for _ in range(3):
            _sample(u, 0)
        assert g.stats["captured"] > before and g.pool_bytes == 0 and g.held == g.bytes > 0


def test_static_buffers_are_allocated_outside_the_captures(tiny_unet, monkeypatch):
    """Under cudaMallocAsync torch warns on stderr for every captured allocation freed outside a
    capture (the H100 printed one per region when graphs went: 227 lines for SDXL), and any graph's
    output the allocator placed in the shared pool can be overwritten by another graph's temporaries.
    No static buffer is a capture's allocation: each graph copies its result into an output buffer
    allocated before the capture, so releasing them warns nothing and serving them uncopied is safe;
    results stay right and the next call captures again. (Before: the outputs were the captures'
    own allocations, emptied through ``set_()`` at release to silence the warning.)"""
    from unet_compiler.tests._fake_cuda import fake_cuda
    u = tiny_unet()
    ref = _sample(u, 0)
    with fake_cuda(monkeypatch, allocator="cudaMallocAsync") as cuda:
        accel = _production_graphs(u, monkeypatch)
        g = accel.graphs
        for _ in range(3):
            torch.testing.assert_close(_sample(u, 0), ref, rtol=1e-5, atol=1e-5)
        static = [t for r in g.regions.values() for e in r.graphs.values() for t in e.tensors()]
        assert static and cuda.captured, "nothing captured"
        inside = [t for t in static if t.untyped_storage().data_ptr() in cuda.captured]
        assert not inside, f"{len(inside)} of {len(static)} static buffers allocated by a capture"
        assert g.release("unload") == len(accel._shims)
        for _ in range(3):
            torch.testing.assert_close(_sample(u, 0), ref, rtol=1e-5, atol=1e-5)
        assert g.stats["captured"] == 2 * len(accel._shims)


def test_the_pools_idle_part_is_kept_out_of_comfyuis_free_memory(comfy, tiny_unet, monkeypatch):
    """ComfyUI's free-memory count (``get_free_memory``: the card's free memory plus torch's reserved
    minus active) counts a live graph pool's idle temporaries as free, though only the graphs'
    replays can use them. While the graphs are held that idle part (the pool: the captures' temporaries)
    is added to what ComfyUI's loader keeps free (``EXTRA_RESERVED_VRAM``, ``--reserve-vram``'s figure,
    read by ``minimum_inference_memory``), and taken back when they go, or with their owner."""
    import gc

    from unet_compiler.tests._fake_cuda import fake_cuda
    mm = comfy.mm
    gc.collect()     # graphs an earlier test left to the collector give their share back first
    base, floor = mm.extra_reserved_memory(), mm.minimum_inference_memory()
    u = tiny_unet()
    with fake_cuda(monkeypatch):
        accel = _production_graphs(u, monkeypatch)
        g = accel.graphs
        for _ in range(3):
            _sample(u, 0)
        idle = g.pool_bytes   # the captures' temporaries: the static buffers are allocated outside the pool
        assert idle > 0 and g.reserved_for_comfy == idle
        assert mm.extra_reserved_memory() == base + idle and mm.minimum_inference_memory() == floor + idle
        assert "kept out of ComfyUI's free-memory count" in "\n".join(g.status_lines())
        g.release("unload")
        assert mm.extra_reserved_memory() == base and g.reserved_for_comfy == 0
        for _ in range(3):
            _sample(u, 0)
        assert mm.extra_reserved_memory() > base
        accel.graphs = g = None          # the owner goes without a release: its share goes with it
        del accel
        gc.collect()
        assert mm.extra_reserved_memory() == base


def test_a_regions_weight_addresses_name_one_state_of_its_weights():
    """``_Region.weight_ptrs`` (read in C for the slots holding a tensor): the same weights give the same
    value; a replaced or moved parameter, a bias set to None, and a bias that appears where there was
    none each give another, and that state again gives that value again."""
    from unet_compiler.compiler import graphs as G  # noqa: N812
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))
    r = G._Region(m)
    start = r.weight_ptrs()
    assert r.ptrs == start == r.weight_ptrs() and len(start) == 3
    seen = {start}
    m[0].weight = torch.nn.Parameter(m[0].weight.clone())           # replaced
    seen.add(r.weight_ptrs())
    m[0].weight.data = m[0].weight.data.clone()                     # moved (same Parameter)
    seen.add(r.weight_ptrs())
    m[0].bias = None                                                # gone
    seen.add(r.weight_ptrs())
    assert r.weight_ptrs() == r.weight_ptrs()
    m[1].bias = torch.nn.Parameter(torch.zeros(4))                  # appeared
    seen.add(r.weight_ptrs())
    assert len(seen) == 5 and r.weight_ptrs() == r.weight_ptrs()
