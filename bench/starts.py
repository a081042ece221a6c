"""Cold and warm starts through a real ComfyUI server: ``python -m unet_compiler.bench starts``.

Every row is its own ComfyUI process (``comfy_server.start_server``: ``main.py``, ``--cpu`` unless
CUDA is there, loopback, this checkout as a custom-node pack) running one txt2img workflow on the
random-weight SD1.5 checkpoint twice: the first prompt loads the checkpoint, encodes the text,
compiles and samples; the second changes only the seed, so ComfyUI reruns KSampler alone (model
loaded, compiled code ready). Times are ComfyUI's own (the execution_start / execution_success
timestamps in /history).

    compile overhead = (first - second) - (first - second of the eager rows, their mean)

is what compiling added before the first image. Rows, in one run, each with fresh caches unless
it says otherwise:

- ``eager``: plain ComfyUI, first and again last (``EAGER_AGAIN``): its own first-prompt cost
  varied by several seconds between runs on this VM, so the baseline is the mean of both and the
  output says how far apart they were (an unreported eager server runs before both: the first
  process of a run paid up to 6.6 s more than the same row at the end);
- ``TorchCompileModel``: ComfyUI's core node (whole-model torch.compile, inductor);
- ``Compile UNet, one shape``: Compile UNet + Warmup Shapes of the prompt's UNet shape (twice the
  image batch: CFG runs cond and uncond in one batch);
- ``Compile UNet, one shape, background``: the same with Warmup Shapes' ``background`` on: warmup
  returns at once and the first prompt samples with the model's own code while a thread compiles;
  the bench waits for the server log's "background compile: done" line before the second prompt
  (its ``note`` says how long after the first prompt began that was);
- ``Compile UNet, range``: Compile UNet + Warmup Shapes of a batch / resolution range;
- ``restart``: a new process on the one-shape row's caches (the pack's folder, and inductor's
  cache the pack placed inside it): what a ComfyUI restart pays; and the same for the range row;
- ``second worker``: a new process given a copy of the pack's folder (its entries and the inductor
  files it placed there), mounted read-only where this machine allows it (a fleet's shared
  mount), with cold caches of its own: what a scale-out worker pays.

The second prompt's seconds are the step time after warmup (it must not get worse than
TorchCompileModel's). Nothing is downloaded; the checkpoint is built once (about a minute).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import comfy_server as S

ONE_SHAPE, RANGE = "Compile UNet, one shape", "Compile UNet, range"
OFF = ", background off"     # the row with Warmup Shapes' background off (the others: every input at its default)
#: the images the session table times (wall time from the first prompt's start to each)
SESSION_IMAGES = (1, 5, 20)
DONE = re.compile(r"background compile: done in ([\d.]+) s, (\d+) region variant\(s\) \((\d+) graph\(s\)\)"
                  r"(?:, (\d+) loaded from the compile cache)?")
RESTART_RANGE = "restart of the range row"
EAGER_AGAIN = "eager, again"


@dataclass
class StartRow:
    row: str
    first_s: float
    second_s: float
    ready_s: float                 # server start until it answered
    overhead_s: float = 0.0        # compile overhead (see the module's docstring)
    graphs: int | None = None      # graphs compiled (the pack's report), None where it has none
    from_cache: int | None = None  # of those, taken from the compile cache
    note: str = ""
    report: str = field(default="", repr=False)


def workflow(ckpt: str, model: str, size: int, batch: int, steps: int, seed: int, shapes: str = "",
             background: bool | None = None, arch: str = "sd15") -> dict:
    """The txt2img API prompt: checkpoint -> [TorchCompileModel | Compile UNet -> Warmup Shapes] ->
    KSampler (euler, normal) -> VAE decode -> preview; ``arch`` "flux": the Flux file through
    UNETLoader instead (``comfy_server.flux_txt2latent``: cfg 1, the latent saved). Every input of
    the pack's nodes but ``shapes`` is left out (its default), ``background`` too where it is None."""
    if arch == "flux":
        p, source = S.flux_txt2latent(ckpt, size, batch, steps, seed), ["20", 0]
    else:
        p, source = S.txt2img(ckpt, size, size, batch, steps, 7.0, seed), ["1", 0]
    if model == "tcm":
        p["10"] = {"class_type": "TorchCompileModel", "inputs": {"model": source, "backend": "inductor"}}
        p["5"]["inputs"]["model"] = ["10", 0]
    elif model == "pack":
        p["11"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": source}}
        p["12"] = {"class_type": "UNetCompiler_WarmupShapes", "inputs": {"model": ["11", 0], "shapes": shapes}}
        if background is not None:
            p["12"]["inputs"]["background"] = background
        p["5"]["inputs"]["model"] = ["12", 0]
    return p


def prompt_seconds(entry: dict, wall: float) -> float:
    """ComfyUI's execution_start -> execution_success (ms timestamps); the wall time without them."""
    stamps = {name: data.get("timestamp") for name, data in (entry.get("status") or {}).get("messages") or []
              if isinstance(data, dict)}
    if stamps.get("execution_start") and stamps.get("execution_success"):
        return (stamps["execution_success"] - stamps["execution_start"]) / 1000
    return wall


def report_text(entry: dict) -> str:
    out = (entry.get("outputs") or {}).get("12") or {}
    text = out.get("text")
    return "\n".join(map(str, text)) if isinstance(text, (list, tuple)) else str(text or "")


def graphs_of(text: str) -> tuple[int | None, int | None]:
    """(graphs compiled and loaded, of those loaded from the compile cache), from a report's calls line."""
    m = re.search(r"graphs compiled: (\d+)(?:; loaded from the compile cache: (\d+))?", text)
    return (int(m.group(1)) + int(m.group(2) or 0), int(m.group(2) or 0)) if m else (None, None)


def wait_for_done(server, timeout: float = 3600.0) -> re.Match:
    """The server log's "background compile: done" line, once it is there."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = DONE.search(server.log_tail(2_000_000))
        if m:
            return m
        server.check_alive()
        time.sleep(0.5)
    raise TimeoutError(f"no 'background compile: done' in the server log after {timeout:.0f} s")


def _arch(args) -> str:
    return getattr(args, "model", "sd15")


def _one_shape(args) -> str:
    """The prompt's model batch and size as Warmup Shapes names it: CFG runs cond and uncond in one
    UNet batch; the Flux prompt runs cfg 1 (Flux dev's guidance is an input, not a second batch)."""
    return f"{(1 if _arch(args) == 'flux' else 2) * args.batch}x{args.px}x{args.px}"


def _server(root: Path, ckpt: Path, env: dict, args):
    """A fresh ComfyUI for one row; with ``--model flux`` the Flux file (built beside the checkpoint
    once) is in its diffusion_models folder."""
    import torch
    server = S.start_server(root, ckpt.parent, env=env, log=None, cpu=not torch.cuda.is_available())
    if _arch(args) == "flux":
        S.link(server.model_dirs["diffusion_models"] / S.FLUX_FILES["flux"], S.flux_files(ckpt.parent)["flux"])
    return server


def run_row(name: str, root: Path, ckpt: Path, model: str, args, env: dict, shapes: str = "", log=print,
            background: bool | None = None) -> StartRow:
    server = _server(root, ckpt, env, args)
    try:
        times = []
        entry = {}
        done = None
        for seed in (1, 2):
            t0 = time.perf_counter()
            entry = server.run_prompt(workflow(ckpt.name, model, args.px, args.batch, args.steps, seed, shapes,
                                               background, _arch(args)), timeout=3600)
            times.append(prompt_seconds(entry, time.perf_counter() - t0))
            if seed == 1 and model == "pack":
                first_report = report_text(entry)
                if "compiling in the background" in first_report:   # (the default, or asked for)
                    done = wait_for_done(server)
                    after = time.perf_counter() - t0
        row = StartRow(name, times[0], times[1], server.ready_s)
        if model == "pack":
            row.report = first_report
            row.graphs, row.from_cache = graphs_of(first_report)
        if done is not None:   # the warmup's (from the compile cache, at a restart) and the thread's
            loaded = int(done.group(4) or 0)    # (a CPU restart's: loaded by the thread once idle)
            row.graphs = (row.graphs or 0) + int(done.group(3)) + loaded
            row.from_cache = (row.from_cache or 0) + loaded
            later = sum(int(n) for n in re.findall(r"(\d+) graph\(s\) compiled after warmup in the background",
                                                   server.log_tail(2_000_000)))
            doing = "loaded from the compile cache" if loaded and not int(done.group(3)) else "compiled"
            row.note = (f"first image with the model's own code while its code {doing}; compiled code from "
                        f"{after:.0f} s after the first prompt began ({float(done.group(1)):.0f} s of that)"
                        + (f"; {later} graph(s) compiled later in the background" if later else ""))
    finally:
        server.stop()
    log(f"  {name}: first prompt {row.first_s:.1f} s, second {row.second_s:.1f} s"
        + (f", {row.graphs - row.from_cache} graph(s) compiled, {row.from_cache} loaded from the compile cache"
           if row.graphs is not None
           else ""))
    return row


def _read_only(folder: Path) -> tuple[Path, str, callable]:
    """``folder`` as a read-only path: a read-only bind mount (root on Linux), else file modes
    (which root ignores: then it says so). Returns (path, how, undo)."""
    target = Path(tempfile.mkdtemp(prefix="unet_compiler_ro_"))
    if os.name == "posix" and hasattr(os, "geteuid") and os.geteuid() == 0:
        ok = subprocess.run(["mount", "--bind", str(folder), str(target)], capture_output=True).returncode == 0
        if ok and subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True).returncode == 0:
            return target, "read-only bind mount", lambda: subprocess.run(["umount", str(target)], capture_output=True)
        if ok:
            subprocess.run(["umount", str(target)], capture_output=True)
    shutil.rmtree(target, ignore_errors=True)
    for p in [folder, *folder.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    how = "file modes a-w" + (" (ignored by root: the folder stays writable)" if os.name == "posix"
                              and os.geteuid() == 0 else "")
    return folder, how, lambda: [p.chmod(p.stat().st_mode | 0o200) for p in [folder, *folder.rglob("*")]]


def second_worker(cache: Path, root: Path, ckpt: Path, args, shapes: str, log=print,
                  background: bool | None = None) -> StartRow:
    """A new ComfyUI process given a copy of ``cache`` (the pack's entries and the inductor folder
    it placed beside them), read-only as a fleet's shared mount, and cold caches of its own."""
    shared = root.with_name(root.name + "_shared_cache")
    shutil.copytree(cache, shared, ignore=shutil.ignore_patterns("locks"))
    ro, how, undo = _read_only(shared)
    try:
        env = {"UNET_COMPILER_CACHE_DIR": str(ro), "UNET_COMPILER_CACHE": None,
               "TORCHINDUCTOR_CACHE_DIR": None, "TRITON_CACHE_DIR": str(root / "triton"),
               "TMPDIR": str(root / "tmp")}   # its own temp: the pack's local copy of the inductor files lands there
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        row = run_row("second worker (a read-only copy of the folder)", root, ckpt, "pack", args, env, shapes,
                      log=log, background=background)
    finally:
        undo()
    row.note = how
    return row


def pack_env(d: Path) -> dict:
    """A pack row's server env: every row's torch caches its own and cold, the pack placing
    inductor's cache in its own folder (as a user who set nothing gets)."""
    return {"UNET_COMPILER_CACHE_DIR": str(d / "pack_cache"), "UNET_COMPILER_CACHE": None,
            "TORCHINDUCTOR_CACHE_DIR": None, "TRITON_CACHE_DIR": str(d / "triton")}


def measure(args, log=print) -> list[StartRow]:
    home = Path(args.work or tempfile.mkdtemp(prefix="unet_compiler_starts_"))
    ckpt = S.checkpoint_path(Path(args.checkpoint_dir).expanduser())
    one = _one_shape(args)
    rows = []

    def fresh(name):
        return home / name

    eager_dir, tcm_dir, one_dir, range_dir = (fresh(n) for n in ("eager", "tcm", "one", "range"))
    # the checkpoint read once first: the eager row (the baseline every overhead is net of) was the
    # only one to find it outside the page cache (its first prompt 9-16 s, varying run to run)
    with open(ckpt, "rb") as f:
        while f.read(1 << 24):
            pass
    log("starts: each row a fresh ComfyUI process; two prompts each")
    # an eager server first, not reported: the first process of a run paid up to 6.6 s more than the
    # same eager row at the end (memory this VM had not handed out for a while); it uses no compile cache
    run_row("eager (settling the machine, not reported)", fresh("settle"), ckpt, "eager", args, {}, log=log)
    rows.append(run_row("eager", eager_dir, ckpt, "eager", args, {}, log=log))
    every = getattr(args, "rows", "all") in ("all", "starts")
    if every:
        rows.append(run_row("TorchCompileModel (inductor)", tcm_dir, ckpt, "tcm", args, {}, log=log))
    rows.append(run_row(f"{ONE_SHAPE} ({one})", one_dir, ckpt, "pack", args, pack_env(one_dir), one, log=log))
    if every:
        rows.append(run_row(f"{ONE_SHAPE}{OFF} ({one})", fresh("one_off"), ckpt, "pack", args,
                            pack_env(fresh("one_off")), one, log=log, background=False))
        rows.append(run_row(f"{RANGE} ({args.range})", range_dir, ckpt, "pack", args, pack_env(range_dir),
                            args.range, log=log))
        rows.append(run_row(f"{RANGE}{OFF} ({args.range})", fresh("range_off"), ckpt, "pack", args,
                            pack_env(fresh("range_off")), args.range, log=log, background=False))
    # restart: the one-shape row's folders again, a new process
    env = pack_env(one_dir)
    rows.append(run_row("restart of the one-shape row", fresh("restart"), ckpt, "pack", args, env, one, log=log))
    if every:
        rows.append(run_row(RESTART_RANGE, fresh("restart_range"), ckpt, "pack", args, pack_env(range_dir),
                            args.range, log=log))
        rows.append(second_worker(one_dir / "pack_cache", fresh("worker"), ckpt, args, one, log))
    # the baseline again, last: eager's first-prompt cost alone varied 4.3-7.7 s between runs here
    rows.append(run_row(EAGER_AGAIN, fresh("eager_again"), ckpt, "eager", args, {}, log=log))
    return net(rows)


@dataclass
class SessionRow:
    row: str
    to_image_s: dict               # image number -> seconds from the first prompt's start to that image
    prompts: int = 0


def _stamp(entry: dict, name: str) -> float:
    for message, data in (entry.get("status") or {}).get("messages") or []:
        if message == name and isinstance(data, dict) and data.get("timestamp"):
            return data["timestamp"] / 1000
    raise ValueError(f"no {name} timestamp in the prompt's /history status")


def session_row(name: str, root: Path, ckpt: Path, model: str, args, env: dict, shapes: str = "",
                background: bool | None = None, log=print) -> SessionRow:
    """A user's session: ``max(SESSION_IMAGES)`` prompts queued at once on a fresh server (each a new
    seed), timed by ComfyUI's own stamps from the first prompt's start to each image."""
    n = max(SESSION_IMAGES)
    server = _server(root, ckpt, env, args)
    try:
        ids = [S.queue_prompt(server, workflow(ckpt.name, model, args.px, args.batch, args.steps, seed, shapes,
                                               background, _arch(args))) for seed in range(1, n + 1)]
        entries = [S.wait_prompt(server, pid, timeout=3600) for pid in ids]
    finally:
        server.stop()
    start = _stamp(entries[0], "execution_start")
    row = SessionRow(name, {k: _stamp(entries[k - 1], "execution_success") - start for k in SESSION_IMAGES}, n)
    log(f"  session, {name}: " + ", ".join(f"image {k} at {t:.1f} s" for k, t in row.to_image_s.items()))
    return row


#: the setting that makes a CPU model's background compile run beside sampling (default: when idle)
BESIDE = "UNET_COMPILER_BACKGROUND_CPU"


def measure_session(args, home: Path, ckpt: Path, log=print) -> list[SessionRow]:
    """The session table's rows, each on a fresh server with cold caches: eager, TorchCompileModel,
    the pack with every input at its default (one shape), the same compiling beside sampling, and
    the same with background off."""
    one = _one_shape(args)
    log(f"session: {max(SESSION_IMAGES)} prompts queued at once per row, each row a fresh ComfyUI process")
    return [session_row("eager", home / "s_eager", ckpt, "eager", args, {}, log=log),
            session_row("TorchCompileModel (inductor)", home / "s_tcm", ckpt, "tcm", args, {}, log=log),
            session_row(f"Compile UNet + Warmup Shapes {one}, defaults", home / "s_pack", ckpt, "pack", args,
                        pack_env(home / "s_pack"), one, log=log),
            session_row(f"the same, compiling beside sampling ({BESIDE}=beside)", home / "s_beside", ckpt,
                        "pack", args, {**pack_env(home / "s_beside"), BESIDE: "beside"}, one, log=log),
            session_row("the same, background off", home / "s_off", ckpt, "pack", args, pack_env(home / "s_off"), one,
                        background=False, log=log)]


def session_table(rows: list[SessionRow]) -> str:
    eager = rows[0].to_image_s
    lines = ["| row | " + " | ".join(f"image {k} s (vs eager)" for k in SESSION_IMAGES) + " |",
             "|---|" + "---|" * len(SESSION_IMAGES)]
    for r in rows:
        cells = [f"{r.to_image_s[k]:.1f}" + ("" if r is rows[0] else f" ({r.to_image_s[k] / eager[k]:.2f}x)")
                 for k in SESSION_IMAGES]
        lines.append(f"| {r.row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _eager_rows(rows: list[StartRow]) -> list[StartRow]:
    return [r for r in rows if r.row == "eager" or r.row == EAGER_AGAIN]


def net(rows: list[StartRow]) -> list[StartRow]:
    """Each row's compile overhead: its first prompt's extra time net of eager's, the mean of the
    eager rows (the first row, and the last where there is one)."""
    eager = _eager_rows(rows)
    base = sum(r.first_s - r.second_s for r in eager) / len(eager)
    for r in rows:
        r.overhead_s = 0.0 if r in eager else (r.first_s - r.second_s) - base
    return rows


def baseline_line(rows: list[StartRow]) -> str:
    """What the baseline was, and how far the two measurements of it were apart."""
    costs = [r.first_s - r.second_s for r in _eager_rows(rows)]
    if len(costs) < 2:
        return f"eager's own first-prompt cost (the baseline): {costs[0]:.1f} s"
    spread = (max(costs) - min(costs)) / 2
    return (f"eager's own first-prompt cost, first and last row: {costs[0]:.1f} s and {costs[-1]:.1f} s; the "
            f"baseline is their mean, {sum(costs) / len(costs):.1f} s, so each overhead is uncertain by about "
            f"+-{spread:.1f} s")


def table(rows: list[StartRow]) -> str:
    tcm = next((r for r in rows if r.row.startswith("TorchCompileModel")), None)
    one = next((r for r in rows if r.row.startswith(ONE_SHAPE + " (")), None)
    rng = next((r for r in rows if r.row.startswith(RANGE + " (")), None)
    lines = ["| row | first prompt s | second prompt s | compile overhead s | vs TorchCompileModel | "
             "vs its cold row | graphs compiled (from cache) |", "|---|---|---|---|---|---|---|"]
    eager = _eager_rows(rows)
    for r in rows:
        vs_tcm = f"{r.overhead_s / tcm.overhead_s:.2f}x" if tcm and r not in eager and tcm.overhead_s > 0 else "-"
        cold = rng if r.row == RESTART_RANGE else one if r.row.startswith(("restart", "second worker")) else None
        vs_cold = f"{r.overhead_s / cold.overhead_s:.0%}" if cold and cold.overhead_s > 0 else "-"
        if cold and r.second_s > 1.2 * cold.second_s:
            # a warm start that is cheap because it runs slower code (regions fell back to eager)
            vs_cold += f" (steps slower than its cold row: {r.second_s:.1f} s vs {cold.second_s:.1f} s)"
        g = "-" if r.graphs is None else f"{r.graphs} ({r.from_cache})"
        note = f" ({r.note})" if r.note else ""
        lines.append(f"| {r.row}{note} | {r.first_s:.1f} | {r.second_s:.1f} | "
                     f"{'-' if r in eager else f'{r.overhead_s:.1f}'} | {vs_tcm} | {vs_cold} | {g} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m unet_compiler.bench starts",
                                 description="Cold and warm starts through a real ComfyUI server (see the module doc)")
    ap.add_argument("--px", type=int, default=64, help="the prompt's image side in pixels (default 64)")
    ap.add_argument("--batch", type=int, default=1, help="the prompt's batch (default 1)")
    ap.add_argument("--steps", type=int, default=4, help="KSampler steps (default 4)")
    ap.add_argument("--model", choices=("sd15", "flux"), default="sd15",
                    help="sd15: the random SD1.5 checkpoint (default); flux: a Flux.1 dev-architecture model at "
                         "its real width with one double and one single block, through UNETLoader at cfg 1 "
                         "(built beside the checkpoint once, about 1 GB)")
    ap.add_argument("--range", default="",
                    help="the range row's Warmup Shapes, model batches (CFG doubles the image batch; default: "
                         "images of batch 1-2 across 64-128 px: 2x64x64, 4x128x128, with --model flux "
                         "1x64x64, 2x128x128)")
    ap.add_argument("--checkpoint-dir", default=os.environ.get("UNET_COMPILER_TEST_CACHE")
                    or str(Path.home() / ".cache" / "unet-compiler"),
                    help="where the random SD1.5 checkpoint is kept (built there once)")
    ap.add_argument("--work", default="", help="folder for the servers' folders (default: a fresh temp folder)")
    ap.add_argument("--out", default="", help="write the rows as JSON into this folder (e.g. docs)")
    ap.add_argument("--rows", choices=("all", "starts", "restart", "session"), default="all",
                    help="'starts': every start row, no session table; 'restart': only eager, the one-shape row "
                         "and its restart (about 6 minutes, for development); 'session': only the session table; "
                         "the README's tables are from all rows")
    a = ap.parse_args(argv)
    a.range = a.range or ("1x64x64, 2x128x128" if a.model == "flux" else "2x64x64, 4x128x128")
    if a.rows not in ("all", "starts") and a.out:
        ap.error("--out writes the README's table: run every start row for it (--rows all or starts)")
    S.comfyui_or_fail()
    if not a.work:
        a.work = tempfile.mkdtemp(prefix="unet_compiler_starts_")
    rows = measure(a) if a.rows != "session" else []
    session = []
    if a.rows in ("all", "session"):
        session = measure_session(a, Path(a.work), S.checkpoint_path(Path(a.checkpoint_dir).expanduser()))
    import torch
    what = "random SD1.5" if a.model == "sd15" else "random Flux.1 dev architecture (width 3072, 1+1 blocks), cfg 1"
    print(f"\nstarts: ComfyUI server, {what}, {a.batch}x{a.px}x{a.px}, {a.steps} euler steps, "
          f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    if rows:
        print(table(rows))
        print("compile overhead = (first - second prompt) - the same for eager; vs its cold row: each restart "
              "against the row it restarts, the second worker against the one-shape row")
        print(baseline_line(rows))
    if session:
        print(f"\nsession: wall time from the first prompt's start to images {', '.join(map(str, SESSION_IMAGES))} "
              f"({max(SESSION_IMAGES)} prompts queued at once, a new seed each)")
        print(session_table(session))
    if a.out:
        out = Path(a.out) / f"starts_{a.model}_{'cuda' if torch.cuda.is_available() else 'cpu'}_{a.px}px.json"
        out.write_text(json.dumps({"args": {k: v for k, v in vars(a).items()}, "torch": torch.__version__,
                                   "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                                   "baseline": baseline_line(rows), "rows": [asdict(r) for r in rows],
                                   "session": [asdict(r) for r in session]}, indent=1))
        print(f"wrote {out}")
