"""Resolve and load a target/draft pair (hub id, local directory, CTranslate2 directory) and check that they can
work together; build random-weight Whisper models of real shapes for tests and benchmarks."""

from __future__ import annotations

import copy
import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


class DraftKind(enum.Enum):
    NONE = "none"
    SHARED_ENCODER = "shared-encoder"  # decoder-only draft reading the target's encoder output (distil-whisper)
    OWN_ENCODER = "own-encoder"  # full Whisper with its own encoder, run once on the same features


def _special_ids(model: nn.Module) -> dict[str, Any]:
    gen, cfg = getattr(model, "generation_config", None), model.config
    get = lambda name: getattr(gen, name, None) if getattr(gen, name, None) is not None else getattr(cfg, name, None)  # noqa: E731
    eos = get("eos_token_id")
    return {
        "vocab_size": cfg.vocab_size,
        "decoder_start_token_id": get("decoder_start_token_id"),
        "eos_token_id": eos[0] if isinstance(eos, (list, tuple)) else eos,
        "no_timestamps_token_id": getattr(gen, "no_timestamps_token_id", None),
        "lang_to_id": getattr(gen, "lang_to_id", None),
    }


def check_pair(target: nn.Module, draft: nn.Module | None) -> DraftKind:
    """Say how `draft` serves `target`, or raise ValueError naming the incompatibility."""
    from transformers import WhisperForCausalLM, WhisperForConditionalGeneration

    if not isinstance(target, WhisperForConditionalGeneration):
        raise ValueError(f"target must be a WhisperForConditionalGeneration, got {type(target).__name__}")
    if draft is None:
        return DraftKind.NONE
    t_ids, d_ids = _special_ids(target), _special_ids(draft)
    for key, value in t_ids.items():
        if d_ids[key] is not None and value is not None and d_ids[key] != value:
            raise ValueError(f"draft and target disagree on {key} ({d_ids[key]} vs {value}): different tokenizers")
    enc_width = target.config.d_model
    if isinstance(draft, WhisperForCausalLM):
        width = draft.model.decoder.layers[0].encoder_attn.k_proj.in_features
        if width != enc_width:
            raise ValueError(
                f"draft decoder reads encoder states of width {width} but the target's encoder gives {enc_width}: "
                "use a draft with its own encoder (a full Whisper model)"
            )
        return DraftKind.SHARED_ENCODER
    if isinstance(draft, WhisperForConditionalGeneration):
        if draft.config.num_mel_bins != target.config.num_mel_bins:
            raise ValueError(
                f"draft expects {draft.config.num_mel_bins} mel bins, the target {target.config.num_mel_bins}"
            )
        if draft.config.max_source_positions != target.config.max_source_positions:
            raise ValueError("draft and target encoders cover different audio lengths")
        return DraftKind.SHARED_ENCODER if same_encoder(target, draft) else DraftKind.OWN_ENCODER
    raise ValueError(f"draft must be WhisperForCausalLM or WhisperForConditionalGeneration, got {type(draft).__name__}")


def same_encoder(a: nn.Module, b: nn.Module) -> bool:
    """True when two Whisper models have identical encoder weights (distil-whisper keeps the teacher's)."""
    sa, sb = a.model.encoder.state_dict(), b.model.encoder.state_dict()
    if sa.keys() != sb.keys():
        return False
    return all(sa[k].shape == sb[k].shape and torch.equal(sa[k].to(sb[k]), sb[k]) for k in sa)


# -- random-weight models of real shapes ------------------------------------------------------------------------

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
        is_multilingual=multilingual, suppress_tokens=text_suppress + specials,
        begin_suppress_tokens=[3 if vocab_size else 220, ids["eot"]],
        max_initial_timestamp_index=5 if vocab_size else 50, return_timestamps=False,
        **(extra if multilingual else {}),  # English-only checkpoints have no language/task tables
    )
    return model


def decoder_draft(target: nn.Module, layers: list[int] | None = None) -> Any:
    """A `WhisperForCausalLM` draft made of some of the target's decoder layers (all by default), sharing its
    encoder output — distil-whisper's initialisation when `layers` is the first and last."""
    from transformers import WhisperForCausalLM

    layers = list(range(target.config.decoder_layers)) if layers is None else list(layers)
    bad = [i for i in layers if not 0 <= i < target.config.decoder_layers]
    if bad or not layers:
        raise ValueError(f"decoder layers {layers} not in 0..{target.config.decoder_layers - 1}")
    config = copy.deepcopy(target.config)
    config.decoder_layers = len(layers)
    config.is_encoder_decoder = False
    draft = WhisperForCausalLM(config).to(target.dtype).to(target.device).eval()
    src = target.model.decoder
    dst = draft.model.decoder
    dst.embed_tokens.load_state_dict(src.embed_tokens.state_dict())
    dst.embed_positions.load_state_dict(src.embed_positions.state_dict())
    dst.layer_norm.load_state_dict(src.layer_norm.state_dict())
    for i, j in enumerate(layers):
        dst.layers[i].load_state_dict(src.layers[j].state_dict())
    draft.proj_out.weight = dst.embed_tokens.weight
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft


# -- loading ----------------------------------------------------------------------------------------------------

def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """"auto" / None: fp16 on CUDA, fp32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(table)} or auto")
    return table[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    return dev


def model_dir(name: str | os.PathLike) -> str:
    """A transformers model directory or hub id for `name`: CTranslate2 directories (model.bin) and the embedded
    names ("embedded:whisper-base") are converted once to a cached safetensors directory."""
    from asr_spec import ct2

    text = str(name)
    if text.startswith("embedded:"):
        return str(ct2.embedded_model_dir(text.split(":", 1)[1]))
    path = Path(text).expanduser()
    if _is_ct2_dir(path):
        return str(ct2.ensure_converted(path))
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name}: not a model directory")
    if path.is_dir() or text.startswith((".", "/", "~")):
        if not (path / "config.json").is_file():
            raise ValueError(f"{name}: no config.json or model.bin there: not a Whisper model directory")
        return str(path)
    return text  # a hub id


def _is_ct2_dir(path: Path) -> bool:
    """A CTranslate2 model directory: model.bin and a config.json that is not a transformers config."""
    import json

    if not (path.is_dir() and (path / "model.bin").is_file()):
        return False
    try:
        return "model_type" not in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return True


def load_model(name: str | os.PathLike, device: torch.device, dtype: torch.dtype, *, decoder_only: bool = False) -> Any:
    """Load a Whisper model (safetensors only, never remote code). decoder_only loads a `WhisperForCausalLM`."""
    from transformers import WhisperForCausalLM, WhisperForConditionalGeneration

    where = model_dir(name)
    cls = WhisperForCausalLM if decoder_only else WhisperForConditionalGeneration
    try:
        model = cls.from_pretrained(where, dtype=dtype, use_safetensors=True, trust_remote_code=False)
    except OSError as err:
        raise ValueError(f"{name}: cannot load the model ({str(err).splitlines()[0]})") from err
    return model.to(device).eval()


def load_processor(name: str | os.PathLike) -> Any:
    from transformers import WhisperProcessor

    where = model_dir(name)
    try:
        return WhisperProcessor.from_pretrained(where)
    except OSError as err:
        raise ValueError(f"{name}: cannot load the tokenizer/feature extractor ({str(err).splitlines()[0]})") from err


def load_draft(name: str | os.PathLike, target: nn.Module, device: torch.device, dtype: torch.dtype) -> Any:
    """Load a draft for `target`: a draft made by `asr-spec distill` (shares the target's embeddings); a
    decoder-only checkpoint as `WhisperForCausalLM`; a full checkpoint whose encoder equals the target's
    (distil-whisper) has its encoder dropped after the check."""
    from transformers import AutoConfig

    where = model_dir(name)
    if (Path(where) / "distill.json").is_file():  # made by `asr-spec distill`: its own layers, the target's rest
        from asr_spec.distill import load_trained_draft

        return load_trained_draft(where, target).to(device, dtype).eval()
    config = AutoConfig.from_pretrained(where)
    archs = getattr(config, "architectures", None) or []
    if "WhisperForCausalLM" in archs:
        return load_model(where, device, dtype, decoder_only=True)
    full = load_model(where, device, dtype)
    if check_pair(target, full) is DraftKind.SHARED_ENCODER:
        log.info("draft %s shares the target's encoder: its own encoder is dropped", name)
        return decoder_draft(full)
    return full
