"""The pack's host time on the GPU path, measured on any machine: ``python -m unet_compiler.bench
hosttime [--size sd15,sdxl] [--iters N] [--out DIR] [--slots]``.

The real SD1.5 / SDXL UNet architectures (diffusers, bf16, a CFG step: batch 2 at 512² / 1024²) on
the meta device: every torch op dispatches with shapes and no data, and every Triton launch of the
pack's kernels is replaced by a counter (the launcher's own Python runs up to the launch; the kernels
plan for an H100, sm_90). Per step and path (the model's own code, the triton backend without CUDA
graphs, and with every region's graph replaying: replays are no-ops here, what is left is the
replay path and its input copies): the pack's own Python per step (the time spent in
the pack's functions, under cProfile, which inflates every function call: an upper bound; with
graphs replaying also the wall time of one step's region calls made again, not profiled),
the launches per step (the pack's kernels, and aten ops that launch work on a GPU, views excluded).
Per kernel call: each launcher alone on CPU tensors of the same shapes, its Python up to triton's
launcher (stubbed), not profiled, and how many of its launches went through triton's JIT dispatch. A meta op's
own dispatch runs Python meta functions, so a step's wall time here is no GPU host time and is not
reported. Inductor's compiled code cannot run on meta: no row. ``--slots``: per size, the host time the
casts cost around a replaying UNet call under Dynamic VRAM (:func:`slot_rows`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections import Counter
from pathlib import Path

import torch

SHAPES = {"sd15": 64, "sdxl": 128, "tiny": 8}   # latent side; tiny: the tests' model


class _Launches:
    """Stands in for one @triton.jit kernel: ``kernel[grid](...)`` (triton's JIT) counts a launch, runs
    nothing and returns a compiled kernel whose ``run`` (triton's launcher, called by the pack's direct
    launches) counts a launch and runs nothing."""

    def __init__(self, kernel, name: str, counts: Counter, jit: Counter):
        self.__name__, self.counts, self.jit, self.arg_names = name, counts, jit, list(kernel.arg_names)
        count = self._count

        class Compiled:
            function = packed_metadata = None

            def run(self, *args):
                count()
        self.compiled = Compiled()

    def _count(self):
        self.counts[self.__name__] += 1

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.jit[self.__name__] += 1
        self._count()
        return self.compiled


@contextlib.contextmanager
def stubbed_launches(counts: Counter, jit: Counter | None = None):
    """Every @triton.jit kernel of the pack replaced by a launch counter (``counts``; ``jit``: those
    through triton's JIT, not a direct launch of the compiled kernel), the launchers taking meta
    tensors and planning for sm_90, autocast queries answered "off" for meta; restored on exit."""
    jit = Counter() if jit is None else jit
    from ..compiler import graphs as G  # noqa: N812
    from ..kernels import _common, attention, epilogue, geglu, groupnorm
    from .spare_kernels import layernorm, qkv
    mods = (attention, epilogue, geglu, groupnorm, layernorm, qkv)
    real_check, real_autocast, real_state = _common.check_tensor, torch.is_autocast_enabled, G._autocast_state

    def check_tensor(kernel_name, arg, t, kernel, **kw):
        try:
            real_check(kernel_name, arg, t, kernel, **kw)
        except _common.KernelUnsupported as e:   # the device clause, last: meta stands for CUDA here
            if not (isinstance(t, torch.Tensor) and t.device.type == "meta" and "is on meta" in str(e)):
                raise

    def is_autocast_enabled(*device_type):   # no autocast on meta (torch raises for the device type)
        return False if device_type[:1] == ("meta",) else real_autocast(*device_type)
    patches = [(m, name, _Launches(obj, name, counts, jit)) for m in mods for name, obj in list(vars(m).items())
               if type(obj).__name__ in ("JITFunction", "InterpretedFunction")]
    # direct launches: checked (nothing runs here), on stream 0 where torch has no CUDA
    patches += [(_common, "_BIND_CHECKED", [None]), (_common, "BIND", [True])]
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        patches.append((torch._C, "_cuda_getCurrentRawStream", lambda device: 0))
    patches += [(m, "check_tensor", check_tensor) for m in mods if hasattr(m, "check_tensor")]
    patches += [(_common, "COMPILE_TARGET", (9, 0)), (torch, "is_autocast_enabled", is_autocast_enabled),
                (G, "_autocast_state", lambda device_type: None if device_type == "meta" else real_state(device_type))]
    missing = object()
    saved = [(m, name, getattr(m, name, missing)) for m, name, _ in patches]
    try:
        for m, name, value in patches:
            setattr(m, name, value)
        yield
    finally:
        for m, name, obj in saved:
            if obj is missing:
                delattr(m, name)
            else:
                setattr(m, name, obj)
        for m in mods:   # plans made here hold the stand-ins
            if hasattr(m, "_PLANS"):
                m._PLANS.clear()


class _NoReplay:
    """CUDA-graph stand-in whose capture runs the body once and whose replay does nothing."""

    def usable(self, tensors):
        return None

    def first_call(self, fn, device):
        return fn()

    def capture(self, fn, device):
        out = fn()

        class Graph:
            def replay(self):
                pass
        return Graph(), out


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """aten ops that would launch work on a GPU (views and metadata ops excluded)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


PACK_DIRS = tuple(str(Path(__file__).resolve().parent.parent / d) for d in ("compiler", "kernels", "nodes"))


def pack_ms(fn) -> float:
    """Milliseconds ``fn()`` spends in the pack's own functions (their own time, cProfile)."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof).stats
    return sum(tt for (file, _, _), (_, _, tt, _, _) in stats.items()
               if os.path.realpath(file).startswith(PACK_DIRS)) * 1e3


def _model(size: str):
    from .run import _inputs, _unet
    u = _unet(size, "meta").to(torch.bfloat16)
    args, kw = _inputs(u, 2, SHAPES[size], torch.device("meta"), torch.bfloat16)
    return u, args, kw


def _triton(u, graphs: bool, whole: bool = False):
    """The triton backend on ``u`` (chosen outright: its CUDA check cannot pass on meta), graphs
    replaying through the no-op stand-in when ``graphs``: region by region, or one graph per UNet
    call (``whole``)."""
    from ..compiler import api, runtime
    from ..compiler import graphs as G  # noqa: N812
    from ..compiler.backends.triton import TritonBackend
    from ..compiler.call_graph import CallGraphs
    real = runtime.choose
    runtime.choose = lambda req, dev, off=None, arch="unet": (TritonBackend(), [])
    try:
        api.compile_unet(u, "triton")
    finally:
        runtime.choose = real
    accel = api.accelerator_of(u)
    accel.call_graphs = None
    if graphs:
        accel.graphs = G.RegionGraphs(graphs=_NoReplay())
        if whole:
            accel.call_graphs = CallGraphs(accel.root, accel.graphs, accel.stats)
    return accel


def whole_wall_ms(accel, step, iters: int) -> float:
    """Milliseconds of wall time one step takes, not profiled, with its UNet call replaying one graph:
    the pack's whole path (the call's checks, the weight-address check, input copies, the output's
    copy; here meta dispatches, on a GPU launches), no model code."""
    g = accel.call_graphs.graphs
    before, eager = g.stats["replays"], accel.stats["region_eager"]
    best, runs = float("inf"), max(20, iters * 4)
    for _ in range(runs):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    if g.stats["replays"] - before != runs or accel.stats["region_eager"] != eager:
        raise RuntimeError(f"UNet calls ran without their graph while timed: {dict(accel.call_graphs.skipped)}")
    return best * 1e3


def replay_wall_ms(accel, step, iters: int) -> tuple[float, int]:
    """(milliseconds of wall time one step's region calls take, not profiled; region calls per step),
    with every region's graph replaying: each region call of one step is recorded, then all of them
    are made again through their shims, inside the regions' call context, and timed. No model code
    runs between them; what is timed is the pack's replay path and the torch calls it makes (input
    copies: here meta dispatches, on a GPU launches)."""
    from ..compiler import graphs as G  # noqa: N812
    calls = []
    shims = list(accel._shims)

    def recording(shim):
        def call(*a, **k):
            calls.append((shim, a, k))
            return shim(*a, **k)
        call.hook = shim.hook
        return call
    accel._shims = [(m, recording(s)) for m, s in shims]
    try:
        step()
    finally:
        accel._shims = shims
    # a recorded argument that is a region's served result would hold that region's output buffer (its
    # replays would then run without the graph): the buffer itself where it is one, else a copy
    buffers = {G._storage(b.tensor): b.tensor for e in accel.graphs._entries() for b in e.outs}

    def unheld(a):
        t = buffers.get(G._storage(a)) if isinstance(a, torch.Tensor) else None
        if t is None:
            return a
        same = a.shape == t.shape and a.stride() == t.stride() and a.storage_offset() == t.storage_offset()
        return t if same else a.clone()
    calls = [(shim, tuple(unheld(x) for x in a), {n: unheld(x) for n, x in k.items()}) for shim, a, k in calls]
    eager = accel.stats["region_eager"], sum(accel.graphs.skipped.values())
    best = float("inf")
    with torch.inference_mode(), accel.active():
        for _ in range(max(20, iters * 4)):
            t0 = time.perf_counter()
            for shim, a, k in calls:
                shim(*a, **k)
            best = min(best, time.perf_counter() - t0)
    if (accel.stats["region_eager"], sum(accel.graphs.skipped.values())) != eager:
        raise RuntimeError(f"region calls ran without their graphs while timed: {dict(accel.graphs.skipped)}")
    return best * 1e3, len(calls)


def step_rows(size: str, iters: int) -> list[dict]:
    from ..compiler.api import uncompile_unet
    u, args, kw = _model(size)

    def step():
        with torch.inference_mode():
            u(*args, **kw)
    rows = []
    for mode in ("eager", "triton", "triton + graphs replaying", "triton + one graph per call"):
        counts: Counter = Counter()
        with stubbed_launches(counts):
            accel = None if mode == "eager" else _triton(u, graphs="graph" in mode, whole="per call" in mode)
            step()
            step()    # graphs: the second call captures; from the third every region replays
            counts.clear()
            with _CountOps() as ops:
                step()
            launches = sum(counts.values())
            ms = min(pack_ms(step) for _ in range(iters))   # the least disturbed of the runs
            regions = len(accel._shims) if accel is not None else 0
            graphs = accel.call_graphs.graphs if "per call" in mode else accel.graphs if accel is not None else None
            stats = dict(graphs.stats) if graphs is not None else {}
            fell_back = dict(accel.stats).get("region_eager", 0) if accel is not None else 0
            wall_ms, region_calls = replay_wall_ms(accel, step, iters) if "graphs" in mode else (None, None)
            if "per call" in mode:
                wall_ms, region_calls = whole_wall_ms(accel, step, iters), 1
        rows.append(dict(size=size, mode=mode, pack_ms=ms, triton_launches=launches, torch_ops=ops.n,
                         regions=regions, graph_replays=stats.get("replays", 0), region_calls_eager=fell_back,
                         replay_wall_ms=wall_ms, region_calls=region_calls))
        if accel is not None:
            uncompile_unet(u)
    return rows


def _kernel_cases(device: str = "cpu") -> list[tuple]:
    """(name, call) per kernel, SD1.5 512² shapes, bf16, on ``device``'s tensors."""
    from ..kernels import attention, epilogue, geglu, groupnorm
    m = dict(device=device, dtype=torch.bfloat16)
    x, w = torch.empty(2, 320, 64, 64, **m), torch.empty(320, **m)
    h = torch.empty(2, 4096, 2560, **m)
    q = torch.empty(2, 4096, 320, **m).view(2, 4096, 8, 40).transpose(1, 2)
    return [("groupnorm_silu 2x320x64x64", lambda: groupnorm.groupnorm(x, 32, w, w, 1e-5, silu=True)),
            ("geglu 2x4096x2560", lambda: geglu.geglu(h)),
            ("attention 2x8x4096x4096 d40", lambda: attention.attention(q, q, q)),
            ("bias_residual 2x320x64x64", lambda: epilogue.bias_residual(x, w, x, dim=1))]


def _per_call_us(fn, iters: int, n: int = 200) -> float:
    """Microseconds per call of ``fn``: the least disturbed of ``iters`` runs of ``n`` calls."""
    best = float("inf")
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def kernel_rows(iters: int) -> list[dict]:
    """The pack's Python per kernel call (launch stubbed), SD1.5 512² shapes, bf16, on CPU tensors:
    their allocations run in C++ as a CUDA caching allocator's do (a meta tensor's run Python meta
    functions, ~100 µs a call)."""
    rows = []
    counts, jit = Counter(), Counter()
    with stubbed_launches(counts, jit), torch.inference_mode():
        for name, fn in _kernel_cases():
            fn()
            counts.clear()
            jit.clear()
            best = _per_call_us(fn, iters)
            calls = 200 * max(1, iters)
            rows.append(dict(kernel=name, host_us=best, launches=sum(counts.values()) // calls,
                             jit_launches=sum(jit.values()) / calls))
    return rows


DISPATCH_PATHS = ("through triton's JIT", "direct")


def dispatch_rows(iters: int, only: str = "") -> list[dict]:
    """Per kernel call with triton's own dispatch in it (in a child process: it swaps triton's
    driver): the kernels compiled for sm_90 (a stand-in driver, as ``bench targets``), each compiled
    kernel's launcher a counter that runs nothing; every launch through triton's JIT (binding,
    specialisation key, cache lookup, launch metadata: the way before direct launches), then with
    direct launches. ``only``: a comma list of kernel names (default all)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "unet_compiler.bench", "hosttime", "--dispatch-child", only or "all",
           "--iters", str(iters)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"hosttime dispatch rows failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _dispatch_child(iters: int, only: str) -> list[dict]:
    from triton.compiler.compiler import CompiledKernel

    from ..kernels import _common
    from .targets import use_target
    use_target(90)
    launches: Counter = Counter()

    def loaded(self):   # stands in for loading the binary onto a GPU: its launcher counts, runs nothing
        if self.module is None:
            self.module, self.function = object(), 0
            self._run = lambda *args: launches.update(["launch"])
    CompiledKernel._init_handles = loaded
    _common._BIND_CHECKED[:] = [None]   # nothing runs here to check
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):
        torch._C._cuda_getCurrentRawStream = lambda device: 0
    cases = [(n, fn) for n, fn in _kernel_cases() if only in ("", "all") or n.split()[0] in only.split(",")]
    rows = []
    with torch.inference_mode():
        for path in DISPATCH_PATHS:
            _common.BIND[0] = path == "direct"
            for name, fn in cases:
                fn()   # compiles (the first time in this triton cache) and plans
                launches.clear()
                us = _per_call_us(fn, iters)
                rows.append(dict(kernel=name, path=path, host_us=us,
                                 launches=launches["launch"] // (200 * max(1, iters))))
    return rows


def slot_rows(sizes: list[str], iters: int) -> list[dict]:
    """Per size: ComfyUI's own UNet (random weights, bf16, on the CPU) under the Dynamic VRAM double
    (tests/_dynamic_vram.py) with every slot resident, the host time the casts cost a UNet call whose
    graphs replay (the graphs themselves not run): one graph per call, each slot faulted in and
    pinned, its signature compared, its address read, and unpinned after (``cast.slots_resident``,
    entered and left); region by region, each region's leaves cast by ComfyUI's cast and released
    (``cast.streams`` and ``cast.applied``, as a region call whose graph replays). The double's
    VBAR is Python where comfy-aimdo's is C: an upper bound for the faults. Least and median of
    ``20 * iters`` runs each."""
    from ..tests._dynamic_vram import DynamicVRAM
    from .dynamic import _comfy
    comfy = _comfy(torch.device("cpu"))
    import comfy.model_management as mm
    rows = []
    for size in sizes:
        with DynamicVRAM(comfy.ops).installed():
            rows.append(_slot_row(comfy, size, iters))
            mm.unload_all_models()
    return rows


def _slot_row(comfy, size: str, iters: int) -> dict:
    from ..compiler import cast
    from ..compiler.call_graph import cast_leaves
    from ..compiler.plan import build_plan
    from ..nodes import warmup as nodes_warmup
    from ..tests._dynamic_vram import SMALL, make_dynamic
    from ..tests._families import make_inputs
    from .dynamic import build
    device, dtype = torch.device("cpu"), torch.bfloat16
    plain, fam = build(size, dtype, device)
    dyn = make_dynamic(comfy, plain, budget=1.0, small=SMALL, reload=lambda: build(size, dtype, device)[0])
    x, sigma, kw = make_inputs(fam, plain, 2, 8, 8)
    comfy.model_management.load_models_gpu([dyn])
    with torch.inference_mode():   # a load's first call fills the slots
        dyn.model.apply_model(x, sigma, transformer_options=nodes_warmup.sampling_transformer_options(dyn), **kw)
    root = dyn.model.diffusion_model
    leaves = cast_leaves(root)
    args, stats = (torch.zeros(1, dtype=dtype, device=device),), Counter()
    regions = [(r.module, cast.plan(r.leaves, args)[0]) for r in build_plan(root).regions]
    regions = [(m, todo) for m, todo in regions if todo]

    def whole():
        with cast.slots_resident(leaves, dtype, device) as resident:
            if resident is None:
                raise RuntimeError(f"{size}: a slot is not resident at room 100 %")
        return len(resident[0])

    def by_region():
        for module, todo in regions:
            if cast.streams(todo, args):
                raise RuntimeError(f"{size}: a region's weights stream at room 100 %")
            with cast.applied(module, todo, args, stats) as (resident, _):
                if resident is None or resident is cast.STREAMED:
                    raise RuntimeError(f"{size}: a region's weights are not resident at room 100 %")
    row = dict(size=size, leaves=len(leaves), weights=whole(), regions=len(regions))
    with torch.inference_mode():
        for name, fn in (("whole", whole), ("regions", by_region)):
            times = []
            for _ in range(20 * iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            times.sort()
            row[f"{name}_min_ms"], row[f"{name}_median_ms"] = times[0] * 1e3, times[len(times) // 2] * 1e3
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unet_compiler.bench hosttime", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="sd15,sdxl", help="comma list of sd15, sdxl (default %(default)s)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="", help="folder for hosttime_<machine>.json")
    ap.add_argument("--dispatch", action="store_true",
                    help="also time each kernel call with triton's own dispatch (kernels compiled for sm_90, "
                         "about a minute the first time), through triton's JIT and launched directly")
    ap.add_argument("--slots", action="store_true",
                    help="also time the casts around a replaying UNet call under Dynamic VRAM, one graph per call and "
                         "region by region (ComfyUI's own UNet of each size under the double, bf16, every slot "
                         "resident; needs a ComfyUI tree)")
    ap.add_argument("--dispatch-child", default=None, help=argparse.SUPPRESS)
    o = ap.parse_args(argv)
    if o.dispatch_child is not None:
        print(json.dumps(_dispatch_child(o.iters, o.dispatch_child)))
        return 0
    import platform
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    print(f"host time on the meta device, launches stubbed ({machine})")
    ks = kernel_rows(o.iters)
    print(f"{'kernel call':34s} {'pack us':>8s} {'launches':>8s} {'by JIT':>7s}")
    for r in ks:
        print(f"{r['kernel']:34s} {r['host_us']:8.1f} {r['launches']:8d} {r['jit_launches']:7.2f}")
    print("pack us: the pack's Python per kernel call up to triton's launcher (stubbed: it counts and runs nothing), "
          "least of --iters runs of 200 calls; by JIT: launches per call that went through triton's JIT dispatch "
          "(its binding, specialisation key and cache lookup, not counted in pack us) instead of a direct launch")
    dispatch = []
    if o.dispatch:
        dispatch = dispatch_rows(o.iters)
        print(f"{'kernel call, with triton dispatch':34s} {'path':>22s} {'us':>7s} {'launches':>8s}")
        for r in dispatch:
            print(f"{r['kernel']:34s} {r['path']:>22s} {r['host_us']:7.1f} {r['launches']:8d}")
        print("us: the pack's and triton's Python per kernel call up to triton's C launcher (a counter here), the "
              "kernels compiled for sm_90; through triton's JIT: every launch bound, keyed and looked up by triton "
              "(before direct launches); direct: the compiled kernel launched with integer pointers")
    rows = []
    print(f"{'model, path':44s} {'pack ms':>8s} {'triton':>7s} {'torch':>6s} {'regions':>7s} {'wall ms':>8s}")
    for size in filter(None, o.size.split(",")):
        for r in step_rows(size, o.iters):
            rows.append(r)
            print(f"{size + ' 2x' + str(SHAPES[size] * 8) + '², ' + r['mode']:44s} {r['pack_ms']:8.2f} "
                  f"{r['triton_launches']:7d} {r['torch_ops']:6d} {r['regions']:7d} "
                  + (f"{r['replay_wall_ms']:8.2f}" + (f" ({r['replay_wall_ms'] * 1e3 / r['region_calls']:.1f} us a "
                                                         f"region call)" if r["region_calls"] > 1 else " (one step)")
                     if r["replay_wall_ms"] is not None else f"{'-':>8s}")
                  + (f"  ({r['region_calls_eager']} region calls fell back: not a valid row)"
                     if r["region_calls_eager"] else ""))
    print("pack ms: one CFG step's time in the pack's own functions (cProfile, least of --iters runs); triton: the pack's kernel "
          "launches per step; torch: aten ops that launch work (views excluded); regions: accelerated regions; "
          "wall ms: with graphs replaying, one step's region calls made again through the pack, not profiled "
          "(least of 20 runs, or 4 x --iters); with one graph per call, one whole step, not profiled")
    slots = []
    if o.slots:
        slots = slot_rows(list(filter(None, o.size.split(","))), o.iters)
        print(f"{'Dynamic VRAM, every slot resident':34s} {'leaves':>7s} {'weights':>8s} {'whole ms':>9s} "
              f"{'regions':>8s} {'by region ms':>13s}")
        for r in slots:
            print(f"{r['size']:34s} {r['leaves']:7d} {r['weights']:8d} {r['whole_min_ms']:4.2f}/{r['whole_median_ms']:4.2f} "
                  f"{r['regions']:8d} {r['regions_min_ms']:6.2f}/{r['regions_median_ms']:6.2f}")
        print("ms (least/median): the casts' host time per UNet call whose graphs replay; whole: one graph per call, "
              "every slot faulted in, pinned, its signature compared and its address read, then unpinned; by region: "
              "each region's leaves cast by ComfyUI's cast and released (the double's Python VBAR: comfy-aimdo's is C)")
    if o.out:
        out = Path(o.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"hosttime_{platform.machine()}.json"
        path.write_text(json.dumps(dict(machine=machine, kernels=ks, dispatch=dispatch, steps=rows, slots=slots),
                                    indent=1))
        print(f"wrote {path}")
    return 0
