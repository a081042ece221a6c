"""``python -m unet_compiler.bench storage``: what a weight storage dtype costs and saves here.

The random-weight SD1.5 checkpoint (built once, as the e2e tests build it) loaded the way ComfyUI's
"Load Diffusion Model" (UNETLoader) loads it at each ``weight_dtype``: fp32 (default on CPU),
fp8_e4m3fn, fp8_e5m2, ... (ComfyUI then casts every weight to fp32 on each call), and the way
ComfyUI-GGUF's UnetLoaderGGUF loads a GGUF file of it (``gguf_Q8_0``, ``gguf_Q4_K``, ``gguf_Q5_K``,
``gguf_F16``: its GGMLOps dequantize per call; the file's tensors made as tests/_gguf.py makes them:
gguf-py's quantizer, random K-quant blocks; needs a ComfyUI-GGUF checkout). For each: one
UNet call through ComfyUI's ``apply_model``, eager vs Compile UNet vs ComfyUI's built-in
TorchCompileModel, timed interleaved (median of ``--iters``), the output's relative L2 error vs eager,
the UNet's weight memory and the step's peak resident memory above the process's before it.
Each storage dtype runs in a fresh process; the compile caches are fresh per run (cold).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .comfy_server import checkpoint_path, comfyui_or_fail
from .run import cold_cache_env

DTYPES = {"default": None, "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
          "fp16": torch.float16, "bf16": torch.bfloat16,
          **{f"gguf_{q}": q for q in ("Q8_0", "Q4_K", "Q5_K", "F16")}}
PACK_ROOT = Path(__file__).resolve().parents[1]
ROW_TAG = "UNET_COMPILER_STORAGE_ROW "


class PeakRss:
    """The highest resident memory of this process (sampled every 5 ms) inside the block, in MiB
    above what it was on entry."""

    def __init__(self):
        import psutil
        self._proc = psutil.Process()
        self.peak_mib = 0.0

    def __enter__(self):
        self._base = self._proc.memory_info().rss
        self._top, self._stop = self._base, threading.Event()

        def sample():
            while not self._stop.wait(0.005):
                self._top = max(self._top, self._proc.memory_info().rss)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._top = max(self._top, self._proc.memory_info().rss)
        self.peak_mib = (self._top - self._base) / 2**20


def _row(args) -> dict:
    """One storage dtype in this process: prints one JSON line."""
    sys.path.insert(0, str(comfyui_or_fail()))
    from comfy.cli_args import args as comfy_args
    comfy_args.cpu = True
    import comfy.model_management as mm
    import comfy.sd
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    from ..compiler.config import CompileConfig
    from ..nodes import patcher, warmup as nodes_warmup
    from ..tests._patch_compat import node
    dtype = DTYPES[args.row]
    if isinstance(dtype, str):
        model = _gguf_model(args.checkpoint, dtype)
    else:
        options = {} if dtype is None else {"dtype": dtype}
        model = comfy.sd.load_diffusion_model(str(args.checkpoint), model_options=options)
    mm.load_models_gpu([model])
    unet = model.model.diffusion_model
    weights_mib = sum(p.numel() * p.element_size() for p in unet.parameters()) / 2**20
    stored = dtype if isinstance(dtype, str) else str(next(unet.parameters()).dtype).replace("torch.", "")
    g = torch.Generator().manual_seed(0)
    lat = args.latent
    with torch.inference_mode():
        x = torch.randn(args.batch, 4, lat, lat, generator=g)
        ctx = torch.randn(args.batch, 77, 768, generator=g)
        t = torch.full((args.batch,), 500.0)

    def call(mp):
        def run():
            with torch.inference_mode():
                return mp.model.apply_model(x, t, c_crossattn=ctx,
                                            transformer_options=nodes_warmup.sampling_transformer_options(mp))
        return run

    t0 = time.perf_counter()
    cm, _ = patcher.compile_model(model, CompileConfig(backend="inductor"))
    text = patcher.warmup_model(cm, f"{args.batch}x{lat * 8}x{lat * 8}", 77)
    compile_s = time.perf_counter() - t0
    whole = node(TorchCompileModel, model=model, backend="inductor")
    t0 = time.perf_counter()
    fns = {"eager": call(model), "compiled": call(cm), "whole": call(whole)}
    whole_failed = None
    try:
        call(whole)()
    except Exception as e:      # (TorchCompileModel on another pack's ops: a row, not a crash)
        whole_failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        del fns["whole"]
    whole_compile_s = time.perf_counter() - t0

    times = {k: [] for k in fns}
    peaks = {}
    outs = {}
    for k, fn in fns.items():       # untimed calls: the first, then one for its peak memory above the model's
        outs[k] = fn()
        with PeakRss() as rss:
            fn()
        peaks[k] = rss.peak_mib
    for i in range(args.iters):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ref = outs["eager"].float()

    def rel(o):
        return float((o.float() - ref).norm() / ref.norm())
    accel = patcher.accelerator_of(cm)
    ran, total = accel.ran_compiled()
    row = dict(weight_dtype=args.row, stored=stored, weights_mib=weights_mib, eager_s=med["eager"],
               compiled_s=med["compiled"], whole_s=med.get("whole"), compile_s=compile_s,
               whole_compile_s=whole_compile_s, whole_failed=whole_failed, rel_l2=rel(outs["compiled"]),
               whole_rel_l2=rel(outs["whole"]) if "whole" in outs else None, peak_mib=peaks,
               regions=f"{ran} of {total}", region_eager=accel.stats["region_eager"],
               status=[line for line in text.splitlines() if "status:" in line][:1])
    print(ROW_TAG + json.dumps(row), flush=True)


def _e(v, fmt=".1e") -> str:
    return "-" if v is None else format(v, fmt)


def _gguf_model(checkpoint, qtype: str):
    """The checkpoint's UNet as ComfyUI-GGUF's UnetLoaderGGUF returns a ``qtype`` GGUF file of it:
    ``load_diffusion_model_state_dict`` with its GGMLOps, in its GGUFModelPatcher."""
    import importlib.util

    import comfy.sd
    import comfy.utils
    from comfy import model_detection
    spec = importlib.util.spec_from_file_location("unet_compiler_bench_gguf", PACK_ROOT / "tests" / "_gguf.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    why = helper.problem()
    if why:
        raise SystemExit(why)
    gg = helper.load()
    sd = comfy.utils.load_torch_file(str(checkpoint))
    prefix = model_detection.unet_prefix_from_state_dict(sd)
    unet = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    del sd
    qsd = {k: helper.quantize(gg, v, qtype, seed=i) for i, (k, v) in enumerate(unet.items())}
    del unet
    model = comfy.sd.load_diffusion_model_state_dict(qsd, model_options={"custom_operations": gg.ops.GGMLOps()})
    return gg.nodes.GGUFModelPatcher.clone(model)


def _table(rows, args) -> str:
    head = (f"random-weight SD1.5 UNet (ComfyUI's UNETLoader), batch {args.batch}, latent {args.latent}x{args.latent} "
            f"({args.latent * 8} px), CPU {torch.get_num_threads()} threads, torch {torch.__version__}; step = one "
            f"UNet call, median of {args.iters}; x = eager / that path")
    lines = [head, "| weight_dtype | weights | eager step | Compile UNet | TorchCompileModel | regions compiled | "
             "rel. L2 vs eager | peak extra memory (eager / compiled / TorchCompileModel) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['weight_dtype']} | failed: {r['failed']} | | | | | | |")
            continue
        p = r["peak_mib"]
        whole = (f"{r['whole_s'] * 1e3:.0f} ms (x{r['eager_s'] / r['whole_s']:.2f})" if r.get("whole_s")
                 else f"failed: {r.get('whole_failed')}")
        lines.append(
            f"| {r['weight_dtype']} ({r['stored']}) | {r['weights_mib']:.0f} MiB | {r['eager_s'] * 1e3:.0f} ms | "
            f"{r['compiled_s'] * 1e3:.0f} ms (x{r['eager_s'] / r['compiled_s']:.2f}) | {whole} | {r['regions']} | "
            f"{r['rel_l2']:.1e} / {_e(r.get('whole_rel_l2'))} | "
            f"{p['eager']:.0f} / {p['compiled']:.0f} / {_e(p.get('whole'), '.0f')} MiB |")
    lines.append("compile: " + "; ".join(f"{r['weight_dtype']}: Compile UNet + Warmup Shapes {r['compile_s']:.0f} s, "
                                         f"TorchCompileModel's first call {r['whole_compile_s']:.0f} s"
                                         for r in rows if "failed" not in r))
    return "\n".join(lines)


def main(args) -> None:
    if args.row:
        return _row(args)
    comfy = comfyui_or_fail()
    # the random checkpoint: kept where the tests keep it (UNET_COMPILER_TEST_CACHE), else built for this run
    ckpt = checkpoint_path(os.environ.get("UNET_COMPILER_TEST_CACHE") or tempfile.mkdtemp(prefix="unet_compiler_"))
    rows = []
    for name in args.dtypes.split(","):
        name = name.strip()
        if name not in DTYPES:
            raise SystemExit(f"--dtypes: {name!r} is not one of {', '.join(DTYPES)}")
        env = cold_cache_env()
        cmd = [sys.executable, "-m", __package__ or "unet_compiler.bench", "storage", "--row", name,
               "--checkpoint", str(ckpt), "--latent", str(args.latent), "--batch", str(args.batch),
               "--iters", str(args.iters)]
        print(f"== {name}: eager, Compile UNet and TorchCompileModel in a fresh process (cold caches)…", flush=True)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False, cwd=str(comfy))
        row = next((json.loads(line[len(ROW_TAG):]) for line in proc.stdout.splitlines()
                    if line.startswith(ROW_TAG)), None)
        rows.append(row or dict(weight_dtype=name, failed=f"exit {proc.returncode}"))
        if row is None:
            print(proc.stdout[-4000:])
    print(_table(rows, args))
