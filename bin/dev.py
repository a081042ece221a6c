"""The development env and the README's two commands, with no shell (Windows included):

    python bin/dev.py setup [--if-missing] [--dry-run] [ENV]   make or update the env from the lock
    python bin/dev.py setup --newest [ENV]                      the same resolving every package afresh
                                                                (torch stays pinned); prints what moved
    python bin/dev.py lock [ENV]                                write the lock (constraints.txt) from ENV
    python bin/dev.py test [--full | --all] [PYTEST ARGS]       the tests (python -m pytest -q ...): the
                                                                quick lane; --full the full lane, --all both
    python bin/dev.py bench [BENCH ARGS]                        the main job (python -m unet_compiler.bench run ...)
    python bin/dev.py python [ARGS]                             the env's python, started as test and bench are
    <env python> bin/dev.py torchvision-cpu                     make that env's torchvision import beside CPU torch

ENV is the venv's folder, relative to the checkout (default ``$UNET_COMPILER_ENV``, else ``.venv``).
``test``, ``bench`` and ``python`` first make it when it is not a complete env of this checkout,
and reuse it when it is. ``bin/setup``, ``bin/test`` and ``bin/bench`` are these commands for a
POSIX shell. The env: a venv with every package pinned by the lock ``constraints.txt`` (CPU torch
included), this pack (editable) with its test extras and, when a ComfyUI tree is found
(``COMFYUI_PATH``, else ``~/comfy/ComfyUI``), ComfyUI's requirements less its torch lines.
Every process it starts runs with ``PYTHONSAFEPATH=1`` (inherited by their children): ``python -m``
and ``-c`` in the checkout would otherwise put the checkout on ``sys.path``, where the pack's own
``kernels/`` hides Hugging Face's ``kernels`` package (diffusers' UNet needs it). Standard library
only: it runs before any env exists.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the lock: every package the env holds, pinned (``lock`` writes it; every install reads it)
LOCK = ROOT / "constraints.txt"
#: the one pin the newest lane keeps: the CPU torch this machine has on disk (any other spec pulls a CUDA build)
TORCH_PIN = "torch==2.13.0"
#: what the lock leaves out: pip is the venv's own, the pack is installed from the checkout
_UNLOCKED = ("pip", "unet-compiler")
#: ComfyUI's requirements this env never takes from its list: torch stays the pinned CPU build,
#: torchaudio is not needed (its nodes log an import failure, harmless)
_TORCH_LINES = ("torch", "torchvision", "torchaudio")
#: a torchvision decorator that registers a fake for one of its C++ ops unconditionally
_UNGUARDED_FAKE = re.compile(r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$', re.M)

_COMPLETE = """
import importlib.util as u, os, sys
pack = u.find_spec("unet_compiler")
mine = pack is not None and os.path.realpath(os.path.dirname(pack.origin)) == os.path.realpath(sys.argv[1])
sys.exit(not (mine and all(map(u.find_spec, ("torch", "pytest", "xdist", "diffusers", "comfy_aimdo")))))
"""


def child_env() -> dict:
    """The environment of every process this script starts: ours with ``PYTHONSAFEPATH=1``, so no
    ``python -m`` / ``-c`` puts its working directory (the checkout) on ``sys.path``; their own
    children inherit it."""
    return {**os.environ, "PYTHONSAFEPATH": "1"}


#: prints ``name==version`` for every distribution the interpreter finds (run by an env's python)
_DISTRIBUTIONS = """
import importlib.metadata as m
print("\\n".join(sorted({f"{d.metadata['Name']}=={d.version}" for d in m.distributions()})))
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
    """Whether ``env``'s python finds torch, pytest (with pytest-xdist), diffusers, comfy-aimdo and this
    checkout's unet_compiler."""
    py = env_python(env, windows)
    if not py.is_file():
        return False
    return subprocess.run([str(py), "-c", _COMPLETE, str(ROOT)], capture_output=True).returncode == 0


def setup_plan(env: Path, comfy: Path | None, windows: bool = os.name == "nt",
               python: str = sys.executable, newest: bool = False) -> list[list[str]]:
    """The commands that make or update ``env``, in order (every pip runs as the env's
    ``python -m pip``, pinned by the lock ``constraints.txt``; ``newest``: by ``<env>/newest-pin.txt``,
    torch's pin alone, so the rest resolves to the registry's newest). A ComfyUI tree adds its
    requirements, written to ``<env>/comfy-requirements.txt`` first by :func:`setup`."""
    py = str(env_python(env, windows))
    pins = env / "newest-pin.txt" if newest else LOCK
    pip = [py, "-m", "pip", "install", "-q", "-c", str(pins)]
    plan = [[python, "-m", "venv", str(env)],
            pip + [TORCH_PIN],
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


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(text: str) -> dict[str, str]:
    """``{normalised name: version}`` of a lock's ``name==version`` lines (comments ignored)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_normal(name)] = version.strip()
    return pins


def locked() -> dict[str, str]:
    """The lock's pins (:func:`read_lock` of :data:`LOCK`)."""
    return read_lock(LOCK.read_text(encoding="utf-8"))


def installed(env: Path) -> dict[str, str]:
    """``{normalised name: version}`` of what ``env`` holds, less the venv's pip and this pack; a
    local version label (torch's ``+cpu``) dropped, so the pin fits the same release of any build."""
    out = subprocess.run([str(env_python(env)), "-c", _DISTRIBUTIONS], capture_output=True, text=True, check=True).stdout
    pins = read_lock(out)
    return {n: v.split("+")[0] for n, v in pins.items() if n not in _UNLOCKED}


def lock_text(pins: dict[str, str]) -> str:
    """The lock file for ``pins``: a header saying what it is and how to refresh it, one pin a line."""
    head = ("# The lock: every package bin/setup installs, at the versions the tests last passed with\n"
            "# (pip reads it as constraints: a line pins a package only where something asks for it).\n"
            "# Refresh: bin/setup --newest .venv-newest && bin/dev.py lock .venv-newest, then bin/test\n"
            "# (docs/testing.md). torch stays 2.13.0: the CPU build on this machine's disk.\n")
    return head + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))


def lock_changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What moved from the lock ``before`` to the env ``after``, a line a package, sorted."""
    lines = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old != new:
            lines.append(f"  {name}: {old or '-'} -> {new or '-'}" + ("  (new)" if old is None else
                                                                       "  (gone)" if new is None else ""))
    return lines


def lock(env: Path) -> int:
    """Write the lock from what ``env`` holds (torch held at :data:`TORCH_PIN`)."""
    pins = installed(env)
    name, version = TORCH_PIN.split("==")
    if pins.get(name) != version:
        print(f"dev.py lock: {env} has torch {pins.get(name)}, the lock keeps {TORCH_PIN}", file=sys.stderr)
        return 1
    changes = lock_changes(locked(), pins)
    LOCK.write_text(lock_text(pins), encoding="utf-8")
    print(f"{LOCK.name}: {len(pins)} packages from {env}; " + (f"{len(changes)} changed:" if changes else "unchanged"),
          *changes, sep="\n", file=sys.stderr)
    return 0


def setup(env: Path, if_missing: bool = False, dry_run: bool = False, newest: bool = False) -> int:
    """Make or update ``env`` (``newest``: make it afresh, removing a venv that is there, resolving
    everything but torch to the registry's newest, and print what moved against the lock)."""
    if if_missing and is_complete(env):
        return 0
    comfy = comfy_tree()
    plan = setup_plan(env, comfy, newest=newest)
    if dry_run:
        print("\n".join(subprocess.list2cmdline(c) for c in plan))
        return 0
    if newest and env.exists():
        if not (env / "pyvenv.cfg").is_file():
            print(f"dev.py setup --newest: {env} is there and is not a venv; name another folder", file=sys.stderr)
            return 2
        import shutil
        shutil.rmtree(env)
    for i, cmd in enumerate(plan):
        if i == 1 and newest:
            (env / "newest-pin.txt").write_text(TORCH_PIN + "\n", encoding="utf-8")
        if i == 3:  # after the pack: ComfyUI's own requirements
            print(f"ComfyUI at {comfy}: installing its requirements into {env}", file=sys.stderr)
            req = comfy_requirements((comfy / "requirements.txt").read_text(encoding="utf-8"))
            (env / "comfy-requirements.txt").write_text("\n".join(req) + "\n", encoding="utf-8")
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr, env=child_env())  # stdout stays the command's own
    if comfy is None:
        print("no ComfyUI tree (COMFYUI_PATH or ~/comfy/ComfyUI): the ComfyUI tests will skip with one line",
              file=sys.stderr)
    elif subprocess.run([str(env_python(env)), "-c", "import torchvision"], capture_output=True).returncode:
        print("torchvision does not import: ComfyUI tests will fail", file=sys.stderr)
    if newest:
        changes = lock_changes(locked(), installed(env))
        print(f"newest against the lock ({LOCK.name}): " + (f"{len(changes)} changed" if changes else "nothing moved"),
              *changes, sep="\n")
    return 0


def run_in_env(args: list[str]) -> int:
    """``python <args>`` in the env (made first when it is missing), in the checkout."""
    env = env_dir()
    setup(env, if_missing=True)
    cmd = [str(env_python(env)), *args]
    if os.name != "nt":  # the command replaces this process, as the shell's exec did (signals, exit status)
        os.chdir(ROOT)
        os.execve(cmd[0], cmd, child_env())
    return subprocess.run(cmd, cwd=ROOT, env=child_env()).returncode


def lane_args(rest: list[str]) -> list[str]:
    """pytest's arguments for ``test``: ``--full`` the full lane (tests marked ``full``: servers, soak,
    browser, minute-long in-process tests; tests/_lanes.py), ``--all`` every test; otherwise the quick
    lane (``-m "not full"``) unless the arguments name tests (a path or node id in the checkout, a
    ``-k`` expression) or a marker (then they run as asked). An option's value (``-p no:warnings``)
    names no test."""
    if "--full" in rest:
        return ["-m", "full", *(a for a in rest if a != "--full")]
    if "--all" in rest:
        return [a for a in rest if a != "--all"]
    return rest if _names_tests(rest) else ["-m", "not full", *rest]


def _names_tests(rest: list[str]) -> bool:
    """Whether pytest's arguments name tests (a path or node id in the checkout, a ``-k``
    expression) or a marker."""
    return any(not a.startswith("-") and ("::" in a or (ROOT / a).exists()) for a in rest) \
        or any(a in ("-m", "-k") or a.startswith(("-m=", "-k=")) for a in rest)


#: a lane's pytest-xdist workers at most (each holds a model or two, 1-2 GB, and torch's threads are shared out)
MAX_WORKERS = 4
#: the env switch for a lane's workers (1: one process, as before pytest-xdist)
WORKERS_ENV = "UNET_COMPILER_TEST_WORKERS"


def worker_args(rest: list[str], cores: int | None = None) -> list[str]:
    """pytest-xdist's arguments for a lane (``test`` with no test named; ``--full``, ``--all``):
    ``-n N --dist loadfile``, N one worker a CPU core up to :data:`MAX_WORKERS`, or
    ``$UNET_COMPILER_TEST_WORKERS``; each module's tests run in one worker, so its compiled fixtures
    are made once. None (one process) where N < 2, where tests are named or where the arguments
    choose (``-n``, ``-p no:xdist``)."""
    chosen = "no:xdist" in rest or any(a in ("-n", "--numprocesses", "--dist")
                                       or a.startswith(("-n", "--numprocesses=", "--dist=")) for a in rest)
    if _names_tests(rest) or chosen:
        return []
    want = os.environ.get(WORKERS_ENV, "").strip()
    n = int(want) if want.isdigit() else min(cores or os.cpu_count() or 1, MAX_WORKERS)
    return ["-n", str(n), "--dist", "loadfile"] if n >= 2 else []


def main(argv: list[str]) -> int:
    cmd, rest = (argv[0], argv[1:]) if argv else ("", [])
    if sys.version_info < (3, 11):
        print("dev.py: needs Python 3.11 or newer (it starts every process with PYTHONSAFEPATH=1, which 3.11 "
              f"added); this is {sys.version.split()[0]}: run it with python3.11 (Windows: py -3.11)", file=sys.stderr)
        return 2
    if cmd in ("setup", "lock"):
        flags = {a for a in rest if a.startswith("--")}
        unknown = flags - ({"--if-missing", "--dry-run", "--newest"} if cmd == "setup" else set())
        names = [a for a in rest if not a.startswith("--")]
        if unknown or len(names) > 1 or {"--newest", "--if-missing"} <= flags:
            print(f"dev.py {cmd}: unknown arguments {sorted(unknown) or names[1:] or ['--newest', '--if-missing']}; "
                  "usage: setup [--if-missing | --newest] [--dry-run] [ENV], lock [ENV]", file=sys.stderr)
            return 2
        env = env_dir(names[0] if names else None)
        if cmd == "lock":
            return lock(env)
        return setup(env, "--if-missing" in flags, "--dry-run" in flags, "--newest" in flags)
    if cmd == "test":
        return run_in_env(["-m", "pytest", "-q", *lane_args(rest), *worker_args(rest)])
    if cmd == "bench":
        return run_in_env(["-m", "unet_compiler.bench", "run", *rest])
    if cmd == "python":
        return run_in_env(rest)
    if cmd == "torchvision-cpu" and not rest:
        return torchvision_cpu()
    print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
