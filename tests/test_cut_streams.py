"""benchmarks/cut_streams.py's reading of a close decode's trace line (the benchmark itself runs real weights)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.cut_streams import last_segment

FRAMES_PER_S = 16_000 / 512


def test_the_last_closed_segment_of_a_close_line_is_measured_against_the_audio() -> None:
    line = ("stream 0 decode 3 (close) of 43.40-60.00 s, heard 60.00 s: <|0.00|> Fine.<|5.00|><|14.00|> Because"
            " you are the one.<|19.00|><|eot|> | committed ' Fine.', buffer from 60.00 s, final")
    speech = np.zeros(int(61 * FRAMES_PER_S), bool)
    speech[int(59.68 * FRAMES_PER_S):int(60.0 * FRAMES_PER_S)] = True  # "Because", cut off
    per_word, past, n_words, text = last_segment(line, speech)
    assert (n_words, text) == (5, "Because you are the one.")
    assert past == pytest.approx(2.4)
    assert per_word == pytest.approx(10 * 512 / 16_000 / 5)  # 10 speech frames over five words
    assert last_segment(line.replace("(close)", "(step)"), speech) is None
    assert last_segment("stream 0 decode 1 (close) of 0.00-1.00 s, heard 1.00 s: <|0.00|><|eot|> | committed ''",
                        speech) is None
