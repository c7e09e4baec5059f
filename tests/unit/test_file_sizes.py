"""Files stay short (STYLE.md: split by concern before a module passes 500 lines): every Python file in ``vime/``."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500


def too_long(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path: lines`` of every ``.py`` under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root.parent)}: {lines}")
    return found


def test_the_check_counts_lines(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 4)
    assert too_long(tmp_path / "pkg", limit=3) == ["pkg/long.py: 4"]


def test_no_module_of_vime_passes_500_lines():
    found = too_long(ROOT / "vime")
    assert not found, f"split by concern (STYLE.md), these pass {MAX_LINES} lines:\n" + "\n".join(found)
