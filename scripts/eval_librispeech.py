#!/usr/bin/env python
"""WER, CER and speed of asr-spec on LibriSpeech, resumable; a thin wrapper over `asr-spec eval`
(`asr_spec.cli.evaluation.eval_main`).

    python scripts/eval_librispeech.py --preset large-v2 --split test.clean --batch-size 16 --compare-greedy
    python scripts/eval_librispeech.py --preset base --data-dir tests/fixtures/librispeech --limit 4 \\
        --output runs/base-fixtures.jsonl        # rerun the same command to resume after a kill
    python scripts/eval_librispeech.py --data-dir TREE --split my-split   # any folder of a local tree

One JSONL line per utterance as it finishes (--output, default runs/<preset>-<split>.jsonl), then a summary
table, also saved as <output stem>.summary.json. See `python scripts/eval_librispeech.py --help`.
"""

import sys

from asr_spec.cli.evaluation import eval_main
from asr_spec.logs import configure_logging

if __name__ == "__main__":
    configure_logging()
    sys.exit(eval_main(sys.argv[1:], prog="eval_librispeech.py"))
