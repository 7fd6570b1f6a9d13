"""The server's temperature field, OpenAI's meaning: 0 raises the temperature automatically while a window fails
Whisper's thresholds, t > 0 starts the schedule at t; the answer is the Transcriber's with that schedule (the same
sampled windows: their keys come from the seed and the window's audio, not from the batch)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
from fastapi.testclient import TestClient  # noqa: E402
from test_serve import post  # noqa: E402
from test_transcribe import SHORT, transcriber  # noqa: E402

from asr_spec.chunk_id import ChunkId, StreamKey  # noqa: E402
from asr_spec.serve.app import ServeOptions, create_app  # noqa: E402
from asr_spec.serve.batcher import Batcher  # noqa: E402
from asr_spec.transcribe.fallback import WHISPER_SCHEDULE, schedule_from  # noqa: E402


def test_schedule_from_is_openai_whispers_increment():
    assert schedule_from(0.0) == WHISPER_SCHEDULE
    assert schedule_from(0.5) == (0.5, 0.7, 0.9)
    assert schedule_from(0.8) == (0.8, 1.0)
    assert schedule_from(1.0) == (1.0,)


@pytest.mark.slow
def test_temperature_field_runs_the_fallback_schedule_in_the_servers_batch():
    served = transcriber(speculative=True, timestamps=True, best_of=2)
    files = [str(SHORT[0])]
    greedy = served.transcribe(files, progress=False)
    app = create_app(Batcher(served, batch_size=4), ServeOptions(model_id="tiny"))
    with TestClient(app) as client:
        for field, schedule in (("0", WHISPER_SCHEDULE), ("0.6", (0.6, 0.8, 1.0))):
            want = transcriber(speculative=True, timestamps=True, best_of=2, temperature=schedule).transcribe(
                files, progress=False)
            for path, expected, plain in zip(SHORT[:1], want, greedy):
                response = post(client, path, temperature=field)
                assert response.status_code == 200, response.text
                assert response.json()["text"] == expected.text
                if field == "0.6":  # sampled from the first pass: not the greedy text
                    assert expected.text != plain.text
        response = post(client, SHORT[0])  # no field: the server's own schedule (greedy here)
        assert response.json()["text"] == greedy[0].text


def test_a_streams_redecodes_stay_greedy_under_a_servers_fallback_schedule():
    """A server started with a fallback schedule decodes uploads' failing windows again at a temperature, never a
    stream's re-decode: its policy compares greedy hypotheses (and a hypothesis drafts greedy rows only)."""
    batcher = Batcher(transcriber(speculative=False, timestamps=True, temperature=WHISPER_SCHEDULE), batch_size=2)
    assert batcher._schedule(ChunkId(StreamKey(3), 0)) == (0.0,)
    assert batcher._schedule(ChunkId(12345, 0)) == WHISPER_SCHEDULE  # an upload with no request schedule: the server's
