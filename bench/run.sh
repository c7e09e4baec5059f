#!/usr/bin/env bash
# Run one GPU benchmark on the device machine once the kit is installed in /tmp/site (tests/gpu/README.md):
#   bash bench/run.sh bench/rollout_throughput.py --shape 0.6b ...
# Output goes to $OUT/bench.log; the JSON results are written to bench/results/ and the new ones copied to $OUT.
set -o pipefail
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# the lent hosts keep NVLink multicast off (shared GPUs; KINDS.md): state it for every program started here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
marker=$(mktemp)
python3 "$@" 2>&1 | grep --line-buffered -v -i "warn" | tee -a "$out/bench.log" | grep --line-buffered "^\[bench\]\|Error\|error:"
status=${PIPESTATUS[0]}
find bench/results -name '*.json' -newer "$marker" -exec cp {} "$out/" \;
exit $status
