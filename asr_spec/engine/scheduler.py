"""Continuous batching around the speculative step.

Chunks arrive as log-mel features from any iterable (lazily: a long file streams through). The encoder runs
once per batch of chunks (`Feed`); its output is shared by the target and a shared-encoder draft. Whenever rows
finish, their slots are refilled with the next encoded chunks (`admission.Admission`: cross-attention keys/values
computed once, prompts prefilled) and the live rows packed first (`slots.Slots`), so the batch stays full until the
queue runs dry; then the step runs on fewer rows. Results come back tagged with the chunk id, in the
order chunks finish.

A live source (a server's queue) yields None for "nothing right now": the engine then stops filling and keeps
decoding the busy rows (the step runs on the first n_active slots, so idle slots cost nothing). An error in the
engine's own work raises `EngineError` naming the chunks lost with it, so a server fails only those requests; a
request this model cannot take (a prompt over its limit) is refused alone, its result carrying the cause
(engine/refusals.py).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from dataclasses import replace

import torch
from torch import nn

from asr_spec.engine import int8, memory
from asr_spec.engine.admission import Admission, GroupLanguages, RowPrompt
from asr_spec.engine.capture import HostReader, StepRunner, all_n_keys_buckets, n_keys_bucket, pin_attention
from asr_spec.engine.decoder import Decoder, bf16_copy
from asr_spec.engine.encoder import Encoder
from asr_spec.engine.encoding import ChunkEncoder
from asr_spec.engine.features import TargetFeatures
from asr_spec.engine.feed import Encoded, Feed
from asr_spec.engine.hypothesis import Hypotheses
from asr_spec.engine.kernels import onednn_usable
from asr_spec.engine.options import DecodeOptions, check_int
from asr_spec.engine.pairing import DraftKind, check_pair
from asr_spec.engine.refusals import Refusals
from asr_spec.engine.requests import ChunkRequest, ChunkResult
from asr_spec.engine.results import finished_results
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.engine.slots import Slots
from asr_spec.engine.speculative import FINISH_LENGTH, DecodeState, Models
from asr_spec.engine.state import RunState, StaticState
from asr_spec.engine.stats import StageTimes
from asr_spec.engine.withdrawals import Withdrawals


def _release(st: DecodeState, rows: list[int]) -> None:
    """Mark slots `rows`, left by their rows, finished on the device (a step over them masks them)."""
    if rows:
        st.finish[torch.tensor(rows, device=st.finish.device)] = FINISH_LENGTH


def _row_prompt(req: ChunkRequest) -> RowPrompt:
    """A request's previous text, prefix, token limit and language group, as admission takes them."""
    return RowPrompt(tuple(req.prompt), tuple(req.prefix), req.prefix_given, req.max_new_tokens, req.language_group,
                     req.language_token)


# tokens each row of a warm-up generates (`Engine.warm_up`): its admission, then a step or two (a speculative one
# where the run drafts)
WARM_UP_TOKENS = 4


class Engine:
    """Lossless batched speculative decoding of Whisper chunks (greedy when `draft` is None).

    The contract. In fp32 the output is token-identical to transformers `generate()` greedy, except at a checked
    top-2 tie. On a CPU in bf16/fp16 whose products the decoder found row-invariant (`Decoder.row_rows` > 0:
    `kernels.decoder_blocks`), a (K+1)-token verify pass gives each position bit for bit what a 1-token step gives
    it, whatever the batch: speculative == greedy token for token, at any batch composition. Elsewhere in fp16/bf16
    (CUDA; a CPU whose kernels are not row-invariant) a verify pass and a step round differently, so the promise
    is: every emitted token is the target's own argmax (after Whisper's rules) at that position in the pass that
    emitted it; outputs may differ from another batch composition only where the top two logits are within
    rounding. In bf16 and fp16 outputs may differ from `generate()` (other kernels) only at such near-ties.

    target: a transformers `WhisperForConditionalGeneration`, eval mode, on its device and dtype.
    draft:  None, a `WhisperForCausalLM` (reads the target's encoder output) or a `WhisperForConditionalGeneration`
            (its own encoder, run once on the same features; dropped in favour of the target's when identical).
            A draft carrying a `draft_vocab_ids` (V',) long tensor proposes only from those tokens; one carrying a
            `step_decoder` runs through the Decoder it makes (a benchmark's oracle: `engine/oracle.py`; a
            feature-conditioned draft's `FeatureDecoder`: `engine/features.py`).
    Any number of engines over the same target (a greedy one beside a speculative one) hold one set of its packed
    CPU weight copies: they are shared per weight tensor (`kernels.shared`).
    """

    def __init__(self, target: nn.Module, draft: nn.Module | None = None, options: DecodeOptions = DecodeOptions(),
                 runner: StepRunner | None = None):
        self.kind = check_pair(target, draft)
        self.target, self.draft, self.options = target, draft, options
        self.tokens = WhisperTokens.from_generation_config(target.generation_config, target.config.max_target_positions)
        lang_id = None if options.language is None else self.tokens.language_id(options.language)
        # the same for every chunk (a detected language replaces the SOT placeholder)
        self.prompt_len = len(self.tokens.prompt(self.tokens.sot, options.task, options.timestamps))
        if options.max_new_tokens is not None and self.prompt_len + options.max_new_tokens > self.tokens.max_positions:
            raise ValueError(
                f"prompt ({self.prompt_len} tokens) + max_new_tokens ({options.max_new_tokens}) exceeds the model's "
                f"max_target_positions ({self.tokens.max_positions})"
            )
        for name in ("num_draft_tokens", "num_hypothesis_tokens"):  # (10**6 drafted for minutes; 10**20 crashed)
            if getattr(options, name) >= self.tokens.max_positions:
                raise ValueError(f"{name} ({getattr(options, name)}) must be below the model's max_target_positions "
                                 f"({self.tokens.max_positions}): a window holds no more tokens")
        # the target's head is certified (read in bf16, decisions exact) from <|endoftext|> on, with the tokens
        # Whisper's rules suppress by id kept exact, unless options.certified_head is off (and only where a bf16
        # product runs it: head.approximate_product)
        certify = (self.tokens.eot, self.tokens.suppress + self.tokens.begin_suppress)
        # the int8 precision, which the loader marks on the target's encoder (`int8.request`), also holds the fp32
        # decoders' audio keys/values in int8 or bf16 as `int8.audio_dtype` says and their step weights in bf16
        # (target and draft alike: a draft's rounding changes only its proposals, which the target verifies)
        int8_precision = int8.requested(target.model.encoder)
        self.target_dec = Decoder(target.model.decoder, target.proj_out,
                                  certify=certify if options.certified_head else None, int8_precision=int8_precision)
        # a draft carrying `step_decoder` (a Decoder subclass, called as Decoder is) is run through it: the
        # benchmarks' oracle draft (engine/oracle.py); the step only ever sees a Decoder
        make_draft = getattr(draft, "step_decoder", Decoder)
        self.draft_dec = None if draft is None else make_draft(
            *self._draft_modules(draft), getattr(draft, "draft_vocab_ids", None), int8_precision=int8_precision)
        # a plain draft's proposals are chosen from its restricted vocabulary's logits, if it has one (a draft with
        # its own step decoder, feature-conditioned or an oracle, gives logits over the whole vocabulary)
        draft_vocab = self.draft_dec.vocab_ids if self.draft_dec is not None and make_draft is Decoder else None
        self.rules = LogitRules(self.tokens, self.target_dec.vocab_size, options.timestamps, self.target_dec.device,
                                draft_vocab)
        self.sampling_rules = self.rules.with_sampling()  # for the steps whose batch has a sampled row
        self.admission = Admission(self.tokens, self.rules, options, lang_id)
        self.n_audio_ctx = target.config.max_source_positions
        # self-attention cache positions per row: max_target_positions + K + 2, with the K of a loaded draft also in
        # runs that decode without it (one cache size, and so the same key buckets, for every run of this engine)
        self.n_positions = self.tokens.max_positions + (options.num_draft_tokens if draft is not None else 0) + 2
        # runner: how the step runs (tests pass a wrapped one); by default CUDA graphs on CUDA (unless
        # options.cuda_graphs is False), eager on CPU (measured fastest there: docs/engine-step.md)
        pin_attention(self.target_dec.device)  # no cuDNN attention on CUDA (capture.py)
        graphs = self.target_dec.device.type == "cuda" and options.cuda_graphs
        self.runner = runner or StepRunner("cuda-graphs" if graphs else "eager")
        self.times = StageTimes()  # wall seconds per stage on a CPU (benchmarks read it)
        # the target's encoder, and a draft's own where it has one: run by `encoding` alone
        own = Encoder(draft.model.encoder) if self.kind is DraftKind.OWN_ENCODER else None
        self.encoding = ChunkEncoder(Encoder(target.model.encoder), own, self.target_dec.device,
                                     self.target_dec.dtype, None if self.draft_dec is None else self.draft_dec.dtype,
                                     self.times)
        self._eager = StepRunner()  # the steps of a run in a private state (engine/state.py)
        self.read_lag: int | None = None  # steps between a step and the host reading its finished rows (HostReader)
        # the static state of the runs, reset in place run after run; replaced (and the runner's graphs dropped)
        # only for a run of more slots or another K (engine/state.py)
        self.states = StaticState(self._allocate, lambda: self.runner.drop_graphs())
        self.withdrawals = Withdrawals()  # requests whose rows are freed before the next step (`withdraw`)

    @property
    def encoder(self) -> Encoder:
        """The target's encoder as the engine runs it (`encoding.encoder`; benchmarks and tests read it)."""
        return self.encoding.encoder

    def _draft_modules(self, draft: nn.Module) -> tuple[nn.Module, nn.Module]:
        """The draft's decoder and projection as the step runs them: bf16 copies on a CPU fp32 target when the
        draft reads the target's encoder output and bf16 products are native (options.draft_bf16)."""
        dev = self.target_dec.device
        lower = (self.options.draft_bf16 and self.kind is DraftKind.SHARED_ENCODER and dev.type == "cpu"
                 and self.target_dec.dtype == torch.float32 and onednn_usable(dev, torch.bfloat16))
        return bf16_copy(draft) if lower else (draft.model.decoder, draft.proj_out)

    def warm_up(self, batch_size: int = 8) -> None:
        """One run over `batch_size` windows of zero features, `WARM_UP_TOKENS` tokens each, its results dropped: a
        long-running server (`asr-spec serve`) then holds from its start what its runs of `batch_size` rows use (the
        state of that many rows, every row's audio keys/values written, so that its memory is resident, and a batch
        that cannot fit fails at start saying what fits; the encoder's buffers of a full call), and each product has
        made what it makes at its first call. Its stage times count in `times` like any run's."""
        zeros = torch.zeros(self.target.config.num_mel_bins, 2 * self.n_audio_ctx)
        requests = [ChunkRequest(("warm-up", i), zeros, max_new_tokens=WARM_UP_TOKENS) for i in range(batch_size)]
        for _ in self.run(requests, batch_size):
            pass

    def encode(self, features: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
        """(N, n_mels, n_frames) -> (N, n_audio_ctx, d_model) target encoder output, batch_size at a time."""
        return self.encoding(features, batch_size)

    # -- the loop -------------------------------------------------------------------------------------------
    def run(self, requests: Iterable[ChunkRequest | None], batch_size: int = 8) -> Iterator[ChunkResult]:
        """Decode every request, at most `batch_size` rows at a time (never more rows than chunks); yields one
        result per request, in the order they finish. A source may yield None ("nothing right now": see the module
        doc); the run ends when it is exhausted and no row is busy. Errors: see `EngineError`.

        Slots are fixed: new chunks fill the free slots with the lowest indices; when nothing waits for a finished
        row's slot, the last live row moves into it (`Slots.pack`), so the step runs on the first n_active slots
        (views, no copy; with CUDA graphs the first rows-bucket slots: `StepRunner.step_rows`). Shapes then depend
        only on (rows, n_keys bucket, K). The slots are the engine's static state, lent to one run at a time."""
        check_int(batch_size, "batch_size", 1)
        feed = Feed(iter(requests), self.encoding.batch, self.encode_batch(batch_size))
        refusals = Refusals(self._refusal, feed.in_flight)
        feed.source = refusals.screen(feed.source)  # a request this model cannot take is refused alone
        n_rows = self._first_fill(feed, batch_size)
        if n_rows == 0:
            yield from refusals.drain()
            return
        k = self._k(n_rows)
        with self.states.lease(n_rows, k) as state:  # the engine's static state, reset (engine/state.py)
            runner = self._eager if state.private else self.runner  # graphs are bound to the held state
            # language groups are a run's own: another run's input 0, even one open at once, is another file
            yield from self._decode(feed, refusals, state, n_rows, k, runner, GroupLanguages())

    def _decode(self, feed: Feed, refusals: Refusals, state: RunState, n_rows: int, k: int,
                runner: StepRunner, groups: GroupLanguages) -> Iterator[ChunkResult]:
        """`run`'s loop over `n_rows` slots (the first of `state`) at K = `k`, steps by `runner`: withdraw, fill (the
        requests `refusals` refused yielded at once), admit, pack, step, read, yield the finished rows' results. A
        slot left by its row (withdrawn, or moved by `pack`) is marked finished on the device at once, so a step
        over more rows than the live ones (a rows bucket) masks it. A row still busy after more steps than any row
        can take raises (`_check_progress`). groups: the run's language groups (`admission.GroupLanguages`)."""
        m, st, hyp = state.m, state.st, state.hyp
        slots: Slots[ChunkRequest] = Slots(n_rows)
        reader = HostReader(n_rows, self.target_dec.device, self.read_lag)
        max_len = 0  # the longest row's n_tok as last read from the device (HostReader)
        while True:
            if self.withdrawals:
                _release(st, self.withdrawals.evict(slots.occupants, feed.ready, feed.in_flight))
            if slots.n_free and feed.more:
                feed.fill(slots.n_free)
            yield from refusals.drain()
            if slots.n_free and feed.ready:
                with feed.losing():
                    max_len = max(max_len, self._admit(m, st, hyp, slots, feed.take(slots.n_free), groups))
            with feed.losing():
                moves = slots.pack()
                for src, dst in moves:
                    m.move_row(src, dst, min(max_len + max(k, hyp.width) + 2, self.n_positions))
                    st.move_row(src, dst)
                    hyp.move_row(src, dst)
                _release(st, [src for src, _ in moves])
            if slots.n_live == 0:
                if feed.done:
                    return
                continue
            with feed.losing():
                read = self._step(m, st, hyp, slots, reader, k, max_len, runner)
                self._check_progress(slots, reader.lag)
            if read is not None:
                tag, finish, longest = read
                # rows placed after the step read have prompts the read did not see (CUDA reads a step late)
                max_len = max(longest, self.prompt_len, *(self.admission.length(_row_prompt(req))
                                                          for req in slots.placed_since(tag)))
                for result in finished_results(st, hyp, slots.finish(tag, finish), finish, self._forced):
                    feed.done_with(result.id)
                    yield result

    def _check_progress(self, slots: Slots[ChunkRequest], lag: int) -> None:
        """RuntimeError naming the chunks when a row has been in its slot for more steps than any row can take:
        each step commits at least one token of a live row, so a row ends within max_target_positions steps and
        is seen `lag` steps later. Past that a step does not advance its rows (a graph replayed on memory that is
        not the state's): the run stops instead of looping for ever."""
        max_steps = self.tokens.max_positions + lag + 2
        stuck = slots.overdue(max_steps)
        if stuck:
            raise RuntimeError(f"chunk(s) {[req.id for req in stuck][:4]} still decoding after {max_steps} steps: "
                               "the step does not advance its rows")

    def capture_ahead(self, batch_size: int) -> int:
        """Capture now the step graphs a run of `batch_size` rows of greedy chunks without hypotheses can need:
        every rows bucket x n_keys bucket at that run's K, on the state such a run decodes in (all slots free, so
        each step masks every row and changes nothing). A server calls it before its first request, a benchmark
        before timing. Only with a CUDA-graph runner (returns 0 otherwise: an eager step has nothing to capture);
        returns the steps run. Sampled or hypothesis steps are still captured when first met."""
        check_int(batch_size, "batch_size", 1)
        if self.runner.mode != "cuda-graphs":
            return 0
        k = self._k(batch_size)
        self._check_fits(batch_size)
        rows = sorted({self.runner.step_rows(n, batch_size) for n in range(1, batch_size + 1)})
        keys = all_n_keys_buckets(self.n_positions)
        with self.states.lease(batch_size, k) as state:
            if state.private:  # a run holds the engine's state: nothing to capture on
                return 0
            for n_rows in rows:
                for n_keys in keys:
                    self.runner(state.m.rows(n_rows), self.rules, state.st.rows(n_rows), k, n_keys)
        return len(rows) * len(keys)

    def withdraw(self, chunk_id: Hashable) -> None:
        """Free the row of request `chunk_id` before the next step of the run decoding it, or drop it if it waits
        for a row; it yields no result (any thread: a server whose client went away). See `withdrawals.py`."""
        self.withdrawals.add(chunk_id)

    def _first_fill(self, feed: Feed, batch_size: int) -> int:
        """Encode up to `batch_size` chunks, one micro-batch at a time, checking after each that a run of the
        chunks seen so far fits in memory (ResourceError at once when not); stops early when a live source has
        nothing right now. Returns the run's rows, checked to fit too: batch_size while more chunks may come, else
        the chunks there are (never a slot for a chunk that does not exist)."""
        while feed.more and len(feed.ready) < batch_size:
            want = min(batch_size, len(feed.ready) + feed.micro_batch)
            feed.fill(want)
            self._check_fits(min(batch_size, len(feed.ready)))
            if feed.more and len(feed.ready) < want:  # the source yielded None
                break
        n_rows = batch_size if feed.more else min(batch_size, len(feed.ready))
        self._check_fits(n_rows)
        return n_rows

    def _k(self, n_rows: int) -> int:
        """Draft tokens per step of a run of `n_rows` rows: the options' K when a draft is loaded and the options
        let it decode runs of this size (`DecodeOptions.drafts`), else 0 (greedy, the draft not even given the
        chunks). The memory check and the allocation both follow it."""
        if self.draft_dec is None or not self.options.drafts(n_rows):
            return 0
        return self.options.num_draft_tokens

    def encode_batch(self, batch_size: int) -> int:
        """How many windows a run of `batch_size` rows encodes in one call (`memory.encode_batch`: 4 on a CPU)."""
        return memory.encode_batch(batch_size, self.target_dec.device)

    def run_shape(self, n_rows: int) -> memory.RunShape:
        """What the memory of a run of `n_rows` rows is made of: the draft's caches only when the run drafts
        (`_k`); both models' parameters, resident either way."""
        def shape(dec: Decoder) -> memory.DecoderShape:
            return memory.DecoderShape(dec.n_layers, dec.n_heads, dec.head_dim, dec.dtype.itemsize,
                                       dec.audio_dtype, dec.min_cache_positions)

        k = self._k(n_rows)
        models = [self.target] + ([self.draft] if self.draft is not None else [])
        model_bytes = sum(p.numel() * p.element_size() for model in models for p in model.parameters())
        return memory.RunShape(shape(self.target_dec), shape(self.draft_dec) if k else None, self.n_positions,
                               self.n_audio_ctx, self.target.config.d_model, self.target_dec.vocab_size, k,
                               model_bytes)

    def _check_fits(self, n_rows: int) -> None:
        """ResourceError, saying what fits, when a run of `n_rows` rows would not fit in the memory free now."""
        releasable = self.states.releasable_bytes(n_rows, self._k(n_rows))  # a held state the run would replace
        reason = memory.fits_now(self.run_shape(n_rows), n_rows, self.target_dec.device, releasable)
        if reason is not None:
            raise memory.ResourceError(reason)

    def _allocate(self, n_rows: int, k: int) -> RunState:
        """The caches, decoding state and hypotheses of `n_rows` slots at K = `k` (`_k`), held by `self.states`
        and reset in place for each run they cover.
        A hypothesis step writes max(k, width) proposals past a row's n_tok: the state's seq has room for them;
        the caches need none (positions past a row's limit are never real: `Decoder.forward` clamps them). A
        feature-conditioned draft's run keeps the target's final states too (`m.features`)."""
        m = Models(self.target_dec, self.target_dec.new_cache(n_rows, self.n_positions, self.n_audio_ctx))
        if k > 0:
            m.draft, m.draft_cache = self.draft_dec, self.draft_dec.new_cache(n_rows, self.n_positions,
                                                                              self.n_audio_ctx)
        if k > 0 and self.kind is DraftKind.TARGET_FEATURES:
            m.features = TargetFeatures.empty(n_rows, self.n_positions, self.target_dec.d_model,
                                              self.target_dec.device, self.target_dec.dtype)
        width = self.options.num_hypothesis_tokens
        dev = self.target_dec.device
        st = DecodeState.empty(n_rows, self.n_positions + max(k, width) + 8, k, dev)
        return RunState(n_rows, k, m, st, Hypotheses.empty(n_rows, self.tokens.max_positions, width, dev))

    def _admit(self, m: Models, st: DecodeState, hyp: Hypotheses, slots: Slots[ChunkRequest],
               taken: list[Encoded], groups: GroupLanguages) -> int:
        """Place encoded chunks in the free slots with the lowest indices and admit them there (`Admission`), with
        their hypotheses; a request that asks to keep its encoder output keeps it in its slot. Returns the longest
        prompt admitted."""
        prompts = [_row_prompt(req) for req, _, _ in taken]
        rows = slots.place([replace(req, encoded=enc) if req.keep_encoded else req for req, enc, _ in taken])
        audio = torch.stack([enc for _, enc, _ in taken])
        draft_audio = None
        if m.draft is not None:
            own = self.kind is DraftKind.OWN_ENCODER
            draft_audio = torch.stack([o for _, _, o in taken]) if own else audio
        with self.times.count("admit", st.n_tok.device.type == "cpu"):
            self.admission(m, st, rows, audio, draft_audio, prompts, groups)
        dev = st.n_tok.device
        st.set_sampling(torch.tensor(rows, device=dev),
                        torch.tensor([float(req.temperature) for req, _, _ in taken], device=dev),
                        torch.tensor([req.seed for req, _, _ in taken], device=dev))
        hyp.start(rows, [req.hypothesis for req, _, _ in taken])
        return max(self.admission.length(p) for p in prompts)

    def _refusal(self, req: ChunkRequest) -> str | None:
        """Why this engine cannot decode `req`, one line naming it; None when it can (`Refusals`): no features where
        its encoder output is not given or the draft encodes the audio itself, else what the model cannot take of
        its prompt, prefix or hypothesis (`Admission.refusal`); features or an encoder output of another shape than
        the target's (another model's mel bins failed the whole run inside oneDNN, a short window in the encoder)."""
        if req.features is None and req.encoded is None:
            return f"chunk {req.id!r}: neither features nor encoder output"
        config = self.target.config
        for name, value, shape in (("features", req.features, (config.num_mel_bins, 2 * self.n_audio_ctx)),
                                   ("encoder output", req.encoded, (self.n_audio_ctx, config.d_model))):
            if value is not None and tuple(value.shape) != shape:
                return f"chunk {req.id!r}: {name} of shape {tuple(value.shape)}, where the target takes {shape}"
        if req.features is None and self.kind is DraftKind.OWN_ENCODER:
            return f"chunk {req.id!r}: no features, which the draft's own encoder needs"
        return self.admission.refusal(req.id, _row_prompt(req), req.hypothesis)

    def _step(self, m: Models, st: DecodeState, hyp: Hypotheses, slots: Slots[ChunkRequest], reader: HostReader,
              k: int, max_len: int, runner: StepRunner) -> tuple[int, list[int], int] | None:
        """One step over the live rows, slots [0, n_live) (and the free slots up to the runner's rows bucket,
        masked); returns the host read due now (`HostReader`). It is a
        hypothesis step (window max(k, width) + 1) while a live row's request came with a hypothesis: known on
        the host, so no read decides it, and the draft's catch-up stays in step (engine/hypothesis.py)."""
        n_active = slots.n_live
        n_step = runner.step_rows(n_active, st.n_tok.shape[0])  # the live rows, or a bucket above them
        with_hyp = any(req is not None and req.hypothesis for req in slots.occupants[:n_active])
        width = max(k, hyp.width) if with_hyp else k
        n_keys = n_keys_bucket(max_len, width, reader.lag, self.n_positions)
        sampling = any(o is not None and o.temperature > 0 for o in slots.occupants[:n_active])
        rules = self.sampling_rules if sampling else self.rules
        with self.times.count("steps", st.n_tok.device.type == "cpu"):
            runner(m.rows(n_step), rules, st.rows(n_step), k, n_keys, hyp.rows(n_step) if with_hyp else None)
        return reader.after_step(st.rows(n_active), slots.step())

    def _forced(self, req: ChunkRequest) -> int:
        """The tokens of a request's prompt that were forced, not generated (its prefix: `Admission.forced`)."""
        return self.admission.forced(_row_prompt(req))

    def decode(self, features: torch.Tensor | None, encoded: torch.Tensor | None = None,
               batch_size: int = 8) -> list[ChunkResult]:
        """Decode N chunks given as (N, n_mels, n_frames) features and/or (N, n_audio_ctx, d) encoder outputs,
        `batch_size` rows at a time; results in input order."""
        n = len(features) if features is not None else len(encoded)
        reqs = (ChunkRequest(i, None if features is None else features[i], None if encoded is None else encoded[i])
                for i in range(n))
        results = {r.id: r for r in self.run(reqs, batch_size)}
        return [results[i] for i in range(n)]

