"""Soak through a real ComfyUI server: ``python -m unet_compiler.bench soak [--prompts 200]``.

One ComfyUI process (``comfy_server.start_server``, ``--cpu`` unless CUDA is there) runs, on the
random-weight SD1.5 checkpoint and its random LoRA (no downloads):

1. a warmup prompt: CheckpointLoader -> Compile UNet -> Warmup Shapes of a range (default
   ``1x64x64, 4x128x128``) -> LoraLoaderModelOnly -> KSampler -> VAE decode -> preview, at the
   range's largest shape;
2. ``--prompts`` more, each with a random image batch (1-4), width and height (multiples of 64
   inside the range) and LoRA strength, cfg 1 (so the UNet batch is the image batch), 2 euler
   steps. ComfyUI reuses the Compile UNet / Warmup Shapes outputs: only the LoRA loader, KSampler
   and the decode run again, as when a user changes those widgets;
3. every ``--check-every``-th prompt (and the first and last) again without the pack's nodes: its
   latent must equal the compiled one (relative L2 within the e2e parity tolerance).

Counted: prompts that failed, recompiles and run-time fallbacks (the pack's ``recompile`` /
``fallback`` events in each prompt's ``/history``, and "compiled after warmup" in the server log),
and the server's resident memory after each prompt: its growth from the baseline prompt (20, or the
middle of a run shorter than 40) to the last. The baseline waits that long because the first prompts
each meet shapes the process has not run yet, and the allocator's high-water mark and oneDNN's
per-shape primitives grow with them once (a 20-prompt CI run stepped +6 % by prompt 10, then held
flat to prompt 20); a leak that matters here -- a model, weight or compiled-graph copy kept per
prompt -- is gigabytes, far past the limit over any half of a run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import comfy_server as S

#: the e2e parity tolerance (tests/e2e/test_comfyui_server.py MAX_LATENT_REL_L2)
MAX_LATENT_REL_L2 = 1e-3
MAX_RSS_GROWTH = 0.05
STEPS = 2


@dataclass
class SoakPrompt:
    index: int          # 0 = the warmup prompt
    batch: int
    width: int
    height: int
    lora_strength: float
    seconds: float
    rss_mib: float
    ok: bool = True
    events: list = field(default_factory=list)    # the pack's recompile / fallback events in its /history
    eager_rel_l2: float | None = None              # against the same prompt without the pack's nodes
    error: str = ""


@dataclass
class SoakResult:
    shapes: str
    prompts: list
    baseline_index: int
    warmup_report: str = ""
    log_recompiles: int = 0
    machine: dict = field(default_factory=dict)

    @property
    def soaked(self) -> list:
        return [p for p in self.prompts if p.index > 0]

    @property
    def failed(self) -> list:
        return [p for p in self.prompts if not p.ok]

    @property
    def recompiles(self) -> int:
        return sum(1 for p in self.soaked for e in p.events if e["name"] == "unet_compiler.recompile")

    @property
    def fallbacks(self) -> int:
        return sum(1 for p in self.prompts for e in p.events if e["name"] == "unet_compiler.fallback")

    @property
    def rss_growth(self) -> float:
        base = next(p.rss_mib for p in self.prompts if p.index == self.baseline_index)
        return (self.prompts[-1].rss_mib - base) / base

    @property
    def worst_rel_l2(self) -> float:
        checked = [p.eager_rel_l2 for p in self.prompts if p.eager_rel_l2 is not None]
        return max(checked) if checked else float("nan")

    def summary(self) -> dict:
        soaked = self.soaked
        return {
            "prompts": len(soaked), "failed": len(self.failed), "recompiles_after_warmup": self.recompiles,
            "recompiles_in_log": self.log_recompiles, "fallbacks": self.fallbacks,
            "rss_mib_baseline": next(p.rss_mib for p in self.prompts if p.index == self.baseline_index),
            "baseline_prompt": self.baseline_index, "rss_mib_last": self.prompts[-1].rss_mib,
            "rss_growth_pct": round(100 * self.rss_growth, 2),
            "eager_checks": sum(p.eager_rel_l2 is not None for p in self.prompts),
            "worst_latent_rel_l2": self.worst_rel_l2,
            "warmup_prompt_s": self.prompts[0].seconds,
            "mean_prompt_s": sum(p.seconds for p in soaked) / max(len(soaked), 1),
            "distinct_shapes": len({(p.batch, p.width, p.height) for p in soaked}),
        }

    def problems(self) -> list[str]:
        """What breaks the soak's promises, in words (empty: it held)."""
        out = [f"prompt {p.index} ({p.batch}x{p.width}x{p.height}, LoRA {p.lora_strength}) failed: {p.error}"
               for p in self.failed]
        if self.recompiles or self.log_recompiles:
            shapes = [e.get("shape") for p in self.soaked for e in p.events if e["name"] == "unet_compiler.recompile"]
            out.append(f"{self.recompiles} recompile event(s) after warmup (shapes {shapes}), "
                       f"{self.log_recompiles} 'compiled after warmup' line(s) in the server log")
        if self.fallbacks:
            out.append(f"{self.fallbacks} run-time fallback event(s): "
                       + "; ".join(e.get("text", "") for p in self.prompts for e in p.events
                                   if e["name"] == "unet_compiler.fallback")[:2000])
        if self.rss_growth >= MAX_RSS_GROWTH:
            out.append(f"resident memory grew {100 * self.rss_growth:.1f} % from prompt {self.baseline_index} "
                       f"to the last (limit {100 * MAX_RSS_GROWTH:.0f} %)")
        bad = [(p.index, p.eager_rel_l2) for p in self.prompts
               if p.eager_rel_l2 is not None and not p.eager_rel_l2 <= MAX_LATENT_REL_L2]
        if bad:
            out.append(f"latent differs from the same prompt without the pack (index, relative L2): {bad}")
        return out


def workflow(ckpt: str, lora: str, batch: int, width: int, height: int, strength: float, seed: int,
             shapes: str, prefix: str, compiled: bool = True) -> dict:
    """txt2img with a LoRA after the pack's nodes, cfg 1, SaveLatent. ``compiled`` False: the LoRA
    on the loader's MODEL; the pack's nodes stay in the prompt, unconnected, so ComfyUI neither runs
    them nor drops their cached outputs (the next compiled prompt warms nothing again)."""
    p = S.txt2img(ckpt, width, height, batch, STEPS, 1.0, seed, latent_prefix=prefix)
    p["11"] = {"class_type": "UNetCompiler_CompileUNet", "inputs": {"model": ["1", 0]}}
    p["12"] = {"class_type": "UNetCompiler_WarmupShapes",
               "inputs": {"model": ["11", 0], "shapes": shapes, "context_tokens": 77, "background": False}}
    p["13"] = {"class_type": "LoraLoaderModelOnly",
               "inputs": {"model": ["12", 0] if compiled else ["1", 0], "lora_name": lora, "strength_model": strength}}
    p["5"]["inputs"]["model"] = ["13", 0]
    return p


def _rss_mib(pid: int) -> float:
    import psutil   # ComfyUI's own requirement
    return psutil.Process(pid).memory_info().rss / 2**20


def _range(shapes: str):
    from ..compiler.shapes import parse_shapes
    parsed = parse_shapes(shapes)
    return (min(s.batch for s in parsed), max(s.batch for s in parsed),
            min(min(s.width, s.height) for s in parsed), max(max(s.width, s.height) for s in parsed))


def baseline_prompt(prompts: int) -> int:
    """The prompt whose resident memory the growth is measured from (see the module's docstring)."""
    return 20 if prompts >= 40 else max(prompts // 2, 1)


def run(server: S.ComfyServer, ckpt: str, lora: str, prompts: int, shapes: str = "1x64x64, 4x128x128",
        check_every: int = 10, seed: int = 0, log=print) -> SoakResult:
    """The soak on a running ``server`` (see the module's docstring)."""
    b_lo, b_hi, px_lo, px_hi = _range(shapes)
    sides = list(range(-(-px_lo // 64) * 64, px_hi + 1, 64))
    rng = random.Random(seed)
    plan = [(b_hi, sides[-1], sides[-1], 1.0)]          # the warmup prompt: the largest shape
    plan += [(rng.randint(max(b_lo, 1), min(b_hi, 4)), rng.choice(sides), rng.choice(sides),
              round(rng.uniform(-1.0, 1.5), 2)) for _ in range(prompts)]
    checks = {1, prompts} | set(range(check_every, prompts + 1, check_every)) if check_every else set()
    result = SoakResult(shapes, [], baseline_prompt(prompts))
    log_start = server.log_path.stat().st_size   # a shared server's earlier lines are not the soak's
    for i, (batch, w, h, strength) in enumerate(plan):
        t0 = time.perf_counter()
        rec = SoakPrompt(i, batch, w, h, strength, 0.0, 0.0)
        try:
            entry = server.run_prompt(workflow(ckpt, lora, batch, w, h, strength, i, shapes, f"soak_{i}"),
                                      timeout=3600)
        except S.PromptFailed as e:
            rec.ok, rec.error, entry = False, str(e)[:2000], None
        rec.seconds = time.perf_counter() - t0
        rec.rss_mib = _rss_mib(server.process.pid)
        if entry is not None:
            messages = (entry.get("status") or {}).get("messages") or []
            rec.events = [dict(d, name=n) for n, d in messages
                          if n in ("unet_compiler.recompile", "unet_compiler.fallback")]
            if i == 0:
                text = ((entry.get("outputs") or {}).get("12") or {}).get("text") or ""
                result.warmup_report = "\n".join(map(str, text)) if isinstance(text, list) else str(text)
            if i in checks:
                eager = server.run_prompt(workflow(ckpt, lora, batch, w, h, strength, i, shapes, f"soak_{i}_eager",
                                                   compiled=False),
                                          timeout=3600)
                rec.eager_rel_l2 = S.relative_l2(S.saved_latent(server, entry), S.saved_latent(server, eager))
        result.prompts.append(rec)
        if log and (i < 3 or i % 10 == 0 or i == prompts or not rec.ok or rec.events):
            log(f"  prompt {i}: {batch}x{w}x{h}, LoRA {strength:+.2f}: {rec.seconds:.1f} s, RSS {rec.rss_mib:.0f} MiB"
                + ("" if rec.ok else " FAILED") + (f", events {[e['name'] for e in rec.events]}" if rec.events else "")
                + (f", vs eager rel L2 {rec.eager_rel_l2:.1e}" if rec.eager_rel_l2 is not None else ""))
    with open(server.log_path, "rb") as f:
        f.seek(log_start)
        result.log_recompiles = f.read().decode(errors="replace").count("compiled after warmup")
    return result


def soak(root: Path, ckpt: Path, prompts: int, shapes: str = "1x64x64, 4x128x128", check_every: int = 10,
         seed: int = 0, env: dict | None = None, log=print) -> SoakResult:
    """Start a ComfyUI server under ``root`` with the checkpoint and its random LoRA, run the soak, stop it."""
    import torch
    lora = S.patch_assets(ckpt, log=log)["lora"]
    server = S.start_server(root, ckpt.parent, env=env, log=log, cpu=not torch.cuda.is_available())
    try:
        S.link(server.model_dirs["loras"] / lora.name, lora)
        result = run(server, ckpt.name, lora.name, prompts, shapes, check_every, seed, log)
    finally:
        server.stop()
    result.machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m unet_compiler.bench soak",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200, help="prompts after the warmup prompt (default 200)")
    ap.add_argument("--range", default="1x64x64, 4x128x128", help="Warmup Shapes' entries (default: %(default)s)")
    ap.add_argument("--check-every", type=int, default=20,
                    help="compare every Nth prompt (and the first and last) with eager (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=os.environ.get("UNET_COMPILER_TEST_CACHE")
                    or str(Path.home() / ".cache" / "unet-compiler"),
                    help="where the random checkpoint and LoRA are kept (built there once)")
    ap.add_argument("--work", default="", help="the server's folder (default: a fresh temp folder)")
    ap.add_argument("--out", default="", help="write the result as JSON into this folder (e.g. docs)")
    args = ap.parse_args(argv)
    ckpt = S.checkpoint_path(Path(args.checkpoint_dir).expanduser())
    root = Path(args.work or tempfile.mkdtemp(prefix="unet_compiler_soak_")) / "server"
    print(f"soak: {args.prompts} prompts after warming {args.range}; server folder {root}")
    result = soak(root, ckpt, args.prompts, args.range, args.check_every, args.seed)
    summary = result.summary()
    print(json.dumps(summary, indent=1))
    problems = result.problems()
    print("soak: held" if not problems else "soak: FAILED\n  " + "\n  ".join(problems))
    if args.out:
        out = Path(args.out) / f"soak_sd15_{'cuda' if 'cpu' != result.machine['device'] else 'cpu'}.json"
        out.write_text(json.dumps({"summary": summary, "problems": problems, "machine": result.machine,
                                   "shapes": result.shapes, "warmup_report": result.warmup_report,
                                   "prompts": [asdict(p) for p in result.prompts]}, indent=1))
        print(f"wrote {out}")
    return 0 if not problems else 1
