"""The feature-conditioned draft beside the step's other features: ragged prompts and prefixes in one admission,
sampled rows (temperature > 0) beside greedy ones, and hypothesis steps (a stream's re-decodes). Each stays exactly
what it is without the feature draft: greedy rows token for token the greedy output, sampled rows the tokens they
sample with no draft proposal (the feature draft has no q: it offers them none), and the draft is kept in step (a
draft that is the target itself is then always accepted)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_engine import MAX_NEW, _features, _target
from test_feature_draft import _teacher_forced_matches, drafts

from asr_spec.engine import ChunkRequest, DecodeOptions, Engine

N_CHUNKS = 10
PROMPT_LENGTHS = (0, 3, 17, 0, 40, 1, 9, 25, 0, 5)  # previous-text tokens per chunk: none to long, in one batch
PREFIXES = {2: (11, 12), 7: (5,), 8: (20, 21, 22)}  # forced starts of some transcripts


def _prompt(row: int) -> tuple[int, ...]:
    """Chunk `row`'s previous text: text token ids (3..39 of the 70-token test vocabulary), varied per chunk."""
    g = torch.Generator().manual_seed(100 + row)
    return tuple(torch.randint(3, 40, (PROMPT_LENGTHS[row],), generator=g).tolist())


def _prompted(prefixes: bool) -> list[ChunkRequest]:
    return [ChunkRequest(i, _features()[i], prompt=_prompt(i), prefix=PREFIXES.get(i, ()) if prefixes else ())
            for i in range(N_CHUNKS)]


def _run(draft, requests, batch_size: int, read_lag: int | None = None, **opts) -> dict:
    opts.setdefault("max_new_tokens", MAX_NEW)
    engine = Engine(_target(), draft, DecodeOptions(language="en", **opts))
    engine.read_lag = read_lag  # 1: the CUDA scheduling (the host reads a step late), on the CPU
    return {r.id: r for r in engine.run(requests, batch_size)}


@functools.cache
def _greedy_prompted(prefixes: bool, batch_size: int) -> dict:
    return {i: r.tokens for i, r in _run(None, _prompted(prefixes), batch_size).items()}


@pytest.mark.parametrize("read_lag", [None, 1])
@pytest.mark.parametrize("batch_size", [3, 8])
@pytest.mark.parametrize("name", ["reading", "self"])
def test_prompts_of_different_lengths_equal_greedy(name, batch_size, read_lag):
    """Rows with previous-text prompts of 0-40 tokens and prefixes admitted together: every row is the greedy
    engine's output, and the target-as-draft is still always accepted (its cache prefilled per row to its own
    length)."""
    results = _run(drafts(name), _prompted(True), batch_size, read_lag)
    assert {i: r.tokens for i, r in results.items()} == _greedy_prompted(True, batch_size)
    for i, r in results.items():
        assert r.prompt[1:len(_prompt(i)) + 1] == _prompt(i)  # the prompt really went in, after <|startofprev|>
        if name == "self":
            k = DecodeOptions().num_draft_tokens
            assert r.stats.drafted_tokens - r.stats.accepted_tokens <= k, i  # only the last step is cut by a limit


def test_ragged_admission_to_slots_apart_keeps_the_states_of_one_run_of_slots():
    """Two chunks with prompts of different lengths admitted to slots apart (0 and 3: caches and a feature store
    of their own, sized for the longer prompt, then copied in) get exactly the target's states, the draft's cache
    and lengths they get in one run of slots (1 and 2, written in place), at every position each row holds."""
    from asr_spec.engine.admission import RowPrompt

    engine = Engine(_target(), drafts("reading"), DecodeOptions(language="en"))
    audio = engine.encode(_features()[:2])
    prompts = [RowPrompt(previous=_prompt(2)), RowPrompt(previous=_prompt(5), prefix=(11, 12))]
    admitted = []
    for rows in ([1, 2], [0, 3]):
        state = engine._allocate(4, 3)
        m, st = state.m, state.st
        engine.admission(m, st, rows, audio, audio, prompts)
        admitted.append((rows, m, st))
    (run, a, sa), (apart, b, sb) = admitted
    lengths = sa.n_tok[run].tolist()
    assert lengths == sb.n_tok[apart].tolist() and lengths[0] != lengths[1]
    assert a.draft_cache.lengths[run].tolist() == b.draft_cache.lengths[apart].tolist() == [n - 1 for n in lengths]
    for (x, y), n in zip(zip(run, apart), lengths):
        held = n - 1  # positions of the row's prompt held (the step feeds its last token)
        torch.testing.assert_close(a.features.states[x, :held], b.features.states[y, :held], rtol=0, atol=0)
        assert bool(a.features.states[x, :held].abs().sum(-1).gt(0).all())  # every held position was written
        for name in ("self_k", "self_v"):
            torch.testing.assert_close(getattr(a.draft_cache, name)[:, x, :, :held],
                                       getattr(b.draft_cache, name)[:, y, :, :held], rtol=0, atol=0)


def test_proposals_on_prompted_rows_are_the_teacher_forced_ones_at_k1():
    """At K = 1 every proposal is made from the target's states (the catch-up): with previous-text prompts of
    different lengths in one admission, each chunk's accepted count is exactly what the training forward's
    teacher-forced proposals over its whole prompt give, so the target's states were kept at every row's own prompt
    positions and reached the draft there."""
    from asr_spec.distill.evaluation import simulate_steps

    draft = drafts("reading")
    results = _run(draft, _prompted(False), 3, num_draft_tokens=1)
    total = 0
    for row, r in results.items():
        matches = _teacher_forced_matches(draft, row, r.tokens, r.prompt)
        _, accepted = simulate_steps(matches, 1)
        assert r.stats.accepted_tokens == accepted, row
        total += accepted
    assert 0 < total < sum(len(r.tokens) for r in results.values())  # neither vacuous nor trivial


def _chunks(temps: dict[int, float]) -> list[ChunkRequest]:
    return [ChunkRequest(i, _features()[i], temperature=t, seed=1000 + i) for i, t in temps.items()]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_sampled_rows_sample_plainly_and_greedy_rows_stay_greedy(batch_size):
    """Greedy rows beside sampled rows: the greedy ones are the greedy output and drafted; the sampled ones are
    offered no proposal and give exactly the tokens they sample with no draft (K = 0, the same keys)."""
    temps = {i: 0.0 if i % 3 == 0 else 1.0 for i in range(N_CHUNKS)}
    mixed = _run(drafts("reading"), _chunks(temps), batch_size)
    no_draft = _run(None, _chunks(temps), batch_size)
    greedy = _run(None, _chunks({i: 0.0 for i in temps}), batch_size)
    for i, t in temps.items():
        if t == 0.0:
            assert mixed[i].tokens == greedy[i].tokens, i
            assert mixed[i].avg_logprob == pytest.approx(greedy[i].avg_logprob, abs=1e-5)
            assert mixed[i].stats.drafted_tokens > 0
        else:
            assert mixed[i].tokens == no_draft[i].tokens, i
            assert mixed[i].stats.drafted_tokens == 0 and mixed[i].stats.accepted_tokens == 0
    assert any(mixed[i].tokens != greedy[i].tokens for i, t in temps.items() if t > 0)  # really sampled


def _hypothesis(kind: str, tokens: tuple[int, ...], row: int) -> tuple[int, ...]:
    """A hypothesis of `kind` from a chunk's greedy tokens: its first 10 (then the draft goes on), all of them,
    one wrong after 6, random tokens, or none."""
    vocab = _target().config.vocab_size
    if kind == "start":
        return tokens[:10]
    if kind == "true":
        return tokens
    if kind == "perturbed":
        return tokens[:6] + ((tokens[6] + 1) % vocab,) + tokens[7:] if len(tokens) > 6 else tokens
    if kind == "wrong":
        return tuple(torch.randint(0, vocab, (30,), generator=torch.Generator().manual_seed(row)).tolist())
    return ()


HYP_KINDS = ("start", "true", "perturbed", "wrong", "none")


@functools.cache
def _greedy() -> dict:
    return {i: r.tokens for i, r in _run(None, _chunks({i: 0.0 for i in range(N_CHUNKS)}), 1).items()}


@pytest.mark.parametrize("width,k", [(8, 2), (3, 4)])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("name", ["reading", "self"])
def test_hypothesis_steps_equal_greedy_and_keep_the_draft_in_step(name, batch_size, width, k):
    """Rows with hypotheses of every kind beside rows without (hypothesis steps, window max(K, width) + 1): every
    row is the greedy output. A row accepting width + 1 tokens in one step leaves the feature draft that many
    behind; its widened catch-up (max(K, width) + 1) feeds them all, so the target-as-draft is always accepted
    after its hypothesis ends or is dropped (a catch-up of K + 1 would leave stale entries: rejections)."""
    greedy = _greedy()
    requests = [ChunkRequest(i, _features()[i], hypothesis=_hypothesis(HYP_KINDS[i % len(HYP_KINDS)], greedy[i], i))
                for i in range(N_CHUNKS)]
    results = _run(drafts(name), requests, batch_size, num_draft_tokens=k, num_hypothesis_tokens=width)
    assert {i: r.tokens for i, r in results.items()} == greedy
    assert sum(r.stats.hypothesis_accepted for r in results.values()) > 0
    if name == "self":
        for i, r in results.items():
            assert r.stats.drafted_tokens - r.stats.accepted_tokens <= k, i  # only the last step is cut by a limit
        assert sum(r.stats.accepted_tokens for r in results.values()) > 0


@pytest.mark.parametrize("name", ["reading", "self"])
def test_a_hypothesis_rows_freed_slot_in_a_graphs_row_bucket_with_the_feature_draft(name):
    """As tests/test_hints.py's test of it with a model draft: the feature draft's window is K + 1 in a plain step
    and max(K, width) + 1 in a hypothesis step, so the slot of a row that took 8 hypothesis tokens a step and
    finished is computed (a CUDA graph's row bucket) with an index past the plain window: clamped."""
    from test_hints import BucketRunner

    greedy = _greedy()
    requests = [ChunkRequest(i, _features()[i], hypothesis=greedy[i] if i == 3 else ()) for i in range(4)]
    engine = Engine(_target(), drafts(name), DecodeOptions(language="en", max_new_tokens=MAX_NEW, num_draft_tokens=2,
                                                           num_hypothesis_tokens=8), runner=BucketRunner())
    results = {r.id: r.tokens for r in engine.run(requests, 4)}
    assert results == {i: greedy[i] for i in range(4)}


def test_a_sampled_hypothesis_step_with_the_feature_draft_has_no_graph_break():
    """The step with a feature-conditioned draft, sampled rows and hypothesis rows at once (the widest combination
    a server runs) still traces into one graph: what CUDA graphs capture per (rows, n_keys, K, sampling, width)."""
    from asr_spec.engine.capture import StepRunner
    from asr_spec.engine.speculative import step

    engine = Engine(_target(), drafts("reading"), DecodeOptions(language="en", max_new_tokens=8,
                                                                num_hypothesis_tokens=5))
    captured = {}

    def grab(*args):
        if len(args) > 5 and args[1].sampling:
            captured["args"] = args
        step(*args)

    engine.runner = StepRunner("wrapped", lambda fn: grab)
    greedy = _greedy()
    requests = [ChunkRequest(0, _features()[0], hypothesis=greedy[0][:4]),
                ChunkRequest(1, _features()[1], temperature=0.7, seed=3), ChunkRequest(2, _features()[2])]
    list(engine.run(requests, 3))
    assert "args" in captured
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(step)(*captured["args"])
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
