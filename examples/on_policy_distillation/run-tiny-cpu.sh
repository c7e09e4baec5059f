#!/bin/bash
# On-policy distillation on a CPU machine: a tiny student (seed 0) learns from a tiny teacher (seed 1) that a vLLM
# server on this machine serves. Shows the teacher's log-probs arriving on every sample and the opd_reverse_kl
# metric; extra flags are appended ("$@").
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." &>/dev/null && pwd)"
PYTHON=${PYTHON:-${REPO}/.venv/bin/python}
STUDENT=${STUDENT:-/tmp/vime-tiny}
TEACHER=${TEACHER:-/tmp/vime-tiny-teacher}
TEACHER_PORT=${TEACHER_PORT:-30123}
RUN_DIR=${RUN_DIR:-${REPO}/runs/opd-tiny}
mkdir -p "${RUN_DIR}"

[ -f "${STUDENT}/config.json" ] || "${PYTHON}" -m vime.tools.make_tiny_model "${STUDENT}" --seed 0
[ -f "${TEACHER}/config.json" ] || "${PYTHON}" -m vime.tools.make_tiny_model "${TEACHER}" --seed 1 --no-data

VLLM_CPU_KVCACHE_SPACE=1 "${PYTHON}" -m vllm.entrypoints.openai.api_server --model "${TEACHER}" \
   --host 127.0.0.1 --port "${TEACHER_PORT}" --enforce-eager --dtype float32 --max-model-len 256 \
   > "${RUN_DIR}/teacher.log" 2>&1 &
TEACHER_PID=$!
trap 'kill ${TEACHER_PID} 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:${TEACHER_PORT}/health" > /dev/null; do
   kill -0 ${TEACHER_PID} || { echo "the teacher server exited; see ${RUN_DIR}/teacher.log" >&2; exit 1; }
   sleep 2
done

cd "${REPO}"
"${PYTHON}" train.py \
   --train-backend fsdp \
   --hf-checkpoint "${STUDENT}" \
   --prompt-data "${STUDENT}/train.jsonl" \
   --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 8 --num-rollout 20 \
   --use-opd --opd-type vllm --rm-url "http://127.0.0.1:${TEACHER_PORT}" \
   --custom-rm-path vime.rollout.on_policy_distillation.reward_func \
   --custom-reward-post-process-path vime.rollout.on_policy_distillation.post_process_rewards \
   --lr 1e-3 --log-dir "${RUN_DIR}/logs" \
   --vllm-enforce-eager --vllm-dtype float32 --vllm-max-model-len 256 \
   "$@"
