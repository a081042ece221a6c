"""The import check that every kind of process the project starts passes (tests/test_sys_path.py,
CI's newest lane): the checkout is not on ``sys.path``, diffusers' UNet imports with its peft loader
(which imports Hugging Face's ``kernels`` where transformers >= 5 installed it), and no top-level
name resolves to one of the checkout's folders. ``python -m unet_compiler.tests._imports`` prints
one JSON line and exits 0 when all hold, 1 when not (an import error: its traceback)."""
from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
import os
import sys


def _inside(path: str, folder: str) -> bool:
    path = os.path.realpath(path)
    return path == folder or path.startswith(folder + os.sep)


def check() -> dict:
    """What this process sees: the shadowing ``sys.path`` entries, the versions that matter, where each
    of the checkout's top-level names imports from, and ``ok``. Imports diffusers' UNet (raises if it
    cannot)."""
    from unet_compiler.tests._pack import ROOT, TOP_LEVEL, shadowing
    found = shadowing()
    import diffusers.loaders.peft  # noqa: F401 - the loader that imports Hugging Face's kernels
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel  # noqa: F401
    versions = {}
    for dist in ("diffusers", "transformers", "kernels", "torch"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    root = os.path.realpath(ROOT)
    where, ours = {}, []
    for name in TOP_LEVEL:   # resolved through sys.path alone (pytest keeps a ``tests`` of its own in sys.modules)
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
        origin = spec and (spec.origin or next(iter(spec.submodule_search_locations or []), None))
        where[name] = origin
        if origin and _inside(origin, os.path.join(root, name)):
            ours.append(name)
    hf = sys.modules.get("kernels")   # imported by diffusers' peft loader where installed
    if hf is not None and _inside(hf.__file__ or "", os.path.join(root, "kernels")):
        ours.append("kernels (imported)")
    return {"shadowing": found, "ours": ours, "versions": versions, "where": where, "ok": not found and not ours}


if __name__ == "__main__":
    result = check()
    print(json.dumps(result))
    sys.exit(0 if result["ok"] else 1)
