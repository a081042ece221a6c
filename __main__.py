"""python -m unet_compiler bench: eager vs UNet Compiler vs whole-model
torch.compile (what ComfyUI's built-in TorchCompileModel does), same process,
random-weight SD1.5-architecture diffusers UNet, no downloads."""
from __future__ import annotations

import argparse
import copy
import platform
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
    return UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8,  # SD1.5 config
                                block_out_channels=(320, 640, 1280, 1280), layers_per_block=2).eval()


def _time(fn, n):
    ts = []
    with torch.inference_mode():
        fn()  # untimed: first-call allocations
        for _ in range(n):
            t0 = time.perf_counter()
            out = fn()
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2], out


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


# (label, batch, latent side): the shape changes users hit between prompts
TRANSITIONS = (("to 1x64x64", 1, 8), ("batch 1->2 (2x64x64)", 2, 8), ("64->96 px (2x96x96)", 2, 12))


def _transitions(fn, dev):
    """Call ``fn(x, t, c)`` at each transition shape; graphs compiled and seconds per call."""
    out = []
    for label, b, lat in TRANSITIONS:
        with torch.inference_mode():
            x = torch.randn(b, 4, lat, lat, device=dev)
            t = torch.full((b,), 500.0, device=dev)
            c = torch.randn(b, 77, 768, device=dev)
            g0, t0 = _graphs(), time.perf_counter()
            fn(x, t, c)
            out.append((label, _graphs() - g0, time.perf_counter() - t0))
    return out


def bench(args):
    from .compiler import compile_unet, report, warmup
    dev = torch.device(args.device)
    unet = _unet(args.size).to(dev)
    lat = args.latent
    with torch.inference_mode():
        x = torch.randn(args.batch, 4, lat, lat, device=dev)
        t = torch.full((args.batch,), 500.0, device=dev)
        c = torch.randn(args.batch, 77, 768, device=dev)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, device {dev}")
    print(f"model: random-weight SD1.5-architecture UNet ({args.size}), latent {lat}x{lat}, batch {args.batch}, fp32")
    rows = []
    eager_s, ref = _time(lambda: unet(x, t, c).sample, args.iters)
    rows.append(("eager", eager_s, 0.0, 0.0))
    trans = {}

    ours = copy.deepcopy(unet)
    t0 = time.perf_counter()
    compile_unet(ours, args.backend)
    # warm what this run uses, as a user would with Warmup Shapes: the timed shape and the transitions
    shapes = [f"{args.batch}x{lat * 8}x{lat * 8}"] + [f"{b}x{s * 8}x{s * 8}" for _, b, s in TRANSITIONS]
    warmup(ours, ", ".join(shapes), compare=False)
    cold = time.perf_counter() - t0
    s, out = _time(lambda: ours(x, t, c).sample, args.iters)
    rows.append((f"unet_compiler ({report(ours).splitlines()[0].split('backend ')[1].split(',')[0]})", s, cold,
                 float((out - ref).abs().max())))
    trans["unet_compiler"] = _transitions(lambda *a: ours(*a), dev)

    if not args.skip_whole:
        whole = torch.compile(copy.deepcopy(unet))
        t0 = time.perf_counter()
        with torch.inference_mode():
            whole(x, t, c)
        cold = time.perf_counter() - t0
        s, out = _time(lambda: whole(x, t, c).sample, args.iters)
        rows.append(("whole-model torch.compile (TorchCompileModel)", s, cold, float((out - ref).abs().max())))
        trans["whole-model torch.compile"] = _transitions(lambda *a: whole(*a), dev)

    print(f"\n{'path':48s} {'step s':>8s} {'vs eager':>9s} {'cold s':>8s} {'max|diff|':>10s}")
    for name, s, cold, diff in rows:
        print(f"{name:48s} {s:8.3f} {eager_s / s:8.2f}x {cold:8.1f} {diff:10.2e}")
    print("\nshape changes after the timed runs (graphs compiled = recompiles; seconds include compiling):")
    for name, ts in trans.items():
        print(f"  {name}: " + "; ".join(f"{lbl}: {g} graph(s), {sec:.1f} s" for lbl, g, sec in ts))
    print("\n" + report(ours))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m unet_compiler")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="eager vs compiled vs whole-model torch.compile, same process")
    b.add_argument("--size", choices=["sd15", "tiny"], default="sd15")
    b.add_argument("--latent", type=int, default=16, help="latent side (pixels / 8)")
    b.add_argument("--batch", type=int, default=2)
    b.add_argument("--iters", type=int, default=5)
    b.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    b.add_argument("--backend", default="auto")
    b.add_argument("--skip-whole", action="store_true", help="skip the whole-model torch.compile baseline")
    args = p.parse_args(argv)
    bench(args)


if __name__ == "__main__":
    main()
