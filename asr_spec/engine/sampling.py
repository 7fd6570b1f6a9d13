"""Sampling at a per-row temperature, and speculative sampling that stays lossless in distribution.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023). At a verified position the draft proposed x, drawn
from its own distribution q; the target's distribution there is p. Accept x with probability min(1, p(x) / q(x));
otherwise emit a token drawn from the residual max(0, p - q), normalised. The emitted token is then distributed
exactly as p: P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) (p(x) - q(x))+ / sum_y (p(y) - q(y))+
= min(p(x), q(x)) + (p(x) - q(x))+ = p(x). After the last proposal (or one a row could not keep) the token is drawn
from p itself. p and q are both taken after Whisper's logit rules, then divided by the row's temperature.

Randomness does not depend on the batch. Every draw is a uniform in (0, 1) computed from (row key, absolute token
position, draw kind) by an integer hash on the device (`uniform`), so a row's tokens depend only on its key, its
audio and the models, never on which slot it sits in, what the other rows are or when it was admitted. A draw of
a position that a step computed but did not commit (past a rejection) is drawn again, identically, by the next
step, but it decided nothing committed: the committed tokens at positions <= p use only the draws at positions
<= p, so the draws at later positions are still independent of them.

Draws: tokens are drawn by inverse CDF (a float64 cumulative sum over the vocabulary and one `searchsorted`), one
uniform per (row, position, kind); no (rows, positions, vocab) random tensor is made.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^27: a product of a 32-bit value and it stays below 2^63 (no int64 overflow)
# draw kinds: what a uniform is used for at one position (each gets its own stream)
DRAW_DRAFT, DRAW_ACCEPT, DRAW_TARGET = 1, 2, 3


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (multiply-xorshift rounds) of int64 tensors holding values in [0, 2^32)."""
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    x = ((x ^ (x >> 16)) * _MUL) & _M32
    return x ^ (x >> 16)


def uniform(key: torch.Tensor, position: torch.Tensor, draw: int) -> torch.Tensor:
    """(B,) long row keys, (B, P) long absolute token positions, a draw kind -> (B, P) float32 uniforms in (0, 1):
    odd multiples of 2^-24 (2^23 levels, exactly representable, never 0 or 1)."""
    h = mix32((key[:, None] & _M32) ^ 0x9E3779B9)
    h = mix32(h ^ (position & _M32))
    h = mix32(h ^ (draw * 0x85EBCA6B & _M32))
    return ((h >> 9) * 2 + 1).float() * (2.0 ** -24)


def probabilities(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(B, P, V) rule-applied scores (-inf where forbidden), (B,) temperatures -> (B, P, V) float32 softmax of
    scores / temperature. A row at temperature 0 (greedy) gets the distribution at temperature 1 (unused). The
    scores are taken from their largest first: divided by a tiny temperature (1e-38) they overflowed to -inf and
    inf, their softmax was NaN and every draw the last token; so they tend to the argmax as the temperature does."""
    t = torch.where(temperature > 0, temperature, 1.0).float()
    scores = scores.float()
    top = scores.amax(-1, keepdim=True)
    return ((scores - torch.where(top.isfinite(), top, 0.0)) / t[:, None, None]).softmax(-1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(..., V) non-negative weights (need not sum to 1; not all 0), (...) uniforms in (0, 1) -> (...) long token
    ids by inverse CDF: token i where cdf[i - 1] <= u * total < cdf[i]. A zero-weight token is never drawn."""
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:]
    target = torch.minimum(u[..., None].double() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[..., 0].clamp(max=probs.shape[-1] - 1)


def speculative_choice(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, proposed: torch.Tensor,
                       key: torch.Tensor, n_tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled counterpart of "accept the proposals the target agrees with" over the K + 1 verified positions.

    p:        (B, K + 1, V) target probabilities at the row's temperature (position j predicts token n_tok + j)
    q:        (B, K, V) the draft's probabilities its proposals were drawn from
    drafted:  (B, K) long the proposals; proposed: (B, K) bool those the row really offers
    key:      (B,) long row keys; n_tok: (B,) long committed tokens
    returns:  accept (B, K) bool: proposal j accepted (u * q(x) < p(x), i.e. with probability min(1, p(x)/q(x)));
              choice (B, K + 1) long: the proposal where accepted, else the token emitted if the row stops there
              (from the residual max(0, p - q) after an offered proposal, from p otherwise)
    """
    k = drafted.shape[1]
    pos = n_tok[:, None] + torch.arange(k + 1, device=p.device)
    px = p[:, :k].gather(-1, drafted[..., None])[..., 0]
    qx = q.gather(-1, drafted[..., None])[..., 0]
    accept = proposed & (uniform(key, pos[:, :k], DRAW_ACCEPT) * qx < px)
    residual = (p[:, :k] - q).clamp(min=0)
    residual = torch.where(proposed[..., None] & (residual.sum(-1, keepdim=True) > 0), residual, p[:, :k])
    fix = draw(torch.cat([residual, p[:, k:]], 1), uniform(key, pos, DRAW_TARGET))
    choice = torch.cat([torch.where(accept, drafted, fix[:, :k]), fix[:, k:]], 1)
    return accept, choice
