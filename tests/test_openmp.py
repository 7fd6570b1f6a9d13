"""The server's OpenMP pools (`serve/openmp.py`): torch's runtime found in the process's mappings (before another
package's copy), the calling thread's pool released, torch's results unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asr_spec.serve import openmp

MAPS = """\
7f00a000-7f00b000 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6
7f00c000-7f00d000 rw-p 00000000 00:00 0
7f00e000-7f00f000 r-xp 00000000 08:01 456 /venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1
7f010000-7f011000 r-xp 00000000 08:01 789 /venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1
"""


def test_torchs_own_runtime_is_taken_before_another_packages_copy_mapped_first():
    maps = "7f0-7f1 r-xp 0 08:01 1 /venv/site-packages/ctranslate2.libs/libgomp-e985bcbb.so.1.0.0\n" + MAPS
    torch_lib = "/venv/lib/python3.11/site-packages/torch/lib"
    assert openmp.runtime_path(maps, torch_lib) == f"{torch_lib}/libgomp.so.1"
    assert openmp.runtime_path(maps) == "/venv/site-packages/ctranslate2.libs/libgomp-e985bcbb.so.1.0.0"


def test_the_runtime_is_the_first_openmp_library_mapped():
    assert openmp.runtime_path(MAPS) == "/venv/lib/python3.11/site-packages/torch/lib/libgomp.so.1"
    assert openmp.runtime_path(MAPS.splitlines()[3]) == \
        "/venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1"
    assert openmp.runtime_path("7f0-7f1 r-xp 0 08:01 1 /opt/llvm/lib/libomp.so") == "/opt/llvm/lib/libomp.so"
    assert openmp.runtime_path(MAPS.splitlines()[0] + "\n" + MAPS.splitlines()[1]) is None
    assert openmp.runtime_path("") is None


@pytest.fixture
def runtime():
    if openmp.runtime() is None:
        pytest.skip("torch's OpenMP runtime is not found in this process (not Linux, or torch without OpenMP)")


def test_the_runtime_found_is_torchs_even_beside_another_packages_copy(runtime):
    """ctranslate2 (faster-whisper's) brings its own GNU OpenMP, mapped before torch's in a process that imported
    it first; a call into that copy would not reach torch's pools."""
    pytest.importorskip("ctranslate2")
    assert openmp.runtime()._name.startswith(str(Path(torch.__file__).parent / "lib"))


def test_releasing_the_pool_keeps_the_settings_and_torch_runs_on(runtime):
    threads = torch.get_num_threads()
    x = torch.randn(512, 512)
    before = x @ x
    assert openmp.release_pool()
    assert torch.get_num_threads() == threads
    torch.testing.assert_close(x @ x, before)  # a new pool, the same sums
