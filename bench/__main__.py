"""The bench's command line: ``python -m unet_compiler.bench COMMAND [options]``.

    run       eager vs UNet Compiler vs whole-model torch.compile on a random-weight UNet (bin/bench)
    compat    the compatibility tables: every ComfyUI UNet family, the DiT families, then the core patch nodes
    starts    cold and warm starts through a real ComfyUI server
    soak      prompts with random batch / resolution / LoRA strength through a real ComfyUI server
    storage   what fp8 / fp16 / bf16 weight storage costs and saves (a ComfyUI SD1.5 UNet, eager vs
              Compile UNet vs TorchCompileModel)
    kernels   the per-kernel table: each Triton kernel vs the torch ops it replaces vs inductor
    targets   every kernel compiled for each GPU target, on a machine without a GPU (a CI lane)
    gpu       the GPU check: one call on a GPU machine (tests, probes, SD1.5 bench, SDXL prompts)
    hosttime  the GPU path's host time per step and per kernel call, on the meta device (any machine)
    dynamic   the user's default path: ComfyUI's UNet under Dynamic VRAM (the double; comfy-aimdo's VBAR on a
              GPU), eager vs Compile UNet vs TorchCompileModel per VBAR room (needs a ComfyUI tree)
    beside    background compile beside a Python-bound sampling loop, simulated (any machine)

``python -m unet_compiler bench ...`` (the root ``__main__.py``) is ``run``; the others keep their names.
"""
from __future__ import annotations

import argparse
import os
import sys

def _model_options(p: argparse.ArgumentParser, cuda: bool) -> None:
    """The UNet and the measurement: shared by ``run`` and ``kernels``."""
    p.add_argument("--size", choices=["sd15", "sdxl", "tiny"], default="sd15")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="model + inputs dtype (as ComfyUI would load it); bf16 for the GPU numbers")
    p.add_argument("--latent", type=int, default=16, help="latent side (pixels / 8)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--reuse-cache", action="store_true",
                   help="keep inductor's on-disk cache (default: a fresh one, so cold compile seconds are real)")
    p.add_argument("--out", default="", help="folder for the table as JSON and a PNG plot (e.g. docs)")


def parser() -> argparse.ArgumentParser:
    import torch
    from ..tests._families import FAMILIES
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m unet_compiler.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("run", help="eager vs compiled vs whole-model torch.compile on a random-weight UNet",
                       description="Every row but eager in a fresh process, timed interleaved with eager there.")
    _model_options(b, cuda)
    b.add_argument("--peak-tflops", type=float, default=None,
                   help="add an MFU column against this peak in TFLOP/s (default on CUDA in bf16/fp16: 790, the H100 "
                        "bf16 reference of the project's GPU targets; none in fp32)")
    b.add_argument("--backend", default=None,
                   help="comma-separated, each gets its own row; a +graphs suffix adds CUDA graphs "
                        "(default: inductor,triton,triton+graphs on CUDA, auto elsewhere)")
    b.add_argument("--kernels", nargs="?", const="all", default="",
                   help="first a per-kernel table (triton vs eager torch vs inductor); optionally a comma list of "
                        "groupnorm_silu,layernorm,geglu,attention,bias_residual")
    b.add_argument("--kernels-only", action="store_true", help="only the per-kernel table (implies --kernels)")
    b.add_argument("--kernels-skip-inductor", action="store_true", help="no inductor column in the kernel table")
    b.add_argument("--bf16-eager", action="store_true", help="add an eager row with the model in bf16")
    b.add_argument("--skip-whole", action="store_true", help="skip the whole-model torch.compile baseline")
    b.add_argument("--skip-shape-changes", action="store_true",
                   help="time the one shape only: no calls at the other batch sizes and resolutions (a short GPU "
                        "call; whole-model torch.compile recompiles at each)")
    b.add_argument("--compat", action="store_true",
                   help="after the bench table, the model-family compatibility table (needs a ComfyUI tree: "
                        "COMFYUI_PATH or ~/comfy/ComfyUI)")
    b.add_argument("--row", default="", help=argparse.SUPPRESS)  # internal: one row, in a fresh process
    b.add_argument("--row-progress", default="", help=argparse.SUPPRESS)  # internal: "row 2/5", its progress lines

    c = sub.add_parser("compat", help="the compatibility tables alone: model families, then core patch nodes")
    c.add_argument("--backend", dest="compat_backend", default="inductor", metavar="NAME",
                   help="inductor (default), triton (CUDA), ipex, eager")
    c.add_argument("--only", choices=["families", "patches"], default="", help="one of the two tables")
    c.add_argument("--latent", dest="latent_hw", default="16x16", metavar="HxW", help="families: latent HxW (16x16 = 128 px)")
    c.add_argument("--batch", dest="compat_batch", type=int, default=2, metavar="N",
                   help="families: batch (videos of families.FRAMES frames for the video families)")
    c.add_argument("--full", action="store_true",
                   help="patch nodes: every case on SD1.5 and SDXL in both node orders (default: the CI set)")
    c.add_argument("families", nargs="*", choices=list(FAMILIES), metavar="FAMILY",
                   help=f"families: default all ({' '.join(FAMILIES)})")

    k = sub.add_parser("kernels", help="the per-kernel table alone (what run --kernels-only prints)")
    _model_options(k, cuda)
    k.add_argument("--only", dest="kernels", default="all",
                   help="comma list of groupnorm_silu,layernorm,geglu,attention,bias_residual (default all)")
    k.add_argument("--skip-inductor", dest="kernels_skip_inductor", action="store_true",
                   help="no inductor column")
    k.set_defaults(kernels_only=True, row="", row_progress="", backend="", peak_tflops=0.0)

    st = sub.add_parser("storage", help="weight storage dtypes (fp8 ...) on a ComfyUI SD1.5 UNet: eager vs "
                        "Compile UNet vs TorchCompileModel, step time and memory (needs a ComfyUI tree)")
    st.add_argument("--dtypes", default="default,fp8_e4m3fn,fp8_e5m2",
                    help="comma list of UNETLoader weight_dtype values, plus fp16 and bf16, and GGUF files "
                    "ComfyUI-GGUF loads: gguf_Q8_0, gguf_Q4_K, gguf_Q5_K, gguf_F16 (default %(default)s)")
    st.add_argument("--latent", type=int, default=16, help="latent side (pixels / 8)")
    st.add_argument("--batch", type=int, default=2)
    st.add_argument("--iters", type=int, default=5)
    st.add_argument("--row", default="", help=argparse.SUPPRESS)          # internal: one dtype, in a fresh process
    st.add_argument("--checkpoint", default="", help=argparse.SUPPRESS)

    sub.add_parser("starts", add_help=False, help="cold and warm starts through a real ComfyUI server "
                   "(starts --help)")
    sub.add_parser("soak", add_help=False, help="prompts with random batch / resolution / LoRA strength through a "
                   "real ComfyUI server after warming a range (soak --help)")
    sub.add_parser("targets", add_help=False, help="every Triton kernel compiled for sm_80/86/89/90a/120 with no "
                   "GPU (targets --help)")
    sub.add_parser("beside", add_help=False, help="background compile beside a Python-bound sampling loop, "
                   "simulated (beside --help)")
    sub.add_parser("hosttime", add_help=False, help="host time of the GPU path per step and kernel call, on "
                   "the meta device (hosttime --help)")
    sub.add_parser("dynamic", add_help=False, help="ComfyUI's UNet under Dynamic VRAM: eager vs Compile UNet vs "
                   "TorchCompileModel per VBAR room (dynamic --help)")
    sub.add_parser("gpu", add_help=False, help="the GPU check, one call on a GPU machine within a time budget "
                   "(gpu --help)")
    return p


def main(argv=None):
    from ..tests._pack import shadow_problem
    problem = shadow_problem()
    if problem:   # every bench command, and its rows' processes (they run this too)
        print(f"unet_compiler.bench: {problem}", file=sys.stderr)
        return 2
    os.environ["PYTHONSAFEPATH"] = "1"   # nor its children (``python -m`` / ``-c`` in the checkout)
    argv = list(sys.argv[1:] if argv is None else argv)
    # these parse their own options (their --help is theirs)
    if argv[:1] == ["starts"]:
        from .starts import main as starts
        return starts(argv[1:])
    if argv[:1] == ["soak"]:
        from .soak import main as soak
        return soak(argv[1:])
    if argv[:1] == ["targets"]:
        from .targets import main as targets
        return targets(argv[1:])
    if argv[:1] == ["gpu"]:
        from .gpu import main as gpu
        return gpu(argv[1:])
    if argv[:1] == ["beside"]:
        from .beside import main as beside
        return beside(argv[1:])
    if argv[:1] == ["hosttime"]:
        from .hosttime import main as hosttime
        return hosttime(argv[1:])
    if argv[:1] == ["dynamic"]:
        from .dynamic import main as dynamic
        return dynamic(argv[1:])
    args = parser().parse_args(argv)
    if args.cmd == "storage":
        from .storage import main as storage
        return storage(args)
    if args.cmd == "compat":
        from .run import compat
        return compat(args)
    from .run import main as run
    return run(args, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
