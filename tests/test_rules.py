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


@pytest.mark.parametrize("timestamps", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_rules_match_transformers_processors(timestamps, seed):
    model = tiny_target()
    gen = model.generation_config
    vocab = model.config.vocab_size
    tokens = WhisperTokens.from_generation_config(gen, 448)
    rules = LogitRules(tokens, vocab, timestamps, torch.device("cpu"))
    begin, n_rows, n_hist, n_pos = 3, 6, 3, 9
    seq = random_histories(gen, n_rows, n_hist + n_pos, seed, vocab)
    seq[:, :begin] = torch.tensor(tokens.prompt(tokens.lang_to_id["<|en|>"], "transcribe", timestamps)[:begin])
    g = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(n_rows, n_pos, vocab, generator=g) * 3
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
