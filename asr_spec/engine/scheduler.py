"""Continuous batching around the speculative step.

Chunks arrive as log-mel features from any iterable (lazily: a long file streams through). The encoder runs
once per batch of chunks; its output is shared by the target and a shared-encoder draft. Whenever a row
finishes, its slot is refilled with the next encoded chunk (its cross-attention keys/values computed once, its
prompt fed by the next step), so the batch stays full until the queue runs dry; then finished rows are dropped
from the batch. Results come back tagged with the chunk id, in the order chunks finish.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from asr_spec.engine import memory
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.options import DecodeOptions
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.engine.speculative import FINISH_EOS, FINISH_NONE, DecodeState, Models, step
from asr_spec.engine.pairing import DraftKind, check_pair
from asr_spec.engine.stats import ChunkStats
from asr_spec.errors import ResourceError

FINISH_REASONS = {FINISH_EOS: "eos"}


@dataclass(frozen=True)
class ChunkRequest:
    """One 30 s window to decode.

    features: (n_mels, n_frames) log-mel, n_frames = 2 * the encoder's positions.
    encoded:  optional (n_audio_ctx, d_model) target encoder output already computed (e.g. to decode the same
              audio twice, greedy and speculative); features may then be None unless the draft has its own encoder.
    """

    id: Hashable
    features: torch.Tensor | None
    encoded: torch.Tensor | None = None


@dataclass(frozen=True)
class ChunkResult:
    id: Hashable
    tokens: tuple[int, ...]  # generated tokens (prompt excluded), ending with <|endoftext|> when finished by it
    prompt: tuple[int, ...]
    finish_reason: str  # "eos" or "length" (max_new_tokens or max_target_positions)
    stats: ChunkStats
    # Whisper's window statistics, from the target's logits only (so identical with or without a draft):
    no_speech_prob: float = float("nan")  # P(<|nospeech|>) at the SOT position, from the raw logits
    avg_logprob: float = float("nan")  # sum of the tokens' log-probabilities / (text tokens + 1), as Whisper


class Engine:
    """Lossless batched speculative decoding of Whisper chunks (greedy when `draft` is None).

    target: a transformers `WhisperForConditionalGeneration`, eval mode, on its device and dtype.
    draft:  None, a `WhisperForCausalLM` (reads the target's encoder output) or a `WhisperForConditionalGeneration`
            (its own encoder, run once on the same features; dropped in favour of the target's when identical).
            A draft carrying a `draft_vocab_ids` (V',) long tensor proposes only from those tokens.
    """

    def __init__(self, target: nn.Module, draft: nn.Module | None = None, options: DecodeOptions = DecodeOptions()):
        self.kind = check_pair(target, draft)
        self.target, self.draft, self.options = target, draft, options
        self.tokens = WhisperTokens.from_generation_config(target.generation_config, target.config.max_target_positions)
        self.lang_id = None if options.language is None else self.tokens.language_id(options.language)
        placeholder = self.tokens.sot if self.lang_id is None else self.lang_id  # detected later: same length
        prompt_len = len(self.tokens.prompt(placeholder, options.task, options.timestamps))
        if options.max_new_tokens is not None and prompt_len + options.max_new_tokens > self.tokens.max_positions:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({options.max_new_tokens}) exceeds the model's "
                f"max_target_positions ({self.tokens.max_positions})"
            )
        self.target_dec = Decoder(target.model.decoder, target.proj_out)
        self.draft_dec = None if draft is None else Decoder(
            draft.model.decoder, draft.proj_out, getattr(draft, "draft_vocab_ids", None))
        self.rules = LogitRules(self.tokens, self.target_dec.vocab_size, options.timestamps, self.target_dec.device)
        self.n_audio_ctx = target.config.max_source_positions

    # -- encoding -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _encode(self, batch: list[ChunkRequest]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Target encoder outputs (n_audio_ctx, d) of a batch of chunks — one encoder pass for those not encoded
        yet — and the draft's own encoder outputs when it has its own encoder."""
        dev, dtype = self.target_dec.device, self.target_dec.dtype
        need = [r for r in batch if r.encoded is None]
        if any(r.features is None for r in need) or (
            self.kind is DraftKind.OWN_ENCODER and any(r.features is None for r in batch)
        ):
            raise ValueError("a chunk request has neither features nor (usable) encoder output")
        fresh = iter(self.encode(torch.stack([r.features for r in need]), len(need)) if need else [])
        enc = [r.encoded.to(dev, dtype) if r.encoded is not None else next(fresh) for r in batch]
        own = None
        if self.kind is DraftKind.OWN_ENCODER:
            x = torch.stack([r.features for r in batch]).to(dev, self.draft_dec.dtype)
            own = list(self.draft.model.encoder(input_features=x).last_hidden_state)
        return enc, own

    def _fill_ready(self, source: Iterator[ChunkRequest], ready: deque, n_needed: int) -> bool:
        """Encode micro-batches of chunks until `n_needed` are ready; returns False once the source is exhausted."""
        while len(ready) < n_needed:
            batch = [r for _, r in zip(range(min(n_needed - len(ready), memory.MAX_ENCODE_BATCH)), source)]
            if not batch:
                return False
            enc, own = self._encode(batch)
            for i, r in enumerate(batch):
                ready.append((r, enc[i], None if own is None else own[i]))
        return True

    # -- admission ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _admit(self, m: Models, st: DecodeState, rows: list[int], items: list) -> int:
        """Attach encoded chunks to free slots `rows`; returns the longest prompt among them."""
        dev = self.target_dec.device
        idx = torch.tensor(rows, device=dev)
        enc = torch.stack([e for _, e, _ in items])
        self.target_dec.attach(m.target_cache, idx, enc)
        if m.draft is not None:
            draft_audio = enc if self.kind is DraftKind.SHARED_ENCODER else torch.stack([o for _, _, o in items])
            m.draft.attach(m.draft_cache, idx, draft_audio)
        # one pass at position 0 (the SOT token) on the new chunks' audio: language and no-speech probability
        probe = self.target_dec.new_cache(len(rows), 1, 1)
        probe.cross_k, probe.cross_v = m.target_cache.cross_k[:, idx], m.target_cache.cross_v[:, idx]
        sot = torch.full((len(rows), 1), self.tokens.sot, device=dev)
        logits = self.target_dec.forward(probe, sot, torch.zeros_like(sot), 1)[:, 0].float()  # (R, V)
        # Whisper's no_speech_prob: softmax of the raw logits (no rule applied) at <|nospeech|>, which precedes
        # <|notimestamps|> in every Whisper vocabulary (transformers' WhisperNoSpeechDetection uses the same id)
        st.logp[idx, 0] = 0.0
        st.logp[idx, 1] = logits.softmax(-1)[:, self.tokens.no_timestamps - 1]
        if self.tokens.is_multilingual and self.lang_id is None:
            langs = self.rules.detect_language(logits).tolist()
        else:
            langs = [self.lang_id] * len(rows)
        prompts = [self.tokens.prompt(lang, self.options.task, self.options.timestamps) for lang in langs]
        n_prompt = max(len(p) for p in prompts)
        for row, p in zip(rows, prompts):
            st.seq[row, : len(p)] = torch.tensor(p, device=dev)
        plen = torch.tensor([len(p) for p in prompts], device=dev)
        max_new = self.options.max_new_tokens or self.tokens.max_positions
        st.n_tok[idx] = plen
        st.begin[idx] = plen
        st.limit[idx] = torch.clamp(plen + max_new, max=self.tokens.max_positions)
        st.finish[idx] = FINISH_NONE
        st.stats[idx] = 0
        st.hist[idx] = 0
        return n_prompt

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self, requests: Iterable[ChunkRequest], batch_size: int = 8) -> Iterator[ChunkResult]:
        """Decode every request, `batch_size` rows at a time; yields one result per request, in the order they
        finish."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        opts = self.options
        k_max = opts.num_draft_tokens if self.draft_dec is not None else 0
        n_positions = self.tokens.max_positions + k_max + 2
        source, ready = iter(requests), deque()
        more = self._first_fill(source, ready, batch_size, self._run_shape(n_positions, k_max))
        n_rows = batch_size if more else len(ready)  # never a slot for a chunk that does not exist
        if n_rows == 0:
            return
        m = Models(self.target_dec, self.target_dec.new_cache(n_rows, n_positions, self.n_audio_ctx))
        if self.draft_dec is not None:
            m.draft, m.draft_cache = self.draft_dec, self.draft_dec.new_cache(n_rows, n_positions, self.n_audio_ctx)
        st = DecodeState.empty(n_rows, n_positions + k_max + 8, k_max, self.target_dec.device)
        slots: list[ChunkRequest | None] = [None] * n_rows
        max_len = 0
        while True:
            free = [i for i, s in enumerate(slots) if s is None]
            n_pending = 1
            if free and more:
                more = self._fill_ready(source, ready, len(free))
            if free and ready:
                take = [ready.popleft() for _ in range(min(len(free), len(ready)))]
                rows = free[: len(take)]
                n_pending = self._admit(m, st, rows, take)
                for row, (req, _, _) in zip(rows, take):
                    slots[row] = req
                max_len = max(max_len, n_pending)
            if all(s is None for s in slots):
                return
            if not more and not ready and any(s is None for s in slots):
                keep = [i for i, s in enumerate(slots) if s is not None]
                self._keep_rows(m, st, keep)
                slots = [slots[i] for i in keep]
            step(m, self.rules, st, k_max, n_pending, max_len)
            host = torch.cat([st.finish, st.n_tok.max()[None]]).tolist()  # the step's one sync
            finish, max_len = host[:-1], host[-1]
            for row, code in enumerate(finish):
                if code != FINISH_NONE and slots[row] is not None:
                    yield self._result(slots[row], st, row, code)
                    slots[row] = None

    def _first_fill(self, source: Iterator[ChunkRequest], ready: deque, batch_size: int,
                    run: memory.RunShape) -> bool:
        """Encode up to `batch_size` chunks, one micro-batch at a time, checking after each that a batch of the
        chunks seen so far fits in memory (ResourceError at once when not); returns whether more chunks may come."""
        more = True
        while more and len(ready) < batch_size:
            more = self._fill_ready(source, ready, min(batch_size, len(ready) + memory.MAX_ENCODE_BATCH))
            reason = memory.check_fits(run, len(ready), memory.free_bytes(self.target_dec.device))
            if reason is not None:
                raise ResourceError(reason)
        return more

    def _run_shape(self, n_positions: int, k_max: int) -> memory.RunShape:
        def shape(dec: Decoder) -> memory.DecoderShape:
            return memory.DecoderShape(dec.n_layers, dec.n_heads, dec.head_dim, dec.dtype.itemsize)

        models = [self.target] + ([self.draft] if self.draft is not None else [])
        model_bytes = sum(p.numel() * p.element_size() for model in models for p in model.parameters())
        return memory.RunShape(shape(self.target_dec), None if self.draft_dec is None else shape(self.draft_dec),
                               n_positions, self.n_audio_ctx, self.target.config.d_model, self.target_dec.vocab_size,
                               k_max, model_bytes)

    @staticmethod
    def _keep_rows(m: Models, st: DecodeState, keep: list[int]) -> None:
        idx = torch.tensor(keep, device=st.n_tok.device)
        st.keep_rows(idx)
        m.target_cache.keep_rows(idx)
        if m.draft_cache is not None:
            m.draft_cache.keep_rows(idx)

    @staticmethod
    def _result(req: ChunkRequest, st: DecodeState, row: int, code: int) -> ChunkResult:
        begin, n_tok = int(st.begin[row]), int(st.n_tok[row])
        seq = st.seq[row, :n_tok].tolist()
        target_passes, draft_passes, drafted, accepted = st.stats[row].tolist()
        stats = ChunkStats(1, n_tok - begin, target_passes, draft_passes, drafted, accepted,
                           tuple(st.hist[row].tolist()))
        sum_logprob, no_speech_prob = st.logp[row].tolist()
        # Whisper divides by the text tokens + 1: the generated count with a final <|endoftext|>, one more without
        avg_logprob = sum_logprob / (n_tok - begin + (code != FINISH_EOS))
        return ChunkResult(req.id, tuple(seq[begin:]), tuple(seq[:begin]), FINISH_REASONS.get(code, "length"), stats,
                           no_speech_prob, avg_logprob)

    @torch.inference_mode()
    def encode(self, features: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
        """(N, n_mels, n_frames) -> (N, n_audio_ctx, d_model) target encoder output, batch_size at a time."""
        x = features.to(self.target_dec.device, self.target_dec.dtype)
        return torch.cat([self.target.model.encoder(input_features=x[i:i + batch_size]).last_hidden_state
                          for i in range(0, len(x), batch_size)])

    def decode(self, features: torch.Tensor | None, encoded: torch.Tensor | None = None,
               batch_size: int = 8) -> list[ChunkResult]:
        """Decode N chunks given as (N, n_mels, n_frames) features and/or (N, n_audio_ctx, d) encoder outputs,
        `batch_size` rows at a time; results in input order."""
        n = len(features) if features is not None else len(encoded)
        reqs = (ChunkRequest(i, None if features is None else features[i], None if encoded is None else encoded[i])
                for i in range(n))
        results = {r.id: r for r in self.run(reqs, batch_size)}
        return [results[i] for i in range(n)]
