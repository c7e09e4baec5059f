"""Configuration and runtime, kept apart (DESIGN.md §4).

``args`` is what the user asked for: fixed once parsing and validation are done, never written again. What the run
learns while it runs (the router's address, every model's router, the live engines, the weight versions) is the
rollout manager's :class:`RunContext`. vime's own rollout and generate functions take it as the keyword-only argument
``run_context``; a plug-in with slime's signature (no such parameter) gets a :class:`PluginArgs` in place of
``args``: a copy-on-write view that answers every flag and, under the names slime plug-ins read, the runtime values
(``args.sglang_router_ip``/``port``, ``args.vllm_model_routers`` for ``get_model_url``, ``args.rollout_engine_urls``
...). :func:`call_plugin` picks between the two by the function's signature.
"""

from __future__ import annotations

import argparse
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class RunContext:
    """The run's runtime state, owned by the rollout manager (one per run; rollout functions share it, and the
    engine monitor keeps ``engine_urls`` current)."""

    router_ip: str | None = (
        None  # the policy's router (``--vllm-router-ip`` until the manager starts its own)
    )
    router_port: int | None = None
    model_routers: dict[str, tuple[str, int]] = field(default_factory=dict)  # every model's router, by name
    model_roles: dict[str, str] = field(
        default_factory=dict
    )  # every model's role (policy, teacher ...), by name
    engine_urls: list[str] = field(
        default_factory=list
    )  # the policy's live engines (abort and control calls)
    weight_version: int = 0  # the policy version the engines serve (stamped on each request)
    train_weight_version: int = (
        0  # the version the trainer will hold when it trains the batch being generated
    )

    @property
    def router_url(self) -> str:
        """``http://IP:PORT`` of the policy's router."""
        if self.router_ip is None:
            raise RuntimeError(
                "no router address yet: the rollout manager knows it once its engines and router are up"
            )
        return f"http://{self.router_ip}:{self.router_port}"


# slime's (and vime's earlier) names of the runtime values, as a plug-in reads them from args -> RunContext field
RUNTIME_NAMES = {
    "vllm_router_ip": "router_ip",
    "vllm_router_port": "router_port",
    "sglang_router_ip": "router_ip",
    "sglang_router_port": "router_port",
    "vllm_model_routers": "model_routers",
    "vllm_model_roles": "model_roles",
    "rollout_engine_urls": "engine_urls",
    "weight_version": "weight_version",
    "train_weight_version": "train_weight_version",
}


class PluginArgs:
    """``args`` as a plug-in with slime's signature sees it: every flag, and the runtime values under
    :data:`RUNTIME_NAMES` (read when asked: a router restarted or an engine replaced shows at once). What a plug-in
    writes stays in this view (slime's plug-ins keep state on ``args``, and some adjust a flag for their own calls,
    e.g. the multi-agent example's ``args.rollout_max_context_len``): it shadows the flag for whoever reads this view
    and never reaches the run's configuration. A copy (``copy.copy``, ``copy.deepcopy``, pickling) is a writable
    ``argparse.Namespace`` of the values then, and ``vars(args)`` their read-only mapping."""

    __slots__ = ("_args", "_run", "_own")

    def __init__(self, args: argparse.Namespace, run_context: RunContext):
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_run", run_context)
        object.__setattr__(self, "_own", {})  # what the plug-in wrote

    def __getattr__(self, name: str) -> Any:
        if name in self._own:
            return self._own[name]
        if name in RUNTIME_NAMES:
            value = getattr(self._run, RUNTIME_NAMES[name])
            return (
                type(value)(value) if isinstance(value, list | dict) else value
            )  # the run's own stay its own
        return getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._own[name] = value

    def __delattr__(self, name: str) -> None:
        if name not in self._own:
            raise AttributeError(
                f"cannot delete args.{name}: the run's configuration; a plug-in deletes only what it set"
            )
        del self._own[name]

    def __contains__(self, name: str) -> bool:
        return name in self._own or name in RUNTIME_NAMES or name in vars(self._args)

    @property
    def __dict__(self) -> types.MappingProxyType:  # vars(args)
        return types.MappingProxyType(self._values())

    def __reduce__(self) -> tuple:
        return argparse.Namespace, (), self._values()

    def __repr__(self) -> str:
        return f"PluginArgs({self._args!r}, {self._run!r}, own={self._own!r})"

    def _values(self) -> dict[str, Any]:
        return {**vars(self._args), **{name: getattr(self, name) for name in RUNTIME_NAMES}, **self._own}


def plugin_args(args: argparse.Namespace | PluginArgs, run_context: RunContext) -> PluginArgs:
    """The plug-in view of ``args`` and ``run_context`` (``args`` itself when it already is one)."""
    return args if isinstance(args, PluginArgs) else PluginArgs(args, run_context)


def configuration(args: argparse.Namespace | PluginArgs) -> argparse.Namespace:
    """The parsed flags behind ``args``."""
    return args._args if isinstance(args, PluginArgs) else args


def run_context_of(
    args: argparse.Namespace | PluginArgs, run_context: RunContext | None = None
) -> RunContext:
    """``run_context`` when given, else the one behind the view a plug-in was handed; ``ValueError`` without either
    (a function vime's rollout calls gets one of them)."""
    if run_context is not None:
        return run_context
    if isinstance(args, PluginArgs):
        return args._run
    raise ValueError(
        "no run context: pass run_context= (vime's rollout and generate functions receive it) or the args the "
        "rollout manager handed the plug-in (they carry it)"
    )


def takes_run_context(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (a function, or an instance of a class with ``__call__``) has a keyword-only ``run_context``."""
    try:
        parameter = inspect.signature(fn).parameters.get("run_context")
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY


def call_plugin(
    fn: Callable[..., Any],
    args: argparse.Namespace | PluginArgs,
    *positional: Any,
    run_context: RunContext,
    **kwargs: Any,
) -> Any:
    """Call a rollout, eval or generate function: one of vime's (a keyword-only ``run_context``) with the parsed
    flags and ``run_context=``; one with slime's signature with the plug-in view in place of ``args``."""
    if takes_run_context(fn):
        return fn(configuration(args), *positional, run_context=run_context, **kwargs)
    return fn(plugin_args(args, run_context), *positional, **kwargs)
