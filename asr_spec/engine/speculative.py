"""One draft/verify/accept step over all rows of the batch, with per-row rollback: static shapes, no host sync.

Per row, the step: (1) lets the draft catch up on the committed tokens it has not seen and propose K tokens;
(2) feeds the target its pending token plus the K proposals in *one* pass (a fixed window of K + 1) and applies
Whisper's rules at each of the K + 1 positions; (3) accepts the longest prefix where proposal == target's choice,
plus the target's next token; (4) moves each cache's length to exactly the tokens it holds that were accepted.
Without a draft (K = 0) the same step is plain batched greedy decoding (a window of 1). With `hyp`
(`hypothesis.Hypotheses`), rows that have a hypothesis left propose its next tokens instead of the draft's, and the
window is max(K, hyp.width) + 1 for every row (hypothesis drafting: the same accept, the same invariant).

Sampled rows (temperature > 0, when `rules.sampling` says the batch has some: engine/sampling.py): the draft draws
its proposals from its own rule-applied distribution q at the row's temperature, and (3) becomes speculative
sampling: accept proposal x with probability min(1, p(x)/q(x)), else emit a token drawn from max(0, p - q), the
token after the last accepted proposal drawn from p. Lossless in distribution; greedy rows (temperature 0) beside
them are decided exactly as above, token for token.

Invariant between steps, per row: `seq[:n_tok]` are the committed tokens (prompt + generated); the target cache
holds exactly the first `n_tok - 1` of them and the draft cache the first `d_len` with
n_tok - 2 <= d_len <= n_tok - 1, so each step feeds the target one pending token and the draft a window of two
(after a hypothesis step n_tok - hyp.width - 2 <= d_len: the next one, a hypothesis step too, feeds a window of
hyp.width + 2). A refilled slot's prompt is prefilled by the scheduler's admission before the next step (the
invariant then holds for it too). A feature-conditioned draft (`Models.features`, engine/features.py) keeps only
what it was fed with the target's own states: n_tok - K - 1 <= d_len <= n_tok - 1, a catch-up window of K + 1
(max(K, hyp.width) + 1 in a hypothesis step); it has no q of its own, so sampled rows offer none of its proposals.

Static: every tensor shape depends only on (rows, n_keys, K), every update is in place and nothing is read back
to the host, so the step traces into one graph (`torch.compile(fullgraph=True)`) and is captured as one CUDA graph
per (rows, n_keys bucket, K). A finished row (finish != 0) is masked: it computes but commits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder import Decoder, full_vocab_logits
from asr_spec.engine.hypothesis import Hypotheses
from asr_spec.engine.rules import LogitRules
from asr_spec.engine.sampling import DRAW_DRAFT, DRAW_TARGET, draw, probabilities, speculative_choice, uniform

FINISH_NONE, FINISH_EOS, FINISH_LENGTH = 0, 1, 2


COUNTS = ("target_passes", "draft_passes", "drafted", "accepted")  # the per-row counts of DecodeState


@dataclass
class DecodeState:
    """Per-row decoding state of the batch slots; every tensor's first dimension is the row.

    seq:      (B, S) long committed tokens, then scratch (draft proposals are written past n_tok)
    n_tok:    (B,) committed tokens; begin: (B,) index of the first generated token (the end of the SOT
              sequence: a forced prefix after it counts as generated for Whisper's rules)
    given:    (B,) tokens after `begin` of a given prefix, <|0.00|> included (`ChunkRequest.prefix_given`; 0: none):
              at the first position after them the totals decide a timestamp (`LogitRules.apply`)
    limit:    (B,) n_tok at which the row must stop (prompt + max_new_tokens, capped at max_target_positions)
    finish:   (B,) FINISH_* code (0 = still decoding)
    target_passes, draft_passes: (B,) long target / draft forward passes over the row (steps; steps x K)
    drafted, accepted: (B,) long draft tokens offered for verification, and of them those the target accepted
    hist:     (B, k_max + 1) long number of steps that accepted j draft tokens
    sum_logprob:    (B,) float32 sum of the log-probabilities of the generated tokens under the target's
                    rule-applied scores (Whisper's sum_logprobs)
    no_speech_prob: (B,) float32 <|nospeech|> probability at the SOT position (set by admission)
    temperature:    (B,) float32 sampling temperature (0 = greedy); key: (B,) long the row's random key, in
                    [0, 2^32) (set by the scheduler from the request: `set_sampling`)
    """

    seq: torch.Tensor
    n_tok: torch.Tensor
    begin: torch.Tensor
    given: torch.Tensor
    limit: torch.Tensor
    finish: torch.Tensor
    target_passes: torch.Tensor
    draft_passes: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    hist: torch.Tensor
    sum_logprob: torch.Tensor
    no_speech_prob: torch.Tensor
    temperature: torch.Tensor
    key: torch.Tensor

    @classmethod
    def empty(cls, n_rows: int, n_seq: int, k_max: int, device: torch.device) -> DecodeState:
        """The state of `n_rows` free slots (finished: FINISH_LENGTH), seq of `n_seq` tokens each."""
        per_row = {name: torch.zeros(n_rows, dtype=torch.long, device=device)
                   for name in ("n_tok", "begin", "given", "limit", *COUNTS)}
        return cls(seq=torch.zeros(n_rows, n_seq, dtype=torch.long, device=device),
                   finish=torch.full((n_rows,), FINISH_LENGTH, dtype=torch.long, device=device),
                   hist=torch.zeros(n_rows, k_max + 1, dtype=torch.long, device=device),
                   sum_logprob=torch.zeros(n_rows, device=device), no_speech_prob=torch.zeros(n_rows, device=device),
                   temperature=torch.zeros(n_rows, device=device), key=torch.zeros_like(per_row["n_tok"]),
                   **per_row)

    def keeps(self, i: int) -> torch.Tensor:
        """(B,) bool: whether each row could keep a proposal at position n_tok + i, before its limit. A row may
        commit up to limit - n_tok tokens a step (the accept is capped there), so the last one it can keep is offered
        too: a sampled row's token there goes through accept / resample as when no limit cuts the row there (a row
        cut by max_new_tokens is the uncut row cut there)."""
        return i < self.limit - self.n_tok

    def rows(self, n_rows: int) -> DecodeState:
        """The first `n_rows` slots, as views (in-place updates reach the full state)."""
        return DecodeState(*(getattr(self, f.name)[:n_rows] for f in fields(self)))

    def start(self, rows: torch.Tensor, prompts: torch.Tensor, limit: int | torch.Tensor, no_speech_prob: torch.Tensor,
              lengths: torch.Tensor | None = None, begin: torch.Tensor | None = None,
              given: torch.Tensor | None = None) -> None:
        """Start rows `rows` ((R,) long: newly admitted slots) on their prompts, their counts at zero.

        prompts: (R, prompt_len) long, right-padded where `lengths` (R,) says how many tokens each row has (None:
        all of them); begin: (R,) index of each row's first generated token (None: its length); given: (R,) tokens
        after it of a given prefix (None: none); limit: n_tok at which the rows stop, one for all or (R,);
        no_speech_prob: (R,) float32.
        """
        n_prompt = prompts.shape[1]
        self.seq[rows, :n_prompt] = prompts
        self.n_tok[rows] = n_prompt if lengths is None else lengths
        self.begin[rows] = self.n_tok[rows] if begin is None else begin
        self.given[rows] = 0 if given is None else given
        self.limit[rows] = limit
        self.finish[rows] = FINISH_NONE
        for name in COUNTS:
            getattr(self, name)[rows] = 0
        self.hist[rows] = 0
        self.sum_logprob[rows] = 0.0
        self.no_speech_prob[rows] = no_speech_prob

    def set_sampling(self, rows: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor) -> None:
        """Rows `rows` ((R,) long) sample at `temperature` ((R,) float32, 0 = greedy) with keys `key` ((R,) long)."""
        self.temperature[rows] = temperature
        self.key[rows] = key

    def move_row(self, src: int, dst: int) -> None:
        for f in fields(self):
            t = getattr(self, f.name)
            t[dst] = t[src]


def _catch_up_index(n_tok: torch.Tensor, d_len: torch.Tensor, catch_up: int) -> torch.Tensor:
    """(B, 1) long: where in the draft's catch-up window of `catch_up` tokens each row's last committed token sits
    (n_tok - d_len - 1). A live row's is inside the window by construction; a freed slot computed only to fill a
    CUDA graph's row bucket keeps its last state, which after a hypothesis step (the draft kept none of its
    tokens) may point past a narrower window: clamped, so that such a row reads a token of its window, not out of
    bounds (a device-side assert on CUDA). It commits nothing either way."""
    return (n_tok - d_len - 1).clamp(0, catch_up - 1)[:, None]


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

    def rows(self, n_rows: int, first: int = 0) -> Models:
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


def step(m: Models, rules: LogitRules, st: DecodeState, k: int, n_keys: int, hyp: Hypotheses | None = None) -> None:
    """Advance every unfinished row by at least one token, in place.

    k: draft tokens proposed this step (0 = greedy); n_keys: attention keys read, a bucket above every real
    position of the step (> max n_tok + max(k, hyp.width) over live rows), at most the caches' n_positions.
    rules.sampling (a Python bool, fixed per traced graph): rows with st.temperature > 0 are sampled; False: every
    row is greedy. hyp: the rows' hypotheses (None: no row has one; the step is then exactly the draft/greedy
    step); a row with a hypothesis is greedy (`ChunkRequest` refuses one with a temperature).
    """
    live = st.finish == FINISH_NONE
    dev = st.n_tok.device
    proposed, q, from_hyp = _propose(m, rules, st, k, n_keys, hyp)
    p = proposed.shape[1]  # proposals verified this step: k, or max(k, hyp.width)

    # verify: the target's pending token then the p proposals, one pass, logits at all p + 1 positions
    t_len = m.target_cache.lengths
    tokens, pos = _window(st.seq, t_len, p + 1)
    # a batch with sampled rows reads the whole distribution: every logit in fp32 (a certified head's approximate
    # text logits decide no argmax, but a sampled token would see them)
    if m.features is None:
        logits = m.target.forward(m.target_cache, tokens, pos, n_keys, exact=rules.sampling)
    else:  # the same pass, its final states kept for the feature-conditioned draft
        logits = m.features.target_pass(m.target, m.target_cache, tokens, pos, n_keys, exact=rules.sampling)
    # the target's choice at each of the p + 1 positions, (B, p + 1), and its log-probability (Whisper's rules)
    if rules.sampling:  # the whole scores: sampled rows draw from them (engine/sampling.py)
        scores = rules.apply(logits, st.seq, st.n_tok, st.begin, st.given)  # (B, p + 1, V)
        choice = scores.max(-1).indices
    else:
        choice, logprob = rules.greedy(logits, st.seq, st.n_tok, st.begin, st.given)

    # accept the longest agreeing prefix plus the target's own next token, within each row's limits
    j = torch.arange(p + 1, device=dev)
    drafted = st.seq.gather(1, st.n_tok[:, None] + j[:p])
    match = (drafted == choice[:, :p]) & proposed
    if rules.sampling:  # sampled rows: speculative sampling instead
        match, choice = _sampled(st, scores, q, drafted, proposed, match, choice)
        logprob = scores.gather(-1, choice[..., None])[..., 0] - scores.logsumexp(-1)
    n_acc = match.long().cumprod(1).sum(1)
    is_eos = (choice == rules.tokens.eot) & (j[None, :] <= n_acc[:, None])
    eos_at = torch.where(is_eos, j[None, :], p + 1).min(1).values
    n_new = torch.minimum(torch.minimum(n_acc + 1, eos_at + 1), st.limit - st.n_tok)
    n_new = torch.where(live, n_new, 0)
    # past n_tok + n_new the row's seq is scratch, so all k + 1 choices can be written
    st.seq.scatter_(1, (st.n_tok[:, None] + j).clamp(max=st.seq.shape[1] - 1), choice)
    old_n = st.n_tok.clone()
    st.n_tok.add_(n_new)
    t_len.copy_(torch.where(live, st.n_tok - 1, t_len))
    if k > 0:  # the draft holds the accepted proposals it was fed itself; none of a hypothesis row's
        d_len = m.draft_cache.lengths
        # a feature-conditioned draft keeps none: it was fed them with its own guesses of the target's states (the
        # next catch-up feeds them again with the target's)
        d_keep = torch.where(from_hyp, 0, torch.clamp(n_new - 1, max=k - 1)) if m.features is None else 0
        d_len.copy_(torch.where(live, old_n + d_keep, d_len))
    ended_eos = live & (eos_at < n_new)
    ended_len = live & ~ended_eos & (st.n_tok >= st.limit)
    st.finish.copy_(torch.where(ended_eos, FINISH_EOS, torch.where(ended_len, FINISH_LENGTH, st.finish)))

    n_offered, n_taken = _count(st, logprob, live, from_hyp, proposed, n_acc, n_new, k)
    if hyp is not None:
        hyp.settle(choice, n_new, st.seq, st.n_tok, live & from_hyp, n_offered, n_taken)


def _propose(m: Models, rules: LogitRules, st: DecodeState, k: int, n_keys: int,
             hyp: Hypotheses | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The step's proposals, written into st.seq[n_tok:n_tok + P]: the draft's k (a plain draft's `_draft`, a
    feature-conditioned one's `TargetFeatures.propose`), overlaid by the hypothesis rows' own. Returns the (B, P)
    bool proposals each row offers (P = k, or max(k, hyp.width) in a hypothesis step), the sampled rows' (B, P, V)
    q (None without one) and the (B,) bool rows proposing from their hypothesis."""
    n_rows, dev = st.n_tok.shape[0], st.n_tok.device
    if m.features is None:
        catch_up, draft = (2 if hyp is None else hyp.width + 2), _draft
    else:  # it keeps none of last step's tokens: a window over every one (engine/features.py)
        catch_up, draft = (k + 1 if hyp is None else max(k, hyp.width) + 1), m.features.propose
    proposed, q = (draft(m, rules, st, k, n_keys, catch_up) if k > 0
                   else (torch.zeros(n_rows, 0, dtype=torch.bool, device=dev), None))
    from_hyp = torch.zeros(n_rows, dtype=torch.bool, device=dev)
    if hyp is not None:
        proposed, from_hyp = hyp.propose(st.seq, st.n_tok, st.begin, st.limit, proposed)
    p = proposed.shape[1]
    if q is not None and p > k:  # a sampled row offers only its k draft proposals: none past them (q = 0 there)
        q = torch.nn.functional.pad(q, (0, 0, 0, p - k))
    return proposed, q, from_hyp


def _count(st: DecodeState, logprob: torch.Tensor, live: torch.Tensor, from_hyp: torch.Tensor,
           proposed: torch.Tensor, n_acc: torch.Tensor, n_new: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """The step's statistics into `st`; returns the (B,) long proposals offered and accepted per row.

    logprob: (B, P + 1) float32 the log-probability of each token written under the rule-applied scores at
    temperature 1, as Whisper's sum_logprobs (its score less the logsumexp): the emitted ones are summed; live,
    from_hyp: (B,) bool the rows decoding this step, those proposing from their hypothesis; proposed: (B, P) bool;
    n_acc, n_new: (B,) long."""
    emitted = torch.arange(logprob.shape[1], device=logprob.device)[None, :] < n_new[:, None]
    st.sum_logprob.add_(torch.where(emitted, logprob, 0.0).sum(1))
    live_l = live.long()
    drafting = (live & ~from_hyp).long()  # the rows whose proposals were the model draft's
    n_offered, n_taken = proposed.sum(1), torch.minimum(n_acc, n_new)
    st.target_passes.add_(live_l)
    st.draft_passes.add_(live_l * k)
    st.drafted.add_(n_offered * drafting)
    st.accepted.add_(n_taken * drafting)
    if k > 0:
        # the proposals this pass committed (not those matching past an <|endoftext|> among them)
        st.hist.scatter_add_(1, n_taken.clamp(max=st.hist.shape[1] - 1)[:, None], drafting[:, None])
    return n_offered, n_taken


def _sampled(st: DecodeState, scores: torch.Tensor, q: torch.Tensor | None, drafted: torch.Tensor,
             proposed: torch.Tensor, match: torch.Tensor, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled rows' (match, choice) replaced by speculative sampling's (plain sampling from p when K = 0);
    the greedy rows' (temperature 0) kept as they are. scores: (B, P + 1, V); q: (B, P, V) or None (K = 0);
    drafted, proposed, match: (B, P); choice: (B, P + 1); P = K, or max(K, hyp.width) in a hypothesis step."""
    sampled = (st.temperature > 0)[:, None]
    p = probabilities(scores, st.temperature)
    if q is not None:
        accept, drawn = speculative_choice(p, q, drafted, proposed, st.key, st.n_tok)
    else:
        accept, drawn = match, draw(p, uniform(st.key, st.n_tok[:, None] + torch.arange(p.shape[1], device=p.device),
                                               DRAW_TARGET))
    return torch.where(sampled, accept, match), torch.where(sampled, drawn, choice)


def _draft(m: Models, rules: LogitRules, st: DecodeState, k: int, n_keys: int,
           catch_up: int = 2) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Let the draft propose k tokens per row, written into st.seq[n_tok:n_tok + k]; returns the (B, k) mask of
    the tokens each row really offers (none it could not keep before its limit) and, when rules.sampling, the
    (B, k, V) float32 distributions q the sampled rows' proposals were drawn from (None otherwise). catch_up: the
    width of the window feeding the draft the committed tokens it has not seen (2; hyp.width + 2 in a hypothesis
    step).

    Greedy rows propose the argmax after the static rules (`LogitRules.draft_choice`); sampled rows draw from q:
    all of Whisper's rules applied (the proposals so far are the history), divided by the row's temperature."""
    d_len = m.draft_cache.lengths
    # catch up on the committed tokens the draft has not seen: one more than the target after a full accept (more
    # after a hypothesis step)
    tokens, pos = _window(st.seq, d_len, catch_up)
    index = _catch_up_index(st.n_tok, d_len, catch_up)
    proposed, qs = [], []
    restricted = rules.draft_vocab is not None  # logits over the draft's own vocabulary (`draft_choice`)
    for i in range(k):
        logits = m.draft.forward(m.draft_cache, tokens, pos, n_keys, index, full_vocab=not restricted)
        token = rules.draft_choice(logits, st.n_tok + i, st.begin)
        if rules.sampling:
            full = full_vocab_logits(logits, rules.draft_vocab, m.draft.vocab_size) if restricted else logits
            q = probabilities(rules.apply(full, st.seq, st.n_tok + i, st.begin, st.given), st.temperature)[:, 0]
            drawn = draw(q, uniform(st.key, (st.n_tok + i)[:, None], DRAW_DRAFT)[:, 0])
            token = torch.where(st.temperature > 0, drawn, token)
            qs.append(q)
        st.seq.scatter_(1, (st.n_tok + i)[:, None], token[:, None])
        # a row proposes none it could not keep (`DecodeState.keeps`): the batch still computes them, but they are
        # neither offered nor counted
        proposed.append(st.keeps(i))
        tokens, pos = token[:, None], (st.n_tok + i)[:, None]
        index = torch.zeros_like(index)
    return torch.stack(proposed, 1), torch.stack(qs, 1) if qs else None
