"""Hypothesis drafting: a request's expected tokens (a stream's previous hypothesis of the same audio) proposed as
the draft of its row while they last and agree with the target. Pure tensor pieces of `speculative.step`.

Per row, a step with hypotheses proposes either (a) the next `width` tokens of the row's hypothesis, from the
row's place in it (`at`) while it is in step with it, or (b) the model draft's K tokens (none without a draft).
The verify window is then max(K, width) + 1 wide for every row of the step (static shapes: the scheduler takes
such steps only while a row with a hypothesis is live). Once a committed token differs from the hypothesis at its
place, the row is out of step: it continues with the model draft, or greedily, and after each step looks for its
last committed token within two tokens of where it diverged (a token inserted or left out there), else for its last
two committed tokens anywhere further on; where found, it is in step again from the token after them. Why not
drop the hypothesis at the first rejection: successive decodes of a growing buffer differ mostly in a timestamp
here and there, and the text after such a timestamp is usually the same (benchmarks/bench_stream.py, one stream:
2.0 tokens a target pass when dropping it, 2.4 re-synchronising). The target still decides every token,
so the output is the greedy decoding whatever the hypothesis (lossless).

The model draft stays in step: its cache does not hold the hypothesis tokens a row accepted, so after a
hypothesis step its length is the committed tokens before that step, and the next step's catch-up window is
`width + 2` wide (it feeds the draft every committed token it has not seen: at most width + 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


@dataclass
class Hypotheses:
    """The offered tokens of the batch slots; every tensor's first dimension is the row.

    tokens:   (B, H) long, each row's hypothesis (generated tokens, prompt excluded), then zeros
    length:   (B,) long, the row's hypothesis tokens (0: none)
    at:       (B,) long, the index in `tokens` of the next token the row is expected to produce (in step), or
              from which it looks for its last committed token (out of step)
    in_step:  (B,) bool, the row's committed tokens since `at` was set agree with the hypothesis
    offered, accepted: (B,) long, hypothesis tokens proposed for verification, and of them those accepted
    width:    tokens proposed per step from a hypothesis (`DecodeOptions.num_hypothesis_tokens`)
    """

    tokens: torch.Tensor
    length: torch.Tensor
    at: torch.Tensor
    in_step: torch.Tensor
    offered: torch.Tensor
    accepted: torch.Tensor
    width: int

    @classmethod
    def empty(cls, n_rows: int, n_tokens: int, width: int, device: torch.device) -> Hypotheses:
        """No hypothesis in `n_rows` slots of `n_tokens` tokens each."""
        def zeros() -> torch.Tensor:
            return torch.zeros(n_rows, dtype=torch.long, device=device)

        return cls(torch.zeros(n_rows, n_tokens, dtype=torch.long, device=device), zeros(), zeros(),
                   zeros().bool(), zeros(), zeros(), width)

    def _tensors(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "width"]

    def rows(self, n_rows: int) -> Hypotheses:
        """The first `n_rows` slots, as views."""
        return Hypotheses(*(getattr(self, name)[:n_rows] for name in self._tensors()), self.width)

    def move_row(self, src: int, dst: int) -> None:
        for name in self._tensors():
            t = getattr(self, name)
            t[dst] = t[src]

    def start(self, rows: Sequence[int], hypotheses: Sequence[Sequence[int]]) -> None:
        """Rows `rows` (newly admitted slots) start with `hypotheses` (each cut to H tokens; () = none)."""
        n_tokens = self.tokens.shape[1]
        host = torch.zeros(len(rows), n_tokens, dtype=torch.long)
        lengths = torch.zeros(len(rows), dtype=torch.long)
        for i, hyp in enumerate(hypotheses):
            cut = list(hyp)[:n_tokens]
            host[i, :len(cut)] = torch.tensor(cut, dtype=torch.long)
            lengths[i] = len(cut)
        index = torch.tensor(list(rows), device=self.tokens.device)
        self.tokens[index] = host.to(self.tokens.device)
        self.length[index] = lengths.to(self.tokens.device)
        self.at[index] = 0
        self.in_step[index] = True
        self.offered[index] = 0
        self.accepted[index] = 0

    def propose(self, seq: torch.Tensor, n_tok: torch.Tensor, begin: torch.Tensor, limit: torch.Tensor,
                drafted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Overlay the hypothesis proposals on the draft's in seq[n_tok : n_tok + width] of the rows that use them.

        seq: (B, S), n_tok, begin, limit: (B,) long, the decoding state (`DecodeState`); drafted: (B, K) bool, the
        draft's proposals (K = 0 without a draft). Returns the (B, P) bool proposals each row really offers,
        P = max(K, width), and the (B,) bool rows whose proposals come from their hypothesis.
        """
        width = self.width
        i = torch.arange(width, device=seq.device)
        left = torch.where(self.in_step, self.length - self.at, 0).clamp(min=0)  # hypothesis tokens not reached
        uses = left > 0
        offered = self.tokens.gather(1, (self.at[:, None] + i).clamp(max=self.tokens.shape[1] - 1))
        pos = (n_tok[:, None] + i).clamp(max=seq.shape[1] - 1)
        seq.scatter_(1, pos, torch.where(uses[:, None], offered, seq.gather(1, pos)))
        # a row offers none it could not keep before its limit (as `DecodeState.keeps`)
        mine = (i < left[:, None]) & (i < (limit - n_tok)[:, None])
        p = max(drafted.shape[1], width)
        proposed = torch.where(uses[:, None], F.pad(mine, (0, p - width)), F.pad(drafted, (0, p - drafted.shape[1])))
        return proposed, uses

    def settle(self, choice: torch.Tensor, n_new: torch.Tensor, seq: torch.Tensor, n_tok: torch.Tensor,
               counted: torch.Tensor, n_offered: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """After the accept: move each row's place in its hypothesis past its newly committed tokens
        (choice[:, :n_new], the target's choices) where they agree with it; elsewhere (out of step) look for the
        last committed token near where the row diverged, else the last two (seq[n_tok - 2 : n_tok], the state
        after the accept) further on, and go on after them, or stay out of step. Counts the rows `counted` ((B,)
        bool: live and proposing from their hypothesis) offered / accepted tokens ((B,) long each)."""
        n_hyp = self.tokens.shape[1]
        j = torch.arange(choice.shape[1], device=choice.device)
        at = self.at[:, None] + j
        expected = self.tokens.gather(1, at.clamp(max=n_hyp - 1))
        wrong = (j[None, :] < n_new[:, None]) & ((at >= self.length[:, None]) | (choice != expected))
        agrees = self.in_step & ~wrong.any(1)
        # an in-step row that diverged looks from where it diverged on, one out of step from its place
        diverged_at = torch.where(wrong, j[None, :], choice.shape[1]).min(1).values
        floor = torch.where(self.in_step, self.at + diverged_at, self.at)
        last = seq.gather(1, (n_tok - 1)[:, None])  # (B, 1) the last committed token, and the one before it
        before = seq.gather(1, (n_tok - 2).clamp(min=0)[:, None])
        k = torch.arange(n_hyp, device=choice.device)
        previous = torch.cat([torch.full_like(self.tokens[:, :1], -1), self.tokens[:, :-1]], 1)  # tokens[k - 1]
        ahead = (k[None, :] >= floor[:, None]) & (k[None, :] < self.length[:, None])
        # the last token within two of the place (a token inserted or left out there), else the last two anywhere on
        near = ahead & (self.tokens == last) & (k[None, :] <= floor[:, None] + 2)
        far = ahead & (self.tokens == last) & (previous == before)
        first_near = torch.where(near, k[None, :], n_hyp).min(1).values
        first = torch.where(first_near < n_hyp, first_near, torch.where(far, k[None, :], n_hyp).min(1).values)
        moved = n_new > 0
        self.at.copy_(torch.where(agrees, self.at + n_new, torch.where(moved & (first < n_hyp), first + 1, floor)))
        self.in_step.copy_(agrees | (moved & (first < n_hyp)))
        self.offered.add_(torch.where(counted, n_offered, 0))
        self.accepted.add_(torch.where(counted, n_accepted, 0))
