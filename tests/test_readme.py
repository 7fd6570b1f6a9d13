"""README's code blocks still work: every ```bash and ```python block of README.md is run, as a user would run it.

The convention (README authors, read this):
- Every fenced block whose language is ``bash`` or ``python`` is executed, in order of appearance, each on its own.
- A block is skipped only when the nearest non-blank line before its opening fence is an HTML comment
  ``<!-- not run: REASON -->`` (REASON is required: hub models, a GPU, a server, a long job, a placeholder file...).
  The reason shows in pytest's skip report. Blocks in other languages (``toml``, ``text``, none) are never run.
- bash blocks run with ``bash -euo pipefail`` in a fresh temporary directory that holds links to the repository's
  top-level entries (``tests/``, ``scripts/``, ``configs/``, ``drafts/``...), so relative paths such as
  ``tests/fixtures/...`` work and outputs land in the temporary directory. ``asr-spec`` and ``python`` on PATH are
  this interpreter (``asr-spec`` runs ``python -m asr_spec``); this checkout's ``asr_spec`` is imported.
- python blocks run the same way, as ``python -c BLOCK``, in such a directory.
- A block passes when it exits with status 0 within BLOCK_TIMEOUT_S.
Blocks may load the offline real weights (``embedded:whisper-base``), so the tests that run them are marked
``real`` and ``slow``; the parser's own tests are fast. The pages under docs/ follow the same convention: their
``asr-spec`` commands are parsed (not run) beside README's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
RUN_LANGUAGES = ("bash", "python")
BLOCK_TIMEOUT_S = 600
_FENCE = re.compile(r"^```(\S*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip_reason: str | None  # None: run it

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.language}"


def code_blocks(text: str) -> list[Block]:
    """The bash/python blocks of a Markdown text, each with its `<!-- not run: ... -->` reason if it has one."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"README.md:{i + 1}: code block never closed")
        if match.group(1) in RUN_LANGUAGES:
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            if before.startswith("<!--") and "not run" in before and not _NOT_RUN.match(before):
                raise ValueError(f"README.md:{i}: write the marker as <!-- not run: REASON -->, got {before!r}")
            reason = _NOT_RUN.match(before)
            blocks.append(Block(i + 1, match.group(1), "\n".join(lines[i + 1:end]) + "\n",
                                reason.group(1) if reason else None))
        i = end + 1
    return blocks


def _workdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A directory linking the repository's top-level entries, and an environment whose `python` and `asr-spec`
    are this interpreter running this checkout."""
    work = tmp_path / "work"
    work.mkdir(parents=True)
    for entry in REPO.iterdir():
        if entry.name not in (".git", ".venv", "runs", "out"):  # out/: where README blocks write; never the repo's
            (work / entry.name).symlink_to(entry)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (("python", ""), ("python3", ""), ("asr-spec", " -m asr_spec")):
        wrapper = bin_dir / name  # a script, not a symlink: a venv's interpreter must be called by its own path
        wrapper.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}"{command} "$@"\n')
        wrapper.chmod(0o755)
    threads = os.environ.get("ASR_SPEC_TEST_THREADS", "1")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    return work, env


def run_block(block: Block, tmp_path: Path) -> subprocess.CompletedProcess:
    work, env = _workdir(tmp_path)
    if block.language == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    else:
        argv = [sys.executable, "-c", block.code]
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


# -- the convention itself (fast) ----------------------------------------------------------------------------

SAMPLE = """# t

```bash
echo run me
```

<!-- not run: needs a GPU -->

```python
import torch
```

```toml
model = "x"
```

```python
print(1 + 1)
```
"""


def test_parser_follows_the_convention(tmp_path: Path) -> None:
    blocks = code_blocks(SAMPLE)
    assert [(b.line, b.language, b.skip_reason) for b in blocks] == [
        (3, "bash", None), (9, "python", "needs a GPU"), (17, "python", None)]
    assert blocks[0].code == "echo run me\n"
    with pytest.raises(ValueError, match="never closed"):
        code_blocks("```bash\necho\n")
    with pytest.raises(ValueError, match="write the marker as <!-- not run: REASON -->"):
        code_blocks("<!-- not run -->\n```bash\necho\n```\n")


def test_blocks_run_with_this_checkout_and_fail_loudly(tmp_path: Path) -> None:
    where = "import asr_spec, pathlib; print(pathlib.Path(asr_spec.__file__).resolve())"
    ok = run_block(Block(1, "bash", f'test "$(python -c "{where}")" = "{REPO / "asr_spec" / "__init__.py"}"\n'
                                    "ls tests/fixtures/speech >/dev/null\nasr-spec --help | grep -q transcribe\n",
                         None), tmp_path / "a")
    assert ok.returncode == 0, ok.stderr
    failing = run_block(Block(1, "bash", "false\necho never\n", None), tmp_path / "b")
    assert failing.returncode != 0 and "never" not in failing.stdout
    assert run_block(Block(1, "python", "raise SystemExit(3)\n", None), tmp_path / "c").returncode == 3


def test_readme_has_blocks_that_run() -> None:
    blocks = code_blocks(README.read_text(encoding="utf-8"))
    assert any(b.skip_reason is None for b in blocks), "every README block is marked not run"


def test_ci_runs_readme_test_command() -> None:
    """.ci/run ends by running README's test command (the block that runs pytest) line for line, linter included."""
    tests = [b for b in code_blocks(README.read_text(encoding="utf-8")) if "python -m pytest" in b.code]
    assert len(tests) == 1, "README shows one test command"
    command = tests[0].code.strip()
    assert "ruff check ." in command
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-len(command.splitlines()):] == command.splitlines()

def _command_lines(text: str) -> list[str]:
    """The ``asr-spec ...`` command lines of a Markdown text's bash blocks (continuations joined, comments and
    pipes cut; lines with a ``...`` placeholder left out)."""
    lines = []
    for block in code_blocks(text):
        if block.language != "bash":
            continue
        for line in block.code.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].split("|")[0].strip()
            if line.startswith("asr-spec ") and "..." not in line:
                lines.append(line)
    return lines


DOCS = sorted((REPO / "docs").glob("*.md"))


def test_readme_commands_parse(capsys) -> None:
    """Every `asr-spec` command README and docs/*.md show (run or not) is accepted by the CLI: with --help
    appended, each parses its options and prints its help instead of running (an unknown option or a bad value
    exits 2). The docs' blocks follow README's convention (a malformed `not run` marker is an error)."""
    from asr_spec.cli import main

    readme = _command_lines(README.read_text(encoding="utf-8"))
    assert any(line.startswith("asr-spec eval") for line in readme) and any("distill" in line for line in readme)
    lines = readme + [line for path in DOCS for line in _command_lines(path.read_text(encoding="utf-8"))]
    assert any(line.startswith("asr-spec serve") for line in lines)
    for line in lines:
        with pytest.raises(SystemExit) as exit_:
            main([*shlex.split(line)[1:], "--help"])
        assert exit_.value.code in (0, None), f"{line}\n{capsys.readouterr().err}"


# -- README itself (real weights, slow) ----------------------------------------------------------------------

_BLOCKS = code_blocks(README.read_text(encoding="utf-8")) if README.is_file() else []


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("block", _BLOCKS, ids=[b.id for b in _BLOCKS])
def test_readme_block(block: Block, tmp_path: Path) -> None:
    if block.skip_reason is not None:
        pytest.skip(f"README.md:{block.line}: not run: {block.skip_reason}")
    done = run_block(block, tmp_path)
    assert done.returncode == 0, (f"README.md:{block.line} ({block.language}) exited {done.returncode}\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
