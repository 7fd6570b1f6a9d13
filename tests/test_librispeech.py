"""LibriSpeech loading, long-form joining, the resumable results log and its summary, on the committed fixtures."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from asr_spec.errors import InputError
from asr_spec.eval.librispeech import (
    HubUnavailableError,
    ResultsLog,
    Utterance,
    iter_hub,
    iter_local,
    long_form,
    summarize,
    take,
)

pytestmark = pytest.mark.filterwarnings("ignore:English text normaliser built without")

ROOT = Path(__file__).parent / "fixtures" / "librispeech"
EXPECTED_IDS = (
    [f"9001-100201-{i:04d}" for i in range(3)]
    + [f"9001-100202-{i:04d}" for i in range(4)]
    + [f"9002-100301-{i:04d}" for i in range(4)]
    + [f"9003-100401-{i:04d}" for i in range(3)]
)


@pytest.fixture(scope="module")
def utterances() -> list[Utterance]:
    return list(iter_local(ROOT, "test-clean"))


def test_iter_local_reads_ids_texts_and_durations(utterances):
    assert [u.id for u in utterances] == EXPECTED_IDS
    first = utterances[0]
    assert (first.speaker, first.chapter) == ("9001", "100201")
    assert first.text == "THE GARDEN BEHIND THE HOUSE WAS FULL OF ROSES AND TALL GRASS"
    assert utterances[8].text == "MERCHANTS SOLD APPLES CHEESE AND BRIGHT WOOL CLOTH"
    for u in utterances:
        info = sf.info(str(u.audio))
        assert u.audio == ROOT / "test-clean" / u.speaker / u.chapter / f"{u.id}.flac"
        assert u.sampling_rate == info.samplerate == 16_000
        assert u.duration_s == pytest.approx(info.frames / info.samplerate)
        assert 2.0 <= u.duration_s <= 6.0
        assert u.text == u.text.upper() and u.text.strip()
    audio = first.load()
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert len(audio) == round(first.duration_s * 16_000)


def test_iter_local_accepts_the_split_folder_itself(utterances):
    assert list(iter_local(ROOT / "test-clean", "test-clean")) == utterances


def test_iter_local_errors(tmp_path):
    with pytest.raises(InputError, match="no LibriSpeech split 'test-other'"):
        next(iter_local(ROOT, "test-other"))
    chapter = tmp_path / "dev" / "1" / "2"
    chapter.mkdir(parents=True)
    with pytest.raises(InputError, match="transcript file missing"):
        next(iter_local(tmp_path, "dev"))
    (chapter / "1-2.trans.txt").write_text("1-3-0000 WRONG CHAPTER\n")
    with pytest.raises(InputError, match=r"1-2.trans.txt:1: id '1-3-0000'"):
        next(iter_local(tmp_path, "dev"))


def test_take(utterances):
    assert [u.id for u in take(iter(utterances), 2)] == EXPECTED_IDS[:2]
    assert len(list(take(utterances, None))) == len(utterances)
    assert list(take(utterances, 0)) == []
    with pytest.raises(InputError):
        take(utterances, -1)


def test_long_form_joins_each_chapter_in_order(utterances):
    chapters = list(long_form(reversed(utterances)))  # reversed: order inside a chapter comes from the ids
    assert [c.id for c in chapters] == ["9003-100401", "9002-100301", "9001-100202", "9001-100201"]
    by_id = {u.id: u for u in utterances}
    ship = chapters[2]
    assert ship.parts == tuple(f"9001-100202-{i:04d}" for i in range(4))
    assert ship.text == " ".join(by_id[p].text for p in ship.parts)
    assert ship.text.startswith("THE SHIP LEFT THE PORT") and ship.text.endswith("SEE THE LAND BEHIND US")
    assert ship.duration_s == pytest.approx(sum(by_id[p].duration_s for p in ship.parts))
    assert len(ship.audio) == round(ship.duration_s * 16_000)
    # the pieces sit end to end in order
    offset = 0
    for part_id in ship.parts:
        part = by_id[part_id].load()
        np.testing.assert_array_equal(ship.audio[offset : offset + len(part)], part)
        offset += len(part)
    assert np.array_equal(ship.load(), ship.audio)


def test_long_form_gap(utterances):
    chapter = utterances[:3]
    (joined,) = long_form(chapter, gap_s=0.5)
    assert joined.duration_s == pytest.approx(sum(u.duration_s for u in chapter) + 2 * 0.5)
    first_len = len(chapter[0].load())
    assert not joined.audio[first_len : first_len + 8000].any()


def test_long_form_rejects_ungrouped_input(utterances):
    mixed = [utterances[0], utterances[3], utterances[1]]  # 100201, 100202, 100201 again
    with pytest.raises(InputError, match="appears twice"):
        list(long_form(mixed))
    # the eval runner groups chapters itself (one unit each, loaded only when run): the same check when the chapter
    # comes again (it scored the chapter's first part under an id its second part then replaced in the summary)
    from asr_spec.eval.runner import _units

    with pytest.raises(InputError, match="chapter 9001-100201 appears twice"):
        list(_units(mixed, limit=None, as_long_form=True, done=set(), scope=[]))


def test_results_log_resumes_after_a_truncated_line(tmp_path):
    path = tmp_path / "run" / "results.jsonl"
    log = ResultsLog(path)
    assert log.done_ids() == set()
    for i in range(3):
        log.append({"id": f"u{i}", "ref": "a", "hyp": "a", "audio_s": 1.0, "wall_s": 0.5})
    # a crash in the middle of writing the 4th record
    with open(path, "ab") as handle:
        handle.write(b'{"id": "u3", "ref": "a", "hy')
    resumed = ResultsLog(path)
    with pytest.warns(UserWarning, match="incomplete last line"):
        assert resumed.done_ids() == {"u0", "u1", "u2"}
    resumed.append({"id": "u3", "ref": "a", "hyp": "b", "audio_s": 1.0, "wall_s": 0.5})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["u0", "u1", "u2", "u3"]
    assert resumed.done_ids() == {"u0", "u1", "u2", "u3"}


def test_a_text_file_given_as_the_log_is_refused_not_cut(tmp_path):
    """A one-line file without a newline (`printf 'junk' > junk.txt`, given as --output) was read as a crash's
    partial record: a warning, then its content cut away and replaced by the records. Only a line that can be the
    head of a record (a JSON object) is crash residue."""
    junk = tmp_path / "junk.txt"
    junk.write_bytes(b"junk line no newline")
    log = ResultsLog(junk)
    with pytest.raises(InputError, match=r"junk.txt: not a results log \(its last line, b'junk line no newline', is "
                                         r"no JSON record\)"):
        log.done_ids()
    with pytest.raises(InputError, match="not a results log"):
        log.append({"id": "u0", "ref": "a", "hyp": "a", "audio_s": 1.0, "wall_s": 0.5})
    assert junk.read_bytes() == b"junk line no newline"
    blank = tmp_path / "blank.jsonl"  # a hand edit (deleting a failed record's line) left a blank last line
    blank.write_bytes(b'{"id": "u0", "ref": "a", "hyp": "a", "audio_s": 1.0, "wall_s": 0.5}\n \n ')
    with pytest.warns(UserWarning, match="incomplete last line"):
        assert ResultsLog(blank).done_ids() == {"u0"}


def test_results_log_rejects_bad_records_and_corruption(tmp_path):
    log = ResultsLog(tmp_path / "r.jsonl")
    with pytest.raises(InputError, match="needs a non-empty string 'id'"):
        log.append({"ref": "a"})
    with pytest.raises(InputError, match="not JSON-serialisable"):
        log.append({"id": "x", "wall_s": float("nan")})
    (tmp_path / "r.jsonl").write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(InputError, match=r"r.jsonl:2: not a JSON record"):
        log.done_ids()


def test_summarize_maths(tmp_path):
    log = ResultsLog(tmp_path / "results.jsonl")
    common = {"identical_to_greedy": True}
    # 6 + 3 reference words; edits: 1 substitution (cat->bat), 1 deletion (on), 1 insertion (today)
    log.append(
        {
            "id": "a",
            "ref": "THE CAT SAT ON THE MAT",
            "hyp": "The bat sat the mat.",
            "audio_s": 10.0,
            "wall_s": 2.0,
            "generated_tokens": 30,
            "target_passes": 10,
            "accepted_tokens": 20,
            "drafted_tokens": 40,
            **common,
        }
    )
    log.append(
        {
            "id": "b",
            "ref": "HELLO THERE FRIEND",
            "hyp": "Hello there, friend today.",
            "audio_s": 5.0,
            "wall_s": 3.0,
            "generated_tokens": 10,
            "target_passes": 10,
            "accepted_tokens": 0,
            "drafted_tokens": 40,
            "identical_to_greedy": False,
        }
    )
    log.append({"id": "c", "ref": "IGNORED", "hyp": "", "audio_s": 4.0, "wall_s": 1.0, "error": "decoder crashed"})
    s = summarize(log.path)
    assert (s["n_records"], s["n_failed"], s["n_scored"]) == (3, 1, 2)
    assert (s["n_words"], s["substitutions"], s["deletions"], s["insertions"]) == (9, 1, 1, 1)
    assert s["wer"] == pytest.approx(3 / 9)
    assert (s["audio_s"], s["wall_s"]) == (15.0, 5.0)
    assert s["rtfx"] == pytest.approx(3.0)
    assert (s["n_greedy_checked"], s["n_identical_to_greedy"], s["all_identical_to_greedy"]) == (2, 1, False)
    assert (s["generated_tokens"], s["target_passes"]) == (40, 20)
    assert s["tokens_per_target_pass"] == pytest.approx(2.0)
    assert (s["accepted_tokens"], s["drafted_tokens"]) == (20, 80)
    assert s["acceptance_rate"] == pytest.approx(0.25)


def test_summarize_plain_greedy_log_and_repeated_ids(tmp_path):
    path = tmp_path / "results.jsonl"
    rows = [
        {"id": "a", "ref": "A B", "hyp": "a c", "audio_s": 2.0, "wall_s": 1.0},
        {"id": "a", "ref": "A B", "hyp": "a b", "audio_s": 2.0, "wall_s": 1.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match="1 repeated ids"):
        s = summarize(path)
    assert s["n_records"] == 1 and s["wer"] == 0.0  # the later record wins
    assert "tokens_per_target_pass" not in s and "n_greedy_checked" not in s
    empty = summarize(tmp_path / "none.jsonl")
    assert empty["n_scored"] == 0 and math.isnan(empty["wer"]) and math.isnan(empty["rtfx"])  # nothing scored: n/a


def test_iter_hub_offline_error_is_one_clear_line(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openslr/librispeech_asr' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(HubUnavailableError) as info:
        next(iter_hub("clean", "test"))
    message = str(info.value)
    assert "\n" not in message
    assert "hub is unreachable" in message and "iter_local(root, split)" in message
    assert isinstance(info.value.__cause__, ConnectionError)


def test_iter_hub_converts_rows(monkeypatch, utterances):
    """The hub path past load_dataset, on an in-memory dataset shaped like openslr/librispeech_asr."""
    datasets = pytest.importorskip("datasets")
    local = utterances[:2]
    table = datasets.Dataset.from_dict(
        {
            "file": [str(u.audio) for u in local],
            "audio": [{"bytes": Path(u.audio).read_bytes(), "path": u.audio.name} for u in local],
            "text": [u.text for u in local],
            "speaker_id": [int(u.speaker) for u in local],
            "chapter_id": [int(u.chapter) for u in local],
            "id": [u.id for u in local],
        }
    ).cast_column("audio", datasets.Audio(decode=False))
    seen = {}

    def fake_load(name, config, split, streaming):
        seen.update(name=name, config=config, split=split, streaming=streaming)
        return table.to_iterable_dataset() if streaming else table

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    got = list(iter_hub("clean", "test"))
    assert seen == {"name": "openslr/librispeech_asr", "config": "clean", "split": "test", "streaming": True}
    assert got == local  # same id, speaker, chapter, rate, text, duration (audio is not compared)
    np.testing.assert_array_equal(got[0].audio, local[0].load())
