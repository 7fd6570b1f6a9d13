"""Fixture and corpus makers and the house's tools, run from the repository root as modules
(``python -m scripts.make_fixtures``; ``scripts/gpu_check.sh`` is a shell script).

make_fixtures, make_word_fixtures, make_prompt_fixtures: the Debian-voice test fixtures (tests/fixtures/);
make_longform_fixtures with kokoro_tts (its texts in texts/*.json): the Kokoro long-form fixtures;
make_draft_corpus: the speech a draft is distilled on; check_sizes: the module and function size limits;
record_outputs: every fixture's outputs, for a before/after comparison. The benchmarks are the package
``benchmarks``.
"""
