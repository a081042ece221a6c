"""Per-kernel timings: the pack's Triton kernel vs eager torch vs inductor.

``python -m unet_compiler.bench kernels`` prints this table alone; ``run --kernels`` before the UNet table.
Each case is one call the SD1.5 / SDXL UNet makes at the benchmarked latent
size and batch: "eager torch" is the op sequence the model runs without the
pack (F.group_norm then F.silu, SDPA, ...), "inductor" is torch.compile of
that same function (fixed shapes), "triton" is the kernel the triton backend
launches. Times are medians (triton.testing.do_bench on CUDA, which clears the L2
cache before each call); the effective bandwidth (bytes in + out / time) or
TFLOP/s says how close each is to the hardware. On CUDA the "backend" column is
what the triton backend runs at that signature, decided as it decides
(``_kernel_choice.decide``: back-to-back calls, L2 warm as in a UNet): without
CUDA graphs (wall time, launches paid) / with graphs replaying (device time). On CPU the Triton column runs under TRITON_INTERPRET=1: it checks
that the kernels run and agree, it is not a speed.
"""
from __future__ import annotations

import time
from functools import partial
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

#: per UNet size: (channels per level, attention levels, heads or head dim, context width)
ARCH = {
    "sd15": dict(channels=(320, 640, 1280, 1280), attn_levels=(0, 1, 2), heads=8, head_dim=None),
    "sdxl": dict(channels=(320, 640, 1280), attn_levels=(1, 2), heads=None, head_dim=64),
    "tiny": dict(channels=(32, 64), attn_levels=(0,), heads=8, head_dim=None),
}


@dataclass
class Case:
    name: str
    shape: str
    make: Callable[[], tuple]      # -> inputs
    triton: Callable                # (*inputs) -> tensor
    eager: Callable                 # (*inputs) -> tensor
    bytes: int = 0                  # memory traffic of one call (in + out)
    flops: float = 0.0              # for attention


def cases(size: str, latent: int, batch: int, device, dtype, only: set | None = None) -> list[Case]:
    from ..kernels import attention, epilogue, geglu, groupnorm
    from .spare_kernels import layernorm
    a = ARCH[size]
    esize = dtype.itemsize
    out: list[Case] = []

    def want(name):
        return not only or name in only

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    for lvl, c in enumerate(a["channels"]):
        side = max(1, latent >> lvl)
        if want("groupnorm_silu"):
            def make(c=c, side=side):
                return rnd(batch, c, side, side), rnd(c), rnd(c)
            out.append(Case("groupnorm_silu", f"{batch}x{c}x{side}x{side}, 32 groups", make,
                            lambda x, w, b: groupnorm.groupnorm(x, 32, w, b, 1e-5, silu=True),
                            lambda x, w, b: F.silu(F.group_norm(x, 32, w, b, 1e-5)),
                            bytes=2 * batch * c * side * side * esize))
        if lvl == 0 and want("bias_residual"):
            def make(c=c, side=side):
                return rnd(batch, c, side, side), rnd(c), rnd(batch, c, side, side)
            out.append(Case("bias_residual", f"{batch}x{c}x{side}x{side} + bias + residual", make,
                            lambda x, b, r: epilogue.bias_residual(x, b, r, dim=1),
                            lambda x, b, r: x + b[:, None, None] + r,
                            bytes=3 * batch * c * side * side * esize))
        if lvl not in a["attn_levels"]:
            continue
        n = side * side
        heads = a["heads"] or c // a["head_dim"]
        d = c // heads
        if want("layernorm"):
            def make(c=c, n=n):
                return rnd(batch, n, c), rnd(c), rnd(c)
            out.append(Case("layernorm", f"{batch}x{n}x{c}", make,
                            lambda x, w, b: layernorm.layernorm(x, w, b, 1e-5),
                            lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
                            bytes=2 * batch * n * c * esize))
        if want("geglu"):
            def make(c=c, n=n):
                return (rnd(batch, n, 8 * c),)
            out.append(Case("geglu", f"{batch}x{n}x{8 * c} -> {4 * c}", make,
                            lambda h: geglu.geglu(h),
                            lambda h: (lambda x, g: x * F.gelu(g))(*h.chunk(2, dim=-1)),
                            bytes=(8 * c + 4 * c) * batch * n * esize))
        for kind, m in (("self", n), ("cross", 77)):
            if not want("attention"):
                break

            def make(heads=heads, n=n, m=m, d=d):
                return rnd(batch, heads, n, d), rnd(batch, heads, m, d), rnd(batch, heads, m, d)
            out.append(Case("attention", f"{kind} {batch}x{heads}h x {n}q x {m}k, d {d}", make,
                            attention.attention, F.scaled_dot_product_attention,
                            bytes=(2 * n + 2 * m) * batch * heads * d * esize,
                            flops=4.0 * batch * heads * n * m * d))
    return out


def _median_ms(fn, device, iters: int) -> float:
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=10, rep=max(25, iters * 5), return_mode="median"))
    fn()
    ts = []
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def run(size: str, latent: int, batch: int, device, dtype, iters: int = 5, only: set | None = None,
        inductor: bool = True, log=print) -> list[dict]:
    """Time every case; one dict per case (ms per path, max |triton - eager|)."""
    from ..kernels._common import KernelUnsupported
    rows = []
    for case in cases(size, latent, batch, device, dtype, only):
        inputs = case.make()
        with torch.inference_mode():
            ref = case.eager(*inputs)
            row = dict(kernel=case.name, shape=case.shape, bytes=case.bytes, flops=case.flops)
            try:
                out = case.triton(*inputs)
                row["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
                row["triton_ms"] = _median_ms(partial(case.triton, *inputs), device, iters)
            except KernelUnsupported as e:
                row["triton_ms"], row["unsupported"] = None, str(e)
            row["eager_ms"] = _median_ms(partial(case.eager, *inputs), device, iters)
            if device.type == "cuda" and row["triton_ms"] is not None:
                from ..compiler.backends._kernel_choice import decide
                for timing in ("wall", "device"):
                    choice, t_kernel, t_torch = decide(partial(case.triton, *inputs), partial(case.eager, *inputs),
                                                       timing)
                    row[f"backend_{timing}"] = dict(choice=choice, triton_ms=t_kernel, torch_ms=t_torch)
            if inductor:
                compiled = torch.compile(case.eager, dynamic=False)
                t0 = time.perf_counter()
                compiled(*inputs)
                row["inductor_compile_s"] = time.perf_counter() - t0
                row["inductor_ms"] = _median_ms(partial(compiled, *inputs), device, iters)
        rows.append(row)
        log(format_row(row, device))
    return rows


def header(device) -> str:
    note = "" if device.type == "cuda" else "   (triton = interpreter on CPU: agreement, not speed)"
    return (f"{'kernel':15s} {'shape':40s} {'triton ms':>10s} {'eager ms':>9s} {'inductor':>9s} "
            f"{'vs eager':>8s} {'vs ind.':>8s} {'triton rate':>14s} {'max|diff|':>9s} {'backend':>13s}{note}")


def format_row(r: dict, device) -> str:
    t, e, i = r.get("triton_ms"), r["eager_ms"], r.get("inductor_ms")
    if t is None:
        return f"{r['kernel']:15s} {r['shape']:40s} {'refused':>10s} {e:9.3f}  ({r['unsupported']})"
    if device.type != "cuda":
        rate = "-"
    elif r["flops"]:
        rate = f"{r['flops'] / t / 1e9:9.1f} TF/s"
    else:
        rate = f"{r['bytes'] / t / 1e6:9.1f} GB/s"
    ind, vs_ind = (f"{i:9.3f}", f"{i / t:7.2f}x") if i else ("-", "-")
    chosen = "/".join(r[f"backend_{m}"]["choice"] for m in ("wall", "device")) if "backend_wall" in r else "-"
    return (f"{r['kernel']:15s} {r['shape']:40s} {t:10.3f} {e:9.3f} {ind:>9s} "
            f"{e / t:7.2f}x {vs_ind:>8s} {rate:>14s} {r['max_abs_diff']:9.2e} {chosen:>13s}")
