"""Background compile beside sampling, simulated on any machine: ``python -m unet_compiler.bench beside
[--share 1,0.25] [--host-ms 2] [--gpu-ms 0,4]``.

On a GPU the compile thread compiles while sampling runs, and both are Python: sampling's host side
launches kernels, the compile traces and generates code, and the two take the interpreter (the GIL)
in turns. Here a sampling loop stands for that host side: each step is ``--host-ms`` of Python (as
measured alone), then ``--gpu-ms`` of waiting without the GIL (the GPU's part of the step), inside
the runtime's model-call bracket so the compile thread sees sampling. Beside it the real compile
thread compiles a tiny UNet's region variants: inductor on CPU, compiled beside sampling and paced
as a GPU model's are, its C++ compiles (which a GPU does not have in the thread) made once first and
cached. Per row, each in a fresh process: the loop's steps a second beside the compile against
alone, the compile's wall seconds, and the seconds the thread paused.
``--share 1``: the thread never pauses (before ``BESIDE_SHARE``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _python_ms(n: int) -> None:
    x = 0
    for i in range(n):
        x += i


def _calibrate(host_ms: float) -> int:
    n = 20000
    while True:
        t0 = time.perf_counter()
        _python_ms(n)
        took = (time.perf_counter() - t0) * 1e3
        if took > 20:
            return max(1, int(n * host_ms / took))
        n *= 2


def _loop(n: int, gpu_ms: float, seconds: float | None, until=None) -> float:
    """Steps a second of the sampling stand-in, for ``seconds`` or until ``until()`` is False."""
    from ..compiler.lifecycle.scheduler import process_scheduler
    activity = process_scheduler().activity
    steps, t0 = 0, time.perf_counter()
    while (time.perf_counter() - t0 < seconds) if seconds is not None else until():
        with activity.call():
            _python_ms(n)
        if gpu_ms:
            time.sleep(gpu_ms / 1e3)
        steps += 1
    return steps / (time.perf_counter() - t0)


def row(share: float, host_ms: float, gpu_ms: float) -> dict:
    """One measurement (in this process: run it in a fresh one)."""
    import torch

    from ..compiler import api
    from ..compiler.lifecycle import pacing
    from ..compiler.lifecycle.scheduler import process_scheduler
    from ..compiler.lifecycle.variants import Variants
    from .run import _unet
    pacing.BESIDE_SHARE = share
    pacing.paces = lambda device_type: True    # this CPU compile stands in for a GPU model's
    # a compile on a GPU is Python: tracing, lowering and code generation in the thread, Triton's own
    # compiles in worker processes. On a CPU inductor's C++ compiles would leave the thread waiting
    # on g++ most of the time, so they are made once first (kept in the on-disk code cache) and the
    # measured compile redoes the rest (its FX graph cache off)
    warm = _unet("tiny")
    api.compile_unet(warm, "inductor")
    with torch.inference_mode():
        api.warmup(warm, "2x64x64", context_tokens=77, compare=False)
    api.uncompile_unet(warm)
    scheduler = process_scheduler()
    scheduler.variants = Variants()      # (as a fresh process's: the measured compile is not served)
    torch._dynamo.reset()
    unet = _unet("tiny")
    api.compile_unet(unet, "inductor")
    n = _calibrate(host_ms)
    alone = _loop(n, gpu_ms, 3.0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        api.warmup(unet, "2x64x64", context_tokens=77, background=True)
    beside = _loop(n, gpu_ms, None, until=lambda: scheduler.thread.active)
    wall = time.perf_counter() - t0
    owner = api.accelerator_of(unet).background.owner
    return dict(share=share, host_ms=host_ms, gpu_ms=gpu_ms, steps_alone=alone, steps_beside=beside,
                speed=beside / alone, compile_s=wall, paused_s=owner.paused, variants=owner.variants)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unet_compiler.bench beside", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--share", default="1,0.25", help="comma list: the compile thread's share of the GIL")
    ap.add_argument("--host-ms", type=float, default=2.0, help="Python per sampling step, measured alone")
    ap.add_argument("--gpu-ms", default="0,4", help="comma list: GIL-free wait per step (the GPU's part)")
    ap.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help="folder for beside_<machine>.json")
    a = ap.parse_args(argv)
    if a.row:
        print("ROW " + json.dumps(row(float(a.share), a.host_ms, float(a.gpu_ms))), flush=True)
        return 0
    rows = []
    for gpu_ms in [float(g) for g in a.gpu_ms.split(",")]:
        for share in [float(s) for s in a.share.split(",")]:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, UNET_COMPILER_CACHE="off",
                           UNET_COMPILER_BACKGROUND_CPU="beside", TORCHINDUCTOR_FX_GRAPH_CACHE="0")
                p = subprocess.run([sys.executable, "-m", "unet_compiler.bench", "beside", "--row", "--share",
                                    str(share), "--host-ms", str(a.host_ms), "--gpu-ms", str(gpu_ms)],
                                   env=env, capture_output=True, text=True, timeout=1800)
            line = next((ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ROW ")), None)
            if line is None:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(line)
            rows.append(r)
            print(f"share {share:4.2f}, step {a.host_ms:.0f} ms Python + {gpu_ms:.0f} ms GPU: sampling at "
                  f"{r['speed']:.2f} of its speed alone ({r['steps_beside']:.0f} vs {r['steps_alone']:.0f} steps/s) "
                  f"while {r['variants']} variants compiled in {r['compile_s']:.1f} s, {r['paused_s']:.1f} s paused",
                  flush=True)
    if a.out:
        import platform
        with open(os.path.join(a.out, f"beside_{platform.machine()}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0
