"""The benchmarks, run from the repository root as modules: ``python -m benchmarks.bench --help``.

End to end against faster-whisper (``bench``, its faster-whisper column ``bench_fw``, its table and plot
``bench_report``), decode steps against the machine's floor (``bench_engine``, ``step_floor``), the GPU bench
(``gpu_bench``, run by ``scripts/gpu_check.sh``), long-form accuracy (``bench_longform``), temperature fallback
(``bench_fallback``), live streams (``bench_stream``), the server under load (``load_test``, its long uploads
``long_upload``), Ray (``bench_ray``) and the draft length K (``tune_draft_length``). Their figures and commands:
docs/measurements.md and the topic pages it links.
"""
