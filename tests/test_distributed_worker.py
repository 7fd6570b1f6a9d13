"""The Ray runner's transcription actor (`distributed._TranscribeWorker`) in this process, without Ray: a batch
whose transcription raises is transcribed file by file, so one file's fault is that file's record, not the end of
the run; a fault of every file is raised as before."""

from __future__ import annotations

import numpy as np
import pytest

from asr_spec.distributed import _TranscribeWorker
from asr_spec.transcribe.results import Transcription


class Poisoned:
    """A transcriber that raises on any batch holding a source whose first sample is `poison`."""

    def __init__(self, poison: float | None):
        self.poison, self.calls = poison, []

    def transcribe(self, sources, progress=False):
        self.calls.append(len(sources))
        if any(source["array"][0] == self.poison for source in sources):
            raise RuntimeError("index 7 is out of bounds")
        return [Transcription(s["path"], f"text of {s['path']}", (), "en", None, len(s["array"]) / 16_000, 0.1, ())
                for s in sources]


def _batch(firsts: list[float], errors: list[str] | None = None) -> dict:
    audio = np.empty(len(firsts), dtype=object)
    audio[:] = [np.full(16_000, first, np.float32) for first in firsts]
    return {"id": np.array([f"id{i}" for i in range(len(firsts))]), "path": np.array([f"f{i}.wav" for i in
            range(len(firsts))]), "audio": audio, "read_s": np.zeros(len(firsts)),
            "error": np.array(errors or [""] * len(firsts), dtype=object)}


def test_a_file_whose_transcription_raises_is_its_own_record_and_the_batch_goes_on() -> None:
    worker = _TranscribeWorker(lambda: Poisoned(0.5), threads=1, use_gpu=False)
    out = worker(_batch([0.0, 0.5, 0.1], errors=["", "", ""]))
    results = list(out["result"])
    assert [r.text for r in results] == ["text of f0.wav", "", "text of f2.wav"]
    assert results[1].error == "transcription failed: index 7 is out of bounds"
    assert results[1].audio_s == 1.0 and results[0].ok and results[2].ok
    assert worker.transcriber.calls == [3, 1, 1, 1]  # the batch, then each file alone


def test_a_fault_of_every_file_stops_the_run_as_it_did() -> None:
    worker = _TranscribeWorker(lambda: Poisoned(0.5), threads=1, use_gpu=False)
    with pytest.raises(RuntimeError, match="out of bounds"):
        worker(_batch([0.5, 0.5]))
    with pytest.raises(RuntimeError, match="out of bounds"):
        worker(_batch([0.5]))  # one file alone: raised at once


def test_a_batch_that_goes_through_is_transcribed_once() -> None:
    worker = _TranscribeWorker(lambda: Poisoned(None), threads=1, use_gpu=False)
    out = worker(_batch([0.0, 0.1], errors=["", "cannot read f1.wav"]))
    assert [r.error for r in out["result"]] == [None, "cannot read f1.wav"] and worker.transcriber.calls == [1]
