"""Hypothesis drafting: a request's expected tokens (a stream's previous hypothesis of the same audio) proposed as
the draft of its row while they last and agree with the target. Pure tensor pieces of `speculative.step`.

Per row, a step with hypotheses proposes either (a) the next `width` tokens of the row's hypothesis, when some are
left and none was rejected yet, or (b) the model draft's K tokens (none without a draft). The verify window is
then max(K, width) + 1 wide for every row of the step (static shapes: the scheduler takes such steps only while a
row with a hypothesis is live). Once a committed token differs from the hypothesis at its place, the row's
hypothesis is dropped (`length` set to 0): the row continues with the model draft, or greedily. The target still
decides every token, so the output is the greedy decoding whatever the hypothesis (lossless).

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
    length:   (B,) long, the row's usable hypothesis tokens counted from its first generated token; 0 without one
              or once one was rejected
    offered, accepted: (B,) long, hypothesis tokens proposed for verification, and of them those accepted
    width:    tokens proposed per step from a hypothesis (`DecodeOptions.num_hypothesis_tokens`)
    """

    tokens: torch.Tensor
    length: torch.Tensor
    offered: torch.Tensor
    accepted: torch.Tensor
    width: int

    @classmethod
    def empty(cls, n_rows: int, n_tokens: int, width: int, device: torch.device) -> "Hypotheses":
        """No hypothesis in `n_rows` slots of `n_tokens` tokens each."""
        def zeros() -> torch.Tensor:
            return torch.zeros(n_rows, dtype=torch.long, device=device)

        return cls(torch.zeros(n_rows, n_tokens, dtype=torch.long, device=device), zeros(), zeros(), zeros(), width)

    def _tensors(self) -> list[str]:
        return [f.name for f in fields(self) if f.name != "width"]

    def rows(self, n_rows: int) -> "Hypotheses":
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
        done = n_tok - begin
        left = (self.length - done).clamp(min=0)  # hypothesis tokens not yet reached
        uses = left > 0
        offered = self.tokens.gather(1, (done[:, None] + i).clamp(max=self.tokens.shape[1] - 1))
        pos = (n_tok[:, None] + i).clamp(max=seq.shape[1] - 1)
        seq.scatter_(1, pos, torch.where(uses[:, None], offered, seq.gather(1, pos)))
        # a row offers none it could not keep (room before its limit, less the target's own token)
        mine = (i < left[:, None]) & (i < (limit - n_tok - 1)[:, None])
        p = max(drafted.shape[1], width)
        proposed = torch.where(uses[:, None], F.pad(mine, (0, p - width)), F.pad(drafted, (0, p - drafted.shape[1])))
        return proposed, uses

    def settle(self, choice: torch.Tensor, old_n: torch.Tensor, begin: torch.Tensor, n_new: torch.Tensor,
               counted: torch.Tensor, n_offered: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """After the accept: drop the hypothesis of every row whose newly committed tokens (choice[:, :n_new], the
        target's choices at positions old_n...) differ from it, and count the rows `counted` ((B,) bool: live and
        proposing from their hypothesis) offered / accepted tokens ((B,) long each)."""
        j = torch.arange(choice.shape[1], device=choice.device)
        at = (old_n - begin)[:, None] + j
        expected = self.tokens.gather(1, at.clamp(max=self.tokens.shape[1] - 1))
        wrong = (j[None, :] < n_new[:, None]) & (at < self.length[:, None]) & (choice != expected)
        self.length.masked_fill_(wrong.any(1), 0)
        self.offered.add_(torch.where(counted, n_offered, 0))
        self.accepted.add_(torch.where(counted, n_accepted, 0))
