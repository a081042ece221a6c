"""Security: the pack runs no code it did not ship, installs nothing and writes only where it may.

- Static (``ast``, every .py file in the checkout but the tests and docs: the pack and bench/, which
  ships in the same folder): no eval / exec / compile() / dynamic import of a computed name, no
  os.system, no unpickling (pickle, marshal, torch.load without weights_only=True, yaml.load), and
  a process started only where ``PROCESSES`` lists it,
  with no pip / install / ensurepip / uv / conda in its command line. Each list names file,
  function and why; a new use fails until it is listed (and a stale entry fails too).
- The compile cache hands torch's Mega-Cache loader (which unpickles what it loads, then and when
  inductor reads it) only bytes the pack wrote: an entry whose .json (format, key, size, sha256)
  does not vouch for its .bin, or any other file in the folder, reaches no deserializer.
- At run time, a real compile + warmup + cache save writes only under the configured cache
  folder, the system temp folder and the test's own folder: never the package, home or cwd.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from unet_compiler.compiler.lifecycle.scheduler import process_scheduler
from unet_compiler.tests._pack import ROOT, py_files

#: what the static scan reads: the pack and bench/ (development tools, shipped in the same folder)
SCANNED = py_files(leave_out=("tests", "docs"))


# ---- the scanner ---------------------------------------------------------------------------------
#: what starts a process (resolved through the file's imports and aliases)
PROCESS_CALLS = ("subprocess.", "os.system", "os.popen", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
                 "pty.spawn", "asyncio.create_subprocess_", "multiprocessing.Process")
#: words that make a command line an install, wherever they appear in it
INSTALL_WORDS = ("pip", "pip3", "install", "ensurepip", "uv", "conda", "mamba", "easy_install")
#: calls that unpickle (or execute) what they read, always
DESERIALIZERS = ("pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "cPickle.load",
                 "cPickle.loads", "marshal.load", "marshal.loads", "dill.load", "dill.loads", "shelve.open",
                 "joblib.load", "yaml.unsafe_load", "yaml.full_load", "numpy.load", "jsonpickle.decode")
#: torch's Mega-Cache loaders: they unpickle artifacts; only compiler/cache/megacache.py may call them
MEGACACHE_LOADERS = ("load_cache_artifacts", "populate_caches", "to_list", "deserialize")


@dataclass(frozen=True)
class Finding:
    file: str       # relative to the pack's root
    function: str   # enclosing def (Class.method), or <module>
    kind: str       # eval, exec, compile, dynamic-import, process, install, unpickle, torch.load, megacache
    detail: str     # the call as written

    def __str__(self):
        return f"{self.file}:{self.function}: {self.kind}: {self.detail}"


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _strings(node) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _is_constant(node) -> bool:
    return isinstance(node, ast.Constant)


class _Scan(ast.NodeVisitor):
    def __init__(self, rel: str):
        self.rel, self.found = rel, []
        self.aliases: dict[str, str] = {}   # local name -> module or module.attr it was imported as
        self.stack: list[str] = []
        self.functions: list[ast.AST] = []

    # imports (module level and local): record what each bound name means
    def visit_Import(self, node):
        for a in node.names:
            self.aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node):
        base = node.module or ""
        for a in node.names:
            self.aliases[a.asname or a.name] = f"{base}.{a.name}" if base else a.name

    def _scoped(self, node):
        self.stack.append(node.name)
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _resolve(self, func) -> str | None:
        name = _dotted(func)
        if name is None:   # a method of a computed object (``f().load(...)``): its name alone
            return "?." + func.attr if isinstance(func, ast.Attribute) else None
        head, _, rest = name.partition(".")
        if head in self.aliases:
            head = self.aliases[head]
        return f"{head}.{rest}" if rest else head

    def _add(self, kind, node):
        fn = ".".join(self.stack) or "<module>"
        self.found.append(Finding(self.rel, fn, kind, ast.unparse(node)[:160]))

    def _argv_strings(self, node) -> list[str]:
        """String constants in the call and in what its argument names were assigned in the same function."""
        out = _strings(node)
        names = {n.id for a in [*node.args, *(k.value for k in node.keywords)] for n in ast.walk(a)
                 if isinstance(n, ast.Name)}
        scope = self.functions[-1] if self.functions else None
        for n in ast.walk(scope) if scope is not None else ():
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(isinstance(t, ast.Name) and t.id in names for t in targets) and n.value is not None:
                    out += _strings(n.value)
        return out

    def visit_Call(self, node):
        name = self._resolve(node.func)
        plain = node.func.id if isinstance(node.func, ast.Name) else None
        if name in ("builtins.eval", "builtins.exec", "builtins.compile"):
            plain = name.split(".")[1]
        if plain in ("eval", "exec", "compile") and plain not in self.aliases or name in (
                "builtins.eval", "builtins.exec", "builtins.compile"):
            self._add(plain, node)
        elif plain == "__import__" and not (node.args and _is_constant(node.args[0])):
            self._add("dynamic-import", node)
        elif name in ("importlib.import_module", "importlib.__import__") and not (node.args and _is_constant(node.args[0])):
            self._add("dynamic-import", node)
        elif name is not None and name.startswith(PROCESS_CALLS):
            self._add("process", node)
            words = {w for s in self._argv_strings(node) for w in s.replace("/", " ").replace("=", " ").split()}
            if words & set(INSTALL_WORDS):
                self._add("install", node)
        elif name is not None and (name in DESERIALIZERS or name == "yaml.load" and not any(
                "Safe" in ast.unparse(k.value) for k in node.keywords) and not any(
                "Safe" in ast.unparse(a) for a in node.args[1:])):
            self._add("unpickle", node)
        elif name is not None and name.split(".")[-1] == "load" and name.startswith("torch."):
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
            if not safe:
                self._add("torch.load", node)
        elif name is not None and name.split(".")[-1] in MEGACACHE_LOADERS:
            self._add("megacache", node)
        self.generic_visit(node)


def scan_source(source: str, rel: str = "<string>") -> list[Finding]:
    s = _Scan(rel)
    s.visit(ast.parse(source))
    return s.found


def scan_pack() -> list[Finding]:
    return [f for p in SCANNED for f in scan_source(p.read_text(encoding="utf-8"), p.relative_to(ROOT).as_posix())]


# ---- the allow-lists: (file, function) -> why -----------------------------------------------------
PROCESSES = {
    ("bench/run.py", "_run_row"): "the benchmark runs each row in a fresh python process (`-m unet_compiler.bench "
                                   "run --row`) so its cold compile is cold",
    ("bench/dynamic.py", "main"): "bench dynamic measures in a fresh python process (`-m unet_compiler.bench "
                                  "dynamic --here`) with fresh compile caches, so its cold seconds are cold",
    ("bench/beside.py", "main"): "bench beside runs each row in a fresh python process (`-m unet_compiler.bench "
                                 "beside --row`): its compile thread and caches start fresh",
    ("bench/comfy_server.py", "build_checkpoint"): "tests/bench: builds the random-weight test checkpoint with "
                                                   "ComfyUI's classes in a python subprocess (cwd = the ComfyUI tree)",
    ("bench/comfy_server.py", "patch_assets"): "tests/bench: builds a random LoRA / ControlNet / T2I-Adapter for "
                                                "that checkpoint the same way",
    ("bench/comfy_server.py", "flux_files"): "tests/bench: builds a random-weight Flux-architecture model and a LoRA "
                                              "for it the same way",
    ("bench/comfy_server.py", "start_server"): "tests/bench: starts a headless ComfyUI server (main.py) on a local "
                                                "port",
    ("bench/storage.py", "main"): "the storage bench runs each weight_dtype in a fresh python process (`-m "
                                  "unet_compiler.bench storage --row`, cwd = the ComfyUI tree) so its compile is cold",
    ("bench/starts.py", "_read_only"): "the fleet-start bench: `mount --bind` / `remount,ro` / `umount` of a temp "
                                       "folder to simulate a read-only shared cache (root only)",
    ("bench/hosttime.py", "dispatch_rows"): "times triton's dispatch in a fresh python process (`-m "
                                            "unet_compiler.bench hosttime --dispatch-child`): it swaps triton's driver",
    ("bench/targets.py", "sass_of"): "runs triton's bundled cuobjdump to read a compiled kernel's SASS",
    ("bin/dev.py", "is_complete"): "the developers' env tool (bin/setup, bin/test, bin/bench; never imported by the "
                                   "pack): asks the env's python whether it finds torch, pytest and this checkout",
    ("bin/dev.py", "setup"): "the same tool: makes the developers' venv (python -m venv, the env's own python -m pip "
                             "pinned by constraints.txt), prints that plan for --dry-run (list2cmdline)",
    ("bin/dev.py", "run_in_env"): "the same tool: runs pytest / the bench in that env (exec on POSIX)",
    ("bin/dev.py", "installed"): "the same tool: asks the env's python which distributions it holds "
                                 "(importlib.metadata), for the lock and the newest lane's changes",
    ("bin/dev.py", "torchvision_cpu"): "the same tool: asks the env's python whether torchvision imports, before "
                                       "and after guarding its two unguarded fake registrations",
    ("bench/targets.py", "main"): "one python process per GPU target (`-m unet_compiler.bench.targets --cap N`): "
                                  "triton keeps its target per process",
    ("bench/gpu.py", "Check.run"): "the GPU check runs each step (pytest, a probe, the bench) as a python process "
                                   "with its own log and time cap",
    ("bench/gpu.py", "Check.env_line"): "the GPU check's first summary line: the env's python prints its torch / "
                                        "triton / GPU, and nvidia-smi its driver",
    ("bench/gpu_carry.py", "prepare"): "the GPU call's carry, made on request (`bench gpu --prepare`): `pip "
                                       "download` of the wheels the GPU image lacks (nothing is installed) and the "
                                       "trimmed ComfyUI tree's import check in a fresh python",
    ("bench/gpu_probes.py", "alloc"): "each CUDA graph capture stage in its own python process under one allocator "
                                      "(a C++ abort there kills only that process)",
}
DYNAMIC_IMPORTS = {
    ("compiler/backends/__init__.py", "lookup_backend"): "imports `.<name>` only after checking the name against "
                                                         "the package's own backends/ modules (pkgutil)",
    ("compiler/compat/diffusers.py", "_first_attr"): "tries the module-level constant lists of diffusers' two layouts",
    ("bench/targets.py", "run_target"): "imports the kernel modules named in the constant FAMILIES",
}
MEGACACHE = {
    ("compiler/cache/megacache.py", "artifacts"): "reads torch's Mega-Cache stream; compiler/cache/entry.py hands it "
                                                   "only an entry whose .json (format, key, size, sha256) matches",
    ("compiler/cache/megacache.py", "load"): "the same entry, to torch's caches (public call where the "
                                              "serializer is missing)",
    ("compiler/lifecycle/variants.py", "_deserialize"): "a precompiled region variant of the same entry, which "
                                                 "compiler/cache/entry.py hands over only after its .json matched",
}


def _by_kind(findings, *kinds):
    return [f for f in findings if f.kind in kinds]


def test_no_eval_exec_or_compile_of_code():
    bad = _by_kind(scan_pack(), "eval", "exec", "compile")
    assert not bad, "the pack must not run code it builds at run time:\n" + "\n".join(map(str, bad))


def test_dynamic_imports_only_of_the_packs_own_names():
    found = _by_kind(scan_pack(), "dynamic-import")
    new = [f for f in found if (f.file, f.function) not in DYNAMIC_IMPORTS]
    assert not new, "an import of a computed name; list it in DYNAMIC_IMPORTS with why:\n" + "\n".join(map(str, new))
    stale = set(DYNAMIC_IMPORTS) - {(f.file, f.function) for f in found}
    assert not stale, f"DYNAMIC_IMPORTS lists what is gone: {stale}"


def test_processes_only_where_listed_and_never_an_install():
    found = scan_pack()
    installs = _by_kind(found, "install")
    assert not installs, "the pack must never install anything at run time:\n" + "\n".join(map(str, installs))
    procs = _by_kind(found, "process")
    new = [f for f in procs if (f.file, f.function) not in PROCESSES]
    assert not new, "a new process start; list it in PROCESSES with why:\n" + "\n".join(map(str, new))
    stale = set(PROCESSES) - {(f.file, f.function) for f in procs}
    assert not stale, f"PROCESSES lists what is gone: {stale}"


def test_nothing_unpickled_outside_the_checked_compile_cache():
    found = scan_pack()
    bad = _by_kind(found, "unpickle", "torch.load")
    assert not bad, "the pack must not unpickle (torch.load needs weights_only=True):\n" + "\n".join(map(str, bad))
    mega = _by_kind(found, "megacache")
    new = [f for f in mega if (f.file, f.function) not in MEGACACHE]
    assert not new, "torch's Mega-Cache loader unpickles; only compiler/cache/megacache.py may call it:\n" + \
        "\n".join(map(str, new))
    assert {(f.file, f.function) for f in mega} == set(MEGACACHE)


@pytest.mark.parametrize("source,kind", [
    ('eval("1")', "eval"),
    ("exec(code)", "exec"),
    ("compile(src, 'f', 'exec')", "compile"),
    ("__import__(name)", "dynamic-import"),
    ("import importlib\nimportlib.import_module(user_text)", "dynamic-import"),
    ("import os\nos.system('ls')", "process"),
    ("import subprocess as sp\nsp.check_call([sys.executable, '-m', 'pip', 'install', 'triton'])", "install"),
    ("from subprocess import run\ndef f():\n    cmd = ['uv', 'pip', 'install', 'x']\n    run(cmd)", "install"),
    ("import subprocess\nsubprocess.Popen('conda install -y triton', shell=True)", "install"),
    ("import pickle\npickle.loads(data)", "unpickle"),
    ("from pickle import load\nload(f)", "unpickle"),
    ("import marshal\nmarshal.loads(b)", "unpickle"),
    ("import yaml\nyaml.load(text)", "unpickle"),
    ("import torch\ntorch.load(path)", "torch.load"),
    ("import torch\ntorch.load(path, weights_only=False)", "torch.load"),
    ("import torch\ntorch.compiler.load_cache_artifacts(data)", "megacache"),
])
def test_the_scanner_finds_each_forbidden_call(source, kind):
    assert kind in {f.kind for f in scan_source(source)}, scan_source(source)


@pytest.mark.parametrize("source", [
    "model.eval()", "torch.compile(fn)", "re.compile('x')", "import torch\ntorch.load(p, weights_only=True)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)", "import yaml\nyaml.safe_load(text)",
    "importlib.import_module('diffusers')", "json.loads(s)",
])
def test_the_scanner_lets_harmless_calls_be(source):
    assert scan_source(source) == []


# ---- the compile cache refuses what it did not write ---------------------------------------------
@pytest.fixture
def deserializers(monkeypatch):
    """Every door to unpickling what the cache folder holds, recording what reaches it (the pack's
    own path, torch's public loader, its serializer, pickle itself)."""
    import pickle

    import torch
    import torch.compiler._cache as tc

    from unet_compiler.compiler.cache import megacache
    reached = []

    def record(name):
        def door(*args, **kwargs):
            reached.append(name)
            raise RuntimeError(f"{name} reached")
        return door
    monkeypatch.setattr(megacache, "artifacts", record("megacache.artifacts"))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", record("torch.compiler.load_cache_artifacts"))
    monkeypatch.setattr(tc.CacheArtifactManager, "deserialize", staticmethod(record("CacheArtifactManager.deserialize")))
    monkeypatch.setattr(tc.CacheArtifactManager, "populate_caches", staticmethod(record("populate_caches")))
    from torch._dynamo.aot_compile import AOTCompiledFunction
    monkeypatch.setattr(AOTCompiledFunction, "deserialize", classmethod(record("AOTCompiledFunction.deserialize")))
    monkeypatch.setattr(pickle, "loads", record("pickle.loads"))
    monkeypatch.setattr(pickle, "load", record("pickle.load"))
    return reached


@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    from unet_compiler.compiler import cache as C
    monkeypatch.setenv(C.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(C.MODE_ENV, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))   # the user's: left alone
    monkeypatch.setattr(C.entry, "_loaded", set())
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache"


class _Evil:
    """Unpickling this runs code; the test fails if anything does."""
    def __reduce__(self):
        return (pytest.fail, ("a foreign cache file was unpickled",))


FOREIGN = ["no-json", "json-of-another-format", "json-of-another-key", "json-with-wrong-sha", "truncated",
           "json-naming-a-file-elsewhere",
           "other-name"]


@pytest.mark.parametrize("case", FOREIGN)
def test_a_foreign_cache_file_reaches_no_deserializer(tiny_unet, cache_folder, deserializers, case):
    """A file the pack's .json does not vouch for (or a file of another name) is never handed to a
    deserializer: not by load() before compiling, nor by save(), which reads the entry to merge."""
    import pickle

    import torch
    from unittest import mock

    from unet_compiler.compiler import cache as C
    from unet_compiler.compiler.config import CompileConfig
    entry = C.CompileCache(tiny_unet(), CompileConfig(backend="inductor"), "cpu", process_scheduler())
    bin_path, meta_path = entry.paths
    payload = pickle.dumps(_Evil())

    def plant():
        def meta(**over):
            return json.dumps({"format": C.FORMAT, "key": entry.key, "size": len(payload),
                               "sha256": hashlib.sha256(payload).hexdigest(), **over})
        if case == "other-name":            # not this model's entry
            (cache_folder / ("0" * 32 + ".bin")).write_bytes(payload)
            (cache_folder / ("0" * 32 + ".json")).write_text(meta(key="0" * 32))
            return
        bin_path.write_bytes(payload if case != "truncated" else payload[:-3])
        meta_path.unlink(missing_ok=True)
        if case == "truncated":
            meta_path.write_text(meta())
        elif case == "json-of-another-format":
            meta_path.write_text(meta(format="someone-else-1"))
        elif case == "json-of-another-key":
            meta_path.write_text(meta(key="f" * 32))
        elif case == "json-with-wrong-sha":
            meta_path.write_text(meta(sha256="0" * 64))
        elif case == "json-naming-a-file-elsewhere":   # its own sha, but not a .bin of this key in the folder
            (cache_folder.parent / "elsewhere.bin").write_bytes(payload)
            meta_path.write_text(meta(bin="../elsewhere.bin"))

    plant()
    assert entry.load() is False
    plant()
    with mock.patch.object(torch.compiler, "save_cache_artifacts", lambda: (b"the pack's own bytes", None)):
        entry.save()
    assert deserializers == [], f"a foreign cache file reached {deserializers}"
    assert C.unpack_entry(entry.paths[0].read_bytes())[0] == b"the pack's own bytes", \
        "the pack wrote its own entry, merged with nothing"


def test_the_packs_own_entry_is_what_reaches_the_loader(tiny_unet, cache_folder, deserializers):
    """Control: an entry the pack wrote (its .json matches) is handed to the deserializer, so the
    doors recorded above are the real path (the bytes here are not torch's, so it refuses them)."""
    from unet_compiler.compiler import cache as C
    from unet_compiler.compiler.config import CompileConfig
    import torch
    from unittest import mock
    entry = C.CompileCache(tiny_unet(), CompileConfig(backend="inductor"), "cpu", process_scheduler())
    with mock.patch.object(torch.compiler, "save_cache_artifacts", lambda: (b"written by the pack", None)):
        entry.save()
    assert C.unpack_entry(entry.paths[0].read_bytes())[0] == b"written by the pack" and deserializers == []
    C.entry._loaded.clear()
    fresh = C.CompileCache(tiny_unet(), CompileConfig(backend="inductor"), "cpu", process_scheduler())
    assert fresh.load() is False and "torch could not load" in fresh.state
    assert deserializers == ["megacache.artifacts"], deserializers


# ---- run time: where a real compile, warmup and cache save write ----------------------------------
_WRITES = textwrap.dedent('''
    import json, os, sys
    writes, on = [], [False]
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def where(path, dir_fd=None):
        """An absolute path; one relative to a directory descriptor (shutil.rmtree's) resolved through it."""
        path = os.fsdecode(path)
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):   # -1: none given
            try:
                return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
            except OSError:
                return f"<fd {dir_fd}>/{path}"
        return os.path.abspath(path)

    def hook(event, args):          # audit hooks cannot be removed: this one records only while on
        if not on[0]:
            return
        if event == "open":
            path, mode, flags = (list(args) + [None, None])[:3]
            if isinstance(path, int) or path is None:
                return
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & WRITE_FLAGS):
                writes.append([event, where(path)])
        elif event in ("os.rename", "os.replace"):      # src, dst, src_dir_fd, dst_dir_fd
            writes.append([event, where(args[1], args[3])])
        elif event in ("os.link", "os.symlink", "shutil.copyfile", "shutil.copytree", "shutil.move"):
            writes.append([event, where(args[1])])
        elif event == "os.mkdir":                         # path, mode, dir_fd
            if not os.path.isdir(where(args[0], args[2])):   # makedirs(exist_ok) of what exists writes nothing
                writes.append([event, where(args[0], args[2])])
        elif event in ("os.remove", "os.rmdir"):          # path, dir_fd
            writes.append([event, where(args[0], args[1])])
        elif event in ("os.truncate", "os.chmod", "os.utime", "shutil.rmtree", "os.mkfifo", "os.mknod"):
            if not isinstance(args[0], int):
                writes.append([event, where(args[0])])
    sys.addaudithook(hook)

    import tempfile, torch, diffusers
    from unet_compiler.compiler import api
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, norm_num_groups=8).eval()
    on[0] = True
    api.compile_unet(unet, "inductor", dynamic_shapes=False)
    report = api.warmup(unet, "1x64x64", context_tokens=6)
    on[0] = False
    print("RESULT" + json.dumps({"writes": writes, "report": report, "tmp": tempfile.gettempdir(),
                                 "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
''')


def _files(folder: Path) -> dict:
    """Every file under ``folder`` with its mtime and size, less git's and the editable install's
    metadata (``*.egg-info``: pip rewrites it when another env installs this checkout, as CI's newest
    lane does beside the full lane; the pack never writes it) and the tests' folder (the other tests,
    in pytest-xdist workers beside this one, write there: the browser test's screenshots; the audit
    hook still sees any write of the pack's own process under it)."""
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")
            if p.is_file() and not any(part == ".git" or part.endswith(".egg-info")
                                       for part in p.relative_to(folder).parts)
            and p.relative_to(folder).parts[0] != "tests"}


def _under(path: str, root) -> bool:
    try:
        return Path(path).resolve().is_relative_to(Path(root).resolve())
    except OSError:
        return False


@pytest.mark.slow
def test_a_real_compile_writes_only_where_it_may(tmp_path):
    """Cold compile + warmup + compile-cache save of the tiny UNet in a fresh process (cache on, in
    tmp_path; torch's inductor cache left to the pack to place), recording every file opened for
    writing, created, moved or removed (Python audit hooks), plus what appeared in the package,
    home and cwd folders (C++ compiler output does not pass through Python). ~1 min here."""
    home, cwd, cache = tmp_path / "home", tmp_path / "cwd", tmp_path / "cache"
    for folder in (home, cwd, tmp_path / "tmp"):
        folder.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "UNET_COMPILER_CACHE")}
    # TMPDIR: the system temp folder (torch's own caches, its precompiled headers) fresh and this test's,
    # so the run is cold whatever the machine's /tmp holds; bytecode caches are the interpreter's
    env.update(HOME=str(home), TMPDIR=str(tmp_path / "tmp"), UNET_COMPILER_CACHE="on",
               UNET_COMPILER_CACHE_DIR=str(cache), PYTHONDONTWRITEBYTECODE="1", TORCH_NUM_THREADS="1")
    package_before = _files(ROOT)
    proc = subprocess.run([sys.executable, "-c", _WRITES], env=env, cwd=str(cwd), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert "compile cache: saved" in got["report"], got["report"]
    assert list(cache.glob("*.bin")) and _under(got["inductor"], cache), "the run wrote its cache entry"
    assert _under(got["tmp"], tmp_path / "tmp"), got["tmp"]
    writes = got["writes"]
    assert any(_under(p, cache) for _, p in writes), "the audit hook saw the cache writes"
    forbidden = {"the package": ROOT, "home": home, "the cwd": cwd}
    allowed = [cache, tmp_path / "tmp", got["tmp"], "/dev"]   # the real home and /tmp are outside them
    bad = [(event, p, where) for event, p in writes for where, root in forbidden.items() if _under(p, root)]
    bad += [(event, p, "outside the allowed folders") for event, p in writes
            if not any(_under(p, root) for root in allowed)]
    assert not bad, "writes where the pack must not write:\n" + "\n".join(map(str, bad))
    assert not any(home.rglob("*")) and not any(cwd.rglob("*")), (list(home.rglob("*")), list(cwd.rglob("*")))
    changed = {p for p, st in _files(ROOT).items() if package_before.get(p) != st}
    assert not changed, f"files in the package folder changed: {sorted(changed)[:10]}"
