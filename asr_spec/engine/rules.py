"""Whisper's decoding rules, applied exactly as transformers' `WhisperForConditionalGeneration.generate()` applies
them in greedy decoding, but vectorised over rows *and* over the K+1 positions a speculative step verifies.

transformers chains, in this order: `SuppressTokensAtBeginLogitsProcessor` (begin_suppress_tokens at the first
generated position), `SuppressTokensLogitsProcessor` (suppress_tokens) and, in timestamp mode,
`WhisperTimeStampLogitsProcessor` (pairs, monotonic, max initial timestamp, timestamps forced when their total
probability beats every text token). The timestamp rule loops over rows with `.tolist()` per step; here every
per-row decision is a tensor op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @classmethod
    def from_generation_config(cls, gen: Any, max_positions: int) -> "WhisperTokens":
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
        )

    def language_id(self, language: str) -> int | None:
        """Map "en", "english" or "<|en|>" to its token id (None on an English-only model, whose prompt has no
        language token, when the language is English); ValueError naming the language otherwise."""
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        lang = language.lower().strip()
        code = TO_LANGUAGE_CODE.get(lang, lang).strip("<|>")
        if not self.is_multilingual:
            if code != "en":
                raise ValueError(f"language {language!r} was given but the target model is English-only")
            return None
        token = f"<|{code}|>"
        if token not in self.lang_to_id:
            raise ValueError(f"language {language!r} is not supported by this model")
        return self.lang_to_id[token]

    def prompt(self, lang_id: int | None, task: str, timestamps: bool) -> list[int]:
        """Decoder prompt as transformers builds it: sot [lang task] [notimestamps]."""
        tokens = [self.sot]
        if self.is_multilingual:
            if lang_id is None:
                raise ValueError("multilingual model needs a language id (given or detected)")
            tokens += [lang_id, self.task_to_id[task]]
        if not timestamps:
            tokens.append(self.no_timestamps)
        return tokens


class LogitRules:
    """Vectorised Whisper logit rules for one decoding configuration."""

    def __init__(self, tokens: WhisperTokens, vocab_size: int, timestamps: bool, device: torch.device):
        self.tokens = tokens
        self.timestamps = timestamps
        vocab = torch.arange(vocab_size, device=device)
        self.vocab = vocab
        self.suppress = torch.isin(vocab, torch.tensor(tokens.suppress, dtype=torch.long, device=device))
        self.begin_suppress = torch.isin(vocab, torch.tensor(tokens.begin_suppress, dtype=torch.long, device=device))
        ts = tokens.timestamp_begin
        self.is_timestamp = vocab >= ts
        self.below_eot = vocab < tokens.eot
        if tokens.max_initial_timestamp_index is not None:
            self.beyond_initial = vocab > ts + tokens.max_initial_timestamp_index
        else:
            self.beyond_initial = torch.zeros_like(self.is_timestamp)
        self.lang_ids = torch.tensor(sorted(tokens.lang_to_id.values()), dtype=torch.long, device=device)

    def detect_language(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (R, vocab) at the <|startoftranscript|> position -> (R,) most likely language token id."""
        return self.lang_ids[logits[:, self.lang_ids].argmax(-1)]

    def apply(self, logits: torch.Tensor, seq: torch.Tensor, n_hist: torch.Tensor, begin: torch.Tensor) -> torch.Tensor:
        """Processed scores at P consecutive positions of every row.

        logits: (B, P, V) raw logits; position j predicts token index n_hist + j of its row.
        seq:    (B, S) long tokens of each row; seq[:, :n_hist + P - 1] must hold the history (committed tokens,
                then the draft tokens being verified).
        n_hist: (B,) long number of tokens before position 0; begin: (B,) long index of the first generated token.
        returns: (B, P, V) float32 scores, -inf where a rule forbids the token.
        """
        scores = logits.float()
        b, p, _ = scores.shape
        cur_len = n_hist[:, None] + torch.arange(p, device=scores.device)  # (B, P) length of the input so far
        at_begin = cur_len == begin[:, None]
        forbid = self.suppress[None, None, :] | (at_begin[:, :, None] & self.begin_suppress[None, None, :])
        if self.timestamps:
            forbid = forbid | self._timestamp_forbid(seq, cur_len, begin, at_begin)
        scores = scores.masked_fill(forbid, NEG_INF)
        if self.timestamps:
            # timestamps win when their total probability beats every single text token
            logprobs = torch.log_softmax(scores, dim=-1)
            ts = self.tokens.timestamp_begin
            ts_logprob = logprobs[..., ts:].logsumexp(dim=-1)
            max_text = logprobs[..., :ts].max(dim=-1).values
            scores[..., :ts] = scores[..., :ts].masked_fill((ts_logprob > max_text)[..., None], NEG_INF)
        return scores

    def _timestamp_forbid(
        self, seq: torch.Tensor, cur_len: torch.Tensor, begin: torch.Tensor, at_begin: torch.Tensor
    ) -> torch.Tensor:
        """(B, P, V) mask of what WhisperTimeStampLogitsProcessor sets to -inf (before its probability test)."""
        ts = self.tokens.timestamp_begin
        n_seq = seq.shape[1]
        idx = torch.arange(n_seq, device=seq.device)
        generated = idx[None, :] >= begin[:, None]
        is_ts = (seq >= ts) & generated
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
        ts_last = torch.where(last_idx >= 0, ts_last, ts)  # (B, P): timestamps below this are forbidden

        vocab = self.vocab[None, None, :]
        forbid = (vocab == self.tokens.no_timestamps).expand(*cur_len.shape, -1)
        forbid = forbid | ((last_was_ts & penult_was_ts)[..., None] & self.is_timestamp)
        forbid = forbid | ((last_was_ts & ~penult_was_ts)[..., None] & self.below_eot)
        forbid = forbid | (self.is_timestamp & (vocab < ts_last[..., None]))
        forbid = forbid | (at_begin[..., None] & (~self.is_timestamp | self.beyond_initial))
        return forbid
