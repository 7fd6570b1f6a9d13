"""The server honours OpenAI's `prompt` field (and asr-spec's `hotwords` and `prefix`): a request's transcript is
the Transcriber's with the same prompts, and requests with different prompts share the engine's batch."""

from __future__ import annotations

import concurrent.futures

import pytest

pytest.importorskip("fastapi", reason="needs the asr-spec[serve] extra")
from fastapi.testclient import TestClient  # noqa: E402
from test_serve import post  # noqa: E402
from test_transcribe import LONG, SHORT, transcriber  # noqa: E402

from asr_spec.serve.app import ServeOptions, create_app  # noqa: E402
from asr_spec.serve.batcher import Batcher  # noqa: E402

PROMPT = "Earlier text about a village, a baker and the river."


@pytest.fixture(scope="module")
def greedy():
    return transcriber(speculative=False, timestamps=True)


@pytest.fixture(scope="module")
def client(greedy):
    app = create_app(Batcher(greedy, batch_size=4), ServeOptions(model_id="tiny", max_file_mb=2))
    with TestClient(app) as client:
        yield client


def test_prompt_hotwords_and_prefix_are_honoured(client, greedy):
    files = [LONG, SHORT[0]]
    plain = greedy.transcribe([str(p) for p in files], progress=False)
    asks = [dict(prompt=PROMPT), dict(hotwords="baker river"), dict(prefix="The village"),
            dict(prompt=PROMPT, hotwords="baker", prefix="The village")]
    requests = [(path, ask) for path in files for ask in asks]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:  # all at once: one batch, mixed prompts
        responses = list(pool.map(lambda r: post(client, r[0], response_format="json", **r[1]), requests))
    changed = 0
    for (path, ask), response in zip(requests, responses):
        assert response.status_code == 200, response.text
        values = {"initial_prompt" if k == "prompt" else k: v for k, v in ask.items()}
        [want] = greedy.transcribe(str(path), progress=False, **values)
        assert response.json()["text"] == want.text
        if "prefix" in ask:
            assert want.text.strip().startswith("The village")
        changed += want.text != plain[files.index(path)].text
    assert changed >= len(requests) - 1  # the prompts really changed the transcripts (not a vacuous equality)


def test_an_empty_prompt_is_none(client, greedy):
    [want] = greedy.transcribe(str(SHORT[0]), progress=False)
    response = post(client, SHORT[0], prompt="", hotwords="", prefix="")
    assert response.status_code == 200 and response.json()["text"] == want.text


def test_a_prompt_for_a_model_that_takes_none_is_a_400_and_gives_back_its_budget():
    """A model whose generation config has no <|startofprev|> takes no prompt: the request gets a 400 naming why
    (it was a 500), and the admission budget it had reserved comes back."""
    import dataclasses

    served = transcriber(speculative=False, timestamps=True)  # its own Transcriber: its tokens are changed here
    served.tokens = dataclasses.replace(served.tokens, sot_prev=None)
    batcher = Batcher(served, batch_size=4)
    with TestClient(create_app(batcher, ServeOptions(model_id="tiny"))) as client:
        response = post(client, SHORT[0], prompt="The quick brown fox.")
        assert response.status_code == 400 and "prev_sot_token_id" in response.text, response.text
        assert batcher.in_flight == (0, 0.0)
        assert post(client, SHORT[0]).status_code == 200  # no prompt: served
