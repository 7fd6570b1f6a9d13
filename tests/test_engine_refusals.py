"""A request the model cannot take (a prompt over its limit, a token id past its vocabulary) is refused alone: its
result carries the cause naming it, and every other request of the run decodes as it would without it. Before, the
refusal raised out of the run as an `EngineError` that lost every chunk in flight (every other file and stream)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import perturbed, tiny_target
from test_transcribe import SHORT, transcriber

from asr_spec.engine import ChunkRequest, DecodeOptions, Engine, EngineError
from asr_spec.models.loading import decoder_draft
from asr_spec.transcribe.prompts import InputPrompt

MAX_NEW = 12
N_GOOD = 7


@functools.cache
def _target():
    return tiny_target()


@functools.cache
def _draft():
    return decoder_draft(perturbed(_target(), 0.3, seed=3, encoder=False))


@functools.cache
def _features():
    return torch.randn(N_GOOD, 16, 100, generator=torch.Generator().manual_seed(0))


def _engine(speculative: bool) -> Engine:
    return Engine(_target(), _draft() if speculative else None,
                  DecodeOptions(language="en", max_new_tokens=MAX_NEW, draft_bf16=False))


def _good() -> list[ChunkRequest]:
    return [ChunkRequest(i, _features()[i]) for i in range(N_GOOD)]


@pytest.mark.parametrize("speculative", [False, True])
def test_an_over_long_prompt_is_refused_alone(speculative):
    """Batch 4, the bad request third: it was checked in the micro-batch that also held rows 0, 1 and 3."""
    engine = _engine(speculative)
    alone = {r.id: r for r in engine.run(_good(), batch_size=4)}
    requests = _good()
    requests.insert(2, ChunkRequest("talk.wav#5", _features()[0], prompt=(5,) * 300))
    results = list(engine.run(requests, batch_size=4))
    assert sorted(map(str, (r.id for r in results))) == sorted(map(str, (r.id for r in requests)))  # one each
    by_id = {r.id: r for r in results}
    refused = by_id.pop("talk.wav#5")
    assert refused.error == "chunk 'talk.wav#5': prompt of 300 tokens, more than the model's 223"
    assert refused.tokens == () and refused.finish_reason == "refused" and refused.stats.chunks == 0
    assert {i: r.tokens for i, r in by_id.items()} == {i: r.tokens for i, r in alone.items()}
    assert all(r.error is None and r.stats.chunks == 1 for r in by_id.values())
    if speculative:
        assert sum(r.stats.accepted_tokens for r in by_id.values()) > 0  # the run really drafted


def test_each_refusal_names_its_request_and_cause():
    """Every cause admission refuses, among good requests of a live source ("nothing right now" between them)."""
    engine = _engine(False)
    eot, vocab = engine.tokens.eot, engine.target_dec.vocab_size
    bad = {
        "prefix": (dict(prefix=(5,) * 224), "prefix of 224 tokens, more than the model's 223"),
        "not an id": (dict(prompt=(5, vocab)), "prompt holds a value that is not a token id of the model"),
        "eot": (dict(prefix=(5, eot)), f"prefix holds <|endoftext|> ({eot})"),
        "no room": (dict(prompt=(5,) * 223, prefix=(6,) * 223),
                    "prompt and prefix leave no room in the model's 448 positions"),
        "hypothesis": (dict(hypothesis=(3, vocab + 1)),
                       f"hypothesis holds {vocab + 1}, not a token id below {vocab}"),
        "no features": (dict(features=None), "neither features nor encoder output"),
        # another model's mel bins failed the whole run inside oneDNN; a short window, inside the encoder
        "mel bins": (dict(features=torch.zeros(20, 100)), "features of shape (20, 100), where the target takes "
                                                          "(16, 100)"),
        "frames": (dict(features=torch.zeros(16, 60)), "features of shape (16, 60), where the target takes (16, 100)"),
        "encoded": (dict(features=None, encoded=torch.zeros(50, 7)),
                    "encoder output of shape (50, 7), where the target takes (50, 64)"),
    }
    good = _good()
    requests = [good[0], *(ChunkRequest(name, **{"features": _features()[1], **fields})
                           for name, (fields, _) in bad.items()), None, *good[1:]]
    results = {r.id: r for r in engine.run(requests, batch_size=4)}
    for name, (_, cause) in bad.items():
        assert results.pop(name).error == f"chunk {name!r}: {cause}"
    assert {i: r.tokens for i, r in results.items()} == {r.id: r.tokens for r in engine.run(good, batch_size=4)}


def test_an_id_that_cannot_be_hashed_is_refused_when_made():
    """A list as a chunk id failed inside the run (a TypeError in its feed), with every chunk in flight."""
    with pytest.raises(ValueError, match=r"chunk id \['talk', 3\]: must be hashable"):
        ChunkRequest(["talk", 3], _features()[0])


def test_a_run_of_refused_requests_only_yields_them():
    results = list(_engine(False).run([ChunkRequest(i, _features()[i], prefix=(5,) * 300) for i in range(3)], 4))
    assert [r.id for r in results] == [0, 1, 2] and all("prefix of 300 tokens" in r.error for r in results)


def test_an_engine_error_names_a_refused_request_not_yet_yielded(monkeypatch):
    """A refusal pulled in the micro-batch whose encoding raises is lost with it: the error names it."""
    engine = _engine(False)

    def broken(batch):
        raise RuntimeError("the encoder failed")

    monkeypatch.setattr(engine.encoding, "batch", broken)
    requests = [ChunkRequest("long", _features()[0], prompt=(5,) * 300), ChunkRequest("good", _features()[1])]
    with pytest.raises(EngineError) as caught:
        list(engine.run(requests, batch_size=2))
    assert set(caught.value.chunk_ids) == {"long", "good"}


@pytest.mark.parametrize("temperature", [(0.0,), (0.0, 0.4)])
def test_a_refused_chunk_fails_its_input_and_the_others_go_on(monkeypatch, temperature):
    """Through the Transcriber, with and without temperature fallback (the refused result resolves its window):
    the input whose first chunk the model cannot take fails with the engine's cause; the others are transcribed
    as in a run without it."""
    greedy = transcriber(speculative=False, temperature=temperature, best_of=2)
    inputs = [str(path) for path in SHORT[:3]]
    alone = greedy.transcribe([inputs[0], inputs[2]], progress=False)
    encode = greedy.prompt_tokens
    limit = greedy.tokens.max_prompt_tokens
    monkeypatch.setattr(greedy, "prompt_tokens", lambda options: InputPrompt(prefix=(440,) * (limit + 1))
                        if options.prefix == "bad" else encode(options))
    out = greedy.transcribe(inputs, progress=False, prefix=[None, "bad", None])
    assert out[1].error is not None and not out[1].ok
    assert "owner=1" in out[1].error and f"prefix of {limit + 1} tokens, more than the model's {limit}" in out[1].error
    assert "\n" not in out[1].error
    assert [t.error for t in (out[0], out[2])] == [None, None]
    assert [t.text for t in (out[0], out[2])] == [t.text for t in alone] and all(t.text for t in alone)
