"""slime's own examples (slime @624b824a, stored unmodified in ``tests/e2e/data/slime``) after the rename a
migrating user makes (``slime.`` → ``vime.``, ``sglang_rollout`` → ``vllm_rollout``), on the tiny model and the
shared engines (issue 26, item 2).

Each test reads the example's run script (its flags, fitted to the tiny model by ``slime_port.fit_to_tiny``) and
runs the example's own Python files through vime's rollout manager, or through ``train.py`` where the example's
path is in training. Where the example needs a service (search-r1's retriever), the test serves a stand-in. The
random tiny model does not write tags: the examples' generate functions run with their output format forced by
vLLM's structured outputs (``slime_port``), never a mock engine.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import sys
from pathlib import Path

import pytest
import slime_port
import torch
import yaml
from conftest import new_marker, read_metrics, run_side_by_side, start_run, wait_until_no_marked_processes
from slime_port import StandInService, fit_to_tiny, flag_value, importable, renamed_examples, script_arrays
from test_examples import mask_runs
from transformers import AutoModelForCausalLM, AutoTokenizer

from vime.backends.vllm_utils.control_client import EngineGroup
from vime.rollout.rollout_manager import RolloutManager, load_rollout_data
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.eval_config import load_eval_configs
from vime.utils.ppo_utils import log_probs_from_logits
from vime.utils.types import RolloutFnEvalOutput, RolloutFnTrainOutput, Status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slime_root(tmp_path_factory) -> Path:
    """The stored slime examples, renamed."""
    return renamed_examples(tmp_path_factory.mktemp("slime"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rollout(argv: list[str], log_dir: Path) -> RolloutFnTrainOutput:
    """One training rollout of ``argv`` through vime's rollout manager in this process."""
    manager = RolloutManager(parse_args(["--train-backend", "fsdp", "--debug-rollout-only", *argv]), log_dir)
    manager.start()
    try:
        return manager.generate(0)
    finally:
        manager.shutdown()


def evaluate(argv: list[str], log_dir: Path) -> RolloutFnEvalOutput:
    """The evaluation of ``argv`` through vime's rollout manager in this process."""
    manager = RolloutManager(parse_args(["--train-backend", "fsdp", "--debug-rollout-only", *argv]), log_dir)
    manager.start()
    try:
        return manager.eval(0)
    finally:
        manager.shutdown()


def start_train(
    script: str, argv: list[str], out_dir: Path, marker: str, cwd: Path | None = None, **env: str
):
    """A start function for ``run_side_by_side``: a whole run of vime's ``script`` (``train.py`` /
    ``train_async.py``) with ``argv``, from ``cwd`` (``out_dir`` by default), logging to ``out_dir``/logs."""
    full = [
        sys.executable, str(REPO / script), "--train-backend", "fsdp", "--log-dir", str(out_dir / "logs"), *argv,
    ]  # fmt: skip
    return lambda: (out_dir, start_run(full, out_dir, marker, cwd=cwd, **env))


def finished(out_dir: Path, marker: str) -> list[dict]:
    """The metrics records of a run that exited, once it left no process behind."""
    assert wait_until_no_marked_processes(marker, timeout=30) == []
    return read_metrics(out_dir / "logs")


def train(script: str, argv: list[str], cwd: Path, marker: str) -> list[dict]:
    """A whole run of vime's ``script`` with ``argv``, from ``cwd``; its metrics records. Leaves no process behind."""
    run_side_by_side({script: start_train(script, argv, cwd, marker)}, timeout=540)
    return finished(cwd, marker)


# ------------------------------------------------------------------------------------------------------------ search-r1
def retriever(body: dict) -> dict:
    """Search-R1's retrieval server (``retrieval_server.py``): ``{"result": [[{"contents": '"title"\\ntext'}]]}``."""
    docs = ['"paris"\nparis is the capital of france.', '"lyon"\nlyon is a city in france.']
    return {"result": [[{"contents": doc} for doc in docs[: body["topk"]]] for _ in body["queries"]]}


def test_search_r1_calls_the_retriever_and_masks_the_information(
    slime_root, tiny_model_dir, engine_pool, tmp_path
):
    script = slime_root / "examples" / "search-r1" / "run_qwen2.5_3B.sh"
    argv = fit_to_tiny(
        script_arrays(script),
        write_jsonl(tmp_path / "nq.jsonl", [
            {"prompt": [{"role": "user", "content": "question: what is the capital of france?"}],
             "reward_model": {"ground_truth": {"target": ["paris"]}, "style": "rule"}},
        ] * 2),
        "--hf-checkpoint", str(tiny_model_dir), "--rollout-external-engine-addrs", *engine_pool.addrs(),
        "--rollout-max-response-len", "64",
    )  # fmt: skip
    assert flag_value(argv, "--custom-generate-function-path") == ["generate_with_search.generate"]
    argv += ["--custom-generate-function-path", "slime_port.search_r1"]  # the example's, format forced
    with importable(slime_root, "search-r1"), StandInService({"/retrieve": retriever}) as service:
        example = importlib.import_module("generate_with_search")
        example.SEARCH_R1_CONFIGS["local"]["search_url"] = f"{service.url}/retrieve"  # the user's own setting
        output = rollout(argv, tmp_path / "logs")
    samples = [s for group in output.samples for s in group]
    turns = example.SEARCH_R1_CONFIGS["max_turns"]
    assert len(samples) == 4 and len(service.calls) == 4 * turns  # every turn searched
    assert all(body == {"queries": [slime_port.SEARCH_QUERY], "topk": 3, "return_scores": False}
               for _, body in service.calls)  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    information = (  # the retriever's documents as Search-R1 shows them to the model
        '\n\n<information>Doc 1(Title: "paris") paris is the capital of france.\n'
        'Doc 2(Title: "lyon") lyon is a city in france.</information>\n\n'
    )
    for s in samples:
        # max_turns searches, no <answer>: Search-R1's exact-match score is 0
        assert s.status == Status.COMPLETED and s.reward == 0 and s.response.count(information) == turns
        assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
        runs = mask_runs(s.loss_mask)
        assert [value for value, _, _ in runs] == [1, 0] * turns, runs  # search (trained), information (not)
        response = s.tokens[s.prompt_length :]
        for (_, a, b), (_, c, d) in zip(runs[::2], runs[1::2], strict=True):
            assert tokenizer.decode(response[a:b]) == slime_port.SEARCH_TURN  # generated up to the stop tag
            assert response[c:d] == tokenizer(information, add_special_tokens=False)["input_ids"]
            assert all(lp == 0.0 for lp in s.rollout_log_probs[c:d])


# --------------------------------------------------------------------------------------------------------------- retool
def test_retool_runs_the_code_in_its_sandbox_and_masks_the_interpreter_output(
    slime_root, tiny_model_dir, engine_pool, tmp_path
):
    script = slime_root / "examples" / "retool" / "retool_qwen3_4b_rl.sh"
    argv = fit_to_tiny(
        script_arrays(script, WANDB_KEY=""),
        write_jsonl(tmp_path / "math.jsonl", [{"prompt": "what is 3+4?", "label": "7"}] * 2),
        "--hf-checkpoint", str(tiny_model_dir), "--rollout-external-engine-addrs", *engine_pool.addrs(),
        # retool's system prompt and tool list take ~900 tokens: room for two tool calls
        "--rollout-max-response-len", "32", "--rollout-max-context-len", "1000",
    )  # fmt: skip
    assert flag_value(argv, "--custom-generate-function-path") == ["generate_with_retool.generate"]
    assert flag_value(argv, "--reward-key") == ["score"]  # retool's reward is a dict
    argv += ["--custom-generate-function-path", "slime_port.retool"]
    with importable(slime_root, "retool"):
        output = rollout(argv, tmp_path / "logs")
    samples = [s for group in output.samples for s in group]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(samples) == 4
    for s in samples:
        calls = s.tool_call_count
        assert calls >= 2 and s.status == Status.TRUNCATED, (calls, s.status)  # stopped by the context budget
        assert s.prompt_length + s.response_length <= 1000
        assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
        runs = mask_runs(s.loss_mask)
        assert [value for value, _, _ in runs] == [1, 0] * calls, runs  # code (trained), interpreter (not)
        response = s.tokens[s.prompt_length :]
        # the sandbox's answer to print(3+4) ("Output" has a capital the tiny vocab lacks)
        observation = "\n\n<interpreter>\n<|unk|>utput:\n7\n</interpreter>\n\n"
        for i, ((_, a, b), (_, c, d)) in enumerate(zip(runs[::2], runs[1::2], strict=True)):
            assert tokenizer.decode(response[a:b], skip_special_tokens=True) == slime_port.CODE_TURN
            shown = tokenizer.decode(response[c:d])  # the last one may be cut at the context budget
            assert shown == observation or (i == calls - 1 and observation.startswith(shown))
            assert all(lp == 0.0 for lp in s.rollout_log_probs[c:d])
        # math_dapo scores the missing answer -1; the example adds 0.1 per two tool calls past two, capped at -0.6
        assert s.reward == {"score": min(-0.6, -1.0 + (calls - 2) / 2 * 0.1), "acc": False, "pred": ""}


# ---------------------------------------------------------------------------------------------------------- multi-agent
def test_multi_agent_returns_every_agents_sample(slime_root, tiny_model_dir, engine_pool, tmp_path):
    script = slime_root / "examples" / "multi_agent" / "run-qwen3-30B-A3B-multi-agent.sh"
    argv = fit_to_tiny(
        script_arrays(script),
        tiny_model_dir / "train.jsonl",
        "--hf-checkpoint", str(tiny_model_dir), "--rollout-external-engine-addrs", *engine_pool.addrs(),
        "--rollout-max-response-len", "32",
    )  # fmt: skip
    path = "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents"
    assert flag_value(argv, "--custom-generate-function-path") == [path]
    argv += ["--custom-generate-function-path", "slime_port.multi_agent"]
    with importable(slime_root):
        config = importlib.import_module("examples.multi_agent.rollout_with_multi_agents").MULTI_AGENT_CONFIGS
        output = rollout(argv, tmp_path / "logs")
    agents = 2 * config["num_parallel"] + 1  # solvers, rewriters (each sees every solution), one selector
    assert len(output.samples) == 2
    for group in output.samples:
        assert len(group) == 2 * agents  # --n-samples-per-prompt 2 runs of the agent system
        runs: dict[int, list] = {}
        for s in group:
            runs.setdefault(s.rollout_id, []).append(s)
            assert s.status == Status.COMPLETED and len(s.rollout_log_probs) == s.response_length > 0
            assert re.fullmatch(r"\d+(<\|\w+\|>)?", s.response_content)  # what follows </think> (and the EOS)
        assert len(runs) == 2
        for trajectory in runs.values():
            kinds = sorted(
                "rewriter" if s.prompt.startswith("### Task: Solution Rewriting")
                else "selector" if s.prompt.startswith("You will be given a challenging math problem")
                else "solver"
                for s in trajectory
            )  # fmt: skip
            n = config["num_parallel"]
            assert kinds == ["rewriter"] * n + ["selector"] + ["solver"] * n
            (selector,) = [s for s in trajectory if s.prompt.startswith("You will be given")]
            assert all(f"Solution {i + 1}\n" in selector.prompt for i in range(config["num_parallel"]))
            # no "Judgment: n" (a capital the tiny vocab lacks): no pick, so every reward is scaled as a wrong one
            assert selector.reward == 0
            weight = config["incorrect_reward_weight"]
            assert all(s.reward in (0.0, weight) for s in trajectory), [s.reward for s in trajectory]


# ----------------------------------------------------------------------------------------- on-policy distillation
TEACHER_CONFIDENCE = 30.0  # the teacher's output layer is scaled by this


def confident_teacher(out_dir: Path) -> Path:
    """A tiny teacher (seed 1) whose output layer is scaled by :data:`TEACHER_CONFIDENCE`: peaked, as a trained
    teacher is, against the near-uniform random student. An unscaled random teacher is only ~0.05 nat/token from
    the student, which the test's 32 sampled tokens estimate with a standard deviation of ~0.06 (so ~10% of the
    shared engine's sampler states put it under 0.01); this one is ~11.6 nat/token away (standard deviation ~1.5
    over 32 tokens): a sampled token scores low only if the teacher ranks it among its top few."""
    teacher_dir = build_tiny_model(out_dir, seed=1, task=None)
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(TEACHER_CONFIDENCE)
    model.save_pretrained(teacher_dir)
    return teacher_dir


def test_on_policy_distillation_trains_against_the_teacher_server(
    slime_root, tiny_model_dir, engine_pool, tmp_path
):
    teacher_dir = confident_teacher(tmp_path / "teacher")
    # the second shared engine serves the teacher (the pool gives it its weights back after the test)
    teacher_url = engine_pool.urls[1]
    with EngineGroup([teacher_url]) as group:
        group.run(lambda engine: engine.reload_weights(str(teacher_dir)))
    host, port = teacher_url.removeprefix("http://").rsplit(":", 1)
    script = slime_root / "examples" / "on_policy_distillation" / "run-qwen3-8B-opd.sh"
    argv = fit_to_tiny(
        script_arrays(script, TEACHER_IP=host, TEACHER_PORT=port),
        tiny_model_dir / "train.jsonl",
        "--hf-checkpoint", str(tiny_model_dir), "--rollout-external-engine-addrs", *engine_pool.addrs(1),
        "--num-rollout", "1", "--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.json"),
    )  # fmt: skip
    assert flag_value(argv, "--rm-url") == [f"{teacher_url}/generate"]  # slime's SGLang route on the teacher
    assert flag_value(argv, "--opd-type") == ["sglang"]
    (record,) = train("train.py", argv, tmp_path, new_marker("slime-opd"))
    samples = [s for group in load_rollout_data(tmp_path / "rollout_0.json").samples for s in group]
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    gaps = []
    with torch.no_grad():
        for s in samples:
            assert s.reward == 0.0 and len(s.teacher_log_probs) == s.response_length  # pure distillation
            ids = torch.tensor([s.tokens])
            logits = teacher(ids).logits[0, s.prompt_length - 1 : -1]
            expected = log_probs_from_logits(logits, ids[0, s.prompt_length :], temperature=1.0)
            # the teacher's log-probs, per token
            assert (expected - torch.tensor(s.teacher_log_probs)).abs().max() < 1e-4
            gaps.append(torch.tensor(s.rollout_log_probs) - torch.tensor(s.teacher_log_probs))
    # the trainer's reverse KL (student - teacher log-prob, over response tokens) is the rollout's, as the step
    # starts from the weights the rollout sampled with
    assert record["train/opd_reverse_kl"] == pytest.approx(torch.cat(gaps).mean().item(), abs=1e-3)
    # the teacher disagrees with the student (a teacher serving the student's weights gives ~0) far beyond the
    # sampling noise (see confident_teacher)
    assert record["train/opd_reverse_kl"] > 1.0 and record["train/grad_norm"] > 0


# --------------------------------------------------------------------- fully-async and the train-infer mismatch helper
def test_fully_async_and_mismatch_helper_examples_side_by_side(
    slime_root, tiny_model_dir, engine_pool, tmp_path
):
    """Two independent whole runs at once, each on its own pooled engine: slime's fully-async example
    (``train_async.py``) and its train-infer mismatch helper (``train.py`` from slime's root)."""
    fully_async_dir, mis_dir = tmp_path / "fully_async", tmp_path / "mis"
    fully_async_dir.mkdir()
    mis_dir.mkdir()
    fully_async_argv = fully_async_example_argv(slime_root, tiny_model_dir, engine_pool.addrs()[0])
    mis_argv = mismatch_helper_argv(slime_root, tiny_model_dir, engine_pool.addrs()[1], mis_dir)
    fully_async_marker, mis_marker = new_marker("slime-fully-async"), new_marker("slime-mis")
    run_side_by_side(
        {
            "fully-async": start_train(
                "train_async.py", fully_async_argv, fully_async_dir, fully_async_marker
            ),
            # run from slime's root, as its script: the YAML path is relative, the function a module of its examples
            "mis": start_train(
                "train.py", mis_argv, mis_dir, mis_marker, cwd=slime_root, PYTHONPATH=str(slime_root)
            ),
        },
        timeout=540,
    )
    check_fully_async_keeps_generating_across_training_steps(finished(fully_async_dir, fully_async_marker))
    check_mismatch_helper_weights_the_loss_with_its_yaml_settings(
        slime_root, finished(mis_dir, mis_marker), mis_dir
    )


def fully_async_example_argv(slime_root: Path, tiny_model_dir: Path, addr: str) -> list[str]:
    script = slime_root / "examples" / "fully_async" / "run-qwen2.5-0.5B-fully_async.sh"
    argv = fit_to_tiny(
        script_arrays(script),
        tiny_model_dir / "train.jsonl",
        "--hf-checkpoint", str(tiny_model_dir), "--rollout-external-engine-addrs", addr,
    )  # fmt: skip
    path = "vime.rollout.fully_async_rollout.generate_rollout_fully_async"
    assert flag_value(argv, "--rollout-function-path") == [path]
    return argv


def check_fully_async_keeps_generating_across_training_steps(records: list[dict]) -> None:
    assert [r["rollout_id"] for r in records] == [0, 1]
    first, second = records
    # the worker went on past the batch it handed out: groups for the next rollouts were generating while step 0
    # trained (the default rollout submits the batch's 2 groups and stops)
    assert first["rollout/submitted_groups"] > 2
    assert first["fully_async/ready_groups"] + first["fully_async/in_flight_groups"] > 0
    # so rollout 1 trains, after a weight sync, on samples generated before it: one version behind
    assert second["fully_async/train_weight_version"] == first["fully_async/train_weight_version"] + 1
    assert second["fully_async/staleness_samples/1"] == 4 and second["fully_async/regenerated_groups"] == 0


MIS_SCRIPT = Path("examples") / "train_infer_mismatch_helper" / "run-qwen3-4b-mis.sh"


def mismatch_helper_argv(slime_root: Path, tiny_model_dir: Path, addr: str, out_dir: Path) -> list[str]:
    argv = fit_to_tiny(
        script_arrays(slime_root / MIS_SCRIPT, WANDB_KEY=""),
        tiny_model_dir / "train.jsonl",
        "--hf-checkpoint", str(tiny_model_dir), "--rollout-external-engine-addrs", addr,
        "--num-rollout", "1", "--save-debug-rollout-data", str(out_dir / "rollout_{rollout_id}.json"),
    )  # fmt: skip
    # the YAML path is relative to slime's root, the function a module of its examples package
    assert flag_value(argv, "--custom-config-path") == ["examples/train_infer_mismatch_helper/mis.yaml"]
    function = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
    assert flag_value(argv, "--custom-tis-function-path") == [function]
    return argv


def check_mismatch_helper_weights_the_loss_with_its_yaml_settings(
    slime_root: Path, records: list[dict], out_dir: Path
) -> None:
    (record,) = records
    settings = yaml.safe_load((slime_root / MIS_SCRIPT).with_name("mis.yaml").read_text())
    assert settings["use_rs"] and settings["tis_mode"] == "truncate" and settings["tis_batch_normalize"]
    # mis.py's metrics, as the YAML switched them on: rejection sampling with its veto, truncation, batch norm
    switched_on = (
        "rs_mask_fraction_low",
        "rs_catastrophic_seq_fraction",
        "tis_truncate_fraction",
        "batch_norm_factor",
    )
    assert all(f"train/mis_{key}" in record for key in switched_on), sorted(record)
    # it got the engine's log-probs of every response token: its rollout perplexity is theirs (a mean per sample,
    # then over samples) ...
    samples = [s for group in load_rollout_data(out_dir / "rollout_0.json").samples for s in group]
    rollout_log_ppl = sum(-sum(s.rollout_log_probs) / s.response_length for s in samples) / len(samples)
    assert record["train/mis_rollout_log_ppl"] == pytest.approx(rollout_log_ppl, abs=1e-5)
    # ... and the trainer's, which match them (the engines hold the trainer's weights): weights 1, nothing rejected
    assert record["train/mis_training_log_ppl"] == pytest.approx(rollout_log_ppl, abs=1e-4)
    assert record["train/mis_tis_weight_before_bound"] == pytest.approx(1.0, abs=1e-4)
    assert record["train/mis_rs_mask_fraction_low"] == record["train/mis_rs_catastrophic_seq_fraction"] == 0


# ------------------------------------------------------------------------------------------------- eval multi-task
def test_eval_multi_task_yaml_evaluates_each_dataset_with_its_settings(
    slime_root, tiny_model_dir, engine_pool, tmp_path
):
    example = slime_root / "examples" / "eval_multi_task"
    config = yaml.safe_load((example / "multi_task.yaml").read_text())
    rows = [json.loads(line) for line in (tiny_model_dir / "eval.jsonl").read_text().splitlines()][:2]
    for dataset in config["eval"]["datasets"]:  # the datasets' paths on the author's machine, made the test's
        dataset["path"] = str(write_jsonl(tmp_path / f"{dataset['name']}.jsonl", rows))
    (tmp_path / "multi_task.yaml").write_text(yaml.safe_dump(config))
    argv = fit_to_tiny(
        script_arrays(example / "multi_task.sh", WANDB_KEY="", EVAL_CONFIG_PATH=str(tmp_path / "multi_task.yaml")),
        tiny_model_dir / "train.jsonl",
        "--hf-checkpoint", str(tiny_model_dir), "--rollout-external-engine-addrs", *engine_pool.addrs(),
    )  # fmt: skip
    assert flag_value(argv, "--eval-config") == [str(tmp_path / "multi_task.yaml")]
    # its ifbench dataset: slime fetches IFBench's checkers from GitHub at run time, vime refuses that at start
    with contextlib.redirect_stderr(io.StringIO()) as err, pytest.raises(SystemExit):
        parse_args(["--train-backend", "fsdp", *argv])
    assert "eval dataset 'ifbench'" in err.getvalue() and "--custom-rm-path" in err.getvalue()
    # the other datasets, each with its reward, samples per prompt and the shared defaults
    datasets = [d for d in config["eval"]["datasets"] if d["rm_type"] != "ifbench"]
    config["eval"]["datasets"] = datasets
    (tmp_path / "multi_task.yaml").write_text(yaml.safe_dump(config))
    configs = {c.name: c for c in load_eval_configs(parse_args(["--train-backend", "fsdp", *argv]))}
    defaults = config["eval"]["defaults"]
    for dataset in datasets:  # slime's keys (n_samples_per_eval_prompt) and its defaults' precedence
        got = configs[dataset["name"]]
        assert (got.rm_type, got.n_samples) == (dataset["rm_type"], dataset["n_samples_per_eval_prompt"])
        assert (got.top_p, got.max_response_len) == (defaults["top_p"], defaults["max_response_len"])
    output = evaluate(argv, tmp_path / "logs")
    metrics = output.metrics
    assert set(output.data) == set(configs) == {"aime", "gpqa"}
    for name, got in configs.items():
        samples = output.data[name]["samples"]
        assert len(samples) == len(rows) * got.n_samples == metrics[f"eval/{name}/num_samples"]
        assert metrics[f"eval/{name}/failed"] == 0 and f"eval/{name}/pass@{got.n_samples}" in metrics
        assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples)
        # within the engines' context (--rollout-max-context-len), not 16384 new tokens
        assert all(len(s.tokens) <= 2048 for s in samples)
