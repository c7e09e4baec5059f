"""Checkpoints (DESIGN.md §7) with ``torch.distributed.checkpoint`` (DCP), and HF export.

Layout of ``--save DIR``::

    DIR/latest_checkpointed_iteration.txt       last complete rollout id (written last, by rank 0)
    DIR/iter_{rollout_id:07d}/model/             DCP: sharded weights, keyed by HF parameter names
    DIR/iter_{rollout_id:07d}/optim/             DCP: sharded optimizer state (not with --no-save-optim)
    DIR/iter_{rollout_id:07d}/trainer_state.pt   rank 0: rollout id, optimizer step, LR scheduler, world size
    DIR/iter_{rollout_id:07d}/rng/rank_{r}.pt    per rank: torch (+CUDA), python ``random`` and numpy RNG states

DCP writes each rank's shards in parallel (no full gather) and reshards on load, so a run may resume on a
different number of ranks (then the RNG states of ranks that did not exist are left as seeded). Weights and
optimizer live in separate DCP folders so a weights-only load (reference model, ``--finetune``) reads only weights.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import AutoTokenizer

from vime.backends.fsdp_utils.model import load_hf_model
from vime.backends.fsdp_utils.weights import checkpoint_format, hf_weight_names
from vime.utils.checkpoint_layout import (
    LATEST_FILE,
    host_rng_state,
    iteration_dir,
    latest_iteration,
    set_host_rng_state,
)


def _rng_state() -> dict:
    return {**host_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    set_host_rng_state(state)
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    save_dir: str | Path,
    rollout_id: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    step: int,
) -> Path:
    """Write ``iter_{rollout_id}`` (collective); the caller then marks it the latest (``mark_latest``)."""
    out = iteration_dir(save_dir, rollout_id)
    rank = dist.get_rank()
    dcp.save(get_model_state_dict(model), checkpoint_id=out / "model")
    if optimizer is not None:
        dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=out / "optim")
    (out / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(_rng_state(), out / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        state = {
            "rollout_id": rollout_id,
            "step": step,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "world_size": dist.get_world_size(),
        }
        torch.save(state, out / "trainer_state.pt")
    dist.barrier()  # every rank's files exist before the caller declares the checkpoint complete
    return out


def load_checkpoint(
    iter_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    load_rng: bool,
) -> dict:
    """Restore weights, and optimizer/scheduler when given, and this rank's RNG with ``load_rng``; returns
    ``trainer_state.pt`` (rollout id, step). Collective."""
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=iter_dir / "model")
    set_model_state_dict(model, state)
    if optimizer is not None:
        if not (iter_dir / "optim").is_dir():
            raise FileNotFoundError(
                f"{iter_dir} has no optimizer state (saved with --no-save-optim); pass --no-load-optim"
            )
        optim_state = get_optimizer_state_dict(model, optimizer)
        dcp.load(optim_state, checkpoint_id=iter_dir / "optim")
        set_optimizer_state_dict(model, optimizer, optim_state)
    trainer_state = torch.load(iter_dir / "trainer_state.pt", weights_only=False)
    if scheduler is not None and trainer_state["scheduler"] is not None:
        scheduler.load_state_dict(trainer_state["scheduler"])
    rng_file = iter_dir / "rng" / f"rank_{dist.get_rank()}.pt"
    if load_rng and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state


def load_weights(model: nn.Module, path: str | Path, ckpt_step: int | None = None) -> None:
    """Load only weights into a sharded model, from a vime checkpoint directory (its latest iteration, or
    ``ckpt_step``) or from an HF directory of safetensors. Collective."""
    step = ckpt_step if ckpt_step is not None else latest_iteration(path)
    if step is not None:
        load_checkpoint(iteration_dir(path, step), model, None, None, load_rng=False)
        return
    if not any(Path(path).glob("*.safetensors")):
        raise FileNotFoundError(
            f"{path} is neither a vime checkpoint ({LATEST_FILE}) nor an HF safetensors dir"
        )
    # through transformers, which converts a checkpoint's layout to the in-memory one (e.g. fuses MoE experts)
    full = load_hf_model(str(path), "critic" if hasattr(model, "score") else "actor").state_dict()
    result = set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
    missing = set(result.missing_keys) & set(hf_weight_names(model))
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{path} does not fit the model: missing {sorted(missing)[:5]}, unexpected {result.unexpected_keys[:5]}"
        )


def export_hf(model: nn.Module, out_dir: str | Path, tokenizer_path: str | Path, dtype: torch.dtype) -> None:
    """Write a ``from_pretrained``-loadable HF directory (safetensors in ``dtype`` with the names and layout of
    ``save_pretrained``, config, generation config, tokenizer from ``tokenizer_path``). Collective: the weights are
    gathered to rank 0, which writes; an error there is raised on every rank (instead of leaving the others
    waiting)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    error: Exception | None = None
    if dist.get_rank() == 0:
        try:
            _write_hf(model, full, Path(out_dir), tokenizer_path, dtype)
        except Exception as exc:  # re-raised below, once the other ranks know
            error = exc
    message = [repr(error) if error is not None else None]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise RuntimeError(f"HF export to {out_dir} failed on rank 0: {message[0]}")


def _write_hf(
    model: nn.Module, full: dict, out: Path, tokenizer_path: str | Path, dtype: torch.dtype
) -> None:
    out.mkdir(parents=True, exist_ok=True)

    def cast() -> Iterator[tuple[str, torch.Tensor]]:
        for name in hf_weight_names(model):
            tensor = full.pop(name)
            yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor

    # clone: the gathered tensors can be views into one flat buffer (and the per-expert tensors views into the
    # fused tensor they were split from), which safetensors refuses to write
    tensors = {name: tensor.clone() for name, tensor in checkpoint_format(model, cast())}
    save_torch_state_dict(tensors, out)
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)
