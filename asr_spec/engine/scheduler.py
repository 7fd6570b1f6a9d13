"""Continuous batching around the speculative step.

Chunks arrive as log-mel features from any iterable (lazily: a long file streams through). The encoder runs
once per batch of chunks; its output is shared by the target and a shared-encoder draft. Whenever a row
finishes, its slot is refilled with the next encoded chunk (its cross-attention keys/values computed once, its
prompt fed by the next step), so the batch stays full until the queue runs dry; then finished rows are dropped
from the batch. Results come back tagged with the chunk id, in the order chunks finish.

A live source (a server's queue) yields None for "nothing right now": the engine then stops filling and keeps
decoding the busy rows (the step runs on the first n_active slots, so idle slots cost nothing). An error in the
engine's own work raises `EngineError` naming the chunks lost with it, so a server fails only those requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from asr_spec.engine import memory
from asr_spec.engine.cache import KVCache
from asr_spec.engine.capture import HostReader, StepRunner, n_keys_bucket
from asr_spec.engine.decoder import Decoder, bf16_copy
from asr_spec.engine.encoder import Encoder
from asr_spec.engine.kernels import onednn_usable
from asr_spec.engine.options import DecodeOptions, check_int
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.engine.speculative import FINISH_EOS, FINISH_NONE, DecodeState, Models, step
from asr_spec.engine.pairing import DraftKind, check_pair
from asr_spec.engine.stats import ChunkStats

FINISH_REASONS = {FINISH_EOS: "eos"}


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
    encoded:  optional (n_audio_ctx, d_model) target encoder output the engine gave before (`ChunkResult.encoded`,
              e.g. to decode the same audio twice, greedy and speculative); features may then be None unless the
              draft has its own encoder.
    keep_encoded: return the chunk's target encoder output with its result (`ChunkResult.encoded`), e.g. for the
              word-timestamp alignment pass; off by default (it holds n_audio_ctx x d_model values per chunk).
    """

    id: Hashable
    features: torch.Tensor | None
    encoded: torch.Tensor | None = None
    keep_encoded: bool = False


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
    # (n_audio_ctx, d_model) the target encoder output it was decoded from, when the request asked to keep it
    encoded: torch.Tensor | None = field(default=None, compare=False, repr=False)


class Engine:
    """Lossless batched speculative decoding of Whisper chunks (greedy when `draft` is None).

    The contract. In fp32 the output is token-identical to transformers `generate()` greedy, except at a checked
    top-2 tie. In fp16/bf16 a (K+1)-token verify pass and a 1-token step round differently, so the promise is:
    every emitted token is the target's own argmax (after Whisper's rules) at that position in the pass that
    emitted it; outputs may differ from another batch composition or from `generate()` only where the top two
    logits are within rounding.

    target: a transformers `WhisperForConditionalGeneration`, eval mode, on its device and dtype.
    draft:  None, a `WhisperForCausalLM` (reads the target's encoder output) or a `WhisperForConditionalGeneration`
            (its own encoder, run once on the same features; dropped in favour of the target's when identical).
            A draft carrying a `draft_vocab_ids` (V',) long tensor proposes only from those tokens.
    share:  an engine of the same target whose encoder and target decoder this one reuses (with their packed CPU
            weight copies), e.g. a greedy engine beside a speculative one.
    """

    def __init__(self, target: nn.Module, draft: nn.Module | None = None, options: DecodeOptions = DecodeOptions(),
                 runner: StepRunner | None = None, share: Engine | None = None):
        self.kind = check_pair(target, draft)
        self.target, self.draft, self.options = target, draft, options
        self.tokens = WhisperTokens.from_generation_config(target.generation_config, target.config.max_target_positions)
        self.lang_id = None if options.language is None else self.tokens.language_id(options.language)
        placeholder = self.tokens.sot if self.lang_id is None else self.lang_id  # detected later: same length
        prompt_len = len(self.tokens.prompt(placeholder, options.task, options.timestamps))
        self.prompt_len = prompt_len  # the same for every chunk (a detected language replaces the placeholder)
        if options.max_new_tokens is not None and prompt_len + options.max_new_tokens > self.tokens.max_positions:
            raise ValueError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({options.max_new_tokens}) exceeds the model's "
                f"max_target_positions ({self.tokens.max_positions})"
            )
        # share: another engine of the same target, whose encoder and decoder (their packed weight copies on CPU)
        # this one uses too instead of making its own
        same = share is not None and share.target is target
        self.encoder = share.encoder if same else Encoder(target.model.encoder)
        # the target's head is certified (read in bf16, decisions exact) from <|endoftext|> on, with the tokens
        # Whisper's rules suppress by id kept exact
        certify = (self.tokens.eot, self.tokens.suppress + self.tokens.begin_suppress)
        self.target_dec = share.target_dec if same else Decoder(target.model.decoder, target.proj_out,
                                                                certify=certify)
        self.draft_dec = None if draft is None else Decoder(
            *self._draft_modules(draft), getattr(draft, "draft_vocab_ids", None))
        self.draft_encoder = Encoder(draft.model.encoder) if self.kind is DraftKind.OWN_ENCODER else None
        self.rules = LogitRules(self.tokens, self.target_dec.vocab_size, options.timestamps, self.target_dec.device)
        self.n_audio_ctx = target.config.max_source_positions
        # runner: how the step runs (tests pass a wrapped one); by default CUDA graphs on CUDA (unless
        # options.cuda_graphs is False), eager on CPU (measured fastest there: docs/engine-step.md)
        graphs = self.target_dec.device.type == "cuda" and options.cuda_graphs
        self.runner = runner or StepRunner("cuda-graphs" if graphs else "eager")
        self.read_lag: int | None = None  # steps between a step and the host reading its finished rows (HostReader)

    def _draft_modules(self, draft: nn.Module) -> tuple[nn.Module, nn.Module]:
        """The draft's decoder and projection as the step runs them: bf16 copies on a CPU fp32 target when the
        draft reads the target's encoder output and bf16 products are native (options.draft_bf16)."""
        dev = self.target_dec.device
        lower = (self.options.draft_bf16 and self.kind is DraftKind.SHARED_ENCODER and dev.type == "cpu"
                 and self.target_dec.dtype == torch.float32 and onednn_usable(dev, torch.bfloat16))
        return bf16_copy(draft) if lower else (draft.model.decoder, draft.proj_out)

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
            own = list(self.draft_encoder(x))
        return enc, own

    def _fill_ready(self, source: Iterator[ChunkRequest | None], ready: deque, n_needed: int,
                    batch_size: int, in_flight: set) -> bool:
        """Encode batches of chunks until `n_needed` are ready or the source has nothing right now (it yields
        None); returns False once the source is exhausted. Pulled ids are added to `in_flight`."""
        while len(ready) < n_needed:
            batch, more = [], True
            while len(batch) < batch_size:
                req = next(source, StopIteration)
                if req is StopIteration or req is None:
                    more = req is None
                    break
                batch.append(req)
                in_flight.add(req.id)
            if batch:
                with _losing(in_flight):
                    enc, own = self._encode(batch)
                for i, r in enumerate(batch):
                    ready.append((r, enc[i], None if own is None else own[i]))
            if len(batch) < batch_size:
                return more
        return True

    # -- admission ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _admit(self, m: Models, st: DecodeState, rows: list[int], items: list) -> torch.Tensor | None:
        """Attach encoded chunks to free slots `rows` and prefill their prompts (the eager admission step): each
        model gets the new chunks' audio in a staging cache, detects the language there when asked (a pass at the
        <|startoftranscript|> position), is fed the prompt but its last token, and the staging cache is stored in
        the slots. Returns the target's (R, V) logits at the <|startoftranscript|> position (from the language
        probe or the prefill pass; None only for a one-token prompt, whose SOT is fed by the first step)."""
        dev = self.target_dec.device
        idx = torch.tensor(rows, device=dev)
        enc = torch.stack([e for _, e, _ in items])
        n_prompt, r = self.prompt_len, len(rows)
        # contiguous free slots (always so for one chunk): the audio's keys/values are written there directly
        first = rows[0] if rows == list(range(rows[0], rows[0] + len(rows))) else None
        staged = self.target_dec.stage(enc, n_prompt - 1, None if first is None else (m.target_cache, first))
        sot_logits = None
        detect = self.lang_id is None and self.tokens.is_multilingual
        if detect or n_prompt == 1:  # a pass at the SOT position alone (else the prefill pass starts there)
            sot = torch.full((r, 1), self.tokens.sot, device=dev)
            sot_logits = self.target_dec.forward(staged, sot, torch.zeros_like(sot), 1, exact=True)[:, 0]
        if detect:
            lang = self.rules.detect_language(sot_logits.float())
        else:
            lang = torch.full((r,), self.tokens.sot if self.lang_id is None else self.lang_id, device=dev)
        prompts = self._prompts(lang)
        prefill_logits = self._prefill(self.target_dec, staged, prompts, 0 if sot_logits is None else 1)
        if sot_logits is None:  # the prefill pass started at <|startoftranscript|>: its logits are the same
            sot_logits = prefill_logits
        m.target_cache.commit(idx, staged)
        if m.draft is not None:
            draft_audio = enc if self.kind is DraftKind.SHARED_ENCODER else torch.stack([o for _, _, o in items])
            d_staged = m.draft.stage(draft_audio, n_prompt - 1, None if first is None else (m.draft_cache, first))
            self._prefill(m.draft, d_staged, prompts, 0)
            m.draft_cache.commit(idx, d_staged)
        max_new = self.options.max_new_tokens or self.tokens.max_positions
        st.seq[idx, :n_prompt] = prompts
        st.n_tok[idx] = n_prompt
        st.begin[idx] = n_prompt
        st.limit[idx] = min(n_prompt + max_new, self.tokens.max_positions)
        st.finish[idx] = FINISH_NONE
        st.stats[idx] = 0
        st.hist[idx] = 0
        # Whisper's no_speech_prob: softmax of the raw logits (no rule applied) at <|nospeech|>, which precedes
        # <|notimestamps|> in every Whisper vocabulary (transformers' WhisperNoSpeechDetection uses the same id)
        st.logp[idx, 0] = 0.0
        st.logp[idx, 1] = sot_logits.float().softmax(-1)[:, self.tokens.no_timestamps - 1]
        return sot_logits

    def _prompts(self, lang: torch.Tensor) -> torch.Tensor:
        """(R,) language token ids (ignored by an English-only model) -> (R, prompt_len) prompts, on the device."""
        template = self.tokens.prompt(self.tokens.sot, self.options.task, self.options.timestamps)
        prompts = torch.tensor(template, device=lang.device).repeat(len(lang), 1)
        if self.tokens.is_multilingual:
            prompts[:, 1] = lang
        return prompts

    @staticmethod
    def _prefill(dec: Decoder, staged: KVCache, prompts: torch.Tensor, fed: int) -> torch.Tensor | None:
        """Feed prompts[:, fed:-1] at their positions into a staging cache that holds `fed` tokens already;
        returns the (R, V) logits at the first position fed (None when nothing was fed)."""
        n_prompt = prompts.shape[1]
        logits = None
        if n_prompt - 1 > fed:
            pos = torch.arange(fed, n_prompt - 1, device=prompts.device).expand(len(prompts), -1)
            logits = dec.forward(staged, prompts[:, fed:-1], pos, n_prompt - 1, prompts.new_zeros(len(prompts), 1),
                                 exact=True)
            logits = logits[:, 0]
        staged.lengths.fill_(n_prompt - 1)
        return logits

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self, requests: Iterable[ChunkRequest | None], batch_size: int = 8) -> Iterator[ChunkResult]:
        """Decode every request, at most `batch_size` rows at a time (never more rows than chunks); yields one
        result per request, in the order they finish. A source may yield None ("nothing right now": see the module
        doc); the run ends when it is exhausted and no row is busy. Errors: see `EngineError`.

        Slots are fixed: new chunks fill the free slots with the lowest indices; when nothing waits for a finished
        row's slot, the last live row moves into it, so the step runs on the first n_active slots (views, no copy).
        Shapes then depend only on (n_active, n_keys bucket, K)."""
        check_int(batch_size, "batch_size", 1)
        k = self.options.num_draft_tokens if self.draft_dec is not None else 0
        n_positions = self.tokens.max_positions + k + 2
        source, ready = iter(requests), deque()
        in_flight: set = set()  # ids pulled from the source and not yet yielded: lost if the engine raises
        more = self._first_fill(source, ready, batch_size, in_flight, self._run_shape(n_positions, k))
        n_rows = batch_size if more else min(batch_size, len(ready))  # never a slot for a chunk that does not exist
        if n_rows == 0:
            return
        m, st, k = self._allocate(n_rows, n_positions, k)
        slots: list[ChunkRequest | None] = [None] * n_rows
        since = [0] * n_rows  # number of the last step before each slot's occupant was placed there
        reader = HostReader(n_rows, self.target_dec.device, self.read_lag)
        max_len, n_step = 0, 0
        while True:
            free = [i for i, s in enumerate(slots) if s is None]
            if free and more:
                more = self._fill_ready(source, ready, len(free), min(batch_size, memory.MAX_ENCODE_BATCH),
                                        in_flight)
            if free and ready:
                take = [ready.popleft() for _ in range(min(len(free), len(ready)))]
                with _losing(in_flight):
                    self._admit(m, st, free[: len(take)], take)
                for row, (req, enc, _) in zip(free, take):
                    slots[row], since[row] = replace(req, encoded=enc) if req.keep_encoded else req, n_step
                max_len = max(max_len, self.prompt_len)
            with _losing(in_flight):
                n_active = self._pack(m, st, slots, since, n_step, min(max_len + k + 2, n_positions))
            if n_active == 0:
                if not more and not ready:
                    return
                continue
            n_keys = n_keys_bucket(max_len, k, reader.lag, n_positions)
            # eager steps run in inference mode (~0.3 ms a step less dispatch); traced and captured ones in no_grad
            with _losing(in_flight), (torch.inference_mode() if self.runner.mode == "eager" else torch.no_grad()):
                self.runner(m.rows(n_active), self.rules, st.rows(n_active), k, n_keys)
                n_step += 1
                if reader.lag == 0:
                    reader.push(st.rows(n_active), n_step)
                read = reader.pull()  # on CUDA: the previous step's, the one just queued is not waited for
                if reader.lag:
                    reader.push(st.rows(n_active), n_step)
            if read is not None:
                tag, finish, max_len = read
                max_len = max(max_len, self.prompt_len)
                done = [r for r, code in enumerate(finish)
                        if code != FINISH_NONE and slots[r] is not None and tag > since[r]]
                for result in self._results(slots, st, done, finish):
                    in_flight.discard(result.id)
                    yield result
                for r in done:
                    slots[r] = None

    def _first_fill(self, source: Iterator[ChunkRequest | None], ready: deque, batch_size: int, in_flight: set,
                    run: memory.RunShape) -> bool:
        """Encode up to `batch_size` chunks, one micro-batch at a time, checking after each that a batch of the
        chunks seen so far fits in memory (ResourceError at once when not); returns whether more chunks may come.
        Stops early when a live source has nothing right now."""
        micro, more = min(batch_size, memory.MAX_ENCODE_BATCH), True
        while more and len(ready) < batch_size:
            want = min(batch_size, len(ready) + micro)
            more = self._fill_ready(source, ready, want, micro, in_flight)
            reason = memory.check_fits(run, len(ready), memory.free_bytes(self.target_dec.device))
            if reason is not None:
                raise memory.ResourceError(reason)
            if more and len(ready) < want:  # the source yielded None
                break
        return more

    def _run_shape(self, n_positions: int, k_max: int) -> memory.RunShape:
        def shape(dec: Decoder) -> memory.DecoderShape:
            return memory.DecoderShape(dec.n_layers, dec.n_heads, dec.head_dim, dec.dtype.itemsize)

        models = [self.target] + ([self.draft] if self.draft is not None else [])
        model_bytes = sum(p.numel() * p.element_size() for model in models for p in model.parameters())
        return memory.RunShape(shape(self.target_dec), None if self.draft_dec is None else shape(self.draft_dec),
                               n_positions, self.n_audio_ctx, self.target.config.d_model, self.target_dec.vocab_size,
                               k_max, model_bytes)

    def _allocate(self, n_rows: int, n_positions: int, k: int) -> tuple[Models, DecodeState, int]:
        """The caches and decoding state of `n_rows` slots, allocated once per run, and the run's K: 0 (greedy, the
        draft not even given the chunks) when the run has more rows than options.draft_max_rows."""
        limit = self.options.draft_max_rows
        k = 0 if limit is not None and n_rows > limit else k
        m = Models(self.target_dec, self.target_dec.new_cache(n_rows, n_positions, self.n_audio_ctx))
        if self.draft_dec is not None and k > 0:
            m.draft, m.draft_cache = self.draft_dec, self.draft_dec.new_cache(n_rows, n_positions, self.n_audio_ctx)
        return m, DecodeState.empty(n_rows, n_positions + k + 8, k, self.target_dec.device), k

    @staticmethod
    def _pack(m: Models, st: DecodeState, slots: list, since: list[int], n_step: int, n_positions: int) -> int:
        """Move the last live rows into the holes before them so the live rows are slots [0, n); returns n."""
        n_live = sum(s is not None for s in slots)
        holes = [i for i in range(n_live) if slots[i] is None]
        tail = [i for i in range(n_live, len(slots)) if slots[i] is not None]
        for dst, src in zip(holes, tail):
            m.target_cache.move_row(src, dst, n_positions)
            if m.draft_cache is not None:
                m.draft_cache.move_row(src, dst, n_positions)
            st.move_row(src, dst)
            slots[dst], slots[src], since[dst] = slots[src], None, n_step
        return n_live

    @staticmethod
    def _results(slots: list, st: DecodeState, done: list[int], finish: list[int]) -> list[ChunkResult]:
        """The results of finished rows `done`, read from the device in one copy per state field."""
        if not done:
            return []
        idx = torch.tensor(done, device=st.n_tok.device)
        seqs, begins, n_toks = st.seq[idx].tolist(), st.begin[idx].tolist(), st.n_tok[idx].tolist()
        stats, hists, logps = st.stats[idx].tolist(), st.hist[idx].tolist(), st.logp[idx].tolist()
        out = []
        for i, row in enumerate(done):
            begin, n_tok = begins[i], n_toks[i]
            target_passes, draft_passes, drafted, accepted = stats[i]
            chunk_stats = ChunkStats(1, n_tok - begin, target_passes, draft_passes, drafted, accepted,
                                     tuple(hists[i]))
            sum_logprob, no_speech_prob = logps[i]
            # Whisper divides by the text tokens + 1: the generated count with a final <|endoftext|>, one more without
            avg_logprob = sum_logprob / (n_tok - begin + (finish[row] != FINISH_EOS))
            out.append(ChunkResult(slots[row].id, tuple(seqs[i][begin:n_tok]), tuple(seqs[i][:begin]),
                                   FINISH_REASONS.get(finish[row], "length"), chunk_stats, no_speech_prob,
                                   avg_logprob, slots[row].encoded if slots[row].keep_encoded else None))
        return out

    @torch.inference_mode()
    def encode(self, features: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
        """(N, n_mels, n_frames) -> (N, n_audio_ctx, d_model) target encoder output, batch_size at a time."""
        x = features.to(self.target_dec.device, self.target_dec.dtype)
        return torch.cat([self.encoder(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])

    def decode(self, features: torch.Tensor | None, encoded: torch.Tensor | None = None,
               batch_size: int = 8) -> list[ChunkResult]:
        """Decode N chunks given as (N, n_mels, n_frames) features and/or (N, n_audio_ctx, d) encoder outputs,
        `batch_size` rows at a time; results in input order."""
        n = len(features) if features is not None else len(encoded)
        reqs = (ChunkRequest(i, None if features is None else features[i], None if encoded is None else encoded[i])
                for i in range(n))
        results = {r.id: r for r in self.run(reqs, batch_size)}
        return [results[i] for i in range(n)]
