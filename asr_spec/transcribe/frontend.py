"""The front half of the pipeline: sources -> 16 kHz blocks -> chunks -> log-mel features -> engine requests.

    Input.source ──stream_audio / load_audio──► blocks ──ChunkingOptions.iter / iter_vad_chunks──► (span, samples)
    ──FeatureBatcher, min(batch_size, MAX_ENCODE_BATCH) chunks at a time──► ChunkRequest(ChunkId(key, index), features)

It is one lazy generator: a file is read one block at a time as the chunker asks for it, and chunks are
featurised one batch at a time as requests are pulled (`Engine.run` pulls them as rows free up), so a 2-hour file
is never held whole. A batch may hold the chunks of several inputs. The front half stops at the features: the
engine encodes (a chunk that needs word timestamps asks it to keep its encoder output, `keep_encoded`).
`Transcriber.iter_transcribe` runs it inside the engine's pull; the server runs it in a worker thread per request.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np

from asr_spec.audio.chunking import ChunkSpan, skip_silent_windows
from asr_spec.audio.features import FeatureBatcher
from asr_spec.audio.loading import SAMPLE_RATE, load_audio, stream_audio
from asr_spec.audio.silero import SileroVad, window_speech
from asr_spec.audio.vad import VadOptions, iter_vad_chunks
from asr_spec.chunk_id import ChunkId
from asr_spec.engine import ChunkRequest
from asr_spec.engine.memory import MAX_ENCODE_BATCH
from asr_spec.errors import AudioTooLong, InputError, one_line
from asr_spec.transcribe.inputs import INPUT_ERRORS, Input
from asr_spec.transcribe.options import TranscribeOptions

__all__ = ["FrontEnd"]

_Chunk = tuple[ChunkId, bool, np.ndarray]  # (request id, keep_encoded, samples) of one chunk


class FrontEnd:
    """Decodes, chunks and featurises inputs as `options` say, for the models `features` was made for.

    options:  the transcription options (chunking or vad, block_s, word_timestamps).
    features: the target's `FeatureBatcher` (its mel bins, device and dtype).
    """

    def __init__(self, options: TranscribeOptions, features: FeatureBatcher):
        self.options = options
        self.features = features
        self._vads: list[SileroVad] = []  # idle VAD states, loaded when first needed (see chunk_audio)
        self._vad_lock = threading.Lock()

    def prepare(self, inputs: Iterable[Input], batch_size: int,
                keep_samples: dict | None = None) -> Iterator[ChunkRequest]:
        """The engine requests of every chunk of `inputs`, in input and chunk order, lazily; request ids are
        `ChunkId(input.key, chunk index)`, features (n_mels, n_frames) made min(batch_size, MAX_ENCODE_BATCH)
        chunks at a time. Each input's spans, n_samples, started and read_done are filled in as it is read; one
        that cannot be read gets `error` (one line) and `exception`, and the requests of it already yielded are to
        be ignored.
        An input asking for word timestamps needs options.word_timestamps (else `InputError`). batch_size: the
        run's engine rows, checked by the caller (`Transcriber.batch_rows`). keep_samples: when given, each
        chunk's samples are put there under its request id (tail repair, `tail_runs.TailSource`, lets them go)."""
        return self._featurise(self._chunks(inputs), min(batch_size, MAX_ENCODE_BATCH), keep_samples)

    def window_speech(self, samples: np.ndarray) -> np.ndarray:
        """(F,) bool speech frames of one chunk's samples (`silero.window_speech`, at the VAD threshold of
        options.vad or the default's): for a stride window whose transcript may stop early (tail repair)."""
        threshold = (self.options.vad or VadOptions()).threshold
        with self._vad_lock:
            vad = self._vads.pop() if self._vads else None
        if vad is None:
            vad = SileroVad()
        try:
            return window_speech(samples, vad, threshold)
        finally:
            with self._vad_lock:
                self._vads.append(vad)

    def chunk_audio(self, blocks: Iterable[np.ndarray]) -> Iterator[tuple[ChunkSpan, np.ndarray]]:
        """(span, samples) of one 16 kHz mono signal given as blocks: overlapping windows (`options.vad` None) or
        speech chunks found by the VAD. Concurrent calls are safe (each takes its own VAD state, loaded at the
        first call that needs one)."""
        if self.options.vad is None:  # digital silence is not decoded (as the VAD never makes a chunk of it)
            yield from skip_silent_windows(self.options.chunking.iter(blocks))
            return
        with self._vad_lock:
            vad = self._vads.pop() if self._vads else None
        if vad is None:
            vad = SileroVad()
        vad.reset()
        try:
            yield from iter_vad_chunks(blocks, self.options.vad, vad)
        finally:
            with self._vad_lock:
                self._vads.append(vad)

    def _chunks(self, inputs: Iterable[Input]) -> Iterator[_Chunk]:
        """Every chunk of every input, in order, read lazily; an input that fails is marked and left."""
        for item in inputs:
            if item.word_timestamps and not self.options.word_timestamps:
                raise InputError("word timestamps are off: set word_timestamps (with chunking 'vad')")
            item.started = time.perf_counter()
            try:
                for span, samples in self.chunk_audio(self._blocks(item)):
                    chunk_id = ChunkId(item.key, len(item.spans))
                    item.spans.append(span)
                    yield chunk_id, item.word_timestamps, samples
            except INPUT_ERRORS as err:
                item.error = one_line(err, item.name)
                item.exception = err
            item.read_done = True

    def _blocks(self, item: Input) -> Iterator[np.ndarray]:
        """16 kHz mono blocks of one input (files stream; an in-memory source is loaded whole and cut into blocks
        of the same length: the VAD's front end holds a block's frames at once, 739 MB for 30 min as one block),
        counted into `item.n_samples`."""
        if isinstance(item.source, (str, os.PathLike)):
            blocks = stream_audio(item.source, self.options.block_s)
        else:
            samples, step = load_audio(item.source, name=item.name), int(self.options.block_s * SAMPLE_RATE)
            blocks = (samples[i:i + step] for i in range(0, max(len(samples), 1), step))
        with contextlib.closing(blocks):  # the reader let go now (ffmpeg, an open upload), not by the collector
            for block in blocks:
                item.n_samples += len(block)
                if item.max_samples is not None and item.n_samples > item.max_samples:
                    raise AudioTooLong(item.max_samples / SAMPLE_RATE, item.audio_s)
                yield block

    def _featurise(self, chunks: Iterator[_Chunk], batch: int, keep_samples: dict | None) -> Iterator[ChunkRequest]:
        """Requests for `chunks`, featurised `batch` chunks at a time (bounded features in flight)."""
        pending: list[_Chunk] = []
        for chunk in chunks:
            pending.append(chunk)
            if len(pending) == batch:
                yield from self._requests(pending, keep_samples)
                pending = []
        if pending:
            yield from self._requests(pending, keep_samples)

    def _requests(self, pending: list[_Chunk], keep_samples: dict | None) -> Iterator[ChunkRequest]:
        features = self.features([samples for _, _, samples in pending])  # (B, n_mels, n_frames)
        for (chunk_id, keep_encoded, samples), row in zip(pending, features):
            if keep_samples is not None:  # held from the moment the engine pulls the chunk
                keep_samples[chunk_id] = samples
            yield ChunkRequest(chunk_id, row, keep_encoded=keep_encoded, language_group=chunk_id.owner)
