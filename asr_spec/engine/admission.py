"""Admission: new chunks attached to free batch slots and brought to the state the step expects of every row.

New chunks take the free slots with the lowest indices (`slots.Slots.place`). When those form one run of slots
[first, first + R) (always so for one chunk, and whenever the free slots are the last ones) every step below writes
straight into views of them (`KVCache.rows`); slots apart are admitted in caches of R rows of their own, copied into
the slots at the end (`KVCache.write_rows`). Either way the R chunks go through each pass together, in one batch of
R rows, so a chunk's numbers do not depend on where its slot is (CPU attention rounds by the batch a row is in).
In order:

1. cross-attention: each model's keys/values of the chunks' audio, computed once per chunk;
2. the <|startoftranscript|> pass (language detection, or a one-token prompt): the target's logits there;
3. the prompts, with the detected (or given) language;
4. prefill: each model is fed the prompt but its last token (the step feeds that one), target then draft (a
   feature-conditioned draft with the target's states of the prompt, kept by the target's passes);
5. the rows' decoding state starts, with Whisper's no-speech probability from the target's SOT logits.

The invariant `speculative.step` relies on then holds for the new rows too.
"""

from __future__ import annotations

import torch

from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.features import TargetFeatures
from asr_spec.engine.options import DecodeOptions
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.engine.speculative import DecodeState, Models


class Admission:
    """Admits chunks to slots of one engine's caches and state (its tokens, rules and options fixed)."""

    def __init__(self, tokens: WhisperTokens, rules: LogitRules, options: DecodeOptions, lang_id: int | None):
        """lang_id: the options' language as a token id, None to detect it per chunk (multilingual models)."""
        self.tokens, self.rules = tokens, rules
        self.template = tokens.prompt(tokens.sot, options.task, options.timestamps)
        self.n_prompt = len(self.template)  # the same for every chunk (a detected language replaces a token)
        self.detect = lang_id is None and tokens.is_multilingual
        self.lang_id = tokens.sot if lang_id is None else lang_id  # the language token when not detected
        max_new = options.max_new_tokens or tokens.max_positions
        self.limit = min(self.n_prompt + max_new, tokens.max_positions)  # n_tok at which a row stops

    @torch.inference_mode()
    def __call__(self, m: Models, st: DecodeState, rows: list[int], audio: torch.Tensor,
                 draft_audio: torch.Tensor | None) -> None:
        """Admit R chunks to slots `rows` (ascending).

        audio: (R, n_audio_ctx, d_model) target encoder output; draft_audio: what the draft's cross-attention reads
        (the same, or its own encoder's output), None when the run does not draft.
        """
        r, first = len(rows), rows[0]
        together = rows == list(range(first, first + r))
        caches = m.rows(r, first) if together else self._own_caches(m, r)
        prompts, sot_logits = self._prefill_all(caches, audio, draft_audio)
        index = torch.tensor(rows, device=prompts.device)
        if not together:
            m.target_cache.write_rows(index, caches.target_cache)
            if m.draft_cache is not None:
                m.draft_cache.write_rows(index, caches.draft_cache)
            if m.features is not None:
                m.features.write_rows(index, caches.features)
        st.start(index, prompts, self.limit, self._no_speech_prob(sot_logits))

    def _own_caches(self, m: Models, r: int) -> Models:
        """Caches of R rows for chunks admitted to slots apart: their audio, and their prompts but the last token."""
        n_audio_ctx = m.target_cache.cross_v.shape[3]
        n_positions = max(self.n_prompt - 1, 1)
        draft_cache = None if m.draft is None else m.draft.new_cache(r, n_positions, n_audio_ctx)
        features = None if m.features is None else type(m.features).empty(
            r, max(self.n_prompt - 1, 1), m.target.d_model, m.target.device, m.target.dtype)
        return Models(m.target, m.target.new_cache(r, n_positions, n_audio_ctx), m.draft, draft_cache, features)

    def _prefill_all(self, caches: Models, audio: torch.Tensor,
                     draft_audio: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-4 into R-row caches (views of the slots, or their own); returns the (R, prompt_len) prompts and
        the target's (R, V) logits at the <|startoftranscript|> position."""
        r = len(audio)
        caches.target.write_audio(caches.target_cache, audio)
        detect_pass = self.detect or self.n_prompt == 1
        sot_logits = self._sot_pass(caches) if detect_pass else None
        prompts = self._prompts(self._languages(sot_logits, r, caches.target.device))
        prefill_logits = prefill(caches.target, caches.target_cache, prompts, 0 if sot_logits is None else 1,
                                 caches.features)
        if sot_logits is None:  # the prefill pass started at <|startoftranscript|>: its logits are the same
            sot_logits = prefill_logits
        if caches.draft is not None:
            caches.draft.write_audio(caches.draft_cache, draft_audio)
            if caches.features is None:
                prefill(caches.draft, caches.draft_cache, prompts, 0)
            else:
                caches.features.prefill_draft(caches.draft, caches.draft_cache, prompts)
        return prompts, sot_logits

    def _sot_pass(self, caches: Models) -> torch.Tensor:
        """(R, V) target logits at the <|startoftranscript|> position, from a pass over that token alone (its final
        state kept for a feature-conditioned draft)."""
        dec, cache = caches.target, caches.target_cache
        sot = torch.full((cache.n_rows, 1), self.tokens.sot, device=dec.device)
        if caches.features is not None:
            return caches.features.target_pass(dec, cache, sot, torch.zeros_like(sot), 1, exact=True)[:, 0]
        return dec.forward(cache, sot, torch.zeros_like(sot), 1, exact=True)[:, 0]

    def _languages(self, sot_logits: torch.Tensor | None, r: int, device: torch.device) -> torch.Tensor:
        """(R,) language token ids: detected from the SOT logits, or the one given (ignored by English-only)."""
        if self.detect:
            return self.rules.detect_language(sot_logits.float())
        return torch.full((r,), self.lang_id, device=device)

    def _prompts(self, lang: torch.Tensor) -> torch.Tensor:
        """(R,) language token ids -> (R, prompt_len) prompts, on the device."""
        prompts = torch.tensor(self.template, device=lang.device).repeat(len(lang), 1)
        if self.tokens.is_multilingual:
            prompts[:, 1] = lang
        return prompts

    def _no_speech_prob(self, sot_logits: torch.Tensor) -> torch.Tensor:
        """Whisper's no_speech_prob, (R,) float32: softmax of the raw logits (no rule applied) at <|nospeech|>,
        which precedes <|notimestamps|> in every Whisper vocabulary (transformers' WhisperNoSpeechDetection uses
        the same id)."""
        return sot_logits.float().softmax(-1)[:, self.tokens.no_timestamps - 1]


def prefill(dec: Decoder, cache: KVCache, prompts: torch.Tensor, fed: int,
            features: TargetFeatures | None = None) -> torch.Tensor | None:
    """Feed prompts[:, fed:-1] at their positions into `cache` (the slots' view) that holds `fed` tokens already,
    and set its lengths to prompt_len - 1; returns the (R, V) logits at the first position fed (None when nothing
    was fed). features: the target's final states of the fed positions are kept there (a target's prefill for a
    feature-conditioned draft)."""
    n_prompt = prompts.shape[1]
    logits = None
    if n_prompt - 1 > fed:
        pos = torch.arange(fed, n_prompt - 1, device=prompts.device).expand(len(prompts), -1)
        if features is None:
            logits = dec.forward(cache, prompts[:, fed:-1], pos, n_prompt - 1, prompts.new_zeros(len(prompts), 1),
                                 exact=True)
        else:
            logits = features.target_pass(dec, cache, prompts[:, fed:-1], pos, n_prompt - 1, exact=True)
        logits = logits[:, 0]
    cache.lengths.fill_(n_prompt - 1)
    return logits
