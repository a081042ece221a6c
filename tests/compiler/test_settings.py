"""compiler/settings.py: the one declaration of the pack's UNET_COMPILER_* variables, their parser,
and the README's table of them."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from unet_compiler.compiler import settings

ROOT = Path(__file__).resolve().parents[2]
PACK = [p for folder in ("compiler", "nodes", "kernels") for p in (ROOT / folder).rglob("*.py")] + [ROOT / "__init__.py"]


def test_the_readme_table_is_the_settings_table():
    assert settings.table() in (ROOT / "README.md").read_text(), \
        "README.md's environment table differs from compiler/settings.py's: paste settings.table()"


def test_every_variable_the_pack_names_is_declared_and_read_only_in_settings():
    named, readers = set(), []
    for p in PACK:
        text = p.read_text()
        named |= set(re.findall(r"UNET_COMPILER_([A-Z_]+)", text))
        if p.name != "settings.py" and re.search(r"environ(\.get)?\(?\[?[^)\]]*UNET_COMPILER_", text):
            readers.append(str(p.relative_to(ROOT)))
    assert named <= set(settings.SETTINGS), f"named in the pack, not declared: {sorted(named - set(settings.SETTINGS))}"
    assert not readers, f"read outside compiler/settings.py: {readers}"


@pytest.mark.parametrize("raw, want", [("1", True), ("ON", True), (" yes ", True), ("true", True),
                                       ("0", False), ("off", False), ("No", False), ("", False), ("maybe", False)])
def test_flag_parses_one_way(monkeypatch, raw, want):
    monkeypatch.setenv("UNET_COMPILER_DISABLE", raw)
    assert settings.flag("DISABLE") is want and settings.disabled() is want


def test_defaults_and_choices(monkeypatch):
    for name in settings.SETTINGS:
        monkeypatch.delenv(settings.env(name), raising=False)
    assert settings.flag("PRECOMPILE") and settings.choice("CACHE") == "on" and settings.value("CACHE_DIR") == ""
    monkeypatch.setenv("UNET_COMPILER_PRECOMPILE", "garbage")
    assert settings.flag("PRECOMPILE"), "an unreadable value is the default"
    monkeypatch.setenv("UNET_COMPILER_CACHE", "CLEAR")
    assert settings.choice("CACHE") == "clear"
    monkeypatch.setenv("UNET_COMPILER_CACHE", "sometimes")
    assert settings.choice("CACHE") == "on"
