"""Finished rows read back from the device into `ChunkResult`s (the scheduler's last stage of a chunk).

The state of the finished rows is gathered on the device and read in two copies (the integer fields side by side,
the two float ones), not one per field or row; then each row's tokens, statistics and Whisper's average
log-probability are put together on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asr_spec.engine.hypothesis import Hypotheses
from asr_spec.engine.requests import ChunkRequest, ChunkResult
from asr_spec.engine.speculative import COUNTS, FINISH_EOS, DecodeState
from asr_spec.engine.stats import ChunkStats

FINISH_REASONS = {FINISH_EOS: "eos"}  # a result's finish reason by FINISH_* code; any other: "length"


def read_rows(st: DecodeState, hyp: Hypotheses, rows: list[int]) -> list[dict]:
    """The state of slots `rows` as Python values, one dict per row (seq, n_tok, begin, the COUNTS, hist,
    sum_logprob, no_speech_prob, offered, taken): gathered on the device, then read in two copies (the integer
    fields side by side, the two float ones), not one per field."""
    idx = torch.tensor(rows, device=st.n_tok.device)
    singles = ("n_tok", "begin", *COUNTS)
    ints = torch.cat([st.seq[idx], st.hist[idx], torch.stack([getattr(st, name)[idx] for name in singles]
                                                             + [hyp.offered[idx], hyp.accepted[idx]], 1)], 1).tolist()
    floats = torch.stack([st.sum_logprob[idx], st.no_speech_prob[idx]], 1).tolist()
    n_seq, n_hist = st.seq.shape[1], st.hist.shape[1]
    out = []
    for values, (sum_logprob, no_speech_prob) in zip(ints, floats):
        r = dict(zip((*singles, "offered", "taken"), values[n_seq + n_hist:]))
        out.append(dict(r, seq=values[:n_seq], hist=values[n_seq:n_seq + n_hist], sum_logprob=sum_logprob,
                        no_speech_prob=no_speech_prob))
    return out


def finished_results(st: DecodeState, hyp: Hypotheses, done: list[tuple[int, ChunkRequest]], finish: list[int],
                     forced: Callable[[ChunkRequest], int]) -> list[ChunkResult]:
    """The results of the finished (row, request) pairs `done`, read from the device in two copies (`read_rows`);
    finish: every row's FINISH_* code as read; forced(request): the tokens of its prompt that were forced (a
    prefix), not generated."""
    if not done:
        return []
    out = []
    for (row, req), r in zip(done, read_rows(st, hyp, [row for row, _ in done])):
        begin, n_tok = r["begin"], r["n_tok"]
        n_generated = n_tok - begin - forced(req)  # a prefix was not generated
        stats = ChunkStats(chunks=1, generated_tokens=n_generated, target_passes=r["target_passes"],
                           draft_passes=r["draft_passes"], drafted_tokens=r["drafted"],
                           accepted_tokens=r["accepted"], accepted_hist=tuple(r["hist"]),
                           hypothesis_offered=r["offered"], hypothesis_accepted=r["taken"])
        # Whisper divides by the text tokens + 1: the generated count with a final <|endoftext|>, one more without
        avg_logprob = r["sum_logprob"] / (n_generated + (finish[row] != FINISH_EOS))
        out.append(ChunkResult(req.id, tuple(r["seq"][begin:n_tok]), tuple(r["seq"][:begin]),
                               FINISH_REASONS.get(finish[row], "length"), stats, r["no_speech_prob"],
                               avg_logprob, req.encoded if req.keep_encoded else None, float(req.temperature)))
    return out
