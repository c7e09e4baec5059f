"""Parse-time checks and derived defaults for vime's arguments (errors name the flag and the fix)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
from pathlib import Path

import yaml

from vime.utils.algorithm_flags import check_algorithm_flags
from vime.utils.backend_flags import check_backend_flags
from vime.utils.eval_config import load_eval_configs
from vime.utils.rm_types import check_rm_type
from vime.utils.serving_flags import check_flush_cache_interval, check_rollout_session
from vime.utils.slime_names import set_slime_names
from vime.utils.vllm_config import check_external_engines, check_vllm_config, engine_size_problem

logger = logging.getLogger(__name__)


def finalize_args(args: argparse.Namespace) -> None:
    """Fill derived defaults and reject inconsistent settings (ValueError naming the flag and the fix)."""
    _apply_custom_config(args)
    if args.offload:
        args.offload_train = args.offload_rollout = True
    args.offload_rollout = args.offload_rollout or args.colocate  # colocated engines sleep while training
    args.critic_num_nodes = args.critic_num_nodes or args.actor_num_nodes
    args.critic_num_gpus_per_node = args.critic_num_gpus_per_node or args.actor_num_gpus_per_node
    if args.rollout_num_gpus is None and args.vllm_config:
        raise ValueError(
            f"--vllm-config {args.vllm_config} needs --rollout-num-gpus: the GPUs of all its server groups (as "
            "slime's --sglang-config)"
        )
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = (
            0
            if args.rollout_external_engine_addrs
            else args.actor_num_nodes * args.actor_num_gpus_per_node
            if args.colocate
            else args.rollout_num_gpus_per_engine
        )
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.update_weight_transport is None:
        args.update_weight_transport = "tensor" if args.colocate else "distributed"
    if args.update_weight_transport == "nccl":  # slime's name for the same broadcast
        args.update_weight_transport = "distributed"
    for name in ("max_response_len", "temperature", "top_p", "top_k"):
        if getattr(args, f"eval_{name}") is None:
            setattr(args, f"eval_{name}", getattr(args, f"rollout_{name}"))
    args.eval_reward_key = args.eval_reward_key or args.reward_key
    _check_sampling(args)
    check_algorithm_flags(args)
    _check_batch_sizes(args)
    _check_cluster(args)
    _check_data(args)
    _check_backend(args)
    check_flush_cache_interval(args)
    check_rollout_session(args)
    _check_fully_async(args)
    _check_slime_flags(args)
    set_slime_names(args)


def _check_sampling(args: argparse.Namespace) -> None:
    if args.rollout_temperature <= 0:
        raise ValueError(
            f"--rollout-temperature {args.rollout_temperature}: must be > 0 (greedy decoding makes every response "
            "in a group identical, so group advantages are zero); use e.g. 1.0, or 0.6 for less randomness"
        )
    if not 0 < args.rollout_top_p <= 1:
        raise ValueError(f"--rollout-top-p {args.rollout_top_p}: must be in (0, 1]")
    if args.n_samples_per_prompt < 1:
        raise ValueError(f"--n-samples-per-prompt {args.n_samples_per_prompt}: must be >= 1")
    if args.rollout_max_response_len < 1:
        raise ValueError(f"--rollout-max-response-len {args.rollout_max_response_len}: must be >= 1")


def _check_batch_sizes(args: argparse.Namespace) -> None:
    if args.rollout_batch_size is None:
        raise ValueError("--rollout-batch-size is required (number of prompts per rollout step)")
    if args.rollout_batch_size < 1:
        raise ValueError(f"--rollout-batch-size {args.rollout_batch_size}: must be >= 1")
    if args.over_sampling_batch_size is not None and args.over_sampling_batch_size < args.rollout_batch_size:
        raise ValueError(
            f"--over-sampling-batch-size {args.over_sampling_batch_size} is below --rollout-batch-size "
            f"{args.rollout_batch_size}; it must be at least as large"
        )
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        if samples % args.num_steps_per_rollout:
            raise ValueError(
                f"--num-steps-per-rollout {args.num_steps_per_rollout} does not divide the {samples} samples of a "
                f"rollout (--rollout-batch-size {args.rollout_batch_size} x --n-samples-per-prompt "
                f"{args.n_samples_per_prompt})"
            )
        derived = samples // args.num_steps_per_rollout
        if args.global_batch_size is not None and args.global_batch_size != derived:
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} contradicts --num-steps-per-rollout "
                f"{args.num_steps_per_rollout} ({samples} samples / {args.num_steps_per_rollout} = {derived}); "
                "pass only one of them"
            )
        args.global_batch_size = derived
    if args.global_batch_size is None:
        args.global_batch_size = samples
    if samples % args.global_batch_size:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} does not divide the {samples} samples of a rollout "
            f"(--rollout-batch-size {args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt})"
        )
    args.num_steps_per_rollout = samples // args.global_batch_size
    model_parallel = (
        args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    )
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    if world % model_parallel:
        raise ValueError(
            f"{world} training ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not divisible by "
            f"TP x PP x CP = {model_parallel}"
        )
    dp_size = world // model_parallel
    per_step = dp_size if args.use_dynamic_batch_size else dp_size * args.micro_batch_size
    if args.global_batch_size % per_step:
        what = (
            "data-parallel size" if args.use_dynamic_batch_size else "data-parallel size x --micro-batch-size"
        )
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} is not divisible by the {what} ({per_step}); "
            "change --global-batch-size, --micro-batch-size or the number of training ranks"
        )
    if args.use_dynamic_batch_size and not args.max_tokens_per_gpu:
        raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu (token budget per micro-batch)")


def _check_cluster(args: argparse.Namespace) -> None:
    if problem := engine_size_problem(args.rollout_num_gpus_per_engine, args.num_gpus_per_node):
        raise ValueError(f"--rollout-num-gpus-per-engine {args.rollout_num_gpus_per_engine}: {problem}")
    check_external_engines(args)
    if args.vllm_config:
        check_vllm_config(args)
    elif args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        raise ValueError(
            f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
            f"{args.rollout_num_gpus_per_engine}"
        )
    if (args.vllm_router_ip is None) != (args.vllm_router_port is None):
        raise ValueError("--vllm-router-ip and --vllm-router-port go together (an external router's address)")
    if args.update_weight_transport == "tensor" and not args.colocate:
        raise ValueError(
            "--update-weight-transport tensor (CUDA IPC) needs --colocate; use distributed or disk"
        )
    if args.use_fault_tolerance and args.offload_rollout:
        raise ValueError(
            "--use-fault-tolerance restarts engines that have GPUs of their own: with --colocate / --offload-rollout "
            "the engines sleep while the trainer trains, and restarting one beside the trainer's memory is not built "
            "yet. Drop --colocate (engines on --rollout-num-gpus GPUs of their own) or drop --use-fault-tolerance"
        )


def _check_data(args: argparse.Namespace) -> None:
    needs_prompts = not args.load_debug_rollout_data and args.rollout_global_dataset
    if needs_prompts and not args.prompt_data:
        raise ValueError("--prompt-data is required (a .jsonl or .parquet file of prompts)")
    if not args.hf_checkpoint:
        raise ValueError(
            "--hf-checkpoint is required (HF model directory: tokenizer, config, initial weights)"
        )
    if args.rm_type is not None and not args.custom_rm_path:
        check_rm_type(args.rm_type)
    eval_configs = load_eval_configs(args)
    if not eval_configs and args.eval_interval:
        raise ValueError(f"--eval-interval {args.eval_interval} needs --eval-prompt-data or --eval-config")
    for config in eval_configs if not args.custom_rm_path else []:
        # at start, not at the first eval (after --eval-interval training steps)
        if config.rm_type is not None:
            try:
                check_rm_type(config.rm_type)
            except ValueError as exc:
                source = f"--eval-config {args.eval_config}" if args.eval_config else "--eval-prompt-data"
                raise ValueError(f"eval dataset {config.name!r} ({source}): {exc}") from None
    default_rollout = "vime.rollout.vllm_rollout.generate_rollout"
    if (
        args.debug_train_only
        and not args.load_debug_rollout_data
        and args.rollout_function_path == default_rollout
    ):
        raise ValueError(
            "--debug-train-only starts no engines: pass --load-debug-rollout-data PATTERN (files written by "
            "--save-debug-rollout-data, with {rollout_id} in the name), or a --rollout-function-path that needs no "
            "engines (e.g. vime.rollout.sft_rollout.generate_rollout)"
        )
    if args.debug_train_only and args.debug_rollout_only:
        raise ValueError("--debug-train-only and --debug-rollout-only both set; pass one")
    if args.num_rollout is None and (args.num_epoch is None or args.load_debug_rollout_data):
        raise ValueError(
            "set --num-rollout (rollout steps)"
            + ("" if args.load_debug_rollout_data else " or --num-epoch (passes over --prompt-data)")
        )
    if args.num_rollout is not None and args.num_epoch is not None:
        raise ValueError("--num-rollout and --num-epoch both set; pass one (--num-epoch sets --num-rollout)")


def _apply_custom_config(args: argparse.Namespace) -> None:
    """``--custom-config-path`` (slime): a YAML mapping set on ``args`` before anything is derived or checked, so
    plug-ins read their settings from ``args`` and overridden flags are validated like typed ones."""
    if not args.custom_config_path:
        return
    try:
        with open(args.custom_config_path, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
    except OSError as exc:
        raise ValueError(f"--custom-config-path {args.custom_config_path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--custom-config-path {args.custom_config_path}: not valid YAML: {exc}") from None
    if not isinstance(values, dict) or not all(isinstance(key, str) for key in values):
        raise ValueError(
            f"--custom-config-path {args.custom_config_path}: expected a mapping of names to values, got "
            f"{type(values).__name__}"
        )
    for key, value in values.items():
        if hasattr(args, key):
            logger.info("--custom-config-path sets %s = %r (was %r)", key, value, getattr(args, key))
        setattr(args, key, value)


def _check_slime_flags(args: argparse.Namespace) -> None:
    """The slime flags of issue 15: derived values and the combinations that cannot work."""
    if args.dump_details:  # slime's one switch for both debug dumps
        args.save_debug_rollout_data = os.path.join(args.dump_details, "rollout_data", "{rollout_id}.json")
        args.save_debug_train_data = os.path.join(args.dump_details, "train_data", "{rollout_id}_{rank}.pt")
    if args.save_debug_train_data and args.save_debug_train_data == args.save_debug_rollout_data:
        raise ValueError(
            "--save-debug-train-data must differ from --save-debug-rollout-data (both write files)"
        )
    if args.update_weight_mode == "delta":
        raise ValueError(
            "--update-weight-mode delta: slime's delta sync needs SGLang's /pull_weights patch on the engines; "
            "vime's engines load full weights every sync (--update-weight-mode full)"
        )
    if args.rollout_data_transport == "nixl":
        raise ValueError(
            "--rollout-data-transport nixl: vime passes rollouts to the trainers through Ray's object store by "
            "reference (object-store); Ray's NIXL transport is not wired in"
        )
    disk_only = [f for f, on in (("--update-weight-disk-keep-files", args.update_weight_disk_keep_files),
                                 ("--custom-update-weight-post-write-path", args.custom_update_weight_post_write_path)) if on]  # fmt: skip
    if disk_only and args.update_weight_transport != "disk":
        raise ValueError(f"{', '.join(disk_only)} apply to --update-weight-transport disk only")
    if args.check_weight_update_equal and args.debug_train_only:
        raise ValueError(
            "--check-weight-update-equal compares engines with the trainer: --debug-train-only has none"
        )
    if args.check_weight_update_equal is None:  # on by default wherever there are engines to check
        args.check_weight_update_equal = not args.debug_train_only
    if args.balance_by_flops:
        if not args.use_dynamic_batch_size:
            raise ValueError(
                "--balance-by-flops packs dynamic micro-batches: it needs --use-dynamic-batch-size"
            )
        args.balance_data = True
    if args.log_probs_max_tokens_per_gpu is not None and not args.use_dynamic_batch_size:
        raise ValueError(
            "--log-probs-max-tokens-per-gpu is a dynamic-batching budget: add --use-dynamic-batch-size"
        )
    if args.use_dynamic_batch_size and args.log_probs_max_tokens_per_gpu is None:
        args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu
    if args.log_probs_chunk_size == 0 or args.log_probs_chunk_size < -1:
        raise ValueError(
            f"--log-probs-chunk-size {args.log_probs_chunk_size}: a token count > 0, or -1 (no chunks)"
        )
    if args.data_pad_size_multiplier < 1:
        raise ValueError(f"--data-pad-size-multiplier {args.data_pad_size_multiplier}: must be >= 1")
    megatron_only = [f for f, on in (("--data-pad-size-multiplier", args.data_pad_size_multiplier != 1),
                                     ("--custom-model-provider-path", args.custom_model_provider_path),
                                     ("--padded-vocab-size", args.padded_vocab_size is not None),
                                     ("--allgather-cp", args.allgather_cp)) if on]  # fmt: skip
    if megatron_only and args.train_backend != "megatron":
        raise ValueError(
            f"{', '.join(megatron_only)}: Megatron backend flags; the fsdp backend has no context parallelism, packs "
            "without padding and builds the Hugging Face model of --hf-checkpoint as it is: drop them or use "
            "--train-backend megatron"
        )
    if args.keep_old_actor and args.debug_train_only:
        raise ValueError(
            "--keep-old-actor keeps the weights the engines generated with: --debug-train-only has none"
        )
    if args.keep_old_actor and args.use_rollout_logprobs:
        raise ValueError(
            "--keep-old-actor with --use-rollout-logprobs: the old log-probs come from the engines, so no old "
            "actor is needed; drop one of them"
        )
    if args.use_stateless_adam and (args.optimizer != "adam" or not args.no_save_optim):
        raise ValueError(
            "--use-stateless-adam keeps no Adam moments to save: it needs --optimizer adam and --no-save-optim"
        )
    if not args.rollout_global_dataset:
        if args.num_epoch is not None:
            raise ValueError("--num-epoch counts passes over --prompt-data: with --disable-rollout-global-dataset "
                             "there is none; set --num-rollout")  # fmt: skip
        if args.rollout_function_path in ("vime.rollout.vllm_rollout.generate_rollout",
                                          "vime.rollout.sft_rollout.generate_rollout"):  # fmt: skip
            raise ValueError(
                f"--disable-rollout-global-dataset: {args.rollout_function_path} generates from --prompt-data's "
                "prompts; pass a --rollout-function-path that makes its own"
            )
    subsample = args.load_debug_rollout_data_subsample
    if subsample is not None and (not args.load_debug_rollout_data or not 0 < subsample <= 1):
        raise ValueError(
            f"--load-debug-rollout-data-subsample {subsample}: a fraction in (0, 1] of the groups that "
            "--load-debug-rollout-data loads"
        )
    if args.load_forge_rollout_data and (args.load_debug_rollout_data or args.debug_train_only):
        raise ValueError(
            "--load-forge-rollout-data replays rollouts with engines running; --load-debug-rollout-data and "
            "--debug-train-only run without them: pass one"
        )
    if args.ci_save_grad_norm and args.ci_load_grad_norm:
        raise ValueError(
            "--ci-save-grad-norm and --ci-load-grad-norm both set: save in one run, compare in another"
        )
    if set(args.profile_target) != {"train_overall"}:
        raise ValueError(
            f"--profile-target {' '.join(args.profile_target)}: vime records memory over the whole training "
            "(train_overall); train_actor and train_log_probs select what slime's --use-pytorch-profiler (a "
            "Megatron-LM flag vime does not have) traces"
        )
    if args.memory_snapshot_num_steps is not None and not args.record_memory_history:
        raise ValueError(
            "--memory-snapshot-num-steps needs --record-memory-history (what the snapshot holds)"
        )


def _check_backend(args: argparse.Namespace) -> None:
    check_backend_flags(args)
    if args.train_backend != "megatron" or args.debug_rollout_only:
        return
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise ValueError(
            "--train-backend megatron needs megatron-core (pip install 'vime[gpu]'), which is not installed here; "
            "use --train-backend fsdp (torch-native, runs on CPU and GPU)"
        )
    if not os.environ.get("RAY_ADDRESS"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "--train-backend megatron needs CUDA GPUs and none is visible; use --train-backend fsdp "
                "(torch-native, runs on CPU and GPU)"
            )


FULLY_ASYNC_ROLLOUTS = (
    "vime.rollout.fully_async_rollout.generate_rollout",
    "vime.rollout.fully_async_rollout.generate_rollout_fully_async",
)


def _check_fully_async(args: argparse.Namespace) -> None:
    fully_async = args.rollout_function_path in FULLY_ASYNC_ROLLOUTS
    if args.max_staleness is not None and not fully_async:
        raise ValueError(
            f"--max-staleness bounds the fully-async rollout only; add --rollout-function-path {FULLY_ASYNC_ROLLOUTS[0]} "
            "or drop the flag"
        )
    if args.max_staleness is not None and args.max_staleness < 0:
        raise ValueError(f"--max-staleness {args.max_staleness}: must be >= 0 (weight versions)")
    if fully_async and args.offload_rollout:
        raise ValueError(
            "the fully-async rollout generates while the trainer trains: with --colocate / --offload-rollout the "
            "engines sleep then, under its running requests. Give the engines their own GPUs (drop --colocate) or "
            "use the default rollout"
        )


def check_run_paths(args: argparse.Namespace) -> None:
    """Checks on the file system, when a run starts (not at parse time: a parsed config may be meant for another
    machine): ``--hf-checkpoint`` given as a path is a model directory, and ``--save`` can be written."""
    checkpoint = str(args.hf_checkpoint)
    if checkpoint.startswith(("/", "./", "../", "~")) or os.path.exists(checkpoint):
        path = os.path.expanduser(checkpoint)
        if not os.path.isdir(path):
            raise ValueError(
                f"--hf-checkpoint {checkpoint}: no such directory (a Hugging Face model directory)"
            )
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(
                f"--hf-checkpoint {checkpoint}: no config.json there; it must be a Hugging Face model directory "
                "(config, tokenizer and weights, as save_pretrained writes them)"
            )
        _check_model_name(args, path)
    for flag in ("save", "critic_save"):
        target = getattr(args, flag, None)
        if not target:
            continue
        try:
            os.makedirs(target, exist_ok=True)
            probe = os.path.join(target, f".vime-write-check-{os.getpid()}")
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as exc:
            raise ValueError(
                f"--{flag.replace('_', '-')} {target}: cannot write there ({exc.strerror}); checkpoints would fail "
                "at the first save. Pick a writable directory"
            ) from None


def _family(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "").removesuffix("config")


def _check_model_name(args: argparse.Namespace, checkpoint: str) -> None:
    """``--model-name`` (slime picks its Megatron-to-HF converter by it) must name the family of the checkpoint's
    ``config.json``, by which vime maps weights."""
    if not getattr(args, "model_name", None):
        return
    config = json.loads(Path(checkpoint, "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type", "")
    if _family(args.model_name) != _family(model_type):
        raise ValueError(
            f"--model-name {args.model_name} names another model family than {checkpoint}/config.json "
            f"(model_type {model_type!r}), by which vime converts weights: drop --model-name or fix --hf-checkpoint"
        )
