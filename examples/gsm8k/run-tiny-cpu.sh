#!/bin/bash
# The GSM8K recipe on a 2-core CPU machine: the tiny random-init model, the FSDP trainer, one vLLM engine.
# It shows the whole pipeline (prompts from ../shared/data/gsm8k_test.jsonl, gsm8k reward, GRPO steps, weight
# sync, eval); the tiny model cannot solve GSM8K, so rewards stay at 0. Extra flags are appended ("$@").
set -euo pipefail

REPO="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/../.." &>/dev/null && pwd)"
PYTHON=${PYTHON:-${REPO}/.venv/bin/python}
DATA=${VIME_SHARED_DIR:-${REPO}/../shared}/data/gsm8k_test.jsonl
MODEL=${TINY_MODEL:-/tmp/vime-tiny}
RUN_DIR=${RUN_DIR:-${REPO}/runs/gsm8k-tiny}

[ -f "${MODEL}/config.json" ] || "${PYTHON}" -m vime.tools.make_tiny_model "${MODEL}"
cd "${REPO}"
"${PYTHON}" train.py \
   --train-backend fsdp \
   --hf-checkpoint "${MODEL}" \
   --prompt-data "${DATA}@[:1000]" \
   --input-key question \
   --label-key answer \
   --apply-chat-template \
   --rollout-max-prompt-len 400 \
   --rollout-shuffle \
   --rm-type gsm8k \
   --num-rollout 10 \
   --rollout-batch-size 4 \
   --n-samples-per-prompt 4 \
   --rollout-max-response-len 16 \
   --advantage-estimator grpo \
   --lr 1e-4 \
   --eval-prompt-data gsm8k "${DATA}@[1000:1016]" \
   --eval-max-prompt-len 400 \
   --eval-interval 5 \
   --log-dir "${RUN_DIR}/logs" \
   --vllm-enforce-eager \
   --vllm-dtype float32 \
   --vllm-max-model-len 512 \
   "$@"
