"""The CPU fp32 kernels: oneDNN products with packed weights (one packed copy per weight tensor, whatever the number
of engines), the encoder run through them, the decoder's packed path against its plain one, and admission writing
chunks' audio keys/values and prompts straight into their slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import first_divergence, hf_greedy

from asr_spec.engine import decoder as decoder_module
from asr_spec.engine.admission import prefill
from asr_spec.engine.decoder import Decoder
from asr_spec.engine.encoder import Encoder
from asr_spec.engine.kernels import attention, mask_bias, onednn_linear, onednn_usable, pack, stored, transposed_product
from asr_spec.testing import random_whisper

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not onednn_usable(CPU, torch.float32), reason="torch built without oneDNN")
# bf16 keeps 8 significant bits (2^-8 relative); two bf16 paths through a decoder differ by a few of those
BF16_RTOL = 5e-2


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_encoder_equals_transformers_encoder(activation, dtype):
    """The oneDNN encoder (fused q/k/v, fused GELU, or the module's activation after the product) gives
    transformers' WhisperEncoder output up to rounding, in fp32 and in bf16 (where oneDNN has bf16 products)."""
    if dtype == torch.bfloat16 and not onednn_usable(CPU, dtype):
        pytest.skip("oneDNN has no bf16 products on this CPU (AVX2-only): the bf16 encoder runs the module itself")
    model = random_whisper("test", seed=5, vocab_size=70, init_std=0.2).to(dtype)
    model.config.activation_function = activation
    for layer in model.model.encoder.layers:
        layer.activation_fn = torch.nn.ReLU() if activation == "relu" else layer.activation_fn
    enc = Encoder(model.model.encoder)
    assert enc.fast and (enc.post is not None) == (activation == "gelu")
    n_frames = 2 * model.config.max_source_positions
    features = torch.randn(3, model.config.num_mel_bins, n_frames, generator=torch.Generator().manual_seed(0))
    features = features.to(dtype)
    with torch.inference_mode():
        ref = model.model.encoder(input_features=features).last_hidden_state
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # bf16: 8 significant bits, rounded after every product
    torch.testing.assert_close(enc(features).float(), ref.float(), rtol=tol, atol=tol)
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
    (window logits, single-token step logits) from the same cache contents: (packed, plain, [outs, outs]). The thin
    kernel's products (`cpu_linear`, fp32) are turned off: these are oneDNN's."""
    monkeypatch.setattr(decoder_module.cpu_linear, "fused_linear_usable", lambda device, dtype: False)
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
            cache = dec.new_cache(2, 8, model.config.max_source_positions)
            dec.write_audio(cache, audio)
            window = dec.forward(cache, tokens, positions, 8)
            step = dec.forward(cache, tokens[:, :1], positions[:, :1] + 4, 8)
        outs.append((window, step))
    return packed, plain, outs


def test_admission_writes_into_slot_views_as_into_a_cache_of_their_own():
    """Admitting two chunks to slots [1, 3) of a batch cache writes their audio keys/values and prefilled prompts
    straight into those slots (views): exactly the values a cache of their own gets, the same logits, and the other
    slots untouched."""
    model = random_whisper("test", seed=2, vocab_size=70, init_std=0.2)
    dec = Decoder(model.model.decoder, model.proj_out)
    n_ctx = model.config.max_source_positions
    audio = torch.randn(2, n_ctx, model.config.d_model, generator=torch.Generator().manual_seed(1))
    prompts = torch.tensor([[1, 5, 9, 11], [3, 4, 12, 2]])
    batch, own = dec.new_cache(4, 16, n_ctx), dec.new_cache(2, 16, n_ctx)
    for cache in (batch, own):
        cache.cross_k.fill_(7.0)
        cache.cross_v.fill_(7.0)
    logits = []
    with torch.inference_mode():  # as admission runs
        for cache in (batch.rows(2, 1), own):
            dec.write_audio(cache, audio)
            # every row's 4 tokens (lengths), from position 0, the logits at position 0 (a SOT index)
            logits.append(prefill(dec, cache, prompts, torch.full((2,), 4), 0, torch.zeros(2, dtype=torch.long)))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    for name in ("cross_k", "cross_v"):
        torch.testing.assert_close(getattr(batch, name)[:, 1:3], getattr(own, name), rtol=0, atol=0)
        assert bool((getattr(batch, name)[:, [0, 3]] == 7.0).all())
    for name in ("self_k", "self_v"):  # the prompt but its last token: positions 0-2
        torch.testing.assert_close(getattr(batch, name)[:, 1:3, :, :3], getattr(own, name)[:, :, :, :3], rtol=0,
                                   atol=0)
        assert not bool(getattr(batch, name)[:, [0, 3]].any())
    assert batch.lengths.tolist() == [0, 3, 3, 0] and own.lengths.tolist() == [3, 3]


def test_admission_to_slots_apart_equals_admission_to_one_run_of_slots():
    """Two chunks admitted to slots apart (0 and 3: computed in caches of their own, then copied in) get exactly
    the audio keys/values, prefilled prompt and decoding state they get in one run of slots (1 and 2, written in
    place); the language is detected on the way (a multilingual model, no language given)."""
    from dataclasses import fields

    from asr_spec.engine import DecodeOptions, Engine
    from asr_spec.engine.speculative import DecodeState, Models

    model = random_whisper("test", seed=2, vocab_size=70, init_std=0.2)
    engine = Engine(model, None, DecodeOptions())
    n_ctx = model.config.max_source_positions
    audio = torch.randn(2, n_ctx, model.config.d_model, generator=torch.Generator().manual_seed(1))
    admitted = []
    for rows in ([1, 2], [0, 3]):
        m = Models(engine.target_dec, engine.target_dec.new_cache(4, 16, n_ctx))
        st = DecodeState.empty(4, 24, 0, CPU)
        engine.admission(m, st, rows, audio, None)
        admitted.append((rows, m.target_cache, st))
    (run, a, sa), (apart, b, sb) = admitted
    n = engine.prompt_len - 1
    for name in ("cross_k", "cross_v", "self_k", "self_v"):
        x, y = getattr(a, name)[:, run], getattr(b, name)[:, apart]
        if name.startswith("self"):
            x, y = x[:, :, :, :n], y[:, :, :, :n]
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert a.lengths[run].tolist() == b.lengths[apart].tolist() == [n, n]
    for f in fields(DecodeState):
        torch.testing.assert_close(getattr(sa, f.name)[run], getattr(sb, f.name)[apart], rtol=0, atol=0)
    assert sa.n_tok[run].tolist() == [engine.prompt_len] * 2 and bool((sa.no_speech_prob[run] > 0).all())


@needs_onednn
def test_engines_over_one_target_read_one_packed_copy_of_each_weight():
    """Packed copies are made once per weight tensor: a greedy and a speculative engine over one target read the
    same packed tensors (no engine has to be told to share). A weight modified in place gets a fresh copy with its
    new values in the next engine (the one built before keeps the copy it read); the others stay shared."""
    from asr_spec.engine import DecodeOptions, Engine
    from asr_spec.models.loading import decoder_draft

    model = random_whisper("test", seed=3, vocab_size=70, init_std=0.2)
    greedy = Engine(model, None, DecodeOptions(language="en"))
    spec = Engine(model, decoder_draft(model, [0]), DecodeOptions(language="en"))
    a, b = greedy.target_dec, spec.target_dec
    fc1 = model.model.decoder.layers[0].fc1
    assert a.weights[fc1] is b.weights[fc1]
    assert all(x[0] is y[0] for x, y in zip(a.qkv + a.cross_q, b.qkv + b.cross_q, strict=True))
    if a.certified is None:
        assert a.head_packed is b.head_packed
    else:
        assert a.certified.text_packed is b.certified.text_packed
        assert a.certified.exact_packed is b.certified.exact_packed
    with torch.no_grad():
        fc1.weight.mul_(2.0)
    fresh = Engine(model, None, DecodeOptions(language="en")).target_dec
    assert fresh.weights[fc1] is not a.weights[fc1] and fresh.qkv[0][0] is a.qkv[0][0]
    x = torch.randn(3, fc1.in_features)
    torch.testing.assert_close(fresh.linear(x, fresh.weights[fc1], fc1.bias), F.linear(x, fc1.weight, fc1.bias),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.linear(x, a.weights[fc1], fc1.bias), F.linear(x, fc1.weight / 2, fc1.bias),
                               rtol=1e-5, atol=1e-5)


def test_a_shared_copy_is_made_afresh_when_its_source_gets_new_data_under_the_same_object():
    """`module.to(dtype)` gives a Parameter new data without moving its version counter: a copy made from it before
    is not the one to read after (a Decoder built on the model in fp32 and then in bf16 read fp32 panels)."""
    from asr_spec.engine.kernels import shared

    layer = torch.nn.Linear(8, 4)
    made = []

    def make():
        made.append(layer.weight.detach().clone())
        return made[-1]

    first = shared("test-copy", (layer.weight,), make)
    assert shared("test-copy", (layer.weight,), make) is first  # the same source: shared
    layer.to(torch.bfloat16)
    again = shared("test-copy", (layer.weight,), make)
    assert again is not first and again.dtype == torch.bfloat16 and len(made) == 2
    with torch.no_grad():
        layer.weight.data = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert shared("test-copy", (layer.weight,), make) is not again and bool((made[-1] == 0).all())


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
    # one bf16 copy of a draft (and of its packed weights), whatever the number of engines using it
    assert Engine(model, draft, options).draft_dec.head_packed is low.draft_dec.head_packed
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
    oneDNN products: the same logits as the plain bf16 path up to bf16 rounding; a bf16 target decodes through it
    to transformers' own bf16 greedy tokens, diverging only where the top two scores are within that rounding."""
    from asr_spec.engine import DecodeOptions, Engine

    model = random_whisper("test", seed=7, vocab_size=70, init_std=0.2).to(torch.bfloat16)
    packed, _, outs = _packed_and_plain(model, monkeypatch)
    assert packed.certified is None
    for a, b in zip(*outs):
        a, b = a.float(), b.float()
        torch.testing.assert_close(a, b, rtol=BF16_RTOL, atol=BF16_RTOL * float(b.abs().max()))
    monkeypatch.undo()
    features = torch.randn(2, 16, 100, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    results = Engine(model, None, DecodeOptions(language="en", max_new_tokens=10)).decode(features, batch_size=2)
    for row, r in enumerate(results):
        assert len(r.tokens) >= 1
        ref = hf_greedy(model, features[row], language="en", max_new_tokens=10)
        diverged = first_divergence(model, features[row], r.prompt + r.tokens, ref, len(r.prompt), False)
        if diverged is not None:
            i, gap, top = diverged
            assert abs(gap) <= 2 * BF16_RTOL * max(abs(top), 1.0), f"row {row}: diverges at {i}, top-2 gap {gap}"


@pytest.mark.parametrize("width, lone", [(0, False), (2, True)])
def test_attention_reads_values_stored_either_way(width, lone):
    """`kernels.attention` over values stored (S, head_dim) and over the same values stored (head_dim, S)
    (`stored`, the layout `values_transposed` picks): both softmax(q k^T + bias) v, a lone query's piece included
    (3 queries in pieces of 2), masked keys left out."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 4, generator=gen, dtype=torch.float64) for n in (3, 7, 7))
    seen = torch.arange(7)[None, None, None, :] <= torch.tensor([[2, 4, 6], [0, 3, 5]])[:, None, :, None]
    bias = mask_bias(seen, q.dtype)
    expected = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v
    for transposed in (False, True):
        values = stored(v, transposed)
        assert (values.stride(-2) == 1) == transposed
        out = attention(q, k.transpose(-1, -2).contiguous(), values, bias, width, lone)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("bias", [True, False])
def test_transposed_product_writes_each_chunks_projection_transposed(bias):
    """`kernels.transposed_product`: the audio keys/values of a transposed cache, (audio @ W^T + b)^T per chunk,
    written in place; a chunk gets bit for bit the same values alone as among others (bf16)."""
    gen = torch.Generator().manual_seed(0)
    proj = torch.nn.Linear(8, 6, bias=bias)
    audio = torch.randn(3, 5, 8, generator=gen)
    out = torch.empty(3, 2, 3, 5)
    with torch.inference_mode():  # as `Decoder.write_audio` runs
        transposed_product(audio, proj, out)
        torch.testing.assert_close(out, proj(audio).view(3, 5, 2, 3).permute(0, 2, 3, 1))
        proj, audio = proj.to(torch.bfloat16), audio.to(torch.bfloat16)
        together = torch.empty(3, 2, 3, 5, dtype=torch.bfloat16)
        alone = torch.empty(1, 2, 3, 5, dtype=torch.bfloat16)
        transposed_product(audio, proj, together)
        transposed_product(audio[1:2], proj, alone)
    assert torch.equal(together[1:2], alone)
