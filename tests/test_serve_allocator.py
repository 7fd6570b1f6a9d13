"""The server's malloc settings (serve/allocator.py): pinned on glibc unless the environment chose, and pinned by
`asr-spec serve` before it serves."""

from __future__ import annotations

import pytest

from asr_spec.serve import allocator


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES"])
def test_the_users_own_malloc_settings_win(monkeypatch, name):
    monkeypatch.setattr(allocator, "_glibc", lambda: pytest.fail("libc looked up though the user set malloc"))
    assert allocator.pin({name: "2"}) is False


def test_without_glibc_nothing_is_pinned(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    assert allocator.pin({}) is False


def test_on_glibc_both_settings_are_taken():
    if allocator._glibc() is None:
        pytest.skip("not glibc")
    assert allocator.pin({}) is True


def test_serve_pins_malloc_before_it_serves(monkeypatch):
    import uvicorn

    import asr_spec.serve as serve

    order: list[str] = []
    monkeypatch.setattr(allocator, "pin", lambda: order.append("pin") or True)
    monkeypatch.setattr(serve, "build_app", lambda preset, **settings: order.append("build") or "app")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: order.append(f"run {app}"))
    serve.run_server("base")
    assert order == ["pin", "build", "run app"]
