"""The bench (``python -m unet_compiler.bench run``, ``bin/bench``): eager vs UNet Compiler vs
whole-model torch.compile (what ComfyUI's built-in TorchCompileModel does) on a random-weight
SD1.5-architecture diffusers UNet, no downloads. Each row but eager runs in a fresh process
(``bench_row``) timed interleaved with eager there. The command line is bench/__main__.py."""
from __future__ import annotations

import copy
import logging
import os
import platform
import sys
import tempfile
import time

import torch


def _unet(size: str, device="cpu"):
    """The random-weight UNet, built on ``device`` (on a GPU its random init takes a moment
    instead of half a minute of CPU time per bench row: each row builds its own)."""
    with torch.device(device):
        return _build_unet(size)


def _build_unet(size: str):
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    if size == "tiny":
        return UNet2DConditionModel(sample_size=8, block_out_channels=(32, 64), layers_per_block=1,
                                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=8).eval()
    if size == "sdxl":  # the SDXL base UNet config
        return UNet2DConditionModel(
            sample_size=128, cross_attention_dim=2048, block_out_channels=(320, 640, 1280), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816).eval()
    return UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8,  # SD1.5 config
                                block_out_channels=(320, 640, 1280, 1280), layers_per_block=2).eval()


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _inputs(unet, batch, lat, dev, dtype):
    from ..compiler.shapes import Shape, unet_inputs
    with torch.inference_mode():
        return unet_inputs(unet, "diffusers", Shape(batch, lat * 8, lat * 8), 77, dtype, dev)


def _flops(unet, args, kwargs) -> float:
    """FLOPs of one eager forward (torch's own counter)."""
    from torch.utils.flop_counter import FlopCounterMode
    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        unet(*args, **kwargs)
    return float(fc.get_total_flops())


def _time(fn, n, dev=torch.device("cpu")):
    ts = []
    with torch.inference_mode():
        fn()  # untimed: first-call allocations
        for _ in range(n):
            _sync(dev)
            t0 = time.perf_counter()
            out = fn()
            _sync(dev)
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2], out


def _time_pair(eager, compiled, n, dev):
    """Median seconds of ``eager`` and ``compiled``, timed interleaved (alternating calls,
    alternating which goes first): a concurrent load on a shared machine then slows both
    alike instead of whichever happened to run during it. Returns (eager s, compiled s,
    eager output, compiled output)."""
    te, tc = [], []
    with torch.inference_mode():
        ref, out = eager(), compiled()  # untimed: first-call allocations
        for i in range(n):
            for fn, ts in ((eager, te), (compiled, tc)) if i % 2 == 0 else ((compiled, tc), (eager, te)):
                _sync(dev)
                t0 = time.perf_counter()
                fn()
                _sync(dev)
                ts.append(time.perf_counter() - t0)
    return sorted(te)[len(te) // 2], sorted(tc)[len(tc) // 2], ref, out


def _graphs() -> int:
    """Dynamo graphs plus compiles of the pack's Triton kernels (inductor's own kernels are part
    of its graphs)."""
    import sys
    from torch._dynamo.utils import counters
    tc = sys.modules.get(__package__.rpartition(".")[0] + ".compiler.compat.triton") if __package__ else None
    return int(counters["stats"]["unique_graphs"]) + (tc.kernel_compiles() if tc is not None else 0)


# (label, batch, latent side): the shape changes users hit between prompts
TRANSITIONS = (("to 1x64x64", 1, 8), ("batch 1->2 (2x64x64)", 2, 8), ("64->96 px (2x96x96)", 2, 12))


def _transitions(model, unet, dev, dtype):
    """Call ``model`` (a callable taking ``unet``'s inputs) at each transition shape;
    graphs compiled and seconds per call."""
    out = []
    for label, b, lat in TRANSITIONS:
        a, kw = _inputs(unet, b, lat, dev, dtype)
        with torch.inference_mode():
            _sync(dev)
            g0, t0 = _graphs(), time.perf_counter()
            model(*a, **kw)
            _sync(dev)
            out.append((label, _graphs() - g0, time.perf_counter() - t0))
    return out


def _save(args, rows, kernel_rows=()):
    """The measured table as JSON, and a bar chart when matplotlib is installed."""
    import json
    from pathlib import Path
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{args.size}_{args.device}_lat{args.latent}_b{args.batch}"
    ok = [r for r in rows if not r.get("failed")]
    data = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "device": args.device, "size": args.size, "latent": args.latent,
            "batch": args.batch, "dtype": args.dtype,
            "allocator": torch.cuda.memory.get_allocator_backend() if args.device.startswith("cuda") else None,
            "rows": [dict({k: v for k, v in r.items() if k not in ("report", "shape_changes")},
                          **({"speedup": r["eager_s"] / r["step_s"]} if not r.get("failed") else {}))
                     for r in rows],
            "shape_changes": {r["path"]: r["shape_changes"] for r in ok if r["shape_changes"]},
            "kernels": list(kernel_rows)}
    if dev_name := _device_name(args.device):
        data["device_name"] = dev_name
    if not rows:
        stem = stem.replace("bench_", "kernels_")
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    if not rows:
        print(f"wrote {out / stem}.json")
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out / stem}.json (pip install matplotlib for the plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(ok) + 1.2))
    names = [r["path"] for r in ok][::-1]
    ax.barh(names, [r["step_s"] for r in ok][::-1], color=["#888" if n == "eager" else "#2a7" for n in names])
    for i, r in enumerate(ok[::-1]):
        ax.text(r["step_s"], i, f" {r['step_s']:.3g} s ({r['eager_s'] / r['step_s']:.2f}x)", va="center")
    ax.set_xlabel("seconds per UNet step (lower is better)")
    ax.set_title(f"{args.size}-arch UNet, {args.device}, latent {args.latent}x{args.latent}, batch {args.batch}",
                 fontsize=9)
    ax.set_xlim(0, max(r["step_s"] for r in ok) * 1.45)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110, bbox_inches="tight")   # long row names stay whole
    print(f"wrote {out / stem}.json and .png")


def _kernel_table(args, dev, dtype) -> list[dict]:
    from . import kernels as kb
    only = None if args.kernels == "all" else {k.strip() for k in args.kernels.split(",") if k.strip()}
    print(f"\nper-kernel: {args.size} UNet calls at latent {args.latent}x{args.latent}, batch {args.batch}, "
          f"{args.dtype}; eager = the model's own torch ops, inductor = torch.compile of them")
    print(kb.header(dev))
    return kb.run(args.size, args.latent, args.batch, dev, dtype, iters=args.iters, only=only,
                  inductor=not args.kernels_skip_inductor)


def _backend_spec(spec: str) -> tuple[str, dict]:
    """``triton+graphs`` -> ("triton", {"cuda_graphs": True})."""
    name, _, extra = spec.partition("+")
    if extra not in ("", "graphs"):
        raise SystemExit(f"--backend {spec!r}: the only suffix is +graphs (CUDA graphs), e.g. triton+graphs")
    return name, ({"cuda_graphs": True} if extra else {})


ROW_TAG = "UNET_COMPILER_ROW "
#: the whole-model rows: (spec, label, torch.compile mode)
WHOLE = {"whole": ("whole-model torch.compile (TorchCompileModel)", None),
         "whole-max-autotune": ("whole-model torch.compile max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs")}
CUDNN = "eager+cudnn-benchmark"


def _peak_mib(dev):
    return torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None


def _progress(where: str, what: str) -> None:
    """One progress line on stderr ("row 2/5: inductor: compiling…"): a row runs for minutes in its
    own process, whose output comes back only when it ends."""
    if where:
        print(f"{where}: {what}", file=sys.stderr, flush=True)


class _NoEmptyFloat32Notice(logging.Filter):
    """diffusers logs "There are modules in UNet2DConditionModel that should be kept in float32: []"
    at every ``.to(dtype)`` even when that list is empty (the random-weight UNet has none): nothing
    for the reader to act on. Only that message with the empty list is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "that should be kept in float32: []" not in record.getMessage()


def bench_row(args):
    """One row of the table in this (fresh) process: compile + warm up with the caches
    the parent made fresh for it (cold), synchronised; then eager and the row timed
    interleaved on the same module; then the shape changes. Prints one JSON line."""
    import json
    from ..compiler import compile_unet, report, warmup
    from ..compiler.api import accelerator_of
    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    unet = _unet(args.size, dev).to(dev, dtype)
    lat, spec = args.latent, args.row
    a, kw = _inputs(unet, args.batch, lat, dev, dtype)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    text, compiled_model = "", unet

    def eager():
        return unet(*a, **kw).sample
    _progress(args.row_progress, f"{spec}: compiling…" if spec != CUDNN else f"{spec}: first call…")
    _sync(dev)
    t0 = time.perf_counter()
    if spec in WHOLE:
        name, mode = WHOLE[spec]
        compiled_model = torch.compile(unet, mode=mode)   # the same module: one copy of the weights
        with torch.inference_mode():
            compiled_model(*a, **kw)
    elif spec == CUDNN:
        name = "eager, torch.backends.cudnn.benchmark (ComfyUI --fast autotune)"

        def compiled_model(*args_, **kwargs_):
            prev, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, True
            try:
                return unet(*args_, **kwargs_)
            finally:
                torch.backends.cudnn.benchmark = prev
        with torch.inference_mode():
            compiled_model(*a, **kw)
    else:
        backend, options = _backend_spec(spec)
        compile_unet(unet, backend, **options)
        # warm what this run uses, as a user would with Warmup Shapes: the timed shape and the transitions
        shapes = [f"{args.batch}x{lat * 8}x{lat * 8}"] + [f"{b}x{s * 8}x{s * 8}" for _, b, s in TRANSITIONS]
        warmup(unet, ", ".join(shapes), compare=False)
        accel = accelerator_of(unet)
        name = f"unet_compiler {accel.backend.name}" + (" + cuda graphs" if accel.graphs is not None else "")

        def eager():
            with accel.bypass():
                return unet(*a, **kw).sample
    _sync(dev)
    cold = time.perf_counter() - t0
    _progress(args.row_progress, f"{name}: timing {args.iters} steps, each beside an eager one…")
    eager_s, step_s, ref, out = _time_pair(eager, lambda: compiled_model(*a, **kw).sample, args.iters, dev)
    peak = _peak_mib(dev)
    trans = []
    if not args.skip_shape_changes:
        _progress(args.row_progress, f"{name}: shape changes…")
        trans = _transitions(compiled_model, unet, dev, dtype)
    if spec not in WHOLE and spec != CUDNN:
        text = report(unet)
    row = dict(path=name, spec=spec, step_s=step_s, eager_s=eager_s, cold_s=cold,
               max_abs_diff=float((out.float() - ref.float()).abs().max()), peak_mib=peak,
               shape_changes=[dict(change=lbl, graphs=g, seconds=sec) for lbl, g, sec in trans], report=text,
               pid=os.getpid(), caches={k: os.environ.get(v) for k, v in (
                   ("inductor", "TORCHINDUCTOR_CACHE_DIR"), ("triton", "TRITON_CACHE_DIR"),
                   ("pack", "UNET_COMPILER_CACHE_DIR"))})
    print(ROW_TAG + json.dumps(row), flush=True)


def cold_cache_env() -> dict:
    """This process's environment with fresh, empty inductor, Triton and pack caches: a process
    started with it compiles cold."""
    fresh = tempfile.mkdtemp(prefix="unet_compiler_bench_row_")
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(fresh, "inductor"),
                TRITON_CACHE_DIR=os.path.join(fresh, "triton"),
                UNET_COMPILER_CACHE_DIR=os.path.join(fresh, "unet_compiler"))   # the pack's own cache: cold too


def _run_row(args, spec, where="") -> dict:
    """``bench_row`` for ``spec`` in a fresh process with fresh inductor and Triton caches
    (unless --reuse-cache): nothing an earlier row or the kernel table compiled is reused,
    so 'cold' is cold. ``where`` ("row 2/5") prefixes its progress lines."""
    import json
    import subprocess
    env = dict(os.environ) if args.reuse_cache else cold_cache_env()
    cmd = [sys.executable, "-m", __package__ or "unet_compiler.bench", "run", *args.argv, "--row", spec,
           "--row-progress", where]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
    row = None
    for line in proc.stdout.splitlines():
        if line.startswith(ROW_TAG):
            row = json.loads(line[len(ROW_TAG):])
        else:
            print(line)
    if row is None or proc.returncode:
        print(f"row {spec}: failed (exit {proc.returncode}); see the output above", flush=True)
        return dict(path=f"{spec} (failed, exit {proc.returncode})", spec=spec, failed=True)
    if row["report"]:
        print("\n" + row["report"], flush=True)
    print(f"row {spec}: {row['step_s'] * 1e3:.1f} ms a step, eager {row['eager_s'] * 1e3:.1f} ms beside it, "
          f"cold {row['cold_s']:.1f} s, max abs diff {row['max_abs_diff']:.1e}", flush=True)   # kept if a later row is cut
    return row


def _eager_rows(args, dev, dtype, n_rows: int):
    """The eager rows, timed in this process (the model is freed on return): eager alone, and with
    --bf16-eager the bf16 model timed interleaved with it."""
    unet = _unet(args.size, dev).to(dev, dtype)
    lat = args.latent
    a, kw = _inputs(unet, args.batch, lat, dev, dtype)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    print(f"model: random-weight {args.size}-architecture UNet, latent {lat}x{lat} ({lat * 8} px), "
          f"batch {args.batch}, {args.dtype}")
    flops = _flops(unet, a, kw) if args.peak_tflops else 0.0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    _progress(f"row 1/{n_rows}", f"eager: timing {args.iters} steps…")
    eager_s, ref = _time(lambda: unet(*a, **kw).sample, args.iters, dev)
    rows = [dict(path="eager", spec="eager", step_s=eager_s, eager_s=eager_s, cold_s=0.0, max_abs_diff=0.0,
                 peak_mib=_peak_mib(dev), shape_changes=[])]
    if args.bf16_eager:
        low = copy.deepcopy(unet).to(torch.bfloat16)
        ab, kwb = _inputs(low, args.batch, lat, dev, torch.bfloat16)
        _progress(f"row 2/{n_rows}", f"eager bf16: timing {args.iters} steps, each beside an eager one…")
        twin_s, s, ref_twin, out = _time_pair(lambda: unet(*a, **kw).sample, lambda: low(*ab, **kwb).sample,
                                              args.iters, dev)
        rows.append(dict(path="eager bf16 weights+activations", spec="eager-bf16", step_s=s, eager_s=twin_s,
                         cold_s=0.0, max_abs_diff=float((out.float() - ref_twin.float()).abs().max()), peak_mib=None,
                         shape_changes=[]))
        del low
    return rows, flops


def bench(args):
    if args.row:
        return bench_row(args)
    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    kernel_rows = _kernel_table(args, dev, dtype) if args.kernels else []
    if args.kernels_only:
        if args.out:
            _save(args, [], kernel_rows)
        return
    specs = [b.strip() for b in args.backend.split(",") if b.strip()]
    for spec in specs:
        _backend_spec(spec)  # a bad suffix fails before any row runs
    if dev.type == "cuda":
        specs.insert(0, CUDNN)
    if not args.skip_whole:
        specs += ["whole", "whole-max-autotune"] if dev.type == "cuda" else ["whole"]
    n_rows = 1 + bool(args.bf16_eager) + len(specs)
    rows, flops = _eager_rows(args, dev, dtype, n_rows)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rows += [_run_row(args, spec, f"row {i}/{n_rows}") for i, spec in enumerate(specs, len(rows) + 1)]
    _print_table(args, rows, flops)
    if args.out:
        _save(args, rows, kernel_rows)
    if args.compat:
        compat(args)


def compat(args):
    """The compatibility tables (README "Compatibility"), measured now: every ComfyUI
    openaimodel.UNetModel family, then ComfyUI's core patch nodes through KSampler sampling."""
    from ..tests import _families as families, _patch_compat as patch_compat
    if families.comfy_path() is None:
        print("\ncompatibility table: skipped: no ComfyUI tree (set COMFYUI_PATH or install it at ~/comfy/ComfyUI)")
        return
    problem = families.comfy_problem()
    if problem:
        print(f"\ncompatibility table: skipped: {problem}")
        return
    backend = getattr(args, "compat_backend", "inductor")
    log = lambda m: print("  " + m, flush=True)  # noqa: E731
    if getattr(args, "only", "") != "patches":
        h, w = (int(v) for v in getattr(args, "latent_hw", "16x16").lower().split("x"))
        batch = getattr(args, "compat_batch", 2)
        print(f"\nCompatibility: every ComfyUI openaimodel.UNetModel family at tiny widths, random weights, "
              f"{backend}, latent {h}x{w}, batch {batch}, compiled vs the model's own code on the same inputs "
              f"({'CUDA' if torch.cuda.is_available() else 'CPU'})")
        print(families.table(families.compat_rows(backend, (h, w), batch, getattr(args, "families", None) or None,
                                                  log=log)))
    if getattr(args, "only", "") != "patches" and not getattr(args, "families", None):
        print(f"\nCompatibility: ComfyUI's diffusion transformers at tiny widths, random weights, {backend}, Warmup "
              f"Shapes over 1x64x64 and 2x128x96 (video: 1x64x64x1 and 2x128x96x9), then batches 1 and 2 at both "
              f"sizes (video: each at 1 and 9 frames), compiled vs the model's own code on the same inputs; "
              f"recompiles counted over those calls")
        print(families.table(families.dit_compat_rows(backend, log=log)))
        print(families.dit_not_yet_table())
    if getattr(args, "only", "") != "families":
        full = getattr(args, "full", False)
        cases = patch_compat.all_cases() if full else None
        print(f"\nCompatibility: ComfyUI's core patch nodes, alone and stacked, on tiny random-weight SD1.5 / SDXL "
              f"UNets through KSampler ({patch_compat.STEPS} euler steps, cfg {patch_compat.CFG:g}), {backend}: "
              f"the compiled latent vs the eager latent of the same nodes (tolerance {patch_compat.REL:g} x "
              f"max(1, max |eager|)); {'every case' if full else 'the default cases (--full: both kinds, both orders)'}")
        print(patch_compat.format_table(patch_compat.patch_rows(backend, cases, log=log)))


def _ms(seconds: float) -> str:
    """Milliseconds to about three significant digits (a row's ratio is then its two ms within 1 %)."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _print_table(args, rows, flops):
    """Every number in a row comes from that row's own measurement: its step and its eager twin, timed
    interleaved in one process (vs eager = eager ms / step ms); vs TCM divides two rows' vs eager."""
    ok = [r for r in rows if not r.get("failed")]
    whole = next((r for r in ok if r["spec"] == "whole"), None)
    mfu = f" {'MFU':>6s}" if flops else ""
    print(f"\n{'path':58s} {'step ms':>8s} {'eager ms':>8s} {'vs eager':>8s} {'vs TCM':>7s} {'cold s':>7s} "
          f"{'max|diff|':>9s} {'peak MiB':>8s}{mfu}")
    for r in rows:
        if r.get("failed"):
            print(f"{r['path']:58s}")
            continue
        speed = r["eager_s"] / r["step_s"]
        vs_whole = f"{speed / (whole['eager_s'] / whole['step_s']):6.2f}x" if whole else f"{'-':>7s}"
        peak = f"{r['peak_mib']:8.0f}" if r.get("peak_mib") is not None else f"{'-':>8s}"
        m = f" {flops / r['step_s'] / (args.peak_tflops * 1e12) * 100:5.1f}%" if flops else ""
        print(f"{r['path']:58s} {_ms(r['step_s']):>8s} {_ms(r['eager_s']):>8s} {speed:7.2f}x {vs_whole} "
              f"{r['cold_s']:7.1f} {r['max_abs_diff']:9.2e} {peak}{m}")
    print("step ms: the row's median UNet step; eager ms: the same model run eager, timed interleaved with it "
          "(alternating calls) in that row's own process, so a concurrent load slows both alike; vs eager = "
          "eager ms / step ms; the eager row is timed alone in the bench's process. vs TCM: vs eager over "
          "whole-model torch.compile's (what ComfyUI's TorchCompileModel does). cold: compile + warmup in a "
          "fresh process with fresh inductor/Triton caches, GPU synchronised")
    if flops:
        print(f"(one forward = {flops / 1e12:.2f} TFLOP counted by torch.utils.flop_counter; MFU against "
              f"{args.peak_tflops:g} TFLOP/s)")
    if not any(r["shape_changes"] for r in ok):
        return
    print("\nshape changes after the timed runs (graphs compiled = recompiles; seconds include compiling):")
    for r in ok:
        if r["shape_changes"]:
            print(f"  {r['path']}: " + "; ".join(f"{c['change']}: {c['graphs']} graph(s), {c['seconds']:.1f} s"
                                                   for c in r["shape_changes"]))


def main(args, argv):
    """Run the bench: ``args`` as bench/__main__.py's ``run`` parsed them, ``argv`` the arguments
    they came from (what each row's process is started with)."""
    args.argv = list(argv)
    logging.getLogger("diffusers.models.modeling_utils").addFilter(_NoEmptyFloat32Notice())
    if not args.reuse_cache and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # cold means cold: a fresh inductor/triton cache for this run, so compile seconds are not cache hits
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="unet_compiler_bench_")
        os.environ.setdefault("UNET_COMPILER_CACHE_DIR", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "pack"))
    if args.kernels_only and not args.kernels:
        args.kernels = "all"
    if args.backend is None:
        args.backend = "inductor,triton,triton+graphs" if args.device.startswith("cuda") else "auto"
    if args.kernels and not args.device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors
    if args.peak_tflops is None:
        # 790 TFLOP/s: the H100 bf16 reference the GPU issue measures against (the SXM datasheet says
        # 989 dense); only for 16-bit runs, where tensor cores are the limit
        args.peak_tflops = 790.0 if args.device.startswith("cuda") and args.dtype in ("bf16", "fp16") else 0.0
    bench(args)
