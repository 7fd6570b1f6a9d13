"""Evaluating a distilled draft: teacher-forced agreement with the target's greedy tokens on cached windows, the
constant-K simulation of tokens per target pass it implies, the engine's real speculative run (tokens per target
pass, acceptance, wall time against greedy) and a decoder step's cost.

For a decoder-only draft the teacher-forced agreement is exact at every draft position (its proposal depends on the
tokens only). A feature-conditioned draft reads the target's states only for its first proposal of a step; later
ones read its own guesses, so its teacher-forced agreement is that of the first proposal, and `simulate_steps` on it
is an upper bound: its tokens per target pass are measured by running the engine (`engine_tokens_per_pass`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from asr_spec.distill.data import CacheBatch, PseudoLabelCache
from asr_spec.engine import full_vocab_logits
from asr_spec.models.feature_draft import shift_features


def reads_features(draft: nn.Module) -> bool:
    """A feature-conditioned draft (asr_spec.models.feature_draft), as the engine's pair check knows it."""
    return bool(getattr(draft, "reads_target_features", False))


def draft_states(draft: nn.Module, b: CacheBatch) -> torch.Tensor:
    """The draft's final LayerNormed state at each input position of a batch, teacher-forced, (B, T, d): from the
    tokens and encoder output, and for a feature-conditioned draft the target's states at each position - 1."""
    if reads_features(draft):
        return draft.hidden(b.input_ids, shift_features(b.teacher_hidden), b.encoded)
    return draft.model.decoder(input_ids=b.input_ids, encoder_hidden_states=b.encoded.to(draft.dtype),
                               use_cache=False).last_hidden_state

@dataclass(frozen=True)
class AgreementReport:
    """Teacher-forced agreement of a draft with the target's greedy tokens on cached windows."""

    agreement: float  # fraction of generated tokens where draft argmax (Whisper rules applied) == target token
    tokens: int  # generated tokens scored
    accepted_per_step: dict[int, float]  # K -> mean draft tokens accepted per speculative step (constant K)
    tokens_per_pass: dict[int, float]  # K -> generated tokens per target pass
    vocab_coverage: float  # fraction of target tokens inside the draft's vocabulary (1.0 for a full head)


def simulate_steps(match: Sequence[bool], k: int) -> tuple[int, int]:
    """(target passes, accepted draft tokens) of constant-K speculative decoding of one sequence, given whether
    the draft's argmax (on the target's prefix) equals the target's token at each generated position.

    Exact for greedy verification: a step at position p accepts the run of matches from p (at most K) and adds
    the target's own token; a draft proposal past the first mismatch is never looked at. A sequence cut by its
    length limit is no different: the engine offers its last position too (`DecodeState.keeps`), and a step that
    accepts it commits no token past it.
    """
    n, pos, passes, accepted = len(match), 0, 0, 0
    while pos < n:
        run = 0
        while run < k and pos + run < n and match[pos + run]:
            run += 1
        accepted += min(run, n - pos)
        pos += min(run + 1, n - pos)
        passes += 1
    return passes, accepted


@torch.inference_mode()
def draft_matches(target: nn.Module, draft: nn.Module, cache: PseudoLabelCache, i: int) -> list[bool]:
    """Per generated token of window i: does the draft's proposal equal the target's token? The proposal is chosen
    as the engine chooses it (`LogitRules.draft_choice`: the history-free rules of the cache's mode)."""
    from asr_spec.engine.rules import LogitRules, WhisperTokens

    tokens = WhisperTokens.from_generation_config(target.generation_config, target.config.max_target_positions)
    rules = LogitRules(tokens, target.config.vocab_size, cache.timestamps, torch.device("cpu"))
    b = cache.batch([i])
    p = cache.prompt_len
    h = draft_states(draft, b)[:, p - 1:]
    vocab_ids = getattr(draft, "draft_vocab_ids", None)
    w = draft.proj_out.weight
    logits = full_vocab_logits(h @ (w if vocab_ids is None else w[vocab_ids]).T, vocab_ids, w.shape[0])
    seq = torch.tensor([cache.sequence(i)])
    at_begin = torch.arange(logits.shape[1])[None, :] == 0
    return (rules.static_scores(logits, at_begin).argmax(-1)[0] == seq[0, p:]).tolist()


def evaluate_agreement(target: nn.Module, draft: nn.Module, cache: PseudoLabelCache,
                       ks: Sequence[int] = (4, 8)) -> AgreementReport:
    matches = [draft_matches(target, draft, cache, i) for i in range(len(cache))]
    flat = [m for ms in matches for m in ms]
    n = max(1, len(flat))
    acc, tpp = {}, {}
    for k in ks:
        sims = [simulate_steps(ms, k) for ms in matches]
        passes = sum(s[0] for s in sims)
        acc[k] = sum(s[1] for s in sims) / max(1, passes)
        tpp[k] = len(flat) / max(1, passes)
    vocab_ids = getattr(draft, "draft_vocab_ids", None)
    if vocab_ids is None:
        coverage = 1.0
    else:
        gen = [t for i in range(len(cache)) for t in cache.sequence(i)[cache.prompt_len:]]
        coverage = float(torch.isin(torch.tensor(gen), vocab_ids).float().mean()) if gen else 1.0
    return AgreementReport(sum(flat) / n, len(flat), acc, tpp, coverage)


def decoder_step_ms(model: nn.Module, batch_size: int, n_audio_ctx: int, repeats: int = 20) -> float:
    """Milliseconds of one engine decoder step of `model` (a target, or a draft with its restricted head if it has
    one) at `batch_size` rows: a single-token step at position 40, cross-attention over `n_audio_ctx` frames of
    keys/values written from a random encoder output (in the decoder's audio dtype and layout, int8 with its
    scales included), after 3 warm-up steps. Host clock, no device sync: for CPU benchmarks."""
    from asr_spec.engine import Decoder

    decoder = getattr(model, "step_decoder", Decoder)(model.model.decoder, model.proj_out,
                                                      getattr(model, "draft_vocab_ids", None))
    cache = decoder.new_cache(batch_size, 64, n_audio_ctx)
    d_encoder = decoder.layers[0].encoder_attn.k_proj.in_features
    decoder.write_audio(cache, torch.randn(batch_size, n_audio_ctx, d_encoder, device=decoder.device))
    tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=decoder.device)
    positions = torch.full((batch_size, 1), 40, device=decoder.device)
    if reads_features(model):  # a feature-conditioned draft's step: the token and the state it reads
        states = torch.zeros(batch_size, 1, decoder.d_model, device=decoder.device, dtype=decoder.dtype)

        def one_step() -> None:
            decoder.draft_forward(cache, tokens, states, positions, 41)
    else:
        def one_step() -> None:
            decoder.forward(cache, tokens, positions, 41)
    for _ in range(3):
        one_step()
    start = time.perf_counter()
    for _ in range(repeats):
        one_step()
    return (time.perf_counter() - start) / repeats * 1e3


def engine_tokens_per_pass(target: nn.Module, draft: nn.Module, cache: PseudoLabelCache, k: int,
                           batch_size: int = 8) -> dict:
    """The engine's own speculative run over a cache's windows (their stored encoder outputs, the cache's mode and
    token limit) at K = `k`: tokens per target pass, acceptance (accepted / offered draft tokens) and whether the
    output equals the cache's greedy pseudo-labels (it must, up to a near-tie: fp16 encoder outputs, other batch)."""
    from asr_spec.engine import ChunkStats, DecodeOptions, Engine

    opts = DecodeOptions(language=cache.meta["language"], max_new_tokens=cache.meta["max_new_tokens"],
                         num_draft_tokens=k, timestamps=cache.timestamps)
    encoded = torch.from_numpy(cache.encoded[:].astype("float32"))
    results = Engine(target, draft, opts).decode(None, encoded, batch_size)
    stats = ChunkStats.total(r.stats for r in results)
    same = sum(list(r.prompt + r.tokens) == cache.sequence(i) for i, r in enumerate(results))
    return {"tokens_per_target_pass": round(stats.tokens_per_target_pass, 3),
            "acceptance_rate": round(stats.acceptance_rate, 3), "tokens": stats.generated_tokens,
            "windows_equal_to_labels": f"{same}/{len(results)}"}


@dataclass(frozen=True)
class SpeedReport:
    batch_size: int
    k: int
    greedy_s: float
    speculative_s: float
    generated_tokens: int
    tokens_per_target_pass: float
    acceptance_rate: float
    identical: bool  # speculative output == greedy output, token for token, every chunk

    @property
    def speedup(self) -> float:
        return self.greedy_s / self.speculative_s


def benchmark(target: nn.Module, draft: nn.Module, encoded: torch.Tensor, *, batch_size: int = 4, k: int = 4,
              language: str | None = "en", max_new_tokens: int = 256, repeats: int = 2, timestamps: bool = False,
) -> SpeedReport:
    """Wall time of the Engine's greedy vs speculative decoding of the same encoder outputs (best of `repeats`
    interleaved runs each, after a warm-up run each); CPU only (no device sync)."""
    from asr_spec.engine import ChunkStats, DecodeOptions, Engine

    opts = DecodeOptions(language=language, max_new_tokens=max_new_tokens, num_draft_tokens=k, timestamps=timestamps)
    greedy = Engine(target, None, opts)
    spec = Engine(target, draft, opts)  # packed weights are shared by construction: one copy of the target's

    res_g = greedy.decode(None, encoded, batch_size)  # warm-up
    res_s = spec.decode(None, encoded, batch_size)
    t_g = t_s = float("inf")
    for _ in range(repeats):  # interleaved, best of each: a machine shared with other jobs drifts between runs
        t0 = time.perf_counter()
        greedy.decode(None, encoded, batch_size)
        t1 = time.perf_counter()
        spec.decode(None, encoded, batch_size)
        t_g, t_s = min(t_g, t1 - t0), min(t_s, time.perf_counter() - t1)

    stats = ChunkStats.total(r.stats for r in res_s)
    return SpeedReport(batch_size, k, t_g, t_s, stats.generated_tokens, stats.tokens_per_target_pass,
                       stats.acceptance_rate, [r.tokens for r in res_g] == [r.tokens for r in res_s])
