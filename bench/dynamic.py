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

Per row: ms per step, x against eager and against TorchCompileModel, cold seconds (compile + warmup,
or the node's first call), max |diff| against eager, peak MiB (CUDA), the pack's region calls by
path and its status line. The allocator is the process's: a user's ComfyUI runs cudaMallocAsync
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


def rows(args):
    """The rows of the table, measured in this process, yielded as each room's are (a call cut short
    keeps what it measured)."""
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    comfy = _comfy(device)
    import comfy.model_management as mm
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    from ..compiler.config import CompileConfig
    from ..nodes import patcher, warmup as nodes_warmup
    from ..tests._dynamic_vram import SMALL, DynamicVRAM, make_dynamic
    from ..tests._families import make_inputs
    from ..tests._patch_compat import node
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
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        cm, _ = patcher.compile_model(dyn, CompileConfig())
        text = patcher.warmup_model(cm, f"{args.batch}x{lat * 8}x{lat * 8}", kw["c_crossattn"].shape[1])
        _sync(device)
        pack_cold = time.perf_counter() - t0
        accel = patcher.accelerator_of(cm)
        whole = node(TorchCompileModel, model=dyn.clone(disable_dynamic=True), backend="inductor")
        mm.load_models_gpu([whole])
        t0 = time.perf_counter()
        call(whole)()
        _sync(device)
        whole_cold = time.perf_counter() - t0
        status = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("status:")), "")
        for room in args.rooms:
            for p in (dyn, cm):
                p.budget = room
            mm.load_models_gpu([cm])
            for _ in range(3):                    # the slots settle: a load's first call refills them
                call(cm)()
            before = _counts(accel)
            fns = {"eager": call(dyn), "pack": call(cm), "whole": call(whole)}
            outs = {k: fn() for k, fn in fns.items()}
            ms = _median_ms(fns, args.iters, device)
            paths = _paths(accel, before)
            ref = outs["eager"].float()
            peak = torch.cuda.max_memory_allocated(device) >> 20 if device.type == "cuda" else None
            for k, name, cold in (("eager", "eager (ComfyUI's own code)", None),
                                  ("pack", "Compile UNet (defaults) + Warmup Shapes", pack_cold),
                                  ("whole", "TorchCompileModel (demoted to a classic copy)", whole_cold)):
                yield dict(room=room, path=name, ms=ms[k], vs_eager=ms["eager"] / ms[k],
                           vs_torchcompilemodel=ms["whole"] / ms[k], cold_s=cold,
                           max_abs_diff=float((outs[k].float() - ref).abs().max()), peak_mib=peak,
                           regions=paths if k == "pack" else None, status=status if k == "pack" else None)


def table(rs: list[dict], args) -> str:
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    lines = [f"ComfyUI's {args.size} UNet (random weights) under Dynamic VRAM (the double; "
             f"{'comfy-aimdo VBAR on the GPU' if dev.type == 'cuda' else 'its CPU VBAR'}), {args.dtype}, batch "
             f"{args.batch}, latent {args.latent}x{args.latent}; {name}, torch {torch.__version__}, allocator "
             f"{torch.cuda.memory.get_allocator_backend() if dev.type == 'cuda' else '-'}; median of {args.iters}",
             "| VBAR room | path | ms / step | x eager | x TorchCompileModel | cold s | max abs diff | peak MiB | "
             "the pack's region calls |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        cold = "-" if r["cold_s"] is None else f"{r['cold_s']:.1f}"
        regions = "" if r["regions"] is None else ", ".join(f"{k} {v}" for k, v in sorted(r["regions"].items()))
        lines.append(f"| {r['room']:.0%} | {r['path']} | {r['ms']:.1f} | {r['vs_eager']:.2f} | "
                     f"{r['vs_torchcompilemodel']:.2f} | {cold} | {r['max_abs_diff']:.1e} | "
                     f"{'-' if r['peak_mib'] is None else r['peak_mib']} | {regions} |")
    status = next((r["status"] for r in rs if r["status"]), "")
    return "\n".join(lines + ([f"the pack's {status}"] if status else []))


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
    p.add_argument("--here", action="store_true", help=argparse.SUPPRESS)   # internal: measuring in this process
    args = p.parse_args(argv)
    if not args.here:
        # measured in a fresh process with fresh inductor, Triton and pack caches (unless --reuse-cache)
        import os
        import subprocess

        from .run import cold_cache_env
        env = dict(os.environ) if args.reuse_cache else cold_cache_env()
        cmd = [sys.executable, "-m", __package__ or "unet_compiler.bench", "dynamic", *argv, "--here"]
        return subprocess.run(cmd, env=env, check=False).returncode
    rs = []
    for r in rows(args):
        rs.append(r)
        print(ROW_TAG + json.dumps(r), flush=True)
    print(table(rs, args), flush=True)
    return 0
