"""Prompts: the text a user gives Whisper besides the audio, turned into the token ids of each chunk's request.

The one home of these rules (the CLI, the Python API and the server all come here):

- ``initial_prompt``: previous text, fed after ``<|startofprev|>`` before the SOT sequence, as openai-whisper's
  ``initial_prompt``: encoded as ``" " + text.strip()``, at most ``n_text_ctx // 2 - 1`` tokens (223), the *last*
  ones kept (the words nearest the audio).
- ``hotwords``: faster-whisper's hint phrases: the same place, before the initial prompt, the *first* tokens kept;
  the initial prompt then gets what remains of the 223. As in faster-whisper, hotwords are not given to a chunk
  that has a prefix.
- ``prefix``: the text the transcript starts with, forced after the SOT sequence (after ``<|0.00|>`` in timestamp
  mode, which the engine adds), at most 223 tokens, the first ones kept. It is part of the transcript, and
  Whisper's rules count it as generated, but right after it a timestamp is forced only where the timestamps' total
  probability beats the text's total (`ChunkRequest.prefix_given`).

How they apply to the chunks of one input: the initial prompt and the hotwords go with *every* chunk (voice
chunks or strided windows, and a re-decoded tail), as faster-whisper's batched pipeline does, so chunks stay
independent and batch freely; the prefix goes with the input's *first* chunk only (the audio starts with it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from asr_spec.engine import ChunkRequest
from asr_spec.errors import InputError

__all__ = ["InputPrompt", "PromptOptions", "encode_prompt", "per_input", "with_prompts"]

PROMPT_KEYS = ("initial_prompt", "hotwords", "prefix")


@dataclass(frozen=True)
class PromptOptions:
    """The prompts of an input (or of every input of a run): text, or None. An empty text is none."""

    initial_prompt: str | None = None  # previous text: names, terms, a style of writing
    hotwords: str | None = None  # hint phrases (faster-whisper), before the initial prompt; not with a prefix
    prefix: str | None = None  # the transcript's start, forced on the input's first chunk

    def __post_init__(self) -> None:
        for name in PROMPT_KEYS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InputError(f"{name} must be text or None, got {type(value).__name__}")
            if isinstance(value, str) and not value.strip():
                object.__setattr__(self, name, None)

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in PROMPT_KEYS)


@dataclass(frozen=True)
class InputPrompt:
    """An input's prompts as token ids (`ChunkRequest.prompt`, `.prefix`): what its first chunk gets, and what
    every other chunk (and every re-decoded tail) gets."""

    first_previous: tuple[int, ...] = ()
    prefix: tuple[int, ...] = ()
    previous: tuple[int, ...] = ()

    def for_chunk(self, index: int, attempt: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt, prefix) of chunk `index` of the input, or of its re-decoded tail number `attempt` (> 0)."""
        if index == 0 and attempt == 0:
            return self.first_previous, self.prefix
        return self.previous, ()


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Text token ids of `text` as Whisper prompts encode it (a leading space; "<|...|>" stays text)."""
    text = " " + text.strip()
    ids = _text_ids(tokenizer, text)
    if set(tokenizer.get_added_vocab().values()).isdisjoint(ids):
        return ids
    # Whisper's timestamps ("<|2.00|>") are added tokens but not special ones, so `split_special_tokens` kept them
    # whole (a prefix "<|0.00|>" forced a timestamp and emptied the transcript): cut between "<" and "|", every
    # added token of Whisper's ("<|...|>") is text
    return [i for piece in re.split(r"(?<=<)(?=\|)", text) for i in _text_ids(tokenizer, piece)]


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)


def encode_prompt(options: PromptOptions, tokenizer: Any, max_tokens: int) -> InputPrompt:
    """The token ids of `options` for a model whose prompts hold at most `max_tokens` (`max_prompt_tokens`). The
    first chunk's previous text and prefix hold at most `max_tokens` together (the previous text's last tokens
    give way): each at its limit, they filled 451 of Whisper's 448 positions and the chunk could not be decoded (a
    server's whole engine run failed with it)."""
    hot = _encode(tokenizer, options.hotwords)[:max_tokens] if options.hotwords else []
    text = _encode(tokenizer, options.initial_prompt) if options.initial_prompt else []

    def previous(with_hotwords: bool, room: int) -> tuple[int, ...]:
        head = hot if with_hotwords else []
        room -= len(head)
        return tuple(head + (text[-room:] if room > 0 and text else []))

    prefix = tuple(_encode(tokenizer, options.prefix)[:max_tokens]) if options.prefix else ()
    return InputPrompt(previous(not prefix, max_tokens - len(prefix)), prefix, previous(True, max_tokens))


def per_input(base: PromptOptions, n_inputs: int, **values: Any) -> list[PromptOptions]:
    """Each input's `PromptOptions`: `base` with the values of one call (initial_prompt, hotwords, prefix) over it,
    each a text for every input, a list of one per input (None: the base's), or None (the base's)."""
    unknown = sorted(set(values) - set(PROMPT_KEYS))
    if unknown:
        raise InputError(f"unknown prompt option(s) {', '.join(unknown)} (known: {', '.join(PROMPT_KEYS)})")
    columns = {}
    for name, value in values.items():
        if isinstance(value, (list, tuple)):
            if len(value) != n_inputs:
                raise InputError(f"{name}: {len(value)} values for {n_inputs} inputs (give one per input)")
            columns[name] = list(value)
        else:
            columns[name] = [value] * n_inputs
    out = []
    for i in range(n_inputs):
        given = {name: column[i] for name, column in columns.items() if column[i] is not None}
        out.append(replace(base, **given))
    return out


def with_prompts(requests: Iterable[ChunkRequest | None],
                 prompt_of: Callable[[Hashable], InputPrompt | None]) -> Iterator[ChunkRequest | None]:
    """The engine's source `requests` with each chunk's prompt and prefix set from its input's `InputPrompt`
    (`prompt_of(input key)`, None for none). Request ids are `ChunkId`s."""
    for req in requests:
        if req is None:
            yield req
            continue
        prompt = prompt_of(req.id.owner)
        if prompt is None:
            yield req
            continue
        previous, prefix = prompt.for_chunk(req.id.index, req.id.attempt)
        yield replace(req, prompt=previous, prefix=prefix, prefix_given=bool(prefix))  # a user's: given text

