"""``torch_dist`` checkpoints (DESIGN.md §7) through ``megatron.core.dist_checkpointing``, and HF export.

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt      last complete rollout id (written last, by rank 0)
    DIR/iter_{rollout_id:07d}/                  torch_dist: {"model": ..., "optimizer": ...} sharded tensors
    DIR/iter_{rollout_id:07d}/vime_state.pt     rank 0: rollout id, optimizer step, LR scheduler state, expert layout
    DIR/iter_{rollout_id:07d}/rng/rank_{r}.pt   per rank: torch, CUDA (+Megatron tracker), python, numpy RNG

The model part is keyed by Megatron's sharded names, so it reloads under another TP/PP/EP layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from vime.backends.megatron_utils import weights
from vime.backends.megatron_utils.grouped_experts import GroupedGemmExperts
from vime.utils.checkpoint_layout import (
    LATEST_FILE,
    host_rng_state,
    iteration_dir,
    latest_iteration,
    set_host_rng_state,
)

# The distributed optimizer's state as its flat per-bucket shards (resumes only with the same TP/PP, any DP).
# megatron-core 0.19.2 without Apex/TE fails on the other formats: the default "fully_sharded_model_space" is
# rejected by its own dist_checkpointing, and "fully_reshardable" trips on torch Adam's per-parameter 'step'.
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rng_state() -> dict:
    return {
        **host_rng_state(),
        "cuda": torch.cuda.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    set_host_rng_state(state)
    torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _ensure_optimizer_state(optimizer) -> None:
    """A fresh distributed optimizer has no state tensors to load into (and, without Apex/TE, its
    ``state_dict`` asserts on that): create them, as Megatron does, with one zero-gradient step on the fp32 main
    params, which the load then overwrites."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is not None and not inner.state and hasattr(sub, "_init_optimizer_states_with_dummy_values"):
            sub._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer, loaded: dict) -> None:
    """Give every parameter's Adam state the step count the checkpoint saved, as its own tensor.

    megatron-core 0.19.2 without Apex/TE keeps torch Adam's per-parameter ``step`` in the param groups of the
    checkpoint, and its ``load_state_dict`` sets it, but the dp_reshardable parameter state then copies back the
    step counters the optimizer held *before* the load (it marks them non-persistent): a resumed run restarted
    Adam's bias correction at the dummy step 1 (seen at EP=4, ``tests/gpu/test_checkpoint_ep_gpu.py``). The load
    also shares one ``step`` tensor between all states, which torch's Adam would then increment once per
    parameter per step."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    per_sub = [loaded] if len(subs) == 1 else [loaded[key] for key in sorted(loaded)]
    for sub, saved in zip(subs, per_sub, strict=True):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        groups = saved.get("optimizer", {}).get("param_groups", []) if isinstance(saved, dict) else []
        steps = {group["step"] for group in groups if group.get("step") is not None}
        if len(steps) > 1:
            raise ValueError(
                f"the checkpoint's optimizer param groups disagree on Adam's step: {sorted(steps)}"
            )
        saved_step = float(next(iter(steps))) if steps else None
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                step = state["step"]
                state["step"] = step.clone() if saved_step is None else torch.full_like(step, saved_step)


def _sync_hybrid_optimizer(optimizer) -> None:
    """``--optimizer-cpu-offload``: megatron-core 0.19.2 re-syncs its ``HybridDeviceOptimizer`` after loading the
    fully_reshardable and fs_model_space formats but not after dp_reshardable (``METADATA``): do it here, so the
    loaded master weights reach the CPU optimizers' fp32 copies and the loaded state sits on each one's device."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if hasattr(inner, "_sync_hdo_state_to_sub_optimizers"):
            inner._sync_hdo_state_to_sub_optimizers()


def save(save_dir, rollout_id: int, model, optimizer, scheduler, step: int) -> Path:
    """Write ``iter_{rollout_id}`` (collective); the caller then marks it the latest (``mark_latest``)."""
    out = iteration_dir(save_dir, rollout_id)
    out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(metadata=METADATA)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=METADATA)
    dist_checkpointing.save(state, str(out))
    rank = dist.get_rank()
    (out / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), out / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        torch.save(
            {
                "rollout_id": rollout_id,
                "step": step,
                "scheduler": scheduler.state_dict() if scheduler else None,
                "expert_layout": expert_layout(model),
            },
            out / "vime_state.pt",
        )
    dist.barrier()  # every rank's files exist before the caller declares the checkpoint complete
    return out


def load(load_dir, step: int | None, model, optimizer, scheduler, load_rng: bool) -> dict:
    """Restore the model (and optimizer, scheduler, RNG when given) from ``load_dir``'s iteration ``step``
    (default: the latest). Returns ``vime_state.pt`` (rollout id, step). Collective."""
    step = step if step is not None else latest_iteration(load_dir)
    if step is None:
        raise FileNotFoundError(f"{load_dir} has no {LATEST_FILE}")
    iter_dir = iteration_dir(load_dir, step)
    if not iter_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint {iter_dir}")
    vime_state = torch.load(iter_dir / "vime_state.pt", weights_only=False)
    if optimizer is not None:
        check_optimizer_layout(vime_state, model, optimizer, iter_dir)
    state = {"model": model.sharded_state_dict(metadata=METADATA)}
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True, metadata=METADATA)
    loaded = dist_checkpointing.load(state, str(iter_dir))
    model.load_state_dict(loaded["model"], strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer, loaded["optimizer"])
        _sync_hybrid_optimizer(optimizer)
    if scheduler is not None and vime_state.get("scheduler") is not None:
        scheduler.load_state_dict(vime_state["scheduler"])
    rng_file = iter_dir / "rng" / f"rank_{dist.get_rank()}.pt"
    if load_rng and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return vime_state


def expert_layout(model) -> str:
    """How ``model`` holds its MoE experts' weights: ``stacked`` (``--moe-grouped-gemm``) or ``per-expert``."""
    return "stacked" if any(isinstance(m, GroupedGemmExperts) for m in model.modules()) else "per-expert"


def check_optimizer_layout(vime_state: dict, model, optimizer, iter_dir: Path) -> None:
    """Refuse to load a distributed optimizer's state saved under the other expert layout: that state is flat
    per gradient bucket, whose order the layout changes, so it would load into the wrong parameters. (The model's
    weights, and a plain optimizer's state, are keyed per expert and load either way.)"""
    saved = vime_state.get("expert_layout", "per-expert")  # checkpoints from before stacked experts
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    if saved != expert_layout(model) and any(isinstance(o, DistributedOptimizer) for o in inners):
        flag = "with" if saved == "stacked" else "without"
        raise ValueError(
            f"{iter_dir}: its distributed optimizer state was saved with {saved} expert weights, this run holds "
            f"them {expert_layout(model)}; that state is laid out by gradient bucket and cannot move between the "
            f"two. Resume {flag} --moe-grouped-gemm, or load the weights only (--no-load-optim)"
        )


def export_hf(model, out_dir, tokenizer_path, hf_vocab_size: int, dtype: torch.dtype) -> None:
    """Write an HF directory: the gathered weights (rank 0 writes) plus the config and tokenizer of
    ``tokenizer_path`` (the ``--hf-checkpoint``). Collective."""
    tensors = {}
    for name, tensor in weights.iter_hf_tensors(model, hf_vocab_size, dtype):
        if dist.get_rank() == 0:
            tensors[name] = tensor.cpu().clone()
    if dist.get_rank() == 0:
        write_hf_dir(tensors, out_dir, tokenizer_path, dtype)
    dist.barrier()


def write_hf_dir(tensors: dict[str, torch.Tensor], out_dir, source_dir, dtype: torch.dtype) -> None:
    """Save ``tensors`` as safetensors with ``source_dir``'s config (dtype updated), generation config and
    tokenizer files."""
    import json
    import shutil

    from huggingface_hub import save_torch_state_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(tensors, out)
    source = Path(source_dir)
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in source.iterdir():
        if (
            extra.name != "config.json"
            and not extra.name.endswith(".safetensors")
            and extra.name != ("model.safetensors.index.json")
            and extra.is_file()
        ):
            shutil.copy(extra, out / extra.name)
