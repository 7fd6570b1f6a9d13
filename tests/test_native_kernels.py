"""The CPU kernel extension as built for this very CPU. The suite pins an AVX2 CPU's flags (conftest.py), so the
kernels it tests are the AVX2 build's; on an AVX-512 CPU the native build takes other code paths (16-lane vectors,
8-row groups, AVX-512-BF16's `vdpbf16ps` for bf16 sums). This runs the kernels' own test files once more, in a
pytest process without the pin, where the native build differs from the pinned one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NATIVE_ENV

from asr_spec.engine import cpu_attention

REPO = Path(__file__).resolve().parent.parent
KERNEL_TESTS = ["tests/test_cpu_linear.py", "tests/test_encoder_attention.py", "tests/test_cpu_attention.py",
                "tests/test_int8_encoder.py", "tests/test_cpu_reduce.py", "tests/test_cpu_layers.py"]


def test_the_kernels_built_for_this_cpu_pass_their_tests(monkeypatch):
    monkeypatch.delenv(cpu_attention.FLAGS_ENV, raising=False)  # this CPU's own flags, as the native build's
    if "avx512f" not in cpu_attention.cpu_flags().split():
        pytest.skip("this CPU's own build takes the pinned AVX2 build's code paths")
    if cpu_attention.disabled():
        pytest.skip("the CPU kernels are disabled here")
    env = {**os.environ, NATIVE_ENV: "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *KERNEL_TESTS], capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    # the kernels ran: no test skipped for want of the native build (a skip for another reason, e.g. no oneDNN
    # bf16 products on an AVX-512 CPU without AVX-512-BF16, is that test's own)
    assert " passed" in done.stdout and "could not be built" not in done.stdout, done.stdout[-1000:]
