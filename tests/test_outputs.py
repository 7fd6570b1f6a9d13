"""Writers: timestamp formatting, file contents, atomic replacement, format validation."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from asr_spec.errors import InputError
from asr_spec.transcribe.files import read_sources
from asr_spec.transcribe.outputs import (
    MIN_CUE_S,
    SOURCES_INDEX,
    TranscriptSegment,
    atomic_write,
    check_not_replacing,
    format_timestamp,
    output_stems,
    prepare_output_dir,
    render_json,
    render_srt,
    render_txt,
    render_vtt,
    told_apart,
    write_outputs,
)
from asr_spec.transcribe.segments import Segment


def _result() -> dict:
    return {
        "text": " Hello world. <Second> line & more",
        "segments": [
            {"start_s": 0.0, "end_s": 2.5, "text": " Hello world."},
            {"start_s": 2.5, "end_s": 3661.0416, "text": " <Second> line & more"},
        ],
        "stats": {"acceptance": np.float32(0.75), "n_chunks": np.int64(2), "histogram": np.arange(3)},
        "timings": {"decode_s": 1.25, "idle_s": float("nan")},
    }


@pytest.mark.parametrize(
    "time_s,srt,vtt",
    [
        (0.0, "00:00:00,000", "00:00:00.000"),
        (1.0005, "00:00:01,000", "00:00:01.000"),  # float 1.0005 is just below the half: rounds down
        (59.9996, "00:01:00,000", "00:01:00.000"),  # rounding carries into the minutes
        (3661.042, "01:01:01,042", "01:01:01.042"),
        (7 * 3600 + 0.5, "07:00:00,500", "07:00:00.500"),
        (100 * 3600, "100:00:00,000", "100:00:00.000"),  # no wrap past 99 hours
    ],
)
def test_format_timestamp(time_s: float, srt: str, vtt: str) -> None:
    assert format_timestamp(time_s) == srt
    assert format_timestamp(time_s, ".") == vtt


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf"), "1.0", None])
def test_format_timestamp_rejects_bad_times(bad: object) -> None:
    with pytest.raises(InputError, match="timestamp"):
        format_timestamp(bad)  # type: ignore[arg-type]


def test_srt_content() -> None:
    assert render_srt(_result()) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello world.\n\n"
        "2\n00:00:02,500 --> 01:01:01,042\n<Second> line & more\n"
    )


def test_vtt_content_escapes_markup() -> None:
    assert render_vtt(_result()) == (
        "WEBVTT\n\n"
        "00:00:00.000 --> 00:00:02.500\nHello world.\n\n"
        "00:00:02.500 --> 01:01:01.042\n&lt;Second&gt; line &amp; more\n"
    )


def test_caption_cues_skip_empty_text_and_cannot_be_broken_by_text() -> None:
    result = {
        "text": "x",
        "segments": [
            {"start_s": 0.0, "end_s": 1.0, "text": "  "},
            {"start_s": 1.0, "end_s": 2.0, "text": "a\n\nb --> c"},
        ],
    }
    assert render_srt(result) == "1\n00:00:01,000 --> 00:00:02,000\na\nb -> c\n"


def test_txt_is_one_line_per_segment_or_the_text() -> None:
    assert render_txt(_result()) == "Hello world.\n<Second> line & more\n"
    assert render_txt({"text": "  just text ", "segments": []}) == "just text\n"


def test_json_keeps_everything_as_plain_json(tmp_path: Path) -> None:
    paths = write_outputs(_result(), tmp_path, "talk", ["json"])
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert data["text"] == _result()["text"]
    assert data["segments"][1] == {"start_s": 2.5, "end_s": 3661.0416, "text": " <Second> line & more"}
    assert data["stats"] == {"acceptance": 0.75, "n_chunks": 2, "histogram": [0, 1, 2]}
    assert data["timings"] == {"decode_s": 1.25, "idle_s": None}  # NaN is not JSON


def test_dataclass_results_and_segment_objects() -> None:
    @dataclasses.dataclass
    class Result:
        text: str
        segments: list[TranscriptSegment]

    result = Result("hi", [TranscriptSegment(0.25, 1.0, "hi", token_ids=(7, 8))])
    assert render_srt(result) == "1\n00:00:00,250 --> 00:00:01,000\nhi\n"
    # the one segment type: its token ids (and empty words) stay out of the json
    assert TranscriptSegment is Segment
    assert json.loads(render_json(result))["segments"] == [{"start_s": 0.25, "end_s": 1.0, "text": "hi"}]


def test_write_outputs_writes_every_format(tmp_path: Path) -> None:
    out = tmp_path / "new" / "folder"
    paths = write_outputs(_result(), out, "talk", ["txt", "JSON", ".srt", "vtt", "txt"])
    assert sorted(paths) == ["json", "srt", "txt", "vtt"]
    assert sorted(p.name for p in out.iterdir()) == ["talk.json", "talk.srt", "talk.txt", "talk.vtt"]
    assert paths["vtt"].read_text(encoding="utf-8").startswith("WEBVTT\n")
    assert oct(paths["txt"].stat().st_mode & 0o777) == oct(0o644)


def test_unknown_format_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="'docx'"):
        write_outputs(_result(), tmp_path, "talk", ["txt", "docx"])
    with pytest.raises(InputError, match="no output format"):
        write_outputs(_result(), tmp_path, "talk", [])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stem", ["", "a/b", "..", None])
def test_bad_stem_is_rejected(tmp_path: Path, stem: object) -> None:
    with pytest.raises(InputError, match="stem"):
        write_outputs(_result(), tmp_path, stem, ["txt"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "segments,needle",
    [
        ([{"start_s": 2.0, "end_s": 1.0, "text": "x"}], "segment 0: needs 0 <= start_s <= end_s"),
        ([{"start_s": 0.0, "end_s": 3.0, "text": "x"}, {"start_s": 2.0, "end_s": 4.0, "text": "y"}], "segment 1"),
        ([{"start_s": 0.0, "text": "x"}], "segment 0: missing 'end_s'"),
        ([{"start_s": float("nan"), "end_s": 1.0, "text": "x"}], "start_s must be a finite"),
    ],
)
def test_bad_segments_are_rejected_before_writing(tmp_path: Path, segments: list, needle: str) -> None:
    with pytest.raises(InputError, match=needle):
        write_outputs({"text": "x", "segments": segments}, tmp_path, "talk", ["txt", "srt"])
    assert list(tmp_path.iterdir()) == []


def test_srt_without_segments_is_an_error() -> None:
    with pytest.raises(InputError, match="srt: the result has no 'segments'"):
        render_srt({"text": "x"})


def test_atomic_write_leaves_no_partial_file_when_the_writer_raises(tmp_path: Path) -> None:
    target = tmp_path / "talk.txt"

    def half_then_fail(file) -> None:
        file.write("partial transcript")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(target, half_then_fail)
    assert list(tmp_path.iterdir()) == []  # neither the target nor the temporary file

    target.write_text("old transcript\n", encoding="utf-8")
    with pytest.raises(RuntimeError):
        atomic_write(target, half_then_fail)
    assert target.read_text(encoding="utf-8") == "old transcript\n"  # the old file is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["talk.txt"]

    atomic_write(target, lambda file: file.write("new\n"))
    assert target.read_text(encoding="utf-8") == "new\n"


def test_atomic_write_replaces_by_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "talk.srt"
    seen = []
    real_replace = os.replace

    def spy(src, dst) -> None:
        seen.append((Path(src).parent, Path(src).name.startswith(".talk.srt."), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_outputs(_result(), tmp_path, "talk", ["srt"])
    assert seen == [(tmp_path, True, target)]  # temp file in the same folder, then one rename


def test_an_inputs_formats_are_written_all_or_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An io reviewer's: `talk.srt` a folder left `talk.txt` and `talk.json` written and unjournaled beside the
    error, and a Ctrl-C between two formats left `cut.json/srt/txt` without `cut.vtt`. Now a format that cannot be
    written writes none (no temporary left), and a Ctrl-C during the renames is raised once every format and the
    journal's line are in place."""
    (tmp_path / "talk.srt").mkdir()
    with pytest.raises(IsADirectoryError, match="talk.srt"):
        write_outputs(_result(), tmp_path, "talk", ["txt", "json", "srt", "vtt"], source=tmp_path / "talk.wav")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["talk.srt"]  # no txt / json, no temporary, no journal

    import signal

    real_replace, renamed = os.replace, []

    def interrupted_replace(src, dst) -> None:
        if not renamed:  # Ctrl-C as the first format is moved into place
            os.kill(os.getpid(), signal.SIGINT)
        real_replace(src, dst)
        renamed.append(Path(dst).name)

    monkeypatch.setattr(os, "replace", interrupted_replace)
    folder = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        write_outputs(_result(), folder, "cut", ["txt", "json", "srt", "vtt"], source=tmp_path / "cut.wav")
    assert renamed == ["cut.txt", "cut.json", "cut.srt", "cut.vtt"]
    assert read_sources(folder) == {"cut": str(tmp_path / "cut.wav")}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works as before afterwards


def test_a_held_ctrl_c_goes_to_the_handler_in_place_and_an_ignored_one_stays_ignored(tmp_path: Path) -> None:
    """`interrupts_held` (the renames of an input's formats): a SIGINT during the block reaches the application's
    own handler once the block is done (it was raised as KeyboardInterrupt over it), and an ignored SIGINT (a
    background job's) stays ignored."""
    import signal

    from asr_spec.errors import interrupts_held

    calls: list[int] = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            assert calls == []  # held
        assert calls == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_inputs_sharing_a_stem_get_the_shortest_distinct_names() -> None:
    """Folders tell apart the same name in two folders; where they cannot (talk.flac and talk.wav in one folder),
    the file names do, with as few folders as it takes. Climbing to / first put the whole path in each name: in a
    folder 232 characters deep the names were too long for the file system and both transcripts were lost."""
    deep = "/" + "d" * 200
    assert output_stems([f"{deep}/talk.flac", f"{deep}/talk.wav"]) == ["talk.flac", "talk.wav"]
    assert output_stems(["/x/a/same.flac", "/x/b/same.flac", "/x/c/other.flac"]) == ["a__same", "b__same", "other"]
    assert output_stems(["/x/a/talk.flac", "/x/a/talk.wav", "/x/b/talk.flac"]) == [
        "a__talk.flac", "a__talk.wav", "b__talk.flac"]
    assert output_stems(["/a/x/same.flac", "/b/x/same.flac", None]) == ["a__x__same", "b__x__same", None]
    assert told_apart([Path("/same.flac"), Path("/q/same.flac")]) == ["root__same", "q__same"]


def test_an_input_in_memory_does_not_take_a_files_name() -> None:
    """A file named input-1.wav and an array given second both wrote input-1.txt: one transcript lost, both inputs
    reported done."""
    from asr_spec.transcribe.inputs import name_outputs, run_inputs

    inputs = run_inputs(["/x/input-1.wav", np.zeros(16_000, np.float32), np.zeros(8, np.float32),
                         "/x/input-2-memory.flac", "/x/input-2.flac"])
    name_outputs(inputs)
    stems = [item.stem for item in inputs]
    assert stems == ["input-1", "input-1-memory", "input-2-memory-memory", "input-2-memory", "input-2"]
    assert len(set(stems)) == len(stems)


def test_an_output_directory_that_is_not_a_path_is_named() -> None:
    from asr_spec.transcribe.outputs import prepare_output_dir

    with pytest.raises(InputError, match="output directory must be a path, got int 123"):  # a raw TypeError before
        prepare_output_dir(123)


# -- cues a player shows -----------------------------------------------------------------------------------------

def _cue_lines(srt: str) -> list[str]:
    return [line for line in srt.splitlines() if "-->" in line]


def test_a_segment_timed_past_its_vad_chunks_audio_gets_a_visible_cue() -> None:
    """A 5 s vad chunk (padded to 30 s) whose second segment Whisper timed at 5.5-7.0 s: the stitch clamps it to
    the chunk's end, 15.0-15.0 s, and its cue had no length, so players never showed "Three four." It now lasts
    MIN_CUE_S into the silence after it, before the next chunk's cue; the json keeps the stitched times."""
    from asr_spec.audio.vad import SpeechSpan
    from asr_spec.transcribe.stitch import ChunkTokens, concat_chunks

    eot, ts, rate = 50257, 50364, 16_000
    a = ChunkTokens((ts, 1, 2, ts + 240, ts + 275, 3, 4, ts + 350, eot), SpeechSpan(10 * rate, 15 * rate, 0, 0, True,
                                                                                    False))
    b = ChunkTokens((ts, 5, ts + 100, eot), SpeechSpan(16 * rate, 19 * rate, 0, 0, False, True))
    stitched = concat_chunks([a, b], eot_id=eot, timestamp_begin_id=ts)
    assert [(s.start_s, s.end_s) for s in stitched.segments] == [(10.0, 14.8), (15.0, 15.0), (16.0, 18.0)]
    result = {"text": "", "segments": [dataclasses.replace(s, text=t) for s, t in
                                       zip(stitched.segments, ["One two.", "Three four.", "Five."])]}
    assert _cue_lines(render_srt(result)) == ["00:00:10,000 --> 00:00:14,800", "00:00:15,000 --> 00:00:15,500",
                                              "00:00:16,000 --> 00:00:18,000"]
    assert "00:00:15.000 --> 00:00:15.500\nThree four." in render_vtt(result)
    assert json.loads(render_json(result))["segments"][1]["end_s"] == 15.0


def test_cues_of_no_length_grow_into_free_time_or_borrow_from_a_neighbour() -> None:
    def srt(segments, **extra):
        return render_srt({"text": "", "segments": [{"start_s": a, "end_s": b, "text": t} for a, b, t in segments],
                           **extra})

    half = MIN_CUE_S
    # room after: forward; none after (the next cue starts there): backward; long cues as they were
    assert _cue_lines(srt([(1.0, 1.0, "a"), (3.0, 4.0, "b")])) == [
        f"00:00:01,000 --> {format_timestamp(1.0 + half)}", "00:00:03,000 --> 00:00:04,000"]
    assert _cue_lines(srt([(0.0, 2.0, "a"), (2.7, 2.7, "b"), (2.7, 4.0, "c")])) == [
        "00:00:00,000 --> 00:00:02,000", f"{format_timestamp(2.7 - half)} --> 00:00:02,700",
        "00:00:02,700 --> 00:00:04,000"]
    assert _cue_lines(srt([(1.0, 1.2, "a"), (1.25, 1.3, "b"), (1.3, 2.0, "c")])) == [  # a cue with a length
        "00:00:01,000 --> 00:00:01,200", "00:00:01,250 --> 00:00:01,300",  # keeps Whisper's times (a short word)
        "00:00:01,300 --> 00:00:02,000"]
    assert _cue_lines(srt([(1.0, 1.2, "a"), (1.3, 1.3, "b"), (1.4, 2.0, "c")])) == [  # only free time is taken
        "00:00:01,000 --> 00:00:01,200", "00:00:01,200 --> 00:00:01,400", "00:00:01,400 --> 00:00:02,000"]
    # no free time on either side: the cue it touches lends it time (the one before; the one after for the
    # first), so every cue is seen and there are as many as before (--max-words-per-cue holds)
    assert _cue_lines(srt([(0.0, 2.0, "a"), (2.0, 2.0, "b"), (2.0, 3.0, "c")])) == [
        f"00:00:00,000 --> {format_timestamp(2.0 - half)}", f"{format_timestamp(2.0 - half)} --> 00:00:02,000",
        "00:00:02,000 --> 00:00:03,000"]
    assert _cue_lines(srt([(0.0, 0.0, "a"), (0.0, 0.6, "b")])) == [  # at most half of its time
        "00:00:00,000 --> 00:00:00,300", "00:00:00,300 --> 00:00:00,600"]
    assert _cue_lines(srt([(0.0, 0.0, "a"), (0.0, 0.0, "b")])) == [  # the last grows, then lends
        "00:00:00,000 --> 00:00:00,250", "00:00:00,250 --> 00:00:00,500"]
    assert _cue_lines(srt([(0.0, 0.0, "a"), (0.0, 0.0, "b")], audio_s=0.0)) == ["00:00:00,000 --> 00:00:00,000"] * 2
    # the last cue stays inside the audio when its length is known; a cue without text takes no room
    assert _cue_lines(srt([(0.0, 4.8, "a"), (5.0, 5.0, "b")], audio_s=5.0)) == [
        "00:00:00,000 --> 00:00:04,800", "00:00:04,800 --> 00:00:05,000"]
    assert _cue_lines(srt([(1.0, 1.0, "a"), (1.1, 3.0, " ")])) == [f"00:00:01,000 --> {format_timestamp(1 + half)}"]
    # a neighbour of 1 ms has none to lend: the other one lends (a share under 1 ms left "21,180 --> 21,180")
    assert _cue_lines(srt([(21.179, 21.18, "a"), (21.18, 21.18, "b"), (21.18, 21.26, "c")])) == [
        "00:00:21,179 --> 00:00:21,180", "00:00:21,180 --> 00:00:21,220", "00:00:21,220 --> 00:00:21,260"]


def test_no_arrow_is_left_in_a_cue() -> None:
    """"a ---> b" became "a --> b" (one replacement made another arrow): a timing line to a player."""
    result = {"text": "", "segments": [{"start_s": 0.0, "end_s": 1.0, "text": " a ---> b ----> c --> d"}]}
    assert render_srt(result).splitlines()[2] == "a -> b -> c -> d"


# -- a transcript of another file with the same name is not replaced ----------------------------------------------

def _two_files_named_same(tmp_path: Path) -> tuple[Path, Path]:
    """`a/same.flac` and `b/same.flac` under `tmp_path`: two files with one name (the content does not matter)."""
    first, second = tmp_path / "a" / "same.flac", tmp_path / "b" / "same.flac"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(path.parent.name.encode())
    return first, second


def _run(out_dir: Path, source: str, formats: list[str]) -> dict[str, Path]:
    """What a run into `out_dir` does with one file (`Transcriber.iter_transcribe`, the CLI): check, prepare, write."""
    check_not_replacing(out_dir, ["same"], [source])
    prepare_output_dir(out_dir)
    result = {**_result(), "source": source}
    return write_outputs(result, out_dir, "same", formats, source=source)


@pytest.mark.parametrize("formats", [["txt"], ["srt", "vtt"], ["json", "txt"]])
def test_a_transcript_of_another_file_with_the_same_name_is_not_replaced(tmp_path: Path, formats: list[str]) -> None:
    """Two runs over two folders holding the same file name, into one output folder: the second is refused, with
    txt (or srt / vtt) alone too, where no json names the source (they replaced the first's without a word)."""
    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    kept = _run(out_dir, str(first), formats)[formats[0]].read_text(encoding="utf-8")
    _run(out_dir, str(first), formats)  # a rerun of the same file replaces its own
    with pytest.raises(InputError) as refused:
        _run(out_dir, str(second), formats)
    message = str(refused.value)
    assert f"holds the transcript of {first}; {second} would replace it" in message and "\n" not in message
    assert (out_dir / f"same.{formats[0]}").read_text(encoding="utf-8") == kept
    first.unlink()  # a source that no longer resolves cannot be told apart: replaced, as a rerun's own is
    _run(out_dir, str(second), formats)


def test_the_sources_index_holds_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file given relative to the folder a run started in is still told apart from a run started elsewhere."""
    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    _run(out_dir, "a/same.flac", ["txt"])
    monkeypatch.chdir(second.parent)
    with pytest.raises(InputError, match=f"holds the transcript of {first}; same.flac would replace it"):
        _run(out_dir, "same.flac", ["txt"])


@pytest.mark.parametrize("foreign", [b"\xff\xfe not json", b"[1, 2]", b'{"same": 3}', None])
def test_a_corrupt_sources_index_does_not_break_a_run(tmp_path: Path, foreign: bytes | None) -> None:
    """Unreadable or foreign content where the index goes (None: a folder) is ignored, never fatal."""
    first, _ = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    index = out_dir / SOURCES_INDEX
    if foreign is None:
        index.mkdir()
    else:
        index.write_bytes(foreign)
    paths = _run(out_dir, str(first), ["txt"])
    assert paths["txt"].read_text(encoding="utf-8") == "Hello world.\n<Second> line & more\n"
    if foreign is not None:  # the foreign line skipped, the run's recorded after it
        assert read_sources(out_dir) == {"same": str(first)}


def test_a_json_of_a_file_given_relative_to_another_folder_is_not_replaced(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs started in two folders, each given `same.flac` (two files), into one output folder writing json:
    the second is refused (the json's "source" is the path as given, "same.flac", which named the second run's own
    file from its folder: the first transcript was replaced without a word)."""
    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    monkeypatch.chdir(first.parent)
    kept = _run(out_dir, "same.flac", ["json", "txt"])["txt"].read_text(encoding="utf-8")
    monkeypatch.chdir(second.parent)
    with pytest.raises(InputError, match=f"same.json: holds the transcript of {first}; same.flac would replace it"):
        _run(out_dir, "same.flac", ["json", "txt"])
    assert (out_dir / "same.txt").read_text(encoding="utf-8") == kept
    monkeypatch.chdir(first.parent)
    _run(out_dir, "same.flac", ["json", "txt"])  # a rerun of the same file replaces its own


def test_a_folder_written_before_the_index_is_told_from_its_json(tmp_path: Path) -> None:
    """A json naming its source, in a folder without the index (as runs wrote before the index held every run's),
    still keeps another file's run from replacing it."""
    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    _run(out_dir, str(first), ["json"])
    (out_dir / SOURCES_INDEX).unlink()
    with pytest.raises(InputError, match=f"holds the transcript of {first}; {second} would replace it"):
        _run(out_dir, str(second), ["json"])


def test_the_sources_index_is_kept(tmp_path: Path) -> None:
    """`prepare_output_dir` removes stale temporary files, not the index (nor an old one left by a killed write of
    it: that goes); a run writing a json records its source in the index too."""
    first, _ = _two_files_named_same(tmp_path)
    _run(tmp_path / "with-json", str(first), ["txt", "json"])
    assert sorted(p.name for p in (tmp_path / "with-json").iterdir()) == [SOURCES_INDEX, "same.json", "same.txt"]
    out_dir = tmp_path / "out"
    _run(out_dir, str(first), ["txt"])
    stale = out_dir / f".{SOURCES_INDEX}.x8k2.tmp"
    stale.write_text("partial")
    long_ago = time.time() - 3600
    for path in (out_dir / SOURCES_INDEX, stale):
        os.utime(path, (long_ago, long_ago))
    assert prepare_output_dir(out_dir) == 1
    assert sorted(p.name for p in out_dir.iterdir()) == [SOURCES_INDEX, "same.txt"]


def test_runs_sharing_a_folder_keep_every_entry_of_the_index(tmp_path: Path) -> None:
    """Two runs writing into one folder at once each read, merge and write the index: 400 records made by two
    processes kept 231 (a lost entry leaves its transcripts unprotected); they now take turns."""
    import threading

    out_dir = tmp_path / "out"
    out_dir.mkdir()

    def run(name: str) -> None:
        for i in range(60):
            write_outputs({**_result(), "source": f"/{name}/{i}.flac"}, out_dir, f"{name}{i}", ["txt"],
                          source=f"/{name}/{i}.flac")

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b", "c")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(read_sources(out_dir)) == 180


def test_transcripts_of_no_file_take_their_stems_entry_out_of_the_index(tmp_path: Path) -> None:
    """Transcripts written without a source (an array's, `input-0`) over an earlier file's of that stem: the
    file's entry spoke for them, so a later run of another file was refused naming the wrong source, or the
    array's transcripts were replaced; the entry goes."""
    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    _run(out_dir, str(first), ["txt"])
    write_outputs(_result(), out_dir, "same", ["txt"])
    assert read_sources(out_dir) == {}
    _run(out_dir, str(second), ["txt"])  # the transcripts said nothing of their source: replaced


def test_recording_a_source_appends_one_line_to_the_index(tmp_path: Path) -> None:
    """The index is a journal: each transcript written adds one line, the last of a stem winning (rewritten whole
    per file, 3,000 files into one folder took 5 s, and 100,000 would have taken hours)."""
    for i in range(300):
        write_outputs(_result(), tmp_path, f"f{i}", ["txt"], source=f"/archive/{i}.flac")
    index = tmp_path / SOURCES_INDEX
    before = index.read_bytes()
    write_outputs(_result(), tmp_path, "f7", ["txt"], source="/elsewhere/7.flac")
    write_outputs(_result(), tmp_path, "f8", ["txt"])  # an array's transcripts: the stem's entry forgotten
    assert index.read_bytes() == before + b'["f7", "/elsewhere/7.flac"]\n["f8", null]\n'
    sources = read_sources(tmp_path)
    assert len(sources) == 299 and sources["f7"] == "/elsewhere/7.flac" and "f8" not in sources


def test_the_index_is_compacted_before_a_run(tmp_path: Path) -> None:
    """Files transcribed again add lines; `prepare_output_dir` rewrites a journal holding more than twice as many
    lines as stems (plus a margin) with one line a stem, the same entries."""
    for _ in range(4):
        for i in range(60):
            write_outputs(_result(), tmp_path, f"f{i}", ["txt"], source=f"/archive/{i}.flac")
    index = tmp_path / SOURCES_INDEX
    assert len(index.read_bytes().splitlines()) == 240
    expected = read_sources(tmp_path)
    prepare_output_dir(tmp_path)
    lines = index.read_bytes().splitlines()
    assert len(lines) == 61 and json.loads(lines[0])["compacted"] == 60 and read_sources(tmp_path) == expected
    for i in range(60):  # twice the compacted entries and the margin, counted (not parsed) before each run
        write_outputs(_result(), tmp_path, f"f{i}", ["txt"], source=f"/archive/{i}.flac")
    prepare_output_dir(tmp_path)
    assert len(index.read_bytes().splitlines()) == 121  # left as it is
    for i in range(70):
        write_outputs(_result(), tmp_path, f"f{i % 60}", ["txt"], source=f"/archive/{i % 60}.flac")
    prepare_output_dir(tmp_path)
    assert len(index.read_bytes().splitlines()) == 61 and read_sources(tmp_path) == expected


def test_a_torn_last_line_of_the_index_loses_no_later_entry(tmp_path: Path) -> None:
    """A run killed while appending leaves a line without its newline: the next line starts anew, not glued to it
    (and so lost with it)."""
    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / SOURCES_INDEX).write_bytes(b'["torn", "/x')
    _run(out_dir, str(first), ["txt"])
    assert read_sources(out_dir) == {"same": str(first)}
    with pytest.raises(InputError, match=f"holds the transcript of {first}"):
        _run(out_dir, str(second), ["txt"])


def test_the_earlier_json_index_still_protects_its_transcripts(tmp_path: Path) -> None:
    """A folder written by the version whose index was one json object (`.asr-spec-sources.json`) keeps another
    file's run from replacing its transcripts; `prepare_output_dir` folds it into the journal and removes it."""
    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "same.txt").write_text("kept\n", encoding="utf-8")
    old = out_dir / ".asr-spec-sources.json"
    old.write_text(json.dumps({"same": str(first)}), encoding="utf-8")
    with pytest.raises(InputError, match=f"holds the transcript of {first}; {second} would replace it"):
        _run(out_dir, str(second), ["txt"])
    prepare_output_dir(out_dir)
    assert not old.exists() and read_sources(out_dir) == {"same": str(first)}
    with pytest.raises(InputError, match=f"holds the transcript of {first}; {second} would replace it"):
        _run(out_dir, str(second), ["txt"])


def test_the_index_lives_where_flock_is_refused_and_names_are_not_utf8(tmp_path: Path, monkeypatch) -> None:
    """NFS refuses flock on a folder opened to read (EBADF): every record failed, the protection gone without a
    word (a diff reviewer's). A file name that is not UTF-8 (its bytes as surrogates) raised UnicodeEncodeError out
    of the record, after the transcripts were written, and the file was reported failed."""
    import errno
    import fcntl

    def refused(handle, op):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", refused)
    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    _run(out_dir, str(first), ["txt"])
    with pytest.raises(InputError, match=f"holds the transcript of {first}"):
        _run(out_dir, str(second), ["txt"])
    odd = os.fsdecode(b"/archive/caf\xe9.wav")  # latin-1 bytes in a UTF-8 file system: a lone surrogate
    write_outputs(_result(), out_dir, "cafe", ["txt"], source=odd)
    assert read_sources(out_dir)["cafe"] == odd
    prepare_output_dir(out_dir)  # compaction writes it back the same
    assert read_sources(out_dir)["cafe"] == odd


def test_a_transcript_named_like_the_old_index_is_not_taken_for_it(tmp_path: Path) -> None:
    """An input `.asr-spec-sources.wav` written as json has the thirty-ninth session's index name: it was read as
    an index and removed by the next run's compaction (a diff reviewer's). Only an object of absolute paths is."""
    out_dir = tmp_path / "out"
    transcript = write_outputs(_result(), out_dir, ".asr-spec-sources", ["json"], source="/a/.asr-spec-sources.wav")
    prepare_output_dir(out_dir)
    assert transcript["json"].is_file() and "text" not in read_sources(out_dir)


def test_a_folder_without_transcripts_of_the_inputs_is_not_read(tmp_path: Path, monkeypatch) -> None:
    """`check_not_replacing` read the whole journal every call: a program transcribing one file a call into a
    folder of 100,000 transcripts parsed it each time. Nothing of the inputs there, nothing to read."""
    from asr_spec.transcribe import outputs

    first, _ = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    _run(out_dir, str(first), ["txt"])

    def unread(folder, stems=None):
        raise AssertionError("the index was read")

    monkeypatch.setattr(outputs, "read_sources", unread)
    check_not_replacing(out_dir, ["other"], ["/x/other.flac"])
    with pytest.raises(AssertionError, match="the index was read"):
        check_not_replacing(out_dir, ["same"], [str(first)])


def test_two_runs_writing_one_name_at_once_do_not_replace_each_other(tmp_path: Path) -> None:
    """An archive reviewer's two runs started at once into one folder, each over a folder holding clip01 ...: both
    passed their checks at start (nothing written yet) and the second's transcripts replaced the first's, both
    saying 24/24 files done. The check is made again when a transcript is written, in the same turn of the folder's
    lock as its writes: the second of two writers of one name is refused and writes nothing."""
    import threading

    first, second = _two_files_named_same(tmp_path)
    out_dir = tmp_path / "out"
    start = threading.Barrier(2)
    outcome: dict[str, str] = {}

    def run(source: Path) -> None:
        start.wait()
        try:
            write_outputs({**_result(), "text": str(source)}, out_dir, "same", ["txt", "json"], source=str(source))
            outcome[str(source)] = "written"
        except InputError as err:
            outcome[str(source)] = str(err)

    threads = [threading.Thread(target=run, args=(path,)) for path in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcome.values()).count("written") == 1
    winner = next(source for source, said in outcome.items() if said == "written")
    loser = next(source for source in outcome if source != winner)
    assert f"holds the transcript of {winner}; {loser} would replace it" in outcome[loser]
    assert json.loads((out_dir / "same.json").read_text(encoding="utf-8"))["text"] == winner
    assert read_sources(out_dir) == {"same": winner}


def test_the_index_is_read_from_where_this_process_last_read_it(tmp_path: Path, monkeypatch) -> None:
    """Each transcript written checks the index (a run's own writes too): read whole each time, a folder of
    100,000 transcripts cost a parse of 100,000 lines a file. Only the lines appended since are parsed; after a
    compaction (a new file) it is read whole again, with the same entries."""
    from asr_spec.transcribe import files

    for i in range(100):
        write_outputs(_result(), tmp_path, f"f{i}", ["txt"], source=f"/archive/{i}.flac")
    assert len(read_sources(tmp_path)) == 100
    parsed = []
    real = files._parsed
    monkeypatch.setattr(files, "_parsed", lambda lines: parsed.append(len(lines)) or real(lines))
    write_outputs(_result(), tmp_path, "f100", ["txt"], source="/archive/100.flac")
    assert len(read_sources(tmp_path)) == 101 and parsed[-1] == 1
    assert read_sources(tmp_path, ["f7", "none"]) == {"f7": "/archive/7.flac"}  # the stems asked for, alone
    for i in range(200):
        write_outputs(_result(), tmp_path, f"f{i % 50}", ["txt"], source=f"/archive/{i % 50}.flac")
    before = read_sources(tmp_path)
    prepare_output_dir(tmp_path)  # compacted: a new file, read whole
    assert read_sources(tmp_path) == before and parsed[-1] == 102


def test_a_journal_another_run_compacted_is_read_again_whatever_its_inode(tmp_path: Path) -> None:
    """The cache of what this process read trusted (device, inode) and a newline before its offset: a compaction by
    another run, in a file whose freed inode came back with lines of equal width lined up at the old offset, left
    this process's entries stale, and a compaction through that cache wrote the loss to disk (a diff reviewer's,
    the journal rewritten in place to stand for the reused inode)."""
    for i in range(100):
        write_outputs(_result(), tmp_path, f"e{i:05d}", ["txt"], source=f"/archive/e{i:05d}.flac")
    assert len(read_sources(tmp_path)) == 100
    index = tmp_path / SOURCES_INDEX
    others = [json.dumps([f"o{i:05d}", f"/archive/o{i:05d}.flac"]) for i in range(200)]
    with open(index, "r+", encoding="ascii") as journal:  # in place: the same inode, the same line widths
        journal.write("\n".join(others) + "\n")
    assert len(read_sources(tmp_path)) == 200 and "e00000" not in read_sources(tmp_path)
