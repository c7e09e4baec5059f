"""Eval dataset configs: from --eval-prompt-data pairs or an --eval-config YAML, precedence, and bad input."""

from __future__ import annotations

import argparse

import pytest

from vime.utils.eval_config import EvalDatasetConfig, load_eval_configs


def make_args(**overrides) -> argparse.Namespace:
    values = dict(
        eval_prompt_data=None,
        eval_config=None,
        rm_type="math",
        n_samples_per_eval_prompt=1,
        eval_temperature=0.7,
        eval_top_p=0.9,
        eval_top_k=-1,
        eval_max_response_len=256,
        input_key="prompt",
        label_key="label",
        metadata_key="metadata",
        tool_key=None,
        apply_chat_template=True,
        eval_reward_key=None,
        eval_input_key=None,
        eval_label_key=None,
        eval_tool_key=None,
        eval_min_new_tokens=0,
        eval_max_prompt_len=None,
        eval_max_context_len=None,
        rollout_max_context_len=None,
    )
    return argparse.Namespace(**{**values, **overrides})


def write_yaml(tmp_path, text: str) -> str:
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return str(path)


def test_pairs_take_every_setting_from_the_flags():
    configs = load_eval_configs(make_args(eval_prompt_data=["aime", "a.jsonl", "gsm8k", "g.jsonl@[:50]"]))
    assert configs == [
        EvalDatasetConfig(
            name="aime",
            path="a.jsonl",
            rm_type="math",
            n_samples=1,
            temperature=0.7,
            top_p=0.9,
            top_k=-1,
            max_response_len=256,
            input_key="prompt",
            label_key="label",
            metadata_key="metadata",
            tool_key=None,
            apply_chat_template=True,
            reward_key=None,
            min_new_tokens=0,
            max_prompt_len=None,
            max_context_len=None,
        ),
        EvalDatasetConfig(**{**vars(configs[0]), "name": "gsm8k", "path": "g.jsonl@[:50]"}),
    ]


def test_no_eval_datasets_is_an_empty_list():
    assert load_eval_configs(make_args()) == []


def test_odd_pairs_and_duplicate_names_fail():
    with pytest.raises(ValueError, match="NAME PATH pairs; got 3 values"):
        load_eval_configs(make_args(eval_prompt_data=["a", "a.jsonl", "b"]))
    with pytest.raises(ValueError, match="'a' appears twice"):
        load_eval_configs(make_args(eval_prompt_data=["a", "a.jsonl", "a", "b.jsonl"]))


def test_yaml_dataset_overrides_defaults_which_override_flags(tmp_path):
    path = write_yaml(
        tmp_path,
        """
eval:
  defaults:
    n_samples: 4
    temperature: 1
    label_key: answer
  datasets:
    - name: aime
      path: aime.jsonl
      n_samples: 16
      rm_type: gsm8k
      reward_key: acc
    - name: math500
      path: math500.jsonl@[:100]
      label_key: null
""",
    )
    aime, math500 = load_eval_configs(make_args(eval_config=path))
    assert (aime.name, aime.path, aime.n_samples, aime.rm_type, aime.reward_key) == (
        "aime",
        "aime.jsonl",
        16,
        "gsm8k",
        "acc",
    )
    assert (aime.temperature, aime.label_key, aime.top_p, aime.max_response_len) == (1.0, "answer", 0.9, 256)
    assert isinstance(aime.temperature, float)
    assert (math500.n_samples, math500.rm_type, math500.label_key, math500.reward_key) == (
        4,
        "math",
        None,
        None,
    )


def test_slimes_key_for_the_samples_per_prompt_is_read(tmp_path):
    path = write_yaml(
        tmp_path,
        """
eval:
  defaults:
    n_samples_per_eval_prompt: 4
  datasets:
    - name: aime
      path: aime.jsonl
      n_samples_per_eval_prompt: 16
    - name: math500
      path: math500.jsonl
""",
    )
    aime, math500 = load_eval_configs(make_args(eval_config=path))
    assert (aime.n_samples, math500.n_samples) == (16, 4)
    both = write_yaml(
        tmp_path,
        "eval:\n  datasets:\n    - {name: a, path: a.jsonl, n_samples: 2, n_samples_per_eval_prompt: 3}\n",
    )
    with pytest.raises(ValueError, match="both 'n_samples_per_eval_prompt'"):
        load_eval_configs(make_args(eval_config=both))


def test_both_sources_at_once_is_an_error(tmp_path):
    path = write_yaml(tmp_path, "eval:\n  datasets:\n    - {name: a, path: a.jsonl}\n")
    with pytest.raises(ValueError, match="both --eval-prompt-data b b.jsonl and --eval-config .*eval.yaml"):
        load_eval_configs(make_args(eval_config=path, eval_prompt_data=["b", "b.jsonl"]))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "eval:\n  datasets:\n    - {name: aime, path: a.jsonl, temprature: 0.5}\n",
            r"eval dataset 'aime' in .*eval.yaml: unknown key 'temprature' \(did you mean 'temperature'\?\); "
            r"valid keys: name, path, rm_type, n_samples",
        ),
        (
            "eval:\n  defaults: {temprature: 2}\n  datasets:\n    - {name: a, path: a.jsonl}\n",
            r"eval.defaults of .*eval.yaml: unknown key 'temprature' \(did you mean 'temperature'\?\).*valid keys: rm_type,",
        ),
        (
            "eval:\n  defaults: {name: x}\n  datasets:\n    - {name: a, path: a.jsonl}\n",
            r"eval.defaults of .*: unknown key 'name'",
        ),
        (
            "eval:\n  dataset:\n    - {name: a, path: a.jsonl}\n",
            r"section 'eval' of .*: unknown key 'dataset'",
        ),
        ("eval:\n  datasets:\n    - {path: a.jsonl}\n", r"eval dataset #0 in .*eval.yaml: missing 'name'"),
        ("eval:\n  datasets:\n    - {name: a}\n", r"eval dataset 'a' in .*: missing 'path'"),
        (
            "eval:\n  datasets:\n    - {name: a, path: a.jsonl}\n    - {name: a, path: b.jsonl}\n",
            r"eval.yaml: eval dataset name 'a' appears twice",
        ),
        ("eval:\n  datasets: []\n", "eval.datasets must be a non-empty list"),
        ("datasets:\n  - {name: a, path: a.jsonl}\n", "expected a top-level 'eval:' mapping"),
        ("eval:\n  datasets:\n    - a.jsonl\n", "eval dataset #0 .*: expected a mapping"),
        ("eval:\n  defaults: [1]\n  datasets:\n    - {name: a, path: a.jsonl}\n", "must be a mapping"),
        ("eval: [unclosed\n", "not valid YAML"),
        (
            "eval:\n  datasets:\n    - {name: a, path: a.jsonl, n_samples: 2.5}\n",
            r"eval dataset 'a' .*: n_samples = 2.5 \(from the entry\) must be int",
        ),
        (
            "eval:\n  defaults: {temperature: hot}\n  datasets:\n    - {name: a, path: a.jsonl}\n",
            r"temperature = 'hot' \(from eval.defaults\) must be int or float",
        ),
        (
            "eval:\n  datasets:\n    - {name: a, path: a.jsonl, n_samples: true}\n",
            r"n_samples = True \(from the entry\) must be int",
        ),
        ("eval:\n  datasets:\n    - {name: a, path: a.jsonl, n_samples: 0}\n", "n_samples = 0 must be >= 1"),
        ("eval:\n  datasets:\n    - {name: a/b, path: a.jsonl}\n", "may not contain '/'"),
    ],
)
def test_bad_yaml_names_the_problem(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_eval_configs(make_args(eval_config=write_yaml(tmp_path, text)))


def test_missing_yaml_file_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"--eval-config .*nope.yaml: file not found"):
        load_eval_configs(make_args(eval_config=str(tmp_path / "nope.yaml")))


def test_eval_flags_default_to_the_training_ones():
    from vime.utils.eval_config import load_eval_configs

    args = make_args(eval_prompt_data=["a", "a.jsonl"], eval_label_key="answer", rollout_max_context_len=512)
    (config,) = load_eval_configs(args)
    assert (config.input_key, config.label_key, config.tool_key) == ("prompt", "answer", None)
    assert config.max_context_len == 512 and config.min_new_tokens == 0 and config.max_prompt_len is None
    (config,) = load_eval_configs(make_args(eval_prompt_data=["a", "a.jsonl"], eval_max_context_len=64,
                                            rollout_max_context_len=512, eval_input_key="question"))  # fmt: skip
    assert config.max_context_len == 64 and config.input_key == "question"
