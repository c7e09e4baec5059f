"""Small helpers shared across vime: loading user plug-ins by import path, finding a free port, and two helpers
slime's plug-ins and launch scripts import from ``slime.utils.misc`` (:class:`SingletonMeta`, :func:`exec_command`)."""

from __future__ import annotations

import importlib
import socket
import subprocess
from collections.abc import Callable
from typing import Any


def load_function(path: str, flag: str | None = None) -> Callable[..., Any]:
    """Import ``"package.module.attr"`` and return the attribute.

    Errors name the module or attribute that failed (and the flag the path came from, if given).
    """
    where = f" (from {flag})" if flag else ""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r}{where} is not an import path; expected 'package.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import module {module_name!r} for {path!r}{where}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(name for name in vars(module) if not name.startswith("_"))
        raise AttributeError(
            f"module {module_name!r} has no attribute {attr!r} (needed by {path!r}{where}); "
            f"it defines: {', '.join(public[:20])}"
        ) from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (another process may still take it before use)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SingletonMeta(type):
    """Metaclass of a class with one instance per process (slime's): the first call constructs it, later calls
    return that instance whatever their arguments; ``Cls.clear_instances()`` forgets the instances so the next call
    constructs again."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances = {}


def exec_command(cmd: str, capture_output: bool = False) -> str | None:
    """Run ``cmd`` with bash, echoing it first (slime's launch-script helper); a non-zero exit raises
    ``subprocess.CalledProcessError``. With ``capture_output``, returns its stdout."""
    print(f"EXEC: {cmd}", flush=True)
    result = subprocess.run(
        ["bash", "-c", cmd], check=True, capture_output=capture_output, text=capture_output
    )
    return result.stdout if capture_output else None
