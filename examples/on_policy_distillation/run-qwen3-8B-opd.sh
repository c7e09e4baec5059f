#!/bin/bash
# On-policy distillation of Qwen3-32B into Qwen3-8B on one 8-GPU node (slime's run-qwen3-8B-opd.sh with a vLLM
# teacher): the teacher serves on GPUs 6-7, the student trains and generates colocated on GPUs 0-5.
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." &>/dev/null && pwd)"
source "${REPO}/scripts/models/qwen3-8B.sh"

STUDENT=${STUDENT:-/root/Qwen3-8B}
TEACHER=${TEACHER:-/root/Qwen3-32B}
DATA=${DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}
RUN_DIR=${RUN_DIR:-/root/runs/qwen3-8B-opd}
TEACHER_PORT=${TEACHER_PORT:-30000}

# The teacher: any vLLM OpenAI server with the student's tokenizer (Qwen3 models share one).
CUDA_VISIBLE_DEVICES=6,7 python3 -m vllm.entrypoints.openai.api_server --model "${TEACHER}" \
   --host 127.0.0.1 --port "${TEACHER_PORT}" --tensor-parallel-size 2 --gpu-memory-utilization 0.85 \
   > "${RUN_DIR}.teacher.log" 2>&1 &
TEACHER_PID=$!
trap 'kill ${TEACHER_PID} 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:${TEACHER_PORT}/health" > /dev/null; do
   kill -0 ${TEACHER_PID} || { echo "the teacher server exited; see ${RUN_DIR}.teacher.log" >&2; exit 1; }
   sleep 10
done

OPD_ARGS=(
   --use-opd
   --opd-type vllm                 # slime: --opd-type sglang
   --opd-kl-coef 1.0
   --rm-url "http://127.0.0.1:${TEACHER_PORT}"
   --custom-rm-path vime.rollout.on_policy_distillation.reward_func
   --custom-reward-post-process-path vime.rollout.on_policy_distillation.post_process_rewards
)

cd "${REPO}"
CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 python3 train.py \
   --train-backend megatron --actor-num-nodes 1 --actor-num-gpus-per-node 6 --colocate --offload-train \
   "${MODEL_ARGS[@]}" \
   --hf-checkpoint "${STUDENT}" --load "${RUN_DIR}/ckpt" --save "${RUN_DIR}/ckpt" --save-interval 20 \
   --prompt-data "${DATA}" --input-key prompt --apply-chat-template --rollout-shuffle \
   --num-rollout 300 --rollout-batch-size 16 --n-samples-per-prompt 4 --global-batch-size 64 \
   --rollout-max-response-len 16384 --rollout-temperature 1 \
   "${OPD_ARGS[@]}" \
   --advantage-estimator grpo --entropy-coef 0.0 --eps-clip 0.2 --eps-clip-high 0.28 \
   --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 \
   --tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity full --recompute-method uniform \
   --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 16384 \
   --rollout-num-gpus-per-engine 2 --vllm-gpu-memory-utilization 0.7 \
   --log-dir "${RUN_DIR}/logs" \
   "$@"
