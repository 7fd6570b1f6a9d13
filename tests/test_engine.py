"""Invariant: speculative output == transformers' own greedy output of each row alone, token for token."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import first_divergence, hf_greedy, perturbed, tiny_target

from asr_spec.engine import DecodeOptions, Engine
from asr_spec.engine.capture import StepRunner
from asr_spec.engine.pairing import DraftKind, check_pair
from asr_spec.models.loading import decoder_draft
from asr_spec.testing import Shape, random_whisper

TIE = 1e-4
MAX_NEW = 40


@functools.cache
def drafts(name: str):
    t = _target()
    return {
        "none": lambda: None,
        "self-shared": lambda: decoder_draft(t),  # (a) the target itself: everything accepted
        # (a) with its own encoder, numerically different beyond fp16 rounding (so not shared)
        "self-own": lambda: perturbed(t, 1e-2, seed=1),
        "random-shared": lambda: decoder_draft(tiny_target(seed=7)),  # (b) unrelated: almost nothing accepted
        "random-own": lambda: tiny_target(seed=7),
        "perturbed-shared": lambda: decoder_draft(perturbed(t, 0.3, seed=3, encoder=False)),  # (c) partial
        "perturbed-own": lambda: perturbed(t, 0.3, seed=3),
    }[name]()


@functools.cache
def _target():
    return tiny_target()


@functools.cache
def _features():
    return torch.randn(10, 16, 100, generator=torch.Generator().manual_seed(0))


@functools.cache
def reference(row: int, timestamps: bool, max_new: int) -> tuple[int, ...]:
    return tuple(hf_greedy(_target(), _features()[row], language="en", task="transcribe", timestamps=timestamps,
                           max_new_tokens=max_new))


def assert_same_as_greedy(results, timestamps: bool, max_new: int) -> None:
    """Each row equals the reference, or first differs where the target's top-2 scores are a numerical tie."""
    for row, res in enumerate(results):
        ref = reference(row, timestamps, max_new)
        diverged = first_divergence(_target(), _features()[row], res.prompt + res.tokens, ref, len(res.prompt),
                                    timestamps)
        if diverged is not None:
            i, gap, _ = diverged
            assert abs(gap) < TIE, f"row {row}: diverges at token {i} without a tie (top-2 gap {gap:.2e})"


def run(draft_name: str, batch_size: int, timestamps: bool = False, max_new: int = MAX_NEW, **opts):
    # the target as its own draft must agree on every token: in fp32 (a bf16 copy disagrees at near-ties)
    opts.setdefault("draft_bf16", not draft_name.startswith("self"))
    options = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=max_new, **opts)
    return Engine(_target(), drafts(draft_name), options).decode(_features(), batch_size=batch_size)


ALL_DRAFTS = ["none", "self-shared", "self-own", "random-shared", "random-own", "perturbed-shared", "perturbed-own"]


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("draft_name", ALL_DRAFTS)
def test_speculative_equals_greedy(draft_name, batch_size):
    assert_same_as_greedy(run(draft_name, batch_size), False, MAX_NEW)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("draft_name", ALL_DRAFTS)
def test_speculative_equals_greedy_with_timestamps(draft_name, batch_size):
    results = run(draft_name, batch_size, timestamps=True)
    assert_same_as_greedy(results, True, MAX_NEW)
    ts_begin = _target().generation_config.no_timestamps_token_id + 1
    assert any(tok >= ts_begin for r in results for tok in r.tokens), "timestamp mode produced no timestamps"


def test_rows_end_differently():
    """The fixture really exercises per-row stopping: some rows end by EOS, some by the length limit."""
    results = run("none", 4)
    reasons = {r.finish_reason for r in results}
    assert reasons == {"eos", "length"}, reasons
    assert len({len(r.tokens) for r in results}) >= 3


@pytest.mark.parametrize("draft_name", ["self-shared", "perturbed-own"])
def test_max_new_tokens_inside_a_draft(draft_name):
    results = run(draft_name, 3, max_new=13, num_draft_tokens=8)
    assert_same_as_greedy(results, False, 13)
    assert all(len(r.tokens) <= 13 for r in results)


def test_eos_inside_accepted_draft():
    results = run("self-shared", 4, num_draft_tokens=8)
    assert_same_as_greedy(results, False, MAX_NEW)
    eos_rows = [r for r in results if r.finish_reason == "eos"]
    # with everything accepted, an EOS that is not a step's first token was inside an accepted draft
    assert any(r.stats.accepted_tokens > 0 and len(r.tokens) % 9 != 1 for r in eos_rows)
    for r in results:  # the histogram counts the proposals each pass committed, none matching past the EOS
        assert sum(j * n for j, n in enumerate(r.stats.accepted_hist)) == r.stats.accepted_tokens, r.id


def test_acceptance_statistics():
    perfect = run("self-shared", 4, num_draft_tokens=4)
    for r in perfect:
        assert r.stats.drafted_tokens - r.stats.accepted_tokens <= 4  # only the last step is cut by a limit
        assert r.stats.target_passes <= -(-r.stats.generated_tokens // 5) + 1
        assert sum(r.stats.accepted_hist) == r.stats.target_passes
    unrelated = run("random-shared", 4, num_draft_tokens=4)
    drafted = sum(r.stats.drafted_tokens for r in unrelated)
    accepted = sum(r.stats.accepted_tokens for r in unrelated)
    assert accepted / drafted < 0.2
    greedy = run("none", 4)
    assert all(r.stats.target_passes == r.stats.generated_tokens for r in greedy)


def test_continuous_batching_returns_every_chunk_once():
    engine = Engine(_target(), drafts("perturbed-shared"), DecodeOptions(language="en", max_new_tokens=MAX_NEW))
    from asr_spec.engine import ChunkRequest

    ids = [f"chunk-{i}" for i in range(10)]
    results = list(engine.run((ChunkRequest(i, f) for i, f in zip(ids, _features())), batch_size=3))
    assert sorted(r.id for r in results) == sorted(ids)
    by_id = {r.id: r for r in results}
    assert_same_as_greedy([by_id[i] for i in ids], False, MAX_NEW)


def test_language_detection_matches_transformers():
    t = _target()
    results = Engine(t, None, DecodeOptions(max_new_tokens=5)).decode(_features()[:4], batch_size=4)
    for row, r in enumerate(results):
        ref = hf_greedy(t, _features()[row], max_new_tokens=5)
        assert r.prompt[1] == ref[1]


def test_draft_kinds_detected():
    t = _target()
    assert check_pair(t, None) is DraftKind.NONE
    assert check_pair(t, decoder_draft(t, [0])) is DraftKind.SHARED_ENCODER
    assert check_pair(t, perturbed(t, 0.0)) is DraftKind.SHARED_ENCODER  # identical encoder: run once
    assert check_pair(t, perturbed(t, 0.1)) is DraftKind.OWN_ENCODER


def test_encoder_shared_up_to_fp16_rounding():
    """distil-whisper stores the teacher's encoder in fp16: equal up to that rounding means shared; a draft told
    to keep its own encoder (a preset's share_encoder = false) keeps it."""
    t = _target()
    rounded = perturbed(t, 0.0)
    with torch.no_grad():
        for p in rounded.model.encoder.parameters():
            p.copy_(p.half().float())
    assert not all(torch.equal(a, b) for a, b in zip(t.model.encoder.parameters(), rounded.model.encoder.parameters()))
    assert check_pair(t, rounded) is DraftKind.SHARED_ENCODER
    assert check_pair(t, perturbed(t, 1e-2)) is DraftKind.OWN_ENCODER
    rounded.own_encoder = True
    assert check_pair(t, rounded) is DraftKind.OWN_ENCODER


def test_incompatible_pairs_are_refused():
    t = _target()
    with pytest.raises(ValueError, match="vocab_size"):
        check_pair(t, random_whisper("test", vocab_size=80))
    wide = random_whisper(Shape(96, 1, 1, 4, n_mels=16, audio_ctx=50), vocab_size=70)
    with pytest.raises(ValueError, match="encoder"):
        check_pair(t, decoder_draft(wide))
    with pytest.raises(ValueError, match="batch_size"):
        Engine(t, None).decode(_features()[:1], batch_size=0)
    with pytest.raises(ValueError, match="max_target_positions"):
        Engine(t, None, DecodeOptions(language="en", max_new_tokens=446))
    with pytest.raises(ValueError, match="English-only"):
        Engine(tiny_target(multilingual=False), None, DecodeOptions(language="de"))
    with pytest.raises(ValueError, match="task 'translate' was given but the target model is English-only"):
        Engine(tiny_target(multilingual=False), None, DecodeOptions(task="translate"))  # it transcribed, silently


def test_english_only_model():
    t = tiny_target(multilingual=False)
    results = Engine(t, decoder_draft(t), DecodeOptions(max_new_tokens=20)).decode(_features()[:3], batch_size=3)
    english = Engine(t, None, DecodeOptions(language="english", max_new_tokens=20)).decode(_features()[:3],
                                                                                          batch_size=3)
    assert [r.tokens for r in english] == [r.tokens for r in results]
    for row, r in enumerate(results):
        assert r.prompt + r.tokens == tuple(hf_greedy(t, _features()[row], max_new_tokens=20))


def test_restricted_vocabulary_draft_is_lossless():
    draft = decoder_draft(_target(), [0])
    draft.draft_vocab_ids = torch.tensor(sorted(set(range(0, 70, 2)) | {40}))  # half the vocabulary + EOS
    results = Engine(_target(), draft, DecodeOptions(language="en", max_new_tokens=MAX_NEW)).decode(_features(),
                                                                                                  batch_size=4)
    assert_same_as_greedy(results, False, MAX_NEW)
    assert sum(r.stats.accepted_tokens for r in results) > 0


class CountingRunner(StepRunner):
    """The eager step, remembering the rows each step runs on (the live rows, packed into the first slots)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __call__(self, m, rules, st, k, n_keys, hyp=None):
        self.sizes.append(st.n_tok.shape[0])
        super().__call__(m, rules, st, k, n_keys, hyp)


def test_live_source_with_gaps_gives_the_same_results():
    """A source that yields None ("nothing right now") between chunks: the engine keeps decoding the busy rows,
    drops idle ones, grows back when chunks come, and every chunk decodes exactly as in one offline run."""
    from asr_spec.engine import ChunkRequest

    runner = CountingRunner()
    engine = Engine(_target(), drafts("perturbed-shared"), DecodeOptions(language="en", max_new_tokens=MAX_NEW),
                    runner=runner)
    offline = {r.id: r.tokens for r in engine.decode(_features(), batch_size=3)}
    runner.sizes.clear()
    offline = dict(enumerate(offline.values()))
    pattern = [0, None, None, 1, 2, 3, None, 4, None, None, None, None, None, None, None, None, 5, 6, 7, 8, 9]

    def live():
        for item in pattern:
            yield None if item is None else ChunkRequest(item, _features()[item])

    results = list(engine.run(live(), batch_size=3))
    assert sorted(r.id for r in results) == list(range(10))
    busy = runner.sizes
    assert min(busy) == 1 and any(b > a for a, b in zip(busy, busy[1:])), busy  # shrunk, then grown back
    assert {r.id: r.tokens for r in results} == offline


def test_engine_error_names_the_chunks_in_flight_and_a_new_run_carries_on(monkeypatch):
    from asr_spec.engine import ChunkRequest, EngineError

    engine = Engine(_target(), None, DecodeOptions(language="en", max_new_tokens=MAX_NEW))
    encode = engine.encoding.batch

    def failing(batch):  # the encoder raises on the "bad" chunk's micro-batch
        if any(req.id == "bad" for req in batch):
            raise RuntimeError("the encoder failed")
        return encode(batch)

    monkeypatch.setattr(engine.encoding, "batch", failing)
    items = [ChunkRequest("a", _features()[0]), None, ChunkRequest("bad", _features()[2]),
             ChunkRequest("b", _features()[1])]
    source = iter(items)
    done = []
    with pytest.raises(EngineError) as caught:
        for result in engine.run(source, batch_size=2):
            done.append(result.id)
    assert "bad" in caught.value.chunk_ids and not set(done) & set(caught.value.chunk_ids)
    assert set(done) | set(caught.value.chunk_ids) >= {"a", "bad"}
    rest = [r.id for r in engine.run(source, batch_size=2)]  # the same source, a fresh run
    assert set(done) | set(caught.value.chunk_ids) | set(rest) == {"a", "bad", "b"}


@pytest.mark.parametrize("timestamps", [False, True])
def test_draft_only_in_runs_of_few_rows(timestamps):
    """draft_max_rows: a run of more rows (batch slots) decodes greedily, the draft not even given the chunks; a
    run of at most that many drafts in every step. Greedy's tokens either way."""
    wide = run("perturbed-shared", 4, timestamps=timestamps, draft_max_rows=2)
    narrow = run("perturbed-shared", 2, timestamps=timestamps, draft_max_rows=2)
    greedy = run("none", 4, timestamps=timestamps)
    assert [r.tokens for r in wide] == [r.tokens for r in narrow] == [r.tokens for r in greedy]
    assert all(r.stats.draft_passes == 0 and r.stats.target_passes == r.stats.generated_tokens for r in wide)
    assert sum(r.stats.accepted_tokens for r in narrow) > 0
    few_chunks = Engine(_target(), drafts("perturbed-shared"), DecodeOptions(
        language="en", timestamps=timestamps, max_new_tokens=MAX_NEW, draft_max_rows=2)).decode(_features()[:2],
                                                                                                batch_size=8)
    assert all(r.stats.drafted_tokens > 0 for r in few_chunks)  # 2 chunks at batch 8: 2 slots, drafted
    with pytest.raises(ValueError, match="draft_max_rows must be an integer >= 1"):
        DecodeOptions(draft_max_rows=0)


def test_memory_is_checked_after_the_draft_decision(monkeypatch):
    """DecodeOptions.drafts is the one rule of draft_max_rows; the memory check asks it too: a run of more rows than
    that is not charged for the draft's caches, so it fits where a drafted run of as many rows would not."""
    from asr_spec.engine import ResourceError, memory

    opts = DecodeOptions(language="en", max_new_tokens=MAX_NEW, draft_max_rows=2)
    assert DecodeOptions().drafts(1000) and opts.drafts(2) and not opts.drafts(3)
    engine = Engine(_target(), drafts("perturbed-shared"), opts)
    greedy_run, drafted_run = engine.run_shape(4), engine.run_shape(2)
    assert greedy_run.draft is None and greedy_run.k_max == 0
    assert drafted_run.draft is not None and drafted_run.k_max == opts.num_draft_tokens
    need = memory.run_bytes(greedy_run, 4)
    assert need < memory.run_bytes(drafted_run, 4)
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(need / memory.USABLE_FRACTION) + 1)
    results = engine.decode(_features()[:4], batch_size=4)
    assert all(r.stats.draft_passes == 0 for r in results)
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(need / memory.USABLE_FRACTION) - 1)
    with pytest.raises(ResourceError, match="batch of 4 needs"):
        engine.decode(_features()[:4], batch_size=4)
    with pytest.raises(ValueError, match="certified_head must be true or false"):
        DecodeOptions(certified_head=1)


def test_a_kept_encoder_output_is_the_one_its_chunk_was_decoded_from():
    """ChunkRequest.keep_encoded: the result carries the target encoder output its chunk was decoded from (decoding
    that output again gives the same result; it equals the engine's encoding of the features); None when not
    asked."""
    from asr_spec.engine import ChunkRequest

    engine = Engine(_target(), drafts("perturbed-shared"), DecodeOptions(language="en", max_new_tokens=MAX_NEW))
    features = _features()
    requests = [ChunkRequest(i, features[i], keep_encoded=i % 2 == 0) for i in range(len(features))]
    results = sorted(engine.run(requests, batch_size=3), key=lambda r: r.id)
    assert all((r.encoded is None) == (r.id % 2 == 1) for r in results)
    kept = [r for r in results if r.encoded is not None]
    encoded = torch.stack([r.encoded for r in kept])
    assert encoded.shape == (len(kept), engine.n_audio_ctx, _target().config.d_model)
    torch.testing.assert_close(encoded, engine.encode(features[[r.id for r in kept]]), rtol=1e-5, atol=1e-5)
    again = engine.decode(None, encoded, batch_size=3)  # other batch compositions: rounding may move the floats
    assert [r.tokens for r in again] == [r.tokens for r in kept]
    for new, old in zip(again, kept, strict=True):
        assert new.avg_logprob == pytest.approx(old.avg_logprob, abs=1e-5)
        assert new.no_speech_prob == pytest.approx(old.no_speech_prob, abs=1e-6)


def test_a_warm_up_holds_its_rows_state_and_changes_no_result():
    # `asr-spec serve` warms its engine up before the first request (`Engine.warm_up`): the state of its rows is
    # then held (the runs of that many rows decode in it, not in a new one) and what it decodes is unchanged
    options = DecodeOptions(language="en", max_new_tokens=MAX_NEW)
    cold = Engine(_target(), drafts("perturbed-shared"), options)
    warm = Engine(_target(), drafts("perturbed-shared"), options)
    assert warm.states.held is None
    warm.warm_up(4)
    held = warm.states.held
    assert held is not None and held.n_rows == 4 and held.k == warm._k(4)
    expected = [r.tokens for r in cold.decode(_features()[:6], batch_size=4)]
    assert [r.tokens for r in warm.decode(_features()[:6], batch_size=4)] == expected
    assert warm.states.held is held  # its runs took the warmed state
