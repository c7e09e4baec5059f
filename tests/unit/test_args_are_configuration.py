"""``args`` is configuration (DESIGN.md §4): after parsing and validation nothing writes it. Runtime state lives in
the rollout manager's run context (``vime.utils.run_context``).

Walks the syntax tree of ``vime/``, ``train.py`` and ``train_async.py``, leaving out the modules that define and
validate flags (``argument_modules.ARGUMENT_MODULES``), and fails on any write to an attribute of ``<x>args``
(``args``, ``self.args``, ``eval_args`` ...): an assignment (plain, augmented, annotated, a ``for`` or ``with``
target, in a tuple), a ``del``, ``setattr``/``delattr``/``object.__setattr__``, or a write through ``vars(args)`` or
``args.__dict__`` (an item assignment, ``update``, ``setdefault``, ``pop`` ...).
"""

from __future__ import annotations

import ast

from argument_modules import ROOT, is_args, walked_files

_DICT_WRITES = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _targets(node: ast.AST) -> list[ast.AST]:
    """The assignment targets of ``node`` (flattened out of tuples, lists and starred targets)."""
    if isinstance(node, ast.Assign | ast.Delete):
        found = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
        found = [node.target]
    elif isinstance(node, ast.With | ast.AsyncWith):
        found = [item.optional_vars for item in node.items if item.optional_vars is not None]
    elif isinstance(node, ast.comprehension):
        found = [node.target]
    else:
        return []
    flat = []
    while found:
        target = found.pop()
        if isinstance(target, ast.Tuple | ast.List):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def _is_args_dict(node: ast.AST) -> bool:
    """``vars(args)`` or ``args.__dict__``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars":
        return bool(node.args) and is_args(node.args[0])
    return isinstance(node, ast.Attribute) and node.attr == "__dict__" and is_args(node.value)


def writes_in(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of every write to ``args`` in ``tree``."""
    found = []
    for node in ast.walk(tree):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and is_args(target.value):
                found.append((target.lineno, ast.unparse(target)))
            elif isinstance(target, ast.Subscript) and _is_args_dict(target.value):
                found.append((target.lineno, ast.unparse(target)))
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if (
            name in ("setattr", "delattr", "__setattr__", "__delattr__")
            and node.args
            and is_args(node.args[0])
        ):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(func, ast.Attribute) and func.attr in _DICT_WRITES and _is_args_dict(func.value):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_walk_finds_every_kind_of_write_and_no_read():
    code = """
args.a = 1
self.args.b, (x, *args.c) = 1, (2, 3)
eval_args.d += 1
args.e: int = 1
del args.f
for args.g in range(2): pass
with open('x') as args.h: pass
setattr(args, 'i', 1)
delattr(self.args, 'j')
object.__setattr__(args, 'k', 1)
vars(args)['l'] = 1
vars(args).update(m=1)
args.__dict__.setdefault('n', 1)
y = args.o + getattr(args, 'p') + vars(args)['q']
z = argparse.Namespace(**{**vars(args), 'r': 1})
other.s = args.t
setattr(other, 'u', args)
"""
    assert [source for _, source in writes_in(ast.parse(code))] == [
        "args.a",
        "args.c",
        "self.args.b",
        "eval_args.d",
        "args.e",
        "args.f",
        "args.g",
        "args.h",
        "setattr(args, 'i', 1)",
        "delattr(self.args, 'j')",
        "object.__setattr__(args, 'k', 1)",
        "vars(args)['l']",
        "vars(args).update(m=1)",
        "args.__dict__.setdefault('n', 1)",
    ]


def test_nothing_writes_args_after_parsing_and_validation():
    files = walked_files()
    assert len(files) > 100, "the walk found too few modules"
    writes = [
        f"{path.relative_to(ROOT)}:{line}: {source}"
        for path in files
        for line, source in writes_in(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    ]
    assert not writes, (
        "args is configuration, fixed after parsing and validation (vime/utils/arg_validation.py ...); runtime "
        "state belongs in the rollout manager's RunContext (vime/utils/run_context.py). Writes found:\n"
        + "\n".join(writes)
    )
