"""The kernel extension's LSTM recurrence (`cpu_lstm.h`, silero-vad's LSTM: `audio.silero.lstm_kernel`): the cell's
equations within float rounding of torch's ops, its state carried from call to call exactly, the sizes it refuses,
and on real speech the VAD's probabilities and speech frames as torch's loop gives them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asr_spec.audio import silero
from asr_spec.audio.silero import LSTM_KERNEL_ENV, kernel_steps, lstm_kernel, lstm_steps
from asr_spec.engine import cpu_attention

# the kernel's values against torch's ops: each step's products and exp rounded differently (~1e-7 a value),
# carried through the state from step to step
TOLERANCE = 5e-6


def _operands(n_hidden: int, n_steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gates_in = 2 * torch.randn(n_steps, 4 * n_hidden, generator=gen)  # saturated gates too
    w_hh_t = torch.randn(n_hidden, 4 * n_hidden, generator=gen) / n_hidden ** 0.5
    state = (torch.randn(1, n_hidden, generator=gen), torch.randn(1, n_hidden, generator=gen))
    return gates_in, w_hh_t, state


@pytest.mark.parametrize("n_hidden", [128, 48, 16])  # silero-vad's, and other multiples of 16
def test_the_kernel_is_the_lstm_cell_within_rounding(kernel, monkeypatch, n_hidden):
    monkeypatch.delenv(LSTM_KERNEL_ENV, raising=False)
    assert lstm_kernel(n_hidden)
    gates_in, w_hh_t, state = _operands(n_hidden, 300)
    kept = tuple(x.clone() for x in state)
    out, (h, c) = kernel_steps(gates_in, w_hh_t, state)
    want, (h_want, c_want) = lstm_steps(gates_in, w_hh_t, state)  # torch's ops (= the plain expressions)
    assert out.shape == want.shape == (1, 300, n_hidden) and h.shape == c.shape == (1, n_hidden)
    assert (out - want).abs().max().item() < TOLERANCE
    assert (c - c_want).abs().max().item() < TOLERANCE and (h - h_want).abs().max().item() < TOLERANCE
    strided = w_hh_t.t().contiguous().t()  # the same weight, not contiguous (a transposed module weight's view)
    assert not strided.is_contiguous() and torch.equal(kernel_steps(gates_in, strided, state)[0], out)
    assert all(torch.equal(a, b) for a, b in zip(state, kept))  # the caller's state is not written to
    zeros = (torch.zeros(1, n_hidden), torch.zeros(1, n_hidden))
    assert torch.equal(kernel_steps(gates_in, w_hh_t, None)[0], kernel_steps(gates_in, w_hh_t, zeros)[0])


def test_the_state_carried_between_calls_gives_the_steps_of_one_call(kernel):
    """A stream's VAD calls the recurrence block by block: split anywhere, the outputs are those of one call, bit for
    bit (each step's arithmetic is its own, whatever the run it is in)."""
    gates_in, w_hh_t, state = _operands(128, 90, seed=1)
    whole, (h, c) = kernel_steps(gates_in, w_hh_t, state)
    parts, carried = [], state
    for block in gates_in.split([1, 40, 7, 42]):
        out, carried = kernel_steps(block, w_hh_t, carried)
        parts.append(out[0])
    assert torch.equal(torch.cat(parts)[None], whole)
    assert torch.equal(carried[0], h) and torch.equal(carried[1], c)


def test_sizes_the_kernel_does_not_take_are_left_to_torch(kernel, monkeypatch):
    monkeypatch.delenv(LSTM_KERNEL_ENV, raising=False)
    assert lstm_kernel(128) and not lstm_kernel(20)  # a hidden size not a multiple of 16: torch's loop
    gates_in, w_hh_t, (h, c) = _operands(20, 3)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_attention.extension().lstm_steps(gates_in, w_hh_t, h, c)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_attention.extension().lstm_steps(gates_in.double(), w_hh_t, h, c)
    monkeypatch.setenv(LSTM_KERNEL_ENV, "1")
    assert not lstm_kernel(128)


def test_silero_through_the_kernel_finds_the_frames_torch_finds_on_real_speech(kernel, monkeypatch):
    """The VAD over a 75 s recording (silero-vad's own weights): probabilities within 1e-5 of the torch loop's, the
    same frames at and above the speech threshold and below its lower bar."""
    pytest.importorskip("silero_vad")
    from asr_spec.audio.loading import load_audio
    from asr_spec.audio.vad import FRAME_SAMPLES, NEG_THRESHOLD_GAP, VadOptions

    samples = load_audio("tests/fixtures/speech/long_75s.flac")
    samples = np.pad(samples, (0, (-len(samples)) % FRAME_SAMPLES))
    vad = silero.SileroVad()
    assert vad._parts is not None  # the batched path, whose LSTM the kernel runs
    probs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(LSTM_KERNEL_ENV, switch)
        vad.reset()
        probs[switch] = vad(samples)
    torch_loop, ours = probs["1"], probs["0"]
    assert (torch_loop > 0.9).sum() > 1000  # speech for most of the file
    assert 0 < np.abs(ours - torch_loop).max() < 1e-5
    on = VadOptions().threshold
    for bar in (on, on - NEG_THRESHOLD_GAP):
        assert np.array_equal(ours >= bar, torch_loop >= bar)
