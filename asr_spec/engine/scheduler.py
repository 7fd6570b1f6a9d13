"""Continuous batching around the speculative step.

Chunks arrive as log-mel features from any iterable (lazily: a long file streams through). The encoder runs
once per batch of chunks; its output is shared by the target and a shared-encoder draft. Whenever a row
finishes, its slot is refilled with the next encoded chunk (its cross-attention keys/values computed once, its
prompt fed by the next step), so the batch stays full until the queue runs dry; then finished rows are dropped
from the batch. Results come back tagged with the chunk id, in the order chunks finish.

A live source (a server's queue) yields None for "nothing right now": the engine then stops filling, drops its idle
rows and keeps decoding the busy ones, and grows the batch back (up to batch_size) when chunks come. An error in
the engine's own work raises `EngineError` naming the chunks lost with it, so a server fails only those requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from asr_spec.engine.decoder import Decoder
from asr_spec.engine.options import DecodeOptions, check_int
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.engine.speculative import FINISH_EOS, FINISH_NONE, DecodeState, Models, step
from asr_spec.engine.pairing import DraftKind, check_pair
from asr_spec.engine.stats import ChunkStats

FINISH_REASONS = {FINISH_EOS: "eos"}
_EXHAUSTED = object()  # the end of the source, told apart from None ("nothing right now")


class EngineError(RuntimeError):
    """The engine's own work (encoding, admitting, a decoding step) raised; the run is over.

    chunk_ids: the chunks lost with it: pulled from the source and not yet yielded (the rows of the failing step
    and any encoded chunks waiting for a row). A new `Engine.run` may carry on from the same source.
    """

    def __init__(self, chunk_ids: tuple[Hashable, ...], cause: BaseException):
        super().__init__(f"engine step failed with {len(chunk_ids)} chunk(s) in flight: "
                         f"{type(cause).__name__}: {cause}")
        self.chunk_ids = chunk_ids


@contextmanager
def _losing(in_flight: set) -> Iterator[None]:
    """Turn an exception of the engine's own work into `EngineError` naming the chunks in flight."""
    try:
        yield
    except Exception as err:
        raise EngineError(tuple(in_flight), err) from err


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

    def _fill_ready(self, source: Iterator[ChunkRequest | None], ready: deque, n_needed: int, batch_size: int,
                    in_flight: set) -> bool:
        """Encode batches of chunks until `n_needed` are ready or the source has nothing right now (it yields
        None); returns False once the source is exhausted. Pulled ids are added to `in_flight`."""
        while len(ready) < n_needed:
            batch: list[ChunkRequest] = []
            request = next(source, _EXHAUSTED)
            while request is not None and request is not _EXHAUSTED:
                batch.append(request)
                in_flight.add(request.id)
                if len(batch) == batch_size:
                    break
                request = next(source, _EXHAUSTED)
            if batch:
                with _losing(in_flight):
                    enc, own = self._encode(batch)
                for i, r in enumerate(batch):
                    ready.append((r, enc[i], None if own is None else own[i]))
            if request is _EXHAUSTED:
                return False
            if request is None:
                return True
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
        if self.tokens.is_multilingual and self.lang_id is None:
            probe = self.target_dec.new_cache(len(rows), 1, 1)  # position 0 only, on the new chunks' audio
            probe.cross_k, probe.cross_v = m.target_cache.cross_k[:, idx], m.target_cache.cross_v[:, idx]
            sot = torch.full((len(rows), 1), self.tokens.sot, device=dev)
            logits = self.target_dec.forward(probe, sot, torch.zeros_like(sot), 1)[:, 0]
            langs = self.rules.detect_language(logits.float()).tolist()
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
    def run(self, requests: Iterable[ChunkRequest | None], batch_size: int = 8) -> Iterator[ChunkResult]:
        """Decode every request, `batch_size` rows at a time; yields one result per request, in the order they
        finish.

        A live source yields None for "nothing right now": the engine stops filling for this step, drops its idle
        rows and decodes the busy ones; with no row busy it asks again at once (so such a source should block
        briefly before a None). The run ends when the source is exhausted and no row is busy. An exception of
        the engine's own work raises `EngineError` with the ids of the chunks lost (see there); one raised by
        the source propagates as it is.
        """
        check_int(batch_size, "batch_size", 1)
        opts, n_rows = self.options, batch_size
        k_max = opts.num_draft_tokens if self.draft_dec is not None else 0
        n_positions = self.tokens.max_positions + k_max + 2
        m = Models(self.target_dec, self.target_dec.new_cache(n_rows, n_positions, self.n_audio_ctx))
        if self.draft_dec is not None:
            m.draft, m.draft_cache = self.draft_dec, self.draft_dec.new_cache(n_rows, n_positions, self.n_audio_ctx)
        st = DecodeState.empty(n_rows, n_positions + k_max + 8, k_max, self.target_dec.device)
        slots: list[ChunkRequest | None] = [None] * n_rows
        source, ready, more = iter(requests), deque(), True
        in_flight: set = set()  # ids pulled from the source and not yet yielded: lost if the engine raises
        max_len = 0
        while True:
            n_free = slots.count(None) + n_rows - len(slots)  # free slots + rows dropped while idle
            n_pending = 1
            if n_free and more:
                more = self._fill_ready(source, ready, n_free, batch_size, in_flight)
            if n_free and ready:
                take = [ready.popleft() for _ in range(min(n_free, len(ready)))]
                with _losing(in_flight):
                    if slots.count(None) < len(take):  # grow back: copies of row 0, overwritten by _admit
                        grow = len(take) - slots.count(None)
                        self._keep_rows(m, st, list(range(len(slots))) + [0] * grow)
                        slots += [None] * grow
                    rows = [i for i, s in enumerate(slots) if s is None][: len(take)]
                    n_pending = self._admit(m, st, rows, take)
                for row, (req, _, _) in zip(rows, take):
                    slots[row] = req
                max_len = max(max_len, n_pending)
            if all(s is None for s in slots):
                if not more:
                    return
                continue  # a live source has nothing right now and no row is busy: ask it again
            with _losing(in_flight):
                if not ready and None in slots:  # nothing waiting: drop the idle rows
                    keep = [i for i, s in enumerate(slots) if s is not None]
                    self._keep_rows(m, st, keep)
                    slots = [slots[i] for i in keep]
                step(m, self.rules, st, k_max, n_pending, max_len)
                host = torch.cat([st.finish, st.n_tok.max()[None]]).tolist()  # the step's one sync
            finish, max_len = host[:-1], host[-1]
            for row, code in enumerate(finish):
                if code != FINISH_NONE and slots[row] is not None:
                    result = self._result(slots[row], st, row, code)
                    in_flight.discard(result.id)
                    yield result
                    slots[row] = None

    @staticmethod
    def _keep_rows(m: Models, st: DecodeState, keep: list[int]) -> None:
        """Rows `keep` of the batch, in that order (an index twice copies that row: the batch grows)."""
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
        return ChunkResult(req.id, tuple(seq[begin:]), tuple(seq[:begin]), FINISH_REASONS.get(code, "length"), stats)

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
