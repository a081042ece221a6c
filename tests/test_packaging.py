"""Install surface: what ComfyUI-Manager and the Comfy Registry read, and a clean import of the pack
(no ComfyUI, triton, IPEX or diffusers needed)."""
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    # every package the code imports is listed for the standalone install
    pkgs = set(meta["tool"]["setuptools"]["packages"])
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts and rel.parts[0] in ("tests", "docs", "example_workflows", "web"):
            continue
        assert ".".join(("unet_compiler",) + rel.parts) in pkgs, rel


def test_ruff_security_rules_clean():
    """No exec / eval anywhere (the Registry scans for them)."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "S102,S307", str(ROOT)],
                       capture_output=True, text=True)
    if r.returncode != 0 and "No module named ruff" in r.stderr:
        src = "\n".join(p.read_text() for p in ROOT.rglob("*.py") if "_artifacts" not in p.parts)
        assert not re.search(r"(?<![\w.])(exec|eval)\(", src)
    else:
        assert r.returncode == 0, r.stdout + r.stderr


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
    assert sorted(mod.NODE_CLASS_MAPPINGS) == ['UNetCompiler_CompileUNet', 'UNetCompiler_SelectBackend', 'UNetCompiler_WarmupShapes']
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
