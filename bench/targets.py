"""Compile every kernel, at the shapes SD1.5 and SDXL UNets launch, for the GPUs users
run, on a machine without a GPU; print what each target gets and fail on what would hurt.

    python -m unet_compiler.bench targets [--cap 80,86,89,90,120] [--dtype fp16,bf16,fp32]
                                          [--only attention,groupnorm,...] [--jobs 2]

Targets: sm_80 (A100), sm_86 (RTX 30xx), sm_89 (RTX 40xx), sm_90a (H100/H200), sm_120
(RTX 50xx). Per compiled variant: the case that first compiled it, kernel, constexpr config,
warps, stages, shared memory, registers and spilled bytes (ptxas -v; "!" when in the hot
loop), resident warps per SM and what bounds them, the MMA kind, and global load / store
widths in bytes (count per width; cp = cp.async, the pipelined loads).
Exit 1 on a compile error, a case no block config fits (shared memory above the target's
limit), spill loads/stores in a hot loop (read from the SASS: inside a loop, or anywhere in
a kernel without one), or 2-byte global loads inside a loop (a 16-bit kernel whose loads
did not vectorise). A launcher declining a case (KernelUnsupported, e.g. fp32 attention,
which SDPA runs on CUDA) is printed, not failed.

How: a stand-in CUDA driver reports the target, so each launch compiles (JITFunction.run
with warmup=True) instead of running; the launchers see ``_common.COMPILE_TARGET`` and choose
as on that GPU. Triton's own ptxas log (TRITON_DUMP_PTXAS_LOG) gives registers and spills.
Needs triton (with its bundled ptxas and cuobjdump) and CPU torch; tested with triton 3.6
and 3.9. Each target compiles in its own process (triton fixes its target per process).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings

CAPS = {80: "A100", 86: "RTX 30xx", 89: "RTX 40xx", 90: "H100/H200", 120: "RTX 50xx"}
# opt-in shared memory per block (bytes): what triton checks against on the GPU
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 120: 101376}
# per SM: shared memory (bytes; each block also reserves 1 KB) and resident warps; 64K registers on all
SMEM_PER_SM = {80: 167936, 86: 102400, 89: 102400, 90: 233472, 120: 102400}
WARPS_PER_SM = {80: 64, 86: 48, 89: 48, 90: 64, 120: 48}
BLOCKS_PER_SM = {80: 32, 86: 16, 89: 24, 90: 32, 120: 32}
FAMILIES = ("attention", "groupnorm", "layernorm", "geglu", "epilogue", "qkv")
SPARE = ("layernorm", "qkv")    # bench/spare_kernels: kernels no backend uses
DTYPES = ("fp16", "bf16", "fp32")
MEM = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*?)\.[bfsu](\d+)\s")
CP_ASYNC = re.compile(r"\bcp\.async\.\w+\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-f]+|\d+)")


def cases(mods, torch, dt):
    """(family, label, launch): one per block config the UNets compile. Configs depend on
    channels, head dim, layout and dtype only (never spatial or token sizes), so these
    cover SD1.5 (heads 8: d 40/80/160) and SDXL (d 64) at any resolution."""
    E, cl = torch.empty, torch.channels_last
    att, gn, ln, gg, ep, qkv = (mods[f] for f in FAMILIES)
    for d, heads, n, m, what in ((40, 8, 4096, 4096, "sd15 self"), (80, 8, 1024, 77, "sd15 cross"),
                                 (160, 8, 256, 154, "sd15 cross"), (64, 10, 4096, 4096, "sdxl self")):
        # laid out as the UNet's views: [B, N, heads*d] viewed as [B, heads, N, d]
        q, k = (E(2, t, heads, d, dtype=dt).transpose(1, 2) for t in (n, m))
        yield "attention", f"attn d{d} {n}x{m} {what}", lambda q=q, k=k: att.attention(q, k, k)
    for fmt, tag in ((torch.contiguous_format, "nchw"), (cl, "cl")):
        x, w = E(2, 320, 64, 64, dtype=dt).contiguous(memory_format=fmt), E(320, dtype=dt)
        yield "groupnorm", f"gn+silu 320ch {tag}", lambda x=x, w=w: gn.groupnorm(x, 32, w, w, silu=True)
        x = E(2, 960, 32, 32, dtype=dt).contiguous(memory_format=fmt)
        yield "groupnorm", f"gn 960ch {tag} no affine", lambda x=x: gn.groupnorm(x, 32)
    for d in (320, 640, 1280):
        x, w = E(2, 1024, d, dtype=dt), E(d, dtype=dt)
        yield "layernorm", f"ln d{d}", lambda x=x, w=w: ln.layernorm(x, w, w)
    yield "geglu", "geglu 2x1024x5120", lambda: gg.geglu(E(2, 1024, 5120, dtype=dt))
    x = E(2, 320, 64, 64, dtype=dt)
    yield "epilogue", "bias_residual 320ch", lambda: ep.bias_residual(x, E(320, dtype=dt), x.clone(), out=x)
    w, wc, x, c = E(640, 640, dtype=dt), E(640, 2048, dtype=dt), E(2, 1024, 640, dtype=dt), E(2, 77, 2048, dtype=dt)
    yield "qkv", "qkv self 640", lambda: qkv.qkv_projection(x, w, w, w)
    yield "qkv", "qkv cross ctx 2048", lambda: qkv.qkv_projection(x, w, wc, wc, c)


def widths(ptx: str) -> tuple[str, str, str, int]:
    """Global loads and stores as 'bytes:count' per access width, cp.async copies the same
    way, and the narrowest global load (ld or cp.async) inside a loop (0: none), a loop
    being the lines between a label and a later branch back to it."""
    lines = ptx.splitlines()
    label_at = {m[1]: i for i, ln in enumerate(lines) if (m := re.match(r"(\$L__BB\w+):", ln))}
    loop = [False] * len(lines)
    for i, ln in enumerate(lines):
        if (m := re.search(r"\bbra(?:\.uni)?\s+(\S+);", ln)) and label_at.get(m[1], i) < i:
            loop[label_at[m[1]]:i + 1] = [True] * (i + 1 - label_at[m[1]])
    count = {"ld": {}, "st": {}, "cp": {}}
    loop_min = 0
    for i, ln in enumerate(lines):
        found = [(op, (int(v[1]) if (v := re.search(r"\.v(\d)", mods)) else 1) * int(bits) // 8)
                 for op, mods, bits in MEM.findall(ln)] + [("cp", int(s, 0)) for s in CP_ASYNC.findall(ln)]
        for op, nbytes in found:
            count[op][nbytes] = count[op].get(nbytes, 0) + 1
            if op != "st" and loop[i]:
                loop_min = min(loop_min or nbytes, nbytes)
    fmt = [",".join(f"{b}:{n}" for b, n in sorted(c.items(), reverse=True)) or "-" for c in count.values()]
    return *fmt, loop_min


def hot_spills(sass: str) -> int:
    """Local-memory (spill) instructions on the hot path of ``cuobjdump -sass`` output:
    inside a loop (from a branch target to the later branch back to it), or anywhere
    in a kernel without loops (its whole body is the hot path)."""
    code = [(int(a, 16), ins) for a, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m[1], 16), a) for a, ins in code
             if (m := re.search(r"\bBRA\s+(0x[0-9a-f]+)", ins)) and int(m[1], 16) < a]  # a backward branch
    spills = [a for a, ins in code if re.search(r"\b(STL|LDL)\b", ins)]
    return len(spills) if not loops else sum(any(t <= a <= b for t, b in loops) for a in spills)


def sass_of(cubin: bytes, cuobjdump: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def occupancy(cap: int, warps: int, regs: int, smem: int) -> str:
    """Resident warps per SM and what limits them: warp slots (full), registers, shared
    memory or block slots."""
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in 256s
    blocks = {"warps": WARPS_PER_SM[cap] // warps, "regs": 65536 // (per_warp * warps),
              "smem": SMEM_PER_SM[cap] // (smem + 1024), "blocks": BLOCKS_PER_SM[cap]}
    limiter = min(blocks, key=blocks.get)
    return f"{blocks[limiter] * warps:2d}w/SM {limiter}"


def use_target(cap: int) -> None:
    """Make triton in this process compile for compute capability ``cap`` with no GPU: a stand-in
    driver reports the target (nothing can run), and the launchers plan for it
    (``_common.COMPILE_TARGET``). Exits with a line naming the triton internal that moved."""
    import torch
    import triton
    try:  # triton internals this tool leans on; they move between releases
        from triton.backends.compiler import GPUTarget
        from triton.backends.driver import DriverBase
        from triton.runtime.driver import driver
    except ImportError as e:
        sys.exit(f"bench targets: triton {triton.__version__} moved an internal this tool uses ({e}); "
                 f"it works with triton 3.6 and 3.9")

    from ..kernels import _common

    class TargetOnlyDriver(DriverBase):
        """Reports the target GPU; launches become compiles (nothing can run)."""
        @classmethod
        def is_active(cls): return True
        def map_python_to_cpp_type(self, ty): return ty
        def get_current_target(self): return GPUTarget("cuda", cap, 32)
        def get_active_torch_device(self): return torch.device("cpu")
        def get_benchmarker(self): raise NotImplementedError("no GPU")
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0

    try:
        driver.set_active(TargetOnlyDriver())
    except TypeError as e:  # a new abstract method on DriverBase
        sys.exit(f"bench targets: triton {triton.__version__}'s driver interface changed ({e})")
    _common.COMPILE_TARGET = (cap // 10, cap % 10)


def run_target(cap: int, dtypes: list[str], only: list[str]) -> int:
    """Compile every case for one target in this process; print a line per variant."""
    os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret
    tmp = tempfile.TemporaryDirectory(prefix="unet-compiler-targets-")
    # a fresh cache, so every variant compiles and triton prints its ptxas -v log
    os.environ.update(TRITON_CACHE_DIR=tmp.name, TRITON_DUMP_PTXAS_LOG="1")
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # triton 3.9's notice of a new default
    import torch
    import triton
    try:  # triton internals this tool leans on; they move between releases
        from triton.runtime.errors import OutOfResources
        from triton.runtime.jit import JITFunction
        from triton.tools.disasm import path_to_cuobjdump
    except ImportError as e:
        sys.exit(f"bench targets: triton {triton.__version__} moved an internal this tool uses ({e}); "
                 f"it works with triton 3.6 and 3.9")

    from ..kernels import _common
    use_target(cap)
    limit = SMEM_LIMIT[cap]
    compiled = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        with contextlib.redirect_stdout(io.StringIO()) as log:  # triton prints the ptxas log
            k = launch(self, *args, grid=grid, warmup=True, **kwargs)
        given = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        cfg = {p.name: given[p.name] for p in self.params if p.is_constexpr and p.name in given}
        compiled.append((self.fn.__name__, cfg, k, log.getvalue()))
        if k.metadata.shared > limit:  # as on the GPU: the launcher tries its next config
            raise OutOfResources(k.metadata.shared, limit, "shared memory")
        return None   # nothing launched: a planned launch has no compiled kernel to launch directly

    JITFunction.run = compile_only
    root = __package__.rpartition('.')[0]
    mods = {f: importlib.import_module(f"{__package__}.spare_kernels.{f}" if f in SPARE else f"{root}.kernels.{f}")
            for f in FAMILIES}
    arch = f"sm_{cap}a" if cap >= 90 else f"sm_{cap}"
    print(f"== {arch} ({CAPS[cap]}), {limit} B shared memory per block, triton "
          f"{triton.__version__}, torch {torch.__version__}")
    seen, failed = set(), []
    for dname in dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dname]
        for family, label, fn in cases(mods, torch, dt):
            if family not in only:
                continue
            compiled.clear()
            error = declined = None
            try:
                fn()
            except _common.KernelUnsupported as e:  # "no block configuration fits": a failure
                declined, error = (None, str(e)) if "no block configuration fits" in str(e) else (str(e), None)
            except Exception as e:  # a compile error
                error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            for kname, cfg, k, log in compiled:
                if k.hash in seen:  # one line per variant: the first case that compiled it
                    continue
                seen.add(k.hash)
                md, ptx = k.metadata, k.asm["ptx"]
                conf = " ".join(f"{a}={v}" for a, v in cfg.items() if a != "UPCAST" and (a != "PREC" or dname == "fp32"))
                head = f"{arch:7s} {dname:4s} {label:24s} {kname:21s} {conf:56s} w{md.num_warps} s{md.num_stages}"
                if md.shared > limit:
                    print(f"{head} smem {md.shared} > {limit}: skipped, as on the GPU")
                    continue
                regs = int(m[1]) if (m := re.search(r"Used (\d+) registers", log)) else -1
                spill = sum(int(s) for s in re.findall(r"(\d+) bytes spill stores", log))
                ld, st, cp, loop_ld = widths(ptx)
                mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
                hot = hot_spills(sass_of(k.asm["cubin"], path_to_cuobjdump())) if spill else 0
                print(f"{head} smem {md.shared:6d} regs {regs:3d} spill {spill:4d}{'!' if hot else ' '} "
                      f"{occupancy(cap, md.num_warps, regs, md.shared)} {mma:8s} ld {ld} st {st} cp {cp}")
                why = ([f"{hot} spill loads/stores in the hot loop ({spill} B spilled)"] * (hot > 0)
                       + ["no ptxas log"] * (regs < 0) + [f"{loop_ld}-byte loads in a loop"] * (0 < loop_ld < 4))
                if why:
                    failed.append(f"{arch} {dname} {label} {kname} [{conf}]: {', '.join(why)}")
            if declined:
                print(f"{arch:7s} {dname:4s} {label:24s} declined: {declined}")
            if error:
                print(f"{arch:7s} {dname:4s} {label:24s} FAILED: {error}")
                failed.append(f"{arch} {dname} {label}: {error}")
    for line in failed:
        print(f"FAIL {line}")
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unet_compiler.bench targets", description=__doc__.split("\n")[0])
    ap.add_argument("--cap", default=",".join(map(str, CAPS)), help="compute capabilities, e.g. 89,90")
    ap.add_argument("--dtype", default=",".join(DTYPES), help=f"comma list of {','.join(DTYPES)}")
    ap.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of {','.join(FAMILIES)}")
    ap.add_argument("--jobs", type=int, default=2, help="targets compiled in parallel (one process each)")
    opt = ap.parse_args(argv)
    caps = [int(c.strip().removeprefix("sm_").rstrip("a")) for c in opt.cap.split(",")]  # 90, sm_90a, ...
    dtypes, only = opt.dtype.split(","), opt.only.split(",")
    for bad in [c for c in caps if c not in CAPS] + [d for d in dtypes if d not in DTYPES] + \
               [f for f in only if f not in FAMILIES]:
        ap.error(f"unknown choice {bad!r}")
    if len(caps) == 1:
        return run_target(caps[0], dtypes, only)
    start, rc, running = time.monotonic(), 0, []
    pending = list(caps)
    while pending or running:  # one process per target: triton keeps its target per process
        while pending and len(running) < max(1, opt.jobs):
            cmd = [sys.executable, "-m", __spec__.name, "--cap", str(pending.pop(0)), "--dtype", opt.dtype,
                   "--only", opt.only]
            out = tempfile.TemporaryFile(mode="w+")
            running.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True), out))
        proc, out = running.pop(0)
        rc |= proc.wait()
        out.seek(0)
        print(out.read(), end="", flush=True)
        out.close()
    print(f"== {'FAILED' if rc else 'ok'}: {len(caps)} targets in {time.monotonic() - start:.0f} s")
    return 1 if rc else 0


if __name__ == "__main__":
    sys.exit(main())
