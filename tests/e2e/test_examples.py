"""The examples' plug-ins end to end through the real rollout manager (vLLM engine + vllm-router) on the tiny model.

The first pooled engine serves every example (module scope; each test swaps the args and data it needs); the
on-policy distillation test loads a teacher's weights into the second (the pool's next user gets the checkpoint's
back). The tiny model does not solve the tasks: the tests check the pipeline (turns, tool calls and their results,
loss masks covering only generated tokens, log-probs, rewards, metrics). Where a turn must call a tool, its first turn
is constrained by vLLM's structured outputs (``example_plugins``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import example_plugins
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from vime.backends.vllm_utils.control_client import EngineGroup
from vime.rollout import sglang_compat
from vime.rollout.data_source import RolloutDataSource
from vime.rollout.rollout_manager import RolloutManager
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.async_utils import run
from vime.utils.ppo_utils import log_probs_from_logits
from vime.utils.train_data import shape_rewards
from vime.utils.types import Status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
GSM8K = Path(os.environ.get("VIME_SHARED_DIR", REPO.parent / "shared")) / "data" / "gsm8k_test.jsonl"
B, N = 2, 2


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    """The tiny model (seed 0), served by the pool with room for multi-turn conversations (2048 positions)."""
    return tiny_model_dir


@pytest.fixture(scope="module")
def manager(model_dir, tmp_path_factory, shared_engines):
    tmp = tmp_path_factory.mktemp("examples")
    shared_engines.reset()
    args = parse_args(
        [
            "--train-backend", "fsdp", "--debug-rollout-only", "--hf-checkpoint", str(model_dir),
            "--prompt-data", str(model_dir / "train.jsonl"), "--rollout-batch-size", str(B),
            "--n-samples-per-prompt", str(N), "--rollout-max-response-len", "8", "--rm-type", "exact",
            "--num-rollout", "1", "--rollout-external-engine-addrs", *shared_engines.addrs(1),
            "--log-dir", str(tmp),
        ]
    )  # fmt: skip
    mgr = RolloutManager(args, tmp)
    mgr.start()
    yield mgr
    mgr.shutdown()


@pytest.fixture(scope="module")
def policy(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def gsm8k() -> Path:
    if not GSM8K.exists():
        pytest.skip(f"GSM8K test split not found at {GSM8K} (set VIME_SHARED_DIR)")
    return GSM8K


@contextlib.contextmanager
def example(manager, **values):
    """Run the manager with ``values`` swapped into its args (and a data source for their prompt data)."""
    args = manager.args
    saved = {k: getattr(args, k) for k in values}
    vars(args).update(values)
    data_source = manager.data_source
    manager.data_source = RolloutDataSource(args, AutoTokenizer.from_pretrained(args.hf_checkpoint))
    try:
        yield args
    finally:
        vars(args).update(saved)
        manager.data_source = data_source


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal loss-mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


@torch.no_grad()
def engine_log_probs_match_a_forward(model, sample, start: int, end: int) -> float:
    """Mean |engine - transformers| log-prob of response tokens [start, end) given everything before them (a wrong
    context, i.e. tokens the engine did not see, would show as a large difference)."""
    ids = torch.tensor([sample.tokens])
    logits = model(ids).logits[0]
    offset = sample.prompt_length
    positions = torch.arange(offset + start - 1, offset + end - 1)
    ref = log_probs_from_logits(logits[positions], ids[0, offset + start : offset + end], temperature=1.0)
    return (ref - torch.tensor(sample.rollout_log_probs[start:end])).abs().mean().item()


def test_multi_turn_tool_use_runs_the_python_tool_and_masks_its_output(manager, gsm8k, tokenizer, policy):
    with example(
        manager,
        prompt_data=f"{gsm8k}@[:64]", input_key="question", label_key="answer", rollout_max_prompt_len=300,
        custom_generate_function_path="example_plugins.tool_use_calls_python",
        custom_rm_path="examples.multi_turn_tool_use.generate.reward", vllm_tool_call_parser="qwen3_xml",
        rollout_max_response_len=120,
    ):  # fmt: skip
        output = manager.generate(0)
    samples = [s for group in output.samples for s in group]
    assert len(samples) == B * N
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.metadata["tool_calls"] == 1
        assert s.reward in (0.0, 1.0)
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
        runs = mask_runs(s.loss_mask)
        assert [value for value, _, _ in runs] == [1, 0, 1], runs  # call, tool result (masked), answer
        (_, a, b), (_, c, d), (_, e, f) = runs
        response = s.tokens[s.prompt_length :]
        assert tokenizer.decode(response[a:b], skip_special_tokens=True) == example_plugins.PYTHON_CALL
        tool_part = tokenizer.decode(response[c:d], skip_special_tokens=False)
        assert "<|im_start|>tool\n7\n" in tool_part and tool_part.endswith("<|im_start|>assistant\n")
        assert all(lp == 0.0 for lp in s.rollout_log_probs[c:d])
        assert engine_log_probs_match_a_forward(policy, s, e, f) < 1e-4
    assert output.metrics["rollout/reward_mean"] == sum(s.reward for s in samples) / len(samples)


def test_agent_openai_api_records_the_sdk_conversation_token_exactly(manager, gsm8k, tokenizer, policy):
    with example(
        manager,
        prompt_data=f"{gsm8k}@[:64]", input_key="question", label_key="answer", rollout_max_prompt_len=300,
        custom_generate_function_path="example_plugins.agent_calls_calculator",
        custom_rm_path="examples.agent_openai_api.generate.reward", vllm_tool_call_parser="qwen3_xml",
        rollout_max_response_len=120,
    ):  # fmt: skip
        output = manager.generate(1)
    for s in (s for group in output.samples for s in group):
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward in (0.0, 1.0)
        runs = mask_runs(s.loss_mask)
        assert [value for value, _, _ in runs] == [1, 0, 1], runs
        (_, a, b), (_, c, d), (_, e, f) = runs
        response = s.tokens[s.prompt_length :]
        assert tokenizer.decode(response[a:b], skip_special_tokens=True) == example_plugins.CALCULATOR_CALL
        assert "<|im_start|>tool\n7<|im_end|>" in tokenizer.decode(response[c:d], skip_special_tokens=False)
        # the second turn was generated from exactly the recorded prompt + call + tool result
        assert engine_log_probs_match_a_forward(policy, s, e, f) < 1e-4
        prompt = tokenizer.decode(s.tokens[: s.prompt_length], skip_special_tokens=False)
        assert (
            prompt.startswith("<|im_start|>system\n") and "are a careful math assistant" in prompt
        )  # (no capitals)


def test_search_example_retrieves_with_bm25_through_sglang_generate(manager, tokenizer, policy):
    with example(
        manager,
        prompt_data=str(EXAMPLES / "search" / "qa.jsonl"), input_key="question", label_key="answer",
        custom_generate_function_path="example_plugins.search_first",
        custom_rm_path="examples.search.generate_with_search.reward", rollout_max_response_len=64,
    ):  # fmt: skip
        output = manager.generate(2)
    for s in (s for group in output.samples for s in group):
        assert s.metadata["searches"] >= 1 and s.reward in (0.0, 0.1, 1.0)
        runs = mask_runs(s.loss_mask)
        assert [value for value, _, _ in runs][:2] == [1, 0], runs
        (_, a, b), (_, c, d) = runs[:2]
        response = s.tokens[s.prompt_length :]
        assert (
            tokenizer.decode(response[a:b]) == example_plugins.SEARCH_QUERY
        )  # stop string kept (no_stop_trim)
        assert tokenizer.decode(response[c:d]).startswith(
            "\n\n<information>"
        )  # (no capitals in the tiny vocab)
        assert "<information>Doc 1 (Paris): Paris is the capital" in s.response
        if len(runs) > 2:  # a second model turn, from the token-exact context
            _, e, f = runs[2]
            assert engine_log_probs_match_a_forward(policy, s, e, f) < 1e-4


def test_multi_agent_returns_every_agents_sample_as_one_trajectory(manager, gsm8k):
    from examples.multi_agent.agent_system import AGENTS_PER_PROMPT, CORRECT_WEIGHT, INCORRECT_WEIGHT

    with example(
        manager,
        prompt_data=f"{gsm8k}@[:64]", input_key="question", label_key="answer", rollout_max_prompt_len=300,
        custom_generate_function_path="examples.multi_agent.agent_system.generate", rm_type="gsm8k",
    ):  # fmt: skip
        output = manager.generate(3)
    assert len(output.samples) == B
    for group in output.samples:
        assert len(group) == N * AGENTS_PER_PROMPT
        by_trajectory: dict[int, list] = {}
        for s in group:
            by_trajectory.setdefault(s.rollout_id, []).append(s)
            assert s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert (
                s.loss_mask in (None, [1] * s.response_length)
                and len(s.rollout_log_probs) == s.response_length
            )
        assert len(by_trajectory) == N
        for agents in by_trajectory.values():
            roles = sorted(a.metadata["agent"] for a in agents)
            assert roles == ["rewriter"] * 2 + ["selector"] + ["solver"] * 2
            assert len({a.index for a in agents}) == AGENTS_PER_PROMPT
            (selector,) = [a for a in agents if a.metadata["agent"] == "selector"]
            weight = CORRECT_WEIGHT if selector.reward == CORRECT_WEIGHT else INCORRECT_WEIGHT
            assert all(a.reward / weight in (0.0, 1.0) for a in agents), [a.reward for a in agents]
            assert "Solution 2:" in selector.prompt


@pytest.fixture(scope="module")
def teacher(shared_engines, tmp_path_factory):
    """Another tiny model (seed 1), its weights loaded into the second pooled engine."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=1, task=None)
    engine = shared_engines.engines[1]

    async def load(client) -> None:
        await client.reload_weights(str(model_dir))
        assert await client.reset_prefix_cache()

    with EngineGroup([engine.url]) as group:
        group.run(load)
    return model_dir, engine


def test_on_policy_distillation_takes_per_token_log_probs_from_a_teacher_engine(manager, teacher, policy):
    teacher_dir, engine = teacher
    with example(
        manager,
        use_opd=True, opd_type="vllm", rm_url=engine.url,
        custom_rm_path="vime.rollout.on_policy_distillation.reward_func",
        custom_reward_post_process_path="vime.rollout.on_policy_distillation.post_process_rewards",
    ) as args:  # fmt: skip
        output = manager.generate(4)
        assert shape_rewards(args, output.samples) == [0.0] * B * N  # the post-process's pure distillation
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    diffs, gaps = [], []
    with torch.no_grad():
        for s in (s for group in output.samples for s in group):
            assert s.reward == 0.0 and len(s.teacher_log_probs) == s.response_length
            ids = torch.tensor([s.tokens])
            logits = model(ids).logits[0, s.prompt_length - 1 : -1]
            ref = log_probs_from_logits(logits, ids[0, s.prompt_length :], temperature=1.0)
            diffs.append((ref - torch.tensor(s.teacher_log_probs)).abs().max().item())
            gaps.append(
                (torch.tensor(s.teacher_log_probs) - torch.tensor(s.rollout_log_probs)).abs().mean().item()
            )
    assert max(diffs) < 1e-4, diffs  # the teacher's, per token, as a forward pass of the teacher gives them
    assert min(gaps) > 1e-2, gaps  # and not the student's own
    # slime's own OPD request (SGLang /generate, max_new_tokens 0, input log-probs) ported by sglang_compat
    payload = {
        "input_ids": s.tokens, "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True, "logprob_start_len": 0,
    }  # fmt: skip
    output = run(sglang_compat.post(f"{engine.url}/generate", payload))
    slime_teacher = [item[0] for item in output["meta_info"]["input_token_logprobs"][1:]][
        -s.response_length :
    ]
    assert output["output_ids"] == [] and slime_teacher == pytest.approx(s.teacher_log_probs, abs=1e-6)


def test_eval_multi_task_yaml_runs_each_dataset_with_its_settings(manager, model_dir, gsm8k, tmp_path):
    text = (EXAMPLES / "eval_multi_task" / "tiny.yaml").read_text()
    config = tmp_path / "tiny.yaml"
    config.write_text(
        text.replace("/tmp/vime-tiny", str(model_dir)).replace("../shared/data", str(gsm8k.parent))
    )
    datasets = {d["name"]: d for d in yaml.safe_load(config.read_text())["eval"]["datasets"]}
    with example(manager, eval_config=str(config), eval_prompt_data=None):
        output = manager.eval(0)
    assert set(output.data) == {"add3", "gsm8k"}
    for name, entry in output.data.items():
        spec = datasets[name]
        assert len(entry["samples"]) % spec["n_samples"] == 0 and entry["samples"]
        assert all(s.response_length <= spec["max_response_len"] for s in entry["samples"])
        assert f"eval/{name}/pass@{spec['n_samples']}" in output.metrics
    assert len(output.data["add3"]["rewards"]) == 20 * 4
    assert all(s.prompt.startswith("<|im_start|>user\n") for s in output.data["gsm8k"]["samples"])
