"""A benchmark tool, not for users: a draft whose acceptance rate is set, at the cost of a real draft's shape.

Speed-up against acceptance is what a benchmark wants to show, and a random draft almost never agrees with a random
target. The oracle draft proposes the target's own greedy continuation, recorded in a first greedy run of the same
chunks, and replaces each proposed token by a wrong one with probability 1 - a. It still runs the layers of a real
draft (`cost_draft`, e.g. distil-large-v2's 2 decoder layers) and discards their logits, so a step costs what it
would with that draft. It goes through the engine's normal draft path: `Engine` builds a draft's step decoder from
the draft's `step_decoder` attribute when it has one, and this one is a `Decoder` (caches, per-row rollback, CUDA
graph capture: nothing in the step knows about it).

How a row knows its chunk without a host read: the rows' caches move (refills, packing), so the chunk of a row is
read from its draft cache itself, by the nearest recorded fingerprint of the chunk's cross-attention values (a few
values of layer 0, head 0: they move with the row). Whether position p of chunk c is corrupted is a counter-based
hash of (c, p, seed): the same in every batch composition, K and step mode.

Per position, P(proposal accepted | the ones before it were) = a, as long as the row's history is greedy's (it is:
speculation is lossless) and the verify pass chooses what the recorded greedy pass chose (in fp16 a near-tie may
flip; the row then leaves the recording and its acceptance falls: `rows_equal_greedy` in benchmarks/gpu_bench.py).
Under torch.compile the discarded head could be eliminated as dead code; eager steps and CUDA graphs run it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import torch
from torch import nn

from asr_spec.engine.cache import KVCache
from asr_spec.engine.decoder import Decoder

FINGERPRINT_POSITIONS = 4  # audio positions of layer 0, head 0 whose cross-attention values identify a chunk
_M32 = 0xFFFFFFFF
_U24 = 1 << 24  # the acceptance draw is the hash's low 24 bits over 2^24: uniform on [0, 1) in steps of 2^-24


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds), on int64 tensors holding values in [0, 2^32): every
    product stays below 2^63."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def position_hash(chunk: torch.Tensor, position: torch.Tensor, seed: int) -> torch.Tensor:
    """(B, P) int64 hash in [0, 2^32) of each (chunk index, absolute token position) pair (broadcast)."""
    return _mix((chunk * 0x9E3779B1 + position * 0x85EBCA6B + seed) & _M32)


class OracleScript:
    """What the oracle proposes: the recorded greedy sequences, where each chunk's audio is, and the set rate.

    sequences: (N, S) long prompt + generated tokens of each chunk (greedy), padded; wrong_ids: (W >= 2,) long tokens
    a corrupted proposal is drawn from (none the draft's static rules suppress); audio: (N, n_audio_ctx, d_model)
    the encoder outputs the chunks are decoded from. All on the device the engine runs on. `acceptance` is a
    device scalar changed in place (`set_acceptance`), so captured CUDA graphs read the new value.
    """

    def __init__(self, sequences: torch.Tensor, wrong_ids: torch.Tensor, audio: torch.Tensor, acceptance: float,
                 seed: int = 0):
        if wrong_ids.numel() < 2:
            raise ValueError(f"the oracle needs at least 2 wrong-token candidates, got {wrong_ids.numel()}")
        if len(sequences) != len(audio):
            raise ValueError(f"{len(sequences)} recorded sequences for {len(audio)} chunks of audio")
        self.sequences, self.wrong_ids, self.audio, self.seed = sequences, wrong_ids, audio, seed
        self.acceptance = torch.zeros((), device=audio.device)
        self.set_acceptance(acceptance)

    def set_acceptance(self, acceptance: float) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.acceptance.fill_(acceptance)

    def proposals(self, chunk: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """(B,) chunk indices, (B, P) absolute positions -> (B, P) proposed tokens: the recorded one with
        probability `acceptance`, else a wrong one (never the recorded token)."""
        right = self.sequences[chunk[:, None], position.clamp(max=self.sequences.shape[1] - 1)]
        h = position_hash(chunk[:, None], position, self.seed)
        keep = (h & (_U24 - 1)).float() < self.acceptance * _U24
        n_wrong = self.wrong_ids.numel()
        pick = _mix(h ^ 0x5BD1E995) % n_wrong
        wrong = self.wrong_ids[pick]
        wrong = torch.where(wrong == right, self.wrong_ids[(pick + 1) % n_wrong], wrong)
        return torch.where(keep, right, wrong)


def _fingerprint(cache: KVCache) -> torch.Tensor:
    """(R, F) float32: a few cross-attention values of each row of `cache` (layer 0, head 0, first positions),
    times their channel scales where the cache has them (int8 audio: `KVCache.cross_v_scales`)."""
    values = cache.cross_v[0, :, 0, :FINGERPRINT_POSITIONS].float()  # (R, positions, head_dim)
    if cache.cross_v_scales is not None:
        values = values * cache.cross_v_scales[0, :, 0, None, :]
    return values.reshape(values.shape[0], -1)


class OracleDecoder(Decoder):
    """A `Decoder` that runs the cost draft's layers (writing its cache as any draft does), discards their logits
    and returns logits that put all the mass on the oracle's proposal at each position asked for."""

    def __init__(self, decoder: nn.Module, proj_out: nn.Module, vocab_ids: torch.Tensor | None = None, *,
                 script: OracleScript, int8_precision: bool = False):
        super().__init__(decoder, proj_out, vocab_ids, int8_precision=int8_precision)
        if script.audio.device != self.device:
            raise ValueError(f"oracle script on {script.audio.device}, draft on {self.device}: put both on one device")
        self.script = script
        self.fingerprints = self._record_fingerprints(script.audio)

    @torch.inference_mode()
    def _record_fingerprints(self, audio: torch.Tensor, batch: int = 8) -> torch.Tensor:
        """(N, F) fingerprints of the chunks, through this decoder's own `write_audio` (so in its layout and dtype)."""
        out = []
        for i in range(0, len(audio), batch):
            part = audio[i:i + batch]
            cache = self.new_cache(len(part), 1, part.shape[1])
            self.write_audio(cache, part)
            out.append(_fingerprint(cache))
        return torch.cat(out)

    def chunks_of(self, cache: KVCache) -> torch.Tensor:
        """(R,) long: the recorded chunk nearest to each row's fingerprint (rounding of a batched projection
        differs from the recording's by far less than chunks differ from each other)."""
        fp = _fingerprint(cache)
        distance = (fp[:, None, :] - self.fingerprints[None, :, :]).square().sum(-1)
        return distance.argmin(1)

    @torch.no_grad()
    def forward(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, n_keys: int,
                logit_index: torch.Tensor | None = None, exact: bool = False, full_vocab: bool = True) -> torch.Tensor:
        """As `Decoder.forward` (same arguments, (B, P, vocab) logits): the layers run and write the cache; the
        logits are 0 at the proposal for the token after each position asked for, the dtype's lowest elsewhere.
        Always over the whole vocabulary (a proposal may be any token): full_vocab False is refused."""
        if not full_vocab:
            raise ValueError("an oracle draft scores the whole vocabulary: full_vocab=False is not supported")
        real = super().forward(cache, tokens, positions, n_keys, logit_index, exact)
        asked = positions if logit_index is None else positions.gather(1, logit_index)
        proposal = self.script.proposals(self.chunks_of(cache), asked + 1)
        logits = torch.full_like(real, torch.finfo(real.dtype).min)
        return logits.scatter_(-1, proposal[..., None], 0.0)


def wrong_candidates(generation_config, eot: int) -> torch.Tensor:
    """(W,) long text tokens below <|endoftext|> that neither suppress list of `generation_config` names."""
    banned = set(generation_config.suppress_tokens or []) | set(generation_config.begin_suppress_tokens or [])
    return torch.tensor([t for t in range(eot) if t not in banned], dtype=torch.long)


def oracle_draft(cost_draft: nn.Module, sequences: Sequence[Sequence[int]], audio: torch.Tensor,
                 acceptance: float, seed: int = 0) -> tuple[nn.Module, OracleScript]:
    """A draft for `Engine` that proposes `sequences` (each chunk's recorded greedy prompt + tokens, in the order
    of `audio`'s chunks) at the set `acceptance`, at the cost of `cost_draft` (a `WhisperForCausalLM` reading the
    target's encoder output). Returns the draft (a shallow copy of `cost_draft`: the same weights) and its script
    (`set_acceptance` between runs). audio: (N, n_audio_ctx, d_model) the target encoder outputs to be decoded."""
    device = audio.device
    width = max(len(s) for s in sequences)
    gen = cost_draft.generation_config
    eot = gen.eos_token_id[0] if isinstance(gen.eos_token_id, (list, tuple)) else gen.eos_token_id
    wrong = wrong_candidates(gen, eot).to(device)
    table = torch.full((len(sequences), width), int(wrong[0]), dtype=torch.long)
    for i, seq in enumerate(sequences):
        table[i, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
    script = OracleScript(table.to(device), wrong, audio, acceptance, seed)
    draft = copy.copy(cost_draft)
    draft.step_decoder = functools.partial(OracleDecoder, script=script)
    return draft, script
