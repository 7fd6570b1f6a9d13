"""Running the static step: eager, one CUDA graph per (rows bucket, n_keys bucket, K), or a compiled function; and
the one read per step the scheduler needs from the device (finished rows, longest row), consumed one step late on
CUDA.

The step (speculative.step) has static shapes for a given (rows, n_keys, K) and updates its state in place, so
replaying a graph captured on the same state tensors is the same computation as running it eagerly. The contract
that makes this true: a graph is replayed only on the tensors it was captured on. The engine keeps one static
state (engine/state.py), reset in place run after run, and drops the graphs (`drop_graphs`) when it replaces it;
tests/test_capture_contract.py checks the addresses every replayed step touches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from asr_spec.engine.hypothesis import Hypotheses
from asr_spec.engine.rules import LogitRules
from asr_spec.engine.speculative import DecodeState, Models, step

KEY_BUCKET = 32  # n_keys is rounded up to a multiple of this: at most 14 buckets over Whisper's 448 positions

StepFn = Callable[..., None]  # speculative.step: (models, rules, state, k, n_keys[, hypotheses])


def pin_attention(device: torch.device) -> None:
    """On CUDA, take cuDNN out of the attention backends PyTorch's SDPA picks from (process-wide; flash,
    memory-efficient and math stay): in fp16/bf16 on Hopper SDPA may choose cuDNN, whose recent versions have given
    silently wrong results, and which builds a new plan for every new key bucket. Every Engine on CUDA calls it."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def rows_bucket(n_live: int, n_slots: int) -> int:
    """Rows a captured step runs on: `n_live` rounded up to a power of two, at most `n_slots` (the run's state).
    The rows past n_live are free slots, finished, so the step masks them; a batch of 64 slots has 7 row buckets
    where it would have 64 row counts."""
    return min(1 << (n_live - 1).bit_length(), n_slots)


def all_n_keys_buckets(n_positions: int) -> list[int]:
    """Every value `n_keys_bucket` can give for caches of `n_positions` positions, ascending."""
    return [*range(KEY_BUCKET, n_positions, KEY_BUCKET), n_positions]


def n_keys_bucket(max_len: int, k: int, lag: int, n_positions: int) -> int:
    """Keys a step must attend to, rounded up to a bucket: above every position a row can reach this step.

    max_len: the longest row's n_tok as last read from the device, `lag` steps ago (each step adds <= k + 1; k is
    max(K, hypothesis width) in a hypothesis step).
    """
    need = max_len + (k + 1) * (lag + 1)
    return min(-(-need // KEY_BUCKET) * KEY_BUCKET, n_positions)


class StepRunner:
    """Calls the step eagerly, through `wrap(step)` (e.g. torch.compile), or as lazily captured CUDA graphs.

    mode: "eager"; "cuda-graphs" (CUDA only: the first call of each (rows, n_keys, K, sampling, hypothesis width)
    runs eagerly as the warm-up, the graph is captured right after and replayed from the next call on, until
    `drop_graphs`); or "wrapped" with `wrap`. Capture is in thread-local mode: another thread of the process (a
    server's) may use CUDA meanwhile, as long as it does not use this capture's stream.
    """

    def __init__(self, mode: str = "eager", wrap: Callable[[StepFn], StepFn] | None = None):
        if mode not in ("eager", "cuda-graphs", "wrapped"):
            raise ValueError(f"step mode must be eager, cuda-graphs or wrapped, got {mode!r}")
        if (mode == "wrapped") != (wrap is not None):
            raise ValueError("a wrapper is given exactly with mode 'wrapped'")
        self.mode = mode
        self.fn: StepFn = wrap(step) if wrap is not None else step
        self.graphs: dict[tuple[int, int, int, bool, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.stream = None  # the side stream of the warm-ups and captures (made at the first capture)

    def step_rows(self, n_live: int, n_slots: int) -> int:
        """Rows the step runs on when `n_live` rows are live in a state of `n_slots`: a bucket when graphs are
        captured (few captures: `rows_bucket`), else exactly the live rows (no masked row computed for nothing)."""
        return rows_bucket(n_live, n_slots) if self.mode == "cuda-graphs" else n_live

    def drop_graphs(self) -> None:
        """Forget every captured graph (and their memory pool): the state they were captured on is being replaced."""
        self.graphs.clear()
        self.pool = None

    def __call__(self, m: Models, rules: LogitRules, st: DecodeState, k: int, n_keys: int,
                 hyp: Hypotheses | None = None) -> None:
        """Run the step once (eager steps in inference mode, ~0.3 ms a step less dispatch; traced and captured
        ones in no_grad: inference tensors cannot be traced). hyp: the rows' hypotheses in a hypothesis step."""
        args = (m, rules, st, k, n_keys) if hyp is None else (m, rules, st, k, n_keys, hyp)
        if self.mode == "eager":
            with torch.inference_mode():
                self.fn(*args)
        elif self.mode == "wrapped":
            with torch.no_grad():
                self.fn(*args)
        else:
            with torch.no_grad():
                self._graph_step(args)

    def _graph_step(self, args: tuple) -> None:
        """Replay the CUDA graph of this (rows, n_keys, K, sampling, hypothesis width), or run the step eagerly and
        capture it for next time."""
        rules, st, k, n_keys = args[1:5]
        width = args[5].width if len(args) > 5 else 0
        key = (st.n_tok.shape[0], n_keys, k, rules.sampling, width)
        graph = self.graphs.get(key)
        # on the state's device: streams, captures and replays without a device are the current device's (cuda:0
        # for `--device cuda:1`: the capture recorded nothing, every replay did nothing)
        device = st.n_tok.device
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # (CPU: tests' doubles)
            if graph is not None:
                self._replay(key, graph, args)
            else:
                self.graphs[key] = self._capture(key, args)

    def _replay(self, key: tuple, graph: torch.cuda.CUDAGraph, args: tuple) -> None:
        """Run the step of `args` by replaying `graph`, captured for `key` (a test double checks the contract)."""
        graph.replay()

    def _capture(self, key: tuple, args: tuple) -> torch.cuda.CUDAGraph:
        """Run the step of `args` once (the warm-up, eagerly on a side stream, as torch.cuda.graphs asks), then
        capture it: the graph of `key`, replayed from the next call on."""
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            step(*args)
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # records, does not run: the state is not advanced twice; thread_local: only this thread's CUDA calls are
        # checked against the capture (global mode fails a capture when a server thread touches CUDA meanwhile)
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step(*args)
        return graph


class HostReader:
    """The scheduler's one read per step: each row's finish code and the longest row's n_tok.

    On CPU it is read at once (a cheap sync). On CUDA it is copied into pinned memory with non_blocking=True
    after the step is queued and consumed one step late, so the host never waits for the step it just queued:
    `lag` is then 1 and a row that finished is seen (and refilled) one step later, masked meanwhile.
    """

    def __init__(self, n_rows: int, device: torch.device, lag: int | None = None):
        """lag: None = 1 on CUDA, 0 elsewhere; 1 on CPU runs the CUDA scheduling (a test of it without a GPU)."""
        self.cuda = device.type == "cuda"
        self.device = device
        self.lag = (1 if self.cuda else 0) if lag is None else lag
        self.buf = torch.zeros(n_rows + 1, dtype=torch.long, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending: int | None = None  # rows of the read in flight
        self.tag = 0

    def push(self, st: DecodeState, tag: int) -> None:
        """Queue the read of the state after the step numbered `tag`."""
        n = st.finish.shape[0]
        self.buf[:n].copy_(st.finish, non_blocking=self.cuda)
        self.buf[n].copy_(st.n_tok.max(), non_blocking=self.cuda)
        if self.cuda:  # after the copies on the state's device's stream (not the current device's: cuda:0)
            self.event.record(torch.cuda.current_stream(self.device))
        self.pending, self.tag = n, tag

    def after_step(self, st: DecodeState, tag: int) -> tuple[int, list[int], int] | None:
        """Queue the read of the state after the step numbered `tag` and return the read due now (see `pull`):
        that step's at lag 0, the previous step's at lag 1 (None after the first step)."""
        if self.lag == 0:
            self.push(st, tag)
        read = self.pull()
        if self.lag:
            self.push(st, tag)
        return read

    def pull(self) -> tuple[int, list[int], int] | None:
        """(tag, finish codes of the rows after that step, longest n_tok) of the read pushed last; None if none."""
        if self.pending is None:
            return None
        if self.cuda:
            self.event.synchronize()
        values = self.buf[: self.pending + 1].tolist()
        self.pending = None
        return self.tag, values[:-1], values[-1]
