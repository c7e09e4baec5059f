"""The micro-batch memory plan on a real GPU (FSDP2 and Megatron, bf16, Adam): its prediction matches the peak a
real training step reaches, where the activations set it and where the optimizer step's temporaries do (small
micro-batches), and a plan that cannot fit fails when the trainer is built, before any step, naming the flag and
the size that would fit."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _args(backend, model_dir, max_tokens):
    from vime.backends.megatron_utils.hf_config import flags_from_hf_config, flags_to_argv, load_hf_config
    from vime.utils.arguments import parse_args

    argv = [
        "--train-backend", backend, "--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--bf16",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(max_tokens), "--rollout-max-response-len", "1024",
    ]  # fmt: skip
    if backend == "megatron":
        argv += flags_to_argv(flags_from_hf_config(load_hf_config(model_dir)))
    return parse_args(argv)


def _trainer_class(backend):
    if backend == "megatron":
        if importlib.util.find_spec("megatron.core") is None:
            pytest.skip("needs megatron-core")
        from vime.backends.megatron_utils.trainer import MegatronTrainer

        return MegatronTrainer
    from vime.backends.fsdp_utils.trainer import FSDPTrainer

    return FSDPTrainer


@pytest.mark.parametrize("max_tokens", [8192, 512])  # the activations set the peak; the optimizer step does
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_memory_plan_predicts_the_step_peak_and_refuses_what_cannot_fit(backend, max_tokens, tmp_path):
    from vime.tools.make_tiny_model import build_tiny_model
    from vime.utils.types import Sample, Status

    Trainer = _trainer_class(backend)
    model_dir = build_tiny_model(tmp_path / "model", seed=0, task=None, num_layers=4, hidden_size=1024,
                                 intermediate_size=4096, max_position_embeddings=4096)  # fmt: skip
    trainer = Trainer(_args(backend, model_dir, max_tokens))
    plan = trainer.memory_plan
    assert plan is not None and plan.fits and plan.tokens == max_tokens
    step_bound = plan.optimizer_step_bytes > plan.activation_bytes
    assert step_bound == (max_tokens == 512), plan.summary()
    g = torch.Generator().manual_seed(0)
    length = min(1024, max_tokens)
    samples = [  # two micro-batches of exactly the token budget (the second one runs with the first one's
        # gradients resident)
        Sample(index=i, tokens=torch.randint(4, 61, (length,), generator=g).tolist(), response_length=length - 1,
               reward=float(i % 2), status=Status.COMPLETED)
        for i in range(2 * max_tokens // length)
    ]  # fmt: skip
    advantages = [1.0, -1.0] * (len(samples) // 2)
    trainer.train(0, samples, advantages)  # creates the optimizer state the plan accounts for
    torch.cuda.reset_peak_memory_stats()
    trainer.train(1, samples, advantages)
    measured = torch.cuda.max_memory_allocated()
    print(
        f"{backend}, {max_tokens} tokens: predicted {plan.predicted_peak_bytes / 2**30:.2f} GiB, measured "
        f"{measured / 2**30:.2f} GiB ({plan.summary()})"
    )
    assert abs(plan.predicted_peak_bytes - measured) < 0.15 * measured
    del trainer
    torch.cuda.empty_cache()
    if max_tokens != 8192:
        return

    too_big = 64 * plan.max_fitting_tokens
    with pytest.raises(MemoryError, match=r"--max-tokens-per-gpu \d+ or lower") as refused:
        Trainer(_args(backend, model_dir, too_big))
    suggested = int(str(refused.value).split("--max-tokens-per-gpu ")[1].split()[0])
    assert 0 < suggested < too_big
