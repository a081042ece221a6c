"""One compile cache entry per model and setup: the precompiled region variants and torch's Mega-Cache.

An entry is ``<key>.bin`` (a header, the Mega-Cache bytes, each variant's bytes) and ``<key>.json``
(the key's facts, the .bin's size and sha256, the probe shapes warmup ran into it and the compares
recorded when its code compiled). A .bin that does not match its .json is never handed to torch
(whose loader unpickles): it is discarded with one log line and rebuilt. A save writes the union of
what the entry held and what this process added; a read-only folder is read, never written.
Folder and modes: ``UNET_COMPILER_CACHE_DIR``, ``UNET_COMPILER_CACHE`` (compiler/settings.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch

from .. import settings
from ..reasons import error_summary
from . import cpu_isa, megacache, torch_dirs
from . import files
from .key import FORMAT, key_facts, key_of

log = logging.getLogger(__name__)

DIR_ENV = settings.env("CACHE_DIR")
MODE_ENV = settings.env("CACHE")
#: a save's temporary file or an entry file no .json names, older than this, is a leftover of a
#: process killed mid-save (a save writes and commits its entry in seconds)
LEFT_PARTIAL_SECONDS = 600
#: an entry's key (``key.key_of``): the .json files eviction may remove
_KEY = re.compile(r"^[0-9a-f]{32}$")
#: digests of unusable variants a save of this process left out already (a save each, not one per model)
_DROPPED: set[str] = set()
_MAGIC = b"UNET-COMPILER-ENTRY-2\n"
_loaded: set = set()       # keys loaded into this process's torch caches
_cleared = [False]


def cache_days() -> float:
    """``UNET_COMPILER_CACHE_DAYS`` as a number of days (its default where it is not one; 0: never)."""
    try:
        days = float(settings.value("CACHE_DAYS"))
    except ValueError:
        days = float("nan")
    return days if math.isfinite(days) else float(settings.SETTINGS["CACHE_DAYS"].default)


def mode() -> str:
    """on, off or clear (``UNET_COMPILER_CACHE``)."""
    return settings.choice("CACHE")


def directory() -> Path:
    env = settings.value("CACHE_DIR")
    if env:
        return Path(env).expanduser()
    try:
        import folder_paths  # ComfyUI's: present when running inside ComfyUI
        return Path(folder_paths.get_user_directory()) / "unet_compiler" / "compile_cache"
    except Exception:  # not inside ComfyUI
        return Path.home() / ".cache" / "unet_compiler" / "compile_cache"


def size_mib(folder: Path) -> float:
    try:
        return sum(p.stat().st_size for p in folder.glob("*.bin")) / 2**20
    except OSError:
        return 0.0


def pack_entry(mega: bytes | None, by_key: dict[str, list[bytes]]) -> bytes:
    """An entry's .bin: a header (JSON: the sizes of what follows), torch's Mega-Cache bytes, then
    each precompiled region variant's bytes (``precompiled.py``)."""
    mega = mega or b""
    order = [(k, b) for k, blobs in sorted(by_key.items()) for b in blobs]
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
    by_key: dict[str, list[bytes]] = {}
    for key, n in header["variants"]:
        by_key.setdefault(key, []).append(data[at:at + n])
        at += n
    if at != len(data):
        raise ValueError("entry length does not match its header")
    return mega or None, by_key


def merge_variants(old: dict, new: dict, drop: set | frozenset = frozenset()) -> dict:
    """Every variant of both, each once (by its bytes' sha256), but those whose sha256 is in ``drop``."""
    out: dict[str, dict[str, bytes]] = {}
    for src in (old, new):
        for key, blobs in src.items():
            for b in blobs:
                digest = hashlib.sha256(b).hexdigest()
                if digest not in drop:
                    out.setdefault(key, {})[digest] = b
    return {k: v for k, v in ((k, list(v.values())) for k, v in out.items()) if v}


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
    """The cache entry of one accelerated model; ``lines()`` is what the report says of it. Its
    precompiled variants load into, and are saved from, ``scheduler``'s registry."""

    def __init__(self, unet, config, device, scheduler):
        self.scheduler = scheduler
        self.enabled = mode() != "off" and config.backend != "eager"
        self.folder = directory()
        self.facts = key_facts(unet, config, device) if self.enabled else {}
        self.key = key_of(self.facts) if self.enabled else ""
        self.state = "off (UNET_COMPILER_CACHE=off)" if mode() == "off" else "not used"
        self.problem = ""
        #: why the last save failed where a later one may not (a disk full); "" after a save that worked
        self.failed_save = ""
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
        #: (entries, bytes) this model's saves removed from the folder, unused for ``CACHE_DAYS`` days
        self.evicted = (0, 0)
        #: the variant keys this model's calls met (its accelerator's: None, every variant of the
        #: process): what a save writes besides what the entry holds
        self.met: set | None = None
        self._dirty = False    # compiled code the entry does not hold yet
        self._held: set[str] = set()      # the digests of the variants this process loaded from the entry
        self._defer = False    # inside ``one_save``

    @property
    def paths(self) -> tuple[Path, Path]:
        """(the .bin the entry's .json names now, the .json). The .json is the entry's commit
        point: each save writes a new .bin named by its digest, then replaces the .json."""
        meta_path = self.folder / f"{self.key}.json"
        try:
            meta = json.loads(files.read_text(meta_path))
        except (OSError, ValueError):
            meta = {}
        return self._bin_of(meta), meta_path

    def _bin_of(self, meta) -> Path:
        """The .bin a .json names: a plain file name of this key in the folder (anything else, or a
        .json from before named .bins, means ``<key>.bin``)."""
        name = meta.get("bin") if isinstance(meta, dict) else None
        if not (isinstance(name, str) and Path(name).name == name and name.startswith(self.key + ".")
                and name.endswith(".bin")):
            name = f"{self.key}.bin"
        return self.folder / name

    # -- what warmup records in the entry --------------------------------------------
    def record_probe(self, label: str) -> None:
        """Warmup ran probe shape ``label`` into this entry: a restart need not run it again."""
        self.primed.add(label)

    def primed_probes(self) -> set[str]:
        """Probe shapes whose code the entry holds (this process's warmups and earlier ones)."""
        return set(self.primed)

    def record_compare(self, label: str, max_abs_diff: float) -> None:
        """Warmup measured max |compiled - eager| at ``label`` for code it compiled into this entry."""
        self.compares[label] = {"max_abs_diff": max_abs_diff, "measured": time.strftime("%Y-%m-%d %H:%M")}

    def recorded_compare(self, label: str) -> dict | None:
        """The compare recorded for ``label`` ({max_abs_diff, measured}), or None (none, or
        ``UNET_COMPILER_COMPARE=always``: warmup runs the eager reference every time)."""
        if settings.choice("COMPARE") == "always":
            return None
        return self.compares.get(label)

    # -- when to save -----------------------------------------------------------------
    def compiled_new(self) -> None:
        """Something compiled that the entry does not hold: saved now, or at the end of ``one_save``."""
        self._dirty = True
        if not self._defer:
            self.save_if_new()

    def save_if_new(self) -> None:
        """Save if something compiled that the entry does not hold, or variants this process loaded
        from it were found unusable (left out: a restart would load and reject them again)."""
        rejected = (self.scheduler.variants.rejected & self._held) - _DROPPED
        if self._dirty or rejected:
            self._dirty = False
            _DROPPED.update(rejected)
            self.save()

    @contextlib.contextmanager
    def one_save(self):
        """Compiles inside are saved once, at the end (warmup: every shape in one write)."""
        prev, self._defer = self._defer, True
        try:
            yield
        finally:
            self._defer = prev
        if not prev:
            self.save_if_new()

    # -- load ----------------------------------------------------------------------
    def load(self) -> bool:
        """Hand this model's entry to torch's caches before anything compiles. True on a hit."""
        if not self.enabled:
            return False
        if mode() == "clear" and not _cleared[0]:
            _cleared[0] = True
            self._clear()
        self.torch_dirs = torch_dirs.place(self.folder)
        cpu_isa.install(self.folder)
        if self.key in _loaded:
            self.state = "hit (loaded earlier in this process)"
            with contextlib.suppress(OSError):      # used now: kept from eviction
                os.utime(self.folder / f"{self.key}.json")
            return True
        # (not ``self.paths``: that parses the .json, which ``_read`` does next)
        if not (self.folder / f"{self.key}.json").is_file() and not (self.folder / f"{self.key}.bin").is_file():
            self.state = "miss (compiles, then saves)"
            return False
        t0 = time.perf_counter()
        data, why = self._read()
        for wait in (0.05, 0.25):   # another process's save replaced the entry between our two reads
            if not why:
                break
            time.sleep(wait)
            data, why = self._read()
        if why:
            log.warning("UNet Compiler: compile cache entry %s discarded: %s; it is rebuilt", self.key, why)
            self._discard()
            self.state = f"miss (entry discarded: {why}; rebuilt after compiling)"
            return False
        try:
            mega, found = unpack_entry(data)
            if mega:
                megacache.load(mega)
            for key, blobs in found.items():
                for blob in blobs:
                    self.scheduler.variants.add_serialized(key, blob)
                    self._held.add(hashlib.sha256(blob).hexdigest())
        except Exception as e:  # a torch that cannot read it: compile as if cold
            log.warning("UNet Compiler: torch could not load compile cache entry %s (%s); it is rebuilt", self.key, e)
            self._discard()
            self.state = f"miss (torch could not load the entry: {type(e).__name__}; rebuilt)"
            return False
        _loaded.add(self.key)
        with contextlib.suppress(OSError):      # used now: kept from eviction (a read-only folder: as is)
            os.utime(self.folder / f"{self.key}.json")
        self._entry = data
        self.primed.update(_labels(self._meta))
        self.compares.update(_compares(self._meta))
        n = sum(map(len, found.values()))
        self.state = (f"hit ({len(data) / 2**20:.1f} MiB loaded in {time.perf_counter() - t0:.2f} s"
                      + (f", {n} precompiled region variant(s)" if n else "") + ")")
        return True

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
            self.problem = f"torch could not serialize its caches ({error_summary(e)})"
            log.warning("UNet Compiler: compile cache: %s", self.problem)
            return
        compiled = self.scheduler.variants.serialized(self.met)
        if (not got or not got[0]) and not compiled:
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with files.lock(self.folder / f"{self.key}.lock") as held:
                data = self._write(got[0] if got else None, compiled, held)
        except OSError as e:
            if self.folder.is_dir() and not files.writable(self.folder):
                # a fleet's shared read-only mount: by design, not a fault (no save is tried again)
                self.problem = (f"{self.folder} is read-only: its entries are read, code compiled here "
                                f"stays in memory")
                log.warning("UNet Compiler: compile cache: %s", self.problem)
                return
            if not self.folder.is_dir():   # it cannot be made (a file in the way, no permission above it)
                self.problem = (f"{self.folder} is not writable ({e.strerror or e}): compiled code is kept in "
                                f"memory only. Fix: set {DIR_ENV} to a writable folder")
                log.warning("UNet Compiler: compile cache: %s", self.problem)
                return
            # a disk full, a file another program holds: said, and tried again at the next save
            why = (f"{self.folder} could not be written ({e.strerror or e}): compiled code is kept in memory, "
                   f"the next save tries again. Fix: free disk space, or set {DIR_ENV} to a writable folder")
            if why != self.failed_save:
                log.warning("UNet Compiler: compile cache: %s", why)
            self.failed_save = why
            return
        self.failed_save = ""
        _loaded.add(self.key)
        self._entry = data
        self.saved_mib = len(data) / 2**20

    def _write(self, new_mega: bytes | None, compiled: dict, held: bool = True) -> bytes:
        """Merge what is on disk now with what this process has, write it as a new .bin, then
        commit it by replacing the .json (a reader sees the old entry or the new one, whole); the
        old .bin goes last (where another process still reads it, it stays until the next save),
        and, ``held`` the lock (no other save under way), what killed saves left."""
        # the entry keeps what it held (another process's graphs, this process's earlier saves)
        try:
            old_mega, old_variants = unpack_entry(self._current_entry())
        except ValueError:   # what this process wrote is always readable; a foreign .bin is replaced
            old_mega, old_variants = None, {}
        old_bin = self._bin_of(self._meta) if self._meta else None
        mega = megacache.merge(old_mega, new_mega) if new_mega else old_mega
        # (variants no process of this install can use: unloadable, or their traced code changed since)
        rejected = set(self.scheduler.variants.rejected)
        data = pack_entry(mega, merge_variants(old_variants, compiled, rejected))
        digest = hashlib.sha256(data).hexdigest()
        bin_path, meta_path = self.folder / f"{self.key}.{digest[:16]}.bin", self.folder / f"{self.key}.json"
        meta = {**self.facts, "key": self.key, "bin": bin_path.name, "size": len(data), "sha256": digest,
                "primed": sorted(self.primed | set(_labels(self._meta))),
                "compares": {**_compares(self._meta), **self.compares},
                "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._atomic_write(bin_path, data)
        try:
            self._atomic_write(meta_path, json.dumps(meta, indent=1, default=str).encode())
        except OSError:
            if bin_path != old_bin:    # not committed: the new .bin would be an orphan no .json names
                with contextlib.suppress(OSError):
                    bin_path.unlink(missing_ok=True)
            raise
        self._meta = meta
        # the old .bin, and any another save left when its process was killed between writing its .bin
        # and its .json, or mid-write (a .partial no process writes any more)
        leftovers = {old_bin, self.folder / f"{self.key}.bin"}
        now = time.time()
        # (old enough that no save still writes or commits it: a lock broken by mistake costs nothing)
        for left in [*self.folder.glob(f"{self.key}.*.bin"), *self.folder.glob(f"{self.key}.*.partial")] if held else ():
            with contextlib.suppress(OSError):
                if now - left.stat().st_mtime > LEFT_PARTIAL_SECONDS:
                    leftovers.add(left)
        for stale in leftovers - {None, bin_path}:
            try:
                stale.unlink(missing_ok=True)
            except OSError:   # Windows: another process has it open; the next save removes it
                pass
        if held:
            try:
                self._evict()
            except OSError as e:   # (the save itself is done)
                log.info("UNet Compiler: compile cache: old entries not looked at (%s)", error_summary(e))
        return data

    def _evict(self) -> None:
        """Remove the other entries in the folder no process loaded or saved for ``CACHE_DAYS`` days
        (each under its own lock, taken without waiting: one in use is left): every update of torch,
        ComfyUI or the pack, and every other setup, starts an entry of its own."""
        days = cache_days()
        if days <= 0:
            return
        now = time.time()
        cutoff = now - days * 86400
        keys = {p.name.split(".", 1)[0] for pattern in ("*.json", "*.bin") for p in self.folder.glob(pattern)}
        for key in sorted(k for k in keys if _KEY.match(k) and k != self.key and k not in _loaded):
            meta = self.folder / f"{key}.json"
            with contextlib.suppress(OSError, ValueError), files.lock(self.folder / f"{key}.lock", timeout=0) as held:
                bins = [p for p in (*self.folder.glob(f"{key}.*.bin"), self.folder / f"{key}.bin") if p.is_file()]
                if not held or max([p.stat().st_mtime for p in (meta, *bins) if p.is_file()], default=now) > cutoff:
                    continue
                if meta.is_file():
                    # (an entry's own .json: another program's file of a hex name stays)
                    m = json.loads(files.read_text(meta))
                    if m.get("key") != key or not str(m.get("format", "")).startswith("unet-compiler"):
                        continue
                size = sum(p.stat().st_size for p in (meta, *bins) if p.is_file())
                for p in (meta, *bins):   # (the .json first: without it the entry is gone for readers)
                    p.unlink(missing_ok=True)
                self.evicted = (self.evicted[0] + 1, self.evicted[1] + size)
        if self.evicted[0]:
            log.info("UNet Compiler: compile cache: removed %d entr(ies) unused for %g days (%.1f MiB) from %s",
                     self.evicted[0], days, self.evicted[1] / 2**20, self.folder)

    def _current_entry(self) -> bytes | None:
        """The entry on disk if it is intact (another worker may have added to it), else what this
        process loaded or wrote."""
        data, why = self._read()
        return self._entry if why else data

    def _read(self) -> tuple[bytes | None, str]:
        """The entry's bytes and why they cannot be used ("" when they match the .json the pack wrote)."""
        meta_path = self.folder / f"{self.key}.json"
        self._meta = {}
        for attempt in range(5):
            try:
                meta = json.loads(files.read_text(meta_path))
                data = self._bin_of(meta).read_bytes()
                break
            except FileNotFoundError as e:
                # a save replaced the .json and removed the .bin it named between our two reads:
                # the new .json names a .bin that is whole (written before it)
                if attempt == 4 or not meta_path.is_file():
                    return None, f"unreadable ({error_summary(e)})"
            except (OSError, ValueError) as e:
                return None, f"unreadable ({error_summary(e)})"
        why = self._mismatch(meta, data)
        if not why:
            self._meta = meta   # (the .json the pack wrote for these bytes)
        return data, why

    @staticmethod
    def _atomic_write(path: Path, data: bytes):
        files.atomic_write(path, data)

    def _discard(self):
        for p in {*self.paths, self.folder / f"{self.key}.bin"}:
            try:
                p.unlink(missing_ok=True)
            except OSError:  # a read-only mount: leave it, use nothing from it
                pass

    def _clear(self):
        """Empty the folder of what the pack and torch keep there: entries, leftovers of saves that
        were killed, locks whose holder is gone, the CPU ISA record and inductor's own folder."""
        n = 0
        found = [p for pattern in ("*.bin", "*.json", "*.partial", "*.stale") for p in self.folder.glob(pattern)]
        found += [p for p in self.folder.glob("*.lock") if files.holder_gone(p)]
        for p in found + [self.folder / cpu_isa.FILE]:
            try:   # (no record: FileNotFoundError, not counted)
                p.unlink()
                n += 1
            except OSError:
                pass
        for tree in {self.folder / "inductor", torch_dirs.short_root(self.folder)}:
            if tree.is_dir():
                n += sum(1 for f in tree.rglob("*") if f.is_file())
                shutil.rmtree(tree, ignore_errors=True)
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
        if self.evicted[0]:
            out.append(f"  compile cache: removed {self.evicted[0]} entr(ies) no process used for "
                       f"{cache_days():g} days ({self.evicted[1] / 2**20:.1f} MiB; {settings.env('CACHE_DAYS')})")
        if self.problem or self.failed_save:
            out.append(f"  compile cache: not saved: {self.problem or self.failed_save}")
        return out
