"""Hypothesis drafting (engine/hypothesis.py) is lossless: whatever a request offers as its hypothesis — the true
greedy continuation, a perturbed one, a wrong one, none, a longer one — each row's output equals transformers'
greedy decoding of that chunk (a divergence only at a checked top-2 tie), with and without a model draft, rows of
every kind mixed in one batch; and the true hypothesis really saves target passes."""

from __future__ import annotations

import pytest
import torch
from test_engine import MAX_NEW, _features, _target, assert_same_as_greedy, drafts, reference

from asr_spec.engine import ChunkRequest, DecodeOptions, Engine
from asr_spec.engine.capture import StepRunner, rows_bucket
from asr_spec.engine.speculative import step

KINDS = ("true", "perturbed", "inserted", "wrong", "empty", "longer")


def hypothesis(kind: str, row: int, timestamps: bool) -> tuple[int, ...]:
    """The hypothesis of `kind` for chunk `row`: built from its greedy continuation (generated tokens)."""
    true = reference(row, timestamps, MAX_NEW)
    n_prompt = 3 if timestamps else 4  # sot, language, task[, notimestamps]
    gen = true[n_prompt:]
    vocab = _target().config.vocab_size
    if kind == "true":
        return gen
    if kind == "perturbed":  # right for 6 tokens, then one wrong, then right again
        return gen[:6] + ((gen[6] + 1) % vocab,) + gen[7:] if len(gen) > 6 else gen
    if kind == "inserted":  # one token too many after the 6th
        return gen[:6] + ((gen[5] + 1) % vocab,) + gen[6:] if len(gen) > 6 else gen
    if kind == "wrong":
        return tuple(int(t) for t in torch.randint(0, vocab, (30,), generator=torch.Generator().manual_seed(row)))
    if kind == "empty":
        return ()
    return gen + tuple((7 * i) % vocab for i in range(60))  # longer: past <|endoftext|> or the length limit


def run(draft_name: str, kinds: list[str], batch_size: int, timestamps: bool = False, **opts):
    opts.setdefault("max_new_tokens", MAX_NEW)
    options = DecodeOptions(language="en", timestamps=timestamps, **opts)
    engine = Engine(_target(), drafts(draft_name), options)
    feats = _features()
    requests = [ChunkRequest(row, feats[row], hypothesis=hypothesis(kinds[row % len(kinds)], row, timestamps))
                for row in range(len(feats))]
    results = {r.id: r for r in engine.run(requests, batch_size)}
    return [results[row] for row in range(len(feats))]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("draft_name", ["none", "perturbed-shared"])
def test_every_kind_of_hypothesis_gives_greedy(kind, draft_name):
    assert_same_as_greedy(run(draft_name, [kind], batch_size=4), False, MAX_NEW)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("draft_name", ["none", "perturbed-shared", "perturbed-own", "self-shared"])
def test_mixed_rows_give_greedy(draft_name, batch_size):
    """Every kind in one batch, refilled as rows finish (10 chunks): rows with and without a hypothesis share
    hypothesis steps; a row whose hypothesis is rejected goes on with the draft."""
    assert_same_as_greedy(run(draft_name, list(KINDS), batch_size, draft_bf16=draft_name != "self-shared"),
                          False, MAX_NEW)


@pytest.mark.parametrize("draft_name", ["none", "perturbed-shared"])
def test_mixed_rows_give_greedy_with_timestamps(draft_name):
    results = run(draft_name, list(KINDS), 3, timestamps=True)
    assert_same_as_greedy(results, True, MAX_NEW)


@pytest.mark.parametrize("width", [1, 5, 24])
def test_width_and_a_short_limit(width):
    """Any width, and a limit that cuts the hypothesis inside a step."""
    results = run("perturbed-shared", list(KINDS), 3, max_new_tokens=11, num_hypothesis_tokens=width)
    assert all(len(r.tokens) <= 11 for r in results)
    assert_same_as_greedy(results, False, 11)


def test_the_true_hypothesis_saves_target_passes():
    width = 16
    true = run("none", ["true"], 4, num_hypothesis_tokens=width)
    plain = run("none", ["empty"], 4)
    for t, p in zip(true, plain):
        assert t.tokens == p.tokens
        assert p.stats.target_passes == p.stats.generated_tokens  # greedy: a pass a token
        assert t.stats.target_passes <= -(-t.stats.generated_tokens // (width + 1)) + 1
        assert t.stats.hypothesis_accepted >= t.stats.generated_tokens - t.stats.target_passes
        assert t.stats.drafted_tokens == 0  # hypothesis tokens are counted as such, not as draft tokens
    wrong = run("none", ["wrong"], 4)
    assert sum(r.stats.hypothesis_accepted for r in wrong) < sum(r.stats.hypothesis_offered for r in wrong) / 2


def test_a_row_out_of_step_finds_its_place_again():
    """A token inserted into the true continuation (as a timestamp that moved between two decodes): the row is out
    of step for one token, finds its last committed token further on, and the rest is verified a window a pass."""
    width = 16
    inserted = run("none", ["inserted"], 4, num_hypothesis_tokens=width)
    assert_same_as_greedy(inserted, False, MAX_NEW)
    # (the tiny model repeats tokens a lot, so a row may find its place at an earlier repeat first: a few passes
    # more than the window allows, never one a token)
    for r in inserted:
        n = r.stats.generated_tokens
        if n > 8:
            assert r.stats.target_passes <= n / 4, (n, r.stats)
            assert r.stats.hypothesis_accepted >= n / 2


def test_perturbed_hypothesis_then_the_draft_goes_on():
    """After the rejected token the model draft proposes (its cache caught up on the accepted tokens) until the
    row is in step with its hypothesis again."""
    results = run("self-shared", ["perturbed"], 4, draft_bf16=False)
    assert_same_as_greedy(results, False, MAX_NEW)
    long_rows = [r for r in results if len(r.tokens) > 12]
    assert long_rows and all(r.stats.hypothesis_accepted >= 6 for r in long_rows)
    assert any(r.stats.accepted_tokens > 0 for r in long_rows)  # the draft (the target itself) took over


def test_a_bad_hypothesis_is_refused_naming_the_chunk():
    engine = Engine(_target(), None, DecodeOptions(language="en", max_new_tokens=4))
    with pytest.raises(ValueError, match=r"chunk 'x': hypothesis must hold token ids \(integers >= 0\)"):
        ChunkRequest("x", _features()[0], hypothesis=(3, -1))
    [refused] = engine.run([ChunkRequest("x", _features()[0], hypothesis=(3, 999))])  # alone, as its result
    assert refused.finish_reason == "refused"
    assert "chunk 'x': hypothesis holds 999, not a token id below" in refused.error
    with pytest.raises(ValueError, match="num_hypothesis_tokens"):
        DecodeOptions(num_hypothesis_tokens=0)


def test_hypothesis_step_has_no_graph_break():
    t = _target()
    engine = Engine(t, drafts("perturbed-shared"), DecodeOptions(language="en", timestamps=True, max_new_tokens=8))
    captured = {}

    def grab(*args):
        if len(args) > 5:
            captured["args"] = args
        step(*args)

    engine.runner = StepRunner("wrapped", lambda fn: grab)
    feats = _features()
    list(engine.run([ChunkRequest(i, feats[i], hypothesis=hypothesis("true", i, True)) for i in range(2)], 2))
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(step)(*captured["args"])
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


class BucketRunner(StepRunner):
    """Eager steps over the rows a CUDA-graph runner computes (`rows_bucket`): a freed slot is computed with its
    last state, as on a GPU, where the eager runner computes the live rows only."""

    def step_rows(self, n_live: int, n_slots: int) -> int:
        return rows_bucket(n_live, n_slots)


@pytest.mark.parametrize("draft_name", ["perturbed-shared", "perturbed-own"])
def test_a_hypothesis_rows_freed_slot_computed_in_a_graphs_row_bucket(draft_name):
    """The last slot's row takes its whole hypothesis (several tokens a step) and finishes first; the other rows
    then run plain steps (a catch-up window of 2) over a bucket of 4 rows that computes its freed slot, whose draft
    cache still lags its tokens by the hypothesis step's: the draft's index into the window is clamped there
    (`_catch_up_index`). It failed the step ('index 4 is out of bounds for dimension 1 with size 2'; a device-side
    assert under CUDA graphs) and lost every chunk in flight."""
    kinds = ["empty", "empty", "empty", "true"]
    options = DecodeOptions(language="en", max_new_tokens=MAX_NEW)
    engine = Engine(_target(), drafts(draft_name), options, runner=BucketRunner())
    feats = _features()[:4]
    requests = [ChunkRequest(row, feats[row], hypothesis=hypothesis(kinds[row], row, False)) for row in range(4)]
    results = {r.id: r for r in engine.run(requests, 4)}
    assert_same_as_greedy([results[row] for row in range(4)], False, MAX_NEW)
    assert results[3].stats.target_passes < len(results[3].tokens)  # its hypothesis was taken several at a time
