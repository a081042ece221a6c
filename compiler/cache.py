"""The pack's persistent compile cache: one entry per model and setup, holding the precompiled
region variants (``precompiled.py``) and torch's Mega-Cache.

A restart (or a second worker pointed at the same folder) loads the entry before anything
compiles: each precompiled region variant is deserialized at its first use and called with
nothing traced; what runs under plain torch.compile finds inductor's, AOTAutograd's and Triton's
artifacts in the Mega-Cache (dynamo still traces those).

- Where: ``UNET_COMPILER_CACHE_DIR`` if set, else ComfyUI's user directory
  (``<user>/unet_compiler/compile_cache``) inside ComfyUI, else ``~/.cache/unet_compiler/compile_cache``.
  A read-only folder (a fleet's shared mount) is read and never written.
- Key: everything the artifacts depend on: the UNet's architecture (class, parameter names,
  shapes, dtypes), device type and GPU capability, torch and triton versions, the CompileConfig,
  the pack's version, a digest of its compiled code (region bodies, passes, backends) and ComfyUI's
  version (the variants carry the bodies' bytecode, traced over ComfyUI's classes). Anything else is
  a different entry.
- Integrity: each entry is ``<key>.bin`` (``pack_entry``: a header, torch's Mega-Cache bytes and
  the precompiled variants' bytes) and ``<key>.json``
  (format, size and sha256 of the .bin, written by the pack after the .bin). An entry whose
  .bin does not match its .json (truncated, corrupt, foreign) is never handed to torch (whose
  loader unpickles): it is discarded with one log line and rebuilt.
- Torch's own caches: unless ``TORCHINDUCTOR_CACHE_DIR`` is set, the pack points inductor's (and
  so Triton's inside it) into the same folder (``inductor/``) at its first compile, so they
  survive a reboot that clears /tmp. Measured on CPU (tiny UNet, 2 cores): the Mega-Cache entry
  alone leaves inductor re-building its C++ kernels (warmup 48 % of cold), the kept inductor
  folder does not (11 %). A read-only folder (a fleet's shared mount) has its ``inductor/``
  copied to a local temp folder first, since inductor writes beside what it reads.
- An entry is the union of every save: torch's loader keeps only the last of several saves of
  one process, and a worker that loaded an entry saves only what it compiled itself
  (compat/megacache.py merges both).
- Inductor's CPU ISA probe (a subprocess per vector ISA, every process) is recorded in
  ``cpu_isa.record`` beside the entries and replayed where the machine matches (compat/cpu_isa.py).
- Off: ``UNET_COMPILER_CACHE=off``. Cleared: ``UNET_COMPILER_CACHE=clear`` (the folder is
  emptied once, at the first compile of the process, then used as usual).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from . import precompiled
from .compat import cpu_isa, megacache
from .files import atomic_write

log = logging.getLogger(__name__)

DIR_ENV = "UNET_COMPILER_CACHE_DIR"
MODE_ENV = "UNET_COMPILER_CACHE"
FORMAT = "unet-compiler-mega-cache-2"
_MAGIC = b"UNET-COMPILER-ENTRY-2\n"
PACK_VERSION = "0.1.0"   # pyproject's version; a new release is a new key
_loaded: set = set()       # keys loaded into this process's torch caches
_cleared = [False]
_copied: dict = {}         # local copies of read-only folders' inductor files made in this process -> seconds


def mode() -> str:
    m = os.environ.get(MODE_ENV, "on").strip().lower()
    return m if m in ("on", "off", "clear") else "on"


def directory() -> Path:
    env = os.environ.get(DIR_ENV)
    if env:
        return Path(env).expanduser()
    try:
        import folder_paths  # ComfyUI's: present when running inside ComfyUI
        return Path(folder_paths.get_user_directory()) / "unet_compiler" / "compile_cache"
    except Exception:  # not inside ComfyUI
        return Path.home() / ".cache" / "unet_compiler" / "compile_cache"


def architecture(unet: torch.nn.Module) -> str:
    """A fingerprint of the UNet's structure (not its weights: parameters are graph inputs)."""
    h = hashlib.sha256(f"{type(unet).__module__}.{type(unet).__qualname__}".encode())
    for name, t in list(unet.named_parameters()) + list(unet.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return h.hexdigest()


def key_facts(unet, config, device) -> dict:
    """What an entry depends on, as written into its .json."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    capability = None
    if dev.type == "cuda" and torch.cuda.is_available():
        capability = ".".join(map(str, torch.cuda.get_device_capability(dev)))
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    return {"format": FORMAT, "architecture": architecture(unet), "device": dev.type, "capability": capability,
            "torch": torch.__version__, "triton": triton_version, "config": dataclasses.asdict(config),
            "pack": PACK_VERSION, "code": code_digest(), "comfyui": _comfyui_version()}


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """The pack's compiled code (region bodies, graph passes, backends): precompiled variants carry
    its bytecode, so a changed body is a new entry even without a version bump."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted([root / "regions.py", root / "precompiled.py", *root.glob("passes/*.py"),
                     *root.glob("backends/*.py")]):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def _comfyui_version() -> str | None:
    """ComfyUI's version when inside it: its module classes' defaults are code the variants were traced over."""
    try:
        import comfyui_version
        return str(comfyui_version.__version__)
    except Exception:
        return None


def key_of(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def size_mib(folder: Path) -> float:
    try:
        return sum(p.stat().st_size for p in folder.glob("*.bin")) / 2**20
    except OSError:
        return 0.0


def pack_entry(mega: bytes | None, variants: dict[str, list[bytes]]) -> bytes:
    """An entry's .bin: a header (JSON: the sizes of what follows), torch's Mega-Cache bytes, then
    each precompiled region variant's bytes (``precompiled.py``)."""
    mega = mega or b""
    order = [(k, b) for k, blobs in sorted(variants.items()) for b in blobs]
    header = json.dumps({"megacache": len(mega), "variants": [[k, len(b)] for k, b in order]}).encode()
    return b"".join([_MAGIC, len(header).to_bytes(8, "little"), header, mega, *(b for _, b in order)])


def unpack_entry(data: bytes | None) -> tuple[bytes | None, dict[str, list[bytes]]]:
    """``pack_entry`` undone (raises ValueError on bytes it did not write)."""
    if not data:
        return None, {}
    if not data.startswith(_MAGIC):
        raise ValueError("not a UNet Compiler cache entry")
    at = len(_MAGIC)
    size = int.from_bytes(data[at:at + 8], "little")
    header = json.loads(data[at + 8:at + 8 + size])
    at += 8 + size
    mega = data[at:at + header["megacache"]]
    at += header["megacache"]
    variants: dict[str, list[bytes]] = {}
    for key, n in header["variants"]:
        variants.setdefault(key, []).append(data[at:at + n])
        at += n
    if at != len(data):
        raise ValueError("entry length does not match its header")
    return mega or None, variants


def merge_variants(old: dict, new: dict) -> dict:
    """Every variant of both, each once (by its bytes' sha256)."""
    out: dict[str, dict[str, bytes]] = {}
    for src in (old, new):
        for key, blobs in src.items():
            for b in blobs:
                out.setdefault(key, {})[hashlib.sha256(b).hexdigest()] = b
    return {k: list(v.values()) for k, v in out.items()}


def _labels(meta: dict) -> list[str]:
    got = meta.get("primed")
    return [p for p in got if isinstance(p, str)] if isinstance(got, list) else []


def _compares(meta: dict) -> dict[str, dict]:
    """The entry's recorded compares: shape label -> {"max_abs_diff": float, "measured": date}."""
    got = meta.get("compares")
    if not isinstance(got, dict):
        return {}
    return {k: {"max_abs_diff": float(v["max_abs_diff"]), "measured": str(v["measured"])}
            for k, v in got.items() if isinstance(k, str) and isinstance(v, dict)
            and isinstance(v.get("max_abs_diff"), (int, float)) and isinstance(v.get("measured"), str)}


class CompileCache:
    """The cache entry of one accelerated model; ``lines()`` is what the report says of it."""

    def __init__(self, unet, config, device):
        self.enabled = mode() != "off" and config.backend != "eager"
        self.folder = directory()
        self.facts = key_facts(unet, config, device) if self.enabled else {}
        self.key = key_of(self.facts) if self.enabled else ""
        self.state = "off (UNET_COMPILER_CACHE=off)" if mode() == "off" else "not used"
        self.problem = ""
        self.saved_mib = None
        self.torch_dirs: list = []
        self._entry: bytes | None = None   # the entry's bytes as loaded or last written here
        self._meta: dict = {}              # the intact entry's .json as last read
        #: warmup probe shapes (labels) whose code the entry holds: read from its .json at a load
        #: from disk, added to by this model's warmup; a restart's warmup need not run them again
        self.primed: set[str] = set()
        #: max |compiled - eager| per shape label, measured by a warmup that compiled the entry's code
        #: (read from its .json at a load from disk, added to by this model's warmup)
        self.compares: dict[str, dict] = {}

    @property
    def paths(self) -> tuple[Path, Path]:
        return self.folder / f"{self.key}.bin", self.folder / f"{self.key}.json"

    # -- load ----------------------------------------------------------------------
    def load(self) -> bool:
        """Hand this model's entry to torch's caches before anything compiles. True on a hit."""
        if not self.enabled:
            return False
        if mode() == "clear" and not _cleared[0]:
            _cleared[0] = True
            self._clear()
        self._place_torch_caches()
        cpu_isa.install(self.folder)
        if self.key in _loaded:
            self.state = "hit (loaded earlier in this process)"
            return True
        bin_path, meta_path = self.paths
        if not meta_path.is_file() and not bin_path.is_file():
            self.state = "miss (compiles, then saves)"
            return False
        t0 = time.perf_counter()
        data, why = self._read()
        if why:
            log.warning("UNet Compiler: compile cache entry %s discarded: %s; it is rebuilt", self.key, why)
            self._discard()
            self.state = f"miss (entry discarded: {why}; rebuilt after compiling)"
            return False
        try:
            mega, variants = unpack_entry(data)
            if mega:
                megacache.load(mega)
            for key, blobs in variants.items():
                for blob in blobs:
                    precompiled.VARIANTS.add_serialized(key, blob)
        except Exception as e:  # a torch that cannot read it: compile as if cold
            log.warning("UNet Compiler: torch could not load compile cache entry %s (%s); it is rebuilt", self.key, e)
            self._discard()
            self.state = f"miss (torch could not load the entry: {type(e).__name__}; rebuilt)"
            return False
        _loaded.add(self.key)
        self._entry = data
        self.primed.update(_labels(self._meta))
        self.compares.update(_compares(self._meta))
        n = sum(map(len, variants.values()))
        self.state = (f"hit ({len(data) / 2**20:.1f} MiB loaded in {time.perf_counter() - t0:.2f} s"
                      + (f", {n} precompiled region variant(s)" if n else "") + ")")
        return True

    def _place_torch_caches(self):
        """Inductor's own on-disk cache (and Triton's inside it, torch's default) into the pack's
        folder, unless the user chose one. Inductor writes its default (/tmp/torchinductor_<user>)
        into the environment on first use, so that value counts as not chosen."""
        self.torch_dirs = []
        env = "TORCHINDUCTOR_CACHE_DIR"
        current = os.environ.get(env)
        if current:
            try:
                from torch._inductor.runtime.cache_dir_utils import default_cache_dir
                if os.path.abspath(current) != os.path.abspath(default_cache_dir()):
                    return
            except Exception:
                return
        target = self.folder / "inductor"
        try:
            if not target.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            writable = os.access(target, os.W_OK)
        except OSError:
            writable = False
        if writable:
            os.environ[env] = str(target)
            self.torch_dirs.append("torch's own inductor cache")
            return
        if not target.is_dir():
            return   # unwritable and empty: torch keeps its default (/tmp)
        # a fleet's read-only shared folder: inductor writes beside what it reads, so its files
        # (the compiled C++ / Triton kernels the entry does not carry) are copied to a local folder
        local = Path(tempfile.gettempdir()) / ("unet_compiler_inductor_"
                                               + hashlib.sha256(str(target.resolve()).encode()).hexdigest()[:12])
        if local not in _copied:   # once per process: later models use the same copy
            t0 = time.perf_counter()
            try:
                shutil.copytree(target, local, dirs_exist_ok=True, ignore=shutil.ignore_patterns("locks", "*.lock"))
            except (OSError, shutil.Error) as e:
                log.warning("UNet Compiler: compile cache: copying %s to %s failed (%s); torch's caches stay in "
                            "their default folder", target, local, e)
                return
            _copied[local] = time.perf_counter() - t0
        os.environ[env] = str(local)
        self.torch_dirs.append(f"torch's own inductor cache, copied from the read-only folder to {local} in "
                               f"{_copied[local]:.1f} s")

    def _mismatch(self, meta: dict, data: bytes) -> str:
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')!r}, expected {FORMAT!r}"
        if meta.get("key") != self.key:
            return "its .json belongs to another key"
        if meta.get("size") != len(data):
            return f"truncated ({len(data)} of {meta.get('size')} bytes)"
        if meta.get("sha256") != hashlib.sha256(data).hexdigest():
            return "sha256 mismatch (corrupt)"
        return ""

    # -- save ----------------------------------------------------------------------
    def save(self) -> None:
        """Write everything this process compiled (and loaded) as this model's entry. Never raises:
        an unwritable folder leaves the cache memory-only, said once in the report."""
        if not self.enabled or self.problem:
            return
        cpu_isa.save(self.folder)
        try:
            got = torch.compiler.save_cache_artifacts()
        except Exception as e:
            self.problem = f"torch could not serialize its caches ({type(e).__name__}: {e})"
            log.warning("UNet Compiler: compile cache: %s", self.problem)
            return
        variants = precompiled.VARIANTS.serialized()
        if (not got or not got[0]) and not variants:
            return
        # the entry keeps what it held (another process's graphs, this process's earlier saves)
        try:
            old_mega, old_variants = unpack_entry(self._current_entry())
        except ValueError:   # what this process wrote is always readable; a foreign .bin is replaced
            old_mega, old_variants = None, {}
        mega = megacache.merge(old_mega, got[0]) if got and got[0] else old_mega
        data = pack_entry(mega, merge_variants(old_variants, variants))
        bin_path, meta_path = self.paths
        primed = self.primed | set(_labels(self._meta))
        meta = {**self.facts, "key": self.key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "primed": sorted(primed), "compares": {**_compares(self._meta), **self.compares},
                "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._atomic_write(bin_path, data)
            self._atomic_write(meta_path, json.dumps(meta, indent=1, default=str).encode())
        except OSError as e:
            if self.folder.is_dir() and not os.access(self.folder, os.W_OK):
                # a fleet's shared read-only mount: by design, not a fault
                self.problem = (f"{self.folder} is read-only: its entries are read, code compiled here "
                                f"stays in memory")
            else:
                self.problem = (f"{self.folder} is not writable ({e.strerror or e}): compiled code is kept in "
                                f"memory only. Fix: set {DIR_ENV} to a writable folder")
            log.warning("UNet Compiler: compile cache: %s", self.problem)
            return
        _loaded.add(self.key)
        self._entry = data
        self.saved_mib = len(data) / 2**20

    def _current_entry(self) -> bytes | None:
        """The entry on disk if it is intact (another worker may have added to it), else what this
        process loaded or wrote."""
        data, why = self._read()
        return self._entry if why else data

    def _read(self) -> tuple[bytes | None, str]:
        """The entry's bytes and why they cannot be used ("" when they match the .json the pack wrote)."""
        bin_path, meta_path = self.paths
        self._meta = {}
        try:
            meta = json.loads(meta_path.read_text())
            data = bin_path.read_bytes()
        except (OSError, ValueError) as e:
            return None, f"unreadable ({type(e).__name__}: {e})"
        why = self._mismatch(meta, data)
        if not why:
            self._meta = meta   # (the .json the pack wrote for these bytes)
        return data, why

    @staticmethod
    def _atomic_write(path: Path, data: bytes):
        atomic_write(path, data)

    def _discard(self):
        for p in self.paths:
            try:
                p.unlink(missing_ok=True)
            except OSError:  # a read-only mount: leave it, use nothing from it
                pass

    def _clear(self):
        n = 0
        for p in list(self.folder.glob("*.bin")) + list(self.folder.glob("*.json")) + [self.folder / cpu_isa.FILE]:
            try:   # (no record: FileNotFoundError, not counted)
                p.unlink()
                n += 1
            except OSError:
                pass
        log.warning("UNet Compiler: compile cache cleared (%s=clear): %d file(s) removed from %s",
                    MODE_ENV, n, self.folder)

    def lines(self) -> list[str]:
        if not self.enabled:
            return [f"  compile cache: {self.state}"] if mode() == "off" else []
        out = [f"  compile cache: {self.state}; {self.folder} holds {size_mib(self.folder):.1f} MiB of entries"
               + (f" (and {'; '.join(self.torch_dirs)})" if self.torch_dirs else "")
               + ("; inductor's CPU ISA probe replayed from its record" if cpu_isa.counts()["replayed"] else "")]
        if self.saved_mib is not None:
            out.append(f"  compile cache: saved {self.saved_mib:.1f} MiB as entry {self.key[:12]}")
        if self.problem:
            out.append(f"  compile cache: not saved: {self.problem}")
        return out
