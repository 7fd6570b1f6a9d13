"""Hours of low-bitrate Ogg Opus in seconds of work, for the server's load test: a short clip is encoded once
(libsndfile's Opus encoder, about 6 kbit/s) and its audio pages are repeated with shifted granule positions, so
the container states the full length and a decoder plays the clip over and over (with a click at each seam).

    python -m benchmarks.long_upload tests/fixtures/speech/long_75s.flac 7200 /tmp/two-hours.opus

An Ogg page: "OggS", version, header type (1 continued, 2 first, 4 last), granule position (int64: 48 kHz samples
up to the end of the page, pre-skip included), stream serial, page sequence number, CRC-32 (polynomial
0x04C11DB7, not reflected, computed with the field zeroed), segment count and table, then the data.
"""

from __future__ import annotations

import argparse
import struct
import tempfile
from pathlib import Path

import soundfile as sf

__all__ = ["make_long_opus"]

_HEADER = struct.Struct("<4sBBqIIIB")  # capture, version, type, granule, serial, sequence, crc, n_segments


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
        table.append(crc & 0xFFFFFFFF)
    return table


_CRC = _crc_table()


def _crc(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _CRC[(crc >> 24) ^ byte]
    return crc


def _pages(data: bytes) -> list[tuple[int, int, bytes]]:
    """(header type, granule position, segment table + body) of each page."""
    pages, pos = [], 0
    while pos < len(data):
        capture, _, kind, granule, _, _, _, n_segments = _HEADER.unpack_from(data, pos)
        if capture != b"OggS":
            raise ValueError(f"not an Ogg page at byte {pos}")
        table = data[pos + _HEADER.size: pos + _HEADER.size + n_segments]
        end = pos + _HEADER.size + n_segments + sum(table)
        pages.append((kind, granule, data[pos + _HEADER.size - 1: end]))
        pos = end
    return pages


def _page(kind: int, granule: int, serial: int, sequence: int, rest: bytes) -> bytes:
    head = _HEADER.pack(b"OggS", 0, kind, granule, serial, sequence, 0, rest[0])[:-1]
    page = head + rest
    return page[:22] + struct.pack("<I", _crc(page)) + page[26:]


def make_long_opus(clip: str | Path, seconds: float, out: str | Path) -> Path:
    """Write `out`: `clip` (any file soundfile reads) as 16 kHz Opus, repeated to at most `seconds` (at least once)."""
    samples, rate = sf.read(str(clip), dtype="float32")
    with tempfile.NamedTemporaryFile(suffix=".opus") as once:
        sf.write(once.name, samples, rate, format="OGG", subtype="OPUS", compression_level=1.0)
        data = Path(once.name).read_bytes()
    serial = struct.unpack_from("<I", data, 14)[0]
    pages = _pages(data)
    headers = [p for p in pages if p[1] == 0]  # OpusHead, OpusTags
    audio = [p for p in pages if p[1] != 0]
    if len(audio) < 2:
        raise ValueError(f"{clip}: too short to repeat (one audio page)")
    # A page's granule counts the 48 kHz samples of every packet up to its end, except the last page's, which
    # may trim the final packet: the repeated body is every audio page but the last, which ends the file once.
    body, tail = audio[:-1], audio[-1]
    period = max(granule for _, granule, _ in body)
    times = max(1, int(seconds * 48_000 // period))  # whole repeats: no longer than `seconds`
    out_pages, sequence = [], 0
    for kind, granule, rest in headers:
        out_pages.append(_page(kind, granule, serial, sequence, rest))
        sequence += 1
    for repeat in range(times):
        for kind, granule, rest in body:
            shifted = granule if granule == -1 else granule + repeat * period  # -1: no packet ends on the page
            out_pages.append(_page(kind & ~4, shifted, serial, sequence, rest))
            sequence += 1
    kind, granule, rest = tail
    out_pages.append(_page(kind | 4, granule + (times - 1) * period, serial, sequence, rest))
    Path(out).write_bytes(b"".join(out_pages))
    return Path(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("clip", help="a short audio file to repeat")
    parser.add_argument("seconds", type=float, help="the length the output states and plays")
    parser.add_argument("out", help="the .opus file to write")
    args = parser.parse_args()
    path = make_long_opus(args.clip, args.seconds, args.out)
    info = sf.info(str(path))
    print(f"{path}: {info.duration:.0f} s, {path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
