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
    assert names == ["comfy_imports", "probe_alloc", "dynamic_sd15", "dynamic_sdxl", "tests", "probe_prompt_async",
                     "probe_prompt", "probe_choice", "bench_sd15", "bench_sdxl_kernels"]
    caps = dict(G.plan(470))
    assert caps["comfy_imports"] == 30 and caps["probe_alloc"] == 150 and caps["dynamic_sd15"] == 160
    assert caps["dynamic_sdxl"] >= 100                       # its minimum, even if every step before used its cap
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


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, gone but not yet reaped, does not)."""
    import os
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


@pytest.mark.skipif(sys.platform == "win32", reason="process groups: POSIX")
def test_a_step_ends_with_everything_it_started(tmp_path):
    """A capped step's command is ended with its children (``bench dynamic``'s measuring process, a
    probe's stage): none runs on into the next steps; one that ends on time but left a child running
    has it killed, and the summary says so."""
    import time
    check = G.Check(tmp_path, budget=60)
    spawn = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
             "print('child', p.pid, flush=True); time.sleep({})")
    for name, sleep, rc in (("capped", 120, 124), ("leaves", 0, 0)):
        step = G.Step(name, 3, 1, [[sys.executable, "-c", spawn.format(sleep)]], [r"^child"])
        t0 = time.monotonic()
        assert check.run(step) == rc and time.monotonic() - t0 < 15
        pid = int((tmp_path / f"{name}.log").read_text().split()[1])
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"{name}: its child {pid} still runs"
    assert "== leaves: rc=0" in (tmp_path / "summary.txt").read_text()
    assert "1 process(es) it left running killed" in (tmp_path / "summary.txt").read_text()


def test_a_failed_import_check_skips_the_steps_after_it(tmp_path):
    check = G.Check(tmp_path, budget=60)
    gate = G.Step("gate", 5, 1, [[sys.executable, "-c", "raise ImportError('No module named av')"]], [r"Error"])
    after = G.Step("after", 5, 1, [[sys.executable, "-c", "print('never')"]], after=("gate",))
    unrelated = G.Step("unrelated", 5, 1, [[sys.executable, "-c", "print('ran')"]], [r"ran"], after=("not_run",))
    assert check.run(gate) == 1 and check.run(after) is None and check.run(unrelated) == 0
    text = (tmp_path / "summary.txt").read_text()
    assert "ImportError: No module named av" in text and "== after: skipped, gate failed" in text
    assert not (tmp_path / "after.log").exists()


def test_the_env_line_is_capped(tmp_path, monkeypatch):
    import subprocess
    check = G.Check(tmp_path, budget=60)

    def slow(*args, **kwargs):
        assert kwargs.get("timeout") == G.ENV_TIMEOUT_S
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])
    monkeypatch.setattr(G.subprocess, "run", slow)
    monkeypatch.setattr(G, "_which", lambda cmd: True)
    check.env_line()
    text = (tmp_path / "summary.txt").read_text()
    assert "did not answer in 60 s" in text and "nvidia-smi did not answer" in text


def test_the_dry_run_sizes_what_the_call_carries(tmp_path):
    whl = tmp_path / ".gpu" / "whl"
    whl.mkdir(parents=True)
    (whl / "diffusers-0.36.0-py3-none-any.whl").write_bytes(b"x" * (3 << 20))
    (tmp_path / ".gpu" / "comfy").mkdir()
    (tmp_path / ".gpu" / "comfy" / "main.py").write_text("")
    lines = G.carry_lines(tmp_path)
    assert lines[0].startswith("carry .gpu/whl") and "3.0 MiB" in lines[0]
    assert "carry total     3.0 MiB of 64 MiB; not in it: comfy-aimdo wheel" == lines[-1]
    with open(whl / "comfy_aimdo-0.6.0-cp311-cp311-manylinux_2_17_x86_64.whl", "wb") as f:
        f.truncate(62 << 20)
    assert G.carry_lines(tmp_path)[-1] == "carry total    65.0 MiB of 64 MiB: OVER the limit"
    nothing = G.carry_lines(tmp_path / "elsewhere")
    assert "missing here" in nothing[0] and nothing[-1].endswith(
        "not in it: comfy-aimdo wheel, diffusers wheel, a ComfyUI tree (its main.py)")


def test_the_alloc_probe_runs_cudamallocasync_first_and_says_what_failed(monkeypatch, capsys):
    """The allocator probe's order (cudaMallocAsync, ComfyUI's default, before the native allocator;
    per allocator the stages issue 59 asks about first), a stage's last exception line, a stage
    ended at its timeout, and stages reported as not run once the probe's budget is spent."""
    import json
    import time

    from unet_compiler.bench import gpu_probes as P  # noqa: N812
    script = {"pointer": "print('RESULT {\"cu_pointer_status_inside\": 1}')",
              "launch": "import sys; sys.stderr.write('Traceback (most recent call last):\\n  File x\\n"
                        "RuntimeError: graph capture failed\\nwarning after it\\n'); sys.exit(1)",
              "pack": "import time; time.sleep(30)"}
    monkeypatch.setattr(P, "stage_command", lambda name: [sys.executable, "-c", script.get(name, "print('RESULT {}')")])
    monkeypatch.setattr(P, "STAGE_TIMEOUT_S", 2)
    monkeypatch.setattr(P, "STAGE_MIN_S", 1)
    t0 = time.monotonic()
    P.alloc(cap=10)
    assert time.monotonic() - t0 < 30
    rows = [json.loads(ln[6:]) for ln in capsys.readouterr().out.splitlines() if ln.startswith("PROBE ")]
    order = [(r["allocator"], r["stage"]) for r in rows]
    assert order[:5] == [("backend:cudaMallocAsync", s) for s in ("pointer", "launch", "pack", "jit", "pack_jit")]
    assert order[5:] == [("native", s) for s in ("pointer", "launch", "pack", "jit", "pack_jit")]
    assert rows[0]["result"] == {"cu_pointer_status_inside": 1}
    assert rows[1]["rc"] == 1 and rows[1]["error"] == "RuntimeError: graph capture failed"
    assert rows[2]["rc"] == "timeout" and rows[2]["error"] == "timeout after 2 s"
    assert rows[-1]["rc"] == "not run"


def test_a_sigterm_to_the_check_ends_the_running_step_whole(tmp_path):
    """The runner's own limit (a SIGTERM to ``bench gpu``) while a step runs: the check exits through
    its cleanup, ending the step's process group. Before, the steps' own sessions outlived it."""
    import os
    import signal
    import subprocess
    import time
    script = (
        "import sys\n"
        "from unet_compiler.bench import gpu as G\n"
        "spawn = ('import subprocess, sys, time; p = subprocess.Popen([sys.executable, \"-c\", \"import time; "
        "time.sleep(120)\"]); print(\"child\", p.pid, flush=True); time.sleep(120)')\n"
        "G.steps = lambda: [G.Step('sleepy', 60, 1, [[sys.executable, '-c', spawn]], [r'^child'])]\n"
        "G.Check.env_line = lambda self: None\n"
        "G.Check.comfy_stubs = lambda self: None\n"
        f"sys.exit(G.main(['--out', {str(tmp_path)!r}, '--budget', '90']))\n")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    check = subprocess.Popen([sys.executable, "-c", script], env=env)
    log, deadline = tmp_path / "sleepy.log", time.monotonic() + 60
    while not (log.exists() and "child" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = int(log.read_text().split()[1])
    check.send_signal(signal.SIGTERM)
    assert check.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"the step's child {pid} outlived the check"


def test_the_carry_is_made_here_trimmed_and_pinned(tmp_path, monkeypatch):
    """``bench gpu --prepare``'s parts: a ComfyUI tree trimmed to its top-level modules and the
    packages the steps import (code and data files; no .git, models, front end, tests or caches),
    a tree without main.py refused with the variable to set; the wheels pinned at the versions
    installed here, for the image's Python, binary only, no dependencies pulled."""
    from unet_compiler.bench import gpu_carry as C  # noqa: N812
    src = tmp_path / "ComfyUI"
    files = {"main.py": "x", "nodes.py": "x", "comfy/ops.py": "x", "comfy/sd1_tokenizer/vocab.json": "{}",
             "comfy/__pycache__/ops.cpython-311.pyc": "x", "comfy_api/torch_helpers/__init__.py": "x",
             "models/checkpoints/a.safetensors": "x", "web/index.html": "x", ".git/HEAD": "x",
             "tests/test_x.py": "x", "comfy/weights.bin": "x", "custom_nodes/pack/__init__.py": "x"}
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    dest = tmp_path / "out"
    assert C.trim_tree(src, dest) > 0
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == ["comfy/ops.py", "comfy/sd1_tokenizer/vocab.json", "comfy_api/torch_helpers/__init__.py",
                    "main.py", "nodes.py"]
    (src / "main.py").unlink()
    with pytest.raises(FileNotFoundError, match="COMFYUI_PATH"):
        C.trim_tree(src, dest)
    cmd = C.download_command(tmp_path / "whl")
    from importlib.metadata import version
    assert f"diffusers=={version('diffusers')}" in cmd
    assert {"--no-deps", "--only-binary=:all:", "manylinux_2_17_x86_64"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    monkeypatch.setattr(C, "WHEELS", ("diffusers", "no-such-distribution"))
    assert not any(a.startswith("no-such-distribution") for a in C.download_command(tmp_path / "whl"))
