"""A Whisper model's vocabulary and configs as transformers takes them, for the converter (`models/embedded.py`).

:func:`build_whisper_tokenizer` makes a ``WhisperTokenizer`` from a tokenizer.json with the 1,501 timestamp tokens
present and reads the special ids (:class:`WhisperTokenIds`); :func:`whisper_generation_config` and
:func:`whisper_config` give the ``GenerationConfig`` transformers' Whisper ``generate`` expects and the model's
``WhisperConfig``. A file that is not what a Whisper model needs raises ``ModelFormatError`` naming it and the fix.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer
from transformers import GenerationConfig, WhisperConfig, WhisperTokenizer

from asr_spec.models.ct2 import ModelFormatError
from asr_spec.models.ct2_whisper import WhisperDims

__all__ = ["WhisperTokenIds", "build_whisper_tokenizer", "read_json", "whisper_config", "whisper_generation_config"]

N_TIMESTAMP_TOKENS = 1501  # <|0.00|> … <|30.00|>: 30 s / 0.02 s per token + 1
MAX_INITIAL_TIMESTAMP_INDEX = 50  # openai: the first timestamp is at most 50 × 0.02 s = 1.0 s
MULTILINGUAL_VOCAB_SIZE = 51865  # openai: a model is multilingual iff n_vocab >= 51865 (English-only: 51864)
# Special tokens every Whisper vocabulary has (the no-speech token is named either way), in id order.
_REQUIRED_SPECIALS = (
    "<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>",
    "<|startoflm|>", "<|startofprev|>", "<|notimestamps|>",
)  # fmt: skip
_TIMESTAMP_RE = re.compile(r"<\|\d+\.\d\d\|>")
_LANGUAGE_RE = re.compile(r"<\|[a-z]{2,3}\|>")


@dataclass(frozen=True)
class WhisperTokenIds:
    """Special token ids of a Whisper vocabulary (multilingual ones are shifted by +1 from English-only)."""

    eot: int  # <|endoftext|>: also bos, pad and unk
    sot: int  # <|startoftranscript|>: the decoder start token
    translate: int
    transcribe: int
    startofprev: int
    notimestamps: int  # the highest special id; the first timestamp <|0.00|> is notimestamps + 1
    languages: dict[str, int]  # "<|en|>" → id: every token between sot and translate


def read_json(path: Path, what: str, fix: str) -> object:
    """A JSON file of a model directory, or a `ModelFormatError` naming it, what it is and `fix`."""
    if not path.is_file():
        raise ModelFormatError(f"{path}: missing; a CTranslate2 Whisper directory needs {what} ({fix})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFormatError(f"{path}: unreadable {what} ({err}); {fix}") from err


def build_whisper_tokenizer(tokenizer_json: Path, vocab_size: int) -> tuple[WhisperTokenizer, WhisperTokenIds]:
    """A ``WhisperTokenizer`` (the fast one) from a tokenizer.json, with the 1501 timestamp tokens present.

    Timestamp tokens missing from the file (tiny.en's lacks them) are added as non-special tokens. The special-token
    list is passed in id order ending with ``<|notimestamps|>``, because transformers takes the first timestamp id
    to be ``all_special_ids[-1] + 1``; both are checked on the built tokenizer.

    Raises:
        ModelFormatError: unreadable file, a missing special token, or a size that does not match ``vocab_size``.
    """
    fix = "copy tokenizer.json from the original Hugging Face Whisper model into the directory"
    spec = read_json(tokenizer_json, "tokenizer.json", fix)
    added = spec.get("added_tokens") if isinstance(spec, dict) else None
    if not isinstance(added, list):
        raise ModelFormatError(f"{tokenizer_json}: no added_tokens list, not a Hugging Face tokenizer.json; {fix}")
    specials = {t["content"]: t["id"] for t in added if t.get("special") and not _TIMESTAMP_RE.fullmatch(t["content"])}
    nospeech = "<|nospeech|>" if "<|nospeech|>" in specials else "<|nocaptions|>"
    absent = [token for token in (*_REQUIRED_SPECIALS, nospeech) if token not in specials]
    if absent:
        raise ModelFormatError(f"{tokenizer_json}: lacks the Whisper special tokens {', '.join(absent)}; {fix}")
    notimestamps = specials["<|notimestamps|>"]
    if max(specials.values()) != notimestamps:
        raise ModelFormatError(f"{tokenizer_json}: a special token has an id above <|notimestamps|>; {fix}")
    try:
        backend = Tokenizer.from_file(str(tokenizer_json))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise ModelFormatError(f"{tokenizer_json}: not a valid tokenizer.json ({err}); {fix}") from err
    timestamps = [f"<|{i * 0.02:.2f}|>" for i in range(N_TIMESTAMP_TOKENS)]
    if backend.token_to_id(timestamps[0]) is None:
        if backend.get_vocab_size(with_added_tokens=True) != notimestamps + 1:
            raise ModelFormatError(f"{tokenizer_json}: tokens after <|notimestamps|> but no timestamps; {fix}")
        backend.add_tokens([AddedToken(t, special=False, normalized=True) for t in timestamps])
    ids = [backend.token_to_id(t) for t in timestamps]
    if ids != list(range(notimestamps + 1, notimestamps + 1 + N_TIMESTAMP_TOKENS)):
        raise ModelFormatError(f"{tokenizer_json}: timestamp tokens do not follow <|notimestamps|>; {fix}")
    if backend.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ModelFormatError(
            f"{tokenizer_json}: {backend.get_vocab_size(with_added_tokens=True)} tokens with timestamps, but "
            f"model.bin has {vocab_size} embeddings; the tokenizer belongs to another model ({fix})"
        )
    eot = "<|endoftext|>"
    extra = sorted((t for t in specials if t != eot), key=specials.__getitem__)
    tokenizer = WhisperTokenizer(
        tokenizer_object=backend, unk_token=eot, bos_token=eot, eos_token=eot, pad_token=eot,
        extra_special_tokens=extra,
    )  # fmt: skip
    if tokenizer.all_special_ids[-1] != notimestamps or tokenizer.convert_tokens_to_ids("<|0.00|>") != notimestamps + 1:
        raise ModelFormatError(f"{tokenizer_json}: transformers would misplace the timestamp tokens; {fix}")
    sot, translate = specials["<|startoftranscript|>"], specials["<|translate|>"]
    languages = {t: i for t, i in specials.items() if sot < i < translate and _LANGUAGE_RE.fullmatch(t)}
    token_ids = WhisperTokenIds(
        eot=specials[eot], sot=sot, translate=translate, transcribe=specials["<|transcribe|>"],
        startofprev=specials["<|startofprev|>"], notimestamps=notimestamps, languages=languages,
    )  # fmt: skip
    return tokenizer, token_ids


def whisper_generation_config(
    ct2_config: dict, ids: WhisperTokenIds, dims: WhisperDims, config_path: Path
) -> GenerationConfig:
    """The generation config transformers' Whisper ``generate`` expects, from CT2's config.json and the vocabulary.

    English-only models get no ``lang_to_id``/``task_to_id``: transformers runs language detection whenever
    ``lang_to_id`` exists and would put a language token into an English-only prompt.
    """
    fix = "re-convert the model with ctranslate2 >= 3.10, which writes it"
    for key in ("suppress_ids", "suppress_ids_begin"):
        if not isinstance(ct2_config.get(key), list):
            raise ModelFormatError(f"{config_path}: no {key} list; {fix}")
    alignment_heads = ct2_config.get("alignment_heads")
    if not alignment_heads:  # CTranslate2's runtime default: every head of the second half of the decoder
        half = dims.n_decoder_layers // 2
        alignment_heads = [[i, h] for i in range(half, dims.n_decoder_layers) for h in range(dims.n_decoder_heads)]
    multilingual = dims.vocab_size >= MULTILINGUAL_VOCAB_SIZE
    kwargs: dict[str, object] = {}
    if multilingual:
        lang_ids = ct2_config.get("lang_ids")
        if lang_ids is not None and sorted(lang_ids) != sorted(ids.languages.values()):
            message = f"{config_path}: lang_ids differ from tokenizer.json's language tokens; using the latter"
            warnings.warn(message, stacklevel=4)  # the caller of convert_ct2
        kwargs["lang_to_id"] = dict(ids.languages)
        kwargs["task_to_id"] = {"translate": ids.translate, "transcribe": ids.transcribe}
    return GenerationConfig(
        decoder_start_token_id=ids.sot, bos_token_id=ids.eot, eos_token_id=ids.eot, pad_token_id=ids.eot,
        max_length=dims.n_text_ctx, alignment_heads=[list(h) for h in alignment_heads],
        suppress_tokens=list(ct2_config["suppress_ids"]), begin_suppress_tokens=list(ct2_config["suppress_ids_begin"]),
        no_timestamps_token_id=ids.notimestamps, prev_sot_token_id=ids.startofprev,
        max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX, is_multilingual=multilingual,
        return_timestamps=False, forced_decoder_ids=None, **kwargs,
    )  # fmt: skip


def whisper_config(dims: Any, ids: Any, generation_config: Any, tied: bool, dtype: torch.dtype) -> WhisperConfig:
    """The transformers config of a converted model."""
    return WhisperConfig(
        vocab_size=dims.vocab_size, num_mel_bins=dims.n_mels, d_model=dims.d_model,
        encoder_layers=dims.n_encoder_layers, encoder_attention_heads=dims.n_encoder_heads,
        decoder_layers=dims.n_decoder_layers, decoder_attention_heads=dims.n_decoder_heads,
        encoder_ffn_dim=dims.encoder_ffn_dim, decoder_ffn_dim=dims.decoder_ffn_dim,
        max_source_positions=dims.n_audio_ctx, max_target_positions=dims.n_text_ctx,
        pad_token_id=ids.eot, bos_token_id=ids.eot, eos_token_id=ids.eot, decoder_start_token_id=ids.sot,
        suppress_tokens=generation_config.suppress_tokens,
        begin_suppress_tokens=generation_config.begin_suppress_tokens,
        activation_function="gelu", scale_embedding=False, tie_word_embeddings=tied, dtype=dtype,
    )  # fmt: skip
