#!/bin/bash
# GRPO on GSM8K with Qwen3-4B on one 8-GPU node (vime's version of slime's scripts/run-qwen3-4B.sh).
# Training and the vLLM engines share the GPUs (--colocate); Megatron trains with TP 2.
# Data: see examples/gsm8k/README.md (GSM8K train split as JSONL rows {"question", "answer"}).
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." &>/dev/null && pwd)"
source "${REPO}/scripts/models/qwen3-4B.sh"

MODEL_DIR=${MODEL_DIR:-/root/Qwen3-4B}
DATA_DIR=${DATA_DIR:-/root/gsm8k}
RUN_DIR=${RUN_DIR:-/root/runs/qwen3-4B-gsm8k}
NUM_GPUS=${NUM_GPUS:-8}

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --load "${RUN_DIR}/ckpt"
   --save "${RUN_DIR}/ckpt"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_DIR}/train.jsonl"
   --input-key question
   --label-key answer
   --apply-chat-template
   --apply-chat-template-kwargs '{"enable_thinking": false}'
   --rollout-shuffle
   --rm-type gsm8k
   --num-rollout 200
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-response-len 1024
   --rollout-temperature 1
   --global-batch-size 256
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data gsm8k "${DATA_DIR}/test.jsonl"
   --n-samples-per-eval-prompt 1
   --eval-max-response-len 1024
   --eval-temperature 0.6
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

VLLM_ARGS=(
   # slime's --sglang-* flags become --vllm-* (every vLLM server flag passes through)
   --rollout-num-gpus-per-engine 2
   --vllm-gpu-memory-utilization 0.7
   --offload-train
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --log-dir "${RUN_DIR}/logs"
   # --use-wandb --wandb-project vime --wandb-group qwen3-4B-gsm8k
)

cd "${REPO}"
# Without RAY_ADDRESS, train.py starts a local Ray instance holding this node's GPUs.
python3 train.py \
   --train-backend megatron \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${NUM_GPUS}" \
   --colocate \
   "${MODEL_ARGS[@]}" \
   "${CKPT_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${EVAL_ARGS[@]}" \
   "${VLLM_ARGS[@]}" \
   "${MISC_ARGS[@]}" \
   "$@"
