#!/usr/bin/env python
"""Same as `asr-spec distill ...` (asr_spec/cli/distill.py, over asr_spec/distill/commands.py): cache pseudo-labels,
train, evaluate a draft."""

import sys

from asr_spec.cli.distill import distill_main

if __name__ == "__main__":
    sys.exit(distill_main(prog="train_draft.py"))
