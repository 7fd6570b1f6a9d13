"""What the engine decodes and what it gives back: `ChunkRequest` (one window, with its prompt, temperature,
seed and hypothesis, checked when made) and `ChunkResult` (its tokens and Whisper's window statistics, or why the
model could not take it)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from asr_spec.engine.stats import ChunkStats

__all__ = ["ChunkRequest", "ChunkResult"]


@dataclass(frozen=True)
class ChunkRequest:
    """One 30 s window to decode.

    features: (n_mels, n_frames) log-mel, n_frames = 2 * the encoder's positions.
    encoded:  optional (n_audio_ctx, d_model) target encoder output the engine gave before (`ChunkResult.encoded`,
              e.g. to decode the same audio twice, greedy and speculative); features may then be None unless the
              draft has its own encoder.
    keep_encoded: return the chunk's target encoder output with its result (`ChunkResult.encoded`), e.g. for the
              word-timestamp alignment pass; off by default (it holds n_audio_ctx x d_model values per chunk).
    temperature: 0 decodes greedily (the target's argmax, token-identical with or without a draft); > 0 samples
              at that temperature (speculative sampling with a draft: distributed as the target's sampling).
    seed:     the row's random key, an integer in [0, 2^32): a sampled chunk's tokens are a function of (seed,
              its audio, the models, K) only, whatever its batch (engine/sampling.py); unused when greedy.
    prompt:   token ids of previous text, fed after <|startofprev|> before the SOT sequence (openai-whisper's
              prompt); at most `WhisperTokens.max_prompt_tokens`; () = none. Rows with prompts of any lengths
              share a batch. Text tokens: `asr_spec.transcribe.prompts` builds them from text.
    prefix:   token ids the transcript starts with, forced after the SOT sequence (after <|0.00|> in timestamp
              mode, which the engine adds); part of `ChunkResult.tokens`; at most `WhisperTokens.max_prompt_tokens`;
              () = none. Whisper's rules treat them as generated (`prefix_given` False) or not.
    prefix_given: the prefix is text given to the decoding (a user's `--prefix`), not words the model said: the
              rules still count it as generated, but at the position after it a timestamp is forced only where
              the timestamps' total probability beats the text tokens' total, not merely every single text token
              (forced text the model would not say spreads its probability over many text tokens: Whisper's rule
              closed the segment there and the model said the prefix again and again; a prefix it would say still
              closes where it would). False (the default): Whisper's rules exactly, so a prefix of what greedy
              decoding says changes nothing (a stream's committed words, re-decoded with more audio).
    hypothesis: generated token ids (prompt excluded) the decoding is expected to start with, e.g. a stream's
              previous hypothesis of the same audio: proposed as the row's draft, up to
              `DecodeOptions.num_hypothesis_tokens` a step, while they last and agree with the target; then the
              model draft (or greedy decoding) goes on. It never changes the output (engine/hypothesis.py). Greedy
              rows only (temperature 0).
    max_new_tokens: the most tokens this row generates after its prompt and prefix (at most the engine's own
              `DecodeOptions.max_new_tokens`); None: the engine's. Its tokens are then the first ones of the
              decoding without it, cut there (finish_reason "length"), e.g. a live re-decode that cannot say more
              than its audio holds (`asr_spec.stream.hearing.token_budget`).
    language_group: where the engine detects the language (`DecodeOptions.language` None, a multilingual model),
              the chunks of one group are decoded in one language (e.g. a file's chunks, its re-decoded tails and
              fallback windows: openai-whisper detects once per file too): the first admitted chunk whose detection
              is sure (`LANGUAGE_SURE`) settles it for the later ones; a chunk before that takes the language the
              group's detections so far give the most probability in all (`admission.GroupLanguages`).
              None: the chunk detects its own. Any hashable; kept for the engine's last `LANGUAGE_GROUPS` groups.
    language_token: the language token id (`<|fr|>`) this chunk is decoded in, whatever the options say or its
              group detected (e.g. a re-decoded tail takes its parent's language); None: as they say. Ignored by
              English-only models, as the options' language is.
    """

    id: Hashable
    features: torch.Tensor | None
    encoded: torch.Tensor | None = None
    keep_encoded: bool = False
    temperature: float = 0.0
    seed: int = 0
    prompt: tuple[int, ...] = ()
    prefix: tuple[int, ...] = ()
    prefix_given: bool = False
    hypothesis: tuple[int, ...] = ()
    max_new_tokens: int | None = None
    language_group: Hashable | None = None
    language_token: int | None = None

    def __post_init__(self) -> None:
        try:  # a list as an id failed only inside the run (a TypeError in its feed), taking the others with it
            hash(self.id)
        except TypeError as err:
            raise ValueError(f"chunk id {self.id!r:.60}: must be hashable ({err})") from None
        try:
            hash(self.language_group)
        except TypeError as err:
            raise ValueError(f"chunk {self.id!r}: language_group must be hashable ({err})") from None
        for name in ("features", "encoded"):
            _check_tensor(self.id, name, getattr(self, name))
        for name in ("prompt", "prefix", "hypothesis"):  # numpy's integers too, kept as ints
            object.__setattr__(self, name, _token_ids(self.id, name, getattr(self, name)))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"chunk {self.id!r}: temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"chunk {self.id!r}: seed must be an integer in [0, 2^32), got {self.seed!r}")
        if not isinstance(self.prefix_given, bool):
            raise ValueError(f"chunk {self.id!r}: prefix_given must be True or False, got {self.prefix_given!r}")
        if self.hypothesis and t > 0:
            raise ValueError(f"chunk {self.id!r}: a hypothesis is for greedy decoding (temperature 0), got "
                             f"temperature {t!r}")
        token = self.language_token
        if token is not None and (isinstance(token, bool) or not isinstance(token, int) or token < 0):
            raise ValueError(f"chunk {self.id!r}: language_token must be None or a token id, got {token!r}")
        n = self.max_new_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"chunk {self.id!r}: max_new_tokens must be None or an integer >= 1, got {n!r}")


def _check_tensor(chunk_id: Hashable, name: str, value: object) -> None:
    """`features` / `encoded`: None or a 2-D floating tensor (a numpy array or a 3-D batch failed inside the
    batch's stack, and took every chunk in flight with it)."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.is_floating_point():
        shown = f"a {value.dim()}-D {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"chunk {chunk_id!r}: {name} must be a 2-D floating torch tensor, got {shown}")


def _token_ids(chunk_id: Hashable, name: str, ids: object) -> tuple[int, ...]:
    """A request's token ids as a tuple of ints (>= 0); numpy integers are taken (refused before as "not a token
    id"); anything else is a ValueError naming the chunk and the field."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"chunk {chunk_id!r}: {name} must be a sequence of token ids, got {type(ids).__name__}")
    values = tuple(ids)  # type: ignore[arg-type]
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in values):
        raise ValueError(f"chunk {chunk_id!r}: {name} must hold token ids (integers >= 0), got {repr(values)[:120]}")
    return tuple(int(t) for t in values)


@dataclass(frozen=True)
class ChunkResult:
    id: Hashable
    # generated tokens (prompt excluded, a request's prefix included), ending with <|endoftext|> when finished by it
    tokens: tuple[int, ...]
    prompt: tuple[int, ...]  # [<|startofprev|> previous text] <|startoftranscript|> [language task] [notimestamps]
    # "eos", "length" (max_new_tokens or max_target_positions), or "refused": not decoded (`error` says why)
    finish_reason: str
    stats: ChunkStats
    # Whisper's window statistics, from the target's logits only (so identical with or without a draft):
    no_speech_prob: float = float("nan")  # P(<|nospeech|>) at the SOT position, from the raw logits
    avg_logprob: float = float("nan")  # sum of the tokens' log-probabilities / (text tokens + 1), as Whisper
    # (n_audio_ctx, d_model) the target encoder output it was decoded from, when the request asked to keep it
    encoded: torch.Tensor | None = field(default=None, compare=False, repr=False)
    temperature: float = 0.0  # the request's: 0 greedy, else the temperature it was sampled at
    # why the engine refused the request, one line naming it (a prompt over the model's limit: engine/refusals.py);
    # None for a decoded chunk. A refused one has no tokens and counts no chunk in its stats.
    error: str | None = None
