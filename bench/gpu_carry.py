"""What the GPU check carries to a lent machine, made here: ``python -m unet_compiler.bench gpu --prepare``.

- ``.gpu/whl``: the wheels the GPU image lacks (``WHEELS``: diffusers and comfy-aimdo at the versions
  installed here, and what of diffusers' own needs the image lacks), downloaded with ``pip download
  --no-deps --only-binary=:all:`` for the image's Python (3.12) and Linux x86-64;
- ``.gpu/comfy``: the ComfyUI tree at ``COMFYUI_PATH`` (else ~/comfy/ComfyUI), trimmed to what the
  steps import (``KEEP``: its top-level modules and the packages below, their code and data files;
  no .git, models, user files, web front end, tests).

Then the trimmed tree is checked by ``bench dynamic --imports-only`` in a fresh process here, and
the carry is sized against the runner's 64 MiB (``gpu.carry_lines``). Nothing of ComfyUI is fetched:
the tree must be here already (DEVELOPERS.md, "GPU").
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

#: distributions the GPU image lacks (docs: the device library's KINDS.md package list), by version here
WHEELS = ("diffusers", "comfy-aimdo", "importlib-metadata")
#: the image's interpreter and platform tags (the device library's README.md: pip download for it)
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
#: what of a ComfyUI tree the steps import: its top-level .py files and these packages
KEEP = ("comfy", "comfy_api", "comfy_execution", "comfy_config", "comfy_extras", "app", "utils")
#: file kinds kept in them (code and the tokenizers' and configs' data files)
KEEP_SUFFIXES = (".py", ".json", ".txt", ".yaml", ".yml", ".model")


def download_command(dest: Path, python: str = PYTHON) -> list[str]:
    """The ``pip download`` of ``WHEELS`` at the versions installed here (those not installed left
    out) for ``python`` on Linux x86-64, into ``dest``."""
    pins = []
    for name in WHEELS:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            python, "--implementation", "cp", *platforms, "-d", str(dest), *pins]


def trim_tree(src: Path, dest: Path) -> int:
    """Copy of ComfyUI tree ``src`` at ``dest`` (made anew) holding its top-level .py files and
    ``KEEP``'s packages' ``KEEP_SUFFIXES`` files, no caches. Returns the bytes copied."""
    if not (src / "main.py").is_file():
        raise FileNotFoundError(f"no ComfyUI tree at {src} (its main.py): set COMFYUI_PATH to one")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    copied = 0

    def copy(path: Path) -> None:
        nonlocal copied
        target = dest / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        copied += path.stat().st_size
    for path in sorted(src.glob("*.py")):
        copy(path)
    for name in KEEP:
        for root, dirs, files in os.walk(src / name):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            for f in sorted(files):
                if f.endswith(KEEP_SUFFIXES):
                    copy(Path(root) / f)
    return copied


def prepare(root: Path, python: str = PYTHON) -> list[str]:
    """``.gpu/whl`` and ``.gpu/comfy`` under checkout ``root``; the trimmed tree's import check.
    Returns what it did, a line each (a failed step raises, naming it)."""
    out = []
    whl = root / ".gpu" / "whl"
    if whl.exists():
        shutil.rmtree(whl)
    whl.mkdir(parents=True)
    cmd = download_command(whl, python)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"pip download failed ({r.returncode}): {' '.join(cmd[3:])}\n{r.stderr[-2000:]}")
    out.append(f"wheels for Python {python}: " + ", ".join(sorted(p.name for p in whl.glob("*.whl"))))
    from ..tests._families import COMFY_NOT_FOUND, comfy_path
    src = comfy_path()     # (the tests' own lookup: COMFYUI_PATH, else ~/comfy/ComfyUI)
    if src is None:
        raise FileNotFoundError(COMFY_NOT_FOUND)
    tree = root / ".gpu" / "comfy"
    n = trim_tree(src, tree)
    out.append(f"ComfyUI tree from {src}: {n / 2**20:.1f} MiB at {tree.relative_to(root)}")
    env = {**os.environ, "COMFYUI_PATH": str(tree)}
    r = subprocess.run([sys.executable, "-m", "unet_compiler.bench", "dynamic", "--imports-only", "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=300)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    if r.returncode != 0:
        raise RuntimeError(f"the trimmed tree does not import what the steps need: {r.stderr[-2000:]}")
    out.append(f"imports from the trimmed tree: {last}")
    return out
