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
    for folder in [ROOT, *_subpackages(ROOT)]:
        rel = folder.relative_to(ROOT)
        assert ".".join(("unet_compiler",) + rel.parts) in pkgs, rel


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
        src = "\n".join(p.read_text() for p in ROOT.rglob("*.py")
                        if "_artifacts" not in p.parts and not any(d.startswith(".") for d in p.relative_to(ROOT).parts))
        assert not re.search(r"(?<![\w.])(exec|eval)\(", src)
    else:
        assert r.returncode == 0, r.stdout + r.stderr


def test_readme_commands_are_what_ci_runs():
    """The README's setup and test commands are the first thing .ci/run runs (in its env, default the
    README's .venv), through the tracked bin/setup and constraints.txt: CI sees what a newcomer sees."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Three commands", 1)[1].split("\n## ", 1)[0]
    commands = [ln.strip() for ln in block.splitlines() if ln.startswith("    ") and not ln.strip().startswith("#")]
    assert commands[0] == "bin/setup" and commands[-1] == ".venv/bin/python -m pytest -q", commands
    assert len(commands) == 3 and commands[1].startswith(".venv/bin/python -m unet_compiler bench"), commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ENV=${UNET_COMPILER_CI_ENV:-.venv}" in ci and 'rm -rf "$ENV"' in ci
    assert '\nbin/setup "$ENV"\n' in ci and '\n"$ENV/bin/python" -m pytest -q\n' in ci
    setup = ROOT / "bin" / "setup"
    assert setup.stat().st_mode & 0o111 and "-c constraints.txt" in setup.read_text()
    assert (ROOT / "constraints.txt").read_text().split() == ["torch==2.13.0"]
    tracked = subprocess.run(["git", "ls-files", "constraints.txt", "bin/setup"], cwd=ROOT, capture_output=True,
                             text=True)
    if tracked.returncode == 0:  # a git checkout (not an sdist): the files the README needs are committed
        assert tracked.stdout.split() == ["bin/setup", "constraints.txt"], tracked.stdout


def test_comfyui_without_its_requirements_skips_with_one_line(tmp_path, monkeypatch):
    """A ComfyUI tree whose requirements are not in this env: the ComfyUI tests skip with one line
    naming the command that installs them (instead of failing on No module named 'psutil')."""
    from unet_compiler import families
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
