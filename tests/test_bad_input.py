"""Issue 13: bad input and bad settings never cost a traceback, a hallucinated page or the machine's memory.

Each case runs beside a good file (tiny random Whisper with the real vocabulary, see test_transcribe) and checks
the exit code, the one-line message and that the good file's outputs are complete and correct.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import perturbed, tiny_target
from test_cli import assert_one_line_error, assert_only_line_is_error, run_cli, tiny
from test_transcribe import LONG, SHORT, _models, auto_precision, save_tiny_models, transcriber

from asr_spec import TranscribeOptions, Transcriber
from asr_spec.audio.loading import SAMPLE_RATE, load_audio
from asr_spec.engine import DecodeOptions, Engine, ResourceError, memory
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.errors import AudioError, InputError, ModelLoadError
from asr_spec.models.loading import decoder_draft
from asr_spec.transcribe.nospeech import NoSpeechRule, compression_ratio

FORMATS = {".txt", ".json", ".srt", ".vtt"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    return save_tiny_models(tmp_path_factory.mktemp("models"))


@functools.cache
def reference_text(path: Path, chunking: str = "vad") -> str:
    """The tiny target's greedy transcript of `path` in timestamp mode with VAD chunks, as the CLI's default preset
    decodes (its tiny models are the same weights, in the precision `auto` resolves to here)."""
    run = transcriber(speculative=False, precision=auto_precision(), timestamps=True, chunking=chunking)
    return run.transcribe(str(path), progress=False)[0].text


def assert_outputs(out_dir: Path, stem: str, source: Path, chunking: str = "vad") -> None:
    """All four transcripts of `source` are in `out_dir` as `stem.*` and hold its reference text."""
    assert {p.suffix for p in out_dir.glob(f"{stem}.*")} == FORMATS, sorted(out_dir.iterdir())
    data = json.loads((out_dir / f"{stem}.json").read_text())
    assert data["text"] == reference_text(source, chunking) and data["error"] is None
    lines = [segment["text"].strip() for segment in data["segments"] if segment["text"].strip()]
    assert data["segments"] and (out_dir / f"{stem}.txt").read_text() == "\n".join(lines) + "\n"


# -- 1. a corrupt model: one line, exit 2, typed exception in the API --------------------------------------------

def _truncate_weights(folder: Path) -> str:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return "SafetensorError"


def _break_config(folder: Path) -> str:
    (folder / "config.json").write_text("{not json")
    return "not a valid JSON file"


def _drop_tokenizer(folder: Path) -> str:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    return "no tokenizer there"


def _drop_encoder_weights(folder: Path) -> str:
    """A decoder-only checkpoint saved with a processor: transformers would fill the encoder with random values."""
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".encoder." not in k}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return "weights lack"


def _fewer_layers_in_config(folder: Path) -> str:
    """A config.json of another model beside the weights (turbo's 4 decoder layers over large-v3's 32): the
    tensors without a place were dropped and the rest transcribed garbage, exit 0."""
    config = json.loads((folder / "config.json").read_text())
    config["decoder_layers"] -= 1
    (folder / "config.json").write_text(json.dumps(config))
    return "tensors its config.json has no place for"


def _another_tokenizers_ids(folder: Path) -> str:
    """Ids the tokenizer does not give its special tokens (another model's tokenizer beside the weights)."""
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] -= 1
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return "the tokenizer is another model's"


def _drop_generation_config(folder: Path) -> str:
    (folder / "generation_config.json").unlink()
    return "no Whisper generation config"


def _another_models_config(folder: Path) -> str:
    """Another model's folder (a BERT config failed in its own checks: "embed_dim must be divisible by num_heads")."""
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    return "config.json says model_type 'bert', not a Whisper model"


@pytest.mark.parametrize("which,damage", [("model", _truncate_weights), ("model", _break_config),
                                          ("model", _drop_tokenizer), ("model", _drop_encoder_weights),
                                          ("model", _fewer_layers_in_config), ("model", _another_tokenizers_ids),
                                          ("model", _drop_generation_config), ("model", _another_models_config),
                                          ("draft", _truncate_weights), ("draft", _break_config),
                                          ("draft", _another_models_config)])
def test_a_broken_model_or_draft_is_one_line_exit_2(capsys, tmp_path: Path, model_dirs, which, damage) -> None:
    target_dir, draft_dir = model_dirs
    broken = tmp_path / f"broken-{which}"
    shutil.copytree(target_dir if which == "model" else draft_dir, broken)
    cause = damage(broken)
    flag = "--model" if which == "model" else "--draft"
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), flag, str(broken)))
    assert code == 2 and out == ""
    assert_only_line_is_error(err, str(broken), cause)
    with pytest.raises(ModelLoadError, match=cause):
        if which == "model":
            Transcriber.from_pretrained(broken, device="cpu")
        else:
            Transcriber.from_pretrained(target_dir, broken, device="cpu")


def test_a_model_folder_that_is_not_there_is_named_so(capsys, tmp_path: Path, model_dirs) -> None:
    """It was "no config.json or model.bin there: not a Whisper model directory"."""
    missing = tmp_path / "nonexistent_dir"
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), "--model", str(missing)))
    assert code == 2 and out == ""
    assert_only_line_is_error(err, str(missing), "no such folder")


def test_a_distilled_draft_that_cannot_be_read_is_a_model_load_error(tmp_path: Path) -> None:
    """`asr-spec distill` and `--draft` load a distilled draft through `load_distilled`: a distill.json that is not
    an object, or weights cut short, is a `ModelLoadError` naming the folder (an AttributeError or a
    SafetensorError traceback before)."""
    from asr_spec.models.loading import load_distilled

    for damage, cause in ((lambda d: (d / "distill.json").write_text("[]\n"), "AttributeError"),
                          (_truncate_weights, "SafetensorError")):
        draft = tmp_path / f"draft-{cause}"
        shutil.copytree(Path(__file__).parent.parent / "drafts" / "whisper-base-2l", draft)
        damage(draft)
        with pytest.raises(ModelLoadError, match=cause) as info:
            load_distilled(draft, tiny_target())
        assert str(draft) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("ids", [[10**6], [], [-5, 1, 2], [1, 1], {"a": 1}, "[1,"], ids=str)
def test_a_draft_vocabulary_that_is_no_list_of_token_ids_is_a_model_load_error(tmp_path: Path, ids) -> None:
    """A distilled draft's draft_vocab.json was read as it was: an id past the vocabulary was an IndexError
    traceback, an empty list a reshape error, a negative id an engine error mid-run."""
    import json

    import torch

    from asr_spec.models.drafts import decoder_draft, save_trained_draft
    from asr_spec.models.loading import load_distilled

    target = tiny_target()
    draft = decoder_draft(target, [0])
    draft.draft_vocab_ids = torch.arange(20)
    folder = save_trained_draft(draft, tmp_path / "draft", dtype=torch.float32)
    assert load_distilled(folder, target).draft_vocab_ids.tolist() == list(range(20))
    (tmp_path / "draft" / "draft_vocab.json").write_text(ids if isinstance(ids, str) else json.dumps(ids))
    with pytest.raises(ModelLoadError, match="draft_vocab.json") as info:
        load_distilled(folder, target)
    assert "\n" not in str(info.value)


# -- 2. the no-speech rule ----------------------------------------------------------------------------------------

def test_the_rule_is_whispers() -> None:
    rule = NoSpeechRule()
    assert (rule.no_speech_threshold, rule.logprob_threshold, rule.compression_ratio_threshold) == (0.6, -1.0, 2.4)
    assert not rule.drops(0.5, -3.0, "a")  # not silent enough
    assert rule.drops(0.9, -1.5, "a")  # silent and unsure
    assert not rule.drops(0.9, -0.5, "hello there")  # silent by the token, but confident: kept (Whisper)
    assert rule.drops(0.9, -0.5, "yw'n " * 40)  # confident only because it loops: Whisper would have re-decoded
    assert compression_ratio("yw'n " * 40) > 2.4 > compression_ratio("hello there") and compression_ratio("") == 0
    assert not NoSpeechRule(no_speech_threshold=None).drops(1.0, -9.0, "")  # off
    assert NoSpeechRule(logprob_threshold=None).drops(0.9, -0.1, "hi")  # no rescue by confidence, as Whisper
    assert not NoSpeechRule(compression_ratio_threshold=None).drops(0.9, -0.5, "yw'n " * 40)  # Whisper exactly
    for bad in ({"no_speech_threshold": 1.5}, {"logprob_threshold": float("nan")}, {"no_speech_threshold": True}):
        with pytest.raises(InputError):
            NoSpeechRule(**bad)


def _features() -> torch.Tensor:
    return torch.randn(5, 16, 100, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("timestamps", [False, True])
def test_no_speech_prob_and_avg_logprob_are_the_targets_with_or_without_a_draft(timestamps: bool) -> None:
    """Both statistics equal a teacher-forced recomputation from the target alone, for greedy and speculative."""
    target = tiny_target()
    options = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=30)
    greedy = Engine(target, None, options).decode(_features(), batch_size=3)
    spec = Engine(target, decoder_draft(perturbed(target, 0.3, seed=3, encoder=False)), options).decode(
        _features(), batch_size=2)
    tokens = WhisperTokens.from_generation_config(target.generation_config, 448)
    rules = LogitRules(tokens, target.config.vocab_size, timestamps, torch.device("cpu"))
    assert sum(r.stats.accepted_tokens for r in spec) > 0  # the draft did propose and get tokens accepted
    for row, (g, s) in enumerate(zip(greedy, spec)):
        assert g.tokens == s.tokens  # lossless
        seq = torch.tensor([g.prompt + g.tokens])
        n_prompt, n_gen = len(g.prompt), len(g.tokens)
        with torch.no_grad():
            logits = target(input_features=_features()[row][None], decoder_input_ids=seq).logits
        no_speech = torch.softmax(logits[0, 0].float(), -1)[tokens.no_timestamps - 1].item()
        scores = rules.apply(logits[:, n_prompt - 1: n_prompt - 1 + n_gen], seq, torch.tensor([n_prompt]),
                             torch.tensor([n_prompt]))
        logprobs = torch.log_softmax(scores, -1)[0].gather(1, seq[0, n_prompt:, None])[:, 0]
        avg = logprobs.sum().item() / (n_gen + (g.finish_reason != "eos"))
        for result in (g, s):
            assert 0 < result.no_speech_prob < 1
            assert result.no_speech_prob == pytest.approx(no_speech, rel=1e-4)
            assert result.avg_logprob == pytest.approx(avg, rel=1e-4, abs=1e-5)
        assert s.avg_logprob == pytest.approx(g.avg_logprob, rel=1e-5)


def test_dropped_windows_are_the_same_with_a_draft_and_leave_no_text() -> None:
    """Thresholds put between the windows' own statistics drop some of LONG's four windows: the same ones, and the
    same transcript, greedy or speculative; the json says which."""
    everything = transcriber(speculative=False, no_speech_threshold=None).transcribe(str(LONG), progress=False)[0]
    median = float(np.median([c.avg_logprob for c in everything.chunks]))
    values = dict(no_speech_threshold=0.0, logprob_threshold=median, compression_ratio_threshold=None)
    greedy = transcriber(speculative=False, **values).transcribe(str(LONG), progress=False)[0]
    spec = transcriber(speculative=True, **values).transcribe(str(LONG), progress=False)[0]
    dropped = [c.dropped for c in greedy.chunks]
    assert 0 < greedy.n_dropped < len(greedy.chunks) and set(dropped) == {None, "no speech"}
    assert [c.dropped for c in spec.chunks] == dropped and spec.text == greedy.text
    assert spec.stats.drafted_tokens > 0
    assert greedy.chunk_tokens == everything.chunk_tokens  # the rule never changes decoding, only what is kept
    assert greedy.text and len(greedy.text) < len(everything.text)
    kept = [c for c in greedy.chunks if c.dropped is None]
    assert all(c.avg_logprob > median for c in kept)


def test_every_window_dropped_gives_an_empty_transcript_exit_0(capsys, tmp_path: Path, model_dirs) -> None:
    out_dir = tmp_path / "out"
    args = tiny(model_dirs, str(LONG), str(SHORT[0]), "--output-dir", str(out_dir), "--chunking", "stride")
    code, _, err = run_cli(capsys, *args, "--no-speech-threshold", "0", "--logprob-threshold", "0")
    assert code == 0 and "error" not in err
    # 4 + 1 windows; the summary ends with the hardware it ran on ("[cpu avx2, float32]")
    assert re.search(r", 5 windows without speech left out \[cpu [^\]]+\]$", err.strip().splitlines()[-1])
    data = json.loads((out_dir / "long_75s.json").read_text())
    assert data["text"] == "" and data["segments"] == [] and len(data["chunks"]) == 4
    assert all(c["dropped"] == "no speech" and 0 < c["no_speech_prob"] < 1 and c["avg_logprob"] < 0
               for c in data["chunks"])
    assert (out_dir / "long_75s.txt").read_text() == "\n"
    code, _, err = run_cli(capsys, *args, "--keep-no-speech")  # the rule off: decoded and kept as before
    assert code == 0 and "left out" not in err
    assert_outputs(out_dir, "long_75s", LONG, "stride")
    assert_outputs(out_dir, SHORT[0].stem, SHORT[0], "stride")
    code, _, err = run_cli(capsys, *args, "--keep-no-speech", "--no-speech-threshold", "0.5")
    assert code == 2
    assert_one_line_error(err, "--keep-no-speech and --no-speech-threshold contradict")


@pytest.mark.real
@pytest.mark.slow
def test_real_near_silence_gives_an_empty_transcript() -> None:
    """60 s of digital silence with a -80 dBFS hiss, stride-chunked into three windows, whisper-base as the base
    preset runs it (language detected, timestamps): each window is detected as Welsh and loops ("yw'n yw'n ...",
    average log-probability -0.26, compression ratio 7.4) with P(no speech) 0.85-0.95. The rule drops all three;
    off, the same tokens are decoded and kept. (max_new_tokens keeps the loops, and the test, short.)"""
    from test_transcribe import _real_base

    target, processor = _real_base()
    hiss = (np.random.default_rng(0).standard_normal(60 * SAMPLE_RATE) * 1e-4).astype(np.float32)
    values = dict(language="auto", timestamps=True, max_new_tokens=48, batch_size=3)
    on = Transcriber(target, None, processor, TranscribeOptions.from_values(**values))
    result = on.transcribe(hiss, progress=False)[0]
    assert result.ok and result.text == "" and result.segments == () and len(result.chunks) == 3
    assert all(c.dropped == "no speech" and c.no_speech_prob > 0.6 for c in result.chunks)
    off = Transcriber(target, None, processor, TranscribeOptions.from_values(no_speech_threshold=None, **values))
    kept = off.transcribe(hiss, progress=False)[0]
    assert kept.n_dropped == 0 and kept.text and kept.chunk_tokens == result.chunk_tokens


# -- 3. memory follows the work ------------------------------------------------------------------------------------

BASE = memory.RunShape(memory.DecoderShape(6, 8, 64, 4), None, 448 + 2, 1500, 512, 51865, 0, 290_000_000)


def test_memory_estimate_is_plain_arithmetic() -> None:
    cache = 2 * 6 * 8 * 64 * 4 * (450 + 1500)  # (k, v) x layers x heads x head_dim x fp32 x (self + cross positions)
    assert memory.row_bytes(BASE) == cache + 1500 * 512 * 4 + 4 * 51865 * 4
    with_draft = memory.RunShape(BASE.target, memory.DecoderShape(2, 8, 64, 4), 448 + 5, 1500, 512, 51865, 3, 0)
    assert memory.row_bytes(with_draft) > memory.row_bytes(BASE)
    free = 10 * memory.row_bytes(BASE)
    assert memory.largest_batch(BASE, free) == 8  # 80 % of what is free
    assert memory.check_fits(BASE, 8, free) is None and memory.check_fits(BASE, 8, None) is None
    message = memory.check_fits(BASE, 1000, free)
    assert "batch of 1000 needs" in message and "--batch-size 8 fits" in message and "\n" not in message
    assert "not even --batch-size 1 fits" in memory.check_fits(BASE, 1, memory.row_bytes(BASE))


def test_slots_never_exceed_the_chunks_that_exist(monkeypatch) -> None:
    """A run takes min(batch size, chunks) rows: with memory free for exactly that many rows (caches of the target
    and the draft), a batch size of a thousand decodes 3 chunks, and one row less does not fit."""
    target = tiny_target()
    engine = Engine(target, decoder_draft(target), DecodeOptions(language="en", max_new_tokens=8))

    def free_for(n_rows: int) -> None:
        need = memory.run_bytes(engine.run_shape(n_rows), n_rows)
        monkeypatch.setattr(memory, "free_bytes", lambda device: int(need / memory.USABLE_FRACTION) + 1)

    assert engine.run_shape(3).draft is not None  # the draft's caches are counted
    free_for(3)
    assert len(engine.decode(_features()[:3], batch_size=1000)) == 3
    free_for(4)
    assert len(engine.decode(_features(), batch_size=4)) == 5
    free_for(20)  # more chunks than rows, encoded ahead in micro-batches of 16: still batch_size rows
    many = _features().repeat(5, 1, 1)[:25]
    assert len(engine.decode(many, batch_size=20)) == 25
    free_for(2)
    with pytest.raises(ResourceError, match="batch of 3 needs"):
        engine.decode(_features()[:3], batch_size=1000)


def test_a_batch_that_cannot_fit_stops_at_once_saying_what_fits(capsys, monkeypatch, model_dirs) -> None:
    target = tiny_target()
    engine = Engine(target, None, DecodeOptions(language="en", max_new_tokens=8))
    one_row = memory.row_bytes(engine.run_shape(1))
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(2.5 * one_row / memory.USABLE_FRACTION))
    with pytest.raises(ResourceError, match="--batch-size 2 fits"):
        engine.decode(_features(), batch_size=4)
    assert len(engine.decode(_features(), batch_size=2)) == 5
    # 4 rows
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(LONG), "--batch-size", "8", "--chunking", "stride"))
    assert code == 2 and out == ""
    assert_one_line_error(err, "batch of 4 needs", "--batch-size")


_PEAK_RSS = """
import resource, sys
from asr_spec import TranscribeOptions, Transcriber
model_dir, audio, batch_size = sys.argv[1:]
tr = Transcriber.from_pretrained(model_dir, device="cpu", language="en", max_new_tokens=8)
assert tr.transcribe(audio, batch_size=int(batch_size), progress=False)[0].ok
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.slow
def test_batch_size_1000_on_a_short_file_costs_no_more_memory_than_8(tmp_path: Path) -> None:
    """A Whisper with the full 448 decoder positions (d=128, one layer: 460 KB of self-attention cache per row),
    measured in fresh processes: before issue 13, batch 1000 allocated 1000 rows of caches up front (~0.5 GB more
    here, 11.8 GB with whisper-base); now the slots follow the chunks that exist."""
    from test_transcribe import tiny_processor

    from asr_spec.testing import Shape, random_whisper

    model_dir = tmp_path / "positions448"
    random_whisper(Shape(128, 1, 1, 4, n_mels=80, audio_ctx=1500), vocab_size=None, seed=1).save_pretrained(model_dir)
    tiny_processor().save_pretrained(model_dir)

    def peak_kib(batch_size: int) -> int:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(model_dir), str(SHORT[0]), str(batch_size)],
                              capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip().splitlines()[-1])

    small, large = peak_kib(8), peak_kib(1000)
    assert large <= 1.2 * small, f"peak RSS {large} KiB at batch 1000 vs {small} KiB at batch 8"


# -- 4. float input on the int16 scale ------------------------------------------------------------------------------

def test_float_audio_far_above_one_is_refused_the_rest_transcribed(capsys, tmp_path: Path, model_dirs) -> None:
    speech = load_audio(SHORT[0])
    results = transcriber(speculative=False, precision=auto_precision(), timestamps=True).transcribe(
        [speech * 32768, speech * 1e6, speech], progress=False)
    assert results[0].error.startswith("float samples peak at")  # the cause alone: the caller names the input
    assert "int16-scale audio: divide by 32768" in results[0].error
    assert "not [-1, 1] audio: rescale it" in results[1].error
    # named once, as the run names it ("<array 1>: <array>: ..." before)
    with pytest.raises(AudioError, match=r"^<array 1>: float samples peak at [^<]*$"):
        transcriber(speculative=False, precision=auto_precision(), timestamps=True)([speech, speech * 1e6])
    assert results[2].ok and results[2].text == reference_text(SHORT[0])
    loud = tmp_path / "int16_as_float.wav"
    sf.write(loud, speech * 32768, SAMPLE_RATE, subtype="FLOAT")
    out_dir = tmp_path / "out"
    code, _, err = run_cli(capsys, *tiny(model_dirs, str(loud), str(SHORT[0]), "--output-dir", str(out_dir)))
    assert code == 1
    assert_one_line_error(err, f"{loud}: ", "int16-scale audio: divide by 32768")
    assert_outputs(out_dir, SHORT[0].stem, SHORT[0])
    with pytest.raises(AudioError, match="int16-scale"):
        load_audio(speech * 32768)


def test_what_the_model_cannot_do_is_an_input_error() -> None:
    """Options this model cannot take (found by the engine, built after loading) and a CUDA device on a machine
    without one are the caller's errors (`AsrSpecError`), not a bare ValueError an application cannot tell from a
    bug."""
    target, _, processor = _models()
    too_long = TranscribeOptions.from_values(language="en", max_new_tokens=10_000)
    with pytest.raises(InputError, match=r"max_new_tokens \(10000\) exceeds the model's max_target_positions"):
        Transcriber(target, None, processor, too_long)
    # tokens drafted or offered per pass past what a window holds: minutes of drafting, or a C++ overflow
    for name in ("num_draft_tokens", "num_hypothesis_tokens"):
        with pytest.raises(InputError, match=rf"{name} \(1000000\) must be below the model's max_target_positions"):
            Transcriber(target, None, processor, TranscribeOptions.from_values(language="en", **{name: 10**6}))
    with pytest.raises(InputError, match="batch_size must be at most 65536, got 100000000000000000000"):
        TranscribeOptions.from_values(batch_size=10**20)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="device 'cuda': CUDA is not available on this machine"):
            Transcriber.from_preset("base", device="cuda")


# -- 5. a bad output directory is found before any model loads ----------------------------------------------------

def test_a_bad_output_dir_is_refused_before_the_model_loads(capsys, tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [(Path("/proc/x"), "cannot be created or written"), (a_file, "is a file, not a folder"),
             (a_file / "sub", "cannot be created or written")]
    for out_dir, cause in cases:  # a model that does not exist: had it been loaded first, that error would show
        code, out, err = run_cli(capsys, "transcribe", str(SHORT[0]), "--model", str(tmp_path / "no-model"),
                                 "--output-dir", str(out_dir))
        assert code == 2 and out == ""
        assert_one_line_error(err, str(out_dir), cause)
    greedy = transcriber(speculative=False)
    with pytest.raises(InputError, match="is a file"):
        greedy.transcribe(str(SHORT[0]), progress=False, output_dir=a_file)


# -- 6. name collisions: distinct names that keep the folder; the same file twice refused --------------------------

def test_same_names_in_two_folders_get_distinct_outputs(capsys, tmp_path: Path, model_dirs) -> None:
    for folder, source in (("a", SHORT[0]), ("b", SHORT[1])):
        (tmp_path / folder).mkdir()
        shutil.copy(source, tmp_path / folder / "same.flac")
    out_dir = tmp_path / "out"
    inputs = [str(tmp_path / "a" / "same.flac"), str(tmp_path / "b" / "same.flac"), str(LONG)]
    code, _, err = run_cli(capsys, *tiny(model_dirs, *inputs, "--output-dir", str(out_dir)))
    assert code == 0 and "error" not in err
    assert_outputs(out_dir, "a__same", SHORT[0])
    assert_outputs(out_dir, "b__same", SHORT[1])
    assert_outputs(out_dir, "long_75s", LONG)
    code, out, err = run_cli(capsys, "transcribe", str(SHORT[0]), str(SHORT[0]), "--model", str(tmp_path / "none"),
                             "--output-dir", str(out_dir))
    assert code == 2 and out == ""
    assert_one_line_error(err, str(SHORT[0]), "given twice")
    # the same names over two runs (folder by folder into one output folder): the first folder's transcripts were
    # replaced without a word; a rerun of the same file replaces its own
    first, second = str(tmp_path / "a" / "same.flac"), str(tmp_path / "b" / "same.flac")
    assert run_cli(capsys, *tiny(model_dirs, first, "--output-dir", str(tmp_path / "one")))[0] == 0
    assert run_cli(capsys, *tiny(model_dirs, first, "--output-dir", str(tmp_path / "one")))[0] == 0
    code, out, err = run_cli(capsys, *tiny(model_dirs, second, "--output-dir", str(tmp_path / "one")))
    assert code == 2 and out == ""
    assert_one_line_error(err, "same.json: holds the transcript of", first, f"{second} would replace it")
    assert_outputs(tmp_path / "one", "same", SHORT[0])


# -- 7. Ctrl-C, stale temporary files, eval's resume warning ------------------------------------------------------

def test_ctrl_c_says_what_is_finished_and_stale_temp_files_go(capsys, monkeypatch, tmp_path: Path, model_dirs):
    import asr_spec.transcribe.transcriber as module

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    stale, fresh, other = out_dir / ".old.txt.k2j4_x.tmp", out_dir / ".live.json.a8d9s.tmp", out_dir / "notes.tmp"
    for path in (stale, fresh, other):
        path.write_text("partial")
    long_ago = time.time() - 3600
    os.utime(stale, (long_ago, long_ago))
    os.utime(other, (long_ago, long_ago))
    writes = []
    original = module.write_outputs

    def write_then_ctrl_c(*args, **kwargs):
        if writes:
            raise KeyboardInterrupt
        writes.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "write_outputs", write_then_ctrl_c)
    code, out, err = run_cli(capsys, *tiny(model_dirs, str(SHORT[0]), str(SHORT[1]), "--output-dir", str(out_dir)))
    assert code == 130 and out == ""
    assert [line for line in err.splitlines() if line.strip()] == [
        f"interrupted: 1 of 2 files finished (outputs in {out_dir})"]
    assert_outputs(out_dir, SHORT[0].stem, SHORT[0])
    assert not list(out_dir.glob(f"{SHORT[1].stem}.*"))
    assert not stale.exists() and fresh.exists() and other.exists()  # only our own, old temp files


def test_eval_resume_warning_is_one_clean_line(capsys, tmp_path: Path, model_dirs) -> None:
    from asr_spec.cli.evaluation import eval_main

    target_dir, _ = model_dirs
    preset = tmp_path / "tiny.toml"
    preset.write_text(f'model = "{target_dir}"\nlanguage = "en"\n')
    log = tmp_path / "run.jsonl"
    log.write_bytes(b'{"id": "9001-100201-0000", "ref": "IN TH')  # a kill cut the first line short
    data = Path(__file__).parent / "fixtures" / "librispeech"
    argv = ["--preset", str(preset), "--data-dir", str(data), "--split", "test.clean", "--limit", "1", "--quiet",
            "--output", str(log)]
    assert eval_main(argv) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "incomplete last line" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: ") and "UserWarning" not in err, err
    assert "warnings.warn" not in err


@pytest.mark.parametrize("change", [{"chunk_length": 10, "n_samples": 160_000, "nb_max_frames": 1000},
                                    {"hop_length": 320, "nb_max_frames": 1500}], ids=["10 s", "hop 320"])
def test_a_model_whose_feature_extractor_is_not_whispers_window_is_a_model_load_error(tmp_path: Path, model_dirs,
                                                                                     change: dict) -> None:
    """The windows are 30 s of 10 ms hops in the chunking and the encoder: a model folder whose extractor says
    otherwise loaded, and every chunk failed ("longer than the 160000-sample window", an engine error), naming
    neither the folder nor the setting."""
    import json

    from asr_spec.models.loading import load_processor

    target_dir, _ = model_dirs
    folder = tmp_path / "model"
    shutil.copytree(target_dir, folder)
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = folder / name
        if path.is_file():
            config = json.loads(path.read_text())
            (config.get("feature_extractor", config)).update(change)
            path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="feature extractor's settings") as info:
        load_processor(folder)
    assert str(folder) in str(info.value) and "\n" not in str(info.value)
    load_processor(target_dir)  # Whisper's own settings load


def test_a_reader_that_goes_away_ends_the_run_quietly(model_dirs) -> None:
    """`asr-spec transcribe *.flac | head -1`: the pipe's reader left, and the run ended with "error: [Errno 32]
    Broken pipe", exit 2. It ends as a Unix filter does: quietly, with 128 + SIGPIPE."""
    args = tiny(model_dirs, *(str(p) for p in SHORT[:4]), "--quiet")
    process = subprocess.Popen([sys.executable, "-m", "asr_spec", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.stdout.readline()  # the first transcript, then the reader goes
    process.stdout.close()
    _, err = process.communicate(timeout=600)
    assert process.returncode == 141 and b"Broken pipe" not in err and b"Traceback" not in err, err.decode()


def test_model_errors_name_the_model_they_are_about(tmp_path: Path, model_dirs) -> None:
    """A draft of another vocabulary, a feature extractor of another mel count and an empty name were errors
    that did not say which model ("draft and target disagree on vocab_size", "the processor makes 128 mel bins",
    ": no config.json": the empty name read as the current folder)."""
    target_dir, draft_dir = model_dirs
    from asr_spec.testing import random_whisper

    other = tmp_path / "other-vocab"
    random_whisper(vocab_size=70).save_pretrained(other)  # a whole model of a test vocabulary
    with pytest.raises(ModelLoadError, match=f"^{re.escape(str(other))}: .*vocab_size"):
        Transcriber.from_pretrained(target_dir, other, device="cpu")
    mels = tmp_path / "mels"
    shutil.copytree(target_dir, mels)
    processor = json.loads((mels / "processor_config.json").read_text())
    processor["feature_extractor"]["feature_size"] = 128
    (mels / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ModelLoadError, match=f"^{re.escape(str(mels))}: its feature extractor makes 128 mel bins"):
        Transcriber.from_pretrained(mels, device="cpu")
    with pytest.raises(ModelLoadError, match="an empty model name"):
        Transcriber.from_pretrained("", device="cpu")
