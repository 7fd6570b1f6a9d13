"""One draft/verify/accept step over all rows of the batch, with per-row rollback.

Per row, the step: (1) lets the draft catch up on the committed tokens it has not seen and propose up to K
tokens; (2) feeds the target its pending token(s) plus the K proposals in *one* pass and applies Whisper's rules
at each of the K+1 positions; (3) accepts the longest prefix where proposal == target's choice, plus the
target's next token; (4) moves each cache's length to exactly the tokens it holds that were accepted.
Without a draft (K = 0) the same step is plain batched greedy decoding.

Invariant between steps, per row: `seq[:n_tok]` are the committed tokens (prompt + generated); the target cache
holds exactly the first `n_tok - 1` of them and the draft cache the first `d_len <= n_tok - 1`, so each step
feeds each model only the committed tokens it has not seen yet (one for the target, one or two for the draft).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.rules import LogitRules

FINISH_NONE, FINISH_EOS, FINISH_LENGTH = 0, 1, 2


@dataclass
class DecodeState:
    """Per-row decoding state of the batch slots; every tensor's first dimension is the row.

    seq:      (B, S) long committed tokens, then scratch (draft proposals are written past n_tok)
    n_tok:    (B,) committed tokens; begin: (B,) prompt length (index of the first generated token)
    limit:    (B,) n_tok at which the row must stop (prompt + max_new_tokens, capped at max_target_positions)
    finish:   (B,) FINISH_* code (0 = still decoding)
    stats:    (B, 4) long [target passes, draft passes, drafted tokens, accepted tokens]
    hist:     (B, k_max + 1) long number of steps that accepted j draft tokens
    logp:     (B, 2) float32 [sum of the log-probabilities of the generated tokens under the target's rule-applied
              scores (Whisper's sum_logprobs), <|nospeech|> probability at the SOT position (set by admission)]
    """

    seq: torch.Tensor
    n_tok: torch.Tensor
    begin: torch.Tensor
    limit: torch.Tensor
    finish: torch.Tensor
    stats: torch.Tensor
    hist: torch.Tensor
    logp: torch.Tensor

    @classmethod
    def empty(cls, n_rows: int, n_seq: int, k_max: int, device: torch.device) -> "DecodeState":
        z = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(n_rows, n_seq), z(n_rows), z(n_rows), z(n_rows), z(n_rows) + FINISH_LENGTH,
                   z(n_rows, 4), z(n_rows, k_max + 1), torch.zeros(n_rows, 2, device=device))

    def keep_rows(self, rows: torch.Tensor) -> None:
        for name in ("seq", "n_tok", "begin", "limit", "finish", "stats", "hist", "logp"):
            setattr(self, name, getattr(self, name)[rows])


def _window(seq: torch.Tensor, start: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens seq[b, start[b] : start[b] + width] and their positions, (B, width) each (indices clamped)."""
    pos = start[:, None] + torch.arange(width, device=seq.device)
    return seq.gather(1, pos.clamp(max=seq.shape[1] - 1)), pos


@dataclass
class Models:
    """The decoders of one engine and their caches (draft ones are None without a draft)."""

    target: Decoder
    target_cache: KVCache
    draft: Decoder | None = None
    draft_cache: KVCache | None = None


def step(m: Models, rules: LogitRules, st: DecodeState, k: int, n_pending: int, max_len: int) -> None:
    """Advance every unfinished row by at least one token (in place).

    k: draft tokens proposed this step (0 = greedy); n_pending: upper bound on tokens a cache must catch up on
    (1 normally, the prompt length after a slot was refilled); max_len: upper bound on n_tok over rows.
    """
    live = st.finish == FINISH_NONE
    n_rows = st.n_tok.shape[0]
    dev = st.n_tok.device
    rows = torch.arange(n_rows, device=dev)
    proposed = torch.zeros(n_rows, k, dtype=torch.bool, device=dev)
    if k > 0:
        proposed = _draft(m, rules, st, k, n_pending, max_len)

    # verify: the target's pending tokens then the k proposals, one pass; logits at the last pending + proposals
    t_len = m.target_cache.lengths
    width = n_pending + k
    tokens, pos = _window(st.seq, t_len, width)
    first = (st.n_tok - t_len - 1)[:, None]  # index of the last pending token in the window
    n_keys = min(max_len + k, m.target_cache.n_positions)
    logits = m.target.forward(m.target_cache, tokens, pos, n_keys, first + torch.arange(k + 1, device=dev))
    scores = rules.apply(logits, st.seq, st.n_tok, st.begin)  # (B, k + 1, V)
    best, choice = scores.max(-1)  # (B, k + 1) each

    # accept the longest agreeing prefix plus the target's own next token, within each row's limits
    match = (st.seq.gather(1, st.n_tok[:, None] + torch.arange(k, device=dev)) == choice[:, :k]) & proposed
    n_acc = match.long().cumprod(1).sum(1)
    j = torch.arange(k + 1, device=dev)
    is_eos = (choice == rules.tokens.eot) & (j[None, :] <= n_acc[:, None])
    eos_at = torch.where(is_eos, j[None, :], k + 1).min(1).values
    n_new = torch.minimum(torch.minimum(n_acc + 1, eos_at + 1), st.limit - st.n_tok)
    n_new = torch.where(live, n_new, 0)
    # past n_tok + n_new the row's seq is scratch, so all k + 1 choices can be written
    st.seq.scatter_(1, (st.n_tok[:, None] + j).clamp(max=st.seq.shape[1] - 1), choice)
    old_n = st.n_tok
    st.n_tok = old_n + n_new
    m.target_cache.lengths = torch.where(live, st.n_tok - 1, t_len)
    if m.draft_cache is not None and k > 0:
        m.draft_cache.lengths = torch.where(live, old_n + torch.minimum(n_new - 1, torch.full_like(n_new, k - 1)),
                                            m.draft_cache.lengths)
    ended_eos = live & (eos_at < n_new)
    ended_len = live & ~ended_eos & (st.n_tok >= st.limit)
    st.finish = torch.where(ended_eos, FINISH_EOS, torch.where(ended_len, FINISH_LENGTH, st.finish))

    # statistics; log-probability of each emitted token (the argmax: its score less the logsumexp)
    emitted = j[None, :] < n_new[:, None]
    st.logp[:, 0] += torch.where(emitted, best - scores.logsumexp(-1), 0.0).sum(1)
    accepted = torch.minimum(n_acc, n_new)
    st.stats += torch.stack([live.long(), live.long() * k, proposed.sum(1), accepted], 1) * live[:, None]
    if k > 0:
        st.hist[rows, n_acc.clamp(max=st.hist.shape[1] - 1)] += live.long()


def _draft(m: Models, rules: LogitRules, st: DecodeState, k: int, n_pending: int, max_len: int) -> torch.Tensor:
    """Let the draft propose k tokens per row, written into st.seq[n_tok:n_tok + k]; returns the (B, k) mask of
    the tokens each row really offers (none it could not keep before its limit)."""
    assert m.draft is not None and m.draft_cache is not None  # the engine passes k > 0 only with a draft
    dev = st.n_tok.device
    d_len = m.draft_cache.lengths
    # catch up on the committed tokens the draft has not seen: one more than the target after a full accept
    tokens, pos = _window(st.seq, d_len, n_pending + 1)
    index = (st.n_tok - d_len - 1)[:, None]
    proposed = []
    for i in range(k):
        n_keys = min(max_len + i, m.draft_cache.n_positions)
        logits = m.draft.forward(m.draft_cache, tokens, pos, n_keys, index)
        token = rules.apply(logits, st.seq, st.n_tok + i, st.begin)[:, 0].argmax(-1)
        st.seq.scatter_(1, (st.n_tok + i)[:, None], token[:, None])
        # a row proposes none it could not keep (room before its limit, less the target's own token): the batch
        # still computes them, but they are neither offered nor counted
        proposed.append(i < st.limit - st.n_tok - 1)
        tokens, pos = token[:, None], (st.n_tok + i)[:, None]
        index = torch.zeros_like(index)
    return torch.stack(proposed, 1)
