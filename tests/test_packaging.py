"""Install surface: what ComfyUI-Manager and the Comfy Registry read, and a clean import of the pack
(no ComfyUI, triton, IPEX or diffusers needed)."""
import ast
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest
from pathlib import Path

from unet_compiler.tests._pack import ROOT, module_name, py_files


def test_requirements_install_nothing_heavy():
    """ComfyUI-Manager pip-installs each line: never torch, triton or IPEX."""
    lines = [ln.strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    banned = re.compile(r"^(torch|torchvision|torchaudio|triton|triton-windows|intel[-_]extension[-_]for[-_]pytorch)\b",
                        re.I)
    assert not [ln for ln in lines if banned.match(ln)], lines


def test_pyproject_registry_fields():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    proj, comfy = meta["project"], meta["tool"]["comfy"]
    name = proj["name"]
    # registry id rules: <100 chars, alnum/-/_/., no leading digit/special, no consecutive specials, no "ComfyUI"
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9._-]*", name) and not re.search(r"[._-]{2}", name)
    assert "comfyui" not in name.lower()
    assert re.fullmatch(r"\d+\.\d+\.\d+", proj["version"])
    assert proj["dependencies"] == []
    assert proj["urls"]["Repository"].startswith("https://")
    assert comfy["PublisherId"] and comfy["DisplayName"]
    assert comfy["Icon"].startswith("https://") and comfy["Icon"].endswith("docs/icon.svg")
    assert (ROOT / "docs" / "icon.svg").is_file()
    assert "web" not in comfy  # WEB_DIRECTORY is set in __init__.py; both would register the extension twice
    # every package the code imports is listed for the standalone install; the bench (development
    # tooling, run from a checkout) is not shipped, and the pack's entry point says so where it is missing
    pkgs = set(meta["tool"]["setuptools"]["packages"])
    for folder in [ROOT, *_subpackages(ROOT)]:
        rel = folder.relative_to(ROOT)
        shipped = ".".join(("unet_compiler",) + rel.parts)
        assert (shipped in pkgs) == (rel.parts[:1] != ("bench",)), rel
    assert "runs from a checkout" in (ROOT / "__main__.py").read_text(encoding="utf-8")
    # ... with the front-end extension and every example workflow beside the code
    data = meta["tool"]["setuptools"]["package-data"]["unet_compiler"]
    shipped = {f for pattern in data for f in ROOT.glob(pattern)}
    for f in [*(ROOT / "web").glob("*.js"), *(ROOT / "example_workflows").rglob("*.json")]:
        assert f in shipped, f


def _subpackages(folder: Path):
    """The pack's subpackages: folders with an ``__init__.py`` reached through folders that have one,
    so nothing in a virtual env, build or cache folder beside the code (README's ``.venv``) counts."""
    for sub in sorted(folder.iterdir()):
        if (sub.is_dir() and (sub / "__init__.py").is_file() and not sub.name.startswith(".")
                and sub.name not in ("tests", "docs", "example_workflows", "web")):
            yield sub
            yield from _subpackages(sub)


def test_ruff_security_rules_clean():
    """No exec / eval anywhere (the Registry scans for them)."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "S102,S307", str(ROOT)],
                       capture_output=True, text=True)
    if r.returncode != 0 and "No module named ruff" in r.stderr:
        # everything the Registry scans (the tests too), not only what the pack runs
        src = "\n".join(p.read_text() for p in ROOT.rglob("*.py")
                        if "_artifacts" not in p.parts and not any(d.startswith(".") for d in p.relative_to(ROOT).parts))
        assert not re.search(r"(?<![\w.])(exec|eval)\(", src)
    else:
        assert r.returncode == 0, r.stdout + r.stderr


def test_readme_commands_are_what_ci_runs():
    """The README's first block is bin/bench and bin/test; each makes its env with bin/setup (CPU torch
    pinned by the tracked constraints.txt) when it is missing and reuses it when present, and .ci/run's
    main lane is bin/test in a freshly removed env (UNET_COMPILER_CI_ENV, default the README's .venv,
    handed to bin/test as UNET_COMPILER_ENV): CI sees what a newcomer sees."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    commands = [ln.strip() for ln in block.splitlines() if ln.startswith("    ") and not ln.strip().startswith("#")]
    assert commands == ["bin/bench", "bin/test"], commands
    bench, test, setup = ((ROOT / "bin" / name).read_text(encoding="utf-8") for name in ("bench", "test", "setup"))
    for script, cmd in ((bench, "bench"), (test, "test"), (setup, "setup")):
        assert script.rstrip().endswith(f'exec python3 "$(dirname "$0")/dev.py" {cmd} "$@"'), script
    src = (ROOT / "bin" / "dev.py").read_text(encoding="utf-8")
    assert 'run_in_env(["-m", "pytest", "-q", *lane_args(rest), *worker_args(rest)])' in src   # the quick lane unless asked
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 0 <= ci.find("\nbin/test\n") < ci.find("\nbin/test --full\n"), "CI runs the README's command, then the full lane"
    assert 'run_in_env(["-m", "unet_compiler.bench", "run", *rest])' in src
    assert 'os.environ.get("UNET_COMPILER_ENV") or ".venv"' in src and "setup(env, if_missing=True)" in src
    assert all((ROOT / "bin" / name).stat().st_mode & 0o111 for name in ("bench", "setup", "test"))
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ENV=${UNET_COMPILER_CI_ENV:-.venv}" in ci and 'rm -rf "$ENV"' in ci
    assert 'export UNET_COMPILER_ENV="$ENV"' in ci and "\nbin/test\n" in ci
    assert ci.index('rm -rf "$ENV"') < ci.index('export UNET_COMPILER_ENV="$ENV"') < ci.index("\nbin/test\n")
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()   # the lock (below) keeps CPU torch
    tracked = subprocess.run(["git", "ls-files", "constraints.txt", "bin"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:  # a git checkout (not an sdist): the files the README needs are committed
        assert tracked.stdout.split() == ["bin/bench", "bin/dev.py", "bin/setup", "bin/test", "constraints.txt"], \
            tracked.stdout


def _dev():
    """bin/dev.py as a module (it is a script, not part of the pack)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("unet_compiler_dev", ROOT / "bin" / "dev.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("how", ["bin/setup", "python bin/dev.py"])
def test_an_env_that_is_there_is_reused(how):
    """``bin/setup --if-missing ENV`` (what bin/bench and bin/test run first), and the same through
    ``python bin/dev.py`` (no shell, as on Windows), leave a complete env of this checkout alone: no
    venv, no pip, at once."""
    cmd = [str(ROOT / "bin" / "setup")] if how == "bin/setup" else [sys.executable, str(ROOT / "bin" / "dev.py"), "setup"]
    r = subprocess.run(cmd + ["--if-missing", sys.prefix], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout and not r.stderr, r.stdout + r.stderr


def test_dev_test_runs_pytest_in_the_env_without_a_shell():
    """``python bin/dev.py test ARGS`` (the Windows way to run bin/test) runs pytest in the env named by
    UNET_COMPILER_ENV, in the checkout, with the caller's arguments."""
    import os
    env = dict(os.environ, UNET_COMPILER_ENV=sys.prefix)
    r = subprocess.run([sys.executable, str(ROOT / "bin" / "dev.py"), "test", "--collect-only",
                        "tests/test_packaging.py::test_requirements_install_nothing_heavy"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=str(ROOT.parent))
    assert r.returncode == 0 and "1 test collected" in r.stdout, r.stdout + r.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "bin" / "dev.py"), "setup", "--nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--nope" in bad.stderr and "usage" in bad.stderr, bad.stderr


def test_the_env_is_the_lock(tmp_path, monkeypatch):
    """constraints.txt is the lock: one ``name==version`` a line for every package this env holds (less
    the venv's pip and the pack), torch at 2.13.0; ``bin/dev.py lock`` of this env writes it back
    unchanged. An env that is not the lock: ``bin/setup`` makes it so (or the lock is stale:
    docs/testing.md, "The lock")."""
    dev = _dev()
    text = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    pins = dev.read_lock(text)
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == len(pins) and lines == sorted(lines, key=lambda ln: dev._normal(ln.split("==")[0])), lines
    assert pins["torch"] == "2.13.0" and "pip" not in pins and "unet-compiler" not in pins
    have = dev.installed(Path(sys.prefix))
    assert have == pins, ("this env is not the lock (bin/setup makes it so):\n"
                          + "\n".join(dev.lock_changes(pins, have)))
    monkeypatch.setattr(dev, "LOCK", tmp_path / "constraints.txt")
    dev.LOCK.write_text(text, encoding="utf-8")
    assert dev.lock(Path(sys.prefix)) == 0 and dev.LOCK.read_text(encoding="utf-8") == text


def test_the_newest_lane_resolves_afresh_and_says_what_moved():
    """``bin/setup --newest ENV`` pins torch alone (the rest resolves to the registry's newest), and
    what moved against the lock is a line a package: changed, new, gone."""
    dev = _dev()
    env = ROOT / ".venv-newest"
    plan = dev.setup_plan(env, comfy=ROOT, windows=False, python="python3", newest=True)
    assert all(cmd[cmd.index("-c") + 1] == str(env / "newest-pin.txt") for cmd in plan[1:4]), plan
    assert dev.TORCH_PIN == "torch==2.13.0" and plan[1][-1] == dev.TORCH_PIN
    assert dev.lock_changes({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "2.1", "d": "4"}) == [
        "  b: 2 -> 2.1", "  c: 3 -> -  (gone)", "  d: - -> 4  (new)"]
    assert dev.read_lock(dev.lock_text({"torch": "2.13.0", "foo-bar": "1.0"})) == {"torch": "2.13.0", "foo-bar": "1.0"}
    assert dev.read_lock("Foo_Bar==1.0\n# x==2\nbaz==3 # pinned\n") == {"foo-bar": "1.0", "baz": "3"}
    bad = subprocess.run([sys.executable, str(ROOT / "bin" / "dev.py"), "setup", "--newest", "--if-missing"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr, bad.stderr


def test_dev_setup_on_windows_runs_the_envs_own_python():
    """Windows simulated: the env's interpreter is ``Scripts\\python.exe``; every install runs as that
    interpreter's ``-m pip`` (never a bare pip, which on the portable build belongs to another Python)
    pinned by constraints.txt; ComfyUI's requirements go in less their torch lines."""
    from pathlib import PureWindowsPath
    dev = _dev()
    env = ROOT / ".venv-win"
    py = str(env / "Scripts" / "python.exe")
    plan = dev.setup_plan(env, comfy=ROOT, windows=True, python=r"C:\\Python311\\python.exe")
    assert plan[0] == [r"C:\\Python311\\python.exe", "-m", "venv", str(env)]
    installs = plan[1:4]
    for cmd in installs:
        assert cmd[:4] == [py, "-m", "pip", "install"] and cmd[cmd.index("-c") + 1] == str(ROOT / "constraints.txt"), cmd
    assert "torch==2.13.0" in installs[0] and f"{ROOT}[test]" in installs[1]
    assert not any(c[0] == "pip" or c[0].endswith(("pip", "pip.exe")) for c in plan)
    assert PureWindowsPath(py).name == "python.exe" and dev.env_python(env, windows=False) == env / "bin" / "python"
    assert dev.comfy_requirements("torch\ntorchvision>=0.20\n# x\ntorchaudio ; sys_platform != 'x'\ntorchsde\n"
                                  "numpy>=1.25.0\nTorch==2.1\n") == ["torchsde", "numpy>=1.25.0"]
    assert len(dev.setup_plan(env, comfy=None, windows=True)) == 3
    assert plan[-1] == [py, str(ROOT / "bin" / "dev.py"), "torchvision-cpu"]    # run by the env's python


def test_a_cuda_torchvision_is_made_to_import_beside_cpu_torch(tmp_path):
    """``dev.py torchvision-cpu`` (the env's last setup step): a torchvision whose C++ ops cannot load
    and whose meta registrations register two fakes unconditionally (the registry's CUDA build beside
    CPU torch: ``import torchvision`` fails) gets those registrations guarded and imports; a second
    run changes nothing; an importing torchvision is left alone."""
    pkg = tmp_path / "torchvision"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import extension, _meta_registrations\n")
    (pkg / "extension.py").write_text("def _has_ops():\n    return False\n")
    meta = textwrap.dedent('''\
        import torch
        import torch.library
        import torchvision.extension

        @torch.library.register_fake("torchvision::nms")
        def meta_nms(dets, scores, iou_threshold):
            return dets

        @torch.library.register_fake("torchvision::qnms")
        def meta_qnms(dets, scores, iou_threshold):
            return dets
        ''')
    (pkg / "_meta_registrations.py").write_text(meta)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}

    def run(*args):
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    assert "torchvision::nms does not exist" in run("-c", "import torchvision").stderr   # the failure itself
    fixed = run(str(ROOT / "bin" / "dev.py"), "torchvision-cpu")
    assert fixed.returncode == 0 and "2 fake registration(s) guarded" in fixed.stderr, fixed.stderr
    assert run("-c", "import torchvision").returncode == 0
    once = (pkg / "_meta_registrations.py").read_text()
    again = run(str(ROOT / "bin" / "dev.py"), "torchvision-cpu")
    assert again.returncode == 0 and (pkg / "_meta_registrations.py").read_text() == once


def test_comfyui_without_its_requirements_skips_with_one_line(tmp_path, monkeypatch):
    """A ComfyUI tree whose requirements are not in this env: the ComfyUI tests skip with one line
    naming the command that installs them (instead of failing on No module named 'psutil')."""
    from unet_compiler.tests import _families as families
    (tmp_path / "main.py").write_text("")
    (tmp_path / "requirements.txt").write_text("pytest\ntorchaudio\nno-such-dist-for-unet-compiler>=1\n# a comment\n")
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path))
    line = families.comfy_problem()
    assert line is not None and "\n" not in line and str(tmp_path) in line, line
    assert "(no-such-dist-for-unet-compiler): run " in line and ("bin/setup" in line or "pip install" in line), line
    (tmp_path / "requirements.txt").write_text("pytest\ntorchaudio\n")
    assert families.comfy_problem() is None
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path / "nowhere"))
    monkeypatch.setenv("HOME", str(tmp_path / "nowhere"))
    assert families.comfy_problem() == families.COMFY_NOT_FOUND


def _run(code, env_extra=None):
    import os
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT.parent))


def test_pack_imports_without_comfyui_triton_ipex_diffusers():
    code = f"""
    import sys, importlib.util, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in ('comfy', 'comfy_api', 'triton', 'intel_extension_for_pytorch', 'diffusers'):
                raise ImportError('blocked ' + name)
    sys.meta_path.insert(0, Block())
    spec = importlib.util.spec_from_file_location('some_custom_node_dir', {str(ROOT / '__init__.py')!r},
                                                  submodule_search_locations=[{str(ROOT)!r}])
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
    # no ComfyUI: nothing registered (V1 is gone; an older ComfyUI gets a log line, test below)
    assert not hasattr(mod, 'NODE_CLASS_MAPPINGS') and mod.WEB_DIRECTORY == './web'
    assert not hasattr(mod, 'comfy_entrypoint')
    from some_custom_node_dir.compiler.backends import resolve
    import torch
    b, _ = resolve('inductor', torch.device('cpu'))
    assert 'triton' not in sys.modules and 'intel_extension_for_pytorch' not in sys.modules
    print('ok', b.name)
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok inductor" in r.stdout


def test_old_comfyui_gets_one_log_line_and_no_nodes():
    """A ComfyUI without comfy_api.latest (older than pyproject's requires-comfyui): one line, no nodes."""
    code = f"""
    import sys, types, logging, importlib.util, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] == 'comfy_api':
                raise ImportError('blocked ' + name)
    sys.meta_path.insert(0, Block())
    sys.modules['comfy'] = types.ModuleType('comfy')   # ComfyUI's own package, loaded before custom nodes
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    spec = importlib.util.spec_from_file_location('some_custom_node_dir', {str(ROOT / '__init__.py')!r},
                                                  submodule_search_locations=[{str(ROOT)!r}])
    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod; spec.loader.exec_module(mod)
    assert not hasattr(mod, 'NODE_CLASS_MAPPINGS') and not hasattr(mod, 'comfy_entrypoint')
    print(mod.MIN_COMFYUI)
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == ["ComfyUI too old: UNet Compiler needs >= 0.3.48"], r.stderr
    import tomllib
    floor = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["comfy"]["requires-comfyui"]
    assert floor == ">=" + r.stdout.strip() == ">=0.3.48"


def test_library_api_at_the_top_level():
    """``from unet_compiler import compile_unet, warmup, report``; importing the package alone (what
    ComfyUI's node loading does first) imports neither torch nor the compiler."""
    code = """
    import sys, importlib.abc
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split('.')[0] in ('comfy', 'comfy_api'):
                raise ImportError('blocked ' + name)
    sys.meta_path.insert(0, Block())
    import unet_compiler
    assert 'torch' not in sys.modules and 'unet_compiler.compiler' not in sys.modules, 'imported eagerly'
    from unet_compiler import compile_unet, report, uncompile_unet, warmup
    from unet_compiler.compiler import api
    assert (compile_unet, warmup, report, uncompile_unet) == (api.compile_unet, api.warmup, api.report,
                                                              api.uncompile_unet)
    try:
        unet_compiler.nope
    except AttributeError:
        print('ok')
    """
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"


def _import_graph() -> dict:
    """The pack's modules and which of them each imports (top level or inside a function)."""
    mods = {module_name(p): p for p in py_files()}
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[:len(parts) - n.level + 1]) + (f".{n.module}" if n.module else "")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in n.names]
            elif isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            else:
                continue
            graph[m] |= {t for t in targets if t in mods and t != m}
    return graph


def test_import_graph_has_no_cycle():
    """No module imports (even lazily, inside a function) one that imports it back: the layers run
    one way (nodes -> compiler -> kernels; compat at the bottom)."""
    graph = _import_graph()
    assert len(graph) > 30 and graph["unet_compiler.compiler.runtime"], "the scan found the package"
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_nodes_reach_the_compiler_through_its_api_only():
    """nodes/ imports from compiler/ only its one surface, compiler/api.py (its ``__all__``), and every
    name it takes from there is listed in it."""
    from unet_compiler.compiler import api
    graph = _import_graph()
    nodes = {m: {t for t in ts if t.startswith("unet_compiler.compiler")} for m, ts in graph.items()
             if m.startswith("unet_compiler.nodes")}
    assert len(nodes) >= 5 and nodes["unet_compiler.nodes.patcher"], nodes
    assert not {m: ts - {"unet_compiler.compiler.api"} for m, ts in nodes.items() if ts - {"unet_compiler.compiler.api"}}
    for path in (ROOT / "nodes").glob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.level == 2 and n.module == "compiler.api":
                assert {a.name for a in n.names} <= set(api.__all__), (path.name, [a.name for a in n.names])


def test_which_files_are_the_packs(tmp_path):
    """One rule: every .py file in the checkout but those under bench/, tests/ and docs/ and in hidden
    or virtual-env folders; the import checks here (tests/_pack.py) and the patch harness's "the
    pack's own frames" (tests/_patch_compat.py) apply it alike."""
    from unet_compiler.compiler.shapes import ShapeError, parse_shapes
    from unet_compiler.tests._patch_compat import _pack_frames, is_pack_file

    names = {p.relative_to(ROOT).as_posix() for p in py_files()}
    assert {"__init__.py", "__main__.py", "compiler/api.py", "nodes/v3.py", "kernels/__init__.py"} <= names
    assert not [n for n in names if n.split("/")[0] in ("bench", "tests", "docs") or n.startswith(".")], names
    assert module_name(ROOT / "compiler" / "__init__.py") == "unet_compiler.compiler"
    assert {p for p in py_files(leave_out=()) if is_pack_file(p)} == set(py_files())
    assert not is_pack_file(ROOT / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "nn" / "functional.py")
    assert not is_pack_file(ROOT / "venv" / "lib" / "python3.11" / "site-packages" / "torch" / "nn" / "functional.py")
    assert not is_pack_file(__file__) and not is_pack_file(tmp_path / "api.py")
    with pytest.raises(ShapeError) as info:
        parse_shapes("1x64")
    assert [f for f in _pack_frames(info.value) if f.startswith("shapes.py:")], _pack_frames(info.value)
    assert not [f for f in _pack_frames(info.value) if "test_packaging" in f]


def _imports_bench(path: Path, tree: ast.AST) -> list[str]:
    """The imports in ``tree`` (the module at ``path``) that reach unet_compiler.bench, as written."""
    package = module_name(path).split(".")[:-1] if path.name != "__init__.py" else module_name(path).split(".")
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names = [a.name.split(".") for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = (package[:len(package) - n.level + 1] if n.level else []) + (n.module.split(".") if n.module else [])
            names = [base + [a.name] for a in n.names]
        else:
            continue
        if any(name[:2] == ["unet_compiler", "bench"] for name in names):
            found.append(f"{path.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
    return found


def test_the_pack_never_imports_bench():
    """bench/ is development tools beside the pack: nothing in nodes/, compiler/, kernels/ or the root
    ``__init__.py`` (what ComfyUI and the library load) imports it, relatively or absolutely, even
    lazily inside a function."""
    files = [p for p in py_files() if p == ROOT / "__init__.py" or p.relative_to(ROOT).parts[0] in
             ("nodes", "compiler", "kernels")]
    assert len(files) > 30 and ROOT / "compiler" / "api.py" in files
    found = [hit for p in files for hit in _imports_bench(p, ast.parse(p.read_text(encoding="utf-8")))]
    assert not found, "the pack imports bench/:\n" + "\n".join(found)
    for source in ("from ..bench import run", "from ..bench.families import comfy_path", "from .. import bench",
                   "import unet_compiler.bench.run", "from unet_compiler import bench",
                   "from unet_compiler.bench import families"):   # what the check catches, from nodes/v3.py
        assert _imports_bench(ROOT / "nodes" / "v3.py", ast.parse(source)), source
    assert not _imports_bench(ROOT / "nodes" / "v3.py", ast.parse("from ..compiler import bench_helpers\nfrom . import bench"))


def test_the_tests_builders_import_nothing_of_the_bench():
    """The tests' tiny-model builders and fixtures (``tests/_*.py``, ``tests/conftest.py``) are the
    tests' own: the bench imports them (its compatibility tables), never the reverse. Also where
    ComfyUI's tree is the working folder (its own ``tests`` package), the bench reaches them as
    ``unet_compiler.tests``."""
    files = sorted((ROOT / "tests").glob("_*.py")) + [ROOT / "tests" / "conftest.py"]
    assert ROOT / "tests" / "_families.py" in files and ROOT / "tests" / "_patch_compat.py" in files
    found = [hit for p in files for hit in _imports_bench(p, ast.parse(p.read_text(encoding="utf-8")))]
    assert not found, "a test builder imports bench/:\n" + "\n".join(found)
    bench = [p for p in (ROOT / "bench").glob("*.py")
             if "unet_compiler.tests._families" in (t := p.read_text(encoding="utf-8")) or "..tests" in t]
    assert bench, "the bench prints its tables from the tests' builders"
    assert not (ROOT / "bench" / "families.py").exists() and not (ROOT / "bench" / "patch_compat.py").exists()


def _text_io_without_encoding(path, tree) -> list[str]:
    """Text reads and writes in ``tree`` that leave the encoding to the locale: ``open(..)`` in a text
    mode, ``.read_text()`` / ``.write_text(..)`` without ``encoding=``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if (name, len(node.args)) in (("read_text", 0), ("write_text", 1)):   # Path's (files.read_text(p) is UTF-8)
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{name}() without encoding")
        elif name == "open" and isinstance(f, ast.Name):
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
            text = mode is None or (isinstance(mode, ast.Constant) and "b" not in str(mode.value))
            if text:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: open() in text mode without encoding")
    return found


def test_the_packs_text_files_are_read_and_written_as_utf8():
    """Windows' locale encoding (cp1252 and others) is not UTF-8: every text read and write of the
    pack names its encoding (a path or an error text with other characters must round-trip)."""
    files = [p for p in py_files() if p == ROOT / "__init__.py" or p.relative_to(ROOT).parts[0] in
             ("nodes", "compiler", "kernels")]
    found = [hit for p in files for hit in _text_io_without_encoding(p, ast.parse(p.read_text(encoding="utf-8")))]
    assert not found, "\n".join(found)
    bad = ast.parse('open("/proc/cpuinfo")\nPath("x").read_text()\nopen(p, "rb")\nopen(p, "w", encoding="utf-8")')
    assert len(_text_io_without_encoding(ROOT / "x.py", bad)) == 2   # what the check catches


def test_the_test_command_runs_the_quick_lane_and_full_the_rest(monkeypatch):
    """``bin/test`` alone is the quick lane, ``--full`` the tests marked full, ``--all`` both; tests
    named on the command line (or a marker) run as asked. Every test tests/_lanes.py names for the
    full lane exists (a renamed test would otherwise slip into the quick lane unnoticed)."""
    from unet_compiler.tests._lanes import FULL, LONG, lane
    dev = _dev()
    assert dev.lane_args([]) == ["-m", "not full"] and dev.lane_args(["-x"]) == ["-m", "not full", "-x"]
    assert dev.lane_args(["--full", "-x"]) == ["-m", "full", "-x"] and dev.lane_args(["--all"]) == []
    assert dev.lane_args(["tests/e2e/test_soak.py"]) == ["tests/e2e/test_soak.py"]
    assert dev.lane_args(["-m", "e2e"]) == ["-m", "e2e"] and dev.lane_args(["-k", "soak"]) == ["-k", "soak"]
    assert dev.lane_args(["-p", "no:warnings"]) == ["-m", "not full", "-p", "no:warnings"]   # a value, not a test
    # each lane runs in one pytest-xdist worker a core (at most MAX_WORKERS), a module to a worker;
    # named tests, an explicit -n / -p no:xdist, one core or UNET_COMPILER_TEST_WORKERS=1 run in one
    # process
    monkeypatch.delenv(dev.WORKERS_ENV, raising=False)
    lane_n = ["-n", "2", "--dist", "loadfile"]
    assert dev.worker_args([], cores=2) == lane_n and dev.worker_args(["-x"], cores=2) == lane_n
    assert dev.worker_args(["--full"], cores=2) == lane_n and dev.worker_args(["--all"], cores=2) == lane_n
    assert dev.worker_args([], cores=64) == ["-n", str(dev.MAX_WORKERS), "--dist", "loadfile"]
    assert dev.worker_args([], cores=1) == [] and dev.worker_args(["tests/e2e/test_soak.py"], cores=2) == []
    assert dev.worker_args(["-k", "soak"], cores=2) == [] and dev.worker_args(["-n", "3"], cores=2) == []
    assert dev.worker_args(["-p", "no:xdist"], cores=2) == [] and dev.worker_args(["-n0"], cores=2) == []
    monkeypatch.setenv(dev.WORKERS_ENV, "1")
    assert dev.worker_args([], cores=2) == []
    monkeypatch.setenv(dev.WORKERS_ENV, "3")
    assert dev.worker_args([], cores=2) == ["-n", "3", "--dist", "loadfile"]
    assert lane("tests/e2e/test_soak.py::test_soak_after_a_range_warmup") == "full"
    assert lane("tests/test_packaging.py::test_the_test_command_runs_the_quick_lane_and_full_the_rest") == "quick"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "full", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    collected = {ln.strip() for ln in out.splitlines() if "::" in ln}
    assert FULL <= collected, sorted(FULL - collected)
    assert LONG <= collected, sorted(LONG - collected)          # (each still collected, skipped unless asked)
