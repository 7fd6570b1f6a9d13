"""Reference check: our vectorised Whisper rules == transformers' logits processors, position by position."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_target
from transformers.generation.logits_process import (
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    WhisperTimeStampLogitsProcessor,
)

from asr_spec.engine.rules import LogitRules, WhisperTokens


def hf_chain(gen, begin: int, timestamps: bool):
    procs = [SuppressTokensAtBeginLogitsProcessor(gen.begin_suppress_tokens, begin),
             SuppressTokensLogitsProcessor(gen.suppress_tokens)]
    if timestamps:
        procs.append(WhisperTimeStampLogitsProcessor(gen, begin_index=begin))
    return procs


def random_histories(gen_cfg, n_rows: int, n_len: int, seed: int, vocab: int) -> torch.Tensor:
    """Histories rich in timestamp tokens: pairs, singles, repeats, decreasing ones."""
    g = torch.Generator().manual_seed(seed)
    ts = gen_cfg.no_timestamps_token_id + 1
    text = torch.randint(0, ts - 30, (n_rows, n_len), generator=g)
    stamps = torch.randint(ts, vocab, (n_rows, n_len), generator=g)
    pick = torch.rand(n_rows, n_len, generator=g) < 0.4
    return torch.where(pick, stamps, text)


def rule_case(timestamps: bool, seed: int, n_rows: int, dtype: torch.dtype):
    """(generation config, tokens, rules, (n_rows, 3 + 9) histories after a 3-token prompt, (n_rows, 9, V) logits
    in `dtype`) of the tiny target, the logits scaled so that Whisper's rules take every branch somewhere."""
    model = tiny_target()
    gen = model.generation_config
    vocab = model.config.vocab_size
    tokens = WhisperTokens.from_generation_config(gen, 448)
    rules = LogitRules(tokens, vocab, timestamps, torch.device("cpu"))
    begin, n_hist, n_pos = 3, 3, 9
    seq = random_histories(gen, n_rows, n_hist + n_pos, seed, vocab)
    seq[:, :begin] = torch.tensor(tokens.prompt(tokens.lang_to_id["<|en|>"], "transcribe", timestamps)[:begin])
    g = torch.Generator().manual_seed(100 + seed)
    logits = (torch.randn(n_rows, n_pos, vocab, generator=g) * 3).to(dtype)
    return gen, tokens, rules, seq, logits


@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_rules_match_transformers_processors(timestamps, seed):
    gen, tokens, rules, seq, logits = rule_case(timestamps, seed, 6, torch.float32)
    begin, n_hist, (n_rows, n_pos) = 3, 3, logits.shape[:2]
    # make the "timestamps win on total probability" branch fire on some positions
    logits[:, ::2, tokens.timestamp_begin:] += 2.5
    ours = rules.apply(logits, seq, torch.full((n_rows,), n_hist), torch.full((n_rows,), begin))
    for j in range(n_pos):
        input_ids = seq[:, : n_hist + j]
        ref = logits[:, j].clone()
        for proc in hf_chain(gen, begin, timestamps):
            ref = proc(input_ids, ref)
        assert torch.equal(torch.isinf(ours[:, j]), torch.isinf(ref)), f"masks differ at position {j}"
        finite = ~torch.isinf(ref)
        torch.testing.assert_close(ours[:, j][finite], ref[finite].float())


def test_rules_at_the_first_generated_position():
    model = tiny_target()
    gen = model.generation_config
    tokens = WhisperTokens.from_generation_config(gen, 448)
    rules = LogitRules(tokens, model.config.vocab_size, True, torch.device("cpu"))
    seq = torch.tensor([tokens.prompt(tokens.lang_to_id["<|en|>"], "transcribe", True)])
    logits = torch.zeros(1, 1, model.config.vocab_size)
    out = rules.apply(logits, seq, torch.tensor([3]), torch.tensor([3]))[0, 0]
    allowed = (~torch.isinf(out)).nonzero().flatten().tolist()
    first_ts = tokens.timestamp_begin
    assert allowed == list(range(first_ts, first_ts + gen.max_initial_timestamp_index + 1))


@pytest.mark.parametrize("seed", range(3))
def test_a_restricted_drafts_choice_is_the_whole_vocabularys(seed):
    """`draft_choice` over a restricted draft's own logits proposes the token it proposes over the whole vocabulary
    with -inf outside the draft's ids (what the step scored before): the static bias, begin-suppress at a row's
    first position (a begin-suppressed id the draft scores, and one it does not), and argmax's lowest-id tie rule."""
    model = tiny_target()
    gen = model.generation_config
    vocab = model.config.vocab_size
    tokens = WhisperTokens.from_generation_config(gen, 448)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=g)[: vocab // 3]
    keep = torch.tensor([*gen.suppress_tokens[:3], gen.begin_suppress_tokens[0], 11, 12, 13])
    ids = torch.unique(torch.cat([ids[~torch.isin(ids, torch.tensor(gen.begin_suppress_tokens[1:]))], keep]))
    whole = LogitRules(tokens, vocab, True, torch.device("cpu"))
    restricted = LogitRules(tokens, vocab, True, torch.device("cpu"), draft_vocab=ids)
    assert restricted.draft_vocab is not None
    n_rows = 6
    logits = (torch.randn(n_rows, 1, len(ids), generator=g) * 3).to(torch.bfloat16)
    col = {int(t): i for i, t in enumerate(ids)}
    logits[0, 0, col[gen.begin_suppress_tokens[0]]] = 50.0  # the best, unless begin-suppressed
    logits[1, 0, col[12]] = logits[1, 0, col[13]] = logits[1, 0, col[11]] = 60.0  # a three-way tie
    logits[2, 0, col[int(gen.suppress_tokens[0])]] = 70.0  # suppressed: never proposed
    n_hist = torch.tensor([3, 4, 3, 3, 5, 3])
    begin = torch.tensor([3, 3, 3, 4, 3, 2])
    full = torch.full((n_rows, 1, vocab), float("-inf"), dtype=logits.dtype).index_copy_(-1, ids, logits)
    ours = restricted.draft_choice(logits, n_hist, begin)
    assert torch.equal(ours, whole.draft_choice(full, n_hist, begin))
    assert int(ours[1]) == 11 and int(ours[2]) != int(gen.suppress_tokens[0])
    assert int(ours[0]) != gen.begin_suppress_tokens[0]  # row 0 is at its first position


def test_draft_ids_not_ascending_are_chosen_over_the_whole_vocabulary():
    model = tiny_target()
    tokens = WhisperTokens.from_generation_config(model.generation_config, 448)
    rules = LogitRules(tokens, model.config.vocab_size, False, torch.device("cpu"), draft_vocab=torch.tensor([5, 3, 9]))
    assert rules.draft_vocab is None


@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_takes_the_argmax_and_log_probability_of_the_applied_scores(timestamps, seed):
    """`greedy` (no text mask written) == `apply`'s scores' first maximum, token for token, and its score less
    their logsumexp, within float rounding: over histories rich in timestamps (every cut: none, below
    <|endoftext|>, all text), the first position, and exact ties between a text token and a timestamp."""
    gen, tokens, rules, seq, logits = rule_case(timestamps, 100 + seed, 8, torch.bfloat16)
    begin, n_rows, n_hist = 3, logits.shape[0], 3
    logits[:, ::2, tokens.timestamp_begin:] += 2.5
    ts = tokens.timestamp_begin
    logits[:2, :, 20] = logits[:2, :, ts + 1] = 40.0  # a tie: the text token is the first maximum
    logits[2:4, :, tokens.eot] = logits[2:4, :, ts + 3] = 40.0  # a tie past a lone timestamp's cut
    n_hist_rows = torch.full((n_rows,), n_hist)
    begins = torch.tensor([begin] * (n_rows - 1) + [n_hist])  # the last row starts here: its first position
    scores = rules.apply(logits, seq, n_hist_rows, begins)
    choice, logprob = rules.greedy(logits, seq, n_hist_rows, begins)
    assert torch.equal(choice, scores.max(-1).indices)
    ref = scores.gather(-1, choice[..., None])[..., 0] - scores.logsumexp(-1)
    torch.testing.assert_close(logprob, ref, rtol=1e-5, atol=1e-5)
    if timestamps:  # the cases above were met: text and timestamp choices, and a cut of all text somewhere
        assert bool((choice >= ts).any()) and bool((choice < ts).any())
        assert bool(torch.isinf(scores[..., :ts]).all(-1).any())


def test_logsumexp_given_its_maximum_is_torchs():
    from asr_spec.engine.rules import _logsumexp

    x = torch.randn(3, 4, 1000) * 5
    x[0, 1] = float("-inf")  # every value forbidden: -inf, as torch.logsumexp
    x[1, 2, 7:] = float("-inf")
    ours = _logsumexp(x.clone(), x.max(-1).values)
    torch.testing.assert_close(ours, x.logsumexp(-1), rtol=1e-6, atol=1e-6)
    assert ours[0, 1] == float("-inf")



def given_prefix_scores(gen, begin: int, ids: torch.Tensor, logits: torch.Tensor, first: bool,
                        timestamps: bool) -> torch.Tensor:
    """transformers' processors from `begin` on (1, V) `logits` after the (1, L) history `ids`, a given prefix
    counted as generated; at the first position after it (`first`) the timestamps' total probability is weighed
    against the text tokens' total (not their best one): the text is cut only where the timestamps' total wins."""
    ref = logits.clone()
    for proc in hf_chain(gen, begin, timestamps):
        ref = proc(ids, ref)
    if first and timestamps:
        ts = gen.no_timestamps_token_id + 1
        base = logits.clone()
        for proc in hf_chain(gen, begin, False):
            base = proc(ids, base)
        no_ts = gen.no_timestamps_token_id  # suppressed in timestamp mode: below it, undo the cut of the text
        ref[:, :no_ts] = base[:, :no_ts]
        logprobs = ref.float().log_softmax(-1)
        if logprobs[:, ts:].logsumexp(-1) > logprobs[:, :ts].logsumexp(-1):
            ref[:, :ts] = float("-inf")
    return ref


@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_after_a_given_prefix_the_totals_decide_a_timestamp(timestamps, seed):
    """`given` tokens after `begin` (a user's prefix and its <|0.00|>) count as generated, but at the first position
    after them timestamps are forced only where their total probability beats the text tokens' total: the other
    positions and the rows without a given prefix keep transformers' rules; `greedy` takes `apply`'s argmax."""
    gen, tokens, rules, seq, logits = rule_case(timestamps, 200 + seed, 8, torch.float32)
    begin, n_pos, n_rows = 3, logits.shape[1], logits.shape[0]
    ts = tokens.timestamp_begin
    given = torch.tensor([0, 2, 2, 4, 0, 3, 2, 2])  # <|0.00|> and at least one token of text
    start = begin + given
    # histories of begin + 4 + n_pos tokens (the rows start at most 4 tokens past begin): <|0.00|> then text
    seq = torch.cat([seq, random_histories(gen, n_rows, 4, 300 + seed, logits.shape[-1])], 1)
    for row in range(n_rows):
        if int(given[row]) and timestamps:
            seq[row, begin] = ts
            seq[row, begin + 1:int(start[row])] = torch.arange(3, 2 + int(given[row])) + row
    n_hist = torch.where(torch.arange(n_rows) % 2 == 0, start, begin + 4)  # half at their first position
    # at the first positions: timestamps whose best beats no text token, their total beating the best text token
    # (rows 0, 2) or the text's total too (rows 4, 6)
    logits[::2, 0, ts:] = 0.0
    logits[::2, 0, :ts] = -0.5
    logits[4::2, 0, :ts] = -8.0
    ours = rules.apply(logits, seq, n_hist, torch.full((n_rows,), begin), given)
    for row in range(n_rows):
        for j in range(n_pos):
            cur = int(n_hist[row]) + j
            first = cur == int(start[row]) and int(given[row]) > 0
            ref = given_prefix_scores(gen, begin, seq[row:row + 1, :cur], logits[row:row + 1, j], first, timestamps)
            assert torch.equal(torch.isinf(ours[row, j]), torch.isinf(ref[0])), f"row {row}, position {j}"
    if timestamps:  # not vacuous: the totals kept the text where the best text token would have cut it, and cut it
        assert not bool(torch.isinf(ours[2, 0, :ts]).all()) and bool(torch.isinf(ours[6, 0, :ts]).all())
    choice, _ = rules.greedy(logits, seq, n_hist, torch.full((n_rows,), begin), given)
    assert torch.equal(choice, ours.max(-1).indices)
