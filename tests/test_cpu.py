"""CPU capabilities (asr_spec.models.cpu): the flags of the three CPU kinds this project has run on, parsed; the
dtype `auto` picks per device and class; the one function every caller resolves a dtype through."""

from __future__ import annotations

import pytest
import torch
from conftest import PINNED_FLAGS

from asr_spec.engine import cpu_attention, kernels
from asr_spec.engine.kernels import ANY_ROWS
from asr_spec.errors import InputError
from asr_spec.models import cpu
from asr_spec.models.loading import resolve_dtype

# /proc/cpuinfo flags lines (shortened to the parts that matter, in their real order) of the CPUs seen here
XEON_AMX = ("fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw "
            "avx512vl avx_vnni avx512_bf16 avx512vbmi avx512_vnni avx512_bitalg amx_bf16 avx512_fp16 amx_tile "
            "amx_int8")
EPYC_ZEN4 = ("fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw "
             "avx512vl avx512_bf16 avx512vbmi avx512_vnni avx512_bitalg")
EPYC_ZEN2 = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 sha_ni clzero"
CPUS = {"amx-bf16": XEON_AMX, "avx512-bf16": EPYC_ZEN4, "avx2": EPYC_ZEN2, "other": "fpu sse sse2"}


@pytest.fixture(autouse=True)
def _pinned_class(monkeypatch):
    """This file's tests read the decisions of the suite's pinned AVX2 class (conftest), also in a run that leaves
    the suite unpinned (`UNPINNED_ENV`): those of other classes pass their flags explicitly."""
    monkeypatch.setenv(cpu.FLAGS_ENV, PINNED_FLAGS)
    cpu.detect_cpu.cache_clear()
    yield
    monkeypatch.undo()
    cpu.detect_cpu.cache_clear()


@pytest.mark.parametrize("expected", list(CPUS))
def test_each_cpu_kind_parses_to_its_class(expected):
    caps = cpu.parse_cpu_flags(CPUS[expected])
    assert caps.cpu_class == expected
    assert caps.native_bf16 == (expected in ("amx-bf16", "avx512-bf16"))
    assert caps.vnni == (expected in ("amx-bf16", "avx512-bf16"))
    assert caps.avx2 == (expected != "other")


def test_features_are_whole_flags_not_substrings():
    """avx512_bf16 does not make avx2 or vnni, and a flag's prefix is no flag: "amx_bf16x" is not amx_bf16."""
    caps = cpu.parse_cpu_flags("avx512_bf16 amx_bf16x avx512_vnnix")
    assert (caps.amx_bf16, caps.avx512_bf16, caps.avx512_vnni, caps.avx2) == (False, True, False, False)
    assert caps.describe() == "avx512-bf16"
    assert cpu.parse_cpu_flags(XEON_AMX).describe() == "amx-bf16 (avx512-bf16, avx512-vnni, avx-vnni, avx2)"


def test_cpuinfo_text_gives_the_first_processor_and_its_model_name():
    text = (f"processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\n"
            f"flags\t\t: {XEON_AMX}\n\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: {EPYC_ZEN2}\n")
    caps = cpu.parse_cpuinfo(text)
    assert caps.cpu_class == "amx-bf16" and caps.model_name == "Intel(R) Xeon(R) Processor"
    assert caps.as_dict()["class"] == "amx-bf16" and caps.as_dict()["native_bf16"] is True
    assert cpu.parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd bf16\n") is None  # an ARM kernel's file


def test_the_environment_replaces_the_detected_flags(monkeypatch):
    """The suite pins an AVX2-only CPU (conftest), so `auto` is float32 here whatever the machine."""
    cpu.detect_cpu.cache_clear()
    try:
        assert cpu.detect_cpu().cpu_class == "avx2" and cpu.detect_cpu().source == "env"
        monkeypatch.setenv(cpu.FLAGS_ENV, EPYC_ZEN4)
        cpu.detect_cpu.cache_clear()
        assert cpu.detect_cpu().cpu_class == "avx512-bf16"
    finally:
        monkeypatch.undo()
        cpu.detect_cpu.cache_clear()


def test_without_cpuinfo_torch_says_what_it_can(monkeypatch, tmp_path):
    monkeypatch.delenv(cpu.FLAGS_ENV)
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "absent")
    cpu.detect_cpu.cache_clear()
    try:
        caps = cpu.detect_cpu()
        assert caps.source == "torch" and caps.cpu_class in cpu.CPU_CLASSES
    finally:
        monkeypatch.undo()
        cpu.detect_cpu.cache_clear()


# torch's cpuid probe on a Cascade Lake Xeon (AVX-512 and its int8 dot products, no bf16 ones), as it names them
CASCADE_LAKE_PROBE = {"avx2": True, "avx512_f": True, "avx512_bw": True, "avx512_vnni": True, "avx512_bf16": False,
                      "amx_tile": False, "amx_bf16": False, "num_physical_cores": 2, "cpu_name": "Intel Xeon"}


def test_without_cpuinfo_the_class_comes_from_torchs_cpuid_probe(monkeypatch, tmp_path):
    """Where /proc/cpuinfo is absent, torch's cpuid probe gives the same flag names: an AVX-512 CPU without bf16 dot
    products is no `avx512-bf16` one (oneDNN's own bf16 check says yes from AVX-512 on); without the probe, the
    dispatch capability as before."""
    monkeypatch.delenv(cpu.FLAGS_ENV)
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "absent")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: CASCADE_LAKE_PROBE)
    kernels.hardware_flags.cache_clear()
    cpu.detect_cpu.cache_clear()
    try:
        caps = cpu.detect_cpu()
        assert (caps.source, caps.cpu_class, caps.avx512_vnni, caps.avx512_bf16) == ("torch", "avx2", True, False)
        monkeypatch.delattr(torch.cpu, "get_capabilities")
        kernels.hardware_flags.cache_clear()
        cpu.detect_cpu.cache_clear()
        assert cpu.detect_cpu().source == "torch" and kernels.hardware_flags() is None
    finally:
        monkeypatch.undo()
        kernels.hardware_flags.cache_clear()
        cpu.detect_cpu.cache_clear()


def test_onednn_bf16_products_are_not_taken_where_the_cpu_emulates_them(monkeypatch):
    """oneDNN emulates bf16 products on AVX-512 CPUs without bf16 dot products (slower than fp32): the head's
    approximate product and the draft's bf16 copy must not go there (`kernels.onednn_usable`)."""
    cpu_device = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: CASCADE_LAKE_PROBE)
    kernels.hardware_flags.cache_clear()
    kernels.onednn_usable.cache_clear()
    try:
        assert not kernels.native_bf16_hardware() and not kernels.onednn_usable(cpu_device, torch.bfloat16)
        assert kernels.onednn_usable(cpu_device, torch.float32) == torch.backends.mkldnn.is_available()
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**CASCADE_LAKE_PROBE, "amx_bf16": True})
        kernels.hardware_flags.cache_clear()
        assert kernels.native_bf16_hardware()
    finally:
        monkeypatch.undo()
        kernels.hardware_flags.cache_clear()
        kernels.onednn_usable.cache_clear()


NATIVE = ("amx-bf16", "avx512-bf16")


@pytest.mark.parametrize(("device", "expected"), [
    ("cpu", {name: torch.bfloat16 if name in NATIVE else torch.float32 for name in CPUS}),
    ("cuda", dict.fromkeys(CPUS, torch.float16)),
    ("mps", dict.fromkeys(CPUS, torch.float32)),
])
def test_auto_dtype_decision_table(device, expected, monkeypatch):
    """Where the probe finds bf16 products row-invariant (lossless): bf16 on a CPU with native bf16."""
    monkeypatch.setattr(cpu, "bf16_row_block", lambda: (32, 32))
    for name, flags in CPUS.items():
        caps = cpu.parse_cpu_flags(flags)
        assert cpu.auto_dtype(torch.device(device), caps) == expected[name], name
        assert resolve_dtype("auto", torch.device(device), caps) == expected[name], name
        assert resolve_dtype(None, torch.device(device), caps) == expected[name], name


@pytest.mark.parametrize(("blocks", "expected"), [
    ((32, 32), "bfloat16"), ((8, 1), "bfloat16"), ((7, 32), "float32"), ((32, 0), "float32"), ((0, 0), "float32")])
def test_auto_is_bf16_only_where_bf16_is_lossless(blocks, expected):
    """A CPU with native bf16 whose products change a row's bits below a batch of 8 rows keeps fp32, and says
    why; the probe is not run for a CPU without native bf16."""
    precision, why = cpu.auto_choice(torch.device("cpu"), cpu.parse_cpu_flags(XEON_AMX), blocks,
                                     attention_kernel=False)
    assert precision == expected
    assert ("lossless" in why and "not lossless" not in why) == (expected == "bfloat16"), why


@pytest.mark.parametrize("usable", [True, False])
def test_auto_is_int8_on_avx2_where_the_int8_encoder_runs(monkeypatch, usable):
    """An AVX2-only CPU: fp32 weights with the encoder's products in int8 where they run here (the kernel
    extension built, oneDNN's int8 linear), else fp32; never on a CPU of the "other" class or with native bf16."""
    from asr_spec.engine import int8

    monkeypatch.setattr(int8, "int8_encoder_usable", lambda device, dtype, asked=False: usable and asked)
    monkeypatch.setattr(cpu, "bf16_row_block", lambda: (ANY_ROWS, 0))
    dev = torch.device("cpu")
    precision, why = cpu.auto_choice(dev, cpu.parse_cpu_flags(EPYC_ZEN2), None)
    assert (precision, why.startswith("no native bf16 products")) == ("int8" if usable else "float32", True), why
    assert cpu.auto_dtype(dev, cpu.parse_cpu_flags(EPYC_ZEN2)) == torch.float32  # int8's weights are fp32
    assert cpu.resolve_precision("auto", dev, cpu.parse_cpu_flags(EPYC_ZEN2)) == precision
    assert cpu.auto_choice(dev, cpu.parse_cpu_flags(CPUS["other"]))[0] == "float32"
    assert cpu.auto_choice(dev, cpu.parse_cpu_flags(EPYC_ZEN4), (ANY_ROWS, 0), True)[0] == "bfloat16"


@pytest.mark.parametrize("name", ["float32", "fp32", "bfloat16", "bf16", "float16", "int8"])
def test_an_explicit_dtype_is_kept_on_every_cpu(name):
    wanted = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "int8": torch.float32}[name]
    for flags in CPUS.values():
        assert resolve_dtype(name, torch.device("cpu"), cpu.parse_cpu_flags(flags)) == wanted
        assert cpu.resolve_precision(name, torch.device("cpu"), cpu.parse_cpu_flags(flags)) == cpu.DTYPES[name]
    with pytest.raises(InputError, match="unknown dtype 'int4'"):  # an AsrSpecError: the caller's, not a bug
        resolve_dtype("int4", torch.device("cpu"))


def test_the_decision_is_logged_once_with_the_cpu_class(caplog, monkeypatch):
    from asr_spec.engine import int8

    cpu._log_once.cache_clear()
    monkeypatch.setattr(int8, "int8_encoder_usable", lambda device, dtype, asked=False: asked)
    with caplog.at_level("INFO", logger="asr_spec.models.cpu"):
        for _ in range(3):
            resolve_dtype("auto", torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if r.name == "asr_spec.models.cpu"]
    assert lines == ["cpu: avx2, dtype auto -> int8 (no native bf16 products; the encoder's products in int8, the "
                     "decoder fp32)"]


@pytest.mark.parametrize("kernel", [True, False])
def test_a_bf16_summary_says_whether_bf16_is_lossless_here(monkeypatch, kernel):
    """The run summary and --json of a CPU bf16 run carry the probe's verdict; fp32's carry none; both say which
    attention the decoder runs."""
    from asr_spec.engine import int8

    cpu_dev = torch.device("cpu")
    monkeypatch.delenv(int8.INT8_AUDIO_ENV, raising=False)
    monkeypatch.setattr(cpu_attention, "fused_attention_usable", lambda device, dtype: kernel)
    path = "cpu kernel" if kernel else "torch"
    audio = ", audio keys/values int8" if kernel else ""  # the kernel's bf16 decoder: `int8.audio_dtype`
    for blocks, words in (((32, 32), "lossless"), ((0, 0), "up to near-ties")):
        monkeypatch.setattr(cpu, "bf16_row_block", lambda blocks=blocks: blocks)
        assert cpu.precision_line(cpu_dev, torch.bfloat16) == f"cpu avx2, bfloat16, {words}, attention: {path}{audio}"
        assert cpu.run_precision(cpu_dev, torch.bfloat16)["bf16_row_invariant"]["lossless"] == (words == "lossless")
    monkeypatch.setattr(cpu, "bf16_row_block", lambda: (ANY_ROWS, 0))  # the thin products: any number of rows
    assert cpu.run_precision(cpu_dev, torch.bfloat16)["bf16_row_invariant"] == {
        "rows": None, "queries": 0, "by_construction": True, "lossless": True}
    assert cpu.precision_line(cpu_dev, torch.float32) == f"cpu avx2, float32, attention: {path}"
    assert "bf16_row_invariant" not in cpu.run_precision(cpu_dev, torch.float32)
    assert cpu.run_precision(cpu_dev, torch.float32)["attention"] == path
    assert cpu.run_precision(cpu_dev, torch.float32)["encoder_products"] == "float32"


def test_a_summary_says_when_the_encoders_products_are_int8(monkeypatch):
    from asr_spec.engine import int8

    cpu_dev = torch.device("cpu")
    monkeypatch.delenv(int8.AUDIO_ENV, raising=False)
    monkeypatch.setattr(cpu_attention, "fused_attention_usable", lambda device, dtype: True)
    monkeypatch.setattr(cpu, "bf16_row_block", lambda: (ANY_ROWS, 0))
    monkeypatch.setattr(int8, "int8_encoder_usable",
                        lambda device, dtype, asked=False: dtype == torch.bfloat16 or asked)
    monkeypatch.delenv(int8.ATTENTION_ENV, raising=False)
    assert cpu.run_precision(cpu_dev, torch.bfloat16)["encoder_products"] == "int8"
    # ... and its attention with them (`int8.int8_attention_usable`), unless switched off
    monkeypatch.delenv(int8.INT8_AUDIO_ENV, raising=False)
    assert cpu.precision_line(cpu_dev, torch.bfloat16) == (
        "cpu avx2, bfloat16, lossless, attention: cpu kernel, encoder products and attention int8, audio keys/values "
        "int8")
    monkeypatch.setenv(int8.ATTENTION_ENV, "1")
    assert cpu.precision_line(cpu_dev, torch.bfloat16) == (
        "cpu avx2, bfloat16, lossless, attention: cpu kernel, encoder products int8, audio keys/values int8")
    # a bf16 decoder's audio keys/values in int8 (`int8.audio_dtype`), in bf16 where that is switched off
    assert cpu.run_precision(cpu_dev, torch.bfloat16)["audio_keys_values"] == "int8"
    monkeypatch.setenv(int8.INT8_AUDIO_ENV, "1")
    assert cpu.run_precision(cpu_dev, torch.bfloat16)["audio_keys_values"] == "bfloat16"
    assert cpu.precision_line(cpu_dev, torch.bfloat16) == (
        "cpu avx2, bfloat16, lossless, attention: cpu kernel, encoder products int8")
    monkeypatch.delenv(int8.INT8_AUDIO_ENV)
    assert cpu.run_precision(cpu_dev, torch.float32)["encoder_products"] == "float32"
    # the "int8" precision: fp32 weights whose encoder was marked (`int8.requested`)
    assert cpu.run_precision(cpu_dev, torch.float32, int8_asked=True)["encoder_products"] == "int8"
    assert cpu.run_precision(cpu_dev, torch.float32, int8_asked=True)["precision"] == "int8"
    assert cpu.run_precision(cpu_dev, torch.float32)["precision"] == "float32"
    # ... whose decoder holds the audio's keys/values in int8 (`int8.audio_dtype`; bf16 where int8 is switched off)
    monkeypatch.delenv(int8.INT8_AUDIO_ENV, raising=False)
    assert cpu.run_precision(cpu_dev, torch.float32, int8_asked=True)["audio_keys_values"] == "int8"
    assert cpu.run_precision(cpu_dev, torch.float32)["audio_keys_values"] == "float32"
    # ... and whose encoder attends through int8 products (`int8.int8_attention_usable`)
    monkeypatch.delenv(int8.ATTENTION_ENV, raising=False)
    assert cpu.run_precision(cpu_dev, torch.float32, int8_asked=True)["encoder_attention"] == "int8"
    assert cpu.run_precision(cpu_dev, torch.bfloat16)["encoder_attention"] == "int8"  # its products are too here
    assert cpu.run_precision(cpu_dev, torch.float32)["encoder_attention"] == "float32"
    # ... and whose decoder's step reads bf16 copies of its weights (`int8.bf16_weights_usable`)
    monkeypatch.delenv(int8.WEIGHTS_ENV, raising=False)
    assert cpu.run_precision(cpu_dev, torch.float32, int8_asked=True)["decoder_weights"] == "bfloat16"
    assert cpu.run_precision(cpu_dev, torch.float32)["decoder_weights"] == "float32"
    assert cpu.precision_line(cpu_dev, torch.float32, int8_asked=True) == (
        "cpu avx2, int8 precision (float32 arithmetic), attention: cpu kernel, encoder products and attention int8, "
        "decoder weights bf16, audio keys/values int8")
    monkeypatch.setenv(int8.INT8_AUDIO_ENV, "1")
    assert cpu.run_precision(cpu_dev, torch.float32, int8_asked=True)["audio_keys_values"] == "bfloat16"
    assert cpu.precision_line(cpu_dev, torch.float32, int8_asked=True).endswith(
        ", encoder products and attention int8, decoder weights and audio keys/values bf16")
    monkeypatch.setenv(int8.AUDIO_ENV, "1")
    monkeypatch.setenv(int8.ATTENTION_ENV, "1")
    assert cpu.run_precision(cpu_dev, torch.float32, int8_asked=True)["encoder_attention"] == "float32"
    assert cpu.precision_line(cpu_dev, torch.float32, int8_asked=True) == (
        "cpu avx2, int8 precision (float32 arithmetic), attention: cpu kernel, encoder products int8, decoder weights "
        "bf16")
    monkeypatch.setenv(int8.WEIGHTS_ENV, "1")
    assert cpu.precision_line(cpu_dev, torch.float32, int8_asked=True) == (
        "cpu avx2, int8 precision (float32 arithmetic), attention: cpu kernel, encoder products int8")
    # asked, but its encoder's products cannot run in int8 here (no extension, or switched off): the run is fp32's
    monkeypatch.setattr(int8, "int8_encoder_usable", lambda device, dtype, asked=False: False)
    assert cpu.run_precision(cpu_dev, torch.float32, int8_asked=True)["precision"] == "float32"
    assert cpu.precision_line(cpu_dev, torch.float32, int8_asked=True) == "cpu avx2, float32, attention: cpu kernel"


def test_a_ray_runs_workers_that_differed_are_each_named():
    """`precision_words` of a list (a Ray run's workers of several kinds): each kind's words, in order."""
    kinds = [{"device": "cuda:0", "dtype": "float16"}, cpu.run_precision(torch.device("cpu"), torch.float32)]
    assert cpu.precision_words(kinds) == f"cuda:0, float16 | {cpu.precision_words(kinds[1])}"
    assert cpu.precision_words(kinds[1]).startswith("cpu avx2, float32, attention: ")


@pytest.mark.parametrize(("blocks", "expected"), [
    ((32, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((7, 0), torch.float32), ((0, 0), torch.float32)])
def test_with_the_attention_kernel_only_the_products_decide(blocks, expected):
    """The CPU attention kernel is query-invariant by construction: the probe's queries figure (0: not probed)
    does not keep fp32, the rows figure still does."""
    precision, why = cpu.auto_choice(torch.device("cpu"), cpu.parse_cpu_flags(XEON_AMX), blocks,
                                     attention_kernel=True)
    assert cpu.torch_dtype(precision) == expected
    assert ("attention kernel: lossless" in why) == (expected == torch.bfloat16), why


def test_a_dtype_is_named_as_precisions_spell_it():
    assert [cpu.dtype_name(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8)] == [
        "float32", "bfloat16", "float16", "int8"]
    assert all(cpu.torch_dtype(cpu.dtype_name(d)) == d for d in (torch.float32, torch.bfloat16, torch.float16))
