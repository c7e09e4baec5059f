"""slime's plug-in surface at slime's paths after the rename (``slime.`` → ``vime.``, ``sglang_rollout`` →
``vllm_rollout``): every name slime's example plug-ins import, called the way they call it (issue 26 item 1).

The rollout path runs a slime-style custom generate function (GenerateState's tokenizer, SGLang ``/generate`` through
``post``, ``sampling_params["max_new_tokens"]``, ``args.sglang_*``) against a fake vLLM server.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from aiohttp import web
from fake_http import serve_posts
from PIL import Image

from vime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp
from vime.rollout import vllm_rollout
from vime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from vime.rollout.generate_state import GenerateState as VimeGenerateState
from vime.rollout.rm_hub import async_rm, batched_async_rm, grade_answer_verl
from vime.rollout.rm_hub.math_dapo_utils import compute_score
from vime.rollout.rm_hub.math_utils import extract_answer
from vime.tools.make_tiny_model import build_tiny_model
from vime.utils.arguments import parse_args
from vime.utils.http_utils import close_session, get_rollout_num_engines, post
from vime.utils.misc import SingletonMeta, exec_command, load_function
from vime.utils.processing_utils import (
    build_processor_kwargs,
    encode_image_for_rollout_engine,
    load_processor,
    load_tokenizer,
)
from vime.utils.run_context import PluginArgs, RunContext
from vime.utils.sglang_compat import SamplingParams
from vime.utils.types import Sample, Status

REQUESTS: list[dict] = []


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("slime_surface") / "m", seed=0, task=None)


def _args(model_dir, *extra):
    return parse_args(
        ["--train-backend", "fsdp", "--hf-checkpoint", str(model_dir), "--prompt-data", "p.jsonl",
         "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1",
         "--rollout-max-response-len", "5", "--rollout-concurrency", "3", *extra]
    )  # fmt: skip


async def _fake_vllm():
    """A server answering ``/v1/completions`` with two tokens (10, 11) per choice, recording each request body."""

    async def completions(request):
        body = await request.json()
        REQUESTS.append(body)
        choices = [{"index": i, "text": "ab", "token_ids": [10, 11], "prompt_token_ids": body["prompt"],
                    "finish_reason": "stop", "stop_reason": None, "logprobs": {"token_logprobs": [-0.5, -0.25]}}
                   for i in range(body.get("n", 1))]  # fmt: skip
        return web.json_response({"id": "c", "choices": choices})

    runner, url = await serve_posts({"/v1/completions": completions})
    return runner, int(url.rsplit(":", 1)[1])


async def slime_style_generate(args, sample, sampling_params):
    """Written as slime's examples are (search-r1, retool), with only the rename applied."""
    state = vllm_rollout.GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    sample.tokens = list(prompt_ids)
    params = dict(sampling_params)
    params["max_new_tokens"] = min(sampling_params["max_new_tokens"], 3)
    output = await post(url, {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True})
    logprobs = output["meta_info"]["output_token_logprobs"]
    sample.append_response_tokens(
        args,
        tokens=[t for _, t, _ in logprobs],
        log_probs=[lp for lp, _, _ in logprobs],
        meta_info=output["meta_info"],
        text=output["text"],
    )
    tool = state.tokenizer("x", add_special_tokens=False)["input_ids"]
    sample.append_response_tokens(args, tokens=tool, trainable=False, text="x")
    sample.metadata["concurrency"] = args.sglang_server_concurrency
    return sample


async def length_reward(args, sample, **kwargs):
    return float(sample.response_length)


async def group_reward(args, samples, **kwargs):
    return [float(i) for i, _ in enumerate(samples)]


# ----------------------------------------------------------------------------- slime.rollout.sglang_rollout
def test_generate_and_rm_group_runs_a_slime_generate_function(model_dir):
    args = _args(
        model_dir,
        "--custom-generate-function-path", f"{__name__}.slime_style_generate",
        "--custom-rm-path", f"{__name__}.length_reward",
    )  # fmt: skip
    assert vllm_rollout.GenerateState is VimeGenerateState

    run = RunContext()
    view = PluginArgs(
        args, run
    )  # what the rollout hands a plug-in: the flags, and the run's router behind them

    async def main():
        runner, port = await _fake_vllm()
        run.router_ip, run.router_port = "127.0.0.1", port
        args = view
        try:
            state = vllm_rollout.GenerateState(args)
            assert state.processor is None  # a text model, as slime's
            assert state.sampling_params["max_new_tokens"] == 5
            group = [Sample(prompt="ab", index=i) for i in range(2)]
            group = await vllm_rollout.generate_and_rm_group(args, group, state.sampling_params)
            done = Sample(prompt="ab", status=Status.COMPLETED, reward=7.0)
            assert await vllm_rollout.generate_and_rm(args, done, state.sampling_params) is done
            single = await vllm_rollout.generate_and_rm(args, Sample(prompt="ab"), state.sampling_params)
            vllm_rollout.get_context(args).aborting = True
            untouched = [Sample(prompt="ab")]
            assert (
                await vllm_rollout.generate_and_rm_group(args, untouched, state.sampling_params) is untouched
            )
            aborted = await vllm_rollout.generate_and_rm(args, Sample(prompt="ab"), state.sampling_params)
            return group, single, aborted
        finally:
            await vllm_rollout.close_contexts()
            await runner.cleanup()

    REQUESTS.clear()
    group, single, aborted = asyncio.run(main())
    for sample in [*group, single]:
        assert sample.tokens == [14, 15, 10, 11, 37] and sample.loss_mask == [1, 1, 0]
        assert sample.rollout_log_probs == [-0.5, -0.25, 0.0] and sample.response == "abx"
        assert sample.status == Status.COMPLETED and sample.reward == 3.0
        assert sample.metadata["concurrency"] == 3
    assert aborted.status == Status.ABORTED and aborted.reward is None
    run.model_routers = {"policy": ("127.0.0.1", 7)}
    assert vllm_rollout.get_model_url(view, "policy") == "http://127.0.0.1:7/generate"  # slime's default path
    assert len(REQUESTS) == 3 and all(r["max_tokens"] == 3 and r["prompt"] == [14, 15] for r in REQUESTS)


def test_sampling_params_answer_to_sglang_names():
    params = SamplingParams({"max_tokens": 8, "temperature": 1.0})
    assert (
        params["max_new_tokens"] == 8 and "max_new_tokens" in params and params.get("min_new_tokens", 2) == 2
    )
    params["max_new_tokens"] = 4
    params["sampling_seed"] = 1
    assert dict(params) == {"max_tokens": 4, "temperature": 1.0, "seed": 1}
    assert json.loads(json.dumps(params)) == {"max_tokens": 4, "temperature": 1.0, "seed": 1}
    clone = copy.deepcopy(params)
    clone["max_new_tokens"] = 1
    assert type(clone) is SamplingParams and params["max_tokens"] == 4 and clone.copy()["max_tokens"] == 1
    assert SamplingParams({"max_new_tokens": 2, "max_tokens": 9})["max_tokens"] == 2  # SGLang's name wins
    params |= {"min_new_tokens": 1}
    assert params["min_tokens"] == 1 and "min_new_tokens" not in dict(params)
    assert params.pop("max_new_tokens") == 4 and "max_tokens" not in params


# --------------------------------------------------------------------------------------- slime.utils.http_utils
def test_post_answers_sglang_generate_and_get_rollout_num_engines(model_dir):
    async def main():
        runner, port = await _fake_vllm()
        try:
            payload = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
            return await post(f"http://127.0.0.1:{port}/generate", payload)
        finally:
            await close_session()
            await runner.cleanup()

    REQUESTS.clear()
    out = asyncio.run(main())
    assert out["output_ids"] == [10, 11] and out["meta_info"]["finish_reason"] == {"type": "stop"}
    assert out["meta_info"]["output_token_logprobs"] == [[-0.5, 10, None], [-0.25, 11, None]]
    assert REQUESTS[0]["max_tokens"] == 2 and REQUESTS[0]["prompt"] == [4, 5]

    args = _args(model_dir, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    assert get_rollout_num_engines(args) == 2
    live = PluginArgs(args, RunContext(engine_urls=["http://a", "http://b", "http://c"]))  # a rollout's view
    assert get_rollout_num_engines(live) == 3
    attached = _args(model_dir, "--rollout-external-engine-addrs", "h:1", "h:2")
    assert get_rollout_num_engines(attached) == 2


# --------------------------------------------------------------------------------------------- slime.utils.misc
class _One(metaclass=SingletonMeta):
    def __init__(self, value):
        self.value = value


def test_singleton_meta_and_exec_command(capsys):
    assert _One(1) is _One(2) and _One(3).value == 1
    _One.clear_instances()
    assert _One(4).value == 4
    assert (
        exec_command("echo hi", capture_output=True) == "hi\n" and "EXEC: echo hi" in capsys.readouterr().out
    )
    with pytest.raises(subprocess.CalledProcessError):
        exec_command("exit 3")
    assert load_function("vime.utils.misc.exec_command") is exec_command


# ------------------------------------------------------------------------------------ slime.utils.processing_utils
def test_processing_utils(model_dir):
    assert load_tokenizer(str(model_dir))("ab", add_special_tokens=False)["input_ids"] == [14, 15]
    assert load_processor(str(model_dir)) is None
    kwargs = build_processor_kwargs({"images": ["img"], "images_kwargs": {"max_pixels": 4}})
    assert kwargs["images"] == ["img"] and kwargs["images_kwargs"] == {
        "max_pixels": 4,
        "return_tensors": "pt",
    }
    assert kwargs["text_kwargs"] == {"return_tensors": None, "return_mm_token_type_ids": False}
    assert kwargs["videos_kwargs"] == kwargs["audio_kwargs"] == {"return_tensors": "pt"}
    image = Image.new("L", (2, 1), color=200)
    uri = encode_image_for_rollout_engine(image)
    assert uri.startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    assert decoded.mode == "RGB" and decoded.getpixel((1, 0)) == (200, 200, 200)


# ----------------------------------------------------------------------------------------- slime.rollout.rm_hub
def test_rm_hub_names_slime_imports():
    assert grade_answer_verl(r"so \boxed{\frac{1}{2}}", "0.5") and grade_answer_verl(
        r"\boxed{3}", r"\boxed{3}"
    )
    assert not grade_answer_verl("Answer: 0.5", "0.5")  # slime's grader reads a boxed answer only
    assert not grade_answer_verl(r"\boxed{3}", "") and not grade_answer_verl(r"\boxed{3}", "4")
    assert (
        extract_answer(r"a \boxed{1} then \boxed{x^{2}}") == "x^{2}" and extract_answer("Answer: 3") is None
    )
    assert compute_score("work\nAnswer: 18", "18") == {"score": 1.0, "acc": True, "pred": "18"}
    assert compute_score("Answer: 17", "18")["score"] == -1.0
    assert compute_score(r"so \boxed{18}", "18", strict_box_verify=True) == {
        "score": 1.0,
        "acc": True,
        "pred": "18",
    }
    assert compute_score(r"\boxed{18} " + "x" * 120, "18", strict_box_verify=True)["pred"] is None


def test_async_rm_and_batched_async_rm_follow_custom_rm_path():
    args = SimpleNamespace(rm_type="exact", custom_rm_path=None, rm_url=None)
    assert asyncio.run(async_rm(args, Sample(response="a", label="a"))) == 1.0
    custom = Sample(response="abc", label="x", response_length=3)
    custom.custom_rm_path = f"{__name__}.length_reward"  # slime's per-sample setting (eval datasets)
    assert asyncio.run(async_rm(args, custom)) == 3.0
    args.custom_rm_path = f"{__name__}.group_reward"  # slime: a batched call gets the whole list
    assert asyncio.run(batched_async_rm(args, [Sample(), Sample(), Sample()])) == [0.0, 1.0, 2.0]


# ------------------------------------------------------------------------- slime.backends.megatron_utils.cp_utils
def test_cp_utils_hand_back_whole_responses():
    log_probs = torch.tensor([-0.1, -0.2, -0.3])
    assert all_gather_with_cp(log_probs, 10, 3) is log_probs
    assert slice_log_prob_with_cp([-0.1, -0.2], 9, 2) == [-0.1, -0.2]
    with pytest.raises(ValueError, match="3 values for a response of 4 tokens"):
        all_gather_with_cp(log_probs, 10, 4)


# -------------------------------------------------------------------------------------------- slime's Sample
def test_a_slime_sample_dict_round_trips_with_its_own_keys():
    slime = {"index": 1, "tokens": [1, 2, 3], "response_length": 1, "status": "completed", "rollout_id": 7,
             "multimodal_inputs": None, "apply_chat_template_kwargs": {"enable_thinking": False},
             "generate_function_path": "my.gen", "custom_rm_path": None, "session_id": "s1",
             "non_generation_time": 0.5, "rollout_top_p_token_ids": None, "rollout_top_p_token_offsets": None,
             "spec_info": {"spec_accept_token_num": 2}, "prefix_cache_info": {"cached_tokens": 1}}  # fmt: skip
    sample = Sample.from_dict(slime)
    assert sample.session_id == "s1" and sample.generate_function_path == "my.gen"
    assert sample.non_generation_time == 0.5 and sample.spec_info == {"spec_accept_token_num": 2}
    again = sample.to_dict()
    assert {k: again[k] for k in slime} == slime
    assert Sample.from_dict(again).to_dict() == again
    fresh = Sample()  # slime's defaults until set; nothing extra in the dict
    assert fresh.session_id is None and fresh.multimodal_inputs is None and fresh.non_generation_time == 0.0
    assert "session_id" not in fresh.to_dict()
    fresh.rollout_top_p_token_ids = None  # plug-ins reset slime's fields (retool does)
    assert fresh.to_dict()["rollout_top_p_token_ids"] is None
    with pytest.raises(AttributeError, match="no attribute 'sesion_id'"):
        fresh.sesion_id  # noqa: B018
    with pytest.raises(ValueError, match="unknown Sample fields \\['typo'\\]"):
        Sample.from_dict({"typo": 1})


# ------------------------------------------------------------------------------------ the rollout-function contract
def _returns(value):
    def fn(args, rollout_id, data_source, evaluation=False):
        return value

    return fn


def test_call_rollout_fn_takes_slimes_return_shapes():
    a, b, c = Sample(index=0), Sample(index=1), Sample(index=2)
    out = call_rollout_fn(_returns([[a, b], [c]]), None, 0, None, evaluation=False, run_context=RunContext())
    assert isinstance(out, RolloutFnTrainOutput) and out.samples == [[a, b], [c]] and out.metrics is None
    fanned = call_rollout_fn(
        _returns([[[a, b], [c]]]), None, 0, None, evaluation=False, run_context=RunContext()
    )  # an agent's turns
    assert fanned.samples == [[a, b, c]]
    typed = RolloutFnTrainOutput(samples=[[a]], metrics={"m": 1})
    assert (
        call_rollout_fn(_returns(typed), None, 0, None, evaluation=False, run_context=RunContext()) is typed
    )
    data = {"d": {"rewards": [1.0], "truncated": [False], "samples": [a]}}
    evaluated = call_rollout_fn(_returns(data), None, 0, None, evaluation=True, run_context=RunContext())
    assert isinstance(evaluated, RolloutFnEvalOutput) and evaluated.data == data
    with pytest.raises(TypeError, match="a flat list of samples"):
        call_rollout_fn(_returns([a, b]), None, 0, None, evaluation=False, run_context=RunContext())
    with pytest.raises(TypeError, match="returned dict; expected RolloutFnTrainOutput"):
        call_rollout_fn(_returns(data), None, 0, None, evaluation=False, run_context=RunContext())
    with pytest.raises(TypeError, match="group 0 has no samples"):
        call_rollout_fn(_returns([[]]), None, 0, None, evaluation=False, run_context=RunContext())
    seen = Sample(index=9)
    seen.multimodal_inputs = {"images": ["img"]}
    with pytest.raises(ValueError, match="sample 9 carries multimodal inputs"):
        call_rollout_fn(_returns([[seen]]), None, 0, None, evaluation=False, run_context=RunContext())
    seen.multimodal_inputs = {"images": None}  # what a text dataset row gives: fine
    assert call_rollout_fn(
        _returns([[seen]]), None, 0, None, evaluation=False, run_context=RunContext()
    ).samples == [[seen]]


# ---------------------------------------------------------------------------------------- flags plug-ins read
def test_slimes_sglang_arg_names_hold_the_vllm_settings_after_parsing(model_dir):
    args = _args(
        model_dir, "--vllm-router-ip", "10.0.0.1", "--vllm-router-port", "30000", "--rollout-sample-seeds"
    )
    assert args.sglang_server_concurrency == 3
    assert (args.sglang_router_ip, args.sglang_router_port) == ("10.0.0.1", 30000)
    assert args.sglang_enable_deterministic_inference is True
    plain = _args(model_dir)
    assert plain.sglang_router_ip is None and plain.sglang_server_concurrency == 3


def test_append_response_tokens_grows_the_lists_a_plug_in_holds():
    sample = Sample(tokens=[1, 2], loss_mask=[], rollout_log_probs=None)
    loss_masks = sample.loss_mask  # retool keeps this alias and assigns it back at the end
    sample.append_response_tokens(tokens=[3, 4], log_probs=[-0.1, -0.2])
    sample.append_response_tokens(tokens=[5], trainable=False)
    sample.loss_mask = loss_masks
    assert sample.loss_mask == [1, 1, 0] and sample.rollout_log_probs == [-0.1, -0.2, 0.0]
    assert sample.tokens == [1, 2, 3, 4, 5] and sample.response_length == 3
    broken = Sample(tokens=[1, 2], response_length=1, loss_mask=[])
    with pytest.raises(ValueError, match="loss_mask has 0 entries for a response of 1 tokens"):
        broken.append_response_tokens(tokens=[3], log_probs=[-0.1])


# ---------------------------------------------------------------------- slime.utils.external_utils.command_utils
def test_execute_train_runs_the_train_script_with_the_models_args(tmp_path, capsys):
    from vime.utils.external_utils.command_utils import ExecuteTrainConfig, execute_train

    script = tmp_path / "fake_train.py"
    out = tmp_path / "argv.json"
    script.write_text(
        "import json, os, sys\n"
        f"json.dump([sys.argv[1:], os.environ['A'], os.environ['B']], open({str(out)!r}, 'w'))\n"
    )
    called = []
    execute_train(
        train_args="--num-rollout 2 --colocate",
        num_gpus_per_node=1,
        megatron_model_type="qwen3-0.6B",
        train_script=str(script),
        before_ray_job_submit=lambda: called.append(1),
        extra_env_vars={"A": "x y"},
        config=ExecuteTrainConfig(extra_env_vars="B=2"),
    )
    argv, a, b = json.loads(out.read_text())
    assert called == [1] and (a, b) == ("x y", "2")
    assert argv[-3:] == ["--num-rollout", "2", "--colocate"] and "--num-layers" in argv  # MODEL_ARGS first
    with pytest.raises(ValueError, match="no .*nope.sh; model types here: .*qwen3-0.6B"):
        execute_train("", 1, "nope", train_script=str(script))
    with pytest.raises(ValueError, match="configure slime's Ray job"):
        execute_train("", 1, None, train_script=str(script), config=ExecuteTrainConfig(num_nodes=2))


def test_a_rollout_written_like_slimes_submits_aborts_and_resets(model_dir):
    """slime's generate_rollout_async pattern: submit groups, take what is needed, abort the rest, reset."""
    flags = _args(model_dir, "--rm-type", "exact", "--partial-rollout")

    run = RunContext()

    async def main():
        runner, port = await _fake_vllm()
        run.router_ip, run.router_port = "127.0.0.1", port
        args = PluginArgs(flags, run)
        try:
            state = vllm_rollout.GenerateState(args)
            state.submit_generate_tasks(
                [[Sample(prompt="ab", index=2 * g + i, label="x") for i in range(2)] for g in range(3)]
            )
            assert state.remaining_batch_size == 3 and len(state.pendings) == 3
            done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
            with state.dp_rank_context() as rank:
                assert rank == 0
            back = await vllm_rollout.abort(args, rollout_id=4)
            aborted, pending = state.aborted, len(state.pendings)
            state.reset()
            return (
                [t.result() for t in done],
                back,
                aborted,
                pending,
                state.aborted,
                state.remaining_batch_size,
            )
        finally:
            await vllm_rollout.close_contexts()
            await runner.cleanup()

    done, back, aborted, pending, after_reset, remaining = asyncio.run(main())
    assert done and all(s.response == "ab" and s.reward == 0.0 for group in done for s in group)
    assert len(done) + len(back) == 3 and aborted and pending == 0 and not after_reset and remaining == 0
    assert all(s.metadata["start_rollout_id"] == 4 for group in back for s in group)
