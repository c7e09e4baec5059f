"""``--vllm-config``: parsing, resolution against the command line, and errors that name the entry and the fix."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import pytest

from vime.utils.vllm_config import (
    VLLMConfigError,
    default_config,
    engine_specs,
    load_vllm_config,
    vllm_flag_tokens,
)


def cli(**overrides) -> argparse.Namespace:
    values = dict(
        hf_checkpoint="/ckpt/actor",
        rollout_num_gpus=4,
        rollout_num_gpus_per_engine=1,
        num_gpus_per_node=8,
        rollout_external_engine_addrs=None,
    )
    return argparse.Namespace(**(values | overrides))


def load(tmp_path, text: str, **overrides):
    path = tmp_path / "vllm.yaml"
    path.write_text(textwrap.dedent(text))
    return load_vllm_config(path, cli(**overrides))


def test_policy_teacher_and_reward_models_resolve_with_defaults(tmp_path):
    config = load(
        tmp_path,
        """
        vllm:
          - name: actor
            server_groups:
              - {worker_type: regular, num_gpus: 2}
          - name: teacher
            role: teacher
            model_path: /ckpt/teacher
            num_gpus_per_engine: 1
            server_groups:
              - num_gpus: 1
                overrides: {max_model_len: 4096, enforce_eager: true}
          - name: judge
            role: reward
            model_path: /ckpt/judge
            server_groups:
              - {worker_type: regular, num_gpus: 1}
        """,
    )
    actor, teacher, judge = config.models
    assert config.policy is actor and actor.role == "policy" and actor.update_weights
    assert actor.model_path == "/ckpt/actor" and actor.num_engines == 2
    assert teacher.role == "teacher" and not teacher.update_weights and teacher.model_path == "/ckpt/teacher"
    assert teacher.server_groups[0].override_args() == ["--max-model-len=4096", "--enforce-eager"]
    assert judge.role == "reward" and config.model("judge") is judge


def test_engines_without_overrides_resolve_without_importing_vllm(tmp_path):
    """Every run's rollout manager resolves its engines: with no overrides to check against vLLM's parser, it must
    not build it (that imports vLLM, ~10 CPU-s per process, on the way to starting the engines)."""
    config = tmp_path / "vllm.yaml"
    config.write_text("vllm:\n  - name: actor\n    server_groups: [{num_gpus: 4}]\n")
    resolve = (
        "import sys, argparse; from vime.utils.vllm_config import default_config, engine_specs, load_vllm_config; "
        f"args = argparse.Namespace(**{vars(cli())!r}); "
        f"specs = engine_specs(default_config(args)) + engine_specs(load_vllm_config({str(config)!r}, args)); "
        "assert all(spec.override_args == () for spec in specs), specs; print('vllm' in sys.modules)"
    )
    imported = subprocess.run([sys.executable, "-c", resolve], capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "False"


def test_slimes_inference_of_the_policy_from_the_model_path(tmp_path):
    config = load(
        tmp_path,
        """
        vllm:
          - name: ref
            model_path: /ckpt/ref
            server_groups: [{worker_type: regular, num_gpus: 2}]
          - name: actor
            model_path: /ckpt/actor
            server_groups: [{worker_type: regular, num_gpus: 2}]
        """,
    )
    assert [m.role for m in config.models] == ["reference", "policy"]
    assert config.policy.name == "actor"


def test_placeholder_groups_count_gpus_but_start_no_engine(tmp_path):
    config = load(
        tmp_path,
        """
        vllm:
          - name: actor
            server_groups:
              - {worker_type: regular, num_gpus: 2, num_gpus_per_engine: 2}
              - {worker_type: placeholder, num_gpus: 2}
        """,
        rollout_num_gpus_per_engine=2,
    )
    assert config.policy.num_gpus == 4 and config.policy.num_engines == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("vllm: []", "top-level 'vllm:' list"),
        ("sglang: [{name: a}]", "top-level 'vllm:' list"),
        ("vllm: [{server_groups: [{num_gpus: 4}]}]", "'name' (a non-empty string) is required"),
        ("vllm: [{name: a, server_groups: [{num_gpus: 3}]}]", "hold 3 GPUs but --rollout-num-gpus is 4"),
        (
            "vllm: [{name: a, server_groups: [{num_gpus: 4, worker_type: prefill}]}]",
            "disaggregation is not supported",
        ),
        (
            "vllm: [{name: a, server_groups: [{num_gpus: 4, worker_type: gpu}]}]",
            "worker_type 'gpu' is not one of",
        ),
        ("vllm: [{name: a, server_groups: [{num_gpus: 4, num_gpus_per_engine: 3}]}]", "not a multiple of"),
        ("vllm: [{name: a, server_groups: [{num_gpus: 0}]}]", "num_gpus must be a positive integer"),
        ("vllm: [{name: a, server_groups: [{num_gpus: 4, tp: 2}]}]", "unknown key(s) ['tp']"),
        ("vllm: [{name: a, role: critic, server_groups: [{num_gpus: 4}]}]", "role 'critic' is not one of"),
        (
            "vllm: [{name: a, server_groups: [{num_gpus: 2}]}, {name: a, server_groups: [{num_gpus: 2}]}]",
            "names must be unique",
        ),
        (
            "vllm: [{name: a, model_path: /x, server_groups: [{num_gpus: 4}]}]",
            "exactly one model must be the policy",
        ),
        (
            "vllm: [{name: a, role: teacher, update_weights: true, server_groups: [{num_gpus: 4}]}]",
            "only the policy model is weight-synced",
        ),
        (
            "vllm: [{name: a, server_groups: [{num_gpus: 4, overrides: {max_modl_len: 9}}]}]",
            "did you mean --max-model-len",
        ),
        ("vllm: [{name: a, server_groups: [{num_gpus: 4, overrides: {port: 9}}]}]", "vime sets this itself"),
        (
            "vllm: [{name: a, server_groups: [{num_gpus: 4, overrides: {max_model_len: many}}]}]",
            "invalid value 'many'",
        ),
        ("vllm: [{name: a, server_groups: [{num_gpus: 4, overrides: {enforce_eager: 1}}]}]", "is a switch"),
        (
            "vllm: [{name: a, server_groups: [{num_gpus: 4, worker_type: placeholder}]}]",
            "all are placeholders",
        ),
    ],
)
def test_bad_configs_are_refused_with_the_entry_and_the_reason(tmp_path, text, message):
    with pytest.raises(VLLMConfigError) as info:
        load(tmp_path, text)
    assert message in str(info.value) and str(tmp_path / "vllm.yaml") in str(info.value)


def test_frozen_models_may_differ_in_engine_size_but_the_policy_may_not(tmp_path):
    config = load(
        tmp_path,
        """
        vllm:
          - {name: actor, server_groups: [{num_gpus: 2}]}
          - {name: judge, role: reward, model_path: /j, server_groups: [{num_gpus: 2, num_gpus_per_engine: 2}]}
        """,
    )
    assert [(s.model, s.model_path, s.num_gpus) for s in engine_specs(config)] == [
        ("actor", "/ckpt/actor", 1),
        ("actor", "/ckpt/actor", 1),
        ("judge", "/j", 2),
    ]
    with pytest.raises(
        VLLMConfigError, match="the policy's engines must all have --rollout-num-gpus-per-engine 1"
    ):
        load(tmp_path, "vllm: [{name: a, server_groups: [{num_gpus: 4, num_gpus_per_engine: 2}]}]")


def test_an_engine_spans_whole_nodes_or_none(tmp_path):
    """slime's multi-node engines: an engine larger than a node takes whole nodes (vLLM's Ray executor)."""
    config = load(
        tmp_path,
        "vllm: [{name: a, server_groups: [{num_gpus: 4, num_gpus_per_engine: 4}]}]",
        num_gpus_per_node=2,
        rollout_num_gpus_per_engine=4,
    )
    assert [s.num_gpus for s in engine_specs(config)] == [4]
    with pytest.raises(VLLMConfigError, match="num_gpus_per_engine 3: 3 GPUs per engine .* not whole nodes"):
        load(
            tmp_path,
            "vllm: [{name: a, server_groups: [{num_gpus: 3, num_gpus_per_engine: 3}]}]",
            num_gpus_per_node=2,
            rollout_num_gpus=3,
            rollout_num_gpus_per_engine=3,
        )


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(VLLMConfigError, match="no such file"):
        load_vllm_config(tmp_path / "absent.yaml", cli())


def test_flag_values_keep_their_types_on_the_command_line():
    tokens = vllm_flag_tokens(
        {"gpu_memory_utilization": 0.5, "enable_prefix_caching": False, "dtype": "float32"}
    )
    assert tokens == ["--gpu-memory-utilization=0.5", "--no-enable-prefix-caching", "--dtype=float32"]


def test_without_a_config_the_policy_takes_every_rollout_gpu():
    config = default_config(cli(rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
    assert config.policy.num_engines == 2 and config.policy.model_path == "/ckpt/actor"


def test_the_command_line_checks_the_file_and_what_other_flags_exclude(tmp_path, capsys):
    from vime.utils.arguments import parse_args

    path = tmp_path / "vllm.yaml"
    path.write_text(
        "vllm:\n  - {name: actor, server_groups: [{num_gpus: 1}]}\n"
        "  - {name: ref, model_path: /ref, server_groups: [{num_gpus: 1}]}\n"
    )
    base = [
        "--train-backend", "fsdp", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--num-rollout", "1", "--vllm-config", str(path),
    ]  # fmt: skip
    args = parse_args([*base, "--rollout-num-gpus", "2"])
    assert args.vllm_config == str(path)
    for extra, message in (
        ([], "needs --rollout-num-gpus"),
        (["--rollout-num-gpus", "3"], "hold 2 GPUs but --rollout-num-gpus is 3"),
        (["--rollout-num-gpus", "2", "--colocate"], "frozen models ['ref'] with --colocate"),
    ):
        with pytest.raises(SystemExit):
            parse_args([*base, *extra])
        assert message in capsys.readouterr().err
