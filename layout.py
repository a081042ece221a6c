"""Which files are the pack's: the one answer for the security scan, the import-graph check and the
patch harness's "the pack's own frames" (a virtual env, a cache or the tests beside the code are not
the pack, nor are the docs, workflows and web assets, which hold no Python the pack runs)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

PACK_ROOT = Path(__file__).resolve().parent
#: folders at the root that hold no module of the pack
NOT_SHIPPED = ("tests", "docs", "example_workflows", "web")


@lru_cache(maxsize=1)
def pack_files() -> tuple[Path, ...]:
    """The .py files the pack ships: the root's and its subpackages' (folders with an ``__init__.py``
    reached through folders that have one; none hidden, none in NOT_SHIPPED)."""
    out, folders = [], [PACK_ROOT]
    while folders:
        folder = folders.pop()
        for p in sorted(folder.iterdir()):
            if p.suffix == ".py" and p.is_file():
                out.append(p)
            elif (p.is_dir() and (p / "__init__.py").is_file() and not p.name.startswith(".")
                  and p.name not in NOT_SHIPPED):
                folders.append(p)
    return tuple(sorted(out))


def is_pack_file(path) -> bool:
    """``path`` (a traceback frame's file, say) is one of :func:`pack_files`."""
    try:
        return Path(path).resolve() in pack_files()
    except (OSError, ValueError):
        return False


def module_name(path: Path) -> str:
    """The dotted module name of one of :func:`pack_files` (``unet_compiler.compiler.api``)."""
    rel = Path(path).resolve().relative_to(PACK_ROOT)
    return ".".join(("unet_compiler",) + rel.with_suffix("").parts).removesuffix(".__init__")
