"""Issue 11's soak through a real ComfyUI server (``unet_compiler.bench.soak.run``, the code of
``python -m unet_compiler.bench soak``): after Warmup Shapes of a range, prompts with a random batch
(1-4), width and height (64 or 128 px) and LoRA strength, the LoRA after the pack's nodes: none
fails, none recompiles or falls back, the server's resident memory stays flat, and sampled prompts
equal the same prompt without the pack.

CI runs 8 prompts on the session's server (one ComfyUI process in memory at a time: each holds
SD1.5 in fp32); ``UNET_COMPILER_SOAK_PROMPTS=200`` runs the full soak. The README's numbers come
from ``python -m unet_compiler.bench soak --prompts 200 --out docs`` (a server of its own)."""
from __future__ import annotations

import os

from unet_compiler.bench import soak


def test_soak_after_a_range_warmup(comfy_server, sd15_checkpoint, patch_assets):
    prompts = int(os.environ.get("UNET_COMPILER_SOAK_PROMPTS", "8"))
    result = soak.run(comfy_server, sd15_checkpoint.name, patch_assets["lora"], prompts,
                      check_every=max(prompts // 2, 1), log=lambda m: print("\n[soak] " + m))
    summary = result.summary()
    print(f"\n[soak] {summary}")
    assert "warmed 1x64x64" in result.warmup_report and "4x128x128" in result.warmup_report, result.warmup_report
    assert summary["prompts"] == prompts and summary["eager_checks"] >= 3, summary
    assert summary["distinct_shapes"] >= min(prompts // 2, 8), summary   # the prompts did vary
    assert not result.problems(), "\n".join(result.problems())
