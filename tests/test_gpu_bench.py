"""benchmarks/gpu_bench.py's logic on the CPU (`--device cpu --tiny`): the oracle draft's measured acceptance is the set
rate, and every speculative row equals greedy, through the engine's normal draft path: 16 chunks through 8 slots,
so slots are refilled and rows packed, and a row's chunk must follow it (an oracle that took a row's slot for its
chunk measured 0.30-0.48 here instead of 0.6/0.9).

Measured acceptance, per position: the chance a proposal is accepted given the ones before it were, from the summed
accepted-length histogram. At 16 chunks x 120 tokens its standard error is about 0.01, so the ±0.05 tolerance is
several standard errors; a set rate off by 0.1 fails it (the last test).
"""

from __future__ import annotations

import json

import pytest
from conftest import script_module

TOLERANCE = 0.05
COLUMNS = ("batch", "k", "set_acceptance", "measured_acceptance", "rows_equal_greedy", "tokens_per_s",
           "speedup_vs_greedy", "tokens_per_target_pass", "step_ms", "floor_ms", "mode")


@pytest.fixture(scope="module")
def gpu_bench():
    with script_module("gpu_bench") as module:
        yield module


def test_tiny_bench_acceptance_and_identity(gpu_bench, tmp_path):
    out = tmp_path / "bench.json"
    rows = gpu_bench.main(["--device", "cpu", "--tiny", "--json", str(out), "--check", str(TOLERANCE)])
    written = json.loads(out.read_text())["rows"]
    assert written == json.loads(json.dumps(rows))  # the JSON holds every row printed
    spec = [r for r in rows if r["k"]]
    assert {(r["k"], r["set_acceptance"]) for r in spec} == {(3, 0.6), (3, 0.9), (8, 0.6), (8, 0.9)}
    for row in rows:
        assert set(COLUMNS) <= row.keys()
        assert row["rows_equal_greedy"] == row["rows"] == 16
        assert row["distinct_rows"] >= 8  # chunks decode differently: a row's chunk matters
    for row in spec:
        assert abs(row["measured_acceptance"] - row["set_acceptance"]) <= TOLERANCE, row
        # tokens per pass follow from the rate: (1 - a^(K+1)) / (1 - a) for a geometric run cut at K
        a, k = row["set_acceptance"], row["k"]
        assert row["tokens_per_target_pass"] == pytest.approx((1 - a ** (k + 1)) / (1 - a), rel=0.1)
        assert row["speedup_vs_greedy"] == pytest.approx(row["tokens_per_s"] / rows[0]["tokens_per_s"])


def test_check_fails_when_the_set_rate_is_not_the_rate_measured(gpu_bench, monkeypatch):
    """A mutation: the oracle corrupts as if the rate were 0.1 higher than the one reported as set."""
    from asr_spec.engine.oracle import OracleScript

    original = OracleScript.set_acceptance
    monkeypatch.setattr(OracleScript, "set_acceptance", lambda self, a: original(self, min(a + 0.1, 1.0)))
    rows = gpu_bench.main(["--device", "cpu", "--tiny", "--ks", "3", "--rates", "0.6", "--new-tokens", "80"])
    assert rows[1]["measured_acceptance"] == pytest.approx(0.7, abs=TOLERANCE)  # what the oracle really did
    failures = gpu_bench.check(rows, TOLERANCE)
    assert len(failures) == 1 and "measured acceptance" in failures[0] and "set 0.6" in failures[0]


def test_oracle_proposals_keep_the_set_share_and_never_corrupt_to_the_right_token():
    """Model-free: over 64 chunks x 400 positions the share of recorded tokens kept is the set rate (standard
    error 0.003), every other proposal differs from the recorded token, and a row's proposals do not depend on
    which other rows share the batch."""
    import torch

    from asr_spec.engine.oracle import OracleScript

    sequences = torch.randint(0, 5, (64, 400), generator=torch.Generator().manual_seed(0))
    script = OracleScript(sequences, torch.arange(0, 5), torch.zeros(64, 1, 1), acceptance=0.8, seed=7)
    chunks, positions = torch.arange(64), torch.arange(400).expand(64, -1)
    proposed = script.proposals(chunks, positions)
    kept = proposed == sequences
    assert kept.float().mean().item() == pytest.approx(0.8, abs=0.01)
    alone = script.proposals(chunks[5:6], positions[:1])
    assert torch.equal(alone, proposed[5:6])
    script.set_acceptance(0.0)
    assert not (script.proposals(chunks, positions) == sequences).any()
    with pytest.raises(ValueError, match="acceptance must be in"):
        script.set_acceptance(1.5)
