"""Evaluation: WER/CER (metrics), LibriSpeech from the hub or a local tree (librispeech), the evaluation runner."""
