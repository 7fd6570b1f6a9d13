"""`python -m asr_spec ...` is the `asr-spec` command; `run` is its console entry point. It imports the command
line (torch, transformers: a second or more) inside its own catch, so a Ctrl-C then is one line and exit 130,
not a traceback from the middle of an import."""

import sys

from asr_spec.errors import EXIT_INTERRUPTED


def run() -> None:
    """`asr-spec`: `asr_spec.cli.main`, imported here."""
    try:
        from asr_spec.cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
    main()


if __name__ == "__main__":
    run()
