"""The server's option dataclasses (`ServeOptions`, `RealtimeOptions`) check themselves when built from Python,
not only behind the CLI's flags: each bad field is one InputError line naming the field and the value (pure, no
model)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
from asr_spec.errors import InputError  # noqa: E402
from asr_spec.serve.app import ServeOptions  # noqa: E402
from asr_spec.serve.realtime import MIN_BLOCK_S, RealtimeOptions  # noqa: E402


def refused(make, match: str) -> str:
    """The one-line message of the InputError `make()` raises (which must match `match`)."""
    with pytest.raises(InputError, match=match) as info:
        make()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(("fields", "match"), [
    # 1e-5 s is 0 samples: every append was refused as too large, the session never got audio
    ({"max_append_s": 1e-5}, r"max_append_s \(1e-05\) must be at least block_s \(0.1\)"),
    ({"max_append_s": 0.5, "block_s": 1.0}, r"max_append_s \(0.5\) must be at least block_s \(1\)"),
    # one-sample blocks: a buffer copy per sample, slower than real time
    ({"block_s": 1e-5}, r"block_s must be at least 0.1 s \(shorter blocks only slow the feed\), got 1e-05"),
    ({"model_id": ""}, "model_id must be a non-empty string, got ''"),
    ({"model_id": 7}, "model_id must be a non-empty string, got 7"),
    ({"policy": "streaming"}, "policy must be None or a callable making a policy, got str"),
])
def test_realtime_options_refuse_what_no_session_could_use(fields, match):
    refused(lambda: RealtimeOptions(**fields), match)


def test_realtime_options_keep_their_smallest_legal_sizes():
    smallest = RealtimeOptions(block_s=MIN_BLOCK_S, max_append_s=MIN_BLOCK_S, max_backlog_s=MIN_BLOCK_S)
    assert smallest.block_samples == smallest.max_append_samples == smallest.max_backlog_samples == 1600
    assert RealtimeOptions(policy=lambda: None).policy is not None


@pytest.mark.parametrize("bad", [-5, 1.5, True, "1", None])
def test_serve_options_refuse_a_retry_delay_that_is_no_delay_seconds(bad):
    """Retry-After is str(retry_after_s): -5 and 1.5 were sent as headers no client can read."""
    refused(lambda: ServeOptions(retry_after_s=bad), rf"retry_after_s must be an integer >= 0, got {bad!r}")


def test_serve_options_take_a_zero_retry_delay_and_refuse_a_model_id_that_is_no_name():
    assert ServeOptions(retry_after_s=0).retry_after_s == 0
    refused(lambda: ServeOptions(model_id=7), "model_id must be a non-empty string, got 7")
    refused(lambda: ServeOptions(model_id=""), "model_id must be a non-empty string, got ''")


@pytest.mark.parametrize(("keys", "match"), [
    # a str is a tuple of its characters: "s" let any request in
    ("sk-secret", "api_keys must be a tuple of strings, got a str"),
    (["sk-secret"], "api_keys must be a tuple of strings, got a list"),
    (("sk-secret", 3), "api_keys must be a tuple of strings, got a key of type int"),
    (("sk-secret", ""), "api_keys must not hold an empty key"),
    ((" sk-secret",), "api_keys must not hold a key with spaces around it"),  # the bearer token is read stripped
])
def test_serve_options_refuse_keys_no_request_could_send_or_any_could(keys, match):
    message = refused(lambda: ServeOptions(api_keys=keys), match)
    assert "sk-secret" not in message  # a key is not written to the logs
    assert ServeOptions(api_keys=("sk-secret", "second")).api_keys == ("sk-secret", "second")
