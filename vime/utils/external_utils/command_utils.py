"""``execute_train``: start a training run from a Python launch script (slime's helper, as its
``examples/*/run_*.py`` call it).

slime's version stops every SGLang/Ray process on the machine, starts a fresh Ray head and submits the run as a Ray
job. vime's runs the entry point directly instead: a run without ``RAY_ADDRESS`` starts its own local Ray instance
that dies with it, and one with ``RAY_ADDRESS`` joins that cluster (README, "Loops, resume, clusters"), so nothing
needs killing first. The model's ``MODEL_ARGS`` come from ``scripts/models/<megatron_model_type>.sh`` as in slime.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vime.utils.misc import exec_command

REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass
class ExecuteTrainConfig:
    """slime's launch settings that vime reads: extra environment variables as ``"K1=V1,K2=V2"``. (slime's
    ``cuda_core_dump`` and ``num_nodes`` configure its Ray job and are refused when set.)"""

    cuda_core_dump: bool = False
    num_nodes: int = 1
    extra_env_vars: str = ""


def parse_env_vars(text: str) -> dict[str, str]:
    """``"K1=V1,K2=V2"`` as a dict (empty text: none); a pair without ``=`` raises ``ValueError``."""
    pairs = [item.strip() for item in text.split(",") if item.strip()]
    for item in pairs:
        if "=" not in item:
            raise ValueError(f"extra_env_vars: {item!r} is not KEY=VALUE (expected 'K1=V1,K2=V2')")
    return dict(item.split("=", 1) for item in pairs)


def execute_train(
    train_args: str,
    num_gpus_per_node: int,
    megatron_model_type: str | None,
    train_script: str = "train.py",
    before_ray_job_submit: Callable[[], None] | None = None,
    extra_env_vars: dict[str, str] | None = None,
    config: ExecuteTrainConfig | None = None,
) -> None:
    """Run ``python <train_script> [MODEL_ARGS] <train_args>`` (this interpreter) from vime's checkout with ``extra_env_vars`` set;
    a failing run raises ``subprocess.CalledProcessError``. ``num_gpus_per_node`` is slime's Ray head size: vime
    takes the GPUs from the train flags (``--actor-num-gpus-per-node``, ``--rollout-num-gpus``).
    ``before_ray_job_submit`` runs just before the run starts, as in slime."""
    config = config or ExecuteTrainConfig()
    if config.cuda_core_dump or config.num_nodes != 1:
        raise ValueError(
            "execute_train: cuda_core_dump and num_nodes configure slime's Ray job; for several nodes start Ray on "
            "each (ray start) and run the train script with RAY_ADDRESS set (README, 'Loops, resume, clusters')"
        )
    env = {**(extra_env_vars or {}), **parse_env_vars(config.extra_env_vars)}
    model_args = ""
    if megatron_model_type is not None:
        script = REPO_ROOT / "scripts" / "models" / f"{megatron_model_type}.sh"
        if not script.exists():
            known = sorted(p.stem for p in script.parent.glob("*.sh"))
            raise ValueError(f"execute_train: no {script}; model types here: {', '.join(known)}")
        model_args = f"source {shlex.quote(str(script))} && "
    if before_ray_job_submit is not None:
        before_ray_job_submit()
    exports = "".join(f"export {key}={shlex.quote(value)} && " for key, value in env.items())
    script_path = Path(train_script)
    if not script_path.is_absolute():
        script_path = REPO_ROOT / script_path
    model_flags = '"${MODEL_ARGS[@]}" ' if megatron_model_type is not None else ""
    exec_command(
        f"cd {shlex.quote(str(REPO_ROOT))} && export PYTHONUNBUFFERED=1 && {exports}{model_args}"
        f"{shlex.quote(sys.executable)} {shlex.quote(str(script_path))} {model_flags}{train_args}"
    )
