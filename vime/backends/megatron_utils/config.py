"""``--megatron-config-path`` (YAML flag overrides, per role) and the ``--custom-megatron-*`` hook loader.

Pure (no Megatron import). The YAML holds flag values by argparse dest or flag spelling; top-level keys apply
to every role, and an ``actor:`` / ``critic:`` mapping overrides them for that role::

    lr: 1.0e-6
    recompute-granularity: full
    critic:
      lr: 1.0e-5
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vime.utils.misc import load_function

ROLE_KEYS = ("actor", "critic")


def role_overrides(data: dict[str, Any], role: str, where: str = "--megatron-config-path") -> dict[str, Any]:
    """The flag values for ``role`` (dests), top-level keys first, then the role's own mapping."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of flag -> value, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in ROLE_KEYS:
            continue
        out[key.lstrip("-").replace("-", "_")] = value
    section = data.get(role) or {}
    if not isinstance(section, dict):
        raise ValueError(f"{where}: '{role}:' must be a mapping of flag -> value")
    for key, value in section.items():
        out[key.lstrip("-").replace("-", "_")] = value
    return out


def apply_megatron_config(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """``args`` updated in place with ``--megatron-config-path`` for ``role``; unknown flags are an error."""
    path = getattr(args, "megatron_config_path", None)
    if not path:
        return args
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    for dest, value in role_overrides(data, role, f"--megatron-config-path {path}").items():
        if not hasattr(args, dest):
            raise ValueError(
                f"--megatron-config-path {path}: unknown flag {dest!r} (use the --flag spelling or dest)"
            )
        setattr(args, dest, value)
    return args


def load_hook(path: str | None, flag: str) -> Callable | None:
    """The function at import path ``path`` (``pkg.module.fn``), or None when unset."""
    return load_function(path, flag) if path else None
