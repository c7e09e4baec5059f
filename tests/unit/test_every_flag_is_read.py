"""A flag that is parsed but never read is a defect (issues 15 and 22): the user asks for something and nothing happens.

Walks the syntax tree of ``vime/``, ``train.py`` and ``train_async.py``, leaving out the modules that define and
validate flags, for loads of ``<x>args.<dest>`` (``args``, ``self.args``, ``eval_args`` ...) and
``getattr(<x>args, "<dest>"...)``, and checks that every flag of vime's parser is read there: vime's own flags and
the Megatron-named ones (not the ``--vllm-*``/``--router-*`` pass-through, which reaches the servers' own parsers,
nor the refused slime flags). A ``getattr`` whose name is computed must be listed in ``COMPUTED_READS``; a flag
that is rightly not read after validation must be listed, with the reason, in ``NOT_READ_AFTER_VALIDATION``.
A flag only one training backend reads must be refused or mapped at parse time for the other (or listed in
``ONE_BACKEND_NEEDS_NO_CHECK``), so that neither backend accepts it and does nothing.
"""

from __future__ import annotations

import argparse
import ast
import re

from argument_modules import ARGUMENT_MODULES, ROOT, is_args, walked_files

from vime.utils import megatron_args
from vime.utils.arguments import build_parser
from vime.utils.backend_flags import MEGATRON_UNSUPPORTED
from vime.utils.passthrough_args import _OwnedByVimeAction
from vime.utils.refused_flags import RefusedFlagAction

# getattr(args, <computed name>) in the walked code -> the flags it reads. (file, the name's source) -> dests.
COMPUTED_READS: dict[tuple[str, str], set[str]] = {
    # sampling_params_from_args: prefix is "rollout" or "eval" (eval_* default to rollout_* in validation)
    ("vime/rollout/vllm_generate.py", "f'{prefix}_temperature'"): {"rollout_temperature", "eval_temperature"},
    ("vime/rollout/vllm_generate.py", "f'{prefix}_top_p'"): {"rollout_top_p", "eval_top_p"},
    ("vime/rollout/vllm_generate.py", "f'{prefix}_top_k'"): {"rollout_top_k", "eval_top_k"},
    ("vime/rollout/vllm_generate.py", "f'{prefix}_max_response_len'"): {
        "rollout_max_response_len",
        "eval_max_response_len",
    },
    # check_hf_config compares every Megatron model-shape flag with the checkpoint's config.json
    ("vime/backends/megatron_utils/hf_config.py", "dest"): {"vocab_size"},
    # check_external_engines (validation) loops over flags refused with external engines: credits none, they are
    # read elsewhere
    ("vime/utils/vllm_config.py", "dest"): set(),
    # PluginArgs forwards whatever name a plug-in reads to the parsed flags: credits none, the plug-in reads it
    ("vime/utils/run_context.py", "name"): set(),
}

# Flags that vime's code after validation rightly never reads, each with the reason. The Megatron-named flags among
# them are those whose every accepted value is what vime does anyway: Megatron-Core gets that value (or, with
# vime's own attention and layers, has no use for it), and validation refuses the others with the reason.
NOT_READ_AFTER_VALIDATION = {
    "help_vllm": "the parser prints the --vllm-* flags and exits (arguments.parse_args)",
    "help_router": "the parser prints the --router-* flags and exits (arguments.parse_args)",
    "custom_config_path": "its YAML is set on args before validation (arg_validation._apply_custom_config)",
    "offload": "slime's shorthand: validation sets --offload-train and --offload-rollout",
    "gradient_checkpointing": "validation sets --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 1, which both backends read",
    "model_name": "checked against config.json's model_type when the run starts (arg_validation.check_run_paths); "
    "vime maps weights by model_type, slime picks its converter by this name",
    "update_weight_mode": "full only (what vime's engines load); delta is refused",
    "rollout_data_transport": "object-store only (Ray object references); nixl is refused",
    "profile_target": "train_overall only (vime records memory over the whole training); the rest are refused",
    "ckpt_format": "torch_dist only, which Megatron-Core's dist_checkpointing writes; torch is refused",
    "mtp_num_layers": "0 only (no multi-token-prediction layers are trained); more is refused",
    "attention_dropout": "0 only: Megatron-Core gets attention_dropout=0.0 (a --megatron-config-path YAML cannot "
    "turn it on); the engines run no dropout",
    "hidden_dropout": "0 only: Megatron-Core gets hidden_dropout=0.0, as attention_dropout",
    "transformer_impl": "local only: Megatron-Core gets transformer_impl='local' (no TransformerEngine); "
    "transformer_engine is refused",
    "attention_backend": "flash/local/auto are what vime's packed attention does (an info line says so); the "
    "TransformerEngine values fused/unfused are refused. Megatron-Core keeps its default: vime replaces its core "
    "attention",
    "attention_softmax_in_fp32": "always on: Megatron-Core gets attention_softmax_in_fp32=True, and vime's packed "
    "attention (FlashAttention-2 / SDPA) computes its softmax in fp32",
    "allgather_cp": "always on: vime's context parallelism all-gathers keys and values (slime's --allgather-cp); "
    "refused with --train-backend fsdp",
    "moe_permute_fusion": "what vime does anyway: Megatron-Core permutes tokens unfused (TransformerEngine's fused "
    "permutation gives the same result); an info line says so",
    "apply_rope_fusion": "what vime does anyway: Megatron-Core gets apply_rope_fusion=False (TransformerEngine's "
    "fused RoPE is not a dependency); --no-rope-fusion gets an info line",
    "add_position_embedding": "--no-position-embedding (slime's GLM-4.7/GLM-5 scripts) changes nothing with RoPE; "
    "refused without it",
    "spec": "a Megatron-LM layer-spec plug-in: refused with --train-backend megatron (vime builds its own specs), an "
    "info line with fsdp (transformers' own class)",
    **{
        dest: "Qwen3-Next / Qwen3.5 (gated DeltaNet) flags: refused with --train-backend megatron (no gated DeltaNet "
        "without TransformerEngine); the fsdp backend takes the model from config.json"
        for dest in (
            "apply_layernorm_1p",
            "attention_output_gate",
            "use_gated_attention",
            "moe_shared_expert_gate",
        )
    },
    # refused whenever set, by backend_flags.MEGATRON_UNSUPPORTED
    **{dest: f"refused when set: vime has no {why}" for dest, why in MEGATRON_UNSUPPORTED.items()},
}


# Read by one training backend only, yet fine with the other without a parse-time check, with the reason. The model
# description (megatron_args' model and MoE sections) needs none: the fsdp backend takes it from config.json.
ONE_BACKEND_NEEDS_NO_CHECK = {
    "accumulate_allreduce_grads_in_fp32": "the fsdp backend always reduces gradients in fp32 (its mixed precision)",
}
BACKEND_PACKAGES = {"megatron": "vime/backends/megatron_utils/", "fsdp": "vime/backends/fsdp_utils/"}


def parser_flags() -> dict[str, str]:
    """dest -> first option string of every flag vime's parser accepts, Megatron-named ones included."""
    parser = build_parser()
    passthrough = {id(action) for action in (*parser.vllm_actions, *parser.router_actions)}
    return {
        action.dest: action.option_strings[0]
        for action in parser._actions
        if action.option_strings
        and id(action) not in passthrough
        and not isinstance(action, argparse._HelpAction | RefusedFlagAction | _OwnedByVimeAction)
    }


def reads_in(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(dests read by attribute or constant getattr, sources of computed getattr names) in ``tree``."""
    names: set[str] = set()
    computed: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and is_args(node.value)
            and not isinstance(node.ctx, ast.Store | ast.Del)
        ):
            names.add(node.attr)
        elif (
            isinstance(node, ast.AugAssign)
            and isinstance(node.target, ast.Attribute)
            and is_args(node.target.value)
        ):
            names.add(node.target.attr)  # args.x += 1 reads x
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and is_args(node.args[0])
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                names.add(name.value)
            else:
                computed.add(ast.unparse(name))
    return names, computed


def reads_per_file() -> dict[str, tuple[set[str], set[str]]]:
    """File -> (dests read, computed getattr names) over the walked code."""
    return {
        path.relative_to(ROOT).as_posix(): reads_in(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for path in walked_files()
    }


def scan() -> tuple[set[str], set[tuple[str, str]]]:
    """(every dest read in the walked code, every (file, computed getattr name) found there)."""
    read: set[str] = set()
    computed: set[tuple[str, str]] = set()
    for path, (names, dynamic) in reads_per_file().items():
        read |= names
        computed |= {(path, source) for source in dynamic}
    return read, computed


def validation_reads() -> set[str]:
    """The dests the flag and validation modules read (refusals and mappings at parse time)."""
    read = set()
    for module in ARGUMENT_MODULES:
        read |= reads_in(ast.parse((ROOT / module).read_text(encoding="utf-8")))[0]
    return read | set(MEGATRON_UNSUPPORTED)  # read there as getattr(args, dest) over that dict


def test_the_walk_finds_reads_and_misses_writes_and_mentions():
    code = (
        "x = self.args.alpha\ny = getattr(eval_args, 'beta', None)\nargs.gamma = 1\nother.delta\n"
        "z = getattr(args, f'{p}_top_p')\n# args.epsilon in a comment\ns = 'args.zeta in a string'\n"
        "args.eta += 1\ndel args.theta\n"
    )
    names, computed = reads_in(ast.parse(code))
    assert names == {"alpha", "beta", "eta"}
    assert computed == {"f'{p}_top_p'"}


def test_every_flag_is_read_after_validation():
    flags = parser_flags()
    read, _ = scan()
    assert len(flags) > 250 and "num_layers" in flags, "the parser walk found too few flags"
    computed = set().union(*COMPUTED_READS.values())
    unread = sorted(
        flag
        for dest, flag in flags.items()
        if dest not in read | computed and dest not in NOT_READ_AFTER_VALIDATION
    )
    assert not unread, (
        f"flags parsed but never read: {unread}; read them, refuse them in validation with the reason, or list them "
        "in NOT_READ_AFTER_VALIDATION with the reason"
    )


def test_every_computed_getattr_is_listed_and_every_listing_is_current():
    flags = parser_flags()
    _, found = scan()
    assert found == set(COMPUTED_READS), (
        f"computed getattr(args, ...) not listed: {sorted(found - set(COMPUTED_READS))}; "
        f"listed but gone: {sorted(set(COMPUTED_READS) - found)}"
    )
    for (path, source), dests in COMPUTED_READS.items():
        assert dests <= set(flags), f"{path}: {source} lists no such flag: {sorted(dests - set(flags))}"
        if source.startswith("f'"):  # each listed dest must fit the f-string's pattern
            pattern = re.sub(r"\\\{[^}]*\\\}", r"\\w+", re.escape(source[2:-1]))
            assert all(re.fullmatch(pattern, dest) for dest in dests), (path, source, dests)


def test_the_not_read_list_is_still_needed_and_each_entry_is_validated():
    flags = parser_flags()
    read, _ = scan()
    assert set(NOT_READ_AFTER_VALIDATION) <= set(flags), "a listed flag no longer exists"
    assert not set(NOT_READ_AFTER_VALIDATION) & read, "now read after validation: drop it from the list"
    assert not sorted(set(NOT_READ_AFTER_VALIDATION) - validation_reads() - {"attention_softmax_in_fp32"}), (
        "listed but not even checked at parse time"
    )


def test_a_flag_one_backend_reads_is_refused_or_mapped_for_the_other():
    """With --train-backend fsdp, --recompute-* and --use-distributed-optimizer were accepted and ignored (issue 22):
    a flag read by one backend only must be checked at parse time, or listed with the reason."""
    flags, per_file = parser_flags(), reads_per_file()
    description = argparse.ArgumentParser()
    for flag, kwargs in (*megatron_args._MODEL, *megatron_args._MOE):
        description.add_argument(flag, **kwargs)
    model_description = {action.dest for action in description._actions}
    checked = validation_reads() | set(ONE_BACKEND_NEEDS_NO_CHECK)
    for backend, package in BACKEND_PACKAGES.items():
        inside = set().union(*(names for path, (names, _) in per_file.items() if path.startswith(package)))
        outside = set().union(
            *(names for path, (names, _) in per_file.items() if not path.startswith(package))
        )
        only_here = {dest for dest in inside - outside if dest in flags}
        unchecked = sorted(flags[dest] for dest in only_here - model_description - checked)
        assert not unchecked, (
            f"read only by the {backend} backend, and accepted by the other without a check: {unchecked}"
        )
    assert set(ONE_BACKEND_NEEDS_NO_CHECK) <= set(flags)
