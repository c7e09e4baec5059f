"""The argument system: pass-through round trips against the installed vLLM/router parsers, validation."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import subprocess
import sys

import pytest

from vime.utils.arguments import build_parser, parse_args
from vime.utils.passthrough_args import is_plain, passthrough_cli_args
from vime.utils.upstream_parsers import (
    VIME_OWNED_ROUTER_FLAGS,
    VIME_OWNED_VLLM_FLAGS,
    build_router_parser,
    build_vllm_serve_parser,
)

BASE = (
    "--train-backend fsdp --hf-checkpoint /m --prompt-data /d.jsonl --rollout-batch-size 4 "
    "--n-samples-per-prompt 4 --num-rollout 3"
).split()
CANDIDATE_VALUES = ["1", "0.5", "{}", "auto", "x", "true", "http://127.0.0.1:1", "name=/path"]


@pytest.fixture(scope="module", autouse=True)
def yaml_candidate(tmp_path_factory):
    """vLLM's --config reads a YAML file while parsing, so offer an (empty-mapping) YAML file as a value."""
    path = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    path.write_text("{}\n")
    CANDIDATE_VALUES.append(str(path))


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def _upstream_parse(upstream: argparse.ArgumentParser, tokens: list[str]) -> argparse.Namespace | None:
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return upstream.parse_args(tokens)
    except (SystemExit, ValueError):
        return None


def _same(a, b) -> bool:
    """Equal values; config objects without value equality (e.g. KVTransferConfig) compare by their fields
    minus any that differ between two parses of the same text (random ids)."""
    if a == b:
        return True
    if type(a) is not type(b) or not hasattr(a, "__dict__"):
        return False
    return {k: v for k, v in vars(a).items() if not k.endswith("_id")} == {
        k: v for k, v in vars(b).items() if not k.endswith("_id")
    }


def _valid_tokens(
    upstream: argparse.ArgumentParser, action: argparse.Action, option: str
) -> list[str] | None:
    """Upstream tokens for this option that the upstream parser itself accepts."""
    if action.nargs == 0:
        return [option]
    candidates = [str(c) for c in action.choices][:1] if action.choices else CANDIDATE_VALUES
    for value in candidates:
        tokens = [option, value]
        if _upstream_parse(upstream, tokens) is not None:
            return tokens
    return None


def _round_trip_all(parser, upstream, prefix: str, owned: dict[str, str]) -> tuple[int, list[str]]:
    checked, failures = 0, []
    for action in upstream._actions:
        if isinstance(action, argparse._HelpAction) or action.dest in owned:
            continue
        for option in (o for o in action.option_strings if o.startswith("--")):
            tokens = _valid_tokens(upstream, action, option)
            if tokens is None:
                failures.append(f"{option}: no accepted sample value found")
                continue
            ours = parser.parse_args([f"--{prefix}-{option[2:]}", *tokens[1:]])
            rebuilt = passthrough_cli_args(ours, prefix)
            direct = _upstream_parse(upstream, tokens)
            replayed = _upstream_parse(upstream, rebuilt)
            ours_value = getattr(ours, f"{prefix}_{action.dest}")
            if replayed is None or not _same(getattr(replayed, action.dest), getattr(direct, action.dest)):
                failures.append(f"{option}: replay {rebuilt} parsed differently")
            elif option == "--config":
                # vLLM expands the YAML file into other flags while parsing and leaves config=None;
                # vime keeps the path (the replay above shows the server gets the same settings).
                if ours_value != tokens[1]:
                    failures.append(f"--config: vime's value {ours_value!r} is not the path")
            elif not _same(ours_value, _as_kept(getattr(direct, action.dest), tokens[1:])):
                failures.append(f"{option}: vime's value {ours_value!r} differs")
            checked += 1
    return checked, failures


def _as_kept(upstream_value, values: list[str]):
    """What vime keeps for a flag upstream parses to ``upstream_value``: the value when plain data, else the typed
    tokens (vLLM's config objects and enums stay out of the arguments every Ray actor unpickles)."""
    if is_plain(upstream_value):
        return upstream_value
    return values[0] if len(values) == 1 else values


def test_every_vllm_flag_round_trips_to_the_server_command_line(parser):
    upstream = build_vllm_serve_parser()
    checked, failures = _round_trip_all(parser, upstream, "vllm", VIME_OWNED_VLLM_FLAGS)
    assert not failures, "\n".join(failures)
    upstream_long = sum(
        1
        for a in upstream._actions
        if a.dest not in VIME_OWNED_VLLM_FLAGS and not isinstance(a, argparse._HelpAction)
        for o in a.option_strings
        if o.startswith("--")
    )
    assert checked == upstream_long > 300  # every long option of the installed vLLM server was exercised


def test_every_router_flag_round_trips(parser):
    upstream = build_router_parser()
    checked, failures = _round_trip_all(parser, upstream, "router", VIME_OWNED_ROUTER_FLAGS)
    assert not failures, "\n".join(failures)
    assert checked > 50


def test_passthrough_keeps_order_and_negative_values(parser):
    args = parser.parse_args(
        ["--vllm-max-num-seqs", "8", "--vllm-no-enable-prefix-caching", "--vllm-max-logprobs=-1"]
    )
    assert passthrough_cli_args(args, "vllm") == [
        "--max-num-seqs",
        "8",
        "--no-enable-prefix-caching",
        "--max-logprobs=-1",
    ]
    assert (
        args.vllm_max_num_seqs == 8
        and args.vllm_enable_prefix_caching is False
        and args.vllm_max_logprobs == -1
    )
    assert passthrough_cli_args(args, "router") == []


def test_unset_passthrough_flags_carry_upstream_defaults(parser):
    args = parser.parse_args([])
    upstream = build_vllm_serve_parser().parse_args([])
    assert args.vllm_max_num_seqs == upstream.max_num_seqs
    assert passthrough_cli_args(args, "vllm") == []


def test_parsed_args_unpickle_without_importing_vllm(parser, tmp_path):
    """Every Ray actor of a run unpickles the arguments: vLLM's config objects and enums among the --vllm-* defaults
    (or typed by the user) would make each import vLLM for it, ~5 s of CPU per process."""
    # --vllm-optimization-level's default is an enum, --vllm-compilation-config's value a config object
    args = parser.parse_args([*BASE, "--vllm-compilation-config", '{"mode": 0}', "--vllm-enforce-eager"])
    assert args.vllm_optimization_level is None and args.vllm_compilation_config == '{"mode": 0}'
    assert passthrough_cli_args(args, "vllm") == ["--compilation-config", '{"mode": 0}', "--enforce-eager"]
    (tmp_path / "args.pkl").write_bytes(pickle.dumps(args))
    imported = subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], 'rb')); "
         "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_router')))", tmp_path / "args.pkl"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert imported == "[]"


LAZY_CHECK = """
import json, sys
from vime.utils.arguments import build_parser
from vime.utils.passthrough_args import passthrough_cli_args
args = build_parser().parse_args(sys.argv[1:])
print(json.dumps({"vllm_imported": "vllm" in sys.modules, "vllm_cli": passthrough_cli_args(args, "vllm"),
                  "args": {k: f"{type(v).__name__} {v!r}" for k, v in vars(args).items()}}))
"""


def _as_text(args: argparse.Namespace) -> dict[str, str]:
    """The namespace as LAZY_CHECK prints it: each value's type and repr."""
    return {k: f"{type(v).__name__} {v!r}" for k, v in vars(args).items()}


def _parse_in_fresh_process(argv: list[str], cache_home) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", LAZY_CHECK, *argv], capture_output=True, text=True, check=True,
        env={**os.environ, "XDG_CACHE_HOME": str(cache_home)},
    )  # fmt: skip
    return json.loads(result.stdout.splitlines()[-1])


def test_a_command_line_without_vllm_flags_does_not_import_vllm(parser, tmp_path, monkeypatch):
    """A driver that passes no --vllm-* flag (a run on external engines) takes their defaults from a cache instead
    of importing vLLM to build its parser (~15 CPU-s): the same arguments either way, and the first run fills it.
    Only the parses that must not import vLLM get a fresh process (one that imports it costs ~20 s on 2 cores); the
    others run here, where vLLM is imported already, and show they mirrored its flags."""
    parser.mirror_vllm_flags()  # the module's parser, flags mirrored whatever ran before
    eager = _as_text(parser.parse_args(BASE))
    assert "vllm_max_num_seqs" in eager
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = build_parser()  # no cache yet: mirrors the flags and writes it
    assert _as_text(first.parse_args(BASE)) == eager and first._vllm_mirrored
    assert len(list((tmp_path / "vime").glob("vllm_flags-*.txt"))) == 1
    second = _parse_in_fresh_process(BASE, tmp_path)
    assert not second["vllm_imported"] and second["args"] == eager
    # a --vllm-* flag no parse has met (or --help-vllm) mirrors them again, so its value is checked by vLLM's type
    used = build_parser()
    assert used.parse_args([*BASE, "--vllm-max-num-seqs", "8"]).vllm_max_num_seqs == 8 and used._vllm_mirrored
    # vime's own --vllm-named flags do not
    own = _parse_in_fresh_process([*BASE, "--vllm-router-port", "8000"], tmp_path)
    assert not own["vllm_imported"] and own["args"]["vllm_router_port"] == "int 8000"


# --vllm-* flags of each kind: nargs 0 (both spellings of a BooleanOptionalAction), one value (also with '=', and
# negative), several, one whose value vime keeps as its tokens (a config object upstream), and vime's own flag
USED_VLLM_FLAGS = [
    "--vllm-enforce-eager", "--vllm-no-enable-prefix-caching", "--vllm-dtype", "float32", "--vllm-max-model-len=64",
    "--vllm-max-logprobs", "-1", "--vllm-cudagraph-capture-sizes", "1", "2", "--vllm-compilation-config",
    '{"mode": 0}', "--vllm-router-port", "8000",
]  # fmt: skip


def test_a_command_line_parsed_before_does_not_import_vllm(tmp_path, monkeypatch):
    """A driver whose --vllm-* flags and values a parse with this vLLM met before (every e2e test's) is parsed from
    the cache that parse left, without vLLM: the same arguments, types included, and the same engine command line."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = [*BASE, *USED_VLLM_FLAGS]
    full = build_parser()
    first = full.parse_args(argv)
    assert full._vllm_mirrored  # the full parse, with vLLM's parser
    second = _parse_in_fresh_process(argv, tmp_path)
    assert not second["vllm_imported"]
    assert second["args"] == _as_text(first) and second["vllm_cli"] == passthrough_cli_args(first, "vllm")
    assert (first.vllm_max_model_len, first.vllm_cudagraph_capture_sizes) == (64, [1, 2])
    cached = build_parser()
    assert _as_text(cached.parse_args(argv)) == _as_text(first) and not cached._vllm_mirrored
    # the flags that stood in are gone again: the same parser mirrors vLLM's for a command line the cache lacks
    assert cached.parse_args([*BASE, "--vllm-max-model-len", "65"]).vllm_max_model_len == 65
    assert cached._vllm_mirrored


FILLS_THE_CACHE = [*BASE, "--vllm-max-model-len", "64", "--vllm-max-num-seqs", "4"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--vllm-max-model-len", "65"],  # a value no parse has met
        ["--vllm-max-model-len", "64", "--vllm-block-size", "16"],  # a flag no parse has met
        ["--vllm-max-model-len", "64", "--vllm-max-model-len", "32"],  # a flag twice
        ["--vllm-max-model-len", "64", "--help-vllm"],
    ],
)
def test_what_the_cache_lacks_takes_the_full_parse(parser, extra, tmp_path, monkeypatch):
    """A new value or flag, a flag twice and --help-vllm take vLLM's parser, with its checks; what that parse adds to
    the cache answers the next one the same."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build_parser().parse_args(FILLS_THE_CACHE)
    fresh = build_parser()
    assert _as_text(fresh.parse_args([*BASE, *extra])) == _as_text(parser.parse_args([*BASE, *extra]))
    assert fresh._vllm_mirrored
    cached = build_parser()  # and what that parse added to the cache is right
    assert _as_text(cached.parse_args(FILLS_THE_CACHE)) == _as_text(parser.parse_args(FILLS_THE_CACHE))
    assert _as_text(cached.parse_args([*BASE, *extra])) == _as_text(parser.parse_args([*BASE, *extra]))


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--vllm-max-model-len"], "argument --vllm-max-model-len: expected one argument"),
        (["--vllm-max-num-seqs", "4", "--rollout-temprature", "1"], "did you mean --rollout-temperature"),
        (["--vllm-max-num-seqs", "4", "--max-model-len", "8"], "did you mean --vllm-max-model-len"),
    ],
)
def test_errors_take_the_full_parse(extra, expected, tmp_path, monkeypatch, capsys):
    """Messages and suggestions come from the full parse, with vLLM's flags, though the cache holds every flag used."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    build_parser().parse_args(FILLS_THE_CACHE)
    fresh = build_parser()
    with pytest.raises(SystemExit):
        fresh.parse_args([*BASE, *extra])
    assert expected in capsys.readouterr().err and fresh._vllm_mirrored


def test_a_corrupt_or_altered_cache_is_no_cache(tmp_path, monkeypatch):
    """The cache file's text must match its digest: a file cut short, or altered (64 read as 65), is ignored."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    argv = [*BASE, "--vllm-max-model-len", "64"]
    build_parser().parse_args(argv)
    (path,) = (tmp_path / "vime").glob("vllm_flags-*.txt")
    text = path.read_text()
    assert text.count("): 64") == 1
    for corrupt in (text[: len(text) // 2], text.replace("): 64", "): 65")):
        path.write_text(corrupt)
        parser = build_parser()
        assert parser.parse_args(argv).vllm_max_model_len == 64 and parser._vllm_mirrored
        assert path.read_text() == text  # and written again whole


def test_the_flag_cache_follows_the_installed_vllm(tmp_path, monkeypatch):
    """The cache key covers vLLM's source files and the VLLM_* environment: another vLLM is another entry."""
    from vime.utils import upstream_parsers

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    own = ["--x"]
    first = upstream_parsers._vllm_cache_path(own)
    monkeypatch.setenv("VLLM_SOME_SETTING", "1")
    assert upstream_parsers._vllm_cache_path(own) != first
    assert upstream_parsers.cached_vllm_flags(own) is None
    entry = {
        "defaults": {"vllm_a": (1, "b"), "vllm_c": None},
        "flags": {},
        "values": {("--c", ("1",), "None"): 1},
    }
    upstream_parsers.cache_vllm_flags(own, entry)
    assert upstream_parsers.cached_vllm_flags(own) == entry
    # values that would not read back the same are left out
    upstream_parsers.cache_vllm_flags(own, {**entry, "values": {("--c", ("nan",), "None"): float("nan")}})
    assert upstream_parsers.cached_vllm_flags(own) == entry


@pytest.mark.parametrize("dest", sorted(VIME_OWNED_VLLM_FLAGS))
def test_flags_vime_owns_are_refused_with_the_fix(parser, dest, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args([f"--vllm-{dest.replace('_', '-')}", "x"])
    err = capsys.readouterr().err
    assert "vime sets this itself" in err and VIME_OWNED_VLLM_FLAGS[dest] in err


def _error_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--vllm-max-modl-len", "3"], "did you mean --vllm-max-model-len"),
        (["--router-polcy", "x"], "did you mean --router-policy"),
        (["--rollout-temprature", "1"], "did you mean --rollout-temperature"),
        (["--max-num-seqs", "8"], "did you mean --vllm-max-num-seqs"),  # mirrored for the hint
        (["--vllm-max-model-len", "abc"], "argument --vllm-max-model-len: invalid value 'abc'"),
        (["--vllm-tensor-parallel-size", "2"], "use --rollout-num-gpus-per-engine"),
        (["--router-policy", "nope"], "argument --router-policy: invalid choice 'nope'"),
        (["--rollout-temperature", "0"], "--rollout-temperature 0.0: must be > 0"),
        (["--kl-coef", "0.1", "--use-kl-loss"], "--kl-coef and --use-kl-loss both set"),
        (["--use-tis", "--use-rollout-logprobs"], "--use-tis with --use-rollout-logprobs"),
        (["--global-batch-size", "5"], "--global-batch-size 5 does not divide the 16 samples"),
        (["--num-steps-per-rollout", "3"], "--num-steps-per-rollout 3 does not divide the 16 samples"),
        (["--global-batch-size", "8", "--num-steps-per-rollout", "4"], "contradicts --num-steps-per-rollout"),
        (
            ["--actor-num-gpus-per-node", "3"],
            "not divisible by the data-parallel size x --micro-batch-size (3)",
        ),
        (["--over-sampling-batch-size", "2"], "--over-sampling-batch-size 2 is below --rollout-batch-size 4"),
        (["--eps-clip-c", "0.5"], "--eps-clip-c 0.5: the dual-clip constant must be > 1"),
        (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
        (
            ["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
            "not a multiple of --rollout-num-gpus-per-engine",
        ),
        (["--vllm-router-ip", "10.0.0.1"], "--vllm-router-ip and --vllm-router-port go together"),
        (["--update-weight-transport", "tensor"], "needs --colocate"),
        (["--mtp-num-layers", "1"], "vime does not train multi-token-prediction layers"),
        (["--hidden-dropout", "0.1"], "--hidden-dropout 0.1: vime trains without dropout"),
        (["--attention-dropout", "0.05"], "--attention-dropout 0.05: vime trains without dropout"),
        (
            ["--rollout-num-gpus", "12", "--rollout-num-gpus-per-engine", "12"],
            "12: 12 GPUs per engine is more than one node's (--num-gpus-per-node 8) but not whole nodes",
        ),
        (
            ["--sequence-parallel"],
            "--sequence-parallel: the fsdp backend shards over data-parallel ranks only",
        ),
        (
            ["--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"],
            "--context-parallel-size 2: the fsdp backend shards",
        ),
        (["--eval-prompt-data", "a", "b", "c"], "NAME PATH pairs"),
        (["--apply-chat-template-kwargs", "[1]"], "expected a JSON object"),
        (["--eval-interval", "5"], "--eval-interval 5 needs --eval-prompt-data or --eval-config"),
        (["--num-epoch", "2"], "--num-rollout and --num-epoch both set"),
        (["--debug-train-only"], "--debug-train-only starts no engines: pass --load-debug-rollout-data"),
        (
            ["--debug-train-only", "--debug-rollout-only", "--load-debug-rollout-data", "r{rollout_id}.json"],
            "--debug-train-only and --debug-rollout-only both set",
        ),
        (["--loss-type", "custom_loss"], "--loss-type custom_loss needs --custom-loss-function-path"),
        (["--loss-type", "sft_loss", "--use-kl-loss"], "--use-kl-loss would not take effect"),
        (
            ["--loss-type", "sft_loss", "--rollout-max-prompt-len", "9"],
            "--rollout-max-prompt-len (SFT conversations are tokenized whole",
        ),
        (["--loss-type", "sft_loss", "--custom-loss-function-path", "m.f"], "pick one"),
    ],
)
def test_parse_time_validation_names_the_flag(extra, expected, capsys):
    assert expected in _error_of(BASE + extra, capsys)


def test_eval_datasets_reward_types_are_checked_at_start(tmp_path, capsys):
    """slime's eval_multi_task YAML lists an ifbench dataset: the run stops before training, naming the dataset,
    not at the first eval after --eval-interval steps."""
    config = tmp_path / "multi_task.yaml"
    config.write_text(
        "eval:\n  datasets:\n    - {name: gpqa, path: g.jsonl, rm_type: gpqa}\n"
        "    - {name: ifbench, path: i.jsonl, rm_type: ifbench}\n"
    )
    err = _error_of([*BASE, "--rm-type", "math", "--eval-config", str(config)], capsys)
    assert f"eval dataset 'ifbench' (--eval-config {config}): --rm-type ifbench: slime clones" in err
    config.write_text("eval:\n  datasets:\n    - {name: a, path: a.jsonl, rm_type: gsm9k}\n")
    err = _error_of([*BASE, "--rm-type", "math", "--eval-config", str(config)], capsys)
    assert "eval dataset 'a' " in err and "unknown --rm-type 'gsm9k'" in err
    # a custom reward scores every dataset: the names are not vime's to check
    parse_args([*BASE, "--custom-rm-path", "my.rm", "--eval-config", str(config)])
    parse_args([*BASE, "--rm-type", "math", "--eval-prompt-data", "a", "a.jsonl"])


def test_sft_runs_without_engines_and_takes_epochs():
    argv = [t if t != "4" else "1" for t in BASE if t not in ("--num-rollout", "3")]
    args = parse_args(
        [*argv, "--num-epoch", "2", "--debug-train-only", "--loss-type", "sft_loss",
         "--rollout-function-path", "vime.rollout.sft_rollout.generate_rollout",
         "--disable-compute-advantages-and-returns"]
    )  # fmt: skip
    assert args.loss_type == "sft_loss" and args.compute_advantages_and_returns is False
    assert args.debug_train_only and args.num_epoch == 2


def test_train_env_vars_and_log_passrate_parse():
    args = parse_args([*BASE, "--train-env-vars", '{"NCCL_DEBUG": "INFO"}', "--log-passrate"])
    assert args.train_env_vars == {"NCCL_DEBUG": "INFO"} and args.log_passrate


def test_required_flags_are_named(capsys):
    assert "--rollout-batch-size is required" in _error_of(
        ["--train-backend", "fsdp", "--hf-checkpoint", "/m", "--n-samples-per-prompt", "2"], capsys
    )
    no_prompts = [t for t in BASE if t not in ("--prompt-data", "/d.jsonl")]
    assert "--prompt-data is required" in _error_of(no_prompts, capsys)


def test_grpo_with_one_sample_per_prompt_turns_std_off_and_warns(caplog):
    argv = [t if t != "4" else "1" for t in BASE]  # --rollout-batch-size 1 --n-samples-per-prompt 1
    args = parse_args(argv)
    assert args.grpo_std_normalization is False and args.rewards_normalization is True
    assert "the policy gets no signal" in caplog.text
    caplog.clear()
    raw = parse_args([*argv, "--disable-rewards-normalization"])
    assert raw.rewards_normalization is False and "no signal" not in caplog.text


def test_megatron_backend_without_megatron_core_suggests_fsdp(capsys):
    argv = [t for t in BASE if t not in ("--train-backend", "fsdp")]
    err = _error_of(argv, capsys)
    assert "--train-backend megatron needs" in err and "use --train-backend fsdp" in err


def test_derived_defaults():
    args = parse_args(BASE + ["--num-steps-per-rollout", "2", "--eps-clip", "0.3"])
    assert args.global_batch_size == 8 and args.num_steps_per_rollout == 2
    assert args.eps_clip_high == 0.3
    assert not args.offload_rollout
    assert args.update_weight_transport == "distributed"
    assert args.critic_num_gpus_per_node == args.actor_num_gpus_per_node
    assert args.eval_temperature == args.rollout_temperature


def test_dropout_defaults_to_off_and_slimes_explicit_zero_parses():
    for argv in (BASE, BASE + ["--attention-dropout", "0.0", "--hidden-dropout", "0"]):
        args = parse_args(argv)
        assert (args.attention_dropout, args.hidden_dropout) == (0.0, 0.0)


def test_offload_sets_both_and_nccl_is_slimes_name_for_distributed():
    args = parse_args(BASE + ["--offload", "--update-weight-transport", "nccl"])
    assert args.offload_train and args.offload_rollout
    assert args.update_weight_transport == "distributed"


def test_colocate_defaults_to_sleeping_engines_and_the_tensor_transport():
    args = parse_args(BASE + ["--colocate"])
    assert args.offload_rollout and args.update_weight_transport == "tensor"
    assert args.rollout_num_gpus == args.actor_num_nodes * args.actor_num_gpus_per_node


@pytest.mark.parametrize("layout", [["--colocate"], ["--offload-rollout"], ["--offload"]])
def test_fault_tolerance_is_refused_for_sleeping_engines(layout, capsys):
    error = _error_of(BASE + layout + ["--use-fault-tolerance"], capsys)
    assert "--use-fault-tolerance restarts engines that have GPUs of their own" in error
    assert parse_args(BASE + ["--use-fault-tolerance", "--offload-train"]).use_fault_tolerance


def test_help_lists_groups_and_points_to_passthrough_help(parser):
    text = parser.format_help()
    for title in ("cluster:", "rollout:", "algorithm:", "weight sync:", "megatron: model shape:"):
        assert title in text
    assert "--help-vllm" in text and "--help-router" in text
    assert "--vllm-enforce-eager" not in text  # pass-through flags stay out of the main help


def test_help_vllm_lists_passthrough_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help-vllm"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--vllm-max-model-len" in out and "--vllm-enforce-eager, --vllm-no-enforce-eager" in out


def test_run_paths_are_checked_when_a_run_starts(tmp_path):
    from vime.utils.arg_validation import check_run_paths

    args = parse_args(BASE)
    args.hf_checkpoint = "/nonexistent"
    with pytest.raises(ValueError, match="--hf-checkpoint /nonexistent: no such directory"):
        check_run_paths(args)
    args.hf_checkpoint = str(tmp_path)
    with pytest.raises(ValueError, match="no config.json there"):
        check_run_paths(args)
    (tmp_path / "config.json").write_text("{}")
    args.hf_checkpoint = "Qwen/Qwen3-4B"  # a hub id is left to Hugging Face
    check_run_paths(args)
    args.hf_checkpoint = str(tmp_path)
    (tmp_path / "a-file").write_text("")
    args.save = str(tmp_path / "a-file" / "ckpt")  # unwritable even for root
    with pytest.raises(ValueError, match="--save .*a-file/ckpt: cannot write there"):
        check_run_paths(args)
    args.save = str(tmp_path / "ckpt")
    check_run_paths(args)
    assert (tmp_path / "ckpt").is_dir()


def test_context_cap_and_eval_before_train(monkeypatch):
    from types import SimpleNamespace

    from vime.ray.run import Run
    from vime.rollout.vllm_generate import max_new_tokens
    from vime.utils.types import Sample

    sample = Sample(tokens=[1] * 10, response_length=4)  # 6 prompt + 4 response tokens
    assert max_new_tokens(SimpleNamespace(rollout_max_context_len=None), sample, {"max_tokens": 16}) == 12
    assert max_new_tokens(SimpleNamespace(rollout_max_context_len=13), sample, {"max_tokens": 16}) == 3
    args = parse_args(BASE + ["--eval-prompt-data", "e", "/e.jsonl", "--eval-interval", "2"])
    run = SimpleNamespace(args=args, has_engines=True)
    assert [Run.should_eval(run, i) for i in range(3)] == [True, False, True]
    args.skip_eval_before_train = True
    assert [Run.should_eval(run, i) for i in range(3)] == [False, False, True]


def test_start_rollout_id_overrides_the_checkpoints():
    from vime.ray.run import first_rollout_id

    args = parse_args(BASE)
    assert first_rollout_id(args, None) == 0 and first_rollout_id(args, 4) == 5
    args = parse_args(BASE + ["--start-rollout-id", "2"])
    assert first_rollout_id(args, None) == 2 and first_rollout_id(args, 4) == 2
