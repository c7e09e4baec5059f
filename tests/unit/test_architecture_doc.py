"""``docs/architecture.md`` matches the code: every module or package it names exists, and it names every package."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "architecture.md"


def _named_paths(text: str) -> set[str]:
    """The ``vime/...`` paths in backticks (a module file or a package directory), without a trailing slash."""
    return {path.rstrip("/") for path in re.findall(r"`(vime/[\w/.]*)`", text)}


def _packages() -> set[str]:
    return {
        str(init.parent.relative_to(REPO))
        for init in (REPO / "vime").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }


def test_every_module_the_page_names_exists():
    missing = sorted(path for path in _named_paths(DOC.read_text()) if not (REPO / path).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_the_page_names_every_package():
    named = _named_paths(DOC.read_text())
    left_out = sorted(package for package in _packages() - {"vime"} if package not in named)
    assert not left_out, f"docs/architecture.md leaves out packages: {left_out}"


def test_the_checks_see_what_they_check():
    assert _named_paths("`vime/ray/run.py` and `vime/nowhere.py`") == {"vime/ray/run.py", "vime/nowhere.py"}
    assert {"vime/ray", "vime/utils/flags", "vime/rollout/rm_hub"} <= _packages()
