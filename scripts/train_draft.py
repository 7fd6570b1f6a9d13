#!/usr/bin/env python
"""Same as `asr-spec distill ...` (see asr_spec/distill/cli.py): cache pseudo-labels, train, evaluate a draft."""

import sys

from asr_spec.distill.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="train_draft.py"))
