"""Intel Extension for PyTorch probes.

Intel archived IPEX: 2.8.0 is the last release and it only works beside
torch 2.8.x. On a mismatch its ``import`` prints an error and kills the
process, so everything here reads package metadata first and imports IPEX
only when the versions match (and then inside a try).
"""
from __future__ import annotations

import logging
import platform
from functools import lru_cache
from importlib import metadata

import torch

from ..reasons import Reason, error_summary

log = logging.getLogger(__name__)

DIST = "intel_extension_for_pytorch"
LAST_RELEASE = "2.8.0"


def ipex_version() -> str | None:
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return None


def _major_minor(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())


def mismatch(ipex_v: str, torch_v: str | None = None) -> str | None:
    """The one-sentence reason IPEX ``ipex_v`` cannot be imported beside
    ``torch_v`` (default: the installed torch), with the fix; None if they match."""
    torch_v = (torch_v or torch.__version__).split("+")[0]
    if _major_minor(ipex_v) == _major_minor(torch_v):
        return None
    need = ".".join(str(p) for p in _major_minor(ipex_v))
    return Reason(f"IPEX {ipex_v} only works with torch {need}.x but torch {torch_v} is installed, and importing "
                  f"it would crash the process, so it was not imported",
                  f"pip install torch=={need}.* (IPEX {LAST_RELEASE} is Intel's last release, for torch 2.8), or "
                  f"pip uninstall {DIST} and use the inductor backend")


def is_intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return "intel" in (platform.processor() or "").lower()


@lru_cache(maxsize=1)
def load():
    """(module, None) when IPEX is installed, matches torch and imports;
    otherwise (None, one-sentence reason with the fix). Cached: imported once."""
    v = ipex_version()
    if v is None:
        return None, Reason(f"{DIST} is not installed (optional; pip install {DIST}=={LAST_RELEASE} beside torch 2.8)")
    bad = mismatch(v)
    if bad:
        return None, bad
    try:
        import intel_extension_for_pytorch as ipex
    except BaseException as e:  # SystemExit from its own version check included
        log.warning("UNet Compiler: importing IPEX %s failed", v, exc_info=True)
        return None, Reason(f"IPEX {v} is installed but failed to import ({error_summary(e)})")
    return ipex, None
