"""The CPU fp32 kernels: oneDNN products with packed weights, the encoder run through them, the decoder's packed
path against its plain one, and admission writing a chunk's audio keys/values straight into its slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asr_spec.engine import decoder as decoder_module
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.encoder import Encoder
from asr_spec.engine.kernels import onednn_linear, onednn_usable, pack
from asr_spec.testing import random_whisper

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_usable(CPU, torch.float32), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33])
def test_packed_product_equals_linear_at_any_row_count(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen), torch.randn(rows, 32, generator=gen)
    packed = pack(w)
    torch.testing.assert_close(onednn_linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(onednn_linear(x, packed, b, "gelu", "none"), F.gelu(F.linear(x, w, b)),
                               rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_encoder_equals_transformers_encoder(activation):
    """The oneDNN encoder (fused q/k/v, fused GELU, or the module's activation after the product) gives
    transformers' WhisperEncoder output up to rounding."""
    model = random_whisper("test", seed=5, vocab_size=70, init_std=0.2)
    model.config.activation_function = activation
    for layer in model.model.encoder.layers:
        layer.activation_fn = torch.nn.ReLU() if activation == "relu" else layer.activation_fn
    enc = Encoder(model.model.encoder)
    assert enc.fast and (enc.post is not None) == (activation == "gelu")
    n_frames = 2 * model.config.max_source_positions
    features = torch.randn(3, model.config.num_mel_bins, n_frames, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model.model.encoder(input_features=features).last_hidden_state
    torch.testing.assert_close(enc(features), ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="mel frames"):
        enc(features[..., :-2])


@needs_onednn
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_decoder_packed_path_equals_plain_path(monkeypatch, activation):
    """The same decoder forward with packed oneDNN weights (fused q/k/v, GELU fused or the module's activation
    after the product, the query scale folded in) and with F.linear: equal logits up to rounding, for a
    single-token step and a multi-token window."""
    model = random_whisper("test", seed=7, vocab_size=70, init_std=0.2)
    if activation == "relu":
        model.config.activation_function = "relu"
        for layer in model.model.decoder.layers:
            layer.activation_fn = torch.nn.ReLU()
    packed, plain, outs = _packed_and_plain(model, monkeypatch)
    assert (packed.post is not None) == (activation == "gelu")
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _packed_and_plain(model, monkeypatch):
    """The model's decoder built packed (oneDNN usable) and plain (monkeypatched unusable), and each one's
    (window logits, single-token step logits) from the same cache contents: (packed, plain, [outs, outs])."""
    packed = Decoder(model.model.decoder, model.proj_out)
    monkeypatch.setattr(decoder_module, "onednn_usable", lambda device, dtype: False)
    plain = Decoder(model.model.decoder, model.proj_out)
    assert packed.qkv is not None and plain.qkv is None
    audio = torch.randn(2, model.config.max_source_positions, model.config.d_model)
    tokens = torch.tensor([[1, 5, 9, 11], [3, 4, 12, 2]])
    positions = torch.arange(4).expand(2, -1)
    outs = []
    for dec in (packed, plain):
        with torch.inference_mode():  # as admission and the eager step run
            cache = dec.stage(audio, 8)
            window = dec.forward(cache, tokens, positions, 8)
            step = dec.forward(cache, tokens[:, :1], positions[:, :1] + 4, 8)
        outs.append((window, step))
    return packed, plain, outs


def test_stage_into_slots_writes_audio_in_place_and_commit_keeps_it():
    """Admission into contiguous slots computes the chunks' cross-attention keys/values in those slots (no copy at
    commit); into other slots (or none given) they are staged apart and copied at commit. Same cache either way."""
    model = random_whisper("test", seed=2, vocab_size=70, init_std=0.2)
    dec = Decoder(model.model.decoder, model.proj_out)
    audio = torch.randn(2, model.config.max_source_positions, model.config.d_model)
    direct, copied = (dec.new_cache(4, 16, model.config.max_source_positions) for _ in range(2))
    staged = dec.stage(audio, 3, (direct, 1))
    assert direct.holds_cross(staged) and not copied.holds_cross(staged)
    direct.commit(torch.tensor([1, 2]), staged)
    apart = dec.stage(audio, 3)
    assert not copied.holds_cross(apart)
    copied.commit(torch.tensor([1, 2]), apart)
    for name in ("cross_k", "cross_v"):
        torch.testing.assert_close(getattr(direct, name)[:, 1:3], getattr(copied, name)[:, 1:3], rtol=0, atol=0)


@pytest.mark.skipif(not onednn_usable(CPU, torch.bfloat16), reason="no native bf16 products on this CPU")
def test_shared_encoder_draft_runs_in_bf16_and_changes_nothing_but_its_proposals():
    """On a CPU fp32 target a draft reading the target's encoder output runs a bf16 copy of its decoder (packed
    bf16 products, bf16 cache); the draft and the target's tensors it shares stay fp32; the output is greedy's, and
    with draft_bf16=False the draft runs in fp32."""
    from asr_spec.engine import DecodeOptions, Engine
    from asr_spec.models.loading import decoder_draft

    model = random_whisper("test", seed=4, vocab_size=70, init_std=0.2)
    draft = decoder_draft(model, [0])
    features = torch.randn(3, 16, 100, generator=torch.Generator().manual_seed(2))
    options = DecodeOptions(language="en", max_new_tokens=20)
    low = Engine(model, draft, options)
    assert low.draft_dec.dtype == torch.bfloat16 and low.draft_dec.head_packed is not None
    assert draft.model.decoder.embed_tokens.weight.dtype == torch.float32
    assert model.model.decoder.embed_tokens.weight.dtype == torch.float32
    full = Engine(model, draft, DecodeOptions(language="en", max_new_tokens=20, draft_bf16=False))
    assert full.draft_dec.dtype == torch.float32
    greedy = Engine(model, None, options).decode(features, batch_size=3)
    for engine in (low, full):
        results = engine.decode(features, batch_size=3)
        assert [r.tokens for r in results] == [g.tokens for g in greedy]
        assert sum(r.stats.accepted_tokens for r in results) > 0
    with pytest.raises(ValueError, match="draft_bf16 must be true or false"):
        DecodeOptions(draft_bf16="yes")


@pytest.mark.skipif(not onednn_usable(CPU, torch.bfloat16), reason="no native bf16 products on this CPU")
def test_bf16_decoder_packed_path_equals_plain_path(monkeypatch):
    """A decoder in bf16 on a CPU with native bf16 (a draft's copy, or a target loaded in bf16) runs packed bf16
    oneDNN products: the same logits as the plain bf16 path up to bf16 rounding; a bf16 target decodes through it."""
    from asr_spec.engine import DecodeOptions, Engine

    model = random_whisper("test", seed=7, vocab_size=70, init_std=0.2).to(torch.bfloat16)
    packed, _, outs = _packed_and_plain(model, monkeypatch)
    assert packed.certified is None
    for a, b in zip(*outs):
        a, b = a.float(), b.float()
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * float(b.abs().max()))
    monkeypatch.undo()
    features = torch.randn(2, 16, 100, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    results = Engine(model, None, DecodeOptions(language="en", max_new_tokens=10)).decode(features, batch_size=2)
    assert all(len(r.tokens) >= 1 for r in results)
