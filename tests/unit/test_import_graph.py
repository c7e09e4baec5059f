"""vime's imports flow one way (STYLE.md): utils at the bottom, then backends, rollout, ray, entry points.

An AST scan of every module under ``vime/`` (imports inside functions included: a lazy import is still a
dependency) fails on an import of a higher layer, on ``rollout/`` importing a training backend, on one backend
importing another, and on any cycle between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vime"
LAYERS = {"utils": 0, "backends": 1, "rollout": 2, "ray": 3}  # anything else in vime/ is an entry point (4)
TRAINING_BACKENDS = (
    "vime.backends.fsdp_utils",
    "vime.backends.megatron_utils",
    "vime.backends.trainer_base",
    "vime.backends.memory_check",
)
# Imports that break a rule on purpose, with the reason. Keep it empty unless something cannot move.
ALLOWED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The vime modules ``name`` imports (``from pkg import mod`` counts as importing ``pkg.mod``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t.startswith("vime") and t in modules and t != name)
    return found


def layer(name: str) -> tuple[int, str]:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS[parts[1]], parts[1]
    return 4, "entry point"


BACKEND_PACKAGES = ("fsdp_utils", "megatron_utils", "vllm_utils")


def backend_of(name: str) -> str | None:
    """The ``vime.backends.<name>`` package of a module; the modules directly in ``vime/backends`` (trainer_base,
    memory_check) are the code the training backends share."""
    parts = name.split(".")
    if len(parts) < 3 or parts[1] != "backends":
        return None
    return parts[2] if parts[2] in BACKEND_PACKAGES else "training"


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for source, targets in edges.items():
        for target in sorted(targets):
            if (source, target) in ALLOWED:
                continue
            (low, low_name), (high, high_name) = layer(source), layer(target)
            if high > low:
                found.append(f"{source} ({low_name}) imports {target} ({high_name}), a higher layer")
            if source.startswith("vime.rollout") and target.startswith(TRAINING_BACKENDS):
                found.append(f"{source} imports the training backend {target}")
            mine, theirs = backend_of(source), backend_of(target)
            if mine and theirs and mine != theirs and not (theirs == "training" and mine != "vllm_utils"):
                found.append(f"{source} (backend {mine}) imports {target} (backend {theirs})")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), allowed edges left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if (node, succ) in ALLOWED:
                continue
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_scan_sees_lazy_and_relative_imports(tmp_path):
    """The scanner itself: imports inside functions and relative imports are dependencies."""
    pkg = tmp_path / "vime" / "utils"
    pkg.mkdir(parents=True)
    (tmp_path / "vime" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from vime.rollout import b\n")
    (pkg / "c.py").write_text("from . import a\nfrom .a import f\n")
    modules = {
        "vime.utils.a": pkg / "a.py",
        "vime.utils.c": pkg / "c.py",
        "vime.rollout.b": tmp_path / "b.py",
    }
    assert imports_of("vime.utils.a", pkg / "a.py", modules) == {"vime.rollout.b"}
    assert imports_of("vime.utils.c", pkg / "c.py", modules) == {"vime.utils.a"}
    edges = {"vime.utils.a": {"vime.rollout.b"}, "vime.rollout.b": {"vime.utils.a"}}
    assert violations(edges) == ["vime.utils.a (utils) imports vime.rollout.b (rollout), a higher layer"]
    assert cycles(edges) == [["vime.rollout.b", "vime.utils.a"]]
    assert violations({"vime.rollout.x": {"vime.backends.fsdp_utils.trainer"}}) == [
        "vime.rollout.x imports the training backend vime.backends.fsdp_utils.trainer"
    ]
    assert violations({"vime.backends.vllm_utils.x": {"vime.backends.trainer_base"}}) == [
        "vime.backends.vllm_utils.x (backend vllm_utils) imports vime.backends.trainer_base (backend training)"
    ]
    assert violations({"vime.backends.fsdp_utils.t": {"vime.backends.trainer_base"}}) == []
    assert violations({"vime.backends.trainer_base": {"vime.backends.memory_check"}}) == []
    assert violations({"vime.backends.trainer_base": {"vime.backends.vllm_utils.x"}}) == [
        "vime.backends.trainer_base (backend training) imports vime.backends.vllm_utils.x (backend vllm_utils)"
    ]


def test_imports_flow_one_way():
    edges = graph()
    assert len(edges) > 50, "the scan found too few modules"
    assert not violations(edges), "\n".join(violations(edges))


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_allow_list_entries_are_still_needed():
    edges = graph()
    stale = [pair for pair in ALLOWED if pair[1] not in edges.get(pair[0], set())]
    assert not stale, f"allow-listed imports that no longer exist: {stale}"
