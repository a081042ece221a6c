"""The GPU check: ``python -m unet_compiler.bench gpu [--out DIR] [--budget S] [--only STEPS]``.

One call on a GPU machine, within a time budget (default 470 s, for a 500 s call), steps in priority
order, each capped and skipped when too little time is left:

    comfy_imports what the dynamic steps import (ComfyUI, comfy-aimdo's VBAR on the GPU, the pack's
                  nodes): failing, those steps are skipped with its error line
    probe_alloc   CUDA graph capture under cudaMallocAsync (ComfyUI's default), then the native
                  allocator: capture memory and the driver, the pack's kernels launched directly,
                  the pack on a tiny UNet with graphs, then the same through triton's JIT
    dynamic_sd15  the user's default path (``bench dynamic``): ComfyUI's SD1.5 UNet 512x512 batch 2 bf16
                  under Dynamic VRAM (comfy-aimdo's VBAR on the GPU) and cudaMallocAsync, resident and
                  at half the room: eager vs Compile UNet's defaults vs TorchCompileModel (demoted)
    dynamic_sdxl  the same for SDXL 1024x1024
    tests         the GPU tests: kernels + triton backend, and real CUDA graphs + graph memory, at once
    probe_prompt_async  SDXL 1024x1024 batch 2 prompts under cudaMallocAsync, as a stock ComfyUI runs
    probe_prompt  the same under torch's native allocator: steady step, each prompt's first step, host ms,
                  memory, graph pool
    probe_choice  kernel vs torch at SD1.5 / SDXL shapes: wall, device and host time per call
    bench_sd15    SD1.5 512x512 batch 2 bf16: eager, eager + cudnn.benchmark, triton, triton + graphs,
                  whole-model torch.compile (ComfyUI's TorchCompileModel), side by side
    bench_sdxl_kernels  the per-kernel table at SDXL shapes, with what is left

Every step writes ``DIR/<step>.log``; ``DIR/summary.txt`` grows as the steps end (so a call cut
short still brings back what ran). Each step runs in its own process group, ended whole at its cap
(SIGTERM, 5 s, SIGKILL), and whatever it left running when it ended is killed too. It installs
nothing: wheels the GPU image lacks (diffusers, comfy-aimdo) come on ``PYTHONPATH``, and the
ComfyUI tree through ``COMFYUI_PATH`` (DEVELOPERS.md, "GPU"); ``--dry-run`` also sizes what the
call carries (``CARRY``) against the device runner's 64 MiB. What the first runs found: docs/gpu.md.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Step:
    name: str
    want_s: int          # its cap when the budget allows
    min_s: int           # skipped when less than this is left
    commands: list       # argv lists run at once (each its own log: <name>.log, <name>.2.log, ...)
    keep: list = field(default_factory=list)   # regexes of log lines the summary keeps
    env: dict = field(default_factory=dict)    # set for this step's commands (e.g. the allocator)
    needs: tuple = ()    # what its commands import beyond torch and triton (NEEDS): missing, it is skipped
    after: tuple = ()    # steps that must not have failed (rc != 0) earlier in this call: else it is skipped


#: what a step may need that a GPU image may lack: name -> how to find it (a module, or "tree": a
#: ComfyUI tree at COMFYUI_PATH); what to carry is in DEVELOPERS.md, "GPU"
NEEDS = {"diffusers": "diffusers", "pytest": "pytest", "comfy-aimdo": "comfy_aimdo", "ComfyUI tree": "tree"}


def missing(needs, env: dict) -> list[str]:
    """Which of ``needs`` this machine lacks (the ComfyUI tree: ``env``'s COMFYUI_PATH, else ~/comfy/ComfyUI)."""
    out = []
    for name in needs:
        how = NEEDS[name]
        tree = Path(env.get("COMFYUI_PATH") or Path.home() / "comfy" / "ComfyUI")   # (the tests' own lookup)
        found = (tree / "main.py").is_file() if how == "tree" else _has(how)
        if not found:
            out.append(name)
    return out


#: what the call carries to a lent machine beside the checkout (git-ignored; DEVELOPERS.md, "GPU"), and
#: the device runner's limit on all it carries
CARRY = {".gpu/whl": "wheels the image lacks: diffusers and its pure-Python dependencies, comfy-aimdo",
         ".gpu/comfy": "a ComfyUI tree, trimmed (no .git, models, user files)"}
CARRY_LIMIT = 64 << 20


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum((Path(d) / f).lstat().st_size for d, _, fs in os.walk(path) for f in fs)


def carry_lines(root: Path = ROOT) -> list[str]:
    """What ``CARRY`` holds under ``root`` here, each path's size, the total against ``CARRY_LIMIT``,
    and what the steps need that is not among it (comfy-aimdo's wheel, the tree's main.py)."""
    out, total = [], 0
    for rel, what in CARRY.items():
        path = root / rel
        if not path.exists():
            out.append(f"carry {rel:12s} missing here ({what})")
            continue
        n = _size(path)
        total += n
        out.append(f"carry {rel:12s} {n / 2**20:6.1f} MiB ({what})")
    whl = root / ".gpu/whl"
    lacking = [name for name, pattern in (("comfy-aimdo wheel", "comfy_aimdo-*.whl"), ("diffusers wheel", "diffusers-*.whl"))
               if not (whl.is_dir() and any(whl.glob(pattern)))]
    if not (root / ".gpu/comfy/main.py").is_file():
        lacking.append("a ComfyUI tree (its main.py)")
    over = total > CARRY_LIMIT
    out.append(f"carry total  {total / 2**20:6.1f} MiB of {CARRY_LIMIT >> 20} MiB" + (": OVER the limit" if over else "")
               + (f"; not in it: {', '.join(lacking)}" if lacking else ""))
    return out


def _group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid`` (Linux: /proc; elsewhere: [pgid] while
    the group can be signalled)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError, AttributeError):
            return []
    alive = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(int(d.name))
    return alive


def end_group(p: subprocess.Popen, grace: float = 5.0) -> int:
    """End ``p`` (started with ``start_new_session=True``) and everything in its process group:
    SIGTERM to the group, up to ``grace`` s for it to go, SIGKILL to what is left; ``p`` reaped.
    Returns how many live processes the group had (0: nothing was signalled)."""
    if not hasattr(os, "killpg"):            # (Windows: its direct child only)
        alive = int(p.poll() is None)
        p.kill()
        p.wait()
        return alive
    alive = _group_alive(p.pid)
    if alive:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if p.poll() is None or _group_alive(p.pid):
                time.sleep(0.1)
                continue
            break
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:          # (stuck in the kernel, a driver call: left to the OS)
        pass
    return len(alive)


def _py(*args) -> list:
    return [sys.executable, *args]


def steps() -> list[Step]:
    tests = ["-m", "pytest", "-q", "-o", "log_level=INFO", "-p", "no:cacheprovider"]
    xdist = ["-n", "4", "--dist", "loadfile"] if _has("xdist") else []
    prompt = _py("-m", "unet_compiler.bench.gpu_probes", "prompt", "--size", "sdxl", "--latent", "128", "--steps", "10",
                 "--prompts", "2")
    def dynamic(size, lat, iters):   # the user's default path: Dynamic VRAM (comfy-aimdo), cudaMallocAsync
        return _py("-m", "unet_compiler.bench", "dynamic", "--size", size, "--device", "cuda", "--dtype", "bf16",
                   "--batch", "2", "--latent", str(lat), "--iters", str(iters), "--rooms", "1,0.5")
    keep_dynamic = [r"^\|", r"^ComfyUI's", r"status:", r"against TorchCompileModel", r"Error|Traceback"]
    comfy_needs = ("ComfyUI tree", "comfy-aimdo")
    async_alloc = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    return [
        Step("comfy_imports", 30, 15, [_py("-m", "unet_compiler.bench", "dynamic", "--imports-only", "--device", "cuda")],
             [r"^bench dynamic: imports", r"Error|Traceback"], async_alloc, comfy_needs),
        Step("probe_alloc", 150, 60, [_py("-m", "unet_compiler.bench.gpu_probes", "alloc", "--cap", "{cap}")],
             [r"rc="], needs=("diffusers",)),
        Step("dynamic_sd15", 160, 90, [dynamic("sd15", 64, 20)], keep_dynamic, async_alloc, comfy_needs,
             ("comfy_imports",)),
        Step("dynamic_sdxl", 150, 100, [dynamic("sdxl", 128, 10)], keep_dynamic, async_alloc, comfy_needs,
             ("comfy_imports",)),
        Step("tests", 190, 60, [
            _py(*tests, "-rfEs", *xdist, "tests/kernels", "tests/compiler/test_triton_backend.py"),
            _py(*tests, "-rfEs", "tests/compiler/test_cuda_graphs.py",
                "tests/compiler/test_lifetime.py::test_cuda_graph_buffers_go_with_their_region",
                "tests/compiler/test_lifetime.py::test_an_accelerators_cuda_graphs_go_with_its_unet",
                "tests/compiler/test_lifetime.py::test_real_cuda_graph_memory_is_returned",
                "tests/nodes/test_dit.py::test_blocks_that_return_two_streams_are_captured",
                "tests/compiler/test_precompiled.py::test_precompiled_variants_serve_a_bf16_unet_on_cuda")],
             [r"^(FAILED|ERROR)", r"^SKIPPED.*(cuda|CUDA|GPU|ComfyUI)", r" passed| failed| error",
              r"not precompiled|graph (capture|replay) failed"], needs=("pytest", "diffusers")),
        Step("probe_prompt_async", 90, 45, [prompt], [r"^PROBE", r"Error|Traceback"], async_alloc, ("diffusers",)),
        Step("probe_prompt", 90, 45, [prompt], [r"^PROBE", r"Error|Traceback"], needs=("diffusers",)),
        Step("probe_choice", 45, 20, [_py("-m", "unet_compiler.bench.gpu_probes", "choice")],
             [r"^(groupnorm|geglu|attention|bias_residual)", r"Error"]),
        Step("bench_sd15", 200, 70, [_py("-m", "unet_compiler.bench", "run", "--device", "cuda", "--dtype", "bf16",
                                         "--size", "sd15", "--latent", "64", "--batch", "2", "--iters", "20",
                                         "--kernels", "--kernels-skip-inductor", "--backend",
                                         "triton,triton+graphs,whole", "--skip-whole", "--out", "{out}/bench")],
             [r"^(path|eager|unet_compiler|whole|machine:|per-kernel|kernel|groupnorm|bias_|layernorm|geglu|attention)",
              r"triton kernels (fired|not used)|torch measured faster|cuda graphs|failed|Traceback"],
             needs=("diffusers",)),
        Step("bench_sdxl_kernels", 60, 20, [_py("-m", "unet_compiler.bench", "kernels", "--device", "cuda", "--dtype",
                                                "bf16", "--size", "sdxl", "--latent", "128", "--batch", "2", "--iters",
                                                "10", "--skip-inductor", "--out", "{out}/bench")],
             [r"^(per-kernel|kernel|groupnorm|bias_|layernorm|geglu|attention)"], needs=("diffusers",)),
    ]


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def cap(want: int, left: float) -> int:
    """A step's time limit: what it wants, or what is left less 10 s for the summary."""
    return int(min(want, left - 10))


def plan(budget: float, only: set | None = None) -> list[tuple[str, int]]:
    """(step, cap) in order as if each used its whole cap; 0: skipped for want of time."""
    out, left = [], budget
    for s in steps():
        if only and s.name not in only:
            continue
        c = cap(s.want_s, left)
        out.append((s.name, c if c >= s.min_s else 0))
        left -= max(c, 0) if c >= s.min_s else 0
    return out


class Check:
    """Runs the steps into ``out``; ``clock`` is injectable for the tests."""

    def __init__(self, out: Path, budget: float, only: set | None = None, env: dict | None = None, clock=time.monotonic):
        self.out, self.budget, self.only, self.clock = out, budget, only, clock
        self.env = dict(os.environ if env is None else env)
        self.t0 = clock()
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench").mkdir(exist_ok=True)
        self.summary = out / "summary.txt"
        self.summary.write_text("")
        self.stubs = ""
        self.results: dict = {}      # step -> its rc (None: skipped)

    def left(self) -> float:
        return self.budget - (self.clock() - self.t0)

    def say(self, line: str) -> None:
        print(line, flush=True)
        with self.summary.open("a") as f:
            f.write(line + "\n")

    def run(self, step: Step) -> int | None:
        """The step's commands at once, each in its own process group, ended at the step's cap; None:
        skipped (too little time left, something it needs missing here, or a step it comes ``after``
        failed). Returns the worst exit status (124: a command ran past the cap)."""
        self.results[step.name] = None
        c = cap(step.want_s, self.left())
        if c < step.min_s:
            self.say(f"== {step.name}: skipped, {self.left():.0f} s left (needs {step.min_s} s)")
            return None
        lacking = missing(step.needs, self.env)
        if lacking:
            self.say(f"== {step.name}: skipped, {', '.join(lacking)} missing here (DEVELOPERS.md, \"GPU\": what to carry)")
            return None
        failed = [a for a in step.after if self.results.get(a) not in (0, None)]
        if failed:
            self.say(f"== {step.name}: skipped, {', '.join(failed)} failed (its log)")
            return None
        start = self.clock()
        env = {k: v for k, v in self.env.items() if k not in step.env} | step.env
        # (for a command that starts processes in their own sessions, out of this group's reach: it
        # ends them by then, whenever its own clock started)
        env[DEADLINE_ENV] = f"{time.time() + c:.1f}"
        if step.name == "tests":
            env["UNET_COMPILER_LONG_TESTS"] = "1"   # the GPU tests marked long run here too
            if self.stubs:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), self.stubs]))
        procs = []
        worst, notes = 0, []
        try:
            for i, argv in enumerate(step.commands):
                log = self.out / (f"{step.name}.log" if i == 0 else f"{step.name}.{i + 1}.log")
                argv = [a.replace("{out}", str(self.out)).replace("{cap}", str(c)) for a in argv]
                f = log.open("w")
                procs.append((subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                               start_new_session=True), f, log))
            for p, f, _ in procs:
                try:
                    rc = p.wait(timeout=max(1.0, c - (self.clock() - start)))
                    left_running = end_group(p)          # what it left behind would run into the next steps
                    if left_running:
                        notes.append(f"{left_running} process(es) it left running killed")
                except subprocess.TimeoutExpired:
                    end_group(p)
                    rc = 124
                f.close()
                worst = rc if worst == 0 else worst
        finally:
            for p, f, _ in procs:                        # (interrupted: nothing left running)
                if p.returncode is None:
                    end_group(p)
                f.close()
        self.say(f"== {step.name}: rc={worst} in {self.clock() - start:.0f} s (cap {c} s)"
                 + (f"; {'; '.join(notes)}" if notes else ""))
        for _, _, log in procs:
            keep = [ln for ln in log.read_text(errors="replace").splitlines()
                    if any(re.search(k, ln) for k in step.keep)]
            for ln in keep[-40:]:
                self.say("   " + ln[:900])
        self.results[step.name] = worst
        return worst

    def comfy_stubs(self) -> None:
        """With a ComfyUI tree (COMFYUI_PATH) whose requirements the image lacks, only the ones the
        in-process tests never import (frontend, templates, av, ...): a dist-info stub each, on the
        tests' path only, so the tests' requirement check passes; no module is faked."""
        path = self.env.get("COMFYUI_PATH")
        if not path or not (Path(path) / "main.py").is_file():
            return
        from ..tests._families import comfy_missing
        missing = comfy_missing(Path(path))
        stubs = self.out / "stubs"
        for name in missing:
            d = stubs / (re.sub(r"[-_.]+", "_", name.lower()) + "-0.0.0.dist-info")
            d.mkdir(parents=True, exist_ok=True)
            (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
        if missing:
            self.stubs = str(stubs)
        self.say("ComfyUI requirements stubbed for the tests' metadata check only: " + (", ".join(missing) or "none"))

    def env_line(self) -> None:
        """The summary's first line: the python's torch / triton / GPU, nvidia-smi's driver (each capped)."""
        probe = ("import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', "
                 "triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', "
                 "torch.cuda.get_device_capability() if torch.cuda.is_available() else '')")
        try:
            p = subprocess.run(_py("-c", probe), cwd=ROOT, env=self.env, capture_output=True, text=True,
                               timeout=ENV_TIMEOUT_S)
            found = p.stdout.strip() or p.stderr[-300:]
        except subprocess.TimeoutExpired:
            found = f"python -c 'import torch, triton' did not answer in {ENV_TIMEOUT_S} s"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=ENV_TIMEOUT_S) if _which("nvidia-smi") else None
            gpu = smi.stdout.strip() if smi is not None and smi.returncode == 0 else ""
        except subprocess.TimeoutExpired:
            gpu = f"nvidia-smi did not answer in {ENV_TIMEOUT_S} s"
        self.say(f"env: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; {found}" + (f"; {gpu}" if gpu else ""))


ENV_TIMEOUT_S = 60     # env_line's two commands, each
#: a step's end, as time.time(), in its commands' environment
DEADLINE_ENV = "UNET_COMPILER_STEP_DEADLINE"


def _which(cmd: str) -> bool:
    import shutil
    return shutil.which(cmd) is not None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m unet_compiler.bench gpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check", help="folder for the summary and logs "
                    "($OUT when set, else ./gpu-check)")
    ap.add_argument("--budget", type=float, default=470, help="seconds for all steps (default %(default)s)")
    ap.add_argument("--only", default="", help="comma list of steps (a targeted rerun)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and their caps, run nothing")
    ap.add_argument("--prepare", action="store_true", help="make what the call carries here (.gpu/whl, .gpu/comfy: "
                    "bench/gpu_carry.py), check it imports, size it; run nothing")
    ap.add_argument("--python", default="3.12", help="with --prepare: the GPU image's Python (default %(default)s)")
    o = ap.parse_args(argv)
    only = set(filter(None, o.only.split(","))) or None
    unknown = (only or set()) - {s.name for s in steps()}
    if unknown:
        ap.error(f"--only: no step {', '.join(sorted(unknown))}; steps: {', '.join(s.name for s in steps())}")
    if o.prepare:
        from .gpu_carry import prepare
        for line in prepare(ROOT, o.python) + carry_lines():
            print(line)
        return 0
    if o.dry_run:
        needs = {s.name: s.needs for s in steps()}
        for name, c in plan(o.budget, only):
            lacking = missing(needs[name], dict(os.environ))
            print(f"{name:20s} " + (f"cap {c} s" if c else "skipped (budget)")
                  + (f"; needs {', '.join(needs[name])}" if needs[name] else "")
                  + (f" (missing here: {', '.join(lacking)})" if lacking else ""))
        for line in carry_lines():
            print(line)
        return 0
    # a SIGTERM (the runner's own limit, `timeout`) ends this process through its finally blocks, so
    # each step's process group is ended too, not left running in sessions of their own
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    check = Check(Path(o.out).resolve(), o.budget, only)
    check.env_line()
    check.comfy_stubs()
    worst = 0
    for s in steps():
        if only and s.name not in only:
            continue
        rc = check.run(s)
        worst = worst or (rc or 0)
    check.say(f"done in {check.budget - check.left():.0f} s")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
