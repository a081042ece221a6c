"""ComfyUI's own smoke test: ``main.py --quick-test-for-ci --cpu`` imports
every node (this pack included, through --extra-model-paths-config; no other
custom node: ``only_these_custom_nodes``) and exits. It exits 0 even when a
custom node fails to import, so the log is what is checked."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unet_compiler.bench.comfy_server import link, only_these_custom_nodes, subprocess_env

pytestmark = pytest.mark.e2e

PACK_ROOT = Path(__file__).resolve().parents[2]


def test_quick_test_for_ci_imports_the_pack(comfyui_path, tmp_path):
    custom_nodes = tmp_path / "custom_nodes"
    custom_nodes.mkdir()
    pack = custom_nodes / "unet-compiler"
    link(pack, PACK_ROOT)
    dirs = {name: tmp_path / name for name in ("output", "input", "temp", "user")}
    for d in dirs.values():
        d.mkdir()
    yaml_path = tmp_path / "extra_model_paths.yaml"
    yaml_path.write_text(f"unet_compiler_quick_test:\n    base_path: {json.dumps(str(tmp_path))}\n"
                         f"    custom_nodes: {json.dumps(str(custom_nodes))}\n")
    cmd = [sys.executable, "main.py", "--quick-test-for-ci", "--cpu",
           "--extra-model-paths-config", str(yaml_path), *only_these_custom_nodes(comfyui_path, tmp_path, [pack.name]),
           "--database-url", "sqlite:///:memory:",
           "--output-directory", str(dirs["output"]), "--input-directory", str(dirs["input"]),
           "--temp-directory", str(dirs["temp"]), "--user-directory", str(dirs["user"]),
           "--disable-api-nodes", "--log-stdout"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=str(comfyui_path), capture_output=True, text=True, timeout=600,
                          env=subprocess_env())
    log = proc.stdout + proc.stderr
    print(f"\n[e2e] --quick-test-for-ci: rc {proc.returncode} in {time.time() - t0:.1f} s")
    assert proc.returncode == 0, f"ComfyUI --quick-test-for-ci failed (rc {proc.returncode}):\n{log[-6000:]}"

    key = str(pack)
    mentions = [line for line in log.splitlines() if key in line]
    bad = [line for line in mentions
           if "IMPORT FAILED" in line or line.startswith(("Cannot import", "Error while calling", "Skip "))
           or "did not return" in line or "is not callable" in line]
    assert not bad, "ComfyUI could not load the pack:\n" + "\n".join(bad) + "\n\nlog tail:\n" + log[-6000:]
    timing = [line for line in mentions if "seconds:" in line]
    assert timing, ("the pack never shows in ComfyUI's 'Import times for custom nodes' list; log tail:\n"
                    + log[-6000:])
    # a traceback through the pack's files (e.g. a warning logged with exc_info at import)
    frames = [line for line in log.splitlines() if line.strip().startswith('File "')
              and (key in line or str(PACK_ROOT) in line)]
    assert not frames, "traceback through the pack while ComfyUI imported it:\n" + log[-6000:]
