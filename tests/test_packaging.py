"""Install surface: what ComfyUI-Manager and the Comfy Registry read."""
import re
import subprocess
import sys
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
