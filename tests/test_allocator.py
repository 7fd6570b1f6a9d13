"""The malloc settings of a process of our own (asr_spec/allocator.py): set on glibc unless the environment chose,
a big block then comes from the heap (not mmapped and unmapped every call), and set by `asr-spec serve` before it
serves and by `asr-spec transcribe` / `stream` before they load a model."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from conftest import no_uvicorn

from asr_spec import allocator


@pytest.mark.parametrize("name", allocator.USER_SETTINGS)
def test_the_users_own_malloc_settings_win(monkeypatch, name):
    monkeypatch.setattr(allocator, "_glibc", lambda: pytest.fail("libc looked up though the user set malloc"))
    assert allocator.pin({name: "2"}) is False


def test_without_glibc_nothing_is_pinned(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    assert allocator.pin({}) is False


class _Libc:
    """A C library that records mallopt calls and accepts all but `refused`."""

    def __init__(self, refused: int | None = None):
        self.calls: list[tuple[int, int]] = []
        self.refused = refused

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return 0 if parameter == self.refused else 1


def test_the_three_settings_are_given_to_mallopt(monkeypatch):
    libc = _Libc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    assert allocator.pin({}) is True
    assert sorted(libc.calls) == sorted([(-3, allocator.MMAP_THRESHOLD_BYTES), (-1, allocator.TRIM_THRESHOLD_BYTES),
                                         (-8, allocator.MAX_ARENAS)])


def test_a_refused_setting_is_reported(monkeypatch, caplog):
    monkeypatch.setattr(allocator, "_glibc", lambda: _Libc(refused=-1))
    assert allocator.pin({}) is False
    assert "mallopt refused" in caplog.text


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def test_on_glibc_a_big_block_comes_from_the_heap_not_mmap():
    """An encoder-sized block (16 MiB, above the 4 MiB threshold pinned before and glibc's initial 128 KiB) is
    served from the heap once pinned: glibc's count of mmapped bytes (mallinfo2's hblkhd) does not move."""
    libc = allocator._glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc 2.33 or later")
    assert allocator.pin({}) is True
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    mapped = libc.mallinfo2().hblkhd
    block = libc.malloc(16 * 1024 * 1024)
    try:
        assert block
        assert libc.mallinfo2().hblkhd == mapped
    finally:
        libc.free(block)


def test_serve_pins_malloc_before_it_serves(monkeypatch):
    import asr_spec.serve as serve

    order: list[str] = []
    monkeypatch.setattr(allocator, "pin", lambda: order.append("pin") or True)
    monkeypatch.setattr(serve, "build_app", lambda preset, **settings: order.append("build") or "app")
    no_uvicorn(monkeypatch, lambda app: order.append(f"run {app}"))
    serve.run_server("base")
    assert order == ["pin", "build", "run app"]


SPEECH = str(Path(__file__).parent / "fixtures" / "speech" / "long_75s.flac")  # transcribe loads nothing for a
# file that is not there


@pytest.mark.parametrize("command", [["transcribe", SPEECH], ["stream", "a.wav"]])
def test_the_cli_pins_malloc_before_it_loads_a_model(monkeypatch, capsys, command):
    """`asr-spec transcribe` and `asr-spec stream` own their process, as the server does: malloc is pinned before
    the models load (here the load fails at once, a user error, and the command exits)."""
    from asr_spec.cli import main
    from asr_spec.errors import InputError
    from asr_spec.transcribe import Transcriber

    order: list[str] = []
    monkeypatch.setattr(allocator, "pin", lambda: order.append("pin") or True)

    def load(*args, **kwargs):
        order.append("load")
        raise InputError("no model here")

    monkeypatch.setattr(Transcriber, "from_preset", load)
    with pytest.raises(SystemExit):
        main(command)
    assert order == ["pin", "load"], capsys.readouterr().err


def test_the_benchmarks_pin_unless_asked_for_plain_malloc(monkeypatch):
    """`benchmarks.malloc`: one option for every benchmark, its older name (`bench_stream --glibc-malloc`) too."""
    import argparse

    from benchmarks import malloc

    parser = argparse.ArgumentParser()
    malloc.add_option(parser)
    calls = []
    monkeypatch.setattr(allocator, "pin", lambda: calls.append(1) or True)
    for argv, pinned in (([], True), (["--plain-malloc"], False), (["--glibc-malloc"], False)):
        assert malloc.pin_unless_plain(parser.parse_args(argv)) is pinned
    assert len(calls) == 1
