"""Shared test helpers: tiny random Whisper models built in-process, the transformers greedy reference, and the
benchmarks' and scripts' modules."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import importlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

torch.set_num_threads(int(os.environ.get("ASR_SPEC_TEST_THREADS", "1")))
# dtype "auto" follows the CPU's class (asr_spec.models.cpu): pinned here to an AVX2-only CPU's (auto = float32) so that
# no test's dtype, nor a decision taken from the CPU's flags, depends on the CPU the suite runs on; subprocesses inherit
# it. What torch's oneDNN can do is still probed on the real CPU (`kernels.onednn_usable`: where it has native bf16
# products an fp32 target's draft runs as a bf16 copy, `DecodeOptions.draft_bf16`): a test asserts the rule there. Tests
# of the per-class decisions pass the capabilities explicitly; those of the bf16 path ask for bfloat16. Except in the
# runs that check the kernels as built for other flags (`UNPINNED_ENV`, tests/test_native_kernels.py: this very CPU's,
# or an AVX-512 CPU's emulated), which set ASR_SPEC_CPU_FLAGS themselves or leave it out.
UNPINNED_ENV = "ASR_SPEC_TEST_UNPINNED"
PINNED_FLAGS = "fpu sse2 avx avx2 fma"
if os.environ.get(UNPINNED_ENV) != "1":
    os.environ["ASR_SPEC_CPU_FLAGS"] = PINNED_FLAGS

EOT = 40  # in the 70-token test vocabulary of asr_spec.models.random_whisper
# how long a test waits for a server or a thread to reach a state it polls for: a deadline, not a count of polls, so
# that a loaded or slow machine gets as long as a quiet one (the wait ends as soon as the state is reached)
WAIT_S = 60.0


@functools.cache
def simde_headers() -> bool:
    """Whether g++ finds SIMDe's AVX-512 header (Debian's libsimde-dev), which an emulated AVX-512 build of the
    kernels includes (`cpu_attention.target_options`); asked of g++ once a process (each emulated build's test
    asks)."""
    try:
        found = subprocess.run(["g++", "-E", "-x", "c++", "-"], input="#include <simde/x86/avx512.h>\n",
                               capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return found.returncode == 0


def no_uvicorn(monkeypatch, run: Callable[[object], object]) -> None:
    """`asr-spec serve` without serving: `run_server`'s uvicorn server replaced by one whose `run()` calls
    `run(app)` and returns (the command then exits 0)."""
    from types import SimpleNamespace

    import asr_spec.serve as serve

    monkeypatch.setattr(serve, "uvicorn_server", lambda app, **config: SimpleNamespace(run=lambda: run(app)))


def wait_until(ready: Callable[[], bool], timeout_s: float = WAIT_S, interval_s: float = 0.01) -> bool:
    """Poll `ready` every `interval_s` until it says True or `timeout_s` of wall time pass; its last answer."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            return ready()
        time.sleep(interval_s)
    return True


async def wait_until_async(ready: Callable[[], bool], timeout_s: float = WAIT_S, interval_s: float = 0.01) -> bool:
    """`wait_until` in a coroutine: the event loop runs between polls."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            return ready()
        await asyncio.sleep(interval_s)
    return True


@pytest.fixture(params=["kernel", "torch"])
def attention_path(request, monkeypatch) -> str:
    """A test run twice: CPU attention through the C++ kernel (`engine/cpu_attention.py`; skipped where it cannot
    be built or ASR_SPEC_NO_CPU_KERNELS is set) and through torch's products (the kernel disabled)."""
    from asr_spec.engine import cpu_attention

    if request.param == "torch":
        monkeypatch.setenv(cpu_attention.DISABLE_ENV, "1")
    elif not cpu_attention.fused_attention_usable(torch.device("cpu"), torch.float32):
        pytest.skip("the CPU attention kernel is not in use here (not built, or ASR_SPEC_NO_CPU_KERNELS set)")
    return request.param


@pytest.fixture
def no_amx_tiles(monkeypatch) -> str:
    """The flags the CPU kernels are built for (`cpu_attention.cpu_flags`) without AMX tiles, where their bf16
    decisions (`cpu_linear.fused_linear_usable`, `cpu_attention.encoder_attention_usable`) take the kernel: the
    suite's pinned AVX2 flags are such, a native run on an AMX Xeon is not. Use after the kernel is built (it is
    named after the flags). Returns the flags."""
    from asr_spec.engine import cpu_attention

    flags = " ".join(flag for flag in cpu_attention.cpu_flags().split() if not flag.startswith("amx_"))
    monkeypatch.setattr(cpu_attention, "cpu_flags", lambda: flags)
    return flags


@pytest.fixture
def kernel(monkeypatch) -> None:
    """The kernel extension (`engine/cpu_attention.py`) built and not disabled; skipped where it cannot be built
    here."""
    from asr_spec.engine import cpu_attention

    monkeypatch.delenv(cpu_attention.DISABLE_ENV, raising=False)
    if not cpu_attention.fused_attention_usable(torch.device("cpu"), torch.float32):
        pytest.skip("the CPU kernel extension could not be built here")


@pytest.fixture
def thin_kernel(kernel) -> None:
    """`kernel`, with the thin products in use for fp32 (`cpu_linear.fused_linear_usable`)."""
    from asr_spec.engine import cpu_linear

    if not cpu_linear.fused_linear_usable(torch.device("cpu"), torch.float32):
        pytest.skip("the thin products are not in use here")


@pytest.fixture
def thin_kernel_no_amx(thin_kernel, no_amx_tiles) -> None:
    """The kernel built (first), then flags without AMX tiles (`no_amx_tiles`): where bf16 decoders take the thin
    products too."""


REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """The module NAME of the benchmarks package, else of the scripts package (both at the repository root, which
    pyproject's pytest settings put on sys.path), imported as a user's `python -m` runs it."""
    package = "benchmarks" if (REPO / "benchmarks" / f"{name}.py").is_file() else "scripts"
    yield importlib.import_module(f"{package}.{name}")


def tiny_target(seed: int = 3, eos_boost: float = 2.0, multilingual: bool = True):
    """A random 70-token Whisper whose rows end with <|endoftext|> at varied lengths (or run to the limit)."""
    from asr_spec.testing import random_whisper

    model = random_whisper("test", seed=seed, vocab_size=70, init_std=0.2, multilingual=multilingual)
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[EOT] *= eos_boost
    return model


def perturbed(model, scale: float, *, seed: int = 0, encoder: bool = True):
    """A copy of `model` with Gaussian noise of relative size `scale` on its weights (the encoder's too or not)."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if not encoder and ".encoder." in f".{name}":
                continue
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp(min=1e-3))
    return out


def first_divergence(model, features_row: torch.Tensor, ours, reference, n_prompt: int, timestamps: bool):
    """None when the token sequences `ours` and `reference` (prompt + generated) are equal; else (i, gap, top): the
    first index where they differ and the top-2 gap and top value of `model`'s rule-applied scores after the common
    prefix reference[:i] (our rules: checked equal to transformers' processors in tests/test_rules.py)."""
    from asr_spec.engine.rules import LogitRules, WhisperTokens

    ours, reference = list(ours), list(reference)
    if ours == reference:
        return None
    i = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
    assert i >= n_prompt, f"prompts differ: {ours[:n_prompt]} vs {reference[:n_prompt]}"
    tokens = WhisperTokens.from_generation_config(model.generation_config, 448)
    rules = LogitRules(tokens, model.config.vocab_size, timestamps, torch.device("cpu"))
    prefix = torch.tensor([reference[:i]])
    with torch.no_grad():
        logits = model(input_features=features_row[None].to(model.device, model.dtype),
                       decoder_input_ids=prefix.to(model.device)).logits[:, -1:].float().cpu()
    top2 = rules.apply(logits, prefix, torch.tensor([i]), torch.tensor([n_prompt]))[0, 0].topk(2).values
    return i, float(top2[0] - top2[1]), float(top2[0])


def hf_greedy(model, features: torch.Tensor, *, language=None, task=None, timestamps=False, max_new_tokens=None):
    """transformers' own greedy decoding of one chunk, alone (batch 1): (prompt, generated tokens)."""
    kwargs = dict(return_timestamps=timestamps, force_unique_generate_call=True, return_dict_in_generate=True)
    if language is not None:
        kwargs.update(language=language, task=task or "transcribe")
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    seq = model.generate(features[None], **kwargs).sequences[0].tolist()
    return seq
