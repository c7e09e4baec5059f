"""Where vime's flags are defined, parsed and validated, shared by the tests that walk the rest of the code for what
it does with ``args`` (``test_every_flag_is_read``: reads; ``test_args_are_configuration``: no writes)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where flags are defined, parsed and validated: a mention there is not a use, and only there is args written.
ARGUMENT_MODULES = {
    "vime/utils/arguments.py",
    "vime/utils/arg_validation.py",
    "vime/utils/algorithm_flags.py",
    "vime/utils/backend_flags.py",
    "vime/utils/megatron_args.py",
    "vime/utils/refused_flags.py",
    "vime/utils/passthrough_args.py",
    "vime/utils/upstream_parsers.py",
    "vime/utils/slime_names.py",
    "vime/utils/serving_flags.py",
}
ARGUMENT_PACKAGES = ("vime/utils/flags/",)
ARGS_NAME = re.compile(r"(?:\w+_)?args$")


def is_args(node: ast.AST) -> bool:
    """``args``, ``eval_args``, ``self.args``, ``self._args`` ..."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return bool(ARGS_NAME.fullmatch(name.lstrip("_")))


def walked_files() -> list[Path]:
    """vime's code after parsing and validation: every module of ``vime/`` but the argument modules, and the two
    loops."""
    files = [*(ROOT / "vime").rglob("*.py"), ROOT / "train.py", ROOT / "train_async.py"]
    return [
        path
        for path in files
        if (rel := path.relative_to(ROOT).as_posix()) not in ARGUMENT_MODULES
        and not rel.startswith(ARGUMENT_PACKAGES)
    ]
