"""Admission: new chunks attached to free batch slots and brought to the state the step expects of every row.

New chunks take the free slots with the lowest indices (`slots.Slots.place`). When those form one run of slots
[first, first + R) (always so for one chunk, and whenever the free slots are the last ones) every step below writes
straight into views of them (`KVCache.rows`); slots apart are admitted in caches of R rows of their own, copied into
the slots at the end (`KVCache.write_rows`). Either way the R chunks go through each pass together, in one batch of
R rows, so a chunk's numbers do not depend on where its slot is (CPU attention rounds by the batch a row is in).
In order:

1. cross-attention: each model's keys/values of the chunks' audio, computed once per chunk;
2. the <|startoftranscript|> pass (language detection, or a one-token prompt): the target's logits there;
3. the prompts, with the detected (or given) language: a row of a language group its group's (`GroupLanguages`);
4. prefill: each model is fed the prompt but its last token (the step feeds that one), target then draft (a
   feature-conditioned draft with the target's states of the prompt, kept by the target's passes);
5. the rows' decoding state starts, with Whisper's no-speech probability from the target's SOT logits.

A row's prompt is ``[<|startofprev|> previous text] sot [language task] [<|notimestamps|>] [<|0.00|>] [prefix]``
(`RowPrompt`): rows of one admission may differ in length. They are fed right-padded in one pass (a row's padding
lies past its own tokens, so causal attention never lets its real tokens see it, and its cache length stops before
it: stale entries, overwritten as the row decodes). Each row's `begin` (the first token Whisper's rules treat as
generated) is right after its SOT sequence, so a prefix counts as generated and previous text never does; the
no-speech probability is read at its own SOT position. Language detection reads a pass over <|startoftranscript|>
alone, without the previous text, as openai-whisper and transformers detect it.

The invariant `speculative.step` relies on then holds for the new rows too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.features import TargetFeatures
from asr_spec.engine.options import DecodeOptions
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.engine.speculative import DecodeState, Models


@dataclass(frozen=True)
class RowPrompt:
    """What one chunk's decoder prompt holds besides the SOT sequence (`ChunkRequest.prompt`, `.prefix`).

    previous: token ids after <|startofprev|> (the prompt); prefix: the forced start of the transcript; given:
    whether the prefix is a user's (`ChunkRequest.prefix_given`: the totals decide a timestamp after it);
    max_new: the most tokens the row generates after them (`ChunkRequest.max_new_tokens`; None: the options');
    group: the chunk's language group (`ChunkRequest.language_group`); language: the language token it is decoded in
    (`ChunkRequest.language_token`; None: the options' or its group's)."""

    previous: tuple[int, ...] = ()
    prefix: tuple[int, ...] = ()
    given: bool = False
    max_new: int | None = None
    group: Hashable | None = None
    language: int | None = None


NO_PROMPT = RowPrompt()
LANGUAGE_GROUPS = 4096  # language groups remembered (`GroupLanguages`): far more files than are ever in flight
# a detection this sure settles its group's language (faster-whisper's language_detection_threshold); a less sure
# one (a first chunk of a second's "Bonjour", of music) leaves the group open, its chunk decoded in the language
# the group's detections so far give the most probability in all (`GroupLanguages`)
LANGUAGE_SURE = 0.5


class GroupLanguages:
    """The language each group's chunks are decoded in (`ChunkRequest.language_group`), kept for the last
    LANGUAGE_GROUPS groups seen (a server's run goes on for days). A group is settled by its first chunk detected
    with probability >= LANGUAGE_SURE; until then each chunk is decoded in the language its group's detections so
    far, its own included, give the most probability in all (faster-whisper pools unsure detections over segments
    too), so the chunks of a file no detection is sure of do not each take a language of their own."""

    def __init__(self, size: int = LANGUAGE_GROUPS):
        # group -> its language token id once settled, else the (L,) sum of its chunks' detections
        self.size, self.known = size, OrderedDict()

    def settle(self, probs: torch.Tensor, lang_ids: Sequence[int], groups: Sequence[Hashable | None]) -> list[int]:
        """Each row's language token.

        probs: (R, L) each row's detected probabilities of the L languages `lang_ids` (`LogitRules.
        detect_language`), rows in admission order (a file's first chunk before its later ones), so what a
        group's choice pools does not depend on the batch; groups: (R,) each row's group, None for none (its own
        detection, always)."""
        out = []
        for row, group in zip(probs.float().cpu(), groups):
            known = self.known.get(group) if group is not None else None
            if isinstance(known, int):
                out.append(known)
                continue
            entry = lang_ids[int(row.argmax())] if float(row.max()) >= LANGUAGE_SURE else (
                row if known is None else known + row)
            out.append(entry if isinstance(entry, int) else lang_ids[int(entry.argmax())])
            if group is not None:
                self.known[group] = entry
                self.known.move_to_end(group)
                if len(self.known) > self.size:
                    self.known.popitem(last=False)
        return out


class Admission:
    """Admits chunks to slots of one engine's caches and state (its tokens, rules and options fixed)."""

    def __init__(self, tokens: WhisperTokens, rules: LogitRules, options: DecodeOptions, lang_id: int | None):
        """lang_id: the options' language as a token id, None to detect it (multilingual models): per chunk, or per
        language group (`GroupLanguages`)."""
        self.tokens, self.rules = tokens, rules
        self.template = tokens.prompt(tokens.sot, options.task, options.timestamps)
        self.n_prompt = len(self.template)  # the SOT sequence, the same for every chunk (a detected language
        # replaces a token)
        self.timestamps = options.timestamps
        self.detect = lang_id is None and tokens.is_multilingual
        self.lang_id = tokens.sot if lang_id is None else lang_id  # the language token when not detected
        self.lang_ids = rules.lang_ids.tolist()  # the language tokens, in the order of a detection's columns
        self.max_new = options.max_new_tokens or tokens.max_positions

    def refusal(self, chunk_id: object, prompt: RowPrompt, hypothesis: tuple[int, ...] = ()) -> str | None:
        """Why this model cannot decode a chunk, one line naming it (`chunk_id`) and the cause; None when it can.
        The one check of what a request asks of the model, not known when the request is made (`ChunkRequest`
        checks the rest): its prompt and prefix, and its hypothesis's ids (engine/hypothesis.py). The engine refuses
        such a chunk alone (engine/refusals.py)."""
        limit, vocab = self.tokens.max_prompt_tokens, self.rules.bias.shape[0]
        for name, ids in (("prompt", prompt.previous), ("prefix", prompt.prefix)):
            if len(ids) > limit:
                return f"chunk {chunk_id!r}: {name} of {len(ids)} tokens, more than the model's {limit}"
            if any(not 0 <= t < vocab for t in ids):
                return f"chunk {chunk_id!r}: {name} holds a value that is not a token id of the model"
            # a forced <|endoftext|> ended nothing: the row decoded on past it to the last position (any other
            # token the target may generate is taken: a live stream forces its previous hypothesis as it came)
            if self.tokens.eot in ids:
                return f"chunk {chunk_id!r}: {name} holds <|endoftext|> ({self.tokens.eot})"
        if prompt.previous and self.tokens.sot_prev is None:
            return f"chunk {chunk_id!r}: a prompt was given but the model's generation config has no prev_sot_token_id"
        if self.length(prompt) >= self.tokens.max_positions:
            return (f"chunk {chunk_id!r}: prompt and prefix leave no room in the model's "
                    f"{self.tokens.max_positions} positions")
        if (prompt.language is not None and self.tokens.is_multilingual
                and prompt.language not in self.tokens.lang_to_id.values()):
            return f"chunk {chunk_id!r}: language token {prompt.language} is not one of the model's languages"
        bad = [t for t in hypothesis if t >= vocab]
        if bad:
            return f"chunk {chunk_id!r}: hypothesis holds {bad[0]!r}, not a token id below {vocab}"
        return None

    def length(self, prompt: RowPrompt) -> int:
        """Tokens of a row's whole prompt (its n_tok when admitted)."""
        n_previous = len(prompt.previous) + 1 if prompt.previous else 0
        n_prefix = len(prompt.prefix) + 1 if prompt.prefix and self.timestamps else len(prompt.prefix)
        return n_previous + self.n_prompt + n_prefix

    def forced(self, prompt: RowPrompt) -> int:
        """Tokens of a row's prefix, <|0.00|> included: the start of its transcript that was not decoded."""
        return self.length(prompt) - self.n_prompt - (len(prompt.previous) + 1 if prompt.previous else 0)

    @torch.inference_mode()
    def __call__(self, m: Models, st: DecodeState, rows: list[int], audio: torch.Tensor,
                 draft_audio: torch.Tensor | None, prompts: Sequence[RowPrompt] | None = None,
                 groups: GroupLanguages | None = None) -> None:
        """Admit R chunks to slots `rows` (ascending).

        audio: (R, n_audio_ctx, d_model) target encoder output; draft_audio: what the draft's cross-attention reads
        (the same, or its own encoder's output), None when the run does not draft; prompts: each chunk's previous
        text and prefix (none of them refused by `refusal`), None for none; groups: the run's language groups
        (`Engine.run` keeps one per run: two runs open at once key their files 0, 1, ... alike), None for none.
        """
        r, first = len(rows), rows[0]
        prompts = [NO_PROMPT] * r if prompts is None else list(prompts)
        together = rows == list(range(first, first + r))
        n_longest = max(self.length(p) for p in prompts)
        caches = m.rows(r, first) if together else self._own_caches(m, r, n_longest)
        seqs, lengths, begin, sot_logits = self._prefill_all(caches, audio, draft_audio, prompts,
                                                             GroupLanguages() if groups is None else groups)
        given = torch.tensor([self.forced(p) if p.given else 0 for p in prompts], device=lengths.device)
        index = torch.tensor(rows, device=seqs.device)
        if not together:
            m.target_cache.write_rows(index, caches.target_cache)
            if m.draft_cache is not None:
                m.draft_cache.write_rows(index, caches.draft_cache)
            if m.features is not None:
                m.features.write_rows(index, caches.features)
        max_new = torch.tensor([self.max_new if p.max_new is None else min(p.max_new, self.max_new) for p in prompts],
                               device=lengths.device, dtype=lengths.dtype)
        limit = torch.clamp(lengths + max_new, max=self.tokens.max_positions)
        st.start(index, seqs, limit, self._no_speech_prob(sot_logits), lengths=lengths, begin=begin, given=given)

    def _own_caches(self, m: Models, r: int, n_longest: int) -> Models:
        """Caches of R rows for chunks admitted to slots apart: their audio, and their prompts (the longest whole,
        for a pass that reads the SOT logits of a row whose SOT is its last token)."""
        n_audio_ctx = m.target_cache.cross_v.shape[3]
        draft_cache = None if m.draft is None else m.draft.new_cache(r, n_longest, n_audio_ctx)
        features = None if m.features is None else type(m.features).empty(
            r, n_longest, m.target.d_model, m.target.device, m.target.dtype)
        return Models(m.target, m.target.new_cache(r, n_longest, n_audio_ctx), m.draft, draft_cache, features)

    def _prefill_all(self, caches: Models, audio: torch.Tensor, draft_audio: torch.Tensor | None,
                     prompts: list[RowPrompt], groups: GroupLanguages) -> tuple[torch.Tensor, ...]:
        """Steps 1-4 into R-row caches (views of the slots, or their own); returns the (R, L) right-padded prompts,
        their (R,) lengths and begins, and the target's (R, V) logits at each row's <|startoftranscript|>."""
        caches.target.write_audio(caches.target_cache, audio)
        any_previous = any(p.previous for p in prompts)
        all_single = all(self.length(p) == 1 for p in prompts)
        sot_logits = None
        if self.detect or all_single:
            sot_logits = self._sot_pass(caches)
        langs = self._languages(sot_logits, prompts, groups)
        seqs, lengths, sot_index = self._prompts(langs, prompts, caches.target.device)
        fed = 1 if sot_logits is not None and not any_previous else 0  # the SOT pass's key/values are kept
        # the SOT logits come from the SOT pass when its key/values are kept (fed = 1), else from this prefill
        prefill_logits = prefill(caches.target, caches.target_cache, seqs, lengths, fed,
                                 sot_index if fed == 0 else None, caches.features)
        if fed == 0 and prefill_logits is not None:  # the prefill pass went through every row's SOT position
            sot_logits = prefill_logits
        if caches.draft is not None:
            caches.draft.write_audio(caches.draft_cache, draft_audio)
            if caches.features is None:
                prefill(caches.draft, caches.draft_cache, seqs, lengths, 0)
            else:  # fed the target's states of each row's prompt, kept by the passes above
                caches.features.prefill_draft(caches.draft, caches.draft_cache, seqs, lengths)
        return seqs, lengths, sot_index + self.n_prompt, sot_logits

    def _sot_pass(self, caches: Models) -> torch.Tensor:
        """(R, V) target logits at the <|startoftranscript|> position, from a pass over that token alone (its final
        state kept for a feature-conditioned draft)."""
        dec, cache = caches.target, caches.target_cache
        sot = torch.full((cache.n_rows, 1), self.tokens.sot, device=dec.device)
        if caches.features is not None:
            return caches.features.target_pass(dec, cache, sot, torch.zeros_like(sot), 1, exact=True)[:, 0]
        return dec.forward(cache, sot, torch.zeros_like(sot), 1, exact=True)[:, 0]

    def _languages(self, sot_logits: torch.Tensor | None, prompts: list[RowPrompt],
                   groups: GroupLanguages) -> list[int]:
        """R language token ids: detected from the SOT logits (the one host read of an admission: the prompts are
        built on the host), a row of a language group taking what its group chooses (`groups`); or the one given
        (ignored by English-only); a row's own (`RowPrompt.language`) before either."""
        langs = [self.lang_id] * len(prompts)
        if self.detect:
            probs = self.rules.detect_language(sot_logits.float())
            keys = [p.group if p.language is None else None for p in prompts]  # a given language settles none
            langs = groups.settle(probs, self.lang_ids, keys)
        return [lang if p.language is None else p.language for lang, p in zip(langs, prompts)]

    def _prompts(self, lang: list[int], prompts: list[RowPrompt], device: torch.device) -> tuple[torch.Tensor, ...]:
        """R language token ids -> the (R, L) prompts right-padded with <|endoftext|> to the longest (L = its
        length), their (R,) lengths and the (R,) index of each one's <|startoftranscript|>, on `device`."""
        rows = []
        for lang_id, p in zip(lang, prompts):
            template = list(self.template)
            if self.tokens.is_multilingual:
                template[1] = lang_id
            previous = [self.tokens.sot_prev, *p.previous] if p.previous else []
            stamp = [self.tokens.timestamp_begin] if p.prefix and self.timestamps else []
            rows.append(previous + template + stamp + list(p.prefix))
        n_longest = max(len(row) for row in rows)
        seqs = torch.tensor([row + [self.tokens.eot] * (n_longest - len(row)) for row in rows], device=device)
        lengths = torch.tensor([len(row) for row in rows], device=device)
        sot_index = torch.tensor([len(p.previous) + 1 if p.previous else 0 for p in prompts], device=device)
        return seqs, lengths, sot_index

    def _no_speech_prob(self, sot_logits: torch.Tensor) -> torch.Tensor:
        """Whisper's no_speech_prob, (R,) float32: softmax of the raw logits (no rule applied) at <|nospeech|>,
        which precedes <|notimestamps|> in every Whisper vocabulary (transformers' WhisperNoSpeechDetection uses
        the same id)."""
        return sot_logits.float().softmax(-1)[:, self.tokens.no_timestamps - 1]


def prefill(dec: Decoder, cache: KVCache, prompts: torch.Tensor, lengths: torch.Tensor, fed: int,
            sot_index: torch.Tensor | None = None, features: TargetFeatures | None = None) -> torch.Tensor | None:
    """Feed the (R, L) `prompts`, right-padded to the longest (L = lengths.max(), so known without a host read),
    from position `fed` (the tokens `cache`, the slots' view, holds already) up to each row's last token but one,
    and set the cache's lengths to `lengths` - 1 (R,). Returns the
    (R, V) logits at each row's `sot_index` (R,) (None when not asked or nothing was fed); every such index must be
    >= fed. Rows are fed together: [fed, L - 1), or [fed, L) when a SOT index asked for is a row's last token.
    features: the target's final states of the fed positions are kept there (a target's prefill for a
    feature-conditioned draft)."""
    end = prompts.shape[1] - 1
    if sot_index is not None:
        end = max(end, int(sot_index.max()) + 1)
    logits = None
    if end > fed:
        pos = torch.arange(fed, end, device=prompts.device).expand(len(prompts), -1)
        at = prompts.new_zeros(len(prompts), 1) if sot_index is None else (sot_index - fed)[:, None]
        if features is None:
            logits = dec.forward(cache, prompts[:, fed:end], pos, end, at, exact=True)[:, 0]
        else:
            logits = features.target_pass(dec, cache, prompts[:, fed:end], pos, end, exact=True, logit_index=at)[:, 0]
    cache.lengths.copy_(lengths - 1)
    return None if sot_index is None else logits
