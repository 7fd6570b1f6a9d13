"""The server's one OpenMP team (`serve/openmp.py`): finding torch's runtime in the process's mappings, worker
threads without a team, the calling thread's pool released, torch's results unchanged."""

from __future__ import annotations

import threading
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
    """torch's OpenMP runtime found (else skipped), and torch on 2 threads for the test (the suite runs on 1:
    `one_thread` must be seen to bring a thread from 2 to 1), its own count restored after."""
    if openmp.runtime() is None:
        pytest.skip("torch's OpenMP runtime is not found in this process (not Linux, or torch without OpenMP)")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # set explicitly, as the server's loading does: a thread's first parallel loop takes it
    yield
    torch.set_num_threads(threads)


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_the_runtime_found_is_torchs_even_beside_another_packages_copy(runtime):
    """ctranslate2 (faster-whisper's) brings its own GNU OpenMP, mapped before torch's in a process that imported
    it first; a count set in that copy would not reach torch's loops."""
    pytest.importorskip("ctranslate2")
    assert openmp.runtime()._name.startswith(str(Path(torch.__file__).parent / "lib"))


def test_a_worker_thread_runs_torch_without_a_team_and_the_others_keep_theirs(runtime):
    threads = torch.get_num_threads()
    a, b = torch.randn(300, 200), torch.randn(200, 100)

    def work():
        openmp.one_thread()
        return torch.get_num_threads(), a @ b

    n, product = _in_thread(work)
    assert n == 1
    assert torch.get_num_threads() == threads == 2
    assert _in_thread(torch.get_num_threads) == 2  # threads started later: torch's own count
    torch.testing.assert_close(product, a @ b)


def test_the_executors_threads_have_no_team(runtime):
    with openmp.executor(max_workers=2) as pool:
        assert set(pool.map(lambda _: torch.get_num_threads(), range(4))) == {1}


def test_releasing_the_pool_keeps_the_settings_and_torch_runs_on(runtime):
    threads = torch.get_num_threads()
    x = torch.randn(512, 512)
    before = x @ x
    assert openmp.release_pool()
    assert torch.get_num_threads() == threads
    torch.testing.assert_close(x @ x, before)  # a new pool, the same sums


def test_a_worker_thread_stays_without_a_team_through_the_kernel_extension(runtime, kernel):
    """The extension keeps its own copy of torch's per-thread setting: its first parallel loop in a thread would
    set the thread's count again unless `one_thread` made it first."""
    from asr_spec.engine import cpu_linear

    panels = cpu_linear.pack_panels(torch.randn(64, 32))
    x = torch.randn(3, 32)

    def work():
        openmp.one_thread()
        out = cpu_linear.linear(x, panels, None)
        return torch.get_num_threads(), out

    n, out = _in_thread(work)
    assert n == 1
    assert torch.equal(out, cpu_linear.linear(x, panels, None))  # row-invariant kernels: the same bits
