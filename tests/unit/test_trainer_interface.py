"""The trainer interface stays narrow (vime.backends.trainer_base): a training backend implements the primitives the
base declares (``PRIMITIVES``) and overrides nothing else of it, nor adds a public method of its own.

The backends' classes are read from their source (every class under ``vime/backends`` deriving from
``TrainerBase``), so the Megatron trainer is checked on a machine without Megatron too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from vime.backends.trainer_base import PRIMITIVES, TrainerBase

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"FSDPTrainer", "MegatronTrainer"}


def defined_names(cls: ast.ClassDef) -> set[str]:
    """The methods and class attributes a class body defines."""
    names = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def backend_classes(root: Path = ROOT / "vime" / "backends") -> dict[str, ast.ClassDef]:
    """Every class under ``root`` that derives from ``TrainerBase``, by name."""
    found = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(base, ast.Name) and base.id == "TrainerBase" for base in node.bases
            ):
                found[node.name] = node
    return found


def base_members() -> set[str]:
    return {name for name in dir(TrainerBase) if not hasattr(object, name)} | set(TrainerBase.__annotations__)


def abstract_primitives() -> set[str]:
    """The primitives the base leaves to the backends (its body raises ``NotImplementedError``)."""
    source = ast.parse((ROOT / "vime" / "backends" / "trainer_base.py").read_text(encoding="utf-8"))
    (base,) = [n for n in ast.walk(source) if isinstance(n, ast.ClassDef) and n.name == "TrainerBase"]
    return {
        node.name
        for node in base.body
        if isinstance(node, ast.FunctionDef)
        and any(
            isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.unparse(stmt) for stmt in node.body
        )
    }


def violations(name: str, cls: ast.ClassDef) -> list[str]:
    """What a backend class does beyond implementing the primitives."""
    found = []
    defined = defined_names(cls) - {"__init__"}
    for extra in sorted((defined & base_members()) - PRIMITIVES):
        found.append(f"{name} overrides TrainerBase.{extra}, which is not a primitive")
    for extra in sorted(n for n in defined - PRIMITIVES - base_members() if not n.startswith("_")):
        found.append(f"{name} adds the public {extra} to the trainer interface")
    for missing in sorted(abstract_primitives() - defined):
        found.append(f"{name} does not implement the primitive {missing}")
    return found


def test_the_check_sees_overrides_new_public_methods_and_missing_primitives():
    source = """
class Wide(TrainerBase):
    cp_size = 2
    def __init__(self): ...
    def load(self): ...
    def _forward(self): ...
    def evaluate(self): ...
    def _helper(self): ...
"""
    (cls,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
    found = violations("Wide", cls)
    assert "Wide overrides TrainerBase.load, which is not a primitive" in found
    assert "Wide overrides TrainerBase.cp_size, which is not a primitive" in found
    assert "Wide adds the public evaluate to the trainer interface" in found
    assert "Wide does not implement the primitive _train_step" in found
    assert not [f for f in found if "_forward" in f or "_helper" in f]


def test_the_base_declares_every_primitive():
    assert PRIMITIVES <= base_members()
    assert (
        {"_forward", "_train_step", "_load_checkpoint", "_save_checkpoint"}
        <= abstract_primitives()
        <= PRIMITIVES
    )


def test_backends_implement_the_primitives_and_override_nothing_else():
    classes = backend_classes()
    assert set(classes) == BACKENDS, f"backends found: {sorted(classes)}"
    found = [v for name, cls in sorted(classes.items()) for v in violations(name, cls)]
    assert not found, "\n".join(found)
