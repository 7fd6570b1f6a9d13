"""The certified output head (bf16 head, exact where a decision depends on it), through each of its bf16 products
where it runs (oneDNN's with native bf16, the thin kernel's fp32 rows over bf16 panels): its error bound holds, a
certified position gets exactly the decisions of Whisper's rules on fp32 logits (any history, timestamps on or
off), an uncertified one is recomputed in fp32, a whole greedy decode is the same with and without it, and the one
decision of the product."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from asr_spec.engine import DecodeOptions, Engine, cpu_attention, cpu_linear, decoder_layout
from asr_spec.engine import head as head_module
from asr_spec.engine.head import PRODUCTS, CertifiedHead, approximate_product
from asr_spec.engine.kernels import onednn_linear, onednn_usable, pack
from asr_spec.engine.rules import LogitRules, WhisperTokens
from asr_spec.testing import random_whisper

CPU = torch.device("cpu")
TOKENS = WhisperTokens.from_generation_config(random_whisper("test").generation_config, 448)  # real 51,865 layout
V, D = 51865, 64


@pytest.fixture(params=PRODUCTS)
def product(request, monkeypatch) -> str:
    """Each bf16 product of the head, where it runs here (oneDNN's needs native bf16 products, the thin one the
    kernel extension and oneDNN's fp32 products)."""
    monkeypatch.delenv(cpu_attention.DISABLE_ENV, raising=False)
    runs = {"onednn": onednn_usable(CPU, torch.bfloat16),
            "thin": onednn_usable(CPU, torch.float32) and cpu_linear.fused_linear_usable(CPU, torch.float32)}
    if not runs[request.param]:
        pytest.skip(f"the {request.param} product does not run on this CPU")
    return request.param


def _head_and_inputs(seed: int, product: str, n: int = 48, n_candidates: int = 32):
    """A head like a trained Whisper's (rows of norm ~1, final hidden states of norm ~100: logits of std ~10)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, D, generator=gen) * 0.12
    x = torch.randn(n, D, generator=gen) * 12
    protected = TOKENS.suppress + TOKENS.begin_suppress
    return CertifiedHead(weight, TOKENS.eot, protected, n_candidates, product), weight, x


def test_error_bound_holds_and_is_tight_enough_to_certify(product):
    head, weight, x = _head_and_inputs(0, product)
    e = TOKENS.eot
    if product == "onednn":
        x_rows = x.to(torch.bfloat16)
        approx = onednn_linear(x_rows, pack(weight[:e].to(torch.bfloat16)), None).float()
    else:  # fp32 rows over the bf16 weights, an fp32 output
        x_rows = x
        approx = cpu_linear.linear(x, cpu_linear.repack(weight[:e].to(torch.bfloat16)), None)
    # the thin product is fp32 arithmetic over the bf16 weights: near their float64 product
    on_rounded = (x_rows.double() @ weight[:e].bfloat16().double().t())
    assert product == "onednn" or float((approx.double() - on_rounded).abs().max()) < 1e-3
    true = (x.double() @ weight[:e].double().t()).float()
    bound = head.error_bound(x, x_rows)[:, None] + approx.abs() * head.output_rel
    assert bool(((approx - true).abs() <= bound).all())
    # the bound is no blanket: it is far below the logits' spread, so nearly every position is certified
    assert float(bound.max()) < 0.2 * float(true.std())
    _, certified = head.logits(x)
    assert float(certified.float().mean()) > 0.9


def test_exact_where_promised(product):
    head, weight, x = _head_and_inputs(1, product)
    mixed, _ = head.logits(x)
    exact = head.exact(x)
    ids = torch.tensor(sorted(set(TOKENS.suppress + TOKENS.begin_suppress) | set(range(TOKENS.eot, V))))
    torch.testing.assert_close(mixed[:, ids], exact[:, ids], rtol=1e-5, atol=1e-4)
    # the k candidates of each position are exact too, and at a certified one they hold the best text token
    text_ok = ((mixed[:, :TOKENS.eot] - exact[:, :TOKENS.eot]).abs() <= 1e-4) & (head.select_bias == 0)
    assert bool((text_ok.sum(1) >= head.k).all())
    _, certified = head.logits(x)
    best = (mixed[:, :TOKENS.eot] + head.select_bias).argmax(-1)
    assert bool(text_ok.gather(1, best[:, None])[certified].all())


def _histories(n: int, n_seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n rows of prompt (3 tokens) then a random mix of text and timestamp tokens, cut at random lengths."""
    gen = torch.Generator().manual_seed(seed)
    ts = TOKENS.timestamp_begin
    text = torch.randint(0, 1000, (n, n_seq), generator=gen)
    stamps = ts + torch.randint(0, 30, (n, n_seq), generator=gen).cummax(1).values
    seq = torch.where(torch.rand(n, n_seq, generator=gen) < 0.4, stamps, text)
    seq[:, :3] = torch.tensor([TOKENS.sot, 50259, 50359])
    n_hist = torch.randint(3, n_seq, (n,), generator=gen)
    return seq, n_hist, torch.full((n,), 3)


@pytest.mark.parametrize("timestamps", [False, True])
def test_certified_positions_take_the_fp32_decisions(timestamps, product):
    """Whisper's rules on the mixed logits and on fp32 logits: the same choice, the same best score and the same
    tokens forbidden, at every certified position, over random histories (first position, after a timestamp
    pair, after a lone one, timestamps forced by their total probability)."""
    head, _, x = _head_and_inputs(2, product, n=96)
    mixed, certified = head.logits(x)
    exact = head.exact(x)
    rules = LogitRules(TOKENS, V, timestamps, torch.device("cpu"))
    seq, n_hist, begin = _histories(len(x), 12, seed=3)
    n_hist[:8] = 3  # some rows at the first generated position
    a = rules.apply(mixed[:, None], seq, n_hist, begin)[:, 0]
    b = rules.apply(exact[:, None], seq, n_hist, begin)[:, 0]
    assert int(certified.sum()) > 80
    best_a, choice_a = a[certified].max(-1)
    best_b, choice_b = b[certified].max(-1)
    assert torch.equal(choice_a, choice_b)
    torch.testing.assert_close(best_a, best_b, rtol=1e-5, atol=1e-4)
    assert torch.equal(a[certified].isinf(), b[certified].isinf())
    # the log-probability normaliser is the only thing that sees approximate values, and barely
    torch.testing.assert_close(a[certified].logsumexp(-1), b[certified].logsumexp(-1), rtol=0, atol=1e-3)


def test_uncertified_positions_are_recomputed_in_fp32(product):
    """Two text tokens with identical rows on top and one candidate: never certifiable, so the call returns the
    fp32 logits of those positions (and counts them)."""
    head, weight, x = _head_and_inputs(4, product, n=6, n_candidates=1)
    weight[500] = weight[501] = x[0] / x[0].norm() * 3.0
    head = CertifiedHead(weight, TOKENS.eot, TOKENS.suppress + TOKENS.begin_suppress, 1, product)
    _, certified = head.logits(x)
    assert not bool(certified[0])
    out = head(x)
    torch.testing.assert_close(out[0], head.exact(x[:1])[0], rtol=1e-6, atol=1e-5)
    assert head.n_rows == 6 and head.n_fallback == int((~certified).sum()) >= 1


@pytest.mark.parametrize("timestamps", [False, True])
def test_greedy_decode_is_identical_with_and_without_the_certified_head(timestamps, product, monkeypatch):
    """A random Whisper of the real vocabulary, peaked enough for most positions to certify: the same tokens and
    (up to 1e-3) the same average log-probabilities as with the fp32 head; with a single candidate many positions
    fall back to fp32, and the tokens are still the same."""
    monkeypatch.setattr(decoder_layout, "approximate_product", lambda device: product)
    model = random_whisper("test", seed=11, init_std=0.3)
    features = torch.randn(4, 16, 100, generator=torch.Generator().manual_seed(1))
    options = DecodeOptions(language="en", timestamps=timestamps, max_new_tokens=30)
    engine = Engine(model, None, options)
    certified = engine.decode(features, batch_size=4)
    head = engine.target_dec.certified
    assert head is not None and head.n_rows > 100 and head.product == product
    engine.target_dec.certified = narrow = CertifiedHead(model.proj_out.weight, TOKENS.eot,
                                                         TOKENS.suppress + TOKENS.begin_suppress, 1, product)
    one_candidate = engine.decode(features, batch_size=4)
    assert 0 < narrow.n_fallback < narrow.n_rows
    plain_engine = Engine(model, None, replace(options, certified_head=False))
    assert plain_engine.target_dec.certified is None
    plain = plain_engine.decode(features, batch_size=4)
    for c, n, p in zip(certified, one_candidate, plain, strict=True):
        assert c.tokens == n.tokens == p.tokens
        assert c.avg_logprob == pytest.approx(p.avg_logprob, abs=1e-3)


def test_the_decision_of_the_product(monkeypatch):
    """oneDNN's bf16 product where it is native, else the thin kernel's where it runs, else none (the plain fp32
    head); never off a CPU."""
    native = {"bf16": True, "thin": True}
    monkeypatch.setattr(head_module, "onednn_usable", lambda device, dtype: dtype == torch.float32 or native["bf16"])
    monkeypatch.setattr(head_module.cpu_linear, "fused_linear_usable", lambda device, dtype: native["thin"])
    assert approximate_product(CPU) == "onednn"
    native["bf16"] = False
    assert approximate_product(CPU) == "thin"
    native["thin"] = False
    assert approximate_product(CPU) is None
    assert approximate_product(torch.device("cuda")) is None
    with pytest.raises(ValueError, match="product must be one of"):
        CertifiedHead(torch.zeros(10, 4), 5, (), 2, "int8")
