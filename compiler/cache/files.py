"""The cache's file operations, safe against a concurrent reader or writer on any OS: a reader never
sees half a file, a file another process holds open (Windows) is retried, not given up on, and
"writable" is tried, not assumed (``os.access`` says yes for every folder on Windows)."""
from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import time
import uuid
from pathlib import Path

#: waits between attempts to replace a file another process has open (Windows raises PermissionError
#: while a second ComfyUI reads the entry or an antivirus scans it; POSIX never does)
RETRY_SECONDS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)


def atomic_write(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file in the same folder and one rename: a crash or a
    concurrent reader sees the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        _replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _replace(src: str, dst: Path) -> None:
    for wait in (*RETRY_SECONDS, None):
        try:
            os.replace(src, dst)
            return
        except PermissionError:
            if wait is None:
                raise
            time.sleep(wait)


def writable(folder: Path) -> bool:
    """Whether a file can be created in ``folder`` (tried: a read-only share, a locked folder)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".unet-compiler-write-test.")
    except OSError:
        return False
    os.close(fd)
    Path(tmp).unlink(missing_ok=True)
    return True


def read_text(path: Path) -> str:
    """A text file the pack wrote (UTF-8 on every OS, whatever the locale's encoding)."""
    return Path(path).read_text(encoding="utf-8")


@contextlib.contextmanager
def lock(path: Path, timeout: float = 30.0, stale: float = 120.0):
    """Hold ``path`` as a lock file (created exclusively) inside the block: two processes saving one
    entry take turns, so neither's merge misses what the other wrote. A lock whose holder is gone (a
    process on this machine that was killed while holding it) or older than ``stale`` seconds (one
    on another machine) is broken; after ``timeout`` seconds, or where the folder cannot hold one
    (read-only), the block runs without it rather than hang or fail."""
    end, wait, held = time.monotonic() + timeout, 0.02, False
    # what this holder wrote (it removes only its own lock), and who it is: its process and machine
    token = f"{uuid.uuid4().hex} {os.getpid()} {machine()}".encode()
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            try:
                os.write(fd, token)
            finally:
                os.close(fd)
            held = True
            break
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime > stale or holder_gone(path):
                    _break_stale(path)
                    continue
            except OSError:
                continue
            if time.monotonic() >= end:
                break
            time.sleep(wait)
            wait = min(wait * 2, 0.5)
        except OSError:
            break
    try:
        yield held
    finally:
        if held and _token(path) == token:   # (held past ``stale``, another process may have broken it)
            with contextlib.suppress(OSError):
                path.unlink()


def holder_gone(path: Path) -> bool:
    """Whether the lock ``path`` was taken by a process on this machine that no longer runs (a lock
    from another machine, or one that cannot be read, is not judged here)."""
    parts = (_token(path) or b"").decode(errors="replace").split(" ", 2)
    # (a lock of the pack's version before pid namespaces named the host alone)
    here = machine() if "/" in parts[-1] else platform.node()
    if len(parts) != 3 or parts[2] != here or not parts[1].isdigit():
        return False
    return not _alive(int(parts[1]))


def machine() -> str:
    """Where a pid means one process: this host's name, and on Linux its pid namespace (containers
    that share a cache volume and a host name each number their own processes)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return platform.node() + (f"/{ns}" if ns else "")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (where that cannot be told, as on Windows without psutil: True)."""
    try:
        import psutil
        return psutil.pid_exists(pid)
    except ImportError:
        pass
    if os.name == "nt":    # (os.kill there terminates the process: never used to ask)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:        # (another user's process: it runs)
        return True
    return True


def _token(path: Path) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except OSError:
        return None


def _break_stale(path: Path) -> None:
    """Remove the stale lock ``path`` unless another process replaced it meanwhile: it is moved aside
    (one mover wins), and put back when what was moved is not the stale lock that was judged."""
    judged = _token(path)
    aside = path.with_name(f"{path.name}.{uuid.uuid4().hex}.stale")
    try:
        os.rename(path, aside)
    except OSError:                       # gone already, or another process moved it first
        return
    if _token(aside) != judged:           # a fresh lock taken between the look and the move: back
        with contextlib.suppress(OSError):
            os.link(aside, path)          # (fails where a lock is there again: that one stands)
    with contextlib.suppress(OSError):
        aside.unlink()
