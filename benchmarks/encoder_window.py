#!/usr/bin/env python
"""What a live buffer's text loses when the encoder hears only the buffer (plus a pad) instead of Whisper's 30 s
window: whisper-base's greedy decoding of slices of the long fixtures with the encoder's input cut to
`buffer + pad` seconds (its positions sliced to match), against the same slices in the full, zero-padded window.

A shorter window is the one way to make a live re-decode's encoder (about half its cost on 2 cores) cheaper in
proportion to the buffer, which is what the 8-stream latency goal of issue 37 would need; Whisper was trained on
30 s windows only, and this measures what that costs in text (docs/live.md, "A shorter encoder window").

    python -m benchmarks.encoder_window --threads 2 --audio tests/fixtures/longform/{dialogue_pauses,dense_windows}.opus

Slices are cut at sentence boundaries from each file's `NAME.sentences.tsv` (start_s, end_s, sentence): from a
sentence's start (less 0.2 s) through the first sentence that ends --lengths seconds or more later (plus 0.3 s),
one slice a length every --every seconds; their reference is the sentences they hold. Per slice: the WER of the
full window's text and of each cut window's against that reference, and the texts where a cut window's parts from
the full window's by more than 10 %; then the WER of each over all slices (transformers' `generate` on the
converted weights, timestamps off, English). The harness is transformers' decoding, not asr-spec's engine: the
comparison is between windows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.nn import functional as F

from asr_spec.audio.loading import SAMPLE_RATE

FRAMES_PER_S = 100  # log-mel frames a second (hop 160)
FULL_FRAMES = 3000  # Whisper's 30 s window


def sentence_slices(rows: list[tuple[float, float, str]], length_s: float, every_s: float
                    ) -> list[tuple[float, float, str]]:
    """(start_s, end_s, reference) slices of a file's sentences (start_s, end_s, text), in order: one starting at
    the first sentence that starts `every_s` or more after the last slice's start (0.2 s before it), ending 0.3 s
    after the first sentence that ends `length_s` or more after that start; a slice running past the last sentence
    is not made. Pure."""
    slices, next_start = [], 0.0
    for i, (start, _, _) in enumerate(rows):
        if start < next_start:
            continue
        last = next((j for j in range(i, len(rows)) if rows[j][1] - start >= length_s), None)
        if last is None:
            break
        slices.append((max(0.0, start - 0.2), rows[last][1] + 0.3, " ".join(r[2] for r in rows[i:last + 1])))
        next_start = start + every_s
    return slices


def window_frames(seconds: float, pad_s: float) -> int:
    """Log-mel frames of a cut window holding `seconds` of audio and `pad_s` after it: even (the encoder's second
    convolution has stride 2), at most the full window's 3,000."""
    if seconds <= 0 or pad_s < 0:
        raise ValueError(f"window of {seconds!r} s with a pad of {pad_s!r} s")
    frames = int(round((seconds + pad_s) * FRAMES_PER_S))
    return min(FULL_FRAMES, frames + frames % 2)


def encode(encoder, features: torch.Tensor, frames: int) -> torch.Tensor:
    """Whisper's encoder forward over the first `frames` of (1, n_mels, 3000) features: its convolutions, its
    first frames / 2 positions, its layers and final LayerNorm -> (1, frames / 2, d_model)."""
    x = F.gelu(encoder.conv1(features[:, :, :frames]))
    x = F.gelu(encoder.conv2(x)).permute(0, 2, 1)
    x = x + encoder.embed_positions.weight[: x.shape[1]]
    for layer in encoder.layers:
        out = layer(x, None)
        x = out[0] if isinstance(out, tuple) else out
    return encoder.layer_norm(x)


def main() -> None:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor
    from transformers.modeling_outputs import BaseModelOutput

    from asr_spec.audio.loading import load_audio
    from asr_spec.eval.metrics import score
    from asr_spec.models.embedded import embedded_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--audio", nargs="+", required=True)
    ap.add_argument("--lengths", default="6,12,18", help="slice lengths, seconds")
    ap.add_argument("--pads", default="1,3", help="seconds of the cut window after the slice's audio")
    ap.add_argument("--every", type=float, default=20.0, help="seconds at least between slice starts")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [float(x) for x in args.lengths.split(",")]
    pads = [float(x) for x in args.pads.split(",")]
    folder = embedded_model_dir("whisper-base")
    model = WhisperForConditionalGeneration.from_pretrained(folder).eval()
    processor = WhisperProcessor.from_pretrained(folder)

    def text(features: torch.Tensor, frames: int) -> str:
        with torch.no_grad():
            hidden = encode(model.model.encoder, features, frames)
            out = model.generate(encoder_outputs=BaseModelOutput(last_hidden_state=hidden), language="en",
                                 task="transcribe", max_new_tokens=200)
        return processor.batch_decode(out, skip_special_tokens=True)[0].strip()

    refs: list[str] = []
    texts: dict[str, list[str]] = {"full": [], **{f"pad {pad:g} s": [] for pad in pads}}
    for path in args.audio:
        audio = load_audio(path, SAMPLE_RATE)
        audio = audio.numpy() if hasattr(audio, "numpy") else audio
        rows = read_rows(Path(path).with_suffix(".sentences.tsv"))
        for length in lengths:
            for start, end, ref in sentence_slices(rows, length, args.every):
                piece = audio[int(start * SAMPLE_RATE): int(end * SAMPLE_RATE)]
                features = processor.feature_extractor(piece, sampling_rate=SAMPLE_RATE,
                                                       return_tensors="pt").input_features
                said = {"full": text(features, FULL_FRAMES)}
                for pad in pads:
                    said[f"pad {pad:g} s"] = text(features, window_frames(len(piece) / SAMPLE_RATE, pad))
                refs.append(ref)
                line = f"{Path(path).name} {start:6.1f}-{end:6.1f} s:"
                for name, got in said.items():
                    texts[name].append(got)
                    line += f"  {name} {score([ref], [got]).wer:6.1%}"
                for name, got in said.items():
                    if name != "full" and score([said["full"]], [got]).wer > 0.1:
                        line += f"\n    full:     {said['full']}\n    {name}: {got}"
                print(line, flush=True)
    for name, got in texts.items():
        print(f"{name}: WER against the slices' sentences {score(refs, got).wer:.2%} ({len(refs)} slices)")


def read_rows(path: Path) -> list[tuple[float, float, str]]:
    """(start_s, end_s, sentence) rows of a `NAME.sentences.tsv` (`bench_longform.sentence_rows`), times parsed."""
    from benchmarks.bench_longform import sentence_rows

    return [(float(start), float(end), sentence.strip()) for start, end, sentence in sentence_rows(path)]


if __name__ == "__main__":
    main()
