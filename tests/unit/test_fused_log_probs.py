"""The GPU path of ``chunked_log_probs`` (:mod:`vime.utils.fused_log_probs`'s Triton kernels) passes every test of
``test_chunked_log_probs.py`` (fp64 references; padding; temperature; two tensor-parallel ranks, one holding only
padding) with rows of several kernel blocks, run on CPU by Triton's interpreter in a subprocess."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.utils import fused_log_probs

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)"
)


def test_the_kernels_pass_the_chunked_log_probs_tests_interpreted():
    assert fused_log_probs.triton is not None
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
         str(Path(__file__).with_name("test_chunked_log_probs.py"))],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
