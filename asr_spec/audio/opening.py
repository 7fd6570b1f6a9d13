"""Opening an encoded file: which decoder reads it, and what its header says of its length.

    path or bytes ──libsndfile (wav, flac, ogg, mp3, ...)──► raw blocks at the native rate, the header's frame count
                  └─ffmpeg (`asr_spec.audio.ffmpeg`) where libsndfile cannot open it, or cannot be trusted with it──►

libsndfile reads what it can open; ffmpeg is asked only where it cannot (m4a, aac, webm, video containers, ...), where
the header leaves the length out (a FLAC written to a pipe, which libsndfile fails to seek the end of), or where the
header says 0 frames (`_open_past_header`: a recorder killed before it rewrote its header leaves 0 there, whatever
audio follows). A file that opens but fails to decode part-way is an error, not a fallback. The blocks are float32
``(frames, channels)``; downmixing, resampling and the checks on the samples are `asr_spec.audio.loading`'s.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import stat
import tempfile
import warnings
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np
import soundfile as sf

from asr_spec.audio.ffmpeg import ffmpeg_blocks, ffmpeg_duration_s, wav_header
from asr_spec.errors import AudioError

__all__ = ["RawBlocks", "check_file", "check_path", "container_of", "header_duration_s", "open_raw_blocks",
           "pcm16_wav_payload"]

_UNKNOWN_FRAMES = 1 << 62  # libsndfile reports SF_COUNT_MAX (2**63 - 1) frames when a header leaves the length out
_LENGTH_MISSING = "length missing from the header"
_HEADER_SAYS_EMPTY = "0 frames in the header"

# (native_rate_hz, expected_frames, exact_length, blocks): blocks float32 (frames, channels); expected_frames None
# where the header does not say; exact_length whether a short read means truncation (libsndfile's count is exact but
# for MP3, estimated from the bitrate there)
RawBlocks = tuple[int, int | None, bool, Iterator[np.ndarray]]


def open_raw_blocks(file: str | bytes, name: str, block_s: float) -> RawBlocks:
    """Open `file` (a path, or an encoded file's bytes) for reading in blocks of about `block_s` seconds; `name` is
    the input as messages name it. Opening errors raise here, decoding errors while the blocks are read."""
    _refuse_text(file, name)
    try:
        handle = sf.SoundFile(_os_name(file) if isinstance(file, str) else io.BytesIO(file))
    except (sf.LibsndfileError, RuntimeError) as sf_err:
        return _ffmpeg_instead(file, name, block_s, _libsndfile_cause(sf_err))
    n_frames = _header_frames(handle)
    if n_frames and handle.format in ("WAV", "WAVEX"):
        _warn_if_cut_short(file, name, n_frames, handle.samplerate)
    if n_frames == 0 or (n_frames is None and isinstance(file, str)):
        handle.close()
        return _ffmpeg_instead(file, name, block_s, _HEADER_SAYS_EMPTY if n_frames == 0 else _LENGTH_MISSING)
    block_frames = max(1, int(round(block_s * handle.samplerate)))
    return handle.samplerate, n_frames, _exact_length(handle), _soundfile_blocks(handle, name, block_frames)


# what libsndfile says of any file it cannot open whose format it does not know (a file there, regular, readable)
_NOT_A_FILE = "File does not exist or is not a regular file (possibly a pipe?)."


def _libsndfile_cause(err: Exception) -> str:
    """libsndfile's refusal as a message's cause: without its "Error opening <name>: " (not the path again, nor
    "<_io.BytesIO object at 0x7f33...>"), and "not a format libsndfile reads" for its "File does not exist or is
    not a regular file" over a file that exists and is one (callers have checked: `check_file`), e.g. a damaged
    MP3 (an io reviewer's)."""
    cause = re.sub(r"""^Error opening (<.*?>|'.*?'|".*?"): """, "", str(err))
    return "not a format libsndfile reads" if cause.strip() == _NOT_A_FILE else cause


def _exact_length(handle: sf.SoundFile) -> bool:
    """Whether libsndfile's frame count of `handle` is exact: not for MPEG audio, in an .mp3 or inside a WAV
    (`ffmpeg -c:a mp3 -f wav`: a reviewer's intact file was "truncated audio (decoded 61632 of 62186 frames the
    header announces)"), where it is estimated from the bitrate."""
    return handle.format != "MP3" and not handle.subtype.startswith("MPEG")


def header_duration_s(path: str | os.PathLike[str]) -> float | None:
    """Duration of the audio file ``path`` in seconds as its container states it, without decoding: libsndfile's
    frame count (exact; estimated from the bitrate for MP3), else ffprobe's reading of the container; None when
    neither says (a FLAC written to a pipe, raw ADTS). ``AudioError`` when nothing can open it. A header's 0 frames
    is ffprobe's to judge, as the audio is ffmpeg's to decode (`_open_past_header`): 0.0 only where it cannot read
    the file either."""
    name = os.fspath(path)
    check_file(name)
    try:
        with sf.SoundFile(_os_name(name)) as handle:
            n_frames, rate = _header_frames(handle), handle.samplerate
    except (sf.LibsndfileError, RuntimeError) as sf_err:
        return ffmpeg_duration_s(name, _libsndfile_cause(sf_err))
    if n_frames is None:
        return ffmpeg_duration_s(name, _LENGTH_MISSING)
    if n_frames == 0:
        try:
            return ffmpeg_duration_s(name, _HEADER_SAYS_EMPTY)
        except AudioError:  # ffmpeg cannot read it either: empty, as the header says (and as it loads)
            return 0.0
    return float(n_frames) / float(rate)


def check_file(path: str) -> None:
    """`AudioError` unless `path` could be audio: a regular file of at least one byte (`check_path`) that is not
    text. What can be known of a file before any decoder is asked (a stat and its first 4 KiB)."""
    check_path(path)
    _refuse_text(path, path)


def check_path(path: str) -> None:
    """`AudioError` unless `path` is a regular file of at least one byte."""
    try:
        info = os.stat(_os_name(path))
    except FileNotFoundError:
        # a quoted pattern reaches here as it was typed: said so where it names files (a missing "take [2].wav"
        # is only missing)
        pattern = glob.has_magic(path) and bool(glob.glob(path))
        hint = " (a pattern is not expanded here: give the files, e.g. leave it unquoted)" if pattern else ""
        raise AudioError(f"{path}: no such file{hint}") from None
    except OSError as err:
        raise AudioError(f"{path}: cannot be read ({err.strerror})") from None
    if stat.S_ISDIR(info.st_mode):
        raise AudioError(f"{path}: is a directory, not an audio file")
    if not stat.S_ISREG(info.st_mode):  # a named pipe (`<(...)`) or a device: its size says nothing, nor can it be
        # read twice
        raise AudioError(f"{path}: not a regular file (a pipe or a device): save the audio to a file first")
    if info.st_size == 0:
        raise AudioError(f"{path}: empty file (0 bytes)")


def _os_name(path: str) -> str | bytes:
    """`path` as libsndfile can open it: as it is, or as the file system's bytes where it is not UTF-8 (Python's
    surrogate escapes, "caf\udce9.flac": libsndfile encodes a str as UTF-8 and could not open it at all)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(path)
    return path


def _header_frames(handle: sf.SoundFile) -> int | None:
    """Frame count from the header; None when unknown (a streamed FLAC reports libsndfile's SF_COUNT_MAX)."""
    return None if handle.frames >= _UNKNOWN_FRAMES else int(handle.frames)


# the WAVE format tags whose data chunk holds whole frames of `block_align` bytes: PCM, IEEE float, A-law, mu-law,
# and the extensible header (whose subformat is one of them where libsndfile opens it)
_FRAMED_WAVE_TAGS = (0x0001, 0x0003, 0x0006, 0x0007, 0xFFFE)
_RIFF_CHUNKS_READ = 64  # chunk headers read looking for "data" (LIST, bext, fact, ... come before it)


def _riff_declared_frames(stream: BinaryIO) -> int | None:
    """The frames a RIFF/WAVE file's data chunk says it holds: its size field over the fmt chunk's block_align;
    None where it does not say (a size of 0 or 0xFFFFFFFF: a streamed header written before the length was known),
    for compressed formats (ADPCM, GSM: blocks of several frames) or where no data chunk is found."""
    if (head := stream.read(12))[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    block_align = None
    for _ in range(_RIFF_CHUNKS_READ):
        chunk = stream.read(8)
        if len(chunk) < 8:
            return None
        kind, size = chunk[:4], int.from_bytes(chunk[4:], "little")
        if kind == b"fmt ":
            fmt = stream.read(size)
            tag, align = int.from_bytes(fmt[0:2], "little"), int.from_bytes(fmt[12:14], "little")
            block_align = align if tag in _FRAMED_WAVE_TAGS and align else None
            stream.seek(size & 1, 1)
        elif kind == b"data":
            return None if block_align is None or size in (0, 0xFFFFFFFF) else size // block_align
        else:
            stream.seek(size + (size & 1), 1)
    return None


def _warn_if_cut_short(file: str | bytes, name: str, n_frames: int, rate: int) -> None:
    """A warning where a WAV's data chunk announces more frames than the file holds (`n_frames`: libsndfile counts
    what is there): a recording cut short (a copy stopped, a recorder killed after writing its header) was read as
    the samples it holds with no word of what is missing. What is there is whole PCM: it is transcribed."""
    try:
        with (open(_os_name(file), "rb") if isinstance(file, str) else io.BytesIO(file)) as stream:
            declared = _riff_declared_frames(stream)
    except OSError:
        return
    if declared is not None and declared > n_frames:
        warnings.warn(f"{name}: truncated audio (the WAV header announces {declared / rate:.2f} s, the file holds "
                      f"{n_frames / rate:.2f} s): transcribing what it holds", stacklevel=2)


def _soundfile_blocks(handle: sf.SoundFile, name: str, block_frames: int) -> Iterator[np.ndarray]:
    with handle:
        while True:
            try:
                raw = handle.read(block_frames, dtype="float32", always_2d=True)
            except (sf.LibsndfileError, RuntimeError) as err:
                raise AudioError(f"{name}: corrupt or truncated audio ({err})") from err
            if raw.shape[0] == 0:
                return
            yield raw


def _ffmpeg_instead(file: str | bytes, name: str, block_s: float, why: str) -> RawBlocks:
    """Read `file` with ffmpeg, `why` being why not with libsndfile; bytes from a temporary file, which may go once
    ffmpeg has opened it."""
    if isinstance(file, bytes):
        with tempfile.NamedTemporaryFile(prefix="asr-spec-", suffix=".audio") as spooled:
            spooled.write(file)
            spooled.flush()
            return _ffmpeg_instead(spooled.name, name, block_s, why)
    if why == _HEADER_SAYS_EMPTY:
        return _open_past_header(file, name, block_s)
    rate, blocks = ffmpeg_blocks(file, block_s, why, name)
    return rate, None, False, blocks


def _open_past_header(path: str, name: str, block_s: float) -> RawBlocks:
    """A header that says 0 frames may never have been rewritten: a recorder killed before it wrote the sizes
    leaves 0 as its RIFF and data chunk sizes, the audio after them. ffmpeg reads such a data chunk to the end of
    the file; what it finds decides. Nothing there, or ffmpeg unable to read it: empty, as the header says (raised
    now, not at the first block)."""
    try:
        rate, blocks = ffmpeg_blocks(path, block_s, _HEADER_SAYS_EMPTY, name)
    except AudioError as err:
        raise AudioError(f"{name}: no audio samples (0 frames)") from err
    first = next(blocks, None)
    if first is None:
        raise AudioError(f"{name}: no audio samples (0 frames)")
    return rate, None, False, _prepended(first, blocks)


def _prepended(first: np.ndarray, rest: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """`first`, then `rest`; `rest` (ffmpeg) let go when this is."""
    with contextlib.closing(rest):  # type: ignore[type-var]  # generators have close()
        yield first
        yield from rest


def _refuse_text(file: str | bytes, name: str) -> None:
    """A text file is not audio: said so before a decoder is asked (libsndfile's MP3 decoder writes its resync
    notes to stderr over a text named .mp3, and its error is not the cause; ffmpeg refuses playlists and scripts
    anyway: `asr_spec.audio.ffmpeg.DEMUXERS`). `file`: a path or an encoded file's bytes."""
    if _is_text(file):
        raise AudioError(f"{name}: not a readable audio file (text, not audio)")


def _is_text(file: str | bytes, n_bytes: int = 4096) -> bool:
    """Whether the file's first `n_bytes` are text (UTF-8 with no control character but whitespace)."""
    if isinstance(file, bytes):
        head = file[:n_bytes]
    else:
        try:
            with open(_os_name(file), "rb") as handle:
                head = handle.read(n_bytes)
        except OSError:
            return False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not merely a character cut at the end of what was read
            return False
        text = head[:err.start].decode("utf-8")
    return bool(text.strip()) and all(ch.isprintable() or ch in "\t\r\n\f\v\ufeff" for ch in text)


# the first bytes of the containers a user may pipe or send where raw PCM16 is expected (`container_of`)
_CONTAINERS = ((0, b"RIFF", "a WAV file"), (0, b"fLaC", "a FLAC file"), (0, b"OggS", "an Ogg file"),
               (0, b"ID3", "an MP3 file"), (0, b"FORM", "an AIFF file"), (0, b"\x1aE\xdf\xa3", "a WebM/Matroska file"),
               (4, b"ftyp", "an MP4/M4A file"))


def container_of(head: bytes) -> str | None:
    """What encoded file the first bytes of a stream of raw PCM16 samples are the header of ("a FLAC file"), or
    None: where raw samples are expected (`asr-spec stream -`, a realtime append), such bytes decode as loud noise
    and the stream "transcribes" to nothing. Raw samples start with one of these 4-byte tags about once in 2**32."""
    for offset, tag, name in _CONTAINERS:
        if head[offset:offset + len(tag)] == tag:
            return name
    return None


def pcm16_wav_payload(head: bytes) -> int | None:
    """Where the samples start in `head`, the first bytes of a WAV file, when they are what raw PCM16 input is
    (16-bit integer PCM, mono, 16 kHz: `arecord -f S16_LE -r 16000 -c 1` without `-t raw` writes such a file):
    after its "data" chunk's header (`ffmpeg.wav_header`); None for any other WAV, or a header not all in `head`."""
    stream = io.BytesIO(head)
    try:
        fmt = wav_header(stream)
    except ValueError:
        return None
    return stream.tell() if fmt == (1, 1, 16000, 16) else None
