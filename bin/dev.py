"""The development env and the README's two commands, with no shell (Windows included):

    python bin/dev.py setup [--if-missing] [--dry-run] [ENV]   make or update the env
    python bin/dev.py test [--full | --all] [PYTEST ARGS]       the tests (python -m pytest -q ...): the
                                                                quick lane; --full the full lane, --all both
    python bin/dev.py bench [BENCH ARGS]                        the main job (python -m unet_compiler.bench run ...)
    <env python> bin/dev.py torchvision-cpu                     make that env's torchvision import beside CPU torch

ENV is the venv's folder, relative to the checkout (default ``$UNET_COMPILER_ENV``, else ``.venv``).
``test`` and ``bench`` first make it when it is not a complete env of this checkout, and reuse it
when it is. ``bin/setup``, ``bin/test`` and ``bin/bench`` are these commands for a POSIX shell.
The env: a venv with CPU torch pinned by ``constraints.txt``, this pack (editable) with its test
extras and, when a ComfyUI tree is found (``COMFYUI_PATH``, else ``~/comfy/ComfyUI``), ComfyUI's
requirements less its torch lines. Standard library only: it runs before any env exists.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: ComfyUI's requirements this env never takes from its list: torch stays the pinned CPU build,
#: torchaudio is not needed (its nodes log an import failure, harmless)
_TORCH_LINES = ("torch", "torchvision", "torchaudio")
#: a torchvision decorator that registers a fake for one of its C++ ops unconditionally
_UNGUARDED_FAKE = re.compile(r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$', re.M)

_COMPLETE = """
import importlib.util as u, os, sys
pack = u.find_spec("unet_compiler")
mine = pack is not None and os.path.realpath(os.path.dirname(pack.origin)) == os.path.realpath(sys.argv[1])
sys.exit(not (mine and all(map(u.find_spec, ("torch", "pytest", "diffusers", "comfy_aimdo")))))
"""


def env_dir(name: str | None = None) -> Path:
    """The env's folder: ``name``, else ``$UNET_COMPILER_ENV``, else ``.venv``; relative to the checkout."""
    return ROOT / (name or os.environ.get("UNET_COMPILER_ENV") or ".venv")


def env_python(env: Path, windows: bool = os.name == "nt") -> Path:
    """The venv's interpreter (``Scripts\\python.exe`` on Windows, ``bin/python`` elsewhere)."""
    return env / "Scripts" / "python.exe" if windows else env / "bin" / "python"


def comfy_tree() -> Path | None:
    """The ComfyUI tree whose requirements the env gets (``COMFYUI_PATH``, else ``~/comfy/ComfyUI``)."""
    tree = Path(os.environ.get("COMFYUI_PATH") or Path.home() / "comfy" / "ComfyUI")
    return tree if (tree / "main.py").is_file() and (tree / "requirements.txt").is_file() else None


def comfy_requirements(text: str) -> list[str]:
    """ComfyUI's requirement lines less torch, torchvision and torchaudio (and comments)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        name = line.split(";")[0].split("[")[0]
        for sep in "=<>!~ ":
            name = name.split(sep)[0]
        if line and not line.startswith("#") and name.lower() not in _TORCH_LINES:
            out.append(line)
    return out


def is_complete(env: Path, windows: bool = os.name == "nt") -> bool:
    """Whether ``env``'s python finds torch, pytest, diffusers and this checkout's unet_compiler."""
    py = env_python(env, windows)
    if not py.is_file():
        return False
    return subprocess.run([str(py), "-c", _COMPLETE, str(ROOT)], capture_output=True).returncode == 0


def setup_plan(env: Path, comfy: Path | None, windows: bool = os.name == "nt",
               python: str = sys.executable) -> list[list[str]]:
    """The commands that make or update ``env``, in order (every pip runs as the env's
    ``python -m pip``, pinned by constraints.txt). A ComfyUI tree adds its requirements, written to
    ``<env>/comfy-requirements.txt`` first by :func:`setup`."""
    py = str(env_python(env, windows))
    pip = [py, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt")]
    plan = [[python, "-m", "venv", str(env)],
            pip + ["torch==2.13.0"],
            pip + ["-e", f"{ROOT}[test]"]]
    if comfy is not None:
        plan.append(pip + ["-r", str(env / "comfy-requirements.txt"), "requests", "torchvision", "torchsde"])
        plan.append([py, str(ROOT / "bin" / "dev.py"), "torchvision-cpu"])
    return plan


def torchvision_cpu() -> int:
    """Make this interpreter's torchvision import beside a CPU torch. The registry's torchvision
    wheels for torch 2.13 are CUDA builds: their C++ ops cannot load beside CPU torch, which
    torchvision copes with (``extension._has_ops()`` is False) except in ``_meta_registrations.py``,
    where two fakes (``torchvision::nms``, ``::qnms``) are registered unconditionally and ``import
    torchvision`` (so ComfyUI's start) fails with "operator torchvision::nms does not exist". Those
    decorators get the ``_has_ops()`` guard the file's other registrations have. Nothing to do (0)
    when torchvision imports or is absent."""
    import importlib.util
    if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0:
        return 0
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return 0
    path = Path(list(spec.submodule_search_locations)[0]) / "_meta_registrations.py"
    src = path.read_text(encoding="utf-8")
    fixed, n = _UNGUARDED_FAKE.subn(r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() "
                                    r"else (lambda fn: fn))", src)
    if n:
        path.write_text(fixed, encoding="utf-8")
        for stale in path.parent.glob("__pycache__/_meta_registrations*.pyc"):
            stale.unlink()
    ok = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0
    print(f"torchvision: {n} fake registration(s) guarded in {path}; "
          + ("it imports now" if ok else "it still does not import"), file=sys.stderr)
    return 0 if ok else 1


def setup(env: Path, if_missing: bool = False, dry_run: bool = False) -> int:
    if if_missing and is_complete(env):
        return 0
    comfy = comfy_tree()
    plan = setup_plan(env, comfy)
    if dry_run:
        print("\n".join(subprocess.list2cmdline(c) for c in plan))
        return 0
    for i, cmd in enumerate(plan):
        if i == 3:  # after the pack: ComfyUI's own requirements
            print(f"ComfyUI at {comfy}: installing its requirements into {env}", file=sys.stderr)
            req = comfy_requirements((comfy / "requirements.txt").read_text(encoding="utf-8"))
            (env / "comfy-requirements.txt").write_text("\n".join(req) + "\n", encoding="utf-8")
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)  # stdout stays the command's own
    if comfy is None:
        print("no ComfyUI tree (COMFYUI_PATH or ~/comfy/ComfyUI): the ComfyUI tests will skip with one line",
              file=sys.stderr)
    elif subprocess.run([str(env_python(env)), "-c", "import torchvision"], capture_output=True).returncode:
        print("torchvision does not import: ComfyUI tests will fail", file=sys.stderr)
    return 0


def run_in_env(args: list[str]) -> int:
    """``python <args>`` in the env (made first when it is missing), in the checkout."""
    env = env_dir()
    setup(env, if_missing=True)
    cmd = [str(env_python(env)), *args]
    if os.name != "nt":  # the command replaces this process, as the shell's exec did (signals, exit status)
        os.chdir(ROOT)
        os.execv(cmd[0], cmd)
    return subprocess.run(cmd, cwd=ROOT).returncode


def lane_args(rest: list[str]) -> list[str]:
    """pytest's arguments for ``test``: ``--full`` the full lane (tests marked ``full``: servers, soak,
    browser, minute-long in-process tests; tests/_lanes.py), ``--all`` every test; otherwise the quick
    lane (``-m "not full"``) unless the arguments name tests or a marker (then they run as asked)."""
    if "--full" in rest:
        return ["-m", "full", *(a for a in rest if a != "--full")]
    if "--all" in rest:
        return [a for a in rest if a != "--all"]
    named = any(not a.startswith("-") for a in rest) or any(a == "-m" or a.startswith("-m=") for a in rest)
    return rest if named else ["-m", "not full", *rest]


def main(argv: list[str]) -> int:
    cmd, rest = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "setup":
        flags = {a for a in rest if a.startswith("--")}
        unknown = flags - {"--if-missing", "--dry-run"}
        names = [a for a in rest if not a.startswith("--")]
        if unknown or len(names) > 1:
            print(f"dev.py setup: unknown arguments {sorted(unknown) or names[1:]}; "
                  "usage: setup [--if-missing] [--dry-run] [ENV]", file=sys.stderr)
            return 2
        return setup(env_dir(names[0] if names else None), "--if-missing" in flags, "--dry-run" in flags)
    if cmd == "test":
        return run_in_env(["-m", "pytest", "-q", *lane_args(rest)])
    if cmd == "bench":
        return run_in_env(["-m", "unet_compiler.bench", "run", *rest])
    if cmd == "torchvision-cpu" and not rest:
        return torchvision_cpu()
    print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
