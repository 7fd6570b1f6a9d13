"""Audio loading: formats, sources, mono, resampling, streaming, and the errors for bad input."""

from __future__ import annotations

import io
import os
import shutil
import struct
import subprocess
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
import torch

from asr_spec.audio.loading import audio_duration_s, header_duration_s, load_audio, stream_audio, to_mono
from asr_spec.audio.opening import check_file
from asr_spec.errors import AudioError, InputError

SR = 16_000


def _tone(n: int, rate: int, freq: float = 440.0, amplitude: float = 0.3) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * freq * np.arange(n) / rate)).astype(np.float32)


@pytest.fixture()
def tone_16k() -> np.ndarray:
    return _tone(3 * SR, SR)


@pytest.mark.parametrize("suffix,tolerance", [("wav", 1e-4), ("flac", 1e-4), ("ogg", 0.05), ("mp3", 0.05)])
def test_formats_load_as_float32_mono(tmp_path: Path, tone_16k: np.ndarray, suffix: str, tolerance: float) -> None:
    path = tmp_path / f"tone.{suffix}"
    sf.write(path, tone_16k, SR)
    audio = load_audio(path)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert abs(len(audio) - len(tone_16k)) <= 1200  # lossy codecs may pad a frame
    n = min(len(audio), len(tone_16k)) - 2000
    # lossy codecs shift phase a little: compare energy, and samples only for lossless formats
    assert np.sqrt(np.mean(audio[:n] ** 2)) == pytest.approx(np.sqrt(np.mean(tone_16k[:n] ** 2)), rel=tolerance + 0.01)
    if suffix in {"wav", "flac"}:
        np.testing.assert_allclose(audio, tone_16k, atol=tolerance)
    assert audio_duration_s(path) == pytest.approx(3.0, abs=0.08)


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs ffmpeg for the fallback")
def test_formats_libsndfile_cannot_open_fall_back_to_ffmpeg(tmp_path: Path, tone_16k: np.ndarray) -> None:
    wav, m4a = tmp_path / "tone.wav", tmp_path / "tone.m4a"
    sf.write(wav, tone_16k, SR)
    subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(wav), "-c:a", "aac", str(m4a)], check=True)
    audio = load_audio(m4a)
    assert audio.dtype == np.float32 and abs(len(audio) - len(tone_16k)) < 2048
    assert audio_duration_s(m4a) == pytest.approx(3.0, abs=0.1)


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs ffmpeg to make the file")
def test_mp3_inside_a_wav_is_not_called_truncated(tmp_path: Path, tone_16k: np.ndarray) -> None:
    """libsndfile estimates the length of MPEG audio in a WAV from its bitrate, as in an .mp3: a reviewer's intact
    file was refused as "truncated audio (decoded 61632 of 62186 frames the header announces)"."""
    wav, mp3_wav = tmp_path / "tone.wav", tmp_path / "mp3.wav"
    sf.write(wav, tone_16k, SR)
    subprocess.run(["ffmpeg", "-loglevel", "error", "-i", str(wav), "-c:a", "mp3", "-f", "wav", str(mp3_wav)],
                   check=True)
    if not sf.info(str(mp3_wav)).subtype.startswith("MPEG"):
        pytest.skip("this libsndfile does not read MPEG audio in a WAV")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # intact: no "truncated audio" either (its estimate ran 1 % over)
        audio = load_audio(mp3_wav)
    assert abs(len(audio) - len(tone_16k)) < 2048


def test_float_audio_a_little_too_loud_is_told_to_rescale_not_to_divide_by_32768() -> None:
    """A float WAV peaking at 5.6 was told "int16-scale audio: divide by 32768" (it would have become inaudible)."""
    from asr_spec.audio.loading import AudioError, check_scale

    for peak, hint in [(5.6, "rescale it"), (200.5, "rescale it"), (3000.0, "divide by 32768"), (1e6, "rescale it"),
                       (59.0, "divide by 32768")]:  # whole numbers: quiet int16 audio
        with pytest.raises(AudioError, match=hint):
            check_scale(np.array([0.0 if peak == 59.0 else 0.1, -peak], np.float32), "loud.wav")
    check_scale(np.array([3.9], np.float32), "fine.wav")


def test_stereo_is_averaged_and_resampled_with_soxr(tmp_path: Path) -> None:
    rate = 44_100
    left, right = _tone(rate, rate, 300.0), _tone(rate, rate, 500.0, 0.1)
    path = tmp_path / "stereo.wav"
    sf.write(path, np.stack([left, right], axis=1), rate, subtype="FLOAT")
    audio = load_audio(path)
    expected = soxr.resample((left + right) / 2, rate, SR, quality="HQ")
    assert len(audio) == SR
    np.testing.assert_allclose(audio, expected, atol=1e-6)


def test_arrays_tensors_and_dicts(tone_16k: np.ndarray) -> None:
    np.testing.assert_array_equal(load_audio(tone_16k), tone_16k)
    np.testing.assert_array_equal(load_audio(torch.from_numpy(tone_16k)), tone_16k)
    np.testing.assert_allclose(load_audio(torch.from_numpy(tone_16k).to(torch.bfloat16)), tone_16k, atol=4e-3)
    stereo_first = np.stack([tone_16k, tone_16k])  # (channels, samples): datasets / torchcodec layout
    np.testing.assert_array_equal(load_audio({"array": stereo_first, "sampling_rate": SR}), tone_16k)
    np.testing.assert_array_equal(load_audio(stereo_first.T.copy()), tone_16k)  # (samples, channels): soundfile
    int16 = (tone_16k * 32768).astype(np.int16)
    np.testing.assert_allclose(load_audio(int16), tone_16k, atol=1 / 32768 + 1e-6)
    tone_8k = _tone(8_000, 8_000)
    resampled = load_audio({"path": "ignored.wav", "array": tone_8k, "sampling_rate": 8_000})
    assert len(resampled) == SR
    np.testing.assert_array_equal(load_audio(tone_8k, input_sampling_rate=8_000), resampled)
    one = io.BytesIO()  # one sample at 48 kHz resamples to none: an empty signal, as the same file streamed gives
    sf.write(one, np.full(1, 0.5, np.float32), 48_000, format="WAV")
    assert load_audio({"bytes": one.getvalue()}).shape == (0,)


def test_dict_with_bytes_or_path(tmp_path: Path, tone_16k: np.ndarray) -> None:
    path = tmp_path / "tone.flac"
    sf.write(path, tone_16k, SR)
    from_bytes = load_audio({"bytes": path.read_bytes(), "path": "tone.flac"})
    from_path = load_audio({"path": str(path), "array": None})
    np.testing.assert_array_equal(from_bytes, from_path)
    np.testing.assert_allclose(from_path, tone_16k, atol=1e-4)


def test_a_tenth_of_a_second_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "short.wav"
    sf.write(path, _tone(4_410, 44_100), 44_100)
    assert len(load_audio(path)) == 1_600


# ------------------------------------------------------------------------------------------------ errors


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _zero_samples(path: Path) -> Path:
    sf.write(path, np.zeros(0, np.float32), SR)  # a valid WAV header announcing 0 frames
    return path


def _write_text(path: Path) -> Path:
    path.write_text("this is a text file, not a RIFF header\n" * 20)
    return path


def _truncated_flac(path: Path) -> Path:
    sf.write(path, np.random.default_rng(0).uniform(-0.5, 0.5, 5 * SR).astype(np.float32), SR)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _nan_wav(path: Path) -> Path:
    samples = _tone(SR, SR)
    samples[[10, 500, 9_000]] = [np.nan, np.inf, -np.inf]
    sf.write(path, samples, SR, subtype="FLOAT")
    return path


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda d: d / "missing.wav", "missing.wav: no such file"),
        (lambda d: d, "is a directory"),
        (lambda d: _write_bytes(d / "empty.wav", b""), "empty.wav: empty file"),
        (lambda d: _write_text(d / "notes.wav"), "notes.wav: not a readable audio file"),
        # eight bytes that ffmpeg opens as a stream of 0 Hz and 0 channels: a ZeroDivisionError traceback before
        (lambda d: _write_bytes(d / "garbage.flac", b"garbage\n"), "garbage.flac: not a readable audio file"),
        # random bytes named .mp3: libsndfile's cause was "File does not exist or is not a regular file"
        (lambda d: _write_bytes(d / "noise.mp3", np.random.default_rng(3).bytes(3000)),
         r"noise.mp3: not a readable audio file \(not a format libsndfile reads"),
        (lambda d: _truncated_flac(d / "cut.flac"), "cut.flac: corrupt or truncated audio"),
        (lambda d: _zero_samples(d / "zero.wav"), "zero.wav: no audio samples"),
        (lambda d: _nan_wav(d / "nan.wav"), r"nan.wav: 3 non-finite samples"),
    ],
)
def test_bad_files_raise_audio_error_naming_file_and_cause(tmp_path: Path, make, needle: str) -> None:
    path = make(tmp_path)
    with pytest.raises(AudioError, match=needle):
        load_audio(path)
    with pytest.raises(AudioError, match=needle):
        list(stream_audio(path))
    if path.name == "garbage.flac":  # its length is read the same way (the command line's progress bar)
        with pytest.raises(AudioError, match=needle):
            audio_duration_s(path)
    if needle.split(": ")[-1] in ("no such file", "is a directory", "empty file", "not a readable audio file"):
        with pytest.raises(AudioError, match=needle):  # found before any model loads (`asr-spec transcribe`)
            check_file(str(path))
    else:
        check_file(str(path))  # only decoding tells these


@pytest.mark.parametrize(
    "source,needle",
    [
        (np.zeros(0, np.float32), "<array>: no audio samples"),
        (np.zeros((0, 2), np.float32), r"<array>: no audio samples \(shape \(0, 2\)\)"),
        (np.zeros((1, 0), np.float32), "<array>: no audio samples"),
        (np.array([0.0, np.nan, np.nan, 0.5], np.float32), "<array>: 2 non-finite samples"),
        (np.zeros((4, 4), np.float32), "cannot tell channels"),
        (np.zeros((2, 3, 100), np.float32), "cannot tell channels"),
        (np.zeros(10, np.complex64), "unsupported sample dtype complex64"),
        ({"sampling_rate": SR}, "needs 'array'"),
        ({"array": np.zeros(10, np.float32)}, "no 'sampling_rate'"),
        ([0.1, 0.2], "<list>: unsupported audio source type"),
    ],
)
def test_bad_in_memory_sources(source: object, needle: str) -> None:
    with pytest.raises(AudioError, match=needle):
        load_audio(source)  # type: ignore[arg-type]


def test_bad_arguments_are_input_errors(tmp_path: Path, tone_16k: np.ndarray) -> None:
    path = tmp_path / "tone.wav"
    sf.write(path, tone_16k, SR)
    with pytest.raises(InputError, match="sampling_rate"):
        load_audio(tone_16k, sampling_rate=0)
    with pytest.raises(InputError, match="input_sampling_rate is only for arrays"):
        load_audio(path, input_sampling_rate=8_000)
    with pytest.raises(InputError, match="block_s"):
        stream_audio(path, block_s=0)


def test_to_mono_keeps_1d_and_averages_either_layout() -> None:
    x = np.arange(6, dtype=np.float32)
    assert to_mono(x, "x") is x
    np.testing.assert_array_equal(to_mono(np.stack([x, 3 * x]), "x"), 2 * x)
    np.testing.assert_array_equal(to_mono(np.stack([x, 3 * x], axis=1), "x"), 2 * x)


# ------------------------------------------------------------------------------------------------ streaming


def test_stream_equals_load_and_blocks_are_bounded(tmp_path: Path) -> None:
    rate = 44_100
    signal = np.random.default_rng(1).uniform(-0.5, 0.5, 23 * rate).astype(np.float32)
    path = tmp_path / "long.flac"
    sf.write(path, signal, rate)
    blocks = list(stream_audio(path, block_s=4.0))
    assert max(len(b) for b in blocks) <= 4 * SR + 512  # soxr releases its filter delay unevenly
    assert len(blocks) >= 6
    streamed = np.concatenate(blocks)
    np.testing.assert_array_equal(streamed, load_audio(path))
    assert len(streamed) == 23 * SR
    assert audio_duration_s(path) == pytest.approx(23.0)


def test_stream_is_lazy_and_holds_one_block(tmp_path: Path) -> None:
    path = tmp_path / "long.wav"
    n = 240 * SR  # 4 minutes: 15 MB as float32
    sf.write(path, _tone(n, SR), SR, subtype="PCM_16")
    tracemalloc.start()
    try:
        total = 0
        for block in stream_audio(path, block_s=5.0):
            total += len(block)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == n
    assert peak_bytes < 0.15 * n * 4  # a few 5 s blocks, never the whole 4 minutes


def test_stream_opening_errors_raise_at_the_call(tmp_path: Path) -> None:
    with pytest.raises(AudioError, match="no such file"):
        stream_audio(tmp_path / "missing.flac")  # no next() needed


def test_a_quoted_pattern_is_named_as_one(tmp_path: Path, tone_16k: np.ndarray) -> None:
    """A glob pattern given as a file (quoted, so no shell expanded it) says why nothing is there."""
    sf.write(tmp_path / "a.wav", tone_16k, 16000)
    with pytest.raises(AudioError, match=r"\*\.wav: no such file \(a pattern is not expanded here"):
        load_audio(str(tmp_path / "*.wav"))
    with pytest.raises(AudioError, match=r"missing\.wav: no such file$"):
        load_audio(str(tmp_path / "missing.wav"))
    with pytest.raises(AudioError, match=r"take \[2\]\.wav: no such file$"):  # a name with brackets, matching none
        load_audio(str(tmp_path / "take [2].wav"))


def test_a_file_name_that_is_not_utf8_loads(tmp_path: Path, tone_16k: np.ndarray) -> None:
    """A Latin-1 name ("caf\\xe9.flac") reaches Python as a str with a surrogate escape, which libsndfile's UTF-8
    names could not hold: the file could not be opened at all ('utf-8' codec can't encode character '\\udce9')."""
    raw = os.fsencode(tmp_path) + b"/caf\xe9.flac"
    try:
        with open(raw, "wb") as handle:
            sf.write(handle, tone_16k, SR, format="FLAC")
    except OSError:
        pytest.skip("this file system takes UTF-8 names only")
    name = os.fsdecode(raw)
    assert audio_duration_s(name) == pytest.approx(len(tone_16k) / SR)
    assert np.allclose(load_audio(name), load_audio(tone_16k), atol=1e-4)


def test_a_playlist_is_not_followed_to_the_files_it_names(tmp_path: Path, tone_16k: np.ndarray) -> None:
    """ffmpeg reads an HLS playlist (or a concat script) by its content, whatever its name, and opens the files it
    names: an uploaded playlist had the server transcribe a file of its own disk. A text file is not audio."""
    target = tmp_path / "secret.flac"
    sf.write(target, tone_16k, SR)
    playlist = tmp_path / "upload.wav"
    playlist.write_text(f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:1.0,\n{target}\n#EXT-X-ENDLIST\n")
    concat = tmp_path / "script.flac"
    concat.write_text(f"ffconcat version 1.0\nfile '{target}'\n")
    for path in (playlist, concat):
        with pytest.raises(AudioError, match="not a readable audio file .*text, not audio"):
            load_audio(path)
        with pytest.raises(AudioError, match="text, not audio"):
            audio_duration_s(path)


def test_text_named_as_audio_is_refused_before_a_decoder_reads_it(tmp_path: Path, capfd) -> None:
    """A text file named .mp3 (an upload, a path): the refusal named libsndfile's unrelated cause ("File does not
    exist or is not a regular file (possibly a pipe?)") and its MP3 decoder wrote resync notes to stderr, outside
    logging, a server's log included. Now one cause, before any decoder."""
    fake = tmp_path / "fake.mp3"
    fake.write_text("hi\n")

    def uploaded(path: Path) -> np.ndarray:
        return load_audio({"bytes": path.read_bytes(), "path": "fake.mp3"})

    for read in (load_audio, audio_duration_s, uploaded):
        with pytest.raises(AudioError) as refused:
            read(fake)
        assert str(refused.value).endswith(": not a readable audio file (text, not audio)"), refused.value
    assert capfd.readouterr().err == ""


needs_ffmpeg = pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs ffmpeg")


@needs_ffmpeg
@pytest.mark.parametrize("extra", ["#\x01\n", "#\xff\xfe\n"])
def test_a_playlist_with_a_byte_that_is_not_text_is_refused_by_ffmpeg_itself(tmp_path: Path, tone_16k: np.ndarray,
                                                                                extra: str) -> None:
    """One control or non-UTF-8 byte made the playlist "not text", and ffmpeg followed it to a file of the server's
    disk; ffmpeg now reads only audio containers (`ffmpeg.DEMUXERS`), whatever the bytes."""
    target = tmp_path / "secret.flac"
    sf.write(target, tone_16k, SR)
    playlist = tmp_path / "upload.wav"
    playlist.write_bytes(f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n{extra}#EXTINF:1.0,\n{target}\n#EXT-X-ENDLIST\n"
                         .encode("latin-1"))
    for read in (load_audio, audio_duration_s, lambda path: load_audio({"bytes": path.read_bytes()})):
        with pytest.raises(AudioError, match="format asr-spec does not read"):
            read(playlist)


def _ffmpeg(*args: str) -> None:
    subprocess.run(["ffmpeg", "-nostdin", "-loglevel", "error", "-y", *args], check=True)


@needs_ffmpeg
@pytest.mark.parametrize("layout", ["2.1", "quad", "5.1", "7.1"])
def test_every_channel_of_a_file_ffmpeg_decodes_is_averaged(tmp_path: Path, layout: str) -> None:
    """3-, 5.1- and 7.1-channel m4a / ac3 / mka files failed ("cannot reshape array of size 4096 into shape (6)":
    ffmpeg's buffers are not whole frames) and a "quad" file was read as mono: 12 s of interleaved samples for 3 s.
    A lossless FLAC in Matroska, which libsndfile cannot open, decodes to the WAV's own average of the channels."""
    n_channels = {"2.1": 3, "quad": 4, "5.1": 6, "7.1": 8}[layout]
    rng = np.random.default_rng(0)
    pcm = (rng.uniform(-0.2, 0.2, (3 * 48_000, n_channels)) * 32768).astype(np.int16)
    wav, mka = tmp_path / "in.wav", tmp_path / "in.mka"
    sf.write(wav, pcm, 48_000, subtype="PCM_16")
    _ffmpeg("-i", str(wav), "-af", f"channelmap=channel_layout={layout}", "-c:a", "flac", str(mka))
    audio = load_audio(mka)
    assert len(audio) == len(load_audio(wav)) == 3 * SR
    np.testing.assert_allclose(audio, load_audio(wav), atol=1e-6)
    assert audio_duration_s(mka) == pytest.approx(3.0, abs=0.01)


@needs_ffmpeg
def test_an_encoded_file_in_memory_reads_as_its_path_does(tmp_path: Path, tone_16k: np.ndarray) -> None:
    """{"bytes"} of an m4a never reached ffmpeg ("Error opening <_io.BytesIO object at 0x7f33...>")."""
    wav, m4a = tmp_path / "tone.wav", tmp_path / "tone.m4a"
    sf.write(wav, tone_16k, SR)
    _ffmpeg("-i", str(wav), "-c:a", "aac", str(m4a))
    np.testing.assert_array_equal(load_audio({"bytes": m4a.read_bytes(), "path": "up.m4a"}), load_audio(m4a))
    with pytest.raises(AudioError, match=r"^up\.m4a: not a readable audio file \((?!.*BytesIO)"):
        load_audio({"bytes": b"\x00\x01" * 500, "path": "up.m4a"})


@needs_ffmpeg
def test_ffmpeg_decodes_as_blocks_are_read_and_stops_when_they_are_let_go(tmp_path: Path) -> None:
    """audioread's reader thread queued the whole decoded file whatever the pace of reading (208 MB for a 20-minute
    webm after one block); ffmpeg now writes into a pipe that waits for the reader."""
    from asr_spec.audio.ffmpeg import ffmpeg_blocks

    webm = tmp_path / "long.webm"
    _ffmpeg("-f", "lavfi", "-i", "sine=frequency=300:sample_rate=48000:duration=600", "-ac", "2", "-c:a", "libopus",
            str(webm))
    rate, blocks = ffmpeg_blocks(str(webm), 10.0, "test")
    first = next(blocks)
    assert rate == 48_000 and first.shape == (480_000, 2) and first.dtype == np.float32
    blocks.close()  # the consumer goes: ffmpeg is stopped, not left decoding into a queue
    rate, blocks = ffmpeg_blocks(str(webm), 60.0, "test")
    assert sum(block.shape[0] for block in blocks) == pytest.approx(600 * 48_000, abs=48_000)


def test_wav_format_reads_the_header_ffmpeg_writes() -> None:
    from asr_spec.audio.ffmpeg import wav_format

    def header(tag: int, channels: int, bits: int, extra: bytes = b"") -> io.BytesIO:
        fmt = struct.pack("<HHIIHH", tag, channels, 48_000, 48_000 * channels * bits // 8, channels * bits // 8,
                          bits) + extra
        body = b"WAVE" + b"LIST" + struct.pack("<I", 3) + b"abc\x00" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        return io.BytesIO(b"RIFF\xff\xff\xff\xff" + body + b"data\xff\xff\xff\xff" + b"\x00" * 8)

    extensible = struct.pack("<HHI", 22, 32, 0x3F) + b"\x03\x00\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x008\x9bq"
    assert wav_format(header(0xFFFE, 6, 32, extensible)) == (48_000, 6)
    stream = header(3, 1, 32)
    assert wav_format(stream) == (48_000, 1) and stream.read() == b"\x00" * 8  # up to the data's first byte
    assert wav_format(io.BytesIO(b"")) is None  # ffmpeg wrote nothing
    with pytest.raises(ValueError, match="not float32 audio"):
        wav_format(header(1, 2, 16))
    with pytest.raises(ValueError, match="not a WAV stream"):
        wav_format(io.BytesIO(b"OggS" + b"\x00" * 20))


def test_a_named_pipe_is_not_called_an_empty_file(tmp_path: Path) -> None:
    fifo = tmp_path / "audio.wav"
    os.mkfifo(fifo)
    with pytest.raises(AudioError, match="not a regular file"):
        load_audio(fifo)


@needs_ffmpeg
def test_an_input_refused_part_way_stops_its_ffmpeg_at_once(tmp_path: Path) -> None:
    """A header-less upload refused past --max-audio-s (the server's 413) kept its ffmpeg blocked on the pipe, and
    the deleted upload open, until Python's cyclic collector ran (the refusal's traceback held the readers)."""
    import gc

    from asr_spec.transcribe.frontend import FrontEnd
    from asr_spec.transcribe.inputs import Input
    from asr_spec.transcribe.options import TranscribeOptions

    m4a = tmp_path / "long.m4a"
    _ffmpeg("-f", "lavfi", "-i", "sine=frequency=300:sample_rate=16000:duration=120", "-c:a", "aac", str(m4a))
    item = Input(1, "upload", str(m4a), max_samples=5 * SR)
    gc.disable()
    try:
        list(FrontEnd(TranscribeOptions.from_values(chunking="stride", block_s=1.0), None)._chunks([item]))
        assert "longer than the limit of 5 s" in item.error
        children = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "comm="], capture_output=True, text=True)
        assert "ffmpeg" not in children.stdout.split()
    finally:
        gc.enable()


@needs_ffmpeg
def test_a_video_without_audio_says_so(tmp_path: Path) -> None:
    """ffmpeg's advice for its command line ("To ignore this, add a trailing '?' to the map") was the message."""
    video = tmp_path / "silent-film.mp4"
    _ffmpeg("-f", "lavfi", "-i", "testsrc=duration=1:size=64x64:rate=5", "-c:v", "mpeg4", str(video))
    with pytest.raises(AudioError, match=r"silent-film\.mp4: not a readable audio file \(.*ffmpeg: no audio stream\)$"):
        load_audio(video)


def _sizes_zeroed(path: Path) -> Path:
    """`path`'s WAV with 0 as its RIFF and data chunk sizes: the header a recorder killed before it rewrites them
    leaves, whatever audio follows."""
    data = bytearray(path.read_bytes())
    at = data.index(b"data")
    data[4:8] = data[at + 4 : at + 8] = struct.pack("<I", 0)
    path.write_bytes(bytes(data))
    return path


@needs_ffmpeg
def test_a_wav_whose_header_says_0_bytes_reads_the_audio_that_follows(tmp_path: Path) -> None:
    """libsndfile's 0 frames was taken as an empty file ("no audio samples (0 frames)") though ffprobe gives its
    length and ffmpeg decodes it; a header with only 0 sizes and nothing after it is still empty."""
    tone = _tone(2 * SR, SR)
    path = tmp_path / "killed.wav"
    sf.write(path, tone, SR, subtype="PCM_16")
    expected = load_audio(path)
    _sizes_zeroed(path)
    np.testing.assert_array_equal(load_audio(path), expected)
    np.testing.assert_array_equal(np.concatenate(list(stream_audio(path, block_s=0.5))), expected)
    np.testing.assert_array_equal(load_audio({"bytes": path.read_bytes(), "path": "up.wav"}), expected)
    assert header_duration_s(path) == pytest.approx(2.0) and audio_duration_s(path) == pytest.approx(2.0)
    empty = _sizes_zeroed(_zero_samples(tmp_path / "empty.wav"))
    for source in (empty, {"bytes": empty.read_bytes(), "path": "empty.wav"}):
        with pytest.raises(AudioError, match=r"empty\.wav: no audio samples \(0 frames\)$"):
            load_audio(source)
    with pytest.raises(AudioError, match=r"empty\.wav: no audio samples \(0 frames\)$"):
        stream_audio(empty)  # at the call, before the first block, as before
    assert header_duration_s(empty) is None and audio_duration_s(empty) == 0.0  # ffprobe: no length; decoded: none


@pytest.mark.parametrize(("head", "name"), [
    (b"RIFF\x24\x00\x00\x00WAVE", "a WAV file"), (b"fLaC\x00", "a FLAC file"), (b"OggS\x00\x02", "an Ogg file"),
    (b"ID3\x04\x00", "an MP3 file"), (b"\x00\x00\x00\x20ftypM4A ", "an MP4/M4A file"),
    (b"\x1aE\xdf\xa3\x01", "a WebM/Matroska file"), (b"FORM\x00\x00", "an AIFF file"),
    (np.array([0, 120, -3, 18770], "<i2").tobytes(), None), (b"RIF", None), (b"", None)])
def test_an_encoded_files_header_is_told_from_raw_samples(head: bytes, name: str | None) -> None:
    from asr_spec.audio.opening import container_of

    assert container_of(head) == name


@pytest.mark.parametrize(("rate", "channels", "subtype", "plain"), [
    (16000, 1, "PCM_16", True), (44100, 1, "PCM_16", False), (16000, 2, "PCM_16", False),
    (16000, 1, "FLOAT", False), (16000, 1, "PCM_24", False)])
def test_a_wav_of_raw_pcm16_samples_is_read_past_its_header(rate: int, channels: int, subtype: str,
                                                              plain: bool) -> None:
    """Only a 16 kHz mono 16-bit PCM WAV holds what raw PCM16 input is: its samples start after the data chunk's
    header (past any other chunk); other WAVs, and a header cut short, give None."""
    from asr_spec.audio.opening import pcm16_wav_payload

    samples = (np.arange(480 * channels, dtype=np.int16).reshape(480, channels) * 7)
    encoded = io.BytesIO()
    sf.write(encoded, samples, rate, format="WAV", subtype=subtype)
    data = encoded.getvalue()
    at = pcm16_wav_payload(data)
    assert (at is not None) == plain
    if plain:
        assert data[at:] == samples.astype("<i2").tobytes()
        assert pcm16_wav_payload(data[:at - 1]) is None
        # a format chunk too short for its fields (a struct.error before): no samples it can say
        short = data[:12] + b"fmt " + (4).to_bytes(4, "little") + data[20:24] + data[at - 8:]
        assert pcm16_wav_payload(short) is None


def test_a_wav_cut_short_is_transcribed_with_a_warning_saying_so(tmp_path: Path) -> None:
    """A WAV whose data chunk announces more than the file holds (a copy stopped half-way) was read as the samples
    it holds with no word (libsndfile counts what is there): now a warning gives both lengths; the whole PCM that is
    there is kept. An intact WAV, and one whose header leaves the length out, say nothing."""
    whole = tmp_path / "whole.wav"
    sf.write(whole, _tone(4 * SR, SR), SR, subtype="PCM_16")
    data = whole.read_bytes()
    cut = _write_bytes(tmp_path / "cut.wav", data[:len(data) // 2])
    with pytest.warns(UserWarning, match=r"cut.wav: truncated audio \(the WAV header announces 4.00 s, the file "
                                         r"holds 2.00 s\): transcribing what it holds"):
        samples = load_audio(cut)
    assert abs(len(samples) - 2 * SR) < 16
    with pytest.warns(UserWarning, match="truncated audio"):
        load_audio({"bytes": cut.read_bytes(), "path": "cut.wav"})
    unknown = bytearray(data)
    at = unknown.index(b"data") + 4
    unknown[at:at + 4] = (0xFFFFFFFF).to_bytes(4, "little")  # a streamed header: the length not yet known
    for path in (whole, _write_bytes(tmp_path / "streamed.wav", bytes(unknown))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(load_audio(path)) == 4 * SR
