"""Prompts through the pipeline: the token rules of asr_spec/transcribe/prompts.py (no model), then the real
whisper-base on TTS clips of rare names (tests/fixtures/prompts, scripts/make_prompt_fixtures.py): without a
prompt it spells each name the common way, with the name as initial prompt or as hotwords it spells it as given."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from asr_spec.errors import InputError
from asr_spec.transcribe.options import TranscribeOptions
from asr_spec.transcribe.prompts import InputPrompt, PromptOptions, encode_prompt, per_input

PROMPTS = Path(__file__).parent / "fixtures" / "prompts"


class WordTokenizer:
    """A tokenizer stand-in: one token per word, its id the word's number ("w12" -> 12)."""

    def __call__(self, text, add_special_tokens, split_special_tokens):
        assert not add_special_tokens and split_special_tokens and text.startswith(" ")

        class Out:
            input_ids = [int(word[1:]) for word in text.split()]
        return Out()

    def get_added_vocab(self) -> dict[str, int]:
        return {}


def _words(first: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(first, first + n))


def test_initial_prompt_keeps_its_last_tokens_hotwords_their_first():
    tok = WordTokenizer()
    prompt = encode_prompt(PromptOptions(initial_prompt=_words(0, 300)), tok, 223)
    assert prompt.previous == tuple(range(77, 300)) and prompt.first_previous == prompt.previous
    both = encode_prompt(PromptOptions(initial_prompt=_words(0, 300), hotwords=_words(1000, 50)), tok, 223)
    assert both.previous == tuple(range(1000, 1050)) + tuple(range(127, 300))  # 223 in all, hotwords first
    only_hot = encode_prompt(PromptOptions(hotwords=_words(1000, 400)), tok, 223)
    assert only_hot.previous == tuple(range(1000, 1223))


def test_prefix_goes_with_the_first_chunk_and_takes_the_hotwords_place_there():
    prompt = encode_prompt(PromptOptions(initial_prompt="w1 w2", hotwords="w7", prefix=_words(500, 300)),
                           WordTokenizer(), 223)
    assert prompt.for_chunk(0) == ((), tuple(range(500, 723)))  # faster-whisper: no hotwords with a prefix
    assert prompt.for_chunk(1) == ((7, 1, 2), ())
    assert prompt.for_chunk(0, attempt=1) == ((7, 1, 2), ())  # a re-decoded tail of chunk 0: no prefix again
    assert InputPrompt().for_chunk(0) == ((), ())
    # the first chunk's previous text gives way to its prefix (both at their limit could not be decoded)
    shorter = encode_prompt(PromptOptions(initial_prompt=_words(0, 300), prefix=_words(500, 100)), WordTokenizer(),
                            223)
    assert shorter.for_chunk(0) == (tuple(range(177, 300)), tuple(range(500, 600)))
    assert shorter.for_chunk(1) == (tuple(range(77, 300)), ())


def test_text_that_reads_like_a_timestamp_stays_text_in_prompts_and_transcripts():
    """Whisper's timestamps are added tokens but not special ones: `split_special_tokens` left "<|0.00|>" one token,
    so a prefix of it (a server's form field) forced a timestamp and the transcript came back empty, "<|5.00|> hi"
    gave "hi" alone. Every "<|...|>" is text now, and the transcript's text keeps it as written."""
    from transformers import WhisperTokenizerFast

    from asr_spec.engine.rules import WhisperTokens
    from asr_spec.transcribe.assembly import Assembler
    from tests.test_transcribe import tiny_real_vocab_whisper, tokenizer_json

    tok = WhisperTokenizerFast(tokenizer_file=str(tokenizer_json()))
    added = set(tok.get_added_vocab().values())
    tokens = WhisperTokens.from_generation_config(tiny_real_vocab_whisper().generation_config, 448)
    assembler = Assembler(tok, tokens, TranscribeOptions())
    for text in ("<|0.00|>", "Note <|2.00|> hi", "<|endoftext|>", "x<|nospeech|><|en|>", "a <| b |> c"):
        prompt = encode_prompt(PromptOptions(prefix=text, initial_prompt=text, hotwords=text), tok, 223)
        for ids in (prompt.prefix, prompt.previous, prompt.first_previous):
            assert ids and added.isdisjoint(ids) and max(ids) < tokens.eot, (text, ids)
        assert assembler.decode(prompt.prefix) == text
    plain = encode_prompt(PromptOptions(prefix="Hello there."), tok, 223).prefix
    assert plain == tuple(tok(" Hello there.", add_special_tokens=False).input_ids)  # plain text: as before


def test_prompt_options_are_checked_and_given_per_input():
    assert PromptOptions(initial_prompt="  ").empty  # empty text: no prompt (OpenAI's prompt="")
    with pytest.raises(InputError, match="initial_prompt must be text or None, got int"):
        PromptOptions(initial_prompt=3)
    opts = TranscribeOptions.from_values(initial_prompt="Kubernetes", hotwords="Jaeger")
    assert opts.prompts == PromptOptions("Kubernetes", "Jaeger")
    each = per_input(opts.prompts, 3, initial_prompt=["a", None, ""], prefix="So")
    assert [p.initial_prompt for p in each] == ["a", "Kubernetes", None]
    assert {p.prefix for p in each} == {"So"} and {p.hotwords for p in each} == {"Jaeger"}
    with pytest.raises(InputError, match="initial_prompt: 2 values for 3 inputs"):
        per_input(opts.prompts, 3, initial_prompt=["a", "b"])
    with pytest.raises(InputError, match="unknown prompt option"):
        per_input(opts.prompts, 1, initial_promt="a")


# -- the real whisper-base ---------------------------------------------------------------------------------------

@functools.cache
def _asr(language: str = "en", **overrides):
    from asr_spec import Transcriber

    pytest.importorskip("asr_spec.models.ct2", reason="the CTranslate2 converter is not available")
    try:
        return Transcriber.from_preset("base", language=language, **overrides)
    except (ImportError, OSError, ValueError) as err:
        pytest.skip(f"whisper-base offline packages not usable: {err}")


def _clips() -> list[dict]:
    return json.loads((PROMPTS / "names.json").read_text())


@pytest.mark.real
@pytest.mark.slow
def test_a_prompted_name_is_spelled_as_in_the_prompt():
    """All clips in one batch, each with its own prompt (rows of different prompt lengths), then as hotwords."""
    asr, clips = _asr(), _clips()
    files = [str(PROMPTS / c["file"]) for c in clips]
    names = [c["name"] for c in clips]
    plain = asr.transcribe(files, progress=False)
    for name, t in zip(names, plain):  # the fixture's point: without a prompt the name is spelled otherwise
        assert name.split()[0] not in t.text and name.split()[1] not in t.text, t.text
    for kind in ("initial_prompt", "hotwords"):
        prompted = asr.transcribe(files, progress=False, **{kind: names})
        for name, t in zip(names, prompted):
            assert name in t.text, f"{kind}: {t.text}"
            assert t.language == "en"  # read after <|startoftranscript|>, not the prompt's first token


def test_a_chunks_language_is_the_token_after_startoftranscript_whatever_the_prompt():
    """A prompt puts <|startofprev|> and its text before <|startoftranscript|>: the language was read as the
    prompt's first text token (None: a prompted request's verbose_json said language "")."""
    import functools
    from types import SimpleNamespace

    from asr_spec.engine.rules import WhisperTokens
    from asr_spec.transcribe.assembly import Assembler

    sot, prev, english, german = 50, 51, 60, 61
    tokens = SimpleNamespace(sot=sot, eot=49, timestamp_begin=70, lang_to_id={"<|en|>": english, "<|de|>": german})
    tokens.language_in = functools.partial(WhisperTokens.language_in, tokens)  # the engine's reading of a prompt
    assembler = Assembler(SimpleNamespace(decode=lambda ids, **_: ""), tokens, TranscribeOptions())
    for prompt, code in [((sot, german, 62), "de"), ((prev, 3, 4, english, sot, german, 62), "de"),
                         ((prev, 3, sot, english, 62), "en"), ((sot,), None)]:
        assert assembler.language(SimpleNamespace(prompt=prompt)) == code
    # an input without chunks (no speech) is in the language decoded in, where one is given
    tokens.language_id = lambda language: {"de": german, "german": german}[language]
    for language, code in (("german", "de"), (None, None)):
        options = TranscribeOptions.from_values(language=language or "auto")
        silent = Assembler(SimpleNamespace(decode=lambda ids, **_: ""), tokens, options).assemble("x", [], [], 1.0, 0.1)
        assert silent.language == code and silent.text == ""


@pytest.mark.real
@pytest.mark.slow
def test_prefix_starts_the_transcript_and_word_timestamps_work_with_a_prompt():
    clip = _clips()[0]  # "Our new engineer, Jaxxon Brookhyde, fixed the server."
    path = str(PROMPTS / clip["file"])
    asr = _asr(word_timestamps=True)
    [t] = asr.transcribe(path, progress=False, prefix="Our new engineer, Jaxxon", initial_prompt="Brookhyde")
    assert t.text.strip().startswith("Our new engineer, Jaxxon Brookhyde"), t.text
    words = [w for s in t.segments for w in s.words]
    assert [w.word.strip(" ,.") for w in words[:5]] == ["Our", "new", "engineer", "Jaxxon", "Brookhyde"]
    starts = [w.start for w in words]
    assert starts == sorted(starts) and 0.0 <= starts[0] and words[-1].end <= t.audio_s + 0.05


@pytest.mark.real
@pytest.mark.slow
def test_the_cli_flags_reach_the_transcript(capsys):
    pytest.importorskip("asr_spec.models.ct2", reason="the CTranslate2 converter is not available")
    from asr_spec.cli import main

    clip = _clips()[1]  # "Doctor Mikayla Szczepanski will see you now."
    args = ["transcribe", str(PROMPTS / clip["file"]), "--preset", "base", "--language", "en", "--quiet",
            "--initial-prompt", "Mikayla Szczepanski", "--prefix", "Doctor"]
    with pytest.raises(SystemExit) as info:
        main(args)
    out = capsys.readouterr()
    assert int(info.value.code or 0) == 0, out.err
    assert out.out.strip().startswith("Doctor Mikayla Szczepanski"), out.out
    main_help = ["transcribe", "--help"]
    with pytest.raises(SystemExit):
        main(main_help)
    shown = capsys.readouterr().out
    assert all(flag in shown for flag in ("--initial-prompt", "--hotwords", "--prefix"))


@pytest.mark.real
@pytest.mark.slow
def test_a_prefix_the_model_would_not_say_is_said_once_and_the_speech_follows():
    """Spanish speech translated after the prefix "Spanish lesson:" (tests/fixtures/prompts/spanish.flac): with the
    prefix counted as generated, the timestamps' total probability (beating the best text token) closed the
    segment right after it and the model said it again, 15 times, losing every sentence; given, the timestamps'
    total is weighed against the text's total there and the translation follows it, as faster-whisper's does."""
    asr = _asr(language="es", task="translate")
    [t] = asr.transcribe(str(PROMPTS / "spanish.flac"), progress=False, prefix="Spanish lesson:")
    assert t.text.count("Spanish lesson") == 1, t.text
    assert "hospital" in t.text, t.text  # "Mi hermana trabaja en un hospital desde hace tres años."


@pytest.mark.real
@pytest.mark.slow
def test_a_prefix_the_model_would_say_changes_nothing_of_its_segments():
    """The first sentence of long_75s.flac as the prefix: its segments are those without a prefix (the timestamps'
    total beats the text's after it, so the segment closes where it did; a rule of no timestamp there, as
    CTranslate2 has, ran it into the next sentence); without timestamps a prefix of the whole sentence ends there
    (begin-suppress after it kept <|endoftext|> out and the model said "." or "you" more)."""
    long_75s = str(Path(__file__).parent / "fixtures" / "speech" / "long_75s.flac")
    first = "The village sat at the edge of a wide green valley."
    asr = _asr()
    plain, prefixed = asr.transcribe([long_75s, long_75s], progress=False, prefix=[None, first])
    assert prefixed.text.startswith(first)
    shown = [[(s.start_s, s.end_s, s.text.strip()) for s in t.segments[:4]] for t in (plain, prefixed)]
    assert shown[0] == shown[1], shown
    clip = _clips()[0]
    [t] = _asr(timestamps=False).transcribe(str(PROMPTS / clip["file"]), progress=False, prefix=clip["text"])
    assert t.text.strip() == clip["text"], t.text
