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
KERNEL_TESTS = ["tests/test_cpu_linear.py", "tests/test_encoder_attention.py", "tests/test_cpu_attention.py"]


def _own_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo lists them (the pin replaces them for everything else in the suite)."""
    text = cpu_attention.CPUINFO.read_text(encoding="utf-8", errors="replace") if cpu_attention.CPUINFO.exists() else ""
    line = next((line for line in text.splitlines() if line.startswith("flags")), "flags:")
    return set(line.split(":", 1)[1].split())


def test_the_kernels_built_for_this_cpu_pass_their_tests():
    if "avx512f" not in _own_flags():
        pytest.skip("this CPU's own build takes the pinned AVX2 build's code paths")
    if cpu_attention.disabled():
        pytest.skip("the CPU kernels are disabled here")
    env = {key: value for key, value in os.environ.items() if key != cpu_attention.FLAGS_ENV}
    env[NATIVE_ENV] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *KERNEL_TESTS], capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-1000:]
