"""The encoder outputs the engine's rows read: the target's encoder over chunks' log-mel features, a few windows a
call, and a draft's own encoder where it has one (`pairing.DraftKind.OWN_ENCODER`), timed in the engine's
`StageTimes`. The sampled candidates of one window carry the very same features tensor: it is encoded once, also
across consecutive calls (`ChunkEncoder.batch`), unless the caller rewrote it in place since (its version counter).
"""

from __future__ import annotations

import torch

from asr_spec.engine.encoder import Encoder
from asr_spec.engine.requests import ChunkRequest
from asr_spec.engine.stats import StageTimes


class ChunkEncoder:
    """encoder: the target's; draft_encoder: a draft's own (None: the draft, if any, reads the target's output).
    device, dtype: the target decoder's (features are moved there); draft_dtype: the draft's (its own encoder's
    input). times: the engine's stage times, which count every call."""

    def __init__(self, encoder: Encoder, draft_encoder: Encoder | None, device: torch.device, dtype: torch.dtype,
                 draft_dtype: torch.dtype | None, times: StageTimes):
        self.encoder, self.draft_encoder = encoder, draft_encoder
        self.device, self.dtype, self.draft_dtype = device, dtype, draft_dtype
        self.times = times
        # the features (with their version counter: `_version`) and target encoder output of the last request
        # encoded (`batch`: its sampled candidates)
        self._last: tuple[torch.Tensor | None, int | None, torch.Tensor | None] = (None, None, None)

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
        """(N, n_mels, n_frames) -> (N, n_audio_ctx, d_model) target encoder output, batch_size at a time."""
        x = features.to(self.device, self.dtype)
        self.times.encoder_calls += 1
        self.times.encoder_windows += len(x)
        with self.times.count("encoder", x.device.type == "cpu"):
            return torch.cat([self.encoder(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])

    @torch.inference_mode()
    def batch(self, batch: list[ChunkRequest]) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Target encoder outputs (n_audio_ctx, d) of a batch of chunks — one encoder pass for those not encoded
        yet (each with features: the engine refused the others) — and the draft's own encoder outputs when it has
        its own encoder. Requests carrying the very same features tensor are encoded once."""
        need = [r for r in batch if r.encoded is None]
        last_features, last_version, last_encoded = self._last
        if last_features is not None and _version(last_features) != last_version:
            last_features = None  # the caller refilled that tensor in place: other audio
        distinct = list({id(r.features): r.features for r in need if r.features is not last_features}.values())
        encoded: dict[int, torch.Tensor] = {}  # id(features) -> its encoder output
        if last_features is not None:
            encoded[id(last_features)] = last_encoded
        if distinct:
            encoded.update(zip(map(id, distinct), self(torch.stack(distinct), len(distinct))))
        enc = [r.encoded.to(self.device, self.dtype) if r.encoded is not None else encoded[id(r.features)]
               for r in batch]
        if need:
            last = need[-1].features
            self._last = (last, _version(last), encoded[id(last)])
        own = None
        if self.draft_encoder is not None:
            x = torch.stack([r.features for r in batch]).to(self.device, self.draft_dtype)
            with self.times.count("encoder", x.device.type == "cpu"):
                own = list(self.draft_encoder(x))
        return enc, own


def _version(features: torch.Tensor) -> int | None:
    """The tensor's version counter (in-place writes raise it); None for an inference tensor, which keeps none:
    the same such tensor is taken for the same audio, as an object whose contents no one rewrites."""
    try:
        return features._version
    except RuntimeError:
        return None
