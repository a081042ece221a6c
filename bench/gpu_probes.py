"""Device probes of the GPU check (``python -m unet_compiler.bench gpu``), each run in its own process:
``python -m unet_compiler.bench.gpu_probes {choice,alloc,prompt}``. One ``PROBE {json}`` line per
result plus readable lines. They call the pack as a user would, and two of its internals to time and
capture exactly as it does (``_kernel_choice._measure_ms``, ``graphs.CudaGraphs``)."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

BF = torch.bfloat16


def emit(kind: str, **row) -> None:
    print("PROBE " + json.dumps(dict(probe=kind, **row), default=str), flush=True)


def host_us(fn, n: int = 20) -> float:
    """Host microseconds per call: ``n`` calls queued behind a GPU sleep, so device time is not in it."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / n * 1e6


def choice() -> None:
    """Per kernel at SD1.5 / SDXL shapes: what the backend would keep by wall time (no graphs; three
    one-shot trials, to see whether one trial is stable) and by device time (graphs), host µs per call."""
    from ..compiler.backends._kernel_choice import _measure_ms
    from ..kernels import attention, epilogue, geglu, groupnorm
    r = lambda *s: torch.randn(*s, device="cuda", dtype=BF)   # noqa: E731
    cases = []
    for tag, c, side in (("sd15 L0", 320, 64), ("sd15 L3", 1280, 8), ("sdxl L0", 320, 128), ("sdxl L2", 1280, 32)):
        x, w, b = r(2, c, side, side), r(c), r(c)
        cases.append((f"groupnorm_silu {tag} 2x{c}x{side}x{side}",
                      lambda x=x, w=w, b=b: groupnorm.groupnorm(x, 32, w, b, 1e-5, silu=True),
                      lambda x=x, w=w, b=b: F.silu(F.group_norm(x, 32, w, b, 1e-5))))
    for tag, n, d2 in (("sd15 L0", 4096, 2560), ("sdxl L2", 1024, 10240)):
        h = r(2, n, d2)
        cases.append((f"geglu {tag} 2x{n}x{d2}", lambda h=h: geglu.geglu(h),
                      lambda h=h: (lambda a, g: a * F.gelu(g))(*h.chunk(2, dim=-1))))
    for tag, heads, n, m, d in (("sd15 L0 self", 8, 4096, 4096, 40), ("sd15 L0 cross", 8, 4096, 77, 40),
                                ("sdxl L1 self", 10, 4096, 4096, 64), ("sdxl L2 self", 20, 1024, 1024, 64)):
        q, k, v = (r(2, t, heads * d).view(2, t, heads, d).transpose(1, 2) for t in (n, m, m))
        cases.append((f"attention {tag} d{d}", lambda q=q, k=k, v=v: attention.attention(q, k, v),
                      lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v)))
    hh, wt, bias, res = r(2, 320, 64, 64), r(320, 320, 3, 3) * 0.05, r(320), r(2, 320, 64, 64)

    def conv_kernel():   # the backend's path: conv without bias, then bias + residual in one pass
        y = F.conv2d(hh, wt, None, 1, 1)
        return epilogue.bias_residual(y, bias, res, dim=1, out=y)
    cases.append(("bias_residual sd15 L0 (with its conv)", conv_kernel, lambda: F.conv2d(hh, wt, bias, 1, 1) + res))
    with torch.inference_mode():
        for name, kern, ref in cases:
            try:
                diff = float((kern().float() - ref().float()).abs().max())
                wall_k = [_measure_ms(kern, 5, "wall") for _ in range(3)]
                wall_t = [_measure_ms(ref, 5, "wall") for _ in range(3)]
                dev_k, dev_t = _measure_ms(kern, 5, "device"), _measure_ms(ref, 5, "device")
                hk, ht = host_us(kern), host_us(ref)
            except Exception as e:   # a kernel that declines or fails: say so, go on
                emit("choice", case=name, error=f"{type(e).__name__}: {e}"[:300])
                continue
            picks = sorted({"triton" if a <= b else "torch" for a, b in zip(wall_k, wall_t, strict=True)})
            emit("choice", case=name, max_abs_diff=diff, wall_ms_kernel=wall_k, wall_ms_torch=wall_t,
                 device_ms_kernel=dev_k, device_ms_torch=dev_t, host_us_kernel=hk, host_us_torch=ht,
                 pick_wall=picks, pick_device="triton" if dev_k <= dev_t else "torch")
            print(f"{name:44s} wall k/t {min(wall_k):.3f}/{min(wall_t):.3f} ms -> {'/'.join(picks):12s} "
                  f"device k/t {dev_k:.3f}/{dev_t:.3f} -> {'triton' if dev_k <= dev_t else 'torch':6s} "
                  f"host k/t {hk:.0f}/{ht:.0f} us  diff {diff:.1e}", flush=True)


TINY = dict(sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            attention_head_dim=8, norm_num_groups=8)
STAGES = ("pointer", "launch", "pack", "jit", "pack_jit", "plain", "pool")
#: what ``alloc`` runs, in order: the allocators (cudaMallocAsync, ComfyUI's default, first: what is
#: still unproven there), and per allocator the stages; ``plain`` and ``pool`` are left out, exact
#: under both allocators in runs 2 and 3 (docs/gpu_h100_probes.jsonl), ``stage plain`` still runs them
ALLOCATORS = ("backend:cudaMallocAsync", "")
ALLOC_STAGES = ("pointer", "launch", "pack", "jit", "pack_jit")
STAGE_TIMEOUT_S = 40       # one stage's process at most (the last H100 call: ~15 s a stage)
STAGE_MIN_S = 10           # a stage is not started with less than this left of alloc's budget

#: ``CUpointer_attribute``: what triton's launcher asks of every tensor argument (driver.c, extractPointer)
CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3


def _cu_pointer_status(t: torch.Tensor) -> int:
    """``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`` on ``t``'s address through ctypes,
    as triton's launcher asks it: the driver's status (0: the address is device memory it knows;
    1: CUDA_ERROR_INVALID_VALUE, which the launcher reports as "cannot be accessed from Triton")."""
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1" if os.name != "nt" else "nvcuda.dll")
    out = ctypes.c_uint64(0)
    return int(lib.cuPointerGetAttribute(ctypes.byref(out), ctypes.c_int(CU_POINTER_ATTRIBUTE_DEVICE_POINTER),
                                         ctypes.c_uint64(t.data_ptr())))


def _launch_stage(name: str) -> dict:
    """pointer / launch / jit: memory a capture allocates, and the pack's groupnorm launched on it."""
    from ..kernels import _common
    from ..kernels import groupnorm
    x, w, b = (torch.randn(*s, device="cuda", dtype=BF) for s in ((2, 320, 32, 32), (320,), (320,)))
    ref = lambda: F.silu(F.group_norm(x.float(), 32, w.float(), b.float(), 1e-5)).to(BF)   # noqa: E731
    with torch.inference_mode():
        groupnorm.groupnorm(x, 32, w, b, 1e-5, silu=True)   # planned and bound outside the capture
        torch.cuda.synchronize()
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        res: dict = {}
        if name == "jit":   # every launch through triton's JIT, let into the capture
            _common.BIND[0] = False
            _common._capturing = lambda: False
        with torch.cuda.graph(g, stream=s):
            h = torch.empty_like(x)
            if name == "pointer":
                res["cu_pointer_status_inside"] = _cu_pointer_status(h)
            y = groupnorm.groupnorm(x, 32, w, b, 1e-5, silu=True) if name != "pointer" else h
        torch.cuda.synchronize()
        if name == "pointer":
            res["cu_pointer_status_outside"] = _cu_pointer_status(x)
            return res

        def replay(graph) -> None:
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            res["max_abs_diff"] = max(res.get("max_abs_diff", 0.0), float((y.float() - ref().float()).abs().max()))
        # unrelated allocations made after the capture, alive and filled with a sentinel across a replay:
        # memory the graph still uses, handed out again, shows as a wrong output or a changed sentinel
        junk = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(16)]
        replay(g)
        res["sentinel_intact"] = all(bool((j == 7.0).all()) for j in junk)
        del junk                                       # then freed: the replays after it
        for _ in range(2):
            replay(g)
        del g
        torch.cuda.synchronize()
    return res


def stage(name: str) -> dict:
    """One capture under this process's allocator. pointer: the driver's answer for memory a capture
    allocated (triton's launcher asks it of every tensor argument); launch: the pack's groupnorm (three
    kernels, launched directly with integer pointers) captured, replayed with unrelated allocations
    alive (their sentinel intact) and after they were freed, == torch, the graph freed; jit: the same launched through triton's JIT (under
    cudaMallocAsync it aborted with triton 3.6); plain: ``torch.cuda.graph`` of a matmul; pool: the
    pack's CudaGraphs (side stream, private pool); pack: the triton backend with graphs on a tiny bf16
    diffusers UNet, as shipped (its captures hold the kernels, launched directly); pack_jit: the same
    with every launch through triton's JIT, let into the captures (as before direct launches)."""
    if name in ("pointer", "launch", "jit"):
        return _launch_stage(name)
    x = torch.randn(256, 256, device="cuda")
    if name == "plain":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x @ x
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            y = x @ x
        x.mul_(2)
        g.replay()
        torch.cuda.synchronize()
        return dict(max_abs_diff=float((y - x @ x).abs().max()))
    if name == "pool":
        from ..compiler.graphs import CudaGraphs
        cg = CudaGraphs()
        cg.first_call(lambda: x @ x, x.device)
        g, y = cg.capture(lambda: torch.relu(x @ x) + 1, x.device)
        x.mul_(2)
        g.replay()
        torch.cuda.synchronize()
        return dict(max_abs_diff=float((y - (torch.relu(x @ x) + 1)).abs().max()))
    import diffusers
    from ..compiler import compile_unet
    from ..compiler.api import accelerator_of
    from ..compiler.compat import triton as tc
    if name == "pack_jit":
        from ..kernels import _common
        _common.BIND[0] = False
        _common._capturing = lambda: False
        tc.kernels_in_captures_problem = lambda facts: None
    torch.manual_seed(0)
    u = diffusers.UNet2DConditionModel(**TINY).eval().to("cuda", BF)
    g = torch.Generator().manual_seed(1)
    ins = [(torch.randn(2, 4, 8, 8, generator=g).to("cuda", BF), torch.full((2,), 500.0, device="cuda"),
            torch.randn(2, 77, 32, generator=g).to("cuda", BF)) for _ in range(4)]
    with torch.inference_mode():
        refs = [u(*i).sample for i in ins]
        compile_unet(u, "triton", cuda_graphs=True)
        outs = [u(*i).sample for i in ins]
        torch.cuda.synchronize()
    a = accelerator_of(u)
    res = dict(max_abs_diff=max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, refs, strict=True)),
               graphs=a.graphs.status_lines() if a.graphs else None, kernels=a.backend.status_lines())
    torch.cuda.synchronize()
    print("RELEASE", file=sys.stderr, flush=True)   # what ComfyUI's unload does; stderr after it is counted
    a.release_graphs("probe: unload")
    torch.cuda.synchronize()
    print("RELEASED", file=sys.stderr, flush=True)
    return res


def last_error(err: str) -> str:
    """The line of a failed stage's stderr that says what failed: the last exception line (``Name:
    message``, ``Name`` ending in Error / Exception / Interrupt), else the last non-empty line."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b(:|$)", ln):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def stage_command(name: str) -> list:
    """The command line of one ``alloc`` stage: this module's ``stage NAME`` in a fresh python."""
    return [sys.executable, "-m", __spec__.name if __spec__ else "unet_compiler.bench.gpu_probes", "stage", name]


def alloc(cap: float = 150.0) -> None:
    """Each stage in its own process (a C++ abort kills only that one), cudaMallocAsync (ComfyUI's
    default) first, then the native allocator (``ALLOCATORS`` x ``ALLOC_STAGES``): its result, or its
    exit code and what failed. Each stage is capped at ``STAGE_TIMEOUT_S``, all of them end 5 s before
    ``cap`` (the GPU check's cap on this probe): a stage that would start with less than ``STAGE_MIN_S``
    left is reported as not run."""
    from .gpu import DEADLINE_ENV, end_group
    t0, budget = time.monotonic(), cap - 5
    deadline = os.environ.get(DEADLINE_ENV)   # the GPU check's step end: this process's start-up counts
    if deadline:
        budget = min(budget, float(deadline) - 5 - time.time())
    for conf in ALLOCATORS:
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        for name in ALLOC_STAGES:
            left = budget - (time.monotonic() - t0)
            if left < STAGE_MIN_S:
                emit("alloc", allocator=conf or "native", stage=name, rc="not run", result=None)
                print(f"{conf or 'native':26s} {name:8s} rc=not run ({left:.0f} s of the probe's {budget:.0f} s left)",
                      flush=True)
                continue
            limit = min(STAGE_TIMEOUT_S, left)
            p = subprocess.Popen(stage_command(name), env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            try:
                out, err = p.communicate(timeout=limit)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                end_group(p)
                try:
                    out, err = p.communicate(timeout=5)
                except subprocess.TimeoutExpired:       # (something outside its group holds the pipes)
                    out, err = "", ""
                rc = "timeout"
            res = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT ")]
            at_release = err.partition("\nRELEASE\n")[2].partition("RELEASED")[0]
            failed = f"timeout after {limit:.0f} s" if rc == "timeout" else last_error(err)
            emit("alloc", allocator=conf or "native", stage=name, rc=rc, result=json.loads(res[-1]) if res else None,
                 release_warnings=at_release.count("uncaptured free") if "RELEASED" in err else None,
                 error=failed if rc else "", err_head=err[:1200] if rc else "", err_tail=err[-600:] if rc else "")
            print(f"{conf or 'native':26s} {name:8s} rc={rc} {res[-1] if res else failed}", flush=True)


def timed_steps(step, n: int) -> tuple[float, float]:
    """(median ms of ``n`` synchronized steps, ms of ``n`` steps back to back with one sync at the end)."""
    step()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return sorted(ts)[n // 2] * 1e3, (time.perf_counter() - t0) * 1e3


def host_ms_step(step) -> tuple[float, bool]:
    """Host ms of one step queued behind ~1 s of GPU sleep; True: the launch queue filled and the host
    waited on the GPU (then the figure is not host time)."""
    step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    t0 = time.perf_counter()
    step()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e3, t > 0.5


def prompt(size: str, lat: int, steps: int, prompts: int) -> None:
    """Prompts as ComfyUI runs them with graphs: eager, then triton + graphs and auto, each warmed; at
    every prompt's end what ComfyUI's ON_CLEANUP calls (``prompt_ended``): the first step of the next
    prompt, the whole prompt, memory."""
    from ..compiler import compile_unet, report, warmup
    from ..compiler.api import accelerator_of, uncompile_unet
    from .run import _inputs, _unet
    dev = torch.device("cuda")
    allocator = torch.cuda.memory.get_allocator_backend()
    mib = lambda: dict(allocated=torch.cuda.memory_allocated() >> 20, reserved=torch.cuda.memory_reserved() >> 20)  # noqa: E731
    u = _unet(size, dev).to(dev, BF)
    a, kw = _inputs(u, 2, lat, dev, BF)
    step = lambda: u(*a, **kw).sample   # noqa: E731
    with torch.inference_mode():
        med, piped = timed_steps(step, steps)
        host, full = host_ms_step(step)
        emit("prompt", mode="eager", allocator=allocator, size=size, latent=lat, step_ms=med, steps_ms=piped, host_ms=host,
             queue_full=full, mem_mib=mib())
        for mode in ("triton+graphs", "auto"):
            try:
                torch.cuda.empty_cache()
                m0, t0 = mib(), time.perf_counter()
                compile_unet(u, "auto" if mode == "auto" else "triton", **({} if mode == "auto" else {"cuda_graphs": True}))
                warmup(u, f"2x{lat * 8}x{lat * 8}", compare=False)
                torch.cuda.synchronize()
                warm_s = time.perf_counter() - t0
                accel = accelerator_of(u)
                with accel.bypass():
                    ref = step()
                diff = float((step().float() - ref.float()).abs().max())
                med, piped = timed_steps(step, steps)
                host, full = host_ms_step(step)
                m1, per = mib(), []
                for _ in range(prompts):
                    freed = accel.prompt_ended("probe: end of prompt")
                    m2 = mib()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    first = (time.perf_counter() - t0) * 1e3
                    for _ in range(steps - 1):
                        step()
                    torch.cuda.synchronize()
                    per.append(dict(freed=freed, mem_after_prompt_end=m2, first_step_ms=first,
                                    prompt_ms=(time.perf_counter() - t0) * 1e3))
                emit("prompt", mode=mode, allocator=allocator, warmup_s=warm_s, max_abs_diff=diff, step_ms=med, steps_ms=piped,
                     host_ms=host, queue_full=full, mem_before=m0, mem_warm=m1,
                     static_mib=(accel.graphs.bytes >> 20) if accel.graphs else None,
                     held_mib=(accel.graphs.held >> 20) if accel.graphs else None, prompts=per,
                     report=[ln.strip() for ln in report(u).splitlines() if any(
                         w in ln for w in ("graph", "fired", "measured faster", "not used", "compiled"))])
            except Exception as e:
                emit("prompt", mode=mode, allocator=allocator, error=f"{type(e).__name__}: {e}"[:400])
            finally:
                try:
                    uncompile_unet(u)
                except Exception:
                    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unet_compiler.bench.gpu_probes")
    ap.add_argument("what", choices=["choice", "alloc", "stage", "prompt"])
    ap.add_argument("name", nargs="?", default="", help="stage: one of " + ", ".join(STAGES))
    ap.add_argument("--size", default="sdxl")
    ap.add_argument("--latent", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--cap", type=float, default=150.0, help="alloc: seconds it may take (its stages end 5 s before)")
    o = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_probes: no CUDA GPU here; these probes run on a GPU machine (python -m unet_compiler.bench gpu)")
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, allocator "
          f"{torch.cuda.memory.get_allocator_backend()}", flush=True)
    if o.what == "stage":
        print("RESULT " + json.dumps(stage(o.name), default=str), flush=True)
    elif o.what == "prompt":
        prompt(o.size, o.latent, o.steps, o.prompts)
    elif o.what == "alloc":
        alloc(o.cap)
    else:
        choice()
    return 0


if __name__ == "__main__":
    sys.exit(main())
