"""Random-weight Whisper models of real shapes, for tests and benchmarks (fast and exact: no download)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    d_model: int
    encoder_layers: int
    decoder_layers: int
    heads: int
    n_mels: int = 80
    audio_ctx: int = 1500


SHAPES: dict[str, Shape] = {
    "test": Shape(64, 2, 2, 4, n_mels=16, audio_ctx=50),
    "tiny": Shape(384, 4, 4, 6),
    "base": Shape(512, 6, 6, 8),
    "large-v2": Shape(1280, 32, 32, 20),
    "distil-large-v2": Shape(1280, 32, 2, 20),
}

# Real multilingual Whisper special-token ids (vocab 51865): used for the "real" shapes.
_REAL_IDS = dict(eot=50257, sot=50258, first_lang=50259, n_langs=99, translate=50358, transcribe=50359,
                 prev=50361, no_speech=50362, no_timestamps=50363, vocab=51865)


def _token_layout(vocab_size: int | None) -> dict[str, int]:
    if vocab_size is None:
        return dict(_REAL_IDS)
    # a small vocabulary for tests: 40 text tokens, specials, then timestamps (so EOS is drawn often enough)
    n_text = vocab_size - 30
    if n_text < 8:
        raise ValueError(f"test vocabulary must have at least 38 tokens, got {vocab_size}")
    return dict(eot=n_text, sot=n_text + 1, first_lang=n_text + 2, n_langs=2, translate=n_text + 4,
                transcribe=n_text + 5, prev=n_text + 6, no_speech=n_text + 7, no_timestamps=n_text + 8,
                vocab=vocab_size)


def random_whisper(
    shape: str | Shape = "test", *, seed: int = 0, vocab_size: int | None = None, init_std: float = 0.02,
    decoder_layers: int | None = None, multilingual: bool = True,
) -> Any:
    """A randomly initialised `WhisperForConditionalGeneration` with a complete Whisper generation config.

    vocab_size None keeps the real 51,865-token layout and special ids; a small number (e.g. 70) makes a test
    vocabulary in which <|endoftext|> and timestamps are drawn often. init_std > 0.02 makes choices less tied.
    """
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    sh = SHAPES[shape] if isinstance(shape, str) else shape
    ids = _token_layout(vocab_size)
    langs = ["en", "de", "fr", "es", "ru", "zh", "ja", "it", "pt", "nl"]
    lang_to_id = {f"<|{langs[i % len(langs)]}{'' if i < len(langs) else i}|>": ids["first_lang"] + i
                  for i in range(ids["n_langs"])}
    config = WhisperConfig(
        vocab_size=ids["vocab"], num_mel_bins=sh.n_mels, d_model=sh.d_model,
        encoder_layers=sh.encoder_layers, decoder_layers=decoder_layers or sh.decoder_layers,
        encoder_attention_heads=sh.heads, decoder_attention_heads=sh.heads,
        encoder_ffn_dim=4 * sh.d_model, decoder_ffn_dim=4 * sh.d_model, max_source_positions=sh.audio_ctx,
        max_target_positions=448, pad_token_id=ids["eot"], bos_token_id=ids["eot"], eos_token_id=ids["eot"],
        decoder_start_token_id=ids["sot"], init_std=init_std, begin_suppress_tokens=None, suppress_tokens=None,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # <|endoftext|> doubles as padding_idx, which nn.Embedding zeroes: give it a real row
        model.model.decoder.embed_tokens.weight[ids["eot"]].normal_(0.0, init_std)
    text_suppress = [1, 2, 7] if vocab_size else [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61]
    specials = [ids["translate"], ids["transcribe"], ids["prev"], ids["sot"]]
    extra = dict(lang_to_id=lang_to_id, task_to_id={"transcribe": ids["transcribe"], "translate": ids["translate"]})
    model.generation_config = GenerationConfig(
        decoder_start_token_id=ids["sot"], eos_token_id=ids["eot"], pad_token_id=ids["eot"],
        bos_token_id=ids["eot"], max_length=448, no_timestamps_token_id=ids["no_timestamps"],
        prev_sot_token_id=ids["prev"],
        is_multilingual=multilingual, suppress_tokens=text_suppress + specials,
        begin_suppress_tokens=[3 if vocab_size else 220, ids["eot"]],
        max_initial_timestamp_index=5 if vocab_size else 50, return_timestamps=False,
        **(extra if multilingual else {}),  # English-only checkpoints have no language/task tables
    )
    return model
