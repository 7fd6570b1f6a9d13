"""One language per file where the engine detects it (a multilingual reviewer's finds): the chunks of a language
group take the language its first sure detection gave (`GroupLanguages`), a re-decoded tail its parent's
(`ChunkRequest.language_token`), at any batch size; speculative == greedy as ever."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from asr_spec.chunk_id import ChunkId
from asr_spec.engine import ChunkRequest, ChunkResult, ChunkStats, DecodeOptions, Engine, admission
from asr_spec.engine.admission import GroupLanguages
from asr_spec.testing import random_whisper
from asr_spec.transcribe.tail_runs import TailSource


@functools.cache
def _features() -> torch.Tensor:
    return torch.randn(8, 16, 100, generator=torch.Generator().manual_seed(5))


def _target():
    """A random multilingual Whisper (<|en|>, <|de|>) that detects either in these random windows."""
    return random_whisper("test", seed=1, vocab_size=70, init_std=1.0)


LANGS = [7, 8, 9]  # three language tokens, a detection's columns


def _probs(*rows: tuple[float, float, float]) -> torch.Tensor:
    return torch.tensor(rows)


def test_a_group_takes_its_first_sure_language_and_forgets_the_oldest():
    groups = GroupLanguages(size=2)
    # an unsure first detection decodes its own row and leaves the group open; the first sure one settles it
    assert groups.settle(_probs((0.4, 0.3, 0.3), (0.05, 0.9, 0.05), (0, 0.01, 0.99)), LANGS, ["f"] * 3) == [7, 8, 8]
    # no group: its own, always
    assert groups.settle(_probs((0, 0.01, 0.99), (0.2, 0.3, 0.5)), LANGS, ["f", None]) == [8, 9]
    assert groups.settle(_probs((0.6, 0.2, 0.2), (0.2, 0.6, 0.2)), LANGS, ["g", "h"]) == [7, 8]
    assert list(groups.known) == ["g", "h"]
    assert groups.settle(_probs((0.1, 0.1, 0.8)), LANGS, ["f"]) == [9]  # "f", the oldest, was forgotten


def test_an_unsure_groups_chunks_take_the_language_its_detections_pool_to():
    """A group no detection was sure of decoded each chunk in its own detected language (a file's chunks in
    several). Unsure detections now pool: a chunk takes the language the group's detections so far give the most
    probability in all, until a sure one settles the group."""
    groups = GroupLanguages()
    first, second = (0.45, 0.30, 0.25), (0.38, 0.42, 0.20)  # alone: 7, then 8
    assert groups.settle(_probs(first, second), LANGS, ["f", "f"]) == [7, 7]  # pooled 0.83 / 0.72 / 0.45
    assert groups.settle(_probs((0.10, 0.45, 0.45)), LANGS, ["f"]) == [8]  # pooled 0.93 / 1.17 / 0.90
    assert groups.settle(_probs((0.05, 0.05, 0.90), (0.8, 0.1, 0.1)), LANGS, ["f", "f"]) == [9, 9]  # sure: settled
    # the same detections one admission at a time (batch 1) choose the same
    one = GroupLanguages()
    assert [one.settle(_probs(p), LANGS, ["f"])[0] for p in (first, second, (0.10, 0.45, 0.45))] == [7, 7, 8]


def _languages(results) -> dict:
    return {r.id: r.prompt[1] for r in results}


@pytest.mark.parametrize("draft", [False, True])
def test_the_chunks_of_a_group_share_a_language_at_any_batch_size(monkeypatch, draft):
    """Random audio gives every chunk its own detected language; in one group they all take the first's, the
    same at batch 1 and 4, with or without the draft (which decodes the target's tokens)."""
    monkeypatch.setattr(admission, "LANGUAGE_SURE", 0.0)
    target = _target()
    options = DecodeOptions(max_new_tokens=6)
    alone = _languages(Engine(target, None, options).decode(_features(), batch_size=4))
    assert len(set(alone.values())) > 1  # the chunks would be decoded in several languages
    runs = []
    for batch_size in (1, 4):
        engine = Engine(target, target if draft else None, options)
        requests = [ChunkRequest(("f", i), f, language_group="f") for i, f in enumerate(_features())]
        runs.append({r.id: r for r in engine.run(iter(requests), batch_size=batch_size)})
    first = alone[0]
    assert all(r.prompt[1] == first for r in runs[0].values())
    assert {k: r.tokens for k, r in runs[0].items()} == {k: r.tokens for k, r in runs[1].items()}


def test_a_new_run_forgets_the_groups_of_the_last(monkeypatch):
    """`Transcriber.transcribe` keys its inputs 0, 1, ... in every call: a second call's input 0 took the first
    call's language."""
    monkeypatch.setattr(admission, "LANGUAGE_SURE", 0.0)
    engine = Engine(_target(), None, DecodeOptions(max_new_tokens=4))
    alone = _languages(engine.decode(_features(), batch_size=8))
    other = next(i for i in alone if alone[i] != alone[0])
    for row in (0, other):
        (result,) = engine.run(iter([ChunkRequest(("input", 0), _features()[row], language_group=0)]), batch_size=1)
        assert result.prompt[1] == alone[row]


def test_a_given_language_token_wins_and_a_foreign_one_is_refused():
    target = _target()
    engine = Engine(target, None, DecodeOptions(max_new_tokens=4))
    german = engine.tokens.lang_to_id["<|de|>"]
    requests = [ChunkRequest("de", _features()[0], language_token=german, language_group="g"),
                ChunkRequest("bad", _features()[1], language_token=3)]
    results = {r.id: r for r in engine.run(iter(requests), batch_size=2)}
    assert results["de"].prompt[1] == german and results["de"].finish_reason != "refused"
    assert results["bad"].finish_reason == "refused" and "not one of the model's languages" in results["bad"].error
    with pytest.raises(ValueError, match="language_token must be None or a token id"):
        ChunkRequest("x", _features()[0], language_token=-1)
    with pytest.raises(ValueError, match="language_group must be hashable"):
        ChunkRequest("x", _features()[0], language_group=["a"])


def test_a_given_language_settles_no_group(monkeypatch):
    monkeypatch.setattr(admission, "LANGUAGE_SURE", 0.0)
    engine = Engine(_target(), None, DecodeOptions(max_new_tokens=4))
    alone = _languages(engine.decode(_features(), batch_size=8))
    given = next(lang for lang in engine.tokens.lang_to_id.values() if lang != alone[0])
    requests = [ChunkRequest("given", _features()[1], language_token=given, language_group="g"),
                ChunkRequest("own", _features()[0], language_group="g")]
    results = {r.id: r.prompt[1] for r in engine.run(iter(requests), batch_size=1)}
    assert results == {"given": given, "own": alone[0]}


def test_two_runs_open_at_once_keep_their_own_groups(monkeypatch):
    """Two `iter_transcribe` generators (or threads) on one Transcriber key their files 0, 1, ... alike: a run's
    start forgot the other's groups and its files settled the other's, so a German file's later chunks were decoded
    in Italian, the other run's second file's language."""
    monkeypatch.setattr(admission, "LANGUAGE_SURE", 0.0)
    engine = Engine(_target(), None, DecodeOptions(max_new_tokens=4))
    alone = _languages(engine.decode(_features(), batch_size=8))
    other = next(i for i in alone if alone[i] != alone[0])

    def run(name: str, first: int):
        rows = [first, *(i for i in range(8) if i != first)][:3]
        return engine.run(iter([ChunkRequest(ChunkId(name, i), _features()[row], language_group=0)
                                for i, row in enumerate(rows)]), batch_size=1)

    a, b = run("a", 0), run("b", other)
    firsts = [next(a), next(b)]
    rest = list(a) + list(b)
    assert [r.prompt[1] for r in firsts] == [alone[0], alone[other]]
    assert all(r.prompt[1] == (alone[0] if r.id.owner == "a" else alone[other]) for r in rest)


def test_a_tail_is_decoded_in_its_parents_language():
    """A French chunk's tail was sent with no language and detected Romanian from its few seconds."""
    engine = Engine(_target(), None, DecodeOptions(max_new_tokens=4))
    tokens = engine.tokens
    german = tokens.lang_to_id["<|de|>"]
    source = TailSource(lambda samples: torch.zeros(len(samples), 16, 100), tokens.language_in)
    parent = ChunkId("file", 0)
    source.samples[parent] = np.zeros(32000, np.float32)
    prompt = (tokens.sot_prev, 5, tokens.sot, german, tokens.task_to_id["transcribe"])
    result = ChunkResult(parent, (), prompt, "eos", ChunkStats())

    class Span:
        start_sample = 0

    tail = type("Tail", (), {"start_sample": 16000})()
    source.finished(result, tail, Span(), False)
    (request,) = source.queued()
    assert request.language_token == german and request.language_group == "file"
    assert tokens.language_in(prompt) == german and tokens.language_in((tokens.sot,)) is None


def test_a_task_in_any_case_and_an_empty_language_named_for_the_cli():
    """`--language EN` was taken but `--task Translate` refused; `--language ""` was told "or None (detect)"."""
    assert DecodeOptions(task=" Translate").task == "translate"
    with pytest.raises(ValueError, match="or auto"):
        DecodeOptions(language="")


def test_a_preset_draft_distilled_on_english_only_sits_out_a_run_given_another_language(tmp_path):
    """The base preset's draft (English pseudo-labels only) decoded German and Spanish at 13 % acceptance, 1.35x
    slower than greedy, with `--language de` too: a given other language now runs greedy, unless --draft asks."""
    import json

    from asr_spec.models.drafts import INFO_FILE, trained_language
    from asr_spec.models.presets import load_preset, plan_models

    preset = load_preset("base")
    assert trained_language(preset.draft) == "en"
    for language, drafts in ((None, True), ("auto", True), ("English", True), ("de", False), ("german", False)):
        overrides = {} if language is None else {"language": language}
        assert (plan_models(preset, "cuda", overrides).draft is not None) == drafts, language
    assert plan_models(preset, "cuda", {"language": "de", "draft": preset.draft}).draft == preset.draft
    (tmp_path / INFO_FILE).write_text(json.dumps({"train_meta": [{"language": "en"}, {"language": "de"}]}))
    assert trained_language(tmp_path) is None and trained_language(tmp_path / "absent") is None


def test_a_windows_later_passes_keep_its_first_passs_language():
    """With --temperature 0,0.2,0.4 a window's later passes took their file's group language as it stood when they
    were admitted: at batch 8 a French window's 0.2 pass came out German, at batch 1 French (a diff reviewer's)."""
    from asr_spec.transcribe.fallback import Fallback
    from asr_spec.transcribe.nospeech import NoSpeechRule

    tokens = Engine(_target(), None, DecodeOptions(max_new_tokens=4)).tokens
    german = tokens.lang_to_id["<|de|>"]
    fallback = Fallback(lambda window: (0.0, 0.2), NoSpeechRule(), lambda ids: "a b c", tokens.eot, 1, 0,
                        tokens.language_in)
    passes = fallback.run(iter([ChunkRequest("w", _features()[0], language_group="f")]))
    first = next(passes)
    assert first.language_token is None
    prompt = (tokens.sot, german, tokens.task_to_id["transcribe"])
    failing = ChunkResult(first.id, (tokens.eot,), prompt, "eos", ChunkStats(), no_speech_prob=0.0, avg_logprob=-5.0)
    assert fallback.resolve(failing) is None  # below the log-probability threshold: decoded again at 0.2
    second = next(passes)
    assert second.temperature == 0.2 and second.language_token == german and second.language_group == "f"


def test_a_drafts_language_is_compared_as_a_code(tmp_path):
    import json

    from asr_spec.models.drafts import INFO_FILE, trained_language

    (tmp_path / INFO_FILE).write_text(json.dumps({"train_meta": [{"language": "english"}, {"language": "en"}]}))
    assert trained_language(tmp_path) == "en"
