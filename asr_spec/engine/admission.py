"""Admission: new chunks attached to free batch slots and brought to the state the step expects of every row.

The scheduler keeps the live rows first (`slots.Slots`), so the free slots are always the last ones and R new
chunks go to one contiguous run of slots [first, first + R). Every step below writes straight into views of those
slots (`KVCache.rows`, `DecodeState.rows`): nothing is staged apart and copied in. In order:

1. cross-attention: each model's keys/values of the chunks' audio, computed once per chunk, in the slots;
2. the <|startoftranscript|> pass (language detection, or a one-token prompt): the target's logits there;
3. the prompts, with the detected (or given) language;
4. prefill: each model is fed the prompt but its last token (the step feeds that one), target then draft;
5. the rows' decoding state starts, with Whisper's no-speech probability from the target's SOT logits.

The invariant `speculative.step` relies on then holds for the new rows too.
"""

from __future__ import annotations

import torch

from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder import Decoder
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
    def __call__(self, m: Models, st: DecodeState, first: int, audio: torch.Tensor,
                 draft_audio: torch.Tensor | None) -> None:
        """Admit R chunks to slots [first, first + R).

        audio: (R, n_audio_ctx, d_model) target encoder output; draft_audio: what the draft's cross-attention reads
        (the same, or its own encoder's output), None when the run does not draft.
        """
        r = len(audio)
        slots = m.rows(r, first)
        slots.target.write_audio(slots.target_cache, audio)
        sot_logits = self._sot_pass(slots.target, slots.target_cache) if self.detect or self.n_prompt == 1 else None
        prompts = self._prompts(self._languages(sot_logits, r, slots.target.device))
        prefill_logits = prefill(slots.target, slots.target_cache, prompts, 0 if sot_logits is None else 1)
        if sot_logits is None:  # the prefill pass started at <|startoftranscript|>: its logits are the same
            sot_logits = prefill_logits
        if slots.draft is not None:
            slots.draft.write_audio(slots.draft_cache, draft_audio)
            prefill(slots.draft, slots.draft_cache, prompts, 0)
        st.rows(r, first).start(prompts, self.limit, self._no_speech_prob(sot_logits))

    def _sot_pass(self, dec: Decoder, cache: KVCache) -> torch.Tensor:
        """(R, V) target logits at the <|startoftranscript|> position, from a pass over that token alone."""
        sot = torch.full((cache.n_rows, 1), self.tokens.sot, device=dec.device)
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


def prefill(dec: Decoder, cache: KVCache, prompts: torch.Tensor, fed: int) -> torch.Tensor | None:
    """Feed prompts[:, fed:-1] at their positions into `cache` (the slots' view) that holds `fed` tokens already,
    and set its lengths to prompt_len - 1; returns the (R, V) logits at the first position fed (None when nothing
    was fed)."""
    n_prompt = prompts.shape[1]
    logits = None
    if n_prompt - 1 > fed:
        pos = torch.arange(fed, n_prompt - 1, device=prompts.device).expand(len(prompts), -1)
        logits = dec.forward(cache, prompts[:, fed:-1], pos, n_prompt - 1, prompts.new_zeros(len(prompts), 1),
                             exact=True)
        logits = logits[:, 0]
    cache.lengths.fill_(n_prompt - 1)
    return logits
