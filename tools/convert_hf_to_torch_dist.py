"""`python tools/convert_hf_to_torch_dist.py ...` (or `torchrun --nproc-per-node N tools/convert_hf_to_torch_dist.py ...`): see
`vime.backends.megatron_utils.convert.hf_to_torch_dist`. Needs CUDA and megatron-core."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing vime

from vime.backends.megatron_utils.convert import hf_to_torch_dist  # noqa: E402

if __name__ == "__main__":
    hf_to_torch_dist()
