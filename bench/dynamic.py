"""``python -m unet_compiler.bench dynamic``: the user's default path, ComfyUI's Dynamic VRAM.

ComfyUI's own UNetModel (random weights; ``--size sd15`` / ``sdxl``: the family's full config,
``tiny``: the tests' tiny one) loaded as the newest ComfyUI loads it on an NVIDIA card, under the
Dynamic VRAM double (tests/_dynamic_vram.py: the newest cast path and ``ModelPatcherDynamic`` over
this ComfyUI's classes; on CUDA comfy-aimdo's own VBAR on the GPU, on a CPU its CPU stand-in). For
each VBAR room (``--rooms``: the share of the slotted weights that may stay resident; 1: resident,
0.5: forced streaming), in one process, timed interleaved (median of ``--iters``):

    eager              ComfyUI's own code
    Compile UNet       the pack with every input at its default, then Warmup Shapes at the timed shape
    TorchCompileModel  ComfyUI's built-in node as it runs there: the model demoted to a classic copy
                       (``clone(disable_dynamic=True)``: the checkpoint loaded again), torch.compile'd
                       (what the node's ``execute`` does, through ``comfy_api.torch_helpers``)

Each row is printed as it is measured: every room's eager and Compile UNet rows first, then
TorchCompileModel's (its cold compile is the longest), timed interleaved with the other two again,
with the pack against it from those rounds; a failed room or path prints its error and the rest
run. Per row: ms per step, x against eager, cold seconds (compile + warmup, or the node's first
call), max |diff| against eager, peak MiB (CUDA: the row's own call, peak reset before it), the
pack's region calls by path and its status line. ``--imports-only``: what the rows import, and on
CUDA a comfy-aimdo VBAR, checked in a few seconds. The allocator is the process's: a user's ComfyUI runs cudaMallocAsync
(``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``; the GPU check sets it). The double copies on
the compute stream, without ComfyUI's offload-stream overlap: a streamed row carries ComfyUI's
copies, not their overlap (tests/_timeline.py models that).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

import torch

ROW_TAG = "UNET_COMPILER_DYNAMIC_ROW "
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _comfy(device: torch.device):
    from .comfy_server import comfyui_or_fail
    sys.path.insert(0, str(comfyui_or_fail()))
    if device.type == "cpu":
        from comfy.cli_args import args as comfy_args
        comfy_args.cpu = True
    import comfy.model_management  # noqa: F401
    import comfy.ops  # noqa: F401
    import comfy
    return comfy


def build(size: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A random-weight SD1.5 / SDXL BaseModel of ComfyUI's own classes in a plain ``ModelPatcher`` that
    loads on ``device``: (patcher, family)."""
    import comfy.model_patcher
    import comfy.supported_models as sm

    from ..tests import _families as F  # noqa: N812
    fam = F.FAMILIES["sdxl" if size == "sdxl" else "sd15"]
    cfg = getattr(sm, fam.cls)(F.tiny_config(fam) if size == "tiny" else F.full_config(fam))
    if size == "tiny":
        F._shrink_heads(cfg.unet_config)
    cfg.set_inference_dtype(dtype, None)
    with torch.no_grad():
        base = cfg.get_model({})
    F.init_random(base.diffusion_model, seed)
    base.eval()
    return comfy.model_patcher.ModelPatcher(base, load_device=device, offload_device=torch.device("cpu")), fam


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fns: dict, iters: int, device) -> dict:
    """Median ms per call of each of ``fns``, called in turn (the order reversed every round)."""
    times = {k: [] for k in fns}
    for i in range(iters):
        for k in (list(fns) if i % 2 == 0 else list(reversed(fns))):
            _sync(device)
            t0 = time.perf_counter()
            fns[k]()
            _sync(device)
            times[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}


def _paths(accel, before: Counter) -> dict:
    """The pack's region calls since ``before`` (a copy of its stats and graph counters), by path."""
    now = _counts(accel)
    now.subtract(before)
    return {k: v for k, v in now.items() if v}


def _counts(accel) -> Counter:
    c = Counter({k: v for k, v in accel.stats.items()
                 if k in ("region_cast_compiled", "region_streamed", "region_streamed_eager", "region_eager",
                          "region_cast_resident")})
    if accel.graphs is not None:
        c["region graph replays"] = accel.graphs.stats["replays"]
    if accel.call_graphs is not None:
        c["whole-call replays"] = accel.call_graphs.graphs.stats["replays"]
    return c


def _skip_transformer_options(guard_entries) -> list:
    """TorchCompileModel's ``skip_torch_compile_dict``: no dynamo guard on transformer_options' entries."""
    return [("transformer_options" not in entry.name) for entry in guard_entries]


def torch_compile_model(model, backend: str = "inductor"):
    """What ComfyUI's TorchCompileModel node's ``execute`` does (comfy_extras/nodes_torch_compile.py,
    0.8.0): a clone of ``model`` with ``comfy_api.torch_helpers.set_torch_compile_wrapper`` and the
    node's guard filter. Called here, not through the node: its module imports ``comfy_api.latest``,
    which needs PyAV (``av``), which a GPU image may lack."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    m = model.clone()
    set_torch_compile_wrapper(model=m, backend=backend, options={"guard_filter_fn": _skip_transformer_options})
    return m


def imports(device: torch.device):
    """Import what the rows import (ComfyUI, its torch.compile helper, comfy-aimdo, the pack's nodes,
    the double): a failure raises here, before any model is built. Returns ComfyUI's ``comfy``."""
    _comfy(device)                     # (its tree on sys.path; on a CPU, its --cpu)
    import comfy.model_management
    import comfy.model_patcher  # noqa: F401
    import comfy.supported_models  # noqa: F401
    import comfy_aimdo.model_vbar  # noqa: F401
    import comfy_api.torch_helpers  # noqa: F401

    from ..nodes import patcher, warmup  # noqa: F401
    from ..tests import _dynamic_vram, _families  # noqa: F401
    return comfy


def check_imports(device: torch.device) -> str:
    """``--imports-only``: :func:`imports`, and on CUDA a 1 MiB comfy-aimdo VBAR made on the device
    (its native library loaded and bound, as the rows' VBARs are); one line saying what was found."""
    import importlib.metadata

    from .comfy_server import comfyui_or_fail
    imports(device)
    try:
        aimdo = importlib.metadata.version("comfy-aimdo")
    except importlib.metadata.PackageNotFoundError:
        aimdo = "?"
    vbar = "no VBAR on a CPU"
    if device.type == "cuda":
        from ..tests._dynamic_vram import CudaVBAR
        v = CudaVBAR(1 << 20, 1 << 20, device)
        vbar = f"a VBAR on {v.device} at 0x{v.vbar.base_addr:x}"
    return f"bench dynamic: imports ok: ComfyUI at {comfyui_or_fail()}, comfy-aimdo {aimdo}, {vbar}"


NAMES = {"eager": "eager (ComfyUI's own code)", "pack": "Compile UNet (defaults) + Warmup Shapes",
         "whole": "TorchCompileModel (demoted to a classic copy)"}


def rows(args):
    """The rows, measured in this process and yielded as each is (a call cut short keeps what it
    measured): per room eager and Compile UNet, then TorchCompileModel (its cold compile is the
    longest) per room, timed interleaved with the other two again. A room or a path that fails
    yields a row with its ``error``; the rest still run."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    comfy = imports(device)
    import comfy.model_management as mm

    from ..compiler.config import CompileConfig
    from ..nodes import patcher, warmup as nodes_warmup
    from ..tests._dynamic_vram import SMALL, DynamicVRAM, make_dynamic
    from ..tests._families import make_inputs
    with DynamicVRAM(comfy.ops).installed():
        plain, fam = build(args.size, dtype, device)
        dyn = make_dynamic(comfy, plain, budget=1.0, small=SMALL,
                           reload=lambda: build(args.size, dtype, device)[0])
        lat = args.latent
        x, sigma, kw = make_inputs(fam, plain, args.batch, lat, lat)
        x, sigma = x.to(device), sigma.to(device)
        kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}

        def call(mp):
            def run():
                with torch.inference_mode():
                    return mp.model.apply_model(x, sigma, transformer_options=nodes_warmup.sampling_transformer_options(mp),
                                                **kw)
            return run
        mm.load_models_gpu([dyn])
        call(dyn)()
        cm = accel = None
        status, cold = "", {"eager": None}
        try:
            t0 = time.perf_counter()
            cm, _ = patcher.compile_model(dyn, CompileConfig())
            text = patcher.warmup_model(cm, f"{args.batch}x{lat * 8}x{lat * 8}", kw["c_crossattn"].shape[1])
            _sync(device)
            cold["pack"] = time.perf_counter() - t0
            accel = patcher.accelerator_of(cm)
            status = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("status:")), "")
        except Exception as e:
            cm = None
            yield dict(room=None, path=NAMES["pack"], error=_error(e))

        def measure(room, fns):
            """ms (median, interleaved), outputs and peak MiB (each path's own calls) at ``room``."""
            for p in (dyn, cm):
                if p is not None:
                    p.budget = room
            loaded = cm if cm is not None else dyn
            mm.load_models_gpu([loaded])
            for _ in range(3):                    # the slots settle: a load's first call refills them
                call(loaded)()
            before = _counts(accel) if accel is not None else None
            outs, peaks = {}, {}
            for k, fn in fns.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                outs[k] = fn()
                _sync(device)
                peaks[k] = torch.cuda.max_memory_allocated(device) >> 20 if device.type == "cuda" else None
            ms = _median_ms(fns, args.iters, device)
            return ms, outs, peaks, (_paths(accel, before) if accel is not None else None)

        def row(room, k, ms, outs, peaks, paths):
            return dict(room=room, path=NAMES[k], ms=ms[k], vs_eager=ms["eager"] / ms[k], cold_s=cold.get(k),
                        max_abs_diff=float((outs[k].float() - outs["eager"].float()).abs().max()), peak_mib=peaks[k],
                        regions=paths if k == "pack" else None, status=status if k == "pack" else None)

        for room in args.rooms:
            try:
                fns = {"eager": call(dyn)} | ({"pack": call(cm)} if cm is not None else {})
                ms, outs, peaks, paths = measure(room, fns)
                for k in fns:
                    yield row(room, k, ms, outs, peaks, paths)
            except Exception as e:
                yield dict(room=room, path="eager, Compile UNet", error=_error(e))
        try:
            whole = torch_compile_model(dyn.clone(disable_dynamic=True), backend="inductor")
            mm.load_models_gpu([whole])
            t0 = time.perf_counter()
            call(whole)()
            _sync(device)
            cold["whole"] = time.perf_counter() - t0
        except Exception as e:
            yield dict(room=None, path=NAMES["whole"], error=_error(e))
            return
        for room in args.rooms:
            try:
                fns = {"eager": call(dyn)} | ({"pack": call(cm)} if cm is not None else {}) | {"whole": call(whole)}
                ms, outs, peaks, _ = measure(room, fns)
                r = row(room, "whole", ms, outs, peaks, None)
                if "pack" in ms:
                    r.update(pack_ms=ms["pack"], pack_vs_torchcompilemodel=ms["whole"] / ms["pack"])
                yield r
            except Exception as e:
                yield dict(room=room, path=NAMES["whole"], error=_error(e))


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def header(args) -> list[str]:
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return [f"ComfyUI's {args.size} UNet (random weights) under Dynamic VRAM (the double; "
            f"{'comfy-aimdo VBAR on the GPU' if dev.type == 'cuda' else 'its CPU VBAR'}), {args.dtype}, batch "
            f"{args.batch}, latent {args.latent}x{args.latent}; {name}, torch {torch.__version__}, allocator "
            f"{torch.cuda.memory.get_allocator_backend() if dev.type == 'cuda' else '-'}; median of {args.iters}, "
            f"each row printed as measured, TorchCompileModel last",
            "| VBAR room | path | ms / step | x eager | cold s | max abs diff | peak MiB | the pack's region calls |",
            "|---|---|---|---|---|---|---|---|"]


def line(r: dict) -> list[str]:
    """A row's table line (and, for TorchCompileModel's, the pack against it in the same rounds)."""
    room = "-" if r.get("room") is None else f"{r['room']:.0%}"
    if r.get("error"):
        return [f"| {room} | {r['path']} | failed: {r['error']} |"]
    cold = "-" if r["cold_s"] is None else f"{r['cold_s']:.1f}"
    regions = "" if r["regions"] is None else ", ".join(f"{k} {v}" for k, v in sorted(r["regions"].items()))
    out = [f"| {room} | {r['path']} | {r['ms']:.1f} | {r['vs_eager']:.2f} | {cold} | {r['max_abs_diff']:.1e} | "
           f"{'-' if r['peak_mib'] is None else r['peak_mib']} | {regions} |"]
    if r.get("pack_vs_torchcompilemodel") is not None:
        out.append(f"Compile UNet against TorchCompileModel at room {room}: {r['pack_vs_torchcompilemodel']:.2f}x "
                   f"({r['pack_ms']:.1f} against {r['ms']:.1f} ms per step, timed interleaved)")
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m unet_compiler.bench dynamic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=["sd15", "sdxl", "tiny"], default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16" if torch.cuda.is_available() else "fp32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--latent", type=int, default=8, help="latent side (pixels / 8)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rooms", type=lambda s: [float(v) for v in s.split(",")], default=[1.0, 0.5],
                   help="VBAR rooms, comma-separated shares of the slotted weights (default 1,0.5)")
    p.add_argument("--reuse-cache", action="store_true",
                   help="keep the compile caches (default: fresh ones, so the cold seconds are cold)")
    p.add_argument("--imports-only", action="store_true",
                   help="import what the rows need (on CUDA: make a comfy-aimdo VBAR), print one line, measure nothing")
    p.add_argument("--here", action="store_true", help=argparse.SUPPRESS)   # internal: measuring in this process
    args = p.parse_args(argv)
    if args.imports_only:
        print(check_imports(torch.device(args.device)), flush=True)
        return 0
    if not args.here:
        # measured in a fresh python with fresh inductor, Triton and pack caches (unless --reuse-cache),
        # which replaces this one (nothing is left waiting on it)
        import os

        from .run import cold_cache_env
        env = dict(os.environ) if args.reuse_cache else cold_cache_env()
        cmd = [sys.executable, "-m", __package__ or "unet_compiler.bench", "dynamic", *argv, "--here"]
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, cmd, env)
    print("\n".join(header(args)), flush=True)
    status_said = False
    for r in rows(args):
        print(ROW_TAG + json.dumps(r), flush=True)
        print("\n".join(line(r)), flush=True)
        if r.get("status") and not status_said:
            print(f"the pack's {r['status']}", flush=True)
            status_said = True
    return 0
