"""pytest imports test modules by basename (no packages under tests/): two files of one name in different folders
stop the whole collection ("import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "e2e" / "data"  # files tests read, never collected (slime's examples keep their own names)


def test_every_test_module_has_a_basename_of_its_own():
    names = Counter(
        path.name for path in TESTS.rglob("*.py") if path.name != "conftest.py" and DATA not in path.parents
    )
    assert [name for name, count in names.items() if count > 1] == []
