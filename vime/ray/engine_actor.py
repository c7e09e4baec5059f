"""Engines on every node: each vLLM engine is owned by a small Ray actor placed in its placement-group bundle, so
its server runs on that bundle's node, under the actor's process guard, and listens on the node's address.

The rollout manager holds a :class:`RemoteEngine` per engine (an ``EngineHandle``, like a local ``VLLMEngine``);
the health monitor restarts a dead engine, or one whose actor died, through :class:`NodeEngines` on the same
bundle. Only the server lifecycle lives in the actor (``VLLMEngine``); this module only wires it to Ray.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.backends.vllm_utils import control_auth
from vime.backends.vllm_utils.engine import VLLMEngine, engine_command, ray_executor_launch
from vime.ray import serving_session
from vime.ray.placement_group import EnginePlacement
from vime.utils.process_group import end_group
from vime.utils.vllm_config import EngineSpec

# How long a call to a live engine actor may take before the engine counts as unreachable (a health probe).
ACTOR_CALL_TIMEOUT_S = 60.0


class NodeEngine(VLLMEngine):
    """A :class:`VLLMEngine` on the actor's node, reporting where it runs. Kept across runs
    (``--rollout-session-id``, :mod:`vime.ray.serving_session`), it also tells a new run what it runs and which run
    holds it."""

    owner: str | None = None  # the Ray job (hex id) of the run that uses it, with --rollout-session-id
    runs = 0  # how many runs have used it

    def address(self) -> str:
        return self.url

    def launch(self) -> None:
        """:meth:`start` (which returns the engine itself: nothing to send back from an actor); nothing when a
        kept engine's server already runs."""
        if not self.is_alive():
            self.start()

    def where(self) -> dict:
        """Its URL, node (Ray id and address), the actor's pid and the server's (its process guard's, the leader
        of the server's process group), and how many runs it served (more than one when kept)."""
        return {
            "url": self.url,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_pid": os.getpid(),
            "server_pid": self.proc.pid if self.proc is not None else None,
            "runs": self.runs,
        }

    def control_secret(self) -> str:
        """The control secret its server checks (the run that started it had it)."""
        return os.environ[control_auth.SECRET_ENV]

    def session_info(self) -> dict:
        """What a run checks before it adopts this engine: host, port, the vLLM command, whether the server runs,
        and the job that holds it."""
        alive = self.is_alive()
        return {
            "host": self.host,
            "port": self.port,
            "command": self.command,
            "alive": alive,
            "owner": self.owner,
        }

    def claim(self, job_id: str) -> None:
        """Serve the run of Ray job ``job_id`` from now on."""
        self.owner, self.runs = job_id, self.runs + 1


# Threaded, so health probes and log tails answer while a start waits for readiness.
EngineActor = ray.remote(num_cpus=0, max_concurrency=4)(NodeEngine)


@ray.remote(num_cpus=0)
def _end_server_group(group: int, grace_s: float) -> list[int]:
    """On an engine's node: end what is left of its server's process group; the pids that survived."""
    return end_group(group, grace_s, kill_wait_s=10.0)[1]


class RemoteEngine:
    """The rollout manager's handle on an engine owned by an :data:`EngineActor`. A dead actor counts as a dead
    engine; stopping one ends what is left of its server there (Ray SIGKILLs the actor's process guard, and a vLLM
    server can hang in the SIGTERM that follows, holding the GPU its replacement needs)."""

    def __init__(self, actor: ray.actor.ActorHandle, placement: EnginePlacement, log_path: Path):
        self.actor = actor
        self.placement = placement
        self.log_path = log_path
        # asked now, awaited on first use: the fleet's actors start together, not one after another
        self._url: ray.ObjectRef | str = actor.address.remote()
        self.server_group: int | None = None  # the server's process group on its node, once started

    @property
    def url(self) -> str:
        if isinstance(self._url, ray.ObjectRef):
            self._url = ray.get(self._url)
        return self._url

    def start(self) -> RemoteEngine:
        ray.get(self.actor.launch.remote())
        self.server_group = ray.get(self.actor.where.remote())["server_pid"]
        return self

    def wait_ready_sync(self, timeout: float | None = None) -> float:
        return ray.get(self.actor.wait_ready_sync.remote(timeout))

    def is_alive(self) -> bool:
        try:
            return ray.get(self.actor.is_alive.remote(), timeout=ACTOR_CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def log_tail(self, n: int = 40) -> str:
        try:
            return ray.get(self.actor.log_tail.remote(n), timeout=ACTOR_CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            return f"(the engine's actor on node {self.placement.node_ip} is gone: {type(exc).__name__}; its log is {self.log_path} there)"

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the server, then the actor (killing the actor alone would also end the server, less gently)."""
        try:
            ray.get(self.actor.stop.remote(grace_s))
        except ray.exceptions.RayActorError:
            # the actor died: end what is left of its server from a task on its node
            if self.server_group is not None:
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement.group,
                    placement_group_bundle_index=self.placement.bundle_index,
                )
                left = ray.get(
                    _end_server_group.options(scheduling_strategy=strategy).remote(self.server_group, grace_s)
                )
                if left:
                    raise RuntimeError(f"engine {self.url}: processes {left} survived SIGKILL") from None
        finally:
            ray.kill(self.actor)


@dataclass
class NodeEngines:
    """Launches engine ``slot`` through a new :data:`EngineActor` in ``placements[slot]``'s bundle; the server
    listens on that node's address (Ray's node IP: loopback for a run's own local Ray, the private interface in a
    cluster). An engine over several nodes (``ray_bundles``) gets vLLM's Ray executor on its bundles
    (``vime.backends.vllm_utils.engine_ray_executor``); its workers are Ray actors owned by the server, and end
    with it. With ``session`` (``--rollout-session-id``) the actor is detached and named, and a kept one is adopted
    (:mod:`vime.ray.serving_session`)."""

    placements: list[EnginePlacement]
    session: str | None = None

    @property
    def on_gpu(self) -> bool:
        return any(p.gpus or p.ray_bundles for p in self.placements)  # an engine over nodes runs only on GPUs

    @property
    def num_slots(self) -> int | None:
        return len(self.placements)

    def launch(
        self,
        args: argparse.Namespace,
        slot: int,
        log_path: Path,
        extra_args: Sequence[str],
        env: Mapping[str, str] | None = None,
        spec: EngineSpec | None = None,
    ) -> RemoteEngine:
        placement = self.placements[slot]
        over_nodes: tuple[list[str], dict[str, str]] = ([], {})
        if placement.ray_bundles:  # the server joins this cluster; vLLM's Ray executor starts its workers
            over_nodes = ray_executor_launch(
                ray.get_runtime_context().gcs_address, placement.group.id.hex(), placement.ray_bundles
            )
        extra_args = [*extra_args, *over_nodes[0]]
        actor = self._kept(args, slot, extra_args, spec) if self.session else None
        if actor is None:
            options: dict = {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=placement.group, placement_group_bundle_index=placement.bundle_index
                )
            }
            if self.session:
                name = serving_session.engine_name(self.session, slot)
                options |= {"name": name, "namespace": serving_session.NAMESPACE, "lifetime": "detached"}
            gpus = {"CUDA_VISIBLE_DEVICES": placement.gpus} if placement.gpus else {}
            actor = EngineActor.options(**options).remote(
                args,
                host=placement.node_ip,
                log_path=log_path,
                extra_args=extra_args,
                env={**(env or {}), **gpus, **over_nodes[1]},
                spec=spec,
                cpu_share=placement.cpu_share,
            )
        if self.session:
            ray.get(actor.claim.remote(ray.get_runtime_context().get_job_id()))
        return RemoteEngine(actor, placement, log_path)

    def _kept(
        self, args: argparse.Namespace, slot: int, extra_args: Sequence[str], spec: EngineSpec | None
    ) -> ray.actor.ActorHandle | None:
        """The session's kept engine of ``slot`` if this run may adopt it; None when there is none (or its server
        has exited: the actor is ended, and a new one takes its name). Raises when it runs another vLLM command
        than this run would, or serves a run that is still going."""
        session = self.session
        actor = serving_session.find_engine(session, slot)
        if actor is None:
            return None
        try:
            info = ray.get(actor.session_info.remote(), timeout=ACTOR_CALL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            info = {"alive": False}
        if not info["alive"]:
            ray.kill(actor)
            deadline = time.monotonic() + ACTOR_CALL_TIMEOUT_S
            while serving_session.find_engine(session, slot) is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            return None
        expected = engine_command(args, info["host"], info["port"], extra_args=extra_args, spec=spec)
        if info["command"] != expected:
            raise ValueError(
                f"--rollout-session-id {session}: engine {slot} runs `{shlex.join(info['command'])}`, this run would "
                f"start `{shlex.join(expected)}`; resubmit with the session's engine flags, or use another session id"
            )
        owner = info["owner"]
        if (
            owner is not None
            and owner != ray.get_runtime_context().get_job_id()
            and serving_session.job_is_running(owner)
        ):
            raise RuntimeError(
                f"--rollout-session-id {session}: engine {slot} serves Ray job {owner}, which is still running; stop "
                "that driver first, or use another session id"
            )
        return actor
