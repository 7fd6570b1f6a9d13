"""Presets: the shipped TOML files, loading by name or path, and the errors for bad ones. No model is loaded."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from asr_spec.engine import DecodeOptions
from asr_spec.errors import InputError
from asr_spec.models import cpu as cpu_module
from asr_spec.models.cpu import parse_cpu_flags, resolve_precision
from asr_spec.models.presets import (
    DEFAULT_PRESET,
    ModelPlan,
    Preset,
    available_presets,
    load_preset,
    plan_models,
    presets_dir,
    presets_dir_of,
)
from asr_spec.transcribe import TranscribeOptions, Transcriber

REPO = Path(__file__).resolve().parent.parent


def test_an_installed_package_reads_its_own_presets_not_a_configs_folder_beside_it(tmp_path: Path) -> None:
    """Installed from a wheel, the package lies in site-packages with its presets inside it; a `configs/` another
    distribution put in site-packages is not its presets. In a repository (editable install) the package has none
    inside and reads the repository's."""
    site = tmp_path / "site-packages"
    (site / "asr_spec" / "configs").mkdir(parents=True)
    (site / "configs").mkdir()
    assert presets_dir_of(site / "asr_spec") == site / "asr_spec" / "configs"
    repo = tmp_path / "repo"
    (repo / "asr_spec").mkdir(parents=True)
    (repo / "configs").mkdir()
    assert presets_dir_of(repo / "asr_spec") == repo / "configs"


def test_shipped_presets() -> None:
    assert presets_dir() == REPO / "configs"
    assert available_presets() == ["base", "base-distilled", "large-v2", "large-v3", "tiny.en"]
    assert DEFAULT_PRESET in available_presets()
    v2, v3 = load_preset("large-v2"), load_preset("large-v3")
    assert (v2.model, v2.draft, v2.chunk_length_s) == ("openai/whisper-large-v2", "distil-whisper/distil-large-v2", 15)
    assert (v3.model, v3.draft, v3.chunk_length_s) == ("openai/whisper-large-v3", "distil-whisper/distil-large-v3", 25)
    base = load_preset("base")
    assert base.model == "embedded:whisper-base" and base.draft == str(REPO / "drafts" / "whisper-base-2l")
    # on a CPU its draft decodes runs of <= 4 rows, 1 in the int8 precision, <= 8 in native bf16 (AMX, AVX-512-BF16)
    assert base.draft_optional
    assert base.cpu_draft_max_rows == {"amx-bf16": 8, "avx512-bf16": 8, "int8": 1, "fp32": 4}
    distilled = load_preset("base-distilled")
    assert distilled.draft == base.draft  # relative to configs/, resolved
    tiny = load_preset("tiny.en")
    assert (tiny.model, tiny.draft, tiny.chunk_length_s, tiny.language) == ("embedded:whisper-tiny.en", None, 30, None)


@pytest.mark.parametrize("name", ["base", "base-distilled", "large-v2", "large-v3", "tiny.en"])
def test_every_shipped_preset_makes_valid_options(name: str) -> None:
    preset = load_preset(name)
    options = TranscribeOptions.from_values(**preset.option_values())
    assert options.chunking.chunk_length_s == preset.chunk_length_s
    # a key the preset leaves out is the option's own default (one default per option, stated once)
    plain_k = None if isinstance(preset.num_draft_tokens, dict) else preset.num_draft_tokens  # a table: per run
    assert options.decode.num_draft_tokens == (plain_k or DecodeOptions().num_draft_tokens)
    assert preset.dtype == "auto" and preset.description
    assert preset.timestamps and options.decode.timestamps  # Whisper's long-form mode (see configs/base.toml)


def test_preset_draft_on_cuda_and_on_cpu_where_measured_to_pay(caplog) -> None:
    """Defaults follow the physics: a preset's draft decodes every run on CUDA; on a CPU only the runs of at most
    cpu_draft_max_rows rows (base: 4, where its draft measured faster), else greedy (said at info level, no
    warning); share_encoder is a checked boolean."""
    distilled, base = load_preset("base-distilled"), load_preset("base")
    with caplog.at_level(logging.INFO, logger="asr_spec"):
        plan = plan_models(distilled, "cpu")
        assert plan.draft is None and plan.draft_max_rows is None
        assert "greedy on cpu" in caplog.text
        assert plan_models(distilled, "cuda") == ModelPlan(distilled.model, distilled.draft, "auto", None, None)
        # int8 on the pinned AVX2 class; unpinned, bf16 where this CPU's bf16 products are native and lossless
        auto_rows = {"int8": 1, "float32": 4, "bfloat16": 8}[resolve_precision("auto", torch.device("cpu"))]
        assert plan_models(base, "cpu").draft == base.draft and plan_models(base, "cpu").draft_max_rows == auto_rows
        assert plan_models(base, "cpu", {"dtype": "int8"}).draft_max_rows == 1
        amx = parse_cpu_flags("avx2 avx512_bf16 amx_bf16")  # bf16 asked for there: the draft up to batch 8
        assert plan_models(base, "cpu", {"dtype": "bfloat16"}, cpu=amx).draft_max_rows == 8
        with pytest.MonkeyPatch.context() as patch:  # auto: bf16 where the probe finds bf16 lossless, else fp32
            patch.setattr(cpu_module, "bf16_row_block", lambda: (32, 32))
            assert plan_models(base, "cpu", cpu=amx).draft_max_rows == 8
            patch.setattr(cpu_module, "bf16_row_block", lambda: (0, 0))
            assert plan_models(base, "cpu", cpu=amx).draft_max_rows == 4
        assert plan_models(base, "cpu", {"dtype": "float32"}, cpu=amx).draft_max_rows == 4
        assert plan_models(base, "cuda").draft == base.draft and plan_models(base, "cuda").draft_max_rows is None
        # asked for: in every run, unless draft_max_rows is given too; off; another model drops the preset's draft
        assert plan_models(distilled, "cpu", {"draft": "d"}).draft_max_rows is None
        assert plan_models(base, "cpu", {"draft": "d", "draft_max_rows": 2}).draft_max_rows == 2
        assert plan_models(base, "cpu", {"draft": None}) == ModelPlan(base.model, None, "auto", None, None)
        assert plan_models(base, "cuda", {"model": "m"}).draft is None
        assert plan_models(base, "cpu", {"dtype": "bfloat16"}).dtype == "bfloat16"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the shipped draft is there
    for bad in (-1, True, 1.5, "1", {"fp32": -1}, {"amx-bf16": 8, "fp32": "4"}):
        with pytest.raises(InputError, match=r"cpu_draft_max_rows(\.\w+)? must be an integer >= 0"):
            Preset("p", "embedded:whisper-base", cpu_draft_max_rows=bad)
    with pytest.raises(InputError, match="cpu_draft_max_rows has unknown class"):
        Preset("p", "embedded:whisper-base", cpu_draft_max_rows={"avx2": 4})
    assert Preset("p", "embedded:whisper-base", share_encoder=False).share_encoder is False
    with pytest.raises(InputError, match="share_encoder must be true or false"):
        Preset("p", "embedded:whisper-base", share_encoder="yes")


def test_unknown_preset_lists_the_known_ones() -> None:
    known = "base, base-distilled, large-v2, large-v3, tiny.en"
    with pytest.raises(InputError, match=rf"unknown preset 'large-v9' \(known: {known}"):
        load_preset("large-v9")
    with pytest.raises(InputError, match="nowhere.toml: no such preset file"):
        load_preset("nowhere.toml")


def test_missing_optional_draft_means_greedy_with_one_warning(tmp_path: Path, caplog) -> None:
    path = tmp_path / "p.toml"
    path.write_text('model = "embedded:whisper-base"\ndraft = "./no-such-draft"\ndraft_optional = true\n')
    preset = load_preset(path)
    with caplog.at_level(logging.WARNING, logger="asr_spec"):
        assert preset.draft_or_none() is None
    assert len(caplog.records) == 1 and "no draft" in caplog.text and "running greedy" in caplog.text
    (tmp_path / "no-such-draft").mkdir()
    assert preset.draft_or_none() == str(tmp_path / "no-such-draft")
    hub = Preset("hub", "openai/whisper-large-v2", draft="distil-whisper/distil-large-v2", draft_optional=True)
    assert hub.draft_or_none() == "distil-whisper/distil-large-v2"  # not a path: loaded (or failing) as given
    required = Preset("strict", "embedded:whisper-base", draft=str(tmp_path / "absent"))
    assert required.draft_or_none() == str(tmp_path / "absent")  # not optional: loading it will fail loudly


def test_preset_by_path_with_all_keys(tmp_path: Path) -> None:
    path = tmp_path / "archive.toml"
    path.write_text(
        'description = "mine"\nmodel = "~/models/whisper"\ndraft = "../drafts/d"\nchunk_length_s = 20\n'
        'stride_length_s = [4, 2]\nnum_draft_tokens = 7\nlanguage = "auto"\ndtype = "float16"\n'
    )
    preset = load_preset(str(path))
    assert preset.name == "archive" and preset.path == path
    assert preset.model == str(Path("~/models/whisper").expanduser())
    assert preset.draft == str((tmp_path / "../drafts/d").resolve())
    assert preset.stride_length_s == (4, 2) and preset.language == "auto" and preset.dtype == "float16"
    options = TranscribeOptions.from_values(**preset.option_values())
    assert (options.chunking.stride_left_s, options.chunking.stride_right_s) == (4, 2)
    assert options.decode.language is None  # "auto": detect per chunk


@pytest.mark.parametrize(
    "text,needle",
    [
        ('model = "x"\nbeam_size = 5\n', r"unknown key\(s\) beam_size \(allowed: model, draft"),
        ('draft = "x"\n', "missing 'model'"),
        ('model = "x"\ndtype = "int4"\n', "dtype must be one of auto"),
        ('model = "x"\ndtype = ["bf16"]\n', "dtype must be one of auto"),  # not a string: no TypeError
        ('model = "x"\ndraft_optional = "yes"\n', "draft_optional must be true or false"),
        ('model = [1]\n', "model must be a model id"),
        ("model = \n", "cannot read the preset"),
    ],
)
def test_bad_preset_files_name_the_file_and_the_cause(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=needle) as info:
        load_preset(path)
    assert str(info.value).startswith(str(path)) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "text,needle",
    [
        ('model = "x"\nchunk_length_s = "long"\n', "chunk_length_s must be in \\(0, 30\\] seconds, got 'long'"),
        ('model = "x"\nnum_draft_tokens = 2.5\n', "num_draft_tokens must be an integer"),
        ('model = "x"\ntimestamps = 1\n', "timestamps must be true or false"),
        ('model = "x"\nstride_length_s = [1, 2, 3]\n', "stride_length_s must be a number"),
    ],
)
def test_bad_option_values_of_a_preset_name_the_file_before_any_loading(tmp_path: Path, text: str,
                                                                         needle: str) -> None:
    """The option values are checked once, where they become options (`Transcriber.from_preset`)."""
    from asr_spec.transcribe import Transcriber

    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=needle) as info:
        Transcriber.from_preset(path)  # model "x" is never loaded: the options fail first
    assert str(info.value).startswith(str(path)) and "\n" not in str(info.value)


def test_the_cpu_draft_decision_follows_the_decode_class(monkeypatch) -> None:
    """A {decode class: rows} table: a bf16 run on an AMX or AVX-512 bf16 CPU takes its class's row, an fp32 run (or
    bf16 where it is emulated) the fp32 row; dtype auto resolves first (here: fp32, the probe finding bf16 not
    lossless); a class left out is greedy; one number serves every class."""
    monkeypatch.setattr(cpu_module, "bf16_row_block", lambda: (0, 0))
    amx, zen4, zen2 = (parse_cpu_flags(f) for f in ("avx2 avx512_bf16 amx_bf16", "avx2 avx512_bf16", "avx2"))
    table = Preset("p", "embedded:whisper-base", draft="d", cpu_draft_max_rows={"amx-bf16": 8, "fp32": 2})
    assert plan_models(table, "cpu", {"dtype": "bfloat16"}, cpu=amx).draft_max_rows == 8  # amx-bf16
    assert plan_models(table, "cpu", cpu=amx).draft_max_rows == 2  # auto -> fp32
    assert plan_models(table, "cpu", {"dtype": "float32"}, cpu=amx).draft_max_rows == 2
    assert plan_models(table, "cpu", cpu=zen2).draft_max_rows == 2  # auto -> int8 or fp32: fp32's row
    assert plan_models(table, "cpu", {"dtype": "bfloat16"}, cpu=zen2).draft_max_rows == 2  # emulated bf16
    # the int8 precision: its own row where the table has one, else fp32's
    assert plan_models(table, "cpu", {"dtype": "int8"}, cpu=zen2).draft_max_rows == 2
    with_int8 = replace(table, cpu_draft_max_rows={"int8": 1, "fp32": 2})
    assert plan_models(with_int8, "cpu", {"dtype": "int8"}, cpu=zen2).draft_max_rows == 1
    assert plan_models(with_int8, "cpu", {"dtype": "float32"}, cpu=zen2).draft_max_rows == 2
    assert plan_models(table, "cpu", {"dtype": "bfloat16"}, cpu=zen4).draft is None  # avx512-bf16 left out: greedy
    assert plan_models(table, "cuda", cpu=zen4).draft == "d"  # CUDA: every run, whatever the CPU
    one = Preset("p", "embedded:whisper-base", draft="d", cpu_draft_max_rows=3)
    assert {plan_models(one, "cpu", cpu=c).draft_max_rows for c in (amx, zen4, zen2)} == {3}


def test_the_draft_length_follows_the_decode_class(monkeypatch) -> None:
    """A {decode class: K} table: a CPU run takes its class's K (dtype auto resolved first), a class left out and
    CUDA the option's default (None in the plan); `from_preset` gives it to the options unless the caller sets K;
    a bad table names the file and the key."""
    monkeypatch.setattr(cpu_module, "bf16_row_block", lambda: (32, 32))  # bf16 lossless: auto -> bf16 on AMX
    amx, zen2 = (parse_cpu_flags(f) for f in ("avx2 avx512_bf16 amx_bf16", "avx2"))
    table = Preset("p", "embedded:whisper-base", draft="d", cpu_draft_max_rows=8,
                   num_draft_tokens={"amx-bf16": 2, "fp32": 4})
    assert "num_draft_tokens" not in table.option_values()
    assert plan_models(table, "cpu", cpu=amx).num_draft_tokens == 2
    assert plan_models(table, "cpu", {"dtype": "float32"}, cpu=amx).num_draft_tokens == 4
    assert plan_models(table, "cpu", cpu=zen2).num_draft_tokens == 4
    assert plan_models(table, "cpu", {"dtype": "int8"}, cpu=zen2).num_draft_tokens == 4  # fp32's K
    int8_k = replace(table, num_draft_tokens={"int8": 2, "fp32": 4})
    assert plan_models(int8_k, "cpu", {"dtype": "int8"}, cpu=zen2).num_draft_tokens == 2
    assert plan_models(table, "cuda", cpu=amx).num_draft_tokens is None
    assert plan_models(replace(table, num_draft_tokens={"fp32": 4}), "cpu", cpu=amx).num_draft_tokens is None
    plain = replace(table, num_draft_tokens=5)
    assert plain.option_values()["num_draft_tokens"] == 5  # a plain K: an option value, not the plan's
    assert plan_models(plain, "cpu", cpu=amx).num_draft_tokens is None
    assert plan_models(table, "cpu", {"draft": None}, cpu=amx).num_draft_tokens is None  # nothing drafts
    for bad, match in (({"avx2": 2}, "num_draft_tokens has unknown class"),
                       ({"fp32": 0}, r"num_draft_tokens\.fp32 must be an integer >= 1")):
        with pytest.raises(InputError, match=match):
            Preset("p", "embedded:whisper-base", num_draft_tokens=bad)
    assert load_preset("base").draft_tokens("amx-bf16") == 2


def test_from_preset_gives_the_runs_draft_length_unless_the_caller_does(monkeypatch) -> None:
    from asr_spec.models import presets

    captured = {}

    def fake_pretrained(model, draft, **kwargs):
        captured["k"] = kwargs["options"].decode.num_draft_tokens

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(fake_pretrained))
    monkeypatch.setattr(presets, "plan_models", lambda *a, **k: presets.ModelPlan("m", "d", None, None, 8, 2))
    Transcriber.from_preset("base")
    assert captured["k"] == 2
    Transcriber.from_preset("base", num_draft_tokens=5)
    assert captured["k"] == 5


def test_a_draft_length_where_no_draft_runs_is_refused_or_noted(caplog) -> None:
    """`--num-draft-tokens` was taken and ignored without a word where no draft runs: beside --no-draft
    (draft=None) the two contradict each other; with a preset that has no draft (tiny.en), a note."""
    with pytest.raises(InputError, match="num_draft_tokens was given with no draft"):
        Transcriber.plan_preset("base", draft=None, num_draft_tokens=4)
    with caplog.at_level(logging.INFO, logger="asr_spec"):
        plan, _ = Transcriber.plan_preset("tiny.en", num_draft_tokens=5)
    assert plan.draft is None and "num_draft_tokens 5 has no effect: no draft runs" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asr_spec"):
        Transcriber.plan_preset("tiny.en")
    assert "num_draft_tokens" not in caplog.text
