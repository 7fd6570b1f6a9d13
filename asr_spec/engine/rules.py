"""Whisper's decoding rules, applied exactly as transformers' `WhisperForConditionalGeneration.generate()` applies
them in greedy decoding, but vectorised over rows *and* over the K+1 positions a speculative step verifies.

transformers chains, in this order: `SuppressTokensAtBeginLogitsProcessor` (begin_suppress_tokens at the first
generated position), `SuppressTokensLogitsProcessor` (suppress_tokens) and, in timestamp mode,
`WhisperTimeStampLogitsProcessor` (pairs, monotonic, max initial timestamp, timestamps forced when their total
probability beats every text token). The timestamp rule loops over rows with `.tolist()` per step; here every
per-row decision is a tensor op. One rule of our own: at the first position after a given prefix (a user's,
`ChunkRequest.prefix_given`) timestamps are forced only when their total probability beats the text tokens' total.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from asr_spec.engine import cpu_attention
from asr_spec.engine.options import language_code

NEG_INF = float("-inf")


@dataclass(frozen=True)
class WhisperTokens:
    """Special token ids and rule parameters of one Whisper checkpoint (from its generation config)."""

    sot: int
    eot: int
    no_timestamps: int
    lang_to_id: dict[str, int]
    task_to_id: dict[str, int]
    is_multilingual: bool
    suppress: tuple[int, ...]
    begin_suppress: tuple[int, ...]
    max_initial_timestamp_index: int | None
    max_positions: int  # the decoder's max_target_positions (448 for every Whisper)
    sot_prev: int | None = None  # <|startofprev|>, which opens a prompt of previous text (None: prompts refused)

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def max_prompt_tokens(self) -> int:
        """openai-whisper's limit on a prompt of previous text (the tokens after <|startofprev|>) and on a prefix:
        n_text_ctx // 2 - 1 tokens (223 for Whisper's 448 positions)."""
        return self.max_positions // 2 - 1

    @classmethod
    def from_generation_config(cls, gen: Any, max_positions: int) -> WhisperTokens:
        missing = [k for k in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id") if
                   getattr(gen, k, None) is None]
        if missing:
            raise ValueError(f"generation config lacks {', '.join(missing)}: not a Whisper generation config")
        eos = gen.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        return cls(
            sot=int(gen.decoder_start_token_id),
            eot=int(eos),
            no_timestamps=int(gen.no_timestamps_token_id),
            lang_to_id=dict(getattr(gen, "lang_to_id", None) or {}),
            task_to_id=dict(getattr(gen, "task_to_id", None) or {}),
            is_multilingual=bool(getattr(gen, "is_multilingual", False)),
            suppress=tuple(int(t) for t in (getattr(gen, "suppress_tokens", None) or ())),
            begin_suppress=tuple(int(t) for t in (getattr(gen, "begin_suppress_tokens", None) or ())),
            max_initial_timestamp_index=getattr(gen, "max_initial_timestamp_index", None),
            max_positions=int(max_positions),
            sot_prev=None if getattr(gen, "prev_sot_token_id", None) is None else int(gen.prev_sot_token_id),
        )

    def language_id(self, language: str) -> int | None:
        """Map "en", "english" or "<|en|>" to its token id (None on an English-only model, whose prompt has no
        language token, when the language is English); ValueError naming the language otherwise."""
        code = language_code(language)
        if not self.is_multilingual:
            if code != "en":
                raise ValueError(f"language {language!r} was given but the target model is English-only")
            return None
        token = f"<|{code}|>"
        if token not in self.lang_to_id:
            raise ValueError(f"language {language!r} is not supported by this model")
        return self.lang_to_id[token]

    def language_in(self, prompt: Sequence[int]) -> int | None:
        """The language token of a decoded row's prompt (`ChunkResult.prompt`: [<|startofprev|> previous text] sot
        language task ...), None on an English-only model or where there is none."""
        prompt = list(prompt)
        if self.sot not in prompt:
            return None
        at = prompt.index(self.sot) + 1
        return prompt[at] if at < len(prompt) and prompt[at] in self.lang_to_id.values() else None

    def prompt(self, lang_id: int | None, task: str, timestamps: bool) -> list[int]:
        """Decoder prompt as transformers builds it: sot [lang task] [notimestamps]."""
        tokens = [self.sot]
        if task == "translate" and not self.is_multilingual:  # it would transcribe, saying nothing (as a language)
            raise ValueError("task 'translate' was given but the target model is English-only")
        if self.is_multilingual:
            if lang_id is None:
                raise ValueError("multilingual model needs a language id (given or detected)")
            tokens += [lang_id, self.task_to_id[task]]
        if not timestamps:
            tokens.append(self.no_timestamps)
        return tokens


def _plus(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(..., V) float32/bf16/fp16 logits + (V,) float32 bias as float32 scores, in one pass: the add promotes
    bf16/fp16 logits (an exact widening), the same values as `logits.float() + bias` without its float copy."""
    return torch.add(logits, bias)


def _logsumexp(x: torch.Tensor, x_max: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (...) logsumexp over the last dimension, given its maximum (...) already reduced: the formula
    of `torch.logsumexp` (max + log sum exp(x - max); -inf where every value is -inf) without its own max pass."""
    shift = torch.where(torch.isinf(x_max), 0.0, x_max)
    return (x - shift[..., None]).exp_().sum(-1).log_() + shift


class _Best(NamedTuple):
    """max(-1)'s pair: the largest values (...) and the first index holding each (...) long."""

    values: torch.Tensor
    indices: torch.Tensor


def _row_kernel(x: torch.Tensor) -> bool:
    """The one decision: whether `x`'s row reductions run through the kernel extension (`cpu_reduce.h`): fp32 CPU
    scores, the extension built and not disabled, an eager step (a traced one keeps torch's ops)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()
            and cpu_attention.fused_attention_usable(x.device, torch.float32))


def _max_logsumexp(x: torch.Tensor, with_logsumexp: bool = True) -> tuple[_Best, torch.Tensor | None]:
    """(..., N) float32 scores -> (max(-1) over the last dimension, its logsumexp (...) or None when not asked).
    Where `_row_kernel`: one call, each row alone in one order (a verify pass's positions get what a greedy step's
    rows get; ~10x torch's separate max and exp / sum passes at 8 x 51,865 scores), its logsumexp rounded
    differently from torch's in the last bits; else torch's max and `_logsumexp`."""
    if _row_kernel(x):
        flat = x.reshape(-1, x.shape[-1])
        values, indices, sums = cpu_attention.extension().max_logsumexp(
            flat if flat.stride(-1) == 1 else flat.contiguous(), with_logsumexp)
        lead = x.shape[:-1]
        return _Best(values.view(lead), indices.view(lead)), sums.view(lead) if with_logsumexp else None
    best = x.max(-1)
    return _Best(best.values, best.indices), _logsumexp(x, best.values) if with_logsumexp else None


def _begin_suppress(scores: torch.Tensor, at_begin: torch.Tensor, columns: torch.Tensor) -> None:
    """-inf in `columns` ((C,) long: begin_suppress_tokens as columns of `scores`) where at_begin (B, P), in place
    on (B, P, V) `scores`, touching only those columns."""
    if columns.numel():
        cols = scores.index_select(-1, columns)
        scores.index_copy_(-1, columns, cols.masked_fill(at_begin[..., None], NEG_INF))


@dataclass(frozen=True)
class _TextRule:
    """The timestamp rule's text cut at (B, P) positions and the reductions that decided it.

    cut: (B, P) long, text tokens below it are forbidden (0, <|endoftext|>'s id, or timestamp_begin: all of them);
    best, tail: max(-1) (values, indices) of the text scores over [0, timestamp_begin) and [eot, timestamp_begin)
    (tail's indices from eot); ts_sum: (B, P) logsumexp of the allowed timestamp tokens' scores; text_sum: (B, P)
    logsumexp of every text score (None when not asked for)."""

    cut: torch.Tensor
    best: Any
    tail: Any
    ts_sum: torch.Tensor
    text_sum: torch.Tensor | None


class LogitRules:
    """Vectorised Whisper logit rules for one decoding configuration.

    The rules that depend only on the vocabulary (suppress_tokens, <|notimestamps|> in timestamp mode) are a
    precomputed additive (V,) bias; begin_suppress_tokens touch only their own columns. The timestamp rules that
    depend on the history are reductions over the 1,501 timestamp tokens and a cut-off index over the text tokens:
    no (B, P, V) boolean mask is built.
    """

    def __init__(self, tokens: WhisperTokens, vocab_size: int, timestamps: bool, device: torch.device,
                 draft_vocab: torch.Tensor | None = None):
        """draft_vocab: (V',) long ascending ids a restricted draft scores (`Decoder.vocab_ids`): its proposals are
        then chosen from its V' logits (`draft_choice`), never scattered into the whole vocabulary; None (or ids
        not ascending): from whole-vocabulary logits."""
        self.tokens = tokens
        self.timestamps = timestamps
        ts = tokens.timestamp_begin
        bias = torch.zeros(vocab_size, device=device)
        bias[list(tokens.suppress)] = NEG_INF
        if timestamps:
            bias[tokens.no_timestamps] = NEG_INF
        self.bias = bias  # (V,) 0 or -inf
        self.begin_ids = torch.tensor(tokens.begin_suppress, dtype=torch.long, device=device)  # first position only
        n_ts = max(vocab_size - ts, 0)
        self.ts_index = torch.arange(n_ts, device=device)  # timestamp token ts + i has index i
        self.text_index = torch.arange(min(ts, vocab_size), device=device)
        max_init = tokens.max_initial_timestamp_index
        self.max_initial = n_ts - 1 if max_init is None else int(max_init)
        self.lang_ids = torch.tensor(sorted(tokens.lang_to_id.values()), dtype=torch.long, device=device)
        # ascending ids keep argmax's tie rule (the lowest id among equal maxima) over the restricted logits
        if draft_vocab is not None and not bool((draft_vocab[1:] > draft_vocab[:-1]).all()):
            draft_vocab = None
        self.draft_vocab = None if draft_vocab is None else draft_vocab.to(device)
        if self.draft_vocab is not None:
            self.draft_bias = bias[self.draft_vocab]  # (V',) the static bias at the draft's ids
            # begin_suppress_tokens as column indices of the draft's logits (those it scores)
            self.draft_begin = torch.searchsorted(self.draft_vocab, self.begin_ids[torch.isin(self.begin_ids,
                                                                                                self.draft_vocab)])
        # whether the step also samples (rows at a temperature > 0; engine/sampling.py): a Python constant of each
        # traced or captured step, so a batch of greedy rows runs the greedy step alone (`with_sampling`)
        self.sampling = False

    def with_sampling(self) -> LogitRules:
        """The same rules for a step whose batch has sampled rows (`sampling` True; the tensors are shared)."""
        rules = copy.copy(self)
        rules.sampling = True
        return rules

    def detect_language(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (R, vocab) at the <|startoftranscript|> position -> (R, L) each row's probabilities of the L
        languages `lang_ids` (Whisper's `detect_language`; `admission.GroupLanguages` chooses from them)."""
        return logits.index_select(-1, self.lang_ids).float().softmax(-1)

    def draft_choice(self, logits: torch.Tensor, n_hist: torch.Tensor, begin: torch.Tensor) -> torch.Tensor:
        """(B, 1, V) draft logits, or (B, 1, V') over `draft_vocab` when the rules have one -> (B,) proposals
        (token ids): argmax after the static bias only (suppress, begin-suppress), without the history-dependent
        timestamp rules. Lossless: the target re-applies every rule to each proposal, so a proposal the full rules
        forbid is merely rejected (it costs acceptance, never accuracy). Over V' the same token as over the
        whole vocabulary with -inf outside V' (`decoder.full_vocab_logits`), reading a third of the columns. The
        first maximum by `max(-1)` (argmax's tie rule; on a CPU ~3x faster than `argmax` over 16k-52k columns)."""
        at_begin = (n_hist == begin)[:, None]
        if self.draft_vocab is None:
            return _max_logsumexp(self.static_scores(logits, at_begin)[:, 0], False)[0].indices
        scores = _plus(logits, self.draft_bias)
        _begin_suppress(scores, at_begin, self.draft_begin)
        return self.draft_vocab[_max_logsumexp(scores[:, 0], False)[0].indices]

    def static_scores(self, logits: torch.Tensor, at_begin: torch.Tensor) -> torch.Tensor:
        """(B, P, V) logits -> float32 scores after the rules that need no history: the static bias, and
        begin-suppress where at_begin (B, P). What a draft's proposals are chosen by."""
        scores = _plus(logits, self.bias)
        _begin_suppress(scores, at_begin, self.begin_ids)
        return scores

    def apply(self, logits: torch.Tensor, seq: torch.Tensor, n_hist: torch.Tensor, begin: torch.Tensor,
              given: torch.Tensor | None = None) -> torch.Tensor:
        """Processed scores at P consecutive positions of every row.

        logits: (B, P, V) raw logits; position j predicts token index n_hist + j of its row.
        seq:    (B, S) long tokens of each row; seq[:, :n_hist + P - 1] must hold the history (committed tokens,
                then the draft tokens being verified).
        n_hist: (B,) long number of tokens before position 0; begin: (B,) long index of the first generated token.
        given:  (B,) long tokens of a given prefix after `begin`, <|0.00|> included (`DecodeState.given`; None: no
                row has one): they count as generated, but at the first position after them timestamps are forced
                only when their total probability beats the text tokens' total, not every single text token
                (text the model would not say spreads its probability over many text tokens: "Spanish lesson:"
                before a translation was closed at once and said again and again; a prefix it would say still
                closes its segment where it would).
        returns: (B, P, V) float32 scores, -inf where a rule forbids the token.
        """
        scores, text = self._scores(logits, seq, n_hist, begin, given)
        if text is not None:  # the text tokens below each position's cut
            scores[..., :self.tokens.timestamp_begin].masked_fill_(self.text_index < text.cut[..., None], NEG_INF)
        return scores

    def greedy(self, logits: torch.Tensor, seq: torch.Tensor, n_hist: torch.Tensor, begin: torch.Tensor,
               given: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What a greedy step takes from `apply`'s scores (arguments as there), without writing the text cut into
        them: (B, P) long the argmax (the first maximum, as `max(-1)`), and (B, P) float32 its log-probability
        (its score less the logsumexp of the position's scores). In timestamp mode both come from reductions the
        rule computes anyway (text maxima) plus the text tokens' logsumexp: three passes over the (B, P, V)
        scores instead of six (the cut's mask, the argmax and the logsumexp of the masked scores)."""
        scores, text = self._scores(logits, seq, n_hist, begin, given, text_sum=True)
        if text is None:
            best, total = _max_logsumexp(scores)
            return best.indices, best.values - total
        ts, eot = self.tokens.timestamp_begin, self.tokens.eot
        cut_all, cut_eot = text.cut == 0, text.cut == eot  # else every text token is cut (text.cut == ts)
        text_best = torch.where(cut_all, text.best.values, torch.where(cut_eot, text.tail.values, NEG_INF))
        text_at = torch.where(cut_all, text.best.indices, text.tail.indices + eot)
        ts_best = scores[..., ts:].max(-1)
        # a timestamp only where it beats the allowed text strictly: on a tie the text token, the lower id, is first
        choice = torch.where(ts_best.values > text_best, ts_best.indices + ts, text_at)
        text_sum = torch.where(cut_all, text.text_sum, torch.where(cut_eot, scores[..., eot:ts].logsumexp(-1), NEG_INF))
        return choice, torch.maximum(text_best, ts_best.values) - torch.logaddexp(text_sum, text.ts_sum)

    def _scores(self, logits: torch.Tensor, seq: torch.Tensor, n_hist: torch.Tensor, begin: torch.Tensor,
                given: torch.Tensor | None, text_sum: bool = False) -> tuple[torch.Tensor, _TextRule | None]:
        """(B, P, V) float32 scores after every rule but the timestamp rule's text cut, and that cut with the
        reductions it was decided by (None without timestamps: the scores are final), with the text scores'
        logsumexp where `text_sum`. Arguments as `apply`."""
        p = logits.shape[1]
        cur_len = n_hist[:, None] + torch.arange(p, device=logits.device)  # (B, P) length of the input so far
        at_begin = cur_len == begin[:, None]
        scores = _plus(logits, self.bias)
        _begin_suppress(scores, at_begin, self.begin_ids)
        if not self.timestamps:
            return scores, None
        after_given = None if given is None else (given > 0)[:, None] & (cur_len == (begin + given)[:, None])
        return scores, self._timestamp_rules(scores, seq, cur_len, begin, at_begin, after_given,
                                             text_sum or given is not None)

    def _timestamp_rules(
        self, scores: torch.Tensor, seq: torch.Tensor, cur_len: torch.Tensor, begin: torch.Tensor,
        at_begin: torch.Tensor, after_given: torch.Tensor | None, text_sum: bool,
    ) -> _TextRule:
        """WhisperTimeStampLogitsProcessor on (B, P, V) `scores` (after the static bias): the timestamp tokens
        masked in place, the text tokens' cut returned (`apply` writes it). after_given: (B, P) the first positions
        after a given prefix (None: none), where the timestamps' total is weighed against the text's total (the
        text_sum reductions must be asked for)."""
        ts, eot = self.tokens.timestamp_begin, self.tokens.eot
        n_seq = seq.shape[1]
        idx = torch.arange(n_seq, device=seq.device)
        is_ts = (seq >= ts) & (idx[None, :] >= begin[:, None])
        # index of the last timestamp token at or before each index (-1: none yet)
        last_ts_idx = torch.where(is_ts, idx[None, :], -1).cummax(dim=1).values

        def at(offset: int, table: torch.Tensor) -> torch.Tensor:
            return table.gather(1, (cur_len - offset).clamp(0, n_seq - 1))

        n_gen = cur_len - begin[:, None]
        last_was_ts = (n_gen >= 1) & (at(1, seq) >= ts)
        penult_was_ts = (n_gen < 2) | (at(2, seq) >= ts)
        last_idx = torch.where(n_gen >= 1, at(1, last_ts_idx), -1)
        last_val = seq.gather(1, last_idx.clamp(min=0))
        ts_last = torch.where(last_was_ts & ~penult_was_ts, last_val, last_val + 1)
        ts_last = torch.where(last_idx >= 0, ts_last, ts) - ts  # (B, P): timestamp indices below it are forbidden

        # timestamps: all after a pair, those before the last one, those past the initial maximum at the start
        ts_floor = torch.where(last_was_ts & penult_was_ts, self.ts_index.shape[0], ts_last)
        ts_ceil = torch.where(at_begin, self.max_initial, self.ts_index.shape[0])
        tsi = self.ts_index
        ts_scores = scores[..., ts:]
        ts_scores.masked_fill_((tsi < ts_floor[..., None]) | (tsi > ts_ceil[..., None]), NEG_INF)
        # text: every text token at the start, those below <|endoftext|> after a lone timestamp, all of them when
        # the timestamps' total probability beats every single text token (the log-softmax normaliser cancels)
        text_cut = torch.where(at_begin, ts, torch.where(last_was_ts & ~penult_was_ts, eot, 0))
        text_scores = scores[..., :ts]
        (best, total), tail = _max_logsumexp(text_scores, text_sum), text_scores[..., eot:].max(-1)
        max_text = torch.where(text_cut == 0, best.values, torch.where(text_cut == eot, tail.values, NEG_INF))
        ts_sum = ts_scores.logsumexp(-1)
        timestamp_due = ts_sum > max_text
        if after_given is not None:  # a given prefix's text ends there (cut 0): totals weighed
            timestamp_due = torch.where(after_given, ts_sum > total, timestamp_due)
        return _TextRule(torch.where(timestamp_due, ts, text_cut), best, tail, ts_sum, total)
