"""A feature-conditioned (EAGLE-style) draft in the step: the target's final states kept per row, and the draft that
reads them.

EAGLE (Li et al., 2024): the draft's input at position t is a projection of [the target's final state at t - 1 ;
the embedding of token t] (plus the position's embedding here: Whisper's layers carry no position of their own);
one or two Whisper decoder layers with self-attention over the draft's own per-row cache and cross-attention to
the target's encoder output; the draft's final LayerNorm gives its guess of the target's state at t, scored by the
target's head. A proposal past the first is drafted from the draft's own guessed state, as EAGLE does.

The target's final states come from passes it runs anyway: the admission prefill (prompt positions) and each
step's verify pass (`TargetFeatures.target_pass`), written into a (B, S, d_model) buffer at their positions. A state at
position p is kept for good once the tokens up to p are committed (the step then never recomputes it): after a step
the states of positions < n_tok - 1 are the target's own.

The draft's cache holds only positions it was fed with the target's states: after a step its length is the old
n_tok (the proposals it was fed with its own guesses are dropped), so n_tok - K - 1 <= d_len <= n_tok - 1 and the
catch-up window is K + 1 wide (the plain draft's is two). Rollback is still moving a length; nothing is read back
to the host, and the step traces as before. Lossless as every draft is: the target decides every token.

Beside the other step features: prompts of different lengths in one admission (each row's states kept at its own
prompt positions, the draft prefilled up to its own length); a hypothesis step (engine/hypothesis.py), whose rows
may commit hyp.width + 1 tokens, widens the catch-up to max(K, hyp.width) + 1 (the verify pass computed the
target's states of all its positions); sampled rows (temperature > 0) offer none of its proposals, since it has no
distribution q of its own yet: they sample plainly from the target's p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder import Decoder, _layer_norm
from asr_spec.engine.rules import LogitRules
from asr_spec.engine.speculative import DecodeState, Models, _catch_up_index, _window


class FeatureDecoder(Decoder):
    """The step decoder of a feature-conditioned draft: `Decoder`'s layers and caches, a different input.

    decoder: a module shaped like a transformers `WhisperDecoder` (layers, layer_norm, embed_tokens,
    embed_positions, config: the target's embeddings and positions) with `fc`, the (2 d_model -> d_model) input
    projection of [feature ; token embedding] (`asr_spec.models.feature_draft.FeatureDraft`).
    """

    reads_target_features = True

    def __init__(self, decoder: nn.Module, proj_out: nn.Module, vocab_ids: torch.Tensor | None = None,
                 certify: tuple[int, tuple[int, ...]] | None = None, *,
                 int8_precision: bool = False):
        super().__init__(decoder, proj_out, vocab_ids, certify, int8_precision=int8_precision)
        self.fc = decoder.fc

    @torch.no_grad()
    def draft_forward(self, cache: KVCache, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                      n_keys: int, logit_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `tokens` at `positions` ((B, T) long, as `Decoder.forward`) with `features` ((B, T, d_model): the
        target's final state at each position - 1, zero at position 0).

        returns: (B, P, vocab) logits at `logit_index` ((B, P) long into T; None = all T) and the (B, T, d_model)
        draft's guesses of the target's final states at `positions`.
        """
        x = F.linear(torch.cat([features.to(self.dtype), self.embed(tokens)], -1), self.fc.weight, self.fc.bias)
        x = x + self.pos_table[positions.clamp(max=self.max_positions - 1)]
        guess = _layer_norm(self.decoder.layer_norm, self.run_layers(x, cache, positions, n_keys))
        at = guess if logit_index is None else guess.gather(1, logit_index[:, :, None].expand(-1, -1, self.d_model))
        return self.logits(at), guess


@dataclass
class TargetFeatures:
    """The target's final states of the batch slots, kept for a feature-conditioned draft.

    states: (n_rows, n_positions, d_model) the target's final (LayerNormed) state at each position of each row;
    entries at or past a row's n_tok - 1 are stale (overwritten by its next verify pass).
    """

    states: torch.Tensor

    @classmethod
    def empty(cls, n_rows: int, n_positions: int, d_model: int, device: torch.device,
              dtype: torch.dtype) -> TargetFeatures:
        return cls(torch.zeros(n_rows, n_positions, d_model, device=device, dtype=dtype))

    def rows(self, n_rows: int, first: int = 0) -> TargetFeatures:
        """Slots [first, first + n_rows), as a view (`KVCache.rows`)."""
        return TargetFeatures(self.states[first:first + n_rows])

    def move_row(self, src: int, dst: int, n_positions: int) -> None:
        self.states[dst, :n_positions] = self.states[src, :n_positions]

    def write_rows(self, rows: torch.Tensor, source: TargetFeatures) -> None:
        """Copy the states of R rows admitted apart ((R, P, d) `source`) into slots `rows` ((R,) long)."""
        self.states[rows, : source.states.shape[1]] = source.states

    def target_pass(self, target: Decoder, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                    n_keys: int, exact: bool = False, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """The target's pass over `tokens` at `positions` ((B, T) long) with its final states written here at
        those positions; returns its (B, P, vocab) logits at `logit_index` ((B, P) long into T; None = all T), as
        `Decoder.forward` would."""
        states = target.features(cache, tokens, positions, n_keys)
        index = positions.clamp(max=self.states.shape[1] - 1)[:, :, None].expand(-1, -1, states.shape[-1])
        self.states.scatter_(1, index, states.to(self.states.dtype))
        if logit_index is not None:
            states = states.gather(1, logit_index[:, :, None].expand(-1, -1, states.shape[-1]))
        return target.logits(states, exact)

    def inputs(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, T) long positions -> (B, T, d_model) the target's states at each position - 1 (zero at 0)."""
        prev = (positions - 1).clamp(min=0, max=self.states.shape[1] - 1)
        got = self.states.gather(1, prev[:, :, None].expand(-1, -1, self.states.shape[-1]))
        return torch.where((positions > 0)[:, :, None], got, 0.0)

    def prefill_draft(self, draft: FeatureDecoder, cache: KVCache, prompts: torch.Tensor,
                      lengths: torch.Tensor) -> None:
        """Admission: feed the draft the right-padded (R, L) `prompts` up to each row's last token but one with the
        target's states of them (written by `target_pass`), its cache's lengths set to `lengths` - 1 ((R,) long;
        `admission.prefill` for a plain draft). Rows are fed together over [0, max(lengths) - 1): a row's padding
        lies past its length (stale entries, overwritten as it decodes)."""
        end = int(lengths.max()) - 1
        if end > 0:
            pos = torch.arange(end, device=prompts.device).expand(len(prompts), -1)
            draft.draft_forward(cache, prompts[:, :end], self.inputs(pos), pos, end,
                                prompts.new_zeros(len(prompts), 1))
        cache.lengths.copy_(lengths - 1)

    def propose(self, m: Models, rules: LogitRules, st: DecodeState, k: int, n_keys: int,
                catch_up: int) -> tuple[torch.Tensor, None]:
        """`speculative._draft` for a feature-conditioned draft: k proposals per row written into
        st.seq[n_tok:n_tok + k]; returns the (B, k) mask of those each row really offers, and no q (None).
        catch_up: the window feeding the draft every committed token it was not fed with the target's states
        (K + 1; max(K, hyp.width) + 1 in a hypothesis step, whose rows may commit hyp.width + 1 tokens).

        The draft has no distribution of its own to sample from yet: sampled rows (temperature > 0, when
        rules.sampling) offer none of its proposals and sample plainly from the target's p (lossless)."""
        d_len = m.draft_cache.lengths
        tokens, pos = _window(st.seq, d_len, catch_up)
        index = _catch_up_index(st.n_tok, d_len, catch_up)
        logits, guess = m.draft.draft_forward(m.draft_cache, tokens, self.inputs(pos), pos, n_keys, index)
        guess = guess.gather(1, index[:, :, None].expand(-1, -1, guess.shape[-1]))
        offers = st.temperature == 0 if rules.sampling else torch.ones_like(st.n_tok, dtype=torch.bool)
        proposed = []
        for i in range(k):
            token = rules.draft_choice(logits, st.n_tok + i, st.begin)
            st.seq.scatter_(1, (st.n_tok + i)[:, None], token[:, None])
            # a row proposes none it could not keep (as speculative._draft)
            proposed.append(st.keeps(i) & offers)
            if i + 1 < k:  # the next proposal from the draft's own guess of the target's state
                logits, guess = m.draft.draft_forward(m.draft_cache, token[:, None], guess,
                                                      (st.n_tok + i)[:, None], n_keys)
        return torch.stack(proposed, 1), None
