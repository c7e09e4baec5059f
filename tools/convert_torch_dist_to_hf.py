"""`python tools/convert_torch_dist_to_hf.py ...` (or `torchrun --nproc-per-node N tools/convert_torch_dist_to_hf.py ...`): see
`vime.backends.megatron_utils.convert.torch_dist_to_hf`. Needs CUDA and megatron-core."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing vime

from vime.backends.megatron_utils.convert import torch_dist_to_hf  # noqa: E402

if __name__ == "__main__":
    torch_dist_to_hf()
