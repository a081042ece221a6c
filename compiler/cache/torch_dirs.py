"""Torch's own on-disk caches (inductor's, and Triton's inside it) moved into the pack's cache
folder, so they survive a reboot that clears /tmp; a read-only folder (a fleet's shared mount)
is copied to a local temp folder first, since inductor writes beside what it reads."""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from . import files

log = logging.getLogger(__name__)

ENV = "TORCHINDUCTOR_CACHE_DIR"
_copied: dict = {}         # local copies of read-only folders' inductor files made in this process -> seconds


#: inductor adds 120-150 characters under its cache folder; Windows paths stop at 260 (MAX_PATH)
#: unless LongPathsEnabled is set, and cl.exe fails on longer ones even then
WINDOWS_ROOM = 100


def short_root(folder: Path, system: str | None = None) -> Path:
    """Where inductor's files go for the cache ``folder``: ``folder/inductor``, except on Windows
    when that path leaves inductor no room under MAX_PATH (a portable build in Downloads): then a
    short folder under %LOCALAPPDATA% (one per cache folder)."""
    target = folder / "inductor"
    if (system or platform.system()) != "Windows" or len(str(target)) <= WINDOWS_ROOM:
        return target
    base = Path(os.environ.get("LOCALAPPDATA") or Path.home())
    return base / "ucc" / hashlib.sha256(str(folder).encode()).hexdigest()[:8]


def place(folder: Path) -> list[str]:
    """Point inductor's cache into ``folder/inductor`` (``short_root``) unless the user chose one
    (inductor writes its default, /tmp/torchinductor_<user>, into the environment at first use:
    that value counts as not chosen). Returns what was placed, in words for the report (empty:
    nothing moved)."""
    current = os.environ.get(ENV)
    if current:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
            if os.path.abspath(current) != os.path.abspath(default_cache_dir()):
                return []
        except Exception:
            return []
    target = short_root(folder)
    try:
        if not target.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        writable = files.writable(target)
    except OSError:
        writable = False
    if writable:
        os.environ[ENV] = str(target)
        return ["torch's own inductor cache" + ("" if target == folder / "inductor" else
                                                 f" (in {target}: a shorter path, for Windows' 260-character limit)")]
    if not target.is_dir():
        return []   # unwritable and empty: torch keeps its default (/tmp)
    local = Path(tempfile.gettempdir()) / ("unet_compiler_inductor_"
                                           + hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:12])
    if local not in _copied:   # once per process: later models use the same copy
        t0 = time.perf_counter()
        try:
            shutil.copytree(target, local, dirs_exist_ok=True, ignore=shutil.ignore_patterns("locks", "*.lock"))
        except (OSError, shutil.Error) as e:
            log.warning("UNet Compiler: compile cache: copying %s to %s failed (%s); torch's caches stay in "
                        "their default folder", target, local, e)
            return []
        _copied[local] = time.perf_counter() - t0
    os.environ[ENV] = str(local)
    return [f"torch's own inductor cache, copied from the read-only folder to {local} in {_copied[local]:.1f} s"]
