"""The decoding rules' row reductions in the CPU kernel extension (`cpu_reduce.h`, `rules._max_logsumexp`): each
row's maximum and first index exactly as torch's max(-1), its logsumexp within fp32 rounding, rows read in place
from wider scores, a row of -inf as torch gives it, each row the same bits whatever the rows beside it, and the
rules' greedy choice and log-probability through them against torch's own reductions."""

from __future__ import annotations

import pytest
import torch

from asr_spec.engine import cpu_attention, rules


def reduce_rows(x: torch.Tensor, with_logsumexp: bool = True):
    return cpu_attention.extension().max_logsumexp(x, with_logsumexp)


@pytest.mark.parametrize("n", [1, 7, 16, 17, 50364, 51865])
def test_max_first_index_and_logsumexp_agree_with_torch(kernel, n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=gen) * 4
    x[1] = float("-inf")
    x[1, n // 2] = 3.0  # one finite score among -inf
    x[2, :] = x[2].max()  # every column tied: the first index
    x[3, n - 1] = 100.0  # the largest in the last (partial) block
    values, indices, sums = reduce_rows(x)
    best = x.max(-1)
    assert torch.equal(values, best.values) and torch.equal(indices, best.indices)
    torch.testing.assert_close(sums, torch.logsumexp(x, -1), rtol=2e-6, atol=2e-6)
    assert torch.equal(reduce_rows(x, False)[2], torch.zeros(5))


def test_ties_take_the_first_index_and_a_row_of_minus_inf_gives_what_torch_gives(kernel):
    x = torch.full((3, 40), float("-inf"))
    x[1, [5, 21, 39]] = 2.0
    x[2, 33] = 0.5
    values, indices, sums = reduce_rows(x)
    assert values.tolist() == [float("-inf"), 2.0, 0.5] and indices.tolist() == [0, 5, 33]
    assert sums[0] == float("-inf") and torch.equal(indices, x.max(-1).indices)
    torch.testing.assert_close(sums[1:], torch.logsumexp(x[1:], -1))


def test_a_row_holding_nan_gives_what_torch_gives(kernel):
    """A step on scratch memory (a capture ahead of the first chunk) may see NaN: its first index, as torch's max."""
    x = torch.randn(3, 100)
    x[0, 37] = float("nan")
    x[0, 90] = float("nan")
    x[1, 99] = float("nan")
    values, indices, sums = reduce_rows(x)
    best = x.max(-1)
    assert indices.tolist() == best.indices.tolist() == [37, 99, int(x[2].argmax())]
    assert values[:2].isnan().all() and sums[:2].isnan().all() and values[2] == best.values[2]


def test_rows_apart_are_read_in_place_and_each_row_is_what_it_is_alone(kernel):
    """A slice of wider scores (the text columns of (B, P, V) scores) gives what its copy gives, and a row's
    results are the same bits alone, in any batch and on any number of threads."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(12, 51865, generator=gen) * 3
    text = wide[:, :50364]
    together = reduce_rows(text)
    for got, want in zip(together, reduce_rows(text.contiguous())):
        assert torch.equal(got, want)
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            alone = [reduce_rows(text[i:i + 1]) for i in range(12)]
            for k in range(3):
                assert torch.equal(torch.cat([a[k] for a in alone]), together[k])
    finally:
        torch.set_num_threads(threads)


def test_the_rules_take_the_same_choices_through_the_kernel_as_through_torch(kernel, monkeypatch):
    """`LogitRules.greedy` and `draft_choice` over random scores with the rules' masks (timestamps on): the same
    tokens, and log-probabilities within fp32 rounding, with the kernel and with torch's reductions."""
    from asr_spec.testing import random_whisper

    model = random_whisper("tiny")
    tokens = rules.WhisperTokens.from_generation_config(model.generation_config, model.config.max_target_positions)
    vocab = model.config.vocab_size
    logic = rules.LogitRules(tokens, vocab, timestamps=True, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)
    b, p = 6, 4
    logits = torch.randn(b, p, vocab, generator=gen) * 3
    logits[:, :, tokens.timestamp_begin:] += 2.0  # timestamps compete with text
    begin = torch.full((b,), 3)
    n_hist = torch.tensor([3, 4, 5, 6, 7, 8])
    seq = torch.randint(0, tokens.eot, (b, 16), generator=gen)
    seq[:, 4] = tokens.timestamp_begin + 2  # a timestamp in the history: the pair rules apply
    choice, logprob = logic.greedy(logits, seq, n_hist, begin)
    draft = logic.draft_choice(logits[:, :1], n_hist, begin)
    monkeypatch.setattr(rules, "_row_kernel", lambda x: False)
    torch_choice, torch_logprob = logic.greedy(logits, seq, n_hist, begin)
    assert torch.equal(choice, torch_choice) and torch.equal(draft, logic.draft_choice(logits[:, :1], n_hist, begin))
    torch.testing.assert_close(logprob, torch_logprob, rtol=1e-5, atol=1e-5)
