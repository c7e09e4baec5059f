"""The rollout-function lifecycle: optional hooks the rollout manager calls on every rollout function.

A rollout function (``--rollout-function-path``, ``--eval-function-path``) is a function
``generate_rollout(args, rollout_id, data_source, evaluation=False)`` (vime's own take the run's context too, as the
keyword-only ``run_context``: :mod:`vime.utils.run_context`), or, when it keeps state across calls, a class: the
manager then makes one instance, ``cls(args, data_source)``, and calls it with the function's arguments.
Either may define any of these hooks (a function as attributes, a class as methods); the manager calls those
present, on the rollout and on the eval function (once when they are the same):

- ``before_weight_update()``: the engines' weights are about to change (a sync, or a push to replacement engines
  during a rollout with ``--use-fault-tolerance``, which calls it from another thread than the rollout's).
- ``after_weight_update(version)``: the engines serve weight version ``version`` now.
- ``state_dict() -> dict``: JSON-serialisable state to checkpoint with the data buffer (taken when the buffer's is:
  just before the next rollout draws when ``train_async.py`` has already started it); an empty dict saves nothing.
- ``load_state_dict(state)``: restore it when a run resumes, after the data buffer, before the first rollout.
- ``stop()``: the run ends (the manager shuts down); stop background work.

A function without hooks works unchanged. The state is saved as ``DIR/iter_{rollout_id:07d}/rollout_function.json``
(``{"rollout": ..., "eval": ...}``, per function that returned some).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from vime.utils.checkpoint_layout import iteration_dir, write_json_atomic
from vime.utils.misc import load_function

STATE_FILE = "rollout_function.json"


def load_rollout_function(path: str, flag: str, args: Any, data_source: Any) -> Callable[..., Any]:
    """The rollout function at ``path``: the function, or an instance of the class, made with ``(args, data_source)``."""
    loaded = load_function(path, flag)
    return loaded(args, data_source) if isinstance(loaded, type) else loaded


class RolloutFunctions:
    """The run's rollout function and eval function, and their lifecycle hooks (see the module docstring)."""

    def __init__(self, args: Any, data_source: Any):
        self.rollout = load_rollout_function(
            args.rollout_function_path, "--rollout-function-path", args, data_source
        )
        eval_path = args.eval_function_path
        self.eval = (
            load_rollout_function(eval_path, "--eval-function-path", args, data_source)
            if eval_path and eval_path != args.rollout_function_path
            else self.rollout
        )

    def _named(self) -> dict[str, Callable[..., Any]]:
        return {"rollout": self.rollout} | ({"eval": self.eval} if self.eval is not self.rollout else {})

    def call(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on each function that defines it."""
        for fn in self._named().values():
            if (method := getattr(fn, hook, None)) is not None:
                method(*args)

    def state_dict(self) -> dict[str, dict]:
        """Each function's non-empty ``state_dict()``, by role."""
        states = {role: fn.state_dict() for role, fn in self._named().items() if hasattr(fn, "state_dict")}
        return {role: state for role, state in states.items() if state}

    def save(self, rollout_id: int, save_dir: str | os.PathLike, state: dict[str, dict]) -> None:
        """Write ``state`` (from :meth:`state_dict`) next to the data buffer's; nothing when it is empty."""
        if state:
            write_json_atomic(iteration_dir(save_dir, rollout_id) / STATE_FILE, state)

    def load(self, rollout_id: int, load_dir: str | os.PathLike) -> None:
        """Hand each function the state saved for it at ``rollout_id``, if any; a saved state that no function here
        loads raises (the run would silently drop it: resume with the rollout function that saved it)."""
        path = iteration_dir(load_dir, rollout_id) / STATE_FILE
        if not path.is_file():
            return
        named = self._named()
        for role, state in json.loads(path.read_text(encoding="utf-8")).items():
            fn = named.get(role)
            if fn is None or not hasattr(fn, "load_state_dict"):
                raise ValueError(
                    f"{path} holds state of the {role} function that this run's {role} function does not load "
                    f"(it has no load_state_dict); resume with the --{role}-function-path that saved it, or delete "
                    "the file to drop that state"
                )
            fn.load_state_dict(state)
