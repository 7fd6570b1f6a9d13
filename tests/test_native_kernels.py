"""The CPU kernel extension as built for other flags than the suite's pinned AVX2 ones (conftest.py), and the
engine's bf16 and sampling invariants as those flags' CPU class decides them. On an AVX-512 CPU the native build
takes other code paths (16-lane vectors, 8-row groups, AVX-512-BF16's `vdpbf16ps` for bf16 sums); on a CPU without
AVX-512 those paths are built emulated (`cpu_attention.target_options`: each AVX-512 intrinsic through SIMDe), so
that every machine the suite runs on runs the code the other kinds build. Each runs the kernels' own test files
and those invariants once more, in a pytest process with those flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import UNPINNED_ENV, simde_headers

from asr_spec.engine import cpu_attention

REPO = Path(__file__).resolve().parent.parent
# the kernels' own tests, then the engine's invariants in bf16 and sampled rows, which with these flags run as that
# CPU class decides them (`auto` bf16 on a native-bf16 class, the bf16 draft copy) over its kernel paths
KERNEL_TESTS = ["tests/test_cpu_linear.py", "tests/test_encoder_attention.py", "tests/test_cpu_attention.py",
                "tests/test_int8_encoder.py", "tests/test_int8_attention.py", "tests/test_int8_decoder.py",
                "tests/test_cpu_reduce.py", "tests/test_cpu_layers.py", "tests/test_cpu_lstm.py", "tests/test_bf16.py",
                "tests/test_cpu_invariance.py", "tests/test_sampling.py"]
# an AVX2 machine's flags with AVX-512 added (and its BF16 instructions or not): only what the emulation builds,
# since torch's and oneDNN's own products still run on this CPU (no VNNI or AMX claimed)
AVX2 = "fpu sse2 avx avx2 fma f16c bmi1 bmi2"
EMULATED = {"avx512": f"{AVX2} avx512f avx512bw avx512vl avx512dq",
            "avx512_bf16": f"{AVX2} avx512f avx512bw avx512vl avx512dq avx512_bf16"}


def _kernel_tests(flags: str | None) -> None:
    """The kernel test files in a pytest process of their own, the CPU flags `flags` forced (None: this CPU's
    own); asserts they pass and that the kernels ran (no test skipped for want of the build: a skip for another
    reason, e.g. no oneDNN bf16 products on a CPU without AVX-512-BF16, is that test's own)."""
    env = {key: value for key, value in os.environ.items() if key != cpu_attention.FLAGS_ENV}
    env = {**env, UNPINNED_ENV: "1", **({cpu_attention.FLAGS_ENV: flags} if flags is not None else {})}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *KERNEL_TESTS], capture_output=True, text=True, timeout=1200, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "could not be built" not in done.stdout, done.stdout[-1000:]


def _own_flags(monkeypatch) -> str:
    monkeypatch.delenv(cpu_attention.FLAGS_ENV, raising=False)
    if cpu_attention.disabled():
        pytest.skip("the CPU kernels are disabled here")
    return cpu_attention.cpu_flags()


def test_the_kernels_built_for_this_cpu_pass_their_tests(monkeypatch):
    if "avx512f" not in _own_flags(monkeypatch).split():
        pytest.skip("this CPU's own build takes the pinned AVX2 build's code paths")
    _kernel_tests(None)


@pytest.mark.parametrize("kind", sorted(EMULATED))
def test_the_kernels_avx512_paths_emulated_pass_their_tests(monkeypatch, kind):
    """On a CPU without AVX-512 (where the native test above is skipped): the kernels as an AVX-512 CPU (with
    AVX-512-BF16 or without) builds them, emulated."""
    own = _own_flags(monkeypatch).split()
    if "avx512f" in own:
        pytest.skip("this CPU builds its own AVX-512 paths (the native test runs them)")
    if "avx2" not in own:
        pytest.skip("the emulated build targets an AVX2 CPU (x86-64-v3)")
    if not simde_headers():
        pytest.skip("SIMDe's headers (libsimde-dev) are not installed: the AVX-512 paths cannot be emulated here")
    _kernel_tests(EMULATED[kind])
