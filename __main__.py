"""python -m unet_compiler bench: eager vs UNet Compiler vs whole-model
torch.compile (what ComfyUI's built-in TorchCompileModel does), same process,
random-weight SD1.5-architecture diffusers UNet, no downloads."""
from __future__ import annotations

import argparse
import copy
import os
import platform
import tempfile
import time

import torch


def _unet(size: str):
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
    from .compiler.shapes import Shape, unet_inputs
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


def _graphs() -> int:
    """Dynamo graphs plus compiles of the pack's Triton kernels (inductor's own kernels are part
    of its graphs)."""
    import sys
    from torch._dynamo.utils import counters
    tb = sys.modules.get(__package__ + ".compiler.backends.triton") if __package__ else None
    return int(counters["stats"]["unique_graphs"]) + (tb.kernel_compiles() if tb is not None else 0)


# (label, batch, latent side): the shape changes users hit between prompts
TRANSITIONS = (("to 1x64x64", 1, 8), ("batch 1->2 (2x64x64)", 2, 8), ("64->96 px (2x96x96)", 2, 12))


def _transitions(model, dev, dtype):
    """Call ``model`` at each transition shape; graphs compiled and seconds per call."""
    out = []
    for label, b, lat in TRANSITIONS:
        a, kw = _inputs(model, b, lat, dev, dtype)
        with torch.inference_mode():
            g0, t0 = _graphs(), time.perf_counter()
            model(*a, **kw)
            _sync(dev)
            out.append((label, _graphs() - g0, time.perf_counter() - t0))
    return out


def _save(args, rows, trans, eager_s, kernel_rows=()):
    """The measured table as JSON, and a bar chart when matplotlib is installed."""
    import json
    from pathlib import Path
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{args.size}_{args.device}_lat{args.latent}_b{args.batch}"
    data = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "device": args.device, "size": args.size, "latent": args.latent,
            "batch": args.batch, "rows": [dict(path=n, step_s=s, speedup=eager_s / s, cold_s=c, max_abs_diff=d)
                                          for n, s, c, d in rows],
            "shape_changes": {k: [dict(change=a, graphs=g, seconds=sec) for a, g, sec in v] for k, v in trans.items()},
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
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(rows) + 1.2))
    names = [r[0] for r in rows][::-1]
    ax.barh(names, [r[1] for r in rows][::-1], color=["#888" if n == "eager" else "#2a7" for n in names])
    for i, r in enumerate(rows[::-1]):
        ax.text(r[1], i, f" {r[1]:.2f} s ({eager_s / r[1]:.2f}x)", va="center")
    ax.set_xlabel("seconds per UNet step (lower is better)")
    ax.set_title(f"SD1.5-arch UNet, {args.device}, latent {args.latent}x{args.latent}, batch {args.batch}", fontsize=9)
    ax.set_xlim(0, max(r[1] for r in rows) * 1.45)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    print(f"wrote {out / stem}.json and .png")


def _kernel_table(args, dev, dtype) -> list[dict]:
    from .kernels import bench as kb
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


def bench(args):
    from .compiler import compile_unet, report, warmup
    from .compiler.api import accelerator_of
    dev = torch.device(args.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    kernel_rows = _kernel_table(args, dev, dtype) if args.kernels else []
    if args.kernels_only:
        if args.out:
            _save(args, [], {}, 1.0, kernel_rows)
        return
    unet = _unet(args.size).to(dev, dtype)
    lat = args.latent
    a, kw = _inputs(unet, args.batch, lat, dev, dtype)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    print(f"model: random-weight {args.size}-architecture UNet, latent {lat}x{lat} ({lat * 8} px), "
          f"batch {args.batch}, {args.dtype}")
    flops = _flops(unet, a, kw) if args.peak_tflops else 0.0
    rows = []
    eager_s, ref = _time(lambda: unet(*a, **kw).sample, args.iters, dev)
    rows.append(("eager", eager_s, 0.0, 0.0))
    trans = {}
    if args.bf16_eager:
        low = copy.deepcopy(unet).to(torch.bfloat16)
        ab, kwb = _inputs(low, args.batch, lat, dev, torch.bfloat16)
        s, out = _time(lambda: low(*ab, **kwb).sample, args.iters, dev)
        rows.append(("eager bf16 weights+activations", s, 0.0, float((out.float() - ref.float()).abs().max())))
        del low

    # warm what this run uses, as a user would with Warmup Shapes: the timed shape and the transitions
    shapes = [f"{args.batch}x{lat * 8}x{lat * 8}"] + [f"{b}x{s * 8}x{s * 8}" for _, b, s in TRANSITIONS]
    ours = None
    for spec in [b.strip() for b in args.backend.split(",") if b.strip()]:
        backend, options = _backend_spec(spec)
        ours = copy.deepcopy(unet)
        t0 = time.perf_counter()
        compile_unet(ours, backend, **options)
        warmup(ours, ", ".join(shapes), compare=False)
        cold = time.perf_counter() - t0
        s, out = _time(lambda m=ours: m(*a, **kw).sample, args.iters, dev)
        name = f"unet_compiler {report(ours).splitlines()[0].split('backend ')[1].split(',')[0]}"
        if options and accelerator_of(ours).graphs is not None:
            name += " + cuda graphs"
        rows.append((name, s, cold, float((out.float() - ref.float()).abs().max())))
        trans[name] = _transitions(ours, dev, dtype)
        print("\n" + report(ours), flush=True)

    if not args.skip_whole:
        whole = torch.compile(copy.deepcopy(unet))
        t0 = time.perf_counter()
        with torch.inference_mode():
            whole(*a, **kw)
        _sync(dev)
        cold = time.perf_counter() - t0
        s, out = _time(lambda: whole(*a, **kw).sample, args.iters, dev)
        rows.append(("whole-model torch.compile (TorchCompileModel)", s, cold,
                     float((out.float() - ref.float()).abs().max())))
        trans["whole-model torch.compile"] = _transitions(whole, dev, dtype)

    if args.out:
        _save(args, rows, trans, eager_s, kernel_rows)
    mfu = f" {'MFU':>6s}" if flops else ""
    print(f"\n{'path':48s} {'step ms':>9s} {'vs eager':>9s} {'cold s':>8s} {'max|diff|':>10s}{mfu}")
    for name, s, cold, diff in rows:
        m = f" {flops / s / (args.peak_tflops * 1e12) * 100:5.1f}%" if flops else ""
        print(f"{name:48s} {s * 1e3:9.1f} {eager_s / s:8.2f}x {cold:8.1f} {diff:10.2e}{m}")
    if flops:
        print(f"(one forward = {flops / 1e12:.2f} TFLOP counted by torch.utils.flop_counter; MFU against "
              f"{args.peak_tflops:g} TFLOP/s)")
    print("\nshape changes after the timed runs (graphs compiled = recompiles; seconds include compiling):")
    for name, ts in trans.items():
        print(f"  {name}: " + "; ".join(f"{lbl}: {g} graph(s), {sec:.1f} s" for lbl, g, sec in ts))



def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m unet_compiler")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="eager vs compiled vs whole-model torch.compile, same process")
    b.add_argument("--size", choices=["sd15", "sdxl", "tiny"], default="sd15")
    b.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="model + inputs dtype (as ComfyUI would load it); bf16 for the GPU numbers")
    b.add_argument("--peak-tflops", type=float, default=None,
                   help="add an MFU column against this peak in TFLOP/s (default on CUDA in bf16/fp16: 790, the H100 "
                        "bf16 reference of the project's GPU targets; none in fp32)")
    b.add_argument("--latent", type=int, default=16, help="latent side (pixels / 8)")
    b.add_argument("--batch", type=int, default=2)
    b.add_argument("--iters", type=int, default=5)
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--backend", default=None,
                   help="comma-separated, each gets its own row; a +graphs suffix adds CUDA graphs "
                        "(default: inductor,triton,triton+graphs on CUDA, auto elsewhere)")
    b.add_argument("--kernels", nargs="?", const="all", default="",
                   help="first a per-kernel table (triton vs eager torch vs inductor); optionally a comma list of "
                        "groupnorm_silu,layernorm,geglu,attention,bias_residual")
    b.add_argument("--kernels-only", action="store_true", help="only the per-kernel table (implies --kernels)")
    b.add_argument("--kernels-skip-inductor", action="store_true", help="no inductor column in the kernel table")
    b.add_argument("--reuse-cache", action="store_true",
                   help="keep inductor's on-disk cache (default: a fresh one, so cold compile seconds are real)")
    b.add_argument("--out", default="", help="folder for the table as JSON and a PNG plot (e.g. docs)")
    b.add_argument("--bf16-eager", action="store_true", help="add an eager row with the model in bf16")
    b.add_argument("--skip-whole", action="store_true", help="skip the whole-model torch.compile baseline")
    args = p.parse_args(argv)
    if not args.reuse_cache and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # cold means cold: a fresh inductor/triton cache for this run, so compile seconds are not cache hits
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="unet_compiler_bench_")
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


if __name__ == "__main__":
    main()
