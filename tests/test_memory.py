"""The memory a CPU run may take: the machine's available memory, or a container's cgroup limit where lower."""

from __future__ import annotations

from pathlib import Path

import torch

from asr_spec.engine import memory
from asr_spec.engine.memory import cgroup_headroom


def _group(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_a_cgroup_v2_limit_less_its_usage_without_the_file_cache(tmp_path: Path) -> None:
    """Inside a container /proc/meminfo shows the host: a batch over the container's limit passed the memory check
    and the process was killed instead of told."""
    membership = tmp_path / "cgroup"
    membership.write_text("0::/kubepods/pod1\n")
    _group(tmp_path / "fs" / "kubepods" / "pod1", {"memory.max": "4294967296\n", "memory.current": "3221225472\n",
                                                   "memory.stat": "anon 1\ninactive_file 1073741824\n"})
    assert cgroup_headroom(str(tmp_path / "fs"), str(membership)) == 2 * 2**30  # 4 - (3 - 1) GiB
    (tmp_path / "fs" / "kubepods" / "pod1" / "memory.max").write_text("max\n")
    assert cgroup_headroom(str(tmp_path / "fs"), str(membership)) is None  # no limit


def test_a_cgroup_v1_limit_at_the_mounted_root_and_none_without_one(tmp_path: Path) -> None:
    membership = tmp_path / "cgroup"
    membership.write_text("5:cpu,cpuacct:/\n4:memory:/docker/abc\n0::/\n")  # the group mounted as the root
    _group(tmp_path / "fs" / "memory", {"memory.limit_in_bytes": "1073741824\n",
                                        "memory.usage_in_bytes": "536870912\n",
                                        "memory.stat": "total_inactive_file 0\n"})
    assert cgroup_headroom(str(tmp_path / "fs"), str(membership)) == 2**29
    (tmp_path / "fs" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_headroom(str(tmp_path / "fs"), str(membership)) is None
    assert cgroup_headroom(str(tmp_path / "none"), str(tmp_path / "absent")) is None


def test_a_cpu_run_takes_the_lower_of_the_machine_and_its_container(monkeypatch) -> None:
    monkeypatch.setattr(memory, "_host_available", lambda: 64 * 2**30)
    monkeypatch.setattr(memory, "cgroup_headroom", lambda: 2 * 2**30)
    assert memory.free_bytes(torch.device("cpu")) == 2 * 2**30
    monkeypatch.setattr(memory, "cgroup_headroom", lambda: None)
    assert memory.free_bytes(torch.device("cpu")) == 64 * 2**30


def test_a_run_that_does_not_fit_is_checked_again_after_collecting_engines_let_go(monkeypatch) -> None:
    """An engine let go keeps its caches until the cyclic collector runs (it references its own methods): a GPU
    benchmark building engine after engine saw the dropped ones as used memory and stopped with ResourceError."""
    import gc
    import weakref

    class Dropped:  # an engine-like cycle holding memory
        def __init__(self) -> None:
            self.me = self

    def free(device):
        return 100 if alive() is not None else 10_000  # what the dropped object holds is free once it is gone

    monkeypatch.setattr(memory, "free_bytes", free)
    monkeypatch.setattr(memory, "check_fits", lambda run, n_rows, free: None if free >= 1000 else "does not fit")
    gc.disable()
    try:
        kept = Dropped()
        alive = weakref.ref(kept)
        assert memory.fits_now(None, 1, torch.device("cpu")) == "does not fit"  # still referenced: a real shortage
        del kept
        assert alive() is not None  # a cycle: not freed by reference counting
        assert memory.fits_now(None, 1, torch.device("cpu")) is None and alive() is None
    finally:
        gc.enable()
