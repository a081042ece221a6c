"""The GPU check (``python -m unet_compiler.bench gpu``, bench/gpu.py) on a machine without a GPU:
its plan under a budget, a step capped and killed, a step skipped for want of time, the summary
written as each step ends, and the probes' clear refusal without CUDA. Its real run is on a GPU
machine (docs/gpu.md)."""
from __future__ import annotations

import sys

import pytest

from unet_compiler.bench import gpu as G  # noqa: N812


def test_the_plan_puts_steps_in_priority_order_within_the_budget():
    names = [name for name, _ in G.plan(470)]
    assert names == ["probe_alloc", "dynamic_sd15", "dynamic_sdxl", "tests", "probe_prompt_async", "probe_prompt",
                     "probe_choice", "bench_sd15", "bench_sdxl_kernels"]
    caps = dict(G.plan(470))
    assert caps["probe_alloc"] == 150 and caps["dynamic_sd15"] == 160 and caps["dynamic_sdxl"] == 150
    assert sum(caps.values()) <= 470 - 10
    assert caps["tests"] == 0 and caps["bench_sd15"] == 0 and caps["bench_sdxl_kernels"] == 0   # left out
    assert dict(G.plan(240, {"tests", "bench_sd15"})) == {"tests": 190, "bench_sd15": 0}   # too little left
    assert dict(G.plan(250, {"bench_sd15"})) == {"bench_sd15": 200}


def test_steps_are_capped_skipped_and_summarised_as_they_end(tmp_path, monkeypatch):
    check = G.Check(tmp_path, budget=16)
    quick = G.Step("quick", 5, 1, [[sys.executable, "-c", "print('kept line'); print('other')"]], [r"^kept"])
    assert check.run(quick) == 0
    text = (tmp_path / "summary.txt").read_text()
    assert "== quick: rc=0" in text and "   kept line" in text and "other" not in text   # written as it ended
    slow = G.Step("slow", 2, 1, [[sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
                                 [sys.executable, "-c", "print('second')"]], [r"started|second"])
    assert check.run(slow) == 124          # killed at its cap, the other command's log kept too
    assert (tmp_path / "slow.log").read_text().startswith("started") and (tmp_path / "slow.2.log").exists()
    late = G.Step("late", 60, 30, [[sys.executable, "-c", "print('never')"]])
    assert check.run(late) is None
    envd = G.Step("envd", 5, 1, [[sys.executable, "-c", "import os; print('conf', os.environ['PYTORCH_CUDA_ALLOC_CONF'])"]],
                  [r"^conf"], {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert check.run(envd) == 0 and "conf backend:cudaMallocAsync" in (tmp_path / "envd.log").read_text()
    assert "== late: skipped" in (tmp_path / "summary.txt").read_text() and not (tmp_path / "late.log").exists()
    check.env["COMFYUI_PATH"] = str(tmp_path / "no-comfyui")
    lacking = G.Step("lacking", 5, 1, [[sys.executable, "-c", "print('never')"]], needs=("ComfyUI tree",))
    assert check.run(lacking) is None and not (tmp_path / "lacking.log").exists()
    assert "== lacking: skipped, ComfyUI tree missing here" in (tmp_path / "summary.txt").read_text()


def test_the_command_line(capsys):
    from unet_compiler.bench.__main__ import main
    assert main(["gpu", "--dry-run", "--budget", "200", "--only", "tests,bench_sd15"]) == 0
    out = capsys.readouterr().out
    assert "tests                cap 190 s; needs pytest, diffusers" in out
    assert "bench_sd15           skipped (budget); needs diffusers" in out
    with pytest.raises(SystemExit):
        main(["gpu", "--only", "bogus"])
    assert "no step bogus" in capsys.readouterr().err


def test_the_probes_say_they_need_a_gpu(capsys):
    import torch
    from unet_compiler.bench import gpu_probes
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probes run (the gpu check's own steps)")
    assert gpu_probes.main(["choice"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().out
