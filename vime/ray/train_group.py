"""Training ranks as Ray actors: thin shells over the backend trainer, and the group that drives them."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime.ray.placement_group import Bundles, BundleSlot, here
from vime.ray.rollout_batch import RolloutBatch, TrainPartition, regroup
from vime.utils.net import interface_of, listen_socket
from vime.utils.types import Sample, Status

if TYPE_CHECKING:  # the driver imports this module; torch is for the ranks
    import torch

    PerSample = list[torch.Tensor]  # one per-token tensor per sample


def cpu_optimizer_threads(args, cores: int) -> int | None:
    """torch's CPU threads for a training rank with ``--optimizer-cpu-offload``, whose optimizer steps run on the
    host: the node's ``cores`` shared by its GPUs (``--num-gpus-per-node``). None otherwise, or where
    ``--train-env-vars`` sets ``OMP_NUM_THREADS``: Ray's ``OMP_NUM_THREADS=1`` for actors that reserve no CPU stays,
    which keeps the trainer's small host-side tensor work from spinning a thread pool per rank."""
    if not getattr(args, "optimizer_cpu_offload", False) or "OMP_NUM_THREADS" in args.train_env_vars:
        return None
    return max(1, cores // max(1, args.num_gpus_per_node))


@ray.remote
class TrainRayActor:
    """One training rank: joins the training process group (:meth:`setup`) and owns a backend trainer."""

    def __init__(self, args, role: str, rank: int, world_size: int):
        self.args, self.role, self.rank, self.world_size = args, role, rank, world_size
        self._listener: socket.socket | None = None

    def master_address(self) -> tuple[str, int]:
        """Rank 0: this node's address and a port bound there for the training group's store (kept for
        :meth:`setup`, so no other process can take it meanwhile)."""
        self._listener = listen_socket(ray.util.get_node_ip_address())
        return self._listener.getsockname()[:2]

    def setup(self, master: tuple[str, int]) -> None:
        """Join the training process group at rank 0's address (``master``), then build the trainer."""
        master_addr, master_port = master
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
        )  # fmt: skip
        # gloo listens on the interface of its host name unless told; use the one Ray's node address is on
        if interface := interface_of(ray.util.get_node_ip_address()):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        from vime.utils.distributed import init_distributed

        init_distributed(listener=self._listener)
        self._listener = None
        if threads := cpu_optimizer_threads(self.args, len(os.sched_getaffinity(0))):
            import torch

            torch.set_num_threads(threads)
        if self.args.train_backend == "megatron":
            from vime.backends.megatron_utils.trainer import MegatronTrainer as Trainer
        else:
            from vime.backends.fsdp_utils.trainer import FSDPTrainer as Trainer
        self.trainer = Trainer(self.args, role=self.role)

    def slot(self) -> BundleSlot:
        """Where this rank runs (node, GPU): a colocated engine shares its GPU."""
        return here(with_gpu=True)

    def data_parallel_rank(self) -> tuple[int, int]:
        """(rank, size) of this rank's data-parallel group: ranks with the same DP rank (tensor/pipeline/expert
        parallel peers) must get the same samples."""
        return self.trainer.dp_rank, self.trainer.dp_size

    def load(self) -> int | None:
        return self.trainer.load()

    def train(self, rollout_id: int, partition: TrainPartition, **per_sample: PerSample) -> dict[str, float]:
        return self.trainer.train(rollout_id, partition.samples, partition.rewards, **per_sample)

    def compute(self, kind: str, partition: TrainPartition) -> PerSample:
        """Forward-only per-token outputs: ``log_probs``, ``ref_log_probs`` (actor) or ``values`` (critic)."""
        if kind == "values":
            return self.trainer.compute_values(partition.samples)
        return self.trainer.compute_log_probs(
            partition.samples, model={"log_probs": self.trainer.old_policy, "ref_log_probs": "ref"}[kind]
        )

    def sequence_log_probs(self, tokens: list[int]) -> list[float]:
        """The policy's log-probs of ``tokens[1:]`` (every rank scores the same sequence)."""
        sample = Sample(
            index=0, tokens=list(tokens), response_length=len(tokens) - 1, status=Status.COMPLETED
        )
        return self.trainer.compute_log_probs([sample])[0].tolist()

    def save(self, rollout_id: int, save_dir: str, mark: bool = True) -> None:
        self.trainer.save(rollout_id, save_dir, mark)

    def mark_saved(self, rollout_id: int, save_dir: str) -> None:
        self.trainer.mark_saved(rollout_id, save_dir)

    def offload(self) -> dict[str, float]:
        return self.trainer.offload()

    def onload(self) -> dict[str, float]:
        return self.trainer.onload()

    def export_hf(self, out_dir: str) -> None:
        self.trainer.export_hf(out_dir)

    def sync_weights(self, engine_urls: list[str], version: int, disk_dir: str | None) -> dict[str, float]:
        """Push the current weights to every engine (rank 0 talks to engines; all ranks gather shards)."""
        from vime.backends.vllm_utils.weight_sync import sync_weights_from_trainer

        metrics = sync_weights_from_trainer(
            self.trainer, self.rank, self.args, engine_urls, version, disk_dir
        )
        self.trainer.after_weight_sync()  # --keep-old-actor: the weights the next rollout is generated with
        return metrics

    def push_rollout_weights(
        self, engine_urls: list[str], version: int, disk_dir: str | None, check_tokens: list[int] | None
    ) -> tuple[dict[str, float], list[float] | None]:
        """Push the weights the current rollout is generated with (``--keep-old-actor``'s kept copy, see
        ``rollout_weights_loaded``) to ``engine_urls`` as ``version``, and score ``check_tokens`` with them (the
        weight check's reference), leaving the trained weights and the old actor as they were."""
        from vime.backends.vllm_utils.weight_sync import sync_weights_from_trainer

        with self.trainer.rollout_weights_loaded():
            metrics = sync_weights_from_trainer(
                self.trainer, self.rank, self.args, engine_urls, version, disk_dir
            )
            return metrics, self.sequence_log_probs(check_tokens) if check_tokens else None


class RayTrainGroup:
    """The actor (or critic) ranks: splits each rollout over data-parallel ranks and calls them together.

    Making the group starts its ranks, which build their trainers in the background (while the engines start);
    :meth:`wait_ready` waits for them, and must come before any other call."""

    def __init__(self, args, bundles: Bundles, role: str = "actor"):
        self.args = args
        world_size = len(bundles.indices)
        # expandable segments: packed micro-batches of varying sizes otherwise fragment the caching allocator
        allocator_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        self.actors = [
            TrainRayActor.options(
                num_cpus=1 if bundles.resource == "CPU" else 0,
                num_gpus=1 if bundles.resource == "GPU" else 0,
                runtime_env={
                    "env_vars": {"PYTORCH_CUDA_ALLOC_CONF": allocator_conf}
                    | {k: str(v) for k, v in args.train_env_vars.items()}
                },
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=bundles.group, placement_group_bundle_index=index
                ),
            ).remote(args, role, rank, world_size)
            for rank, index in enumerate(bundles.indices)
        ]
        master = self.actors[0].master_address.remote()  # rank 0's node; Ray hands each rank the value
        self._setup = [actor.setup.remote(master) for actor in self.actors]
        self.dp_ranks: list[int] = []
        self.dp_size = 0

    def wait_ready(self) -> None:
        """Wait until every rank has joined the group and built its trainer (raises a rank's setup error)."""
        if self._setup:
            ray.get(self._setup)
            self._setup = []
            dp = ray.get([actor.data_parallel_rank.remote() for actor in self.actors])
            self.dp_ranks, self.dp_size = [rank for rank, _ in dp], dp[0][1]

    def slots(self) -> list[BundleSlot]:
        """Node and GPU of every rank, in rank order."""
        return ray.get([actor.slot.remote() for actor in self.actors])

    def load(self) -> int | None:
        """Load every rank; returns the last saved rollout id (None for a fresh start)."""
        return ray.get([actor.load.remote() for actor in self.actors])[0]

    def compute(self, kind: str, batch: RolloutBatch) -> list[ray.ObjectRef]:
        """Per-sample forward outputs (see ``TrainRayActor.compute``) of every data-parallel rank's share of
        ``batch``, as one object reference per data-parallel rank (its tensor/pipeline peers compute the same)."""
        parts = batch.partitions[self.dp_size]
        futures = [
            actor.compute.remote(kind, parts[dp])
            for actor, dp in zip(self.actors, self.dp_ranks, strict=True)
        ]
        return [futures[self.dp_ranks.index(dp)] for dp in range(self.dp_size)]

    def for_me(self, refs: list[ray.ObjectRef], batch: RolloutBatch, dp_size: int) -> list[ray.ObjectRef]:
        """Per-sample results that another group computed (one reference per rank of its ``dp_size``), re-cut for
        this group's data-parallel ranks."""
        return regroup(refs, batch.indices[dp_size], batch.indices[self.dp_size])

    def train_async(
        self, rollout_id: int, batch: RolloutBatch, **per_sample: list[ray.ObjectRef]
    ) -> list[ray.ObjectRef]:
        """Start training on one rollout: every rank gets its data-parallel rank's share of ``batch`` and of each
        per-sample input (e.g. the critic's ``values``, one reference per data-parallel rank), by reference.
        Returns one metrics future per rank."""
        parts = batch.partitions[self.dp_size]
        return [
            actor.train.remote(rollout_id, parts[dp], **{key: refs[dp] for key, refs in per_sample.items()})
            for actor, dp in zip(self.actors, self.dp_ranks, strict=True)
        ]

    def train(
        self, rollout_id: int, batch: RolloutBatch, **per_sample: list[ray.ObjectRef]
    ) -> dict[str, float]:
        """:meth:`train_async` and wait; the last rank's metrics (global values; with pipeline parallelism only the
        last stage has the loss)."""
        return ray.get(self.train_async(rollout_id, batch, **per_sample))[-1]

    def sequence_log_probs(self, tokens: list[int]) -> list[float]:
        """The policy's log-probs of ``tokens[1:]`` (rank 0's; every rank computes them, collectively)."""
        return ray.get([actor.sequence_log_probs.remote(tokens) for actor in self.actors])[0]

    def save(self, rollout_id: int, save_dir: str, mark: bool = True) -> None:
        """Every rank writes iteration ``rollout_id``; ``mark``: then declare it complete (else :meth:`mark_saved`)."""
        ray.get([actor.save.remote(rollout_id, save_dir, mark) for actor in self.actors])

    def mark_saved(self, rollout_id: int, save_dir: str) -> None:
        ray.get([actor.mark_saved.remote(rollout_id, save_dir) for actor in self.actors])

    def export_hf(self, out_dir: str) -> None:
        ray.get([actor.export_hf.remote(out_dir) for actor in self.actors])

    def offload(self) -> dict[str, float]:
        """Free every rank's training state on the GPU (``--offload-train``); rank 0's figures."""
        return ray.get([actor.offload.remote() for actor in self.actors])[0]

    def onload(self) -> dict[str, float]:
        """Bring the training state back to the GPUs; rank 0's figures."""
        return ray.get([actor.onload.remote() for actor in self.actors])[0]

    def sync_weights(self, engine_urls: list[str], version: int, disk_dir: str | None) -> dict[str, float]:
        futures = [actor.sync_weights.remote(engine_urls, version, disk_dir) for actor in self.actors]
        return ray.get(futures)[0]

    def push_rollout_weights(
        self, engine_urls: list[str], version: int, disk_dir: str | None, check_tokens: list[int] | None
    ) -> tuple[dict[str, float], list[float] | None]:
        """See ``TrainRayActor.push_rollout_weights``; rank 0's result."""
        args = (engine_urls, version, disk_dir, check_tokens)
        return ray.get([actor.push_rollout_weights.remote(*args) for actor in self.actors])[0]
