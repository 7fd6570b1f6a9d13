"""Prompts in the engine: rows with previous-text prompts of different lengths (and prefixes) in one batch stay
token-identical to transformers' `generate(prompt_ids=...)` of each row alone, with or without a draft."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from conftest import first_divergence, perturbed, tiny_target
from test_rules import given_prefix_scores

from asr_spec.engine import ChunkRequest, DecodeOptions, Engine
from asr_spec.engine.rules import WhisperTokens
from asr_spec.models.loading import decoder_draft

TIE = 1e-4
MAX_NEW = 30
N_ROWS = 8
# previous-text prompt lengths of the rows: none, short, long, the model's limit (448 // 2 - 1 = 223)
PROMPT_LENGTHS = (0, 3, 17, 0, 60, 1, 223, 9)


@functools.cache
def _target():
    return tiny_target()


@functools.cache
def _features():
    return torch.randn(N_ROWS, 16, 100, generator=torch.Generator().manual_seed(5))


def _prompt(row: int) -> tuple[int, ...]:
    """Row `row`'s previous text: text token ids (3..39 of the 70-token test vocabulary), varied per row."""
    g = torch.Generator().manual_seed(100 + row)
    return tuple(torch.randint(3, 40, (PROMPT_LENGTHS[row],), generator=g).tolist())


@functools.cache
def _reference(row: int, timestamps: bool) -> tuple[int, ...]:
    """transformers' greedy decoding of row `row` alone with its prompt as `prompt_ids` (prompt + generated)."""
    model = _target()
    kwargs = dict(language="en", task="transcribe", return_timestamps=timestamps, max_new_tokens=MAX_NEW,
                  force_unique_generate_call=True, return_dict_in_generate=True)
    if _prompt(row):
        kwargs["prompt_ids"] = torch.tensor([model.generation_config.prev_sot_token_id, *_prompt(row)])
    return tuple(model.generate(_features()[row][None], **kwargs).sequences[0].tolist())


def _run(draft, timestamps: bool, batch_size: int, prefixes=None, max_new: int | None = MAX_NEW,
         read_lag: int | None = None, row_max_new=None, given: bool = False):
    options = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=max_new, draft_bf16=False)
    reqs = [ChunkRequest(i, _features()[i], prompt=_prompt(i), prefix=() if prefixes is None else prefixes[i],
                         prefix_given=given, max_new_tokens=None if row_max_new is None else row_max_new[i])
            for i in range(N_ROWS)]
    engine = Engine(_target(), draft, options)
    engine.read_lag = read_lag  # 1: the CUDA scheduling (the host reads a step late), on the CPU
    results = {r.id: r for r in engine.run(reqs, batch_size)}
    return [results[i] for i in range(N_ROWS)]


def _assert_reference(results, timestamps: bool) -> None:
    """Each row equals transformers' output, or first differs at a checked top-2 tie."""
    for row, res in enumerate(results):
        ref = _reference(row, timestamps)
        ours = res.prompt + res.tokens
        assert ours[:len(res.prompt)] == ref[:len(res.prompt)], f"row {row}: prompts differ"
        diverged = first_divergence(_target(), _features()[row], ours, ref, len(res.prompt), timestamps)
        if diverged is not None:
            i, gap, _ = diverged
            assert abs(gap) < TIE, f"row {row}: diverges at token {i} without a tie (top-2 gap {gap:.2e})"


@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("batch_size", [3, 8])
def test_prompts_of_different_lengths_share_a_batch(timestamps, batch_size):
    results = _run(None, timestamps, batch_size)
    for row, res in enumerate(results):  # the prompt really went in, after <|startofprev|>
        prev = (_target().generation_config.prev_sot_token_id, *_prompt(row)) if _prompt(row) else ()
        assert res.prompt[:len(prev)] == prev
    _assert_reference(results, timestamps)


def test_a_long_prompt_refilled_while_the_host_reads_a_step_late():
    """CUDA's scheduling: a row admitted after the step the host last read has a prompt that read did not see;
    the keys each step attends to must still cover it (here a 223-token prompt refills a slot of a run whose
    other rows are short)."""
    results = _run(None, False, 3, read_lag=1)
    assert len(_prompt(6)) == 223 and results[6].prompt[0] == _target().generation_config.prev_sot_token_id
    _assert_reference(results, False)


@pytest.mark.parametrize("draft_name", ["self", "perturbed"])
def test_speculative_equals_greedy_with_prompts(draft_name):
    t = _target()
    draft = decoder_draft(t) if draft_name == "self" else decoder_draft(perturbed(t, 0.3, seed=3, encoder=False))
    results = _run(draft, True, 4)
    if draft_name == "self":  # the target as its own draft: proposals really were offered and accepted
        assert sum(r.stats.accepted_tokens for r in results) > 0
    _assert_reference(results, True)
    greedy = _run(None, True, 4)
    assert [r.tokens for r in results] == [r.tokens for r in greedy]


def test_no_speech_prob_is_read_at_the_moved_sot_position():
    """With previous text, <|startoftranscript|> is no longer at position 0: the probability is transformers'
    softmax of the raw logits at that position of the prompted input."""
    model = _target()
    results = _run(None, False, 8)
    for row in (2, 6):  # prompts of 17 and 223 tokens
        ids = torch.tensor([results[row].prompt])
        sot_at = len(_prompt(row)) + 1
        with torch.no_grad():
            logits = model(input_features=_features()[row][None], decoder_input_ids=ids).logits[0, sot_at]
        expected = logits.float().softmax(-1)[model.generation_config.no_timestamps_token_id - 1].item()
        assert results[row].no_speech_prob == pytest.approx(expected, rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("timestamps", [False, True])
def test_a_prefix_that_greedy_would_emit_changes_nothing(timestamps):
    """A prefix counts as generated for Whisper's rules, so forcing the first tokens greedy emits anyway gives
    greedy's output, token for token; the prefix is part of the result's tokens, not of its decoded count
    (max_new_tokens counts decoded tokens too, so both runs go to the model's 448 positions)."""
    plain = _run(None, timestamps, 8, max_new=None)
    n_forced = [min(3, len(r.tokens) - 1) for r in plain]
    # in timestamp mode the engine writes <|0.00|> itself: force only rows whose greedy output starts with it
    ts0 = _target().generation_config.no_timestamps_token_id + 1
    prefixes = []
    for r, n in zip(plain, n_forced):
        if timestamps and r.tokens[0] != ts0:
            prefixes.append(())
        else:
            prefixes.append(tuple(r.tokens[int(timestamps):n]))
    assert sum(bool(p) for p in prefixes) >= 2  # not vacuous
    forced = _run(None, timestamps, 8, prefixes, max_new=None)
    assert [r.tokens for r in forced] == [r.tokens for r in plain]
    for p, f, r in zip(prefixes, forced, plain):
        n_stamp = 1 if timestamps and p else 0
        assert f.stats.generated_tokens == r.stats.generated_tokens - len(p) - n_stamp


def test_any_prefix_starts_the_transcript_and_speculation_keeps_it():
    prefixes = [(), (5,), (20, 21, 22), (), (9, 9), (30,), (11, 12), ()]
    greedy = _run(None, True, 8, prefixes)
    ts0 = _target().generation_config.no_timestamps_token_id + 1
    for p, r in zip(prefixes, greedy):
        if p:
            assert r.tokens[:len(p) + 1] == (ts0, *p)
    spec = _run(decoder_draft(perturbed(_target(), 0.3, seed=3, encoder=False)), True, 8, prefixes)
    assert [r.tokens for r in spec] == [r.tokens for r in greedy]


def _given_reference(row: int, prefix: tuple[int, ...], timestamps: bool) -> tuple[list[int], list[float]]:
    """Row `row` alone after a given prefix, decoded greedily by transformers' model and processors, the totals
    deciding a timestamp at the first position after the prefix (tests/test_rules.py's `given_prefix_scores`):
    (prompt + <|0.00|> + prefix + generated, the top-2 gap of the scores at each generated token)."""
    model, gen = _target(), _target().generation_config
    tokens = WhisperTokens.from_generation_config(gen, 448)
    previous = [gen.prev_sot_token_id, *_prompt(row)] if _prompt(row) else []
    seq = previous + tokens.prompt(tokens.lang_to_id["<|en|>"], "transcribe", timestamps)
    begin = len(seq)
    seq += ([tokens.timestamp_begin] if timestamps and prefix else []) + list(prefix)
    start, gaps = len(seq), []
    with torch.no_grad():
        encoded = model.model.encoder(_features()[row][None]).last_hidden_state
        for _ in range(MAX_NEW):
            ids = torch.tensor([seq])
            scores = model(encoder_outputs=(encoded,), decoder_input_ids=ids).logits[:, -1].float()
            scores = given_prefix_scores(gen, begin, ids, scores, len(seq) == start and bool(prefix), timestamps)
            top2 = scores[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            seq.append(int(scores[0].argmax()))
            if seq[-1] == tokens.eot:
                break
    return seq, gaps


@pytest.mark.parametrize("timestamps", [False, True])
def test_a_given_prefix_decodes_on_as_transformers_with_the_totals_rule(timestamps):
    """`prefix_given` (a user's --prefix): the rows decode on after their prefixes as transformers' model and
    processors do, the prefix counted as generated but the totals deciding a timestamp at the first position after
    it, at batch 8 with a draft as greedy at batch 3."""
    prefixes = [(), (5,), (20, 21, 22), (), (9, 9), (30,), (11, 12), (7, 8, 9, 10)]
    greedy = _run(None, timestamps, 3, prefixes, given=True)
    spec = _run(decoder_draft(perturbed(_target(), 0.3, seed=3, encoder=False)), timestamps, 8, prefixes, given=True)
    assert [r.tokens for r in spec] == [r.tokens for r in greedy]
    for row, (p, res) in enumerate(zip(prefixes, greedy)):
        ref, gaps = _given_reference(row, p, timestamps)
        ours = list(res.prompt + res.tokens)
        n_start = len(ref) - len(gaps)
        assert ours[:n_start] == ref[:n_start], f"row {row}: prompt and prefix differ"
        i = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if i is None:
            assert len(ours) == len(ref), f"row {row}: lengths differ"
        else:
            assert gaps[i - n_start] < TIE, f"row {row}: diverges at token {i} without a tie"


@pytest.mark.parametrize("batch_size", [3, 8])
def test_a_rows_own_token_limit_cuts_its_decoding_and_nothing_else(batch_size):
    """`ChunkRequest.max_new_tokens`: a row generates at most that many tokens after its prompt and prefix (the
    options' limit still holds over a larger one), its tokens the first ones of its decoding without a limit; the
    other rows of its batch are untouched, greedy or speculative, whatever the batch size."""
    prefixes = [(), (5,), (20, 21, 22), (), (9, 9), (30,), (), ()]
    caps = [None, 1, 5, 12, None, MAX_NEW + 10, 3, 7]
    free = _run(None, True, 8, prefixes)
    assert sum(len(r.tokens) > 8 for r in free) >= 4  # rows long enough for the caps to cut
    draft = decoder_draft(perturbed(_target(), 0.3, seed=3, encoder=False))
    for run_draft in (None, draft):
        cut = _run(run_draft, True, batch_size, prefixes, row_max_new=caps)
        for p, cap, c, f in zip(prefixes, caps, cut, free):
            forced = 1 + len(p) if p else 0  # <|0.00|> and the prefix (without one <|0.00|> is generated)
            expected = f.tokens if cap is None else f.tokens[:forced + cap]
            assert c.tokens == expected
            assert c.finish_reason == (f.finish_reason if expected == f.tokens else "length")
    with pytest.raises(ValueError, match="max_new_tokens must be None or an integer >= 1, got 0"):
        ChunkRequest("x", _features()[0], max_new_tokens=0)


def test_a_prompt_over_the_limit_is_refused_naming_the_chunk():
    engine = Engine(_target(), None, DecodeOptions(language="en", max_new_tokens=5))
    def refusal(req: ChunkRequest) -> str:
        [result] = engine.run([req])  # refused alone, as its result (engine/refusals.py)
        assert result.finish_reason == "refused" and result.tokens == ()
        return result.error

    too_long = ChunkRequest("talk.wav#0", _features()[0], prompt=(5,) * 224)
    assert re.search(r"'talk.wav#0'.*prompt of 224 tokens, more than the model's 223", refusal(too_long))
    assert "prefix holds a value that is not a token id" in refusal(ChunkRequest("x", _features()[0], prefix=(5, 70)))
    # a forced <|endoftext|> decoded on past it to 448 positions, its text after the end
    eot = engine.tokens.eot
    for field in ("prefix", "prompt"):
        error = refusal(ChunkRequest("x", _features()[0], **{field: (5, eot)}))
        assert re.search(f"'x'.*{field} holds <.endoftext.> \\({eot}\\)", error)


def test_a_request_is_checked_when_made_and_takes_numpy_token_ids():
    """numpy integers were "not a token id"; a numpy array or a 3-D tensor as features failed inside the batch's
    stack, taking every chunk in flight with it."""
    import numpy as np

    features = _features()[0]
    request = ChunkRequest("x", features, prefix=(np.int64(5),), prompt=[np.int32(6), 7], hypothesis=np.array([3]))
    assert request.prefix == (5,) and request.prompt == (6, 7) and request.hypothesis == (3,)
    assert all(type(t) is int for t in request.prefix + request.prompt + request.hypothesis)
    wrong = ((features.numpy(), "ndarray"), (features[None], "a 3-D"), (features.long(), "a 2-D torch.int64"))
    for bad, shown in wrong:
        with pytest.raises(ValueError, match=f"chunk 'x': features must be a 2-D floating torch tensor, got {shown}"):
            ChunkRequest("x", bad)
    with pytest.raises(ValueError, match="chunk 'x': encoded must be a 2-D floating"):
        ChunkRequest("x", None, encoded=torch.zeros(3))
    with pytest.raises(ValueError, match=r"chunk 'x': prefix must hold token ids \(integers >= 0\)"):
        ChunkRequest("x", features, prefix=(5, 1.5))


def test_language_detection_with_prompts_matches_transformers():
    """Detection reads <|startoftranscript|> alone, then the rows are prefilled with their prompts from position 0
    (the detection pass's key/values at position 0 are not the prompt's)."""
    model = _target()
    reqs = [ChunkRequest(i, _features()[i], prompt=_prompt(i)) for i in range(N_ROWS)]
    results = {r.id: r for r in Engine(model, None, DecodeOptions(max_new_tokens=5)).run(reqs, 8)}
    for row in range(N_ROWS):
        kwargs = dict(max_new_tokens=5, force_unique_generate_call=True, return_dict_in_generate=True)
        if _prompt(row):
            kwargs["prompt_ids"] = torch.tensor([model.generation_config.prev_sot_token_id, *_prompt(row)])
        ref = model.generate(_features()[row][None], **kwargs).sequences[0].tolist()
        at = len(_prompt(row)) + 2 if _prompt(row) else 1  # the language token, after <|startoftranscript|>
        sot = model.generation_config.decoder_start_token_id
        assert results[row].prompt[at] == ref[at] and results[row].prompt[at - 1] == sot
