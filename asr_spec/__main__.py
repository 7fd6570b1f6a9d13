"""`python -m asr_spec ...` is the `asr-spec` command."""

from asr_spec.cli import main

if __name__ == "__main__":
    main()
