"""``--vllm-config PATH``: several models and server groups from one YAML file (slime's ``--sglang-config``).

```yaml
vllm:
  - name: actor                  # unique; the key of args.vllm_model_routers
    role: policy                 # policy (weight-synced, the default rollout target) | reference | teacher | reward
    model_path: /ckpt/actor      # default --hf-checkpoint
    update_weights: true         # slime's key; default: true for the policy, false otherwise
    num_gpus_per_engine: 1       # default --rollout-num-gpus-per-engine
    server_groups:
      - worker_type: regular     # regular | placeholder (reserves GPUs, starts nothing)
        num_gpus: 2
        num_gpus_per_engine: 1   # overrides the model's
        overrides: {max_model_len: 4096, enforce_eager: true}   # vLLM server flags, applied last
```

The GPUs of every group add up to ``--rollout-num-gpus``. Each model is served behind its own router; only the
policy model takes part in weight sync. Without a ``role``, a model is the policy when it serves
``--hf-checkpoint`` with ``update_weights`` not false (slime's inference), else ``reference``.
"""

from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vime.utils.passthrough_args import passthrough_cli_args
from vime.utils.upstream_parsers import VIME_OWNED_VLLM_FLAGS, build_vllm_serve_parser

ROLES = ("policy", "reference", "teacher", "reward")
WORKER_TYPES = ("regular", "placeholder")
# vLLM's prefill/decode disaggregation needs a KV connector between engines and a PD-aware router.
PD_REFUSAL = (
    "prefill/decode disaggregation is not supported: vLLM moves the KV cache between prefill and decode engines "
    "through a KV connector (NIXL or Mooncake need wheels the pinned kits do not ship; P2pNcclConnector needs "
    "CUDA) and vllm-router must run in its PD mode; vime starts neither yet. Use worker_type: regular"
)


class VLLMConfigError(ValueError):
    """A ``--vllm-config`` file that cannot be used; the message names the file, the entry and the fix."""


def engine_size_problem(per_engine: int, num_gpus_per_node: int) -> str | None:
    """Why an engine of ``per_engine`` GPUs cannot be laid out on nodes of ``num_gpus_per_node``, or None: it fits
    one node, or spans whole nodes (slime's multi-node engines; vLLM's Ray executor runs them)."""
    if per_engine <= num_gpus_per_node or per_engine % num_gpus_per_node == 0:
        return None
    return (
        f"{per_engine} GPUs per engine is more than one node's (--num-gpus-per-node {num_gpus_per_node}) but not "
        "whole nodes: an engine fits one node or spans whole nodes (a multiple of --num-gpus-per-node)"
    )


@dataclass
class ServerGroup:
    """``num_gpus`` GPUs served by engines of ``num_gpus_per_engine`` each (none for a placeholder)."""

    worker_type: str
    num_gpus: int
    num_gpus_per_engine: int
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def num_engines(self) -> int:
        return 0 if self.worker_type == "placeholder" else self.num_gpus // self.num_gpus_per_engine

    def override_args(self) -> list[str]:
        """The overrides as vLLM server command-line tokens (checked against the installed vLLM's parser)."""
        return vllm_flag_tokens(self.overrides)


@dataclass
class ModelDeployment:
    """One model behind its own router."""

    name: str
    role: str
    model_path: str
    update_weights: bool
    server_groups: list[ServerGroup]

    @property
    def num_gpus(self) -> int:
        return sum(group.num_gpus for group in self.server_groups)

    @property
    def num_engines(self) -> int:
        return sum(group.num_engines for group in self.server_groups)


@dataclass
class VLLMConfig:
    """Every model of a ``--vllm-config`` file, resolved against the command line."""

    models: list[ModelDeployment]

    @property
    def policy(self) -> ModelDeployment:
        return next(model for model in self.models if model.role == "policy")

    def model(self, name: str) -> ModelDeployment:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model named {name!r} in --vllm-config (models: {[m.name for m in self.models]})")


@dataclass(frozen=True)
class EngineSpec:
    """What one engine serves: its model, its GPUs (its tensor-parallel size) and its group's flag overrides."""

    model: str
    model_path: str
    num_gpus: int
    override_args: tuple[str, ...] = ()


def engine_specs(config: VLLMConfig) -> list[EngineSpec]:
    """Every engine, in slot order: the policy's first (slot ``i`` is the policy's engine ``i``), then the other
    models' in file order. Placeholder groups start none."""
    models = [config.policy] + [model for model in config.models if model.role != "policy"]
    return [
        EngineSpec(model.name, model.model_path, group.num_gpus_per_engine, tuple(group.override_args()))
        for model in models
        for group in model.server_groups
        for _ in range(group.num_engines)
    ]


def default_config(args: argparse.Namespace) -> VLLMConfig:
    """What a run without ``--vllm-config`` serves: the policy on ``--rollout-num-gpus`` GPUs, or on the engines of
    ``--rollout-external-engine-addrs``."""
    per_engine = args.rollout_num_gpus_per_engine
    external = args.rollout_external_engine_addrs
    group = ServerGroup(
        "regular", len(external) * per_engine if external else args.rollout_num_gpus, per_engine
    )
    return VLLMConfig([ModelDeployment("policy", "policy", args.hf_checkpoint, True, [group])])


# What each flag needs of engines vime starts, which --rollout-external-engine-addrs engines are not.
_NEEDS_OWN_ENGINES = {
    "colocate": "--colocate puts engines on the trainer's GPUs and sleeps them while it trains",
    "offload_rollout": "--offload-rollout sleeps the engines (vLLM sleep mode is a start-up flag)",
    "use_fault_tolerance": "--use-fault-tolerance restarts dead engines, which only their owner can do (unlike "
    "slime, which warns and runs without it, vime refuses rather than drop the flag)",
    "vllm_config": "--vllm-config describes engines vime starts (slime: mutually exclusive with external engines)",
    "use_rollout_routing_replay": "--use-rollout-routing-replay needs engines started with the flags that return "
    "routed experts",
    "debug_train_only": "--debug-train-only runs no rollout",
}


def external_engine_url(addr: str) -> str:
    """``host:port`` or ``http://host:port`` -> ``http://host:port`` (ValueError naming the address)."""
    url = (addr if "://" in addr else f"http://{addr}").rstrip("/")
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None or parsed.path:
        raise ValueError(
            f"--rollout-external-engine-addrs: {addr!r} is not an engine address; use host:port or "
            "http://host:port (IPv6 in brackets)"
        )
    return url


def check_external_engines(args: argparse.Namespace) -> None:
    """``--rollout-external-engine-addrs``: what it excludes, and no engine of vime's own (``--rollout-num-gpus``
    0, the default with it)."""
    if not args.rollout_external_engine_addrs:
        return
    for addr in args.rollout_external_engine_addrs:
        external_engine_url(addr)
    for dest, reason in _NEEDS_OWN_ENGINES.items():
        if getattr(args, dest):
            raise ValueError(
                f"--rollout-external-engine-addrs with {reason}: it needs engines vime starts itself; drop one of "
                "the two"
            )
    if args.rollout_num_gpus:
        raise ValueError(
            f"--rollout-external-engine-addrs with --rollout-num-gpus {args.rollout_num_gpus}: the run rolls out "
            "on the external engines only; drop --rollout-num-gpus (or pass 0)"
        )
    own_flags = [
        "--vllm-" + token[2:] for token in passthrough_cli_args(args, "vllm") if token.startswith("--")
    ]
    if own_flags:
        raise ValueError(
            f"--rollout-external-engine-addrs with {own_flags}: --vllm-* flags configure engines vime starts; the "
            "external engines keep the flags they were started with. Drop them"
        )


def check_vllm_config(args: argparse.Namespace) -> None:
    """Parse-time checks of ``--vllm-config``: the whole file resolves, and what the run's other flags exclude."""
    config = load_vllm_config(args.vllm_config, args)
    frozen = [model.name for model in config.models if model.role != "policy"]
    if frozen and args.offload_rollout:
        raise VLLMConfigError(
            f"--vllm-config {args.vllm_config}: frozen models {frozen} with --colocate / --offload-rollout: sleeping "
            "engines drop their weights and get them back from the trainer's sync, which a frozen model never "
            "receives; serve frozen models without --colocate (their own GPUs)"
        )


def serving_config(args: argparse.Namespace) -> VLLMConfig:
    """``--vllm-config``, or the policy alone."""
    return load_vllm_config(args.vllm_config, args) if args.vllm_config else default_config(args)


def load_vllm_config(path: str | Path, args: argparse.Namespace) -> VLLMConfig:
    """Read and resolve ``path`` (see the module docstring); :class:`VLLMConfigError` on anything wrong."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise VLLMConfigError(f"--vllm-config {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise VLLMConfigError(f"--vllm-config {path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("vllm"), list) or not data["vllm"]:
        raise VLLMConfigError(
            f"--vllm-config {path}: expected a top-level 'vllm:' list of models, got "
            f"{list(data) if isinstance(data, dict) else type(data).__name__}"
        )
    models = [_model(path, i, entry, args) for i, entry in enumerate(data["vllm"])]
    names = [model.name for model in models]
    if len(set(names)) != len(names):
        raise VLLMConfigError(f"--vllm-config {path}: model names must be unique, got {names}")
    policies = [model.name for model in models if model.role == "policy"]
    if len(policies) != 1:
        raise VLLMConfigError(
            f"--vllm-config {path}: exactly one model must be the policy (role: policy, weight-synced), got "
            f"{policies or 'none'}"
        )
    total = sum(model.num_gpus for model in models)
    if total != args.rollout_num_gpus:
        raise VLLMConfigError(
            f"--vllm-config {path}: the server groups hold {total} GPUs but --rollout-num-gpus is "
            f"{args.rollout_num_gpus}; make them equal"
        )
    return VLLMConfig(models)


def _model(path: Path, index: int, entry: Any, args: argparse.Namespace) -> ModelDeployment:
    where = f"--vllm-config {path}: model #{index}"
    entry = _mapping(entry, where, {"name", "role", "model_path", "update_weights", "num_gpus_per_engine",
                                    "server_groups"})  # fmt: skip
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise VLLMConfigError(f"{where}: 'name' (a non-empty string) is required")
    where = f"--vllm-config {path}: model {name!r}"
    model_path = str(entry.get("model_path") or args.hf_checkpoint)
    update_weights = entry.get("update_weights")
    role = entry.get("role")
    if role is None:
        role = "policy" if model_path == args.hf_checkpoint and update_weights is not False else "reference"
    if role not in ROLES:
        raise VLLMConfigError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    if update_weights is None:
        update_weights = role == "policy"
    if update_weights != (role == "policy"):
        raise VLLMConfigError(
            f"{where}: update_weights is {update_weights} but role is {role}; only the policy model is weight-synced"
        )
    per_engine = _positive_int(entry.get("num_gpus_per_engine", args.rollout_num_gpus_per_engine), where,
                               "num_gpus_per_engine")  # fmt: skip
    groups = entry.get("server_groups")
    if not isinstance(groups, list) or not groups:
        raise VLLMConfigError(f"{where}: 'server_groups' (a non-empty list) is required")
    server_groups = [
        _group(f"{where}, server group #{i}", group, per_engine, args) for i, group in enumerate(groups)
    ]
    if not any(group.num_engines for group in server_groups):
        raise VLLMConfigError(f"{where}: no server group starts an engine (all are placeholders)")
    uneven = [
        g.num_gpus_per_engine for g in server_groups if g.num_engines and g.num_gpus_per_engine != per_engine
    ]
    if role == "policy" and (uneven or per_engine != args.rollout_num_gpus_per_engine):
        raise VLLMConfigError(
            f"{where}: the policy's engines must all have --rollout-num-gpus-per-engine "
            f"{args.rollout_num_gpus_per_engine} GPUs (the weight sync is laid out by it); set num_gpus_per_engine "
            "on the frozen models only"
        )
    return ModelDeployment(name, role, model_path, bool(update_weights), server_groups)


def _group(where: str, entry: Any, per_engine: int, args: argparse.Namespace) -> ServerGroup:
    entry = _mapping(entry, where, {"worker_type", "num_gpus", "num_gpus_per_engine", "overrides"})
    worker_type = entry.get("worker_type", "regular")
    if worker_type in ("prefill", "decode"):
        raise VLLMConfigError(f"{where}: worker_type {worker_type}: {PD_REFUSAL}")
    if worker_type not in WORKER_TYPES:
        raise VLLMConfigError(f"{where}: worker_type {worker_type!r} is not one of {', '.join(WORKER_TYPES)}")
    num_gpus = _positive_int(entry.get("num_gpus"), where, "num_gpus")
    per_engine = _positive_int(entry.get("num_gpus_per_engine", per_engine), where, "num_gpus_per_engine")
    if num_gpus % per_engine:
        raise VLLMConfigError(
            f"{where}: num_gpus {num_gpus} is not a multiple of num_gpus_per_engine {per_engine}"
        )
    if problem := engine_size_problem(per_engine, args.num_gpus_per_node):
        raise VLLMConfigError(f"{where}: num_gpus_per_engine {per_engine}: {problem}")
    overrides = entry.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise VLLMConfigError(f"{where}: 'overrides' must be a mapping of vLLM server flags to values")
    group = ServerGroup(worker_type, num_gpus, per_engine, dict(overrides))
    try:
        group.override_args()
    except ValueError as exc:
        raise VLLMConfigError(f"{where}: overrides: {exc}") from None
    return group


def _mapping(entry: Any, where: str, keys: set[str]) -> dict:
    if not isinstance(entry, dict):
        raise VLLMConfigError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - keys)
    if unknown:
        raise VLLMConfigError(f"{where}: unknown key(s) {unknown}; valid: {sorted(keys)}")
    return entry


def _positive_int(value: Any, where: str, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VLLMConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def vllm_flag_tokens(flags: dict[str, Any]) -> list[str]:
    """``{max_model_len: 4096, enforce_eager: true}`` as vLLM server tokens, each key and value checked against
    the installed vLLM's own parser (ValueError naming the key: unknown, set by vime, or a bad value)."""
    if not flags:  # nothing to check; building vLLM's parser would import vLLM (~10 CPU-s) in every caller
        return []
    parser = build_vllm_serve_parser()
    if parser is None:
        raise ValueError("vLLM is not installed")
    actions = {option: action for action in parser._actions for option in action.option_strings}
    tokens: list[str] = []
    for key, value in flags.items():
        option = "--" + str(key).replace("_", "-")
        action = actions.get(option)
        if action is None:
            close = difflib.get_close_matches(option, list(actions), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"{key!r} is not a flag of the installed vLLM server{hint}")
        if action.dest in VIME_OWNED_VLLM_FLAGS:
            raise ValueError(f"{key!r}: vime sets this itself ({VIME_OWNED_VLLM_FLAGS[action.dest]})")
        tokens += _tokens(option, action, value, key)
    return tokens


def _tokens(option: str, action: argparse.Action, value: Any, key: str) -> list[str]:
    if action.nargs == 0:  # store_true / store_false / BooleanOptionalAction
        if not isinstance(value, bool):
            raise ValueError(f"{key!r} is a switch: give true or false, not {value!r}")
        if value:
            return [option]
        negative = "--no-" + option[2:]
        if negative in action.option_strings:
            return [negative]
        raise ValueError(f"{key!r}: false is the default; leave the key out")
    values = value if isinstance(value, list) else [value]
    raw = [json.dumps(v) if isinstance(v, dict) else str(v).lower() if isinstance(v, bool) else str(v)
           for v in values]  # fmt: skip
    for item in raw:
        converted: Any = item
        if action.type is not None:
            try:
                converted = action.type(item)
            except Exception as exc:  # upstream types raise ValueError, TypeError, ArgumentTypeError...
                raise ValueError(f"{key!r}: invalid value {item!r}: {exc}") from None
        if action.choices is not None and converted not in action.choices:
            raise ValueError(f"{key!r}: {item!r} is not one of {list(action.choices)}")
    return [f"{option}={raw[0]}"] if len(raw) == 1 else [option, *raw]
