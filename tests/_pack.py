"""Which .py files are the pack's, for the tests that read them (test_packaging's import checks,
test_security's scan): every one in the checkout but those under bench/ and bin/ (development
tools), tests/ and docs/, and none in a hidden, virtual-env or build folder. tests/_patch_compat.py's
"the pack's own frames" applies the same rule to a traceback's files."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_THE_PACK = ("bench", "bin", "tests", "docs")


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
