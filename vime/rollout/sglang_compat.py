"""Where vime's own ported examples found SGLang's ``/generate`` translation: it now lives in
:mod:`vime.utils.sglang_compat`, and :func:`vime.utils.http_utils.post` (slime's ``post`` after the rename) applies
it, so ``post`` here is that same function."""

from vime.utils.http_utils import post
from vime.utils.sglang_compat import (
    SamplingParams,
    is_generate_url,
    sglang_output,
    vllm_request,
    vllm_sampling_fields,
)

__all__ = [
    "SamplingParams",
    "is_generate_url",
    "post",
    "sglang_output",
    "vllm_request",
    "vllm_sampling_fields",
]
