"""The /v1/realtime events, pure: what a client may send, checked, and the one-line error of each malformed event."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from asr_spec.serve import realtime_events as events


def _append(samples: np.ndarray) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(samples.tobytes()).decode()})


def test_append_decodes_pcm16_little_endian_to_float32():
    pcm = np.array([0, 1, -1, 32767, -32768, 16384], dtype="<i2")
    event = events.parse(_append(pcm), max_samples=16000)
    assert isinstance(event, events.Append) and event.samples.dtype == np.float32
    assert np.array_equal(event.samples, pcm.astype(np.float32) / 32768.0)


def test_the_client_events_of_vllms_protocol():
    assert events.parse('{"type": "session.update", "model": "m"}', 1) == events.SessionUpdate("m", None)
    assert events.parse('{"type": "session.update", "tentative": true}', 1) == events.SessionUpdate(None, True)
    assert events.parse('{"type": "input_audio_buffer.commit"}', 1) == events.Commit(False)
    assert events.parse('{"type": "input_audio_buffer.commit", "final": true, "event_id": "e1"}', 1) == \
        events.Commit(True)


@pytest.mark.parametrize("message, code, words", [
    ("not json", "invalid_json", "not JSON"),
    (b"\x00\x01", "invalid_event", "binary"),
    ("[1, 2]", "invalid_event", "JSON object"),
    ('{"type": "response.create"}', "unknown_event", "unknown event type 'response.create'"),
    ('{"audio": "AAA="}', "unknown_event", "unknown event type None"),
    ('{"type": []}', "unknown_event", "unknown event type []"),  # not hashable: no TypeError
    ("[" * 100_000, "invalid_json", "nests too deeply"),
    ('{"type": "input_audio_buffer.append"}', "invalid_audio", "base64 string"),
    ('{"type": "input_audio_buffer.append", "audio": "%%%"}', "invalid_audio", "not valid base64"),
    ('{"type": "input_audio_buffer.append", "audio": "AAAA"}', "invalid_audio", "3 bytes"),
    ('{"type": "input_audio_buffer.append", "audio": ""}', "invalid_audio", "non-empty"),
    # an encoded file sent where raw samples go (its header decoded as noise: a done with no text, no error)
    ('{"type": "input_audio_buffer.append", "audio": "ZkxhQwAAACIAAAAAAAAAAA=="}', "invalid_audio", "a FLAC file"),
    ('{"type": "input_audio_buffer.append", "audio": "UklGRiQAAABXQVZFZm10IA=="}', "invalid_audio", "a WAV file"),
    ('{"type": "input_audio_buffer.commit", "final": "yes"}', "invalid_event", "final must be a bool"),
    ('{"type": "session.update", "model": 3}', "invalid_event", "model must be a str"),
    ('{"type": "session.update", "session": {}}', "invalid_event", "unknown field(s) 'session'"),
    ('{"type": "session.update", "lag": ' + "9" * 5000 + "}", "invalid_json", "cannot be read"),  # int limit
    ('{"type": "session.update", "\\ud800x": 1}', "invalid_event", "unknown field(s) '\\ud800x'"),
])
def test_a_malformed_event_is_a_one_line_error_with_a_code(message, code, words):
    with pytest.raises(events.ProtocolError) as err:
        events.parse(message, max_samples=16000)
    assert err.value.code == code and words in str(err.value) and "\n" not in str(err.value)
    json.dumps(events.error(str(err.value), code), ensure_ascii=False).encode()  # sendable (a lone surrogate: not)


def test_an_append_past_the_limit_is_refused_before_it_is_decoded():
    with pytest.raises(events.ProtocolError) as err:
        events.parse(_append(np.zeros(16001, "<i2")), max_samples=16000)
    assert err.value.code == "audio_too_large"
    assert isinstance(events.parse(_append(np.zeros(16000, "<i2")), max_samples=16000), events.Append)


def test_server_events():
    created = events.created()
    assert created["type"] == "session.created" and created["id"].startswith("sess-")
    assert events.done("hi", 3, 4) == {"type": "transcription.done", "text": "hi",
                                       "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    assert events.error("bad", "invalid_event") == {"type": "error", "error": "bad", "code": "invalid_event"}
