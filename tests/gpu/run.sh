#!/usr/bin/env bash
# Run GPU tests on the device machine once the kit is installed in /tmp/site (tests/gpu/README.md):
#   bash tests/gpu/run.sh PYTEST_ARGS...
# Output goes to $OUT/pytest.log; the runs' logs and metrics (*.log, *.jsonl, each < 4 MB) go into $OUT/runs.tgz (one
# file: only 8 files and 2 folder levels under $OUT come back from the device machine).
set -o pipefail
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# the lent hosts keep NVLink multicast off (shared GPUs; KINDS.md): state it for every program started here
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${OUT:-/tmp/gpu-out}
base=$(mktemp -d /tmp/vime-gpu-XXXX)
mkdir -p "$out"
python3 -m pytest -q -s -W ignore -p no:cacheprovider --basetemp="$base" "$@" 2>&1 | tee -a "$out/pytest.log"
status=$?
(cd "$base" && find . \( -name '*.log' -o -name '*.jsonl' \) -size -4M -print0 | tar --null -czf "$out/runs.tgz" -T -)
exit $status
