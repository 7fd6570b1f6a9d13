"""One draft/verify/accept step over all rows of the batch, with per-row rollback: static shapes, no host sync.

Per row, the step: (1) lets the draft catch up on the committed tokens it has not seen and propose K tokens;
(2) feeds the target its pending token plus the K proposals in *one* pass (a fixed window of K + 1) and applies
Whisper's rules at each of the K + 1 positions; (3) accepts the longest prefix where proposal == target's choice,
plus the target's next token; (4) moves each cache's length to exactly the tokens it holds that were accepted.
Without a draft (K = 0) the same step is plain batched greedy decoding (a window of 1).

Invariant between steps, per row: `seq[:n_tok]` are the committed tokens (prompt + generated); the target cache
holds exactly the first `n_tok - 1` of them and the draft cache the first `d_len` with n_tok - 2 <= d_len <=
n_tok - 1, so each step feeds the target one pending token and the draft a window of two. A refilled slot's prompt
is prefilled by the scheduler's admission before the next step (the invariant then holds for it too). A
feature-conditioned draft (`Models.features`, engine/features.py) keeps only what it was fed with the target's own
states: n_tok - K - 1 <= d_len <= n_tok - 1, a catch-up window of K + 1.

Static: every tensor shape depends only on (rows, n_keys, K), every update is in place and nothing is read back
to the host, so the step traces into one graph (`torch.compile(fullgraph=True)`) and is captured as one CUDA graph
per (rows, n_keys bucket, K). A finished row (finish != 0) is masked: it computes but commits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.rules import LogitRules

FINISH_NONE, FINISH_EOS, FINISH_LENGTH = 0, 1, 2


COUNTS = ("target_passes", "draft_passes", "drafted", "accepted")  # the per-row counts of DecodeState


@dataclass
class DecodeState:
    """Per-row decoding state of the batch slots; every tensor's first dimension is the row.

    seq:      (B, S) long committed tokens, then scratch (draft proposals are written past n_tok)
    n_tok:    (B,) committed tokens; begin: (B,) prompt length (index of the first generated token)
    limit:    (B,) n_tok at which the row must stop (prompt + max_new_tokens, capped at max_target_positions)
    finish:   (B,) FINISH_* code (0 = still decoding)
    target_passes, draft_passes: (B,) long target / draft forward passes over the row (steps; steps x K)
    drafted, accepted: (B,) long draft tokens offered for verification, and of them those the target accepted
    hist:     (B, k_max + 1) long number of steps that accepted j draft tokens
    sum_logprob:    (B,) float32 sum of the log-probabilities of the generated tokens under the target's
                    rule-applied scores (Whisper's sum_logprobs)
    no_speech_prob: (B,) float32 <|nospeech|> probability at the SOT position (set by admission)
    """

    seq: torch.Tensor
    n_tok: torch.Tensor
    begin: torch.Tensor
    limit: torch.Tensor
    finish: torch.Tensor
    target_passes: torch.Tensor
    draft_passes: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    hist: torch.Tensor
    sum_logprob: torch.Tensor
    no_speech_prob: torch.Tensor

    @classmethod
    def empty(cls, n_rows: int, n_seq: int, k_max: int, device: torch.device) -> "DecodeState":
        """The state of `n_rows` free slots (finished: FINISH_LENGTH), seq of `n_seq` tokens each."""
        per_row = {name: torch.zeros(n_rows, dtype=torch.long, device=device)
                   for name in ("n_tok", "begin", "limit", *COUNTS)}
        return cls(seq=torch.zeros(n_rows, n_seq, dtype=torch.long, device=device),
                   finish=torch.full((n_rows,), FINISH_LENGTH, dtype=torch.long, device=device),
                   hist=torch.zeros(n_rows, k_max + 1, dtype=torch.long, device=device),
                   sum_logprob=torch.zeros(n_rows, device=device), no_speech_prob=torch.zeros(n_rows, device=device),
                   **per_row)

    def rows(self, n_rows: int) -> "DecodeState":
        """The first `n_rows` slots, as views (in-place updates reach the full state)."""
        return DecodeState(*(getattr(self, f.name)[:n_rows] for f in fields(self)))

    def start(self, rows: torch.Tensor, prompts: torch.Tensor, limit: int, no_speech_prob: torch.Tensor) -> None:
        """Start rows `rows` ((R,) long: newly admitted slots) on their prompts, their counts at zero.

        prompts: (R, prompt_len) long; limit: n_tok at which the rows stop; no_speech_prob: (R,) float32.
        """
        n_prompt = prompts.shape[1]
        self.seq[rows, :n_prompt] = prompts
        self.n_tok[rows] = n_prompt
        self.begin[rows] = n_prompt
        self.limit[rows] = limit
        self.finish[rows] = FINISH_NONE
        for name in COUNTS:
            getattr(self, name)[rows] = 0
        self.hist[rows] = 0
        self.sum_logprob[rows] = 0.0
        self.no_speech_prob[rows] = no_speech_prob

    def move_row(self, src: int, dst: int) -> None:
        for f in fields(self):
            t = getattr(self, f.name)
            t[dst] = t[src]


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
    # a feature-conditioned draft's store of the target's final states (`engine.features.TargetFeatures`): it then
    # proposes (`propose`) and the verify pass runs through it (`target_pass`)
    features: Any = None

    def rows(self, n_rows: int, first: int = 0) -> "Models":
        """The same models over cache slots [first, first + n_rows) (views)."""
        return Models(self.target, self.target_cache.rows(n_rows, first), self.draft,
                      None if self.draft_cache is None else self.draft_cache.rows(n_rows, first),
                      None if self.features is None else self.features.rows(n_rows, first))

    def move_row(self, src: int, dst: int, n_positions: int) -> None:
        """Copy slot `src` into slot `dst` in every cache (`KVCache.move_row`)."""
        self.target_cache.move_row(src, dst, n_positions)
        if self.draft_cache is not None:
            self.draft_cache.move_row(src, dst, n_positions)
        if self.features is not None:
            self.features.move_row(src, dst, n_positions)


def step(m: Models, rules: LogitRules, st: DecodeState, k: int, n_keys: int) -> None:
    """Advance every unfinished row by at least one token, in place.

    k: draft tokens proposed this step (0 = greedy); n_keys: attention keys read, a bucket above every real
    position of the step (> max n_tok + k over live rows), at most the caches' n_positions.
    """
    live = st.finish == FINISH_NONE
    n_rows = st.n_tok.shape[0]
    dev = st.n_tok.device
    draft = _draft if m.features is None else m.features.propose
    proposed = draft(m, rules, st, k, n_keys) if k > 0 else torch.zeros(n_rows, 0, dtype=torch.bool, device=dev)

    # verify: the target's pending token then the k proposals, one pass, logits at all k + 1 positions
    t_len = m.target_cache.lengths
    tokens, pos = _window(st.seq, t_len, k + 1)
    if m.features is None:
        logits = m.target.forward(m.target_cache, tokens, pos, n_keys)
    else:  # the same pass, its final states kept for the feature-conditioned draft
        logits = m.features.target_pass(m.target, m.target_cache, tokens, pos, n_keys)
    scores = rules.apply(logits, st.seq, st.n_tok, st.begin)  # (B, k + 1, V)
    best, choice = scores.max(-1)  # (B, k + 1) each

    # accept the longest agreeing prefix plus the target's own next token, within each row's limits
    j = torch.arange(k + 1, device=dev)
    match = (st.seq.gather(1, st.n_tok[:, None] + j[:k]) == choice[:, :k]) & proposed
    n_acc = match.long().cumprod(1).sum(1)
    is_eos = (choice == rules.tokens.eot) & (j[None, :] <= n_acc[:, None])
    eos_at = torch.where(is_eos, j[None, :], k + 1).min(1).values
    n_new = torch.minimum(torch.minimum(n_acc + 1, eos_at + 1), st.limit - st.n_tok)
    n_new = torch.where(live, n_new, 0)
    # past n_tok + n_new the row's seq is scratch, so all k + 1 choices can be written
    st.seq.scatter_(1, (st.n_tok[:, None] + j).clamp(max=st.seq.shape[1] - 1), choice)
    old_n = st.n_tok.clone()
    st.n_tok.add_(n_new)
    t_len.copy_(torch.where(live, st.n_tok - 1, t_len))
    if k > 0:
        d_len = m.draft_cache.lengths
        # the draft keeps the accepted proposals it was fed; a feature-conditioned one none (it was fed them with its
        # own guesses of the target's states: the next catch-up feeds them again with the target's)
        kept = old_n + torch.clamp(n_new - 1, max=k - 1) if m.features is None else old_n
        d_len.copy_(torch.where(live, kept, d_len))
    ended_eos = live & (eos_at < n_new)
    ended_len = live & ~ended_eos & (st.n_tok >= st.limit)
    st.finish.copy_(torch.where(ended_eos, FINISH_EOS, torch.where(ended_len, FINISH_LENGTH, st.finish)))

    # statistics; log-probability of each emitted token (the argmax: its score less the logsumexp)
    emitted = j[None, :] < n_new[:, None]
    st.sum_logprob.add_(torch.where(emitted, best.float() - scores.float().logsumexp(-1), 0.0).sum(1))
    live_l = live.long()
    st.target_passes.add_(live_l)
    st.draft_passes.add_(live_l * k)
    st.drafted.add_(proposed.sum(1) * live_l)
    st.accepted.add_(torch.minimum(n_acc, n_new) * live_l)
    if k > 0:
        st.hist.scatter_add_(1, n_acc.clamp(max=st.hist.shape[1] - 1)[:, None], live_l[:, None])


def _draft(m: Models, rules: LogitRules, st: DecodeState, k: int, n_keys: int) -> torch.Tensor:
    """Let the draft propose k tokens per row, written into st.seq[n_tok:n_tok + k]; returns the (B, k) mask of
    the tokens each row really offers (none it could not keep before its limit)."""
    d_len = m.draft_cache.lengths
    # catch up on the committed tokens the draft has not seen: one more than the target after a full accept
    tokens, pos = _window(st.seq, d_len, 2)
    index = (st.n_tok - d_len - 1)[:, None]
    proposed = []
    for i in range(k):
        logits = m.draft.forward(m.draft_cache, tokens, pos, n_keys, index)
        token = rules.draft_choice(logits, st.n_tok + i, st.begin)
        st.seq.scatter_(1, (st.n_tok + i)[:, None], token[:, None])
        # a row proposes none it could not keep (room before its limit, less the target's own token): the batch
        # still computes them, but they are neither offered nor counted
        proposed.append(i < st.limit - st.n_tok - 1)
        tokens, pos = token[:, None], (st.n_tok + i)[:, None]
        index = torch.zeros_like(index)
    return torch.stack(proposed, 1)
