"""The faster-whisper columns of benchmarks/bench.py: faster-whisper's `BatchedInferencePipeline` on the CTranslate2
directory of the preset's embedded model (the same weights asr-spec converts), greedy (beam 1), fp32 on CPU
(float16 on CUDA), in a process of its own.

Why a process of its own: CTranslate2's OpenMP threads and torch's would otherwise spin against each other in one
process (measured: both systems 7-15 % slower side by side in one process than alone). The child holds the clips
and is timed from the parent, interleaved with the other configurations like any of them.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from asr_spec.errors import one_line

__all__ = ["FwRunner"]


class FwRunner:
    """A running faster-whisper process. `runner(clips, batch_size)` transcribes the first len(clips) of the clips
    it was started with and returns their texts; `close()` ends the process.

    preset:     an embedded preset (`model = "embedded:<name>"`), else ValueError.
    clips:      objects with `.samples` (float32 mono 16 kHz, shape = (n_samples,)), sent to the child once.
    timestamps: False: faster-whisper's batched default, no timestamp tokens (one segment per voice-activity
                chunk); True: timestamp tokens and segments, as asr-spec's default makes.
    sequential: `WhisperModel.transcribe` instead, its openai-whisper-style loop over 30 s windows that seeks to
                the last timestamp (the batch size is unused).
    compute:    CTranslate2's compute_type; None: float32 on CPU, float16 on CUDA ("int8" is what faster-whisper's
                CPU users pick).
    ImportError when faster-whisper cannot run (not installed, or the child died), with the child's reason.
    """

    def __init__(self, preset: str, device: torch.device, language: str, clips: Sequence[Any],
                 timestamps: bool = False, sequential: bool = False, compute: str | None = None):
        from asr_spec.models.embedded import embedded_ct2_dir
        from asr_spec.models.presets import load_preset

        target = load_preset(preset).model
        if not target.startswith("embedded:"):
            raise ValueError(f"faster-whisper column: preset {preset} is not an embedded CTranslate2 model")
        model_dir = str(embedded_ct2_dir(target.split(":", 1)[1]))
        if compute is None:
            compute = "float32" if device.type == "cpu" else "float16"
        spawn = mp.get_context("spawn")
        self._conn, child = spawn.Pipe()
        worker_args = (child, model_dir, device.type, compute, torch.get_num_threads(), language,
                       [c.samples for c in clips], timestamps, sequential)
        self._worker = spawn.Process(target=_fw_worker, daemon=True, args=worker_args)
        self._worker.start()
        child.close()  # the child's end lives in the child now: its death reads as EOF here
        try:
            status = self._conn.recv()
        except EOFError:
            self._worker.join(5)
            status = f"the faster-whisper process died (exit code {self._worker.exitcode})"
        if status != "ready":
            raise ImportError(status)

    def __call__(self, some: Sequence[Any], batch_size: int) -> list[str]:
        self._conn.send((len(some), batch_size))
        return self._conn.recv()

    def close(self) -> None:
        """The child reads EOF and returns: no killed process, no leaked semaphore warning."""
        self._conn.close()
        self._worker.join(30)


def _fw_worker(conn: Any, model_dir: str, device: str, compute: str, threads: int, language: str,
               samples: list[np.ndarray], timestamps: bool, sequential: bool) -> None:
    """The faster-whisper process: loads the model, then transcribes the first n clips at batch size b for each
    (n, b) it is sent, answering with the texts."""
    try:
        from faster_whisper import BatchedInferencePipeline, WhisperModel  # optional: pip install faster-whisper

        model = WhisperModel(model_dir, device=device, compute_type=compute, cpu_threads=threads)
        pipe = BatchedInferencePipeline(model)
    except Exception as err:  # noqa: BLE001  # reported to the parent, which skips the column
        conn.send(f"{type(err).__name__}: {one_line(err)}")
        return
    conn.send("ready")
    while True:
        try:
            n, batch_size = conn.recv()
        except EOFError:  # the benchmark is over
            return
        texts = []
        for audio in samples[:n]:
            if sequential:
                segments, _ = model.transcribe(audio, language=language, beam_size=1,
                                               without_timestamps=not timestamps)
            else:
                segments, _ = pipe.transcribe(audio, language=language, batch_size=batch_size, beam_size=1,
                                              without_timestamps=not timestamps)
            texts.append(" ".join(seg.text.strip() for seg in segments))
        conn.send(texts)
