"""The benchmarks' one malloc option (`bench`, `bench_encoder`, `bench_stream --server`): glibc's malloc pinned as
the project's own commands pin it (`asr_spec.allocator`: mmap and trim thresholds, arenas) unless ``--plain-malloc``
leaves it as it is (``--glibc-malloc``: its older name in `bench_stream` commands of docs/live.md)."""

from __future__ import annotations

import argparse


def add_option(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--plain-malloc`` on `parser`; `scope` prefixes its help (e.g. "--server: ")."""
    parser.add_argument("--plain-malloc", "--glibc-malloc", dest="plain_malloc", action="store_true",
                        help=f"{scope}leave glibc's malloc as it is (default: pinned as the CLI's commands and the "
                        "server pin it, asr_spec.allocator; compare timings, peak RSS)")


def pin_unless_plain(args: argparse.Namespace) -> bool:
    """Pin malloc unless `args` asks for it plain; whether it is pinned now (False too where glibc or the
    environment's own malloc settings stand aside: `allocator.pin`)."""
    if args.plain_malloc:
        return False
    from asr_spec import allocator

    return allocator.pin()
