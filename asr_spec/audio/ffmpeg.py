"""ffmpeg as a decoder of last resort: the formats libsndfile cannot open (m4a, aac, webm, video containers, ...).

    path ──ffmpeg (a subprocess: one audio stream, float32 WAV on a pipe)──► `wav_format` of its header
         ──blocks of (frames, channels) float32, read as they are consumed──► loading.py (downmix, resample)

Three things this module decides, each here only:

- **Which containers ffmpeg may read** (`DEMUXERS`, passed as `-format_whitelist`, and the file protocol only). ffmpeg
  picks a demuxer by content, whatever the name, and some demuxers open what a file names: an HLS playlist, a
  concat script or an SDP file in an upload made the server transcribe a file of its own disk. None of those is on
  the list, so such a file is refused by ffmpeg itself, whatever bytes it holds.
- **How the audio comes back**: the first audio stream (`-map 0:a:0`), every channel, at its own rate, as float32
  WAV (its header says the rate and channel count: no guessing from ffmpeg's log, which named a "quad" file mono),
  so downmixing and resampling are loading.py's, the same as for libsndfile's formats.
- **Memory**: blocks are read from the pipe as they are consumed, so ffmpeg waits while a block is transcribed (the
  pipe's back-pressure); a 20-minute webm no longer piled up 200 MB of decoded audio in a reader thread's queue.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from typing import IO, NamedTuple, cast

import numpy as np

from asr_spec.errors import AudioError

__all__ = ["DEMUXERS", "WavFormat", "error_text", "ffmpeg_blocks", "ffmpeg_duration_s", "wav_format", "wav_header"]

# ffmpeg demuxers of audio and audio-video files (camcorder DV, Windows Media Center WTV, dictation DSS / ACT /
# QCP, Audible AA among them), none of which opens another file or a URL on its own (HLS, concat, SDP, image
# sequences and lavfi are left out on purpose; MXF too, unchecked whether it follows external essence)
DEMUXERS = (
    "aa", "aac", "ac3", "act", "aiff", "amr", "amrnb", "amrwb", "ape", "asf", "au", "avi", "caf", "dsf", "dss",
    "dts", "dtshd", "dv", "eac3", "flac", "flv", "gsm", "loas", "matroska", "mlp", "mov", "mp3", "mpc", "mpc8",
    "mpeg", "mpegts", "nut", "ogg", "qcp", "rm", "shn", "tak", "truehd", "tta", "voc", "w64", "wav", "wtv", "wv",
    "xwma",
)
_FLOAT32_FORMATS = (3, 0xFFFE)  # WAVE_FORMAT_IEEE_FLOAT, WAVE_FORMAT_EXTENSIBLE (its sub-format: IEEE float)
_MAX_HEADER_BYTES = 1 << 16  # a WAV header ffmpeg writes is under 100 bytes; metadata chunks are switched off


class WavFormat(NamedTuple):
    """The format of a float32 WAV stream."""

    rate: int  # samples a second, Hz
    channels: int


def wav_format(stream: IO[bytes]) -> WavFormat | None:
    """Read a float32 WAV header from `stream` up to its data chunk's first byte: its rate and channel count, or
    None where `stream` ends first (ffmpeg wrote nothing: it could not read the input). ValueError where the header
    is not float32 WAV (`wav_header`'s, or its format's)."""
    fmt = wav_header(stream)
    if fmt is None:
        return None
    tag, channels, rate, bits = fmt
    if tag not in _FLOAT32_FORMATS or bits != 32 or channels < 1 or rate < 1:
        raise ValueError(f"ffmpeg wrote WAV format {tag:#x}, {bits} bits, {channels} channels, {rate} Hz, not "
                         "float32 audio")
    return WavFormat(rate, channels)


def wav_header(stream: IO[bytes]) -> tuple[int, int, int, int] | None:
    """Read a WAV header from `stream` up to its data chunk's first byte: its format chunk's (format tag, channels,
    rate, bits a sample), or None where `stream` ends first. ValueError where it is not WAV, ends or is cut short
    before its data, has no format chunk or a header over _MAX_HEADER_BYTES (the messages name ffmpeg's output,
    the one reader that shows them). The sizes of a WAV written to a pipe are placeholders and are not read."""
    head = _exactly(stream, 12)
    if head is None:
        return None
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise ValueError("ffmpeg's output is not a WAV stream")
    fmt: tuple[int, ...] | None = None
    read = 12
    while True:
        chunk = _exactly(stream, 8)
        if chunk is None:
            raise ValueError("ffmpeg's WAV stream ends before its data")
        kind, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
        if kind == b"data":
            break
        read += 8 + size + size % 2
        if read > _MAX_HEADER_BYTES:
            raise ValueError("ffmpeg's WAV header is too long")
        body = _exactly(stream, size + size % 2)
        if body is None:
            raise ValueError("ffmpeg's WAV header is cut short")
        if kind == b"fmt ":
            if size < 16:
                raise ValueError("ffmpeg's WAV format chunk is cut short")
            fmt = struct.unpack("<HHIIHH", body[:16])
    if fmt is None:
        raise ValueError("ffmpeg's WAV stream has no format chunk")
    tag, channels, rate, _, _, bits = fmt
    return tag, channels, rate, bits


def _exactly(stream: IO[bytes], n: int) -> bytes | None:
    """`n` bytes of `stream`, or None where it ends before any; ValueError where it ends part-way."""
    data = stream.read(n) if n else b""
    if n and not data:
        return None
    while len(data) < n:
        more = stream.read(n - len(data))
        if not more:
            raise ValueError("ffmpeg's output ends part-way through a header")
        data += more
    return data


def _ffmpeg() -> str:
    found = shutil.which("ffmpeg")
    if found is None:
        raise AudioError("ffmpeg not found: install it to read this format (Debian: apt install ffmpeg)")
    return found


def _input_args(path: str) -> list[str]:
    """The input half of an ffmpeg / ffprobe command line: only `DEMUXERS`, only local files."""
    return ["-format_whitelist", ",".join(DEMUXERS), "-protocol_whitelist", "file",
            "-i", "file:" + os.path.abspath(path)]


def ffmpeg_blocks(path: str, block_s: float, cause: str, name: str | None = None) -> tuple[int, Iterator[np.ndarray]]:
    """Open `path` with ffmpeg: `(native_rate_hz, blocks)`, blocks float32 `(frames, channels)` of about
    `block_s` seconds each, decoded as they are read. `cause`: why libsndfile could not; `name`: the input as
    messages name it (default `path`). Raises `AudioError` now where ffmpeg cannot read the file, and while
    iterating where it fails part-way. Once this returns, ffmpeg holds the file open: a temporary one may go."""
    name = path if name is None else name
    errors = tempfile.TemporaryFile()
    command = [_ffmpeg(), "-nostdin", "-hide_banner", "-loglevel", "error", *_input_args(path), "-map", "0:a:0",
               "-c:a", "pcm_f32le", "-map_metadata", "-1", "-fflags", "+bitexact", "-f", "wav", "pipe:1"]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
    stdout = cast(IO[bytes], process.stdout)  # stdout=PIPE: never None
    try:
        form = wav_format(stdout)
    except ValueError as err:
        _stop(process, errors)
        raise AudioError(f"{name}: not a readable audio file ({cause}; {err})") from None
    if form is None:
        message = _stop(process, errors).replace("file:" + os.path.abspath(path), "the input")
        raise AudioError(f"{name}: not a readable audio file ({cause}; ffmpeg: {message or 'no audio stream'})")
    block_bytes = max(1, int(round(block_s * form.rate))) * 4 * form.channels
    return form.rate, _blocks(process, stdout, errors, name, form.channels, block_bytes)


def _blocks(process: subprocess.Popen, stdout: IO[bytes], errors: IO[bytes], name: str, channels: int,
            block_bytes: int) -> Iterator[np.ndarray]:
    """The (frames, channels) float32 blocks of ffmpeg's data chunk; ffmpeg stopped when they are let go."""
    frame_bytes = 4 * channels
    pending = b""
    try:
        while True:
            data = pending + (stdout.read(block_bytes - len(pending)) or b"")
            whole = len(data) // frame_bytes * frame_bytes
            if whole:
                yield np.frombuffer(data[:whole], dtype="<f4").reshape(-1, channels)
            pending = data[whole:]
            if len(data) < block_bytes:  # the pipe ended
                break
        process.wait()
        if process.returncode != 0 or pending:
            message = _last_line(errors) or f"ffmpeg exited with status {process.returncode}"
            raise AudioError(f"{name}: corrupt or truncated audio (ffmpeg: {message})")
    finally:
        _stop(process, errors)


def _stop(process: subprocess.Popen, errors: IO[bytes]) -> str:
    """Stop ffmpeg (if it still runs), close its pipes; its last error line."""
    if process.poll() is None:
        process.kill()
    process.wait()
    if process.stdout is not None:
        process.stdout.close()
    message = _last_line(errors)
    errors.close()
    return message


def _last_line(errors: IO[bytes]) -> str:
    """What ffmpeg said went wrong: its last two error lines (the cause, then the input it failed on)."""
    if errors.closed:
        return ""
    errors.seek(0)
    return error_text(errors.read())


def error_text(stderr: bytes, n_lines: int = 2) -> str:
    """The last `n_lines` distinct lines of an ffmpeg / ffprobe error log, joined by "; ", without the context
    addresses ("[hls @ 0x55e9d04199c0] Format not on whitelist" -> "hls: Format not on whitelist")."""
    lines: list[str] = []
    for line in stderr.decode("utf-8", "replace").splitlines():
        line = re.sub(r"^\[(\S+) @ 0x[0-9a-f]+\] ", r"\1: ", line.strip())
        line = re.sub(r"Format not on whitelist '[^']*'", "a format asr-spec does not read", line)
        if "matches no streams" in line:  # -map 0:a:0 on a file without audio (ffmpeg's advice is for its CLI)
            return "no audio stream"
        if line and line not in lines:
            lines.append(line)
    return "; ".join(lines[-n_lines:])


def ffmpeg_duration_s(path: str, cause: str) -> float | None:
    """The duration of `path`'s first audio stream (else its container's) as ffprobe reads the container, without
    decoding; None where it does not say. `AudioError` where ffprobe cannot read it (`cause`: libsndfile's)."""
    probe = shutil.which("ffprobe")
    if probe is None:
        raise AudioError("ffprobe not found: install ffmpeg to read this format (Debian: apt install ffmpeg)")
    command = [probe, "-v", "error", *_input_args(path), "-select_streams", "a:0",
               "-show_entries", "stream=duration:format=duration", "-of", "default=noprint_wrappers=1:nokey=1"]
    done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, check=False)
    if done.returncode != 0:
        raise AudioError(f"{path}: not a readable audio file ({cause}; ffprobe: {error_text(done.stderr) or 'failed'})")
    for value in done.stdout.decode("ascii", "replace").split():
        try:
            seconds = float(value)
        except ValueError:  # "N/A"
            continue
        if seconds > 0 and np.isfinite(seconds):
            return seconds
    return None
