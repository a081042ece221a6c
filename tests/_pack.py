"""Which .py files are the pack's, for the tests that read them (test_packaging's import checks,
test_security's scan): every one in the checkout but those under bench/ and bin/ (development
tools), tests/ and docs/, and none in a hidden, virtual-env or build folder. tests/_patch_compat.py's
"the pack's own frames" applies the same rule to a traceback's files. And whether the checkout is
on ``sys.path`` (:func:`shadow_problem`), which the tests and the bench refuse at their start."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_THE_PACK = ("bench", "bin", "tests", "docs")


#: the checkout's top-level folders: on ``sys.path`` they would import as top-level packages and hide
#: installed ones of the same name (Hugging Face's ``kernels``, which diffusers' UNet imports)
TOP_LEVEL = ("kernels", "nodes", "compiler", "web", "tests", "bench")


def shadowing(path: list[str] | None = None, cwd: str | None = None) -> list[str]:
    """The entries of ``path`` (default ``sys.path``) that are the checkout, from which its
    :data:`TOP_LEVEL` folders import as top-level packages (``''`` is the working directory ``cwd``)."""
    import sys
    root = os.path.realpath(ROOT)
    here = os.getcwd() if cwd is None else cwd
    return [e for e in (sys.path if path is None else path) if os.path.realpath(e or here) == root]


def shadow_problem(path: list[str] | None = None, cwd: str | None = None) -> str | None:
    """One line when the checkout is on ``sys.path`` (``python -m`` or ``-c`` started in it without
    ``PYTHONSAFEPATH=1``), naming the fix; None when it is not."""
    found = shadowing(path, cwd)
    if not found:
        return None
    return (f"the checkout {ROOT} is on sys.path (entry {found[0]!r}: python -m or -c started in it), so its "
            f"folders {', '.join(TOP_LEVEL)} hide installed packages of those names (Hugging Face's kernels, "
            "which diffusers' UNet imports): start it through bin/test, bin/bench or bin/dev.py python, or "
            "set PYTHONSAFEPATH=1")


def py_files(leave_out=NOT_THE_PACK) -> list[Path]:
    """The .py files under the checkout, less the top-level folders ``leave_out``."""
    out = []
    for folder, subs, files in os.walk(ROOT):
        top = Path(folder) == ROOT
        subs[:] = [s for s in subs if not (s.startswith(".") or s == "__pycache__" or (top and s in (*leave_out, "build"))
                                           or Path(folder, s, "pyvenv.cfg").is_file())]
        out += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def module_name(path: Path) -> str:
    """The dotted module name of a file under the checkout (``unet_compiler.compiler.api``)."""
    rel = Path(path).relative_to(ROOT)
    return ".".join(("unet_compiler",) + rel.with_suffix("").parts).removesuffix(".__init__")
